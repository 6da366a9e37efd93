// `vlmopt calibrate`: binds CalibrateOptions and calls calib::calibrate.
#include "app.hpp"

#include "calib/calibrate.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstdio>

namespace vlmopt::app {

void register_calibrate(CLI::App& root, const GlobalOptions& globals) {
  auto opts = std::make_shared<calib::CalibrateOptions>();
  auto scheme = std::make_shared<std::string>("w8a8");
  auto observer = std::make_shared<std::string>("minmax");
  auto convention = std::make_shared<std::string>("compressed-tensors");
  auto ignore = std::make_shared<std::vector<std::string>>();
  auto alpha = std::make_shared<double>(0.0);
  auto* cmd = root.add_subcommand(
      "calibrate", "Collect activation statistics and write an MP-Cache file and a compressed-tensors bundle");
  cmd->add_option("--model", opts->model, "HF LLaVA model directory or 'builtin'")->capture_default_str();
  cmd->add_option("--data", opts->data, "Calibration dataset: builtin:calib, a .jsonl or an .h5")->capture_default_str();
  cmd->add_option("--samples", opts->samples, "Use the first N samples (0 = all)")->capture_default_str();
  cmd->add_option("--batch-size", opts->batch_size, "Samples per forward pass")->capture_default_str();
  cmd->add_option("--out", opts->out, "Bundle directory to write (replaced atomically)")->required();
  cmd->add_option("--scheme", *scheme, "w8a8 | w8a16 | w4a16 | fp8")
      ->check(CLI::IsMember({"w8a8", "w8a16", "w4a16", "fp8"}))
      ->capture_default_str();
  cmd->add_option("--observer", *observer, "Activation observer: minmax | moving-average | percentile | mse | entropy")
      ->check(CLI::IsMember({"minmax", "moving-average", "percentile", "mse", "entropy"}))
      ->capture_default_str();
  cmd->add_option("--convention", *convention, "Scale/zero-point formulas: compressed-tensors | torch-ao")
      ->check(CLI::IsMember({"compressed-tensors", "torch-ao"}))
      ->capture_default_str();
  cmd->add_option("--ignore", *ignore,
                  "Linears left in float: exact names, 'Linear', or 're:<regex>' (repeatable; replaces the default: "
                  "vision tower, projector, lm_head)");
  cmd->add_option("--smoothquant", *alpha, "SmoothQuant migration strength alpha in (0,1); 0 = off")
      ->capture_default_str();
  cmd->add_option("--outlier-threshold", opts->outlier_threshold,
                  "Input channels with |x| above this stay FP16 (<= 0: off)")
      ->capture_default_str();
  cmd->add_option("--percentile", opts->percentile, "Percentile for --observer percentile")->capture_default_str();
  cmd->add_flag("--layerwise", opts->layerwise,
                "All samples through decoder layer l before l+1, weights loaded per layer (flat memory with depth)");
  cmd->callback([=, &globals] {
    opts->device = globals.device;
    opts->scheme = quant::parse_scheme(*scheme);
    opts->observer = calib::parse_observer_kind(*observer);
    opts->convention = quant::parse_convention(*convention);
    if (!ignore->empty()) opts->ignore = *ignore;
    if (*alpha != 0.0) opts->smoothquant_alpha = *alpha;
    const auto summary = calib::calibrate(*opts);
    if (globals.json) {
      std::puts(summary.dump().c_str());
    } else {
      std::fputs(fmt::format("bundle:   {}\nmp-cache: {}\nreport:   {}\n{} Linear layers quantized ({}), "
                             "{} outlier channels, mean output SQNR {:.1f} dB, {:.1f} s\n",
                             summary["bundle"].get<std::string>(), summary["mp_cache"].get<std::string>(),
                             summary["report"].get<std::string>(), summary["quantized_linears"].get<int64_t>(),
                             summary["scheme"].get<std::string>(), summary["outlier_channels"].get<int64_t>(),
                             summary["mean_output_sqnr_db"].is_null() ? 0.0
                                                                      : summary["mean_output_sqnr_db"].get<double>(),
                             summary["seconds"].get<double>())
                     .c_str(),
                 stdout);
    }
  });
}

}  // namespace vlmopt::app
