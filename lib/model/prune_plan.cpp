#include "model/prune_plan.hpp"

#include "model/layers.hpp"
#include "util/error.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace vlmopt::model {

std::string_view prune_rule_name(PruneRule rule) {
  switch (rule) {
    case PruneRule::kDual: return "vlmopt";
    case PruneRule::kFastV: return "fastv";
    case PruneRule::kRandom: return "random";
  }
  return "?";
}

PruneRule parse_prune_rule(std::string_view name, std::string_view where) {
  if (name == "vlmopt" || name == "dual") return PruneRule::kDual;
  if (name == "fastv") return PruneRule::kFastV;
  if (name == "random") return PruneRule::kRandom;
  throw InputError(fmt::format("{}: expected one of vlmopt, fastv, random, got '{}'", where, name));
}

std::string_view batch_keep_name(BatchKeep mode) {
  return mode == BatchKeep::kBatchMean ? "batch_mean" : "per_sample";
}

BatchKeep parse_batch_keep(std::string_view name, std::string_view where) {
  if (name == "per_sample") return BatchKeep::kPerSample;
  if (name == "batch_mean") return BatchKeep::kBatchMean;
  throw InputError(fmt::format("{}: expected one of per_sample, batch_mean, got '{}'", where, name));
}

std::string_view prune_cut_name(PruneCut cut) { return cut == PruneCut::kInput ? "input" : "output"; }

PruneCut parse_prune_cut(std::string_view name, std::string_view where) {
  if (name == "output") return PruneCut::kOutput;
  if (name == "input") return PruneCut::kInput;
  throw InputError(fmt::format("{}: expected one of output, input, got '{}'", where, name));
}

void PrunePlan::validate(int64_t num_layers, std::string_view where) const {
  VLMOPT_CHECK_INPUT(min_keep >= 0.0 && min_keep <= 1.0, "{}: min_keep: expected a fraction in [0,1], got {}", where,
                     min_keep);
  VLMOPT_CHECK_INPUT(max_keep >= min_keep && max_keep <= 1.0, "{}: max_keep: expected a fraction in [{},1], got {}",
                     where, min_keep, max_keep);
  int64_t previous = -1;  // first pruned layer of the step before
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& s = steps[i];
    // An output cut after the last layer has nothing after it to benefit from the pruning.
    const int64_t last = s.cut == PruneCut::kInput ? num_layers : num_layers - 1;
    VLMOPT_CHECK_INPUT(s.after_layer >= 0 && s.after_layer < last && s.first_pruned_layer() > previous,
                       "{}: steps[{}].after_layer: expected increasing cuts, layers in [0, {}) for a {} cut, got {}",
                       where, i, last, prune_cut_name(s.cut), s.after_layer);
    VLMOPT_CHECK_INPUT(std::isfinite(s.threshold) && s.threshold >= 0.0,
                       "{}: steps[{}].threshold: expected a finite number >= 0, got {}", where, i, s.threshold);
    VLMOPT_CHECK_INPUT(s.keep_ratio >= 0.0 && s.keep_ratio <= 1.0,
                       "{}: steps[{}].keep_ratio: expected a fraction in [0,1], got {}", where, i, s.keep_ratio);
    previous = s.first_pruned_layer();
  }
}

double PruneReport::mean_visual_tokens() const {
  if (visual_tokens.empty() || visual_tokens.front().empty()) return 0.0;
  double total = 0.0;
  for (const auto& layer : visual_tokens)
    for (const int64_t n : layer) total += static_cast<double>(n);
  return total / static_cast<double>(visual_tokens.size() * visual_tokens.front().size());
}

std::pair<torch::Tensor, torch::Tensor> dual_scores(const torch::Tensor& scores, const torch::Tensor& candidates) {
  const auto s = scores.to(torch::kFloat32).masked_fill(candidates.logical_not(), 0.0);
  const auto p = s / s.sum(1, true).clamp_min(std::numeric_limits<float>::min());
  // 0 * log 0 = 0: xlogy.
  const auto entropy = -at::xlogy(p, p).sum(1);  // [B] nats
  return {p * entropy.exp().unsqueeze(1), entropy};
}

torch::Tensor select_kept_tokens(const PrunePlan& plan, const PruneStep& step, int64_t step_index,
                                 const torch::Tensor& scores, const torch::Tensor& candidates,
                                 std::vector<double>* entropy) {
  VLMOPT_CHECK(scores.dim() == 2 && candidates.sizes() == scores.sizes(), "prune scores {} vs candidates {}",
               shape_string(scores.sizes()), shape_string(candidates.sizes()));
  const auto cand = candidates.to(torch::kBool);
  const auto available = cand.sum(1).to(torch::kFloat64);  // [B] visual tokens entering the step
  torch::Tensor ranked;                                    // higher = kept first
  torch::Tensor count;                                     // [B] int64 tokens to keep
  torch::Tensor sample_entropy;
  switch (plan.rule) {
    case PruneRule::kDual: {
      auto [dual, h] = dual_scores(scores, cand);
      sample_entropy = h;
      const auto above = (dual >= step.threshold).logical_and(cand).sum(1).to(torch::kFloat64);
      // Tiny slack so a ratio that is an exact multiple of 1/N is not lost to rounding.
      const auto low = (available * plan.min_keep - 1e-9).ceil();
      const auto high = (available * plan.max_keep + 1e-9).floor();
      auto wanted = torch::maximum(low, torch::minimum(above, high));
      if (plan.batch_keep == BatchKeep::kBatchMean && wanted.size(0) > 1) {
        // One kept fraction for the whole batch (the mean of what the thresholds ask
        // for), so every sample leaves the step with the same count and nothing is padded.
        const auto fraction = (wanted / available.clamp_min(1.0)).mean();
        wanted = torch::maximum(low, torch::minimum((available * fraction).round(), high));
      }
      count = wanted.to(torch::kInt64);
      ranked = dual;
      break;
    }
    case PruneRule::kFastV:
    case PruneRule::kRandom: {
      count = (available * step.keep_ratio).round().to(torch::kInt64);
      if (plan.rule == PruneRule::kFastV) {
        ranked = scores.to(torch::kFloat32);
        sample_entropy = dual_scores(scores, cand).second;
      } else {
        // One stream per (seed, step): the same subset whatever the batch composition would
        // need per-sample streams; per-batch is what the baseline needs (mean over seeds).
        auto gen = at::make_generator<at::CPUGeneratorImpl>(plan.seed * 1000003ULL + static_cast<uint64_t>(step_index));
        ranked = torch::rand(scores.sizes(), gen, torch::TensorOptions().dtype(torch::kFloat32)).to(scores.device());
      }
      break;
    }
  }
  const auto masked = ranked.masked_fill(cand.logical_not(), -std::numeric_limits<float>::infinity());
  const auto order = std::get<1>(torch::sort(masked, /*stable=*/true, /*dim=*/1, /*descending=*/true));
  const int64_t tokens = scores.size(1);
  auto rank = torch::empty_like(order);
  rank.scatter_(1, order, torch::arange(tokens, order.options()).unsqueeze(0).expand_as(order));
  const auto kept_candidates = cand.logical_and(rank < count.to(rank.device()).unsqueeze(1));
  if (entropy != nullptr) {
    entropy->clear();
    if (sample_entropy.defined()) {
      const auto h = sample_entropy.to(torch::kCPU, torch::kFloat64).contiguous();
      entropy->assign(h.data_ptr<double>(), h.data_ptr<double>() + h.numel());
    } else {
      entropy->assign(static_cast<size_t>(scores.size(0)), 0.0);
    }
  }
  return cand.logical_not().logical_or(kept_candidates);
}

}  // namespace vlmopt::model
