#include "model/projector.hpp"

namespace vlmopt::model {

namespace {
constexpr const char* kProjectorOutputTap = "model.multi_modal_projector.output";
}

ProjectorImpl::ProjectorImpl(int64_t in_features, int64_t out_features, bool bias, const std::string& act, Taps* taps,
                             const torch::TensorOptions& options)
    : act_(activation_by_name(act, "config.json: projector_hidden_act")), taps_(taps) {
  linear_1 = register_module(
      "linear_1", Linear("model.multi_modal_projector.linear_1", in_features, out_features, bias, taps, options));
  linear_2 = register_module(
      "linear_2", Linear("model.multi_modal_projector.linear_2", out_features, out_features, bias, taps, options));
}

torch::Tensor ProjectorImpl::forward(const torch::Tensor& features, const TapContext& context) {
  auto out = linear_2(act_(linear_1(features, context)), context);
  if (tap_wanted(taps_, kProjectorOutputTap)) taps_->emit(kProjectorOutputTap, out, context);
  return out;
}

}  // namespace vlmopt::model
