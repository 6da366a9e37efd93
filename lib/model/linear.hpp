// The one Linear layer of the model family: `y = x W^T + b` with taps on its
// input and output, and a pluggable kernel so the runtime can swap in
// fake-quant or int8 GEMMs without touching the model code.
#pragma once

#include "model/taps.hpp"

#include <torch/torch.h>

#include <memory>
#include <string>

namespace vlmopt::model {

class LinearImpl;

// Replaces the default `x W^T + b` of one Linear when set.
struct LinearKernel {
  virtual ~LinearKernel();
  virtual torch::Tensor forward(const LinearImpl& linear, const torch::Tensor& x) = 0;
};

class LinearImpl : public torch::nn::Module {
 public:
  // Parameters are allocated uninitialised (they are loaded or initialised later).
  // `name` is the canonical module name, e.g. "model.language_model.layers.0.self_attn.q_proj".
  LinearImpl(std::string name, int64_t in_features, int64_t out_features, bool bias, Taps* taps,
             const torch::TensorOptions& options);

  // x [..., in] -> [..., out]; emits "<name>.input" and "<name>.output" when wanted.
  torch::Tensor forward(const torch::Tensor& x, const TapContext& context = {});
  // The plain `x W^T + b` (what kernels fall back to).
  torch::Tensor dense(const torch::Tensor& x) const;

  const std::string& name() const { return name_; }
  int64_t in_features() const { return weight.size(1); }
  int64_t out_features() const { return weight.size(0); }
  bool has_bias() const { return bias.defined(); }
  // Makes `shared` this layer's weight (same storage, e.g. lm_head tied to
  // embed_tokens); the shape must match.
  void share_weight(const torch::Tensor& shared);

  torch::Tensor weight;  // [out, in]
  torch::Tensor bias;    // [out] or undefined
  std::shared_ptr<LinearKernel> kernel;  // null = dense()

 private:
  std::string name_;
  std::string input_tap_;
  std::string output_tap_;
  Taps* taps_;
};
TORCH_MODULE(Linear);

}  // namespace vlmopt::model
