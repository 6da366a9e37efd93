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
  auto& prune = opts->session.prune;
  cmd->add_flag("--no-prune{false}", prune.apply_bundle_plan, "Ignore the bundle's vlmopt/prune.json");
  cmd->add_option("--prune-config", prune.config, "Apply this prune.json (instead of the bundle's)");
  cmd->add_option("--scenario", prune.scenario, "prune.json scenario (default: its default_scenario)");
  cmd->add_option("--prune-rule", prune.rule, "Ad-hoc single-step pruning: vlmopt | fastv | random")
      ->check(CLI::IsMember({"vlmopt", "fastv", "random"}));
  cmd->add_option("--prune-layer", prune.layer, "Ad-hoc: prune after this decoder layer (FastV K=2 -> 1)")
      ->capture_default_str();
  cmd->add_option("--prune-keep", prune.keep, "Ad-hoc fastv/random: fraction of visual tokens kept")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--prune-threshold", prune.threshold, "Ad-hoc vlmopt: score threshold")->capture_default_str();
  cmd->add_option("--prune-floor", prune.floor, "Ad-hoc vlmopt: kept fraction floor")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--prune-seed", prune.seed, "Ad-hoc random: seed")->capture_default_str();
  cmd->add_option("--prune-batch-keep", prune.batch_keep, "per_sample | batch_mean (default: the plan's)")
      ->check(CLI::IsMember({"per_sample", "batch_mean"}));
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
