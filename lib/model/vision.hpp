// The ViT vision tower: CLIP (class token, pre-LN, no conv bias) and SigLIP
// (conv bias, no class token, no pre-LN) in one implementation
// (docs/reference.md §4). Module names mirror transformers' so parameter names
// are canonical: model.vision_tower.vision_model.{embeddings,pre_layrnorm,encoder.layers.N,post_layernorm,head}.
#pragma once

#include "io/hf_config.hpp"
#include "model/layers.hpp"
#include "model/linear.hpp"
#include "model/taps.hpp"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace vlmopt::model {

inline constexpr const char* kVisionPrefix = "model.vision_tower.vision_model";

class VisionEmbeddingsImpl : public torch::nn::Module {
 public:
  VisionEmbeddingsImpl(const io::VisionConfig& config, const torch::TensorOptions& options);
  // pixel_values [B,C,H,W] (already validated) -> [B, patches (+1 class token), D]
  torch::Tensor forward(const torch::Tensor& pixel_values) const;

  torch::Tensor patch_weight;     // [D, C, P, P]
  torch::Tensor patch_bias;       // [D] (SigLIP) or undefined (CLIP)
  torch::Tensor class_embedding;  // [D] (CLIP) or undefined
  Embedding position_embedding{nullptr};  // [positions, D]
 private:
  int64_t patch_size_;
};
TORCH_MODULE(VisionEmbeddings);

class VisionAttentionImpl : public torch::nn::Module {
 public:
  VisionAttentionImpl(const std::string& prefix, const io::VisionConfig& config, Taps* taps,
                      const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x, const TapContext& context);
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  bool fused = false;  // at::scaled_dot_product_attention when probs are unobserved

 private:
  int64_t heads_, head_dim_;
  double scale_;
  std::string probs_tap_;
  Taps* taps_;
};
TORCH_MODULE(VisionAttention);

class VisionMlpImpl : public torch::nn::Module {
 public:
  VisionMlpImpl(const std::string& prefix, const io::VisionConfig& config, Taps* taps,
                const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x, const TapContext& context);
  Linear fc1{nullptr}, fc2{nullptr};

 private:
  Activation act_;
};
TORCH_MODULE(VisionMlp);

class VisionEncoderLayerImpl : public torch::nn::Module {
 public:
  VisionEncoderLayerImpl(const std::string& prefix, const io::VisionConfig& config, Taps* taps,
                         const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& hidden, const TapContext& context);
  VisionAttention self_attn{nullptr};
  LayerNorm layer_norm1{nullptr};
  VisionMlp mlp{nullptr};
  LayerNorm layer_norm2{nullptr};
};
TORCH_MODULE(VisionEncoderLayer);

// SigLIP's attention-pooling head: part of the checkpoint (loaded so a bundle
// can write it back) but never run by LLaVA, which reads hidden states.
class SiglipHeadImpl : public torch::nn::Module {
 public:
  SiglipHeadImpl(const io::VisionConfig& config, const torch::TensorOptions& options);
};
TORCH_MODULE(SiglipHead);

// Registered as "vision_tower"; holds "vision_model".
class VisionTowerImpl : public torch::nn::Module {
 public:
  // `with_siglip_head`: SigLIP's `vision_use_head` (default true).
  VisionTowerImpl(const io::VisionConfig& config, bool with_siglip_head, Taps* taps,
                  const torch::TensorOptions& options);

  // Hidden states 0..`count`-1 (runs count-1 encoder layers): [0] is the
  // embedding output (after pre-LN for CLIP), [k] the output of layer k-1.
  // post_layernorm is not applied (LLaVA never uses it). Emits
  // "model.vision_tower.hidden_states.<k>" when wanted. pixel_values must be
  // validated by the caller (validate_pixels).
  std::vector<torch::Tensor> hidden_states(const torch::Tensor& pixel_values, int64_t count);
  // Throws InputError unless pixel_values is floating [B, channels, image_size, image_size].
  void validate_pixels(const torch::Tensor& pixel_values) const;

  const io::VisionConfig& config() const { return config_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
  void set_fused_attention(bool fused);

  VisionEmbeddings embeddings{nullptr};
  LayerNorm pre_layrnorm{nullptr};  // CLIP only
  std::vector<VisionEncoderLayer> layers;
  LayerNorm post_layernorm{nullptr};
  SiglipHead head{nullptr};  // SigLIP with vision_use_head only

 private:
  io::VisionConfig config_;
  Taps* taps_;
  std::vector<std::string> hidden_state_taps_;
};
TORCH_MODULE(VisionTower);

}  // namespace vlmopt::model
