#include "bundle/inspect.hpp"

#include "io/hf_config.hpp"
#include "io/safetensors.hpp"
#include "model/weights.hpp"
#include "quant/mp_cache.hpp"
#include "util/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <map>
#include <string_view>

namespace vlmopt::bundle {

namespace {

// The part of the model a canonical parameter name belongs to.
std::string_view part_of(std::string_view canonical) {
  if (canonical.starts_with("model.vision_tower.")) return "vision_tower";
  if (canonical.starts_with("model.multi_modal_projector.")) return "projector";
  if (canonical.starts_with("model.language_model.")) return "language_model";
  if (canonical.starts_with("lm_head.")) return "lm_head";
  return "other";
}

// Module names of the Linear layers of the LLaVA family (the last path component).
bool is_linear_module(std::string_view module) {
  static constexpr std::array<std::string_view, 13> kLinear = {
      "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "fc1", "fc2",
      "gate_proj", "up_proj", "down_proj", "linear_1", "linear_2", "lm_head"};
  const auto dot = module.rfind('.');
  const auto leaf = dot == std::string_view::npos ? module : module.substr(dot + 1);
  for (auto name : kLinear)
    if (leaf == name) return true;
  return false;
}

nlohmann::json shape_json(const std::vector<int64_t>& shape) { return nlohmann::json(shape); }

}  // namespace

nlohmann::json inspect_safetensors(const std::filesystem::path& file) {
  const auto st = io::SafetensorsFile::open(file);
  nlohmann::json tensors = nlohmann::json::array();
  int64_t params = 0;
  for (const auto& t : st->tensors()) {
    tensors.push_back({{"name", t.name}, {"dtype", io::dtype_name(t.dtype)}, {"shape", shape_json(t.shape)},
                       {"data_offsets", {t.begin, t.end}}});
    params += t.numel();
  }
  return {{"kind", "safetensors"}, {"path", file.string()}, {"file_size", st->file_size()},
          {"tensors", std::move(tensors)}, {"elements", params}, {"metadata", st->metadata()}};
}

nlohmann::json inspect_model_dir(const std::filesystem::path& dir) {
  const auto cfg = io::load_llava_config(dir);
  const auto ckpt = io::Checkpoint::open(dir);

  std::map<std::string, int64_t> params_by_part;
  std::map<std::string, int64_t> dtypes;  // dtype -> tensors
  nlohmann::json linears = nlohmann::json::array();
  int old_keys = 0, new_keys = 0;
  for (const auto& name : ckpt.names()) {
    const auto [file, info] = ckpt.locate(name);
    const auto canonical = model::canonical_key(name);
    if (!canonical) continue;  // buffers such as position_ids
    (name.starts_with("language_model.model.") || name.starts_with("vision_tower.") ||
     name.starts_with("multi_modal_projector."))
        ? ++old_keys
        : ++new_keys;
    params_by_part[std::string(part_of(*canonical))] += info->numel();
    dtypes[std::string(io::dtype_name(info->dtype))] += 1;
    if (canonical->ends_with(".weight") && info->shape.size() == 2) {
      const auto module = canonical->substr(0, canonical->size() - std::string_view(".weight").size());
      if (is_linear_module(module)) {
        linears.push_back({{"name", module}, {"out_features", info->shape[0]}, {"in_features", info->shape[1]},
                           {"dtype", io::dtype_name(info->dtype)}, {"part", part_of(module)}});
      }
    }
  }
  int64_t total = 0;
  for (const auto& [part, n] : params_by_part) total += n;
  const auto& v = cfg.vision;
  const auto& t = cfg.text;
  nlohmann::json arch = {
      {"model_type", cfg.model_type},
      {"vision", {{"model_type", v.model_type}, {"layers", v.num_hidden_layers}, {"hidden_size", v.hidden_size},
                  {"heads", v.num_attention_heads}, {"image_size", v.image_size}, {"patch_size", v.patch_size},
                  {"hidden_act", v.hidden_act}}},
      {"projector", {{"hidden_act", cfg.projector_hidden_act}, {"bias", cfg.multimodal_projector_bias}}},
      {"text", {{"model_type", t.model_type}, {"layers", t.num_hidden_layers}, {"hidden_size", t.hidden_size},
                {"heads", t.num_attention_heads}, {"kv_heads", t.num_key_value_heads}, {"head_dim", t.head_dim},
                {"intermediate_size", t.intermediate_size}, {"vocab_size", t.vocab_size},
                {"rope_theta", t.rope_theta}, {"tie_word_embeddings", t.tie_word_embeddings || cfg.tie_word_embeddings}}},
      {"image_token_id", cfg.image_token_id},
      {"image_tokens_per_image", cfg.image_tokens_per_image()},
      {"vision_feature_layer", cfg.vision_feature_layers},
      {"vision_feature_select_strategy", cfg.vision_feature_select_strategy},
      {"torch_dtype", cfg.torch_dtype}};
  nlohmann::json files = nlohmann::json::array();
  for (const auto& f : ckpt.files()) files.push_back(f->path().filename().string());
  return {{"kind", "model"},
          {"path", dir.string()},
          {"architecture", std::move(arch)},
          {"parameters", {{"total", total}, {"by_part", params_by_part}}},
          {"dtypes", dtypes},
          {"key_layout", old_keys > new_keys ? "old" : "new"},
          {"files", std::move(files)},
          {"linear_layers", std::move(linears)}};
}

nlohmann::json inspect_mp_cache(const std::filesystem::path& file) {
  quant::MpCacheLayout layout;
  const auto cache = quant::read_mp_cache(file, &layout);
  auto summary = quant::summarize_mp_cache(cache, &layout);
  summary["path"] = file.string();
  return summary;
}

nlohmann::json inspect(const std::filesystem::path& path) {
  if (std::filesystem::is_directory(path)) return inspect_model_dir(path);
  if (std::filesystem::is_regular_file(path) && quant::is_mp_cache_file(path)) return inspect_mp_cache(path);
  if (std::filesystem::is_regular_file(path) && path.extension() == ".safetensors") return inspect_safetensors(path);
  if (!std::filesystem::exists(path)) throw InputError(fmt::format("{}: no such file or directory", path.string()));
  throw InputError(fmt::format("{}: not something vlmopt can inspect (expected a model directory, a .safetensors file or an MP-Cache file)",
                               path.string()));
}

namespace {

std::string scale_range_text(const nlohmann::json& lo, const nlohmann::json& hi) {
  if (lo.is_null() || hi.is_null()) return "-";
  return fmt::format("{:.6g}..{:.6g}", lo.get<double>(), hi.get<double>());
}

std::string format_mp_cache(const nlohmann::json& s) {
  std::string out;
  const auto& file = s.at("file");
  out += fmt::format("{}: MP-Cache v{}, {} bytes, {} tensors, sha256 {}\n", s.at("path").get<std::string>(),
                     file.at("format_version").get<uint32_t>(), file.at("file_size").get<uint64_t>(),
                     s.at("tensor_count").get<uint64_t>(), file.at("sha256").get<std::string>());
  out += "  sections (offset, size in bytes):\n";
  for (const char* name : {"directory", "strings", "weight", "activation"}) {  // file order
    const auto& region = file.at("sections").at(name);
    out += fmt::format("    {:<12} {:>12} {:>12}\n", name, region.at("offset").get<uint64_t>(), region.at("size").get<uint64_t>());
  }
  for (const auto& [role, r] : s.at("roles").items())
    out += fmt::format("  {:<10} {} tensors, {} entries, {} masked channels, dtypes {}, scales {}\n", role,
                       r.at("tensors").get<uint64_t>(), r.at("entries").get<uint64_t>(),
                       r.at("masked_channels").get<uint64_t>(), r.at("dtypes").dump(),
                       scale_range_text(r.at("scale_min"), r.at("scale_max")));
  out += fmt::format("  {:<64} {:<10} {:<8} {:>4} {:>5} {:>8} {:>6} {:>8} {:>7}  {}\n", "tensor", "role", "dtype", "axis",
                     "group", "channels", "rows", "entries", "masked", "scales");
  for (const auto& t : s.at("tensors"))
    out += fmt::format("  {:<64} {:<10} {:<8} {:>4} {:>5} {:>8} {:>6} {:>8} {:>7}  {}\n", t.at("name").get<std::string>(),
                       t.at("role").get<std::string>(), t.at("dtype").get<std::string>(), t.at("axis").get<int32_t>(),
                       t.at("group_size").get<uint32_t>(), t.at("channels").get<uint64_t>(), t.at("rows").get<uint64_t>(),
                       t.at("entries").get<uint64_t>(), t.at("masked_channels").get<uint64_t>(),
                       scale_range_text(t.at("scale_min"), t.at("scale_max")));
  return out;
}

}  // namespace

std::string format_inspect(const nlohmann::json& s) {
  std::string out;
  if (s.at("kind") == "mp_cache") return format_mp_cache(s);
  if (s.at("kind") == "safetensors") {
    out += fmt::format("{}: safetensors, {} bytes, {} tensors, {} elements\n", s.at("path").get<std::string>(),
                       s.at("file_size").get<uint64_t>(), s.at("tensors").size(), s.at("elements").get<int64_t>());
    for (const auto& t : s.at("tensors"))
      out += fmt::format("  {:<60} {:<8} {}\n", t.at("name").get<std::string>(), t.at("dtype").get<std::string>(),
                         t.at("shape").dump());
    return out;
  }
  const auto& a = s.at("architecture");
  const auto& v = a.at("vision");
  const auto& t = a.at("text");
  out += fmt::format("{}: LLaVA ({} + {}), key layout {}\n", s.at("path").get<std::string>(),
                     v.at("model_type").get<std::string>(), t.at("model_type").get<std::string>(),
                     s.at("key_layout").get<std::string>());
  out += fmt::format("  vision    {} layers, hidden {}, {} heads, image {} / patch {}, act {}\n",
                     v.at("layers").get<int64_t>(), v.at("hidden_size").get<int64_t>(), v.at("heads").get<int64_t>(),
                     v.at("image_size").get<int64_t>(), v.at("patch_size").get<int64_t>(),
                     v.at("hidden_act").get<std::string>());
  out += fmt::format("  text      {} layers, hidden {}, {} heads / {} kv heads, intermediate {}, vocab {}\n",
                     t.at("layers").get<int64_t>(), t.at("hidden_size").get<int64_t>(), t.at("heads").get<int64_t>(),
                     t.at("kv_heads").get<int64_t>(), t.at("intermediate_size").get<int64_t>(),
                     t.at("vocab_size").get<int64_t>());
  out += fmt::format("  images    {} tokens per image (feature layer {}, strategy {})\n",
                     a.at("image_tokens_per_image").get<int64_t>(), a.at("vision_feature_layer").dump(),
                     a.at("vision_feature_select_strategy").get<std::string>());
  out += fmt::format("  params    {} total\n", s.at("parameters").at("total").get<int64_t>());
  for (const auto& [part, n] : s.at("parameters").at("by_part").items())
    out += fmt::format("    {:<16} {}\n", part, n.get<int64_t>());
  out += fmt::format("  dtypes    {}\n", s.at("dtypes").dump());
  out += fmt::format("  linear layers ({}):\n", s.at("linear_layers").size());
  for (const auto& l : s.at("linear_layers"))
    out += fmt::format("    {:<64} [{}, {}] {}\n", l.at("name").get<std::string>(), l.at("out_features").get<int64_t>(),
                       l.at("in_features").get<int64_t>(), l.at("dtype").get<std::string>());
  return out;
}

}  // namespace vlmopt::bundle
