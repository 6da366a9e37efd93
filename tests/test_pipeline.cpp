// `vlmopt pipeline` end to end on a tiny random fixture: every step runs, its
// report lands in the bundle, the bundle still verifies, and the summary's
// figures are the ones the step reports hold.
#include "bundle/verify.hpp"
#include "io/atomic_file.hpp"
#include "model/prune_config.hpp"
#include "pipeline/pipeline.hpp"
#include "test_support.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

using namespace vlmopt;
using vlmopt::testing::fixture_dir;
using vlmopt::testing::TempDir;

namespace {
nlohmann::json read_json(const std::filesystem::path& path) {
  return nlohmann::json::parse(io::read_whole_file(path, 1ull << 30));
}
}  // namespace

TEST_CASE("pipeline: every step runs into one bundle that verifies") {
  TempDir tmp("vlmopt_pipeline");
  pipeline::PipelineOptions options;
  options.model = fixture_dir("clip_llama_gqa_sharded").string();  // 3 decoder layers: room to prune after layer 1
  options.calib_samples = 8;
  options.eval_limit = 6;
  options.batch_size = 4;
  options.compensate_steps = 3;
  options.compensate_samples = 8;
  options.prune_keep = 0.5;
  options.prune_calib_samples = 4;
  options.prune_cut = model::PruneCut::kInput;  // every decoder layer runs on the kept tokens
  options.prune_layers = {0};
  options.align_samples = 2;
  options.out = tmp.path() / "bundle";

  const auto result = pipeline::run_pipeline(options);
  const auto& summary = result.summary;
  const auto reports = options.out / "vlmopt" / "reports";

  std::vector<std::string> steps;
  for (const auto& s : summary.at("steps")) steps.push_back(s.at("step").get<std::string>());
  CHECK(steps == std::vector<std::string>{"calibrate", "compensate", "prune-fit", "diagnose-align"});

  for (const char* file : {"calibration.json", "compensation.json", "eval_fp32.json", "eval_bundle.json",
                           "eval_bundle_compensated.json", "eval_bundle_pruned.json", "pipeline.json",
                           "align/align.json", "align/report.html"}) {
    CAPTURE(file);
    CHECK(std::filesystem::is_regular_file(reports / file));
  }
  CHECK(std::filesystem::is_regular_file(options.out / "vlmopt" / "adapter.safetensors"));
  CHECK(std::filesystem::is_regular_file(options.out / "vlmopt" / "prune.json"));

  // Every file the steps added is in the manifest with its hash.
  const auto verified = bundle::verify_bundle(options.out);
  CHECK_MESSAGE(verified.ok(), verified.to_json().dump());

  // The summary is what the reports say.
  const auto fp32 = read_json(reports / "eval_fp32.json");
  const auto compensated = read_json(reports / "eval_bundle_compensated.json");
  const auto pruned = read_json(reports / "eval_bundle_pruned.json");
  CHECK(fp32.at("n").get<int64_t>() == 6);
  CHECK(summary.at("accuracy_delta_compensated").get<double>() ==
        doctest::Approx(compensated.at("accuracy").get<double>() - fp32.at("accuracy").get<double>()));
  // Pruning really dropped visual tokens in the last evaluation.
  CHECK(pruned.at("visual_tokens_kept").get<double>() < pruned.at("visual_tokens").get<double>());
  // prune-fit got the cut and layer: an input cut at layer 0 prunes every layer, so the
  // equivalent keep equals the kept fraction.
  const auto plan = model::read_prune_config(options.out / "vlmopt" / "prune.json").plan();
  REQUIRE(plan.steps.size() == 1);
  CHECK(plan.steps[0].cut == model::PruneCut::kInput);
  CHECK(plan.steps[0].after_layer == 0);
  const auto& fitted = summary.at("steps").at(2).at("chosen");
  CHECK(fitted.at("equivalent_keep").get<double>() == doctest::Approx(fitted.at("keep_ratio").get<double>()));
  CHECK(read_json(reports / "pipeline.json").at("options").at("prune_cut") == "input");
  CHECK(read_json(reports / "pipeline.json").at("options").at("compensate_steps").get<int64_t>() == 3);
  CHECK(result.format().find("accuracy compensated") != std::string::npos);
}

TEST_CASE("pipeline: steps switched off leave no reports behind") {
  TempDir tmp("vlmopt_pipeline");
  pipeline::PipelineOptions options;
  options.model = fixture_dir("clip_llama_old").string();
  options.calib_samples = 4;
  options.eval_limit = 4;
  options.batch_size = 4;
  options.compensate_steps = 0;
  options.prune_keep = 0.0;
  options.align_samples = 0;
  options.out = tmp.path() / "bundle";
  const auto result = pipeline::run_pipeline(options);
  const auto reports = options.out / "vlmopt" / "reports";
  CHECK(result.summary.at("steps").size() == 1);
  CHECK_FALSE(result.summary.contains("bundle_compensated"));
  CHECK_FALSE(result.summary.contains("bundle_pruned"));
  CHECK_FALSE(std::filesystem::exists(reports / "compensation.json"));
  CHECK_FALSE(std::filesystem::exists(reports / "eval_bundle_pruned.json"));
  CHECK_FALSE(std::filesystem::exists(reports / "align"));
  CHECK(bundle::verify_bundle(options.out).ok());
}
