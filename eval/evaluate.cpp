#include "eval/evaluate.hpp"

#include "io/atomic_file.hpp"
#include "util/error.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>

namespace vlmopt::eval {

std::pair<double, double> Proportion::wilson95() const {
  if (n == 0) return {0.0, 1.0};
  constexpr double z = 1.959963984540054;
  const double nn = static_cast<double>(n);
  const double p = accuracy();
  const double denom = 1.0 + z * z / nn;
  const double center = (p + z * z / (2.0 * nn)) / denom;
  const double half = z * std::sqrt(p * (1.0 - p) / nn + z * z / (4.0 * nn * nn)) / denom;
  return {std::max(0.0, center - half), std::min(1.0, center + half)};
}

namespace {

nlohmann::json proportion_json(const Proportion& p) {
  const auto [lo, hi] = p.wilson95();
  return {{"accuracy", p.accuracy()}, {"n", p.n}, {"correct", p.correct}, {"ci95", {lo, hi}}};
}

}  // namespace

nlohmann::json EvalResult::to_json() const {
  auto j = proportion_json(overall);
  nlohmann::json types = nlohmann::json::object();
  for (const auto& [name, p] : by_type) types[name] = proportion_json(p);
  j["by_type"] = std::move(types);
  j["visual_tokens"] = visual_tokens;
  j["visual_tokens_per_sample"] = visual_tokens_per_sample;
  j["visual_tokens_kept"] = visual_tokens_kept;
  j["prune"] = prune;
  j["latency_ms"] = latency_ms;
  j["seconds"] = seconds;
  j["batch_size"] = batch_size;
  j["model"] = model_dir;
  j["data"] = data;
  return j;
}

std::string EvalResult::format() const {
  std::string out;
  const auto [lo, hi] = overall.wilson95();
  out += fmt::format("model        {}\ndata         {}\n", model_dir, data);
  out += fmt::format("accuracy     {:.4f}  ({}/{}, 95% CI {:.4f}-{:.4f})\n", overall.accuracy(), overall.correct,
                     overall.n, lo, hi);
  out += fmt::format("pruning      {}\nvisual kept  {:.2f} per sample (mean over decoder layers)\n", prune,
                     visual_tokens_kept);
  out += fmt::format("visual tok.  {} per image, {:.1f} per sample\nlatency      {:.2f} ms/sample (batch {})\n",
                     visual_tokens, visual_tokens_per_sample, latency_ms, batch_size);
  out += "by type:\n";
  for (const auto& [name, p] : by_type) {
    const auto [l, h] = p.wilson95();
    out += fmt::format("  {:<10} {:.4f}  ({}/{}, 95% CI {:.4f}-{:.4f})\n", name, p.accuracy(), p.correct, p.n, l, h);
  }
  return out;
}

EvalResult evaluate(const EvalOptions& options) {
  VLMOPT_CHECK_INPUT(options.batch_size > 0, "--batch-size: must be positive (got {})", options.batch_size);
  auto session_options = options.session;
  session_options.bundle = options.bundle;
  session_options.kernels = options.kernels;
  session_options.use_mp_cache = options.use_mp_cache;
  auto session = VlmSession::open(session_options);
  auto source = datasets::open_dataset(options.data);
  const int64_t total = options.limit > 0 ? std::min<int64_t>(options.limit, static_cast<int64_t>(source->size()))
                                          : static_cast<int64_t>(source->size());
  VLMOPT_CHECK_INPUT(total > 0, "{}: dataset is empty", options.data);

  EvalResult result;
  result.model_dir = session.model_dir().string();
  result.data = options.data;
  result.batch_size = options.batch_size;
  result.visual_tokens = session.model().config().image_tokens_per_image();
  result.prune = session.prune_description();
  double kept_sum = 0.0;  // sum over samples of the per-sample mean over layers
  int64_t images = 0;     // images over all samples (a clip sample has one per frame)
  nlohmann::json predictions = nlohmann::json::array();

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (int64_t begin = 0; begin < total; begin += options.batch_size) {
    const int64_t end = std::min(total, begin + options.batch_size);
    std::vector<datasets::Sample> batch;
    for (int64_t i = begin; i < end; ++i) batch.push_back(source->get(static_cast<size_t>(i)));
    const auto answers = session.answer(batch);
    int64_t batch_images = 0;
    for (const auto& sample : batch) batch_images += 1 + static_cast<int64_t>(sample.frames.size());
    images += batch_images;
    const auto& report = session.model().last_prune_report();
    kept_sum += report.empty() ? static_cast<double>(result.visual_tokens * batch_images)
                               : report.mean_visual_tokens() * static_cast<double>(batch.size());
    for (size_t k = 0; k < batch.size(); ++k) {
      const bool ok = answers[k] == normalize_answer(batch[k].answer);
      result.overall.n += 1;
      result.overall.correct += ok;
      auto& t = result.by_type[batch[k].question_type.empty() ? "untyped" : batch[k].question_type];
      t.n += 1;
      t.correct += ok;
      if (options.predictions) {
        predictions.push_back({{"id", batch[k].id}, {"question", batch[k].question}, {"answer", batch[k].answer},
                               {"prediction", answers[k]}, {"correct", ok}, {"question_type", batch[k].question_type}});
      }
    }
    spdlog::debug("eval: {}/{} samples, accuracy so far {:.4f}", end, total, result.overall.accuracy());
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.latency_ms = 1000.0 * result.seconds / static_cast<double>(total);
  result.visual_tokens_kept = kept_sum / static_cast<double>(total);
  result.visual_tokens_per_sample =
      static_cast<double>(result.visual_tokens * images) / static_cast<double>(total);
  if (options.predictions) {
    std::string lines;
    for (const auto& p : predictions) lines += p.dump() + "\n";
    io::write_file_atomic(*options.predictions, lines);
  }
  return result;
}

}  // namespace vlmopt::eval
