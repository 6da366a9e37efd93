// Quantization schemes and the per-Linear parameters calibrate decides: the
// shared vocabulary of calib/ (observers, calibrate), lib/quant (MP-Cache,
// qparams math), lib/bundle (compressed-tensors export) and lib/runtime.
// Field meanings follow compressed-tensors' QuantizationArgs (reference.md §2-3).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::quant {

enum class QuantType { kInt, kFloat };                 // int8/int4, or fp8 e4m3 (num_bits 8)
enum class Strategy { kTensor, kChannel, kGroup };     // compressed-tensors "strategy"
// Which formulas turn ranges into scale/zero point (reference.md §3).
enum class Convention { kTorchAo, kCompressedTensors };

// How one tensor (a weight, or a Linear's input activations) is quantized.
struct QuantArgs {
  int num_bits = 8;
  QuantType type = QuantType::kInt;
  bool symmetric = true;
  Strategy strategy = Strategy::kTensor;
  int64_t group_size = 0;  // kGroup only: channels per group along the input dimension
  bool dynamic = false;    // true: computed at run time (no stored input scale)

  // Integer range: int8 symmetric/affine [-128, 127], int4 [-8, 7]; fp8 e4m3 [-448, 448].
  int64_t qmin() const;
  int64_t qmax() const;
};

enum class SchemeKind { kW8A8, kW8A16, kW4A16, kFP8 };

struct Scheme {
  SchemeKind kind = SchemeKind::kW8A8;
  QuantArgs weights;
  std::optional<QuantArgs> input_activations;  // nullopt: weight-only

  // w8a8: int8 per-channel symmetric weights + static per-tensor symmetric int8 inputs.
  // w8a16: int8 per-channel symmetric weights only. w4a16: int4 symmetric group 128 weights only.
  // fp8: fp8 e4m3 per-channel weights + static per-tensor fp8 inputs.
  static Scheme preset(SchemeKind kind);
  std::string name() const;  // "w8a8", ...
};

// "w8a8" | "w8a16" | "w4a16" | "fp8"; InputError naming the value otherwise.
SchemeKind parse_scheme(std::string_view text);
std::string_view to_string(SchemeKind kind);
std::string_view to_string(Convention convention);
Convention parse_convention(std::string_view text);  // "torch-ao" | "compressed-tensors"

// Quantization parameters of one tensor, shaped as compressed-tensors stores
// them: tensor [1], channel [out,1], group [out, in/group_size].
struct QParams {
  torch::Tensor scale;       // float32
  torch::Tensor zero_point;  // int32, same shape as scale (all zero when symmetric)
};

// What calibrate decided for one quantized Linear.
struct LinearQuant {
  std::string name;                // canonical module name, e.g. model.language_model.layers.0.self_attn.q_proj
  QParams weight;                  // from the weight observer
  // Static input activations as vlmopt's runtime applies them: the range of the
  // channels NOT marked in outlier_channels (those stay FP16). nullopt: weight-only or dynamic.
  std::optional<QParams> input;
  // Static input activations over ALL channels: what goes into the compressed-tensors
  // checkpoint, since HF transformers and vLLM know no outlier channels. Equals
  // `input` when no channel is an outlier.
  std::optional<QParams> input_all_channels;
  torch::Tensor outlier_channels;  // bool [in]: input channels kept in FP16 (LLM.int8()-style); may be all false
  // Linears that a runtime fuses (q/k/v, gate/up of one layer) share one key and
  // one input scale (the max of the group, as vLLM takes it); empty when alone.
  std::string fused_group;
};

struct QuantPlan {
  Scheme scheme;
  Convention convention = Convention::kCompressedTensors;
  std::vector<std::string> ignore;  // explicit canonical names of every Linear left unquantized
  std::vector<LinearQuant> layers;  // in model order
  // Float tensors (canonical names) that calibration changed and that export must
  // take from here instead of the source checkpoint, e.g. SmoothQuant's rescaled
  // norm and Linear weights. Weights of quantized Linears listed here are the ones quantized.
  std::map<std::string, torch::Tensor> replaced_tensors;
};

}  // namespace vlmopt::quant
