// `vlmopt datasets show|vocab` as library functions (datasets/commands.hpp).
#include "test_support.hpp"
#include "datasets/commands.hpp"
#include "datasets/scenes.hpp"
#include "datasets/source.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>

#include <random>

namespace {
using vlmopt::testing::TempDir;

namespace fs = std::filesystem;
using namespace vlmopt::datasets;

}  // namespace

TEST_CASE("datasets show: size, first samples, PNG dump of the exact pixels") {
  TempDir dir;
  ShowOptions options;
  options.spec = "builtin:eval";
  options.limit = 3;
  options.dump_dir = dir / "dump";
  const auto result = show(options);
  CHECK(result.at("size") == 2000);
  CHECK(result.at("spec") == "builtin:eval");
  REQUIRE(result.at("samples").size() == 3);
  const auto source = open_dataset("builtin:eval");
  for (std::size_t i = 0; i < 3; ++i) {
    const auto& entry = result.at("samples")[i];
    const Sample sample = source->get(i);
    CHECK(entry.at("id") == sample.id);
    CHECK(entry.at("question") == sample.question);
    CHECK(entry.at("answer") == sample.answer);
    CHECK(entry.at("width") == 96);
    const cv::Mat bgr = cv::imread(entry.at("image_file").get<std::string>(), cv::IMREAD_COLOR);
    REQUIRE(!bgr.empty());
    cv::Mat rgb;
    cv::cvtColor(bgr, rgb, cv::COLOR_BGR2RGB);
    CHECK(cv::norm(rgb, sample.image, cv::NORM_INF) == 0.0);
  }
  const std::string text = format_show(result);
  CHECK(text.find("2000 samples") != std::string::npos);
  CHECK(text.find(source->get(2).question) != std::string::npos);

  options.limit = 10'000;  // more than the dataset has: all of it, no error
  options.spec = "builtin:calib";
  options.dump_dir.reset();
  CHECK(show(options).at("samples").size() == 512);
  options.spec = "builtin:nope";
  CHECK_THROWS_AS(show(options), vlmopt::InputError);
}

TEST_CASE("datasets vocab: words, question types and answer sets") {
  const auto result = vocab();
  CHECK(result.at("words").get<std::vector<std::string>>() == builtin_vocabulary());
  CHECK(result.at("question_types").get<std::vector<std::string>>() == builtin_question_types());
  CHECK(result.at("answers").at("exist").get<std::vector<std::string>>() == std::vector<std::string>{"yes", "no"});
  const std::string text = format_vocab(result);
  CHECK(text.starts_with("?\n"));  // one word per line, sorted
  CHECK(static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')) == builtin_vocabulary().size());
}
