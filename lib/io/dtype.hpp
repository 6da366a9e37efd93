// safetensors dtypes and their sizes; conversion to torch lives in io/torch_bridge.hpp.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace vlmopt::io {

enum class DType {
  kBool, kU8, kI8, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64, kF8_E4M3, kF8_E5M2,
};

// Every dtype, in enum order (for tests and tables).
inline constexpr std::array<DType, 15> kAllDTypes{
    DType::kBool, DType::kU8,  DType::kI8,  DType::kI16, DType::kU16,     DType::kF16,     DType::kBF16, DType::kI32,
    DType::kU32,  DType::kF32, DType::kF64, DType::kI64, DType::kU64, DType::kF8_E4M3, DType::kF8_E5M2,
};

// "F32" -> kF32; nullopt for names we do not know.
std::optional<DType> parse_dtype(std::string_view name);
// kF32 -> "F32" (the spelling safetensors headers use).
std::string_view dtype_name(DType dtype);
// Bytes per element.
std::size_t dtype_size(DType dtype);

}  // namespace vlmopt::io
