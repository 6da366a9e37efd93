#include "model/vision.hpp"

#include "util/error.hpp"

namespace vlmopt::model {

namespace {

// A parameter-only container (names the tree like transformers does).
std::shared_ptr<torch::nn::Module> container() { return std::make_shared<torch::nn::Module>(); }

torch::Tensor add_param(torch::nn::Module& module, const std::string& name, c10::IntArrayRef shape,
                        const torch::TensorOptions& options) {
  return module.register_parameter(name, torch::empty(shape, options), false);
}

}  // namespace

VisionEmbeddingsImpl::VisionEmbeddingsImpl(const io::VisionConfig& config, const torch::TensorOptions& options)
    : patch_size_(config.patch_size) {
  const int64_t dim = config.hidden_size;
  auto conv = register_module("patch_embedding", container());
  patch_weight = add_param(*conv, "weight", {dim, config.num_channels, config.patch_size, config.patch_size}, options);
  if (!config.is_clip()) patch_bias = add_param(*conv, "bias", {dim}, options);
  if (config.is_clip()) {
    class_embedding = register_parameter("class_embedding", torch::empty({dim}, options), false);
  }
  const int64_t positions = config.num_patches() + (config.is_clip() ? 1 : 0);
  position_embedding = register_module("position_embedding", Embedding(positions, dim, options));
}

torch::Tensor VisionEmbeddingsImpl::forward(const torch::Tensor& pixel_values) const {
  const int64_t batch = pixel_values.size(0);
  auto patches = torch::conv2d(pixel_values.to(patch_weight.scalar_type()), patch_weight, patch_bias,
                               /*stride=*/{patch_size_, patch_size_});
  auto embeddings = patches.flatten(2).transpose(1, 2);  // [B, patches, D]
  if (class_embedding.defined()) {
    embeddings = torch::cat({class_embedding.expand({batch, 1, -1}), embeddings}, 1);
  }
  return embeddings + position_embedding->weight.unsqueeze(0);
}

VisionAttentionImpl::VisionAttentionImpl(const std::string& prefix, const io::VisionConfig& config, Taps* taps,
                                         const torch::TensorOptions& options)
    : heads_(config.num_attention_heads),
      head_dim_(config.head_dim()),
      scale_(std::pow(static_cast<double>(config.head_dim()), -0.5)),
      probs_tap_(prefix + ".probs"),
      taps_(taps) {
  const int64_t dim = config.hidden_size;
  q_proj = register_module("q_proj", Linear(prefix + ".q_proj", dim, dim, true, taps, options));
  k_proj = register_module("k_proj", Linear(prefix + ".k_proj", dim, dim, true, taps, options));
  v_proj = register_module("v_proj", Linear(prefix + ".v_proj", dim, dim, true, taps, options));
  out_proj = register_module("out_proj", Linear(prefix + ".out_proj", dim, dim, true, taps, options));
}

torch::Tensor VisionAttentionImpl::forward(const torch::Tensor& x, const TapContext& context) {
  const int64_t batch = x.size(0), tokens = x.size(1);
  const auto heads_view = [&](const torch::Tensor& t) { return t.view({batch, tokens, -1, head_dim_}).transpose(1, 2); };
  const auto q = heads_view(q_proj(x, context));
  const auto k = heads_view(k_proj(x, context));
  const auto v = heads_view(v_proj(x, context));
  const auto attended = attention(q, k, v, torch::Tensor(), scale_, fused, taps_, probs_tap_, context);
  return out_proj(attended, context);
}

VisionMlpImpl::VisionMlpImpl(const std::string& prefix, const io::VisionConfig& config, Taps* taps,
                             const torch::TensorOptions& options)
    : act_(activation_by_name(config.hidden_act, "vision_config.hidden_act")) {
  fc1 = register_module("fc1", Linear(prefix + ".fc1", config.hidden_size, config.intermediate_size, true, taps, options));
  fc2 = register_module("fc2", Linear(prefix + ".fc2", config.intermediate_size, config.hidden_size, true, taps, options));
}

torch::Tensor VisionMlpImpl::forward(const torch::Tensor& x, const TapContext& context) {
  return fc2(act_(fc1(x, context)), context);
}

VisionEncoderLayerImpl::VisionEncoderLayerImpl(const std::string& prefix, const io::VisionConfig& config, Taps* taps,
                                               const torch::TensorOptions& options) {
  self_attn = register_module("self_attn", VisionAttention(prefix + ".self_attn", config, taps, options));
  layer_norm1 = register_module("layer_norm1", LayerNorm(config.hidden_size, config.layer_norm_eps, options));
  mlp = register_module("mlp", VisionMlp(prefix + ".mlp", config, taps, options));
  layer_norm2 = register_module("layer_norm2", LayerNorm(config.hidden_size, config.layer_norm_eps, options));
}

torch::Tensor VisionEncoderLayerImpl::forward(const torch::Tensor& hidden, const TapContext& context) {
  auto h = hidden + self_attn(layer_norm1(hidden), context);
  return h + mlp(layer_norm2(h), context);
}

SiglipHeadImpl::SiglipHeadImpl(const io::VisionConfig& config, const torch::TensorOptions& options) {
  const int64_t dim = config.hidden_size, inner = config.intermediate_size;
  add_param(*this, "probe", {1, 1, dim}, options);
  auto attn = register_module("attention", container());
  add_param(*attn, "in_proj_weight", {3 * dim, dim}, options);
  add_param(*attn, "in_proj_bias", {3 * dim}, options);
  auto out = attn->register_module("out_proj", container());
  add_param(*out, "weight", {dim, dim}, options);
  add_param(*out, "bias", {dim}, options);
  register_module("layernorm", LayerNorm(dim, config.layer_norm_eps, options));
  auto mlp = register_module("mlp", container());
  auto fc1 = mlp->register_module("fc1", container());
  add_param(*fc1, "weight", {inner, dim}, options);
  add_param(*fc1, "bias", {inner}, options);
  auto fc2 = mlp->register_module("fc2", container());
  add_param(*fc2, "weight", {dim, inner}, options);
  add_param(*fc2, "bias", {dim}, options);
}

VisionTowerImpl::VisionTowerImpl(const io::VisionConfig& config, bool with_siglip_head, Taps* taps,
                                 const torch::TensorOptions& options)
    : config_(config), taps_(taps) {
  VLMOPT_CHECK_INPUT(config.model_type == "clip_vision_model" || config.model_type == "siglip_vision_model",
                     "config.json: vision_config.model_type (expected clip_vision_model or siglip_vision_model, got "
                     "'{}')",
                     config.model_type);
  VLMOPT_CHECK_INPUT(config.hidden_size > 0 && config.num_attention_heads > 0 &&
                         config.hidden_size % config.num_attention_heads == 0,
                     "config.json: vision_config.hidden_size {} must be a positive multiple of num_attention_heads {}",
                     config.hidden_size, config.num_attention_heads);
  VLMOPT_CHECK_INPUT(config.patch_size > 0 && config.image_size >= config.patch_size && config.num_channels > 0 &&
                         config.num_hidden_layers >= 0 && config.intermediate_size > 0,
                     "config.json: vision_config sizes are inconsistent (image_size {}, patch_size {}, layers {})",
                     config.image_size, config.patch_size, config.num_hidden_layers);
  auto vision_model = register_module("vision_model", container());
  embeddings = vision_model->register_module("embeddings", VisionEmbeddings(config, options));
  if (config.is_clip()) {
    pre_layrnorm = vision_model->register_module("pre_layrnorm", LayerNorm(config.hidden_size, config.layer_norm_eps, options));
  }
  auto encoder = vision_model->register_module("encoder", container());
  auto layer_list = encoder->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const std::string prefix = fmt::format("{}.encoder.layers.{}", kVisionPrefix, i);
    layers.push_back(VisionEncoderLayer(prefix, config, taps, options));
    layer_list->push_back(layers.back());
  }
  post_layernorm = vision_model->register_module("post_layernorm", LayerNorm(config.hidden_size, config.layer_norm_eps, options));
  if (!config.is_clip() && with_siglip_head) head = vision_model->register_module("head", SiglipHead(config, options));
  for (int64_t k = 0; k <= config.num_hidden_layers; ++k) {
    hidden_state_taps_.push_back(fmt::format("model.vision_tower.hidden_states.{}", k));
  }
}

void VisionTowerImpl::validate_pixels(const torch::Tensor& pixel_values) const {
  VLMOPT_CHECK_INPUT(pixel_values.defined() && pixel_values.dim() == 4 && pixel_values.is_floating_point(),
                     "pixel_values: expected a floating tensor [B,{},{},{}], got {} {}", config_.num_channels,
                     config_.image_size, config_.image_size,
                     pixel_values.defined() ? c10::toString(pixel_values.scalar_type()) : "undefined",
                     pixel_values.defined() ? shape_string(pixel_values.sizes()) : "[]");
  VLMOPT_CHECK_INPUT(pixel_values.size(1) == config_.num_channels && pixel_values.size(2) == config_.image_size &&
                         pixel_values.size(3) == config_.image_size && pixel_values.size(0) > 0,
                     "pixel_values: shape (expected [B,{},{},{}], got {})", config_.num_channels, config_.image_size,
                     config_.image_size, shape_string(pixel_values.sizes()));
}

std::vector<torch::Tensor> VisionTowerImpl::hidden_states(const torch::Tensor& pixel_values, int64_t count) {
  VLMOPT_CHECK(count >= 1 && count <= num_layers() + 1, "vision hidden states requested: {} of {}", count,
               num_layers() + 1);
  std::vector<torch::Tensor> states;
  states.reserve(static_cast<size_t>(count));
  auto h = embeddings->forward(pixel_values);
  if (pre_layrnorm) h = pre_layrnorm(h);
  const bool observed = taps_ != nullptr && taps_->active();
  const auto publish = [&](int64_t k, const torch::Tensor& t) {
    if (observed && taps_->wants(hidden_state_taps_[static_cast<size_t>(k)])) {
      taps_->emit(hidden_state_taps_[static_cast<size_t>(k)], t, TapContext{nullptr, nullptr, static_cast<int>(k) - 1});
    }
  };
  states.push_back(h);
  publish(0, h);
  for (int64_t l = 0; l + 1 < count; ++l) {
    h = layers[static_cast<size_t>(l)](h, TapContext{nullptr, nullptr, static_cast<int>(l)});
    states.push_back(h);
    publish(l + 1, h);
  }
  return states;
}

void VisionTowerImpl::set_fused_attention(bool fused) {
  for (auto& layer : layers) layer->self_attn->fused = fused;
}

}  // namespace vlmopt::model
