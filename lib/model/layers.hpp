// Small building blocks shared by the vision tower, projector and decoder:
// activations by their HF name, LayerNorm, RMSNorm, embedding tables, and the
// eager attention core (with its probabilities tap).
#pragma once

#include "model/taps.hpp"

#include <torch/torch.h>

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::model {

// "[a,b,c]" — the shape spelling used in every error message.
std::string shape_string(c10::IntArrayRef shape);
std::string shape_string(std::span<const int64_t> shape);

// An activation as HF's ACT2FN names it: gelu (exact erf), gelu_pytorch_tanh,
// gelu_new, quick_gelu, silu/swish, relu. Unknown names throw InputError naming `where`.
using Activation = torch::Tensor (*)(const torch::Tensor&);
Activation activation_by_name(std::string_view name, std::string_view where);

class LayerNormImpl : public torch::nn::Module {
 public:
  LayerNormImpl(int64_t dim, double eps, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x) const;
  torch::Tensor weight, bias;  // [dim]
  double eps;
};
TORCH_MODULE(LayerNorm);

// LLaMA/Qwen2 RMSNorm: normalised in fp32, cast back to the input dtype, then
// scaled by the weight (HF's order of casts).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x) const;
  torch::Tensor weight;  // [dim]
  double eps;
};
TORCH_MODULE(RMSNorm);

class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t count, int64_t dim, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& ids) const;  // [...] int64 -> [..., dim]
  torch::Tensor weight;  // [count, dim]
};
TORCH_MODULE(Embedding);

// Additive attention bias value for masked positions, as HF's eager masks use:
// the most negative finite value of `dtype` (a fully masked row becomes uniform, not NaN).
double mask_min_value(torch::ScalarType dtype);

// softmax(q k^T * scale + mask) v, HF eager style: scores in the input dtype,
// softmax in fp32 then cast back. q [B,H,Tq,d]; k, v [B,Hkv,Tk,d] with H a
// multiple of Hkv (each kv head serves H/Hkv consecutive query heads);
// mask [B,1,Tq,Tk] additive or undefined. Emits `probs_tap` ([B,H,Tq,Tk]) when
// wanted. With `fused` and the probabilities unobserved, runs
// at::scaled_dot_product_attention instead. Returns [B,Tq,H*d].
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& mask, double scale, bool fused, const Taps* taps,
                        const std::string& probs_tap, const TapContext& context);

}  // namespace vlmopt::model
