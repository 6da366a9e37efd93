// MP-Cache dequantization on the GPU: the launcher's raw-pointer interface.
// Torch-free so that nvcc (C++17) compiles dequant.cu without torch headers;
// lib/quant/dequant.cpp fills DequantArgs from tensors and passes torch's
// current CUDA stream. Semantics are those of dequantize_reference (dequant.hpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vlmopt::quant::cuda {

// Same 40-byte layout as MpCacheEntry (and the MP-Cache file): scale, zero point, mask bits.
struct DequantEntry {
  float scale;
  int32_t zero_point;
  uint8_t channel_mask[32];
};
static_assert(sizeof(DequantEntry) == 40, "must match MpCacheEntry");

struct DequantArgs {
  const int8_t* q = nullptr;             // [rows, cols], contiguous, device memory
  const DequantEntry* entries = nullptr;  // [entry_rows * groups_per_row], device memory
  const uint16_t* passthrough = nullptr;  // fp16 bits [rows, cols]; may be null when no mask bit is set
  uint16_t* out = nullptr;                // fp16 bits [rows, cols]
  int64_t rows = 0;
  int64_t cols = 0;
  int32_t axis = 0;            // 0: channels run along rows; 1: along cols
  uint32_t group_size = 1;     // channels per entry, 1..256
  int64_t groups_per_row = 0;  // ceil(channels / group_size)
  int64_t entry_rows = 1;      // 1: all slices share entries; else one set per slice of the other dimension
};

// Enqueues the kernel on `stream`; returns the launch error (cudaSuccess when enqueued).
cudaError_t launch_mp_dequant(const DequantArgs& args, cudaStream_t stream);

}  // namespace vlmopt::quant::cuda
