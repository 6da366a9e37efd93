// MP-Cache dequantization kernel: out = fp16_rn(scale * float(q - zero_point)), or the
// FP16 passthrough value where the channel's mask bit is set. One thread per element
// (grid-stride loop); the multiply is a single rounded fp32 operation and the fp16
// conversion rounds to nearest even, so results equal the CPU reference bit for bit.
#include "quant/cuda/dequant_kernel.hpp"

#include <cuda_fp16.h>

namespace vlmopt::quant::cuda {
namespace {

__global__ void mp_dequant_kernel(DequantArgs args) {
  const int64_t total = args.rows * args.cols;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t r = i / args.cols;
    const int64_t c = i - r * args.cols;
    const int64_t channel = args.axis == 0 ? r : c;
    const int64_t slice = args.axis == 0 ? c : r;
    const int64_t group = channel / args.group_size;
    const uint32_t bit = static_cast<uint32_t>(channel - group * args.group_size);
    const int64_t entry_index = (args.entry_rows > 1 ? slice * args.groups_per_row : 0) + group;
    const DequantEntry& entry = args.entries[entry_index];
    const bool masked = (__ldg(&entry.channel_mask[bit >> 3]) >> (bit & 7u)) & 1u;
    if (masked) {
      args.out[i] = args.passthrough[i];
    } else {
      const int32_t centered = static_cast<int32_t>(args.q[i]) - __ldg(&entry.zero_point);
      // __fmul_rn: never contracted into an FMA, matching the CPU's plain float multiply.
      const float value = __fmul_rn(__ldg(&entry.scale), static_cast<float>(centered));
      args.out[i] = __half_as_ushort(__float2half_rn(value));
    }
  }
}

}  // namespace

cudaError_t launch_mp_dequant(const DequantArgs& args, cudaStream_t stream) {
  const int64_t total = args.rows * args.cols;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // Enough blocks to fill the GPU several times over; the grid-stride loop covers the rest.
  const int64_t wanted = (total + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < 65535 ? wanted : 65535);
  mp_dequant_kernel<<<blocks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace vlmopt::quant::cuda
