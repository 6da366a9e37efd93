// Bundle export, manifest, verify and update (lib/bundle).
#include "bundle/ct_codec.hpp"
#include "bundle/export.hpp"
#include "bundle/manifest.hpp"
#include "bundle/verify.hpp"
#include "bundle_test_util.hpp"
#include "io/atomic_file.hpp"
#include "io/hf_config.hpp"
#include "model/weights.hpp"
#include "quant/mp_cache.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>

#include <algorithm>

namespace {

using namespace vlmopt;
using namespace vlmopt::testing;

bool any_problem_contains(const bundle::VerifyResult& r, const std::string& text) {
  return std::any_of(r.problems.begin(), r.problems.end(), [&](const auto& p) { return p.find(text) != std::string::npos; });
}

std::string problems_text(const bundle::VerifyResult& r) {
  std::string s;
  for (const auto& p : r.problems) s += p + "\n";
  return s;
}

void flip_byte(const fs::path& path, size_t offset) {
  auto bytes = read_bytes(path);
  REQUIRE(offset < bytes.size());
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x01);
  write_bytes(path, bytes);
}

bundle::ExportOptions export_options(const fs::path& source, const fs::path& out) {
  bundle::ExportOptions o;
  o.source_model = source;
  o.out = out;
  o.dataset_hash = "test-dataset";
  o.step_options = {{"scheme", "w8a8"}, {"observer", "minmax"}};
  return o;
}

}  // namespace

TEST_CASE("ct codec: int4 packing matches the documented bit layout and round-trips") {
  // 9 values -> two words: element i of each word at bits 4i, stored as v + 8.
  const auto values = torch::tensor({{-8, -1, 0, 1, 7, 3, -3, 2, 5}}, torch::kInt8);
  const auto packed = bundle::ct::pack(values, 4);
  REQUIRE(packed.sizes() == torch::IntArrayRef{1, 2});
  uint32_t expect0 = 0;
  const int v[] = {-8, -1, 0, 1, 7, 3, -3, 2};
  for (int i = 0; i < 8; ++i) expect0 |= static_cast<uint32_t>(v[i] + 8) << (4 * i);
  CHECK(static_cast<uint32_t>(packed[0][0].item<int32_t>()) == expect0);
  CHECK(packed[0][1].item<int32_t>() == 5 + 8);
  CHECK(torch::equal(bundle::ct::unpack(packed, 4, 9), values));
}

TEST_CASE("export: w8a8 tensors, dtypes, shapes and quantization_config") {
  TempDir tmp;
  const auto src = fixture_dir("clip_llama_gqa_sharded");
  const auto plan = minmax_plan(src);
  const auto out = tmp / "bundle";
  bundle::export_bundle(export_options(src, out), plan);

  const auto ckpt = io::Checkpoint::open(out);
  const auto source = io::Checkpoint::open(src);
  std::map<std::string, float> input_scale;
  for (const auto& layer : plan.layers) {
    const auto w = ckpt.locate(layer.name + ".weight").second;
    const auto sw = io::load_tensor(source, model::on_disk_key(layer.name + ".weight", model::KeyLayout::kOld));
    CHECK((w->dtype == io::DType::kI8));
    CHECK(w->shape == sw.sizes().vec());
    const auto s = ckpt.locate(layer.name + ".weight_scale").second;
    CHECK((s->dtype == io::DType::kF32));
    CHECK(s->shape == std::vector<int64_t>{sw.size(0), 1});
    CHECK(ckpt.locate(layer.name + ".input_scale").second->shape == std::vector<int64_t>{1});
    CHECK_FALSE(ckpt.contains(layer.name + ".weight_zero_point"));
    CHECK_FALSE(ckpt.contains(layer.name + ".input_zero_point"));
    // Dequantized weights are within half a step of the source (no clamping: min-max scales).
    const auto q = io::load_tensor(ckpt, layer.name + ".weight").to(torch::kFloat32);
    const auto scale = io::load_tensor(ckpt, layer.name + ".weight_scale");
    CHECK(((q * scale - sw).abs() <= scale * 0.50001 + 1e-7).all().item<bool>());
    CHECK(q.abs().max().item<float>() >= 127.0f);  // amax/127.5 maps the largest |w| to +-127.5, rounded
    input_scale[layer.name] = io::load_tensor(ckpt, layer.name + ".input_scale").item<float>();
  }
  // One shared input scale per fused group: the max of the group's own scales.
  for (int l = 0; l < 3; ++l) {
    const auto p = fmt::format("model.language_model.layers.{}.", l);
    float own_max = 0;
    for (const auto& layer : plan.layers)
      if (layer.name.starts_with(p + "self_attn.") && !layer.name.ends_with("o_proj"))
        own_max = std::max(own_max, layer.input_all_channels->scale.item<float>());
    CHECK(input_scale[p + "self_attn.q_proj"] == own_max);
    CHECK(input_scale[p + "self_attn.k_proj"] == own_max);
    CHECK(input_scale[p + "self_attn.v_proj"] == own_max);
    CHECK(input_scale[p + "mlp.gate_proj"] == input_scale[p + "mlp.up_proj"]);
  }
  // Unquantized tensors: canonical names, source dtype and bytes.
  for (const auto& name : source.names()) {
    const auto canonical = *model::canonical_key(name);
    const bool quantized = std::any_of(plan.layers.begin(), plan.layers.end(),
                                       [&](const auto& l) { return l.name + ".weight" == canonical; });
    if (quantized) continue;
    REQUIRE(ckpt.contains(canonical));
    const auto [f1, i1] = source.locate(name);
    const auto [f2, i2] = ckpt.locate(canonical);
    CHECK(i1->dtype == i2->dtype);
    const auto a = f1->bytes(*i1), b = f2->bytes(*i2);
    CHECK(std::equal(a.begin(), a.end(), b.begin(), b.end()));
  }
  // config.json: the source config plus the minimal compressed-tensors config.
  const auto config = io::load_json_file(out / "config.json");
  const auto& q = config.at("quantization_config");
  CHECK(q.at("quant_method").get<std::string>() == std::string("compressed-tensors"));
  CHECK(q.at("format").get<std::string>() == std::string("int-quantized"));
  CHECK(q.at("quantization_status").get<std::string>() == std::string("compressed"));
  const auto& g = q.at("config_groups").at("group_0");
  CHECK(g.at("targets") == nlohmann::json{"Linear"});
  CHECK(g.at("weights").at("strategy").get<std::string>() == std::string("channel"));
  CHECK(g.at("weights").at("num_bits").get<int64_t>() == 8);
  CHECK(g.at("input_activations").at("strategy").get<std::string>() == std::string("tensor"));
  CHECK(g.at("input_activations").at("observer").get<std::string>() == std::string("static_minmax"));
  CHECK_FALSE(g.at("weights").contains("scale_dtype"));
  const auto ignore = q.at("ignore").get<std::vector<std::string>>();
  CHECK(std::count(ignore.begin(), ignore.end(), "lm_head") == 1);
  CHECK(std::count(ignore.begin(), ignore.end(), "model.multi_modal_projector.linear_1") == 1);
  // transformers 5.x module names: the vision tower has no vision_model level.
  CHECK(std::count(ignore.begin(), ignore.end(), "model.vision_tower.encoder.layers.0.self_attn.q_proj") == 1);
  CHECK(ignore.size() == plan.ignore.size());
  auto without_q = config;
  without_q.erase("quantization_config");
  CHECK(without_q == io::load_json_file(src / "config.json"));
  // Side files copied byte for byte; the manifest describes the bundle.
  CHECK(read_bytes(out / "tokenizer.json") == read_bytes(src / "tokenizer.json"));
  CHECK(read_bytes(out / "preprocessor_config.json") == read_bytes(src / "preprocessor_config.json"));
  const auto manifest = bundle::read_manifest(out);
  CHECK(manifest.source_model_sha256 == bundle::source_model_hash(src));
  CHECK(manifest.dataset_hash == "test-dataset");
  REQUIRE(manifest.steps.size() == 1);
  CHECK(manifest.steps[0]["options"]["observer"].get<std::string>() == std::string("minmax"));
  CHECK(manifest.files == bundle::scan_files(out));
  CHECK_FALSE(fs::exists(out / bundle::kOutliersPath));
  const auto mp = quant::read_mp_cache(out / bundle::kMpCachePath);
  CHECK(mp == quant::mp_cache_from_plan(plan));
  CHECK(bundle::verify_bundle(out).ok());
}

TEST_CASE("export: deterministic, sharded, and with outlier columns") {
  TempDir tmp;
  const auto src = fixture_dir("siglip_qwen2_new");
  PlanOptions po;
  po.outliers_per_layer = 2;
  const auto plan = minmax_plan(src, po);
  bundle::export_bundle(export_options(src, tmp / "a"), plan);
  bundle::export_bundle(export_options(src, tmp / "b"), plan);
  const auto files = bundle::list_files(tmp / "a");
  CHECK(files == bundle::list_files(tmp / "b"));
  for (const auto& f : files) CHECK_MESSAGE(read_bytes(tmp / "a" / f) == read_bytes(tmp / "b" / f), f);
  CHECK(read_bytes(tmp / "a" / bundle::kManifestPath) == read_bytes(tmp / "b" / bundle::kManifestPath));

  // Outlier columns: FP16 copies of the source weight's columns of the marked channels.
  const auto outliers = io::Checkpoint::open(tmp / "a" / bundle::kOutliersPath);
  const auto source_model = model::LlavaModel::load(src, torch::kCPU);
  for (const auto& layer : plan.layers) {
    const auto idx = io::load_tensor(outliers, layer.name + ".outlier_channels");
    CHECK(torch::equal(idx, layer.outlier_channels.nonzero().reshape({-1})));
    const auto cols = io::load_tensor(outliers, layer.name + ".outlier_weight");
    CHECK((cols.scalar_type() == torch::kFloat16));
    torch::Tensor w;
    for (const auto& [n, t] : source_model.named_tensors())
      if (n == layer.name + ".weight") w = t;
    CHECK(torch::equal(cols, w.index_select(1, idx).to(torch::kFloat16)));
    CHECK(layer.input->scale.item<float>() < layer.input_all_channels->scale.item<float>());
  }

  // Sharding: a small limit gives shards + index, which verify and load.
  auto sharded = export_options(src, tmp / "sharded");
  sharded.max_shard_bytes = 4096;
  bundle::export_bundle(sharded, plan);
  CHECK_FALSE(fs::exists(tmp / "sharded" / "model.safetensors"));
  CHECK(fs::exists(tmp / "sharded" / "model.safetensors.index.json"));
  const auto ckpt = io::Checkpoint::open(tmp / "sharded");
  CHECK(ckpt.files().size() > 2);
  CHECK(ckpt.names() == io::Checkpoint::open(tmp / "a").names());
  CHECK(bundle::verify_bundle(tmp / "sharded").ok());
}

TEST_CASE("export: w4a16 pack-quantized and refusals") {
  TempDir tmp;
  const auto src = fixture_dir("clip_llama_old");
  PlanOptions po;
  po.kind = quant::SchemeKind::kW4A16;
  po.in_multiple = 32;  // group size 32; down_proj (in 37) stays unquantized
  const auto plan = minmax_plan(src, po);
  bundle::export_bundle(export_options(src, tmp / "w4"), plan);
  const auto ckpt = io::Checkpoint::open(tmp / "w4");
  const auto& l = plan.layers.front();
  const auto packed = ckpt.locate(l.name + ".weight_packed").second;
  CHECK((packed->dtype == io::DType::kI32));
  CHECK(packed->shape == std::vector<int64_t>{32, 4});  // 32 inputs * 4 bits / 32
  CHECK(torch::equal(io::load_tensor(ckpt, l.name + ".weight_shape"), torch::tensor({32, 32}, torch::kInt64)));
  CHECK(ckpt.locate(l.name + ".weight_scale").second->shape == std::vector<int64_t>{32, 1});
  CHECK_FALSE(ckpt.contains(l.name + ".input_scale"));
  const auto q = io::load_json_file(tmp / "w4" / "config.json")["quantization_config"];
  CHECK(q["format"].get<std::string>() == std::string("pack-quantized"));
  CHECK(q["config_groups"]["group_0"]["weights"]["group_size"].get<int64_t>() == 32);
  CHECK(q["config_groups"]["group_0"]["input_activations"].is_null());
  const auto result = bundle::verify_bundle(tmp / "w4");
  CHECK_MESSAGE(result.ok(), problems_text(result));

  // A non-empty directory that is not a bundle is never replaced.
  fs::create_directories(tmp / "precious");
  write_bytes(tmp / "precious" / "notes.txt", "keep me");
  CHECK_THROWS_AS(bundle::export_bundle(export_options(src, tmp / "precious"), plan), InputError);
  CHECK(read_bytes(tmp / "precious" / "notes.txt") == "keep me");
  // A plan naming a Linear the checkpoint lacks.
  auto bad = plan;
  bad.layers.front().name = "model.language_model.layers.9.self_attn.q_proj";
  CHECK_THROWS_WITH_AS(bundle::export_bundle(export_options(src, tmp / "bad"), bad),
                       doctest::Contains("layers.9.self_attn.q_proj"), InputError);
  CHECK_FALSE(fs::exists(tmp / "bad"));
}

TEST_CASE("verify: accepts a fresh bundle and names each corruption") {
  TempDir tmp;
  const auto src = fixture_dir("siglip_qwen2_new");
  PlanOptions po;
  po.outliers_per_layer = 1;
  const auto plan = minmax_plan(src, po);
  const auto good = tmp / "good";
  bundle::export_bundle(export_options(src, good), plan);
  REQUIRE(bundle::verify_bundle(good).ok());

  const auto fresh_copy = [&](const std::string& name) {
    const auto dir = tmp / name;
    fs::copy(good, dir, fs::copy_options::recursive);
    return dir;
  };
  for (const std::string file :
       {"config.json", "model.safetensors", "tokenizer.json", "vlmopt/outliers.safetensors", "vlmopt/mp_cache.bin"}) {
    CAPTURE(file);
    const auto dir = fresh_copy("flip_" + std::to_string(std::hash<std::string>{}(file)));
    flip_byte(dir / file, fs::file_size(dir / file) / 2);
    const auto r = bundle::verify_bundle(dir);
    CHECK_FALSE(r.ok());
    CHECK_MESSAGE(r.problems.front().starts_with(file + ": sha256"), problems_text(r));
  }
  {  // a flipped header byte of model.safetensors is also a broken header
    const auto dir = fresh_copy("flip_header");
    flip_byte(dir / "model.safetensors", 9);  // the header's first '"' -> '#'
    const auto r = bundle::verify_bundle(dir);
    CHECK(any_problem_contains(r, "model.safetensors: sha256"));
    CHECK(r.problems.size() >= 2);
  }
  {  // manifest: its format_version digit
    const auto dir = fresh_copy("flip_manifest");
    const auto text = read_bytes(dir / bundle::kManifestPath);
    flip_byte(dir / bundle::kManifestPath, text.find("\"format_version\": 1") + 18);
    const auto r = bundle::verify_bundle(dir);
    REQUIRE(r.problems.size() == 1);
    CHECK(r.problems.front().find("manifest.json: field 'format_version': expected 1, got 0") != std::string::npos);
  }
  {
    const auto dir = fresh_copy("missing");
    fs::remove(dir / "tokenizer.json");
    const auto r = bundle::verify_bundle(dir);
    CHECK(r.problems == std::vector<std::string>{"tokenizer.json: listed in the manifest but missing"});
  }
  {
    const auto dir = fresh_copy("unlisted");
    write_bytes(dir / "vlmopt" / "extra.bin", "x");
    const auto r = bundle::verify_bundle(dir);
    CHECK(r.problems == std::vector<std::string>{"vlmopt/extra.bin: present but not listed in the manifest"});
  }
  {  // consistent hashes but an inconsistent config: the config check names it
    const auto dir = fresh_copy("config_schema");
    auto config = io::load_json_file(dir / "config.json");
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["scale_dtype"] = "float32";
    config["quantization_config"]["format"] = "float-quantized";
    write_bytes(dir / "config.json", config.dump(2));
    auto manifest = bundle::read_manifest(dir);
    manifest.files = bundle::scan_files(dir);
    bundle::write_manifest(dir, manifest);
    const auto r = bundle::verify_bundle(dir);
    CHECK(any_problem_contains(r, "weights.scale_dtype: unknown key"));
    CHECK(any_problem_contains(r, "format: float-quantized does not match weights type int"));
  }
  {  // an MP-Cache whose bytes are consistent with the manifest but not with itself
    const auto dir = fresh_copy("mp_cache_body");
    flip_byte(dir / bundle::kMpCachePath, fs::file_size(dir / bundle::kMpCachePath) - 20);
    auto manifest = bundle::read_manifest(dir);
    manifest.files = bundle::scan_files(dir);
    bundle::write_manifest(dir, manifest);
    const auto r = bundle::verify_bundle(dir);
    REQUIRE_FALSE(r.ok());
    CHECK_MESSAGE(r.problems.front().starts_with("vlmopt/mp_cache.bin: "), problems_text(r));
  }
  CHECK_FALSE(bundle::verify_bundle(tmp / "nothing_here").ok());
}

TEST_CASE("update_bundle: replaces tensors, adds files, keeps the manifest consistent") {
  TempDir tmp;
  const auto src = fixture_dir("clip_llama_old");
  const auto out = tmp / "bundle";
  bundle::export_bundle(export_options(src, out), minmax_plan(src));
  const auto before = bundle::read_manifest(out);

  const std::string proj = "model.multi_modal_projector.linear_1.weight";
  const auto old_value = io::load_tensor(io::Checkpoint::open(out), proj);
  const auto new_value = old_value * 2 + 1;
  bundle::BundleUpdate update;
  update.step = "compensate";
  update.options = {{"epochs", 3}};
  update.replace_tensors[proj] = new_value;
  update.apply = [](const fs::path& root) { io::write_file_atomic(root / "vlmopt" / "adapter.safetensors", "update_bundle test payload"); };
  bundle::update_bundle(out, update);

  CHECK(torch::equal(io::load_tensor(io::Checkpoint::open(out), proj), new_value));
  const auto after = bundle::read_manifest(out);
  REQUIRE(after.steps.size() == 2);
  CHECK(after.steps[0] == before.steps[0]);
  CHECK(after.steps[1]["step"].get<std::string>() == std::string("compensate"));
  CHECK(after.steps[1]["options"]["epochs"].get<int64_t>() == 3);
  CHECK(after.source_model_sha256 == before.source_model_sha256);
  CHECK(after.files == bundle::scan_files(out));
  CHECK(std::any_of(after.files.begin(), after.files.end(), [](const auto& f) { return f.path == "vlmopt/adapter.safetensors"; }));
  const auto r = bundle::verify_bundle(out);
  CHECK_MESSAGE(r.ok(), problems_text(r));

  bundle::BundleUpdate prune;
  prune.step = "prune-fit";
  prune.apply = [](const fs::path& root) { io::write_file_atomic(root / "vlmopt" / "prune.json", "{}\n"); };
  bundle::update_bundle(out, prune);
  CHECK(bundle::read_manifest(out).steps.size() == 3);
  CHECK(bundle::verify_bundle(out).ok());

  bundle::BundleUpdate bad;
  bad.step = "compensate";
  bad.replace_tensors["model.language_model.layers.0.self_attn.q_proj.weight"] = torch::zeros({32, 32});
  CHECK_THROWS_AS(bundle::update_bundle(out, bad), InputError);  // quantized: not replaceable
  CHECK(bundle::read_manifest(out).steps.size() == 3);
  CHECK(bundle::verify_bundle(out).ok());
  // No staging directories left behind.
  for (const auto& e : fs::directory_iterator(tmp.path()))
    CHECK_FALSE(e.path().filename().string().starts_with(bundle::staging_prefix(out)));
}
