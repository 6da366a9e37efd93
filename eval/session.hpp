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

// Which visual-token pruning plan a session applies (design.md §7), in this order:
// an ad-hoc single-step `rule` (baselines), else the prune.json at `config`, else the
// bundle's vlmopt/prune.json when `apply_bundle_plan`, else none.
struct PruneOptions {
  bool apply_bundle_plan = true;  // false: --no-prune
  std::string config;             // a prune.json to apply ("" = the bundle's, if any)
  std::string scenario;           // scenario of the prune.json ("" = its default_scenario)
  std::string rule;               // "vlmopt" | "fastv" | "random": ad-hoc plan ("" = none)
  int64_t layer = 1;              // ad-hoc: prune after this decoder layer (FastV K=2 -> 1)
  std::string cut = "output";     // ad-hoc: "output" (drop after `layer`) | "input" (before it)
  double keep = 0.5;              // ad-hoc fastv/random: kept fraction of the visual tokens
  double threshold = 1.0;         // ad-hoc vlmopt: score threshold
  double floor = 0.3;             // ad-hoc vlmopt: at least this fraction kept
  uint64_t seed = 0;              // ad-hoc random
  std::string batch_keep;         // "per_sample" | "batch_mean": overrides the plan's ("" = keep it)
};

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
  PruneOptions prune;
  // Bundle fake-quant kernels pass gradients straight through the input rounding
  // (runtime::RuntimeOptions::straight_through): prune-fit's task sensitivity on a bundle.
  bool straight_through = false;
};

// One model input batch: left-padded ids and mask [B,T], pixel values [images,3,H,W]
// (images == B unless samples have frames).
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
  // The pruning plan in use, as text ("none", "fastv after layer 1 keep 0.5", "<file> scenario general").
  const std::string& prune_description() const { return prune_description_; }
  const std::vector<int64_t>& eos_ids() const { return eos_ids_; }
  int64_t pad_id() const { return pad_id_; }

  // Token ids of one prompt (with the image tokens expanded) for `question` about
  // `images` images. For images > 1 the template's single image placeholder becomes
  // `images` placeholders joined by "\n" ("USER: <image>\n<image>\n<image>\n{question} ASSISTANT:"),
  // unless the template already holds exactly `images` placeholders. InputError otherwise.
  std::vector<int64_t> prompt_ids(const std::string& question, int64_t images = 1) const;
  // A sample with frames gets one placeholder per image (image, then frames in
  // order); pixel_values then holds all images of all samples in that order
  // ([sum of images,3,H,W]) and the model fills the image tokens with them in order.
  PreparedBatch prepare(const std::vector<datasets::Sample>& samples) const;
  // Greedy answers, decoded without special tokens and trimmed.
  std::vector<std::string> answer(const std::vector<datasets::Sample>& samples);
  std::vector<std::string> answer(const PreparedBatch& batch);

 private:
  VlmSession(SessionOptions options, std::filesystem::path model_dir, model::LlavaModel model,
             tokenizer::Tokenizer tokenizer, datasets::ImageProcessorConfig processor);
  void apply_prune_options();
  SessionOptions options_;
  std::filesystem::path model_dir_;
  model::LlavaModel model_;
  tokenizer::Tokenizer tokenizer_;
  datasets::ImageProcessorConfig processor_;
  std::vector<int64_t> eos_ids_;
  int64_t pad_id_ = 0;
  std::string prune_description_ = "none";
};

// Exact-match normalisation: lowercase, surrounding whitespace and trailing . ! ? removed.
std::string normalize_answer(std::string_view text);

}  // namespace vlmopt::eval
