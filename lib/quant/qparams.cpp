// Quantization parameter math (see qparams.hpp for the formulas and shapes).
#include "quant/qparams.hpp"

#include "util/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <limits>

namespace vlmopt::quant {
namespace {

std::string shape_str(c10::IntArrayRef shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string_view strategy_name(Strategy strategy) {
  switch (strategy) {
    case Strategy::kTensor: return "tensor";
    case Strategy::kChannel: return "channel";
    case Strategy::kGroup: return "group";
  }
  return "?";
}

void check_args(const QuantArgs& args) {
  if (args.type == QuantType::kFloat) {
    VLMOPT_CHECK_INPUT(args.num_bits == 8, "quantization args: num_bits: expected 8 for float (fp8 e4m3), got {}",
                       args.num_bits);
    VLMOPT_CHECK_INPUT(args.symmetric, "quantization args: symmetric: expected true for fp8, got false");
  } else {
    VLMOPT_CHECK_INPUT(args.num_bits >= 2 && args.num_bits <= 8,
                       "quantization args: num_bits: expected 2..8 for int, got {}", args.num_bits);
  }
  if (args.strategy == Strategy::kGroup) {
    VLMOPT_CHECK_INPUT(args.group_size > 0, "quantization args: group_size: expected > 0 for strategy group, got {}",
                       args.group_size);
  }
}

// x reshaped so that scale / zero point broadcast over it, and the shape to restore.
struct Aligned {
  torch::Tensor x;
  torch::Tensor scale;  // float32
  torch::Tensor zero_point;
  std::vector<int64_t> shape;  // x's original shape
};

Aligned align(const torch::Tensor& x, const QParams& qp, const QuantArgs& args) {
  VLMOPT_CHECK(qp.scale.defined() && qp.zero_point.defined(), "quantization parameters are not set");
  VLMOPT_CHECK_INPUT(qp.scale.sizes() == qp.zero_point.sizes(),
                     "quantization parameters: zero_point: expected shape {}, got {}",
                     shape_str(qp.scale.sizes()), shape_str(qp.zero_point.sizes()));
  Aligned out{x, qp.scale.to(torch::kFloat), qp.zero_point, x.sizes().vec()};
  const auto mismatch = [&] {
    return fmt::format("quantization parameters: scale: shape {} does not fit a tensor of shape {} (strategy {})",
                       shape_str(qp.scale.sizes()), shape_str(x.sizes()), strategy_name(args.strategy));
  };
  if (args.strategy == Strategy::kGroup) {
    VLMOPT_CHECK_INPUT(x.dim() == 2 && x.size(1) % args.group_size == 0, "{}: expected [out, in] with in a multiple "
                       "of group_size {}", mismatch(), args.group_size);
    const int64_t groups = x.size(1) / args.group_size;
    VLMOPT_CHECK_INPUT(qp.scale.dim() == 2 && qp.scale.size(0) == x.size(0) && qp.scale.size(1) == groups, "{}",
                       mismatch());
    out.x = x.reshape({x.size(0), groups, args.group_size});
    out.scale = out.scale.unsqueeze(-1);
    out.zero_point = out.zero_point.unsqueeze(-1);
    return out;
  }
  if (qp.scale.numel() == 1) {  // per tensor (or a single channel): broadcast as a 0-dim value, keeps x's shape
    out.scale = out.scale.reshape({});
    out.zero_point = out.zero_point.reshape({});
    return out;
  }
  const bool weight_rows = qp.scale.dim() == 2 && qp.scale.size(1) == 1 && x.dim() == 2 && x.size(0) == qp.scale.size(0);
  const bool last_dim = qp.scale.dim() == 1 && x.dim() >= 1 && x.size(-1) == qp.scale.size(0);
  VLMOPT_CHECK_INPUT(args.strategy == Strategy::kChannel && (weight_rows || last_dim), "{}", mismatch());
  return out;
}

// Quantized codes as float32 (integers, or fp8-representable values), aligned layout.
torch::Tensor codes_float(const Aligned& a, const QuantArgs& args, Convention convention) {
  const torch::Tensor x = a.x.to(torch::kFloat);
  const double qmin = static_cast<double>(args.qmin());
  const double qmax = static_cast<double>(args.qmax());
  if (args.type == QuantType::kFloat) {
    // torch.ao style multiplies by the reciprocal; compressed-tensors divides.
    const torch::Tensor scaled = convention == Convention::kTorchAo ? x * a.scale.reciprocal() : x / a.scale;
    return torch::clamp(scaled, qmin, qmax).to(torch::kFloat8_e4m3fn).to(torch::kFloat);
  }
  const torch::Tensor zp = a.zero_point.to(torch::kFloat);
  if (convention == Convention::kTorchAo) {
    // ATen: zero_point + nearbyint(x * (1.0f / scale)), then clamp.
    return torch::clamp(torch::round(x * a.scale.reciprocal()) + zp, qmin, qmax);
  }
  // compressed-tensors: round(clamp(x / scale + zp, qmin, qmax)).
  return torch::round(torch::clamp(x / a.scale + zp, qmin, qmax));
}

torch::Tensor dequantize_aligned(const torch::Tensor& codes, const Aligned& a) {
  return (codes.to(torch::kFloat) - a.zero_point.to(torch::kFloat)) * a.scale;
}

}  // namespace

QParams compute_qparams(const torch::Tensor& min_vals, const torch::Tensor& max_vals, const QuantArgs& args,
                        Convention convention) {
  check_args(args);
  VLMOPT_CHECK(min_vals.defined() && max_vals.defined(), "min/max values are not set");
  VLMOPT_CHECK(min_vals.sizes() == max_vals.sizes(), "min_vals shape {} != max_vals shape {}",
               shape_str(min_vals.sizes()), shape_str(max_vals.sizes()));
  VLMOPT_CHECK(min_vals.device() == max_vals.device(), "min_vals and max_vals on different devices");

  const torch::Tensor min_in = min_vals.to(torch::kFloat);
  const torch::Tensor max_in = max_vals.to(torch::kFloat);
  // 0 must stay representable: widen the range to include it.
  const torch::Tensor zeros = torch::zeros_like(min_in);
  const torch::Tensor mn = torch::min(min_in, zeros);
  const torch::Tensor mx = torch::max(max_in, zeros);
  const int64_t qmin = args.qmin();
  const int64_t qmax = args.qmax();
  const auto options = mn.options();

  torch::Tensor scale;
  torch::Tensor zero_point;
  if (convention == Convention::kTorchAo) {
    const torch::Tensor eps = torch::full({1}, kScaleEps, options);
    if (args.symmetric) {
      const torch::Tensor amax = torch::max(-mn, mx);
      scale = torch::max(amax / (static_cast<double>(qmax - qmin) / 2.0), eps);
      zero_point = torch::zeros(scale.sizes(), options.dtype(torch::kInt));
    } else {
      scale = torch::max((mx - mn) / static_cast<double>(qmax - qmin), eps);
      zero_point = torch::clamp(-torch::round(mn / scale).to(torch::kInt) + qmin, qmin, qmax);
    }
  } else {
    const torch::Tensor bit_range = torch::scalar_tensor(static_cast<double>(qmax - qmin), options);
    if (args.symmetric) {
      const torch::Tensor amax = torch::max(torch::abs(mn), torch::abs(mx));
      scale = amax / (bit_range / 2);
      zero_point = torch::zeros(scale.sizes(), options.dtype(torch::kInt));
    } else {
      scale = (mx - mn) / bit_range;
      // Computed before the eps replacement below: a zero range gives 0/0 = NaN
      // here, which compressed-tensors' int8 cast turns into 0; we write 0 explicitly.
      const torch::Tensor qmin_t = torch::scalar_tensor(static_cast<double>(qmin), options);
      const torch::Tensor qmax_t = torch::scalar_tensor(static_cast<double>(qmax), options);
      const torch::Tensor zp = torch::clamp(qmin_t - mn / scale, qmin_t, qmax_t);
      zero_point = torch::round(torch::nan_to_num(zp, 0.0)).to(torch::kInt);
    }
    scale = torch::where(scale == 0, torch::scalar_tensor(kScaleEps, options), scale);
  }
  if (scale.dim() == 0) scale = scale.reshape({1});
  if (zero_point.dim() == 0) zero_point = zero_point.reshape({1});
  return {scale, zero_point};
}

torch::Tensor quantize(const torch::Tensor& x, const QParams& qp, const QuantArgs& args, Convention convention) {
  check_args(args);
  VLMOPT_CHECK(x.is_floating_point(), "quantize expects a float tensor, got {}", c10::toString(x.scalar_type()));
  torch::NoGradGuard no_grad;
  const Aligned a = align(x, qp, args);
  const torch::Tensor codes = codes_float(a, args, convention).reshape(a.shape);
  return args.type == QuantType::kFloat ? codes.to(torch::kFloat8_e4m3fn) : codes.to(torch::kChar);
}

torch::Tensor dequantize(const torch::Tensor& q, const QParams& qp, const QuantArgs& args) {
  check_args(args);
  torch::NoGradGuard no_grad;
  const Aligned a = align(q, qp, args);
  return dequantize_aligned(a.x, a).reshape(a.shape);
}

torch::Tensor fake_quantize(const torch::Tensor& x, const QParams& qp, const QuantArgs& args,
                            Convention convention) {
  check_args(args);
  VLMOPT_CHECK(x.is_floating_point(), "fake_quantize expects a float tensor, got {}",
               c10::toString(x.scalar_type()));
  torch::Tensor fq;
  {
    torch::NoGradGuard no_grad;
    const Aligned a = align(x.detach(), qp, args);
    fq = dequantize_aligned(codes_float(a, args, convention), a).reshape(a.shape).to(x.scalar_type());
  }
  if (!x.requires_grad()) return fq;
  return x + (fq - x).detach();
}

double sqnr_db(const torch::Tensor& reference, const torch::Tensor& approx) {
  VLMOPT_CHECK(reference.sizes() == approx.sizes(), "sqnr_db: reference shape {} != approx shape {}",
               shape_str(reference.sizes()), shape_str(approx.sizes()));
  torch::NoGradGuard no_grad;
  const torch::Tensor ref = reference.detach().to(torch::kDouble);
  const torch::Tensor app = approx.detach().to(ref.device(), torch::kDouble);
  const double signal = ref.square().sum().item<double>();
  const double noise = (ref - app).square().sum().item<double>();
  if (noise == 0.0) return std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(signal / noise);
}

}  // namespace vlmopt::quant
