// Visual-token pruning at run time (model::PrunePlan, LlavaModel::set_prune_plan)
// on small random LLaVA models, and the prune.json reader/writer.
#include "model/llava.hpp"
#include "model/prune_plan.hpp"
#include "model/prune_config.hpp"
#include "test_support.hpp"
#include "tiny_llava.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

using namespace vlmopt;
using namespace vlmopt::testing;

namespace {

// [1,N] bool from 0/1 values.
torch::Tensor bools(std::initializer_list<int64_t> values) {
  return torch::tensor(std::vector<int64_t>(values), torch::kInt64).to(torch::kBool).unsqueeze(0);
}

model::PrunePlan single_step(model::PruneRule rule, int64_t after_layer, double keep_ratio, double threshold = 1.0,
                             model::PruneCut cut = model::PruneCut::kOutput) {
  model::PrunePlan plan;
  plan.rule = rule;
  plan.min_keep = 0.0;
  plan.steps.push_back({after_layer, threshold, keep_ratio, cut});
  return plan;
}

// Original indices kept for sample b (padding slots dropped).
std::vector<int64_t> kept_of(const torch::Tensor& kept_index, int64_t b) {
  const auto row = kept_index[b].contiguous();
  std::vector<int64_t> out;
  for (int64_t i = 0; i < row.size(0); ++i)
    if (row[i].item<int64_t>() >= 0) out.push_back(row[i].item<int64_t>());
  return out;
}

// Reference for one unpadded sample: layers 0..cut on every token, then only the tokens
// `kept` (indices into ids), run with their original positions as explicit position ids.
// cut = -1: every layer runs on the kept tokens only (an input cut at layer 0).
torch::Tensor reference_logits(model::LlavaModel& m, const torch::Tensor& ids, const torch::Tensor& pixels,
                               const std::vector<int64_t>& kept, int64_t cut) {
  torch::NoGradGuard no_grad;
  auto& lm = m.language_model();
  const int64_t tokens = ids.size(1);
  auto hidden = m.embed(ids, m.image_features(pixels));
  const auto positions = torch::arange(tokens, torch::kInt64).unsqueeze(0);
  const auto full = lm->prepare(positions, {}, nullptr);
  hidden = lm->run_layers(hidden, 0, cut + 1, full);
  const auto index = torch::tensor(kept, torch::kInt64);
  hidden = hidden.index_select(1, index);
  const auto rest = lm->prepare(positions.index_select(1, index), {}, nullptr);
  hidden = lm->run_layers(hidden, cut + 1, lm->num_layers(), rest);
  return m.logits(hidden, rest);
}

}  // namespace

TEST_CASE("select_kept_tokens: FastV top-k, dual threshold with its floor and cap, seeded random") {
  // One sample, 6 tokens: 0 and 5 are text, 1..4 visual.
  const auto candidates = bools({0, 1, 1, 1, 1, 0});
  const auto scores = torch::tensor({0.5f, 0.1f, 0.4f, 0.05f, 0.3f, 0.9f}).unsqueeze(0);
  auto plan = single_step(model::PruneRule::kFastV, 0, 0.5);
  auto keep = model::select_kept_tokens(plan, plan.steps[0], 0, scores, candidates);
  CHECK(torch::equal(keep, bools({1, 0, 1, 0, 1, 1})));

  // Dual: p over the visual tokens = (0.1, 0.4, 0.05, 0.3)/0.85; score_j = p_j * exp(H(p)).
  const std::vector<double> p{0.1 / 0.85, 0.4 / 0.85, 0.05 / 0.85, 0.3 / 0.85};
  double h = 0.0;
  for (const double x : p) h -= x * std::log(x);
  const auto [dual, entropy] = model::dual_scores(scores, candidates);
  CHECK(entropy.item<double>() == doctest::Approx(h).epsilon(1e-5));
  for (size_t j = 0; j < p.size(); ++j)
    CHECK(dual[0][static_cast<int64_t>(j) + 1].item<double>() == doctest::Approx(p[j] * std::exp(h)).epsilon(1e-5));
  // Threshold between the 2nd and 3rd score keeps two visual tokens.
  const double between = 0.5 * (p[3] + p[0]) * std::exp(h);
  plan = single_step(model::PruneRule::kDual, 0, 1.0, between);
  std::vector<double> entropies;
  keep = model::select_kept_tokens(plan, plan.steps[0], 0, scores, candidates, &entropies);
  CHECK(torch::equal(keep, bools({1, 0, 1, 0, 1, 1})));
  REQUIRE(entropies.size() == 1);
  CHECK(entropies[0] == doctest::Approx(h).epsilon(1e-5));
  // A threshold above everything keeps the floor (ceil(0.3 * 4) = 2 best), one below keeps the cap.
  plan.steps[0].threshold = 100.0;
  plan.min_keep = 0.3;
  keep = model::select_kept_tokens(plan, plan.steps[0], 0, scores, candidates);
  CHECK(torch::equal(keep, bools({1, 0, 1, 0, 1, 1})));
  plan.steps[0].threshold = 0.0;
  plan.max_keep = 0.75;
  keep = model::select_kept_tokens(plan, plan.steps[0], 0, scores, candidates);
  CHECK(torch::equal(keep, bools({1, 1, 1, 0, 1, 1})));

  // Random: FastV's count, from the candidates only; the seed decides which.
  const auto many = torch::ones({1, 64}, torch::kBool);
  const auto flat = torch::zeros({1, 64});
  std::set<std::vector<bool>> subsets;
  for (const uint64_t seed : {0ULL, 1ULL, 2ULL, 0ULL}) {
    auto random = single_step(model::PruneRule::kRandom, 0, 0.25);
    random.seed = seed;
    const auto kept = model::select_kept_tokens(random, random.steps[0], 0, flat, many);
    CHECK(kept.sum().item<int64_t>() == 16);
    std::vector<bool> bits;
    for (int64_t i = 0; i < 64; ++i) bits.push_back(kept[0][i].item<bool>());
    subsets.insert(bits);
  }
  CHECK(subsets.size() == 3);  // seeds 0, 1, 2 differ; seed 0 twice is the same subset
}

TEST_CASE("keep ratio 1.0 is bit-identical to the unpruned model, logits and generation") {
  auto m = model::LlavaModel::random(tiny_llava_config(4), 21);
  const auto pixels = random_pixels(2, 3);
  const auto [ids, mask] = left_pad({prompt_with_image(2, 5, 4), prompt_with_image(4, 7, 5)});
  model::ForwardInputs in;
  in.input_ids = ids;
  in.attention_mask = mask;
  in.pixel_values = pixels;
  const auto want = m.forward(in).logits;
  const auto want_tokens = m.generate_greedy(in, 6, {});

  for (const auto rule : {model::PruneRule::kFastV, model::PruneRule::kDual, model::PruneRule::kRandom}) {
    const std::string rule_name(model::prune_rule_name(rule));
    CAPTURE(rule_name);
    // Dual keeps everything with threshold 0; FastV/random with ratio 1.
    m.set_prune_plan(single_step(rule, 1, 1.0, 0.0));
    const auto out = m.forward(in);
    REQUIRE(out.kept_index.defined());
    CHECK(torch::equal(out.kept_index, torch::arange(ids.size(1)).unsqueeze(0).expand({2, ids.size(1)})));
    CHECK(torch::equal(out.logits, want));
    CHECK(m.generate_greedy(in, 6, {}) == want_tokens);
    const auto& report = m.last_prune_report();
    REQUIRE(report.visual_tokens.size() == 4);
    for (const auto& layer : report.visual_tokens) CHECK(layer == std::vector<int64_t>{kImageTokens, kImageTokens});
  }
  m.set_prune_plan(std::nullopt);
  CHECK_FALSE(m.forward(in).kept_index.defined());
  CHECK(m.last_prune_report().empty());
}

TEST_CASE("pruned prefill keeps the chosen tokens at their original positions (ragged batch)") {
  auto m = model::LlavaModel::random(tiny_llava_config(4), 22);
  const std::vector<torch::Tensor> prompts{prompt_with_image(3, 6, 31), prompt_with_image(1, 9, 32)};
  const auto pixels = random_pixels(2, 33);
  const auto [ids, mask] = left_pad(prompts);
  constexpr int64_t kCut = 1;

  // The attention the visual tokens get at layer kCut, from the eager probabilities tap.
  std::vector<torch::Tensor> probs;
  const int tap = m.taps().subscribe("model.language_model.layers.1.self_attn.probs",
                                     [&](std::string_view, const torch::Tensor& t, const model::TapContext&) {
                                       probs.push_back(t.clone());
                                     });
  model::ForwardInputs in;
  in.input_ids = ids;
  in.attention_mask = mask;
  in.pixel_values = pixels;
  m.forward(in);
  m.taps().unsubscribe(tap);
  REQUIRE(probs.size() == 1);
  const auto received_last = probs[0].mean(1).select(1, ids.size(1) - 1);  // [B,T] from the last query row

  SUBCASE("FastV keeps the top half by last-row attention") {
    m.set_prune_plan(single_step(model::PruneRule::kFastV, kCut, 0.5));
    const auto out = m.forward(in);
    for (int64_t b = 0; b < 2; ++b) {
      const auto kept = kept_of(out.kept_index, b);
      std::vector<std::pair<float, int64_t>> visual;
      for (int64_t t = 0; t < ids.size(1); ++t)
        if (ids[b][t].item<int64_t>() == kImageId) visual.emplace_back(-received_last[b][t].item<float>(), t);
      std::sort(visual.begin(), visual.end());
      std::set<int64_t> want_visual;
      for (int64_t i = 0; i < kImageTokens / 2; ++i) want_visual.insert(visual[static_cast<size_t>(i)].second);
      std::set<int64_t> got_visual;
      for (const int64_t t : kept)
        if (ids[b][t].item<int64_t>() == kImageId) got_visual.insert(t);
      CHECK(got_visual == want_visual);
      CHECK(m.last_prune_report().visual_tokens[2][static_cast<size_t>(b)] == kImageTokens / 2);
    }
  }

  SUBCASE("dual rule: ragged counts, logits equal a run on the gathered tokens with explicit positions") {
    // A threshold of 1 keeps the tokens above the effective-support average: counts differ per sample.
    auto plan = single_step(model::PruneRule::kDual, kCut, 1.0, 1.0);
    plan.min_keep = 0.1;
    m.set_prune_plan(plan);
    const auto out = m.forward(in);
    const auto& report = m.last_prune_report();
    REQUIRE(report.visual_tokens.size() == 4);
    REQUIRE(report.entropy.size() == 1);
    for (int64_t b = 0; b < 2; ++b) {
      const auto kept = kept_of(out.kept_index, b);
      const int64_t pad = ids.size(1) - prompts[static_cast<size_t>(b)].size(1);
      int64_t kept_visual = 0;
      for (const int64_t t : kept) kept_visual += ids[b][t].item<int64_t>() == kImageId;
      CHECK(report.visual_tokens[0][static_cast<size_t>(b)] == kImageTokens);
      CHECK(report.visual_tokens[1][static_cast<size_t>(b)] == kImageTokens);
      CHECK(report.visual_tokens[2][static_cast<size_t>(b)] == kept_visual);
      CHECK(report.visual_tokens[3][static_cast<size_t>(b)] == kept_visual);
      CHECK(kept_visual >= 2);  // ceil(0.1 * 16)
      CHECK(kept_visual < kImageTokens);
      // Every text token survives, in order.
      CHECK(std::is_sorted(kept.begin(), kept.end()));
      CHECK(static_cast<int64_t>(kept.size()) - kept_visual == prompts[static_cast<size_t>(b)].size(1) - kImageTokens + pad);

      // Reference on the sample alone: its own (unpadded) indices.
      std::vector<int64_t> own;
      for (const int64_t t : kept)
        if (t >= pad) own.push_back(t - pad);
      const auto ref = reference_logits(m, prompts[static_cast<size_t>(b)], pixels.slice(0, b, b + 1), own, kCut);
      // The sample's real slots are the last own.size() positions of its row.
      const auto got = out.logits[b].slice(0, out.logits.size(1) - static_cast<int64_t>(own.size())).unsqueeze(0);
      const double diff = max_abs_diff(got, ref);
      CHECK(diff <= 1e-5);
      MESSAGE("pruned vs gathered reference, sample ", b, ": max |d logits| ", diff);
    }
    CHECK(report.visual_tokens[2][0] != report.visual_tokens[2][1]);  // ragged

    SUBCASE("batch_mean: every sample keeps the batch's mean fraction, so nothing is padded after the cut") {
      const int64_t per_sample_total = report.visual_tokens[2][0] + report.visual_tokens[2][1];
      plan.batch_keep = model::BatchKeep::kBatchMean;
      m.set_prune_plan(plan);
      const auto even = m.forward(in);
      const auto& r = m.last_prune_report();
      CHECK(r.visual_tokens[2][0] == r.visual_tokens[2][1]);
      // Rounded mean of the per-sample counts (both samples have kImageTokens candidates).
      CHECK(std::abs(2 * r.visual_tokens[2][0] - per_sample_total) <= 1);
      // No padding slot after the cut: the prompts differ in length by their text only.
      const int64_t text_longest = std::max(prompts[0].size(1), prompts[1].size(1)) - kImageTokens;
      CHECK(even.kept_index.size(1) == text_longest + r.visual_tokens[2][0]);
      for (int64_t b = 0; b < 2; ++b) {
        // The kept visual tokens are the sample's own highest scorers: a prefix of its
        // per-sample choice when it kept more, a superset when it kept fewer.
        std::set<int64_t> mean_set, own_set;
        for (const int64_t t : kept_of(even.kept_index, b))
          if (ids[b][t].item<int64_t>() == kImageId) mean_set.insert(t);
        for (const int64_t t : kept_of(out.kept_index, b))
          if (ids[b][t].item<int64_t>() == kImageId) own_set.insert(t);
        const auto& small = mean_set.size() < own_set.size() ? mean_set : own_set;
        const auto& large = mean_set.size() < own_set.size() ? own_set : mean_set;
        CHECK(std::includes(large.begin(), large.end(), small.begin(), small.end()));
      }
    }

    SUBCASE("input cut: the scoring layer itself runs on the kept tokens, chosen exactly as by the output cut") {
      for (const int64_t layer : {int64_t{0}, kCut}) {
        CAPTURE(layer);
        auto at_input = single_step(model::PruneRule::kDual, layer, 1.0, 1.0, model::PruneCut::kInput);
        at_input.min_keep = 0.1;
        m.set_prune_plan(at_input);
        const auto cut_in = m.forward(in);
        const auto r = m.last_prune_report();
        if (layer == kCut) CHECK(torch::equal(cut_in.kept_index, out.kept_index));  // same scores, same choice
        for (int64_t b = 0; b < 2; ++b) {
          const auto kept = kept_of(cut_in.kept_index, b);
          const int64_t pad = ids.size(1) - prompts[static_cast<size_t>(b)].size(1);
          int64_t kept_visual = 0;
          for (const int64_t t : kept) kept_visual += ids[b][t].item<int64_t>() == kImageId;
          CHECK(kept_visual < kImageTokens);
          for (int64_t l = 0; l < 4; ++l)
            CHECK(r.visual_tokens[static_cast<size_t>(l)][static_cast<size_t>(b)] ==
                  (l < layer ? kImageTokens : kept_visual));
          std::vector<int64_t> own;
          for (const int64_t t : kept)
            if (t >= pad) own.push_back(t - pad);
          const auto ref =
              reference_logits(m, prompts[static_cast<size_t>(b)], pixels.slice(0, b, b + 1), own, layer - 1);
          const auto got = cut_in.logits[b].slice(0, cut_in.logits.size(1) - static_cast<int64_t>(own.size())).unsqueeze(0);
          const double diff = max_abs_diff(got, ref);
          CHECK(diff <= 1e-5);
          MESSAGE("input cut at layer ", layer, " vs gathered reference, sample ", b, ": max |d logits| ", diff);
        }
      }
    }
  }
  m.set_prune_plan(std::nullopt);
}

TEST_CASE("pruned batch answers like each sample alone, and decoding after the pruned prefill is exact") {
  auto m = model::LlavaModel::random(tiny_llava_config(4), 23);
  const std::vector<torch::Tensor> prompts{prompt_with_image(2, 4, 41), prompt_with_image(5, 8, 42)};
  const auto pixels = random_pixels(2, 43);
  auto plan = single_step(model::PruneRule::kDual, 0, 1.0, 1.0);
  plan.min_keep = 0.2;
  plan.steps.push_back({2, 1.0, 1.0});  // a second cut, on what the first kept
  m.set_prune_plan(plan);
  constexpr int kNew = 5;

  const auto [ids, mask] = left_pad(prompts);
  model::ForwardInputs batch;
  batch.input_ids = ids;
  batch.attention_mask = mask;
  batch.pixel_values = pixels;
  const auto batched = m.generate_greedy(batch, kNew, {});
  REQUIRE(batched.size() == 2);
  for (int64_t b = 0; b < 2; ++b) {
    model::ForwardInputs alone;
    alone.input_ids = prompts[static_cast<size_t>(b)];
    alone.pixel_values = pixels.slice(0, b, b + 1);
    const auto tokens = m.generate_greedy(alone, kNew, {});
    CHECK(tokens[0] == batched[static_cast<size_t>(b)]);
    CHECK(tokens[0].size() == kNew);
  }

  // Decode by hand: prefill with a cache, then one step; the step must equal the model run on
  // (kept prompt tokens + the new token) with explicit positions, i.e. a KV cache whose layers
  // have different lengths attends to the right keys.
  m.set_prune_plan(single_step(model::PruneRule::kFastV, 1, 0.25));
  const auto& prompt = prompts[1];
  const auto image = pixels.slice(0, 1, 2);
  model::KVCache cache(m.language_model()->num_layers());
  model::ForwardInputs prefill;
  prefill.input_ids = prompt;
  prefill.pixel_values = image;
  prefill.cache = &cache;
  const auto first = m.forward(prefill);
  const auto kept = kept_of(first.kept_index, 0);
  CHECK(cache.length(0) == prompt.size(1));
  CHECK(cache.length(1) == prompt.size(1));
  CHECK(cache.length(2) == static_cast<int64_t>(kept.size()));
  CHECK(cache.length(3) == static_cast<int64_t>(kept.size()));
  CHECK_FALSE(cache.key_mask(0).defined());
  CHECK(cache.key_mask(2).defined());

  const auto next = first.logits.select(1, first.logits.size(1) - 1).argmax(-1, true);  // [1,1]
  model::ForwardInputs step;
  step.input_ids = next;
  step.cache = &cache;
  step.attention_mask = torch::ones({1, prompt.size(1) + 1}, torch::kInt64);
  step.position_ids = torch::full({1, 1}, prompt.size(1), torch::kInt64);
  const auto got = m.forward(step).logits;
  CHECK(cache.length(0) == prompt.size(1) + 1);
  CHECK(cache.length(3) == static_cast<int64_t>(kept.size()) + 1);

  auto kept_then_new = kept;
  kept_then_new.push_back(prompt.size(1));
  const auto ref = reference_logits(m, torch::cat({prompt, next}, 1), image, kept_then_new, 1);
  const double diff = max_abs_diff(got, ref.slice(1, ref.size(1) - 1));
  CHECK(diff <= 1e-5);
  MESSAGE("decode step after pruned prefill vs reference: max |d logits| ", diff);

  // An input cut at layer 0: every layer caches only the kept tokens, and decoding stays exact.
  m.set_prune_plan(single_step(model::PruneRule::kFastV, 0, 0.25, 1.0, model::PruneCut::kInput));
  model::KVCache short_cache(m.language_model()->num_layers());
  prefill.cache = &short_cache;
  const auto first_in = m.forward(prefill);
  const auto kept_in = kept_of(first_in.kept_index, 0);
  CHECK(static_cast<int64_t>(kept_in.size()) == prompt.size(1) - kImageTokens + kImageTokens / 4);
  for (int64_t l = 0; l < 4; ++l) CHECK(short_cache.length(l) == static_cast<int64_t>(kept_in.size()));
  const auto next_in = first_in.logits.select(1, first_in.logits.size(1) - 1).argmax(-1, true);
  step.input_ids = next_in;
  step.cache = &short_cache;
  const auto got_in = m.forward(step).logits;
  auto kept_in_then_new = kept_in;
  kept_in_then_new.push_back(prompt.size(1));
  const auto ref_in = reference_logits(m, torch::cat({prompt, next_in}, 1), image, kept_in_then_new, -1);
  const double diff_in = max_abs_diff(got_in, ref_in.slice(1, ref_in.size(1) - 1));
  CHECK(diff_in <= 1e-5);
  MESSAGE("decode step after an input cut at layer 0 vs reference: max |d logits| ", diff_in);
  m.set_prune_plan(std::nullopt);
}

TEST_CASE("pruning works with the fused attention backend and rejects bad plans") {
  auto m = model::LlavaModel::random(tiny_llava_config(4), 24);
  const auto ids = prompt_with_image(2, 6, 51);
  const auto pixels = random_pixels(1, 52);
  model::ForwardInputs in;
  in.input_ids = ids;
  in.pixel_values = pixels;
  m.set_prune_plan(single_step(model::PruneRule::kFastV, 1, 0.5));
  const auto eager = m.forward(in);
  m.set_attention_backend(model::AttentionBackend::kFused);
  const auto fused = m.forward(in);
  CHECK(torch::equal(eager.kept_index, fused.kept_index));
  CHECK(max_abs_diff(eager.logits, fused.logits) <= 1e-4);

  CHECK_THROWS_AS(m.set_prune_plan(single_step(model::PruneRule::kFastV, 3, 0.5)), InputError);  // last layer
  CHECK_THROWS_AS(m.set_prune_plan(single_step(model::PruneRule::kFastV, 1, 1.5)), InputError);
  auto unsorted = single_step(model::PruneRule::kDual, 2, 1.0);
  unsorted.steps.push_back({1, 1.0, 1.0});
  CHECK_THROWS_AS(m.set_prune_plan(unsorted), InputError);
  CHECK_THROWS_AS(model::parse_prune_rule("topk", "--prune-rule"), InputError);
  // An input cut may sit at the last layer; cuts must move strictly later (first pruned layer).
  CHECK_NOTHROW(m.set_prune_plan(single_step(model::PruneRule::kFastV, 3, 0.5, 1.0, model::PruneCut::kInput)));
  CHECK_THROWS_AS(m.set_prune_plan(single_step(model::PruneRule::kFastV, 4, 0.5, 1.0, model::PruneCut::kInput)),
                  InputError);
  auto same_cut = single_step(model::PruneRule::kDual, 1, 1.0);
  same_cut.steps.push_back({2, 1.0, 1.0, model::PruneCut::kInput});  // both first prune layer 2
  CHECK_THROWS_AS(m.set_prune_plan(same_cut), InputError);
  same_cut.steps[0].after_layer = 0;
  CHECK_NOTHROW(m.set_prune_plan(same_cut));
  CHECK_THROWS_AS(model::parse_prune_cut("middle", "--prune-cut"), InputError);
  m.set_prune_plan(std::nullopt);
}

TEST_CASE("prune.json round-trips and every malformed field is an InputError naming the file and field") {
  testing::TempDir dir("vlmopt_prune_json");
  model::PruneConfig config;
  config.rule = model::PruneRule::kDual;
  config.policy = {0.25, 0.5, 0.1, model::BatchKeep::kBatchMean};
  config.hardware = {0.5, 0.25};
  config.scenarios["general"].steps = {{0, 0.75, 1.0}, {2, 1.25, 1.0}};
  config.scenarios["document"].steps = {{1, 0.5, 1.0, model::PruneCut::kInput}};
  config.fit = {{"note", "test"}};
  const auto path = dir / "prune.json";
  model::write_prune_config(path, config);
  const auto back = model::read_prune_config(path);
  CHECK(back.to_json() == config.to_json());
  CHECK(back.scenarios.at("general").steps[1].threshold == 1.25);

  // The plan: floor from the policy, cap = max(floor, 1 - a*mem - b*l2) = 1 - 0.25 - 0.025.
  const auto plan = back.plan("general");
  CHECK(plan.rule == model::PruneRule::kDual);
  REQUIRE(plan.steps.size() == 2);
  CHECK(plan.steps[1].after_layer == 2);
  CHECK(plan.min_keep == 0.25);
  CHECK(plan.max_keep == doctest::Approx(0.725));
  CHECK(plan.batch_keep == model::BatchKeep::kBatchMean);
  const model::HardwareState idle;
  CHECK(back.plan("", &idle).max_keep == 1.0);  // no pressure: no cap
  CHECK(back.plan("document").steps.at(0).threshold == 0.5);
  CHECK(back.plan("document").steps.at(0).cut == model::PruneCut::kInput);
  CHECK(back.plan("general").steps.at(0).cut == model::PruneCut::kOutput);
  CHECK_THROWS_AS(back.plan("video_qa"), InputError);

  const auto good = config.to_json();
  struct Bad {
    const char* field;  // must appear in the message
    nlohmann::json doc;
  };
  std::vector<Bad> cases;
  const auto with = [&](auto edit) {
    auto j = good;
    edit(j);
    return j;
  };
  cases.push_back({"version", with([](auto& j) { j["version"] = 2; })});
  cases.push_back({"version", with([](auto& j) { j["version"] = "1"; })});
  cases.push_back({"format", with([](auto& j) { j["format"] = "other"; })});
  cases.push_back({"rule", with([](auto& j) { j["rule"] = "topk"; })});
  cases.push_back({"rule", with([](auto& j) { j["rule"] = 3; })});
  cases.push_back({"floor", with([](auto& j) { j["policy"]["floor"] = 1.5; })});
  cases.push_back({"a", with([](auto& j) { j["policy"]["a"] = "x"; })});
  cases.push_back({"batch_keep", with([](auto& j) { j["policy"]["batch_keep"] = "sometimes"; })});
  cases.push_back({"batch_keep", with([](auto& j) { j["policy"]["batch_keep"] = 1; })});
  cases.push_back({"mem_pressure", with([](auto& j) { j["hardware"]["mem_pressure"] = -0.1; })});
  cases.push_back({"scenarios", with([](auto& j) { j["scenarios"] = nlohmann::json::object(); })});
  cases.push_back({"steps", with([](auto& j) { j["scenarios"]["general"]["steps"] = 1; })});
  cases.push_back({"after_layer", with([](auto& j) { j["scenarios"]["general"]["steps"][0]["after_layer"] = -1; })});
  cases.push_back({"after_layer", with([](auto& j) { j["scenarios"]["general"]["steps"][1]["after_layer"] = 0; })});
  cases.push_back({"cut", with([](auto& j) { j["scenarios"]["general"]["steps"][0]["cut"] = "middle"; })});
  cases.push_back({"cut", with([](auto& j) { j["scenarios"]["general"]["steps"][0]["cut"] = 0; })});
  // An input cut at layer 1 after an output cut at layer 0: both first prune layer 1.
  cases.push_back({"after_layer", with([](auto& j) {
                     j["scenarios"]["general"]["steps"][1]["after_layer"] = 1;
                     j["scenarios"]["general"]["steps"][1]["cut"] = "input";
                   })});
  cases.push_back({"threshold", with([](auto& j) { j["scenarios"]["general"]["steps"][0]["threshold"] = "high"; })});
  cases.push_back({"keep_ratio", with([](auto& j) { j["scenarios"]["general"]["steps"][0]["keep_ratio"] = 2; })});
  cases.push_back({"default_scenario", with([](auto& j) { j["default_scenario"] = "video_qa"; })});
  cases.push_back({"seed", with([](auto& j) { j["seed"] = -4; })});
  cases.push_back({"extra", with([](auto& j) { j["extra"] = 1; })});
  cases.push_back({"bogus", with([](auto& j) { j["scenarios"]["general"]["steps"][0]["bogus"] = 1; })});
  for (const auto& c : cases) {
    CAPTURE(c.field);
    testing::write_bytes(path, c.doc.dump());
    try {
      (void)model::read_prune_config(path);
      FAIL("accepted a bad prune.json");
    } catch (const InputError& e) {
      const std::string message = e.what();
      CHECK(message.find(path.string()) != std::string::npos);
      CHECK(message.find(c.field) != std::string::npos);
    }
  }
  testing::write_bytes(path, "{\"format\": \"vlmopt.prune\", ");  // truncated
  CHECK_THROWS_AS(model::read_prune_config(path), InputError);
  testing::write_bytes(path, "[]");
  CHECK_THROWS_AS(model::read_prune_config(path), InputError);
  CHECK_THROWS_AS(model::read_prune_config(dir / "missing.json"), InputError);

  // A plan from prune.json must fit the model it is applied to.
  auto m = model::LlavaModel::random(tiny_llava_config(4), 25);
  model::PruneConfig deep;
  deep.scenarios["general"].steps = {{3, 1.0, 1.0}};
  CHECK_THROWS_AS(m.set_prune_plan(deep.plan()), InputError);
}
