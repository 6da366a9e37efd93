#include "align/metrics.hpp"

#include "util/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <numeric>

namespace vlmopt::align {

namespace {

void check_map(std::span<const double> values) {
  VLMOPT_CHECK(!values.empty(), "attention map is empty");
  for (const double v : values) VLMOPT_CHECK(std::isfinite(v) && v >= 0.0, "attention map entry {}", v);
}

// Average ranks (1-based), ties share the mean of the ranks they span.
std::vector<double> average_ranks(std::span<const double> values) {
  const size_t n = values.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return values[a] < values[b]; });
  std::vector<double> ranks(n);
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j + 1 < n && values[order[j + 1]] == values[order[i]]) ++j;
    const double rank = 0.5 * static_cast<double>(i + j) + 1.0;
    for (size_t k = i; k <= j; ++k) ranks[order[k]] = rank;
    i = j + 1;
  }
  return ranks;
}

double pearson(std::span<const double> x, std::span<const double> y) {
  const auto n = static_cast<double>(x.size());
  const double mx = std::accumulate(x.begin(), x.end(), 0.0) / n;
  const double my = std::accumulate(y.begin(), y.end(), 0.0) / n;
  double sxy = 0.0, sxx = 0.0, syy = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  if (sxx <= 0.0 || syy <= 0.0) return 0.0;
  return std::clamp(sxy / std::sqrt(sxx * syy), -1.0, 1.0);
}

[[noreturn]] void malformed(std::string_view expression, std::string_view why) {
  throw Error(ExitCode::kUsage,
              fmt::format("--fail-on '{}': {} (expected METRIC>VALUE or METRIC<VALUE, optionally :PCT%, "
                          "e.g. 'tau_align>2.1:5%'; metrics: {})",
                          expression, why, fmt::join(gate_metrics(), ", ")));
}

bool parse_double(std::string_view text, double& out) {
  if (text.empty()) return false;
  const auto* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end && std::isfinite(out);
}

}  // namespace

int64_t top_k_count(int64_t visual_tokens) {
  VLMOPT_CHECK(visual_tokens > 0, "visual tokens {}", visual_tokens);
  return std::max<int64_t>(1, (visual_tokens + 9) / 10);
}

std::vector<double> renormalise(std::span<const double> values) {
  const double sum = std::accumulate(values.begin(), values.end(), 0.0);
  std::vector<double> out(values.size(), values.empty() ? 0.0 : 1.0 / static_cast<double>(values.size()));
  if (sum > 0.0)
    for (size_t i = 0; i < values.size(); ++i) out[i] = values[i] / sum;
  return out;
}

double entropy_nats(std::span<const double> values) {
  double h = 0.0;
  for (const double p : renormalise(values))
    if (p > 0.0) h -= p * std::log(p);
  return std::max(0.0, h);
}

double spearman_with_index(std::span<const double> values) {
  if (values.size() < 2) return 0.0;
  const auto ranks = average_ranks(values);
  std::vector<double> index(values.size());
  std::iota(index.begin(), index.end(), 1.0);
  return pearson(ranks, index);
}

MapMetrics map_metrics(std::span<const double> visual_attention) {
  check_map(visual_attention);
  const auto n = static_cast<int64_t>(visual_attention.size());
  MapMetrics m;
  m.attn_mass = std::accumulate(visual_attention.begin(), visual_attention.end(), 0.0);
  m.tau_align = entropy_nats(visual_attention);
  m.tau_norm = n > 1 ? m.tau_align / std::log(static_cast<double>(n)) : 0.0;
  auto p = renormalise(visual_attention);
  const auto k = static_cast<size_t>(top_k_count(n));
  std::partial_sort(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(k), p.end(), std::greater<>());
  m.topk_mass = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(k), 0.0);
  m.pos_bias = spearman_with_index(visual_attention);
  return m;
}

double js_divergence(std::span<const double> p, std::span<const double> q) {
  VLMOPT_CHECK(p.size() == q.size() && !p.empty(), "JS divergence of maps of length {} and {}", p.size(), q.size());
  const auto a = renormalise(p), b = renormalise(q);
  double js = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double m = 0.5 * (a[i] + b[i]);
    if (a[i] > 0.0) js += 0.5 * a[i] * std::log2(a[i] / m);
    if (b[i] > 0.0) js += 0.5 * b[i] * std::log2(b[i] / m);
  }
  return std::clamp(js, 0.0, 1.0);
}

double cosine_similarity(std::span<const double> a, std::span<const double> b) {
  VLMOPT_CHECK(a.size() == b.size(), "cosine of vectors of length {} and {}", a.size(), b.size());
  double ab = 0.0, aa = 0.0, bb = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  if (aa <= 0.0 || bb <= 0.0) return 0.0;
  return ab / std::sqrt(aa * bb);
}

std::vector<double> frame_masses(std::span<const double> map, int64_t frames) {
  VLMOPT_CHECK(frames >= 1 && !map.empty() && map.size() % static_cast<size_t>(frames) == 0,
               "{} visual tokens do not split into {} frames", map.size(), frames);
  const size_t per_frame = map.size() / static_cast<size_t>(frames);
  std::vector<double> mass(static_cast<size_t>(frames), 0.0);
  for (size_t j = 0; j < map.size(); ++j) mass[j / per_frame] += map[j];
  return mass;
}

TemporalDelay temporal_delay(std::span<const double> frame_mass, std::span<const double> frame_times_ms,
                             double event_time_ms, double threshold_ms) {
  VLMOPT_CHECK(!frame_mass.empty() && frame_mass.size() == frame_times_ms.size(),
               "{} frame masses for {} frame times", frame_mass.size(), frame_times_ms.size());
  TemporalDelay d;
  d.attended_frame = std::max_element(frame_mass.begin(), frame_mass.end()) - frame_mass.begin();
  d.dt_sem_ms = std::abs(frame_times_ms[static_cast<size_t>(d.attended_frame)] - event_time_ms);
  d.flagged = d.dt_sem_ms > threshold_ms;
  return d;
}

const std::vector<std::string>& gate_metrics() {
  static const std::vector<std::string> names = {
      "tau_align", "tau_norm", "attn_mass", "topk_mass", "pos_bias", "last_tau_align", "last_attn_mass", "js_drift",
      "modality_gap", "sink_tokens", "knockout_delta", "dt_sem_ms", "cmp_js", "cmp_projector_cos"};
  return names;
}

Gate parse_gate(std::string_view expression) {
  Gate gate;
  gate.expression = std::string(expression);
  const auto op = expression.find_first_of("<>");
  if (op == std::string_view::npos) malformed(expression, "no '>' or '<'");
  gate.greater = expression[op] == '>';
  gate.metric = std::string(expression.substr(0, op));
  const auto& known = gate_metrics();
  if (gate.metric.empty()) malformed(expression, "no metric before the comparison");
  if (std::find(known.begin(), known.end(), gate.metric) == known.end())
    malformed(expression, fmt::format("unknown metric '{}'", gate.metric));
  auto rest = expression.substr(op + 1);
  std::string_view value = rest, pct;
  const auto colon = rest.find(':');
  if (colon != std::string_view::npos) {
    value = rest.substr(0, colon);
    pct = rest.substr(colon + 1);
    if (pct.empty()) malformed(expression, "empty percentage after ':'");
  }
  if (!parse_double(value, gate.threshold)) malformed(expression, fmt::format("threshold '{}' is not a number", value));
  if (!pct.empty()) {
    if (pct.back() == '%') pct.remove_suffix(1);
    double percent = 0.0;
    if (!parse_double(pct, percent) || percent < 0.0 || percent > 100.0)
      malformed(expression, fmt::format("percentage '{}' is not a number in [0,100]", pct));
    gate.max_fraction = percent / 100.0;
  }
  return gate;
}

bool violates(const Gate& gate, double value) { return gate.greater ? value > gate.threshold : value < gate.threshold; }

GateResult evaluate_gate(const Gate& gate, std::span<const double> values) {
  GateResult r;
  r.gate = gate;
  r.samples = static_cast<int64_t>(values.size());
  r.violating = std::count_if(values.begin(), values.end(), [&](double v) { return violates(gate, v); });
  r.fraction = r.samples > 0 ? static_cast<double>(r.violating) / static_cast<double>(r.samples) : 0.0;
  r.passed = r.fraction <= gate.max_fraction;
  return r;
}

std::string GateResult::describe() const {
  return fmt::format("gate '{}' {}: {:.1f} % of {} samples ({}) have {} {} {} (allowed {:.1f} %)", gate.expression,
                     passed ? "passed" : "failed", 100.0 * fraction, samples, violating, gate.metric,
                     gate.greater ? '>' : '<', gate.threshold, 100.0 * gate.max_fraction);
}

}  // namespace vlmopt::align
