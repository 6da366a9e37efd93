#include "model/layers.hpp"

#include "util/error.hpp"

#include <cmath>
#include <limits>

namespace vlmopt::model {

namespace {

template <typename Range>
std::string join_shape(const Range& shape) {
  std::string out = "[";
  bool first = true;
  for (const int64_t d : shape) {
    if (!first) out += ',';
    out += std::to_string(d);
    first = false;
  }
  return out + "]";
}

torch::Tensor gelu_erf(const torch::Tensor& x) { return torch::gelu(x); }
torch::Tensor gelu_tanh(const torch::Tensor& x) { return torch::gelu(x, "tanh"); }
// HF NewGELUActivation, spelled out (not bit-identical to the fused tanh kernel).
torch::Tensor gelu_new(const torch::Tensor& x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + torch::tanh(k * (x + 0.044715 * torch::pow(x, 3.0))));
}
torch::Tensor quick_gelu(const torch::Tensor& x) { return x * torch::sigmoid(1.702 * x); }
torch::Tensor silu(const torch::Tensor& x) { return torch::silu(x); }
torch::Tensor relu(const torch::Tensor& x) { return torch::relu(x); }

}  // namespace

std::string shape_string(c10::IntArrayRef shape) { return join_shape(shape); }
std::string shape_string(std::span<const int64_t> shape) { return join_shape(shape); }

Activation activation_by_name(std::string_view name, std::string_view where) {
  if (name == "gelu") return gelu_erf;
  if (name == "gelu_pytorch_tanh") return gelu_tanh;
  if (name == "gelu_new") return gelu_new;
  if (name == "quick_gelu") return quick_gelu;
  if (name == "silu" || name == "swish") return silu;
  if (name == "relu") return relu;
  throw InputError(fmt::format("{}: unsupported activation (expected one of gelu, gelu_pytorch_tanh, gelu_new, "
                               "quick_gelu, silu, relu; got '{}')",
                               where, name));
}

LayerNormImpl::LayerNormImpl(int64_t dim, double eps, const torch::TensorOptions& options) : eps(eps) {
  weight = register_parameter("weight", torch::empty({dim}, options), false);
  bias = register_parameter("bias", torch::empty({dim}, options), false);
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) const {
  return torch::layer_norm(x, {weight.size(0)}, weight, bias, eps);
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, const torch::TensorOptions& options) : eps(eps) {
  weight = register_parameter("weight", torch::empty({dim}, options), false);
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) const {
  const auto x32 = x.to(torch::kFloat32);
  const auto variance = x32.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (x32 * torch::rsqrt(variance + eps)).to(x.scalar_type());
}

EmbeddingImpl::EmbeddingImpl(int64_t count, int64_t dim, const torch::TensorOptions& options) {
  weight = register_parameter("weight", torch::empty({count, dim}, options), false);
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) const { return torch::embedding(weight, ids); }

double mask_min_value(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32: return std::numeric_limits<float>::lowest();
    case torch::kFloat64: return std::numeric_limits<double>::lowest();
    case torch::kFloat16: return -65504.0;
    case torch::kBFloat16: return -3.3895313892515355e38;  // finfo(bfloat16).min
    default: VLMOPT_CHECK(false, "no attention mask value for dtype {}", c10::toString(dtype));
  }
  return 0.0;
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& mask, double scale, bool fused, const Taps* taps,
                        const std::string& probs_tap, const TapContext& context) {
  const int64_t batch = q.size(0), heads = q.size(1), q_len = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = k.size(1);
  VLMOPT_CHECK(heads % kv_heads == 0, "query heads {} not a multiple of kv heads {}", heads, kv_heads);
  const bool want_probs = tap_wanted(taps, probs_tap);

  torch::Tensor out;  // [B,H,Tq,d]
  if (fused && !want_probs) {
    std::optional<torch::Tensor> bias;
    if (mask.defined()) bias = mask;
    out = at::scaled_dot_product_attention(q, k, v, bias, 0.0, false, scale, /*enable_gqa=*/heads != kv_heads);
  } else {
    torch::Tensor keys = k, values = v;
    if (heads != kv_heads) {
      // [B,Hkv,T,d] -> [B,Hkv,rep,T,d] -> [B,H,T,d]: kv head j serves query heads j*rep .. j*rep+rep-1.
      const int64_t rep = heads / kv_heads;
      const auto expand = [&](const torch::Tensor& t) {
        return t.unsqueeze(2).expand({batch, kv_heads, rep, t.size(2), head_dim}).reshape(
            {batch, heads, t.size(2), head_dim});
      };
      keys = expand(k);
      values = expand(v);
    }
    auto scores = torch::matmul(q, keys.transpose(2, 3)) * scale;
    if (mask.defined()) scores = scores + mask;
    const auto probs = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
    if (want_probs) taps->emit(probs_tap, probs, context);
    out = torch::matmul(probs, values);
  }
  return out.transpose(1, 2).contiguous().reshape({batch, q_len, heads * head_dim});
}

}  // namespace vlmopt::model
