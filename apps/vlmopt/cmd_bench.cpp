// `vlmopt bench`: measurements that benchmarks (scripts/bench/) compare against.
//   bench forward: the bare calibration pass (same data, batching, layerwise mode),
//                  the floor `vlmopt calibrate` is measured against.
//   bench prefill: prefill latency (the KV-cache-filling forward of generation) with or
//                  without visual-token pruning (scripts/bench/prune_pareto.py).
#include "app.hpp"

#include "calib/calibrate.hpp"
#include "prune/fit.hpp"

#include <cstdio>

namespace vlmopt::app {

void register_bench(CLI::App& root, const GlobalOptions& globals) {
  auto* bench = root.add_subcommand("bench", "Timing measurements used by scripts/bench/");
  bench->require_subcommand(1);
  auto opts = std::make_shared<calib::CalibrateOptions>();
  auto* forward = bench->add_subcommand("forward", "Time a bare calibration pass (no observers) over a dataset");
  forward->add_option("--model", opts->model, "HF LLaVA model directory or 'builtin'")->capture_default_str();
  forward->add_option("--data", opts->data, "Dataset spec")->capture_default_str();
  forward->add_option("--samples", opts->samples, "First N samples (0 = all)")->capture_default_str();
  forward->add_option("--batch-size", opts->batch_size, "Samples per forward pass")->capture_default_str();
  forward->add_flag("--layerwise", opts->layerwise, "Layer-by-layer pass, as calibrate --layerwise");
  forward->callback([opts, &globals] {
    opts->device = globals.device;
    const auto result = calib::time_bare_pass(*opts);
    if (globals.json) {
      std::puts(result.dump().c_str());
    } else {
      std::printf("%lld samples in %.3f s (%.2f samples/s), peak RSS %.0f MiB\n",
                  static_cast<long long>(result["samples"].get<int64_t>()), result["seconds"].get<double>(),
                  result["samples_per_second"].get<double>(), result["peak_rss_mib"].get<double>());
    }
  });

  auto prefill_opts = std::make_shared<prune::PrefillBenchOptions>();
  auto* prefill = bench->add_subcommand("prefill", "Time the prefill forward, optionally with visual-token pruning");
  auto& s = prefill_opts->session;
  prefill->add_option("--model", s.model, "HF LLaVA model directory or 'builtin'")->capture_default_str();
  prefill->add_option("--bundle", s.bundle, "Bundle directory (its vlmopt/prune.json applies unless --no-prune)");
  prefill->add_option("--data", prefill_opts->data, "Dataset spec")->capture_default_str();
  prefill->add_option("--samples", prefill_opts->samples, "First N samples")->capture_default_str();
  prefill->add_option("--batch-size", prefill_opts->batch_size, "Samples per forward pass")->capture_default_str();
  prefill->add_option("--repeats", prefill_opts->repeats, "Timed passes over the samples")->capture_default_str();
  prefill->add_option("--dtype", s.dtype, "float32 | bfloat16 | float16")->capture_default_str();
  add_prune_options(*prefill, s.prune);
  prefill->callback([prefill_opts, &globals] {
    prefill_opts->session.device = globals.device;
    const auto result = prune::bench_prefill(*prefill_opts);
    if (globals.json) {
      std::puts(result.dump().c_str());
    } else {
      std::printf("prefill %.3f ms/batch (%.3f ms/sample, batch %lld), visual tokens kept %.1f of %lld (%s)\n",
                  result["prefill_ms_per_batch"].get<double>(), result["prefill_ms_per_sample"].get<double>(),
                  static_cast<long long>(result["batch_size"].get<int64_t>()),
                  result["visual_tokens_kept"].get<double>(),
                  static_cast<long long>(result["visual_tokens"].get<int64_t>()),
                  result["prune"].get<std::string>().c_str());
    }
  });
}

}  // namespace vlmopt::app
