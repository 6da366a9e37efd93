// Preprocessing parity with HF transformers (interop): tests/interop/processor_reference.py
// runs AutoImageProcessor (CLIP and SigLIP configs at 96 and 224) on real
// photos from Debian's opencv-doc; we compare our pixel_values with its output.
//
// Two comparisons per image and config:
//  * same input pixels (the RGB array PIL decoded): our resampler reimplements
//    Pillow's fixed-point arithmetic, so the values must agree to float
//    rounding -- asserted max |diff| <= 1e-6;
//  * end to end from the file (OpenCV decodes the JPEG, PIL on the Python side):
//    measured identical as well with Debian's libjpeg62-turbo 2.1.5 and the
//    libjpeg-turbo in Pillow 13's wheel; other decoder builds may round a few
//    pixels differently, so we allow up to 2 levels of 8 bits anywhere
//    (1 level = 1/255/std after normalization, 0.014-0.015 for CLIP, 0.0078 for
//    SigLIP) and a mean of 1/20 level.
// Python 3 with transformers, Pillow and safetensors is required: a missing
// interpreter or package fails the test (set VLMOPT_PYTHON to choose one).
#include "test_support.hpp"
#include "datasets/jsonl.hpp"
#include "datasets/processor.hpp"
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <opencv2/imgcodecs.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <random>

namespace {
using vlmopt::testing::TempDir;
using vlmopt::testing::read_text;

namespace fs = std::filesystem;
using namespace vlmopt::datasets;

constexpr double kSameInputMax = 1e-6;
constexpr double kEndToEndMaxLevels = 2.0;
constexpr double kEndToEndMeanLevels = 0.05;

// One 8-bit input level in units of the processor's output.
double one_level(const ImageProcessorConfig& c) {
  const double scale = c.do_rescale ? c.rescale_factor : 1.0;
  if (!c.do_normalize) return scale;
  return scale / *std::max_element(c.image_std.begin(), c.image_std.end());
}

const fs::path kPhotoDir = "/usr/share/doc/opencv-doc/examples/data";

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out.append("'\\''");
    } else {
      out.push_back(c);
    }
  }
  out.push_back('\'');
  return out;
}

struct ConfigCase {
  std::string name;
  nlohmann::json json;
};

std::vector<ConfigCase> config_cases() {
  std::vector<ConfigCase> cases;
  for (int size : {96, 224}) {
    cases.push_back({fmt::format("clip{}", size),
                     {{"image_processor_type", "CLIPImageProcessor"},
                      {"size", {{"shortest_edge", size}}},
                      {"crop_size", {{"height", size}, {"width", size}}},
                      {"do_resize", true},
                      {"do_center_crop", true},
                      {"resample", 3},
                      {"do_rescale", true},
                      {"rescale_factor", 1.0 / 255.0},
                      {"do_normalize", true},
                      {"image_mean", kClipMean},
                      {"image_std", kClipStd},
                      {"do_convert_rgb", true}}});
    cases.push_back({fmt::format("siglip{}", size),
                     {{"image_processor_type", "SiglipImageProcessor"},
                      {"size", {{"height", size}, {"width", size}}},
                      {"do_resize", true},
                      {"resample", 3},
                      {"do_rescale", true},
                      {"rescale_factor", 1.0 / 255.0},
                      {"do_normalize", true},
                      {"image_mean", {0.5, 0.5, 0.5}},
                      {"image_std", {0.5, 0.5, 0.5}}}});
  }
  // Another Pillow filter through the same machinery (bilinear, no crop: shapes follow the aspect ratio).
  cases.push_back({"clip_bilinear_nocrop",
                   {{"image_processor_type", "CLIPImageProcessor"},
                    {"size", {{"shortest_edge", 80}}},
                    {"do_center_crop", false},
                    {"resample", 2}}});
  return cases;
}

cv::Mat to_mat(const torch::Tensor& hwc_uint8) {
  REQUIRE(hwc_uint8.dim() == 3);
  REQUIRE(hwc_uint8.size(2) == 3);
  const auto t = hwc_uint8.contiguous();
  return cv::Mat(static_cast<int>(t.size(0)), static_cast<int>(t.size(1)), CV_8UC3, t.data_ptr()).clone();
}

}  // namespace

TEST_CASE("preprocessing matches transformers' image processors on real photos") {
  // Different aspect ratios and sizes: 4:3 smaller than 224 (upscaling), square,
  // wide, very wide, large, a grayscale portrait JPEG, and a colour portrait made
  // here by transposing a photo (lossless PNG, so both sides decode it alike).
  const std::vector<std::string> photos = {"HappyFish.jpg", "baboon.jpg", "building.jpg", "messi5.jpg",
                                           "aloeL.jpg",     "ellipses.jpg"};
  TempDir dir;
  std::vector<fs::path> files;
  for (const auto& name : photos) {
    REQUIRE_MESSAGE(fs::exists(kPhotoDir / name), "missing sample photo ", (kPhotoDir / name).string(),
                    " (install Debian's opencv-doc)");
    files.push_back(kPhotoDir / name);
  }
  {
    const cv::Mat butterfly = cv::imread((kPhotoDir / "butterfly.jpg").string(), cv::IMREAD_COLOR);
    REQUIRE(!butterfly.empty());
    cv::Mat portrait;
    cv::transpose(butterfly, portrait);
    files.push_back(dir / "butterfly_portrait.png");
    REQUIRE(cv::imwrite(files.back().string(), portrait));
  }

  const auto cases = config_cases();
  std::string config_args;
  for (const auto& c : cases) {
    fs::create_directories(dir / c.name);
    std::ofstream(dir / c.name / "preprocessor_config.json") << c.json.dump(2);
    config_args += fmt::format(" --config {}", shell_quote(c.name + "=" + (dir / c.name).string()));
  }
  const char* python_env = std::getenv("VLMOPT_PYTHON");
  const std::string python = python_env != nullptr && *python_env != '\0' ? python_env : "python3";
  const fs::path script = vlmopt::testing::source_dir() / "tests/interop/processor_reference.py";
  const fs::path out = dir / "reference.safetensors";
  const fs::path log = dir / "reference.log";
  std::string command = fmt::format("{} {} --out {}{}", shell_quote(python), shell_quote(script.string()),
                                    shell_quote(out.string()), config_args);
  for (const auto& f : files) {
    command.push_back(' ');
    command.append(shell_quote(f.string()));
  }
  command.append(" > ").append(shell_quote(log.string())).append(" 2>&1");
  const int status = std::system(command.c_str());
  REQUIRE_MESSAGE(status == 0, "the Python reference failed (python3 with transformers, Pillow and safetensors is "
                               "required; VLMOPT_PYTHON selects the interpreter):\n",
                  command, "\n", read_text(log));

  const auto reference = vlmopt::io::SafetensorsFile::open(out);
  double worst_same = 0, worst_e2e = 0;
  MESSAGE("reference: ", read_text(log));
  for (const auto& c : cases) {
    const ImageProcessorConfig config = parse_image_processor_config(c.json, c.name);
    const std::string backend = reference->metadata().at("backend." + c.name);
    MESSAGE(c.name, ": transformers used ", reference->metadata().at("class." + c.name), " (backend ", backend, ")");
    for (std::size_t i = 0; i < files.size(); ++i) {
      INFO(c.name, " on ", files[i].filename().string());
      const torch::Tensor expected = vlmopt::io::load_tensor(*reference, reference->at(fmt::format("{}/{}", c.name, i)));
      const cv::Mat pil_pixels = to_mat(vlmopt::io::load_tensor(*reference, reference->at(fmt::format("decoded/{}", i))));

      const torch::Tensor same_input = preprocess(pil_pixels, config);
      REQUIRE((same_input.sizes() == expected.sizes()));
      const double same_max = (same_input - expected).abs().max().item<double>();
      CHECK(same_max <= kSameInputMax);

      const cv::Mat cv_pixels = decode_image_rgb(files[i]);
      REQUIRE(!cv_pixels.empty());
      REQUIRE(cv_pixels.size() == pil_pixels.size());
      const torch::Tensor end_to_end = preprocess(cv_pixels, config);
      REQUIRE((end_to_end.sizes() == expected.sizes()));
      const auto diff = (end_to_end - expected).abs();
      const double e2e_max = diff.max().item<double>();
      const double e2e_mean = diff.mean().item<double>();
      const double decode_max = cv::norm(cv_pixels, pil_pixels, cv::NORM_INF);
      MESSAGE(fmt::format("{:>22} {:<24} {}x{} -> {}x{}: same input max {:.2e}; end to end max {:.4f} mean {:.2e} "
                          "(decoders differ by up to {} levels)",
                          c.name, files[i].filename().string(), pil_pixels.cols, pil_pixels.rows, expected.size(2),
                          expected.size(1), same_max, e2e_max, e2e_mean, decode_max));
      CHECK(e2e_max <= kEndToEndMaxLevels * one_level(config) + 1e-6);
      CHECK(e2e_mean <= kEndToEndMeanLevels * one_level(config));
      worst_same = std::max(worst_same, same_max);
      worst_e2e = std::max(worst_e2e, e2e_max);
    }
  }
  MESSAGE(fmt::format("worst over {} images x {} configs: same input {:.2e}, end to end {:.2e}", files.size(),
                      cases.size(), worst_same, worst_e2e));
}
