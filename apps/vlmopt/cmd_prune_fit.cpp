// `vlmopt prune-fit`: binds PruneFitOptions and prints prune::fit's report.
#include "app.hpp"

#include "prune/fit.hpp"

#include <fmt/format.h>

#include <cstdio>

namespace vlmopt::app {

void register_prune_fit(CLI::App& root, const GlobalOptions& globals) {
  auto opts = std::make_shared<prune::PruneFitOptions>();
  auto target = std::make_shared<double>(0.5);
  auto drop = std::make_shared<double>(0.01);
  auto budget = std::make_shared<double>(0.0);
  auto batch_keep = std::make_shared<std::string>("per_sample");
  auto cut = std::make_shared<std::string>("output");
  auto* cmd = root.add_subcommand("prune-fit", "Fit per-layer visual-token pruning thresholds (writes prune.json)");
  cmd->add_option("--model", opts->session.model, "HF LLaVA model directory or 'builtin'")->capture_default_str();
  cmd->add_option("--bundle", opts->bundle, "Fit on this bundle and write vlmopt/prune.json into it");
  cmd->add_option("--out", opts->out, "Without --bundle: write prune.json and prune_fit_report.json here");
  cmd->add_option("--data", opts->data, "Calibration dataset spec")->capture_default_str();
  cmd->add_option("--limit", opts->limit, "Calibration samples (0 = all)")->capture_default_str();
  cmd->add_option("--batch-size", opts->batch_size, "Batch size of the accuracy and latency passes")
      ->capture_default_str();
  auto* t = cmd->add_option("--target-keep", *target, "Keep this fraction of the visual tokens after the cut")
                ->check(CLI::Range(0.0, 1.0));
  auto* d = cmd->add_option("--max-accuracy-drop", *drop, "Drop the most tokens within this calib accuracy drop")
                ->check(CLI::Range(0.0, 1.0));
  auto* l = cmd->add_option("--latency-budget-ms", *budget, "Keep the most tokens within this prefill latency (ms/batch)")
                ->check(CLI::PositiveNumber);
  t->excludes(d)->excludes(l);
  d->excludes(l);
  cmd->add_option("--scenario", opts->scenario, "Scenario profile to write (general, document, video_qa, ...)")
      ->capture_default_str();
  cmd->add_option("--layers", opts->candidate_layers,
                  "Candidate scoring layers (default: all but the last for --cut output, all for --cut input)");
  cmd->add_option("--cut", *cut, "output: drop after the scoring layer | input: that layer already sees only the kept")
      ->check(CLI::IsMember({"output", "input"}))
      ->capture_default_str();
  cmd->add_option("--floor", opts->policy.floor, "Keep-ratio floor")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  cmd->add_option("--batch-keep", *batch_keep, "per_sample | batch_mean: how batched samples share keep counts")
      ->check(CLI::IsMember({"per_sample", "batch_mean"}))
      ->capture_default_str();
  cmd->add_option("--policy-a", opts->policy.a, "Keep cap coefficient of mem_pressure")->capture_default_str();
  cmd->add_option("--policy-b", opts->policy.b, "Keep cap coefficient of l2_miss_rate")->capture_default_str();
  cmd->add_option("--mem-pressure", opts->hardware.mem_pressure, "Target memory pressure in [0,1]")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--l2-miss-rate", opts->hardware.l2_miss_rate, "Target L2 miss rate in [0,1]")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--dtype", opts->session.dtype, "float32 | bfloat16 | float16")->capture_default_str();
  cmd->callback([=, &globals] {
    opts->session.device = globals.device;
    opts->policy.batch_keep = model::parse_batch_keep(*batch_keep, "--batch-keep");
    opts->cut = model::parse_prune_cut(*cut, "--cut");
    if (*t) opts->target_keep = *target;
    if (*d) opts->max_accuracy_drop = *drop;
    if (*l) opts->latency_budget_ms = *budget;
    if (!*t && !*d && !*l) opts->target_keep = *target;  // default mode: --target-keep 0.5
    const auto report = prune::fit(*opts);
    if (globals.json) {
      std::puts(report.dump().c_str());
    } else {
      const auto& c = report["chosen"];
      const bool input_cut = c["cut"].get<std::string>() == "input";
      std::printf("%s\n", fmt::format("prune-fit ({}): prune {} layer {}, threshold {:.4f}, keeps {:.3f} of the visual "
                                      "tokens (equivalent {:.3f}), sensitivity recall {:.3f}\nwrote {}",
                                      report["mode"].get<std::string>(), input_cut ? "at the input of" : "after",
                                      c["after_layer"].get<int64_t>(),
                                      c["threshold"].get<double>(), c["keep_ratio"].get<double>(),
                                      c["equivalent_keep"].get<double>(), c["sensitivity_recall"].get<double>(),
                                      report["written"].get<std::string>())
                             .c_str());
    }
  });
}

}  // namespace vlmopt::app
