// `vlmopt eval`: binds EvalOptions and prints eval::evaluate's result.
#include "app.hpp"

#include "eval/evaluate.hpp"

#include <cstdio>

namespace vlmopt::app {

void register_eval(CLI::App& root, const GlobalOptions& globals) {
  auto opts = std::make_shared<eval::EvalOptions>();
  auto* cmd = root.add_subcommand("eval", "Greedy answers on a dataset: exact-match accuracy, per type, latency");
  cmd->add_option("--model", opts->session.model, "HF LLaVA model directory or 'builtin'")->capture_default_str();
  cmd->add_option("--bundle", opts->bundle, "Optimized bundle directory to evaluate (instead of --model)");
  cmd->add_option("--kernels", opts->kernels, "Bundle kernels: fake (fake-quant) | int8 (int8 GEMM)")
      ->check(CLI::IsMember({"fake", "int8"}))
      ->capture_default_str();
  cmd->add_flag("--no-mp-cache{false}", opts->use_mp_cache,
                "Run the bundle as compressed-tensors does (no FP16 outlier channels)");
  cmd->add_option("--data", opts->data, "Dataset: builtin:train|calib|eval|stress|clips, a .jsonl or an .h5")
      ->capture_default_str();
  cmd->add_option("--limit", opts->limit, "Evaluate the first N samples (0 = all)")->capture_default_str();
  cmd->add_option("--batch-size", opts->batch_size, "Samples per forward pass")->capture_default_str();
  cmd->add_option("--max-new-tokens", opts->session.max_new_tokens, "Greedy decoding length limit")
      ->capture_default_str();
  cmd->add_option("--dtype", opts->session.dtype, "float32 | bfloat16 | float16")->capture_default_str();
  cmd->add_option("--prompt-template", opts->session.prompt_template, "Prompt with <image> and {question}")
      ->capture_default_str();
  cmd->add_option("--predictions", opts->predictions, "Write one JSON line per sample here");
  // Visual-token pruning (docs/cli.md "prune-fit"): the bundle's vlmopt/prune.json applies by default.
  add_prune_options(*cmd, opts->session.prune);
  cmd->callback([opts, &globals] {
    opts->session.device = globals.device;
    const auto result = eval::evaluate(*opts);
    if (globals.json) {
      std::puts(result.to_json().dump().c_str());
    } else {
      std::fputs(result.format().c_str(), stdout);
    }
  });
}

}  // namespace vlmopt::app
