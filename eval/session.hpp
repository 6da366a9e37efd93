// A loaded VLM ready to answer questions about images: model, tokenizer,
// image processor and prompt template, with batching (left padding) and
// greedy decoding. eval, calibrate, prune-fit and diagnose-align share it.
#pragma once

#include "datasets/processor.hpp"
#include "datasets/source.hpp"
#include "model/llava.hpp"
#include "tokenizer/tokenizer.hpp"

#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

namespace vlmopt::eval {

// LLaVA-1.5's conversation format; `{question}` is replaced, `<image>` expands to the image tokens.
inline constexpr const char* kDefaultPromptTemplate = "USER: <image>\n{question} ASSISTANT:";

struct SessionOptions {
  std::string model = "builtin";  // "builtin" or an HF model directory
  std::string device = "cpu";     // "cpu" | "cuda" | "cuda:N"
  std::string dtype = "float32";  // "float32" | "bfloat16" | "float16"
  std::string prompt_template = kDefaultPromptTemplate;
  int max_new_tokens = 8;
  // Leave the decoder layers unloaded (LlavaModel::load_deferred): layer-by-layer calibration.
  bool defer_decoder_layers = false;
  // Optimized bundle to run instead of `model` (tokenizer and processor from the bundle dir).
  std::string bundle;
  std::string kernels = "fake";  // bundle kernels: "fake" | "int8" (runtime::KernelKind)
  bool use_mp_cache = true;      // false: what compressed-tensors computes (no FP16 outlier channels)
};

// One model input batch: left-padded ids and mask [B,T], pixel values [B,3,H,W].
struct PreparedBatch {
  torch::Tensor input_ids;
  torch::Tensor attention_mask;
  torch::Tensor pixel_values;
};

torch::ScalarType parse_dtype_name(const std::string& name);  // InputError for unknown names

class VlmSession {
 public:
  static VlmSession open(const SessionOptions& options);

  model::LlavaModel& model() { return model_; }
  const tokenizer::Tokenizer& tokenizer() const { return tokenizer_; }
  const datasets::ImageProcessorConfig& processor() const { return processor_; }
  const std::filesystem::path& model_dir() const { return model_dir_; }
  const SessionOptions& options() const { return options_; }

  // Token ids of one prompt (with the image tokens expanded) for `question`.
  std::vector<int64_t> prompt_ids(const std::string& question) const;
  PreparedBatch prepare(const std::vector<datasets::Sample>& samples) const;
  // Greedy answers, decoded without special tokens and trimmed.
  std::vector<std::string> answer(const std::vector<datasets::Sample>& samples);
  std::vector<std::string> answer(const PreparedBatch& batch);

 private:
  VlmSession(SessionOptions options, std::filesystem::path model_dir, model::LlavaModel model,
             tokenizer::Tokenizer tokenizer, datasets::ImageProcessorConfig processor);
  SessionOptions options_;
  std::filesystem::path model_dir_;
  model::LlavaModel model_;
  tokenizer::Tokenizer tokenizer_;
  datasets::ImageProcessorConfig processor_;
  std::vector<int64_t> eos_ids_;
  int64_t pad_id_ = 0;
};

// Exact-match normalisation: lowercase, surrounding whitespace and trailing . ! ? removed.
std::string normalize_answer(std::string_view text);

}  // namespace vlmopt::eval
