#include "io/dtype.hpp"

#include "util/error.hpp"

#include <array>

namespace vlmopt::io {
namespace {

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  std::size_t size;  // bytes per element
};

constexpr std::array<DTypeEntry, 15> kDTypes{{
    {DType::kBool, "BOOL", 1},
    {DType::kU8, "U8", 1},
    {DType::kI8, "I8", 1},
    {DType::kI16, "I16", 2},
    {DType::kU16, "U16", 2},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kI32, "I32", 4},
    {DType::kU32, "U32", 4},
    {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},
    {DType::kI64, "I64", 8},
    {DType::kU64, "U64", 8},
    {DType::kF8_E4M3, "F8_E4M3", 1},
    {DType::kF8_E5M2, "F8_E5M2", 1},
}};

const DTypeEntry& entry(DType dtype) {
  for (const auto& e : kDTypes) {
    if (e.dtype == dtype) return e;
  }
  throw Error(ExitCode::kInternal, fmt::format("unknown DType value {}", static_cast<int>(dtype)));
}

}  // namespace

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& e : kDTypes) {
    if (e.name == name) return e.dtype;
  }
  return std::nullopt;
}

std::string_view dtype_name(DType dtype) { return entry(dtype).name; }

std::size_t dtype_size(DType dtype) { return entry(dtype).size; }

}  // namespace vlmopt::io
