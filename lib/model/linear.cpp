#include "model/linear.hpp"

#include "model/layers.hpp"
#include "util/error.hpp"

namespace vlmopt::model {

LinearKernel::~LinearKernel() = default;

LinearImpl::LinearImpl(std::string name, int64_t in_features, int64_t out_features, bool bias, Taps* taps,
                       const torch::TensorOptions& options)
    : name_(std::move(name)), input_tap_(name_ + ".input"), output_tap_(name_ + ".output"), taps_(taps) {
  weight = register_parameter("weight", torch::empty({out_features, in_features}, options), false);
  if (bias) this->bias = register_parameter("bias", torch::empty({out_features}, options), false);
}

void LinearImpl::share_weight(const torch::Tensor& shared) {
  VLMOPT_CHECK(shared.sizes() == weight.sizes(), "{}: tied weight shape {} != {}", name_,
               shape_string(shared.sizes()), shape_string(weight.sizes()));
  parameters_["weight"] = shared;
  weight = shared;
}

torch::Tensor LinearImpl::dense(const torch::Tensor& x) const {
  return torch::nn::functional::linear(x, weight, bias);
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x, const TapContext& context) {
  if (tap_wanted(taps_, input_tap_)) taps_->emit(input_tap_, x, context);
  torch::Tensor y = kernel ? kernel->forward(*this, x) : dense(x);
  if (tap_wanted(taps_, output_tap_)) taps_->emit(output_tap_, y, context);
  return y;
}

}  // namespace vlmopt::model
