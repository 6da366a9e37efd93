// `vlmopt diagnose-align`: per sample, decoder layer and head alignment metrics
// from the attention probabilities of the prefill forward (docs/align.md),
// optionally compared with an optimized bundle, written as DIR/align.json and a
// self-contained DIR/report.html, with CI gates (--fail-on).
#pragma once

#include "align/metrics.hpp"
#include "datasets/source.hpp"
#include "eval/session.hpp"

#include <nlohmann/json.hpp>
#include <opencv2/core.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace vlmopt::align {

inline constexpr const char* kAlignSchema = "vlmopt.align/1";

struct DiagnoseOptions {
  eval::SessionOptions session;  // the original model (session.model), device, dtype, prompt, max_new_tokens
  std::string bundle;            // optimized bundle diagnosed against session.model; empty = none
  std::string kernels = "fake";  // bundle kernels (runtime::KernelKind)
  bool use_mp_cache = true;
  std::string data = "builtin:eval";  // dataset spec (datasets::open_dataset)
  int64_t limit = 32;                 // first N samples; 0 = all
  std::filesystem::path out;          // DIR for align.json and report.html (created)
  double tau_threshold = 2.1;         // nats; a sample is flagged when its tau_align is above
  double dt_sem_threshold_ms = 320.0; // a clip sample is flagged when its dt_sem_ms is above
  double sink_factor = 5.0;           // a sink gets > sink_factor / N_visual of the visual attention ...
  double sink_head_share = 0.5;       // ... in more than this share of (layer, head) maps
  double massive_factor = 20.0;       // massive activation: token max |h| > factor * median over tokens
  int64_t knockout_limit = 8;         // knock-out on the first N samples (0 = none)
  int64_t heatmaps = 8;               // heatmaps in the HTML report (flagged samples first)
  std::vector<std::string> fail_on;   // gate expressions (parse_gate)
  bool write_html = true;
};

// What one model shows on one sample (before aggregation).
struct SampleAnalysis {
  std::string id;
  std::string question;
  std::string answer;      // reference answer from the dataset
  std::string prediction;  // the model's greedy answer, normalised
  int64_t visual_tokens = 0;
  int64_t text_queries = 0;  // text query rows averaged into the "text" map
  // Text->visual maps, double CPU: [layers, heads, N] raw attention probabilities
  // (mean over the text query rows / the last row); see docs/align.md.
  torch::Tensor text_maps;
  torch::Tensor last_maps;
  torch::Tensor projector_output;  // [N, D_text] float CPU
  double modality_gap = 0.0;
  std::vector<int64_t> massive_visual_tokens;  // visual token indices with massive hidden-state activations
  int64_t massive_text_tokens = 0;             // text positions with massive activations (e.g. BOS)
  std::optional<double> knockout_delta;         // log p(answer | top-k visual masked) - log p(answer), nats
  std::optional<double> knockout_delta_random;  // the same with k random visual tokens masked (control)
  int64_t knockout_k = 0;
  int64_t answer_tokens = 0;
  // Frame sequences: images in the prompt (1 + sample.frames.size(); the visual
  // tokens are frame-major, visual_tokens / images per frame), and from the sample's
  // meta the frame times and the event time (empty / nullopt when absent).
  int64_t images = 1;
  std::vector<double> frame_times_ms;
  std::optional<double> event_time_ms;
  // Frame sequences only: [L,H,N] text->visual maps averaged over the rows that emit
  // the greedy answer's tokens (EOS excluded; the last prompt row when there is at
  // most one), and how many rows that is.
  torch::Tensor answer_maps;
  int64_t answer_rows = 0;
};

struct AnalysisOptions {
  bool knockout = false;
  uint64_t seed = 0;  // random knock-out control
  double massive_factor = 20.0;
};

// Prefill with the attention taps, greedy answer, optional knock-out, on one sample.
SampleAnalysis analyze_sample(eval::VlmSession& session, const datasets::Sample& sample,
                              const AnalysisOptions& options);

struct DiagnoseResult {
  nlohmann::json report;  // the contents of align.json
  std::vector<GateResult> gates;
  std::filesystem::path json_path;
  std::filesystem::path html_path;  // empty without write_html
  bool gates_passed() const;
  std::string format() const;  // human-readable summary for stdout
};

// Runs the diagnosis and writes the files (atomically). Gate parse errors are
// raised before any model work; failed gates are only recorded (see enforce_gates).
DiagnoseResult diagnose(const DiagnoseOptions& options);

// Throws GateError (exit 4) naming the first failed gate.
void enforce_gates(const DiagnoseResult& result);

// Per-sample metric values a gate reads (missing metrics are absent), from one
// sample record of align.json.
std::optional<double> sample_metric(const nlohmann::json& sample_record, const std::string& metric);

}  // namespace vlmopt::align
