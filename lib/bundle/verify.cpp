#include "bundle/verify.hpp"

#include "bundle/export.hpp"
#include "bundle/manifest.hpp"
#include "io/atomic_file.hpp"
#include "io/hash.hpp"
#include "io/hf_config.hpp"
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
#include "quant/mp_cache.hpp"
#include "util/error.hpp"

#include <fmt/ranges.h>

#include <optional>
#include <set>

namespace vlmopt::bundle {

namespace fs = std::filesystem;

nlohmann::json VerifyResult::to_json() const { return {{"ok", ok()}, {"problems", problems}}; }

namespace {

struct Args {
  int num_bits = 8;
  bool is_float = false;
  std::string strategy;
  int64_t group_size = 0;
  bool dynamic = false;
};

struct QuantConfig {
  std::string format;
  Args weights;
  std::optional<Args> inputs;
  std::set<std::string> ignore;
};

std::string shape_str(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ",")); }

// Parses one weights/input_activations object; appends problems prefixed with `where`.
std::optional<Args> check_args(const nlohmann::json& j, const std::string& where, std::vector<std::string>& problems) {
  static const std::set<std::string> allowed{"num_bits", "type",     "symmetric", "strategy", "group_size",
                                             "block_structure", "dynamic", "actorder", "observer", "observer_kwargs"};
  if (!j.is_object()) {
    problems.push_back(fmt::format("{}: expected an object, got {}", where, j.type_name()));
    return std::nullopt;
  }
  const size_t before = problems.size();
  for (const auto& [key, value] : j.items())
    if (!allowed.contains(key)) problems.push_back(fmt::format("{}.{}: unknown key (older loaders reject it)", where, key));
  Args a;
  if (!j.contains("num_bits") || !j["num_bits"].is_number_integer() ||
      (j["num_bits"].get<int64_t>() != 8 && j["num_bits"].get<int64_t>() != 4)) {
    problems.push_back(fmt::format("{}.num_bits: expected 4 or 8, got {}", where, j.value("num_bits", nlohmann::json()).dump()));
  } else {
    a.num_bits = j["num_bits"].get<int>();
  }
  const auto type = j.value("type", nlohmann::json());
  if (type != "int" && type != "float") problems.push_back(fmt::format("{}.type: expected \"int\" or \"float\", got {}", where, type.dump()));
  a.is_float = type == "float";
  const auto symmetric = j.value("symmetric", nlohmann::json());
  if (symmetric != true) problems.push_back(fmt::format("{}.symmetric: expected true, got {}", where, symmetric.dump()));
  const auto strategy = j.value("strategy", nlohmann::json());
  if (strategy != "tensor" && strategy != "channel" && strategy != "group") {
    problems.push_back(fmt::format("{}.strategy: expected tensor, channel or group, got {}", where, strategy.dump()));
  } else {
    a.strategy = strategy.get<std::string>();
  }
  const auto group = j.value("group_size", nlohmann::json());
  if (a.strategy == "group") {
    if (!group.is_number_integer() || group.get<int64_t>() <= 0)
      problems.push_back(fmt::format("{}.group_size: expected a positive integer, got {}", where, group.dump()));
    else
      a.group_size = group.get<int64_t>();
  } else if (!group.is_null()) {
    problems.push_back(fmt::format("{}.group_size: expected null for strategy {}, got {}", where, a.strategy, group.dump()));
  }
  const auto dynamic = j.value("dynamic", nlohmann::json(false));
  if (!dynamic.is_boolean()) problems.push_back(fmt::format("{}.dynamic: expected a boolean, got {}", where, dynamic.dump()));
  a.dynamic = dynamic == true;
  if (problems.size() != before) return std::nullopt;
  return a;
}

std::optional<QuantConfig> check_quantization_config(const fs::path& config_path, std::vector<std::string>& problems) {
  nlohmann::json config;
  try {
    config = io::load_json_file(config_path);
  } catch (const InputError& e) {
    problems.push_back(e.what());
    return std::nullopt;
  }
  const std::string where = config_path.filename().string() + ": quantization_config";
  if (!config.is_object() || !config.contains("quantization_config")) {
    problems.push_back(fmt::format("{}: expected an object, got nothing", where));
    return std::nullopt;
  }
  const auto& q = config["quantization_config"];
  if (!q.is_object()) {
    problems.push_back(fmt::format("{}: expected an object, got {}", where, q.type_name()));
    return std::nullopt;
  }
  const size_t before = problems.size();
  QuantConfig out;
  if (q.value("quant_method", nlohmann::json()) != "compressed-tensors")
    problems.push_back(fmt::format("{}.quant_method: expected \"compressed-tensors\", got {}", where,
                                   q.value("quant_method", nlohmann::json()).dump()));
  const auto format = q.value("format", nlohmann::json());
  if (format != "int-quantized" && format != "pack-quantized" && format != "float-quantized")
    problems.push_back(fmt::format("{}.format: expected int-quantized, pack-quantized or float-quantized, got {}", where,
                                   format.dump()));
  else
    out.format = format.get<std::string>();
  const auto groups = q.value("config_groups", nlohmann::json());
  if (!groups.is_object() || groups.size() != 1) {
    problems.push_back(fmt::format("{}.config_groups: expected an object with one group, got {}", where, groups.dump()));
    return std::nullopt;
  }
  const auto& [group_name, group] = *groups.items().begin();
  const std::string gwhere = fmt::format("{}.config_groups.{}", where, group_name);
  const auto targets = group.value("targets", nlohmann::json());
  if (!targets.is_array() || targets.empty() ||
      !std::all_of(targets.begin(), targets.end(), [](const auto& t) { return t.is_string(); }))
    problems.push_back(fmt::format("{}.targets: expected a non-empty array of strings, got {}", gwhere, targets.dump()));
  if (auto w = check_args(group.value("weights", nlohmann::json()), gwhere + ".weights", problems)) out.weights = *w;
  const auto inputs = group.value("input_activations", nlohmann::json());
  if (!inputs.is_null()) out.inputs = check_args(inputs, gwhere + ".input_activations", problems);
  const auto ignore = q.value("ignore", nlohmann::json::array());
  if (!ignore.is_array()) {
    problems.push_back(fmt::format("{}.ignore: expected an array of module names, got {}", where, ignore.type_name()));
  } else {
    for (const auto& name : ignore) {
      if (!name.is_string())
        problems.push_back(fmt::format("{}.ignore: expected module names, got {}", where, name.dump()));
      else
        out.ignore.insert(name.get<std::string>());
    }
  }
  if (!out.format.empty() && out.weights.is_float != (out.format == "float-quantized"))
    problems.push_back(fmt::format("{}.format: {} does not match weights type {}", where, out.format,
                                   out.weights.is_float ? "float" : "int"));
  if (out.format == "pack-quantized" && out.weights.num_bits == 8)
    problems.push_back(fmt::format("{}.format: pack-quantized with 8-bit weights", where));
  if (problems.size() != before) return std::nullopt;
  return out;
}

// Quantized tensors of each Linear (those with a weight_scale) against the config.
void check_tensors(const io::Checkpoint& ckpt, const QuantConfig& qc, std::vector<std::string>& problems) {
  const auto file_of = [&](const std::string& name) { return ckpt.locate(name).first->path().filename().string(); };
  const auto info_of = [&](const std::string& name) -> const io::TensorInfo* {
    return ckpt.contains(name) ? ckpt.locate(name).second : nullptr;
  };
  const auto problem = [&](const std::string& name, const std::string& what) {
    problems.push_back(fmt::format("{}: tensor '{}': {}", ckpt.contains(name) ? file_of(name) : "model.safetensors", name, what));
  };
  const bool packed = qc.format == "pack-quantized";
  const bool static_inputs = qc.inputs && !qc.inputs->dynamic;
  std::set<std::string> layers;
  for (const auto& name : ckpt.names()) {
    if (name.ends_with(".weight_scale")) layers.insert(name.substr(0, name.size() - std::string_view(".weight_scale").size()));
    if (name.ends_with("_zero_point")) problem(name, "zero points are not written for symmetric quantization");
  }
  for (const auto& name : ckpt.names()) {
    const auto* info = info_of(name);
    if (name.ends_with(".weight") && (info->dtype == io::DType::kI8 || info->dtype == io::DType::kF8_E4M3) &&
        !layers.contains(name.substr(0, name.size() - 7)))
      problem(name, "quantized weight without a weight_scale");
  }
  for (const auto& layer : layers) {
    if (qc.ignore.contains(hf_module_name(layer)))
      problem(layer + ".weight_scale", "layer is quantized but listed in quantization_config.ignore");
    int64_t out = -1, in = -1;
    if (packed) {
      const auto* shape = info_of(layer + ".weight_shape");
      const auto* w = info_of(layer + ".weight_packed");
      if (!shape || shape->dtype != io::DType::kI64 || shape->shape != std::vector<int64_t>{2}) {
        problem(layer + ".weight_shape", "expected I64 [2]");
        continue;
      }
      const auto values = io::load_tensor(ckpt, layer + ".weight_shape");
      out = values[0].item<int64_t>();
      in = values[1].item<int64_t>();
      const int64_t words = (in * qc.weights.num_bits + 31) / 32;
      if (!w || w->dtype != io::DType::kI32 || w->shape != std::vector<int64_t>{out, words}) {
        problem(layer + ".weight_packed", fmt::format("expected I32 [{},{}], got {}", out, words,
                                                      w ? fmt::format("{} {}", io::dtype_name(w->dtype), shape_str(w->shape)) : "nothing"));
        continue;
      }
    } else {
      const auto* w = info_of(layer + ".weight");
      const auto want = qc.weights.is_float ? io::DType::kF8_E4M3 : io::DType::kI8;
      if (!w || w->dtype != want || w->shape.size() != 2) {
        problem(layer + ".weight", fmt::format("expected {} [out,in], got {}", io::dtype_name(want),
                                               w ? fmt::format("{} {}", io::dtype_name(w->dtype), shape_str(w->shape)) : "nothing"));
        continue;
      }
      out = w->shape[0];
      in = w->shape[1];
    }
    const auto* scale = info_of(layer + ".weight_scale");
    std::vector<int64_t> want_scale;
    if (qc.weights.strategy == "tensor") want_scale = {1};
    else if (qc.weights.strategy == "channel") want_scale = {out, 1};
    else if (qc.weights.group_size > 0 && in % qc.weights.group_size == 0) want_scale = {out, in / qc.weights.group_size};
    const bool float_scale = scale->dtype == io::DType::kF32 || scale->dtype == io::DType::kF16 || scale->dtype == io::DType::kBF16;
    if (!float_scale || scale->shape != want_scale)
      problem(layer + ".weight_scale", fmt::format("expected a float {}, got {} {}", shape_str(want_scale),
                                                   io::dtype_name(scale->dtype), shape_str(scale->shape)));
    const auto* input = info_of(layer + ".input_scale");
    if (static_inputs && (!input || input->shape != std::vector<int64_t>{1}))
      problem(layer + ".input_scale", fmt::format("expected a float [1] (static input activations), got {}",
                                                  input ? shape_str(input->shape) : "nothing"));
    if (!static_inputs && input) problem(layer + ".input_scale", "present, but the config has no static input activations");
  }
}

void check_outliers(const fs::path& path, const io::Checkpoint& ckpt, std::vector<std::string>& problems) {
  std::shared_ptr<const io::SafetensorsFile> file;
  try {
    file = io::SafetensorsFile::open(path);
  } catch (const InputError& e) {
    problems.push_back(e.what());
    return;
  }
  const std::string where = kOutliersPath;
  for (const auto& t : file->tensors()) {
    const auto dot = t.name.rfind('.');
    const auto layer = t.name.substr(0, dot);
    const auto kind = t.name.substr(dot + 1);
    if (kind != "outlier_channels" && kind != "outlier_weight") {
      problems.push_back(fmt::format("{}: tensor '{}': unknown kind", where, t.name));
      continue;
    }
    if (!ckpt.contains(layer + ".weight_scale")) {
      problems.push_back(fmt::format("{}: tensor '{}': layer is not quantized in the model", where, t.name));
      continue;
    }
    if (kind != "outlier_channels") continue;
    const auto* w = file->find(layer + ".outlier_weight");
    const int64_t n = t.shape.empty() ? -1 : t.shape[0];
    if (t.dtype != io::DType::kI64 || t.shape.size() != 1)
      problems.push_back(fmt::format("{}: tensor '{}': expected I64 [n]", where, t.name));
    else if (!w || w->dtype != io::DType::kF16 || w->shape.size() != 2 || w->shape[1] != n)
      problems.push_back(fmt::format("{}: tensor '{}.outlier_weight': expected F16 [out,{}]", where, layer, n));
  }
}

// The MP-Cache reads (the reader validates everything) and describes quantized layers;
// its activation masks are the outlier channels whose FP16 columns are stored.
void check_mp_cache(const fs::path& bundle, const io::Checkpoint* ckpt, std::vector<std::string>& problems) {
  quant::MpCache cache;
  try {
    cache = quant::read_mp_cache(bundle / kMpCachePath);
  } catch (const InputError& e) {
    problems.push_back(fmt::format("{}: {}", kMpCachePath, e.what()));
    return;
  }
  std::shared_ptr<const io::SafetensorsFile> outliers;
  if (fs::exists(bundle / kOutliersPath)) {
    try {
      outliers = io::SafetensorsFile::open(bundle / kOutliersPath);
    } catch (const InputError&) {
      // reported by check_outliers
    }
  }
  for (const auto& t : cache.tensors) {
    if (ckpt && !ckpt->contains(t.name + ".weight_scale")) {
      problems.push_back(fmt::format("{}: tensor '{}' ({}): not a quantized layer of the model", kMpCachePath, t.name,
                                     quant::to_string(t.role)));
      continue;
    }
    if (t.role != quant::MpRole::kActivation || t.rows != 1) continue;
    const auto masked = t.mask_tensor().nonzero().reshape({-1});
    if (masked.numel() == 0) continue;
    const auto* stored = outliers ? outliers->find(t.name + ".outlier_channels") : nullptr;
    if (!stored || !torch::equal(io::load_tensor(*outliers, *stored).to(torch::kInt64), masked))
      problems.push_back(fmt::format("{}: tensor '{}': {} masked channels without matching FP16 columns in {}",
                                     kMpCachePath, t.name, masked.numel(), kOutliersPath));
  }
}

}  // namespace

VerifyResult verify_bundle(const fs::path& bundle) {
  VerifyResult result;
  auto& problems = result.problems;
  if (!fs::is_directory(bundle)) {
    problems.push_back(fmt::format("{}: not a directory", bundle.string()));
    return result;
  }
  Manifest manifest;
  try {
    manifest = read_manifest(bundle);
  } catch (const InputError& e) {
    problems.push_back(e.what());
    return result;
  }
  std::set<std::string> listed;
  for (const auto& f : manifest.files) {
    listed.insert(f.path);
    const auto path = bundle / f.path;
    std::error_code ec;
    if (!fs::is_regular_file(fs::symlink_status(path, ec))) {
      problems.push_back(fmt::format("{}: listed in the manifest but missing", f.path));
      continue;
    }
    const auto size = fs::file_size(path, ec);
    if (size != f.size) {
      problems.push_back(fmt::format("{}: size: expected {}, got {}", f.path, f.size, size));
      continue;
    }
    const auto sha = io::sha256_file(path);
    if (sha != f.sha256) problems.push_back(fmt::format("{}: sha256: expected {}, got {}", f.path, f.sha256, sha));
  }
  for (const auto& rel : list_files(bundle))
    if (!listed.contains(rel)) problems.push_back(fmt::format("{}: present but not listed in the manifest", rel));

  const auto qc = check_quantization_config(bundle / "config.json", problems);
  std::optional<io::Checkpoint> ckpt;
  try {
    ckpt = io::Checkpoint::open(bundle);
  } catch (const InputError& e) {
    problems.push_back(e.what());
  }
  if (ckpt && qc) check_tensors(*ckpt, *qc, problems);
  if (ckpt && fs::exists(bundle / kOutliersPath)) check_outliers(bundle / kOutliersPath, *ckpt, problems);
  if (fs::exists(bundle / kMpCachePath)) check_mp_cache(bundle, ckpt ? &*ckpt : nullptr, problems);
  return result;
}

}  // namespace vlmopt::bundle
