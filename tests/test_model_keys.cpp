// Checkpoint key canonicalisation and the loader's errors (lib/model/weights).
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
#include "model/llava.hpp"
#include "model/weights.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

using namespace vlmopt;
using model::KeyLayout;

namespace {

io::LlavaConfig keys_tiny_config(bool siglip = false) {
  io::LlavaConfig c;
  c.vision.model_type = siglip ? "siglip_vision_model" : "clip_vision_model";
  c.vision.hidden_size = 16;
  c.vision.intermediate_size = 24;
  c.vision.num_hidden_layers = 2;
  c.vision.num_attention_heads = 2;
  c.vision.image_size = 8;
  c.vision.patch_size = 4;
  c.vision.hidden_act = siglip ? "gelu_pytorch_tanh" : "quick_gelu";
  c.text.model_type = "llama";
  c.text.vocab_size = 40;
  c.text.hidden_size = 16;
  c.text.intermediate_size = 24;
  c.text.num_hidden_layers = 2;
  c.text.num_attention_heads = 2;
  c.text.num_key_value_heads = 1;
  c.text.head_dim = 8;
  c.image_token_id = 39;
  c.vision_feature_layers = {-2};
  c.vision_feature_select_strategy = siglip ? "full" : "default";
  c.image_seq_length = 4;
  c.raw = nlohmann::json::object();
  return c;
}

// The model's tensors under `layout` names (a tied lm_head left out, as save_pretrained does).
std::map<std::string, torch::Tensor> on_disk(model::LlavaModel& m, KeyLayout layout) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : m.named_tensors()) out[model::on_disk_key(name, layout)] = t.clone();
  return out;
}

std::string load_error(const io::LlavaConfig& config, std::map<std::string, torch::Tensor> tensors) {
  try {
    model::LlavaModel::load(config, model::MapSource(std::move(tensors), "/ckpt/tiny"), torch::kCPU);
  } catch (const InputError& e) {
    return e.what();
  }
  FAIL("expected an InputError");
  return {};
}

bool same_parameters(model::LlavaModel& a, model::LlavaModel& b) {
  const auto ta = a.named_tensors(), tb = b.named_tensors();
  if (ta.size() != tb.size()) return false;
  for (size_t i = 0; i < ta.size(); ++i) {
    if (ta[i].first != tb[i].first || !torch::equal(ta[i].second, tb[i].second)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("canonical_key maps the old, new and 5.x layouts to one name") {
  const std::vector<std::pair<std::string, std::string>> table = {
      {"language_model.model.layers.0.self_attn.q_proj.weight", "model.language_model.layers.0.self_attn.q_proj.weight"},
      {"language_model.model.embed_tokens.weight", "model.language_model.embed_tokens.weight"},
      {"language_model.model.norm.weight", "model.language_model.norm.weight"},
      {"language_model.lm_head.weight", "lm_head.weight"},
      {"language_model.layers.1.mlp.up_proj.weight", "model.language_model.layers.1.mlp.up_proj.weight"},
      {"vision_tower.vision_model.encoder.layers.1.mlp.fc1.bias",
       "model.vision_tower.vision_model.encoder.layers.1.mlp.fc1.bias"},
      {"vision_tower.encoder.layers.0.layer_norm1.weight", "model.vision_tower.vision_model.encoder.layers.0.layer_norm1.weight"},
      {"vision_tower.embeddings.class_embedding", "model.vision_tower.vision_model.embeddings.class_embedding"},
      {"model.vision_tower.embeddings.patch_embedding.weight",
       "model.vision_tower.vision_model.embeddings.patch_embedding.weight"},
      {"model.vision_tower.vision_model.post_layernorm.weight", "model.vision_tower.vision_model.post_layernorm.weight"},
      {"multi_modal_projector.linear_1.weight", "model.multi_modal_projector.linear_1.weight"},
      {"model.multi_modal_projector.linear_2.bias", "model.multi_modal_projector.linear_2.bias"},
      {"model.language_model.layers.3.input_layernorm.weight", "model.language_model.layers.3.input_layernorm.weight"},
      {"lm_head.weight", "lm_head.weight"},
      {"something.else", "something.else"},
  };
  for (const auto& [disk, canonical] : table) {
    CAPTURE(disk);
    const auto got = model::canonical_key(disk);
    REQUIRE(got.has_value());
    CHECK(*got == canonical);
  }
  CHECK_FALSE(model::canonical_key("language_model.model.layers.0.self_attn.rotary_emb.inv_freq").has_value());
  CHECK_FALSE(model::canonical_key("vision_tower.vision_model.embeddings.position_ids").has_value());
  CHECK_FALSE(model::canonical_key("model.vision_tower.embeddings.position_ids").has_value());
}

TEST_CASE("on_disk_key inverts canonical_key for every parameter, in both layouts") {
  auto m = model::LlavaModel::random(keys_tiny_config(), 1);
  for (const auto& [name, t] : m.named_tensors()) {
    CAPTURE(name);
    const auto old_name = model::on_disk_key(name, KeyLayout::kOld);
    CHECK(old_name != name);
    CHECK(model::canonical_key(old_name).value() == name);
    CHECK(model::on_disk_key(name, KeyLayout::kNew) == name);
    CHECK(model::canonical_key(name).value() == name);
  }
  CHECK(model::on_disk_key("lm_head.weight", KeyLayout::kOld) == "language_model.lm_head.weight");
  CHECK(model::detect_layout({"lm_head.weight", "model.language_model.norm.weight"}) == KeyLayout::kNew);
  CHECK(model::detect_layout({"vision_tower.encoder.layers.0.mlp.fc1.weight"}) == KeyLayout::kOld);
}

TEST_CASE("a model loads from the old, new and 5.x native layouts and records which") {
  const auto config = keys_tiny_config();
  auto original = model::LlavaModel::random(config, 7);
  for (const auto layout : {KeyLayout::kOld, KeyLayout::kNew}) {
    auto tensors = on_disk(original, layout);
    tensors["language_model.model.layers.0.self_attn.rotary_emb.inv_freq"] = torch::ones({4});  // ignored
    auto loaded = model::LlavaModel::load(config, model::MapSource(tensors), torch::kCPU);
    CHECK(loaded.key_layout() == layout);
    CHECK(same_parameters(loaded, original));
  }
  // transformers 5.x save_pretrained: old prefixes, vision tower without "vision_model.".
  std::map<std::string, torch::Tensor> native;
  for (const auto& [name, t] : on_disk(original, KeyLayout::kOld)) {
    std::string key = name;
    const std::string from = "vision_tower.vision_model.";
    if (key.starts_with(from)) key = "vision_tower." + key.substr(from.size());
    native[key] = t;
  }
  auto loaded = model::LlavaModel::load(config, model::MapSource(native), torch::kCPU);
  CHECK(loaded.key_layout() == KeyLayout::kOld);
  CHECK(same_parameters(loaded, original));
}

TEST_CASE("a sharded safetensors checkpoint written by io loads through CheckpointSource") {
  const auto config = keys_tiny_config();
  auto original = model::LlavaModel::random(config, 11);
  const auto dir = std::filesystem::temp_directory_path() / "vlmopt_test_model_keys_ckpt";
  std::filesystem::remove_all(dir);
  std::vector<torch::Tensor> keep_alive;
  std::vector<io::TensorToWrite> to_write;
  for (const auto& [name, t] : on_disk(original, KeyLayout::kOld)) {
    keep_alive.push_back(t.contiguous());
    to_write.push_back(io::to_write(name, keep_alive.back()));
  }
  const auto files = io::write_checkpoint(dir, std::move(to_write), /*max_shard_bytes=*/8000);
  CHECK(files.size() > 2);  // shards + index
  auto loaded = model::LlavaModel::load(config, model::CheckpointSource(io::Checkpoint::open(dir)), torch::kCPU);
  CHECK(same_parameters(loaded, original));
  std::filesystem::remove_all(dir);
}

TEST_CASE("missing, unexpected, duplicated, mis-shaped and non-float tensors are errors naming the key") {
  const auto config = keys_tiny_config();
  auto original = model::LlavaModel::random(config, 3);
  const auto good = on_disk(original, KeyLayout::kOld);

  SUBCASE("missing") {
    auto tensors = good;
    tensors.erase("language_model.model.layers.1.post_attention_layernorm.weight");
    const auto msg = load_error(config, tensors);
    CHECK(msg.find("/ckpt/tiny") != std::string::npos);
    CHECK(msg.find("missing") != std::string::npos);
    CHECK(msg.find("language_model.model.layers.1.post_attention_layernorm.weight") != std::string::npos);
  }
  SUBCASE("unexpected") {
    auto tensors = good;
    tensors["language_model.model.layers.0.mlp.extra_proj.weight"] = torch::zeros({2, 2});
    const auto msg = load_error(config, tensors);
    CHECK(msg.find("unexpected") != std::string::npos);
    CHECK(msg.find("language_model.model.layers.0.mlp.extra_proj.weight") != std::string::npos);
  }
  SUBCASE("given twice under two layouts") {
    auto tensors = good;
    tensors["lm_head.weight"] = good.at("language_model.lm_head.weight");
    const auto msg = load_error(config, tensors);
    CHECK(msg.find("twice") != std::string::npos);
    CHECK(msg.find("language_model.lm_head.weight") != std::string::npos);
  }
  SUBCASE("shape mismatch") {
    auto tensors = good;
    tensors["language_model.lm_head.weight"] = torch::zeros({40, 15});
    const auto msg = load_error(config, tensors);
    CHECK(msg.find("language_model.lm_head.weight") != std::string::npos);
    CHECK(msg.find("expected [40,16], got [40,15]") != std::string::npos);
  }
  SUBCASE("integer data") {
    auto tensors = good;
    tensors["multi_modal_projector.linear_1.weight"] = torch::zeros({16, 16}, torch::kInt8);
    const auto msg = load_error(config, tensors);
    CHECK(msg.find("multi_modal_projector.linear_1.weight") != std::string::npos);
    CHECK(msg.find("floating") != std::string::npos);
  }
}

TEST_CASE("tied word embeddings share embed_tokens when lm_head is absent") {
  auto config = keys_tiny_config();
  config.tie_word_embeddings = true;
  config.text.tie_word_embeddings = true;
  auto source_model = model::LlavaModel::random(keys_tiny_config(), 5);  // untied: has its own lm_head
  auto tensors = on_disk(source_model, KeyLayout::kNew);
  const auto lm_head = tensors.at("lm_head.weight");
  tensors.erase("lm_head.weight");

  auto tied = model::LlavaModel::load(config, model::MapSource(tensors), torch::kCPU);
  CHECK(tied.lm_head_tied());
  CHECK(tied.lm_head()->weight.data_ptr() == tied.language_model()->embed_tokens->weight.data_ptr());
  CHECK(torch::equal(tied.lm_head()->weight, tensors.at("model.language_model.embed_tokens.weight")));
  CHECK(tied.parameter_counts().lm_head == 0);
  for (const auto& [name, t] : tied.named_tensors()) CHECK(name != "lm_head.weight");

  // With both present (a config that says tie, a file that does not), both are kept, as transformers does.
  tensors["lm_head.weight"] = lm_head;
  auto untied = model::LlavaModel::load(config, model::MapSource(tensors), torch::kCPU);
  CHECK_FALSE(untied.lm_head_tied());
  CHECK(torch::equal(untied.lm_head()->weight, lm_head));
  CHECK(untied.parameter_counts().lm_head == lm_head.numel());
}

TEST_CASE("SigLIP's pooling head is part of the checkpoint unless vision_use_head is false") {
  auto config = keys_tiny_config(/*siglip=*/true);
  auto original = model::LlavaModel::random(config, 9);
  auto tensors = on_disk(original, KeyLayout::kNew);
  CHECK(tensors.contains("model.vision_tower.vision_model.head.probe"));
  auto loaded = model::LlavaModel::load(config, model::MapSource(tensors), torch::kCPU);
  CHECK(same_parameters(loaded, original));
  // The head never runs: it is not a Linear of the model.
  for (const auto& [name, linear] : loaded.linears()) CHECK(name.find(".head.") == std::string::npos);

  tensors.erase("model.vision_tower.vision_model.head.probe");
  CHECK(load_error(config, tensors).find("model.vision_tower.vision_model.head.probe") != std::string::npos);

  config.raw["vision_config"] = {{"vision_use_head", false}};
  std::map<std::string, torch::Tensor> without_head;
  for (const auto& [name, t] : tensors) {
    if (name.find(".head.") == std::string::npos) without_head[name] = t;
  }
  auto headless = model::LlavaModel::load(config, model::MapSource(without_head), torch::kCPU);
  CHECK(headless.parameter_counts().vision < original.parameter_counts().vision);
}

TEST_CASE("parameter counts split the model into its parts") {
  auto m = model::LlavaModel::random(keys_tiny_config(), 2);
  const auto counts = m.parameter_counts();
  int64_t total = 0;
  for (const auto& [name, t] : m.named_tensors()) total += t.numel();
  CHECK(counts.total() == total);
  // projector: 16->16 and 16->16 with bias
  CHECK(counts.projector == 2 * (16 * 16 + 16));
  CHECK(counts.lm_head == 40 * 16);
  CHECK(counts.vision > 0);
  CHECK(counts.language > 0);
}
