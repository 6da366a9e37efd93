// Fused single-pass CPU statistics of activation rows, for the calibration
// collector: instead of splitting a tapped [N, C] activation into per-modality
// copies and running a dozen torch reductions over each, one parallel pass over
// memory yields, per row class (image / text), everything the collector needs:
// per-channel min / max, the row count and the FP16 safety figures.
//
// Exactness (what the tests check against the torch reference ops):
//   - min / max per channel equal torch::aminmax(rows_of_class, 0) bit for bit,
//     including NaN (a NaN in a channel makes that channel's min and max NaN) and
//     ties between +0 and -0 (the value of the first such row is kept, as torch does);
//   - the FP16 figures equal Fp16Counter::observe(rows_of_class): integer counts,
//     max |x| = max over channels of max(|min|, |max|) (NaN propagates as in
//     torch's amax), min nonzero |x| (NaN ignored, as torch's where + amin does).
#pragma once

#include "calib/fp16_safety.hpp"

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace vlmopt::calib {

// Row classes (values of the row_class tensor).
inline constexpr uint8_t kSkipRow = 0;
inline constexpr uint8_t kImageRow = 1;
inline constexpr uint8_t kTextRow = 2;

struct ClassRowStats {
  int64_t rows = 0;
  torch::Tensor min, max;  // float32 [C] per channel, CPU; undefined when rows == 0
  Fp16Safety fp16;         // as Fp16Counter would count these rows
};

// True when row_stats() handles `rows` itself: a CPU [N, C] tensor of float32,
// bfloat16 or half (the latter two converted to float32 row by row, exactly).
bool row_stats_supported(const torch::Tensor& rows);

// One pass over rows [N, C]. row_class: uint8 [N] (CPU) with values in
// 0..num_classes, 0 = skip; undefined = every row is class 1. Returns
// num_classes entries, entry k-1 for class k. Requires row_stats_supported(rows).
std::vector<ClassRowStats> row_stats(const torch::Tensor& rows, const torch::Tensor& row_class, int num_classes);

// Adds to `counts` (int64 [bins], CPU, contiguous) the histogram of |x| over the
// rows of class `row_class_value` (all rows when row_class is undefined): bin
// floor(|x| * 2^-width_exponent), computed in float32 exactly as
// torch::floor(x.abs() * 2^-width_exponent) does. Every |x| must be finite and
// fall below bins * 2^width_exponent, bins <= 2^24 and width_exponent in
// -126..126 (VLMOPT_CHECK otherwise; counts is then unchanged). Requires
// row_stats_supported(rows).
void add_abs_histogram(const torch::Tensor& rows, const torch::Tensor& row_class, uint8_t row_class_value,
                       int width_exponent, torch::Tensor& counts);

}  // namespace vlmopt::calib
