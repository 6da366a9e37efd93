// CLI binding of eval::PruneOptions, shared by `eval` and `bench prefill`.
#include "app.hpp"
#include "eval/session.hpp"

namespace vlmopt::app {

void add_prune_options(CLI::App& cmd, eval::PruneOptions& prune) {
  cmd.add_flag("--no-prune{false}", prune.apply_bundle_plan, "Ignore the bundle's vlmopt/prune.json");
  cmd.add_option("--prune-config", prune.config, "Apply this prune.json (instead of the bundle's)");
  cmd.add_option("--scenario", prune.scenario, "prune.json scenario (default: its default_scenario)");
  cmd.add_option("--prune-rule", prune.rule, "Ad-hoc single-step pruning: vlmopt | fastv | random")
      ->check(CLI::IsMember({"vlmopt", "fastv", "random"}));
  cmd.add_option("--prune-layer", prune.layer, "Ad-hoc: the decoder layer whose attention scores (FastV K=2 -> 1)")
      ->capture_default_str();
  cmd.add_option("--prune-cut", prune.cut,
                 "Ad-hoc: output (drop after that layer) | input (that layer already sees only the kept tokens)")
      ->check(CLI::IsMember({"output", "input"}))
      ->capture_default_str();
  cmd.add_option("--prune-keep", prune.keep, "Ad-hoc fastv/random: fraction of visual tokens kept")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd.add_option("--prune-threshold", prune.threshold, "Ad-hoc vlmopt: score threshold")->capture_default_str();
  cmd.add_option("--prune-floor", prune.floor, "Ad-hoc vlmopt: kept fraction floor")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd.add_option("--prune-seed", prune.seed, "Ad-hoc random: seed")->capture_default_str();
  cmd.add_option("--prune-batch-keep", prune.batch_keep, "per_sample | batch_mean (default: the plan's)")
      ->check(CLI::IsMember({"per_sample", "batch_mean"}));
}

}  // namespace vlmopt::app
