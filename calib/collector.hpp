// The collector of calibrate: subscribes to the model's taps and feeds every
// observed activation point into observers, kept apart per modality (image-token
// vs text-token positions), plus per-channel ranges (outliers, SmoothQuant),
// FP16 safety counts and a small token sample for error estimates.
//
// Data source (datasets + VlmSession::prepare), collector (this file) and
// persistence (MP-Cache, bundle export) are separate; collectors over shards of
// data merge exactly (ActivationCollector::merge).
#pragma once

#include "calib/fp16_safety.hpp"
#include "calib/observers.hpp"
#include "model/llava.hpp"

#include <torch/torch.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace vlmopt::calib {

enum class Modality { kImage, kText };

// Statistics of one activation point: the input shared by the Linears of one
// fused group (q/k/v, gate/up) or of one Linear.
struct ActivationStats {
  std::string tap;                  // the tap observed, e.g. "...self_attn.q_proj.input"
  std::vector<std::string> linears; // the Linears that read this input
  std::unique_ptr<Observer> image;  // observer over image-token positions
  std::unique_ptr<Observer> text;   // observer over text-token positions (padding excluded)
  // Per input channel, over both modalities, float32 [in] (undefined until observed).
  torch::Tensor channel_min, channel_max;
  // Per modality per-tensor min/max, float32 [2] each: {min, max}; undefined if never seen.
  torch::Tensor image_range, text_range;
  int64_t image_tokens = 0, text_tokens = 0;  // tokens seen per modality
  Fp16Counter fp16;          // what this collector saw
  Fp16Safety fp16_merged;    // what merged collectors saw
  torch::Tensor sample;  // [<=sample_tokens, in] float32 CPU: first tokens seen, for SQNR

  torch::Tensor channel_absmax() const;  // max(|min|, |max|) per channel
  Fp16Safety fp16_safety() const {
    auto result = fp16.result();
    result.merge(fp16_merged);
    return result;
  }
  // Combined observer (image merged with text): what the scale is computed from.
  std::unique_ptr<Observer> combined(const ObserverOptions& options) const;
  // Adds one batch of `tokens` rows of `modality` with per-channel min / max
  // (float32 [in]) to channel_min / channel_max, the modality's range and token count.
  void add_range(Modality modality, int64_t tokens, const torch::Tensor& cmin32, const torch::Tensor& cmax32);
};

struct CollectorOptions {
  ObserverOptions observer;       // for activations
  int64_t sample_tokens = 256;    // tokens kept per point for SQNR estimates
  bool observers = true;          // false: channel ranges only (SmoothQuant's first pass)
};

class ActivationCollector {
 public:
  // Observes the inputs of `linears` (canonical names). Linears of one fused group
  // are observed once, through the group's first member.
  ActivationCollector(model::LlavaModel& model, const std::vector<std::string>& linears, CollectorOptions options);
  ~ActivationCollector();  // unsubscribes
  ActivationCollector(const ActivationCollector&) = delete;
  ActivationCollector& operator=(const ActivationCollector&) = delete;

  void detach();  // unsubscribes early
  // Adds another collector's statistics (same model, linears and options).
  void merge(ActivationCollector& other);

  // Keyed by the Linear names that read each point (every member of a group maps to the same stats).
  const ActivationStats& stats_for(const std::string& linear) const;
  const std::vector<std::unique_ptr<ActivationStats>>& points() const { return points_; }
  const CollectorOptions& options() const { return options_; }

 private:
  void observe(ActivationStats& stats, const torch::Tensor& x, const model::TapContext& context);
  // CPU rows [N, in] (contiguous): every row of `only`, or classes from the bool [N] masks.
  void observe_fused(ActivationStats& stats, const torch::Tensor& rows, std::optional<Modality> only,
                     const torch::Tensor& valid, const torch::Tensor& image);
  model::Taps* taps_;
  CollectorOptions options_;
  std::vector<std::unique_ptr<ActivationStats>> points_;
  std::map<std::string, ActivationStats*> by_linear_;
  std::vector<int> subscriptions_;
};

// The fused-group key of a Linear ("<layer>.self_attn.qkv", "<layer>.mlp.gate_up"),
// or the Linear's own name when it is not fused.
std::string fused_group_of(const std::string& linear);

}  // namespace vlmopt::calib
