// `vlmopt pipeline`: binds PipelineOptions and prints pipeline::run_pipeline's summary.
#include "app.hpp"

#include "pipeline/pipeline.hpp"

#include <cstdio>

namespace vlmopt::app {

void register_pipeline(CLI::App& root, const GlobalOptions& globals) {
  auto opts = std::make_shared<pipeline::PipelineOptions>();
  auto scheme = std::make_shared<std::string>("w8a8");
  auto prune_cut = std::make_shared<std::string>("input");
  auto* cmd = root.add_subcommand("pipeline", "Run every optimization step in order into one bundle, and report");
  cmd->add_option("--model", opts->model, "HF LLaVA model directory or 'builtin'")->capture_default_str();
  cmd->add_option("--out", opts->out, "Bundle directory to write (replaced atomically)")->required();
  cmd->add_option("--calib-data", opts->calib_data, "Calibration dataset")->capture_default_str();
  cmd->add_option("--calib-samples", opts->calib_samples, "Calibration samples")->capture_default_str();
  cmd->add_option("--scheme", *scheme, "w8a8 | w8a16 | w4a16 | fp8")
      ->check(CLI::IsMember({"w8a8", "w8a16", "w4a16", "fp8"}))
      ->capture_default_str();
  cmd->add_option("--eval-data", opts->eval_data, "Dataset for the evaluations")->capture_default_str();
  cmd->add_option("--eval-limit", opts->eval_limit, "Evaluate the first N samples (0 = all)")->capture_default_str();
  cmd->add_option("--batch-size", opts->batch_size, "Samples per forward pass")->capture_default_str();
  cmd->add_option("--compensate-steps", opts->compensate_steps, "compensate: adapter training steps (0 = no compensation step)")
      ->capture_default_str();
  cmd->add_option("--compensate-samples", opts->compensate_samples, "compensate: calibration samples it trains on")
      ->capture_default_str();
  cmd->add_option("--prune-keep", opts->prune_keep,
                  "prune-fit target: fraction of visual tokens kept after the cut (0 = no pruning step)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--prune-calib-samples", opts->prune_calib_samples, "Calibration samples for prune-fit")
      ->capture_default_str();
  cmd->add_option("--prune-cut", *prune_cut, "prune-fit --cut: output | input (the scoring layer sees only the kept)")
      ->check(CLI::IsMember({"output", "input"}))
      ->capture_default_str();
  cmd->add_option("--prune-layers", opts->prune_layers, "prune-fit --layers: candidate scoring layers")
      ->capture_default_str();
  cmd->add_option("--align-samples", opts->align_samples, "diagnose-align samples (0 = no diagnosis step)")
      ->capture_default_str();
  cmd->callback([opts, scheme, prune_cut, &globals] {
    opts->device = globals.device;
    opts->scheme = quant::parse_scheme(*scheme);
    opts->prune_cut = model::parse_prune_cut(*prune_cut, "--prune-cut");
    const auto result = pipeline::run_pipeline(*opts);
    if (globals.json) {
      std::puts(result.summary.dump().c_str());
    } else {
      std::fputs(result.format().c_str(), stdout);
    }
  });
}

}  // namespace vlmopt::app
