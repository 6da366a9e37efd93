// Quantization scheme vocabulary (see scheme.hpp).
#include "quant/scheme.hpp"

#include "util/error.hpp"

#include <fmt/format.h>

namespace vlmopt::quant {

int64_t QuantArgs::qmin() const {
  if (type == QuantType::kFloat) return -448;  // fp8 e4m3fn: largest finite magnitude
  return -(int64_t{1} << (num_bits - 1));
}

int64_t QuantArgs::qmax() const {
  if (type == QuantType::kFloat) return 448;
  return (int64_t{1} << (num_bits - 1)) - 1;
}

Scheme Scheme::preset(SchemeKind kind) {
  Scheme scheme;
  scheme.kind = kind;
  QuantArgs channel_weights;
  channel_weights.strategy = Strategy::kChannel;
  QuantArgs static_tensor_inputs;  // defaults: 8-bit int, symmetric, per tensor, static
  switch (kind) {
    case SchemeKind::kW8A8:
      scheme.weights = channel_weights;
      scheme.input_activations = static_tensor_inputs;
      break;
    case SchemeKind::kW8A16:
      scheme.weights = channel_weights;
      break;
    case SchemeKind::kW4A16:
      scheme.weights.num_bits = 4;
      scheme.weights.strategy = Strategy::kGroup;
      scheme.weights.group_size = 128;
      break;
    case SchemeKind::kFP8:
      scheme.weights = channel_weights;
      scheme.weights.type = QuantType::kFloat;
      scheme.input_activations = static_tensor_inputs;
      scheme.input_activations->type = QuantType::kFloat;
      break;
  }
  return scheme;
}

std::string Scheme::name() const { return std::string(to_string(kind)); }

SchemeKind parse_scheme(std::string_view text) {
  for (SchemeKind kind : {SchemeKind::kW8A8, SchemeKind::kW8A16, SchemeKind::kW4A16, SchemeKind::kFP8}) {
    if (text == to_string(kind)) return kind;
  }
  throw InputError(fmt::format("scheme: expected one of w8a8, w8a16, w4a16, fp8, got '{}'", text));
}

std::string_view to_string(SchemeKind kind) {
  switch (kind) {
    case SchemeKind::kW8A8: return "w8a8";
    case SchemeKind::kW8A16: return "w8a16";
    case SchemeKind::kW4A16: return "w4a16";
    case SchemeKind::kFP8: return "fp8";
  }
  return "?";
}

std::string_view to_string(Convention convention) {
  switch (convention) {
    case Convention::kTorchAo: return "torch-ao";
    case Convention::kCompressedTensors: return "compressed-tensors";
  }
  return "?";
}

Convention parse_convention(std::string_view text) {
  for (Convention convention : {Convention::kTorchAo, Convention::kCompressedTensors}) {
    if (text == to_string(convention)) return convention;
  }
  throw InputError(fmt::format("convention: expected one of torch-ao, compressed-tensors, got '{}'", text));
}

}  // namespace vlmopt::quant
