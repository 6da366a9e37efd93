// CLIP / SigLIP preprocessing (datasets/processor.hpp): config parsing and
// fallbacks, output sizes, crop and normalization arithmetic on images whose
// expected values follow from the definitions. Pixel parity with transformers
// is tested in test_datasets_processor_parity.cpp (interop).
#include "datasets/processor.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <torch/torch.h>

namespace {

using namespace vlmopt::datasets;
using nlohmann::json;

std::string error_of(const json& j) {
  try {
    parse_image_processor_config(j, "preprocessor_config.json");
  } catch (const vlmopt::InputError& e) {
    return e.what();
  }
  FAIL("expected an InputError for ", j.dump());
  return {};
}

}  // namespace

TEST_CASE("processor config: CLIP and SigLIP files, class defaults, legacy forms") {
  const json clip = {{"image_processor_type", "CLIPImageProcessor"},
                     {"size", {{"shortest_edge", 336}}},
                     {"crop_size", {{"height", 336}, {"width", 336}}},
                     {"resample", 3},
                     {"do_normalize", true},
                     {"image_mean", kClipMean},
                     {"image_std", kClipStd}};
  const auto c = parse_image_processor_config(clip, "clip");
  CHECK(c.kind == ImageProcessorKind::kClip);
  CHECK(c.shortest_edge == 336);
  CHECK(c.crop_height == 336);
  CHECK(c.do_center_crop);
  CHECK(c.resample == Resample::kBicubic);
  CHECK(c.rescale_factor == doctest::Approx(1.0 / 255.0));

  const auto s = parse_image_processor_config({{"image_processor_type", "SiglipImageProcessor"},
                                               {"size", {{"height", 384}, {"width", 384}}},
                                               {"do_center_crop", nullptr}},
                                              "siglip");
  CHECK(s.kind == ImageProcessorKind::kSiglip);
  CHECK(s.shortest_edge == 0);
  CHECK(s.resize_height == 384);
  CHECK(!s.do_center_crop);
  CHECK(s.image_mean == std::array<double, 3>{0.5, 0.5, 0.5});
  CHECK(s.image_std == std::array<double, 3>{0.5, 0.5, 0.5});

  // Old LLaVA-1.5 style: integer sizes, feature_extractor_type, the Fast class name.
  const auto legacy = parse_image_processor_config(
      {{"feature_extractor_type", "CLIPFeatureExtractor"}, {"size", 224}, {"crop_size", 224}, {"image_mean", 0.5}},
      "legacy");
  CHECK(legacy.shortest_edge == 224);
  CHECK(legacy.crop_width == 224);
  CHECK(legacy.image_mean == std::array<double, 3>{0.5, 0.5, 0.5});
  CHECK(parse_image_processor_config({{"image_processor_type", "CLIPImageProcessorFast"}}, "fast").shortest_edge == 224);

  // Round trip through the JSON we write.
  const auto again = parse_image_processor_config(to_preprocessor_json(s), "written");
  CHECK(again.kind == s.kind);
  CHECK(again.resize_width == 384);
  CHECK(again.do_center_crop == s.do_center_crop);
}

TEST_CASE("processor config: bad fields name the file and the field") {
  CHECK(error_of({{"image_processor_type", "BlipImageProcessor"}}).find("unsupported processor 'BlipImageProcessor'") !=
        std::string::npos);
  CHECK(error_of({{"size", 224}}).find("field 'image_processor_type'") != std::string::npos);
  const json base = {{"image_processor_type", "CLIPImageProcessor"}};
  auto with = [&](const char* key, json value) {
    json j = base;
    j[key] = std::move(value);
    return error_of(j);
  };
  CHECK(with("size", json{{"longest_edge", 5}}).find("field 'size'") != std::string::npos);
  CHECK(with("size", json{{"shortest_edge", -3}}).find("field 'size.shortest_edge'") != std::string::npos);
  CHECK(with("crop_size", "big").find("field 'crop_size'") != std::string::npos);
  CHECK(with("image_mean", json{0.5, 0.5}).find("field 'image_mean'") != std::string::npos);
  CHECK(with("image_std", json{0.5, 0.0, 0.5}).find("field 'image_std'") != std::string::npos);
  CHECK(with("resample", 9).find("field 'resample'") != std::string::npos);
  CHECK(with("do_resize", "yes").find("field 'do_resize'") != std::string::npos);
  CHECK(with("do_resize", "yes").find("preprocessor_config.json") != std::string::npos);
}

TEST_CASE("processor fallback from the vision config") {
  vlmopt::io::VisionConfig clip;
  clip.model_type = "clip_vision_model";
  clip.image_size = 96;
  const auto c = image_processor_for_vision(clip);
  CHECK(c.kind == ImageProcessorKind::kClip);
  CHECK(c.shortest_edge == 96);
  CHECK(c.fixed_output_size() == std::pair<int64_t, int64_t>{96, 96});
  vlmopt::io::VisionConfig siglip;
  siglip.model_type = "siglip_vision_model";
  siglip.image_size = 384;
  const auto s = image_processor_for_vision(siglip);
  CHECK(s.kind == ImageProcessorKind::kSiglip);
  CHECK(s.fixed_output_size() == std::pair<int64_t, int64_t>{384, 384});
  CHECK(image_processor_for_model("/nonexistent/model", siglip).resize_height == 384);
}

TEST_CASE("processor output sizes follow transformers' rounding") {
  ImageProcessorConfig c = clip_processor_defaults();
  c.do_center_crop = false;
  // Shorter side -> 224, longer side int(224 * long / short) (truncated).
  CHECK(c.output_size(480, 640) == std::pair<int64_t, int64_t>{224, 298});   // 298.67
  CHECK(c.output_size(640, 480) == std::pair<int64_t, int64_t>{298, 224});
  CHECK(c.output_size(342, 548) == std::pair<int64_t, int64_t>{224, 358});   // 358.93
  CHECK(c.output_size(100, 100) == std::pair<int64_t, int64_t>{224, 224});
  CHECK(c.fixed_output_size() == std::nullopt);
  c.do_center_crop = true;
  CHECK(c.output_size(480, 640) == std::pair<int64_t, int64_t>{224, 224});
}

TEST_CASE("preprocess: a constant image normalizes to (v/255 - mean) / std per channel") {
  const cv::Mat image(37, 53, CV_8UC3, cv::Scalar(10, 128, 250));  // RGB
  for (const auto& config : {clip_processor_defaults(), siglip_processor_defaults()}) {
    const at::Tensor out = preprocess(image, config);
    REQUIRE((out.sizes() == at::IntArrayRef({3, 224, 224})));
    CHECK((out.scalar_type() == at::kFloat));
    const std::array<double, 3> values = {10, 128, 250};
    for (int c = 0; c < 3; ++c) {
      const double expected = (values[c] / 255.0 - config.image_mean[c]) / config.image_std[c];
      // Upscaling a constant image may shift it by one level through fixed-point rounding.
      const double one_level = 1.0 / 255.0 / config.image_std[c];
      CHECK(out[c].min().item<double>() >= expected - one_level - 1e-6);
      CHECK(out[c].max().item<double>() <= expected + one_level + 1e-6);
    }
  }
  ImageProcessorConfig raw = siglip_processor_defaults();
  raw.do_resize = false;
  raw.do_normalize = false;
  raw.do_rescale = false;
  const at::Tensor unscaled = preprocess(image, raw);
  CHECK((unscaled.sizes() == at::IntArrayRef({3, 37, 53})));
  CHECK(unscaled[1].max().item<float>() == 128.0f);
}

TEST_CASE("preprocess: gray and RGBA inputs become RGB; other formats are refused") {
  ImageProcessorConfig c = siglip_processor_defaults();
  c.resize_height = c.resize_width = 8;
  const at::Tensor from_gray = preprocess(cv::Mat(8, 8, CV_8UC1, cv::Scalar(77)), c);
  const at::Tensor from_rgb = preprocess(cv::Mat(8, 8, CV_8UC3, cv::Scalar(77, 77, 77)), c);
  CHECK(torch::equal(from_gray, from_rgb));
  const at::Tensor from_rgba = preprocess(cv::Mat(8, 8, CV_8UC4, cv::Scalar(77, 77, 77, 3)), c);
  CHECK(torch::equal(from_rgba, from_rgb));
  CHECK_THROWS_AS(preprocess(cv::Mat(8, 8, CV_32FC3), c), vlmopt::InputError);
  CHECK_THROWS_AS(preprocess(cv::Mat(), c), vlmopt::InputError);
}

TEST_CASE("center crop: floor offsets, zero padding for small images") {
  cv::Mat image(5, 7, CV_8UC3);
  for (int y = 0; y < 5; ++y)
    for (int x = 0; x < 7; ++x) image.at<cv::Vec3b>(y, x) = cv::Vec3b(uint8_t(10 * y), uint8_t(x), 1);
  const cv::Mat crop = center_crop_like_hf(image, 2, 4);  // top (5-2)//2 = 1, left (7-4)//2 = 1
  REQUIRE(crop.size() == cv::Size(4, 2));
  CHECK(crop.at<cv::Vec3b>(0, 0) == cv::Vec3b(10, 1, 1));
  const cv::Mat padded = center_crop_like_hf(image, 8, 10);  // pad ceil(3/2)=2 top, ceil(3/2)=2 left
  REQUIRE(padded.size() == cv::Size(10, 8));
  CHECK(padded.at<cv::Vec3b>(1, 1) == cv::Vec3b(0, 0, 0));
  CHECK(padded.at<cv::Vec3b>(2, 2) == cv::Vec3b(0, 0, 1));
  CHECK(padded.at<cv::Vec3b>(6, 8) == cv::Vec3b(40, 6, 1));
  CHECK(padded.at<cv::Vec3b>(7, 9) == cv::Vec3b(0, 0, 0));
}

TEST_CASE("PIL-style resize: identity at the same size, box filter averages exactly") {
  cv::Mat image(6, 8, CV_8UC3);
  cv::randu(image, 0, 256);
  CHECK(cv::norm(resize_like_pil(image, 8, 6, Resample::kBicubic), image, cv::NORM_INF) == 0.0);
  // Halving with the box filter averages 2x2 blocks (rounded half up).
  const cv::Mat half = resize_like_pil(image, 4, 3, Resample::kBox);
  REQUIRE(half.size() == cv::Size(4, 3));
  for (int y = 0; y < 3; ++y) {
    for (int x = 0; x < 4; ++x) {
      for (int c = 0; c < 3; ++c) {
        // Two passes, each rounding: horizontal pairs first, then vertical.
        const auto h0 = (image.at<cv::Vec3b>(2 * y, 2 * x)[c] + image.at<cv::Vec3b>(2 * y, 2 * x + 1)[c] + 1) / 2;
        const auto h1 =
            (image.at<cv::Vec3b>(2 * y + 1, 2 * x)[c] + image.at<cv::Vec3b>(2 * y + 1, 2 * x + 1)[c] + 1) / 2;
        CHECK(int(half.at<cv::Vec3b>(y, x)[c]) == (h0 + h1 + 1) / 2);
      }
    }
  }
}

TEST_CASE("preprocess_batch stacks equal sizes and refuses different ones") {
  ImageProcessorConfig c = clip_processor_defaults();
  c.shortest_edge = c.crop_height = c.crop_width = 16;
  const std::vector<cv::Mat> images = {cv::Mat(20, 30, CV_8UC3, cv::Scalar(1, 2, 3)),
                                       cv::Mat(40, 10, CV_8UC3, cv::Scalar(4, 5, 6))};
  const at::Tensor batch = preprocess_batch(images, c);
  CHECK((batch.sizes() == at::IntArrayRef({2, 3, 16, 16})));
  CHECK(torch::equal(batch[1], preprocess(images[1], c)));
  c.do_center_crop = false;
  CHECK_THROWS_AS(preprocess_batch(images, c), vlmopt::InputError);
}
