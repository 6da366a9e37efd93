// Calibration observers (see observers.hpp for the algorithms and layouts).
#include "calib/observers.hpp"

#include "calib/row_stats.hpp"
#include "quant/qparams.hpp"
#include "util/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace vlmopt::calib {
namespace {

using quant::Strategy;

constexpr ObserverKind kAllKinds[] = {ObserverKind::kMinMax, ObserverKind::kMovingAverage, ObserverKind::kPercentile,
                                      ObserverKind::kMse, ObserverKind::kEntropy};
// KL candidates start at this bin (TensorRT's start_bin).
constexpr int64_t kEntropyStartBin = 128;
// Histograms coarsen (double the bin width) beyond this many times histogram_bins.
constexpr int64_t kMaxGrowth = 8;

std::string shape_str(c10::IntArrayRef shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

bool same_args(const quant::QuantArgs& a, const quant::QuantArgs& b) {
  return a.num_bits == b.num_bits && a.type == b.type && a.symmetric == b.symmetric && a.strategy == b.strategy &&
         a.group_size == b.group_size && a.dynamic == b.dynamic;
}

bool same_options(const ObserverOptions& a, const ObserverOptions& b) {
  return a.kind == b.kind && same_args(a.args, b.args) && a.convention == b.convention && a.target == b.target &&
         a.averaging_constant == b.averaging_constant && a.percentile == b.percentile &&
         a.histogram_bins == b.histogram_bins && a.mse_grid == b.mse_grid && a.mse_max_shrink == b.mse_max_shrink &&
         a.mse_norm == b.mse_norm && a.mse_patience == b.mse_patience;
}

void validate(const ObserverOptions& o) {
  const std::string_view kind = to_string(o.kind);
  const bool histogram_kind = o.kind == ObserverKind::kPercentile || o.kind == ObserverKind::kEntropy;
  VLMOPT_CHECK_INPUT(!histogram_kind || o.args.strategy == Strategy::kTensor,
                     "observer {}: strategy: expected tensor (histogram observers are per tensor), got {}", kind,
                     o.args.strategy == Strategy::kChannel ? "channel" : "group");
  VLMOPT_CHECK_INPUT(o.args.strategy != Strategy::kGroup || o.target == ObserverTarget::kWeight,
                     "observer {}: strategy group applies to weights only", kind);
  VLMOPT_CHECK_INPUT(o.args.strategy != Strategy::kGroup || o.args.group_size > 0,
                     "observer {}: group_size: expected > 0 for strategy group, got {}", kind, o.args.group_size);
  VLMOPT_CHECK_INPUT(o.averaging_constant > 0.0 && o.averaging_constant <= 1.0,
                     "observer {}: averaging_constant: expected (0, 1], got {}", kind, o.averaging_constant);
  VLMOPT_CHECK_INPUT(o.percentile > 0.0 && o.percentile <= 100.0, "observer {}: percentile: expected (0, 100], got {}",
                     kind, o.percentile);
  VLMOPT_CHECK_INPUT(o.histogram_bins >= 256 && o.histogram_bins <= (int64_t{1} << 24),
                     "observer {}: histogram_bins: expected 256..2^24, got {}", kind, o.histogram_bins);
  VLMOPT_CHECK_INPUT(o.mse_grid > 0, "observer {}: mse_grid: expected > 0, got {}", kind, o.mse_grid);
  VLMOPT_CHECK_INPUT(o.mse_max_shrink > 0.0 && o.mse_max_shrink < 1.0,
                     "observer {}: mse_max_shrink: expected (0, 1), got {}", kind, o.mse_max_shrink);
  VLMOPT_CHECK_INPUT(o.mse_norm > 0.0, "observer {}: mse_norm: expected > 0, got {}", kind, o.mse_norm);
  VLMOPT_CHECK_INPUT(o.mse_patience > 0, "observer {}: mse_patience: expected > 0, got {}", kind, o.mse_patience);
}

// a + (b - a) * weight_b: the count-weighted mean used to merge averaged statistics.
torch::Tensor weighted_mean(const torch::Tensor& a, int64_t count_a, const torch::Tensor& b, int64_t count_b) {
  const double weight_b = static_cast<double>(count_b) / static_cast<double>(count_a + count_b);
  return a + (b.to(a.device()) - a) * weight_b;
}

// ---------------------------------------------------------------------------- min-max

class MinMaxObserver final : public Observer {
 public:
  explicit MinMaxObserver(const ObserverOptions& options) : Observer(options) {}

 private:
  void update(const Batch& batch) override {
    const auto& mn = batch.min;
    const auto& mx = batch.max;
    if (!min_.defined()) {
      min_ = mn;
      max_ = mx;
    } else {
      // Argument order as torch.ao: torch.min(min_val_cur, self.min_val).
      min_ = torch::min(mn, min_);
      max_ = torch::max(mx, max_);
    }
  }
  void merge_from(const Observer& other_base) override {
    const auto& other = static_cast<const MinMaxObserver&>(other_base);
    if (!other.min_.defined()) return;
    if (!min_.defined()) {
      min_ = other.min_.clone();
      max_ = other.max_.clone();
      return;
    }
    min_ = torch::min(min_, other.min_.to(min_.device()));
    max_ = torch::max(max_, other.max_.to(max_.device()));
  }
  std::pair<torch::Tensor, torch::Tensor> selected_range() const override { return {min_, max_}; }

  torch::Tensor min_;
  torch::Tensor max_;
};

// ---------------------------------------------------------------------------- moving average

class MovingAverageObserver final : public Observer {
 public:
  explicit MovingAverageObserver(const ObserverOptions& options) : Observer(options) {}

 private:
  void update(const Batch& batch) override {
    // The batch min / max are exactly torch.ao's per-batch reduction.
    const auto& mn = batch.min;
    const auto& mx = batch.max;
    if (!min_.defined()) {
      min_ = mn;
      max_ = mx;
      return;
    }
    const double c = options_.averaging_constant;
    min_ = min_ + c * (mn - min_);
    max_ = max_ + c * (mx - max_);
  }
  void merge_from(const Observer& other_base) override {
    const auto& other = static_cast<const MovingAverageObserver&>(other_base);
    if (!other.min_.defined()) return;
    if (!min_.defined()) {
      min_ = other.min_.clone();
      max_ = other.max_.clone();
      return;
    }
    min_ = weighted_mean(min_, count_, other.min_, other.count_);
    max_ = weighted_mean(max_, count_, other.max_, other.count_);
  }
  std::pair<torch::Tensor, torch::Tensor> selected_range() const override { return {min_, max_}; }

  torch::Tensor min_;
  torch::Tensor max_;
};

// ---------------------------------------------------------------------------- MSE search

class MseObserver final : public Observer {
 public:
  explicit MseObserver(const ObserverOptions& options) : Observer(options) {}

 private:
  void update(const Batch& batch) override {
    const torch::Tensor x = batch.values().to(torch::kFloat);
    // The min / max of x in its own dtype equal those of its float32 copy.
    const auto& mn = batch.min;
    const auto& mx = batch.max;
    auto best_error = torch::full_like(mn, std::numeric_limits<float>::max());
    auto best_min = mn.clone();
    auto best_max = mx.clone();
    const auto steps = static_cast<int64_t>(options_.mse_max_shrink * static_cast<double>(options_.mse_grid));
    int64_t without_improvement = 0;
    for (int64_t i = 0; i < steps; ++i) {
      const double p = 1.0 - static_cast<double>(i) / static_cast<double>(options_.mse_grid);
      const torch::Tensor shrunk_min = mn * p;
      const torch::Tensor shrunk_max = mx * p;
      const quant::QParams qp = quant::compute_qparams(shrunk_min, shrunk_max, options_.args, options_.convention);
      const torch::Tensor fq = quant::fake_quantize(x, qp, options_.args, options_.convention);
      const torch::Tensor error = reduce_sum((fq - x).abs().pow(options_.mse_norm));
      const torch::Tensor improved = error < best_error;
      if (improved.any().item<bool>()) {
        best_error = torch::where(improved, error, best_error);
        best_min = torch::where(improved, shrunk_min, best_min);
        best_max = torch::where(improved, shrunk_max, best_max);
        without_improvement = 0;
      } else if (++without_improvement >= options_.mse_patience) {
        break;
      }
    }
    if (!min_.defined()) {
      min_ = best_min;
      max_ = best_max;
      return;
    }
    // llm-compressor's lerp: start * (1 - c) + end * c.
    const double c = options_.averaging_constant;
    min_ = min_ * (1.0 - c) + best_min * c;
    max_ = max_ * (1.0 - c) + best_max * c;
  }
  void merge_from(const Observer& other_base) override {
    const auto& other = static_cast<const MseObserver&>(other_base);
    if (!other.min_.defined()) return;
    if (!min_.defined()) {
      min_ = other.min_.clone();
      max_ = other.max_.clone();
      return;
    }
    min_ = weighted_mean(min_, count_, other.min_, other.count_);
    max_ = weighted_mean(max_, count_, other.max_, other.count_);
  }
  std::pair<torch::Tensor, torch::Tensor> selected_range() const override { return {min_, max_}; }

  torch::Tensor min_;
  torch::Tensor max_;
};

// ---------------------------------------------------------------------------- histogram (percentile, entropy)

// Smallest e with absmax < bins * 2^e (absmax > 0).
int first_width_exponent(double absmax, int64_t bins) {
  int e = 0;
  std::frexp(absmax / static_cast<double>(bins), &e);
  while (absmax < std::ldexp(static_cast<double>(bins), e - 1)) --e;
  while (!(absmax < std::ldexp(static_cast<double>(bins), e))) ++e;
  return e;
}

// Bins needed so that absmax falls inside: floor(absmax / 2^e) + 1 (exact: scaling by 2^-e).
int64_t bins_needed(double absmax, int e) { return static_cast<int64_t>(std::floor(std::ldexp(absmax, -e))) + 1; }

// Pairs of bins added: the histogram at twice the width.
torch::Tensor coarsen(const torch::Tensor& counts) {
  torch::Tensor padded = counts;
  if (counts.size(0) % 2 != 0) padded = torch::cat({counts, torch::zeros({1}, counts.options())});
  return padded.view({-1, 2}).sum(1);
}

torch::Tensor pad_to(const torch::Tensor& counts, int64_t bins) {
  if (counts.size(0) >= bins) return counts;
  return torch::cat({counts, torch::zeros({bins - counts.size(0)}, counts.options())});
}

// TensorRT's KL search (see the header); returns the winning candidate bin count i.
int64_t entropy_candidate(const std::vector<int64_t>& counts, int64_t levels) {
  const auto n = static_cast<int64_t>(counts.size());
  std::vector<double> bins(counts.begin(), counts.end());
  if (n >= 2) bins[0] = bins[1];
  // tail[i] = sum(bins[i:]); counts stay exact in double up to 2^53.
  std::vector<double> tail(n + 1, 0.0);
  for (int64_t j = n - 1; j >= 0; --j) tail[j] = tail[j + 1] + bins[j];
  const double total = tail[0];  // sum(P) for every candidate
  std::vector<double> log_bins(n, 0.0);
  for (int64_t j = 0; j < n; ++j) log_bins[j] = bins[j] > 0 ? std::log(bins[j]) : 0.0;

  // p[j] = bins[j] / total and the non-empty bins in order: the sums below add
  // exactly the terms of the definition, in the same order, without a division
  // per candidate and bin (the search is O(bins^2)).
  std::vector<double> p(n);
  std::vector<int64_t> nonempty;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = bins[j] / total;
    if (bins[j] > 0) nonempty.push_back(j);
  }
  std::vector<int64_t> level_of(n);  // floor(j * levels / i) for the current candidate i
  std::vector<double> level_sum(levels);
  std::vector<int64_t> level_nonzero(levels);
  std::vector<double> log_level_mean(levels);
  int64_t best_i = n;
  double best_kl = std::numeric_limits<double>::infinity();
  for (int64_t i = std::min(kEntropyStartBin, n); i <= n; ++i) {
    // Stepping j: j * levels = level * i + remainder with 0 <= remainder < i.
    int64_t level = 0, remainder = 0;
    for (int64_t j = 0; j < i; ++j) {
      level_of[j] = level;
      remainder += levels;
      while (remainder >= i) {
        remainder -= i;
        ++level;
      }
    }
    std::fill(level_sum.begin(), level_sum.end(), 0.0);
    std::fill(level_nonzero.begin(), level_nonzero.end(), 0);
    for (int64_t j : nonempty) {
      if (j >= i) break;
      level_sum[level_of[j]] += bins[j];
      ++level_nonzero[level_of[j]];
    }
    double sum_q = 0.0;  // Q spreads each level's mass over its non-empty bins: sum(Q) = sum of those bins
    for (int64_t l = 0; l < levels; ++l) {
      sum_q += level_sum[l];
      log_level_mean[l] = level_nonzero[l] > 0 ? std::log(level_sum[l] / static_cast<double>(level_nonzero[l])) : 0.0;
    }
    // KL = sum p_j log(p_j / q_j) with p = P / total, q = Q / sum_q:
    // log(p_j / q_j) = log P_j - log Q_j + (log sum_q - log total).
    const double offset = std::log(sum_q) - std::log(total);
    double kl = 0.0;
    for (int64_t j : nonempty) {
      if (j + 1 >= i) break;
      kl += p[j] * (log_bins[j] - log_level_mean[level_of[j]] + offset);
    }
    const double last = bins[i - 1] + tail[i];  // P[i-1] carries everything beyond the candidate
    if (last > 0) {
      if (bins[i - 1] > 0) {
        kl += last / total * (std::log(last) - log_level_mean[level_of[i - 1]] + offset);
      } else {
        kl = std::numeric_limits<double>::infinity();  // P has mass where Q has none
      }
    }
    if (kl <= best_kl) {  // ties go to the later candidate ("last minimum")
      best_kl = kl;
      best_i = i;
    }
  }
  return best_i;
}

class HistogramObserver final : public Observer {
 public:
  explicit HistogramObserver(const ObserverOptions& options) : Observer(options) {}

  std::optional<Histogram> histogram() const override {
    if (!counts_.defined()) return std::nullopt;
    return Histogram{counts_, exponent_};
  }

 private:
  void update(const Batch& batch) override {
    const auto& mn = batch.min;
    const auto& mx = batch.max;
    if (!min_.defined()) {
      min_ = mn;
      max_ = mx;
    } else {
      min_ = torch::min(mn, min_);
      max_ = torch::max(mx, max_);
    }
    // The one host read-back per observe(): the histogram's size depends on it.
    const double batch_absmax = torch::max(-mn, mx).item<float>();
    VLMOPT_CHECK_INPUT(std::isfinite(batch_absmax), "observer {}: input contains non-finite values (max |x| = {})",
                       to_string(options_.kind), batch_absmax);
    absmax_ = std::max(absmax_, batch_absmax);
    cached_amax_.reset();
    if (batch_absmax == 0.0) {
      add_zeros(batch.elements);
      return;
    }
    if (!counts_.defined()) {
      exponent_ = first_width_exponent(batch_absmax, options_.histogram_bins);
      counts_ = torch::zeros({bins_needed(batch_absmax, exponent_)}, mn.options().dtype(torch::kLong));
      add_zeros(pending_zeros_);
      pending_zeros_ = 0;
    }
    fit(batch_absmax);
    // |x| * 2^-e is exact in float32, so floor() gives the true bin, below counts_.size(0) by fit().
    // On the CPU one pass bins the rows where they are (same float32 arithmetic, same counts).
    const bool cpu_binning = counts_.device().is_cpu() && exponent_ >= -126 && exponent_ <= 126 &&
                             counts_.size(0) <= (int64_t{1} << 24);
    if (cpu_binning && batch.rows != nullptr && row_stats_supported(batch.rows->rows)) {
      add_abs_histogram(batch.rows->rows, batch.rows->row_class, batch.rows->row_class_value, exponent_, counts_);
      return;
    }
    const torch::Tensor x = batch.values();
    if (cpu_binning && x.dim() > 0 && row_stats_supported(x.reshape({-1, x.size(-1)}))) {
      add_abs_histogram(x.reshape({-1, x.size(-1)}), {}, 0, exponent_, counts_);
      return;
    }
    // bincount: integer counts, deterministic; on CUDA it reads the index range back (two more syncs).
    const torch::Tensor index =
        torch::floor(x.to(torch::kFloat).abs().flatten() * std::ldexp(1.0, -exponent_)).to(torch::kLong);
    counts_ += torch::bincount(index, {}, counts_.size(0));
  }

  // Grows (same width) or coarsens the histogram so that `absmax` has a bin.
  void fit(double absmax) {
    int64_t needed = std::max(bins_needed(absmax, exponent_), counts_.size(0));
    while (needed > kMaxGrowth * options_.histogram_bins) {
      counts_ = coarsen(counts_);
      ++exponent_;
      needed = std::max(bins_needed(absmax, exponent_), counts_.size(0));
    }
    counts_ = pad_to(counts_, needed);
  }

  void add_zeros(int64_t zeros) {
    if (zeros == 0) return;
    if (!counts_.defined()) {
      pending_zeros_ += zeros;
    } else {
      counts_[0] += zeros;
    }
  }

  void merge_from(const Observer& other_base) override {
    const auto& other = static_cast<const HistogramObserver&>(other_base);
    if (!other.min_.defined()) return;
    cached_amax_.reset();
    if (!min_.defined()) {
      min_ = other.min_.clone();
      max_ = other.max_.clone();
    } else {
      min_ = torch::min(min_, other.min_.to(min_.device()));
      max_ = torch::max(max_, other.max_.to(max_.device()));
    }
    absmax_ = std::max(absmax_, other.absmax_);
    const torch::Device device = min_.device();
    if (other.counts_.defined()) {
      torch::Tensor theirs = other.counts_.to(device);
      int their_exponent = other.exponent_;
      if (!counts_.defined()) {
        counts_ = theirs.clone();
        exponent_ = their_exponent;
        add_zeros(pending_zeros_);
        pending_zeros_ = 0;
      } else {
        while (exponent_ < their_exponent) {
          counts_ = coarsen(counts_);
          ++exponent_;
        }
        while (their_exponent < exponent_) {
          theirs = coarsen(theirs);
          ++their_exponent;
        }
        const int64_t bins = std::max(counts_.size(0), theirs.size(0));
        counts_ = pad_to(counts_, bins) + pad_to(theirs, bins);
      }
      fit(absmax_);
    }
    add_zeros(other.pending_zeros_);
  }

  double selected_amax() const {
    if (cached_amax_) return *cached_amax_;
    double amax = 0.0;
    if (counts_.defined()) {
      const torch::Tensor cpu = counts_.to(torch::kCPU).contiguous();
      const std::vector<int64_t> counts(cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + cpu.numel());
      const double width = std::ldexp(1.0, exponent_);
      if (options_.kind == ObserverKind::kEntropy) {
        const int64_t levels = int64_t{1} << (options_.args.num_bits - 1);
        amax = static_cast<double>(entropy_candidate(counts, levels)) * width;
      } else {
        int64_t total = 0;
        for (int64_t c : counts) total += c;
        const double target = options_.percentile / 100.0 * static_cast<double>(total);
        int64_t cumulative = 0;
        int64_t bin = static_cast<int64_t>(counts.size()) - 1;
        for (int64_t k = 0; k < static_cast<int64_t>(counts.size()); ++k) {
          cumulative += counts[k];
          if (static_cast<double>(cumulative) >= target) {
            bin = k;
            break;
          }
        }
        amax = static_cast<double>(bin + 1) * width;
      }
      amax = std::min(amax, absmax_);  // a range beyond the data adds nothing
    }
    cached_amax_ = amax;
    return amax;
  }

  std::pair<torch::Tensor, torch::Tensor> selected_range() const override {
    if (!min_.defined()) return {};
    const auto amax = static_cast<float>(selected_amax());
    return {torch::clamp_min(min_, -amax), torch::clamp_max(max_, amax)};
  }

  torch::Tensor min_;  // running min / max of x, [1]
  torch::Tensor max_;
  double absmax_ = 0.0;    // running max |x| (host copy)
  torch::Tensor counts_;   // int64 histogram; undefined until a non-zero batch
  int exponent_ = 0;       // bin width 2^exponent_
  int64_t pending_zeros_ = 0;  // zeros seen before the histogram had a width
  mutable std::optional<double> cached_amax_;
};

}  // namespace

// ---------------------------------------------------------------------------- public API

ObserverKind parse_observer_kind(std::string_view text) {
  for (ObserverKind kind : kAllKinds) {
    if (text == to_string(kind)) return kind;
  }
  throw InputError(
      fmt::format("observer: expected one of minmax, moving-average, percentile, mse, entropy, got '{}'", text));
}

std::string_view to_string(ObserverKind kind) {
  switch (kind) {
    case ObserverKind::kMinMax: return "minmax";
    case ObserverKind::kMovingAverage: return "moving-average";
    case ObserverKind::kPercentile: return "percentile";
    case ObserverKind::kMse: return "mse";
    case ObserverKind::kEntropy: return "entropy";
  }
  return "?";
}

double Histogram::bin_width() const { return std::ldexp(1.0, width_exponent); }

Observer::Observer(ObserverOptions options) : options_(std::move(options)) { validate(options_); }

void Observer::check_shape(const torch::Tensor& x) {
  const auto kind = to_string(options_.kind);
  std::vector<int64_t> layout;  // the dims that fix the statistics' shape
  if (options_.args.strategy == Strategy::kTensor) {
    layout = {};
  } else if (options_.target == ObserverTarget::kWeight) {
    VLMOPT_CHECK_INPUT(x.dim() == 2, "observer {}: expected a weight [out, in], got shape {}", kind,
                       shape_str(x.sizes()));
    if (options_.args.strategy == Strategy::kGroup) {
      VLMOPT_CHECK_INPUT(x.size(1) % options_.args.group_size == 0,
                         "observer {}: weight in-features: expected a multiple of group_size {}, got {}", kind,
                         options_.args.group_size, x.size(1));
      layout = {x.size(0), x.size(1)};
    } else {
      layout = {x.size(0)};
    }
  } else {
    VLMOPT_CHECK_INPUT(x.dim() >= 1, "observer {}: expected activations [..., in], got a scalar", kind);
    layout = {x.size(-1)};
  }
  check_layout(layout, x.sizes());
}

void Observer::check_layout(const std::vector<int64_t>& layout, c10::IntArrayRef shape) {
  if (count_ == 0 && seen_shape_.empty()) {
    seen_shape_ = layout;
    return;
  }
  VLMOPT_CHECK(layout == seen_shape_, "observer {}: observed shape {} does not match earlier layout {}",
               to_string(options_.kind), shape_str(shape), shape_str(seen_shape_));
}

void Observer::observe(const torch::Tensor& x) {
  VLMOPT_CHECK(x.defined() && x.is_floating_point(), "observer {}: expected a float tensor",
               to_string(options_.kind));
  if (x.numel() == 0) return;
  check_shape(x);
  torch::NoGradGuard no_grad;
  const torch::Tensor values = x.detach();
  Batch batch;
  std::tie(batch.min, batch.max) = reduce_minmax(values);
  batch.elements = values.numel();
  batch.x = &values;
  update(batch);
  count_ += batch.elements;
}

void Observer::observe(const ActivationBatch& rows) {
  const auto kind = to_string(options_.kind);
  VLMOPT_CHECK(options_.target == ObserverTarget::kActivation, "observer {}: batches of rows are activations", kind);
  VLMOPT_CHECK(rows.rows.defined() && rows.rows.is_floating_point() && rows.rows.dim() == 2,
               "observer {}: expected float activation rows [N, C]", kind);
  if (rows.count == 0) return;
  const int64_t channels = rows.rows.size(1);
  VLMOPT_CHECK(rows.channel_min.defined() && rows.channel_max.defined() &&
                   rows.channel_min.scalar_type() == torch::kFloat && rows.channel_max.scalar_type() == torch::kFloat &&
                   rows.channel_min.dim() == 1 && rows.channel_min.size(0) == channels &&
                   rows.channel_max.sizes() == rows.channel_min.sizes(),
               "observer {}: expected float32 per-channel min / max [{}]", kind, channels);
  const std::vector<int64_t> layout =
      options_.args.strategy == Strategy::kTensor ? std::vector<int64_t>{} : std::vector<int64_t>{channels};
  check_layout(layout, {rows.count, channels});
  torch::NoGradGuard no_grad;
  Batch batch;
  if (options_.args.strategy == Strategy::kTensor) {
    // min over the channels' minima is the min over all values (NaN propagates in both).
    batch.min = rows.channel_min.min().reshape({1});
    batch.max = rows.channel_max.max().reshape({1});
  } else {
    batch.min = rows.channel_min;
    batch.max = rows.channel_max;
  }
  batch.elements = rows.count * channels;
  batch.rows = &rows;
  update(batch);
  count_ += batch.elements;
}

torch::Tensor Observer::Batch::values() const {
  if (x != nullptr) return *x;
  VLMOPT_CHECK(rows != nullptr, "observer batch without values");
  return rows->values();
}

torch::Tensor ActivationBatch::values() const {
  if (!row_class.defined()) return rows;
  return rows.index({(row_class == row_class_value).to(rows.device())});
}

std::pair<torch::Tensor, torch::Tensor> Observer::reduce_minmax(const torch::Tensor& x) const {
  const auto& args = options_.args;
  // Reduced in x's own dtype (no float32 copy of x); min / max are exact in float32.
  const auto as_float = [](std::tuple<torch::Tensor, torch::Tensor> r) {
    return std::pair{std::get<0>(r).to(torch::kFloat), std::get<1>(r).to(torch::kFloat)};
  };
  if (args.strategy == Strategy::kTensor) {
    auto [mn, mx] = as_float(torch::aminmax(x));
    return {mn.reshape({1}), mx.reshape({1})};
  }
  if (options_.target == ObserverTarget::kWeight) {
    if (args.strategy == Strategy::kChannel) return as_float(torch::aminmax(x, 1, /*keepdim=*/true));
    return as_float(torch::aminmax(x.reshape({x.size(0), -1, args.group_size}), 2));
  }
  return as_float(torch::aminmax(x.reshape({-1, x.size(-1)}), 0));
}

torch::Tensor Observer::reduce_sum(const torch::Tensor& values) const {
  const auto& args = options_.args;
  if (args.strategy == Strategy::kTensor) return values.sum().reshape({1});
  if (options_.target == ObserverTarget::kWeight) {
    if (args.strategy == Strategy::kChannel) return values.sum(1, /*keepdim=*/true);
    return values.reshape({values.size(0), -1, args.group_size}).sum(2);
  }
  return values.reshape({-1, values.size(-1)}).sum(0);
}

torch::Tensor Observer::min_vals() const {
  auto range = selected_range();
  VLMOPT_CHECK(range.first.defined(), "observer {}: no data observed", to_string(options_.kind));
  return range.first;
}

torch::Tensor Observer::max_vals() const {
  auto range = selected_range();
  VLMOPT_CHECK(range.second.defined(), "observer {}: no data observed", to_string(options_.kind));
  return range.second;
}

torch::Tensor Observer::amax() const {
  auto [mn, mx] = selected_range();
  VLMOPT_CHECK(mn.defined(), "observer {}: no data observed", to_string(options_.kind));
  // abs() rather than -mn: an all-zero range gives +0, not -0.
  return torch::max(torch::abs(mn), torch::abs(mx));
}

quant::QParams Observer::qparams() const {
  auto [mn, mx] = selected_range();
  VLMOPT_CHECK(mn.defined(), "observer {}: no data observed", to_string(options_.kind));
  return quant::compute_qparams(mn, mx, options_.args, options_.convention);
}

void Observer::merge(const Observer& other) {
  VLMOPT_CHECK(&other != this, "observer cannot merge itself");
  VLMOPT_CHECK(same_options(options_, other.options_), "observer merge: options differ ({} vs {})",
               to_string(options_.kind), to_string(other.options_.kind));
  if (other.count_ == 0) return;
  VLMOPT_CHECK(seen_shape_.empty() || other.seen_shape_.empty() || seen_shape_ == other.seen_shape_,
               "observer merge: layouts differ ({} vs {})", shape_str(seen_shape_), shape_str(other.seen_shape_));
  torch::NoGradGuard no_grad;
  merge_from(other);
  if (seen_shape_.empty()) seen_shape_ = other.seen_shape_;
  count_ += other.count_;
}

std::unique_ptr<Observer> make_observer(const ObserverOptions& options) {
  switch (options.kind) {
    case ObserverKind::kMinMax: return std::make_unique<MinMaxObserver>(options);
    case ObserverKind::kMovingAverage: return std::make_unique<MovingAverageObserver>(options);
    case ObserverKind::kMse: return std::make_unique<MseObserver>(options);
    case ObserverKind::kPercentile:
    case ObserverKind::kEntropy: return std::make_unique<HistogramObserver>(options);
  }
  VLMOPT_CHECK(false, "unknown observer kind {}", static_cast<int>(options.kind));
  return nullptr;
}

}  // namespace vlmopt::calib
