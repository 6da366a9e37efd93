#include "bundle/export.hpp"

#include "bundle/ct_codec.hpp"
#include "bundle/manifest.hpp"
#include "io/atomic_file.hpp"
#include "io/hf_config.hpp"
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
#include "model/weights.hpp"
#include "quant/mp_cache.hpp"
#include "util/error.hpp"
#include "util/version.hpp"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <set>

namespace vlmopt::bundle {

namespace fs = std::filesystem;
using quant::LinearQuant;
using quant::QuantPlan;

namespace {

constexpr std::string_view kVisionTower = "model.vision_tower.";
constexpr std::string_view kVisionModel = "vision_model.";

// Files of an HF model directory that a runtime needs besides weights and config.
const std::vector<std::string> kCopiedFiles = {
    "tokenizer.json",         "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json",             "merges.txt",            "added_tokens.json",       "preprocessor_config.json",
    "processor_config.json",  "chat_template.json",    "chat_template.jinja",     "generation_config.json",
};

fs::path normalized_target(const fs::path& target) {
  auto p = fs::absolute(target).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p;
}

fs::path staging_dir_for(const fs::path& target) {
  return target.parent_path() / (staging_prefix(target) + std::to_string(::getpid()));
}

// Removes the staging directory unless released (after a successful swap).
class StagingGuard {
 public:
  explicit StagingGuard(fs::path dir) : dir_(std::move(dir)) {}
  ~StagingGuard() {
    if (dir_.empty()) return;
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void release() { dir_.clear(); }
  StagingGuard(const StagingGuard&) = delete;
  StagingGuard& operator=(const StagingGuard&) = delete;

 private:
  fs::path dir_;
};

void fsync_file(const fs::path& path) {
  io::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw_file_error(path, "cannot open to fsync: {}", std::strerror(errno));
  if (::fsync(fd.get()) != 0) throw_file_error(path, "fsync failed: {}", std::strerror(errno));
}

// Files then directories (deepest first), so every name is durable before the swap.
void fsync_tree(const fs::path& root) {
  std::vector<fs::path> dirs{root};
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    if (entry.is_symlink()) continue;
    if (entry.is_directory()) {
      dirs.push_back(entry.path());
    } else if (entry.is_regular_file()) {
      fsync_file(entry.path());
    }
  }
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) io::fsync_directory(*it);
}

// An existing target must be an empty directory or a bundle: never replace user data.
void check_replaceable(const fs::path& target) {
  const auto status = fs::symlink_status(target);
  if (!fs::exists(status)) return;
  if (!fs::is_directory(status)) throw_file_error(target, "exists and is not a directory; refusing to replace it");
  if (fs::is_empty(target)) return;
  if (!fs::is_regular_file(target / kManifestPath))
    throw_file_error(target, "exists, is not empty and holds no {}; refusing to replace it", kManifestPath);
}

// Moves the finished staging tree to `target`: an atomic exchange when a bundle is
// there (then the old one, now under the staging name, is deleted), else a rename.
void install(const fs::path& staging, const fs::path& target) {
  fsync_tree(staging);
  const bool replacing = fs::exists(fs::symlink_status(target));
  if (replacing) {
    if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
      throw_file_error(target, "cannot exchange with the new bundle {}: {}", staging.string(), std::strerror(errno));
    }
  } else if (::rename(staging.c_str(), target.c_str()) != 0) {
    throw_file_error(target, "cannot rename the new bundle {} to it: {}", staging.string(), std::strerror(errno));
  }
  io::fsync_directory(target.parent_path());
  if (replacing) {
    std::error_code ec;
    fs::remove_all(staging, ec);  // the previous bundle; a leftover is removed by the next run
    if (ec) spdlog::warn("{}: could not remove the previous bundle: {}", staging.string(), ec.message());
  }
}

nlohmann::json args_json(const quant::QuantArgs& args, const char* observer) {
  return {{"num_bits", args.num_bits},
          {"type", args.type == quant::QuantType::kFloat ? "float" : "int"},
          {"symmetric", args.symmetric},
          {"strategy", std::string(ct::strategy_name(args.strategy))},
          {"group_size", args.strategy == quant::Strategy::kGroup ? nlohmann::json(args.group_size) : nlohmann::json()},
          {"block_structure", nullptr},
          {"dynamic", args.dynamic},
          {"actorder", nullptr},
          {"observer", observer},
          {"observer_kwargs", nlohmann::json::object()}};
}

bool has_static_inputs(const quant::Scheme& scheme) {
  return scheme.input_activations.has_value() && !scheme.input_activations->dynamic;
}

void check_plan(const QuantPlan& plan) {
  const auto& w = plan.scheme.weights;
  VLMOPT_CHECK_INPUT(w.symmetric, "quantization plan: weights: expected symmetric, got asymmetric (not supported)");
  VLMOPT_CHECK_INPUT((w.type == quant::QuantType::kInt && (w.num_bits == 8 || w.num_bits == 4)) ||
                         (w.type == quant::QuantType::kFloat && w.num_bits == 8),
                     "quantization plan: weights: expected int8, int4 or fp8, got {} bits", w.num_bits);
  if (plan.scheme.input_activations) {
    const auto& a = *plan.scheme.input_activations;
    VLMOPT_CHECK_INPUT(a.symmetric && a.strategy == quant::Strategy::kTensor,
                       "quantization plan: input_activations: expected symmetric per-tensor, got another setting");
  }
  std::set<std::string> ignored(plan.ignore.begin(), plan.ignore.end());
  std::set<std::string> seen;
  for (const auto& layer : plan.layers) {
    VLMOPT_CHECK_INPUT(!ignored.contains(layer.name), "quantization plan: layer '{}': expected quantized or ignored, got both",
                       layer.name);
    VLMOPT_CHECK_INPUT(seen.insert(layer.name).second, "quantization plan: layer '{}' appears twice", layer.name);
    VLMOPT_CHECK_INPUT(layer.weight.scale.defined(), "quantization plan: layer '{}': no weight scale", layer.name);
    if (has_static_inputs(plan.scheme))
      VLMOPT_CHECK_INPUT(layer.input_all_channels && layer.input_all_channels->scale.defined() &&
                             layer.input_all_channels->scale.numel() == 1,
                         "quantization plan: layer '{}': expected a static per-tensor input scale, got none",
                         layer.name);
  }
}

// Input scale per layer: one shared value (the max) per fused group, as vLLM fuses them.
std::map<std::string, float> shared_input_scales(const QuantPlan& plan) {
  std::map<std::string, float> group_max;
  std::map<std::string, float> out;
  if (!has_static_inputs(plan.scheme)) return out;
  for (const auto& layer : plan.layers) {
    const float s = layer.input_all_channels->scale.to(torch::kFloat32).item<float>();
    VLMOPT_CHECK_INPUT(std::isfinite(s) && s > 0, "quantization plan: layer '{}': input scale {} is not positive",
                       layer.name, s);
    if (!layer.fused_group.empty()) {
      auto [it, inserted] = group_max.emplace(layer.fused_group, s);
      if (!inserted) it->second = std::max(it->second, s);
    }
    out[layer.name] = s;
  }
  for (const auto& layer : plan.layers)
    if (!layer.fused_group.empty()) out[layer.name] = group_max.at(layer.fused_group);
  return out;
}

torch::ScalarType scale_dtype_for(io::DType weight_dtype) {
  switch (weight_dtype) {
    case io::DType::kBF16: return torch::kBFloat16;
    case io::DType::kF16: return torch::kFloat16;
    default: return torch::kFloat32;
  }
}

// Everything model.safetensors (and outliers.safetensors) will hold; owns the new tensors.
struct TensorSet {
  std::deque<torch::Tensor> owned;
  std::vector<io::TensorToWrite> model;
  std::vector<io::TensorToWrite> outliers;
  void add(std::vector<io::TensorToWrite>& to, std::string name, torch::Tensor t) {
    owned.push_back(t.contiguous().cpu());
    to.push_back(io::to_write(std::move(name), owned.back()));
  }
};

void add_quantized_layer(TensorSet& set, const QuantPlan& plan, const LinearQuant& layer, const torch::Tensor& weight,
                         io::DType weight_dtype, const std::map<std::string, float>& input_scales) {
  const auto& args = plan.scheme.weights;
  const int64_t out = weight.size(0), in = weight.size(1);
  const auto sdtype = scale_dtype_for(weight_dtype);
  // Quantize with the scale as stored, so a loader's dequantization reproduces ours exactly.
  const auto scale = layer.weight.scale.to(torch::kFloat32).to(sdtype);
  const auto& shape = scale.sizes();
  const bool shape_ok = (args.strategy == quant::Strategy::kTensor && scale.numel() == 1) ||
                        (args.strategy == quant::Strategy::kChannel && shape == torch::IntArrayRef{out, 1}) ||
                        (args.strategy == quant::Strategy::kGroup && args.group_size > 0 && in % args.group_size == 0 &&
                         shape == torch::IntArrayRef{out, in / args.group_size});
  VLMOPT_CHECK_INPUT(shape_ok, "quantization plan: layer '{}': weight scale shape {} does not fit weight [{},{}] ({})",
                     layer.name, c10::str(scale.sizes()), out, in, ct::strategy_name(args.strategy));
  VLMOPT_CHECK_INPUT((scale.to(torch::kFloat32) > 0).all().item<bool>(),
                     "quantization plan: layer '{}': weight scales must be positive", layer.name);
  const auto q = ct::quantize(weight, scale, args);
  const auto stored_scale = args.strategy == quant::Strategy::kTensor ? scale.reshape({1}) : scale;
  if (ct::format_for(args) == "pack-quantized") {
    set.add(set.model, layer.name + ".weight_packed", ct::pack(q, args.num_bits));
    set.add(set.model, layer.name + ".weight_shape", torch::tensor({out, in}, torch::kInt64));
  } else {
    set.add(set.model, layer.name + ".weight", q);
  }
  set.add(set.model, layer.name + ".weight_scale", stored_scale);
  if (const auto it = input_scales.find(layer.name); it != input_scales.end())
    set.add(set.model, layer.name + ".input_scale", torch::tensor({it->second}, torch::kFloat32).to(sdtype));

  if (layer.outlier_channels.defined() && layer.outlier_channels.any().item<bool>()) {
    VLMOPT_CHECK_INPUT(layer.outlier_channels.numel() == in, "quantization plan: layer '{}': outlier mask has {} channels, weight {}",
                       layer.name, layer.outlier_channels.numel(), in);
    const auto idx = layer.outlier_channels.to(torch::kBool).cpu().nonzero().reshape({-1});
    set.add(set.outliers, layer.name + ".outlier_channels", idx.to(torch::kInt64));
    set.add(set.outliers, layer.name + ".outlier_weight", weight.index_select(1, idx).to(torch::kFloat16));
  }
}

void copy_file_atomic(const fs::path& from, const fs::path& to) {
  io::write_file_atomic(to, io::read_whole_file(from, uint64_t{1} << 32));
}

}  // namespace

std::string hf_module_name(std::string_view canonical) {
  if (canonical.starts_with(kVisionTower) && canonical.substr(kVisionTower.size()).starts_with(kVisionModel)) {
    return std::string(kVisionTower) + std::string(canonical.substr(kVisionTower.size() + kVisionModel.size()));
  }
  return std::string(canonical);
}

nlohmann::json quantization_config(const QuantPlan& plan, const std::vector<std::string>& extra_ignore) {
  const auto& scheme = plan.scheme;
  nlohmann::json group = {{"targets", {"Linear"}},
                          {"weights", args_json(scheme.weights, "minmax")},
                          {"input_activations", nullptr},
                          {"output_activations", nullptr}};
  if (scheme.input_activations)
    group["input_activations"] =
        args_json(*scheme.input_activations, scheme.input_activations->dynamic ? "memoryless_minmax" : "static_minmax");
  std::vector<std::string> ignore;
  for (const auto& name : plan.ignore) ignore.push_back(hf_module_name(name));
  for (const auto& name : extra_ignore) ignore.push_back(hf_module_name(name));
  std::sort(ignore.begin(), ignore.end());
  ignore.erase(std::unique(ignore.begin(), ignore.end()), ignore.end());
  return {{"quant_method", "compressed-tensors"},
          {"format", std::string(ct::format_for(scheme.weights))},
          {"quantization_status", "compressed"},
          {"global_compression_ratio", nullptr},
          {"kv_cache_scheme", nullptr},
          {"sparsity_config", nlohmann::json::object()},
          {"transform_config", nlohmann::json::object()},
          {"config_groups", {{"group_0", std::move(group)}}},
          {"ignore", std::move(ignore)}};
}

std::string staging_prefix(const fs::path& target) {
  return "." + normalized_target(target).filename().string() + ".vlmopt-tmp.";
}

void remove_stale_staging(const fs::path& target) {
  const auto t = normalized_target(target);
  const auto prefix = staging_prefix(t);
  std::error_code ec;
  if (!fs::is_directory(t.parent_path(), ec)) return;
  for (const auto& entry : fs::directory_iterator(t.parent_path(), ec)) {
    const auto name = entry.path().filename().string();
    if (!name.starts_with(prefix)) continue;
    const auto pid_text = name.substr(prefix.size());
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::stol(pid_text);
    const bool alive = pid != ::getpid() && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
    if (alive) continue;
    spdlog::info("removing leftover staging directory {}", entry.path().string());
    fs::remove_all(entry.path(), ec);
  }
}

void export_bundle(const ExportOptions& options, const QuantPlan& plan) {
  check_plan(plan);
  const auto target = normalized_target(options.out);
  const auto source_dir = options.source_model;
  VLMOPT_CHECK_INPUT(fs::is_directory(source_dir), "{}: expected a model directory, got none", source_dir.string());
  VLMOPT_CHECK_INPUT(normalized_target(source_dir) != target, "{}: the bundle cannot replace its source model",
                     target.string());
  check_replaceable(target);
  fs::create_directories(target.parent_path());
  remove_stale_staging(target);

  auto config = io::load_json_file(source_dir / "config.json");
  VLMOPT_CHECK_INPUT(config.is_object(), "{}: expected a JSON object", (source_dir / "config.json").string());
  (void)io::parse_llava_config(config, (source_dir / "config.json").string());  // fail early on a non-LLaVA source
  const auto checkpoint = io::Checkpoint::open(source_dir);

  // Canonical name -> on-disk name, refusing two spellings of one tensor.
  std::map<std::string, std::string> on_disk;
  for (const auto& name : checkpoint.names()) {
    const auto canonical = model::canonical_key(name);
    if (!canonical) continue;  // inv_freq / position_ids carry no parameters
    const auto [it, inserted] = on_disk.emplace(*canonical, name);
    VLMOPT_CHECK_INPUT(inserted, "{}: tensors '{}' and '{}' are the same parameter", source_dir.string(), it->second,
                       name);
  }
  std::map<std::string, const LinearQuant*> quantized;
  for (const auto& layer : plan.layers) {
    const auto weight_name = layer.name + ".weight";
    VLMOPT_CHECK_INPUT(on_disk.contains(weight_name), "{}: quantized layer '{}' has no tensor '{}'",
                       source_dir.string(), layer.name, weight_name);
    quantized[weight_name] = &layer;
  }
  const auto input_scales = shared_input_scales(plan);
  // Unquantized Linears the plan does not name (see export.hpp).
  std::vector<std::string> extra_ignore;
  const std::set<std::string> named(plan.ignore.begin(), plan.ignore.end());
  for (const auto& [canonical, name] : on_disk) {
    if (!canonical.ends_with(".weight") || quantized.contains(canonical)) continue;
    const auto module = canonical.substr(0, canonical.size() - 7);
    const auto last = module.substr(module.rfind('.') + 1);
    if (checkpoint.locate(name).second->shape.size() == 2 && last.find("embed") == std::string::npos &&
        !named.contains(module))
      extra_ignore.push_back(module);
  }
  config["quantization_config"] = quantization_config(plan, extra_ignore);

  TensorSet set;
  for (const auto& [canonical, name] : on_disk) {
    const auto [file, info] = checkpoint.locate(name);
    if (const auto q = quantized.find(canonical); q != quantized.end()) {
      VLMOPT_CHECK_INPUT(info->shape.size() == 2, "{}: tensor '{}': expected a 2-D Linear weight, got {} dims",
                         source_dir.string(), name, info->shape.size());
      const auto weight = io::load_tensor(*file, *info);
      VLMOPT_CHECK_INPUT(weight.is_floating_point(), "{}: tensor '{}': expected floating weights, got {}",
                         source_dir.string(), name, io::dtype_name(info->dtype));
      add_quantized_layer(set, plan, *q->second, weight, info->dtype, input_scales);
    } else {
      // Unquantized: the source bytes and dtype, unchanged (the checkpoint stays mapped until written).
      set.model.push_back({canonical, info->dtype, info->shape, file->bytes(*info)});
    }
  }

  const auto staging = staging_dir_for(target);
  fs::remove_all(staging);
  StagingGuard guard(staging);
  fs::create_directories(staging / "vlmopt");
  io::write_checkpoint(staging, std::move(set.model), options.max_shard_bytes);
  if (!set.outliers.empty()) io::write_safetensors(staging / kOutliersPath, std::move(set.outliers));
  io::write_file_atomic(staging / "config.json", config.dump(2) + "\n");
  if (options.write_mp_cache && !plan.layers.empty())
    quant::write_mp_cache(staging / kMpCachePath, quant::mp_cache_from_plan(plan));
  for (const auto& name : kCopiedFiles)
    if (fs::is_regular_file(source_dir / name)) copy_file_atomic(source_dir / name, staging / name);
  if (options.add_files) options.add_files(staging);

  Manifest manifest;
  manifest.vlmopt_version = kVersion;
  manifest.source_model_sha256 = source_model_hash(source_dir);
  manifest.dataset_hash = options.dataset_hash;
  manifest.max_shard_bytes = options.max_shard_bytes;
  manifest.steps.push_back({{"step", options.step_name},
                            {"options", options.step_options.is_null() ? nlohmann::json::object() : options.step_options}});
  manifest.files = scan_files(staging);
  write_manifest(staging, manifest);
  install(staging, target);
  guard.release();
  spdlog::info("bundle written to {} ({} quantized Linears, {} files)", target.string(), plan.layers.size(),
               manifest.files.size() + 1);
}

void update_bundle(const fs::path& bundle, const BundleUpdate& update) {
  const auto target = normalized_target(bundle);
  VLMOPT_CHECK_INPUT(!update.step.empty(), "bundle update: expected a step name, got an empty one");
  auto manifest = read_manifest(target);
  remove_stale_staging(target);
  const auto staging = staging_dir_for(target);
  fs::remove_all(staging);
  StagingGuard guard(staging);
  fs::create_directories(staging);
  for (const auto& rel : list_files(target)) {
    fs::create_directories((staging / rel).parent_path());
    fs::copy_file(target / rel, staging / rel);
  }
  fs::copy_file(target / kManifestPath, staging / kManifestPath);

  if (!update.replace_tensors.empty()) {
    std::vector<torch::Tensor> owned;
    std::vector<io::TensorToWrite> tensors;
    std::set<std::string> replaced;
    {
      const auto checkpoint = io::Checkpoint::open(staging);
      for (const auto& name : checkpoint.names()) {
        auto t = io::load_tensor(checkpoint, name);
        if (const auto it = update.replace_tensors.find(name); it != update.replace_tensors.end()) {
          VLMOPT_CHECK_INPUT(t.is_floating_point() && !checkpoint.contains(
                                 name.substr(0, name.rfind('.')) + ".weight_scale"),
                             "{}: tensor '{}': expected an unquantized floating tensor to replace", target.string(), name);
          VLMOPT_CHECK_INPUT(it->second.sizes() == t.sizes(), "{}: tensor '{}': expected shape {}, got {}",
                             target.string(), name, c10::str(t.sizes()), c10::str(it->second.sizes()));
          t = it->second.detach().to(torch::kCPU, t.scalar_type()).contiguous();
          replaced.insert(name);
        }
        owned.push_back(t);
      }
      for (const auto& [name, value] : update.replace_tensors)
        VLMOPT_CHECK_INPUT(replaced.contains(name), "{}: no tensor '{}' to replace", target.string(), name);
      const auto names = checkpoint.names();
      for (size_t i = 0; i < names.size(); ++i) tensors.push_back(io::to_write(names[i], owned[i]));
    }  // the staging copies are unmapped before they are overwritten
    io::write_checkpoint(staging, std::move(tensors), manifest.max_shard_bytes);
  }
  if (update.apply) update.apply(staging);

  manifest.vlmopt_version = kVersion;
  manifest.steps.push_back({{"step", update.step},
                            {"options", update.options.is_null() ? nlohmann::json::object() : update.options}});
  manifest.files = scan_files(staging);
  write_manifest(staging, manifest);
  install(staging, target);
  guard.release();
}

}  // namespace vlmopt::bundle
