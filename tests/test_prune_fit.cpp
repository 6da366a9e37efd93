// prune::fit (`vlmopt prune-fit`) on a tiny random fixture: the output and input
// cuts fit the same scores, account equivalent tokens per cut, write a prune.json
// the runtime accepts, and refuse candidate layers the cut cannot use.
#include "model/prune_config.hpp"
#include "prune/fit.hpp"
#include "test_support.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

using namespace vlmopt;
using vlmopt::testing::fixture_dir;
using vlmopt::testing::TempDir;

namespace {

prune::PruneFitOptions fit_options(const std::filesystem::path& out, model::PruneCut cut, std::vector<int64_t> layers) {
  prune::PruneFitOptions o;
  o.session.model = fixture_dir("clip_llama_gqa_sharded").string();  // 3 decoder layers
  o.data = "builtin:calib";
  o.limit = 4;
  o.target_keep = 0.5;
  o.cut = cut;
  o.candidate_layers = std::move(layers);
  o.out = out;
  return o;
}

}  // namespace

TEST_CASE("prune-fit: the input cut fits the output cut's scores one layer cheaper") {
  TempDir tmp("vlmopt_prune_fit");
  const auto output = prune::fit(fit_options(tmp / "output", model::PruneCut::kOutput, {1}));
  const auto input = prune::fit(fit_options(tmp / "input", model::PruneCut::kInput, {1}));
  const auto& out_chosen = output.at("chosen");
  const auto& in_chosen = input.at("chosen");
  CHECK(out_chosen.at("cut") == "output");
  CHECK(in_chosen.at("cut") == "input");
  CHECK(out_chosen.at("after_layer") == 1);
  CHECK(in_chosen.at("after_layer") == 1);
  // Same layer, same scores (layer 1's attention on its input): the same threshold and keep.
  CHECK(in_chosen.at("threshold").get<double>() == out_chosen.at("threshold").get<double>());
  const double keep = in_chosen.at("keep_ratio").get<double>();
  CHECK(keep == out_chosen.at("keep_ratio").get<double>());
  CHECK(keep <= 0.5 + 1e-9);  // the threshold keeps at most the target on average, at least the floor
  CHECK(keep >= 0.3);
  // Equivalent tokens over 3 layers: output cut at 1 -> (1 + 1 + keep) / 3, input cut -> (1 + keep + keep) / 3.
  CHECK(out_chosen.at("equivalent_keep").get<double>() == doctest::Approx((2.0 + keep) / 3.0));
  CHECK(in_chosen.at("equivalent_keep").get<double>() == doctest::Approx((1.0 + 2.0 * keep) / 3.0));
  CHECK(input.at("keep_per_layer") == nlohmann::json::array({1.0, keep, keep}));
  CHECK(output.at("keep_per_layer") == nlohmann::json::array({1.0, 1.0, keep}));
  // Sensitivity is measured where each cut drops the tokens, so recall may differ, but both are shares.
  for (const auto* r : {&out_chosen, &in_chosen}) {
    const double recall = r->at("sensitivity_recall").get<double>();
    CHECK(recall > 0.0);
    CHECK(recall <= 1.0 + 1e-9);
  }

  const auto written = model::read_prune_config(tmp / "input" / "prune.json");
  const auto plan = written.plan();
  REQUIRE(plan.steps.size() == 1);
  CHECK(plan.steps[0].cut == model::PruneCut::kInput);
  CHECK(plan.steps[0].after_layer == 1);
  CHECK(plan.steps[0].first_pruned_layer() == 1);
  CHECK_NOTHROW(plan.validate(3));
}

TEST_CASE("prune-fit: candidate layers must suit the cut") {
  TempDir tmp("vlmopt_prune_fit_layers");
  // An output cut after the last layer would prune nothing that runs.
  CHECK_THROWS_WITH_AS(prune::fit(fit_options(tmp / "a", model::PruneCut::kOutput, {2})),
                       doctest::Contains("--layers"), InputError);
  // The input cut may score at the last layer (it still shortens that layer).
  const auto last = prune::fit(fit_options(tmp / "b", model::PruneCut::kInput, {2}));
  CHECK(last.at("chosen").at("after_layer") == 2);
  CHECK(last.at("keep_per_layer").at(0) == 1.0);
  CHECK(last.at("keep_per_layer").at(1) == 1.0);
  // By default the input cut considers every layer, the output cut all but the last.
  const auto all_in = prune::fit(fit_options(tmp / "c", model::PruneCut::kInput, {}));
  CHECK(all_in.at("layers").size() == 3);
  const auto all_out = prune::fit(fit_options(tmp / "d", model::PruneCut::kOutput, {}));
  CHECK(all_out.at("layers").size() == 2);
}

TEST_CASE("bench prefill: reports the vision tower's share next to the prefill, pruned or not") {
  prune::PrefillBenchOptions o;
  o.session.model = fixture_dir("clip_llama_gqa_sharded").string();
  o.data = "builtin:calib";
  o.samples = 4;
  o.batch_size = 2;
  o.repeats = 1;
  const auto unpruned = prune::bench_prefill(o);
  o.session.prune.rule = "random";
  o.session.prune.layer = 0;
  o.session.prune.cut = "input";
  o.session.prune.keep = 0.0;  // every visual token dropped before the decoder
  const auto pruned = prune::bench_prefill(o);
  for (const auto* r : {&unpruned, &pruned}) {
    const double prefill = r->at("prefill_ms_per_batch").get<double>();
    const double vision = r->at("image_features_ms_per_batch").get<double>();
    CHECK(vision > 0.0);
    CHECK(prefill > 0.0);
    CHECK(r->at("prefill_ms_per_sample").get<double>() == doctest::Approx(prefill / 2.0));
  }
  CHECK(unpruned.at("visual_tokens_kept").get<double>() == unpruned.at("visual_tokens").get<double>());
  CHECK(pruned.at("visual_tokens_kept").get<double>() == 0.0);
}
