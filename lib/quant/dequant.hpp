// Dequantization with MP-Cache parameters: w_fp16 = scale * (q - zero_point) per
// entry group along the tensor's axis, and FP16 passthrough values for the
// channels whose mask bit is set (LLM.int8()-style outlier channels).
#pragma once

#include "quant/mp_cache.hpp"

#include <torch/torch.h>

namespace vlmopt::quant {

// Contract (the CPU reference and the CUDA kernel give bit-identical results):
//   q            int8 [rows, cols], CPU or CUDA, any strides. Holds int8 values, or int4
//                values in [-8, 7] one per byte (params.qdtype int8 or int4; fp8 is refused).
//   params       one MpCacheTensor. axis 0: params.channels == rows, and params.rows is 1 or
//                cols; axis 1 or -1: params.channels == cols, and params.rows is 1 or rows.
//                Element (r, c) has channel ch = (axis 0 ? r : c) and slice s = (axis 0 ? c : r);
//                it uses entry e = (params.rows > 1 ? s * groups_per_row : 0) + ch / group_size
//                and mask bit ch % group_size of that entry.
//   passthrough  float16 [rows, cols] on q's device: the FP16 values of the masked channels.
//                Required when any mask bit is set; may be undefined otherwise (then ignored).
//   result       float16 [rows, cols] on q's device, contiguous:
//                  masked    -> passthrough[r, c] (bits copied)
//                  otherwise -> fp16_round_nearest_even(float(scale) * float(q[r, c] - zero_point)),
//                               the product a single fp32 multiply (no FMA).
// Activations [..., in] are dequantized as q.reshape({-1, in}) with axis -1.
// Violations throw InputError naming the argument. CUDA tensors run the CUDA kernel on the
// current torch CUDA stream when vlmopt was built with CUDA kernels, else throw InputError.
torch::Tensor dequantize(const torch::Tensor& q, const MpCacheTensor& params, const torch::Tensor& passthrough = {});

// The same computation in plain C++ loops on the CPU (q and passthrough must be CPU tensors).
torch::Tensor dequantize_reference(const torch::Tensor& q, const MpCacheTensor& params,
                                   const torch::Tensor& passthrough = {});

// True when this build has the CUDA dequantization kernel (VLMOPT_HAVE_CUDA at configure time).
bool have_cuda_dequant_kernel();

}  // namespace vlmopt::quant
