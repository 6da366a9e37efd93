// Hugging Face config.json for the LLaVA family, with the per-model-type
// defaults that save_pretrained leaves out (docs/reference.md §4).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
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
  int64_t num_key_value_heads = 32;  // defaults to num_attention_heads when absent
  int64_t head_dim = 128;            // defaults to hidden_size / num_attention_heads when absent
  std::string hidden_act = "silu";
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;       // also read from rope_parameters.rope_theta / rope_scaling
  int64_t max_position_embeddings = 2048;
  bool attention_bias = false;       // q/k/v/o bias (llama); qwen2: q/k/v only (qkv_bias)
  bool qkv_bias = false;             // true for qwen2
  bool o_bias = false;
  bool mlp_bias = false;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  int64_t pad_token_id = -1;
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
  bool tie_word_embeddings = false;
  std::string torch_dtype = "float32";  // from "dtype" or "torch_dtype"
  nlohmann::json raw;                   // the file as read, for export

  // Image tokens per image after feature selection.
  int64_t image_tokens_per_image() const;
};

// Parses <dir>/config.json (or a path to a config file). Throws InputError
// "<file>: field '<name>': <problem>" for missing/ill-typed fields and
// unknown model types.
LlavaConfig load_llava_config(const std::filesystem::path& dir_or_file);
LlavaConfig parse_llava_config(const nlohmann::json& j, const std::string& source_name);

}  // namespace vlmopt::io
