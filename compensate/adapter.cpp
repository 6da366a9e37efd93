#include "compensate/adapter.hpp"

#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
#include "util/error.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <cmath>

namespace vlmopt::compensate {

namespace fs = std::filesystem;

Placement parse_placement(const std::string& text) {
  if (text == "output") return Placement::kProjectorOutput;
  if (text == "input") return Placement::kProjectorInput;
  throw InputError(fmt::format("--placement: expected output or input, got '{}'", text));
}

std::string placement_name(Placement placement) {
  return placement == Placement::kProjectorOutput ? "output" : "input";
}

std::string fold_target(Placement placement) {
  return placement == Placement::kProjectorOutput ? "model.multi_modal_projector.linear_2"
                                                  : "model.multi_modal_projector.linear_1";
}

CompensatoryAdapterImpl::CompensatoryAdapterImpl(int64_t dim, int64_t rank, uint64_t seed, torch::Device device) {
  VLMOPT_CHECK_INPUT(dim > 0 && rank > 0 && rank <= dim, "--rank: expected 1..{} (the feature width), got {}", dim,
                     rank);
  // Values from one CPU generator: the same adapter on every device.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  auto d = at::normal(0.0, 1.0 / std::sqrt(static_cast<double>(dim)), {rank, dim}, generator, f32);
  auto u = at::normal(0.0, 1.0 / std::sqrt(static_cast<double>(rank)), {dim, rank}, generator, f32);
  down = register_parameter("down", d.to(device));
  up = register_parameter("up", u.to(device));
  gate = register_parameter("gate", torch::zeros({1}, f32.device(device)));
}

torch::Tensor CompensatoryAdapterImpl::forward(const torch::Tensor& x) {
  VLMOPT_CHECK(x.size(-1) == dim(), "adapter input width: expected {}, got {}", dim(), x.size(-1));
  const auto xf = x.to(torch::kFloat32);
  const auto delta = torch::matmul(torch::matmul(xf, down.t()), up.t());  // [..., dim]
  return (xf + gate * delta).to(x.scalar_type());
}

torch::Tensor CompensatoryAdapterImpl::matrix() const {
  const auto u = up.detach().to(torch::kFloat64), d = down.detach().to(torch::kFloat64);
  const auto g = gate.detach().to(torch::kFloat64);
  return torch::eye(dim(), u.options()) + g * torch::matmul(u, d);
}

FoldedLinear fold(const CompensatoryAdapterImpl& adapter, Placement placement, const torch::Tensor& weight,
                  const torch::Tensor& bias) {
  VLMOPT_CHECK(weight.dim() == 2, "fold: weight must be 2-D, got {} dims", weight.dim());
  const auto m = adapter.matrix().to(weight.device());
  const auto w = weight.detach().to(torch::kFloat64);
  FoldedLinear out;
  if (placement == Placement::kProjectorOutput) {
    VLMOPT_CHECK_INPUT(weight.size(0) == adapter.dim(), "fold into {}: expected {} output features, got {}",
                       fold_target(placement), adapter.dim(), weight.size(0));
    out.weight = torch::matmul(m, w).to(weight.scalar_type());
    if (bias.defined()) out.bias = torch::matmul(m, bias.detach().to(torch::kFloat64)).to(bias.scalar_type());
  } else {
    VLMOPT_CHECK_INPUT(weight.size(1) == adapter.dim(), "fold into {}: expected {} input features, got {}",
                       fold_target(placement), adapter.dim(), weight.size(1));
    out.weight = torch::matmul(w, m).to(weight.scalar_type());
    if (bias.defined()) out.bias = bias.detach().clone();
  }
  return out;
}

void save_adapter(const fs::path& path, const CompensatoryAdapterImpl& adapter, Placement placement) {
  const auto d = adapter.down.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  const auto u = adapter.up.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  const auto g = adapter.gate.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  std::vector<io::TensorToWrite> tensors{io::to_write("down.weight", d), io::to_write("up.weight", u),
                                         io::to_write("gate", g)};
  io::write_safetensors(path, std::move(tensors),
                        {{"format", "pt"},
                         {"vlmopt", "compensatory-adapter"},
                         {"placement", placement_name(placement)},
                         {"folded_into", fold_target(placement)}});
}

LoadedAdapter load_adapter(const fs::path& path) {
  const auto file = io::SafetensorsFile::open(path);
  const auto& meta = file->metadata();
  const auto kind = meta.find("vlmopt");
  if (kind == meta.end() || kind->second != "compensatory-adapter")
    throw_file_error(path, "metadata 'vlmopt': expected compensatory-adapter, got '{}'",
                     kind == meta.end() ? "" : kind->second);
  const auto placement_it = meta.find("placement");
  if (placement_it == meta.end()) throw_file_error(path, "metadata 'placement': expected output or input, got nothing");
  LoadedAdapter out;
  out.placement = parse_placement(placement_it->second);
  const auto& d = file->at("down.weight");
  const auto& u = file->at("up.weight");
  const auto& g = file->at("gate");
  for (const auto* info : {&d, &u, &g})
    if (info->dtype != io::DType::kF32) throw_file_error(path, "tensor '{}': expected F32", info->name);
  if (d.shape.size() != 2 || u.shape.size() != 2 || g.shape != std::vector<int64_t>{1} || d.shape[0] <= 0 ||
      d.shape[1] <= 0 || u.shape[0] != d.shape[1] || u.shape[1] != d.shape[0])
    throw_file_error(path, "tensors: expected down.weight [r,d], up.weight [d,r], gate [1], got {}x{}, {}x{}, {} values",
                     d.shape.size() > 0 ? d.shape[0] : -1, d.shape.size() > 1 ? d.shape[1] : -1,
                     u.shape.size() > 0 ? u.shape[0] : -1, u.shape.size() > 1 ? u.shape[1] : -1, g.shape.size());
  out.adapter = CompensatoryAdapter(d.shape[1], d.shape[0], 0);
  torch::NoGradGuard no_grad;
  out.adapter->down.copy_(io::load_tensor(*file, d));
  out.adapter->up.copy_(io::load_tensor(*file, u));
  out.adapter->gate.copy_(io::load_tensor(*file, g));
  return out;
}

}  // namespace vlmopt::compensate
