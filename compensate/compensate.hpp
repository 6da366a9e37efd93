// `vlmopt compensate` (design.md §6, docs/compensate.md): trains a compensatory
// adapter with the quantized bundle as student and the original model as
// teacher, folds it into the bundle's projector and records it in the bundle.
//
// Loss of one batch of B samples (docs/compensate.md gives the derivation):
//   d_i = mean over features f of ||s_f,i - t_f,i||^2 / ||t_f,i||^2
//         features: the projector output [N, D] (adapter applied) and the decoder hidden
//         states at `feature_layers` over the sample's real (non-padding) tokens
//   w_i = softmax_i(-H_i / tau)   (= exp(-H_i/tau) normalised over the batch; tau = inf: 1/B)
//         H_i = the teacher's text->visual attention entropy in nats: for every decoder layer
//         and head, each text row of the prompt that can see the image (after the first image
//         token) attends to the visual tokens; that distribution renormalised over the visual
//         tokens has an entropy; H_i is its mean over rows, heads and layers
//   G_i = mean over probes u of ||J_s^T u - J_t^T u||^2 / ||J_t^T u||^2
//         J = d(last hidden state, after the final norm) / d(features at the adapter's place)
//         (the student's through its straight-through fake-quant: the gradient it really
//         propagates); u ~ N(0, I) on the sample's real tokens, unit norm. J^T u is the
//         gradient of <h, u> (reverse mode; the student's with create_graph, so the loss
//         backpropagates through it: double backward). E_u ||A^T u||^2 = ||A||_F^2 / dim,
//         the same Hutchinson estimate of ||J_s - J_t||_F^2 as with J v.
//   L = sum_i w_i d_i + gamma * mean_i G_i
#pragma once

#include "compensate/adapter.hpp"
#include "eval/session.hpp"
#include "model/llava.hpp"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

namespace vlmopt::compensate {

struct LossOptions {
  double gamma = 0.1;  // weight of the gradient-flow term G; 0 = off (no extra forwards)
  double tau = 0.5;    // entropy temperature in nats; +inf = uniform sample weights
  // Decoder hidden states compared, transformers' hidden_states indices: 0 = decoder input,
  // k = output of layer k-1, the last (-1) = after the final norm. Negative counts from the end.
  std::vector<int64_t> feature_layers = {-1};
  bool projector_feature = true;  // include the (adapted) projector output in d_i
  // Positions of the decoder hidden states compared: all real tokens, or only the text
  // tokens after the image (the query rows that produce the answer). The visual
  // positions are ~90 % of a LLaVA sequence, so "all" mostly matches the visual tokens.
  bool text_tokens_only = true;
  int64_t probes = 1;             // random directions per step for G
};

struct TrainOptions {
  Placement placement = Placement::kProjectorOutput;
  int64_t rank = 8;
  LossOptions loss;
  int64_t steps = 100;   // optimizer steps; batches are visited in order, cyclically
  double lr = 5e-4;      // Adam; 2e-3 made the loss rise on builtin (docs/compensate.md)
  double clip_grad_norm = 1.0;  // <= 0: no clipping
  uint64_t seed = 0;     // adapter init and probe directions
  int64_t max_nan_steps = 5;  // abort (vlmopt::Error) when this many steps had a non-finite loss or gradient
  // Keep the adapter only if it lowered the mean loss on the training batches (fixed
  // probes); otherwise the gate is reset to 0 (the identity) and the report says so.
  bool keep_only_if_better = true;
  nlohmann::json to_json() const;
};

struct LossValue {
  double total = 0.0, perceptual = 0.0, gradflow = 0.0;
  nlohmann::json to_json() const;
};

struct CurvePoint {
  int64_t step = 0;
  bool skipped = false;  // non-finite loss or gradient: no update
  LossValue loss;
};

struct TrainResult {
  CompensatoryAdapter adapter{nullptr};
  std::vector<CurvePoint> curve;  // one point per step
  int64_t nan_steps = 0;
  // Mean loss over all batches with fixed probe directions, before training (gate 0:
  // the quantized model as is) and after; batches with a non-finite loss are left out.
  LossValue before, after;
  bool accepted = true;  // false: training did not lower the loss and the adapter was reset to the identity
  double seconds = 0.0;
};

// Trains an adapter on `batches` (left-padded, one image per sample). Both models'
// parameters are frozen (requires_grad off). `student` should run fake-quant kernels with
// runtime::RuntimeOptions::straight_through so gradients pass its quantized Linears.
TrainResult train_adapter(model::LlavaModel& teacher, model::LlavaModel& student,
                          const std::vector<eval::PreparedBatch>& batches, const TrainOptions& options);

// A whole forward pass with `adapter` (may be null: none) applied at `placement`.
struct AdaptedForward {
  torch::Tensor image_features;               // [B, N, D_text] what the decoder receives
  std::vector<torch::Tensor> hidden_states;   // transformers' convention (last after the final norm)
  torch::Tensor logits;                       // [B, T, V]
};
AdaptedForward forward_with_adapter(model::LlavaModel& model, const eval::PreparedBatch& batch,
                                    CompensatoryAdapterImpl* adapter, Placement placement);

struct CompensateOptions {
  std::string model = "builtin";       // the original (teacher) model: HF directory or "builtin"
  std::filesystem::path bundle;        // calibrated bundle, updated in place (atomically)
  std::string data = "builtin:calib";  // calibration data only (evaluation splits are refused)
  int64_t samples = 128;               // the first N samples; 0 = all
  int64_t batch_size = 8;
  std::string device = "cpu";
  TrainOptions train;
  nlohmann::json to_json() const;  // echoed at start-up and recorded in the manifest
};

// Trains on the data, writes vlmopt/adapter.safetensors and vlmopt/reports/compensation.json,
// folds the adapter into the bundle's projector Linear (which must be unquantized) and
// updates the manifest, all through bundle::update_bundle. Returns the report.
nlohmann::json compensate(const CompensateOptions& options);

}  // namespace vlmopt::compensate
