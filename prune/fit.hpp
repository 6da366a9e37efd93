// `vlmopt prune-fit` (design.md §7): learns where to prune and the per-layer
// score threshold of the dual criterion on a calibration split, and writes
// prune.json (into a bundle with bundle::update_bundle, or into --out).
//
// Statistics (one teacher-forced pass per calibration sample, batch 1):
//   - run-time score of every visual token at every candidate layer l: the dual
//     score p_j * exp(H(p)) of the attention the question rows give it (model::dual_scores);
//   - task sensitivity of dropping it at the cut: ||dNLL/dh||_1 / ||h||_1 at the input
//     of layer l+1 (output cut) or of layer l (input cut), NLL = the answer tokens'
//     (and </s>) negative log-likelihood.
// Fit: for each candidate layer the threshold that keeps the target fraction on
// average (floor/cap applied per sample), and the share of the task sensitivity that
// survives ("sensitivity recall"); the earliest layer within 0.02 of the best recall
// wins (earlier = cheaper). Modes: --target-keep r; --max-accuracy-drop d (largest
// drop of tokens whose calib accuracy stays within d of unpruned); --latency-budget-ms
// X (the most tokens kept whose measured prefill latency is <= X).
#pragma once

#include "eval/session.hpp"
#include "model/prune_config.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace vlmopt::prune {

struct PruneFitOptions {
  eval::SessionOptions session;       // model, device, dtype (bundle set from `bundle`)
  std::string bundle;                 // fit on this bundle and write vlmopt/prune.json into it
  std::filesystem::path out;          // without a bundle: <out>/prune.json + <out>/prune_fit_report.json
  std::string data = "builtin:calib";
  int64_t limit = 128;                // calibration samples (0 = all)
  int64_t batch_size = 8;             // accuracy / latency passes
  std::optional<double> target_keep;        // fraction of visual tokens kept after the cut
  std::optional<double> max_accuracy_drop;  // absolute (0.01 = 1 point)
  std::optional<double> latency_budget_ms;  // prefill ms per batch of batch_size
  std::string scenario = "general";
  // output: drop after the scoring layer; input: the scoring layer already sees only the kept tokens.
  model::PruneCut cut = model::PruneCut::kOutput;
  std::vector<int64_t> candidate_layers;  // empty: 0 .. layers-2 (output cut), 0 .. layers-1 (input cut)
  model::KeepPolicy policy;
  model::HardwareState hardware;
};

// Returns the report (also written next to prune.json).
nlohmann::json fit(const PruneFitOptions& options);

struct PrefillBenchOptions {
  eval::SessionOptions session;  // prune options select the plan
  std::string data = "builtin:eval";
  int64_t samples = 64;
  int64_t batch_size = 1;
  int repeats = 5;  // timed passes over the samples (after one warm-up pass); the median counts
};

// Prefill latency (the forward that fills the KV cache, as generate does) per batch
// (median over the timed passes) and per sample, and the visual tokens kept. {prefill_ms_per_batch, ...}.
nlohmann::json bench_prefill(const PrefillBenchOptions& options);

}  // namespace vlmopt::prune
