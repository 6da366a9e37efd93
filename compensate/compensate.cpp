#include "compensate/compensate.hpp"

#include "bundle/export.hpp"
#include "bundle/manifest.hpp"
#include "datasets/source.hpp"
#include "io/atomic_file.hpp"
#include "runtime/runtime.hpp"
#include "util/error.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

namespace vlmopt::compensate {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr double kTiny = 1e-12;  // guards the relative-error denominators

nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

void freeze(model::LlavaModel& model) {
  for (auto& [name, tensor] : model.named_tensors()) tensor.requires_grad_(false);
}

// Hidden states (transformers' convention) of the decoder fed with `image_features`
// ([B, N, D_text]) at the image tokens of `input_ids`.
std::vector<torch::Tensor> decoder_states(model::LlavaModel& model, const torch::Tensor& input_ids,
                                          const torch::Tensor& attention_mask, const torch::Tensor& image_features) {
  auto& lm = model.language_model();
  const int64_t batch = input_ids.size(0), tokens = input_ids.size(1);
  auto hidden = model.embed(input_ids, image_features);
  const auto positions = model.default_position_ids(attention_mask, batch, tokens, 0);
  const auto inputs = lm->prepare(positions, attention_mask, nullptr, model.image_token_mask(input_ids));
  std::vector<torch::Tensor> states;
  hidden = lm->run_layers(hidden, 0, lm->num_layers(), inputs, &states);
  states.back() = lm->final_norm(hidden);
  return states;
}

// Features at the adapter's place: the projector output, or its input (selected vision features).
torch::Tensor features_at(model::LlavaModel& model, const torch::Tensor& pixel_values, Placement placement) {
  const auto vision = model.select_vision_features(model.vision_hidden_states(pixel_values));
  return placement == Placement::kProjectorInput ? vision : model.projector()(vision);
}

// Features at the adapter's place -> what the decoder receives.
torch::Tensor to_decoder_features(model::LlavaModel& model, const torch::Tensor& point, Placement placement) {
  return placement == Placement::kProjectorInput ? model.projector()(point) : point;
}

std::vector<int64_t> resolve_layers(const std::vector<int64_t>& layers, int64_t states) {
  std::vector<int64_t> out;
  for (const auto l : layers) {
    VLMOPT_CHECK_INPUT(l >= -states && l < states, "--feature-layers: expected indices in [{}, {}], got {}", -states,
                       states - 1, l);
    out.push_back(l < 0 ? l + states : l);
  }
  return out;
}

// What the teacher and the (frozen) student part before the adapter give for one batch:
// computed once, reused at every step.
struct CachedBatch {
  torch::Tensor input_ids, attention_mask;  // [B,T]
  torch::Tensor token_mask;                 // [B,T,1] float, 1 = real token
  torch::Tensor text_mask;                  // [B,T,1] float, 1 = real text token after the first image token
  torch::Tensor student_point;              // student features before the adapter [B,N,d]
  torch::Tensor teacher_point;              // teacher features at the adapter's place [B,N,d]
  torch::Tensor teacher_projected;          // teacher projector output [B,N,D]
  std::vector<torch::Tensor> teacher_hidden;  // per feature layer [B,T,D]
  torch::Tensor teacher_last;               // [B,T,D] after the final norm
  torch::Tensor entropy;                    // [B] nats
};

// Mean text->visual attention entropy per sample over the layers seen (see compensate.hpp).
class EntropyMeter {
 public:
  EntropyMeter(const torch::Tensor& input_ids, const torch::Tensor& attention_mask, int64_t image_token_id) {
    const auto image = input_ids == image_token_id;
    visual_ = image.to(torch::kFloat32);                                   // [B,T] keys
    const auto after_image = image.to(torch::kInt64).cumsum(-1) > 0;       // at or after the first image token
    rows_ = (after_image & image.logical_not() & (attention_mask != 0)).to(torch::kFloat32);  // [B,T] queries
  }
  void add(const torch::Tensor& probs) {  // [B,H,T,T]
    const auto p = probs.detach().to(torch::kFloat32) * visual_.unsqueeze(1).unsqueeze(1);
    const auto mass = p.sum(-1, /*keepdim=*/true);
    const auto q = p / mass.clamp_min(kTiny);
    const auto h = -(q * q.clamp_min(kTiny).log()).sum(-1).mean(1);  // [B,T] mean over heads
    const auto per_sample = (h * rows_).sum(-1) / rows_.sum(-1).clamp_min(1.0);
    sum_ = sum_.defined() ? sum_ + per_sample : per_sample;
    ++layers_;
  }
  torch::Tensor mean() const {
    VLMOPT_CHECK(layers_ > 0, "no attention probabilities were tapped");
    return sum_ / static_cast<double>(layers_);
  }

 private:
  torch::Tensor visual_, rows_, sum_;
  int64_t layers_ = 0;
};

CachedBatch cache_batch(model::LlavaModel& teacher, model::LlavaModel& student, const eval::PreparedBatch& batch,
                        const std::vector<int64_t>& layers, Placement placement) {
  torch::NoGradGuard no_grad;
  CachedBatch c;
  const auto device = student.device();
  c.input_ids = batch.input_ids.to(device, torch::kInt64);
  c.attention_mask = batch.attention_mask.to(device, torch::kInt64);
  c.token_mask = c.attention_mask.to(torch::kFloat32).unsqueeze(-1);
  {
    const auto image = c.input_ids == student.config().image_token_id;
    const auto after_image = image.to(torch::kInt64).cumsum(-1) > 0;
    c.text_mask = (after_image & image.logical_not() & (c.attention_mask != 0)).to(torch::kFloat32).unsqueeze(-1);
  }
  const auto pixels = batch.pixel_values.to(device, torch::kFloat32);
  VLMOPT_CHECK(pixels.size(0) == c.input_ids.size(0), "compensate expects one image per sample, got {} for {}",
               pixels.size(0), c.input_ids.size(0));
  c.student_point = features_at(student, pixels, placement);
  c.teacher_point = features_at(teacher, pixels, placement);
  c.teacher_projected = to_decoder_features(teacher, c.teacher_point, placement);

  EntropyMeter entropy(c.input_ids, c.attention_mask, teacher.config().image_token_id);
  const int id = teacher.taps().subscribe("model.language_model.layers.*",
                                          [&](std::string_view name, const torch::Tensor& t, const model::TapContext&) {
                                            if (name.ends_with(".probs")) entropy.add(t);
                                          });
  std::vector<torch::Tensor> states;
  try {
    states = decoder_states(teacher, c.input_ids, c.attention_mask, c.teacher_projected);
  } catch (...) {
    teacher.taps().unsubscribe(id);
    throw;
  }
  teacher.taps().unsubscribe(id);
  for (const auto l : layers) c.teacher_hidden.push_back(states[static_cast<size_t>(l)]);
  c.teacher_last = states.back();
  c.entropy = entropy.mean();
  return c;
}

// Relative squared error per sample over the masked positions: [B].
torch::Tensor relative_error(const torch::Tensor& s, const torch::Tensor& t, const torch::Tensor& mask) {
  const auto diff = (s - t).pow(2) * mask;
  const auto ref = t.pow(2) * mask;
  return diff.sum({1, 2}) / ref.sum({1, 2}).clamp_min(kTiny);
}

struct LossTensors {
  torch::Tensor total, perceptual, gradflow;
  LossValue value() const {
    return {total.item<double>(), perceptual.item<double>(), gradflow.item<double>()};
  }
};

// Reverse-mode "gradient flow" of one model: J^T u for each probe u, [B,N,d] each, where
// J = d(last hidden state) / d(point). `create_graph` keeps it differentiable (student).
std::vector<torch::Tensor> vector_jacobian(const torch::Tensor& last, const torch::Tensor& point,
                                           const std::vector<torch::Tensor>& probes, bool create_graph) {
  std::vector<torch::Tensor> out;
  for (size_t p = 0; p < probes.size(); ++p) {
    const auto projection = (last * probes[p]).sum();
    const bool more = p + 1 < probes.size();
    out.push_back(torch::autograd::grad({projection}, {point}, {}, /*retain_graph=*/create_graph || more,
                                        create_graph)[0]);
  }
  return out;
}

LossTensors batch_loss(const CachedBatch& c, model::LlavaModel& teacher, model::LlavaModel& student,
                       CompensatoryAdapterImpl& adapter, const TrainOptions& options, const std::vector<int64_t>& layers,
                       at::Generator& probe_generator) {
  torch::AutoGradMode grad_mode(true);  // the gradient-flow term differentiates even when only evaluating
  const auto& lo = options.loss;
  const int64_t batch = c.input_ids.size(0);
  const bool gradflow = lo.gamma > 0.0 && lo.probes > 0;

  const auto adapted = adapter.forward(c.student_point);  // [B,N,d]
  const auto projected = to_decoder_features(student, adapted, options.placement);
  const auto states = decoder_states(student, c.input_ids, c.attention_mask, projected);

  std::vector<torch::Tensor> terms;
  if (lo.projector_feature) terms.push_back(relative_error(projected, c.teacher_projected, torch::ones({1, 1, 1}, projected.options())));
  for (size_t k = 0; k < layers.size(); ++k)
    terms.push_back(relative_error(states[static_cast<size_t>(layers[k])], c.teacher_hidden[k],
                                   lo.text_tokens_only ? c.text_mask : c.token_mask));
  VLMOPT_CHECK(!terms.empty(), "the perceptual loss has no features");
  const auto d = torch::stack(terms, 0).mean(0);  // [B]
  const auto weights = std::isfinite(lo.tau) ? torch::softmax(-c.entropy / lo.tau, 0)
                                             : torch::full({batch}, 1.0 / static_cast<double>(batch), d.options());
  LossTensors out;
  out.perceptual = (weights * d).sum();
  out.gradflow = torch::zeros({}, d.options());
  if (gradflow) {
    // Probes u ~ N(0, I) on the real tokens of the last hidden state, unit norm per sample.
    std::vector<torch::Tensor> probes;
    for (int64_t p = 0; p < lo.probes; ++p) {
      auto u = at::normal(0.0, 1.0, c.teacher_last.sizes(), probe_generator, torch::TensorOptions().dtype(torch::kFloat32))
                   .to(c.teacher_last.device()) *
               c.token_mask;
      probes.push_back(u / u.flatten(1).norm(2, 1).clamp_min(kTiny).view({-1, 1, 1}));
    }
    const auto student_flow = vector_jacobian(states.back(), adapted, probes, /*create_graph=*/true);
    const auto point = c.teacher_point.detach().clone().requires_grad_(true);
    const auto teacher_last =
        decoder_states(teacher, c.input_ids, c.attention_mask, to_decoder_features(teacher, point, options.placement))
            .back();
    const auto teacher_flow = vector_jacobian(teacher_last, point, probes, /*create_graph=*/false);
    std::vector<torch::Tensor> g;
    const auto all = torch::ones({1, 1, 1}, d.options());
    for (size_t p = 0; p < probes.size(); ++p) g.push_back(relative_error(student_flow[p], teacher_flow[p].detach(), all));
    out.gradflow = torch::stack(g, 0).mean();
  }
  out.total = out.perceptual + lo.gamma * out.gradflow;
  return out;
}

LossValue mean_loss(const std::vector<CachedBatch>& cache, model::LlavaModel& teacher, model::LlavaModel& student,
                    CompensatoryAdapterImpl& adapter, const TrainOptions& options, const std::vector<int64_t>& layers) {
  // Fixed probe directions: before and after see the same ones.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed + 0x5eed);
  LossValue sum;
  int64_t n = 0;
  for (const auto& c : cache) {
    const auto v = batch_loss(c, teacher, student, adapter, options, layers, generator).value();
    if (!std::isfinite(v.total)) continue;  // (the graph built for the value is dropped here)
    sum.total += v.total;
    sum.perceptual += v.perceptual;
    sum.gradflow += v.gradflow;
    ++n;
  }
  if (n == 0) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    return {nan, nan, nan};
  }
  return {sum.total / n, sum.perceptual / n, sum.gradflow / n};
}

bool all_finite(const std::vector<torch::Tensor>& tensors) {
  for (const auto& t : tensors)
    if (t.grad().defined() && !torch::isfinite(t.grad()).all().item<bool>()) return false;
  return true;
}

}  // namespace

nlohmann::json LossValue::to_json() const {
  return {{"total", finite_or_null(total)}, {"perceptual", finite_or_null(perceptual)},
          {"gradflow", finite_or_null(gradflow)}};
}

nlohmann::json TrainOptions::to_json() const {
  return {{"placement", placement_name(placement)},
          {"rank", rank},
          {"gamma", loss.gamma},
          {"tau", std::isfinite(loss.tau) ? nlohmann::json(loss.tau) : nlohmann::json("inf")},
          {"feature_layers", loss.feature_layers},
          {"projector_feature", loss.projector_feature},
          {"feature_tokens", loss.text_tokens_only ? "text" : "all"},
          {"keep_only_if_better", keep_only_if_better},
          {"probes", loss.probes},
          {"steps", steps},
          {"lr", lr},
          {"clip_grad_norm", clip_grad_norm},
          {"seed", seed},
          {"max_nan_steps", max_nan_steps}};
}

nlohmann::json CompensateOptions::to_json() const {
  auto j = train.to_json();
  j["model"] = model;
  j["bundle"] = bundle.string();
  j["data"] = data;
  j["samples"] = samples;
  j["batch_size"] = batch_size;
  j["device"] = device;
  return j;
}

AdaptedForward forward_with_adapter(model::LlavaModel& model, const eval::PreparedBatch& batch,
                                    CompensatoryAdapterImpl* adapter, Placement placement) {
  torch::NoGradGuard no_grad;
  const auto device = model.device();
  const auto ids = batch.input_ids.to(device, torch::kInt64);
  const auto mask = batch.attention_mask.to(device, torch::kInt64);
  auto point = features_at(model, batch.pixel_values.to(device, model.dtype()), placement);
  if (adapter != nullptr) point = adapter->forward(point);
  AdaptedForward out;
  out.image_features = to_decoder_features(model, point, placement);
  out.hidden_states = decoder_states(model, ids, mask, out.image_features);
  out.logits = model.lm_head()->forward(out.hidden_states.back());
  return out;
}

TrainResult train_adapter(model::LlavaModel& teacher, model::LlavaModel& student,
                          const std::vector<eval::PreparedBatch>& batches, const TrainOptions& options) {
  const auto t0 = Clock::now();
  VLMOPT_CHECK_INPUT(!batches.empty(), "compensate: no training batches");
  VLMOPT_CHECK_INPUT(options.steps >= 0, "--steps: expected >= 0, got {}", options.steps);
  VLMOPT_CHECK_INPUT(options.lr > 0.0, "--lr: expected > 0, got {}", options.lr);
  VLMOPT_CHECK_INPUT(options.loss.gamma >= 0.0, "--gamma: expected >= 0, got {}", options.loss.gamma);
  VLMOPT_CHECK_INPUT(options.loss.tau > 0.0, "--tau: expected > 0 (inf = no entropy weighting), got {}",
                     options.loss.tau);
  VLMOPT_CHECK_INPUT(options.loss.probes >= 0, "--probes: expected >= 0, got {}", options.loss.probes);
  VLMOPT_CHECK_INPUT(options.max_nan_steps > 0, "--max-nan-steps: expected > 0, got {}", options.max_nan_steps);
  VLMOPT_CHECK_INPUT(teacher.config().text.hidden_size == student.config().text.hidden_size &&
                         teacher.language_model()->num_layers() == student.language_model()->num_layers(),
                     "compensate: the bundle's model and the teacher differ in shape (decoder width or depth)");
  freeze(teacher);
  freeze(student);
  const auto layers = resolve_layers(options.loss.feature_layers, student.language_model()->num_layers() + 1);
  VLMOPT_CHECK_INPUT(options.loss.projector_feature || !layers.empty(),
                     "compensate: no features to compare (no projector feature and no --feature-layers)");

  std::vector<CachedBatch> cache;
  for (const auto& b : batches) cache.push_back(cache_batch(teacher, student, b, layers, options.placement));

  const int64_t dim = cache.front().student_point.size(-1);
  TrainResult result;
  result.adapter = CompensatoryAdapter(dim, options.rank, options.seed, student.device());
  auto& adapter = *result.adapter;
  result.before = mean_loss(cache, teacher, student, adapter, options, layers);

  std::vector<torch::Tensor> params{adapter.down, adapter.up, adapter.gate};
  torch::optim::Adam optimizer(params, torch::optim::AdamOptions(options.lr));
  auto probe_generator = at::make_generator<at::CPUGeneratorImpl>(options.seed + 1);
  for (int64_t step = 0; step < options.steps; ++step) {
    const auto& c = cache[static_cast<size_t>(step) % cache.size()];
    optimizer.zero_grad();
    const auto loss = batch_loss(c, teacher, student, adapter, options, layers, probe_generator);
    CurvePoint point{step, false, loss.value()};
    bool finite = std::isfinite(point.loss.total);
    if (finite) {
      loss.total.backward();
      finite = all_finite(params);
    }
    if (!finite) {
      point.skipped = true;
      ++result.nan_steps;
      result.curve.push_back(point);
      spdlog::warn("compensate: step {}: non-finite loss or gradient, step skipped ({} of at most {})", step,
                   result.nan_steps, options.max_nan_steps);
      if (result.nan_steps >= options.max_nan_steps)
        throw Error(ExitCode::kFailure,
                    fmt::format("compensate: {} steps had a non-finite loss or gradient (--max-nan-steps {}); "
                                "aborted at step {}",
                                result.nan_steps, options.max_nan_steps, step));
      continue;
    }
    if (options.clip_grad_norm > 0.0) torch::nn::utils::clip_grad_norm_(params, options.clip_grad_norm);
    optimizer.step();
    result.curve.push_back(point);
    if (step % 10 == 0 || step + 1 == options.steps)
      spdlog::info("compensate: step {}/{} loss {:.6g} (perceptual {:.6g}, gradflow {:.6g}) gate {:.4g}", step + 1,
                   options.steps, point.loss.total, point.loss.perceptual, point.loss.gradflow,
                   adapter.gate.item<double>());
  }
  result.after = mean_loss(cache, teacher, student, adapter, options, layers);
  if (options.keep_only_if_better && options.steps > 0 && !(result.after.total < result.before.total)) {
    spdlog::warn("compensate: training did not lower the loss ({:.6g} -> {:.6g}); the adapter is reset to the identity",
                 result.before.total, result.after.total);
    torch::NoGradGuard no_grad;
    adapter.gate.zero_();
    result.accepted = false;
    result.after = mean_loss(cache, teacher, student, adapter, options, layers);
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return result;
}

namespace {

// Refuses the evaluation splits: the adapter is fit on calibration data only.
void check_training_data(const std::string& spec) {
  for (const char* split : {"builtin:eval", "builtin:stress"})
    VLMOPT_CHECK_INPUT(spec != split, "--data {}: expected calibration data (e.g. builtin:calib), got an evaluation split",
                       spec);
}

}  // namespace

nlohmann::json compensate(const CompensateOptions& options) {
  const auto t0 = Clock::now();
  VLMOPT_CHECK_INPUT(!options.bundle.empty(), "--bundle: expected a bundle directory, got nothing");
  VLMOPT_CHECK_INPUT(options.batch_size > 0, "--batch-size: expected a positive number, got {}", options.batch_size);
  VLMOPT_CHECK_INPUT(options.samples >= 0, "--samples: expected >= 0, got {}", options.samples);
  check_training_data(options.data);
  spdlog::info("compensate: {}", options.to_json().dump());

  eval::SessionOptions so;
  so.model = options.model;
  so.device = options.device;
  so.dtype = "float32";
  auto session = eval::VlmSession::open(so);
  const auto manifest = bundle::read_manifest(options.bundle);
  const auto source_hash = bundle::source_model_hash(session.model_dir());
  VLMOPT_CHECK_INPUT(manifest.source_model_sha256 == source_hash,
                     "{}: source_model_sha256: expected the teacher's {} ({}), got {} (the bundle was made from "
                     "another model)",
                     (options.bundle / bundle::kManifestPath).string(), source_hash, session.model_dir().string(),
                     manifest.source_model_sha256);

  runtime::RuntimeOptions ro;
  ro.kernels = runtime::KernelKind::kFakeQuant;
  ro.use_mp_cache = true;  // the student is the bundle exactly as `vlmopt eval --bundle` runs it
  ro.straight_through = true;
  auto loaded = runtime::load_bundle(options.bundle, session.model().device(), ro);
  const auto target = fold_target(options.train.placement);
  VLMOPT_CHECK_INPUT(std::find(loaded.quantized_layers.begin(), loaded.quantized_layers.end(), target) ==
                         loaded.quantized_layers.end(),
                     "{}: layer '{}': expected unquantized (the adapter folds into it), got quantized; keep the "
                     "projector in calibrate --ignore",
                     options.bundle.string(), target);

  const auto data = datasets::open_dataset(options.data);
  const int64_t available = static_cast<int64_t>(data->size());
  const int64_t count = options.samples == 0 ? available : std::min(options.samples, available);
  VLMOPT_CHECK_INPUT(count > 0, "{}: the dataset has no samples", options.data);
  std::vector<eval::PreparedBatch> batches;
  for (int64_t begin = 0; begin < count; begin += options.batch_size) {
    std::vector<datasets::Sample> samples;
    for (int64_t i = begin; i < std::min(count, begin + options.batch_size); ++i)
      samples.push_back(data->get(static_cast<size_t>(i)));
    batches.push_back(session.prepare(samples));
  }

  auto& student = loaded.model;
  auto trained = train_adapter(session.model(), student, batches, options.train);
  auto& adapter = *trained.adapter;

  model::Linear linear{nullptr};
  for (auto& [name, l] : student.linears())
    if (name == target) linear = l;
  VLMOPT_CHECK(!linear.is_empty(), "no Linear {}", target);
  const auto folded = fold(adapter, options.train.placement, linear->weight, linear->bias);

  // Fold check on the first batch: the folded projector against projector + adapter.
  nlohmann::json fold_check;
  {
    torch::NoGradGuard no_grad;
    const auto pixels = batches.front().pixel_values.to(student.device(), torch::kFloat32);
    const auto unfolded =
        to_decoder_features(student, adapter.forward(features_at(student, pixels, options.train.placement)),
                            options.train.placement);
    const auto w = linear->weight.clone(), b = linear->bias.defined() ? linear->bias.clone() : torch::Tensor();
    linear->weight.copy_(folded.weight);
    if (b.defined()) linear->bias.copy_(folded.bias);
    const auto folded_features = student.image_features(pixels);
    linear->weight.copy_(w);
    if (b.defined()) linear->bias.copy_(b);
    const double max_abs = (folded_features - unfolded).abs().max().item<double>();
    const double rel = ((folded_features - unfolded).norm() / unfolded.norm().clamp_min(kTiny)).item<double>();
    fold_check = {{"max_abs_delta", max_abs}, {"relative_delta", rel}};
    VLMOPT_CHECK(rel < 1e-4, "folded projector differs from projector + adapter (relative {})", rel);
  }

  nlohmann::json curve = nlohmann::json::array();
  for (const auto& p : trained.curve) {
    auto j = p.loss.to_json();
    j["step"] = p.step;
    if (p.skipped) j["skipped"] = true;
    curve.push_back(j);
  }
  nlohmann::json report = {{"format", "vlmopt-compensation-report"},
                           {"options", options.to_json()},
                           {"samples", count},
                           {"batches", batches.size()},
                           {"folded_into", target},
                           {"gate", adapter.gate.item<double>()},
                           {"delta_norm", (adapter.matrix() - torch::eye(adapter.dim(), torch::kFloat64).to(adapter.gate.device()))
                                              .norm()
                                              .item<double>()},
                           {"loss_before", trained.before.to_json()},
                           {"loss_after", trained.after.to_json()},
                           {"nan_steps", trained.nan_steps},
                           {"accepted", trained.accepted},
                           {"fold_check", fold_check},
                           {"train_seconds", trained.seconds},
                           {"curve", curve}};

  bundle::BundleUpdate update;
  update.step = "compensate";
  update.options = options.to_json();
  update.replace_tensors[target + ".weight"] = folded.weight.to(torch::kCPU);
  if (folded.bias.defined()) update.replace_tensors[target + ".bias"] = folded.bias.to(torch::kCPU);
  const std::string report_text = report.dump(2) + "\n";
  update.apply = [&](const fs::path& root) {
    fs::create_directories(root / "vlmopt" / "reports");
    save_adapter(root / "vlmopt" / "adapter.safetensors", adapter, options.train.placement);
    io::write_file_atomic(root / "vlmopt" / "reports" / "compensation.json", report_text);
  };
  bundle::update_bundle(options.bundle, update);
  report["seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
  report["bundle"] = options.bundle.string();
  report["adapter"] = (options.bundle / "vlmopt" / "adapter.safetensors").string();
  report["report"] = (options.bundle / "vlmopt" / "reports" / "compensation.json").string();
  return report;
}

}  // namespace vlmopt::compensate
