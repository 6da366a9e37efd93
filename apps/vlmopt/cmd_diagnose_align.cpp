// `vlmopt diagnose-align`: binds DiagnoseOptions, runs align::diagnose, prints
// the summary and turns a failed --fail-on gate into exit 4 (GateError).
#include "app.hpp"

#include "align/diagnose.hpp"

#include <cstdio>

namespace vlmopt::app {

void register_diagnose_align(CLI::App& root, const GlobalOptions& globals) {
  auto opts = std::make_shared<align::DiagnoseOptions>();
  auto* cmd = root.add_subcommand("diagnose-align",
                                  "Cross-modal alignment diagnostics (attention entropy, mass, sinks, drift, "
                                  "knock-out) as align.json + report.html, with CI gates");
  cmd->add_option("--model", opts->session.model, "HF LLaVA model directory or 'builtin'")->capture_default_str();
  cmd->add_option("--bundle", opts->bundle, "Optimized bundle to compare against --model");
  cmd->add_option("--kernels", opts->kernels, "Bundle kernels: fake (fake-quant) | int8 (int8 GEMM)")
      ->check(CLI::IsMember({"fake", "int8"}))
      ->capture_default_str();
  cmd->add_flag("--no-mp-cache{false}", opts->use_mp_cache,
                "Run the bundle as compressed-tensors does (no FP16 outlier channels)");
  cmd->add_option("--data", opts->data, "Dataset: builtin:train|calib|eval|stress|clips, a .jsonl or an .h5")
      ->capture_default_str();
  cmd->add_option("--limit", opts->limit, "Diagnose the first N samples (0 = all)")->capture_default_str();
  cmd->add_option("--out", opts->out, "Output directory for align.json and report.html")->required();
  cmd->add_option("--tau-threshold", opts->tau_threshold, "Flag samples whose tau_align exceeds this (nats)")
      ->capture_default_str();
  cmd->add_option("--dt-sem-threshold-ms", opts->dt_sem_threshold_ms,
                  "Flag frame-sequence samples whose dt_sem (attended frame vs event time) exceeds this (ms)")
      ->capture_default_str();
  cmd->add_option("--fail-on", opts->fail_on,
                  "Gate METRIC>VALUE[:PCT%] or METRIC<VALUE[:PCT%]: exit 4 when more than PCT % of the samples "
                  "meet the condition (repeatable), e.g. 'tau_align>2.1:5%', 'dt_sem_ms>320:10%', "
                  "'knockout_delta>-1:80%' (over the --knockout-limit samples)");
  cmd->add_option("--knockout-limit", opts->knockout_limit, "Knock-out test on the first N samples (0 = none)")
      ->capture_default_str();
  cmd->add_option("--sink-factor", opts->sink_factor, "Attention sink: more than this times the uniform share")
      ->capture_default_str();
  cmd->add_option("--massive-factor", opts->massive_factor,
                  "Massive activation: token max |hidden| above this times the median token")
      ->capture_default_str();
  cmd->add_option("--heatmaps", opts->heatmaps, "Attention heatmaps in report.html (flagged samples first)")
      ->capture_default_str();
  cmd->add_option("--max-new-tokens", opts->session.max_new_tokens, "Greedy answer length limit")
      ->capture_default_str();
  cmd->add_option("--dtype", opts->session.dtype, "float32 | bfloat16 | float16")->capture_default_str();
  cmd->add_option("--prompt-template", opts->session.prompt_template, "Prompt with <image> and {question}")
      ->capture_default_str();
  cmd->callback([opts, &globals] {
    opts->session.device = globals.device;
    const auto result = align::diagnose(*opts);
    if (globals.json) {
      std::puts(result.report["summary"].dump().c_str());
    } else {
      std::fputs(result.format().c_str(), stdout);
    }
    std::fflush(stdout);
    align::enforce_gates(result);
  });
}

}  // namespace vlmopt::app
