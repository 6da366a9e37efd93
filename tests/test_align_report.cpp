// diagnose-align end to end on real checkpoints: the tiny fixture (schema keys,
// HTML with its heatmaps, metrics cross-checked against an independent tap,
// gates, bundle comparison) and the builtin model against a damaged copy whose
// projector output rows are shuffled (issue 8 item 5).
#include "align/diagnose.hpp"
#include "bundle/export.hpp"
#include "bundle_test_util.hpp"
#include "datasets/processor.hpp"
#include "tokenizer/prompt.hpp"
#include "util/error.hpp"
#include "util/paths.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <regex>
#include <string>
#include <vector>

using namespace vlmopt;
using vlmopt::testing::fixture_dir;
using vlmopt::testing::TempDir;
namespace fs = std::filesystem;

namespace {

align::DiagnoseOptions fixture_options(const TempDir& tmp, const std::string& out = "diag") {
  align::DiagnoseOptions o;
  o.session.model = fixture_dir("clip_llama_old").string();
  o.session.max_new_tokens = 3;
  o.data = "builtin:eval";
  o.limit = 4;
  o.knockout_limit = 2;
  o.heatmaps = 3;
  o.out = tmp / out;
  return o;
}

size_t count_occurrences(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (auto pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++n;
  return n;
}

// Copies an HF model directory with every tensor kept except the projector's
// second Linear, whose output rows (weight rows and bias) are permuted: the image
// features reach the decoder with their channels scrambled.
void write_shuffled_projector_copy(const fs::path& src, const fs::path& dst, uint64_t seed) {
  fs::create_directories(dst);
  for (const auto& entry : fs::directory_iterator(src)) {
    const auto name = entry.path().filename().string();
    if (!entry.is_regular_file() || name.ends_with(".safetensors") || name == "model.safetensors.index.json") continue;
    fs::copy_file(entry.path(), dst / name);
  }
  const auto ckpt = io::Checkpoint::open(src);
  std::vector<torch::Tensor> keep;
  std::vector<io::TensorToWrite> tensors;
  torch::Tensor permutation;
  int shuffled = 0;
  for (const auto& name : ckpt.names()) {
    auto t = io::load_tensor(ckpt, name).contiguous();
    if (name.find("multi_modal_projector.linear_2.") != std::string::npos) {
      if (!permutation.defined()) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
        permutation = torch::randperm(t.size(0), gen, torch::kLong);
      }
      t = t.index_select(0, permutation).contiguous();
      ++shuffled;
    }
    keep.push_back(t);
    tensors.push_back(io::to_write(name, keep.back()));
  }
  REQUIRE(shuffled == 2);  // weight and bias
  io::write_checkpoint(dst, std::move(tensors), 0);
}

}  // namespace

TEST_CASE("diagnose-align on the tiny fixture: align.json schema, HTML report, tap cross-check") {
  TempDir tmp("align_report");
  const auto options = fixture_options(tmp);
  const auto result = align::diagnose(options);
  CHECK(result.gates_passed());
  REQUIRE(fs::is_regular_file(options.out / "align.json"));
  REQUIRE(fs::is_regular_file(options.out / "report.html"));

  const auto j = nlohmann::json::parse(vlmopt::testing::read_text(options.out / "align.json"));
  CHECK(j == result.report);
  CHECK(j["schema"] == "vlmopt.align/1");
  for (const char* key : {"vlmopt_version", "config", "model", "summary", "layers", "compare", "flagged", "samples"})
    CHECK_MESSAGE(j.contains(key), key);
  CHECK(j["compare"].is_null());
  CHECK(j["model"]["layers"] == 2);
  CHECK(j["model"]["heads"] == 4);
  CHECK(j["model"]["visual_tokens"] == 16);
  CHECK(j["summary"]["samples"] == 4);
  REQUIRE(j["layers"].size() == 2);
  REQUIRE(j["samples"].size() == 4);
  const double log_n = std::log(16.0);
  for (const auto& s : j["samples"]) {
    for (const char* key : {"id", "question", "answer", "prediction", "metrics", "layers", "flags", "flagged", "sinks",
                            "knockout", "massive_visual_tokens"})
      CHECK_MESSAGE(s.contains(key), key);
    const auto& m = s["metrics"];
    for (const char* key : {"tau_align", "tau_norm", "attn_mass", "topk_mass", "pos_bias", "js_drift", "modality_gap", "sink_tokens"})
      CHECK_MESSAGE(m.contains(key), key);
    CHECK(m["tau_align"].get<double>() >= 0.0);
    CHECK(m["tau_align"].get<double>() <= log_n + 1e-9);
    CHECK(m["tau_norm"].get<double>() == doctest::Approx(m["tau_align"].get<double>() / log_n));
    CHECK(m["attn_mass"].get<double>() > 0.0);
    CHECK(m["attn_mass"].get<double>() <= 1.0 + 1e-9);
    CHECK(m["js_drift"].get<double>() >= 0.0);
    CHECK(m["js_drift"].get<double>() <= 1.0);
    CHECK(m["modality_gap"].get<double>() > 0.0);
    CHECK(m["modality_gap"].get<double>() <= 2.0);
    REQUIRE(s["layers"].size() == 2);
    CHECK(s["layers"][0]["heads"]["tau_align"].size() == 4);
    CHECK(s["layers"][1]["js_to_next"].is_null());
    // The flag follows the threshold.
    CHECK(s["flagged"].get<bool>() == (m["tau_align"].get<double>() > options.tau_threshold));
  }
  // Knock-out only on the first knockout_limit samples.
  CHECK(j["samples"][0]["knockout"].is_object());
  CHECK(j["samples"][0]["knockout"]["k"] == 2);  // 10 % of 16 visual tokens, rounded up
  CHECK(j["samples"][1]["metrics"].contains("knockout_delta"));
  CHECK(j["samples"][2]["knockout"].is_null());

  // HTML: self-contained, one PNG data URI per heatmap, no external references.
  const auto html = vlmopt::testing::read_text(options.out / "report.html");
  CHECK(html.starts_with("<!DOCTYPE html>"));
  CHECK(count_occurrences(html, "<img ") == 3);
  CHECK(count_occurrences(html, "src=\"data:image/png;base64,") == 3);
  CHECK(html.find("<svg") != std::string::npos);
  CHECK(html.find("http://") == html.find("http://www.w3.org/2000/svg"));  // only the SVG namespace
  CHECK(html.find("https://") == std::string::npos);
  CHECK(html.find(j["samples"][0]["id"].get<std::string>()) != std::string::npos);

  // Independent cross-check of the last-row visual mass: tap layer 1's probabilities directly.
  eval::SessionOptions so = options.session;
  auto session = eval::VlmSession::open(so);
  const auto sample = datasets::open_dataset(options.data)->get(0);
  const auto batch = session.prepare({sample});
  torch::Tensor probs;
  auto& model = session.model();
  const int id = model.taps().subscribe("model.language_model.layers.1.self_attn.probs",
                                        [&](std::string_view, const torch::Tensor& p, const model::TapContext&) { probs = p.clone(); });
  model::ForwardInputs in;
  in.input_ids = batch.input_ids;
  in.attention_mask = batch.attention_mask;
  in.pixel_values = batch.pixel_values;
  (void)model.forward(in);
  model.taps().unsubscribe(id);
  REQUIRE(probs.defined());
  const auto image = (batch.input_ids[0] == model.config().image_token_id);
  const auto last_row_visual = probs[0].select(1, probs.size(2) - 1).index({torch::indexing::Slice(), image}).sum(-1);  // [H]
  const auto& recorded = j["samples"][0]["layers"][1]["last_heads"]["attn_mass"];
  REQUIRE(recorded.size() == 4);
  for (int64_t h = 0; h < 4; ++h)
    CHECK(recorded[static_cast<size_t>(h)].get<double>() == doctest::Approx(last_row_visual[h].item<double>()).epsilon(1e-5));
}

TEST_CASE("diagnose-align gates: failing gates raise GateError (exit 4), malformed ones are usage errors") {
  TempDir tmp("align_gates");
  auto options = fixture_options(tmp);
  options.limit = 3;
  options.knockout_limit = 0;
  options.fail_on = {"tau_align>0:0%", "attn_mass<2", "js_drift>1:100%"};
  const auto result = align::diagnose(options);
  REQUIRE(result.gates.size() == 3);
  CHECK_FALSE(result.gates[0].passed);  // every sample has positive entropy
  CHECK(result.gates[0].violating == 3);
  CHECK_FALSE(result.gates[1].passed);  // mass is always below 2
  CHECK(result.gates[2].passed);
  CHECK_FALSE(result.gates_passed());
  try {
    align::enforce_gates(result);
    FAIL("enforce_gates did not throw");
  } catch (const GateError& e) {
    CHECK(e.code() == ExitCode::kGateFailed);
    CHECK(std::string(e.what()).find("tau_align>0:0%") != std::string::npos);
  }
  // Gate results are in the JSON, and violating samples are flagged with the gate.
  const auto& gates = result.report["summary"]["gates"];
  REQUIRE(gates.size() == 3);
  CHECK(gates[0]["passed"] == false);
  CHECK(result.report["flagged"].size() == 3);

  options.out = tmp / "never";
  // A rejected gate is a usage error that names what is wrong.
  const auto expect_usage_error = [&](const std::string& needle) {
    try {
      (void)align::diagnose(options);
      FAIL("gate accepted: " << options.fail_on.front());
    } catch (const Error& e) {
      CHECK(e.code() == ExitCode::kUsage);
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  options.fail_on = {"tau_align>abc"};  // malformed
  expect_usage_error("tau_align>abc");
  options.fail_on = {"cmp_js>0.1"};  // comparison metric without --bundle
  expect_usage_error("--bundle");
  options.fail_on = {"knockout_delta>-1:80%"};  // knock-out metric without knock-out samples
  options.knockout_limit = 0;
  expect_usage_error("--knockout-limit");
  CHECK_FALSE(fs::exists(tmp / "never"));  // rejected before any work
}

TEST_CASE("diagnose-align --bundle: decoder-only quantization drifts attention, not the projector") {
  TempDir tmp("align_bundle");
  const auto src = fixture_dir("clip_llama_old");
  const auto export_with = [&](quant::SchemeKind kind, const std::string& name) {
    vlmopt::testing::PlanOptions po;
    po.kind = kind;
    po.in_multiple = kind == quant::SchemeKind::kW4A16 ? 32 : 0;
    bundle::ExportOptions eo;
    eo.source_model = src;
    eo.out = tmp / name;
    bundle::export_bundle(eo, vlmopt::testing::minmax_plan(src, po));
    return eo.out;
  };
  const auto w8 = export_with(quant::SchemeKind::kW8A8, "w8a8");
  const auto w4 = export_with(quant::SchemeKind::kW4A16, "w4a16");

  auto options = fixture_options(tmp, "cmp8");
  options.knockout_limit = 0;
  options.bundle = w8.string();
  options.fail_on = {"cmp_js>0.5:0%", "cmp_projector_cos<0.999:0%"};
  const auto r8 = align::diagnose(options);
  options.bundle = w4.string();
  options.out = tmp / "cmp4";
  const auto r4 = align::diagnose(options);

  for (const auto* r : {&r8, &r4}) {
    const auto& j = r->report;
    REQUIRE(j["compare"].is_object());
    CHECK(r->gates_passed());
    for (const auto& s : j["samples"]) {
      // minmax_plan leaves the vision tower and projector unquantized.
      CHECK(s["metrics"]["cmp_projector_cos"].get<double>() == doctest::Approx(1.0).epsilon(1e-6));
      CHECK(s["metrics"]["cmp_js"].get<double>() > 0.0);
      CHECK(s["layers"][0].contains("cmp_js"));
      CHECK(s["bundle"]["metrics"].contains("tau_align"));
    }
    CHECK(j["layers"][1].contains("cmp_js"));
  }
  // 4-bit weights move the attention maps further than 8-bit ones.
  const auto mean_js = [](const align::DiagnoseResult& r) { return r.report["compare"]["cmp_js"]["mean"].get<double>(); };
  MESSAGE("mean JS divergence vs original: W8A8 " << mean_js(r8) << " bits, W4A16 " << mean_js(r4) << " bits");
  CHECK(mean_js(r4) > mean_js(r8));
  const auto html = vlmopt::testing::read_text(tmp / "cmp4" / "report.html");
  CHECK(html.find("Original vs optimized bundle") != std::string::npos);
}

TEST_CASE("diagnose-align flags the builtin model with shuffled projector rows, not the clean one") {
  fs::path builtin;
  try {
    builtin = builtin_model_dir();
  } catch (const InputError&) {
  }
  if (builtin.empty() || !fs::is_regular_file(builtin / "config.json")) {
    MESSAGE("SKIPPED: models/builtin is missing (train it with scripts/train_builtin.py)");
    return;
  }
  TempDir tmp("align_damaged");
  const auto damaged = tmp / "damaged";
  write_shuffled_projector_copy(builtin, damaged, 1234);

  // The gate is on grounding, not on the attention's shape. With scrambled features the answer no
  // longer depends on where the text looks: masking the 10 % of visual tokens the text attends to
  // most (knockout_delta, nats) leaves it where it was. On 24 samples of builtin:eval at most 16
  // clean samples keep their answer's log-probability within 1 nat (13-16 on the session-22
  // model and four session-25 siblings, 11 on the session-31 one; 11-17 per 24-sample window over 96) against 23-24 shuffled
  // ones (all 96 of 96). The attention-shape metrics (tau_align, tau_norm, topk_mass, js_drift,
  // attn_mass) separated the two on some checkpoints and not on others: their per-checkpoint
  // thresholds are in docs/align.md, and they are printed below for the record.
  const std::vector<std::string> gates = {"knockout_delta>-1:80%"};
  const auto run = [&](const fs::path& model, const std::string& out) {
    align::DiagnoseOptions o;
    o.session.model = model.string();
    o.session.max_new_tokens = 4;
    o.data = "builtin:eval";
    o.limit = 24;
    o.knockout_limit = 24;
    o.heatmaps = 4;
    o.fail_on = gates;
    o.out = tmp / out;
    return align::diagnose(o);
  };
  const auto clean = run(builtin, "clean");
  const auto bad = run(damaged, "bad");
  const auto range = [](const align::DiagnoseResult& r, const char* metric) {
    const auto& st = r.report["summary"]["metrics"][metric];
    return fmt::format("mean {:.5f} [min {:.5f}, max {:.5f}]", st["mean"].get<double>(), st["min"].get<double>(),
                       st["max"].get<double>());
  };
  for (const char* metric : {"knockout_delta", "knockout_delta_random", "last_tau_align", "tau_align", "tau_norm",
                             "topk_mass", "js_drift", "attn_mass", "modality_gap"})
    MESSAGE(std::string(metric) << ": clean " << range(clean, metric) << " | shuffled projector " << range(bad, metric));
  MESSAGE("accuracy: clean " << clean.report["summary"]["accuracy"].get<double>() << ", shuffled projector "
                             << bad.report["summary"]["accuracy"].get<double>());
  REQUIRE(clean.gates.size() == gates.size());
  REQUIRE(bad.gates.size() == gates.size());
  for (size_t g = 0; g < gates.size(); ++g) {
    MESSAGE("clean: " << clean.gates[g].describe());
    MESSAGE("shuffled: " << bad.gates[g].describe());
    CHECK(clean.gates[g].passed);
    CHECK_FALSE(bad.gates[g].passed);
  }
  // Scrambling the features also destroys the answers: the flags point at a real failure.
  CHECK(bad.report["summary"]["accuracy"].get<double>() < clean.report["summary"]["accuracy"].get<double>());
}

TEST_CASE("frame sequences: a clip is prompted with one <image> per frame, filled with the frames in order") {
  auto session = eval::VlmSession::open([] {
    eval::SessionOptions so;
    so.model = fixture_dir("clip_llama_old").string();
    so.max_new_tokens = 3;
    return so;
  }());
  auto& model = session.model();
  const auto per_image = model.config().image_tokens_per_image();
  const auto clips = datasets::open_dataset("builtin:clips");
  const auto still = datasets::open_dataset("builtin:eval")->get(0);
  const auto clip = clips->get(0);
  REQUIRE(clip.frames.size() == 2);

  // Still images keep the single-placeholder prompt.
  CHECK(session.prompt_ids(still.question) == session.prompt_ids(still.question, 1));
  const auto clip_batch = session.prepare({clip});
  CHECK(clip_batch.pixel_values.size(0) == 3);
  const auto image_mask = model.image_token_mask(clip_batch.input_ids)[0];
  CHECK(image_mask.sum().item<int64_t>() == 3 * per_image);
  // The HF multi-image prompt: one placeholder per frame, joined by newlines.
  const auto expected = tokenizer::build_llava_input(
      session.tokenizer(), "USER: <image>\n<image>\n<image>\n" + clip.question + " ASSISTANT:",
      model.config().image_token_id, per_image);
  CHECK(session.prompt_ids(clip.question, 3) == expected);
  CHECK_THROWS_AS(session.prompt_ids(clip.question, 0), Error);
  {
    // A custom template with one placeholder per image is used as is; any other count is an input error.
    eval::SessionOptions so = session.options();
    so.prompt_template = "<image> <image> <image> {question}";
    auto three = eval::VlmSession::open(so);
    CHECK(model.image_token_mask(torch::tensor(three.prompt_ids(clip.question, 3))).sum().item<int64_t>() == 3 * per_image);
    CHECK_THROWS_AS(three.prompt_ids(clip.question, 2), InputError);
  }
  const auto positions = image_mask.nonzero().flatten();

  // The k-th block of image tokens holds frame k's projector output, computed here frame by frame.
  torch::NoGradGuard no_grad;
  const std::vector<cv::Mat> frames = {clip.image, clip.frames[0], clip.frames[1]};
  const auto features = model.image_features(clip_batch.pixel_values);  // [3,N,D]
  const auto embeds = model.embed(clip_batch.input_ids, features)[0];    // [T,D]
  for (int64_t f = 0; f < 3; ++f) {
    const auto alone = model.image_features(
        datasets::preprocess_batch({frames[static_cast<size_t>(f)]}, session.processor()).to(model.dtype()))[0];
    const auto rows = embeds.index_select(0, positions.slice(0, f * per_image, (f + 1) * per_image));
    CHECK(torch::allclose(rows, alone, 1e-5, 1e-6));
  }
  // The event frame differs from the others, so the blocks are not interchangeable.
  const int64_t k = clip.meta["event_frame"].get<int64_t>();
  CHECK_FALSE(torch::allclose(features[k], features[0]));

  // A batch mixing a still image and a clip answers each as alone.
  const auto mixed = session.prepare({still, clip});
  CHECK(mixed.pixel_values.size(0) == 4);
  const auto together = session.answer(mixed);
  REQUIRE(together.size() == 2);
  CHECK(together[0] == session.answer(std::vector<datasets::Sample>{still})[0]);
  CHECK(together[1] == session.answer(std::vector<datasets::Sample>{clip})[0]);
}

TEST_CASE("diagnose-align on builtin:clips: per-frame masses, dt_sem, its flag and gate") {
  TempDir tmp("align_clips");
  auto options = fixture_options(tmp, "clips");
  options.data = "builtin:clips";
  options.knockout_limit = 1;
  options.heatmaps = 2;
  options.fail_on = {"dt_sem_ms>900:0%", "dt_sem_ms>-1:0%"};  // delays are 0, 400 or 800 ms
  const auto result = align::diagnose(options);
  const auto& j = result.report;
  const auto clips = datasets::open_dataset("builtin:clips");
  CHECK(j["config"]["dt_sem_threshold_ms"].get<double>() == 320.0);
  CHECK(j["model"]["visual_tokens"] == 16);  // per image
  REQUIRE(j["samples"].size() == 4);
  std::vector<double> delays;
  for (size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    const auto& s = j["samples"][i];
    const auto sample = clips->get(i);
    CHECK(s["visual_tokens"] == 3 * 16);
    const auto& d = s["dt_sem"];
    REQUIRE(d.is_object());
    CHECK(d["frames"] == 3);
    CHECK(d["query"] == "answer");
    const auto rows = d["answer_rows"].get<int64_t>();
    CHECK(rows >= 1);
    CHECK(rows <= options.session.max_new_tokens);
    const auto mass = d["frame_mass"].get<std::vector<double>>();
    REQUIRE(mass.size() == 3);
    for (const double w : mass) CHECK(w > 0.0);
    // With a one-token answer the frame masses split the last row's visual mass.
    if (rows == 1)
      CHECK(mass[0] + mass[1] + mass[2] == doctest::Approx(s["metrics"]["last_attn_mass"].get<double>()).epsilon(1e-9));
    const auto attended = std::max_element(mass.begin(), mass.end()) - mass.begin();
    CHECK(d["attended_frame"].get<int64_t>() == attended);
    const auto times = sample.meta["frame_times_ms"].get<std::vector<double>>();
    const double event = sample.meta["event_time_ms"].get<double>();
    CHECK(d["frame_times_ms"].get<std::vector<double>>() == times);
    CHECK(d["event_time_ms"].get<double>() == event);
    const double dt = std::abs(times[static_cast<size_t>(attended)] - event);
    CHECK(d["dt_sem_ms"].get<double>() == dt);
    CHECK(s["metrics"]["dt_sem_ms"].get<double>() == dt);
    CHECK(d["flagged"].get<bool>() == (dt > 320.0));
    const auto& flags = s["flags"];
    CHECK((std::find(flags.begin(), flags.end(), "dt_sem_ms>320") != flags.end()) == (dt > 320.0));
    delays.push_back(dt);
  }
  CHECK(j["samples"][0]["knockout"].is_object());  // knock-out runs on multi-image prompts too
  const auto& summary = j["summary"]["dt_sem"];
  CHECK(summary["samples"] == 4);
  CHECK(summary["flagged"].get<int64_t>() == std::count_if(delays.begin(), delays.end(), [](double d) { return d > 320.0; }));
  CHECK(summary["mean_ms"].get<double>() == doctest::Approx(std::accumulate(delays.begin(), delays.end(), 0.0) / 4.0));
  CHECK(j["summary"]["metrics"]["dt_sem_ms"]["n"] == 4);

  REQUIRE(result.gates.size() == 2);
  CHECK(result.gates[0].passed);
  CHECK(result.gates[0].samples == 4);
  CHECK_FALSE(result.gates[1].passed);
  try {
    align::enforce_gates(result);
    FAIL("enforce_gates did not throw");
  } catch (const GateError& e) {
    CHECK(e.code() == ExitCode::kGateFailed);
    CHECK(std::string(e.what()).find("dt_sem_ms>-1:0%") != std::string::npos);
  }

  // Independent recomputation of clip 0's frame masses: one tapped forward over the
  // prompt and the greedy answer, the answer-emitting rows read off directly.
  {
    auto session = eval::VlmSession::open(options.session);
    auto& model = session.model();
    const auto batch = session.prepare({clips->get(0)});
    model::ForwardInputs prompt;
    prompt.input_ids = batch.input_ids;
    prompt.attention_mask = batch.attention_mask;
    prompt.pixel_values = batch.pixel_values;
    const auto generated = model.generate_greedy(prompt, options.session.max_new_tokens, session.eos_ids()).front();
    const auto& eos = session.eos_ids();
    std::vector<int64_t> answer;
    for (const auto t : generated) {
      if (std::find(eos.begin(), eos.end(), t) != eos.end()) break;
      answer.push_back(t);
    }
    const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(answer.size()));
    const auto& d = j["samples"][0]["dt_sem"];
    CHECK(d["answer_rows"].get<int64_t>() == rows);
    const int64_t prompt_len = batch.input_ids.size(1);
    std::vector<int64_t> ids(batch.input_ids[0].data_ptr<int64_t>(), batch.input_ids[0].data_ptr<int64_t>() + prompt_len);
    for (int64_t i = 0; i + 1 < rows; ++i) ids.push_back(answer[static_cast<size_t>(i)]);
    model::ForwardInputs in;
    in.input_ids = torch::tensor(ids, torch::kLong).unsqueeze(0);
    in.pixel_values = batch.pixel_values;
    std::vector<torch::Tensor> probs;
    const int id = model.taps().subscribe("model.language_model.layers.*",
                                          [&](std::string_view name, const torch::Tensor& p, const model::TapContext&) {
                                            if (name.ends_with(".self_attn.probs")) probs.push_back(p[0].to(torch::kFloat64).clone());
                                          });
    (void)model.forward(in);
    model.taps().unsubscribe(id);
    REQUIRE(probs.size() == 2);
    const auto is_image = (in.input_ids[0] == model.config().image_token_id);
    const auto image_pos = is_image.nonzero().flatten();
    REQUIRE(image_pos.numel() == 48);
    std::vector<double> expected(3, 0.0);
    const double share = 1.0 / static_cast<double>(probs.size() * probs[0].size(0) * rows);
    for (const auto& p : probs)
      for (int64_t h = 0; h < p.size(0); ++h)
        for (int64_t r = prompt_len - 1; r < prompt_len - 1 + rows; ++r)
          for (int64_t t = 0; t < 48; ++t)
            expected[static_cast<size_t>(t / 16)] += share * p[h][r][image_pos[t].item<int64_t>()].item<double>();
    const auto mass = d["frame_mass"].get<std::vector<double>>();
    for (size_t f = 0; f < 3; ++f) CHECK(mass[f] == doctest::Approx(expected[f]).epsilon(1e-6));
    MESSAGE("clip 0: " << rows << " answer rows, frame masses " << mass[0] << " " << mass[1] << " " << mass[2]);
  }

  // HTML: the frame-mass bar rows, and heatmaps of the attended frames (16-token grids).
  const auto html = vlmopt::testing::read_text(options.out / "report.html");
  CHECK(html.find("Frame sequences") != std::string::npos);
  CHECK(count_occurrences(html, "<img ") == 2);
  CHECK(html.find("dt_sem") != std::string::npos);

  // Still images have no dt_sem, and a dt_sem gate then sees no samples.
  auto still = fixture_options(tmp, "still");
  still.limit = 2;
  still.knockout_limit = 0;
  still.write_html = false;
  still.fail_on = {"dt_sem_ms>-1:0%"};
  const auto r = align::diagnose(still);
  for (const auto& s : r.report["samples"]) {
    CHECK(s["dt_sem"].is_null());
    CHECK_FALSE(s["metrics"].contains("dt_sem_ms"));
  }
  CHECK(r.report["summary"]["dt_sem"]["samples"] == 0);
  CHECK(r.gates[0].samples == 0);
  CHECK(r.gates_passed());
}
