#include "calib/fp16_safety.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace vlmopt::calib {

namespace {
double fraction(int64_t part, int64_t total) {
  return total == 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(total);
}
// Above this share of flushed or overflowing values fp16 is not "fine".
constexpr double kTolerableFraction = 1e-4;
}  // namespace

double Fp16Safety::overflow_fraction() const { return fraction(overflow, elements); }
double Fp16Safety::subnormal_fraction() const { return fraction(subnormal, elements); }
double Fp16Safety::underflow_fraction() const { return fraction(underflow, elements); }

int Fp16Safety::rescale_exponent() const {
  if (max_abs > kFp16Max) {
    // Smallest shift down that brings the maximum into range...
    const int k = -static_cast<int>(std::ceil(std::log2(max_abs / kFp16Max)));
    // ...helps only if the smallest nonzero values do not then flush to zero.
    if (min_abs_nonzero == 0.0 || std::ldexp(min_abs_nonzero, k) >= kFp16MinSubnormal) return k;
    return 0;
  }
  if (underflow_fraction() > kTolerableFraction && min_abs_nonzero > 0.0) {
    const int k = static_cast<int>(std::ceil(std::log2(kFp16MinNormal / min_abs_nonzero)));
    // Lift the small values to the normal range while the maximum stays representable.
    const int headroom = static_cast<int>(std::floor(std::log2(kFp16Max / std::max(max_abs, 1e-30))));
    return std::max(0, std::min(k, headroom));
  }
  return 0;
}

std::string Fp16Safety::recommendation() const {
  const bool overflows = overflow > 0;
  const bool flushes = underflow_fraction() > kTolerableFraction;
  if (!overflows && !flushes) return "fp16 fine";
  const int k = rescale_exponent();
  if (k != 0) return fmt::format("rescale by 2^{}", k);
  return "keep bf16 or fp32";
}

void Fp16Safety::merge(const Fp16Safety& other) {
  elements += other.elements;
  overflow += other.overflow;
  subnormal += other.subnormal;
  underflow += other.underflow;
  max_abs = std::max(max_abs, other.max_abs);
  if (other.min_abs_nonzero > 0.0)
    min_abs_nonzero = min_abs_nonzero > 0.0 ? std::min(min_abs_nonzero, other.min_abs_nonzero) : other.min_abs_nonzero;
}

nlohmann::json Fp16Safety::to_json() const {
  return {{"elements", elements},
          {"max_abs", max_abs},
          {"min_abs_nonzero", min_abs_nonzero},
          {"overflow_fraction", overflow_fraction()},
          {"subnormal_fraction", subnormal_fraction()},
          {"underflow_fraction", underflow_fraction()},
          {"recommendation", recommendation()}};
}

void Fp16Counter::observe(const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  const auto ax = x.detach().abs().to(torch::kFloat32);
  const auto nonzero = ax > 0;
  const auto counts = torch::stack({torch::full({}, ax.numel(), ax.options().dtype(torch::kLong)),
                                    (ax > kFp16Max).sum(), ((ax < kFp16MinNormal) & nonzero).sum(),
                                    ((ax < kFp16MinSubnormal) & nonzero).sum()});
  // The smallest nonzero magnitude: zeros are lifted to +inf before the min.
  const auto min_nonzero = torch::where(nonzero, ax, std::numeric_limits<float>::infinity()).amin();
  const auto extrema = torch::stack({ax.amax(), -min_nonzero}).to(torch::kDouble);
  if (!counts_.defined()) {
    counts_ = counts;
    extrema_ = extrema;
  } else {
    counts_.add_(counts);
    extrema_ = torch::maximum(extrema_, extrema);
  }
}

namespace {
// NaN-propagating max, as torch::maximum (std::max would drop a NaN in `b`).
double max_propagating_nan(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? std::nan("") : std::max(a, b);
}

// Folds b into a like Fp16Counter's tensors do: counts add, extrema max with NaN
// propagating. Fp16Safety{} (zero counts, max_abs 0, no nonzero minimum) is its identity.
void accumulate(Fp16Safety& a, const Fp16Safety& b) {
  a.elements += b.elements;
  a.overflow += b.overflow;
  a.subnormal += b.subnormal;
  a.underflow += b.underflow;
  a.max_abs = max_propagating_nan(a.max_abs, b.max_abs);
  if (b.min_abs_nonzero > 0.0)
    a.min_abs_nonzero = a.min_abs_nonzero > 0.0 ? std::min(a.min_abs_nonzero, b.min_abs_nonzero) : b.min_abs_nonzero;
}
}  // namespace

void Fp16Counter::add(const Fp16Safety& batch) { accumulate(added_, batch); }

Fp16Safety Fp16Counter::result() const {
  Fp16Safety s;
  if (!counts_.defined()) return added_;
  const auto c = counts_.to(torch::kCPU);
  const auto e = extrema_.to(torch::kCPU);
  s.elements = c[0].item<int64_t>();
  s.overflow = c[1].item<int64_t>();
  s.subnormal = c[2].item<int64_t>();
  s.underflow = c[3].item<int64_t>();
  s.max_abs = e[0].item<double>();
  const double min_nonzero = -e[1].item<double>();
  s.min_abs_nonzero = std::isfinite(min_nonzero) ? min_nonzero : 0.0;
  accumulate(s, added_);  // an identity when nothing was added
  return s;
}

}  // namespace vlmopt::calib
