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
#include "model/prune_plan.hpp"
#include "model/taps.hpp"

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace vlmopt::model {

inline constexpr const char* kLanguagePrefix = "model.language_model";

// Keys/values of every decoder layer, [B, kv_heads, T, head_dim] each, grown by
// concatenation along T as tokens are decoded. After a pruned prefill the layers
// behind the cut cache fewer tokens than the sequence has; such layers also keep a key mask.
class KVCache {
 public:
  explicit KVCache(int64_t num_layers = 0)
      : keys_(static_cast<size_t>(num_layers)), values_(keys_.size()), key_masks_(keys_.size()) {}
  int64_t num_layers() const { return static_cast<int64_t>(keys_.size()); }
  // Sequence positions so far: what layer 0 caches (the full sequence, unless an input cut
  // at layer 0 pruned it) plus the positions such a cut dropped before any layer cached them.
  int64_t length() const;
  // An input cut at layer 0 dropped `count` columns of the prompt before layer 0 ran.
  void add_uncached_positions(int64_t count) { uncached_ += count; }
  int64_t length(int64_t layer) const;
  // Appends this step's k/v for `layer` and returns the full (past + new) k/v.
  // `new_key_mask` [B,T_new] (1 = real token; undefined = all real) is recorded when the
  // layer already has a key mask or `record_key_mask` is set (first pruned segment).
  std::pair<torch::Tensor, torch::Tensor> append(int64_t layer, const torch::Tensor& k, const torch::Tensor& v,
                                                 const torch::Tensor& new_key_mask = {},
                                                 bool record_key_mask = false);
  const torch::Tensor& keys(int64_t layer) const { return keys_.at(static_cast<size_t>(layer)); }
  const torch::Tensor& values(int64_t layer) const { return values_.at(static_cast<size_t>(layer)); }
  // [B, length(layer)] bool, true = may be attended; undefined for layers that cache the
  // unpruned sequence (the caller's attention_mask describes those).
  const torch::Tensor& key_mask(int64_t layer) const { return key_masks_.at(static_cast<size_t>(layer)); }
  bool has_key_masks() const;
  void clear();

 private:
  std::vector<torch::Tensor> keys_, values_, key_masks_;
  int64_t uncached_ = 0;  // positions no layer caches (see add_uncached_positions)
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
  // Per-layer additive masks that replace `mask` where defined: decoding steps after a
  // pruned prefill, whose cached layers have different lengths. Empty = `mask` everywhere.
  std::vector<torch::Tensor> layer_masks;
  // [B,T] 1 = real token among the keys this forward appends (recorded by the cache for
  // layers with key masks; undefined = all real), and whether to start key masks.
  torch::Tensor append_key_mask;
  bool record_key_mask = false;
  const torch::Tensor& mask_for(int64_t layer) const {
    const auto l = static_cast<size_t>(layer);
    return l < layer_masks.size() && layer_masks[l].defined() ? layer_masks[l] : mask;
  }
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

  // Attention each key receives at `layer` from the query rows: [B,T] fp32, the softmax
  // probabilities (over all causally visible keys, with inputs.mask_for(layer)) averaged over
  // heads and over the rows where `query_rows` [B,T] bool is true. `layer_input` [B,T,D] is
  // the input of `layer` (before its input_layernorm). Computes q for the last rows that
  // contain every query row and k for all tokens with the layer's own projections (no taps),
  // so it never needs the full TxT matrix and works whatever the attention backend.
  torch::Tensor attention_received(int64_t layer, const torch::Tensor& layer_input, const DecoderInputs& inputs,
                                   const torch::Tensor& query_rows);

  struct PrunedPrefill {
    torch::Tensor hidden;      // [B,T',D] output of the last layer on the kept tokens (left-padded)
    torch::Tensor kept_index;  // [B,T'] int64 index of each slot in the original T tokens, -1 = padding slot
    DecoderInputs inputs;      // inputs of the last segment (tap context of the kept tokens)
    PruneReport report;
  };
  // Prefill with visual-token pruning: runs every layer, applying `plan` after its
  // steps' layers. `inputs` from prepare() with no cached tokens; image_mask [B,T] bool
  // marks the visual tokens. Layers up to a step's layer cache the full sequence, the
  // ones after it the kept tokens (with key masks). `collect` as in run_layers (the
  // collected states shrink after each step).
  PrunedPrefill run_layers_pruned(torch::Tensor hidden, const DecoderInputs& inputs, const torch::Tensor& image_mask,
                                  const PrunePlan& plan, std::vector<torch::Tensor>* collect = nullptr);

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
