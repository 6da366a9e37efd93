// Calibration observers: running statistics of a weight or of a Linear's input
// activations, turned into quantization parameters (reference.md §3, design.md §4).
//
// Layout of the statistics (and of min_vals / max_vals / amax / qparams):
//   strategy tensor            any x            -> [1]
//   strategy channel, weight   x [out, in]      -> [out, 1]   (one row per output channel)
//   strategy channel, activ.   x [..., in]      -> [in]       (one value per last-dim channel)
//   strategy group,   weight   x [out, in]      -> [out, in / group_size]
//
// Kinds:
//   minmax          running min / max over everything observed (torch.ao
//                   MinMaxObserver, llm-compressor static_minmax).
//   moving-average  torch.ao MovingAverageMinMaxObserver: the first batch sets
//                   min/max, later ones do min += c * (batch_min - min).
//   mse             llm-compressor's MSE search, per observe(): shrink the batch
//                   range by p = 1 - i / grid for i < max_shrink * grid, keep the
//                   p with the least sum |fake_quant(x) - x|^norm per qparam
//                   entry, stop after `patience` steps with no entry improving.
//                   Batches are combined like llm-compressor's "mse" observer:
//                   min = min * (1 - c) + best_min * c (first batch sets it).
//   percentile      (strategy tensor) amax at the `percentile`-th percentile of |x|,
//                   read from the histogram below: the upper edge of the bin where
//                   the cumulative count first reaches percentile/100 * count, capped
//                   at max|x|. So it is >= the exact percentile and exceeds it by
//                   less than one bin width.
//   entropy         (strategy tensor) TensorRT's KL-divergence calibration on the
//                   histogram below: bins[0] = bins[1]; for every candidate i from
//                   128 (or fewer bins if the histogram has fewer) to the bin count,
//                   P = bins[:i] with the rest added to P[i-1], Q = bins[:i] merged
//                   into 2^(num_bits-1) levels (level of bin j = floor(j * levels / i))
//                   and spread evenly over each level's non-empty bins; the last
//                   candidate with the least KL(P || Q) wins; amax = i * bin_width,
//                   capped at max|x|.
//
// Histogram of |x| (percentile, entropy). Bin k counts |x| in [k*w, (k+1)*w).
// The bin width w is a power of two, 2^e: the first non-zero batch picks the
// smallest e with max|x| < histogram_bins * 2^e, giving floor(max|x| / w) + 1
// bins, between histogram_bins/2 + 1 and histogram_bins. Because w is a power of
// two, |x| / w is exact in float32, so a bin index never depends on the device
// or on rounding, and any histogram coarsens exactly to 2w by adding adjacent
// pairs. Hence:
//   - a larger max adds bins of the same width (count = floor(max / w) + 1);
//     past 8 * histogram_bins bins the width doubles (pairs added) until it fits,
//     which bounds memory and the O(bins^2) KL search;
//   - merge() coarsens the finer of two histograms to the wider width and adds
//     counts: the result equals, bin for bin, the histogram of all the data at
//     that width.
// The published algorithm uses exactly histogram_bins bins over [0, max]; ours
// spans [0, bins * w) with max in the last bin, at most twice as wide per bin.
//
// Cost: observe() queues only device work for minmax and moving-average (one
// aminmax, a few element-wise ops on the statistics; no host synchronisation).
// Histogram kinds read max|x| back once per observe() to size the histogram
// (torch::bincount adds two more read-backs on CUDA; on the CPU, float rows are
// binned in one pass by calib/row_stats, with the same counts); mse synchronises
// once per search step.
#pragma once

#include "quant/scheme.hpp"

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

namespace vlmopt::calib {

enum class ObserverKind { kMinMax, kMovingAverage, kPercentile, kMse, kEntropy };

// "minmax" | "moving-average" | "percentile" | "mse" | "entropy"; InputError otherwise.
ObserverKind parse_observer_kind(std::string_view text);
std::string_view to_string(ObserverKind kind);

// What observe() receives: selects the channel layout (see the table above).
enum class ObserverTarget { kWeight, kActivation };

struct ObserverOptions {
  ObserverKind kind = ObserverKind::kMinMax;
  quant::QuantArgs args;  // strategy, bits, symmetry of the quantization being calibrated
  quant::Convention convention = quant::Convention::kCompressedTensors;
  ObserverTarget target = ObserverTarget::kActivation;
  double averaging_constant = 0.01;  // moving-average / mse: weight of each new batch (0, 1]
  double percentile = 99.99;         // percentile: in percent, (0, 100]
  int64_t histogram_bins = 2048;     // percentile / entropy: most bins at the first batch's range (>= 256)
  int64_t mse_grid = 100;            // mse: shrink step is 1 / mse_grid of the range
  double mse_max_shrink = 0.2;       // mse: largest shrink tried, as a fraction of the range
  double mse_norm = 2.4;             // mse: error exponent, sum |fq(x) - x|^norm
  int64_t mse_patience = 5;          // mse: stop after this many steps without improvement
};

// A batch of activations handed over as a selection of rows of a larger tensor,
// with its per-channel min / max already computed (calib/row_stats): how the
// collector feeds each modality's rows without copying them out.
struct ActivationBatch {
  torch::Tensor rows;               // [N, C]: the tapped activations (any float dtype and device)
  torch::Tensor row_class;          // uint8 [N] on the CPU, or undefined: every row belongs to the batch
  uint8_t row_class_value = 1;      // the batch = the rows whose row_class equals this
  int64_t count = 0;                // rows in the batch
  torch::Tensor channel_min, channel_max;  // float32 [C]: per-channel min / max over the batch's rows

  // The batch's rows copied out, [count, C] (rows itself when row_class is undefined).
  torch::Tensor values() const;
};

// Counts of |x| per bin; bin k covers [k * 2^width_exponent, (k+1) * 2^width_exponent).
struct Histogram {
  torch::Tensor counts;    // int64 [bins], on the observer's device
  int width_exponent = 0;  // bin width = 2^width_exponent
  double bin_width() const;
};

class Observer {
 public:
  virtual ~Observer() = default;
  Observer(const Observer&) = delete;
  Observer& operator=(const Observer&) = delete;

  // Adds one tensor (weight [out,in], or activations [..., in]) to the
  // statistics. Empty tensors are ignored. Statistics live on x's device.
  void observe(const torch::Tensor& x);
  // The same state as observe(batch.values()), for target activation, reading
  // only what each kind needs: minmax and moving-average use the batch's
  // channel_min / channel_max alone (no pass over the rows); percentile and
  // entropy take the range from there and bin the selected rows in place (CPU
  // float32 / bfloat16 / half rows; else on a copy); mse copies the rows out.
  // count == 0 is ignored.
  void observe(const ActivationBatch& batch);

  // Scale / zero point from the selected range; requires count() > 0.
  quant::QParams qparams() const;
  // The range the scale is computed from (after percentile / MSE / KL selection), float32.
  torch::Tensor min_vals() const;
  torch::Tensor max_vals() const;
  torch::Tensor amax() const;  // max(|min_vals|, |max_vals|)
  int64_t count() const { return count_; }  // elements observed
  const ObserverOptions& options() const { return options_; }
  // The |x| histogram (percentile / entropy), nullopt for other kinds or before any data.
  virtual std::optional<Histogram> histogram() const { return std::nullopt; }

  // Folds in another observer's statistics (same options, else VLMOPT_CHECK),
  // as if this observer had also seen the other's data: minmax takes the
  // min / max; histograms add (see above); moving-average and mse, whose
  // statistics are averages, take the count-weighted mean of the two.
  void merge(const Observer& other);

 protected:
  explicit Observer(ObserverOptions options);
  // One non-empty batch to add, shape already checked against options().
  struct Batch {
    torch::Tensor min, max;                   // the batch's min / max in the layout above, float32
    int64_t elements = 0;                     // values in the batch
    const torch::Tensor* x = nullptr;         // the values (own float dtype, detached), or
    const ActivationBatch* rows = nullptr;    // the rows that hold them
    torch::Tensor values() const;             // *x, or the selected rows copied out
  };
  virtual void update(const Batch& batch) = 0;
  virtual void merge_from(const Observer& other) = 0;
  virtual std::pair<torch::Tensor, torch::Tensor> selected_range() const = 0;

  // Per-entry min / max of x in the layout of the table above, returned as float32.
  std::pair<torch::Tensor, torch::Tensor> reduce_minmax(const torch::Tensor& x) const;
  // Per-entry sum of `values` (shaped like an observed x) in that layout.
  torch::Tensor reduce_sum(const torch::Tensor& values) const;

  ObserverOptions options_;
  int64_t count_ = 0;

 private:
  void check_shape(const torch::Tensor& x);
  void check_layout(const std::vector<int64_t>& layout, c10::IntArrayRef shape);
  std::vector<int64_t> seen_shape_;  // the layout-defining dims of the first observed x
};

std::unique_ptr<Observer> make_observer(const ObserverOptions& options);

}  // namespace vlmopt::calib
