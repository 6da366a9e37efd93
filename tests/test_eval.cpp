// eval::evaluate: the accounting around the answers (counts, per-type split,
// Wilson intervals, predictions file, visual-token figures for still images and
// frame sequences). The answers themselves are checked against transformers in
// tests/interop/builtin_generate.py.
#include "eval/evaluate.hpp"
#include "io/atomic_file.hpp"
#include "test_support.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <sstream>

using namespace vlmopt;
using vlmopt::testing::fixture_dir;
using vlmopt::testing::TempDir;

TEST_CASE("wilson95: known values and edge cases") {
  // 50/100: centre 0.5, half-width 1.96 * sqrt(0.25/100 + 1.96^2/(4*100^2)) / (1 + 1.96^2/100).
  const auto [lo, hi] = eval::Proportion{50, 100}.wilson95();
  CHECK(lo == doctest::Approx(0.4038).epsilon(1e-3));
  CHECK(hi == doctest::Approx(0.5962).epsilon(1e-3));
  const auto [lo0, hi0] = eval::Proportion{0, 10}.wilson95();
  CHECK(lo0 == doctest::Approx(0.0));
  CHECK(hi0 > 0.2);  // not the degenerate [0, 0] of the normal approximation
  CHECK(hi0 < 0.35);
  const auto [lo1, hi1] = eval::Proportion{10, 10}.wilson95();
  CHECK(hi1 == doctest::Approx(1.0));
  CHECK(lo1 < 0.8);
}

TEST_CASE("evaluate: counts, per-type split and the predictions file agree") {
  TempDir tmp("vlmopt_eval");
  eval::EvalOptions options;
  options.session.model = fixture_dir("clip_llama_old").string();
  options.data = "builtin:eval";
  options.limit = 10;
  options.batch_size = 4;  // a ragged last batch
  options.predictions = tmp.path() / "pred.jsonl";
  const auto result = eval::evaluate(options);

  CHECK(result.overall.n == 10);
  int64_t n = 0, correct = 0;
  for (const auto& [type, p] : result.by_type) {
    CAPTURE(type);
    CHECK_FALSE(type.empty());
    n += p.n;
    correct += p.correct;
  }
  CHECK(n == 10);
  CHECK(correct == result.overall.correct);
  CHECK(result.visual_tokens == 16);  // fixture: image 8 px, patch 2 -> 16 tokens ("default" drops CLS)
  CHECK(result.visual_tokens_per_sample == doctest::Approx(16.0));
  CHECK(result.visual_tokens_kept == doctest::Approx(16.0));  // no pruning

  std::istringstream lines(io::read_whole_file(*options.predictions, 1 << 20));
  std::string line;
  int64_t rows = 0, rows_correct = 0;
  while (std::getline(lines, line)) {
    const auto row = nlohmann::json::parse(line);
    ++rows;
    rows_correct += row.at("correct").get<bool>();
    CHECK(row.at("id").get<std::string>().starts_with("builtin:eval/"));
  }
  CHECK(rows == 10);
  CHECK(rows_correct == result.overall.correct);

  const auto j = result.to_json();
  for (const char* key : {"accuracy", "n", "ci95", "by_type", "visual_tokens", "visual_tokens_per_sample",
                          "visual_tokens_kept", "latency_ms"})
    CHECK_MESSAGE(j.contains(key), key);
}

TEST_CASE("evaluate: a frame sequence counts the visual tokens of every frame") {
  eval::EvalOptions options;
  options.session.model = fixture_dir("clip_llama_old").string();
  options.data = "builtin:clips";  // 3 frames per sample
  options.limit = 4;
  options.batch_size = 4;
  const auto result = eval::evaluate(options);
  CHECK(result.visual_tokens == 16);
  CHECK(result.visual_tokens_per_sample == doctest::Approx(48.0));
  CHECK(result.visual_tokens_kept == doctest::Approx(48.0));
}
