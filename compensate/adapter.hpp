// The compensatory adapter (design.md §6, docs/compensate.md): a gated low-rank
// residual map y = x + gate * up(down(x)) on the visual features, and its exact
// fold into the neighbouring projector Linear.
//
// Because the adapter is linear, y = M x with M = I + gate * U D
// (U = up.weight [dim, rank], D = down.weight [rank, dim]):
//   after the projector  (Placement::kProjectorOutput, x = linear_2 output):
//     M (W2 h + b2) = (M W2) h + M b2        -> linear_2: W' = M W2, b' = M b2
//   before the projector (Placement::kProjectorInput, x = vision features):
//     W1 (M x) + b1 = (W1 M) x + b1          -> linear_1: W' = W1 M, b' = b1
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <string>

namespace vlmopt::compensate {

enum class Placement {
  kProjectorOutput,  // on the projector output [images, N, D_text]; folds into linear_2
  kProjectorInput,   // on the selected vision features [images, N, D_vision]; folds into linear_1
};
Placement parse_placement(const std::string& text);  // "output" | "input"; InputError otherwise
std::string placement_name(Placement placement);    // "output" | "input"
// Canonical name of the projector Linear the adapter folds into.
std::string fold_target(Placement placement);

class CompensatoryAdapterImpl : public torch::nn::Module {
 public:
  // down ~ N(0, 1/dim), up ~ N(0, 1/rank) (so up(down(x)) has x's scale), gate = 0:
  // the identity at start. Both factors are random because with up = 0 and gate = 0
  // every gradient would be zero. Deterministic in `seed`; parameters in float32.
  CompensatoryAdapterImpl(int64_t dim, int64_t rank, uint64_t seed, torch::Device device = torch::kCPU);
  // [..., dim] -> [..., dim], in x's dtype.
  torch::Tensor forward(const torch::Tensor& x);
  // M = I + gate * U D, [dim, dim] float64 (the adapter as one matrix).
  torch::Tensor matrix() const;
  int64_t dim() const { return down.size(1); }
  int64_t rank() const { return down.size(0); }

  // Module parameters "down", "up", "gate"; in adapter.safetensors "down.weight", "up.weight", "gate".
  torch::Tensor down;  // [rank, dim]
  torch::Tensor up;    // [dim, rank]
  torch::Tensor gate;  // [1]
};
TORCH_MODULE(CompensatoryAdapter);

struct FoldedLinear {
  torch::Tensor weight;  // [out, in], the dtype of the weight given
  torch::Tensor bias;    // [out] or undefined when the Linear has none
};
// The projector Linear (fold_target(placement)) with the adapter folded in, computed
// in float64. kProjectorOutput needs weight [dim, *]; kProjectorInput weight [*, dim].
FoldedLinear fold(const CompensatoryAdapterImpl& adapter, Placement placement, const torch::Tensor& weight,
                  const torch::Tensor& bias);

// vlmopt/adapter.safetensors: "down.weight", "up.weight", "gate" (F32) and metadata
// {"format": "pt", "vlmopt": "compensatory-adapter", "placement": "output"|"input",
//  "folded_into": <canonical Linear name>}. Written atomically.
void save_adapter(const std::filesystem::path& path, const CompensatoryAdapterImpl& adapter, Placement placement);
struct LoadedAdapter {
  CompensatoryAdapter adapter{nullptr};
  Placement placement = Placement::kProjectorOutput;
};
// Validates names, dtypes, shapes and metadata before building the module; InputError otherwise.
LoadedAdapter load_adapter(const std::filesystem::path& path);

}  // namespace vlmopt::compensate
