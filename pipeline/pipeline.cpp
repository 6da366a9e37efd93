#include "pipeline/pipeline.hpp"

#include "align/diagnose.hpp"
#include "bundle/export.hpp"
#include "calib/calibrate.hpp"
#include "compensate/compensate.hpp"
#include "eval/evaluate.hpp"
#include "io/atomic_file.hpp"
#include "io/safetensors.hpp"
#include "prune/fit.hpp"
#include "util/paths.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <set>
#include <unistd.h>

namespace vlmopt::pipeline {

namespace fs = std::filesystem;

nlohmann::json PipelineOptions::to_json() const {
  return {{"model", model},           {"device", device},
          {"calib_data", calib_data}, {"calib_samples", calib_samples},
          {"scheme", std::string(quant::to_string(scheme))},
          {"eval_data", eval_data},   {"eval_limit", eval_limit},
          {"batch_size", batch_size}, {"compensate_steps", compensate_steps},
          {"compensate_samples", compensate_samples}, {"prune_keep", prune_keep},
          {"prune_calib_samples", prune_calib_samples},
          {"prune_cut", std::string(model::prune_cut_name(prune_cut))}, {"prune_layers", prune_layers},
          {"align_samples", align_samples},
          {"out", out.string()}};
}

namespace {

// Bytes of the tensors of `linears` (canonical names; weights, biases and their
// quantization parameters) in a bundle directory, and of all its tensors.
std::pair<uint64_t, uint64_t> linear_bytes(const fs::path& dir, const std::set<std::string>& linears) {
  const auto checkpoint = io::Checkpoint::open(dir);
  uint64_t part = 0, total = 0;
  for (const auto& name : checkpoint.names()) {
    const auto [file, info] = checkpoint.locate(name);
    total += info->nbytes();
    const auto dot = name.rfind('.');
    if (dot != std::string::npos && linears.contains(name.substr(0, dot))) part += info->nbytes();
  }
  return {part, total};
}

}  // namespace

PipelineResult run_pipeline(const PipelineOptions& options) {
  spdlog::info("pipeline options: {}", options.to_json().dump());
  PipelineResult result;
  result.out = options.out;
  result.summary = {{"options", options.to_json()}, {"steps", nlohmann::json::array()}};

  const bool compensate = options.compensate_steps > 0;
  const bool prune = options.prune_keep > 0.0;
  const bool align = options.align_samples > 0;
  const int steps = 3 + (compensate ? 2 : 0) + (prune ? 2 : 0) + (align ? 1 : 0);
  int step = 3;
  spdlog::info("pipeline step 1/{}: calibrate ({}, {} samples of {})", steps, quant::to_string(options.scheme),
               options.calib_samples, options.calib_data);
  calib::CalibrateOptions calibrate;
  calibrate.model = options.model;
  calibrate.device = options.device;
  calibrate.data = options.calib_data;
  calibrate.samples = options.calib_samples;
  calibrate.batch_size = options.batch_size;
  calibrate.scheme = options.scheme;
  calibrate.out = options.out;
  auto calibrated = calib::calibrate(calibrate);
  calibrated["step"] = "calibrate";
  result.summary["steps"].push_back(calibrated);

  eval::EvalOptions eval_options;
  eval_options.session.model = options.model;
  eval_options.session.device = options.device;
  eval_options.data = options.eval_data;
  eval_options.limit = options.eval_limit;
  eval_options.batch_size = options.batch_size;
  spdlog::info("pipeline step 2/{}: eval fp32 on {}", steps, options.eval_data);
  const auto fp32 = eval::evaluate(eval_options).to_json();
  spdlog::info("pipeline step 3/{}: eval bundle on {}", steps, options.eval_data);
  eval_options.bundle = options.out.string();
  eval_options.session.prune.apply_bundle_plan = false;  // the bundle as calibrated
  const auto quantized = eval::evaluate(eval_options).to_json();

  nlohmann::json compensated;
  if (compensate) {
    spdlog::info("pipeline step {}/{}: compensate ({} steps on {} samples of {})", ++step, steps,
                 options.compensate_steps, options.compensate_samples, options.calib_data);
    compensate::CompensateOptions comp;
    comp.model = options.model;
    comp.device = options.device;
    comp.bundle = options.out;
    comp.data = options.calib_data;
    comp.samples = options.compensate_samples;
    comp.batch_size = options.batch_size;
    comp.train.steps = options.compensate_steps;
    auto report = compensate::compensate(comp);
    report["step"] = "compensate";
    report.erase("curve");  // per-step losses stay in reports/compensation.json
    result.summary["steps"].push_back(report);
    spdlog::info("pipeline step {}/{}: eval the compensated bundle on {}", ++step, steps, options.eval_data);
    compensated = eval::evaluate(eval_options).to_json();
  }

  nlohmann::json pruned;
  if (prune) {
    spdlog::info("pipeline step {}/{}: prune-fit (keep {} of the visual tokens after the cut) on {}", ++step, steps,
                 options.prune_keep, options.calib_data);
    prune::PruneFitOptions fit;
    fit.session.model = options.model;
    fit.session.device = options.device;
    fit.bundle = options.out.string();
    fit.data = options.calib_data;
    fit.limit = options.prune_calib_samples;
    fit.batch_size = options.batch_size;
    fit.target_keep = options.prune_keep;
    fit.cut = options.prune_cut;
    fit.candidate_layers = options.prune_layers;
    auto fitted = prune::fit(fit);
    fitted["step"] = "prune-fit";
    result.summary["steps"].push_back(fitted);
    spdlog::info("pipeline step {}/{}: eval the pruned bundle on {}", ++step, steps, options.eval_data);
    eval_options.session.prune.apply_bundle_plan = true;
    pruned = eval::evaluate(eval_options).to_json();
  }

  // diagnose-align writes into a scratch directory; its files join the bundle
  // in the final (atomic) update below.
  const fs::path align_scratch =
      fs::temp_directory_path() / fmt::format("vlmopt-pipeline-align-{}", static_cast<long>(::getpid()));
  if (align) {
    spdlog::info("pipeline step {}/{}: diagnose-align of the bundle against the model ({} samples of {})", steps,
                 steps, options.align_samples, options.eval_data);
    align::DiagnoseOptions diagnose;
    diagnose.session.model = options.model;
    diagnose.session.device = options.device;
    diagnose.bundle = options.out.string();
    diagnose.data = options.eval_data;
    diagnose.limit = options.align_samples;
    diagnose.out = align_scratch;
    const auto diagnosed = align::diagnose(diagnose);
    result.summary["steps"].push_back({{"step", "diagnose-align"}, {"summary", diagnosed.report.value("summary", nlohmann::json::object())}});
  }

  // Sizes: the quantized Linears' bytes before and after, and the whole checkpoints.
  const auto plan_report = nlohmann::json::parse(
      io::read_whole_file(options.out / "vlmopt" / "reports" / "calibration.json", 1ull << 30));
  std::set<std::string> linears;
  for (const auto& layer : plan_report.at("layers")) linears.insert(layer.at("name").get<std::string>());
  const auto [bundle_part, bundle_total] = linear_bytes(options.out, linears);
  // The source may use the old key layout: count its quantized Linears through the bundle's names.
  const auto source_dir = resolve_model_dir(options.model);
  uint64_t source_part = 0, source_total = 0;
  {
    const auto source = io::Checkpoint::open(source_dir);
    for (const auto& name : source.names()) {
      const auto [file, info] = source.locate(name);
      source_total += info->nbytes();
      for (const auto& l : linears) {
        // canonical "model.language_model.X" is "language_model.model.X" in the old layout
        const std::string old = "language_model.model." + l.substr(std::string("model.language_model.").size());
        if (name == l + ".weight" || name == l + ".bias" || name == old + ".weight" || name == old + ".bias") {
          source_part += info->nbytes();
          break;
        }
      }
    }
  }
  result.summary["fp32"] = fp32;
  result.summary["bundle"] = quantized;
  result.summary["accuracy_delta"] = quantized.at("accuracy").get<double>() - fp32.at("accuracy").get<double>();
  if (compensate) {
    result.summary["bundle_compensated"] = compensated;
    result.summary["accuracy_delta_compensated"] =
        compensated.at("accuracy").get<double>() - fp32.at("accuracy").get<double>();
  }
  if (prune) {
    result.summary["bundle_pruned"] = pruned;
    result.summary["accuracy_delta_pruned"] = pruned.at("accuracy").get<double>() - fp32.at("accuracy").get<double>();
  }
  result.summary["size"] = {{"quantized_linears_fp32_bytes", source_part},
                            {"quantized_linears_bundle_bytes", bundle_part},
                            {"checkpoint_fp32_bytes", source_total},
                            {"checkpoint_bundle_bytes", bundle_total}};

  // The evaluations become part of the bundle (reports listed in the manifest).
  bundle::BundleUpdate update;
  update.step = "pipeline";
  update.options = options.to_json();
  const std::string fp32_text = fp32.dump(2) + "\n", bundle_text = quantized.dump(2) + "\n",
                    compensated_text = compensated.dump(2) + "\n", pruned_text = pruned.dump(2) + "\n", summary_text = result.summary.dump(2) + "\n";
  update.apply = [&](const fs::path& root) {
    const auto reports = root / "vlmopt" / "reports";
    fs::create_directories(reports);
    io::write_file_atomic(reports / "eval_fp32.json", fp32_text);
    io::write_file_atomic(reports / "eval_bundle.json", bundle_text);
    if (compensate) io::write_file_atomic(reports / "eval_bundle_compensated.json", compensated_text);
    if (prune) io::write_file_atomic(reports / "eval_bundle_pruned.json", pruned_text);
    if (align) {
      fs::create_directories(reports / "align");
      for (const auto& entry : fs::directory_iterator(align_scratch))
        if (entry.is_regular_file()) fs::copy_file(entry.path(), reports / "align" / entry.path().filename());
    }
    io::write_file_atomic(reports / "pipeline.json", summary_text);
  };
  bundle::update_bundle(options.out, update);
  if (align) fs::remove_all(align_scratch);
  result.summary["report"] = (options.out / "vlmopt" / "reports" / "pipeline.json").string();
  return result;
}

std::string PipelineResult::format() const {
  const auto& s = summary;
  const auto& fp32 = s.at("fp32");
  const auto& bundle = s.at("bundle");
  const auto& size = s.at("size");
  auto mib = [](const nlohmann::json& v) { return static_cast<double>(v.get<uint64_t>()) / (1024.0 * 1024.0); };
  std::string compensated_line, pruned_line;
  if (s.contains("bundle_compensated")) {
    const auto& c = s.at("bundle_compensated");
    compensated_line = fmt::format("accuracy compensated {:.4f} (n={}), delta {:+.4f}\n", c.at("accuracy").get<double>(),
                                   c.at("n").get<int64_t>(), s.at("accuracy_delta_compensated").get<double>());
  }
  if (s.contains("bundle_pruned")) {
    const auto& p = s.at("bundle_pruned");
    pruned_line = fmt::format("accuracy pruned {:.4f} (n={}), delta {:+.4f}; visual tokens {:.1f} -> {:.1f} per layer\n",
                              p.at("accuracy").get<double>(), p.at("n").get<int64_t>(),
                              s.at("accuracy_delta_pruned").get<double>(), p.value("visual_tokens", 0.0),
                              p.value("visual_tokens_kept", 0.0));
  }
  return fmt::format(
      "bundle:  {}\nreport:  {}\n"
      "accuracy fp32   {:.4f} (n={})\n"
      "accuracy bundle {:.4f} (n={}), delta {:+.4f}\n{}{}"
      "quantized Linears: {:.2f} MiB fp32 -> {:.2f} MiB in the bundle; checkpoint {:.2f} -> {:.2f} MiB\n",
      out.string(), s.at("report").get<std::string>(), fp32.at("accuracy").get<double>(), fp32.at("n").get<int64_t>(),
      bundle.at("accuracy").get<double>(), bundle.at("n").get<int64_t>(), s.at("accuracy_delta").get<double>(),
      compensated_line, pruned_line, mib(size.at("quantized_linears_fp32_bytes")), mib(size.at("quantized_linears_bundle_bytes")),
      mib(size.at("checkpoint_fp32_bytes")), mib(size.at("checkpoint_bundle_bytes")));
}

}  // namespace vlmopt::pipeline
