#include "runtime/runtime.hpp"

#include "bundle/ct_codec.hpp"
#include "bundle/export.hpp"
#include "io/hf_config.hpp"
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
#include "model/weights.hpp"
#include "quant/mp_cache.hpp"
#include "util/error.hpp"

#include <spdlog/spdlog.h>

#include <map>
#include <optional>
#include <set>

namespace vlmopt::runtime {

namespace fs = std::filesystem;
namespace ct = bundle::ct;

KernelKind parse_kernel_kind(const std::string& text) {
  if (text == "fake") return KernelKind::kFakeQuant;
  if (text == "int8") return KernelKind::kInt8;
  throw InputError(fmt::format("--kernels: expected fake or int8, got '{}'", text));
}

namespace {

struct WeightFormat {
  std::string format;  // int-quantized | pack-quantized | float-quantized
  quant::QuantArgs weights;
  std::optional<quant::QuantArgs> inputs;  // static per-tensor inputs only
};

quant::QuantArgs parse_args(const nlohmann::json& j, const std::string& where) {
  quant::QuantArgs a;
  VLMOPT_CHECK_INPUT(j.is_object() && j.value("num_bits", 0) > 0, "{}: expected quantization args, got {}", where, j.dump());
  a.num_bits = j.value("num_bits", 8);
  a.type = j.value("type", std::string("int")) == "float" ? quant::QuantType::kFloat : quant::QuantType::kInt;
  a.symmetric = j.value("symmetric", true);
  const auto strategy = j.value("strategy", std::string("tensor"));
  a.strategy = strategy == "channel" ? quant::Strategy::kChannel
               : strategy == "group" ? quant::Strategy::kGroup
                                     : quant::Strategy::kTensor;
  a.group_size = j["group_size"].is_number_integer() ? j["group_size"].get<int64_t>() : 0;
  a.dynamic = j.value("dynamic", false);
  VLMOPT_CHECK_INPUT(a.symmetric, "{}: expected symmetric, got asymmetric (not supported)", where);
  return a;
}

WeightFormat read_format(const nlohmann::json& config, const fs::path& config_path) {
  const std::string where = config_path.string() + ": quantization_config";
  VLMOPT_CHECK_INPUT(config.contains("quantization_config") && config["quantization_config"].is_object(),
                     "{}: expected an object, got nothing", where);
  const auto& q = config["quantization_config"];
  VLMOPT_CHECK_INPUT(q.value("quant_method", "") == "compressed-tensors", "{}.quant_method: expected compressed-tensors",
                     where);
  const auto& groups = q.value("config_groups", nlohmann::json());
  VLMOPT_CHECK_INPUT(groups.is_object() && groups.size() == 1, "{}.config_groups: expected one group", where);
  const auto& group = groups.front();  // the one group's value (front() of an object)
  WeightFormat f;
  f.format = q.value("format", "");
  f.weights = parse_args(group.value("weights", nlohmann::json()), where + ".weights");
  const auto inputs = group.value("input_activations", nlohmann::json());
  if (!inputs.is_null()) {
    auto a = parse_args(inputs, where + ".input_activations");
    if (!a.dynamic) f.inputs = a;  // dynamic inputs: not produced by vlmopt; run unquantized inputs
  }
  return f;
}

// The bundle's checkpoint seen as plain floating weights: quantized Linear weights
// are dequantized on load, the scale tensors are hidden from the model loader.
class BundleSource : public model::TensorSource {
 public:
  BundleSource(io::Checkpoint ckpt, WeightFormat format) : ckpt_(std::move(ckpt)), plain_(ckpt_), format_(std::move(format)) {
    for (const auto& name : ckpt_.names()) {
      if (name.ends_with(".weight_scale")) quantized_.insert(name.substr(0, name.size() - 13));
    }
    for (const auto& name : ckpt_.names()) {
      if (name.ends_with(".weight_scale") || name.ends_with(".input_scale") || name.ends_with(".weight_shape") ||
          name.ends_with("_zero_point"))
        continue;
      if (name.ends_with(".weight_packed")) {
        names_.push_back(name.substr(0, name.size() - 7));  // "<L>.weight"
        continue;
      }
      names_.push_back(name);
    }
    std::sort(names_.begin(), names_.end());
  }
  std::vector<std::string> names() const override { return names_; }
  Meta meta(std::string_view name) const override {
    const auto layer = quantized_layer(name);
    if (!layer) return plain_.meta(name);
    return Meta{weight_shape(*layer), true, "quantized"};
  }
  torch::Tensor load(std::string_view name) const override {
    const auto layer = quantized_layer(name);
    if (!layer) return plain_.load(name);
    return ct::dequantize(quantized_values(*layer), io::load_tensor(ckpt_, *layer + ".weight_scale"));
  }
  std::string describe() const override { return ckpt_.dir().string(); }

  const std::set<std::string>& quantized() const { return quantized_; }
  const io::Checkpoint& checkpoint() const { return ckpt_; }
  // Stored values of a quantized weight: int8 (also unpacked int4) or float8 [out,in].
  torch::Tensor quantized_values(const std::string& layer) const {
    if (format_.format == "pack-quantized") {
      const auto shape = weight_shape(layer);
      return ct::unpack(io::load_tensor(ckpt_, layer + ".weight_packed"), format_.weights.num_bits, shape[1]);
    }
    return io::load_tensor(ckpt_, layer + ".weight");
  }

 private:
  std::optional<std::string> quantized_layer(std::string_view name) const {
    if (!name.ends_with(".weight")) return std::nullopt;
    std::string layer(name.substr(0, name.size() - 7));
    if (!quantized_.contains(layer)) return std::nullopt;
    return layer;
  }
  std::vector<int64_t> weight_shape(const std::string& layer) const {
    if (format_.format == "pack-quantized") {
      const auto s = io::load_tensor(ckpt_, layer + ".weight_shape");
      VLMOPT_CHECK_INPUT(s.numel() == 2, "{}: tensor '{}.weight_shape': expected 2 values", describe(), layer);
      return {s[0].item<int64_t>(), s[1].item<int64_t>()};
    }
    return ckpt_.locate(layer + ".weight").second->shape;
  }

  io::Checkpoint ckpt_;
  model::CheckpointSource plain_;
  WeightFormat format_;
  std::set<std::string> quantized_;
  std::vector<std::string> names_;
};

// int8 [M,K] x int8 [K,N] -> int32 [M,N]. CUDA's _int_mm needs M > 16 and K, N
// multiples of 8: pad with zeros there (zeros add nothing to the sums).
torch::Tensor int8_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.is_cuda()) return at::_int_mm(a, b);
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const auto round8 = [](int64_t v) { return (v + 7) / 8 * 8; };
  const int64_t mp = std::max<int64_t>(m, 17), kp = round8(k), np = round8(n);
  const auto ap = torch::constant_pad_nd(a, {0, kp - k, 0, mp - m}, 0);
  const auto bp = torch::constant_pad_nd(b, {0, np - n, 0, kp - k}, 0);
  return at::_int_mm(ap, bp).slice(0, 0, m).slice(1, 0, n);
}

class QuantizedLinearKernel : public model::LinearKernel {
 public:
  KernelKind kind = KernelKind::kFakeQuant;
  bool straight_through = false;  // RuntimeOptions::straight_through
  quant::QuantArgs input_args;
  std::optional<double> input_scale;  // static per-tensor input scale; nullopt: inputs not quantized
  torch::Tensor q_weight_t;           // int8 [in,out] (kInt8)
  torch::Tensor weight_scale_row;     // float32 [1,out] or [1,1] (kInt8)
  torch::Tensor inlier_weight;        // dequantized weight with outlier columns zeroed (fake path, outliers)
  torch::Tensor inlier_mask;          // [in] 1 for quantized channels, 0 for outliers; undefined: no outliers
  torch::Tensor outlier_channels;     // int64 [n]
  torch::Tensor outlier_weight;       // f16 [out,n]

  torch::Tensor forward(const model::LinearImpl& linear, const torch::Tensor& x) override {
    const bool outliers = inlier_mask.defined();
    const auto x_in = outliers ? x * inlier_mask.to(x.scalar_type()) : x;
    torch::Tensor y;
    if (kind == KernelKind::kInt8 && input_scale) {
      const auto s = *input_scale;
      const auto flat = x_in.reshape({-1, x_in.size(-1)});
      const auto xq = (flat.to(torch::kFloat32) / s).clamp(ct::qmin(input_args), ct::qmax(input_args)).round().to(torch::kInt8);
      const auto acc = int8_matmul(xq, q_weight_t);
      y = acc.to(torch::kFloat32) * (weight_scale_row * s);
      if (linear.has_bias()) y = y + linear.bias.to(torch::kFloat32);
      auto shape = x.sizes().vec();
      shape.back() = y.size(-1);
      y = y.reshape(shape).to(x.scalar_type());
    } else {
      auto xq = input_scale ? ct::fake_quantize(x_in, *input_scale, input_args) : x_in;
      // fq + (x - x) is fq exactly in value; its gradient w.r.t. x is the identity.
      if (straight_through && input_scale && x_in.requires_grad()) xq = xq.detach() + (x_in - x_in.detach());
      y = torch::nn::functional::linear(xq, outliers ? inlier_weight : linear.weight, linear.bias);
    }
    if (outliers) {
      // FP16 operands, fp32 accumulation (what a GPU half GEMM does).
      const auto xo = x.index_select(-1, outlier_channels).to(torch::kFloat16).to(torch::kFloat32);
      y = y + torch::matmul(xo, outlier_weight.to(torch::kFloat32).t()).to(y.scalar_type());
    }
    return y;
  }
};

}  // namespace

LoadedBundle load_bundle(const fs::path& bundle, torch::Device device, const RuntimeOptions& options) {
  auto manifest = bundle::read_manifest(bundle);
  const auto config_path = bundle / "config.json";
  const auto config_json = io::load_json_file(config_path);
  const auto format = read_format(config_json, config_path);
  VLMOPT_CHECK_INPUT(format.format == "int-quantized" || format.format == "pack-quantized" ||
                         format.format == "float-quantized",
                     "{}: quantization_config.format: expected int-quantized, pack-quantized or float-quantized, got '{}'",
                     config_path.string(), format.format);
  if (options.kernels == KernelKind::kInt8)
    VLMOPT_CHECK_INPUT(format.weights.type == quant::QuantType::kInt,
                       "--kernels int8: the bundle's {} weights have no int8 path (use --kernels fake)", format.format);
  const auto config = io::parse_llava_config(config_json, config_path.string());
  BundleSource source(io::Checkpoint::open(bundle), format);
  auto model = model::LlavaModel::load(config, source, device, options.dtype);

  // MP-Cache activation parameters and FP16 outlier columns, used only with use_mp_cache.
  std::optional<quant::MpCache> mp_cache;
  std::shared_ptr<const io::SafetensorsFile> outliers;
  if (options.use_mp_cache && fs::exists(bundle / bundle::kMpCachePath)) {
    mp_cache = quant::read_mp_cache(bundle / bundle::kMpCachePath);
    if (fs::exists(bundle / bundle::kOutliersPath)) outliers = io::SafetensorsFile::open(bundle / bundle::kOutliersPath);
  }

  LoadedBundle out{bundle, std::move(model), std::move(manifest), format.format, {}, {}};
  std::set<std::string> remaining = source.quantized();
  torch::NoGradGuard no_grad;
  for (auto& [name, linear] : out.model.linears()) {
    if (!remaining.erase(name)) continue;
    auto kernel = std::make_shared<QuantizedLinearKernel>();
    kernel->kind = options.kernels;
    kernel->straight_through = options.straight_through;
    const auto& ckpt = source.checkpoint();
    if (format.inputs) {
      kernel->input_args = *format.inputs;
      VLMOPT_CHECK_INPUT(ckpt.contains(name + ".input_scale"), "{}: tensor '{}.input_scale' missing", bundle.string(), name);
      kernel->input_scale = io::load_tensor(ckpt, name + ".input_scale").to(torch::kFloat32).item<double>();
    }
    const auto* activation = mp_cache ? mp_cache->find(name, quant::MpRole::kActivation) : nullptr;
    if (activation && kernel->input_scale) {
      const auto where = (bundle / bundle::kMpCachePath).string();
      VLMOPT_CHECK_INPUT(activation->rows == 1 && activation->channels == static_cast<uint64_t>(linear->in_features()) &&
                             !activation->entries.empty(),
                         "{}: tensor '{}' (activation): expected one row of {} channels, got {} x {}", where, name,
                         linear->in_features(), activation->rows, activation->channels);
      kernel->input_scale = static_cast<double>(activation->entries.front().scale);
    }
    const auto mask = activation ? activation->mask_tensor() : torch::Tensor();
    if (mask.defined() && mask.any().item<bool>()) {
      const auto where = (bundle / bundle::kOutliersPath).string();
      VLMOPT_CHECK_INPUT(outliers && outliers->find(name + ".outlier_channels") && outliers->find(name + ".outlier_weight"),
                         "{}: layer '{}': the MP-Cache marks outlier channels but no FP16 columns are stored", where, name);
      const auto idx = io::load_tensor(*outliers, outliers->at(name + ".outlier_channels")).to(torch::kInt64);
      VLMOPT_CHECK_INPUT(torch::equal(idx, mask.nonzero().reshape({-1})),
                         "{}: layer '{}': outlier_channels differ from the MP-Cache mask", where, name);
      const auto cols = io::load_tensor(*outliers, outliers->at(name + ".outlier_weight"));
      const int64_t in = linear->in_features();
      VLMOPT_CHECK_INPUT(idx.dim() == 1 && (idx.numel() == 0 || (idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < in)) &&
                             cols.dim() == 2 && cols.size(0) == linear->out_features() && cols.size(1) == idx.numel(),
                         "{}: layer '{}': outlier channels/weights do not fit a Linear [{},{}]",
                         (bundle / bundle::kOutliersPath).string(), name, linear->out_features(), in);
      auto mask = torch::ones({in}, torch::kFloat32);
      mask.index_fill_(0, idx, 0.0);
      kernel->inlier_mask = mask.to(device);
      kernel->outlier_channels = idx.to(device);
      kernel->outlier_weight = cols.to(device, torch::kFloat16);
      kernel->inlier_weight = linear->weight * kernel->inlier_mask.to(linear->weight.scalar_type());
      out.outlier_layers.push_back(name);
    }
    if (options.kernels == KernelKind::kInt8 && kernel->input_scale) {
      // With outliers, their int8 columns are zeroed: those channels come in as zeros anyway.
      auto q = source.quantized_values(name).to(torch::kInt8);
      const auto scale = io::load_tensor(ckpt, name + ".weight_scale").to(torch::kFloat32);
      VLMOPT_CHECK_INPUT(scale.numel() == 1 || (scale.dim() == 2 && scale.size(1) == 1),
                         "--kernels int8: layer '{}': expected per-channel or per-tensor weight scales", name);
      kernel->q_weight_t = q.to(device).t();
      kernel->weight_scale_row = scale.reshape({1, -1}).to(device);
    }
    linear->kernel = kernel;
    out.quantized_layers.push_back(name);
  }
  VLMOPT_CHECK_INPUT(remaining.empty(), "{}: quantized tensors of '{}' belong to no Linear of the model", bundle.string(),
                     remaining.empty() ? "" : *remaining.begin());
  spdlog::debug("runtime: {} quantized Linears ({}), {} with FP16 outlier channels", out.quantized_layers.size(),
                out.format, out.outlier_layers.size());
  return out;
}

}  // namespace vlmopt::runtime
