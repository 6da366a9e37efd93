#include "calib/collector.hpp"

#include "calib/row_stats.hpp"
#include "util/error.hpp"

#include <algorithm>
#include <optional>

namespace vlmopt::calib {

namespace {

// "<prefix>.self_attn.q_proj" -> {"<prefix>.self_attn", "q_proj"}.
std::pair<std::string, std::string> split_last(const std::string& name) {
  const auto dot = name.rfind('.');
  if (dot == std::string::npos) return {"", name};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

torch::Tensor min_or(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() ? torch::minimum(a, b) : b;
}
torch::Tensor max_or(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() ? torch::maximum(a, b) : b;
}
// {min, max} of two [2] ranges.
torch::Tensor combine_range(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  return torch::stack({torch::minimum(a[0], b[0]), torch::maximum(a[1], b[1])});
}

}  // namespace

std::string fused_group_of(const std::string& linear) {
  const auto [parent, leaf] = split_last(linear);
  if (parent.ends_with(".self_attn") && (leaf == "q_proj" || leaf == "k_proj" || leaf == "v_proj"))
    return parent + ".qkv";
  if (parent.ends_with(".mlp") && (leaf == "gate_proj" || leaf == "up_proj")) return parent + ".gate_up";
  return linear;
}

torch::Tensor ActivationStats::channel_absmax() const {
  VLMOPT_CHECK(channel_min.defined(), "no activations were observed at {}", tap);
  return torch::maximum(channel_min.abs(), channel_max.abs());
}

std::unique_ptr<Observer> ActivationStats::combined(const ObserverOptions& options) const {
  auto all = make_observer(options);
  if (image) all->merge(*image);
  if (text) all->merge(*text);
  return all;
}

ActivationCollector::ActivationCollector(model::LlavaModel& model, const std::vector<std::string>& linears,
                                         CollectorOptions options)
    : taps_(&model.taps()), options_(std::move(options)) {
  std::map<std::string, ActivationStats*> by_group;
  for (const auto& linear : linears) {
    const auto group = fused_group_of(linear);
    auto it = by_group.find(group);
    if (it == by_group.end()) {
      auto stats = std::make_unique<ActivationStats>();
      stats->tap = linear + ".input";
      if (options_.observers) {
        stats->image = make_observer(options_.observer);
        stats->text = make_observer(options_.observer);
      }
      it = by_group.emplace(group, stats.get()).first;
      points_.push_back(std::move(stats));
    }
    it->second->linears.push_back(linear);
    by_linear_[linear] = it->second;
  }
  for (auto& point : points_) {
    ActivationStats* stats = point.get();
    subscriptions_.push_back(taps_->subscribe(
        stats->tap, [this, stats](std::string_view, const torch::Tensor& x, const model::TapContext& context) {
          observe(*stats, x, context);
        }));
  }
}

ActivationCollector::~ActivationCollector() { detach(); }

void ActivationCollector::detach() {
  for (int id : subscriptions_) taps_->unsubscribe(id);
  subscriptions_.clear();
}

const ActivationStats& ActivationCollector::stats_for(const std::string& linear) const {
  const auto it = by_linear_.find(linear);
  VLMOPT_CHECK(it != by_linear_.end(), "'{}' is not observed by this collector", linear);
  return *it->second;
}

void ActivationStats::add_range(Modality modality, int64_t tokens, const torch::Tensor& cmin32,
                                const torch::Tensor& cmax32) {
  channel_min = min_or(channel_min, cmin32);
  channel_max = max_or(channel_max, cmax32);
  const auto range = torch::stack({cmin32.min(), cmax32.max()});
  if (modality == Modality::kImage) {
    image_range = combine_range(image_range, range);
    image_tokens += tokens;
  } else {
    text_range = combine_range(text_range, range);
    text_tokens += tokens;
  }
}

void ActivationCollector::observe(ActivationStats& s, const torch::Tensor& x_in, const model::TapContext& context) {
  torch::NoGradGuard no_grad;
  const auto x = x_in.detach();
  const int64_t channels = x.size(-1);
  const auto rows = x.reshape({-1, channels});
  // Decoder and lm_head taps carry the image-token mask; the vision tower and the
  // projector see image content only.
  const bool decoder = !(s.tap.starts_with("model.vision_tower.") || s.tap.starts_with("model.multi_modal_projector."));
  // lm_head with logits_to_keep sees fewer positions than the masks describe:
  // those are the last (text) positions, taken as they are.
  const bool masks_fit = (context.image_mask == nullptr || context.image_mask->numel() == rows.size(0)) &&
                         (context.attention_mask == nullptr || context.attention_mask->numel() == rows.size(0));
  // Every row of one modality (no masks apply), or per-row classes from the masks.
  std::optional<Modality> only;
  torch::Tensor valid, image;  // bool [rows] on the masks' device
  if (decoder && !masks_fit) {
    only = Modality::kText;
  } else if (decoder) {
    valid = context.attention_mask != nullptr ? (context.attention_mask->reshape({-1}) != 0)
                                              : torch::ones({rows.size(0)}, rows.options().dtype(torch::kBool));
    if (context.image_mask != nullptr) image = context.image_mask->reshape({-1});
  } else {
    only = Modality::kImage;
  }
  if (row_stats_supported(rows)) {
    observe_fused(s, rows.contiguous(), only, valid, image);
    return;
  }

  torch::Tensor image_rows, text_rows;
  if (only) {
    (*only == Modality::kImage ? image_rows : text_rows) = rows;
  } else if (image.defined()) {
    image_rows = rows.index({image & valid});
    text_rows = rows.index({valid & image.logical_not()});
  } else {
    text_rows = rows.index({valid});
  }
  auto update = [&](const torch::Tensor& part, Modality modality) {
    if (!part.defined() || part.size(0) == 0) return;
    const auto [cmin, cmax] = torch::aminmax(part, 0);  // [in] each
    s.add_range(modality, part.size(0), cmin.to(torch::kFloat32), cmax.to(torch::kFloat32));
    if (auto& observer = modality == Modality::kImage ? s.image : s.text) observer->observe(part);
    s.fp16.observe(part);
    const int64_t have = s.sample.defined() ? s.sample.size(0) : 0;
    if (have < options_.sample_tokens) {
      const auto take = part.slice(0, 0, std::min(part.size(0), options_.sample_tokens - have))
                            .to(torch::kCPU, torch::kFloat32);
      s.sample = s.sample.defined() ? torch::cat({s.sample, take}) : take.clone();
    }
  };
  update(image_rows, Modality::kImage);
  update(text_rows, Modality::kText);
}

// The CPU path: one fused pass (calib/row_stats) gives both modalities' channel
// ranges, token counts and FP16 figures; observers get the rows in place with
// their per-channel min / max. Same statistics as the torch path above.
void ActivationCollector::observe_fused(ActivationStats& s, const torch::Tensor& rows, std::optional<Modality> only,
                                        const torch::Tensor& valid, const torch::Tensor& image) {
  torch::Tensor row_class;  // uint8 [rows]: kImageRow / kTextRow / kSkipRow (padding)
  std::vector<ClassRowStats> stats;
  if (only) {
    stats = row_stats(rows, {}, 1);
  } else {
    const auto valid_cpu = valid.to(torch::kCPU);
    if (image.defined()) {
      const auto image_cpu = image.to(torch::kCPU, torch::kBool);
      row_class = torch::where(image_cpu, kImageRow, kTextRow).to(torch::kUInt8) * valid_cpu.to(torch::kUInt8);
    } else {
      row_class = valid_cpu.to(torch::kUInt8) * kTextRow;
    }
    stats = row_stats(rows, row_class, 2);
  }
  auto update = [&](Modality modality) {
    const uint8_t value = modality == Modality::kImage ? kImageRow : kTextRow;
    if (only && *only != modality) return;
    const ClassRowStats& cs = only ? stats[0] : stats[value - 1];
    if (cs.rows == 0) return;
    s.add_range(modality, cs.rows, cs.min, cs.max);
    ActivationBatch batch;
    batch.rows = rows;
    batch.row_class = row_class;
    batch.row_class_value = value;
    batch.count = cs.rows;
    batch.channel_min = cs.min;
    batch.channel_max = cs.max;
    if (auto& observer = modality == Modality::kImage ? s.image : s.text) observer->observe(batch);
    s.fp16.add(cs.fp16);
    const int64_t have = s.sample.defined() ? s.sample.size(0) : 0;
    if (have < options_.sample_tokens) {
      // The first tokens of this modality, in order (as the torch path's slice of its rows).
      const int64_t want = std::min(cs.rows, options_.sample_tokens - have);
      const auto take = row_class.defined()
                            ? rows.index_select(0, (row_class == value).nonzero().reshape({-1}).slice(0, 0, want))
                            : rows.slice(0, 0, want);
      const auto take32 = take.to(torch::kFloat32);
      s.sample = s.sample.defined() ? torch::cat({s.sample, take32}) : take32.clone();
    }
  };
  update(Modality::kImage);
  update(Modality::kText);
}

void ActivationCollector::merge(ActivationCollector& other) {
  VLMOPT_CHECK(other.points_.size() == points_.size(), "collectors differ: {} vs {} points", points_.size(),
               other.points_.size());
  for (std::size_t i = 0; i < points_.size(); ++i) {
    auto& a = *points_[i];
    auto& b = *other.points_[i];
    VLMOPT_CHECK(a.tap == b.tap, "collectors differ at point {}: {} vs {}", i, a.tap, b.tap);
    if (a.image && b.image) a.image->merge(*b.image);
    if (a.text && b.text) a.text->merge(*b.text);
    if (b.channel_min.defined()) {
      a.channel_min = min_or(a.channel_min, b.channel_min);
      a.channel_max = max_or(a.channel_max, b.channel_max);
    }
    a.image_range = combine_range(a.image_range, b.image_range);
    a.text_range = combine_range(a.text_range, b.text_range);
    a.image_tokens += b.image_tokens;
    a.text_tokens += b.text_tokens;
    // FP16 statistics merge through their results (exact integer counts and extrema).
    a.fp16_merged.merge(b.fp16_safety());
    if (b.sample.defined()) {
      const int64_t have = a.sample.defined() ? a.sample.size(0) : 0;
      if (have < options_.sample_tokens) {
        const auto take = b.sample.slice(0, 0, options_.sample_tokens - have);
        a.sample = a.sample.defined() ? torch::cat({a.sample, take}) : take.clone();
      }
    }
  }
}

}  // namespace vlmopt::calib
