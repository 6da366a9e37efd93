#include "eval/session.hpp"

#include "model/prune_config.hpp"
#include "runtime/runtime.hpp"
#include "tokenizer/prompt.hpp"
#include "util/error.hpp"
#include "util/paths.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <cctype>

namespace vlmopt::eval {

torch::ScalarType parse_dtype_name(const std::string& name) {
  if (name == "float32" || name == "fp32") return torch::kFloat32;
  if (name == "bfloat16" || name == "bf16") return torch::kBFloat16;
  if (name == "float16" || name == "fp16") return torch::kFloat16;
  throw InputError(fmt::format("--dtype: unsupported '{}' (supported: float32, bfloat16, float16)", name));
}

VlmSession::VlmSession(SessionOptions options, std::filesystem::path model_dir, model::LlavaModel model,
                       tokenizer::Tokenizer tokenizer, datasets::ImageProcessorConfig processor)
    : options_(std::move(options)),
      model_dir_(std::move(model_dir)),
      model_(std::move(model)),
      tokenizer_(std::move(tokenizer)),
      processor_(std::move(processor)) {
  const auto& text = model_.config().text;
  eos_ids_ = text.eos_token_ids;
  if (eos_ids_.empty() && tokenizer_.eos_id()) eos_ids_.push_back(*tokenizer_.eos_id());
  if (text.pad_token_id >= 0) {
    pad_id_ = text.pad_token_id;
  } else if (tokenizer_.pad_id()) {
    pad_id_ = *tokenizer_.pad_id();
  } else if (!eos_ids_.empty()) {
    pad_id_ = eos_ids_.front();  // padded positions are masked out; any valid id works
  }
}

VlmSession VlmSession::open(const SessionOptions& options) {
  const torch::Device device(options.device);
  if (device.is_cuda() && !torch::cuda::is_available())
    throw InputError(fmt::format("--device {}: CUDA is not available on this machine", options.device));
  const auto dir = options.bundle.empty() ? resolve_model_dir(options.model) : std::filesystem::path(options.bundle);
  auto model = [&] {
    if (options.bundle.empty() && options.defer_decoder_layers)
      return model::LlavaModel::load_deferred(dir, device, parse_dtype_name(options.dtype));
    if (options.bundle.empty()) return model::LlavaModel::load(dir, device, parse_dtype_name(options.dtype));
    runtime::RuntimeOptions runtime_options;
    runtime_options.kernels = runtime::parse_kernel_kind(options.kernels);
    runtime_options.use_mp_cache = options.use_mp_cache;
    runtime_options.straight_through = options.straight_through;
    runtime_options.dtype = parse_dtype_name(options.dtype);
    return std::move(runtime::load_bundle(dir, device, runtime_options).model);
  }();
  auto tok = tokenizer::Tokenizer::load(dir);
  auto processor = datasets::image_processor_for_model(dir, model.config().vision);
  if (options.prompt_template.find("{question}") == std::string::npos)
    throw InputError("--prompt-template: must contain '{question}'");
  spdlog::debug("session: {} on {} ({})", dir.string(), options.device, options.dtype);
  VlmSession session(options, dir, std::move(model), std::move(tok), std::move(processor));
  session.apply_prune_options();
  return session;
}

void VlmSession::apply_prune_options() {
  const auto& p = options_.prune;
  std::optional<model::PrunePlan> plan;
  if (!p.rule.empty()) {
    plan.emplace();
    plan->rule = model::parse_prune_rule(p.rule, "--prune-rule");
    plan->min_keep = plan->rule == model::PruneRule::kDual ? p.floor : 0.0;
    plan->seed = p.seed;
    const auto cut = model::parse_prune_cut(p.cut, "--prune-cut");
    plan->steps.push_back({p.layer, p.threshold, p.keep, cut});
    const auto where = fmt::format("{} layer {}", cut == model::PruneCut::kInput ? "at the input of" : "after", p.layer);
    prune_description_ = plan->rule == model::PruneRule::kDual
                             ? fmt::format("vlmopt {} threshold {} floor {}", where, p.threshold, p.floor)
                             : fmt::format("{} {} keep {}", p.rule, where, p.keep);
  } else {
    std::filesystem::path file = p.config;
    if (file.empty() && p.apply_bundle_plan && !options_.bundle.empty()) {
      const auto candidate = std::filesystem::path(options_.bundle) / model::kPruneFile;
      if (std::filesystem::exists(candidate)) file = candidate;
    }
    if (!file.empty()) {
      const auto config = model::read_prune_config(file);
      plan = config.plan(p.scenario);
      prune_description_ = fmt::format("{} (scenario {})", file.string(),
                                       p.scenario.empty() ? config.default_scenario : p.scenario);
    }
  }
  if (plan && !p.batch_keep.empty()) {
    plan->batch_keep = model::parse_batch_keep(p.batch_keep, "--prune-batch-keep");
    prune_description_ += fmt::format(", batch_keep {}", p.batch_keep);
  }
  model_.set_prune_plan(plan);
  if (plan) spdlog::info("pruning: {}", prune_description_);
}

std::vector<int64_t> VlmSession::prompt_ids(const std::string& question, int64_t images) const {
  VLMOPT_CHECK(images >= 1, "prompt for {} images", images);
  std::string prompt = options_.prompt_template;
  prompt.replace(prompt.find("{question}"), std::string_view("{question}").size(), question);
  const auto& cfg = model_.config();
  if (images > 1) {
    // One placeholder per image, in order, as HF LlavaProcessor expects for several images.
    const std::string placeholder = tokenizer_.id_to_token(cfg.image_token_id);
    int64_t present = 0;
    for (auto at = prompt.find(placeholder); !placeholder.empty() && at != std::string::npos;
         at = prompt.find(placeholder, at + placeholder.size()))
      ++present;
    if (present == 1) {
      std::string repeated = placeholder;
      for (int64_t i = 1; i < images; ++i) repeated += "\n" + placeholder;
      prompt.replace(prompt.find(placeholder), placeholder.size(), repeated);
    } else if (present != images) {
      throw InputError(fmt::format("--prompt-template: a sample with {} images needs 1 or {} '{}' placeholders, got {}",
                                   images, images, placeholder, present));
    }
  }
  return tokenizer::build_llava_input(tokenizer_, prompt, cfg.image_token_id, cfg.image_tokens_per_image());
}

PreparedBatch VlmSession::prepare(const std::vector<datasets::Sample>& samples) const {
  VLMOPT_CHECK(!samples.empty(), "prepare() needs at least one sample");
  std::vector<std::vector<int64_t>> ids;
  std::vector<cv::Mat> images;
  ids.reserve(samples.size());
  images.reserve(samples.size());
  size_t longest = 0;
  for (const auto& s : samples) {
    ids.push_back(prompt_ids(s.question, 1 + static_cast<int64_t>(s.frames.size())));
    longest = std::max(longest, ids.back().size());
    images.push_back(s.image);
    images.insert(images.end(), s.frames.begin(), s.frames.end());
  }
  const auto batch = static_cast<int64_t>(samples.size());
  auto input_ids = torch::full({batch, static_cast<int64_t>(longest)}, pad_id_, torch::kLong);
  auto mask = torch::zeros({batch, static_cast<int64_t>(longest)}, torch::kLong);
  for (int64_t b = 0; b < batch; ++b) {
    const auto& row = ids[static_cast<size_t>(b)];
    const auto offset = static_cast<int64_t>(longest - row.size());  // left padding
    input_ids[b].slice(0, offset).copy_(torch::tensor(row, torch::kLong));
    mask[b].slice(0, offset).fill_(1);
  }
  const auto device = model_.device();
  return {input_ids.to(device), mask.to(device),
          datasets::preprocess_batch(images, processor_).to(device, model_.dtype())};
}

std::vector<std::string> VlmSession::answer(const PreparedBatch& batch) {
  model::ForwardInputs in;
  in.input_ids = batch.input_ids;
  in.attention_mask = batch.attention_mask;
  in.pixel_values = batch.pixel_values;
  const auto tokens = model_.generate_greedy(in, options_.max_new_tokens, eos_ids_);
  std::vector<std::string> out;
  out.reserve(tokens.size());
  for (const auto& t : tokens) out.push_back(normalize_answer(tokenizer_.decode(t, /*skip_special_tokens=*/true)));
  return out;
}

std::vector<std::string> VlmSession::answer(const std::vector<datasets::Sample>& samples) {
  return answer(prepare(samples));
}

std::string normalize_answer(std::string_view text) {
  std::string s(text);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  auto not_trim = [](unsigned char c) { return !std::isspace(c) && c != '.' && c != '!' && c != '?'; };
  const auto first = std::find_if(s.begin(), s.end(), [](unsigned char c) { return !std::isspace(c); });
  const auto last = std::find_if(s.rbegin(), s.rend(), not_trim).base();
  return first < last ? std::string(first, last) : std::string();
}

}  // namespace vlmopt::eval
