// `vlmopt bench`: measurements that benchmarks (scripts/bench/) compare against.
//   bench forward: the bare calibration pass (same data, batching, layerwise mode),
//                  the floor `vlmopt calibrate` is measured against.
#include "app.hpp"

#include "calib/calibrate.hpp"

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
}

}  // namespace vlmopt::app
