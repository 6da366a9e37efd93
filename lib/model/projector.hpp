// The LLaVA multimodal projector: linear_2(act(linear_1(x))), registered as
// "multi_modal_projector" (canonical names model.multi_modal_projector.linear_{1,2}).
#pragma once

#include "model/layers.hpp"
#include "model/linear.hpp"
#include "model/taps.hpp"

#include <torch/torch.h>

#include <string>

namespace vlmopt::model {

class ProjectorImpl : public torch::nn::Module {
 public:
  ProjectorImpl(int64_t in_features, int64_t out_features, bool bias, const std::string& act, Taps* taps,
                const torch::TensorOptions& options);
  // [..., in] -> [..., out]; emits "model.multi_modal_projector.output".
  torch::Tensor forward(const torch::Tensor& features, const TapContext& context = {});
  Linear linear_1{nullptr}, linear_2{nullptr};

 private:
  Activation act_;
  Taps* taps_;
};
TORCH_MODULE(Projector);

}  // namespace vlmopt::model
