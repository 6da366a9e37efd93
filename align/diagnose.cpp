#include "align/diagnose.hpp"

#include "align/report_html.hpp"
#include "io/atomic_file.hpp"
#include "model/layers.hpp"
#include "util/error.hpp"
#include "util/version.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

namespace vlmopt::align {

namespace {

// Reduce over dims 0 and 1. Spelled `sum({0, 1})`, torch 2.11's headers find it ambiguous: the
// braces also build a DimnameList from (pointer 0, length 1).
constexpr std::array<int64_t, 2> kLeadingTwoDims{0, 1};

// Unsubscribes its taps on scope exit (also when the forward throws).
class TapSubscriptions {
 public:
  explicit TapSubscriptions(model::Taps& taps) : taps_(taps) {}
  ~TapSubscriptions() {
    for (const int id : ids_) taps_.unsubscribe(id);
  }
  TapSubscriptions(const TapSubscriptions&) = delete;
  TapSubscriptions& operator=(const TapSubscriptions&) = delete;
  void add(std::string pattern, model::Taps::Callback callback) {
    ids_.push_back(taps_.subscribe(std::move(pattern), std::move(callback)));
  }

 private:
  model::Taps& taps_;
  std::vector<int> ids_;
};

std::span<const double> row_span(const torch::Tensor& contiguous_double, int64_t row) {
  const auto n = contiguous_double.size(-1);
  return {contiguous_double.data_ptr<double>() + row * n, static_cast<size_t>(n)};
}

std::vector<int64_t> eos_ids_of(eval::VlmSession& session) {
  auto ids = session.model().config().text.eos_token_ids;
  if (ids.empty() && session.tokenizer().eos_id()) ids.push_back(*session.tokenizer().eos_id());
  return ids;
}

// Sum of log p(answer token | prefix) over the answer tokens, nats.
double answer_log_prob(model::LlavaModel& model, const torch::Tensor& ids, const torch::Tensor& mask,
                       const torch::Tensor& positions, const torch::Tensor& pixels, int64_t answer_tokens) {
  model::ForwardInputs in;
  in.input_ids = ids;
  in.attention_mask = mask;
  in.position_ids = positions;
  in.pixel_values = pixels;
  in.logits_to_keep = answer_tokens + 1;
  const auto out = model.forward(in);
  // Position T-1+i predicts answer token i; the last kept logit predicts nothing.
  const auto logits = out.logits[0].slice(0, 0, answer_tokens).to(torch::kCPU, torch::kFloat64);
  const auto targets = ids[0].slice(0, ids.size(1) - answer_tokens).to(torch::kCPU);
  const auto logp = torch::log_softmax(logits, -1).gather(1, targets.unsqueeze(1));
  return logp.sum().item<double>();
}

struct Aggregate {
  double attn_mass = 0.0, tau_align = 0.0, tau_norm = 0.0, topk_mass = 0.0, pos_bias = 0.0;
};

// Head metrics of a [H,N] map set.
std::vector<MapMetrics> head_metrics(const torch::Tensor& maps) {
  const auto c = maps.contiguous();
  std::vector<MapMetrics> out;
  for (int64_t h = 0; h < c.size(0); ++h) out.push_back(map_metrics(row_span(c, h)));
  return out;
}

// Visual mass: plain mean over heads; the rest weighted by each head's visual
// mass, so heads that barely look at the image do not dominate (docs/align.md).
Aggregate aggregate_heads(const std::vector<MapMetrics>& heads) {
  Aggregate a;
  double weight = 0.0;
  for (const auto& m : heads) weight += m.attn_mass;
  for (const auto& m : heads) {
    const double w = weight > 0.0 ? m.attn_mass / weight : 1.0 / static_cast<double>(heads.size());
    a.attn_mass += m.attn_mass / static_cast<double>(heads.size());
    a.tau_align += w * m.tau_align;
    a.tau_norm += w * m.tau_norm;
    a.topk_mass += w * m.topk_mass;
    a.pos_bias += w * m.pos_bias;
  }
  return a;
}

nlohmann::json heads_json(const std::vector<MapMetrics>& heads) {
  std::vector<double> mass, tau, tau_norm, topk, pos;
  for (const auto& m : heads) {
    mass.push_back(m.attn_mass);
    tau.push_back(m.tau_align);
    tau_norm.push_back(m.tau_norm);
    topk.push_back(m.topk_mass);
    pos.push_back(m.pos_bias);
  }
  return {{"attn_mass", mass}, {"tau_align", tau}, {"tau_norm", tau_norm}, {"topk_mass", topk}, {"pos_bias", pos}};
}

nlohmann::json aggregate_json(const Aggregate& a) {
  return {{"attn_mass", a.attn_mass}, {"tau_align", a.tau_align}, {"tau_norm", a.tau_norm},
          {"topk_mass", a.topk_mass}, {"pos_bias", a.pos_bias}};
}

// [L,N]: each layer's text->visual map summed over heads (= mass-weighted head average).
torch::Tensor layer_maps(const SampleAnalysis& a) { return a.text_maps.sum(1).contiguous(); }

// [N]: the text->visual map summed over layers and heads.
torch::Tensor overall_map(const SampleAnalysis& a) { return a.text_maps.sum(kLeadingTwoDims).contiguous(); }

// Visual tokens that get more than sink_factor / N of the renormalised text->visual
// attention in more than sink_head_share of the (layer, head) maps.
std::vector<int64_t> attention_sinks(const SampleAnalysis& a, double sink_factor, double sink_head_share) {
  const auto maps = a.text_maps.reshape({-1, a.text_maps.size(-1)}).contiguous();
  const auto n = maps.size(1);
  std::vector<int64_t> counts(static_cast<size_t>(n), 0);
  for (int64_t r = 0; r < maps.size(0); ++r) {
    const auto p = renormalise(row_span(maps, r));
    for (int64_t j = 0; j < n; ++j)
      if (p[static_cast<size_t>(j)] > sink_factor / static_cast<double>(n)) ++counts[static_cast<size_t>(j)];
  }
  std::vector<int64_t> sinks;
  for (int64_t j = 0; j < n; ++j)
    if (static_cast<double>(counts[static_cast<size_t>(j)]) > sink_head_share * static_cast<double>(maps.size(0)))
      sinks.push_back(j);
  return sinks;
}

// Frame sequences: the answer rows' attention mass per frame and Δt_sem
// (docs/align.md §Frame sequences: Δt_sem); null for still images.
nlohmann::json dt_sem_record(const SampleAnalysis& a, double threshold_ms) {
  if (a.images <= 1) return nullptr;
  // Mean over the answer rows (per layer and head, in analyze_sample), then over layers and heads: [N].
  const auto answer_map = (a.answer_maps.defined() ? a.answer_maps : a.last_maps).mean(kLeadingTwoDims).contiguous();
  const auto mass = frame_masses(row_span(answer_map, 0), a.images);
  nlohmann::json rec = {{"frames", a.images}, {"query", "answer"}, {"answer_rows", a.answer_rows}, {"frame_mass", mass}};
  if (a.frame_times_ms.empty() || !a.event_time_ms) return rec;
  const auto d = temporal_delay(mass, a.frame_times_ms, *a.event_time_ms, threshold_ms);
  rec["frame_times_ms"] = a.frame_times_ms;
  rec["event_time_ms"] = *a.event_time_ms;
  rec["attended_frame"] = d.attended_frame;
  rec["dt_sem_ms"] = d.dt_sem_ms;
  rec["threshold_ms"] = threshold_ms;
  rec["flagged"] = d.flagged;
  return rec;
}

nlohmann::json sample_record(const SampleAnalysis& a, const DiagnoseOptions& options) {
  const auto layers = a.text_maps.size(0);
  nlohmann::json layer_records = nlohmann::json::array();
  Aggregate mean_text, mean_last;
  const auto per_layer = layer_maps(a);
  std::vector<double> drift;
  for (int64_t l = 0; l < layers; ++l) {
    const auto text_heads = head_metrics(a.text_maps[l]);
    const auto last_heads = head_metrics(a.last_maps[l]);
    const auto t = aggregate_heads(text_heads), s = aggregate_heads(last_heads);
    auto rec = aggregate_json(t);
    rec["layer"] = l;
    rec["last"] = aggregate_json(s);
    rec["heads"] = heads_json(text_heads);
    rec["last_heads"] = heads_json(last_heads);
    if (l + 1 < layers) {
      drift.push_back(js_divergence(row_span(per_layer, l), row_span(per_layer, l + 1)));
      rec["js_to_next"] = drift.back();
    } else {
      rec["js_to_next"] = nullptr;
    }
    layer_records.push_back(std::move(rec));
    const auto accumulate_layer = [&](Aggregate& mean, const Aggregate& layer) {
      const auto share = 1.0 / static_cast<double>(layers);
      mean.attn_mass += share * layer.attn_mass;
      mean.tau_align += share * layer.tau_align;
      mean.tau_norm += share * layer.tau_norm;
      mean.topk_mass += share * layer.topk_mass;
      mean.pos_bias += share * layer.pos_bias;
    };
    accumulate_layer(mean_text, t);
    accumulate_layer(mean_last, s);
  }
  const auto sinks = attention_sinks(a, options.sink_factor, options.sink_head_share);
  nlohmann::json metrics = aggregate_json(mean_text);
  metrics["last_attn_mass"] = mean_last.attn_mass;
  metrics["last_tau_align"] = mean_last.tau_align;
  metrics["js_drift"] = drift.empty() ? 0.0 : std::accumulate(drift.begin(), drift.end(), 0.0) / static_cast<double>(drift.size());
  metrics["modality_gap"] = a.modality_gap;
  metrics["sink_tokens"] = static_cast<int64_t>(sinks.size());
  if (a.knockout_delta) metrics["knockout_delta"] = *a.knockout_delta;
  if (a.knockout_delta_random) metrics["knockout_delta_random"] = *a.knockout_delta_random;
  const auto dt_sem = dt_sem_record(a, options.dt_sem_threshold_ms);
  if (dt_sem.contains("dt_sem_ms")) metrics["dt_sem_ms"] = dt_sem["dt_sem_ms"];

  nlohmann::json rec = {{"id", a.id},
                        {"question", a.question},
                        {"answer", a.answer},
                        {"prediction", a.prediction},
                        {"correct", a.prediction == eval::normalize_answer(a.answer)},
                        {"visual_tokens", a.visual_tokens},
                        {"text_queries", a.text_queries},
                        {"metrics", std::move(metrics)},
                        {"sinks", sinks},
                        {"massive_visual_tokens", a.massive_visual_tokens},
                        {"massive_text_tokens", a.massive_text_tokens},
                        {"layers", std::move(layer_records)},
                        {"dt_sem", dt_sem}};
  if (a.knockout_delta) {
    rec["knockout"] = {{"k", a.knockout_k},
                       {"answer_tokens", a.answer_tokens},
                       {"delta", *a.knockout_delta},
                       {"delta_random", a.knockout_delta_random ? nlohmann::json(*a.knockout_delta_random) : nlohmann::json()}};
  } else {
    rec["knockout"] = nullptr;
  }
  return rec;
}

nlohmann::json stats_json(std::vector<double> values) {
  if (values.empty()) return {{"n", 0}};
  std::sort(values.begin(), values.end());
  const auto n = values.size();
  const auto quantile = [&](double q) { return values[static_cast<size_t>(std::floor(q * static_cast<double>(n - 1)))]; };
  return {{"n", n},
          {"mean", std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(n)},
          {"median", quantile(0.5)},
          {"p95", quantile(0.95)},
          {"min", values.front()},
          {"max", values.back()}};
}

double mean_of(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// Per-layer means over samples of the sample records' layer entries.
nlohmann::json layer_aggregates(const nlohmann::json& samples, int64_t layers, int64_t heads) {
  nlohmann::json out = nlohmann::json::array();
  const std::vector<std::string> keys = {"attn_mass", "tau_align", "tau_norm", "topk_mass", "pos_bias"};
  for (int64_t l = 0; l < layers; ++l) {
    nlohmann::json rec = {{"layer", l}};
    std::map<std::string, std::vector<double>> values;
    std::map<std::string, std::vector<double>> head_sums;
    for (const auto& key : keys) head_sums[key].assign(static_cast<size_t>(heads), 0.0);
    for (const auto& s : samples) {
      const auto& lr = s["layers"][static_cast<size_t>(l)];
      for (const auto& key : keys) {
        values[key].push_back(lr[key].get<double>());
        for (int64_t h = 0; h < heads; ++h) head_sums[key][static_cast<size_t>(h)] += lr["heads"][key][static_cast<size_t>(h)].get<double>();
      }
      values["last_attn_mass"].push_back(lr["last"]["attn_mass"].get<double>());
      values["last_tau_align"].push_back(lr["last"]["tau_align"].get<double>());
      if (!lr["js_to_next"].is_null()) values["js_to_next"].push_back(lr["js_to_next"].get<double>());
      if (lr.contains("cmp_js")) values["cmp_js"].push_back(lr["cmp_js"].get<double>());
    }
    for (const auto& [key, v] : values) rec[key] = mean_of(v);
    if (!values.count("js_to_next")) rec["js_to_next"] = nullptr;
    nlohmann::json head_means;
    for (auto& [key, sums] : head_sums) {
      for (auto& x : sums) x /= static_cast<double>(std::max<size_t>(1, samples.size()));
      head_means[key] = sums;
    }
    rec["heads"] = std::move(head_means);
    out.push_back(std::move(rec));
  }
  return out;
}

std::vector<Gate> parse_gates(const DiagnoseOptions& options) {
  std::vector<Gate> gates;
  for (const auto& expr : options.fail_on) {
    auto gate = parse_gate(expr);
    if (gate.metric.rfind("cmp_", 0) == 0 && options.bundle.empty())
      throw Error(ExitCode::kUsage, fmt::format("--fail-on '{}': metric '{}' compares with an optimized bundle and needs --bundle",
                                                expr, gate.metric));
    // Without knock-out samples the gate would see no values and pass without measuring anything.
    if (gate.metric == "knockout_delta" && options.knockout_limit == 0)
      throw Error(ExitCode::kUsage,
                  fmt::format("--fail-on '{}': metric 'knockout_delta' is measured on the first --knockout-limit "
                              "samples and needs --knockout-limit > 0",
                              expr));
    gates.push_back(std::move(gate));
  }
  return gates;
}

}  // namespace

SampleAnalysis analyze_sample(eval::VlmSession& session, const datasets::Sample& sample,
                              const AnalysisOptions& options) {
  torch::NoGradGuard no_grad;
  auto& model = session.model();
  const auto device = model.device();
  const auto batch = session.prepare({sample});
  const auto ids = batch.input_ids;  // [1,T]
  const int64_t tokens = ids.size(1);
  const auto image_mask = model.image_token_mask(ids)[0].to(torch::kCPU);
  const auto valid = batch.attention_mask[0].to(torch::kCPU) != 0;
  const auto image_positions = (image_mask & valid).nonzero().flatten();  // [N]
  const int64_t visual = image_positions.size(0);
  VLMOPT_CHECK_INPUT(visual > 0, "{}: the prompt has no image tokens", sample.id);
  const int64_t last_image = image_positions[visual - 1].item<int64_t>();
  const auto positions = torch::arange(tokens, torch::kLong);
  auto text_rows = ((positions > last_image) & valid & image_mask.logical_not()).nonzero().flatten();
  if (text_rows.numel() == 0) text_rows = torch::full({1}, tokens - 1, torch::kLong);

  SampleAnalysis a;
  a.id = sample.id;
  a.question = sample.question;
  a.answer = sample.answer;
  a.visual_tokens = visual;
  a.text_queries = text_rows.numel();
  a.images = 1 + static_cast<int64_t>(sample.frames.size());
  VLMOPT_CHECK_INPUT(visual % a.images == 0, "{}: {} image tokens do not split into {} frames", sample.id, visual,
                     a.images);
  if (a.images > 1 && sample.meta.is_object() && sample.meta.contains("frame_times_ms") &&
      sample.meta.contains("event_time_ms")) {
    const auto& times = sample.meta["frame_times_ms"];
    const auto& event = sample.meta["event_time_ms"];
    VLMOPT_CHECK_INPUT(times.is_array() && static_cast<int64_t>(times.size()) == a.images,
                       "{}: meta.frame_times_ms: expected {} numbers, got {}", sample.id, a.images, times.dump());
    for (const auto& t : times) {
      VLMOPT_CHECK_INPUT(t.is_number(), "{}: meta.frame_times_ms: expected numbers, got {}", sample.id, times.dump());
      a.frame_times_ms.push_back(t.get<double>());
    }
    VLMOPT_CHECK_INPUT(event.is_number(), "{}: meta.event_time_ms: expected a number, got {}", sample.id, event.dump());
    a.event_time_ms = event.get<double>();
  }

  const int64_t layers = model.config().text.num_hidden_layers;
  std::vector<torch::Tensor> text_maps(static_cast<size_t>(layers)), last_maps(static_cast<size_t>(layers));
  std::vector<torch::Tensor> peaks(static_cast<size_t>(layers));
  const auto image_idx = image_positions.to(device), text_idx = text_rows.to(device);
  model::ForwardInputs in;
  in.input_ids = ids;
  in.attention_mask = batch.attention_mask;
  in.pixel_values = batch.pixel_values;
  in.logits_to_keep = 1;
  torch::Tensor image_features;
  {
    TapSubscriptions subs(model.taps());
    for (int64_t l = 0; l < layers; ++l) {
      const auto slot = static_cast<size_t>(l);
      subs.add(fmt::format("model.language_model.layers.{}.self_attn.probs", l),
               [&, slot](std::string_view, const torch::Tensor& probs, const model::TapContext&) {
                 const auto p = probs[0];  // [H,T,T]
                 text_maps[slot] = p.index_select(1, text_idx).index_select(2, image_idx).to(torch::kCPU, torch::kFloat64).mean(1);
                 last_maps[slot] = p.select(1, tokens - 1).index_select(1, image_idx).to(torch::kCPU, torch::kFloat64);
               });
      subs.add(fmt::format("model.language_model.hidden_states.{}", l + 1),
               [&, slot](std::string_view, const torch::Tensor& hidden, const model::TapContext&) {
                 peaks[slot] = hidden[0].abs().amax(-1).to(torch::kCPU, torch::kFloat64);  // [T]
               });
    }
    image_features = model.forward(in).image_features;
  }
  for (int64_t l = 0; l < layers; ++l)
    VLMOPT_CHECK(text_maps[static_cast<size_t>(l)].defined() && peaks[static_cast<size_t>(l)].defined(),
                 "decoder layer {} emitted no attention probabilities or hidden states", l);
  a.text_maps = torch::stack(text_maps).contiguous();  // [L,H,N]
  a.last_maps = torch::stack(last_maps).contiguous();
  VLMOPT_CHECK(image_features.defined() && image_features.numel() / image_features.size(-1) == visual,
               "projector output rows vs {} image tokens", visual);
  a.projector_output = image_features.reshape({visual, -1}).to(torch::kCPU, torch::kFloat32).contiguous();

  // Modality gap: unit-normalised projector rows vs unit-normalised embeddings of the prompt's text tokens.
  {
    namespace F = torch::nn::functional;
    const auto text_ids = ids[0].to(torch::kCPU).index({valid & image_mask.logical_not()});
    const auto text_emb = model.language_model()->embed(text_ids.unsqueeze(0).to(device))[0].to(torch::kCPU, torch::kFloat64);
    const auto norm = F::NormalizeFuncOptions().dim(-1);
    const auto mu_image = F::normalize(a.projector_output.to(torch::kFloat64), norm).mean(0);
    const auto mu_text = F::normalize(text_emb, norm).mean(0);
    a.modality_gap = (mu_image - mu_text).norm().item<double>();
  }

  // Massive activations: a token whose largest |hidden| exceeds massive_factor x the median over tokens.
  {
    std::set<int64_t> visual_massive, text_massive;
    std::vector<int64_t> visual_index(static_cast<size_t>(tokens), -1);
    for (int64_t j = 0; j < visual; ++j) visual_index[static_cast<size_t>(image_positions[j].item<int64_t>())] = j;
    for (const auto& peak : peaks) {
      const double median = peak.index({valid}).median().item<double>();
      const auto massive = (peak > options.massive_factor * median) & valid;
      const auto where = massive.nonzero().flatten();
      for (int64_t i = 0; i < where.numel(); ++i) {
        const auto t = where[i].item<int64_t>();
        if (visual_index[static_cast<size_t>(t)] >= 0) {
          visual_massive.insert(visual_index[static_cast<size_t>(t)]);
        } else {
          text_massive.insert(t);
        }
      }
    }
    a.massive_visual_tokens.assign(visual_massive.begin(), visual_massive.end());
    a.massive_text_tokens = static_cast<int64_t>(text_massive.size());
  }

  // Greedy answer (no taps subscribed: decode steps are not part of the metrics).
  model::ForwardInputs prompt;
  prompt.input_ids = ids;
  prompt.attention_mask = batch.attention_mask;
  prompt.pixel_values = batch.pixel_values;
  const auto generated =
      model.generate_greedy(prompt, session.options().max_new_tokens, eos_ids_of(session)).front();
  a.prediction = eval::normalize_answer(session.tokenizer().decode(generated, /*skip_special_tokens=*/true));
  a.answer_tokens = static_cast<int64_t>(generated.size());

  // Frame sequences: the text->visual maps of the rows that emit the answer's
  // tokens (EOS excluded): the last prompt row emits the first, the row of answer
  // token i emits token i+1. One answer token: the last-row maps already are that.
  if (a.images > 1) {
    const auto eos = eos_ids_of(session);
    std::vector<int64_t> answer(generated.begin(), std::find_first_of(generated.begin(), generated.end(), eos.begin(), eos.end()));
    const auto rows = std::max<int64_t>(1, static_cast<int64_t>(answer.size()));
    a.answer_rows = rows;
    if (rows == 1) {
      a.answer_maps = a.last_maps;
    } else {
      answer.pop_back();  // the last answer token emits only EOS or nothing
      const auto extra = torch::tensor(answer, torch::kLong).unsqueeze(0).to(device);
      model::ForwardInputs full;
      full.input_ids = torch::cat({ids, extra}, 1);
      full.attention_mask = torch::cat({batch.attention_mask.to(torch::kLong), torch::ones({1, rows - 1}, torch::kLong).to(device)}, 1);
      full.pixel_values = batch.pixel_values;
      full.logits_to_keep = 1;
      const auto answer_idx = torch::arange(tokens - 1, tokens - 1 + rows, torch::kLong).to(device);
      std::vector<torch::Tensor> maps(static_cast<size_t>(layers));
      {
        TapSubscriptions subs(model.taps());
        for (int64_t l = 0; l < layers; ++l) {
          const auto slot = static_cast<size_t>(l);
          subs.add(fmt::format("model.language_model.layers.{}.self_attn.probs", l),
                   [&, slot](std::string_view, const torch::Tensor& probs, const model::TapContext&) {
                     maps[slot] = probs[0].index_select(1, answer_idx).index_select(2, image_idx).to(torch::kCPU, torch::kFloat64).mean(1);
                   });
        }
        (void)model.forward(full);
      }
      for (const auto& m : maps) VLMOPT_CHECK(m.defined(), "a decoder layer emitted no attention probabilities");
      a.answer_maps = torch::stack(maps).contiguous();  // [L,H,N]
    }
  }

  if (options.knockout && !generated.empty()) {
    const int64_t n = a.answer_tokens;
    const auto answer = torch::tensor(generated, torch::kLong).unsqueeze(0).to(device);
    const auto full_ids = torch::cat({ids, answer}, 1);
    const auto mask = torch::cat({batch.attention_mask.to(torch::kLong), torch::ones({1, n}, torch::kLong).to(device)}, 1);
    // Positions fixed from the unmasked sequence: knocking tokens out must not shift the others.
    const auto pos = model.default_position_ids(mask, 1, tokens + n, 0);
    const double base = answer_log_prob(model, full_ids, mask, pos, batch.pixel_values, n);
    a.knockout_k = top_k_count(visual);
    const auto knock = [&](const torch::Tensor& visual_indices) {
      auto knocked = mask.clone();
      knocked.select(0, 0).index_fill_(0, image_positions.index({visual_indices}).to(device), 0);
      return answer_log_prob(model, full_ids, knocked, pos, batch.pixel_values, n) - base;
    };
    const auto top = std::get<1>(overall_map(a).topk(a.knockout_k));
    a.knockout_delta = knock(top);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(options.seed);
    const auto random = torch::randperm(visual, gen, torch::kLong).slice(0, 0, a.knockout_k);
    a.knockout_delta_random = knock(random);
  }
  return a;
}

bool DiagnoseResult::gates_passed() const {
  return std::all_of(gates.begin(), gates.end(), [](const GateResult& g) { return g.passed; });
}

std::optional<double> sample_metric(const nlohmann::json& sample_record, const std::string& metric) {
  const auto m = sample_record.find("metrics");
  if (m == sample_record.end()) return std::nullopt;
  const auto v = m->find(metric);
  if (v == m->end() || !v->is_number()) return std::nullopt;
  return v->get<double>();
}

DiagnoseResult diagnose(const DiagnoseOptions& options) {
  const auto gates = parse_gates(options);
  VLMOPT_CHECK_INPUT(!options.out.empty(), "--out: an output directory is required");
  VLMOPT_CHECK_INPUT(options.limit >= 0, "--limit: expected >= 0, got {}", options.limit);
  VLMOPT_CHECK_INPUT(options.knockout_limit >= 0, "--knockout-limit: expected >= 0, got {}", options.knockout_limit);
  VLMOPT_CHECK_INPUT(std::isfinite(options.tau_threshold) && options.tau_threshold >= 0.0,
                     "--tau-threshold: expected a non-negative number, got {}", options.tau_threshold);
  VLMOPT_CHECK_INPUT(options.sink_factor > 0.0, "--sink-factor: expected > 0, got {}", options.sink_factor);
  VLMOPT_CHECK_INPUT(std::isfinite(options.dt_sem_threshold_ms) && options.dt_sem_threshold_ms >= 0.0,
                     "--dt-sem-threshold-ms: expected a non-negative number, got {}", options.dt_sem_threshold_ms);
  const auto started = std::chrono::steady_clock::now();

  auto source = datasets::open_dataset(options.data);
  const int64_t total = options.limit > 0 ? std::min<int64_t>(options.limit, static_cast<int64_t>(source->size()))
                                          : static_cast<int64_t>(source->size());
  VLMOPT_CHECK_INPUT(total > 0, "{}: dataset is empty", options.data);

  std::vector<SampleAnalysis> analyses;
  std::vector<std::vector<cv::Mat>> images;  // per sample: the image, then its frames
  nlohmann::json model_info;
  std::string model_dir;
  {
    auto session_options = options.session;
    session_options.bundle.clear();
    auto session = eval::VlmSession::open(session_options);
    model_dir = session.model_dir().string();
    const auto& text = session.model().config().text;
    model_info = {{"dir", model_dir},
                  {"layers", text.num_hidden_layers},
                  {"heads", text.num_attention_heads},
                  {"visual_tokens", session.model().config().image_tokens_per_image()}};
    for (int64_t i = 0; i < total; ++i) {
      const auto sample = source->get(static_cast<size_t>(i));
      AnalysisOptions ao;
      ao.knockout = i < options.knockout_limit;
      ao.seed = static_cast<uint64_t>(i);
      ao.massive_factor = options.massive_factor;
      analyses.push_back(analyze_sample(session, sample, ao));
      images.push_back({sample.image.clone()});
      for (const auto& frame : sample.frames) images.back().push_back(frame.clone());
      spdlog::debug("diagnose-align: {}/{} {}", i + 1, total, sample.id);
    }
  }

  nlohmann::json samples = nlohmann::json::array();
  for (const auto& a : analyses) samples.push_back(sample_record(a, options));

  nlohmann::json compare = nullptr;
  if (!options.bundle.empty()) {
    auto session_options = options.session;
    session_options.bundle = options.bundle;
    session_options.kernels = options.kernels;
    session_options.use_mp_cache = options.use_mp_cache;
    // Attention maps are compared token for token: a bundle's prune.json (which drops
    // visual tokens) is not applied here; pruning is measured by eval instead.
    session_options.prune.apply_bundle_plan = false;
    session_options.prune.config.clear();
    session_options.prune.rule.clear();
    auto session = eval::VlmSession::open(session_options);
    std::vector<double> js_all, cos_all;
    for (int64_t i = 0; i < total; ++i) {
      const auto sample = source->get(static_cast<size_t>(i));
      const auto b = analyze_sample(session, sample, AnalysisOptions{false, 0, options.massive_factor});
      const auto& o = analyses[static_cast<size_t>(i)];
      VLMOPT_CHECK_INPUT(b.text_maps.sizes() == o.text_maps.sizes(),
                         "{}: the bundle's attention maps {} do not match the model's {} (different architecture?)",
                         options.bundle, model::shape_string(b.text_maps.sizes()), model::shape_string(o.text_maps.sizes()));
      const auto maps_o = layer_maps(o), maps_b = layer_maps(b);
      auto& rec = samples[static_cast<size_t>(i)];
      std::vector<double> js;
      for (int64_t l = 0; l < maps_o.size(0); ++l) {
        js.push_back(js_divergence(row_span(maps_o, l), row_span(maps_b, l)));
        rec["layers"][static_cast<size_t>(l)]["cmp_js"] = js.back();
      }
      const auto po = o.projector_output.to(torch::kFloat64), pb = b.projector_output.to(torch::kFloat64);
      const double cos = torch::nn::functional::cosine_similarity(po, pb, torch::nn::functional::CosineSimilarityFuncOptions().dim(-1))
                             .mean()
                             .item<double>();
      rec["metrics"]["cmp_js"] = mean_of(js);
      rec["metrics"]["cmp_projector_cos"] = cos;
      const auto brec = sample_record(b, options);
      rec["bundle"] = {{"prediction", b.prediction}, {"metrics", brec["metrics"]}, {"dt_sem", brec["dt_sem"]}};
      js_all.push_back(mean_of(js));
      cos_all.push_back(cos);
    }
    compare = {{"bundle", options.bundle}, {"kernels", options.kernels}, {"use_mp_cache", options.use_mp_cache},
               {"cmp_js", stats_json(js_all)}, {"cmp_projector_cos", stats_json(cos_all)}};
  }

  // Flags: tau_align above the threshold, and every gate a sample violates.
  std::vector<GateResult> gate_results;
  for (auto& rec : samples) rec["flags"] = nlohmann::json::array();
  for (auto& rec : samples) {
    if (rec["metrics"]["tau_align"].get<double>() > options.tau_threshold)
      rec["flags"].push_back(fmt::format("tau_align>{}", options.tau_threshold));
    if (rec["dt_sem"].is_object() && rec["dt_sem"].value("flagged", false))
      rec["flags"].push_back(fmt::format("dt_sem_ms>{}", options.dt_sem_threshold_ms));
  }
  for (const auto& gate : gates) {
    std::vector<double> values;
    for (auto& rec : samples) {
      const auto v = sample_metric(rec, gate.metric);
      if (!v) continue;
      values.push_back(*v);
      if (violates(gate, *v)) rec["flags"].push_back("gate:" + gate.expression);
    }
    gate_results.push_back(evaluate_gate(gate, values));
  }
  nlohmann::json flagged = nlohmann::json::array();
  for (auto& rec : samples) {
    rec["flagged"] = !rec["flags"].empty();
    if (rec["flagged"].get<bool>()) flagged.push_back(rec["id"]);
  }

  nlohmann::json summary = {{"samples", total},
                            {"flagged", flagged.size()},
                            {"flagged_fraction", static_cast<double>(flagged.size()) / static_cast<double>(total)},
                            {"tau_threshold", options.tau_threshold}};
  int64_t correct = 0;
  for (const auto& rec : samples) correct += rec["correct"].get<bool>();
  summary["accuracy"] = static_cast<double>(correct) / static_cast<double>(total);
  {
    std::vector<double> delays;
    int64_t late = 0;
    for (const auto& rec : samples)
      if (rec["dt_sem"].is_object() && rec["dt_sem"].contains("dt_sem_ms")) {
        delays.push_back(rec["dt_sem"]["dt_sem_ms"].get<double>());
        late += rec["dt_sem"]["flagged"].get<bool>();
      }
    summary["dt_sem"] = {{"threshold_ms", options.dt_sem_threshold_ms},
                         {"samples", delays.size()},
                         {"flagged", late},
                         {"flagged_fraction", delays.empty() ? 0.0 : static_cast<double>(late) / static_cast<double>(delays.size())},
                         {"mean_ms", delays.empty() ? nlohmann::json() : nlohmann::json(mean_of(delays))}};
  }
  nlohmann::json metric_stats;
  for (const auto& name : gate_metrics()) {
    std::vector<double> values;
    for (const auto& rec : samples)
      if (const auto v = sample_metric(rec, name)) values.push_back(*v);
    if (!values.empty()) metric_stats[name] = stats_json(std::move(values));
  }
  {
    std::vector<double> random;
    for (const auto& rec : samples)
      if (const auto v = sample_metric(rec, "knockout_delta_random")) random.push_back(*v);
    if (!random.empty()) metric_stats["knockout_delta_random"] = stats_json(std::move(random));
  }
  summary["metrics"] = std::move(metric_stats);
  nlohmann::json gates_json = nlohmann::json::array();
  for (const auto& g : gate_results)
    gates_json.push_back({{"expression", g.gate.expression},
                          {"metric", g.gate.metric},
                          {"op", g.gate.greater ? ">" : "<"},
                          {"threshold", g.gate.threshold},
                          {"max_fraction", g.gate.max_fraction},
                          {"samples", g.samples},
                          {"violating", g.violating},
                          {"fraction", g.fraction},
                          {"passed", g.passed}});
  summary["gates"] = std::move(gates_json);

  const auto layers = model_info["layers"].get<int64_t>(), heads = model_info["heads"].get<int64_t>();
  nlohmann::json report = {
      {"schema", kAlignSchema},
      {"vlmopt_version", kVersion},
      {"config",
       {{"model", options.session.model},
        {"bundle", options.bundle.empty() ? nlohmann::json() : nlohmann::json(options.bundle)},
        {"data", options.data},
        {"dataset", source->describe()},
        {"limit", options.limit},
        {"device", options.session.device},
        {"dtype", options.session.dtype},
        {"prompt_template", options.session.prompt_template},
        {"max_new_tokens", options.session.max_new_tokens},
        {"tau_threshold", options.tau_threshold},
        {"dt_sem_threshold_ms", options.dt_sem_threshold_ms},
        {"sink_factor", options.sink_factor},
        {"sink_head_share", options.sink_head_share},
        {"massive_factor", options.massive_factor},
        {"knockout_limit", options.knockout_limit},
        {"fail_on", options.fail_on}}},
      {"model", model_info},
      {"summary", std::move(summary)},
      {"layers", layer_aggregates(samples, layers, heads)},
      {"compare", compare},
      {"flagged", flagged},
      {"samples", samples}};
  report["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

  DiagnoseResult result;
  result.gates = gate_results;
  std::filesystem::create_directories(options.out);
  result.json_path = options.out / "align.json";
  io::write_file_atomic(result.json_path, report.dump(1) + "\n");
  if (options.write_html) {
    // Heatmaps: flagged samples first, then the others in dataset order.
    std::vector<size_t> order;
    for (size_t i = 0; i < analyses.size(); ++i)
      if (samples[i]["flagged"].get<bool>()) order.push_back(i);
    for (size_t i = 0; i < analyses.size(); ++i)
      if (!samples[i]["flagged"].get<bool>()) order.push_back(i);
    std::vector<HeatmapFigure> figures;
    for (const size_t i : order) {
      if (static_cast<int64_t>(figures.size()) >= options.heatmaps) break;
      const auto map = overall_map(analyses[i]);
      auto weights = row_span(map, 0);
      size_t frame = 0;
      std::string frame_note;
      if (const auto& dt = samples[i]["dt_sem"]; dt.is_object()) {
        // A clip: the heatmap of the frame the answer row attends to most, over that frame.
        const auto mass = dt["frame_mass"].get<std::vector<double>>();
        frame = static_cast<size_t>(std::max_element(mass.begin(), mass.end()) - mass.begin());
        const size_t per_frame = weights.size() / mass.size();
        weights = weights.subspan(frame * per_frame, per_frame);
        frame_note = dt.contains("dt_sem_ms")
                         ? fmt::format(" | frame {} of {}, dt_sem {:.0f} ms", frame, mass.size(), dt["dt_sem_ms"].get<double>())
                         : fmt::format(" | frame {} of {}", frame, mass.size());
      }
      auto png = heatmap_png(images[i][frame], weights);
      if (png.empty()) continue;
      const auto& m = samples[i]["metrics"];
      figures.push_back({analyses[i].id,
                         fmt::format("{} | Q: {} | A: {} | pred: {} | tau {:.2f} nats, mass {:.3f}{}{}", analyses[i].id,
                                     analyses[i].question, analyses[i].answer, analyses[i].prediction,
                                     m["tau_align"].get<double>(), m["attn_mass"].get<double>(), frame_note,
                                     samples[i]["flagged"].get<bool>() ? " | FLAGGED" : ""),
                         std::move(png)});
    }
    result.html_path = options.out / "report.html";
    io::write_file_atomic(result.html_path, render_report_html(report, figures));
  }
  result.report = std::move(report);
  return result;
}

void enforce_gates(const DiagnoseResult& result) {
  for (const auto& g : result.gates)
    if (!g.passed) throw GateError(g.describe());
}

std::string DiagnoseResult::format() const {
  const auto& s = report["summary"];
  std::string out = fmt::format("model        {}\ndata         {}\nsamples      {} ({} flagged, tau_align > {} nats)\n",
                                report["model"]["dir"].get<std::string>(), report["config"]["data"].get<std::string>(),
                                s["samples"].get<int64_t>(), s["flagged"].get<int64_t>(), s["tau_threshold"].get<double>());
  out += fmt::format("accuracy     {:.4f}\n", s["accuracy"].get<double>());
  for (const auto& [name, st] : s["metrics"].items()) {
    if (st.value("n", 0) == 0) continue;
    out += fmt::format("{:<22} mean {:>9.4f}  median {:>9.4f}  max {:>9.4f}  (n {})\n", name, st["mean"].get<double>(),
                       st["median"].get<double>(), st["max"].get<double>(), st["n"].get<int64_t>());
  }
  for (const auto& g : gates) out += g.describe() + "\n";
  out += fmt::format("wrote        {}\n", json_path.string());
  if (!html_path.empty()) out += fmt::format("wrote        {}\n", html_path.string());
  return out;
}

}  // namespace vlmopt::align
