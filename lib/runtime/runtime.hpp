// vlmopt's runtime for bundles (design.md §5): loads a bundle's compressed-tensors
// checkpoint into a model::LlavaModel and gives each quantized Linear a kernel.
//
// Kernels (same answers up to float rounding):
//   kFakeQuant: dequantized weights; inputs fake-quantized with the static scale.
//   kInt8:      int8 x int8 -> int32 GEMM (at::_int_mm, CPU and CUDA), rescaled by s_x * s_w.
//               Schemes without static int8 inputs (w8a16, w4a16) run their dequantized
//               weights densely either way; fp8 has no int8 path (InputError).
// use_mp_cache = true and vlmopt/mp_cache.bin present: each quantized Linear's input
// scale comes from its MP-Cache activation entry, and the channels its mask marks
// bypass quantization through an FP16 path with the weight columns stored in
// vlmopt/outliers.safetensors.
// use_mp_cache = false: exactly what compressed-tensors computes (all channels
// quantized with the checkpoint's input_scale), for comparisons with HF transformers.
#pragma once

#include "bundle/manifest.hpp"
#include "model/llava.hpp"

#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

namespace vlmopt::runtime {

enum class KernelKind { kFakeQuant, kInt8 };
KernelKind parse_kernel_kind(const std::string& text);  // "fake" | "int8"; InputError otherwise

struct RuntimeOptions {
  KernelKind kernels = KernelKind::kFakeQuant;
  bool use_mp_cache = true;
  torch::ScalarType dtype = torch::kFloat32;  // compute dtype of the unquantized parts
  // Fake-quant kernels pass gradients straight through the input rounding (identity
  // gradient, forward values bit-identical) when their input requires grad: training
  // something upstream of quantized Linears (compensate). Off: round() gives zero gradient.
  bool straight_through = false;
};

struct LoadedBundle {
  std::filesystem::path dir;
  model::LlavaModel model;
  bundle::Manifest manifest;
  std::string format;                         // quantization_config.format
  std::vector<std::string> quantized_layers;  // canonical names, module order
  std::vector<std::string> outlier_layers;    // layers running the FP16 outlier path
};

// Reads the manifest (schema only: run verify for hashes), config.json and the
// checkpoint; InputError for a malformed bundle.
LoadedBundle load_bundle(const std::filesystem::path& bundle, torch::Device device, const RuntimeOptions& options = {});

}  // namespace vlmopt::runtime
