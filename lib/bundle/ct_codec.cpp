#include "bundle/ct_codec.hpp"

#include "util/error.hpp"

namespace vlmopt::bundle::ct {

using quant::QuantArgs;
using quant::QuantType;

std::string_view format_for(const QuantArgs& weights) {
  if (weights.type == QuantType::kFloat) return "float-quantized";
  return weights.num_bits == 8 ? "int-quantized" : "pack-quantized";
}

std::string_view strategy_name(quant::Strategy strategy) {
  switch (strategy) {
    case quant::Strategy::kTensor: return "tensor";
    case quant::Strategy::kChannel: return "channel";
    case quant::Strategy::kGroup: return "group";
  }
  return "tensor";
}

std::string_view scheme_name(quant::SchemeKind kind) {
  switch (kind) {
    case quant::SchemeKind::kW8A8: return "w8a8";
    case quant::SchemeKind::kW8A16: return "w8a16";
    case quant::SchemeKind::kW4A16: return "w4a16";
    case quant::SchemeKind::kFP8: return "fp8";
  }
  return "w8a8";
}

double qmin(const QuantArgs& args) {
  if (args.type == QuantType::kFloat) return -448.0;
  return -static_cast<double>(int64_t{1} << (args.num_bits - 1));
}

double qmax(const QuantArgs& args) {
  if (args.type == QuantType::kFloat) return 448.0;
  return static_cast<double>((int64_t{1} << (args.num_bits - 1)) - 1);
}

torch::Tensor expand_scale(const torch::Tensor& scale, int64_t out, int64_t in) {
  auto s = scale.to(torch::kFloat32);
  if (s.dim() == 1) {
    VLMOPT_CHECK(s.numel() == 1, "per-tensor scale has {} elements", s.numel());
    return s.reshape({1, 1}).expand({out, in});
  }
  VLMOPT_CHECK(s.dim() == 2 && s.size(0) == out, "scale of shape {} for a weight [{},{}]", c10::str(s.sizes()), out, in);
  const int64_t groups = s.size(1);
  if (groups == 1) return s.expand({out, in});
  VLMOPT_CHECK(in % groups == 0, "{} groups do not divide {} input channels", groups, in);
  return s.repeat_interleave(in / groups, 1);
}

torch::Tensor quantize(const torch::Tensor& weight, const torch::Tensor& scale, const QuantArgs& args) {
  VLMOPT_CHECK(weight.dim() == 2, "weight must be 2-D, got {}", c10::str(weight.sizes()));
  const auto s = expand_scale(scale.to(weight.device()), weight.size(0), weight.size(1));
  const auto scaled = (weight.to(torch::kFloat32) / s).clamp(qmin(args), qmax(args));
  if (args.type == QuantType::kFloat) return scaled.to(torch::kFloat8_e4m3fn);
  return scaled.round().to(torch::kInt8);  // torch rounds half to even, as compressed-tensors
}

torch::Tensor dequantize(const torch::Tensor& q, const torch::Tensor& scale) {
  return q.to(torch::kFloat32) * expand_scale(scale.to(q.device()), q.size(0), q.size(1));
}

torch::Tensor fake_quantize(const torch::Tensor& x, double scale, const QuantArgs& args) {
  auto scaled = (x.to(torch::kFloat32) / scale).clamp(qmin(args), qmax(args));
  scaled = args.type == QuantType::kFloat ? scaled.to(torch::kFloat8_e4m3fn).to(torch::kFloat32) : scaled.round();
  return (scaled * scale).to(x.scalar_type());
}

torch::Tensor pack(const torch::Tensor& values, int bits) {
  VLMOPT_CHECK(bits > 0 && 32 % bits == 0 && bits < 32, "cannot pack {} bits", bits);
  const int per_word = 32 / bits;
  const int64_t out = values.size(0), in = values.size(1);
  const int64_t words = (in + per_word - 1) / per_word;
  auto u = (values.to(torch::kInt64) + (int64_t{1} << (bits - 1))).cpu();
  u = torch::constant_pad_nd(u, {0, words * per_word - in}, 0).reshape({out, words, per_word});
  auto shifts = torch::arange(per_word, torch::kInt64) * bits;
  auto word = torch::bitwise_left_shift(u, shifts).sum(-1);  // < 2^32: the fields do not overlap
  word = torch::where(word >= (int64_t{1} << 31), word - (int64_t{1} << 32), word);  // two's complement int32
  return word.to(torch::kInt32);
}

torch::Tensor unpack(const torch::Tensor& packed, int bits, int64_t in) {
  const int per_word = 32 / bits;
  const int64_t out = packed.size(0);
  auto word = packed.to(torch::kInt64) & 0xFFFFFFFFLL;
  auto shifts = torch::arange(per_word, torch::TensorOptions().dtype(torch::kInt64).device(packed.device())) * bits;
  auto fields = torch::bitwise_right_shift(word.unsqueeze(-1), shifts) & ((int64_t{1} << bits) - 1);
  return (fields.reshape({out, -1}).slice(1, 0, in) - (int64_t{1} << (bits - 1))).to(torch::kInt8);
}

}  // namespace vlmopt::bundle::ct
