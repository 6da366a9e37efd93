// Alignment metrics on text->visual attention maps (docs/align.md defines each
// one with its units) and the CI gates of `diagnose-align --fail-on`.
// Pure functions on plain vectors: no model, no I/O.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::align {

// Metrics of one text->visual attention map. The map holds, for each of N visual
// tokens, the attention probability a text query (or the mean over several text
// queries) gives it; it is NOT renormalised, so its sum is the visual mass <= 1.
struct MapMetrics {
  double attn_mass = 0.0;  // sum of the map: share of the query's attention on visual tokens, [0,1]
  double tau_align = 0.0;  // entropy (nats) of the map renormalised over the N visual tokens, [0, log N]
  double tau_norm = 0.0;   // tau_align / log N, [0,1] (0 when N == 1)
  double topk_mass = 0.0;  // share of the renormalised map on its k largest entries, k = top_k_count(N)
  double pos_bias = 0.0;   // Spearman rank correlation of attention with token index, [-1,1]; 0 for a constant map
};

// k of the top-k mass: 10 % of N visual tokens, rounded up, at least 1.
int64_t top_k_count(int64_t visual_tokens);

// Throws VLMOPT_CHECK on an empty map or negative / non-finite entries.
MapMetrics map_metrics(std::span<const double> visual_attention);

// `values` divided by their sum (uniform when the sum is 0).
std::vector<double> renormalise(std::span<const double> values);

// Shannon entropy in nats of a distribution (renormalised first).
double entropy_nats(std::span<const double> values);

// Spearman rank correlation (average ranks for ties) of `values` with 0..N-1.
// 0 when the values are all equal (the correlation is undefined there).
double spearman_with_index(std::span<const double> values);

// Jensen-Shannon divergence in bits, [0,1], of two non-negative maps of equal
// length (each renormalised first). 0 for identical maps, 1 for disjoint supports.
double js_divergence(std::span<const double> p, std::span<const double> q);

// Cosine similarity of two equal-length vectors; 0 when either is all zeros.
double cosine_similarity(std::span<const double> a, std::span<const double> b);

// --- Frame sequences: temporal delay Δt_sem ------------------------------------

// Attention mass per frame of a text->visual map over `frames` frames of equal
// token count, in frame-major order (frame f holds tokens [f*n, (f+1)*n),
// n = map.size() / frames): the sum of the map over each frame's tokens.
// VLMOPT_CHECK: frames >= 1 and map.size() divisible by frames.
std::vector<double> frame_masses(std::span<const double> map, int64_t frames);

struct TemporalDelay {
  int64_t attended_frame = 0;  // argmax of the frame masses (the first on ties)
  double dt_sem_ms = 0.0;      // |frame_times_ms[attended_frame] - event_time_ms|
  bool flagged = false;        // dt_sem_ms > threshold_ms
};

// Δt_sem of per-frame attention masses (docs/align.md). VLMOPT_CHECK: equal,
// non-zero lengths of masses and times.
TemporalDelay temporal_delay(std::span<const double> frame_mass, std::span<const double> frame_times_ms,
                             double event_time_ms, double threshold_ms);

// --- CI gates: --fail-on 'METRIC>VALUE[:PCT%]' ---------------------------------

// A gate fails when MORE than `max_fraction` of the samples that have the metric
// satisfy `value <op> threshold` (default max_fraction 0: any such sample fails it).
struct Gate {
  std::string expression;  // as given
  std::string metric;      // one of gate_metrics()
  bool greater = true;     // '>' (true) or '<'
  double threshold = 0.0;
  double max_fraction = 0.0;  // [0,1]; "5%" -> 0.05
};

// The per-sample metrics gates may name (see docs/align.md).
const std::vector<std::string>& gate_metrics();

// Parses "tau_align>2.1:5%", "attn_mass<0.05", "cmp_js>0.1:0%". Throws
// vlmopt::Error(ExitCode::kUsage) naming the expression when it is malformed or
// names an unknown metric.
Gate parse_gate(std::string_view expression);

struct GateResult {
  Gate gate;
  int64_t samples = 0;    // samples that have the metric
  int64_t violating = 0;  // samples with value <op> threshold
  double fraction = 0.0;  // violating / samples (0 without samples)
  bool passed = true;
  std::string describe() const;  // one line: "gate 'x' failed: 12.0 % of 50 samples have tau_align > 2.1 (allowed 5 %)"
};

// Whether one value violates the gate's condition.
bool violates(const Gate& gate, double value);
GateResult evaluate_gate(const Gate& gate, std::span<const double> values);

}  // namespace vlmopt::align
