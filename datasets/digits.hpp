// Real handwritten digits: OpenCV's sample sheet digits.png (5000 digits of
// 20x20 px, white ink on black; 100 columns x 50 rows, five rows per class
// 0..9). The digits are split by sheet column so that a digit image used for
// training never appears in calibration or evaluation data.
#pragma once

#include <opencv2/core.hpp>

#include <array>
#include <filesystem>
#include <string_view>
#include <vector>

namespace vlmopt::datasets {

inline constexpr int kDigitCellPx = 20;
inline constexpr int kDigitSheetColumns = 100;
inline constexpr int kDigitSheetRows = 50;
inline constexpr int kDigitRowsPerClass = 5;
inline constexpr int kDigitCount = kDigitSheetColumns * kDigitSheetRows;  // 5000

// Fixed split rule by sheet column: 0-59 train (60 %), 60-74 calib (15 %), 75-99 eval (25 %).
enum class DigitSplit { kTrain = 0, kCalib = 1, kEval = 2 };
inline constexpr int kDigitTrainColumns = 60;
inline constexpr int kDigitCalibColumns = 15;

std::string_view digit_split_name(DigitSplit split);
// sheet_index = row * 100 + column, in [0, 5000).
DigitSplit digit_split_of(int sheet_index);
int digit_label_of(int sheet_index);

// $VLMOPT_DIGITS_PNG when set, else Debian opencv-doc's
// /usr/share/doc/opencv-doc/examples/data/digits.png.
std::filesystem::path default_digits_path();

class DigitSheet {
 public:
  // Loads and validates the sheet; InputError "<path>: ..." when missing or not 2000x1000.
  static DigitSheet load(const std::filesystem::path& path);
  // The sheet at default_digits_path(), loaded once per process (thread-safe).
  static const DigitSheet& shared();

  // 20x20 CV_8UC1 view of one digit (white ink on black).
  cv::Mat cell(int sheet_index) const;
  // Sheet indices of one class within one split, ascending.
  const std::vector<int>& pool(DigitSplit split, int label) const;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  cv::Mat sheet_;
  std::array<std::array<std::vector<int>, 10>, 3> pools_;
};

}  // namespace vlmopt::datasets
