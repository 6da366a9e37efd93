// Image preprocessing matching Hugging Face's CLIPImageProcessor and
// SiglipImageProcessor as AutoImageProcessor builds them in our pinned
// environment (transformers 5.17 without torchvision -> the PIL backends
// CLIPImageProcessorPil / SiglipImageProcessorPil):
//
//   CLIP:   resize the shorter side to size.shortest_edge (longer side
//           int(shortest * long / short)), PIL bicubic; center crop crop_size
//           (zero padding when the image is smaller); x * rescale_factor;
//           (x - mean) / std with OpenAI CLIP mean/std; CHW float32.
//   SigLIP: resize to size.height x size.width, PIL bicubic; rescale;
//           mean = std = 0.5.
//
// Resizing reimplements Pillow's separable convolution resampler with its
// 8-bit fixed-point arithmetic, so pixels match PIL exactly; the measured
// parity (docs/datasets.md §Preprocessing) is asserted by the interop test.
#pragma once

#include "io/hf_config.hpp"

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>
#include <opencv2/core.hpp>

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace vlmopt::datasets {

// Pillow's resampling filters, numbered as PIL.Image.Resampling (and HF's "resample" field).
enum class Resample : int { kNearest = 0, kLanczos = 1, kBilinear = 2, kBicubic = 3, kBox = 4, kHamming = 5 };

enum class ImageProcessorKind { kClip, kSiglip };

inline constexpr std::array<double, 3> kClipMean = {0.48145466, 0.4578275, 0.40821073};
inline constexpr std::array<double, 3> kClipStd = {0.26862954, 0.26130258, 0.27577711};

struct ImageProcessorConfig {
  ImageProcessorKind kind = ImageProcessorKind::kClip;
  bool do_convert_rgb = true;
  bool do_resize = true;
  int64_t shortest_edge = 224;  // > 0: resize so the shorter side has this length (aspect kept)
  int64_t resize_height = 0;    // used when shortest_edge == 0: resize to exactly this size
  int64_t resize_width = 0;
  Resample resample = Resample::kBicubic;
  bool do_center_crop = true;
  int64_t crop_height = 224;
  int64_t crop_width = 224;
  bool do_rescale = true;
  double rescale_factor = 1.0 / 255.0;
  bool do_normalize = true;
  std::array<double, 3> image_mean = kClipMean;
  std::array<double, 3> image_std = kClipStd;

  // (height, width) of the output for an input of the given size.
  std::pair<int64_t, int64_t> output_size(int64_t height, int64_t width) const;
  // The output size when it does not depend on the input (center crop or fixed resize).
  std::optional<std::pair<int64_t, int64_t>> fixed_output_size() const;
};

// Class defaults (what the processors use for fields a config leaves out).
ImageProcessorConfig clip_processor_defaults();    // shortest_edge 224, crop 224x224, CLIP mean/std
ImageProcessorConfig siglip_processor_defaults();  // 224x224, no crop, mean = std = 0.5

// Parses a preprocessor_config.json object. InputError "<source_name>: field
// '<name>': <problem>" for unsupported processor types or ill-typed fields.
ImageProcessorConfig parse_image_processor_config(const nlohmann::json& j, const std::string& source_name);
ImageProcessorConfig load_image_processor_config(const std::filesystem::path& file);
// Fallback when a checkpoint has no preprocessor_config.json: CLIP towers get
// shortest_edge = crop = image_size; SigLIP towers a square resize to image_size.
ImageProcessorConfig image_processor_for_vision(const io::VisionConfig& vision);
// <model_dir>/preprocessor_config.json when present, else the fallback.
ImageProcessorConfig image_processor_for_model(const std::filesystem::path& model_dir, const io::VisionConfig& vision);
// The preprocessor_config.json that transformers reads back as the same processor.
nlohmann::json to_preprocessor_json(const ImageProcessorConfig& config);

// Pillow's Image.resize((width, height), filter) on an RGB uint8 image.
cv::Mat resize_like_pil(const cv::Mat& rgb, int width, int height, Resample filter);
// transformers' center_crop: crop around the centre (floor offsets), zero-padding when smaller.
cv::Mat center_crop_like_hf(const cv::Mat& rgb, int64_t crop_height, int64_t crop_width);

// One image (RGB uint8 HxWx3; gray and RGBA are converted as PIL's convert("RGB")
// does) -> float32 [3, H, W] pixel_values. InputError for other pixel formats.
at::Tensor preprocess(const cv::Mat& rgb, const ImageProcessorConfig& config);
// Several images -> [B, 3, H, W]; InputError when their output sizes differ.
at::Tensor preprocess_batch(const std::vector<cv::Mat>& images, const ImageProcessorConfig& config);

}  // namespace vlmopt::datasets
