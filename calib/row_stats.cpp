// Fused row statistics (see row_stats.hpp).
#include "calib/row_stats.hpp"

#include "util/error.hpp"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

namespace vlmopt::calib {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// The FP16 limits as float32: all three are exact, and torch compares a float32
// tensor with a double scalar in float32, so these comparisons match Fp16Counter.
constexpr float kMaxF = static_cast<float>(kFp16Max);
constexpr float kMinNormalF = static_cast<float>(kFp16MinNormal);
constexpr float kMinSubnormalF = static_cast<float>(kFp16MinSubnormal);

// A chunk of rows is worth a thread from about this many elements on.
constexpr int64_t kElementsPerChunk = 1 << 15;

// Splits N rows of C channels into contiguous chunks, at most one per thread:
// chunk i covers rows [begin(i), begin(i+1)). Partial results are merged in chunk
// order, so results never depend on scheduling.
struct Chunks {
  int64_t count = 1;
  int64_t rows = 0;
  int64_t begin(int64_t i) const { return rows * i / count; }
};

Chunks chunk_rows(int64_t rows, int64_t channels) {
  Chunks chunks;
  chunks.rows = rows;
  const int64_t elements = rows * channels;
  chunks.count = std::clamp<int64_t>(elements / kElementsPerChunk, 1, std::max<int64_t>(1, at::get_num_threads()));
  chunks.count = std::min(chunks.count, std::max<int64_t>(rows, 1));
  return chunks;
}

// Per-class accumulators of one chunk, each [num_classes * C] (class k at (k-1) * C).
struct Partial {
  std::vector<float> min, max, min_nonzero;
  std::vector<int64_t> rows, overflow, subnormal, underflow;  // [num_classes]
  bool bad_class = false;

  Partial(int num_classes, int64_t channels)
      : min(static_cast<std::size_t>(num_classes * channels), kInf),
        max(static_cast<std::size_t>(num_classes * channels), -kInf),
        min_nonzero(static_cast<std::size_t>(num_classes * channels), kInf),
        rows(static_cast<std::size_t>(num_classes), 0),
        overflow(static_cast<std::size_t>(num_classes), 0),
        subnormal(static_cast<std::size_t>(num_classes), 0),
        underflow(static_cast<std::size_t>(num_classes), 0) {}
};

// The channel loops below are compiled twice where the toolchain allows: for
// AVX2 and for the baseline ISA, picked at load time (GCC function multi-
// versioning). Both do the same compares, selects and power-of-two scalings, so
// the results are identical; AVX2 handles twice the channels per instruction.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__ELF__)
#define VLMOPT_CHANNEL_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define VLMOPT_CHANNEL_LOOP
#endif

struct RowCounts {
  int32_t overflow = 0, subnormal = 0, underflow = 0;  // per row: at most C each
};

// The channel loop, branch-free so that it vectorizes (compares, selects, integer sums).
// min / max replace only on strictly smaller / larger values (ties keep the first
// row's value, as torch's aminmax does) or on NaN (which then sticks, as in torch).
VLMOPT_CHANNEL_LOOP RowCounts accumulate_row(const float* __restrict x, int64_t channels, float* __restrict mn,
                                             float* __restrict mx, float* __restrict min_nonzero) {
  int32_t overflow = 0, subnormal = 0, underflow = 0;
  for (int64_t c = 0; c < channels; ++c) {
    const float v = x[c];
    const bool nan = v != v;
    mn[c] = ((v < mn[c]) | nan) ? v : mn[c];
    mx[c] = ((v > mx[c]) | nan) ? v : mx[c];
    const float a = std::fabs(v);
    const bool nonzero = a > 0.0f;  // false for NaN: Fp16Counter's `ax > 0`
    const float a_or_inf = nonzero ? a : kInf;
    min_nonzero[c] = a_or_inf < min_nonzero[c] ? a_or_inf : min_nonzero[c];
    overflow += static_cast<int32_t>(a > kMaxF);
    subnormal += static_cast<int32_t>(nonzero & (a < kMinNormalF));
    underflow += static_cast<int32_t>(nonzero & (a < kMinSubnormalF));
  }
  return {overflow, subnormal, underflow};
}

// The histogram bins floor(|x| * scale) of one row into `index`, branch-free so
// that it vectorizes (the counting itself is a scatter). A value outside
// [0, bins) -- also NaN and inf -- is put in bin 0 and makes the result true.
VLMOPT_CHANNEL_LOOP bool bin_row(const float* __restrict x, int64_t channels, float scale, float bins,
                                 int32_t* __restrict index) {
  int32_t outside = 0;
  for (int64_t c = 0; c < channels; ++c) {
    const float scaled = std::fabs(x[c]) * scale;  // exact: a power-of-two scaling
    const bool inside = scaled < bins;
    outside |= static_cast<int32_t>(!inside);
    // scaled >= 0, so truncation is floor(); below 2^24, so it fits.
    index[c] = inside ? static_cast<int32_t>(scaled) : 0;
  }
  return outside != 0;
}

// Row r of `rows` as float32: the row itself for float32, else converted into `buffer`.
class RowReader {
 public:
  RowReader(const torch::Tensor& rows, int64_t channels) : channels_(channels), type_(rows.scalar_type()) {
    base_ = static_cast<const char*>(rows.const_data_ptr());
    row_bytes_ = channels * static_cast<int64_t>(rows.element_size());
    if (type_ != torch::kFloat32) buffer_.resize(static_cast<std::size_t>(channels));
  }
  const float* row(int64_t r) {
    const char* src = base_ + r * row_bytes_;
    if (type_ == torch::kFloat32) return reinterpret_cast<const float*>(src);
    if (type_ == torch::kBFloat16) {
      convert(reinterpret_cast<const c10::BFloat16*>(src));
    } else {
      convert(reinterpret_cast<const c10::Half*>(src));
    }
    return buffer_.data();
  }

 private:
  template <typename T>
  void convert(const T* src) {
    float* dst = buffer_.data();
    for (int64_t c = 0; c < channels_; ++c) dst[c] = static_cast<float>(src[c]);  // exact widening
  }
  int64_t channels_;
  torch::ScalarType type_;
  const char* base_ = nullptr;
  int64_t row_bytes_ = 0;
  std::vector<float> buffer_;
};

void check_rows(const torch::Tensor& rows, const torch::Tensor& row_class, const char* what) {
  VLMOPT_CHECK(row_stats_supported(rows), "{}: expected CPU rows [N, C] of float32, bfloat16 or half, got {}", what,
               rows.defined() ? fmt::format("{} {}-d on {}", c10::toString(rows.scalar_type()), rows.dim(),
                                            rows.device().str())
                              : std::string("undefined"));
  if (row_class.defined()) {
    VLMOPT_CHECK(row_class.device().is_cpu() && row_class.scalar_type() == torch::kUInt8 && row_class.dim() == 1 &&
                     row_class.size(0) == rows.size(0),
                 "{}: expected row classes uint8 [{}] on the CPU, got {} with {} elements", what, rows.size(0),
                 c10::toString(row_class.scalar_type()), row_class.numel());
  }
}

}  // namespace

bool row_stats_supported(const torch::Tensor& rows) {
  if (!rows.defined() || !rows.device().is_cpu() || rows.dim() != 2) return false;
  const auto type = rows.scalar_type();
  return type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kHalf;
}

std::vector<ClassRowStats> row_stats(const torch::Tensor& rows_in, const torch::Tensor& row_class_in,
                                     int num_classes) {
  check_rows(rows_in, row_class_in, "row_stats");
  VLMOPT_CHECK(num_classes >= 1 && num_classes <= 255, "row_stats: num_classes: expected 1..255, got {}",
               num_classes);
  const auto rows = rows_in.contiguous();
  const auto row_class = row_class_in.defined() ? row_class_in.contiguous() : torch::Tensor();
  const int64_t n = rows.size(0);
  const int64_t channels = rows.size(1);
  const uint8_t* classes = row_class.defined() ? row_class.const_data_ptr<uint8_t>() : nullptr;

  const Chunks chunks = chunk_rows(n, channels);
  std::vector<Partial> partials;
  partials.reserve(static_cast<std::size_t>(chunks.count));
  for (int64_t i = 0; i < chunks.count; ++i) partials.emplace_back(num_classes, channels);

  at::parallel_for(0, chunks.count, 1, [&](int64_t first, int64_t last) {
    RowReader reader(rows, channels);
    for (int64_t i = first; i < last; ++i) {
      Partial& p = partials[static_cast<std::size_t>(i)];
      for (int64_t r = chunks.begin(i); r < chunks.begin(i + 1); ++r) {
        const int k = classes != nullptr ? classes[r] : 1;
        if (k == kSkipRow) continue;
        if (k > num_classes) {
          p.bad_class = true;
          continue;
        }
        const int64_t offset = static_cast<int64_t>(k - 1) * channels;
        const RowCounts counts = accumulate_row(reader.row(r), channels, p.min.data() + offset,
                                                p.max.data() + offset, p.min_nonzero.data() + offset);
        const auto slot = static_cast<std::size_t>(k - 1);
        ++p.rows[slot];
        p.overflow[slot] += counts.overflow;
        p.subnormal[slot] += counts.subnormal;
        p.underflow[slot] += counts.underflow;
      }
    }
  });

  // Merge in chunk order: a later chunk's value wins only when strictly beyond (or NaN).
  Partial& total = partials.front();
  for (std::size_t i = 1; i < partials.size(); ++i) {
    const Partial& p = partials[i];
    total.bad_class |= p.bad_class;
    for (std::size_t j = 0; j < total.min.size(); ++j) {
      const float lo = p.min[j], hi = p.max[j], nz = p.min_nonzero[j];
      total.min[j] = ((lo < total.min[j]) | (lo != lo)) ? lo : total.min[j];
      total.max[j] = ((hi > total.max[j]) | (hi != hi)) ? hi : total.max[j];
      total.min_nonzero[j] = std::min(total.min_nonzero[j], nz);
    }
    for (std::size_t k = 0; k < total.rows.size(); ++k) {
      total.rows[k] += p.rows[k];
      total.overflow[k] += p.overflow[k];
      total.subnormal[k] += p.subnormal[k];
      total.underflow[k] += p.underflow[k];
    }
  }
  VLMOPT_CHECK(!total.bad_class, "row_stats: row classes: expected values 0..{}", num_classes);

  std::vector<ClassRowStats> result(static_cast<std::size_t>(num_classes));
  for (int k = 1; k <= num_classes; ++k) {
    auto& out = result[static_cast<std::size_t>(k - 1)];
    const auto slot = static_cast<std::size_t>(k - 1);
    out.rows = total.rows[slot];
    if (out.rows == 0) continue;
    const auto offset = static_cast<std::size_t>(k - 1) * static_cast<std::size_t>(channels);
    out.min = torch::empty({channels}, torch::kFloat32);
    out.max = torch::empty({channels}, torch::kFloat32);
    std::memcpy(out.min.data_ptr<float>(), total.min.data() + offset, sizeof(float) * channels);
    std::memcpy(out.max.data_ptr<float>(), total.max.data() + offset, sizeof(float) * channels);
    // max |x| = max(|min|, |max|) over channels; NaN propagates as in torch's amax.
    float max_abs = 0.0f, min_nonzero = kInf;
    for (int64_t c = 0; c < channels; ++c) {
      const float m = std::max(std::fabs(total.min[offset + c]), std::fabs(total.max[offset + c]));
      const bool nan = std::isnan(total.min[offset + c]) || std::isnan(total.max[offset + c]);
      if (nan || std::isnan(max_abs)) {
        max_abs = std::numeric_limits<float>::quiet_NaN();
      } else {
        max_abs = std::max(max_abs, m);
      }
      min_nonzero = std::min(min_nonzero, total.min_nonzero[offset + c]);
    }
    out.fp16.elements = out.rows * channels;
    out.fp16.overflow = total.overflow[slot];
    out.fp16.subnormal = total.subnormal[slot];
    out.fp16.underflow = total.underflow[slot];
    out.fp16.max_abs = static_cast<double>(max_abs);
    out.fp16.min_abs_nonzero = std::isfinite(min_nonzero) ? static_cast<double>(min_nonzero) : 0.0;
  }
  return result;
}

void add_abs_histogram(const torch::Tensor& rows_in, const torch::Tensor& row_class_in, uint8_t row_class_value,
                       int width_exponent, torch::Tensor& counts) {
  check_rows(rows_in, row_class_in, "add_abs_histogram");
  VLMOPT_CHECK(counts.defined() && counts.device().is_cpu() && counts.scalar_type() == torch::kInt64 &&
                   counts.dim() == 1 && counts.is_contiguous() && counts.size(0) > 0,
               "add_abs_histogram: expected contiguous int64 [bins] counts on the CPU");
  // torch multiplies a float32 tensor by a double scalar in float32: the scalar
  // 2^-e becomes a float, exact while it is a normal float.
  VLMOPT_CHECK(width_exponent >= -126 && width_exponent <= 126,
               "add_abs_histogram: width exponent: expected -126..126, got {}", width_exponent);
  const auto scale = static_cast<float>(std::ldexp(1.0, -width_exponent));
  const auto rows = rows_in.contiguous();
  const auto row_class = row_class_in.defined() ? row_class_in.contiguous() : torch::Tensor();
  const int64_t n = rows.size(0);
  const int64_t channels = rows.size(1);
  const int64_t bins = counts.size(0);
  VLMOPT_CHECK(bins <= (int64_t{1} << 24), "add_abs_histogram: expected at most 2^24 bins, got {}", bins);
  const auto bins_f = static_cast<float>(bins);  // exact below 2^24
  const uint8_t* classes = row_class.defined() ? row_class.const_data_ptr<uint8_t>() : nullptr;

  const Chunks chunks = chunk_rows(n, channels);
  std::vector<std::vector<int64_t>> partials(static_cast<std::size_t>(chunks.count));
  std::atomic<bool> out_of_range{false};
  at::parallel_for(0, chunks.count, 1, [&](int64_t first, int64_t last) {
    RowReader reader(rows, channels);
    for (int64_t i = first; i < last; ++i) {
      auto& local = partials[static_cast<std::size_t>(i)];
      local.assign(static_cast<std::size_t>(bins), 0);
      std::vector<int32_t> index(static_cast<std::size_t>(channels));
      bool bad = false;
      for (int64_t r = chunks.begin(i); r < chunks.begin(i + 1); ++r) {
        if (classes != nullptr && classes[r] != row_class_value) continue;
        bad |= bin_row(reader.row(r), channels, scale, bins_f, index.data());
        for (int64_t c = 0; c < channels; ++c) ++local[static_cast<std::size_t>(index[c])];
      }
      // Counts of a chunk with a value out of range are dropped: the check below throws.
      if (bad) out_of_range = true;
    }
  });
  VLMOPT_CHECK(!out_of_range, "add_abs_histogram: a value is non-finite or beyond the {} bins of width 2^{}", bins,
               width_exponent);
  int64_t* out = counts.data_ptr<int64_t>();
  for (const auto& local : partials)
    for (int64_t b = 0; b < bins; ++b) out[b] += local[static_cast<std::size_t>(b)];
}

}  // namespace vlmopt::calib
