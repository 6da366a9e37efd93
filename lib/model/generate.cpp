// Greedy decoding with the KV cache (LlavaModel::generate_greedy), following
// transformers' generate(): prefill on the whole prompt, then one token per
// step with the mask extended by one and positions continuing from the last.
#include "model/llava.hpp"

#include "util/error.hpp"

#include <algorithm>

namespace vlmopt::model {

std::vector<std::vector<int64_t>> LlavaModel::generate_greedy(const ForwardInputs& prompt, int max_new_tokens,
                                                              std::vector<int64_t> eos_ids) {
  VLMOPT_CHECK_INPUT(prompt.cache == nullptr, "generate: the prompt must not carry a KV cache");
  VLMOPT_CHECK_INPUT(max_new_tokens >= 0, "generate: max_new_tokens (expected >= 0, got {})", max_new_tokens);
  check_input_ids(prompt.input_ids);
  torch::NoGradGuard no_grad;
  const int64_t batch = prompt.input_ids.size(0), tokens = prompt.input_ids.size(1);
  std::vector<std::vector<int64_t>> generated(static_cast<size_t>(batch));
  if (max_new_tokens == 0) return generated;

  KVCache cache(language_->num_layers());
  const auto ones_options = torch::TensorOptions().device(device_).dtype(torch::kInt64);
  ForwardInputs step = prompt;
  step.cache = &cache;
  step.output_hidden_states = false;
  step.enable_grad = false;
  step.logits_to_keep = 1;
  step.attention_mask =
      prompt.attention_mask.defined() ? prompt.attention_mask.to(device_, torch::kInt64) : torch::ones({batch, tokens}, ones_options);
  step.position_ids = prompt.position_ids.defined() ? prompt.position_ids.to(device_, torch::kInt64)
                                                    : default_position_ids(step.attention_mask, batch, tokens, 0);

  std::vector<bool> finished(static_cast<size_t>(batch), false);
  for (int n = 0; n < max_new_tokens; ++n) {
    const auto out = forward(step);
    // argmax takes the first maximum, as torch.argmax in HF's greedy search.
    const auto next = out.logits.select(1, out.logits.size(1) - 1).argmax(-1);  // [B]
    const auto next_cpu = next.to(torch::kCPU, torch::kInt64).contiguous();
    const auto* ids = next_cpu.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      if (finished[static_cast<size_t>(b)]) continue;
      generated[static_cast<size_t>(b)].push_back(ids[b]);
      if (std::find(eos_ids.begin(), eos_ids.end(), ids[b]) != eos_ids.end()) finished[static_cast<size_t>(b)] = true;
    }
    if (std::all_of(finished.begin(), finished.end(), [](bool f) { return f; })) break;
    // Next step: the new tokens only (finished rows keep decoding; their output is dropped).
    step.input_ids = next.unsqueeze(1);
    step.pixel_values = torch::Tensor();
    step.attention_mask = torch::cat({step.attention_mask, torch::ones({batch, 1}, ones_options)}, 1);
    step.position_ids = step.position_ids.slice(1, step.position_ids.size(1) - 1) + 1;
  }
  return generated;
}

}  // namespace vlmopt::model
