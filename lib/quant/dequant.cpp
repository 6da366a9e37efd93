#include "quant/dequant.hpp"

#include "util/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>

#ifdef VLMOPT_WITH_CUDA_KERNELS
#include "quant/cuda/dequant_kernel.hpp"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace vlmopt::quant {
namespace {

std::string shape_text(torch::IntArrayRef sizes) { return fmt::format("[{}]", fmt::join(sizes, ", ")); }

// Everything the contract in dequant.hpp requires, checked before any work.
void check_arguments(const torch::Tensor& q, const MpCacheTensor& params, const torch::Tensor& passthrough) {
  const std::string who = fmt::format("dequantize '{}' ({})", params.name, to_string(params.role));
  VLMOPT_CHECK_INPUT(q.defined(), "{}: q: expected an int8 tensor, got undefined", who);
  VLMOPT_CHECK_INPUT(q.scalar_type() == torch::kInt8, "{}: q dtype: expected int8, got {}", who,
                     c10::toString(q.scalar_type()));
  VLMOPT_CHECK_INPUT(q.dim() == 2, "{}: q shape: expected [rows, cols], got {}", who, shape_text(q.sizes()));
  VLMOPT_CHECK_INPUT(params.qdtype == MpQDType::kInt8 || params.qdtype == MpQDType::kInt4,
                     "{}: qdtype: expected int8 or int4, got {}", who, to_string(params.qdtype));
  validate_mp_cache_tensor(params, "dequantize");
  const bool along_rows = params.axis == 0;
  const int64_t channels = along_rows ? q.size(0) : q.size(1);
  const int64_t slices = along_rows ? q.size(1) : q.size(0);
  VLMOPT_CHECK_INPUT(static_cast<uint64_t>(channels) == params.channels,
                     "{}: q shape {}: expected {} channels along axis {}, got {}", who, shape_text(q.sizes()), params.channels,
                     params.axis, channels);
  VLMOPT_CHECK_INPUT(params.rows == 1 || params.rows == static_cast<uint64_t>(slices),
                     "{}: q shape {}: expected 1 or {} (params.rows) slices along the other axis, got {}", who,
                     shape_text(q.sizes()), params.rows, slices);
  if (passthrough.defined()) {
    VLMOPT_CHECK_INPUT(passthrough.scalar_type() == torch::kHalf, "{}: passthrough dtype: expected float16, got {}", who,
                       c10::toString(passthrough.scalar_type()));
    VLMOPT_CHECK_INPUT(passthrough.sizes() == q.sizes(), "{}: passthrough shape: expected {} (as q), got {}", who,
                       shape_text(q.sizes()), shape_text(passthrough.sizes()));
    VLMOPT_CHECK_INPUT(passthrough.device() == q.device(), "{}: passthrough device: expected {} (as q), got {}", who,
                       q.device().str(), passthrough.device().str());
  } else {
    VLMOPT_CHECK_INPUT(params.masked_channel_count() == 0,
                       "{}: passthrough: expected a float16 tensor for the {} masked channels, got undefined", who,
                       params.masked_channel_count());
  }
}

#ifdef VLMOPT_WITH_CUDA_KERNELS
torch::Tensor dequantize_cuda(const torch::Tensor& q_in, const MpCacheTensor& params, const torch::Tensor& passthrough_in) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = q_in.contiguous();
  const bool use_passthrough = passthrough_in.defined() && params.masked_channel_count() > 0;
  const auto passthrough = use_passthrough ? passthrough_in.contiguous() : torch::Tensor();
  // The 40-byte entries go to the device as raw bytes (same layout as DequantEntry).
  const auto host_entries = torch::from_blob(const_cast<MpCacheEntry*>(params.entries.data()),
                                             {static_cast<int64_t>(params.entries.size() * sizeof(MpCacheEntry))},
                                             torch::kUInt8);
  const auto entries = host_entries.to(q.device());
  auto out = torch::empty(q.sizes(), q.options().dtype(torch::kHalf));

  cuda::DequantArgs args;
  args.q = q.const_data_ptr<int8_t>();
  args.entries = reinterpret_cast<const cuda::DequantEntry*>(entries.const_data_ptr<uint8_t>());
  args.passthrough = use_passthrough ? reinterpret_cast<const uint16_t*>(passthrough.const_data_ptr<c10::Half>()) : nullptr;
  args.out = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::Half>());
  args.rows = q.size(0);
  args.cols = q.size(1);
  args.axis = params.axis == 0 ? 0 : 1;
  args.group_size = params.group_size;
  args.groups_per_row = static_cast<int64_t>(params.groups_per_row());
  args.entry_rows = static_cast<int64_t>(params.rows);
  const cudaError_t err = cuda::launch_mp_dequant(args, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  VLMOPT_CHECK(err == cudaSuccess, "MP-Cache dequant kernel launch failed: {}", cudaGetErrorString(err));
  return out;
}
#endif

}  // namespace

bool have_cuda_dequant_kernel() {
#ifdef VLMOPT_WITH_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

namespace {

// dequantize_reference after check_arguments.
torch::Tensor dequantize_cpu(const torch::Tensor& q_in, const MpCacheTensor& params, const torch::Tensor& passthrough_in) {
  const auto q = q_in.contiguous();
  const auto passthrough = passthrough_in.defined() ? passthrough_in.contiguous() : torch::Tensor();
  auto out = torch::empty(q.sizes(), q.options().dtype(torch::kHalf));
  const int64_t rows = q.size(0);
  const int64_t cols = q.size(1);
  const int8_t* qp = q.const_data_ptr<int8_t>();
  const c10::Half* pp = passthrough.defined() ? passthrough.const_data_ptr<c10::Half>() : nullptr;
  c10::Half* op = out.mutable_data_ptr<c10::Half>();
  const uint64_t groups = params.groups_per_row();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const auto channel = static_cast<uint64_t>(params.axis == 0 ? r : c);
      const auto slice = static_cast<uint64_t>(params.axis == 0 ? c : r);
      const auto& entry = params.entries[(params.rows > 1 ? slice * groups : 0) + channel / params.group_size];
      const int64_t i = r * cols + c;
      if (entry.masked(static_cast<uint32_t>(channel % params.group_size))) {
        op[i] = pp[i];
      } else {
        const float value = entry.scale * static_cast<float>(static_cast<int32_t>(qp[i]) - entry.zero_point);
        op[i] = c10::Half(value);  // round to nearest even
      }
    }
  }
  return out;
}

}  // namespace

torch::Tensor dequantize_reference(const torch::Tensor& q, const MpCacheTensor& params, const torch::Tensor& passthrough) {
  check_arguments(q, params, passthrough);
  VLMOPT_CHECK_INPUT(q.device().is_cpu(), "dequantize_reference '{}': q device: expected cpu, got {}", params.name,
                     q.device().str());
  return dequantize_cpu(q, params, passthrough);
}

torch::Tensor dequantize(const torch::Tensor& q, const MpCacheTensor& params, const torch::Tensor& passthrough) {
  check_arguments(q, params, passthrough);
  if (q.device().is_cpu()) return dequantize_cpu(q, params, passthrough);
  VLMOPT_CHECK_INPUT(q.device().is_cuda(), "dequantize '{}': q device: expected cpu or cuda, got {}", params.name,
                     q.device().str());
#ifdef VLMOPT_WITH_CUDA_KERNELS
  return dequantize_cuda(q, params, passthrough);
#else
  throw InputError(fmt::format("dequantize '{}': q is on {}, but this vlmopt was built without CUDA kernels "
                               "(VLMOPT_CUDA=OFF or no nvcc at configure time); move the tensors to the CPU",
                               params.name, q.device().str()));
#endif
}

}  // namespace vlmopt::quant
