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

// Additive attention mask from allowed [B or 1, Tq, S] bool: 0 = attend, dtype min = masked.
torch::Tensor additive_mask(const torch::Tensor& allowed, torch::ScalarType dtype) {
  return torch::zeros(allowed.sizes(), torch::TensorOptions().device(allowed.device()).dtype(dtype))
      .masked_fill(allowed.logical_not(), mask_min_value(dtype))
      .unsqueeze(1);
}

// x W^T + b through the layer's kernel but without its taps (scoring is not part of the forward).
torch::Tensor untapped(Linear& linear, const torch::Tensor& x) {
  return linear->kernel ? linear->kernel->forward(*linear, x) : linear->dense(x);
}

std::vector<int64_t> per_sample_counts(const torch::Tensor& mask) {
  const auto counts = mask.sum(1).to(torch::kCPU, torch::kInt64).contiguous();
  return {counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel()};
}

}  // namespace

int64_t KVCache::length() const {
  if (keys_.empty() || !keys_.front().defined()) return 0;
  return keys_.front().size(2) + uncached_;
}

int64_t KVCache::length(int64_t layer) const {
  const auto& k = keys_.at(static_cast<size_t>(layer));
  return k.defined() ? k.size(2) : 0;
}

bool KVCache::has_key_masks() const {
  for (const auto& m : key_masks_)
    if (m.defined()) return true;
  return false;
}

std::pair<torch::Tensor, torch::Tensor> KVCache::append(int64_t layer, const torch::Tensor& k, const torch::Tensor& v,
                                                        const torch::Tensor& new_key_mask, bool record_key_mask) {
  VLMOPT_CHECK(layer >= 0 && layer < num_layers(), "KV cache layer {} of {}", layer, num_layers());
  auto& keys = keys_[static_cast<size_t>(layer)];
  auto& values = values_[static_cast<size_t>(layer)];
  auto& key_mask = key_masks_[static_cast<size_t>(layer)];
  if (key_mask.defined() || record_key_mask) {
    auto added = new_key_mask.defined() ? new_key_mask.to(k.device()).to(torch::kBool)
                                        : torch::ones({k.size(0), k.size(2)}, k.options().dtype(torch::kBool));
    VLMOPT_CHECK(added.size(0) == k.size(0) && added.size(1) == k.size(2), "KV cache layer {}: key mask {} for keys {}",
                 layer, shape_string(added.sizes()), shape_string(k.sizes()));
    if (!key_mask.defined() && keys.defined()) {
      // Start masking a layer that already caches an unpruned sequence: all of it was attendable.
      key_mask = torch::ones({keys.size(0), keys.size(2)}, added.options());
    }
    key_mask = key_mask.defined() ? torch::cat({key_mask, added}, 1) : added;
  }
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
  for (auto& t : key_masks_) t = torch::Tensor();
  uncached_ = 0;
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
  if (inputs.cache != nullptr)
    std::tie(k, v) = inputs.cache->append(layer_, k, v, inputs.append_key_mask, inputs.record_key_mask);
  const auto attended = attention(q, k, v, inputs.mask_for(layer_), scale_, fused, taps_, probs_tap_, context);
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
  if (cache != nullptr && cache->has_key_masks()) {
    // After a pruned prefill: layers behind the cut attend to their own (shorter) cache,
    // described by its key mask, plus the new tokens causally.
    const auto new_keys = attention_mask.defined()
                              ? attention_mask.slice(1, inputs.past_length).to(device).to(torch::kBool)
                              : torch::ones({batch, tokens}, torch::TensorOptions().device(device).dtype(torch::kBool));
    inputs.append_key_mask = new_keys;
    inputs.layer_masks.resize(static_cast<size_t>(num_layers()));
    for (int64_t l = 0; l < num_layers(); ++l) {
      const auto& cached = cache->key_mask(l);
      if (!cached.defined()) continue;
      VLMOPT_CHECK(cached.size(0) == batch, "KV cache layer {}: key mask batch {} vs {}", l, cached.size(0), batch);
      const int64_t held = cached.size(1);
      const auto keys = torch::cat({cached.to(device), new_keys}, 1);                           // [B,S]
      const auto key_index = torch::arange(held + tokens, options).unsqueeze(0);                 // [1,S]
      const auto query_index = torch::arange(held, held + tokens, options).unsqueeze(1);         // [T,1]
      const auto layer_allowed = (key_index <= query_index).unsqueeze(0).logical_and(keys.unsqueeze(1));
      inputs.layer_masks[static_cast<size_t>(l)] = additive_mask(layer_allowed, dtype);
    }
  }
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

torch::Tensor LanguageModelImpl::attention_received(int64_t layer, const torch::Tensor& layer_input,
                                                    const DecoderInputs& inputs, const torch::Tensor& query_rows) {
  VLMOPT_CHECK(layer >= 0 && layer < num_layers(), "decoder layer {} of {}", layer, num_layers());
  const int64_t batch = layer_input.size(0), tokens = layer_input.size(1);
  VLMOPT_CHECK(query_rows.dim() == 2 && query_rows.size(0) == batch && query_rows.size(1) == tokens,
               "query rows {} for hidden {}", shape_string(query_rows.sizes()), shape_string(layer_input.sizes()));
  const auto rows = query_rows.to(layer_input.device()).to(torch::kBool);
  const auto any_row = rows.any(0).nonzero();
  VLMOPT_CHECK(any_row.numel() > 0, "attention_received: no query rows");
  const int64_t first = any_row.min().item<int64_t>();
  const int64_t query_count = tokens - first;
  auto& module = layers[static_cast<size_t>(layer)];
  auto& attn = module->self_attn;
  const int64_t head_dim = config_.head_dim;
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const auto x = module->input_layernorm(layer_input);
  auto q = untapped(attn->q_proj, x.slice(1, first)).view({batch, query_count, heads, head_dim}).transpose(1, 2);
  auto k = untapped(attn->k_proj, x).view({batch, tokens, kv_heads, head_dim}).transpose(1, 2);
  const auto cos = inputs.cos.unsqueeze(1), sin = inputs.sin.unsqueeze(1);  // [B,1,T,d]
  const auto cos_q = cos.slice(2, first), sin_q = sin.slice(2, first);
  q = q * cos_q + rotate_half(q) * sin_q;
  k = k * cos + rotate_half(k) * sin;
  if (heads != kv_heads) {
    const int64_t rep = heads / kv_heads;
    k = k.unsqueeze(2).expand({batch, kv_heads, rep, tokens, head_dim}).reshape({batch, heads, tokens, head_dim});
  }
  auto scores = torch::matmul(q, k.transpose(2, 3)) * std::pow(static_cast<double>(head_dim), -0.5);  // [B,H,Q,T]
  const auto& mask = inputs.mask_for(layer);
  if (mask.defined()) {
    VLMOPT_CHECK(mask.size(-1) == tokens, "attention_received: mask {} for {} tokens (prefill only)",
                 shape_string(mask.sizes()), tokens);
    scores = scores + mask.slice(2, first);
  }
  const auto probs = torch::softmax(scores, -1, torch::kFloat32).mean(1);  // [B,Q,T]
  const auto weights = rows.slice(1, first).to(torch::kFloat32);         // [B,Q]
  return (probs * weights.unsqueeze(-1)).sum(1) / weights.sum(1, true).clamp_min(1.0);
}

LanguageModelImpl::PrunedPrefill LanguageModelImpl::run_layers_pruned(torch::Tensor hidden,
                                                                      const DecoderInputs& inputs,
                                                                      const torch::Tensor& image_mask,
                                                                      const PrunePlan& plan,
                                                                      std::vector<torch::Tensor>* collect) {
  plan.validate(num_layers());
  VLMOPT_CHECK(inputs.past_length == 0, "pruning applies to the prefill only ({} cached tokens)", inputs.past_length);
  const auto device = hidden.device();
  const int64_t batch = hidden.size(0);
  int64_t tokens = hidden.size(1);
  VLMOPT_CHECK(image_mask.dim() == 2 && image_mask.size(0) == batch && image_mask.size(1) == tokens,
               "image mask {} for hidden {}", shape_string(image_mask.sizes()), shape_string(hidden.sizes()));
  const auto bool_options = torch::TensorOptions().device(device).dtype(torch::kBool);
  const auto long_options = torch::TensorOptions().device(device).dtype(torch::kInt64);

  PrunedPrefill out;
  DecoderInputs current = inputs;
  auto valid = inputs.token_mask.defined() ? inputs.token_mask.to(device).to(torch::kBool)
                                           : torch::ones({batch, tokens}, bool_options);  // real tokens
  auto image = image_mask.to(device).to(torch::kBool);
  auto index = torch::arange(tokens, long_options).unsqueeze(0).expand({batch, tokens}).contiguous();
  out.report.visual_tokens.assign(static_cast<size_t>(num_layers()), {});
  auto visual_counts = per_sample_counts(image.logical_and(valid));
  const auto account = [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) out.report.visual_tokens[static_cast<size_t>(l)] = visual_counts;
  };

  int64_t begin = 0;
  for (size_t s = 0; s < plan.steps.size(); ++s) {
    const auto& step = plan.steps[s];
    const int64_t layer = step.after_layer;
    // (Skipped when empty so hidden_states.0 is published once, by the call that runs layer 0:
    // with an input cut at layer 0 that is the pruned sequence.)
    if (layer > begin) hidden = run_layers(hidden, begin, layer, current, collect);
    const auto visual = image.logical_and(valid);
    const auto positions = torch::arange(tokens, long_options).unsqueeze(0);  // [1,T]
    torch::Tensor scores;
    if (plan.rule == PruneRule::kRandom) {
      scores = torch::zeros({batch, tokens}, torch::TensorOptions().device(device).dtype(torch::kFloat32));
    } else {
      torch::Tensor rows;
      if (plan.rule == PruneRule::kFastV) {
        rows = (positions == tokens - 1).expand({batch, tokens});  // left padding: the last token is real
      } else {
        // The text after the image (the question): real, non-visual rows behind the last visual token.
        const auto last_visual = torch::where(visual, positions, torch::full_like(positions, -1)).amax(1, true);
        rows = valid.logical_and(image.logical_not()).logical_and(positions > last_visual);
        const auto none = rows.any(1, true).logical_not();
        rows = rows.logical_or(none.logical_and(positions == tokens - 1));
      }
      scores = attention_received(layer, hidden, current, rows);
    }
    // An output cut runs the scoring layer on every token first; an input cut prunes its input.
    const int64_t pruned_from = step.first_pruned_layer();
    if (pruned_from > layer) hidden = run_layers(hidden, layer, pruned_from, current, collect);
    account(begin, pruned_from);

    std::vector<double> entropy;
    const auto keep = select_kept_tokens(plan, step, static_cast<int64_t>(s), scores, visual, &entropy);
    out.report.entropy.push_back(std::move(entropy));

    // Gather the kept tokens, in order, left-padded to the longest sample.
    const auto count = keep.sum(1);  // [B]
    const int64_t kept = count.max().item<int64_t>();
    const auto pad = (kept - count).unsqueeze(1);                                    // [B,1]
    const auto slot = torch::where(keep, pad + keep.to(torch::kInt64).cumsum(1) - 1,  // destination slot,
                                   torch::full_like(index, kept));                   // or the overflow column
    auto source = torch::zeros({batch, kept + 1}, long_options);
    source.scatter_(1, slot, torch::arange(tokens, long_options).unsqueeze(0).expand({batch, tokens}));
    source = source.slice(1, 0, kept).contiguous();                                    // [B,T'] current index
    const auto used = torch::arange(kept, long_options).unsqueeze(0) >= pad;         // [B,T']
    const auto gather_rows = [&](const torch::Tensor& t) {
      auto full = t.size(0) == batch ? t : t.expand({batch, t.size(1), t.size(2)});
      return full.gather(1, source.unsqueeze(-1).expand({batch, kept, t.size(2)}));
    };
    hidden = gather_rows(hidden);
    valid = valid.gather(1, source).logical_and(used);
    image = image.gather(1, source).logical_and(used);
    index = torch::where(used, index.gather(1, source), torch::full_like(source, -1));

    DecoderInputs next;
    next.cos = gather_rows(current.cos);
    next.sin = gather_rows(current.sin);
    const auto causal = torch::arange(kept, long_options).unsqueeze(0) <= torch::arange(kept, long_options).unsqueeze(1);
    next.mask = additive_mask(causal.unsqueeze(0).logical_and(valid.unsqueeze(1)), hidden.scalar_type());
    next.cache = current.cache;
    next.past_length = 0;
    if (inputs.image_mask.defined()) next.image_mask = image;
    next.token_mask = valid.to(torch::kInt64);
    next.append_key_mask = valid;
    next.record_key_mask = true;
    if (pruned_from == 0 && current.cache != nullptr) current.cache->add_uncached_positions(tokens - kept);
    current = std::move(next);
    tokens = kept;
    visual_counts = per_sample_counts(image.logical_and(valid));
    begin = pruned_from;
  }
  hidden = run_layers(hidden, begin, num_layers(), current, collect);
  account(begin, num_layers());
  out.hidden = hidden;
  out.kept_index = index;
  out.inputs = std::move(current);
  return out;
}

void LanguageModelImpl::set_fused_attention(bool fused) {
  for (auto& layer : layers) layer->self_attn->fused = fused;
}

}  // namespace vlmopt::model
