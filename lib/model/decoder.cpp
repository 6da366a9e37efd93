#include "model/decoder.hpp"

#include "util/error.hpp"

#include <cmath>

namespace vlmopt::model {

namespace {

// cat(-x2, x1) of the two halves of the last dim (half split, not interleaved).
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

}  // namespace

int64_t KVCache::length() const {
  if (keys_.empty() || !keys_.front().defined()) return 0;
  return keys_.front().size(2);
}

std::pair<torch::Tensor, torch::Tensor> KVCache::append(int64_t layer, const torch::Tensor& k, const torch::Tensor& v) {
  VLMOPT_CHECK(layer >= 0 && layer < num_layers(), "KV cache layer {} of {}", layer, num_layers());
  auto& keys = keys_[static_cast<size_t>(layer)];
  auto& values = values_[static_cast<size_t>(layer)];
  if (!keys.defined()) {
    keys = k;
    values = v;
  } else {
    VLMOPT_CHECK(keys.size(0) == k.size(0) && keys.size(1) == k.size(1) && keys.size(3) == k.size(3),
                 "KV cache layer {}: cached {} vs new {}", layer, shape_string(keys.sizes()), shape_string(k.sizes()));
    keys = torch::cat({keys, k}, 2);
    values = torch::cat({values, v}, 2);
  }
  return {keys, values};
}

void KVCache::clear() {
  for (auto& t : keys_) t = torch::Tensor();
  for (auto& t : values_) t = torch::Tensor();
}

DecoderAttentionImpl::DecoderAttentionImpl(const std::string& prefix, int64_t layer, const io::TextConfig& config,
                                           Taps* taps, const torch::TensorOptions& options)
    : layer_(layer),
      head_dim_(config.head_dim),
      scale_(std::pow(static_cast<double>(config.head_dim), -0.5)),
      probs_tap_(prefix + ".probs"),
      taps_(taps) {
  // LLaMA: attention_bias on all four; Qwen2: q/k/v biased, o_proj never.
  const bool qwen2 = config.model_type == "qwen2";
  const bool qkv_bias = config.qkv_bias || config.attention_bias || qwen2;
  const bool o_bias = config.o_bias || (config.attention_bias && !qwen2);
  const int64_t dim = config.hidden_size;
  const int64_t q_dim = config.num_attention_heads * config.head_dim;
  const int64_t kv_dim = config.num_key_value_heads * config.head_dim;
  q_proj = register_module("q_proj", Linear(prefix + ".q_proj", dim, q_dim, qkv_bias, taps, options));
  k_proj = register_module("k_proj", Linear(prefix + ".k_proj", dim, kv_dim, qkv_bias, taps, options));
  v_proj = register_module("v_proj", Linear(prefix + ".v_proj", dim, kv_dim, qkv_bias, taps, options));
  o_proj = register_module("o_proj", Linear(prefix + ".o_proj", q_dim, dim, o_bias, taps, options));
}

torch::Tensor DecoderAttentionImpl::forward(const torch::Tensor& x, const DecoderInputs& inputs,
                                            const TapContext& context) {
  const int64_t batch = x.size(0), tokens = x.size(1);
  const auto heads_view = [&](const torch::Tensor& t) { return t.view({batch, tokens, -1, head_dim_}).transpose(1, 2); };
  auto q = heads_view(q_proj(x, context));
  auto k = heads_view(k_proj(x, context));
  auto v = heads_view(v_proj(x, context));
  const auto cos = inputs.cos.unsqueeze(1), sin = inputs.sin.unsqueeze(1);  // [B,1,T,d]
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (inputs.cache != nullptr) std::tie(k, v) = inputs.cache->append(layer_, k, v);
  const auto attended = attention(q, k, v, inputs.mask, scale_, fused, taps_, probs_tap_, context);
  return o_proj(attended, context);
}

DecoderMlpImpl::DecoderMlpImpl(const std::string& prefix, const io::TextConfig& config, Taps* taps,
                               const torch::TensorOptions& options)
    : act_(activation_by_name(config.hidden_act, "text_config.hidden_act")) {
  const int64_t dim = config.hidden_size, inner = config.intermediate_size;
  const bool bias = config.mlp_bias;
  gate_proj = register_module("gate_proj", Linear(prefix + ".gate_proj", dim, inner, bias, taps, options));
  up_proj = register_module("up_proj", Linear(prefix + ".up_proj", dim, inner, bias, taps, options));
  down_proj = register_module("down_proj", Linear(prefix + ".down_proj", inner, dim, bias, taps, options));
}

torch::Tensor DecoderMlpImpl::forward(const torch::Tensor& x, const TapContext& context) {
  return down_proj(act_(gate_proj(x, context)) * up_proj(x, context), context);
}

DecoderLayerImpl::DecoderLayerImpl(int64_t layer, const io::TextConfig& config, Taps* taps,
                                   const torch::TensorOptions& options)
    : layer_(static_cast<int>(layer)) {
  const std::string prefix = fmt::format("{}.layers.{}", kLanguagePrefix, layer);
  self_attn = register_module("self_attn", DecoderAttention(prefix + ".self_attn", layer, config, taps, options));
  mlp = register_module("mlp", DecoderMlp(prefix + ".mlp", config, taps, options));
  input_layernorm = register_module("input_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps, options));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps, options));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& hidden, const DecoderInputs& inputs) {
  const TapContext context = inputs.tap_context(layer_);
  auto h = hidden + self_attn(input_layernorm(hidden), inputs, context);
  return h + mlp(post_attention_layernorm(h), context);
}

LanguageModelImpl::LanguageModelImpl(const io::TextConfig& config, Taps* taps, const torch::TensorOptions& options)
    : config_(config), taps_(taps) {
  VLMOPT_CHECK_INPUT(config.model_type == "llama" || config.model_type == "qwen2",
                     "config.json: text_config.model_type (expected llama or qwen2, got '{}')", config.model_type);
  VLMOPT_CHECK_INPUT(config.num_attention_heads > 0 && config.num_key_value_heads > 0 &&
                         config.num_attention_heads % config.num_key_value_heads == 0,
                     "config.json: text_config.num_attention_heads {} must be a multiple of num_key_value_heads {}",
                     config.num_attention_heads, config.num_key_value_heads);
  VLMOPT_CHECK_INPUT(config.head_dim > 0 && config.head_dim % 2 == 0,
                     "config.json: text_config.head_dim (expected a positive even number, got {})", config.head_dim);
  VLMOPT_CHECK_INPUT(config.hidden_size > 0 && config.intermediate_size > 0 && config.vocab_size > 0 &&
                         config.num_hidden_layers >= 0,
                     "config.json: text_config sizes must be positive (hidden {}, intermediate {}, vocab {})",
                     config.hidden_size, config.intermediate_size, config.vocab_size);
  VLMOPT_CHECK_INPUT(config.rope_theta > 0.0, "config.json: text_config.rope_theta (expected > 0, got {})",
                     config.rope_theta);
  embed_tokens = register_module("embed_tokens", Embedding(config.vocab_size, config.hidden_size, options));
  auto layer_list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers.push_back(DecoderLayer(i, config, taps, options));
    layer_list->push_back(layers.back());
  }
  norm = register_module("norm", RMSNorm(config.hidden_size, config.rms_norm_eps, options));
  // inv_freq = 1 / theta^(arange(0, d, 2) / d), in fp32 on the CPU like transformers, then moved.
  const int64_t d = config.head_dim;
  const auto exponent = torch::arange(0, d, 2, torch::kInt64).to(torch::kFloat32) / static_cast<double>(d);
  inv_freq_ = torch::pow(config.rope_theta, exponent).reciprocal().to(options.device());
  for (int64_t k = 0; k <= config.num_hidden_layers; ++k) {
    hidden_state_taps_.push_back(fmt::format("{}.hidden_states.{}", kLanguagePrefix, k));
  }
}

torch::Tensor LanguageModelImpl::embed(const torch::Tensor& input_ids) const { return embed_tokens->forward(input_ids); }

DecoderInputs LanguageModelImpl::prepare(const torch::Tensor& position_ids, const torch::Tensor& attention_mask,
                                         KVCache* cache, const torch::Tensor& image_mask) const {
  const auto device = embed_tokens->weight.device();
  const auto dtype = embed_tokens->weight.scalar_type();
  VLMOPT_CHECK(position_ids.dim() == 2, "position_ids must be [B,T], got {}", shape_string(position_ids.sizes()));
  const int64_t batch = position_ids.size(0), tokens = position_ids.size(1);
  DecoderInputs inputs;
  inputs.cache = cache;
  inputs.past_length = cache != nullptr ? cache->length() : 0;
  const int64_t total = inputs.past_length + tokens;

  // freqs[b,t,i] = position[b,t] * inv_freq[i] (one fp32 product, as HF's rank-1 matmul).
  const auto freqs = position_ids.to(device, torch::kFloat32).unsqueeze(-1) * inv_freq_;
  const auto emb = torch::cat({freqs, freqs}, -1);
  inputs.cos = emb.cos().to(dtype);
  inputs.sin = emb.sin().to(dtype);

  // Causal on cache positions (query i sits at past+i) and, when given, padding.
  const auto options = torch::TensorOptions().device(device).dtype(torch::kInt64);
  const auto query_pos = torch::arange(inputs.past_length, total, options).unsqueeze(1);  // [T,1]
  const auto key_pos = torch::arange(total, options).unsqueeze(0);                        // [1,S]
  auto allowed = (key_pos <= query_pos).unsqueeze(0);                                     // [1,T,S]
  if (attention_mask.defined()) {
    VLMOPT_CHECK(attention_mask.dim() == 2 && attention_mask.size(0) == batch && attention_mask.size(1) == total,
                 "attention_mask expected [{},{}], got {}", batch, total, shape_string(attention_mask.sizes()));
    const auto keep = attention_mask.to(device).to(torch::kBool);
    allowed = allowed.logical_and(keep.unsqueeze(1));  // [B,T,S]
    inputs.token_mask = attention_mask.slice(1, inputs.past_length).to(device);
  }
  inputs.mask = torch::zeros(allowed.sizes(), torch::TensorOptions().device(device).dtype(dtype))
                    .masked_fill(allowed.logical_not(), mask_min_value(dtype))
                    .unsqueeze(1);
  if (image_mask.defined()) inputs.image_mask = image_mask;
  return inputs;
}

torch::Tensor LanguageModelImpl::run_layers(torch::Tensor hidden, int64_t begin, int64_t end,
                                            const DecoderInputs& inputs, std::vector<torch::Tensor>* collect) {
  VLMOPT_CHECK(begin >= 0 && begin <= end && end <= num_layers(), "decoder layers [{}, {}) of {}", begin, end,
               num_layers());
  const auto publish = [&](int64_t k, const torch::Tensor& t) {
    const auto& name = hidden_state_taps_[static_cast<size_t>(k)];
    if (tap_wanted(taps_, name)) taps_->emit(name, t, inputs.tap_context(static_cast<int>(k) - 1));
  };
  if (begin == 0) {
    publish(0, hidden);
    if (collect != nullptr) collect->push_back(hidden);
  }
  for (int64_t l = begin; l < end; ++l) {
    hidden = layers[static_cast<size_t>(l)]->forward(hidden, inputs);
    publish(l + 1, hidden);
    if (collect != nullptr) collect->push_back(hidden);
  }
  return hidden;
}

void LanguageModelImpl::set_fused_attention(bool fused) {
  for (auto& layer : layers) layer->self_attn->fused = fused;
}

}  // namespace vlmopt::model
