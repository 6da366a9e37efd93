// Dataset sources: one random-access interface over the builtin synthetic VQA
// scenes, LLaVA-style JSONL + image folders and HDF5 packs (docs/datasets.md).
// Consumers (calibrate, compensate, prune-fit, eval, ...) only see DatasetSource.
#pragma once

#include <nlohmann/json.hpp>
#include <opencv2/core.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace vlmopt::datasets {

// One visual question with its answer.
struct Sample {
  std::string id;              // unique within its source, e.g. "builtin:eval/000042"
  cv::Mat image;               // RGB uint8, H x W x 3 (CV_8UC3), continuous
  std::vector<cv::Mat> frames; // optional extra frames (same format); empty for still images
  std::string question;        // no "<image>" placeholder, no newlines
  std::string answer;
  std::string question_type;   // tag such as "color", "count"; empty when the source has none
  nlohmann::json meta;         // source-specific facts (scene layout, JSONL line, ...); an object
};

// Random access, deterministic: get(i) returns the same sample every time and
// on every machine. get() is safe to call from several threads at once.
class DatasetSource {
 public:
  virtual ~DatasetSource() = default;
  virtual std::size_t size() const = 0;
  // Throws InputError for i >= size() or when the sample's data cannot be read.
  virtual Sample get(std::size_t i) const = 0;
  // One line for logs and manifests, e.g. "builtin:eval (2000 synthetic VQA scenes, 96x96)".
  virtual std::string describe() const = 0;
};

// Opens a dataset spec:
//   builtin:train | builtin:calib | builtin:eval | builtin:stress   synthetic scenes
//   builtin:clips                                                   synthetic 3-frame clips (datasets/clips.hpp)
//   <path>.jsonl                                                    LLaVA JSONL, images relative to its folder
//   <path>.h5 | <path>.hdf5                                         a pack written by `vlmopt datasets pack`
// Throws InputError naming the spec when it is none of these or cannot be opened.
std::unique_ptr<DatasetSource> open_dataset(const std::string& spec);

// Throws InputError "<what>: sample index i out of range (expected < n, got i)".
void check_index(std::size_t i, std::size_t size, const std::string& what);

}  // namespace vlmopt::datasets
