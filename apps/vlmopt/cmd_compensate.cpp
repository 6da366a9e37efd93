// `vlmopt compensate`: binds CompensateOptions and calls compensate::compensate.
#include "app.hpp"

#include "compensate/compensate.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <limits>

namespace vlmopt::app {

void register_compensate(CLI::App& root, const GlobalOptions& globals) {
  auto opts = std::make_shared<compensate::CompensateOptions>();
  auto placement = std::make_shared<std::string>("output");
  auto no_entropy = std::make_shared<bool>(false);
  auto no_projector_feature = std::make_shared<bool>(false);
  auto feature_tokens = std::make_shared<std::string>("text");
  auto keep_worse = std::make_shared<bool>(false);
  auto* cmd = root.add_subcommand(
      "compensate", "Train a low-rank compensatory adapter against the original model and fold it into the bundle");
  auto& t = opts->train;
  cmd->add_option("--model", opts->model, "The original (teacher) model: HF LLaVA directory or 'builtin'")
      ->capture_default_str();
  cmd->add_option("--bundle", opts->bundle, "Calibrated bundle to compensate (updated atomically)")->required();
  cmd->add_option("--data", opts->data, "Calibration data: builtin:calib, a .jsonl or an .h5 (not an eval split)")
      ->capture_default_str();
  cmd->add_option("--samples", opts->samples, "Use the first N samples (0 = all)")->capture_default_str();
  cmd->add_option("--batch-size", opts->batch_size, "Samples per training batch")->capture_default_str();
  cmd->add_option("--placement", *placement, "Adapter on the projector output (folds into linear_2) or input (linear_1)")
      ->check(CLI::IsMember({"output", "input"}))
      ->capture_default_str();
  cmd->add_option("--rank", t.rank, "Adapter rank")->capture_default_str();
  cmd->add_option("--steps", t.steps, "Optimizer steps")->capture_default_str();
  cmd->add_option("--lr", t.lr, "Adam learning rate")->capture_default_str();
  cmd->add_option("--seed", t.seed, "Seed of the adapter init and the probe directions")->capture_default_str();
  cmd->add_option("--gamma", t.loss.gamma, "Weight of the gradient-flow (Jacobian matching) term; 0 = off")
      ->capture_default_str();
  cmd->add_option("--tau", t.loss.tau, "Entropy temperature in nats for the sample weights exp(-H/tau)")
      ->capture_default_str();
  cmd->add_flag("--no-entropy-weighting", *no_entropy, "Uniform sample weights (tau = inf)");
  cmd->add_option("--feature-layers", t.loss.feature_layers,
                  "Decoder hidden states compared (transformers' indices; -1 = last, after the final norm)")
      ->capture_default_str();
  cmd->add_flag("--no-projector-feature", *no_projector_feature, "Leave the projector output out of the loss");
  cmd->add_option("--feature-tokens", *feature_tokens,
                  "Hidden-state positions compared: text (the text tokens after the image) or all real tokens")
      ->check(CLI::IsMember({"text", "all"}))
      ->capture_default_str();
  cmd->add_flag("--keep-worse", *keep_worse, "Keep the trained adapter even if it did not lower the loss");
  cmd->add_option("--probes", t.loss.probes, "Random directions per step for the gradient-flow term")
      ->capture_default_str();
  cmd->add_option("--max-nan-steps", t.max_nan_steps, "Abort when this many steps had a non-finite loss")
      ->capture_default_str();
  cmd->callback([=, &globals] {
    opts->device = globals.device;
    opts->train.placement = compensate::parse_placement(*placement);
    if (*no_entropy) opts->train.loss.tau = std::numeric_limits<double>::infinity();
    if (*no_projector_feature) opts->train.loss.projector_feature = false;
    opts->train.loss.text_tokens_only = *feature_tokens == "text";
    opts->train.keep_only_if_better = !*keep_worse;
    auto report = compensate::compensate(*opts);
    if (globals.json) {
      report.erase("curve");  // in the report file; keeps stdout one short line
      std::puts(report.dump().c_str());
      return;
    }
    const auto value = [](const nlohmann::json& v) { return v.is_null() ? std::nan("") : v.get<double>(); };
    std::fputs(fmt::format("bundle:  {}\nadapter: {}\nreport:  {}\nloss {:.6g} -> {:.6g} (perceptual {:.6g} -> {:.6g}, "
                           "gradflow {:.6g} -> {:.6g}), gate {:.4g}, {} skipped steps, {:.1f} s\n",
                           report["bundle"].get<std::string>(), report["adapter"].get<std::string>(),
                           report["report"].get<std::string>(), value(report["loss_before"]["total"]),
                           value(report["loss_after"]["total"]), value(report["loss_before"]["perceptual"]),
                           value(report["loss_after"]["perceptual"]), value(report["loss_before"]["gradflow"]),
                           value(report["loss_after"]["gradflow"]), report["gate"].get<double>(),
                           report["nan_steps"].get<int64_t>(), report["seconds"].get<double>())
                   .c_str(),
               stdout);
  });
}

}  // namespace vlmopt::app
