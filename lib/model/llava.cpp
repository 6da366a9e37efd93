#include "model/llava.hpp"

#include "util/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <unordered_set>

namespace vlmopt::model {

namespace {

const nlohmann::json* object_at(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  const auto it = j.find(key);
  return it != j.end() && it->is_object() ? &*it : nullptr;
}

// Features of the text config that change the math and that we do not implement.
void reject_unsupported(const io::LlavaConfig& config) {
  const auto* text = object_at(config.raw, "text_config");
  if (text == nullptr) return;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const auto* rope = object_at(*text, key);
    if (rope == nullptr) continue;
    for (const char* type_key : {"rope_type", "type"}) {
      const auto it = rope->find(type_key);
      if (it != rope->end() && it->is_string() && *it != "default") {
        throw InputError(fmt::format("config.json: text_config.{}.{} (expected \"default\", got \"{}\")", key,
                                     type_key, it->get<std::string>()));
      }
    }
  }
  const auto sliding = text->find("use_sliding_window");
  if (sliding != text->end() && sliding->is_boolean() && sliding->get<bool>()) {
    throw InputError("config.json: text_config.use_sliding_window (expected false, got true)");
  }
}

bool siglip_uses_head(const io::LlavaConfig& config) {
  if (config.vision.is_clip()) return false;
  const auto* vision = object_at(config.raw, "vision_config");
  if (vision == nullptr) return true;
  const auto it = vision->find("vision_use_head");
  return it == vision->end() || !it->is_boolean() || it->get<bool>();
}

std::shared_ptr<torch::nn::Module> container() { return std::make_shared<torch::nn::Module>(); }

}  // namespace

LlavaModel::LlavaModel(io::LlavaConfig config, torch::Device device, torch::ScalarType dtype)
    : config_(std::move(config)), device_(device), dtype_(dtype), taps_(std::make_unique<Taps>()) {
  VLMOPT_CHECK_INPUT(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16 ||
                         dtype == torch::kFloat64,
                     "model dtype (expected float32, bfloat16 or float16, got {})", c10::toString(dtype));
  reject_unsupported(config_);
  const auto& vision = config_.vision;
  VLMOPT_CHECK_INPUT(config_.vision_feature_select_strategy == "default" ||
                         config_.vision_feature_select_strategy == "full",
                     "config.json: vision_feature_select_strategy (expected \"default\" or \"full\", got \"{}\")",
                     config_.vision_feature_select_strategy);
  VLMOPT_CHECK_INPUT(!config_.vision_feature_layers.empty(), "config.json: vision_feature_layer is an empty list");
  const int64_t states = vision.num_hidden_layers + 1;
  for (const int64_t layer : config_.vision_feature_layers) {
    VLMOPT_CHECK_INPUT(layer >= -states && layer < states,
                       "config.json: vision_feature_layer (expected an index in [{}, {}], got {})", -states,
                       states - 1, layer);
    const int64_t index = layer < 0 ? layer + states : layer;
    feature_states_.push_back(index);
    vision_states_needed_ = std::max(vision_states_needed_, index + 1);
  }

  const auto options = torch::TensorOptions().device(device).dtype(dtype);
  Taps* taps = taps_.get();
  root_ = container();
  auto model = root_->register_module("model", container());
  vision_ = model->register_module("vision_tower", VisionTower(vision, siglip_uses_head(config_), taps, options));
  const int64_t projector_in = vision.hidden_size * static_cast<int64_t>(config_.vision_feature_layers.size());
  projector_ = model->register_module(
      "multi_modal_projector", Projector(projector_in, config_.text.hidden_size, config_.multimodal_projector_bias,
                                         config_.projector_hidden_act, taps, options));
  language_ = model->register_module("language_model", LanguageModel(config_.text, taps, options));
  lm_head_ = root_->register_module(
      "lm_head", Linear("lm_head", config_.text.hidden_size, config_.text.vocab_size, false, taps, options));
}

void LlavaModel::tie_lm_head() {
  lm_head_->share_weight(language_->embed_tokens->weight);
  tied_ = true;
}

LlavaModel LlavaModel::load(const std::filesystem::path& dir, torch::Device device, torch::ScalarType dtype) {
  const auto config = io::load_llava_config(dir);
  const CheckpointSource source(io::Checkpoint::open(dir));
  return load(config, source, device, dtype);
}

LlavaModel LlavaModel::load(const io::LlavaConfig& config, const TensorSource& source, torch::Device device,
                            torch::ScalarType dtype) {
  LlavaModel model(config, device, dtype);
  const bool tie_config = config.tie_word_embeddings || config.text.tie_word_embeddings;
  if (tie_config) {
    // transformers ties only when the checkpoint lacks lm_head (with both present it keeps both).
    bool has_lm_head = false;
    for (const auto& name : source.names()) {
      const auto canonical = canonical_key(name);
      if (canonical && *canonical == "lm_head.weight") has_lm_head = true;
    }
    if (!has_lm_head) model.tie_lm_head();
  }
  model.layout_ = load_parameters(*model.root_, source).layout;
  return model;
}

LlavaModel LlavaModel::load_deferred(const std::filesystem::path& dir, torch::Device device,
                                     torch::ScalarType dtype) {
  const auto config = io::load_llava_config(dir);
  auto source = std::make_shared<CheckpointSource>(io::Checkpoint::open(dir));
  LlavaModel model(config, device, dtype);
  if (config.tie_word_embeddings || config.text.tie_word_embeddings) {
    bool has_lm_head = false;
    for (const auto& name : source->names()) {
      const auto canonical = canonical_key(name);
      if (canonical && *canonical == "lm_head.weight") has_lm_head = true;
    }
    if (!has_lm_head) model.tie_lm_head();
  }
  LoadOptions options;
  const std::string layers_prefix = std::string(kLanguagePrefix) + ".layers.";
  for (const auto& item : model.root_->named_parameters(true)) {
    if (item.key().starts_with(layers_prefix)) options.skip.insert(item.key());
  }
  model.layout_ = load_parameters(*model.root_, *source, options).layout;
  model.deferred_source_ = std::move(source);
  return model;
}

void LlavaModel::load_decoder_layer(int64_t layer) {
  VLMOPT_CHECK(deferred_source_ != nullptr, "load_decoder_layer needs a model from load_deferred");
  VLMOPT_CHECK(layer >= 0 && layer < language_->num_layers(), "decoder layer {} out of range [0, {})", layer,
               language_->num_layers());
  auto& module = *language_->layers[static_cast<std::size_t>(layer)];
  // Parameters released earlier are empty: give them their shapes back before loading.
  torch::NoGradGuard no_grad;
  for (auto& item : module.named_parameters(true)) {
    if (item.value().numel() == 0) {
      const auto it = released_shapes_.find(fmt::format("{}.{}", layer, item.key()));
      VLMOPT_CHECK(it != released_shapes_.end(), "no shape recorded for released parameter {}", item.key());
      item.value().set_(torch::empty(it->second, item.value().options()));
    }
  }
  const SubtreeSource source(*deferred_source_, fmt::format("{}.layers.{}.", kLanguagePrefix, layer));
  load_parameters(module, source);
}

void LlavaModel::release_decoder_layer(int64_t layer) {
  VLMOPT_CHECK(layer >= 0 && layer < language_->num_layers(), "decoder layer {} out of range [0, {})", layer,
               language_->num_layers());
  torch::NoGradGuard no_grad;
  auto& module = *language_->layers[static_cast<std::size_t>(layer)];
  for (auto& item : module.named_parameters(true)) {
    auto param = item.value();
    if (param.numel() == 0) continue;
    released_shapes_[fmt::format("{}.{}", layer, item.key())] = param.sizes().vec();
    param.set_(torch::empty({0}, param.options()));
  }
}

LlavaModel LlavaModel::random(const io::LlavaConfig& config, uint64_t seed, torch::Device device,
                              torch::ScalarType dtype) {
  LlavaModel model(config, device, dtype);
  if (config.tie_word_embeddings || config.text.tie_word_embeddings) model.tie_lm_head();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  std::unordered_set<const void*> done;
  for (const auto& item : model.root_->named_parameters(true)) {
    auto param = item.value();
    if (!done.insert(param.unsafeGetTensorImpl()).second) continue;
    const std::string& name = item.key();
    // Values on the CPU in fp32 from one generator: the same model on every device.
    auto values = at::normal(0.0, 1.0, param.sizes(), generator, torch::TensorOptions().dtype(torch::kFloat32));
    const bool is_norm = name.find("norm") != std::string::npos;  // layer_norm*, *layernorm, norm.weight
    if (is_norm && name.ends_with(".weight")) {
      values = 1.0 + 0.1 * values;
    } else if (name.ends_with(".bias") || is_norm) {
      values = 0.02 * values;
    } else if (name.find("embed") != std::string::npos) {
      values = 0.5 * values;  // embeddings (token, patch, position, class)
    } else {
      values = values * (1.0 / std::sqrt(static_cast<double>(param.size(-1))));  // ~unit-variance outputs
    }
    param.copy_(values);
  }
  return model;
}

void LlavaModel::set_prune_plan(std::optional<PrunePlan> plan) {
  if (plan) plan->validate(language_->num_layers());
  prune_plan_ = std::move(plan);
}

void LlavaModel::set_attention_backend(AttentionBackend backend) {
  backend_ = backend;
  vision_->set_fused_attention(backend == AttentionBackend::kFused);
  language_->set_fused_attention(backend == AttentionBackend::kFused);
}

std::vector<torch::Tensor> LlavaModel::vision_hidden_states(const torch::Tensor& pixel_values) {
  vision_->validate_pixels(pixel_values);
  return vision_->hidden_states(pixel_values.to(device_), vision_states_needed_);
}

torch::Tensor LlavaModel::select_vision_features(const std::vector<torch::Tensor>& hidden_states) const {
  std::vector<torch::Tensor> selected;
  for (const int64_t index : feature_states_) {
    VLMOPT_CHECK(index < static_cast<int64_t>(hidden_states.size()), "vision hidden state {} of {}", index,
                 hidden_states.size());
    auto h = hidden_states[static_cast<size_t>(index)];
    if (config_.vision_feature_select_strategy == "default") h = h.slice(1, 1);  // drop the class token
    selected.push_back(h);
  }
  return selected.size() == 1 ? selected.front() : torch::cat(selected, -1);
}

torch::Tensor LlavaModel::image_features(const torch::Tensor& pixel_values) {
  return projector_(select_vision_features(vision_hidden_states(pixel_values)));
}

torch::Tensor LlavaModel::image_token_mask(const torch::Tensor& input_ids) const {
  return input_ids == config_.image_token_id;
}

void LlavaModel::check_input_ids(const torch::Tensor& input_ids) const {
  VLMOPT_CHECK_INPUT(input_ids.defined() && input_ids.dim() == 2 && input_ids.size(0) > 0 && input_ids.size(1) > 0 &&
                         !input_ids.is_floating_point() && !input_ids.is_complex() &&
                         input_ids.scalar_type() != torch::kBool,
                     "input_ids: expected an integer tensor [B,T] with B, T > 0, got {} {}",
                     input_ids.defined() ? c10::toString(input_ids.scalar_type()) : "undefined",
                     input_ids.defined() ? shape_string(input_ids.sizes()) : "[]");
  const auto [lo, hi] = torch::aminmax(input_ids);
  const int64_t low = lo.item<int64_t>(), high = hi.item<int64_t>();
  VLMOPT_CHECK_INPUT(low >= 0 && high < config_.text.vocab_size,
                     "input_ids: token id out of range (expected 0..{}, got {}..{})", config_.text.vocab_size - 1, low,
                     high);
}

torch::Tensor LlavaModel::embed(const torch::Tensor& input_ids, const torch::Tensor& image_features) {
  auto embeds = language_->embed(input_ids);
  if (!image_features.defined()) return embeds;
  const auto mask = image_token_mask(input_ids);
  const int64_t tokens = mask.sum().item<int64_t>();
  const int64_t dim = config_.text.hidden_size;
  VLMOPT_CHECK_INPUT(image_features.size(-1) == dim, "image features: width (expected {}, got {})", dim,
                     image_features.size(-1));
  const auto features = image_features.reshape({-1, dim}).to(embeds.scalar_type());
  VLMOPT_CHECK_INPUT(tokens == features.size(0), "image tokens in input_ids: {}, image features: {}", tokens,
                     features.size(0));
  return embeds.masked_scatter(mask.unsqueeze(-1), features);
}

torch::Tensor LlavaModel::default_position_ids(const torch::Tensor& attention_mask, int64_t batch, int64_t tokens,
                                               int64_t past) const {
  const auto options = torch::TensorOptions().device(device_).dtype(torch::kInt64);
  if (!attention_mask.defined()) return torch::arange(past, past + tokens, options).unsqueeze(0).expand({batch, tokens});
  const auto mask = attention_mask.to(device_).to(torch::kInt64);
  auto positions = mask.cumsum(-1) - 1;
  positions = positions.masked_fill(mask == 0, 0);
  return positions.slice(1, positions.size(1) - tokens);
}

torch::Tensor LlavaModel::logits(const torch::Tensor& decoder_output, const DecoderInputs& inputs) {
  return lm_head_(language_->final_norm(decoder_output), inputs.tap_context(-1));
}

ModelOutput LlavaModel::forward(const ForwardInputs& in) {
  std::optional<torch::NoGradGuard> no_grad;
  if (!in.enable_grad) no_grad.emplace();
  check_input_ids(in.input_ids);
  const auto input_ids = in.input_ids.to(device_, torch::kInt64);
  const int64_t batch = input_ids.size(0), tokens = input_ids.size(1);
  if (in.cache != nullptr) {
    VLMOPT_CHECK_INPUT(in.cache->num_layers() == language_->num_layers(),
                       "KV cache: layers (expected {}, got {})", language_->num_layers(), in.cache->num_layers());
    VLMOPT_CHECK_INPUT(in.cache->length() == 0 || in.cache->keys(0).size(0) == batch,
                       "KV cache: batch (expected {}, got {})", in.cache->keys(0).size(0), batch);
  }
  const int64_t past = in.cache != nullptr ? in.cache->length() : 0;
  torch::Tensor attention_mask;
  if (in.attention_mask.defined()) {
    VLMOPT_CHECK_INPUT(in.attention_mask.dim() == 2 && in.attention_mask.size(0) == batch &&
                           in.attention_mask.size(1) == past + tokens && !in.attention_mask.is_floating_point(),
                       "attention_mask: expected an integer or bool tensor [{},{}], got {}", batch, past + tokens,
                       shape_string(in.attention_mask.sizes()));
    attention_mask = in.attention_mask.to(device_, torch::kInt64);
  }
  torch::Tensor position_ids;
  if (in.position_ids.defined()) {
    VLMOPT_CHECK_INPUT(in.position_ids.dim() == 2 && in.position_ids.size(0) == batch &&
                           in.position_ids.size(1) == tokens && !in.position_ids.is_floating_point(),
                       "position_ids: expected an integer tensor [{},{}], got {}", batch, tokens,
                       shape_string(in.position_ids.sizes()));
    position_ids = in.position_ids.to(device_, torch::kInt64);
  } else {
    position_ids = default_position_ids(attention_mask, batch, tokens, past);
  }
  VLMOPT_CHECK_INPUT(in.logits_to_keep >= 0, "logits_to_keep (expected >= 0, got {})", in.logits_to_keep);

  ModelOutput out;
  if (in.pixel_values.defined()) out.image_features = image_features(in.pixel_values);
  auto hidden = embed(input_ids, out.image_features);

  torch::Tensor image_mask;
  const bool prefill = past == 0;
  torch::Tensor visual;
  if (prefill) last_prune_report_ = PruneReport{};
  if (prefill && prune_plan_ && !prune_plan_->steps.empty()) {
    visual = image_token_mask(input_ids);
    if (!visual.any().item<bool>()) visual = torch::Tensor();
  }
  if (taps_->active()) image_mask = visual.defined() ? visual : image_token_mask(input_ids);
  auto inputs = language_->prepare(position_ids, attention_mask, in.cache, image_mask);
  auto* collect = in.output_hidden_states ? &out.hidden_states : nullptr;
  if (visual.defined()) {
    auto pruned = language_->run_layers_pruned(hidden, inputs, visual, *prune_plan_, collect);
    hidden = std::move(pruned.hidden);
    out.kept_index = std::move(pruned.kept_index);
    inputs = std::move(pruned.inputs);
    last_prune_report_ = std::move(pruned.report);
  } else {
    hidden = language_->run_layers(hidden, 0, language_->num_layers(), inputs, collect);
  }
  auto normed = language_->final_norm(hidden);
  if (in.output_hidden_states) out.hidden_states.back() = normed;
  // RMSNorm is per token, so keeping the last positions after the norm changes nothing.
  const int64_t out_tokens = normed.size(1);
  if (in.logits_to_keep > 0 && in.logits_to_keep < out_tokens) normed = normed.slice(1, out_tokens - in.logits_to_keep);
  out.logits = lm_head_(normed, inputs.tap_context(-1));
  return out;
}

std::vector<std::pair<std::string, Linear>> LlavaModel::linears() {
  std::vector<std::pair<std::string, Linear>> out;
  for (const auto& item : root_->named_modules("", /*include_self=*/false)) {
    if (auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value())) out.emplace_back(item.key(), Linear(linear));
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> LlavaModel::named_tensors() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : root_->named_parameters(true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  }
  return out;
}

ParameterCounts LlavaModel::parameter_counts() const {
  ParameterCounts counts;
  for (const auto& [name, tensor] : named_tensors()) {
    const int64_t n = tensor.numel();
    if (name.starts_with("model.vision_tower.")) {
      counts.vision += n;
    } else if (name.starts_with("model.multi_modal_projector.")) {
      counts.projector += n;
    } else if (name.starts_with("model.language_model.")) {
      counts.language += n;
    } else {
      counts.lm_head += n;
    }
  }
  return counts;
}

}  // namespace vlmopt::model
