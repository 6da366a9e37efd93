// A tiny random LLaVA (no files needed) and its inputs, shared by the model-level
// tests: CLIP (image 8, patch 2 -> 16 patches + class token) + a LLaMA decoder
// with GQA (4 heads, 2 kv heads), vocabulary 99, image token id 3.
#pragma once

#include "io/hf_config.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace vlmopt::testing {

inline constexpr int64_t kImageTokens = 16;  // visual tokens per image (class token dropped)
inline constexpr int64_t kImageId = 3;

inline io::LlavaConfig tiny_llava_config(int64_t text_layers) {
  io::LlavaConfig c;
  c.vision.model_type = "clip_vision_model";
  c.vision.hidden_size = 32;
  c.vision.intermediate_size = 37;
  c.vision.num_hidden_layers = 2;
  c.vision.num_attention_heads = 4;
  c.vision.image_size = 8;
  c.vision.patch_size = 2;
  c.vision.hidden_act = "quick_gelu";
  c.text.model_type = "llama";
  c.text.vocab_size = 99;
  c.text.hidden_size = 32;
  c.text.intermediate_size = 37;
  c.text.num_hidden_layers = text_layers;
  c.text.num_attention_heads = 4;
  c.text.num_key_value_heads = 2;
  c.text.head_dim = 8;
  c.image_token_id = kImageId;
  c.vision_feature_layers = {-2};
  c.vision_feature_select_strategy = "default";
  c.image_seq_length = kImageTokens;
  c.raw = nlohmann::json::object();
  return c;
}

// [1,T] ids: <s>=1, `before` words, 16 image tokens, `after` words (word ids 4..98, seeded).
inline torch::Tensor prompt_with_image(int64_t before, int64_t after, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto words = [&](int64_t n) { return torch::randint(4, 99, {n}, gen, torch::kInt64); };
  return torch::cat({torch::ones({1}, torch::kInt64), words(before), torch::full({kImageTokens}, kImageId, torch::kInt64),
                     words(after)})
      .unsqueeze(0);
}

// [images,3,8,8] standard-normal pixel values, seeded.
inline torch::Tensor random_pixels(int64_t images, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::normal(0.0, 1.0, {images, 3, 8, 8}, gen);
}

inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// Left-pads [1,t] prompts to one [B,T] batch (pad id 0) with its attention mask.
inline std::pair<torch::Tensor, torch::Tensor> left_pad(const std::vector<torch::Tensor>& prompts) {
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size(1));
  std::vector<torch::Tensor> ids, masks;
  for (const auto& p : prompts) {
    const int64_t pad = longest - p.size(1);
    ids.push_back(torch::cat({torch::zeros({1, pad}, torch::kInt64), p}, 1));
    masks.push_back(torch::cat({torch::zeros({1, pad}, torch::kInt64), torch::ones_like(p)}, 1));
  }
  return {torch::cat(ids, 0), torch::cat(masks, 0)};
}

}  // namespace vlmopt::testing
