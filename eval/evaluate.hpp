// `vlmopt eval`: greedy answers on a dataset, exact-match accuracy overall and
// per question type with 95 % Wilson intervals, visual tokens and latency.
#pragma once

#include "eval/session.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

namespace vlmopt::eval {

struct EvalOptions {
  SessionOptions session;
  std::string bundle;                 // optimized bundle to run instead of the plain model
  std::string kernels = "fake";       // bundle kernels: "fake" (fake-quant) | "int8" (int8 GEMM)
  bool use_mp_cache = true;           // false (--no-mp-cache): no FP16 outlier path, as compressed-tensors
  std::string data = "builtin:eval";  // dataset spec (see datasets::open_dataset)
  int64_t limit = 0;                  // first N samples; 0 = all
  int64_t batch_size = 8;
  std::optional<std::filesystem::path> predictions;  // JSONL: one line per sample (id, question, answer, prediction)
};

struct Proportion {
  int64_t correct = 0;
  int64_t n = 0;
  double accuracy() const { return n == 0 ? 0.0 : static_cast<double>(correct) / static_cast<double>(n); }
  // 95 % Wilson score interval (stays inside [0,1] and is sane for small n).
  std::pair<double, double> wilson95() const;
};

struct EvalResult {
  std::string model_dir;
  std::string data;
  Proportion overall;
  std::map<std::string, Proportion> by_type;
  int64_t visual_tokens = 0;       // image tokens per image the decoder sees
  double visual_tokens_per_sample = 0.0;  // mean over samples: per image x images (frames) per sample
  // Equivalent-token accounting: visual tokens per sample averaged over the decoder
  // layers (= visual_tokens without pruning).
  double visual_tokens_kept = 0.0;
  std::string prune = "none";      // the pruning plan applied (VlmSession::prune_description)
  double latency_ms = 0.0;         // mean wall time per sample (batched), preprocessing included
  double seconds = 0.0;
  int64_t batch_size = 0;
  nlohmann::json to_json() const;  // {accuracy, ci95, n, correct, by_type, visual_tokens, visual_tokens_per_sample, visual_tokens_kept, prune, latency_ms, ...}
  std::string format() const;      // human-readable table
};

EvalResult evaluate(const EvalOptions& options);

}  // namespace vlmopt::eval
