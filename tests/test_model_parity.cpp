// Numerical parity of the native LLaVA model with HF transformers (eager, fp32)
// on every fixture variant under tests/fixtures (or
// $VLMOPT_FIXTURES_DIR_OVERRIDE): logits, image features, hidden states and
// greedy tokens, all computed by transformers (scripts/make_fixtures.py).
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
#include "model/llava.hpp"
#include "test_support.hpp"

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace vlmopt;

namespace {

constexpr double kTolerance = 1e-4;

fs::path parity_fixtures_root() {
  if (const char* override_dir = std::getenv("VLMOPT_FIXTURES_DIR_OVERRIDE"); override_dir && *override_dir) {
    return override_dir;
  }
  return vlmopt::testing::fixtures_dir();
}

std::vector<fs::path> parity_variants() {
  std::vector<fs::path> out;
  const auto root = parity_fixtures_root();
  if (!fs::is_directory(root)) return out;
  for (const auto& entry : fs::directory_iterator(root)) {
    if (entry.is_directory() && fs::exists(entry.path() / "reference.safetensors") &&
        fs::exists(entry.path() / "config.json")) {
      out.push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

double max_abs_diff(const torch::Tensor& got, const torch::Tensor& want) {
  REQUIRE_MESSAGE(got.sizes() == want.sizes(), "shape ", got.sizes(), " vs reference ", want.sizes());
  return (got.to(torch::kFloat64) - want.to(torch::kFloat64)).abs().max().item<double>();
}

struct Reference {
  std::shared_ptr<const io::SafetensorsFile> file;
  bool has(const std::string& name) const { return file->find(name) != nullptr; }
  torch::Tensor operator[](const std::string& name) const { return io::load_tensor(*file, file->at(name)); }
  std::string meta(const std::string& key) const {
    const auto it = file->metadata().find(key);
    return it == file->metadata().end() ? std::string() : it->second;
  }
};

}  // namespace

TEST_CASE("model parity: every fixture variant matches transformers") {
  const auto variants = parity_variants();
  REQUIRE_MESSAGE(!variants.empty(), "no fixture variants under ", parity_fixtures_root().string());
  for (const auto& dir : variants) {
    const std::string variant = dir.filename().string();
    CAPTURE(variant);
    const Reference ref{io::SafetensorsFile::open(dir / "reference.safetensors")};
    auto model = model::LlavaModel::load(dir, torch::kCPU, torch::kFloat32);
    CHECK(std::string(model::to_string(model.key_layout())) == ref.meta("layout"));

    model::ForwardInputs inputs;
    inputs.input_ids = ref["input_ids"];
    inputs.pixel_values = ref["pixel_values"];
    inputs.attention_mask = ref["attention_mask"];
    inputs.output_hidden_states = true;
    const auto out = model.forward(inputs);

    const double d_logits = max_abs_diff(out.logits, ref["logits"]);
    CHECK(d_logits <= kTolerance);
    const auto features = out.image_features.reshape({-1, out.image_features.size(-1)});
    const double d_features = max_abs_diff(features, ref["image_features"]);
    CHECK(d_features <= kTolerance);

    // Text hidden states: HF's tuple, the last one after the final norm.
    double d_text = 0.0;
    int text_states = 0;
    while (ref.has("text_hidden_states." + std::to_string(text_states))) ++text_states;
    REQUIRE(static_cast<int>(out.hidden_states.size()) == text_states);
    for (int k = 0; k < text_states; ++k) {
      CAPTURE(k);
      const double d = max_abs_diff(out.hidden_states[static_cast<size_t>(k)],
                                    ref["text_hidden_states." + std::to_string(k)]);
      CHECK(d <= kTolerance);
      d_text = std::max(d_text, d);
    }

    // Vision hidden states: only the ones LLaVA needs are computed.
    const auto vision_states = model.vision_hidden_states(ref["pixel_values"]);
    int all_vision_states = 0;
    while (ref.has("vision_hidden_states." + std::to_string(all_vision_states))) ++all_vision_states;
    REQUIRE(static_cast<int>(vision_states.size()) <= all_vision_states);
    double d_vision = 0.0;
    for (size_t k = 0; k < vision_states.size(); ++k) {
      CAPTURE(k);
      const double d = max_abs_diff(vision_states[k], ref["vision_hidden_states." + std::to_string(k)]);
      CHECK(d <= kTolerance);
      d_vision = std::max(d_vision, d);
    }

    // Greedy decoding with the KV cache reproduces generate().
    const auto generated_ref = ref["generated_ids"];
    const int64_t prompt_len = inputs.input_ids.size(1);
    const int max_new = static_cast<int>(generated_ref.size(1) - prompt_len);
    model::ForwardInputs prompt = inputs;
    prompt.output_hidden_states = false;
    const auto generated = model.generate_greedy(prompt, max_new, {});
    REQUIRE(generated.size() == static_cast<size_t>(generated_ref.size(0)));
    for (size_t b = 0; b < generated.size(); ++b) {
      const auto want = generated_ref[static_cast<int64_t>(b)].slice(0, prompt_len).contiguous();
      const std::vector<int64_t> want_ids(want.data_ptr<int64_t>(), want.data_ptr<int64_t>() + want.numel());
      CHECK(generated[b] == want_ids);
    }

    // The fused attention backend (SDPA where probabilities are not tapped) must hold the same bound.
    model.set_attention_backend(model::AttentionBackend::kFused);
    model::ForwardInputs plain = inputs;
    plain.output_hidden_states = false;
    const double d_fused = max_abs_diff(model.forward(plain).logits, ref["logits"]);
    CHECK(d_fused <= kTolerance);

    MESSAGE(variant, ": max |d| logits ", d_logits, ", image_features ", d_features, ", text hidden ", d_text,
            ", vision hidden (", vision_states.size(), " of ", all_vision_states, " computed) ", d_vision,
            ", fused-attention logits ", d_fused);
  }
}

TEST_CASE("model parity on CUDA (skipped without a GPU)") {
  if (!torch::cuda::is_available()) {
    MESSAGE("no CUDA device: skipped");
    return;
  }
  // cuDNN may run the patch convolution in TF32 by default; parity needs full fp32.
  const bool tf32_conv = at::globalContext().allowTF32CuDNN();
  at::globalContext().setAllowTF32CuDNN(false);
  for (const auto& dir : parity_variants()) {
    const std::string variant = dir.filename().string();
    CAPTURE(variant);
    const Reference ref{io::SafetensorsFile::open(dir / "reference.safetensors")};
    auto model = model::LlavaModel::load(dir, torch::Device(torch::kCUDA, 0), torch::kFloat32);
    model::ForwardInputs inputs;
    inputs.input_ids = ref["input_ids"];
    inputs.pixel_values = ref["pixel_values"];
    inputs.attention_mask = ref["attention_mask"];
    const auto out = model.forward(inputs);
    CHECK(out.logits.device().is_cuda());
    const double d_logits = max_abs_diff(out.logits.cpu(), ref["logits"]);
    CHECK(d_logits <= kTolerance);
    const auto generated_ref = ref["generated_ids"];
    const int64_t prompt_len = inputs.input_ids.size(1);
    const auto generated = model.generate_greedy(inputs, static_cast<int>(generated_ref.size(1) - prompt_len), {});
    for (size_t b = 0; b < generated.size(); ++b) {
      const auto want = generated_ref[static_cast<int64_t>(b)].slice(0, prompt_len).contiguous();
      CHECK(generated[b] == std::vector<int64_t>(want.data_ptr<int64_t>(), want.data_ptr<int64_t>() + want.numel()));
    }
    MESSAGE(variant, " on CUDA: max |d| logits ", d_logits);
  }
  at::globalContext().setAllowTF32CuDNN(tf32_conv);
}
