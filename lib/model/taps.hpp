// Activation taps: named points of the forward pass (every Linear input/output,
// attention probabilities, hidden states, projector output, logits) that
// observers, losses and diagnostics subscribe to without touching the forward
// code. Tap names are the canonical module names (design.md §3):
//   <linear>.input / <linear>.output        every Linear, incl. vision tower, projector, lm_head
//   <attention module>.probs                 [B,H,Tq,Tk] softmax probabilities
//   model.vision_tower.hidden_states.<k>     k = 0 embeddings (after pre-LN), k = l+1 output of layer l
//   model.language_model.hidden_states.<k>   k = 0 decoder input, k = l+1 output of layer l (before final norm)
//   model.multi_modal_projector.output       [B,N,D_text]
//   lm_head.output                           the logits
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::model {

struct TapContext {
  // [B,T] bool, true at image-token positions of the tokens in this forward (decoder taps only).
  const torch::Tensor* image_mask = nullptr;
  // [B,T] of the tokens in this forward, 1 = real token, 0 = padding (decoder taps only; null = no padding).
  const torch::Tensor* attention_mask = nullptr;
  int layer = -1;  // decoder or vision layer index, -1 outside layers
};

// Subscriptions to named taps. Callbacks run synchronously inside the forward
// pass and must not subscribe or unsubscribe while being called. Not thread-safe.
class Taps {
 public:
  using Callback = std::function<void(std::string_view name, const torch::Tensor&, const TapContext&)>;

  // `pattern` is an exact tap name, or a prefix followed by a single trailing '*'
  // ("model.language_model.layers.3.*", or "*" for everything). Returns an id for unsubscribe().
  int subscribe(std::string pattern, Callback callback);
  // Unknown ids are ignored (unsubscribing twice is harmless).
  void unsubscribe(int id);
  void clear() { subscriptions_.clear(); }

  // True when anything is subscribed; the forward code checks this first so an
  // unobserved model pays one branch per tap point.
  bool active() const { return !subscriptions_.empty(); }
  bool wants(std::string_view name) const;
  // Calls every matching subscriber, in subscription order.
  void emit(std::string_view name, const torch::Tensor& tensor, const TapContext& context) const;

  static bool matches(std::string_view pattern, std::string_view name);

 private:
  struct Subscription {
    int id;
    std::string pattern;
    Callback callback;
  };
  std::vector<Subscription> subscriptions_;
  int next_id_ = 1;
};

// The one test each tap point makes: cheap when `taps` is null or idle.
inline bool tap_wanted(const Taps* taps, std::string_view name) {
  return taps != nullptr && taps->active() && taps->wants(name);
}

}  // namespace vlmopt::model
