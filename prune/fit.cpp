#include "prune/fit.hpp"

#include "bundle/export.hpp"
#include "datasets/source.hpp"
#include "io/atomic_file.hpp"
#include "util/error.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

namespace vlmopt::prune {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// Per candidate layer, per calibration sample: [N] fp32 on the CPU.
struct LayerStats {
  int64_t layer = 0;
  std::vector<torch::Tensor> score;        // dual score p_j * exp(H) at the layer's attention
  std::vector<torch::Tensor> sensitivity;  // ||dNLL/dh||_1 / ||h||_1 where the cut drops tokens
};

int64_t sample_count(const datasets::DatasetSource& source, int64_t limit) {
  const auto size = static_cast<int64_t>(source.size());
  return limit > 0 ? std::min(limit, size) : size;
}

std::vector<LayerStats> collect_statistics(eval::VlmSession& session, const datasets::DatasetSource& source,
                                           int64_t samples, const std::vector<int64_t>& layers,
                                           model::PruneCut cut) {
  auto& m = session.model();
  auto& lm = m.language_model();
  const auto device = m.device();
  std::vector<LayerStats> stats;
  for (const int64_t l : layers) stats.push_back({l, {}, {}});
  for (int64_t i = 0; i < samples; ++i) {
    const auto sample = source.get(static_cast<size_t>(i));
    const auto batch = session.prepare({sample});  // [1,P] prompt, no padding
    auto answer = session.tokenizer().encode(sample.answer, /*add_special_tokens=*/false);
    if (!session.eos_ids().empty()) answer.push_back(session.eos_ids().front());
    VLMOPT_CHECK_INPUT(!answer.empty(), "{}: answer of sample {} is empty", source.describe(), sample.id);
    const auto answer_ids = torch::tensor(answer, torch::kInt64).to(device);
    const auto ids = torch::cat({batch.input_ids, answer_ids.unsqueeze(0)}, 1);
    const int64_t prompt = batch.input_ids.size(1), tokens = ids.size(1);

    torch::Tensor embeds;
    {
      torch::NoGradGuard no_grad;
      embeds = m.embed(ids, m.image_features(batch.pixel_values));
    }
    torch::AutoGradMode grad_on(true);
    auto h = embeds.detach().requires_grad_(true);
    const auto positions = torch::arange(tokens, torch::TensorOptions().device(device).dtype(torch::kInt64)).unsqueeze(0);
    const auto inputs = lm->prepare(positions, {}, nullptr);
    std::vector<torch::Tensor> layer_inputs;  // [l] = input of layer l, [L] = last output
    for (int64_t l = 0; l < lm->num_layers(); ++l) {
      layer_inputs.push_back(h);
      if (!h.is_leaf()) h.retain_grad();
      h = lm->run_layers(h, l, l + 1, inputs);
    }
    layer_inputs.push_back(h);
    const auto logits = m.logits(h, inputs).squeeze(0).to(torch::kFloat32);  // [T,V]
    // Teacher forcing: position t predicts token t+1; the answer starts at `prompt`.
    const auto loss = torch::nn::functional::cross_entropy(logits.slice(0, prompt - 1, tokens - 1), answer_ids);
    loss.backward();

    torch::NoGradGuard no_grad;
    const auto visual = m.image_token_mask(ids);  // [1,T]
    const auto pos = torch::arange(tokens, positions.options()).unsqueeze(0);
    const auto last_visual = torch::where(visual, pos, torch::full_like(pos, -1)).amax(1, true);
    // Question rows: what the run-time scorer sees (the prompt only; causal, so the answer does not matter).
    auto rows = visual.logical_not().logical_and(pos > last_visual).logical_and(pos < prompt);
    if (!rows.any().item<bool>()) rows = pos == prompt - 1;
    for (auto& st : stats) {
      const auto received = lm->attention_received(st.layer, layer_inputs[static_cast<size_t>(st.layer)].detach(),
                                                   inputs, rows);
      const auto dual = model::dual_scores(received, visual).first;
      st.score.push_back(dual.masked_select(visual).to(torch::kCPU));
      const int64_t dropped_at = model::PruneStep{.after_layer = st.layer, .cut = cut}.first_pruned_layer();
      const auto& at = layer_inputs[static_cast<size_t>(dropped_at)];
      VLMOPT_CHECK(at.grad().defined(), "no gradient at the input of layer {}", dropped_at);
      const auto sens = at.grad().abs().sum(-1) / at.detach().abs().sum(-1).clamp_min(1e-12);  // [1,T]
      st.sensitivity.push_back(sens.masked_select(visual).to(torch::kCPU, torch::kFloat32));
    }
    if ((i + 1) % 16 == 0) spdlog::info("prune-fit: statistics {}/{}", i + 1, samples);
  }
  return stats;
}

int64_t kept_count(const torch::Tensor& score, double tau, double floor, double cap) {
  const auto n = static_cast<double>(score.numel());
  const auto above = static_cast<double>((score >= tau).sum().item<int64_t>());
  const double low = std::ceil(n * floor - 1e-9), high = std::floor(n * cap + 1e-9);
  return static_cast<int64_t>(std::max(low, std::min(above, high)));
}

double mean_keep(const LayerStats& st, double tau, double floor, double cap) {
  double sum = 0.0;
  for (const auto& s : st.score)
    sum += static_cast<double>(kept_count(s, tau, floor, cap)) / static_cast<double>(std::max<int64_t>(1, s.numel()));
  return st.score.empty() ? 1.0 : sum / static_cast<double>(st.score.size());
}

// Smallest threshold whose mean kept fraction is <= target (mean_keep falls as tau grows).
double fit_threshold(const LayerStats& st, double target, double floor, double cap) {
  double lo = 0.0, hi = 0.0;
  for (const auto& s : st.score) hi = std::max(hi, s.max().item<double>());
  hi += 1.0;
  for (int it = 0; it < 60; ++it) {
    const double mid = 0.5 * (lo + hi);
    (mean_keep(st, mid, floor, cap) > target ? lo : hi) = mid;
  }
  return hi;
}

// Mean share of the task sensitivity carried by the tokens the rule keeps.
double sensitivity_recall(const LayerStats& st, double tau, double floor, double cap) {
  double sum = 0.0;
  for (size_t i = 0; i < st.score.size(); ++i) {
    const auto& s = st.score[i];
    const int64_t k = kept_count(s, tau, floor, cap);
    const auto order = std::get<1>(torch::sort(s, /*stable=*/true, 0, /*descending=*/true));
    const auto kept = st.sensitivity[i].index_select(0, order.slice(0, 0, k));
    sum += kept.sum().item<double>() / std::max(1e-30, st.sensitivity[i].sum().item<double>());
  }
  return st.score.empty() ? 1.0 : sum / static_cast<double>(st.score.size());
}

struct Candidate {
  int64_t layer = 0;
  double keep = 1.0;  // target kept fraction after the cut
  double threshold = 0.0;
  double floor = 0.3;
  double calib_keep = 1.0;  // achieved mean kept fraction on calib
  double recall = 1.0;
};

Candidate choose(const std::vector<LayerStats>& stats, double keep, const model::KeepPolicy& policy, double cap,
                 json* per_layer) {
  std::vector<Candidate> all;
  for (const auto& st : stats) {
    Candidate c;
    c.layer = st.layer;
    c.keep = keep;
    c.floor = std::min(policy.floor, keep);  // a budget below the floor lowers the floor to it
    c.threshold = fit_threshold(st, keep, c.floor, cap);
    c.calib_keep = mean_keep(st, c.threshold, c.floor, cap);
    c.recall = sensitivity_recall(st, c.threshold, c.floor, cap);
    all.push_back(c);
    if (per_layer != nullptr) {
      per_layer->push_back({{"after_layer", c.layer}, {"threshold", c.threshold}, {"keep_ratio", c.calib_keep},
                            {"sensitivity_recall", c.recall}, {"floor", c.floor}});
    }
  }
  VLMOPT_CHECK(!all.empty(), "no candidate layers");
  double best = 0.0;
  for (const auto& c : all) best = std::max(best, c.recall);
  for (const auto& c : all)
    if (c.recall >= best - 0.02) return c;  // the earliest layer close to the best
  return all.front();
}

double calib_accuracy(eval::VlmSession& session, const datasets::DatasetSource& source, int64_t samples,
                      int64_t batch_size) {
  int64_t correct = 0;
  for (int64_t begin = 0; begin < samples; begin += batch_size) {
    std::vector<datasets::Sample> batch;
    for (int64_t i = begin; i < std::min(samples, begin + batch_size); ++i) batch.push_back(source.get(static_cast<size_t>(i)));
    const auto answers = session.answer(batch);
    for (size_t k = 0; k < batch.size(); ++k) correct += answers[k] == eval::normalize_answer(batch[k].answer);
  }
  return static_cast<double>(correct) / static_cast<double>(samples);
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index() < 0 ? -1 : device.index());
}

// Ms per batch of `run_batch` over `batches`: one warm-up pass, then the median over `repeats`
// timed passes of each pass's mean (the median resists other processes on a shared machine).
template <typename RunBatch>
double median_pass_ms(const torch::Device& device, const std::vector<eval::PreparedBatch>& batches, int repeats,
                      RunBatch&& run_batch) {
  torch::NoGradGuard no_grad;
  for (const auto& b : batches) run_batch(b);
  synchronize(device);
  std::vector<double> pass_ms;
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    for (const auto& b : batches) run_batch(b);
    synchronize(device);
    pass_ms.push_back(1000.0 * std::chrono::duration<double>(Clock::now() - start).count() /
                      static_cast<double>(batches.size()));
  }
  std::sort(pass_ms.begin(), pass_ms.end());
  const size_t n = pass_ms.size();
  return n % 2 == 1 ? pass_ms[n / 2] : 0.5 * (pass_ms[n / 2 - 1] + pass_ms[n / 2]);
}

// Prefill ms per batch (median_pass_ms) and the mean visual tokens kept over the timed passes.
std::pair<double, double> time_prefill(eval::VlmSession& session, const std::vector<eval::PreparedBatch>& batches,
                                       int repeats) {
  auto& m = session.model();
  double kept = 0.0;
  int64_t runs = 0;
  const double ms = median_pass_ms(m.device(), batches, repeats, [&](const eval::PreparedBatch& b) {
    model::KVCache cache(m.language_model()->num_layers());
    model::ForwardInputs in;
    in.input_ids = b.input_ids;
    in.attention_mask = b.attention_mask;
    in.pixel_values = b.pixel_values;
    in.cache = &cache;
    in.logits_to_keep = 1;
    m.forward(in);
    const auto& report = m.last_prune_report();
    kept += report.empty() ? static_cast<double>(m.config().image_tokens_per_image()) : report.mean_visual_tokens();
    ++runs;  // warm-up included: every pass runs the same plan on the same batches
  });
  return {ms, kept / static_cast<double>(runs)};
}

// Vision tower + projector alone (the part of a prefill no visual-token pruning can shorten).
double time_image_features(eval::VlmSession& session, const std::vector<eval::PreparedBatch>& batches, int repeats) {
  auto& m = session.model();
  return median_pass_ms(m.device(), batches, repeats,
                        [&](const eval::PreparedBatch& b) { m.image_features(b.pixel_values); });
}

std::vector<eval::PreparedBatch> prepare_batches(eval::VlmSession& session, const datasets::DatasetSource& source,
                                                 int64_t samples, int64_t batch_size) {
  std::vector<eval::PreparedBatch> out;
  for (int64_t begin = 0; begin < samples; begin += batch_size) {
    std::vector<datasets::Sample> batch;
    for (int64_t i = begin; i < std::min(samples, begin + batch_size); ++i) batch.push_back(source.get(static_cast<size_t>(i)));
    out.push_back(session.prepare(batch));
  }
  return out;
}

model::PrunePlan plan_of(const Candidate& c, const model::KeepPolicy& policy, double cap, model::PruneCut cut) {
  model::PrunePlan plan;
  plan.rule = model::PruneRule::kDual;
  plan.min_keep = c.floor;
  plan.max_keep = std::max(c.floor, cap);
  plan.batch_keep = policy.batch_keep;  // latency search measures the plan as it will run
  plan.steps.push_back({c.layer, c.threshold, 1.0, cut});
  return plan;
}

}  // namespace

nlohmann::json fit(const PruneFitOptions& options) {
  const int modes = options.target_keep.has_value() + options.max_accuracy_drop.has_value() +
                    options.latency_budget_ms.has_value();
  VLMOPT_CHECK_INPUT(modes == 1, "prune-fit: expected exactly one of --target-keep, --max-accuracy-drop, "
                                 "--latency-budget-ms, got {}", modes);
  VLMOPT_CHECK_INPUT(!options.bundle.empty() || !options.out.empty(), "prune-fit: expected --bundle or --out");
  if (options.target_keep)
    VLMOPT_CHECK_INPUT(*options.target_keep > 0.0 && *options.target_keep <= 1.0,
                       "--target-keep: expected a fraction in (0,1], got {}", *options.target_keep);
  VLMOPT_CHECK_INPUT(options.batch_size > 0, "--batch-size: expected > 0, got {}", options.batch_size);
  const auto start = Clock::now();
  auto session_options = options.session;
  session_options.bundle = options.bundle;
  session_options.prune = eval::PruneOptions{};
  session_options.prune.apply_bundle_plan = false;  // fit on the unpruned model
  session_options.straight_through = true;          // else fake-quant rounding zeroes the sensitivities
  auto session = eval::VlmSession::open(session_options);
  auto& m = session.model();
  const int64_t layers = m.language_model()->num_layers();
  VLMOPT_CHECK_INPUT(layers >= 2, "prune-fit: the decoder needs at least 2 layers, got {}", layers);
  // An output cut after the last layer would prune nothing that runs; an input cut may sit at any layer.
  const bool input_cut = options.cut == model::PruneCut::kInput;
  const int64_t layer_end = input_cut ? layers : layers - 1;
  std::vector<int64_t> candidates = options.candidate_layers;
  if (candidates.empty())
    for (int64_t l = 0; l < layer_end; ++l) candidates.push_back(l);
  std::sort(candidates.begin(), candidates.end());
  for (const int64_t l : candidates)
    VLMOPT_CHECK_INPUT(l >= 0 && l < layer_end, "--layers: expected layers in [0, {}) for the {} cut, got {}",
                       layer_end, model::prune_cut_name(options.cut), l);

  const auto source = datasets::open_dataset(options.data);
  const int64_t samples = sample_count(*source, options.limit);
  VLMOPT_CHECK_INPUT(samples > 0, "{}: dataset is empty", options.data);
  spdlog::info("prune-fit: statistics on {} samples of {}", samples, options.data);
  const auto stats = collect_statistics(session, *source, samples, candidates, options.cut);
  const double cap = options.policy.cap(options.hardware.mem_pressure, options.hardware.l2_miss_rate);
  const int64_t visual = m.config().image_tokens_per_image();

  json report = {{"data", options.data}, {"samples", samples}, {"scenario", options.scenario},
                 {"visual_tokens", visual}, {"decoder_layers", layers}, {"cap", cap},
                 {"cut", std::string(model::prune_cut_name(options.cut))}};
  Candidate chosen;
  json search = json::array();
  if (options.target_keep) {
    report["mode"] = "target_keep";
    report["target_keep"] = *options.target_keep;
    json per_layer = json::array();
    chosen = choose(stats, *options.target_keep, options.policy, cap, &per_layer);
    report["layers"] = per_layer;
  } else {
    const std::vector<double> grid{0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1};
    if (options.max_accuracy_drop) {
      report["mode"] = "max_accuracy_drop";
      report["max_accuracy_drop"] = *options.max_accuracy_drop;
      m.set_prune_plan(std::nullopt);
      const double base = calib_accuracy(session, *source, samples, options.batch_size);
      report["baseline_accuracy"] = base;
      chosen = choose(stats, 1.0, options.policy, cap, nullptr);
      for (const double keep : grid) {
        const auto c = choose(stats, keep, options.policy, cap, nullptr);
        m.set_prune_plan(plan_of(c, options.policy, cap, options.cut));
        const double acc = calib_accuracy(session, *source, samples, options.batch_size);
        search.push_back({{"keep", keep}, {"after_layer", c.layer}, {"threshold", c.threshold}, {"accuracy", acc},
                          {"accuracy_drop", base - acc}});
        spdlog::info("prune-fit: keep {:.2f} after layer {}: calib accuracy {:.4f} (unpruned {:.4f})", keep, c.layer,
                     acc, base);
        if (base - acc > *options.max_accuracy_drop) break;
        chosen = c;
      }
    } else {
      report["mode"] = "latency_budget_ms";
      report["latency_budget_ms"] = *options.latency_budget_ms;
      const auto batches = prepare_batches(session, *source, std::min<int64_t>(samples, 4 * options.batch_size),
                                           options.batch_size);
      m.set_prune_plan(std::nullopt);
      report["baseline_prefill_ms"] = time_prefill(session, batches, 3).first;
      bool met = false;
      for (const double keep : grid) {
        chosen = choose(stats, keep, options.policy, cap, nullptr);
        m.set_prune_plan(plan_of(chosen, options.policy, cap, options.cut));
        const double ms = time_prefill(session, batches, 3).first;
        search.push_back({{"keep", keep}, {"after_layer", chosen.layer}, {"prefill_ms", ms}});
        if (ms <= *options.latency_budget_ms) {
          met = true;
          break;
        }
      }
      report["budget_met"] = met;
      if (!met) spdlog::warn("prune-fit: no keep ratio meets {} ms; using the smallest", *options.latency_budget_ms);
    }
    report["search"] = search;
    json per_layer = json::array();
    chosen = choose(stats, chosen.keep, options.policy, cap, &per_layer);
    report["layers"] = per_layer;
  }
  m.set_prune_plan(std::nullopt);

  // Equivalent-token accounting: layers before the cut see every visual token, the rest the kept ones.
  const int64_t first_pruned = model::PruneStep{.after_layer = chosen.layer, .cut = options.cut}.first_pruned_layer();
  const double equivalent = (static_cast<double>(first_pruned) +
                             static_cast<double>(layers - first_pruned) * chosen.calib_keep) /
                            static_cast<double>(layers);
  report["chosen"] = {{"after_layer", chosen.layer}, {"cut", std::string(model::prune_cut_name(options.cut))},
                      {"threshold", chosen.threshold}, {"keep_ratio", chosen.calib_keep},
                      {"sensitivity_recall", chosen.recall}, {"floor", chosen.floor},
                      {"equivalent_keep", equivalent}};
  // Per decoder layer kept fraction of the visual tokens (calib mean).
  json per_layer_keep = json::array();
  for (int64_t l = 0; l < layers; ++l) per_layer_keep.push_back(l < first_pruned ? 1.0 : chosen.calib_keep);
  report["keep_per_layer"] = per_layer_keep;

  model::PruneConfig config;
  const auto existing = options.bundle.empty() ? options.out / "prune.json"
                                               : std::filesystem::path(options.bundle) / model::kPruneFile;
  if (std::filesystem::exists(existing)) {
    config = model::read_prune_config(existing);  // keep its other scenarios
    VLMOPT_CHECK_INPUT(config.rule == model::PruneRule::kDual, "{}: rule: expected vlmopt to add a scenario, got {}",
                       existing.string(), model::prune_rule_name(config.rule));
  }
  config.rule = model::PruneRule::kDual;
  config.policy = options.policy;
  config.policy.floor = std::min(config.policy.floor, chosen.floor);
  config.hardware = options.hardware;
  model::Scenario scenario;
  scenario.steps.push_back(model::PruneStep{chosen.layer, chosen.threshold, 1.0, options.cut});
  config.scenarios[options.scenario] = scenario;
  if (config.scenarios.count(config.default_scenario) == 0) config.default_scenario = options.scenario;
  config.fit[options.scenario] = {{"data", options.data}, {"samples", samples}, {"mode", report["mode"]},
                                  {"keep_ratio", chosen.calib_keep}, {"equivalent_keep", equivalent}};
  report["seconds"] = std::chrono::duration<double>(Clock::now() - start).count();
  report["prune_json"] = config.to_json();

  if (!options.bundle.empty()) {
    bundle::BundleUpdate update;
    update.step = "prune-fit";
    update.options = {{"data", options.data}, {"samples", samples}, {"scenario", options.scenario},
                      {"mode", report["mode"]}};
    update.apply = [&](const std::filesystem::path& root) {
      std::filesystem::create_directories(root / "vlmopt" / "reports");
      model::write_prune_config(root / model::kPruneFile, config);
      io::write_file_atomic(root / "vlmopt" / "reports" / "prune_fit.json", report.dump(2) + "\n");
    };
    bundle::update_bundle(options.bundle, update);
    report["written"] = (std::filesystem::path(options.bundle) / model::kPruneFile).string();
  } else {
    std::filesystem::create_directories(options.out);
    model::write_prune_config(options.out / "prune.json", config);
    io::write_file_atomic(options.out / "prune_fit_report.json", report.dump(2) + "\n");
    report["written"] = (options.out / "prune.json").string();
  }
  return report;
}

nlohmann::json bench_prefill(const PrefillBenchOptions& options) {
  VLMOPT_CHECK_INPUT(options.batch_size > 0 && options.samples > 0 && options.repeats > 0,
                     "bench prefill: expected positive --batch-size, --samples and --repeats");
  auto session = eval::VlmSession::open(options.session);
  const auto source = datasets::open_dataset(options.data);
  const int64_t samples = sample_count(*source, options.samples);
  const auto batches = prepare_batches(session, *source, samples, options.batch_size);
  const auto [ms, kept] = time_prefill(session, batches, options.repeats);
  const double vision_ms = time_image_features(session, batches, options.repeats);
  const double per_batch_samples = static_cast<double>(samples) / static_cast<double>(batches.size());
  return {{"prefill_ms_per_batch", ms},
          {"image_features_ms_per_batch", vision_ms},
          {"prefill_ms_per_sample", ms / per_batch_samples},
          {"batch_size", options.batch_size},
          {"samples", samples},
          {"repeats", options.repeats},
          {"visual_tokens", session.model().config().image_tokens_per_image()},
          {"visual_tokens_kept", kept},
          {"prune", session.prune_description()},
          {"device", options.session.device},
          {"dtype", options.session.dtype}};
}

}  // namespace vlmopt::prune
