// Checkpoint key names (old and new layouts -> one canonical form) and loading
// a module tree whose parameter names are canonical from a tensor source.
//
// Canonical = transformers' in-memory LlavaForConditionalGeneration names, with
// the vision tower always under "vision_model.":
//   model.vision_tower.vision_model.*, model.multi_modal_projector.*,
//   model.language_model.*, lm_head.*
#pragma once

#include "io/safetensors.hpp"

#include <torch/torch.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::model {

// kOld: what save_pretrained wrote before transformers 4.52 (and 5.x writes for
// BC): language_model.model.*, language_model.lm_head.*, vision_tower.*,
// multi_modal_projector.*. kNew: the canonical names.
enum class KeyLayout { kOld, kNew };
std::string_view to_string(KeyLayout layout);

// Canonical name of an on-disk key; nullopt for keys that carry no parameter
// (*.rotary_emb.inv_freq, *.position_ids). Keys of no known layout come back
// unchanged (and are then reported as unexpected by the loader).
std::optional<std::string> canonical_key(std::string_view on_disk);
// The on-disk spelling of a canonical name in `layout` (kOld always writes
// vision_tower.vision_model.*).
std::string on_disk_key(std::string_view canonical, KeyLayout layout);
// kOld when any parameter key uses the old prefixes, else kNew.
KeyLayout detect_layout(const std::vector<std::string>& on_disk_names);

// Where tensors come from: a checkpoint directory, or tensors in memory (tests).
class TensorSource {
 public:
  struct Meta {
    std::vector<int64_t> shape;
    bool floating = true;
    std::string dtype;  // e.g. "F32", for messages
  };
  virtual ~TensorSource();
  virtual std::vector<std::string> names() const = 0;
  virtual Meta meta(std::string_view name) const = 0;
  virtual torch::Tensor load(std::string_view name) const = 0;  // CPU tensor
  virtual std::string describe() const = 0;                      // for error messages
  // Hint that `name` will not be loaded again soon: memory-mapped sources drop
  // its pages from the resident set. Default: nothing.
  virtual void release(std::string_view name) const;
};

class CheckpointSource : public TensorSource {
 public:
  explicit CheckpointSource(io::Checkpoint checkpoint) : checkpoint_(std::move(checkpoint)) {}
  std::vector<std::string> names() const override { return checkpoint_.names(); }
  Meta meta(std::string_view name) const override;
  torch::Tensor load(std::string_view name) const override;
  std::string describe() const override { return checkpoint_.dir().string(); }
  void release(std::string_view name) const override;

 private:
  io::Checkpoint checkpoint_;
};

class MapSource : public TensorSource {
 public:
  MapSource(std::map<std::string, torch::Tensor> tensors, std::string description = "<memory>")
      : tensors_(tensors.begin(), tensors.end()), description_(std::move(description)) {}
  std::vector<std::string> names() const override;
  Meta meta(std::string_view name) const override;
  torch::Tensor load(std::string_view name) const override;
  std::string describe() const override { return description_; }

 private:
  std::map<std::string, torch::Tensor, std::less<>> tensors_;
  std::string description_;
};

// The tensors of one module subtree of another source, named relative to it:
// canonical "model.language_model.layers.3.mlp.up_proj.weight" becomes
// "mlp.up_proj.weight" for prefix "model.language_model.layers.3." (loading one
// decoder layer into its module, layer-by-layer calibration).
class SubtreeSource : public TensorSource {
 public:
  SubtreeSource(const TensorSource& base, std::string canonical_prefix);
  std::vector<std::string> names() const override;
  Meta meta(std::string_view name) const override;
  torch::Tensor load(std::string_view name) const override;
  std::string describe() const override;
  void release(std::string_view name) const override;

 private:
  const std::string& on_disk(std::string_view name) const;
  const TensorSource& base_;
  std::string prefix_;
  std::map<std::string, std::string, std::less<>> on_disk_;  // relative name -> base's name
};

struct LoadOptions {
  // Canonical names that may be absent from the source (left as they are).
  std::set<std::string> optional;
  // Canonical names present in the source that are accepted but not loaded
  // (e.g. lm_head.weight when it is tied to the embeddings).
  std::set<std::string> skip;
};

struct LoadReport {
  KeyLayout layout = KeyLayout::kNew;
  std::vector<std::string> absent;   // optional names that were not in the source
  std::vector<std::string> ignored;  // on-disk names skipped (inv_freq, position_ids, LoadOptions::skip)
};

// Fills every parameter of `root` (named canonically by its module tree) from
// `source`, converting dtype and moving to the parameter's device. All names and
// shapes are checked against the source's metadata before any data is read.
// Throws InputError naming the source and key for: a missing tensor, a tensor
// given twice (two on-disk keys with one canonical name), unexpected tensors
// (the first few are listed), shape mismatch ("expected [a,b], got [c,d]") and
// non-floating data. Tied parameters (same tensor under two names) are filled
// once, from the first name.
LoadReport load_parameters(torch::nn::Module& root, const TensorSource& source, const LoadOptions& options = {});

}  // namespace vlmopt::model
