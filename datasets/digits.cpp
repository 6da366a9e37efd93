#include "datasets/digits.hpp"

#include "util/error.hpp"

#include <opencv2/imgcodecs.hpp>

#include <cstdlib>

namespace vlmopt::datasets {

std::string_view digit_split_name(DigitSplit split) {
  switch (split) {
    case DigitSplit::kTrain: return "train";
    case DigitSplit::kCalib: return "calib";
    case DigitSplit::kEval: return "eval";
  }
  return "?";
}

DigitSplit digit_split_of(int sheet_index) {
  VLMOPT_CHECK(sheet_index >= 0 && sheet_index < kDigitCount, "digit sheet index {} out of range", sheet_index);
  const int column = sheet_index % kDigitSheetColumns;
  if (column < kDigitTrainColumns) return DigitSplit::kTrain;
  if (column < kDigitTrainColumns + kDigitCalibColumns) return DigitSplit::kCalib;
  return DigitSplit::kEval;
}

int digit_label_of(int sheet_index) {
  VLMOPT_CHECK(sheet_index >= 0 && sheet_index < kDigitCount, "digit sheet index {} out of range", sheet_index);
  return sheet_index / kDigitSheetColumns / kDigitRowsPerClass;
}

std::filesystem::path default_digits_path() {
  if (const char* env = std::getenv("VLMOPT_DIGITS_PNG"); env != nullptr && *env != '\0') return env;
  return "/usr/share/doc/opencv-doc/examples/data/digits.png";
}

DigitSheet DigitSheet::load(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw_file_error(path,
                     "digit sheet not found (install Debian's opencv-doc or set VLMOPT_DIGITS_PNG to OpenCV's "
                     "samples/data/digits.png)");
  }
  DigitSheet sheet;
  sheet.path_ = path;
  sheet.sheet_ = cv::imread(path.string(), cv::IMREAD_GRAYSCALE);
  if (sheet.sheet_.empty()) throw_file_error(path, "cannot decode the digit sheet image");
  const int expected_w = kDigitSheetColumns * kDigitCellPx;
  const int expected_h = kDigitSheetRows * kDigitCellPx;
  if (sheet.sheet_.cols != expected_w || sheet.sheet_.rows != expected_h) {
    throw_file_error(path, "digit sheet has the wrong size (expected {}x{}, got {}x{})", expected_w, expected_h,
                     sheet.sheet_.cols, sheet.sheet_.rows);
  }
  for (int index = 0; index < kDigitCount; ++index) {
    sheet.pools_[static_cast<int>(digit_split_of(index))][digit_label_of(index)].push_back(index);
  }
  return sheet;
}

const DigitSheet& DigitSheet::shared() {
  // A failed load throws out of the initialiser, so the next call retries.
  static const DigitSheet sheet = load(default_digits_path());
  return sheet;
}

cv::Mat DigitSheet::cell(int sheet_index) const {
  VLMOPT_CHECK(sheet_index >= 0 && sheet_index < kDigitCount, "digit sheet index {} out of range", sheet_index);
  const int row = sheet_index / kDigitSheetColumns;
  const int column = sheet_index % kDigitSheetColumns;
  return sheet_(cv::Rect(column * kDigitCellPx, row * kDigitCellPx, kDigitCellPx, kDigitCellPx));
}

const std::vector<int>& DigitSheet::pool(DigitSplit split, int label) const {
  VLMOPT_CHECK(label >= 0 && label < 10, "digit label {} out of range", label);
  return pools_[static_cast<int>(split)][label];
}

}  // namespace vlmopt::datasets
