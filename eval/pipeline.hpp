// `vlmopt pipeline`: runs the optimization steps that exist, in order, on one
// model and writes their reports under <out>/vlmopt/reports/. Today: the FP32
// evaluation that every later step (calibrate, compensate, prune-fit,
// diagnose-align) is measured against.
#pragma once

#include "eval/evaluate.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

namespace vlmopt::eval {

struct PipelineOptions {
  SessionOptions session;
  std::filesystem::path out = "vlmopt-out";
  std::string eval_data = "builtin:eval";
  int64_t eval_limit = 0;  // 0 = the whole split
  int64_t batch_size = 8;
};

struct PipelineResult {
  std::filesystem::path out;
  std::vector<std::filesystem::path> reports;
  nlohmann::json summary;  // {"steps": [{"step", "report", ...figures}]}
  std::string format() const;
};

PipelineResult run_pipeline(const PipelineOptions& options);

}  // namespace vlmopt::eval
