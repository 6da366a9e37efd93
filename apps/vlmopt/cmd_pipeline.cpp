// `vlmopt pipeline`: binds PipelineOptions and prints eval::run_pipeline's summary.
#include "app.hpp"

#include "eval/pipeline.hpp"

#include <cstdio>

namespace vlmopt::app {

void register_pipeline(CLI::App& root, const GlobalOptions& globals) {
  auto opts = std::make_shared<eval::PipelineOptions>();
  auto* cmd = root.add_subcommand("pipeline", "Run every optimization step in order and report");
  cmd->add_option("--model", opts->session.model, "HF LLaVA model directory or 'builtin'")->capture_default_str();
  cmd->add_option("--out", opts->out, "Output directory (bundle and reports)")->required();
  cmd->add_option("--eval-data", opts->eval_data, "Dataset for the evaluations")->capture_default_str();
  cmd->add_option("--eval-limit", opts->eval_limit, "Evaluate the first N samples (0 = all)")->capture_default_str();
  cmd->add_option("--batch-size", opts->batch_size, "Samples per forward pass")->capture_default_str();
  cmd->callback([opts, &globals] {
    opts->session.device = globals.device;
    const auto result = eval::run_pipeline(*opts);
    if (globals.json) {
      std::puts(result.summary.dump().c_str());
    } else {
      std::fputs(result.format().c_str(), stdout);
    }
  });
}

}  // namespace vlmopt::app
