// Hugging Face config.json for the LLaVA family, with the per-model-type
// defaults that save_pretrained leaves out (docs/reference.md §4).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::io {

struct VisionConfig {
  std::string model_type;  // "clip_vision_model" | "siglip_vision_model"
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t num_channels = 3;
  int64_t image_size = 224;
  int64_t patch_size = 32;
  std::string hidden_act;  // "quick_gelu" (CLIP) | "gelu_pytorch_tanh" (SigLIP) | "gelu"
  double layer_norm_eps = 1e-5;
  bool is_clip() const { return model_type == "clip_vision_model"; }
  int64_t num_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
};

struct TextConfig {
  std::string model_type;  // "llama" | "qwen2"
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;  // llama: absent/null -> heads; qwen2: absent -> 32 (class default), null -> heads
  int64_t head_dim = 128;            // defaults to hidden_size / num_attention_heads when absent
  std::string hidden_act = "silu";
  double rms_norm_eps = 1e-6;
  // rope_scaling (if non-empty) else rope_parameters: its rope_theta, else the top-level
  // rope_theta, else 10000. Only rope_type "default" is accepted (others: InputError).
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 2048;
  bool attention_bias = false;       // q/k/v/o bias (llama); qwen2: q/k/v only (qkv_bias)
  bool qkv_bias = false;             // true for qwen2
  bool o_bias = false;
  bool mlp_bias = false;
  bool tie_word_embeddings = false;  // the effective value: same as LlavaConfig::tie_word_embeddings
  int64_t bos_token_id = -1;          // -1: none (llama default 1, qwen2 none)
  std::vector<int64_t> eos_token_ids; // int or list in the file (llama default {2}, qwen2 none)
  int64_t pad_token_id = -1;          // -1: none
};

struct LlavaConfig {
  std::string model_type = "llava";
  VisionConfig vision;
  TextConfig text;
  int64_t image_token_id = 32000;
  std::string projector_hidden_act = "gelu";
  std::vector<int64_t> vision_feature_layers = {-2};  // one entry unless a list was given (features concatenated)
  std::string vision_feature_select_strategy = "default";  // "default" drops CLS (CLIP), "full" keeps all
  int64_t image_seq_length = 576;
  bool multimodal_projector_bias = true;
  // LlavaConfig semantics (transformers 5.17): top-level value OR text_config's value
  // (a false/absent top level takes text_config's); lm_head is tied to embed_tokens when true.
  bool tie_word_embeddings = false;
  // Top-level "dtype", else "torch_dtype", else the same keys in text_config, else "float32".
  std::string torch_dtype = "float32";
  nlohmann::json raw;                   // the file as read, for export

  // Image tokens per image after feature selection: patches (+1 class token for CLIP),
  // minus the first token for "default" (LlavaModel drops it whatever the tower).
  int64_t image_tokens_per_image() const;
};

// Parses <dir>/config.json (or a path to a config file). Throws InputError
// "<file>: field '<name>': <problem>" for ill-typed fields and unknown model
// types. Absent (or null) fields take the class defaults of the sub-config's
// model_type; a missing vision_config is LlavaConfig's CLIP ViT-L/14-336 tower,
// a missing text_config LlamaConfig(); sub-configs without model_type are
// clip_vision_model / llama, as in LlavaConfig. Missing model_type means llava.
LlavaConfig load_llava_config(const std::filesystem::path& dir_or_file);
LlavaConfig parse_llava_config(const nlohmann::json& j, const std::string& source_name);

// Strict JSON for every io reader: like nlohmann::json::parse, but a key that
// repeats within one object (which parsers silently collapse to the last value)
// and nesting deeper than kMaxJsonDepth are errors. Throws InputError
// "<source>: <what>: ..." (`what` e.g. "header"; may be empty).
inline constexpr int kMaxJsonDepth = 128;
nlohmann::json parse_json_strict(std::string_view text, const std::string& source, std::string_view what = {});
// Reads (at most max_bytes) and parses a JSON file strictly.
nlohmann::json load_json_file(const std::filesystem::path& path, uint64_t max_bytes = 100'000'000);

}  // namespace vlmopt::io
