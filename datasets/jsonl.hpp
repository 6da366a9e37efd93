// LLaVA-style JSONL datasets: one JSON object per line,
//   {"id": "...", "image": "rel/path.jpg",
//    "conversations": [{"from": "human", "value": "<image>\nWhat is ...?"},
//                      {"from": "gpt", "value": "..."}],
//    "question_type": "..."}            (optional vlmopt extension)
// Image paths are relative to the dataset root (by default the folder of the
// JSONL file); paths that leave it, also through symlinks, are refused.
#pragma once

#include "datasets/source.hpp"

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::datasets {

class JsonlSource final : public DatasetSource {
 public:
  // Reads and validates every line (JSON, fields, image path stays inside the
  // root); images are decoded in get(). Errors name "<file>:<line>".
  explicit JsonlSource(const std::filesystem::path& jsonl_path);
  JsonlSource(const std::filesystem::path& jsonl_path, const std::filesystem::path& image_root);

  std::size_t size() const override { return entries_.size(); }
  Sample get(std::size_t i) const override;
  std::string describe() const override;

  const std::filesystem::path& root() const { return root_; }

 private:
  struct Entry {
    std::size_t line = 0;       // 1-based line number in the file
    std::string id;
    std::string image;          // as written in the file
    std::string question;
    std::string answer;
    std::string question_type;
  };

  std::string where(const Entry& entry) const;  // "<file>:<line>"
  std::filesystem::path resolve(const Entry& entry) const;

  std::filesystem::path file_;
  std::filesystem::path root_;  // canonical
  std::vector<Entry> entries_;
};

// The human turn as a question: "<image>" placeholders removed, newlines and
// runs of whitespace turned into single spaces, trimmed.
std::string clean_question(std::string_view human_value);

// `relative` resolved against `canonical_root` with symlinks followed;
// nullopt when the result lies outside the root.
std::optional<std::filesystem::path> resolve_inside(const std::filesystem::path& canonical_root,
                                                    const std::filesystem::path& relative);

// Decodes an image file to RGB uint8 (HxWx3). EXIF orientation is ignored, as
// PIL's Image.open(...).convert("RGB") does. Empty Mat when unreadable.
cv::Mat decode_image_rgb(const std::filesystem::path& path);

}  // namespace vlmopt::datasets
