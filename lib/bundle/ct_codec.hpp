// compressed-tensors' symmetric quantize/dequantize and int4 packing, as the
// bundle stores tensors (reference.md §2-3): q = round(clamp(x / scale, qmin, qmax))
// (half-to-even), x' = q * scale. Shared by export (encode), verify (shapes) and
// the runtime (decode). Symmetric only: the bundle never stores zero points.
#pragma once

#include "quant/scheme.hpp"

#include <torch/torch.h>

#include <cstdint>
#include <string_view>

namespace vlmopt::bundle::ct {

// compressed-tensors "format" for the weights' args: int 8-bit -> "int-quantized",
// int < 8 bits -> "pack-quantized", float -> "float-quantized".
std::string_view format_for(const quant::QuantArgs& weights);
std::string_view strategy_name(quant::Strategy strategy);
std::string_view scheme_name(quant::SchemeKind kind);
// Integer or fp8 range of `args`: int b bits [-2^(b-1), 2^(b-1)-1]; fp8 e4m3 [-448, 448].
double qmin(const quant::QuantArgs& args);
double qmax(const quant::QuantArgs& args);

// Scale of shape [1], [out,1] or [out, in/group] broadcast to [out,in] (float32).
torch::Tensor expand_scale(const torch::Tensor& scale, int64_t out, int64_t in);
// Quantized values of weight [out,in] with `scale` (any of the shapes above):
// int8 for int 8-bit, int8 values in [qmin,qmax] for int < 8 bits, float8_e4m3fn for float.
torch::Tensor quantize(const torch::Tensor& weight, const torch::Tensor& scale, const quant::QuantArgs& args);
// q (as quantize returns it, or int32 unpacked values) times the expanded scale, float32.
torch::Tensor dequantize(const torch::Tensor& q, const torch::Tensor& scale);
// x fake-quantized with a per-tensor scale: dequantize(quantize(x)) in x's dtype.
torch::Tensor fake_quantize(const torch::Tensor& x, double scale, const quant::QuantArgs& args);

// Packs int values in [-2^(bits-1), 2^(bits-1)) of shape [out,in] into int32 words
// [out, ceil(in*bits/32)]: v + 2^(bits-1), element i of each word at bit i*bits.
torch::Tensor pack(const torch::Tensor& values, int bits);
// Inverse of pack: int8 values [out, in].
torch::Tensor unpack(const torch::Tensor& packed, int bits, int64_t in);

}  // namespace vlmopt::bundle::ct
