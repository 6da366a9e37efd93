// `vlmopt pipeline`: runs the optimization steps in order on one model and
// leaves one bundle: calibrate (MP-Cache + compressed-tensors checkpoint), then
// the FP32 and bundle evaluations, whose reports are added to the bundle.
// Later steps (compensate, prune-fit, diagnose-align) join here.
#pragma once

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
  // --- output
  std::filesystem::path out = "vlmopt-out";  // the bundle directory

  nlohmann::json to_json() const;
};

struct PipelineResult {
  std::filesystem::path out;
  nlohmann::json summary;  // {"steps": [...], "fp32": {...}, "bundle": {...}, "size": {...}}
  std::string format() const;
};

PipelineResult run_pipeline(const PipelineOptions& options);

}  // namespace vlmopt::pipeline
