// LLaVA config.json parsing with transformers' class defaults (lib/io/hf_config).
// Expected defaults were checked against transformers 5.17 (LlavaConfig(**json) on the same inputs).
#include "io/hf_config.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>

#include <fstream>
#include <random>

namespace {

using vlmopt::io::LlavaConfig;
using vlmopt::io::parse_llava_config;

LlavaConfig parse(std::string_view text) { return parse_llava_config(nlohmann::json::parse(text), "config.json"); }

std::string error_of(std::string_view text) {
  try {
    parse(text);
  } catch (const vlmopt::InputError& e) {
    return e.what();
  }
  FAIL("expected an InputError for " << text);
  return {};
}

}  // namespace

TEST_CASE("a minimal LLaVA config gets LlavaConfig's default CLIP tower and LlamaConfig") {
  const LlavaConfig c = parse(R"({"model_type": "llava"})");
  CHECK(c.model_type == "llava");
  CHECK(c.vision.model_type == "clip_vision_model");
  CHECK(c.vision.is_clip());
  CHECK(c.vision.hidden_size == 1024);
  CHECK(c.vision.intermediate_size == 4096);
  CHECK(c.vision.num_hidden_layers == 24);
  CHECK(c.vision.num_attention_heads == 16);
  CHECK(c.vision.num_channels == 3);
  CHECK(c.vision.image_size == 336);
  CHECK(c.vision.patch_size == 14);
  CHECK(c.vision.hidden_act == "quick_gelu");
  CHECK(c.vision.layer_norm_eps == doctest::Approx(1e-5));

  CHECK(c.text.model_type == "llama");
  CHECK(c.text.vocab_size == 32000);
  CHECK(c.text.hidden_size == 4096);
  CHECK(c.text.intermediate_size == 11008);
  CHECK(c.text.num_hidden_layers == 32);
  CHECK(c.text.num_attention_heads == 32);
  CHECK(c.text.num_key_value_heads == 32);
  CHECK(c.text.head_dim == 128);
  CHECK(c.text.hidden_act == "silu");
  CHECK(c.text.rms_norm_eps == doctest::Approx(1e-6));
  CHECK(c.text.rope_theta == 10000.0);
  CHECK(c.text.max_position_embeddings == 2048);
  CHECK_FALSE(c.text.qkv_bias);
  CHECK_FALSE(c.text.o_bias);
  CHECK_FALSE(c.text.mlp_bias);
  CHECK(c.text.bos_token_id == 1);
  CHECK(c.text.eos_token_ids == std::vector<int64_t>{2});
  CHECK(c.text.pad_token_id == -1);

  CHECK(c.image_token_id == 32000);
  CHECK(c.projector_hidden_act == "gelu");
  CHECK(c.vision_feature_layers == std::vector<int64_t>{-2});
  CHECK(c.vision_feature_select_strategy == "default");
  CHECK(c.image_seq_length == 576);
  CHECK(c.multimodal_projector_bias);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK(c.torch_dtype == "float32");
  CHECK(c.image_tokens_per_image() == 576);  // (336/14)^2 + CLS - CLS
}

TEST_CASE("empty sub-configs take the CLIPVisionConfig class defaults, not LLaVA's tower") {
  const LlavaConfig c = parse(R"({"model_type": "llava", "vision_config": {}, "text_config": {}})");
  CHECK(c.vision.model_type == "clip_vision_model");
  CHECK(c.vision.hidden_size == 768);
  CHECK(c.vision.num_hidden_layers == 12);
  CHECK(c.vision.image_size == 224);
  CHECK(c.vision.patch_size == 32);
  CHECK(c.text.model_type == "llama");
  CHECK(c.image_tokens_per_image() == 49);
}

TEST_CASE("Qwen2 + SigLIP defaults differ from Llama + CLIP") {
  const LlavaConfig c = parse(R"({"model_type": "llava", "vision_config": {"model_type": "siglip_vision_model"},
                                  "text_config": {"model_type": "qwen2"}, "vision_feature_select_strategy": "full"})");
  CHECK(c.vision.model_type == "siglip_vision_model");
  CHECK_FALSE(c.vision.is_clip());
  CHECK(c.vision.hidden_size == 768);
  CHECK(c.vision.image_size == 224);
  CHECK(c.vision.patch_size == 16);
  CHECK(c.vision.hidden_act == "gelu_pytorch_tanh");
  CHECK(c.vision.layer_norm_eps == doctest::Approx(1e-6));
  CHECK(c.image_tokens_per_image() == 196);  // no class token; "full" keeps every patch

  CHECK(c.text.model_type == "qwen2");
  CHECK(c.text.vocab_size == 151936);
  CHECK(c.text.intermediate_size == 22016);
  CHECK(c.text.max_position_embeddings == 32768);
  CHECK(c.text.num_key_value_heads == 32);
  CHECK(c.text.head_dim == 128);
  CHECK(c.text.qkv_bias);
  CHECK_FALSE(c.text.o_bias);
  CHECK_FALSE(c.text.mlp_bias);
  CHECK(c.text.bos_token_id == -1);
  CHECK(c.text.eos_token_ids.empty());

  // SigLIP with "default" still drops the first token, as LlavaModel does for any tower.
  CHECK(parse(R"({"vision_config": {"model_type": "siglip_vision_model"}})").image_tokens_per_image() == 195);
  // Qwen2: only an explicit null means "as many kv heads as heads".
  const LlavaConfig null_kv =
      parse(R"({"text_config": {"model_type": "qwen2", "num_attention_heads": 8, "hidden_size": 64,
                                "num_key_value_heads": null}})");
  CHECK(null_kv.text.num_key_value_heads == 8);
  CHECK(null_kv.text.head_dim == 8);
}

TEST_CASE("a tiny test config: alias spellings, lists, rope parameters, head_dim null, biases, tying") {
  const LlavaConfig c = parse(R"({
    "model_type": "llava", "image_token_id": 5, "torch_dtype": "bfloat16", "vision_feature_layer": [-2, -1],
    "image_seq_length": 16, "tie_word_embeddings": false, "multimodal_projector_bias": false,
    "text_config": {"model_type": "llama", "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "intermediate_size": 37, "head_dim": null,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                    "eos_token_id": [2, 7], "pad_token_id": 0, "tie_word_embeddings": true, "attention_bias": true},
    "vision_config": {"image_size": 8, "patch_size": 2, "hidden_size": 32, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "intermediate_size": 37}})");
  CHECK(c.image_token_id == 5);
  CHECK(c.torch_dtype == "bfloat16");
  CHECK(c.vision_feature_layers == std::vector<int64_t>{-2, -1});
  CHECK(c.image_seq_length == 16);
  CHECK_FALSE(c.multimodal_projector_bias);
  CHECK(c.text.num_key_value_heads == 4);
  CHECK(c.text.head_dim == 8);
  CHECK(c.text.rope_theta == 500000.0);
  CHECK(c.text.eos_token_ids == std::vector<int64_t>{2, 7});
  CHECK(c.text.pad_token_id == 0);
  CHECK(c.text.qkv_bias);
  CHECK(c.text.o_bias);
  CHECK_FALSE(c.text.mlp_bias);
  // LlavaConfig: a false top-level tie_word_embeddings takes text_config's value.
  CHECK(c.tie_word_embeddings);
  CHECK(c.text.tie_word_embeddings);
  CHECK(c.vision.num_patches() == 16);
  CHECK(c.vision.head_dim() == 8);
  CHECK(c.image_tokens_per_image() == 16);
  CHECK(c.raw["image_token_id"] == 5);
}

TEST_CASE("both spellings of renamed keys are read") {
  CHECK(parse(R"({"image_token_index": 7})").image_token_id == 7);
  CHECK(parse(R"({"image_token_id": 7})").image_token_id == 7);
  CHECK(parse(R"({"image_token_index": 7, "image_token_id": 7})").image_token_id == 7);
  CHECK(parse(R"({"dtype": "float16"})").torch_dtype == "float16");
  CHECK(parse(R"({"torch_dtype": "float16"})").torch_dtype == "float16");
  CHECK(parse(R"({"dtype": "bfloat16", "torch_dtype": "float16"})").torch_dtype == "bfloat16");
  CHECK(parse(R"({"text_config": {"torch_dtype": "float16"}})").torch_dtype == "float16");
  CHECK(parse(R"({"vision_feature_layer": -1})").vision_feature_layers == std::vector<int64_t>{-1});
  CHECK(parse(R"({"text_config": {"eos_token_id": 9}})").text.eos_token_ids == std::vector<int64_t>{9});
  CHECK(parse(R"({"text_config": {"eos_token_id": null}})").text.eos_token_ids.empty());
  // RoPE base: top level, rope_parameters, rope_scaling (legacy), dict value wins over the top-level one.
  CHECK(parse(R"({"text_config": {"rope_theta": 1000000.0}})").text.rope_theta == 1e6);
  CHECK(parse(R"({"text_config": {"rope_parameters": {"rope_theta": 5e5}}})").text.rope_theta == 5e5);
  CHECK(parse(R"({"text_config": {"rope_theta": 1e6, "rope_parameters": {"rope_type": "default"}}})").text.rope_theta == 1e6);
  CHECK(parse(R"({"text_config": {"rope_theta": 1e6, "rope_scaling": {"type": "default"}}})").text.rope_theta == 1e6);
  CHECK(parse(R"({"text_config": {"rope_theta": 1e6, "rope_parameters": {"rope_theta": 2e6}}})").text.rope_theta == 2e6);
  // Top-level tie_word_embeddings true wins even over an explicit false in text_config.
  const LlavaConfig tied = parse(R"({"tie_word_embeddings": true, "text_config": {"tie_word_embeddings": false}})");
  CHECK(tied.tie_word_embeddings);
  CHECK(tied.text.tie_word_embeddings);
}

TEST_CASE("config errors name the file and the field") {
  CHECK(error_of(R"({"text_config": {"model_type": "xyz"}})") ==
        "config.json: field 'text_config.model_type': unsupported 'xyz' (supported: llama, qwen2)");
  CHECK(error_of(R"({"vision_config": {"model_type": "vit"}})").find("field 'vision_config.model_type': unsupported 'vit'") !=
        std::string::npos);
  CHECK(error_of(R"({"model_type": "llava_next"})").find("field 'model_type': unsupported 'llava_next'") != std::string::npos);
  CHECK(error_of(R"({"text_config": {"hidden_size": "4096"}})") ==
        "config.json: field 'text_config.hidden_size': expected an integer, got \"4096\"");
  CHECK(error_of(R"({"text_config": {"hidden_size": 40.5}})").find("field 'text_config.hidden_size'") != std::string::npos);
  CHECK(error_of(R"({"vision_config": {"patch_size": 0}})").find("field 'vision_config.patch_size': expected a positive integer") !=
        std::string::npos);
  CHECK(error_of(R"({"text_config": {"rms_norm_eps": "small"}})").find("field 'text_config.rms_norm_eps': expected a number") !=
        std::string::npos);
  CHECK(error_of(R"({"multimodal_projector_bias": 1})").find("field 'multimodal_projector_bias': expected true or false") !=
        std::string::npos);
  CHECK(error_of(R"({"text_config": 3})").find("field 'text_config': expected an object") != std::string::npos);
  CHECK(error_of(R"({"text_config": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}})")
            .find("field 'text_config.rope_scaling.rope_type': unsupported 'llama3' (supported: default)") != std::string::npos);
  CHECK(error_of(R"({"text_config": {"rope_parameters": {"rope_type": "yarn"}}})")
            .find("field 'text_config.rope_parameters.rope_type'") != std::string::npos);
  CHECK(error_of(R"({"text_config": {"num_attention_heads": 32, "num_key_value_heads": 5}})")
            .find("field 'text_config.num_key_value_heads'") != std::string::npos);
  CHECK(error_of(R"({"vision_feature_layer": [-2, "x"]})").find("field 'vision_feature_layer'") != std::string::npos);
  CHECK(error_of(R"({"vision_feature_layer": 30})").find("field 'vision_feature_layer': expected a hidden-state index in [-25, 24]") !=
        std::string::npos);
  CHECK(error_of(R"({"vision_feature_select_strategy": "cls"})").find("field 'vision_feature_select_strategy'") !=
        std::string::npos);
  CHECK(error_of(R"({"image_token_index": 3, "image_token_id": 4})").find("field 'image_token_id'") != std::string::npos);
  CHECK(error_of(R"([1, 2])").find("config.json: expected a JSON object") != std::string::npos);
}

TEST_CASE("load_llava_config reads a directory or a file, strictly") {
  std::random_device rd;
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("vlmopt_test_cfg_{:08x}", rd());
  std::filesystem::create_directories(dir);
  const auto write = [&](std::string_view text) { std::ofstream(dir / "config.json") << text; };

  write(R"({"model_type": "llava", "image_token_index": 11, "text_config": {"model_type": "qwen2"}})");
  CHECK(vlmopt::io::load_llava_config(dir).image_token_id == 11);
  CHECK(vlmopt::io::load_llava_config(dir / "config.json").text.model_type == "qwen2");

  const auto message = [&] {
    try {
      vlmopt::io::load_llava_config(dir);
    } catch (const vlmopt::InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  write(R"({"model_type": "llava", "text_config": {"hidden_size": 64, "hidden_size": 128}})");
  CHECK(message().find("config.json: duplicate key 'text_config.hidden_size'") != std::string::npos);
  write(R"({"model_type": "llava",)");
  CHECK(message().find("config.json: not valid JSON") != std::string::npos);
  write(R"({"text_config": {"hidden_size": true}})");
  CHECK(message().find((dir / "config.json").string() + ": field 'text_config.hidden_size'") != std::string::npos);
  std::filesystem::remove(dir / "config.json");
  CHECK(message().find("config.json: cannot open") != std::string::npos);
  std::filesystem::remove_all(dir);
}
