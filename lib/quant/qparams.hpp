// Scale / zero-point math, quantize, dequantize and fake-quantize for the two
// conventions vlmopt claims compatibility with (reference.md §3):
//
//   torch.ao            scale = max(range / (qmax - qmin) [/2 when symmetric], eps)
//                       zp    = clamp(qmin - round(mn / scale), qmin, qmax)
//                       q     = clamp(round(x * (1/scale)) + zp, qmin, qmax)
//   compressed-tensors  scale = range / (qmax - qmin) [/2 when symmetric]; a scale of exactly 0 becomes eps
//                       zp    = round(clamp(qmin - mn / scale, qmin, qmax))
//                       q     = round(clamp(x / scale + zp, qmin, qmax))
//
// with mn = min(min_val, 0), mx = max(max_val, 0), eps = float32 eps, rounding
// half-to-even, all arithmetic in float32 on the inputs' device. Each formula is
// evaluated with the same torch operations the reference library uses (a Python
// scalar divisor for torch.ao, a 0-dim tensor on the device for
// compressed-tensors), so results are bit-identical to theirs on CPU and CUDA.
//
// FP8 (e4m3fn, QuantType::kFloat, symmetric only): scale = amax / 448 (as
// compressed-tensors' range [-448, 448] gives); x / scale is clamped to
// [-448, 448] and cast to float8_e4m3fn (round to nearest even). torch.ao has no
// FP8 observer; under Convention::kTorchAo FP8 uses torch.ao's style (scalar
// divisor, eps clamp, multiply by 1/scale).
//
// Shapes: compute_qparams returns scale / zero_point shaped like min_vals (a
// 0-dim input gives [1]); the caller reduces min/max to the layout it wants:
// tensor [1], weight channel [out,1], weight group [out, in/group_size],
// activation channel [in]. quantize / fake_quantize / dequantize broadcast
// those layouts over x: [1] over any x, [out,1] over [out,in], [in] over
// [..., in], and group [out,G] over [out, G*group_size].
#pragma once

#include "quant/scheme.hpp"

#include <torch/torch.h>

namespace vlmopt::quant {

// torch.finfo(torch.float32).eps: the smallest scale either convention produces.
inline constexpr float kScaleEps = 1.1920928955078125e-07f;
// Largest finite float8_e4m3fn value.
inline constexpr float kFp8E4m3Max = 448.0f;

// Scale (float32) and zero point (int32) from observed ranges. min_vals and
// max_vals have the same shape and live on the same device; any float dtype.
QParams compute_qparams(const torch::Tensor& min_vals, const torch::Tensor& max_vals, const QuantArgs& args,
                        Convention convention);

// x (any float dtype) -> int8 codes (int4 codes are stored in int8 too), or
// float8_e4m3fn for QuantType::kFloat. Same shape as x.
torch::Tensor quantize(const torch::Tensor& x, const QParams& qp, const QuantArgs& args, Convention convention);

// Codes from quantize() -> float32 values (q - zp) * scale.
torch::Tensor dequantize(const torch::Tensor& q, const QParams& qp, const QuantArgs& args);

// quantize + dequantize, returned in x's dtype. When x requires grad the result
// is x + (fq - x).detach(): the forward value of fq with the identity
// (straight-through) gradient.
torch::Tensor fake_quantize(const torch::Tensor& x, const QParams& qp, const QuantArgs& args,
                            Convention convention);

// Signal-to-quantization-noise ratio in dB: 10 log10(sum(ref^2) / sum((ref - approx)^2)),
// computed in float64. +inf when the tensors are equal; -inf when the reference is
// all zero but approx is not.
double sqnr_db(const torch::Tensor& reference, const torch::Tensor& approx);

}  // namespace vlmopt::quant
