#include "model/weights.hpp"

#include "io/torch_bridge.hpp"
#include "model/layers.hpp"
#include "util/error.hpp"

#include <fmt/format.h>

#include <unordered_map>
#include <unordered_set>

namespace vlmopt::model {

namespace {

constexpr std::string_view kVisionTower = "model.vision_tower.";
constexpr std::string_view kVisionModel = "vision_model.";

bool strip_prefix(std::string_view& s, std::string_view prefix) {
  if (!s.starts_with(prefix)) return false;
  s.remove_prefix(prefix.size());
  return true;
}

std::string join_first(const std::vector<std::string>& items, size_t limit) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < limit; ++i) {
    if (i > 0) out += ", ";
    out += "'" + items[i] + "'";
  }
  if (items.size() > limit) out += fmt::format(", ... ({} in all)", items.size());
  return out;
}

}  // namespace

std::string_view to_string(KeyLayout layout) { return layout == KeyLayout::kOld ? "old" : "new"; }

std::optional<std::string> canonical_key(std::string_view key) {
  if (key.ends_with(".rotary_emb.inv_freq") || key.ends_with(".position_ids") || key == "position_ids") {
    return std::nullopt;
  }
  std::string out;
  std::string_view rest = key;
  if (strip_prefix(rest, "language_model.model.")) {
    out = "model.language_model." + std::string(rest);
  } else if (strip_prefix(rest, "language_model.lm_head.")) {
    out = "lm_head." + std::string(rest);
  } else if (strip_prefix(rest, "language_model.")) {
    out = "model.language_model." + std::string(rest);
  } else if (strip_prefix(rest, "vision_tower.")) {
    out = "model.vision_tower." + std::string(rest);
  } else if (strip_prefix(rest, "multi_modal_projector.")) {
    out = "model.multi_modal_projector." + std::string(rest);
  } else {
    out = std::string(key);
  }
  // transformers >= 5 drops the vision_model level of the vision tower.
  std::string_view tail = out;
  if (strip_prefix(tail, kVisionTower) && !tail.starts_with(kVisionModel)) {
    out = std::string(kVisionTower) + std::string(kVisionModel) + std::string(tail);
  }
  return out;
}

std::string on_disk_key(std::string_view canonical, KeyLayout layout) {
  if (layout == KeyLayout::kNew) return std::string(canonical);
  std::string_view rest = canonical;
  if (strip_prefix(rest, "model.language_model.")) return "language_model.model." + std::string(rest);
  if (strip_prefix(rest, "lm_head.")) return "language_model.lm_head." + std::string(rest);
  if (strip_prefix(rest, "model.vision_tower.")) return "vision_tower." + std::string(rest);
  if (strip_prefix(rest, "model.multi_modal_projector.")) return "multi_modal_projector." + std::string(rest);
  return std::string(canonical);
}

KeyLayout detect_layout(const std::vector<std::string>& names) {
  for (const auto& n : names) {
    if (!canonical_key(n)) continue;  // inv_freq / position_ids say nothing about the layout
    if (n.starts_with("language_model.") || n.starts_with("vision_tower.") || n.starts_with("multi_modal_projector.")) {
      return KeyLayout::kOld;
    }
  }
  return KeyLayout::kNew;
}

TensorSource::~TensorSource() = default;
void TensorSource::release(std::string_view) const {}

void CheckpointSource::release(std::string_view name) const {
  const auto [file, info] = checkpoint_.locate(name);
  file->release_pages(*info);
}

SubtreeSource::SubtreeSource(const TensorSource& base, std::string canonical_prefix)
    : base_(base), prefix_(std::move(canonical_prefix)) {
  for (const auto& name : base_.names()) {
    const auto canonical = canonical_key(name);
    if (canonical && canonical->starts_with(prefix_)) on_disk_.emplace(canonical->substr(prefix_.size()), name);
  }
}

std::vector<std::string> SubtreeSource::names() const {
  std::vector<std::string> out;
  out.reserve(on_disk_.size());
  for (const auto& [relative, name] : on_disk_) out.push_back(relative);
  return out;
}

const std::string& SubtreeSource::on_disk(std::string_view name) const {
  const auto it = on_disk_.find(name);
  if (it == on_disk_.end()) throw InputError(fmt::format("{}: no tensor '{}{}'", base_.describe(), prefix_, name));
  return it->second;
}

TensorSource::Meta SubtreeSource::meta(std::string_view name) const { return base_.meta(on_disk(name)); }
torch::Tensor SubtreeSource::load(std::string_view name) const { return base_.load(on_disk(name)); }
std::string SubtreeSource::describe() const { return fmt::format("{} ({}*)", base_.describe(), prefix_); }
void SubtreeSource::release(std::string_view name) const { base_.release(on_disk(name)); }

TensorSource::Meta CheckpointSource::meta(std::string_view name) const {
  const auto [file, info] = checkpoint_.locate(name);
  const bool floating = info->dtype == io::DType::kF32 || info->dtype == io::DType::kF16 ||
                        info->dtype == io::DType::kBF16 || info->dtype == io::DType::kF64;
  return Meta{info->shape, floating, std::string(io::dtype_name(info->dtype))};
}

torch::Tensor CheckpointSource::load(std::string_view name) const { return io::load_tensor(checkpoint_, name); }

std::vector<std::string> MapSource::names() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : tensors_) out.push_back(name);
  return out;
}

TensorSource::Meta MapSource::meta(std::string_view name) const {
  const auto& t = tensors_.find(name)->second;
  return Meta{t.sizes().vec(), t.is_floating_point(), std::string(c10::toString(t.scalar_type()))};
}

torch::Tensor MapSource::load(std::string_view name) const { return tensors_.find(name)->second; }

LoadReport load_parameters(torch::nn::Module& root, const TensorSource& source, const LoadOptions& options) {
  const std::string where = source.describe();
  LoadReport report;
  const auto on_disk = source.names();
  report.layout = detect_layout(on_disk);

  // canonical -> on-disk name, each canonical name exactly once.
  std::map<std::string, std::string> by_canonical;
  for (const auto& name : on_disk) {
    auto canonical = canonical_key(name);
    if (!canonical) {
      report.ignored.push_back(name);
      continue;
    }
    auto [it, inserted] = by_canonical.emplace(*canonical, name);
    if (!inserted) {
      throw InputError(fmt::format("{}: tensor '{}' given twice (as '{}' and '{}')", where, *canonical, it->second,
                                   name));
    }
  }

  // Pass 1: names, shapes and dtypes against metadata only.
  struct Planned {
    torch::Tensor param;
    std::string on_disk;
  };
  std::vector<Planned> plan;
  std::unordered_set<const void*> filled;  // TensorImpl of parameters already planned (tied weights)
  std::vector<std::string> missing;
  std::set<std::string> consumed;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    const torch::Tensor& param = item.value();
    if (options.skip.contains(name)) continue;
    if (filled.contains(param.unsafeGetTensorImpl())) {
      if (by_canonical.contains(name)) consumed.insert(name);  // a tied copy on disk is accepted
      continue;
    }
    const auto found = by_canonical.find(name);
    if (found == by_canonical.end()) {
      if (options.optional.contains(name)) {
        report.absent.push_back(name);
      } else {
        missing.push_back(name);
      }
      continue;
    }
    const auto meta = source.meta(found->second);
    if (!meta.floating) {
      throw InputError(fmt::format("{}: tensor '{}' dtype (expected a floating type, got {})", where, found->second,
                                   meta.dtype));
    }
    if (c10::IntArrayRef(meta.shape) != param.sizes()) {
      throw InputError(fmt::format("{}: tensor '{}' shape (expected {}, got {})", where, found->second,
                                   shape_string(param.sizes()), shape_string(std::span<const int64_t>(meta.shape))));
    }
    consumed.insert(name);
    filled.insert(param.unsafeGetTensorImpl());
    plan.push_back(Planned{param, found->second});
  }
  if (!missing.empty()) {
    std::vector<std::string> spelled;
    for (const auto& m : missing) spelled.push_back(on_disk_key(m, report.layout));
    throw InputError(fmt::format("{}: missing tensor(s) {} (canonical {})", where, join_first(spelled, 5),
                                 join_first(missing, 5)));
  }
  std::vector<std::string> unexpected;
  for (const auto& [canonical, name] : by_canonical) {
    if (consumed.contains(canonical)) continue;
    if (options.skip.contains(canonical)) {
      report.ignored.push_back(name);
      continue;
    }
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    throw InputError(fmt::format("{}: unexpected tensor(s) {}", where, join_first(unexpected, 5)));
  }

  // Pass 2: data.
  torch::NoGradGuard no_grad;
  for (auto& p : plan) {
    p.param.copy_(source.load(p.on_disk));
    source.release(p.on_disk);  // the copy is what we keep; mapped file pages need not stay resident
  }
  return report;
}

}  // namespace vlmopt::model
