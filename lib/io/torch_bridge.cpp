#include "io/torch_bridge.hpp"

#include "util/error.hpp"

#include <cstring>

namespace vlmopt::io {

torch::ScalarType to_torch(DType dtype) {
  switch (dtype) {
    case DType::kBool: return torch::kBool;
    case DType::kU8: return torch::kUInt8;
    case DType::kI8: return torch::kInt8;
    case DType::kI16: return torch::kInt16;
    case DType::kU16: return torch::kUInt16;
    case DType::kF16: return torch::kFloat16;
    case DType::kBF16: return torch::kBFloat16;
    case DType::kI32: return torch::kInt32;
    case DType::kU32: return torch::kUInt32;
    case DType::kF32: return torch::kFloat32;
    case DType::kF64: return torch::kFloat64;
    case DType::kI64: return torch::kInt64;
    case DType::kU64: return torch::kUInt64;
    case DType::kF8_E4M3: return torch::kFloat8_e4m3fn;
    case DType::kF8_E5M2: return torch::kFloat8_e5m2;
  }
  throw Error(ExitCode::kInternal, fmt::format("unknown DType value {}", static_cast<int>(dtype)));
}

DType from_torch(torch::ScalarType type) {
  switch (type) {
    case torch::kBool: return DType::kBool;
    case torch::kUInt8: return DType::kU8;
    case torch::kInt8: return DType::kI8;
    case torch::kInt16: return DType::kI16;
    case torch::kUInt16: return DType::kU16;
    case torch::kFloat16: return DType::kF16;
    case torch::kBFloat16: return DType::kBF16;
    case torch::kInt32: return DType::kI32;
    case torch::kUInt32: return DType::kU32;
    case torch::kFloat32: return DType::kF32;
    case torch::kFloat64: return DType::kF64;
    case torch::kInt64: return DType::kI64;
    case torch::kUInt64: return DType::kU64;
    case torch::kFloat8_e4m3fn: return DType::kF8_E4M3;
    case torch::kFloat8_e5m2: return DType::kF8_E5M2;
    default:
      throw InputError(fmt::format("torch dtype {} cannot be stored in safetensors (supported: bool, (u)int8-64, "
                                   "float16, bfloat16, float32, float64, float8_e4m3fn, float8_e5m2)",
                                   std::string(c10::toString(type))));
  }
}

torch::Tensor load_tensor(const SafetensorsFile& file, const TensorInfo& info) {
  const auto bytes = file.bytes(info);
  torch::Tensor tensor = torch::empty(info.shape, torch::TensorOptions().dtype(to_torch(info.dtype)));
  VLMOPT_CHECK(static_cast<std::size_t>(tensor.nbytes()) == bytes.size(), "tensor '{}': {} bytes for {} in the file",
               info.name, tensor.nbytes(), bytes.size());
  // memcpy, not from_blob: the mapped data need not be aligned for the element type.
  if (!bytes.empty()) std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
  return tensor;
}

torch::Tensor load_tensor(const Checkpoint& ckpt, std::string_view name) {
  const auto [file, info] = ckpt.locate(name);
  return load_tensor(*file, *info);
}

TensorToWrite to_write(std::string name, const torch::Tensor& contiguous_cpu) {
  VLMOPT_CHECK(contiguous_cpu.defined() && contiguous_cpu.device().is_cpu() && contiguous_cpu.is_contiguous(),
               "to_write('{}') needs a defined, contiguous CPU tensor", name);
  TensorToWrite out;
  out.name = std::move(name);
  out.dtype = from_torch(contiguous_cpu.scalar_type());
  out.shape = contiguous_cpu.sizes().vec();
  const auto nbytes = static_cast<std::size_t>(contiguous_cpu.nbytes());
  out.data = {static_cast<const std::byte*>(contiguous_cpu.const_data_ptr()), nbytes};
  return out;
}

}  // namespace vlmopt::io
