#include "eval/pipeline.hpp"

#include "io/atomic_file.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace vlmopt::eval {

PipelineResult run_pipeline(const PipelineOptions& options) {
  PipelineResult result;
  result.out = options.out;
  const auto reports_dir = options.out / "vlmopt" / "reports";
  std::filesystem::create_directories(reports_dir);
  result.summary = {{"model", options.session.model}, {"out", options.out.string()}, {"steps", nlohmann::json::array()}};

  spdlog::info("pipeline step 1/1: eval (fp32 baseline) on {}", options.eval_data);
  EvalOptions eval_opts;
  eval_opts.session = options.session;
  eval_opts.data = options.eval_data;
  eval_opts.limit = options.eval_limit;
  eval_opts.batch_size = options.batch_size;
  const auto baseline = evaluate(eval_opts);
  const auto report = reports_dir / "eval_fp32.json";
  io::write_file_atomic(report, baseline.to_json().dump(2) + "\n");
  result.reports.push_back(report);
  auto step = baseline.to_json();
  step.erase("by_type");
  step["step"] = "eval_fp32";
  step["report"] = report.string();
  result.summary["steps"].push_back(std::move(step));
  return result;
}

std::string PipelineResult::format() const {
  std::string s = fmt::format("pipeline output: {}\n", out.string());
  for (const auto& step : summary.at("steps")) {
    s += fmt::format("  {:<10} accuracy {:.4f} (n={}), {:.2f} ms/sample, {} visual tokens -> {}\n",
                     step.at("step").get<std::string>(), step.at("accuracy").get<double>(), step.at("n").get<int64_t>(),
                     step.at("latency_ms").get<double>(), step.at("visual_tokens").get<int64_t>(),
                     step.at("report").get<std::string>());
  }
  return s;
}

}  // namespace vlmopt::eval
