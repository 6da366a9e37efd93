// align/metrics: attention-map metrics on hand-built maps with known answers,
// JS divergence, Spearman, and the --fail-on gate grammar and evaluation.
#include "align/metrics.hpp"
#include "align/report_html.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <opencv2/imgcodecs.hpp>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

using namespace vlmopt;
using namespace vlmopt::align;

TEST_CASE("map metrics: uniform attention has entropy log N and no positional bias") {
  const size_t n = 144;
  const std::vector<double> uniform(n, 0.4 / static_cast<double>(n));  // 40 % of the attention on the image
  const auto m = map_metrics(uniform);
  CHECK(m.attn_mass == doctest::Approx(0.4));
  CHECK(m.tau_align == doctest::Approx(std::log(144.0)));
  CHECK(m.tau_norm == doctest::Approx(1.0));
  CHECK(m.topk_mass == doctest::Approx(15.0 / 144.0));  // k = ceil(14.4) = 15 of 144 equal shares
  CHECK(m.pos_bias == 0.0);
}

TEST_CASE("map metrics: one-hot attention has entropy 0 and top-k mass 1") {
  std::vector<double> one_hot(50, 0.0);
  one_hot[17] = 0.25;
  const auto m = map_metrics(one_hot);
  CHECK(m.attn_mass == doctest::Approx(0.25));
  CHECK(m.tau_align == 0.0);
  CHECK(m.tau_norm == 0.0);
  CHECK(m.topk_mass == doctest::Approx(1.0));
}

TEST_CASE("map metrics: two equal tokens give log 2 nats; top-k count") {
  std::vector<double> two(10, 0.0);
  two[2] = two[7] = 0.3;
  const auto m = map_metrics(two);
  CHECK(m.tau_align == doctest::Approx(std::log(2.0)));
  CHECK(m.tau_norm == doctest::Approx(std::log(2.0) / std::log(10.0)));
  CHECK(m.topk_mass == doctest::Approx(0.5));  // k = 1 of 10
  CHECK(top_k_count(1) == 1);
  CHECK(top_k_count(10) == 1);
  CHECK(top_k_count(11) == 2);
  CHECK(top_k_count(144) == 15);
  CHECK(top_k_count(576) == 58);
}

TEST_CASE("spearman: monotone maps give +1 and -1, ties use average ranks") {
  std::vector<double> rising(20), falling(20);
  for (size_t i = 0; i < 20; ++i) {
    rising[i] = std::exp(0.3 * static_cast<double>(i));  // monotone but far from linear
    falling[i] = 1.0 / (1.0 + static_cast<double>(i));
  }
  CHECK(spearman_with_index(rising) == doctest::Approx(1.0));
  CHECK(spearman_with_index(falling) == doctest::Approx(-1.0));
  CHECK(map_metrics(rising).pos_bias == doctest::Approx(1.0));
  // Symmetric V shape: no monotone trend.
  const std::vector<double> v = {3, 2, 1, 0, 1, 2, 3};
  CHECK(spearman_with_index(v) == doctest::Approx(0.0));
  // Ties: [0,0,1,1] has average ranks [1.5,1.5,3.5,3.5]; by hand r = 2/sqrt(5) ~ 0.894.
  const std::vector<double> steps = {0, 0, 1, 1};
  CHECK(spearman_with_index(steps) == doctest::Approx(2.0 / std::sqrt(5.0)));
  const std::vector<double> constant(5, 0.2);
  CHECK(spearman_with_index(constant) == 0.0);
}

TEST_CASE("JS divergence: identical maps 0, disjoint 1 bit, symmetric, scale-free") {
  const std::vector<double> p = {0.1, 0.2, 0.3, 0.4};
  const std::vector<double> p_scaled = {0.01, 0.02, 0.03, 0.04};
  CHECK(js_divergence(p, p) == doctest::Approx(0.0));
  CHECK(js_divergence(p, p_scaled) == doctest::Approx(0.0));  // maps are renormalised
  const std::vector<double> a = {1, 0, 0, 0}, b = {0, 0, 1, 1};
  CHECK(js_divergence(a, b) == doctest::Approx(1.0));
  const std::vector<double> q = {0.4, 0.3, 0.2, 0.1};
  CHECK(js_divergence(p, q) == doctest::Approx(js_divergence(q, p)));
  // By hand: p = (1,0), q = (1/2,1/2): m = (3/4,1/4);
  // JS = 1/2 [log2(4/3)] + 1/2 [1/2 log2(2/3) + 1/2 log2(2)] bits.
  const std::vector<double> x = {1, 0}, y = {0.5, 0.5};
  const double expected = 0.5 * std::log2(4.0 / 3.0) + 0.5 * (0.5 * std::log2(2.0 / 3.0) + 0.5 * 1.0);
  CHECK(js_divergence(x, y) == doctest::Approx(expected));
}

TEST_CASE("cosine similarity and entropy helpers") {
  const std::vector<double> a = {1, 2, 3}, b = {2, 4, 6}, c = {-1, -2, -3}, zero = {0, 0, 0};
  CHECK(cosine_similarity(a, b) == doctest::Approx(1.0));
  CHECK(cosine_similarity(a, c) == doctest::Approx(-1.0));
  CHECK(cosine_similarity(a, zero) == 0.0);
  const std::vector<double> unnormalised = {2, 2, 2, 2};
  CHECK(entropy_nats(unnormalised) == doctest::Approx(std::log(4.0)));
}

TEST_CASE("map metrics reject empty or negative maps") {
  const std::vector<double> empty;
  CHECK_THROWS_AS(map_metrics(empty), Error);
  const std::vector<double> negative = {0.5, -0.1};
  CHECK_THROWS_AS(map_metrics(negative), Error);
  const std::vector<double> nan = {0.5, std::nan("")};
  CHECK_THROWS_AS(map_metrics(nan), Error);
}

TEST_CASE("gates: parsing") {
  auto g = parse_gate("tau_align>2.1:5%");
  CHECK(g.metric == "tau_align");
  CHECK(g.greater);
  CHECK(g.threshold == doctest::Approx(2.1));
  CHECK(g.max_fraction == doctest::Approx(0.05));
  CHECK(g.expression == "tau_align>2.1:5%");

  g = parse_gate("attn_mass<0.05");
  CHECK(g.metric == "attn_mass");
  CHECK_FALSE(g.greater);
  CHECK(g.threshold == doctest::Approx(0.05));
  CHECK(g.max_fraction == 0.0);

  g = parse_gate("cmp_js>0.1:12.5");  // the % sign is optional
  CHECK(g.max_fraction == doctest::Approx(0.125));
  g = parse_gate("knockout_delta<-1e-1:0%");
  CHECK(g.threshold == doctest::Approx(-0.1));
}

TEST_CASE("gates: malformed expressions are usage errors naming the expression") {
  for (const std::string bad : {"tau_align", "tau_align>", ">2.1", "tau_align>abc", "tau_align>2.1:", "tau_align>2.1:x%",
                                "tau_align>2.1:150%", "nonsense>1", "tau_align=2.1", "tau_align>2.1:5%%", "tau_align>>2"}) {
    CAPTURE(bad);
    try {
      (void)parse_gate(bad);
      FAIL("no error for a malformed gate");
    } catch (const Error& e) {
      CHECK(e.code() == ExitCode::kUsage);
      CHECK(std::string(e.what()).find("'" + bad + "'") != std::string::npos);
    }
  }
}

TEST_CASE("gates: evaluation counts violating samples against the allowed share") {
  const auto gate = parse_gate("tau_align>2.1:5%");
  std::vector<double> values(100, 1.0);
  for (int i = 0; i < 5; ++i) values[static_cast<size_t>(i)] = 3.0;
  auto r = evaluate_gate(gate, values);
  CHECK(r.samples == 100);
  CHECK(r.violating == 5);
  CHECK(r.fraction == doctest::Approx(0.05));
  CHECK(r.passed);  // exactly 5 % is allowed
  values[50] = 2.2;
  r = evaluate_gate(gate, values);
  CHECK(r.violating == 6);
  CHECK_FALSE(r.passed);
  CHECK(r.describe().find("tau_align>2.1:5%") != std::string::npos);
  CHECK(r.describe().find("failed") != std::string::npos);

  // Equal to the threshold does not violate a strict comparison.
  const auto strict = parse_gate("attn_mass<0.1");
  const std::vector<double> at = {0.1, 0.2};
  CHECK(evaluate_gate(strict, at).passed);
  const std::vector<double> below = {0.1, 0.05};
  CHECK_FALSE(evaluate_gate(strict, below).passed);
  CHECK(evaluate_gate(strict, std::vector<double>{}).passed);  // no samples carry the metric
}

TEST_CASE("dt_sem: per-frame masses of a frame-major map, attended frame, delay and the flag at the threshold") {
  // 3 frames x 4 tokens; the answer row puts 0.05 on every token of frames 0
  // and 2 and 0.10 on frame 1's tokens (plus a spike on one frame-2 token that
  // does not outweigh frame 1 as a whole).
  std::vector<double> map(12, 0.05);
  for (size_t j = 4; j < 8; ++j) map[j] = 0.10;
  map[9] = 0.15;
  const auto mass = frame_masses(map, 3);
  REQUIRE(mass.size() == 3);
  CHECK(mass[0] == doctest::Approx(0.20));
  CHECK(mass[1] == doctest::Approx(0.40));
  CHECK(mass[2] == doctest::Approx(0.30));

  const std::vector<double> times = {0.0, 400.0, 800.0};
  auto d = temporal_delay(mass, times, 800.0, 320.0);  // event in frame 2, the model looks at frame 1
  CHECK(d.attended_frame == 1);
  CHECK(d.dt_sem_ms == doctest::Approx(400.0));
  CHECK(d.flagged);
  d = temporal_delay(mass, times, 400.0, 320.0);  // on the event frame
  CHECK(d.attended_frame == 1);
  CHECK(d.dt_sem_ms == 0.0);
  CHECK_FALSE(d.flagged);
  // The flag is strict: a delay equal to the threshold is not flagged, one above it is.
  d = temporal_delay(mass, times, 80.0, 320.0);
  CHECK(d.dt_sem_ms == doctest::Approx(320.0));
  CHECK_FALSE(d.flagged);
  d = temporal_delay(mass, times, 79.0, 320.0);
  CHECK(d.dt_sem_ms == doctest::Approx(321.0));
  CHECK(d.flagged);
  // Ties go to the earliest frame.
  const std::vector<double> tied = {0.2, 0.3, 0.3};
  CHECK(temporal_delay(tied, times, 800.0, 320.0).attended_frame == 1);
  // One frame: its whole map is the frame mass.
  CHECK(frame_masses(map, 1) == std::vector<double>{std::accumulate(map.begin(), map.end(), 0.0)});
  // Shape errors are internal checks.
  CHECK_THROWS_AS(frame_masses(map, 5), Error);
  CHECK_THROWS_AS(frame_masses(map, 0), Error);
  CHECK_THROWS_AS(temporal_delay(mass, std::vector<double>{0.0, 400.0}, 0.0, 320.0), Error);
}

TEST_CASE("gates: dt_sem_ms is a gate metric") {
  const auto gate = parse_gate("dt_sem_ms>320:10%");
  CHECK(gate.metric == "dt_sem_ms");
  CHECK(gate.threshold == doctest::Approx(320.0));
  CHECK(gate.max_fraction == doctest::Approx(0.10));
  // 1 of 10 clips late: allowed; 2 of 10: failed.
  std::vector<double> delays(10, 0.0);
  delays[3] = 400.0;
  CHECK(evaluate_gate(gate, delays).passed);
  delays[7] = 800.0;
  CHECK_FALSE(evaluate_gate(gate, delays).passed);
}

TEST_CASE("report helpers: base64 and the heatmap PNG") {
  const auto bytes = [](const std::string& s) {
    return std::vector<unsigned char>(s.begin(), s.end());
  };
  CHECK(base64_encode(bytes("Man")) == "TWFu");
  CHECK(base64_encode(bytes("Ma")) == "TWE=");
  CHECK(base64_encode(bytes("M")) == "TQ==");
  CHECK(base64_encode(bytes("")) == "");
  CHECK(base64_encode(bytes("any carnal pleasure.")) == "YW55IGNhcm5hbCBwbGVhc3VyZS4=");
  CHECK(html_escape("<a href=\"x\">&'") == "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");

  cv::Mat image(60, 80, CV_8UC3, cv::Scalar(128, 128, 128));  // grey: the colour comes from the map
  std::vector<double> map(16, 0.0);
  map[5] = 1.0;  // row 1, column 1 of a 4x4 grid
  const auto png = heatmap_png(image, map, 64);
  REQUIRE_FALSE(png.empty());
  const auto decoded = cv::imdecode(png, cv::IMREAD_COLOR);
  REQUIRE(decoded.rows == 64);
  REQUIRE(decoded.cols == 64);
  // JET: the hot patch is red-dominated, a cold patch blue-dominated (BGR).
  const auto hot = decoded.at<cv::Vec3b>(24, 24), cold = decoded.at<cv::Vec3b>(56, 56);
  CHECK(hot[2] > hot[0]);
  CHECK(cold[0] > cold[2]);
  // A grid with a leading class token is accepted; a non-square one is not.
  std::vector<double> with_cls(17, 0.1);
  CHECK_FALSE(heatmap_png(image, with_cls, 32).empty());
  std::vector<double> odd(15, 0.1);
  CHECK(heatmap_png(image, odd, 32).empty());
}
