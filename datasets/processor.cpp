#include "datasets/processor.hpp"

#include "util/error.hpp"

#include <fmt/format.h>
#include <opencv2/imgproc.hpp>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <numbers>

namespace vlmopt::datasets {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kMaxProcessorSide = 16384;  // px; anything larger in a config is a typo

// ---------------------------------------------------------------------------
// Pillow's resampling filters (weights as a function of the distance in input
// pixels, scaled by the downscale factor) and their supports.

double box_weight(double x) { return (x > -0.5 && x <= 0.5) ? 1.0 : 0.0; }

double bilinear_weight(double x) {
  x = std::abs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

double hamming_weight(double x) {
  x = std::abs(x);
  if (x == 0.0) return 1.0;
  if (x >= 1.0) return 0.0;
  x *= std::numbers::pi;
  return std::sin(x) / x * (0.54f + 0.46f * std::cos(x));  // Pillow uses float constants here
}

double bicubic_weight(double x) {
  constexpr double a = -0.5;  // Pillow's bicubic (OpenCV's INTER_CUBIC uses -0.75)
  x = std::abs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

double sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= std::numbers::pi;
  return std::sin(x) / x;
}

double lanczos_weight(double x) { return (-3.0 <= x && x < 3.0) ? sinc(x) * sinc(x / 3.0) : 0.0; }

struct Filter {
  double support;
  double (*weight)(double);
};

Filter filter_for(Resample resample) {
  switch (resample) {
    case Resample::kBox: return {0.5, box_weight};
    case Resample::kBilinear: return {1.0, bilinear_weight};
    case Resample::kHamming: return {1.0, hamming_weight};
    case Resample::kBicubic: return {2.0, bicubic_weight};
    case Resample::kLanczos: return {3.0, lanczos_weight};
    case Resample::kNearest: break;
  }
  VLMOPT_CHECK(false, "no convolution filter for resample {}", static_cast<int>(resample));
  return {};
}

// Fixed-point weights as Pillow computes them for 8-bit images: 32 bits minus
// 8 for the pixel value minus 2 of headroom for negative lobes.
constexpr int kPrecisionBits = 32 - 8 - 2;

struct Coefficients {
  int taps = 0;                // coefficients per output pixel (ksize)
  std::vector<int> first;      // first input index per output pixel
  std::vector<int> count;      // used coefficients per output pixel
  std::vector<int32_t> weights;  // out_size * taps
};

Coefficients precompute(int in_size, int out_size, const Filter& filter) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double filter_scale = std::max(scale, 1.0);  // widen the kernel when shrinking (antialiasing)
  const double support = filter.support * filter_scale;
  Coefficients c;
  c.taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(static_cast<std::size_t>(out_size));
  c.count.resize(static_cast<std::size_t>(out_size));
  c.weights.assign(static_cast<std::size_t>(out_size) * c.taps, 0);
  std::vector<double> k(static_cast<std::size_t>(c.taps));
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double inv_scale = 1.0 / filter_scale;
    // Truncation towards zero, as C's (int) cast; the + 0.5 rounds.
    int x_min = static_cast<int>(center - support + 0.5);
    if (x_min < 0) x_min = 0;
    int x_max = static_cast<int>(center + support + 0.5);
    if (x_max > in_size) x_max = in_size;
    x_max -= x_min;
    double total = 0.0;
    for (int x = 0; x < x_max; ++x) {
      const double w = filter.weight((x + x_min - center + 0.5) * inv_scale);
      k[static_cast<std::size_t>(x)] = w;
      total += w;
    }
    for (int x = 0; x < x_max; ++x) {
      const double normalized = total != 0.0 ? k[static_cast<std::size_t>(x)] / total : k[static_cast<std::size_t>(x)];
      const double fixed = normalized * (1 << kPrecisionBits);
      c.weights[static_cast<std::size_t>(xx) * c.taps + x] =
          static_cast<int32_t>(fixed < 0 ? fixed - 0.5 : fixed + 0.5);  // round half away from zero
    }
    c.first[static_cast<std::size_t>(xx)] = x_min;
    c.count[static_cast<std::size_t>(xx)] = x_max;
  }
  return c;
}

uint8_t clip8(int64_t accumulator) {
  const int64_t v = accumulator >> kPrecisionBits;  // arithmetic shift: floor
  return static_cast<uint8_t>(std::clamp<int64_t>(v, 0, 255));
}

// One separable pass along x (horizontal) or y, on interleaved RGB bytes.
cv::Mat resample_horizontal(const cv::Mat& in, int out_width, const Filter& filter) {
  const Coefficients c = precompute(in.cols, out_width, filter);
  cv::Mat out(in.rows, out_width, CV_8UC3);
  constexpr int64_t half = int64_t{1} << (kPrecisionBits - 1);
  for (int y = 0; y < in.rows; ++y) {
    const uint8_t* src = in.ptr<uint8_t>(y);
    uint8_t* dst = out.ptr<uint8_t>(y);
    for (int xx = 0; xx < out_width; ++xx) {
      const int32_t* k = &c.weights[static_cast<std::size_t>(xx) * c.taps];
      const int x0 = c.first[static_cast<std::size_t>(xx)];
      const int n = c.count[static_cast<std::size_t>(xx)];
      for (int ch = 0; ch < 3; ++ch) {
        int64_t acc = half;
        for (int x = 0; x < n; ++x) acc += static_cast<int64_t>(src[(x0 + x) * 3 + ch]) * k[x];
        dst[xx * 3 + ch] = clip8(acc);
      }
    }
  }
  return out;
}

cv::Mat resample_vertical(const cv::Mat& in, int out_height, const Filter& filter) {
  const Coefficients c = precompute(in.rows, out_height, filter);
  cv::Mat out(out_height, in.cols, CV_8UC3);
  constexpr int64_t half = int64_t{1} << (kPrecisionBits - 1);
  const int row_bytes = in.cols * 3;
  for (int yy = 0; yy < out_height; ++yy) {
    const int32_t* k = &c.weights[static_cast<std::size_t>(yy) * c.taps];
    const int y0 = c.first[static_cast<std::size_t>(yy)];
    const int n = c.count[static_cast<std::size_t>(yy)];
    uint8_t* dst = out.ptr<uint8_t>(yy);
    for (int i = 0; i < row_bytes; ++i) {
      int64_t acc = half;
      for (int y = 0; y < n; ++y) acc += static_cast<int64_t>(in.ptr<uint8_t>(y0 + y)[i]) * k[y];
      dst[i] = clip8(acc);
    }
  }
  return out;
}

// Pillow maps output pixel x to input pixel floor((x + 0.5) * in / out).
cv::Mat resize_nearest(const cv::Mat& in, int out_width, int out_height) {
  cv::Mat out(out_height, out_width, CV_8UC3);
  const double sx = static_cast<double>(in.cols) / out_width;
  const double sy = static_cast<double>(in.rows) / out_height;
  for (int y = 0; y < out_height; ++y) {
    const int src_y = std::min(static_cast<int>((y + 0.5) * sy), in.rows - 1);
    for (int x = 0; x < out_width; ++x) {
      const int src_x = std::min(static_cast<int>((x + 0.5) * sx), in.cols - 1);
      out.at<cv::Vec3b>(y, x) = in.at<cv::Vec3b>(src_y, src_x);
    }
  }
  return out;
}

cv::Mat to_rgb8(const cv::Mat& image) {
  if (image.empty()) throw InputError("preprocess: empty image");
  switch (image.type()) {
    case CV_8UC3: return image;
    case CV_8UC1: {
      cv::Mat rgb;
      cv::cvtColor(image, rgb, cv::COLOR_GRAY2RGB);
      return rgb;
    }
    case CV_8UC4: {  // PIL's convert("RGB") drops alpha without compositing
      cv::Mat rgb;
      cv::cvtColor(image, rgb, cv::COLOR_RGBA2RGB);
      return rgb;
    }
    default: break;
  }
  throw InputError(fmt::format("preprocess: unsupported pixel format (expected 8-bit gray, RGB or RGBA, got {}x{} "
                               "with {} channels of depth code {})",
                               image.cols, image.rows, image.channels(), image.depth()));
}

// --- JSON helpers ------------------------------------------------------------

[[noreturn]] void field_error(const std::string& source, const std::string& field, const std::string& problem) {
  throw InputError(fmt::format("{}: field '{}': {}", source, field, problem));
}

void read_bool(const nlohmann::json& j, const char* key, bool& out, const std::string& source) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;  // absent or null: class default
  if (!it->is_boolean()) field_error(source, key, fmt::format("expected true or false, got {}", it->dump()));
  out = it->get<bool>();
}

int64_t read_side(const nlohmann::json& value, const std::string& source, const std::string& field) {
  if (!value.is_number_integer() || value.get<int64_t>() < 1 || value.get<int64_t>() > kMaxProcessorSide) {
    field_error(source, field, fmt::format("expected an integer in 1..{}, got {}", kMaxProcessorSide, value.dump()));
  }
  return value.get<int64_t>();
}

std::array<double, 3> read_triplet(const nlohmann::json& value, const std::string& source, const char* field,
                                   bool positive) {
  std::array<double, 3> out{};
  if (value.is_number()) {
    out.fill(value.get<double>());
  } else if (value.is_array() && value.size() == 3 &&
             std::all_of(value.begin(), value.end(), [](const auto& v) { return v.is_number(); })) {
    for (std::size_t c = 0; c < 3; ++c) out[c] = value[c].get<double>();
  } else {
    field_error(source, field, fmt::format("expected a number or 3 numbers, got {}", value.dump()));
  }
  if (positive && std::any_of(out.begin(), out.end(), [](double v) { return !(v > 0.0); })) {
    field_error(source, field, fmt::format("expected positive values, got {}", value.dump()));
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------

std::pair<int64_t, int64_t> ImageProcessorConfig::output_size(int64_t height, int64_t width) const {
  int64_t h = height, w = width;
  if (do_resize) {
    if (shortest_edge > 0) {
      const int64_t short_side = std::min(h, w), long_side = std::max(h, w);
      // transformers: int(size * long / short) -- exact integer product, one float division, truncation.
      const auto new_long = static_cast<int64_t>(static_cast<double>(shortest_edge * long_side) / short_side);
      if (w <= h) {
        w = shortest_edge;
        h = new_long;
      } else {
        h = shortest_edge;
        w = new_long;
      }
    } else {
      h = resize_height;
      w = resize_width;
    }
  }
  if (do_center_crop) return {crop_height, crop_width};
  return {h, w};
}

std::optional<std::pair<int64_t, int64_t>> ImageProcessorConfig::fixed_output_size() const {
  if (do_center_crop) return std::pair{crop_height, crop_width};
  if (do_resize && shortest_edge == 0) return std::pair{resize_height, resize_width};
  return std::nullopt;
}

ImageProcessorConfig clip_processor_defaults() { return ImageProcessorConfig{}; }

ImageProcessorConfig siglip_processor_defaults() {
  ImageProcessorConfig c;
  c.kind = ImageProcessorKind::kSiglip;
  c.shortest_edge = 0;
  c.resize_height = 224;
  c.resize_width = 224;
  c.do_center_crop = false;
  c.crop_height = 0;
  c.crop_width = 0;
  c.image_mean = {0.5, 0.5, 0.5};
  c.image_std = {0.5, 0.5, 0.5};
  return c;
}

ImageProcessorConfig parse_image_processor_config(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) throw InputError(fmt::format("{}: expected a JSON object, got {}", source, j.type_name()));
  std::string type;
  const char* type_field = "image_processor_type";
  if (const auto it = j.find("image_processor_type"); it != j.end() && it->is_string()) {
    type = it->get<std::string>();
  } else if (const auto fe = j.find("feature_extractor_type"); fe != j.end() && fe->is_string()) {
    type_field = "feature_extractor_type";
    type = fe->get<std::string>();  // legacy configs: CLIPFeatureExtractor
  } else {
    field_error(source, "image_processor_type", "missing (expected CLIPImageProcessor or SiglipImageProcessor)");
  }
  std::string base = type;
  for (const std::string suffix : {"Fast", "Pil"}) {
    if (base.size() > suffix.size() && base.ends_with(suffix)) base.resize(base.size() - suffix.size());
  }
  ImageProcessorConfig c;
  if (base == "CLIPImageProcessor" || base == "CLIPFeatureExtractor") {
    c = clip_processor_defaults();
  } else if (base == "SiglipImageProcessor") {
    c = siglip_processor_defaults();
  } else {
    field_error(source, type_field,
                fmt::format("unsupported processor '{}' (expected CLIPImageProcessor or SiglipImageProcessor)", type));
  }

  read_bool(j, "do_convert_rgb", c.do_convert_rgb, source);
  read_bool(j, "do_resize", c.do_resize, source);
  read_bool(j, "do_center_crop", c.do_center_crop, source);
  read_bool(j, "do_rescale", c.do_rescale, source);
  read_bool(j, "do_normalize", c.do_normalize, source);

  if (const auto it = j.find("size"); it != j.end() && !it->is_null()) {
    // An integer means the shortest edge for both processors (default_to_square=False).
    if (it->is_number_integer()) {
      c.shortest_edge = read_side(*it, source, "size");
    } else if (it->is_object()) {
      const bool has_short = it->contains("shortest_edge");
      const bool has_hw = it->contains("height") || it->contains("width");
      if (it->contains("longest_edge") || it->contains("max_height") || it->contains("max_width")) {
        field_error(source, "size", fmt::format("unsupported keys in {} (expected shortest_edge or height+width)", it->dump()));
      }
      if (has_short && !has_hw) {
        c.shortest_edge = read_side(it->at("shortest_edge"), source, "size.shortest_edge");
      } else if (!has_short && it->contains("height") && it->contains("width")) {
        c.shortest_edge = 0;
        c.resize_height = read_side(it->at("height"), source, "size.height");
        c.resize_width = read_side(it->at("width"), source, "size.width");
      } else {
        field_error(source, "size", fmt::format("expected {{\"shortest_edge\": n}} or {{\"height\": h, \"width\": w}}, got {}", it->dump()));
      }
    } else {
      field_error(source, "size", fmt::format("expected an integer or an object, got {}", it->dump()));
    }
  }
  if (const auto it = j.find("crop_size"); it != j.end() && !it->is_null()) {
    if (it->is_number_integer()) {
      c.crop_height = c.crop_width = read_side(*it, source, "crop_size");
    } else if (it->is_object() && it->contains("height") && it->contains("width")) {
      c.crop_height = read_side(it->at("height"), source, "crop_size.height");
      c.crop_width = read_side(it->at("width"), source, "crop_size.width");
    } else {
      field_error(source, "crop_size", fmt::format("expected an integer or {{\"height\": h, \"width\": w}}, got {}", it->dump()));
    }
  }
  if (c.do_center_crop && (c.crop_height <= 0 || c.crop_width <= 0)) {
    field_error(source, "crop_size", "missing while do_center_crop is true");
  }
  if (const auto it = j.find("resample"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 5) {
      field_error(source, "resample", fmt::format("expected a PIL filter number 0..5, got {}", it->dump()));
    }
    c.resample = static_cast<Resample>(it->get<int>());
  }
  if (const auto it = j.find("rescale_factor"); it != j.end() && !it->is_null()) {
    if (!it->is_number() || !(it->get<double>() > 0.0)) {
      field_error(source, "rescale_factor", fmt::format("expected a positive number, got {}", it->dump()));
    }
    c.rescale_factor = it->get<double>();
  }
  if (const auto it = j.find("image_mean"); it != j.end() && !it->is_null()) {
    c.image_mean = read_triplet(*it, source, "image_mean", false);
  }
  if (const auto it = j.find("image_std"); it != j.end() && !it->is_null()) {
    c.image_std = read_triplet(*it, source, "image_std", true);
  }
  return c;
}

ImageProcessorConfig load_image_processor_config(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw_file_error(file, "cannot open for reading");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw_file_error(file, "invalid JSON at byte {} ({})", e.byte, e.what());
  }
  return parse_image_processor_config(j, file.string());
}

ImageProcessorConfig image_processor_for_vision(const io::VisionConfig& vision) {
  if (vision.image_size < 1 || vision.image_size > kMaxProcessorSide) {
    throw InputError(fmt::format("vision_config.image_size: expected 1..{}, got {}", kMaxProcessorSide, vision.image_size));
  }
  if (vision.is_clip()) {
    ImageProcessorConfig c = clip_processor_defaults();
    c.shortest_edge = c.crop_height = c.crop_width = vision.image_size;
    return c;
  }
  ImageProcessorConfig c = siglip_processor_defaults();
  c.resize_height = c.resize_width = vision.image_size;
  return c;
}

ImageProcessorConfig image_processor_for_model(const fs::path& model_dir, const io::VisionConfig& vision) {
  const fs::path file = model_dir / "preprocessor_config.json";
  std::error_code ec;
  if (fs::is_regular_file(file, ec)) return load_image_processor_config(file);
  return image_processor_for_vision(vision);
}

nlohmann::json to_preprocessor_json(const ImageProcessorConfig& c) {
  nlohmann::json j;
  const bool clip = c.kind == ImageProcessorKind::kClip;
  j["image_processor_type"] = clip ? "CLIPImageProcessor" : "SiglipImageProcessor";
  j["do_convert_rgb"] = c.do_convert_rgb;
  j["do_resize"] = c.do_resize;
  if (c.shortest_edge > 0) {
    j["size"] = {{"shortest_edge", c.shortest_edge}};
  } else {
    j["size"] = {{"height", c.resize_height}, {"width", c.resize_width}};
  }
  j["resample"] = static_cast<int>(c.resample);
  j["do_center_crop"] = c.do_center_crop;
  if (c.crop_height > 0) j["crop_size"] = {{"height", c.crop_height}, {"width", c.crop_width}};
  j["do_rescale"] = c.do_rescale;
  j["rescale_factor"] = c.rescale_factor;
  j["do_normalize"] = c.do_normalize;
  j["image_mean"] = c.image_mean;
  j["image_std"] = c.image_std;
  return j;
}

cv::Mat resize_like_pil(const cv::Mat& input, int width, int height, Resample resample) {
  VLMOPT_CHECK(width > 0 && height > 0, "resize target {}x{} must be positive", width, height);
  const cv::Mat rgb = to_rgb8(input);
  if (rgb.cols == width && rgb.rows == height) return rgb.clone();  // Pillow returns a copy
  if (resample == Resample::kNearest) return resize_nearest(rgb, width, height);
  const Filter filter = filter_for(resample);
  // Each pass runs only when its dimension changes. Pillow 13 runs the
  // vertical pass first when the height shrinks by more than twice as many
  // pixels as the width (cheaper); the order changes the uint8 rounding
  // between the passes, so we follow it.
  const int height_drop = rgb.rows - height;
  const int width_drop = rgb.cols - width;
  const bool vertical_first = height_drop > 0 && height_drop > width_drop * 2;
  cv::Mat out = rgb;
  if (vertical_first) {
    out = resample_vertical(out, height, filter);
    if (width != rgb.cols) out = resample_horizontal(out, width, filter);
  } else {
    if (width != rgb.cols) out = resample_horizontal(out, width, filter);
    if (height != rgb.rows) out = resample_vertical(out, height, filter);
  }
  return out;
}

cv::Mat center_crop_like_hf(const cv::Mat& rgb, int64_t crop_height, int64_t crop_width) {
  VLMOPT_CHECK(crop_height > 0 && crop_width > 0, "crop {}x{} must be positive", crop_width, crop_height);
  const int64_t h = rgb.rows, w = rgb.cols;
  const auto floor_half = [](int64_t v) { return v >= 0 ? v / 2 : -((-v + 1) / 2); };  // Python's // 2
  int64_t top = floor_half(h - crop_height);
  int64_t left = floor_half(w - crop_width);
  if (top >= 0 && left >= 0 && top + crop_height <= h && left + crop_width <= w) {
    return rgb(cv::Rect(static_cast<int>(left), static_cast<int>(top), static_cast<int>(crop_width),
                        static_cast<int>(crop_height)))
        .clone();
  }
  // Smaller than the crop: centre it on a zero canvas first (ceil offsets), then crop.
  const int64_t canvas_h = std::max(crop_height, h), canvas_w = std::max(crop_width, w);
  const int64_t pad_top = (canvas_h - h + 1) / 2, pad_left = (canvas_w - w + 1) / 2;
  cv::Mat canvas = cv::Mat::zeros(static_cast<int>(canvas_h), static_cast<int>(canvas_w), rgb.type());
  rgb.copyTo(canvas(cv::Rect(static_cast<int>(pad_left), static_cast<int>(pad_top), static_cast<int>(w),
                             static_cast<int>(h))));
  top += pad_top;
  left += pad_left;
  const int64_t y0 = std::max<int64_t>(0, top), y1 = std::min(canvas_h, top + crop_height);
  const int64_t x0 = std::max<int64_t>(0, left), x1 = std::min(canvas_w, left + crop_width);
  return canvas(cv::Rect(static_cast<int>(x0), static_cast<int>(y0), static_cast<int>(x1 - x0),
                         static_cast<int>(y1 - y0)))
      .clone();
}

at::Tensor preprocess(const cv::Mat& image, const ImageProcessorConfig& config) {
  cv::Mat rgb = to_rgb8(image);
  const auto [resized_h, resized_w] = [&] {
    ImageProcessorConfig no_crop = config;
    no_crop.do_center_crop = false;
    return no_crop.output_size(rgb.rows, rgb.cols);
  }();
  if (config.do_resize) {
    if (resized_h < 1 || resized_w < 1 || resized_h > kMaxProcessorSide || resized_w > kMaxProcessorSide) {
      throw InputError(fmt::format("preprocess: a {}x{} image resizes to an unusable {}x{}", rgb.cols, rgb.rows,
                                   resized_w, resized_h));
    }
    rgb = resize_like_pil(rgb, static_cast<int>(resized_w), static_cast<int>(resized_h), config.resample);
  }
  if (config.do_center_crop) rgb = center_crop_like_hf(rgb, config.crop_height, config.crop_width);
  if (!rgb.isContinuous()) rgb = rgb.clone();

  const int h = rgb.rows, w = rgb.cols;
  at::Tensor out = torch::empty({3, h, w}, torch::kFloat32);
  float* dst = out.data_ptr<float>();
  // Same arithmetic as transformers' numpy path: rescale in float64 then cast
  // to float32; normalize in float32.
  std::array<float, 3> mean{}, stddev{};
  for (int c = 0; c < 3; ++c) {
    mean[c] = static_cast<float>(config.image_mean[c]);
    stddev[c] = static_cast<float>(config.image_std[c]);
  }
  const std::size_t plane = static_cast<std::size_t>(h) * w;
  for (int y = 0; y < h; ++y) {
    const uint8_t* src = rgb.ptr<uint8_t>(y);
    for (int x = 0; x < w; ++x) {
      for (int c = 0; c < 3; ++c) {
        const double raw = src[x * 3 + c];
        float v = config.do_rescale ? static_cast<float>(raw * config.rescale_factor) : static_cast<float>(raw);
        if (config.do_normalize) v = (v - mean[c]) / stddev[c];
        dst[c * plane + static_cast<std::size_t>(y) * w + x] = v;
      }
    }
  }
  return out;
}

at::Tensor preprocess_batch(const std::vector<cv::Mat>& images, const ImageProcessorConfig& config) {
  if (images.empty()) throw InputError("preprocess_batch: no images");
  std::vector<at::Tensor> tensors;
  tensors.reserve(images.size());
  for (std::size_t i = 0; i < images.size(); ++i) {
    tensors.push_back(preprocess(images[i], config));
    if (tensors[i].sizes() != tensors[0].sizes()) {
      throw InputError(fmt::format("preprocess_batch: image {} becomes {}x{} but image 0 becomes {}x{} (configure a "
                                   "center crop or a fixed size to batch images of different shapes)",
                                   i, tensors[i].size(2), tensors[i].size(1), tensors[0].size(2), tensors[0].size(1)));
    }
  }
  return torch::stack(tensors);
}

}  // namespace vlmopt::datasets
