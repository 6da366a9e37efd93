#include "calib/calibrate.hpp"

#include "bundle/export.hpp"
#include "datasets/source.hpp"
#include "eval/session.hpp"
#include "io/atomic_file.hpp"
#include "io/hash.hpp"
#include "quant/mp_cache.hpp"
#include "quant/qparams.hpp"
#include "util/error.hpp"
#include "util/paths.hpp"
#include "util/progress.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <cmath>
#include <limits>
#include <regex>

namespace vlmopt::calib {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::vector<std::string> default_ignore() {
  return {"re:model\\.vision_tower\\.", "re:model\\.multi_modal_projector\\.", "lm_head"};
}

bool is_ignored(const std::string& linear, const std::vector<std::string>& ignore) {
  for (const auto& pattern : ignore) {
    if (pattern == "Linear" || pattern == linear) return true;
    if (pattern.starts_with("re:")) {
      // compressed-tensors matches with Python's re.match: anchored at the start only.
      const std::regex re(pattern.substr(3));
      if (std::regex_search(linear, re, std::regex_constants::match_continuous)) return true;
    }
  }
  return false;
}

nlohmann::json CalibrateOptions::to_json() const {
  return {{"model", model},
          {"data", data},
          {"samples", samples},
          {"batch_size", batch_size},
          {"device", device},
          {"scheme", std::string(quant::to_string(scheme))},
          {"observer", std::string(to_string(observer))},
          {"convention", std::string(quant::to_string(convention))},
          {"ignore", ignore},
          {"smoothquant_alpha", smoothquant_alpha ? nlohmann::json(*smoothquant_alpha) : nlohmann::json(nullptr)},
          {"outlier_threshold", outlier_threshold},
          {"percentile", percentile},
          {"layerwise", layerwise},
          {"out", out.string()},
          {"max_shard_bytes", max_shard_bytes}};
}

namespace {

// Resident set now, from /proc/self/statm (pages), for -v progress logs.
double current_rss_mib() {
  std::ifstream statm("/proc/self/statm");
  long long size = 0, resident = 0;
  statm >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

double peak_rss_mib() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// SQNR in dB; an exact reproduction has infinite SQNR, which JSON cannot hold: "inf".
nlohmann::json db_json(double db) { return std::isfinite(db) ? nlohmann::json(db) : nlohmann::json("inf"); }

double scalar(const torch::Tensor& t) { return t.to(torch::kCPU, torch::kDouble).item<double>(); }

// quant::sqnr_db for whole weights: the same torch ops on the same float64
// values (so the same sums, bit for bit), written into buffers kept across
// Linears. The weights' float64 copies and temporaries are planning's largest
// allocations; fresh ones cost a page fault per 4 KiB, and sqnr_db makes five
// per Linear.
class WeightSqnr {
 public:
  double db(const torch::Tensor& reference, const torch::Tensor& approx) {
    VLMOPT_CHECK(reference.sizes() == approx.sizes(), "weight SQNR: shapes differ");
    const int64_t n = reference.numel();
    if (!ref_.defined() || ref_.numel() < n || ref_.device() != reference.device()) {
      const auto options = reference.options().dtype(torch::kDouble);
      ref_ = torch::empty({n}, options);
      app_ = torch::empty({n}, options);
      tmp_ = torch::empty({n}, options);
    }
    // Flat views: a full sum over a contiguous tensor reduces it as one dimension either way.
    auto ref = ref_.narrow(0, 0, n).view(reference.sizes());
    auto app = app_.narrow(0, 0, n).view(reference.sizes());
    auto tmp = tmp_.narrow(0, 0, n).view(reference.sizes());
    ref.copy_(reference.detach());
    app.copy_(approx.detach());
    const double signal = torch::square_out(tmp, ref).sum().item<double>();
    const double noise = torch::sub_out(tmp, ref, app).square_().sum().item<double>();
    if (noise == 0.0) return std::numeric_limits<double>::infinity();
    return 10.0 * std::log10(signal / noise);
  }

 private:
  torch::Tensor ref_, app_, tmp_;  // float64 [largest weight's numel]
};

nlohmann::json range_json(const torch::Tensor& range) {
  if (!range.defined()) return nullptr;
  const double lo = scalar(range[0]), hi = scalar(range[1]);
  return {{"min", lo}, {"max", hi}, {"absmax", std::max(std::abs(lo), std::abs(hi))}};
}

// One calibration pass: the first `count` samples of `data`, batched, through the model.
template <typename Fn>
void for_each_batch(eval::VlmSession& session, const datasets::DatasetSource& data, int64_t count, int64_t batch_size,
                    const std::string& label, Fn&& fn) {
  ProgressBar progress(label, count);
  for (int64_t begin = 0; begin < count; begin += batch_size) {
    const int64_t end = std::min(count, begin + batch_size);
    std::vector<datasets::Sample> samples;
    samples.reserve(static_cast<std::size_t>(end - begin));
    for (int64_t i = begin; i < end; ++i) samples.push_back(data.get(static_cast<std::size_t>(i)));
    fn(samples, session.prepare(samples));
    progress.advance(end - begin);
  }
}

void forward_batch(model::LlavaModel& model, const eval::PreparedBatch& batch);

// One pass of the calibration data through the model, with the taps live.
// Whole-model: batch by batch. Layer-by-layer (--layerwise): every sample's
// decoder input is computed first (vision tower, projector, embeddings), then
// all of them go through decoder layer l -- loaded from the checkpoint just
// before and released just after, calling after_layer(l) in between -- before
// layer l+1, so memory holds one layer's weights however deep the model is.
void run_pass(eval::VlmSession& session, const datasets::DatasetSource& data, int64_t count, int64_t batch_size,
              bool layerwise, const std::string& label,
              const std::function<void(const std::vector<datasets::Sample>&)>& on_samples,
              const std::function<void(int64_t)>& after_layer) {
  auto& model = session.model();
  if (!layerwise) {
    for_each_batch(session, data, count, batch_size, label,
                   [&](const std::vector<datasets::Sample>& samples, const eval::PreparedBatch& batch) {
                     on_samples(samples);
                     forward_batch(model, batch);
                   });
    return;
  }
  torch::NoGradGuard no_grad;
  // Each layer's weights are allocated and freed in turn. glibc raises its mmap
  // threshold after the first large free and then serves those blocks from the
  // heap, where fragmentation keeps them resident: peak memory would grow with
  // depth again. A fixed threshold keeps every weight-sized block mmapped, so
  // freeing it returns the memory.
  ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
  struct Staged {
    torch::Tensor hidden;          // [B,T,D] decoder hidden states
    model::DecoderInputs inputs;   // RoPE tables, masks
  };
  std::vector<Staged> staged;
  auto& lm = model.language_model();
  for_each_batch(session, data, count, batch_size, label + " (inputs)",
                 [&](const std::vector<datasets::Sample>& samples, const eval::PreparedBatch& batch) {
                   on_samples(samples);
                   const auto device = model.device();
                   const auto ids = batch.input_ids.to(device);
                   const auto mask = batch.attention_mask.to(device, torch::kInt64);
                   const auto features = model.image_features(batch.pixel_values.to(device, model.dtype()));
                   Staged s;
                   s.hidden = model.embed(ids, features);
                   const auto positions = model.default_position_ids(mask, ids.size(0), ids.size(1), 0);
                   s.inputs = lm->prepare(positions, mask, nullptr, model.image_token_mask(ids));
                   staged.push_back(std::move(s));
                 });
  ProgressBar progress(label + " (layers)", lm->num_layers());
  for (int64_t l = 0; l < lm->num_layers(); ++l) {
    model.load_decoder_layer(l);
    for (auto& s : staged) s.hidden = lm->run_layers(s.hidden, l, l + 1, s.inputs);
    after_layer(l);
    model.release_decoder_layer(l);
    spdlog::debug("layerwise: layer {} done, RSS {:.0f} MiB (peak {:.0f} MiB)", l, current_rss_mib(), peak_rss_mib());
    progress.advance();
  }
  // lm_head sees the last position only, as in the whole-model pass (logits_to_keep = 1).
  for (auto& s : staged) {
    const int64_t tokens = s.hidden.size(1);
    (void)model.logits(s.hidden.slice(1, tokens - 1), s.inputs);
  }
}

void forward_batch(model::LlavaModel& model, const eval::PreparedBatch& batch) {
  model::ForwardInputs inputs;
  const auto device = model.device();
  inputs.input_ids = batch.input_ids.to(device);
  inputs.attention_mask = batch.attention_mask.to(device);
  inputs.pixel_values = batch.pixel_values.to(device, model.dtype());
  inputs.logits_to_keep = 1;  // lm_head is not calibrated by default; keep its cost out of the pass
  (void)model.forward(inputs);
}

void hash_sample(io::Sha256& sha, const datasets::Sample& s) {
  for (const auto& field : {s.id, s.question, s.answer}) {
    sha.update(field);
    sha.update(std::string_view("\0", 1));
  }
  const cv::Mat& img = s.image;
  const std::string dims = fmt::format("{}x{}x{}", img.rows, img.cols, img.channels());
  sha.update(dims);
  if (img.isContinuous()) {
    sha.update(img.data, img.total() * img.elemSize());
  } else {
    for (int r = 0; r < img.rows; ++r) sha.update(img.ptr(r), static_cast<std::size_t>(img.cols) * img.elemSize());
  }
}

// SmoothQuant (reference.md §3): per input channel s = amax_x^a / amax_w^(1-a);
// the preceding RMSNorm's weight is divided by s and the Linears reading it are
// multiplied by s, so the float function is unchanged and activation outliers
// move into the weights. Applied where a norm precedes the Linears (q/k/v, gate/up).
nlohmann::json apply_smoothquant(model::LlavaModel& model, const ActivationCollector& ranges, double alpha,
                                 const std::vector<std::string>& quantized, quant::QuantPlan& plan) {
  torch::NoGradGuard no_grad;
  nlohmann::json applied = nlohmann::json::array();
  auto linears = model.linears();
  std::map<std::string, model::Linear> by_name(linears.begin(), linears.end());
  auto& lm = model.language_model();
  for (int64_t l = 0; l < lm->num_layers(); ++l) {
    auto& layer = lm->layers[static_cast<std::size_t>(l)];
    const std::string prefix = fmt::format("{}.layers.{}", model::kLanguagePrefix, l);
    struct Site {
      model::RMSNorm norm;
      std::string norm_name;
      std::vector<std::string> members;
    };
    const Site sites[] = {
        {layer->input_layernorm, prefix + ".input_layernorm.weight",
         {prefix + ".self_attn.q_proj", prefix + ".self_attn.k_proj", prefix + ".self_attn.v_proj"}},
        {layer->post_attention_layernorm, prefix + ".post_attention_layernorm.weight",
         {prefix + ".mlp.gate_proj", prefix + ".mlp.up_proj"}},
    };
    for (const auto& site : sites) {
      // Every member must be quantized: smoothing a Linear that stays float gains nothing.
      if (!std::all_of(site.members.begin(), site.members.end(), [&](const std::string& m) {
            return std::find(quantized.begin(), quantized.end(), m) != quantized.end();
          }))
        continue;
      const auto x_amax = ranges.stats_for(site.members.front()).channel_absmax().to(torch::kFloat32);
      torch::Tensor w_amax;
      for (const auto& m : site.members) {
        const auto a = by_name.at(m)->weight.detach().abs().amax(0).to(torch::kFloat32);  // [in]
        w_amax = w_amax.defined() ? torch::maximum(w_amax, a) : a;
      }
      const auto s = (x_amax.clamp_min(1e-5).pow(alpha) / w_amax.clamp_min(1e-5).pow(1.0 - alpha)).clamp_min(1e-5);
      auto& norm_weight = site.norm->weight;
      norm_weight.div_(s.to(norm_weight.device(), norm_weight.scalar_type()));
      plan.replaced_tensors[site.norm_name] = norm_weight.detach().to(torch::kCPU).clone();
      for (const auto& m : site.members) {
        auto& w = by_name.at(m)->weight;
        w.mul_(s.to(w.device(), w.scalar_type()).unsqueeze(0));
        plan.replaced_tensors[m + ".weight"] = w.detach().to(torch::kCPU).clone();
      }
      applied.push_back({{"norm", site.norm_name},
                         {"linears", site.members},
                         {"scale_min", scalar(s.min())},
                         {"scale_max", scalar(s.max())}});
    }
  }
  return applied;
}

// The runtime input parameters: the range of the channels that are NOT outliers
// (those bypass quantization), never wider than what the observer chose.
quant::QParams runtime_input_qparams(const ActivationStats& stats, const Observer& combined,
                                     const torch::Tensor& outliers, const quant::QuantArgs& args,
                                     quant::Convention convention) {
  const auto keep = outliers.logical_not().to(stats.channel_min.device());
  if (keep.sum().item<int64_t>() == 0) return combined.qparams();  // every channel is an outlier: nothing to narrow
  const auto cmin = stats.channel_min.index({keep}).min();
  const auto cmax = stats.channel_max.index({keep}).max();
  const auto observed_min = combined.min_vals().to(torch::kFloat32).reshape({-1})[0];
  const auto observed_max = combined.max_vals().to(torch::kFloat32).reshape({-1})[0];
  torch::Tensor lo, hi;
  if (args.symmetric) {
    const auto amax = torch::minimum(combined.amax().to(torch::kFloat32).reshape({-1})[0],
                                     torch::maximum(cmin.abs(), cmax.abs()));
    lo = -amax;
    hi = amax;
  } else {
    lo = torch::maximum(observed_min, cmin);
    hi = torch::minimum(observed_max, cmax);
  }
  return quant::compute_qparams(lo.reshape({1}), hi.reshape({1}), args, convention);
}

// The session and sample count every calibration pass starts from.
eval::VlmSession open_session(const CalibrateOptions& options) {
  eval::SessionOptions session_options;
  session_options.model = options.model;
  session_options.device = options.device;
  session_options.dtype = "float32";
  session_options.defer_decoder_layers = options.layerwise;
  return eval::VlmSession::open(session_options);
}

int64_t samples_to_use(const CalibrateOptions& options, const datasets::DatasetSource& data) {
  const int64_t available = static_cast<int64_t>(data.size());
  const int64_t count = options.samples == 0 ? available : std::min(options.samples, available);
  VLMOPT_CHECK_INPUT(count > 0, "{}: the dataset has no samples", options.data);
  if (options.samples > available)
    spdlog::warn("--samples {}: {} has only {} samples; using all of them", options.samples, options.data, available);
  return count;
}

}  // namespace

CalibrationRun run_calibration(const CalibrateOptions& options) {
  const auto t_start = Clock::now();
  VLMOPT_CHECK_INPUT(options.batch_size > 0, "--batch-size: expected a positive number, got {}", options.batch_size);
  VLMOPT_CHECK_INPUT(options.samples >= 0, "--samples: expected >= 0, got {}", options.samples);
  if (options.smoothquant_alpha)
    VLMOPT_CHECK_INPUT(*options.smoothquant_alpha > 0.0 && *options.smoothquant_alpha < 1.0,
                       "--smoothquant: expected alpha in (0, 1), got {}", *options.smoothquant_alpha);
  VLMOPT_CHECK_INPUT(!(options.layerwise && options.smoothquant_alpha),
                     "--layerwise with --smoothquant: not supported together (SmoothQuant needs the whole model)");
  VLMOPT_CHECK_INPUT(options.percentile > 0.0 && options.percentile <= 100.0,
                     "--percentile: expected a value in (0, 100], got {}", options.percentile);

  auto session = open_session(options);
  auto& model = session.model();
  const auto data = datasets::open_dataset(options.data);
  const int64_t count = samples_to_use(options, *data);

  CalibrationRun run;
  run.samples = count;
  auto& plan = run.plan;
  plan.scheme = quant::Scheme::preset(options.scheme);
  plan.convention = options.convention;

  std::vector<std::string> quantized;
  std::vector<std::string> not_divisible;
  for (auto& [name, linear] : model.linears()) {
    const bool ragged_groups = plan.scheme.weights.strategy == quant::Strategy::kGroup &&
                               linear->in_features() % plan.scheme.weights.group_size != 0;
    if (!is_ignored(name, options.ignore) && ragged_groups) not_divisible.push_back(name);
    (is_ignored(name, options.ignore) || ragged_groups ? plan.ignore : quantized).push_back(name);
  }
  if (!not_divisible.empty())
    spdlog::warn("calibrate: {} Linear layer(s) left in float: in_features not a multiple of group size {} (first: {})",
                 not_divisible.size(), plan.scheme.weights.group_size, not_divisible.front());
  VLMOPT_CHECK_INPUT(!quantized.empty(), "--ignore: every Linear of {} is ignored; nothing to calibrate",
                     session.model_dir().string());
  spdlog::info("calibrate: {} Linear layers to quantize ({}), {} left in float", quantized.size(),
               plan.scheme.name(), plan.ignore.size());

  // Activation observers use the scheme's input arguments; weight-only schemes still
  // collect int8 per-tensor statistics so the report shows ranges and FP16 safety.
  quant::QuantArgs input_args = plan.scheme.input_activations.value_or(quant::QuantArgs{});
  ObserverOptions observer_options;
  observer_options.kind = options.observer;
  observer_options.args = input_args;
  observer_options.convention = options.convention;
  observer_options.percentile = options.percentile;

  nlohmann::json smoothquant = nullptr;
  if (options.smoothquant_alpha) {
    CollectorOptions first;
    first.observer = observer_options;
    first.observers = false;
    first.sample_tokens = 0;
    ActivationCollector ranges(model, quantized, first);
    run_pass(session, *data, count, options.batch_size, false, "smoothquant ranges",
             [](const std::vector<datasets::Sample>&) {}, [](int64_t) {});
    ranges.detach();
    smoothquant = apply_smoothquant(model, ranges, *options.smoothquant_alpha, quantized, plan);
  }

  CollectorOptions collector_options;
  collector_options.observer = observer_options;
  ActivationCollector collector(model, quantized, collector_options);

  ObserverOptions weight_options;
  weight_options.kind = ObserverKind::kMinMax;
  weight_options.args = plan.scheme.weights;
  weight_options.convention = options.convention;
  weight_options.target = ObserverTarget::kWeight;

  // Per activation point (memoized): the combined observer and the outlier channels.
  struct PointDecision {
    std::unique_ptr<Observer> combined;
    torch::Tensor outliers;  // bool [in], CPU
  };
  std::map<const ActivationStats*, PointDecision> point_decisions;
  auto decide_point = [&](const ActivationStats& stats) -> PointDecision& {
    auto it = point_decisions.find(&stats);
    if (it != point_decisions.end()) return it->second;
    PointDecision d;
    d.combined = stats.combined(observer_options);
    const auto absmax = stats.channel_absmax();
    d.outliers = options.outlier_threshold > 0.0 && plan.scheme.input_activations
                     ? (absmax > options.outlier_threshold).to(torch::kCPU)
                     : torch::zeros({absmax.size(0)}, torch::kBool);
    return point_decisions.emplace(&stats, std::move(d)).first->second;
  };

  // Deciding a Linear needs its weight and its complete input statistics: after the
  // pass, or with --layerwise right after all samples went through its layer.
  std::map<std::string, std::pair<quant::LinearQuant, nlohmann::json>> decided;
  std::vector<double> output_sqnr;
  // The sampled input as the runtime sees it, shared by the Linears of one point
  // (q/k/v, gate/up come one after the other): quantized once, not per Linear.
  // Only the last point's is kept, so memory stays flat with --layerwise.
  struct SampledInput {
    const ActivationStats* point = nullptr;
    torch::Tensor x, x_q;
    nlohmann::json sqnr;
  } sampled;
  WeightSqnr weight_sqnr;
  auto decide_linear = [&](const std::string& name, const model::Linear& linear) {
    torch::NoGradGuard no_grad;
    const auto& stats = collector.stats_for(name);
    auto& point = decide_point(stats);
    quant::LinearQuant lq;
    lq.name = name;
    const auto weight = linear->weight.detach().to(torch::kFloat32);
    auto weight_observer = make_observer(weight_options);
    weight_observer->observe(weight);
    lq.weight = weight_observer->qparams();
    lq.outlier_channels = point.outliers;
    if (stats.linears.size() > 1) lq.fused_group = fused_group_of(name);
    if (plan.scheme.input_activations) {
      lq.input_all_channels = point.combined->qparams();
      lq.input = lq.outlier_channels.any().item<bool>()
                     ? runtime_input_qparams(stats, *point.combined, lq.outlier_channels,
                                             *plan.scheme.input_activations, options.convention)
                     : *lq.input_all_channels;
    }
    // Quantization error on the sampled tokens, as vlmopt's runtime computes it:
    // outlier input channels (and their weight columns) stay in float.
    nlohmann::json sqnr;
    const auto w_fq = quant::fake_quantize(weight, lq.weight, plan.scheme.weights, options.convention);
    sqnr["weight"] = db_json(weight_sqnr.db(weight, w_fq));
    if (stats.sample.defined() && stats.sample.size(0) > 0) {
      const auto keep = lq.outlier_channels.to(weight.device());
      // With no outlier channel, where(keep, float, quantized) is the quantized tensor itself.
      const bool any_outlier = lq.outlier_channels.any().item<bool>();
      if (sampled.point != &stats) {
        sampled = SampledInput{&stats, stats.sample.to(weight.device()), torch::Tensor(), nullptr};
        sampled.x_q = sampled.x;
        if (lq.input) {
          sampled.x_q = quant::fake_quantize(sampled.x, *lq.input, *plan.scheme.input_activations, options.convention);
          if (any_outlier) sampled.x_q = torch::where(keep.unsqueeze(0), sampled.x, sampled.x_q);
          sampled.sqnr = db_json(quant::sqnr_db(sampled.x, sampled.x_q));
        }
      }
      const auto& x = sampled.x;
      const auto& x_q = sampled.x_q;
      if (lq.input) sqnr["input"] = sampled.sqnr;
      const auto w_runtime = any_outlier ? torch::where(keep.unsqueeze(0), weight, w_fq) : w_fq;
      const double out_db = quant::sqnr_db(torch::matmul(x, weight.t()), torch::matmul(x_q, w_runtime.t()));
      sqnr["output"] = db_json(out_db);
      if (std::isfinite(out_db)) output_sqnr.push_back(out_db);
    }
    nlohmann::json j = {{"name", name},
                        {"fused_group", lq.fused_group},
                        {"weight_scale", {{"min", scalar(lq.weight.scale.min())}, {"max", scalar(lq.weight.scale.max())}}},
                        {"sqnr_db", sqnr},
                        {"outlier_channels", lq.outlier_channels.sum().item<int64_t>()}};
    if (lq.input) {
      j["input_scale"] = scalar(lq.input->scale.reshape({-1})[0]);
      j["input_zero_point"] = lq.input->zero_point.reshape({-1})[0].item<int64_t>();
      j["input_scale_all_channels"] = scalar(lq.input_all_channels->scale.reshape({-1})[0]);
    }
    decided.emplace(name, std::make_pair(std::move(lq), std::move(j)));
  };
  auto decide_pending = [&](const std::string& prefix) {
    for (auto& [name, linear] : model.linears()) {
      if (!name.starts_with(prefix) || decided.contains(name)) continue;
      if (std::find(quantized.begin(), quantized.end(), name) == quantized.end()) continue;
      decide_linear(name, linear);
    }
  };

  io::Sha256 data_hash;
  const auto t_collect = Clock::now();
  run_pass(
      session, *data, count, options.batch_size, options.layerwise, "calibrate",
      [&](const std::vector<datasets::Sample>& samples) {
        for (const auto& s : samples) hash_sample(data_hash, s);
      },
      [&](int64_t layer) {
        const auto prefix = fmt::format("{}.layers.{}.", model::kLanguagePrefix, layer);
        decide_pending(prefix);
        // The layer is decided: its sampled tokens are no longer needed, so memory
        // stays flat with depth (they are the largest per-layer state).
        for (const auto& point : collector.points())
          if (point->tap.starts_with(prefix)) point->sample = torch::Tensor();
      });
  collector.detach();
  run.collect_seconds = std::chrono::duration<double>(Clock::now() - t_collect).count();
  run.dataset_hash = data_hash.hex_digest();
  // A Linear the pass never reached (e.g. vision-tower layers after
  // vision_feature_layer, which LLaVA computes nowhere) has no input range to
  // quantize with, and quantizing it would change nothing the model computes:
  // it stays in float and is named in the ignore list like any other.
  std::vector<std::string> unobserved;
  std::erase_if(quantized, [&](const std::string& name) {
    if (collector.stats_for(name).channel_min.defined()) return false;
    unobserved.push_back(name);
    return true;
  });
  if (!unobserved.empty()) {
    spdlog::warn("calibrate: {} Linear layer(s) never ran on the calibration data and stay in float (first: {})",
                 unobserved.size(), unobserved.front());
    plan.ignore.insert(plan.ignore.end(), unobserved.begin(), unobserved.end());
  }
  VLMOPT_CHECK_INPUT(!quantized.empty(), "calibrate: none of the Linears to quantize ran on {}", options.data);
  decide_pending("");
  for (const auto& name : quantized) {
    auto& [lq, j] = decided.at(name);
    plan.layers.push_back(std::move(lq));
  }
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& name : quantized) layers.push_back(decided.at(name).second);

  nlohmann::json points = nlohmann::json::array();
  int64_t total_outliers = 0, image_tokens = 0, text_tokens = 0;
  std::vector<std::string> fp16_unsafe;
  for (const auto& point : collector.points()) {
    const auto& stats = *point;
    if (!stats.channel_min.defined()) continue;  // never ran: its Linears stay in float (above)
    auto& decision = decide_point(stats);
    const auto outlier_index = decision.outliers.nonzero().reshape({-1});
    total_outliers += outlier_index.numel();
    image_tokens = std::max(image_tokens, stats.image_tokens);
    text_tokens = std::max(text_tokens, stats.text_tokens);
    const auto fp16 = stats.fp16_safety();
    if (fp16.recommendation() != "fp16 fine") fp16_unsafe.push_back(stats.tap);
    auto image = range_json(stats.image_range), text = range_json(stats.text_range);
    const double image_absmax = image.is_null() ? 0.0 : image["absmax"].get<double>();
    const double text_absmax = text.is_null() ? 0.0 : text["absmax"].get<double>();
    points.push_back({
        {"tap", stats.tap},
        {"linears", stats.linears},
        {"tokens", {{"image", stats.image_tokens}, {"text", stats.text_tokens}}},
        {"range", {{"image", image}, {"text", text}}},
        {"observer_amax", scalar(decision.combined->amax().reshape({-1}).max())},
        {"dominant_modality", image_absmax >= text_absmax ? "image" : "text"},
        {"fp16", fp16.to_json()},
        {"outlier_channels", std::vector<int64_t>(outlier_index.data_ptr<int64_t>(),
                                                  outlier_index.data_ptr<int64_t>() + outlier_index.numel())},
    });
  }

  run.total_seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  run.peak_rss_mib = peak_rss_mib();
  double mean_sqnr = 0.0;
  for (double v : output_sqnr) mean_sqnr += v / static_cast<double>(output_sqnr.size());
  run.report = {
      {"format", "vlmopt-calibration-report"},
      {"version", 1},
      {"options", options.to_json()},
      {"model", session.model_dir().string()},
      {"dataset", {{"spec", options.data}, {"describe", data->describe()}, {"samples", count}, {"sha256", run.dataset_hash}}},
      {"scheme", plan.scheme.name()},
      {"tokens_per_point", {{"image", image_tokens}, {"text", text_tokens}}},
      {"smoothquant", smoothquant},
      {"left_in_float_ragged_groups", not_divisible},
      {"summary",
       {{"quantized_linears", plan.layers.size()},
        {"ignored_linears", plan.ignore.size()},
        {"activation_points", points.size()},
        {"outlier_channels", total_outliers},
        {"fp16_unsafe_points", fp16_unsafe},
        {"min_output_sqnr_db", output_sqnr.empty() ? nlohmann::json(nullptr)
                                                   : nlohmann::json(*std::min_element(output_sqnr.begin(), output_sqnr.end()))},
        {"mean_output_sqnr_db", output_sqnr.empty() ? nlohmann::json(nullptr) : nlohmann::json(mean_sqnr)}}},
      {"timing",
       {{"collect_seconds", run.collect_seconds},
        {"total_seconds", run.total_seconds},
        {"samples_per_second", static_cast<double>(count) / std::max(run.collect_seconds, 1e-9)}}},
      {"peak_rss_mib", run.peak_rss_mib},
      {"activations", points},
      {"layers", layers},
  };
  return run;
}

nlohmann::json time_bare_pass(const CalibrateOptions& options) {
  auto session = open_session(options);
  const auto data = datasets::open_dataset(options.data);
  const int64_t count = samples_to_use(options, *data);
  const auto t0 = Clock::now();
  run_pass(session, *data, count, options.batch_size, options.layerwise, "forward",
           [](const std::vector<datasets::Sample>&) {}, [](int64_t) {});
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return {{"model", session.model_dir().string()},
          {"data", options.data},
          {"samples", count},
          {"batch_size", options.batch_size},
          {"layerwise", options.layerwise},
          {"seconds", seconds},
          {"samples_per_second", static_cast<double>(count) / std::max(seconds, 1e-9)},
          {"peak_rss_mib", peak_rss_mib()}};
}

nlohmann::json calibrate(const CalibrateOptions& options) {
  VLMOPT_CHECK_INPUT(!options.out.empty(), "--out: a bundle directory is required");
  spdlog::info("calibrate options: {}", options.to_json().dump());
  const auto t0 = Clock::now();
  auto run = run_calibration(options);

  const auto cache = quant::mp_cache_from_plan(run.plan);
  bundle::ExportOptions export_options;
  export_options.source_model = vlmopt::resolve_model_dir(options.model);
  export_options.out = options.out;
  export_options.max_shard_bytes = options.max_shard_bytes;
  export_options.step_name = "calibrate";
  export_options.step_options = options.to_json();
  export_options.dataset_hash = run.dataset_hash;
  const std::string report_text = run.report.dump(1) + "\n";
  export_options.add_files = [&](const fs::path& root) {
    fs::create_directories(root / "vlmopt" / "reports");
    quant::write_mp_cache(root / "vlmopt" / "mp_cache.bin", cache);
    io::write_file_atomic(root / "vlmopt" / "reports" / "calibration.json", report_text);
  };
  bundle::export_bundle(export_options, run.plan);

  const auto& summary = run.report["summary"];
  return {{"bundle", options.out.string()},
          {"mp_cache", (options.out / "vlmopt" / "mp_cache.bin").string()},
          {"report", (options.out / "vlmopt" / "reports" / "calibration.json").string()},
          {"scheme", run.plan.scheme.name()},
          {"samples", run.samples},
          {"quantized_linears", summary["quantized_linears"]},
          {"outlier_channels", summary["outlier_channels"]},
          {"fp16_unsafe_points", summary["fp16_unsafe_points"]},
          {"mean_output_sqnr_db", summary["mean_output_sqnr_db"]},
          {"collect_seconds", run.collect_seconds},
          {"seconds", std::chrono::duration<double>(Clock::now() - t0).count()},
          {"peak_rss_mib", run.peak_rss_mib}};
}

}  // namespace vlmopt::calib
