// Shared by the bundle/runtime tests: temp dirs and a min-max QuantPlan built
// with plain torch (independent of calibrate), from a fixture's reference inputs.
#pragma once

#include "test_support.hpp"
#include "bundle/manifest.hpp"
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
#include "model/llava.hpp"
#include "quant/scheme.hpp"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>

namespace vlmopt::bundle {
// doctest prints FileEntry vectors in failed comparisons.
inline std::ostream& operator<<(std::ostream& os, const FileEntry& e) {
  return os << e.path << " (" << e.size << " bytes, " << e.sha256 << ")";
}
}  // namespace vlmopt::bundle

namespace vlmopt::testing {

namespace fs = std::filesystem;

inline quant::Scheme make_scheme(quant::SchemeKind kind, int64_t group_size = 32) {
  quant::Scheme s;
  s.kind = kind;
  s.weights.num_bits = kind == quant::SchemeKind::kW4A16 ? 4 : 8;
  s.weights.type = kind == quant::SchemeKind::kFP8 ? quant::QuantType::kFloat : quant::QuantType::kInt;
  s.weights.strategy = kind == quant::SchemeKind::kW4A16 ? quant::Strategy::kGroup : quant::Strategy::kChannel;
  s.weights.group_size = kind == quant::SchemeKind::kW4A16 ? group_size : 0;
  if (kind == quant::SchemeKind::kW8A8 || kind == quant::SchemeKind::kFP8) {
    quant::QuantArgs a;
    a.type = s.weights.type;
    a.strategy = quant::Strategy::kTensor;
    s.input_activations = a;
  }
  return s;
}

// The fixture's reference inputs (input_ids, attention_mask, pixel_values).
inline model::ForwardInputs reference_inputs(const fs::path& dir) {
  const auto ref = io::Checkpoint::open(dir / "reference.safetensors");
  model::ForwardInputs in;
  in.input_ids = io::load_tensor(ref, "input_ids").to(torch::kLong);
  in.attention_mask = io::load_tensor(ref, "attention_mask").to(torch::kLong);
  in.pixel_values = io::load_tensor(ref, "pixel_values");
  return in;
}

struct PlanOptions {
  quant::SchemeKind kind = quant::SchemeKind::kW8A8;
  int outliers_per_layer = 0;  // input channels with the largest range marked as FP16 outliers
  // Quantize only decoder Linears whose input width divides by this (w4a16 groups); 0 = all.
  int64_t in_multiple = 0;
};

// Decoder Linears quantized; vision tower, projector and lm_head ignored. Weights:
// per-channel (or per-group) symmetric min-max, scale = amax / (qmax + 0.5) as
// compressed-tensors (amax / 127.5 for int8). Inputs: amax of the fixture's reference
// forward over all channels, and over the non-outlier ones for `input`.
inline quant::QuantPlan minmax_plan(const fs::path& dir, const PlanOptions& options = {}) {
  auto model = model::LlavaModel::load(dir, torch::kCPU);
  std::map<std::string, torch::Tensor> input_amax;  // per input channel
  const int id = model.taps().subscribe("model.language_model.*", [&](std::string_view name, const torch::Tensor& x,
                                                                       const model::TapContext&) {
    if (!name.ends_with(".input")) return;
    const auto amax = x.detach().abs().reshape({-1, x.size(-1)}).amax(0);
    auto& slot = input_amax[std::string(name.substr(0, name.size() - 6))];
    slot = slot.defined() ? torch::maximum(slot, amax) : amax;
  });
  model.forward(reference_inputs(dir));
  model.taps().unsubscribe(id);

  quant::QuantPlan plan;
  plan.scheme = make_scheme(options.kind);
  const double wq = plan.scheme.weights.type == quant::QuantType::kFloat ? 448.0
                                                                          : (1 << (plan.scheme.weights.num_bits - 1)) - 0.5;
  for (auto& [name, linear] : model.linears()) {
    const bool decoder = name.starts_with("model.language_model.");
    if (!decoder || (options.in_multiple > 0 && linear->in_features() % options.in_multiple != 0)) {
      plan.ignore.push_back(name);
      continue;
    }
    quant::LinearQuant lq;
    lq.name = name;
    const auto w = linear->weight.detach();
    if (plan.scheme.weights.strategy == quant::Strategy::kGroup) {
      const auto g = plan.scheme.weights.group_size;
      lq.weight.scale = w.reshape({w.size(0), -1, g}).abs().amax(-1) / wq;
    } else {
      lq.weight.scale = w.abs().amax(1, /*keepdim=*/true) / wq;
    }
    lq.weight.zero_point = torch::zeros_like(lq.weight.scale, torch::kInt32);
    const auto amax = input_amax.at(name);
    auto outliers = torch::zeros({linear->in_features()}, torch::kBool);
    if (options.outliers_per_layer > 0)
      outliers.index_fill_(0, std::get<1>(amax.topk(options.outliers_per_layer)), true);
    lq.outlier_channels = outliers;
    if (plan.scheme.input_activations) {
      const double aq = plan.scheme.input_activations->type == quant::QuantType::kFloat ? 448.0 : 127.5;
      const auto all = (amax.max() / aq).reshape({1});
      const auto inl = (amax.masked_fill(outliers, 0).max() / aq).reshape({1});
      lq.input_all_channels = quant::QParams{all, torch::zeros({1}, torch::kInt32)};
      lq.input = quant::QParams{inl, torch::zeros({1}, torch::kInt32)};
    }
    const auto layer_end = name.find(".", name.find("layers.") + 7);
    const auto layer_prefix = name.substr(0, layer_end);
    if (name.ends_with("q_proj") || name.ends_with("k_proj") || name.ends_with("v_proj")) lq.fused_group = layer_prefix + ".qkv";
    if (name.ends_with("gate_proj") || name.ends_with("up_proj")) lq.fused_group = layer_prefix + ".gate_up";
    plan.layers.push_back(std::move(lq));
  }
  return plan;
}

}  // namespace vlmopt::testing
