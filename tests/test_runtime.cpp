// vlmopt's bundle runtime (lib/runtime): fake-quant and int8 kernels, outliers.
#include "bundle/ct_codec.hpp"
#include "bundle/export.hpp"
#include "bundle_test_util.hpp"
#include "runtime/runtime.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>

namespace {

using namespace vlmopt;
using namespace vlmopt::testing;

fs::path export_fixture(const TempDir& tmp, const std::string& fixture, const PlanOptions& po,
                        quant::QuantPlan* plan_out = nullptr) {
  const auto src = fixture_dir(fixture);
  auto plan = minmax_plan(src, po);
  bundle::ExportOptions o;
  o.source_model = src;
  o.out = tmp / ("bundle_" + fixture);
  bundle::export_bundle(o, plan);
  if (plan_out) *plan_out = plan;
  return o.out;
}

runtime::LoadedBundle load(const fs::path& dir, runtime::KernelKind kind, bool mp_cache = true) {
  runtime::RuntimeOptions ro;
  ro.kernels = kind;
  ro.use_mp_cache = mp_cache;
  return runtime::load_bundle(dir, torch::kCPU, ro);
}

model::LinearImpl& find_linear(model::LlavaModel& m, const std::string& name) {
  for (auto& [n, l] : m.linears())
    if (n == name) return *l;
  FAIL("no Linear " << name);
  throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("runtime: fake-quant and int8 kernels agree; unquantized layers untouched") {
  TempDir tmp;
  for (const std::string fixture : {"clip_llama_old", "siglip_qwen2_new"}) {
    CAPTURE(fixture);
    const auto dir = export_fixture(tmp, fixture, {});
    auto fake = load(dir, runtime::KernelKind::kFakeQuant);
    auto int8 = load(dir, runtime::KernelKind::kInt8);
    auto reference = model::LlavaModel::load(fixture_dir(fixture), torch::kCPU);
    CHECK(fake.quantized_layers.size() == 14);  // 2 decoder layers x 7 Linears
    CHECK(fake.outlier_layers.empty());

    const auto inputs = reference_inputs(fixture_dir(fixture));
    const auto lf = fake.model.forward(inputs).logits;
    const auto li = int8.model.forward(inputs).logits;
    const auto lr = reference.forward(inputs).logits;
    const double fake_vs_int8 = (lf - li).abs().max().item<double>();
    const double fake_vs_float = (lf - lr).abs().max().item<double>();
    MESSAGE(fixture << ": max |logit delta| fake vs int8 " << fake_vs_int8 << ", fake vs float " << fake_vs_float);
    CHECK(fake_vs_int8 < 1e-4);
    const double relative = ((lf - lr).norm() / lr.norm()).item<double>();
    MESSAGE(fixture << ": relative logit error of the quantized model " << relative);
    CHECK(fake_vs_float > 0);  // quantization did change something...
    CHECK(relative < 0.1);     // ...but not much (int8 min-max on the fixture's own reference inputs)
    model::ForwardInputs prompt = inputs;
    const auto gf = fake.model.generate_greedy(prompt, 6, {});
    const auto gi = int8.model.generate_greedy(prompt, 6, {});
    CHECK(gf == gi);

    // Unquantized Linears: no kernel, the source weights exactly. Quantized: dequantized weights.
    auto ref_linears = reference.linears();
    size_t i = 0;
    for (auto& [name, linear] : fake.model.linears()) {
      const auto& [ref_name, ref_linear] = ref_linears[i++];
      REQUIRE(name == ref_name);
      const bool quantized = std::count(fake.quantized_layers.begin(), fake.quantized_layers.end(), name) == 1;
      CHECK((linear->kernel != nullptr) == quantized);
      if (!quantized) {
        CHECK(torch::equal(linear->weight, ref_linear->weight));
      } else {
        const auto step = (ref_linear->weight.abs().amax(1, true) / 127.5);
        CHECK(((linear->weight - ref_linear->weight).abs() <= step * 0.5001).all().item<bool>());  // half a step, float slack
        CHECK_FALSE(torch::equal(linear->weight, ref_linear->weight));
      }
    }
  }
}

TEST_CASE("runtime: one kernel computes fake-quant x dequantized W, the int8 one the same in integers") {
  TempDir tmp;
  quant::QuantPlan plan;
  const auto dir = export_fixture(tmp, "clip_llama_old", {}, &plan);
  auto fake = load(dir, runtime::KernelKind::kFakeQuant);
  auto int8 = load(dir, runtime::KernelKind::kInt8);
  const std::string name = "model.language_model.layers.1.mlp.down_proj";
  auto& lf = find_linear(fake.model, name);
  auto& li = find_linear(int8.model, name);
  const auto x = torch::randn({2, 5, lf.in_features()}, torch::TensorOptions().dtype(torch::kFloat32)) * 0.3;
  const auto ckpt = io::Checkpoint::open(dir);
  const auto q = io::load_tensor(ckpt, name + ".weight").to(torch::kFloat32);
  const auto sw = io::load_tensor(ckpt, name + ".weight_scale");
  const double sx = io::load_tensor(ckpt, name + ".input_scale").item<double>();
  // Independent reference: integer inputs and weights, integer products, one rescale.
  const auto xq = (x / sx).clamp(-128, 127).round();
  const auto expected = torch::matmul(xq.to(torch::kFloat64), q.to(torch::kFloat64).t()) * (sw.reshape({1, -1}).to(torch::kFloat64) * sx);
  torch::NoGradGuard no_grad;
  CHECK(torch::allclose(lf.forward(x).to(torch::kFloat64), expected, 1e-5, 1e-5));
  CHECK(torch::allclose(li.forward(x).to(torch::kFloat64), expected, 1e-5, 1e-5));
  CHECK_THROWS_AS(runtime::parse_kernel_kind("int4"), InputError);
}

TEST_CASE("runtime: outlier channels take the FP16 path with the stored columns") {
  TempDir tmp;
  PlanOptions po;
  po.outliers_per_layer = 2;
  quant::QuantPlan plan;
  const auto dir = export_fixture(tmp, "clip_llama_old", po, &plan);
  auto with = load(dir, runtime::KernelKind::kFakeQuant, true);
  auto with_int8 = load(dir, runtime::KernelKind::kInt8, true);
  auto without = load(dir, runtime::KernelKind::kFakeQuant, false);
  auto reference = model::LlavaModel::load(fixture_dir("clip_llama_old"), torch::kCPU);
  CHECK(with.outlier_layers.size() == with.quantized_layers.size());
  CHECK(without.outlier_layers.empty());

  const auto& lq = plan.layers.front();
  auto& lw = find_linear(with.model, lq.name);
  auto& lw8 = find_linear(with_int8.model, lq.name);
  auto& lo = find_linear(without.model, lq.name);
  auto& lr = find_linear(reference, lq.name);
  const auto idx = lq.outlier_channels.nonzero().reshape({-1});
  torch::NoGradGuard no_grad;
  // Inlier channels small, outlier channels far beyond the all-channel input range.
  auto x = torch::randn({3, lr.in_features()}) * 0.05;
  x.index_fill_(1, idx, 0.0);
  x.index_put_({torch::indexing::Slice(), idx}, torch::tensor({40.0f, -25.0f}).expand({3, 2}));
  const auto exact = lr.dense(x);
  const auto yw = lw.forward(x), yw8 = lw8.forward(x), yo = lo.forward(x);
  // FP16 columns: the outlier contribution is exact up to fp16 rounding of x and W.
  const auto cols = io::load_tensor(io::Checkpoint::open(dir / bundle::kOutliersPath), lq.name + ".outlier_weight");
  const auto outlier_part = torch::matmul(x.index_select(1, idx).to(torch::kFloat16).to(torch::kFloat32),
                                          cols.to(torch::kFloat32).t());
  const double sx_in = lq.input->scale.item<double>();
  const auto inl = x.index_fill(1, idx, 0.0);
  const auto w_deq = lw.weight.index_fill(1, idx, 0.0);
  const auto expected = torch::matmul((inl / sx_in).clamp(-128, 127).round() * sx_in, w_deq.t()) + outlier_part +
                        (lr.has_bias() ? lr.bias : torch::zeros({lr.out_features()}));
  CHECK(torch::allclose(yw, expected, 1e-4, 1e-5));
  CHECK(torch::allclose(yw8, expected, 1e-4, 1e-4));
  const double err_with = (yw - exact).abs().max().item<double>();
  const double err_without = (yo - exact).abs().max().item<double>();
  MESSAGE("outlier layer: max |error| with FP16 outliers " << err_with << ", compressed-tensors path " << err_without);
  CHECK(err_with < err_without);
  // Whole model: still runs, and differs from the compressed-tensors path.
  const auto inputs = reference_inputs(fixture_dir("clip_llama_old"));
  CHECK_FALSE(torch::allclose(with.model.forward(inputs).logits, without.model.forward(inputs).logits));
}

// Driven by tests/interop/bundle_transformers.py (skipped otherwise): runs a bundle
// on inputs from a safetensors file (input_ids, attention_mask, pixel_values) and
// writes logits F32 [B,T,V] and `generated` I64 [B,n] (greedy, no EOS) to VLMOPT_RUNTIME_OUT.
TEST_CASE("bundle runtime driver") {
  const char* bundle_dir = std::getenv("VLMOPT_RUNTIME_BUNDLE");
  const char* inputs_path = std::getenv("VLMOPT_RUNTIME_INPUTS");
  const char* out_path = std::getenv("VLMOPT_RUNTIME_OUT");
  if (!bundle_dir || !inputs_path || !out_path) return;
  const char* kernels = std::getenv("VLMOPT_RUNTIME_KERNELS");
  const char* mp_cache = std::getenv("VLMOPT_RUNTIME_MP_CACHE");
  const char* new_tokens = std::getenv("VLMOPT_RUNTIME_NEW_TOKENS");
  runtime::RuntimeOptions ro;
  ro.kernels = runtime::parse_kernel_kind(kernels ? kernels : "fake");
  ro.use_mp_cache = !(mp_cache && std::string(mp_cache) == "0");
  auto loaded = runtime::load_bundle(bundle_dir, torch::kCPU, ro);
  const auto ref = io::Checkpoint::open(inputs_path);
  model::ForwardInputs in;
  in.input_ids = io::load_tensor(ref, "input_ids").to(torch::kLong);
  in.attention_mask = io::load_tensor(ref, "attention_mask").to(torch::kLong);
  in.pixel_values = io::load_tensor(ref, "pixel_values");
  const auto logits = loaded.model.forward(in).logits.to(torch::kFloat32).contiguous();
  const int n = new_tokens ? std::atoi(new_tokens) : 8;
  const auto tokens = loaded.model.generate_greedy(in, n, {});
  auto generated = torch::full({static_cast<int64_t>(tokens.size()), n}, -1, torch::kInt64);
  for (size_t b = 0; b < tokens.size(); ++b)
    for (size_t t = 0; t < tokens[b].size(); ++t) generated[static_cast<int64_t>(b)][static_cast<int64_t>(t)] = tokens[b][t];
  io::write_safetensors(out_path, {io::to_write("logits", logits), io::to_write("generated", generated)});
}
