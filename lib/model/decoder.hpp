// The LLaMA-style decoder (LLaMA, Qwen2): RMSNorm, half-split RoPE from
// explicit position ids, grouped-query attention with a KV cache, SiLU-gated
// MLP (docs/reference.md §4). Registered as "language_model"; canonical
// parameter names model.language_model.{embed_tokens,layers.N.*,norm}.
//
// Layer-by-layer use (calibration): embed -> prepare(...) once -> run_layers(h, l, l+1, inputs)
// for each l -> final_norm.
#pragma once

#include "io/hf_config.hpp"
#include "model/layers.hpp"
#include "model/linear.hpp"
#include "model/taps.hpp"

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace vlmopt::model {

inline constexpr const char* kLanguagePrefix = "model.language_model";

// Keys/values of every decoder layer, [B, kv_heads, T, head_dim] each, grown by
// concatenation along T as tokens are decoded.
class KVCache {
 public:
  explicit KVCache(int64_t num_layers = 0) : keys_(static_cast<size_t>(num_layers)), values_(keys_.size()) {}
  int64_t num_layers() const { return static_cast<int64_t>(keys_.size()); }
  // Tokens cached so far (layer 0; 0 when empty).
  int64_t length() const;
  // Appends this step's k/v for `layer` and returns the full (past + new) k/v.
  std::pair<torch::Tensor, torch::Tensor> append(int64_t layer, const torch::Tensor& k, const torch::Tensor& v);
  const torch::Tensor& keys(int64_t layer) const { return keys_.at(static_cast<size_t>(layer)); }
  const torch::Tensor& values(int64_t layer) const { return values_.at(static_cast<size_t>(layer)); }
  void clear();

 private:
  std::vector<torch::Tensor> keys_, values_;
};

// Everything the decoder layers need besides the hidden states, computed once
// per forward by LanguageModelImpl::prepare.
struct DecoderInputs {
  torch::Tensor cos, sin;    // [B,T,head_dim] RoPE tables in the compute dtype
  torch::Tensor mask;        // [B or 1, 1, T, past+T] additive: 0 = attend, dtype min = masked
  KVCache* cache = nullptr;  // appended by every layer that runs
  int64_t past_length = 0;   // tokens already in `cache` when prepared
  torch::Tensor image_mask;  // [B,T] bool, for taps (may be undefined)
  torch::Tensor token_mask;  // [B,T] 1 = real token (undefined = no padding), for taps
  TapContext tap_context(int layer) const {
    return TapContext{image_mask.defined() ? &image_mask : nullptr, token_mask.defined() ? &token_mask : nullptr,
                      layer};
  }
};

class DecoderAttentionImpl : public torch::nn::Module {
 public:
  DecoderAttentionImpl(const std::string& prefix, int64_t layer, const io::TextConfig& config, Taps* taps,
                       const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x, const DecoderInputs& inputs, const TapContext& context);
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  bool fused = false;  // at::scaled_dot_product_attention when probs are unobserved

 private:
  int64_t layer_, head_dim_;
  double scale_;
  std::string probs_tap_;
  Taps* taps_;
};
TORCH_MODULE(DecoderAttention);

class DecoderMlpImpl : public torch::nn::Module {
 public:
  DecoderMlpImpl(const std::string& prefix, const io::TextConfig& config, Taps* taps,
                 const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x, const TapContext& context);
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  Activation act_;
};
TORCH_MODULE(DecoderMlp);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(int64_t layer, const io::TextConfig& config, Taps* taps, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& hidden, const DecoderInputs& inputs);
  DecoderAttention self_attn{nullptr};
  DecoderMlp mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};

 private:
  int layer_;
};
TORCH_MODULE(DecoderLayer);

class LanguageModelImpl : public torch::nn::Module {
 public:
  LanguageModelImpl(const io::TextConfig& config, Taps* taps, const torch::TensorOptions& options);

  // [B,T] int64 ids (validated by the caller) -> [B,T,D]; no scaling.
  torch::Tensor embed(const torch::Tensor& input_ids) const;
  // RoPE tables and the causal + padding mask for T new tokens.
  // position_ids [B,T] int64; attention_mask [B, past+T] (1 = token) or undefined;
  // `cache` (may be null) supplies past = cache->length(); image_mask [B,T] for taps or undefined.
  DecoderInputs prepare(const torch::Tensor& position_ids, const torch::Tensor& attention_mask, KVCache* cache,
                        const torch::Tensor& image_mask = {}) const;
  // Runs layers [begin, end) on hidden [B,T,D]. Emits hidden_states.<l+1> after
  // layer l (and hidden_states.0 when begin == 0). When `collect` is given, the
  // input (if begin == 0) and every layer output are appended to it.
  torch::Tensor run_layers(torch::Tensor hidden, int64_t begin, int64_t end, const DecoderInputs& inputs,
                           std::vector<torch::Tensor>* collect = nullptr);
  torch::Tensor final_norm(const torch::Tensor& hidden) const { return norm->forward(hidden); }

  const io::TextConfig& config() const { return config_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
  void set_fused_attention(bool fused);
  // inv_freq [head_dim/2] fp32, as transformers computes it.
  const torch::Tensor& inv_freq() const { return inv_freq_; }

  Embedding embed_tokens{nullptr};
  std::vector<DecoderLayer> layers;
  RMSNorm norm{nullptr};

 private:
  io::TextConfig config_;
  Taps* taps_;
  torch::Tensor inv_freq_;
  std::vector<std::string> hidden_state_taps_;
};
TORCH_MODULE(LanguageModel);

}  // namespace vlmopt::model
