// `vlmopt pipeline`: runs the optimization steps in order on one model and
// leaves one bundle: calibrate (MP-Cache + compressed-tensors checkpoint), then
// the FP32 and bundle evaluations, compensate (adapter folded into the projector)
// and its evaluation, prune-fit (prune.json in the bundle), the evaluation of the
// pruned bundle and diagnose-align of the bundle against the model; the reports
// are added to the bundle.
#pragma once

#include "model/prune_plan.hpp"
#include "quant/scheme.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace vlmopt::pipeline {

struct PipelineOptions {
  // --- model
  std::string model = "builtin";
  std::string device = "cpu";
  // --- calibration
  std::string calib_data = "builtin:calib";
  int64_t calib_samples = 128;
  quant::SchemeKind scheme = quant::SchemeKind::kW8A8;
  // --- evaluation
  std::string eval_data = "builtin:eval";
  int64_t eval_limit = 0;  // 0 = the whole split
  int64_t batch_size = 8;
  // --- compensation (adapter trained on the calibration data, folded into the projector)
  int64_t compensate_steps = 100;  // 0 = skip the step
  int64_t compensate_samples = 64;
  // --- visual-token pruning (prune-fit on the calibration data into the bundle)
  double prune_keep = 0.5;          // fraction of visual tokens kept after the cut; 0 = skip the step
  int64_t prune_calib_samples = 64;
  // Where prune-fit cuts. The default (before layer 0, scored by layer 0) shortens every
  // decoder layer: the operating point with the largest prefill gain at equal accuracy
  // on the builtin model (docs/BENCHMARKS.md). Empty layers: prune-fit's own default.
  model::PruneCut prune_cut = model::PruneCut::kInput;
  std::vector<int64_t> prune_layers{0};
  // --- alignment diagnosis of the final bundle against the model (reports/align/)
  int64_t align_samples = 16;  // 0 = skip the step
  // --- output
  std::filesystem::path out = "vlmopt-out";  // the bundle directory

  nlohmann::json to_json() const;
};

struct PipelineResult {
  std::filesystem::path out;
  // {"steps": [...], "fp32": {...}, "bundle": {...}, "bundle_compensated": {...} (when compensation ran),
  //  "bundle_pruned": {...} (when pruning ran), "size": {...}}
  nlohmann::json summary;
  std::string format() const;
};

PipelineResult run_pipeline(const PipelineOptions& options);

}  // namespace vlmopt::pipeline
