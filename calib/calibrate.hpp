// `vlmopt calibrate`: calibration data -> model taps -> observers on every
// quantized Linear's input (per modality) and weight -> a QuantPlan, FP16
// safety and outlier analysis, written as an MP-Cache file, a compressed-tensors
// bundle and reports/calibration.json (design.md §4).
#pragma once

#include "calib/collector.hpp"
#include "calib/observers.hpp"
#include "quant/scheme.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace vlmopt::calib {

// Canonical names left unquantized by default: vision tower, projector, lm_head
// (the usual practice for VLMs, reference.md §2).
std::vector<std::string> default_ignore();

struct CalibrateOptions {
  // --- model and data
  std::string model = "builtin";        // HF model directory or "builtin"
  std::string data = "builtin:calib";   // dataset spec (datasets::open_dataset)
  int64_t samples = 128;                // the first N samples; 0 = all
  int64_t batch_size = 8;
  std::string device = "cpu";
  // --- quantization
  quant::SchemeKind scheme = quant::SchemeKind::kW8A8;
  ObserverKind observer = ObserverKind::kMinMax;  // for input activations; weights use min-max
  quant::Convention convention = quant::Convention::kCompressedTensors;
  // Exact canonical names, "Linear" (every Linear) or "re:<regex>" matched from the start of the name.
  std::vector<std::string> ignore = default_ignore();
  std::optional<double> smoothquant_alpha;  // migrate activation ranges into weights (0 < alpha < 1)
  double outlier_threshold = 6.0;           // input channels with |x| above this stay FP16; <= 0 disables
  double percentile = 99.99;                // for the percentile observer
  // --- execution
  bool layerwise = false;  // all samples through decoder layer l before l+1; weights loaded per layer
  // --- output
  std::filesystem::path out;                 // bundle directory (replaced atomically)
  uint64_t max_shard_bytes = 2ull << 30;

  nlohmann::json to_json() const;  // echoed at start-up and recorded in the manifest
};

// What one calibration run decided and measured (before anything is written).
struct CalibrationRun {
  quant::QuantPlan plan;
  nlohmann::json report;     // reports/calibration.json
  std::string dataset_hash;  // sha256 over the samples used (ids, questions, answers, pixels)
  int64_t samples = 0;
  double collect_seconds = 0.0;  // forward passes with observers
  double total_seconds = 0.0;
  double peak_rss_mib = 0.0;
};

// True when `ignore` leaves `linear` unquantized (exact name, "Linear", or "re:" prefix-anchored regex).
bool is_ignored(const std::string& linear, const std::vector<std::string>& ignore);

// Runs the data through the model and computes the plan; writes nothing.
CalibrationRun run_calibration(const CalibrateOptions& options);

// The floor calibration is measured against: the same data, batching and pass
// (whole-model or --layerwise) with nothing subscribed to the taps. Returns
// {seconds, samples_per_second, peak_rss_mib, ...}.
nlohmann::json time_bare_pass(const CalibrateOptions& options);

// run_calibration + MP-Cache + bundle export + report. Returns a summary (also the --json output).
nlohmann::json calibrate(const CalibrateOptions& options);

}  // namespace vlmopt::calib
