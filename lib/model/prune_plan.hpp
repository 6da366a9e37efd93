// Visual-token pruning during the prefill (design.md §7): which decoder layers
// score the visual tokens, the rule that decides how many survive, and what a
// pruned prefill reports back (visual tokens each layer processed).
//
// A step at layer l scores the visual tokens with the attention they receive
// in layer l (its own q/k on the layer's input, recomputed for the query rows
// only, so it also works with fused attention). With the default output cut,
// layers l+1.. see only the kept tokens at their ORIGINAL positions (RoPE) and
// layer l and every layer before it process (and cache) the full prompt. With
// the input cut, layer l itself already runs on the kept tokens: its scores come
// from its input, so nothing else changes, but one more layer is cheaper (the
// only way to shorten layer 0).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::model {

enum class PruneRule {
  // vlmopt: attention from the text rows after the image, p = that attention
  // renormalised over the visual tokens, score_j = p_j * exp(H(p)) (1 = the
  // level of a uniform map over the effective support exp(H)); keep score >= threshold.
  // A peaked (low-entropy) map has a small support, so the same threshold drops more.
  kDual,
  // FastV: attention from the last query token, keep the top keep_ratio fraction.
  kFastV,
  // A seeded random subset of the same size as FastV's.
  kRandom,
};

// How kDual sets the keep counts of the samples of one batch.
enum class BatchKeep {
  // Each sample keeps what its own threshold gives: answers do not depend on the
  // batch, but the batch is left-padded to its longest sample after the cut.
  kPerSample,
  // Every sample keeps the batch's mean kept fraction (its highest-scoring tokens):
  // no padding, so a batch runs at its mean length. Answers may depend on the batch.
  kBatchMean,
};

std::string_view prune_rule_name(PruneRule rule);
std::string_view batch_keep_name(BatchKeep mode);
// "per_sample" | "batch_mean"; InputError naming `where` otherwise.
BatchKeep parse_batch_keep(std::string_view name, std::string_view where);
// "vlmopt" (or "dual"), "fastv", "random"; InputError naming `where` otherwise.
PruneRule parse_prune_rule(std::string_view name, std::string_view where);

// Where a step drops the tokens it did not keep.
enum class PruneCut {
  kOutput,  // after its layer: the layer itself processes every token ("output", the default)
  kInput,   // before its layer: the layer already processes the kept tokens only ("input")
};

std::string_view prune_cut_name(PruneCut cut);
// "output" | "input"; InputError naming `where` otherwise.
PruneCut parse_prune_cut(std::string_view name, std::string_view where);

struct PruneStep {
  int64_t after_layer = 0;  // 0-based decoder layer whose attention scores the tokens
  double threshold = 1.0;   // kDual: keep score >= threshold
  double keep_ratio = 1.0;  // kFastV / kRandom: fraction of the step's visual tokens kept (rounded)
  PruneCut cut = PruneCut::kOutput;
  // The first layer that sees only the kept tokens.
  int64_t first_pruned_layer() const { return cut == PruneCut::kInput ? after_layer : after_layer + 1; }
};

struct PrunePlan {
  PruneRule rule = PruneRule::kDual;
  // Strictly increasing first_pruned_layer(), each < layers (an output cut is
  // therefore never after the last layer, which has nothing after it to benefit).
  std::vector<PruneStep> steps;
  // kDual per-sample bounds on the kept fraction of the visual tokens entering a step:
  // min_keep is the floor, max_keep the hardware-aware cap max(floor, 1 - a*mem - b*l2).
  double min_keep = 0.3;
  double max_keep = 1.0;
  BatchKeep batch_keep = BatchKeep::kPerSample;  // kDual
  uint64_t seed = 0;                              // kRandom
  // InputError (naming `where`) for cuts outside the decoder or unsorted, ratios out of [0,1].
  void validate(int64_t num_layers, std::string_view where = "prune plan") const;
};

struct PruneReport {
  // visual_tokens[l][b]: visual tokens decoder layer l processed for sample b.
  std::vector<std::vector<int64_t>> visual_tokens;
  // entropy[s][b]: entropy (nats) of step s's text->visual attention map for sample b (0 for kRandom).
  std::vector<std::vector<double>> entropy;
  bool empty() const { return visual_tokens.empty(); }
  // Equivalent-token accounting: mean over samples of the mean over layers.
  double mean_visual_tokens() const;
};

// Which tokens a step keeps. scores [B,T] fp32 (attention each key received,
// any scale; ignored for kRandom), candidates [B,T] bool (the visual tokens that
// may be dropped). Returns keep [B,T] bool: every non-candidate, plus the
// selected candidates (highest scores; ties by position). `entropy` gets one value per sample.
torch::Tensor select_kept_tokens(const PrunePlan& plan, const PruneStep& step, int64_t step_index,
                                 const torch::Tensor& scores, const torch::Tensor& candidates,
                                 std::vector<double>* entropy = nullptr);

// The kDual score p_j * exp(H(p)) of every candidate ([B,T] fp32, 0 elsewhere)
// and H (nats) per sample; exposed so prune-fit learns thresholds on the same scale.
std::pair<torch::Tensor, torch::Tensor> dual_scores(const torch::Tensor& scores, const torch::Tensor& candidates);

}  // namespace vlmopt::model
