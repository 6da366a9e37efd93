// calibrate: the collector's per-modality statistics and merging, FP16 safety,
// ignore patterns, SmoothQuant's invariance, layer-by-layer == whole-model, and
// the written MP-Cache/bundle agreeing with the plan.
#include "bundle_test_util.hpp"

#include "calib/calibrate.hpp"
#include "calib/collector.hpp"
#include "calib/fp16_safety.hpp"
#include "io/hf_config.hpp"
#include "quant/mp_cache.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <fstream>

using namespace vlmopt;
using vlmopt::testing::fixture_dir;
using vlmopt::testing::TempDir;

namespace {

// The fixture's reference inputs: input_ids [B,T] with image tokens, pixel_values, attention_mask.
model::ForwardInputs fixture_inputs(const std::filesystem::path& dir) {
  const auto ref = io::Checkpoint::open(dir / "reference.safetensors");
  model::ForwardInputs in;
  in.input_ids = io::load_tensor(ref, "input_ids");
  in.pixel_values = io::load_tensor(ref, "pixel_values");
  in.attention_mask = io::load_tensor(ref, "attention_mask");
  return in;
}

calib::CollectorOptions minmax_collector() {
  calib::CollectorOptions o;
  o.observer.kind = calib::ObserverKind::kMinMax;
  return o;
}

}  // namespace

TEST_CASE("collector: per-modality ranges and token counts match the tapped tensor") {
  const auto dir = fixture_dir("clip_llama_old");
  auto model = model::LlavaModel::load(dir, torch::kCPU);
  const auto inputs = fixture_inputs(dir);
  const std::string q = "model.language_model.layers.1.self_attn.q_proj";
  const std::string k = "model.language_model.layers.1.self_attn.k_proj";
  const std::string down = "model.language_model.layers.1.mlp.down_proj";

  // An independent capture of q_proj's input and the masks, to check against.
  torch::Tensor captured, image_mask, token_mask;
  const int id = model.taps().subscribe(q + ".input", [&](std::string_view, const torch::Tensor& x,
                                                          const model::TapContext& ctx) {
    captured = x.clone();
    image_mask = ctx.image_mask ? ctx.image_mask->clone() : torch::Tensor();
    token_mask = ctx.attention_mask ? ctx.attention_mask->clone() : torch::Tensor();
  });
  calib::ActivationCollector collector(model, {q, k, down}, minmax_collector());
  (void)model.forward(inputs);
  model.taps().unsubscribe(id);
  collector.detach();

  REQUIRE(captured.defined());
  REQUIRE(image_mask.defined());
  const auto& stats = collector.stats_for(q);
  CHECK(&stats == &collector.stats_for(k));   // q/k share one observed input
  CHECK(&stats != &collector.stats_for(down));
  CHECK(collector.points().size() == 2);
  const auto rows = captured.reshape({-1, captured.size(-1)});
  const auto img = image_mask.reshape({-1});
  const auto valid = token_mask.defined() ? token_mask.reshape({-1}) != 0 : torch::ones_like(img);
  const auto image_rows = rows.index({img & valid});
  const auto text_rows = rows.index({valid & img.logical_not()});
  CHECK(stats.image_tokens == image_rows.size(0));
  CHECK(stats.text_tokens == text_rows.size(0));
  CHECK(stats.image_tokens > 0);
  CHECK(stats.text_tokens > 0);
  CHECK(stats.image_range[0].item<float>() == image_rows.min().item<float>());
  CHECK(stats.image_range[1].item<float>() == image_rows.max().item<float>());
  CHECK(stats.text_range[0].item<float>() == text_rows.min().item<float>());
  CHECK(stats.text_range[1].item<float>() == text_rows.max().item<float>());
  const auto all = torch::cat({image_rows, text_rows});
  CHECK(torch::equal(stats.channel_max, std::get<0>(all.max(0))));
  CHECK(torch::equal(stats.channel_min, std::get<0>(all.min(0))));
  // The combined observer spans both modalities.
  const auto combined = stats.combined(collector.options().observer);
  CHECK(combined->min_vals().reshape({-1})[0].item<float>() == all.min().item<float>());
  CHECK(combined->max_vals().reshape({-1})[0].item<float>() == all.max().item<float>());
  CHECK(stats.sample.size(0) == std::min<int64_t>(256, all.size(0)));
}

TEST_CASE("collector: statistics of two shards merge into those of the whole") {
  const auto dir = fixture_dir("siglip_qwen2_new");
  auto model = model::LlavaModel::load(dir, torch::kCPU);
  const auto inputs = fixture_inputs(dir);
  const int64_t batch = inputs.input_ids.size(0);
  REQUIRE(batch >= 2);
  auto half = [&](int64_t begin, int64_t end) {
    model::ForwardInputs in = inputs;
    in.input_ids = inputs.input_ids.slice(0, begin, end);
    in.attention_mask = inputs.attention_mask.slice(0, begin, end);
    // One image per sample, in order.
    in.pixel_values = inputs.pixel_values.slice(0, begin, end);
    return in;
  };
  std::vector<std::string> linears;
  for (auto& [name, l] : model.linears())
    if (name.starts_with("model.language_model.")) linears.push_back(name);

  calib::ActivationCollector whole(model, linears, minmax_collector());
  (void)model.forward(half(0, 1));
  (void)model.forward(half(1, batch));
  whole.detach();
  calib::ActivationCollector a(model, linears, minmax_collector());
  (void)model.forward(half(0, 1));
  a.detach();
  calib::ActivationCollector b(model, linears, minmax_collector());
  (void)model.forward(half(1, batch));
  b.detach();
  a.merge(b);
  for (std::size_t i = 0; i < whole.points().size(); ++i) {
    const auto& w = *whole.points()[i];
    const auto& m = *a.points()[i];
    CAPTURE(w.tap);
    CHECK(torch::equal(w.channel_min, m.channel_min));
    CHECK(torch::equal(w.channel_max, m.channel_max));
    CHECK(w.image_tokens == m.image_tokens);
    CHECK(w.text_tokens == m.text_tokens);
    const auto wq = w.combined(whole.options().observer)->qparams();
    const auto mq = m.combined(a.options().observer)->qparams();
    CHECK(torch::equal(wq.scale, mq.scale));
    CHECK(torch::equal(wq.zero_point, mq.zero_point));
    const auto wf = w.fp16_safety(), mf = m.fp16_safety();
    CHECK(wf.elements == mf.elements);
    CHECK(wf.max_abs == mf.max_abs);
  }
}

TEST_CASE("fp16 safety: counts and recommendations") {
  calib::Fp16Counter counter;
  counter.observe(torch::tensor({0.0f, 1.0f, -70000.0f, 3e-5f, 1e-8f, 2.0f, 0.5f, -4.0f}));
  auto s = counter.result();
  CHECK(s.elements == 8);
  CHECK(s.overflow == 1);
  CHECK(s.subnormal == 2);  // 3e-5 and 1e-8 are below 2^-14
  CHECK(s.underflow == 1);  // 1e-8 is below 2^-24
  CHECK(s.max_abs == doctest::Approx(70000.0));
  // 70000 fits after halving, and 1e-8/2 still is not... flushed further: a shift cannot help both.
  CHECK(s.recommendation() == "keep bf16 or fp32");

  calib::Fp16Counter big;
  big.observe(torch::tensor({1.0f, 200000.0f, 0.25f}));
  const auto b = big.result();
  CHECK(b.rescale_exponent() == -2);  // 200000 / 4 = 50000 <= 65504
  CHECK(b.recommendation() == "rescale by 2^-2");

  calib::Fp16Counter fine;
  fine.observe(torch::randn({1000}));
  CHECK(fine.result().recommendation() == "fp16 fine");

  // Merging results equals observing everything.
  calib::Fp16Safety merged = counter.result();
  merged.merge(big.result());
  calib::Fp16Counter both;
  both.observe(torch::tensor({0.0f, 1.0f, -70000.0f, 3e-5f, 1e-8f, 2.0f, 0.5f, -4.0f}));
  both.observe(torch::tensor({1.0f, 200000.0f, 0.25f}));
  const auto all = both.result();
  CHECK(merged.elements == all.elements);
  CHECK(merged.overflow == all.overflow);
  CHECK(merged.underflow == all.underflow);
  CHECK(merged.max_abs == all.max_abs);
  CHECK(merged.min_abs_nonzero == all.min_abs_nonzero);
}

TEST_CASE("ignore patterns: exact names, Linear, and start-anchored regexes") {
  const auto defaults = calib::default_ignore();
  CHECK(calib::is_ignored("model.vision_tower.vision_model.encoder.layers.0.mlp.fc1", defaults));
  CHECK(calib::is_ignored("model.multi_modal_projector.linear_1", defaults));
  CHECK(calib::is_ignored("lm_head", defaults));
  CHECK_FALSE(calib::is_ignored("model.language_model.layers.0.self_attn.q_proj", defaults));
  CHECK(calib::is_ignored("anything", {"Linear"}));
  CHECK_FALSE(calib::is_ignored("model.language_model.layers.0.mlp.down_proj", {"re:mlp"}));  // anchored at the start
  CHECK(calib::is_ignored("model.language_model.layers.0.mlp.down_proj", {"re:.*down_proj"}));
}

namespace {
calib::CalibrateOptions fixture_options(const std::string& fixture) {
  calib::CalibrateOptions o;
  o.model = fixture_dir(fixture).string();
  o.data = "builtin:calib";
  o.samples = 6;
  o.batch_size = 4;
  return o;
}
}  // namespace

TEST_CASE("calibrate: layer-by-layer gives the same plan as the whole-model pass") {
  auto options = fixture_options("clip_llama_gqa_sharded");
  const auto whole = calib::run_calibration(options);
  options.layerwise = true;
  const auto layerwise = calib::run_calibration(options);
  REQUIRE(whole.plan.layers.size() == layerwise.plan.layers.size());
  REQUIRE(!whole.plan.layers.empty());
  CHECK(whole.dataset_hash == layerwise.dataset_hash);
  for (std::size_t i = 0; i < whole.plan.layers.size(); ++i) {
    const auto& a = whole.plan.layers[i];
    const auto& b = layerwise.plan.layers[i];
    CAPTURE(a.name);
    CHECK(a.name == b.name);
    CHECK(torch::equal(a.weight.scale, b.weight.scale));
    REQUIRE(a.input.has_value());
    REQUIRE(b.input.has_value());
    CHECK(torch::allclose(a.input->scale, b.input->scale, 1e-6, 0.0));
  }
  // Default ignore: no vision tower, projector or lm_head Linear is quantized.
  for (const auto& l : whole.plan.layers) CHECK(l.name.starts_with("model.language_model.layers."));
  CHECK(std::find(whole.plan.ignore.begin(), whole.plan.ignore.end(), "lm_head") != whole.plan.ignore.end());
}

TEST_CASE("calibrate: vision-tower layers that never run stay in float instead of failing") {
  // clip_llama_old: 2 vision layers, vision_feature_layer -2, so layer 1 computes nothing LLaVA uses.
  auto options = fixture_options("clip_llama_old");
  options.ignore = {"lm_head", "re:model\\.multi_modal_projector\\."};
  const auto run = calib::run_calibration(options);
  const std::string used = "model.vision_tower.vision_model.encoder.layers.0.";
  const std::string unused = "model.vision_tower.vision_model.encoder.layers.1.";
  int64_t used_quantized = 0;
  for (const auto& l : run.plan.layers) {
    CAPTURE(l.name);
    CHECK_FALSE(l.name.starts_with(unused));
    used_quantized += l.name.starts_with(used);
  }
  CHECK(used_quantized == 6);  // q, k, v, out_proj, fc1, fc2
  const auto& ignore = run.plan.ignore;
  CHECK(std::find(ignore.begin(), ignore.end(), unused + "self_attn.q_proj") != ignore.end());
  CHECK(std::find(ignore.begin(), ignore.end(), unused + "mlp.fc2") != ignore.end());
}

TEST_CASE("calibrate: SmoothQuant leaves the float function unchanged") {
  auto options = fixture_options("clip_llama_old");
  options.smoothquant_alpha = 0.5;
  const auto run = calib::run_calibration(options);
  REQUIRE(!run.plan.replaced_tensors.empty());
  const auto dir = fixture_dir("clip_llama_old");
  auto original = model::LlavaModel::load(dir, torch::kCPU);
  auto smoothed = model::LlavaModel::load(dir, torch::kCPU);
  {
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> params;
    for (const auto& item : smoothed.module().named_parameters(true)) params[item.key()] = item.value();
    int replaced = 0;
    for (const auto& [name, t] : run.plan.replaced_tensors) {
      REQUIRE(params.contains(name));
      CHECK_FALSE(torch::equal(params[name], t));  // the tensor really changed
      params[name].copy_(t);
      ++replaced;
    }
    CHECK(replaced > 0);
  }
  const auto inputs = fixture_inputs(dir);
  const auto a = original.forward(inputs).logits;
  const auto b = smoothed.forward(inputs).logits;
  CHECK((a - b).abs().max().item<float>() < 1e-4f);
  CHECK(run.report["smoothquant"].is_array());
}

TEST_CASE("calibrate: the bundle's MP-Cache and report agree with the plan") {
  TempDir tmp;
  auto options = fixture_options("clip_llama_old");
  options.out = tmp / "bundle";
  options.outlier_threshold = 1.0;  // low on purpose: the tiny random fixture has no natural outliers
  const auto summary = calib::calibrate(options);
  const auto cache_path = tmp.path() / "bundle" / "vlmopt" / "mp_cache.bin";
  REQUIRE(std::filesystem::exists(cache_path));
  const auto cache = quant::read_mp_cache(cache_path);
  const auto report = nlohmann::json::parse(vlmopt::testing::read_bytes(tmp.path() / "bundle" / "vlmopt" / "reports" / "calibration.json"));
  CHECK(report["format"] == "vlmopt-calibration-report");
  CHECK(report["layers"].size() == summary["quantized_linears"].get<std::size_t>());
  int64_t masked = 0;
  for (const auto& layer : report["layers"]) {
    const std::string name = layer["name"];
    CAPTURE(name);
    const auto* w = cache.find(name, quant::MpRole::kWeight);
    const auto* a = cache.find(name, quant::MpRole::kActivation);
    REQUIRE(w != nullptr);
    REQUIRE(a != nullptr);
    CHECK(a->entries.front().scale == doctest::Approx(layer["input_scale"].get<double>()).epsilon(1e-7));
    masked += static_cast<int64_t>(a->masked_channel_count());
    // int8 keeps > 10 dB even on random weights; "inf" when every input channel bypasses quantization.
    const auto& out_db = layer["sqnr_db"]["output"];
    if (out_db.is_string()) {
      CHECK(out_db == "inf");
    } else {
      CHECK(out_db.get<double>() > 10.0);
    }
    CHECK(layer["sqnr_db"]["weight"].get<double>() > 30.0);
  }
  CHECK(masked > 0);
  int64_t channels = 0;
  for (const auto& t : cache.tensors)
    if (t.role == quant::MpRole::kActivation) channels += static_cast<int64_t>(t.channels);
  CHECK(masked < channels);
  CHECK(masked == [&] {
    int64_t n = 0;
    for (const auto& layer : report["layers"]) n += layer["outlier_channels"].get<int64_t>();
    return n;
  }());
  // Per-modality ranges are reported for decoder inputs.
  for (const auto& point : report["activations"]) {
    CHECK(point["tokens"]["image"].get<int64_t>() > 0);
    CHECK(point["tokens"]["text"].get<int64_t>() > 0);
  }
}
