// Writing a bundle (design.md §5, reference.md §2): an HF model directory that
// transformers and vLLM load through compressed-tensors, plus vlmopt/ extras,
// built in a staging directory next to the target and swapped in atomically.
//
// Tensor names in model.safetensors use the new canonical layout
// (model.language_model.*, model.vision_tower.vision_model.*, model.multi_modal_projector.*,
// lm_head.*). Per quantized Linear <L>:
//   w8a8 / w8a16 (int-quantized): <L>.weight I8 [out,in], <L>.weight_scale [out,1],
//                                 <L>.input_scale [1] (w8a8 only; one shared value per fused group)
//   w4a16 (pack-quantized):       <L>.weight_packed I32 [out, ceil(in/8)], <L>.weight_scale [out, in/group],
//                                 <L>.weight_shape I64 [2]
//   fp8 (float-quantized):        <L>.weight F8_E4M3 [out,in], <L>.weight_scale [out,1], <L>.input_scale [1]
// Scales are stored in the source weight's floating dtype; no zero points (symmetric only).
// quantization_config.ignore lists plan.ignore and also every other unquantized Linear
// of the checkpoint (a 2-D "<X>.weight" whose module name has no "embed"), e.g. the
// SigLIP pooling head that transformers instantiates but vlmopt never runs: with
// targets ["Linear"], compressed-tensors would otherwise quantize it and report its
// scales missing.
//
// vlmopt/mp_cache.bin (ExportOptions::write_mp_cache): quant::mp_cache_from_plan(plan), the
// runtime's source for input scales (over the non-outlier channels) and outlier masks.
// vlmopt/outliers.safetensors (only when some LinearQuant has outlier channels), per such <L>:
//   <L>.outlier_channels I64 [n]       input channels kept in FP16, ascending (= the MP-Cache mask bits)
//   <L>.outlier_weight   F16 [out, n]  the source weight's columns of those channels
//
// Staging directories are `.<target name>.vlmopt-tmp.<pid>` next to the target.
// Cleanup rule: every export/update first removes such directories whose <pid>
// is not a running process (a killed run's leftovers, which may also hold the
// previous bundle after an interrupted swap); directories of live processes are left alone.
#pragma once

#include "quant/scheme.hpp"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::bundle {

inline constexpr const char* kOutliersPath = "vlmopt/outliers.safetensors";
inline constexpr const char* kMpCachePath = "vlmopt/mp_cache.bin";

struct ExportOptions {
  std::filesystem::path source_model;  // HF checkpoint directory (config.json + safetensors)
  std::filesystem::path out;           // bundle directory (replaced atomically if it holds a bundle)
  uint64_t max_shard_bytes = 2ull << 30;
  nlohmann::json step_options = nlohmann::json::object();  // recorded in the manifest under step "export"
  std::string step_name = "export";
  std::string dataset_hash;
  bool write_mp_cache = true;  // vlmopt/mp_cache.bin from the plan (add_files may replace it)
  // Called with the staging root before the manifest is written, to add files
  // (e.g. vlmopt/mp_cache.bin, reports). Must not touch vlmopt/manifest.json.
  std::function<void(const std::filesystem::path& staging_root)> add_files;
};

// Writes the bundle described above. InputError for an unusable source or plan
// (a quantized Linear whose weight is missing, shape mismatches, unsupported
// scheme settings) or a target that exists and is not a bundle (non-empty, no manifest).
void export_bundle(const ExportOptions& options, const quant::QuantPlan& plan);

struct BundleUpdate {
  std::string step;                                    // e.g. "compensate", "prune-fit"
  nlohmann::json options = nlohmann::json::object();   // appended to the manifest's steps
  // Tensors of model.safetensors to replace, by on-disk (canonical) name; each must exist,
  // be unquantized, and keep its shape; values are converted to the stored dtype.
  std::map<std::string, torch::Tensor> replace_tensors;
  // Adds or replaces files under the staging root (e.g. vlmopt/adapter.safetensors, vlmopt/prune.json).
  std::function<void(const std::filesystem::path& staging_root)> apply;
};

// Copies `bundle` to a staging directory, applies `update`, rewrites the manifest
// and swaps it in atomically. The bundle must verify's manifest checks first
// (InputError naming the problem otherwise).
void update_bundle(const std::filesystem::path& bundle, const BundleUpdate& update);

// The module name transformers 5.x gives a canonical Linear name in memory
// (what compressed-tensors matches `ignore`/`targets` against): the vision tower
// loses its "vision_model." level.
std::string hf_module_name(std::string_view canonical);

// The minimal compressed-tensors quantization_config of reference.md §2 for `plan`.
// `ignore` = plan.ignore plus `extra_ignore` (canonical names), as transformers' module names, sorted.
nlohmann::json quantization_config(const quant::QuantPlan& plan, const std::vector<std::string>& extra_ignore = {});

// Staging-directory prefix for `target` and the cleanup of dead runs' leftovers (see above).
std::string staging_prefix(const std::filesystem::path& target);
void remove_stale_staging(const std::filesystem::path& target);

}  // namespace vlmopt::bundle
