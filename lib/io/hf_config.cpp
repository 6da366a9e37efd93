#include "io/hf_config.hpp"

#include "io/atomic_file.hpp"
#include "util/error.hpp"

#include <fmt/ranges.h>

#include <limits>
#include <optional>
#include <set>

namespace vlmopt::io {
namespace {

using nlohmann::json;

// config.json files are small; anything larger is not a config.
constexpr uint64_t kMaxConfigBytes = 16'000'000;

std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  constexpr std::size_t kMax = 60;
  if (text.size() > kMax) text = text.substr(0, kMax) + "...";
  return text;
}

// Reads typed fields of one JSON object; errors name the field by its full path
// ("<source>: field 'text_config.hidden_size': expected an integer, got \"4k\"").
class Fields {
 public:
  Fields(const json& object, std::string prefix, const std::string& source)
      : object_(object), prefix_(std::move(prefix)), source_(source) {}

  std::string path(std::string_view key) const { return prefix_.empty() ? std::string(key) : prefix_ + "." + std::string(key); }

  [[noreturn]] void fail(std::string_view key, const std::string& problem) const {
    throw InputError(fmt::format("{}: field '{}': {}", source_, path(key), problem));
  }

  bool object_has(std::string_view key) const { return object_.contains(key); }

  // The value if present and not null (null means "use the default" for every field we read).
  const json* find(std::string_view key) const {
    const auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }

  int64_t integer(std::string_view key, int64_t fallback) const { return optional_integer(key).value_or(fallback); }

  std::optional<int64_t> optional_integer(std::string_view key) const {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (v->is_number_unsigned()) {
      if (v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail(key, fmt::format("integer out of range, got {}", shown(*v)));
      }
      return v->get<int64_t>();
    }
    if (!v->is_number_integer()) fail(key, fmt::format("expected an integer, got {}", shown(*v)));
    return v->get<int64_t>();
  }

  int64_t positive(std::string_view key, int64_t fallback) const {
    const int64_t value = integer(key, fallback);
    if (value <= 0) fail(key, fmt::format("expected a positive integer, got {}", value));
    return value;
  }

  double number(std::string_view key, double fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_number()) fail(key, fmt::format("expected a number, got {}", shown(*v)));
    return v->get<double>();
  }

  bool boolean(std::string_view key, bool fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) fail(key, fmt::format("expected true or false, got {}", shown(*v)));
    return v->get<bool>();
  }

  std::optional<std::string> optional_string(std::string_view key) const {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) fail(key, fmt::format("expected a string, got {}", shown(*v)));
    return v->get<std::string>();
  }

  std::string string(std::string_view key, std::string_view fallback) const {
    return optional_string(key).value_or(std::string(fallback));
  }

  // An int, or a list of ints (eos_token_id, vision_feature_layer).
  std::optional<std::vector<int64_t>> integer_list(std::string_view key) const {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (v->is_number_integer()) return std::vector<int64_t>{v->get<int64_t>()};
    if (!v->is_array()) fail(key, fmt::format("expected an integer or a list of integers, got {}", shown(*v)));
    std::vector<int64_t> out;
    for (const json& item : *v) {
      if (!item.is_number_integer()) fail(key, fmt::format("expected a list of integers, got {}", shown(*v)));
      out.push_back(item.get<int64_t>());
    }
    return out;
  }

  // A nested object ("rope_parameters"); nullptr when absent or null.
  const json* object(std::string_view key) const {
    const json* v = find(key);
    if (v != nullptr && !v->is_object()) fail(key, fmt::format("expected an object, got {}", shown(*v)));
    return v;
  }

 private:
  const json& object_;
  std::string prefix_;
  const std::string& source_;
};

// ---- vision tower -----------------------------------------------------------------------------

// Class defaults of CLIPVisionConfig / SiglipVisionConfig (transformers 5.17).
VisionConfig vision_defaults(const std::string& model_type) {
  VisionConfig v;
  v.model_type = model_type;
  v.hidden_size = 768;
  v.intermediate_size = 3072;
  v.num_hidden_layers = 12;
  v.num_attention_heads = 12;
  v.num_channels = 3;
  v.image_size = 224;
  if (model_type == "clip_vision_model") {
    v.patch_size = 32;
    v.hidden_act = "quick_gelu";
    v.layer_norm_eps = 1e-5;
  } else {  // siglip_vision_model
    v.patch_size = 16;
    v.hidden_act = "gelu_pytorch_tanh";
    v.layer_norm_eps = 1e-6;
  }
  return v;
}

VisionConfig parse_vision(const json* object, const std::string& source) {
  if (object == nullptr) {
    // LlavaConfig without vision_config: the llava-1.5 CLIP ViT-L/14-336 tower.
    VisionConfig v = vision_defaults("clip_vision_model");
    v.hidden_size = 1024;
    v.intermediate_size = 4096;
    v.num_hidden_layers = 24;
    v.num_attention_heads = 16;
    v.image_size = 336;
    v.patch_size = 14;
    return v;
  }
  const Fields f(*object, "vision_config", source);
  const std::string model_type = f.string("model_type", "clip_vision_model");
  if (model_type != "clip_vision_model" && model_type != "siglip_vision_model") {
    f.fail("model_type", fmt::format("unsupported '{}' (supported: clip_vision_model, siglip_vision_model)", model_type));
  }
  VisionConfig v = vision_defaults(model_type);
  v.hidden_size = f.positive("hidden_size", v.hidden_size);
  v.intermediate_size = f.positive("intermediate_size", v.intermediate_size);
  v.num_hidden_layers = f.positive("num_hidden_layers", v.num_hidden_layers);
  v.num_attention_heads = f.positive("num_attention_heads", v.num_attention_heads);
  v.num_channels = f.positive("num_channels", v.num_channels);
  v.image_size = f.positive("image_size", v.image_size);
  v.patch_size = f.positive("patch_size", v.patch_size);
  v.hidden_act = f.string("hidden_act", v.hidden_act);
  v.layer_norm_eps = f.number("layer_norm_eps", v.layer_norm_eps);
  if (v.hidden_size % v.num_attention_heads != 0) {
    f.fail("hidden_size", fmt::format("expected a multiple of num_attention_heads {}, got {}", v.num_attention_heads,
                                      v.hidden_size));
  }
  if (v.patch_size > v.image_size) {
    f.fail("patch_size", fmt::format("expected at most image_size {}, got {}", v.image_size, v.patch_size));
  }
  return v;
}

// ---- language model ---------------------------------------------------------------------------

// RoPE base from rope_scaling / rope_parameters / rope_theta, with transformers'
// precedence: a non-empty rope_scaling replaces rope_parameters; a rope_theta inside
// the dict wins over the top-level one; else RotaryEmbeddingConfigMixin.default_theta.
double parse_rope_theta(const Fields& f, const std::string& source) {
  std::string dict_key = "rope_scaling";
  const json* rope = f.object("rope_scaling");
  if (rope == nullptr || rope->empty()) {
    dict_key = "rope_parameters";
    rope = f.object("rope_parameters");
  }
  double theta = f.number("rope_theta", 10000.0);
  if (const auto factor = f.find("partial_rotary_factor"); factor != nullptr && !(factor->is_number() && factor->get<double>() == 1.0)) {
    f.fail("partial_rotary_factor", fmt::format("unsupported {} (supported: 1.0)", shown(*factor)));
  }
  if (rope == nullptr) return theta;

  const Fields r(*rope, f.path(dict_key), source);
  for (const char* layer_type : {"full_attention", "sliding_attention"}) {
    if (rope->contains(layer_type)) r.fail(layer_type, "per-layer-type RoPE parameters are not supported");
  }
  const std::string rope_type = r.optional_string("rope_type").value_or(r.string("type", "default"));
  if (rope_type != "default") {
    r.fail(rope->contains("rope_type") ? "rope_type" : "type",
           fmt::format("unsupported '{}' (supported: default)", rope_type));
  }
  if (const auto factor = r.find("partial_rotary_factor"); factor != nullptr && !(factor->is_number() && factor->get<double>() == 1.0)) {
    r.fail("partial_rotary_factor", fmt::format("unsupported {} (supported: 1.0)", shown(*factor)));
  }
  theta = r.number("rope_theta", theta);
  if (!(theta > 0.0)) r.fail("rope_theta", fmt::format("expected a positive number, got {}", theta));
  return theta;
}

TextConfig parse_text(const json* object, const std::string& source) {
  static const json kEmpty = json::object();
  // LlavaConfig without text_config: LlamaConfig() defaults.
  const Fields f(object != nullptr ? *object : kEmpty, "text_config", source);
  const std::string model_type = f.string("model_type", "llama");
  const bool qwen2 = model_type == "qwen2";
  if (model_type != "llama" && !qwen2) {
    f.fail("model_type", fmt::format("unsupported '{}' (supported: llama, qwen2)", model_type));
  }

  // Class defaults: LlamaConfig / Qwen2Config (transformers 5.17).
  TextConfig t;
  t.model_type = model_type;
  t.vocab_size = f.positive("vocab_size", qwen2 ? 151936 : 32000);
  t.hidden_size = f.positive("hidden_size", 4096);
  t.intermediate_size = f.positive("intermediate_size", qwen2 ? 22016 : 11008);
  t.num_hidden_layers = f.positive("num_hidden_layers", 32);
  t.num_attention_heads = f.positive("num_attention_heads", 32);
  // Llama's default is None (-> heads); Qwen2's class default is 32, and only an explicit null means heads.
  const bool kv_absent = !f.object_has("num_key_value_heads");
  t.num_key_value_heads = f.positive("num_key_value_heads", qwen2 && kv_absent ? 32 : t.num_attention_heads);
  if (f.find("head_dim") != nullptr) {
    t.head_dim = f.positive("head_dim", 0);
  } else {
    if (t.hidden_size % t.num_attention_heads != 0) {
      f.fail("hidden_size", fmt::format("expected a multiple of num_attention_heads {} (head_dim is not given), got {}",
                                        t.num_attention_heads, t.hidden_size));
    }
    t.head_dim = t.hidden_size / t.num_attention_heads;
  }
  if (t.num_attention_heads % t.num_key_value_heads != 0) {
    f.fail("num_key_value_heads", fmt::format("expected a divisor of num_attention_heads {}, got {}",
                                              t.num_attention_heads, t.num_key_value_heads));
  }
  t.hidden_act = f.string("hidden_act", "silu");
  t.rms_norm_eps = f.number("rms_norm_eps", 1e-6);
  t.max_position_embeddings = f.positive("max_position_embeddings", qwen2 ? 32768 : 2048);
  t.rope_theta = parse_rope_theta(f, source);
  if (qwen2) {
    // Qwen2Attention: q/k/v always have biases, o_proj and the MLP never (attention_bias is not read).
    t.attention_bias = false;
    t.qkv_bias = true;
    t.o_bias = false;
    t.mlp_bias = false;
  } else {
    t.attention_bias = f.boolean("attention_bias", false);
    t.qkv_bias = t.attention_bias;
    t.o_bias = t.attention_bias;
    t.mlp_bias = f.boolean("mlp_bias", false);
  }
  t.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  t.bos_token_id = f.integer("bos_token_id", qwen2 || f.object_has("bos_token_id") ? -1 : 1);
  if (const auto eos = f.integer_list("eos_token_id")) {
    t.eos_token_ids = *eos;
  } else if (!qwen2 && !f.object_has("eos_token_id")) {
    t.eos_token_ids = {2};  // LlamaConfig default; an explicit null means none
  }
  t.pad_token_id = f.integer("pad_token_id", -1);
  return t;
}

}  // namespace

// ---- strict JSON ------------------------------------------------------------------------------

nlohmann::json parse_json_strict(std::string_view text, const std::string& source, std::string_view what) {
  const std::string context = what.empty() ? source : fmt::format("{}: {}", source, what);
  // One frame per open object/array: the keys seen so far and the key being parsed.
  struct Frame {
    bool is_object;
    std::set<std::string> keys;
    std::string current_key;
  };
  std::vector<Frame> open;
  const auto key_path = [&open](const std::string& last) {
    std::string path;
    for (const Frame& frame : open) {
      if (frame.is_object && &frame != &open.back()) path += frame.current_key + ".";
    }
    return path + last;
  };
  const json::parser_callback_t track = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (open.size() >= static_cast<std::size_t>(kMaxJsonDepth)) {
          throw InputError(fmt::format("{}: JSON nests deeper than {} levels", context, kMaxJsonDepth));
        }
        open.push_back({event == json::parse_event_t::object_start, {}, {}});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        open.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!open.back().keys.insert(key).second) {
          throw InputError(fmt::format("{}: duplicate key '{}' (JSON readers would keep only the last value)", context,
                                       key_path(key)));
        }
        open.back().current_key = key;
        break;
      }
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), track);
  } catch (const json::parse_error& e) {
    throw InputError(fmt::format("{}: not valid JSON: {}", context, e.what()));
  }
}

nlohmann::json load_json_file(const std::filesystem::path& path, uint64_t max_bytes) {
  return parse_json_strict(read_whole_file(path, max_bytes), path.string());
}

// ---- LLaVA ------------------------------------------------------------------------------------

int64_t LlavaConfig::image_tokens_per_image() const {
  // Tower output: patches (+ class token for CLIP); "default" drops the first token whatever the tower.
  return vision.num_patches() + (vision.is_clip() ? 1 : 0) - (vision_feature_select_strategy == "default" ? 1 : 0);
}

LlavaConfig load_llava_config(const std::filesystem::path& dir_or_file) {
  std::error_code ec;
  const auto file = std::filesystem::is_directory(dir_or_file, ec) ? dir_or_file / "config.json" : dir_or_file;
  return parse_llava_config(parse_json_strict(read_whole_file(file, kMaxConfigBytes), file.string()), file.string());
}

LlavaConfig parse_llava_config(const nlohmann::json& j, const std::string& source_name) {
  if (!j.is_object()) throw InputError(fmt::format("{}: expected a JSON object, got {}", source_name, shown(j)));
  const Fields f(j, "", source_name);
  LlavaConfig c;
  c.raw = j;
  c.model_type = f.string("model_type", "llava");
  if (c.model_type != "llava") f.fail("model_type", fmt::format("unsupported '{}' (supported: llava)", c.model_type));

  c.vision = parse_vision(f.object("vision_config"), source_name);
  c.text = parse_text(f.object("text_config"), source_name);

  // image_token_id is an alias (attribute_map) of image_token_index.
  const auto index = f.optional_integer("image_token_index");
  const auto id = f.optional_integer("image_token_id");
  if (index && id && *index != *id) {
    f.fail("image_token_id", fmt::format("disagrees with image_token_index (expected {}, got {})", *index, *id));
  }
  c.image_token_id = index.value_or(id.value_or(32000));
  if (c.image_token_id < 0) f.fail(index ? "image_token_index" : "image_token_id",
                                   fmt::format("expected a non-negative token id, got {}", c.image_token_id));

  c.projector_hidden_act = f.string("projector_hidden_act", "gelu");
  c.vision_feature_select_strategy = f.string("vision_feature_select_strategy", "default");
  if (c.vision_feature_select_strategy != "default" && c.vision_feature_select_strategy != "full") {
    f.fail("vision_feature_select_strategy",
           fmt::format("unsupported '{}' (supported: default, full)", c.vision_feature_select_strategy));
  }
  c.vision_feature_layers = f.integer_list("vision_feature_layer").value_or(std::vector<int64_t>{-2});
  if (c.vision_feature_layers.empty()) f.fail("vision_feature_layer", "expected at least one layer, got []");
  // hidden_states has num_hidden_layers + 1 entries (embeddings, then each layer's output).
  const int64_t states = c.vision.num_hidden_layers + 1;
  for (int64_t layer : c.vision_feature_layers) {
    if (layer < -states || layer >= states) {
      f.fail("vision_feature_layer", fmt::format("expected a hidden-state index in [{}, {}] (vision_config has {} layers), got {}",
                                                 -states, states - 1, c.vision.num_hidden_layers, layer));
    }
  }
  c.image_seq_length = f.positive("image_seq_length", 576);
  c.multimodal_projector_bias = f.boolean("multimodal_projector_bias", true);
  // LlavaConfig.__post_init__: a false top-level value takes text_config's (so the result is an OR);
  // the model ties lm_head to embed_tokens when it is true. Both fields hold that effective value.
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false) || c.text.tie_word_embeddings;
  c.text.tie_word_embeddings = c.tie_word_embeddings;

  if (auto dtype = f.optional_string("dtype")) {
    c.torch_dtype = *dtype;
  } else if (auto legacy = f.optional_string("torch_dtype")) {
    c.torch_dtype = *legacy;
  } else if (const json* text = f.object("text_config")) {
    const Fields tf(*text, "text_config", source_name);
    c.torch_dtype = tf.optional_string("dtype").value_or(tf.string("torch_dtype", "float32"));
  }
  return c;
}

}  // namespace vlmopt::io
