// FP16 safety of activations: how many values would overflow (> 65504), fall
// into the subnormal range (< 2^-14) or flush to zero (< 2^-24) if the tensor
// were stored in IEEE half precision, and what to do about it.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace vlmopt::calib {

inline constexpr double kFp16Max = 65504.0;
inline constexpr double kFp16MinNormal = 6.103515625e-05;       // 2^-14
inline constexpr double kFp16MinSubnormal = 5.9604644775390625e-08;  // 2^-24

struct Fp16Safety {
  int64_t elements = 0;   // values seen (zeros included)
  int64_t overflow = 0;   // |x| > 65504
  int64_t subnormal = 0;  // 0 < |x| < 2^-14 (representable only with reduced precision)
  int64_t underflow = 0;  // 0 < |x| < 2^-24 (flushed to zero)
  double max_abs = 0.0;
  double min_abs_nonzero = 0.0;  // 0 when every value was zero

  double overflow_fraction() const;
  double subnormal_fraction() const;
  double underflow_fraction() const;
  // "fp16 fine" | "rescale by 2^k" (k < 0 shrinks: the range fits once shifted) |
  // "keep bf16 or fp32" (the range is wider than fp16's).
  std::string recommendation() const;
  // Power-of-two exponent k that moves max_abs below 65504 (k < 0) or lifts the
  // smallest values out of the flush-to-zero range (k > 0); 0 when no shift helps or is needed.
  int rescale_exponent() const;
  void merge(const Fp16Safety& other);
  nlohmann::json to_json() const;
};

// Accumulates Fp16Safety over batches without synchronising the device per batch:
// counts live in device tensors until result() is called.
class Fp16Counter {
 public:
  void observe(const torch::Tensor& x);  // any shape, floating
  // Adds a batch whose figures were computed elsewhere (calib/row_stats: the
  // collector's fused CPU pass), with the same result as observe() of that batch:
  // counts add, max |x| is maxed with NaN propagating as in torch::maximum.
  void add(const Fp16Safety& batch);
  Fp16Safety result() const;

 private:
  torch::Tensor counts_;   // int64 [4]: elements, overflow, subnormal, underflow
  torch::Tensor extrema_;  // float64 [2]: max |x|, -min nonzero |x| (both maxed)
  Fp16Safety added_;       // the sum of add() batches
};

}  // namespace vlmopt::calib
