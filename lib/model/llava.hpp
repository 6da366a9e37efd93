// The native LLaVA model: vision tower -> projector -> token merge -> LLaMA/Qwen2
// decoder -> lm_head, numerically matching transformers' eager fp32 forward.
// Parameter names are canonical (see weights.hpp); taps (taps.hpp) observe
// every Linear, attention probabilities and hidden states.
#pragma once

#include "io/hf_config.hpp"
#include "model/decoder.hpp"
#include "model/linear.hpp"
#include "model/projector.hpp"
#include "model/prune_plan.hpp"
#include "model/taps.hpp"
#include "model/vision.hpp"
#include "model/weights.hpp"

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace vlmopt::model {

struct ForwardInputs {
  torch::Tensor input_ids;       // [B,T] integer token ids
  torch::Tensor pixel_values;    // optional [images,C,H,W]; features fill the image tokens in order
  torch::Tensor attention_mask;  // optional [B, past+T], 1 = token, 0 = padding (left padding supported)
  // optional [B,T]; default: cumsum(attention_mask)-1 with 0 at padding (HF generate),
  // or past..past+T-1 without a mask. Pass explicitly when tokens were dropped.
  torch::Tensor position_ids;
  KVCache* cache = nullptr;  // appended to; its length is the number of past tokens
  bool output_hidden_states = false;
  int64_t logits_to_keep = 0;  // 0 = logits for every position, n = for the last n
  bool enable_grad = false;    // false: the forward runs under torch::NoGradGuard
};

struct ModelOutput {
  torch::Tensor logits;  // [B, T or logits_to_keep, V], model dtype
  // With output_hidden_states, transformers' convention: [0] the decoder input,
  // [k] the output of layer k-1, and the last one after the final norm.
  std::vector<torch::Tensor> hidden_states;
  torch::Tensor image_features;  // [images, N, D_text] when pixel_values were given
  // After a pruned prefill (see set_prune_plan): [B,T'] int64, the index in input_ids of
  // each output position (-1 = padding slot); logits and hidden states cover these T'
  // positions. Undefined when nothing was pruned.
  torch::Tensor kept_index;
};

struct ParameterCounts {
  int64_t vision = 0;     // model.vision_tower.*
  int64_t projector = 0;  // model.multi_modal_projector.*
  int64_t language = 0;   // model.language_model.*
  int64_t lm_head = 0;    // 0 when tied to the embeddings
  int64_t total() const { return vision + projector + language + lm_head; }
};

enum class AttentionBackend {
  kEager,  // explicit matmul + fp32 softmax, as transformers' eager attention
  kFused,  // at::scaled_dot_product_attention wherever probabilities are not tapped
};

class LlavaModel {
 public:
  // Reads <dir>/config.json and the safetensors checkpoint in `dir`.
  static LlavaModel load(const std::filesystem::path& dir, torch::Device device,
                         torch::ScalarType dtype = torch::kFloat32);
  static LlavaModel load(const io::LlavaConfig& config, const TensorSource& source, torch::Device device,
                         torch::ScalarType dtype = torch::kFloat32);
  // Everything but the decoder layers, whose parameters stay allocated but
  // untouched (no resident memory) until load_decoder_layer(). For layer-by-layer
  // calibration of models larger than memory: load layer l, run all samples
  // through it, release_decoder_layer(l), go on with l+1.
  static LlavaModel load_deferred(const std::filesystem::path& dir, torch::Device device,
                                  torch::ScalarType dtype = torch::kFloat32);
  // Loads decoder layer `layer` from the checkpoint given to load_deferred.
  void load_decoder_layer(int64_t layer);
  // Frees the parameters of decoder layer `layer` (they become empty tensors) and
  // drops their mapped checkpoint pages; the layer cannot run again until reloaded.
  void release_decoder_layer(int64_t layer);
  // Randomly initialised model of `config` (tests, smoke runs); deterministic in `seed`
  // on every device.
  static LlavaModel random(const io::LlavaConfig& config, uint64_t seed, torch::Device device = torch::kCPU,
                           torch::ScalarType dtype = torch::kFloat32);

  LlavaModel(LlavaModel&&) noexcept = default;
  LlavaModel& operator=(LlavaModel&&) noexcept = default;

  const io::LlavaConfig& config() const { return config_; }
  Taps& taps() { return *taps_; }
  torch::Device device() const { return device_; }
  torch::ScalarType dtype() const { return dtype_; }
  KeyLayout key_layout() const { return layout_; }  // layout of the checkpoint loaded (kNew for random)
  bool lm_head_tied() const { return tied_; }
  void set_attention_backend(AttentionBackend backend);
  AttentionBackend attention_backend() const { return backend_; }
  // Visual-token pruning applied by every prefill (forward with an empty or no KV cache
  // whose input_ids contain image tokens); nullopt or no steps = off. InputError when the
  // plan does not fit this model.
  void set_prune_plan(std::optional<PrunePlan> plan);
  const std::optional<PrunePlan>& prune_plan() const { return prune_plan_; }
  // What the last prefill pruned (empty when it pruned nothing).
  const PruneReport& last_prune_report() const { return last_prune_report_; }

  // --- whole forward passes ---
  ModelOutput forward(const ForwardInputs& inputs);
  // Projector output for each image: [images, N, D_text] (N = image tokens per image).
  torch::Tensor image_features(const torch::Tensor& pixel_values);
  // Greedy decoding with the KV cache. The prompt may be a left-padded batch
  // (attention_mask); `prompt.cache` must be null. Returns, per sample, the new
  // tokens up to and including the first of `eos_ids` (at most max_new_tokens).
  std::vector<std::vector<int64_t>> generate_greedy(const ForwardInputs& prompt, int max_new_tokens,
                                                    std::vector<int64_t> eos_ids);

  // --- lower-level pieces (layer-by-layer calibration, pruning) ---
  // Vision hidden states 0..k (k = the deepest selected by vision_feature_layer).
  std::vector<torch::Tensor> vision_hidden_states(const torch::Tensor& pixel_values);
  // vision_feature_layer / select strategy applied: [images, N, D_vision * layers].
  torch::Tensor select_vision_features(const std::vector<torch::Tensor>& hidden_states) const;
  // [B,T] bool, true where input_ids == image_token_id.
  torch::Tensor image_token_mask(const torch::Tensor& input_ids) const;
  // Token embeddings with `image_features` ([images,N,D] or [M,D]; may be
  // undefined) scattered into the image-token positions in order. Throws
  // InputError "image tokens in input_ids: N, image features: M" on a count mismatch.
  torch::Tensor embed(const torch::Tensor& input_ids, const torch::Tensor& image_features);
  // Default position ids for T tokens after `past` cached ones (see ForwardInputs).
  torch::Tensor default_position_ids(const torch::Tensor& attention_mask, int64_t batch, int64_t tokens,
                                     int64_t past) const;
  // Final norm + lm_head on decoder output [B,T,D] -> logits [B,T,V]; emits lm_head taps.
  torch::Tensor logits(const torch::Tensor& decoder_output, const DecoderInputs& inputs);

  VisionTower& vision_tower() { return vision_; }
  Projector& projector() { return projector_; }
  LanguageModel& language_model() { return language_; }
  Linear& lm_head() { return lm_head_; }
  // Root of the module tree; its named_parameters() are the canonical names.
  torch::nn::Module& module() { return *root_; }

  // Every Linear by canonical name, in module order (vision, projector, decoder, lm_head).
  std::vector<std::pair<std::string, Linear>> linears();
  // Every parameter by canonical name, each tensor once (a tied lm_head is left out).
  std::vector<std::pair<std::string, torch::Tensor>> named_tensors() const;
  ParameterCounts parameter_counts() const;

 private:
  LlavaModel(io::LlavaConfig config, torch::Device device, torch::ScalarType dtype);
  void tie_lm_head();
  void check_input_ids(const torch::Tensor& input_ids) const;

  io::LlavaConfig config_;
  torch::Device device_;
  torch::ScalarType dtype_;
  std::shared_ptr<const TensorSource> deferred_source_;  // set by load_deferred
  std::map<std::string, std::vector<int64_t>> released_shapes_;  // "<layer>.<param>" -> shape
  std::unique_ptr<Taps> taps_;  // heap-allocated: modules keep a pointer to it across moves
  std::shared_ptr<torch::nn::Module> root_;
  VisionTower vision_{nullptr};
  Projector projector_{nullptr};
  LanguageModel language_{nullptr};
  Linear lm_head_{nullptr};
  KeyLayout layout_ = KeyLayout::kNew;
  bool tied_ = false;
  AttentionBackend backend_ = AttentionBackend::kEager;
  std::optional<PrunePlan> prune_plan_;
  PruneReport last_prune_report_;
  std::vector<int64_t> feature_states_;  // vision_feature_layer as hidden-state indices 0..L
  int64_t vision_states_needed_ = 1;     // hidden states to compute (max index + 1)
};

}  // namespace vlmopt::model
