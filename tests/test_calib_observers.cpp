// Calibration observers (calib/observers): statistics, merging, histogram selection.
#include "calib/observers.hpp"
#include "quant/qparams.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

using namespace vlmopt::calib;
using vlmopt::quant::Convention;
using vlmopt::quant::QuantArgs;
using vlmopt::quant::Strategy;

ObserverOptions options_for(ObserverKind kind, Strategy strategy = Strategy::kTensor,
                            ObserverTarget target = ObserverTarget::kActivation) {
  ObserverOptions o;
  o.kind = kind;
  o.args.strategy = strategy;
  o.target = target;
  return o;
}

bool bit_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto ca = a.contiguous().cpu();
  const auto cb = b.contiguous().cpu();
  return std::memcmp(ca.const_data_ptr(), cb.const_data_ptr(), ca.nbytes()) == 0;
}

// Histogram of |x| computed directly at bin width 2^exponent, one bin past the max.
torch::Tensor direct_histogram(const torch::Tensor& x, int exponent) {
  const auto a = x.abs().flatten().to(torch::kDouble);
  const auto index = torch::floor(a * std::ldexp(1.0, -exponent)).to(torch::kLong);
  const int64_t bins = index.max().item<int64_t>() + 1;
  return torch::bincount(index, {}, bins);
}

// Heavy tail: unit normal bulk plus a handful of large outliers.
torch::Tensor heavy_tailed(int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  auto x = torch::randn({n});
  x.index_put_({torch::indexing::Slice(0, 8)}, torch::tensor({60.0f, -80.0f, 100.0f, 70.0f, -55.0f, 90.0f, 65.0f, -75.0f}));
  return x;
}

}  // namespace

TEST_CASE("observer kinds parse and print") {
  const std::pair<const char*, ObserverKind> names[] = {{"minmax", ObserverKind::kMinMax},
                                                        {"moving-average", ObserverKind::kMovingAverage},
                                                        {"percentile", ObserverKind::kPercentile},
                                                        {"mse", ObserverKind::kMse},
                                                        {"entropy", ObserverKind::kEntropy}};
  for (const auto& [text, kind] : names) {
    CHECK(parse_observer_kind(text) == kind);
    CHECK(to_string(kind) == text);
  }
  CHECK_THROWS_AS(parse_observer_kind("kl"), vlmopt::InputError);
  // Histogram observers are per tensor; groups are for weights.
  CHECK_THROWS_AS(make_observer(options_for(ObserverKind::kEntropy, Strategy::kChannel)), vlmopt::InputError);
  auto group = options_for(ObserverKind::kMinMax, Strategy::kGroup);
  group.args.group_size = 4;
  CHECK_THROWS_AS(make_observer(group), vlmopt::InputError);
}

TEST_CASE("min-max: running min / max, count, and qparams from them") {
  torch::manual_seed(1);
  const auto a = torch::randn({4, 16});
  const auto b = torch::randn({2, 16}) * 3;
  auto obs = make_observer(options_for(ObserverKind::kMinMax));
  obs->observe(a);
  obs->observe(torch::empty({0, 16}));  // ignored
  obs->observe(b);
  CHECK(obs->count() == 96);
  auto [mn, mx] = torch::aminmax(torch::cat({a, b}));
  CHECK(bit_equal(obs->min_vals(), mn.reshape({1})));
  CHECK(bit_equal(obs->max_vals(), mx.reshape({1})));
  CHECK(bit_equal(obs->amax(), torch::max(-mn, mx).reshape({1})));
  const auto qp = obs->qparams();
  const auto expected = vlmopt::quant::compute_qparams(mn, mx, obs->options().args, obs->options().convention);
  CHECK(bit_equal(qp.scale, expected.scale));
  CHECK(bit_equal(qp.zero_point, expected.zero_point));
  // Before any data there are no statistics.
  auto empty = make_observer(options_for(ObserverKind::kMinMax));
  CHECK(empty->count() == 0);
  CHECK_THROWS_AS(empty->qparams(), vlmopt::Error);
}

TEST_CASE("layouts: weight channel [out,1], weight group [out,G], activation channel [in]") {
  torch::manual_seed(2);
  const auto w = torch::randn({3, 8});
  auto channel = make_observer(options_for(ObserverKind::kMinMax, Strategy::kChannel, ObserverTarget::kWeight));
  channel->observe(w);
  CHECK(bit_equal(channel->max_vals(), w.amax(1, true)));
  CHECK(channel->qparams().scale.sizes() == std::vector<int64_t>{3, 1});

  auto group_options = options_for(ObserverKind::kMinMax, Strategy::kGroup, ObserverTarget::kWeight);
  group_options.args.group_size = 4;
  auto group = make_observer(group_options);
  group->observe(w);
  CHECK(bit_equal(group->min_vals(), w.reshape({3, 2, 4}).amin(2)));
  CHECK(group->qparams().scale.sizes() == std::vector<int64_t>{3, 2});
  CHECK_THROWS_AS(group->observe(torch::randn({3, 6})), vlmopt::InputError);

  const auto act = torch::randn({2, 5, 8});
  auto per_channel = make_observer(options_for(ObserverKind::kMinMax, Strategy::kChannel));
  per_channel->observe(act);
  CHECK(bit_equal(per_channel->max_vals(), act.reshape({-1, 8}).amax(0)));
  CHECK(per_channel->qparams().scale.sizes() == std::vector<int64_t>{8});
  CHECK_THROWS_AS(per_channel->observe(torch::randn({2, 5, 7})), vlmopt::Error);
}

TEST_CASE("merge: min / max of shards equal the statistics of all the data, bit for bit") {
  torch::manual_seed(3);
  const auto a = torch::randn({32, 8});
  const auto b = torch::randn({16, 8}) * 2 + 0.5;
  for (Strategy strategy : {Strategy::kTensor, Strategy::kChannel}) {
    auto shard_a = make_observer(options_for(ObserverKind::kMinMax, strategy));
    auto shard_b = make_observer(options_for(ObserverKind::kMinMax, strategy));
    auto whole = make_observer(options_for(ObserverKind::kMinMax, strategy));
    shard_a->observe(a);
    shard_b->observe(b);
    whole->observe(torch::cat({a, b}));
    shard_a->merge(*shard_b);
    CHECK(shard_a->count() == whole->count());
    CHECK(bit_equal(shard_a->min_vals(), whole->min_vals()));
    CHECK(bit_equal(shard_a->max_vals(), whole->max_vals()));
    CHECK(bit_equal(shard_a->qparams().scale, whole->qparams().scale));
  }
  // Merging into an empty observer copies; options must match.
  auto empty = make_observer(options_for(ObserverKind::kMinMax));
  auto full = make_observer(options_for(ObserverKind::kMinMax));
  full->observe(a);
  empty->merge(*full);
  CHECK(bit_equal(empty->max_vals(), full->max_vals()));
  auto other_kind = make_observer(options_for(ObserverKind::kMovingAverage));
  CHECK_THROWS_AS(full->merge(*other_kind), vlmopt::Error);
}

TEST_CASE("moving average follows torch.ao: first batch sets, then min += c * (cur - min)") {
  torch::manual_seed(4);
  auto options = options_for(ObserverKind::kMovingAverage);
  options.averaging_constant = 0.25;
  auto obs = make_observer(options);
  float expected_min = 0;
  float expected_max = 0;
  for (int i = 0; i < 4; ++i) {
    const auto batch = torch::randn({64}) * (1.0 + i);
    obs->observe(batch);
    const float cur_min = batch.min().item<float>();
    const float cur_max = batch.max().item<float>();
    if (i == 0) {
      expected_min = cur_min;
      expected_max = cur_max;
    } else {
      expected_min = expected_min + 0.25f * (cur_min - expected_min);
      expected_max = expected_max + 0.25f * (cur_max - expected_max);
    }
  }
  CHECK(obs->min_vals().item<float>() == doctest::Approx(expected_min).epsilon(1e-6));
  CHECK(obs->max_vals().item<float>() == doctest::Approx(expected_max).epsilon(1e-6));
  // Merging averaged statistics weighs them by element count.
  auto other = make_observer(options);
  other->observe(torch::full({768}, 10.0f));  // 768 of 1024 elements: weight 0.75
  obs->merge(*other);
  CHECK(obs->max_vals().item<float>() == doctest::Approx(0.25 * expected_max + 0.75 * 10.0).epsilon(1e-6));
}

TEST_CASE("histogram: power-of-two bin width, growth keeps the width, counts match direct binning") {
  torch::manual_seed(5);
  const auto a = torch::rand({1000}) * 2 - 1;  // |x| < 1
  auto obs = make_observer(options_for(ObserverKind::kEntropy));
  obs->observe(a);
  auto h = obs->histogram();
  REQUIRE(h.has_value());
  const double absmax = a.abs().max().item<double>();
  // Smallest power-of-two width with max < 2048 * w; bins = floor(max / w) + 1 in (1024, 2048].
  CHECK(absmax < 2048 * h->bin_width());
  CHECK(absmax >= 1024 * h->bin_width());
  CHECK(h->counts.size(0) == static_cast<int64_t>(std::floor(absmax / h->bin_width())) + 1);
  CHECK(bit_equal(h->counts, direct_histogram(a, h->width_exponent)));

  // A batch with a 3x larger max adds bins of the same width.
  const auto b = torch::rand({500}) * 3;
  obs->observe(b);
  const auto grown = obs->histogram();
  CHECK(grown->width_exponent == h->width_exponent);
  CHECK(bit_equal(grown->counts, direct_histogram(torch::cat({a, b}), h->width_exponent)));

  // A 100x larger max exceeds 8 * 2048 bins: the width doubles until it fits, counts stay exact.
  const auto c = torch::rand({500}) * 100;
  obs->observe(c);
  const auto coarse = obs->histogram();
  CHECK(coarse->width_exponent > h->width_exponent);
  CHECK(coarse->counts.size(0) <= 8 * 2048);
  CHECK(bit_equal(coarse->counts, direct_histogram(torch::cat({a, b, c}), coarse->width_exponent)));
  CHECK(obs->count() == 2000);
}

TEST_CASE("histogram merge is exact: shards at different widths equal one histogram of all the data") {
  torch::manual_seed(6);
  const auto a = torch::randn({4000}) * 0.1;
  const auto b = heavy_tailed(3000, 7);
  const auto zeros = torch::zeros({100});
  for (ObserverKind kind : {ObserverKind::kEntropy, ObserverKind::kPercentile}) {
    auto shard_a = make_observer(options_for(kind));
    auto shard_b = make_observer(options_for(kind));
    auto shard_zero = make_observer(options_for(kind));
    auto whole = make_observer(options_for(kind));
    shard_zero->observe(zeros);  // only zeros: no width yet
    shard_a->observe(a);
    shard_b->observe(b);
    whole->observe(torch::cat({a, b, zeros}));
    shard_zero->merge(*shard_a);
    shard_zero->merge(*shard_b);
    const auto merged = shard_zero->histogram();
    const auto single = whole->histogram();
    REQUIRE(merged.has_value());
    CHECK(merged->width_exponent == single->width_exponent);
    CHECK(bit_equal(merged->counts, single->counts));
    CHECK(bit_equal(merged->counts, direct_histogram(torch::cat({a, b, zeros}), merged->width_exponent)));
    CHECK(bit_equal(shard_zero->min_vals(), whole->min_vals()));
    CHECK(bit_equal(shard_zero->max_vals(), whole->max_vals()));
    CHECK(bit_equal(shard_zero->amax(), whole->amax()));
    CHECK(shard_zero->count() == whole->count());
  }
}

TEST_CASE("percentile: upper edge of the bin where the cumulative count reaches the percentile") {
  // |x| = 1 .. 10000: max 10000 -> width 8 (10000 < 2048 * 8), 1251 bins. 99 % of 10000
  // values is reached at value 9900, in bin floor(9900 / 8) = 1237 -> amax = 1238 * 8.
  const auto x = torch::arange(1, 10001, torch::kFloat) * torch::where(torch::arange(10000) % 2 == 0, 1.0f, -1.0f);
  auto options = options_for(ObserverKind::kPercentile);
  options.percentile = 99.0;
  auto obs = make_observer(options);
  obs->observe(x);
  REQUIRE(obs->histogram()->width_exponent == 3);
  CHECK(obs->amax().item<float>() == 9904.0f);
  CHECK(obs->max_vals().item<float>() == 9904.0f);
  CHECK(obs->min_vals().item<float>() == -9904.0f);
  // 100 % is the maximum itself (the bin's upper edge is capped at max |x|).
  options.percentile = 100.0;
  auto all = make_observer(options);
  all->observe(x);
  CHECK(all->amax().item<float>() == 10000.0f);
}

TEST_CASE("entropy: clips heavy tails, keeps about the max on uniform data") {
  // Student-t with 3 degrees of freedom: a dense bulk with a long, thinning tail.
  torch::manual_seed(11);
  const auto t3 = torch::randn({200000}) / torch::sqrt(torch::randn({200000, 3}).square().sum(1) / 3);
  auto heavy = make_observer(options_for(ObserverKind::kEntropy));
  heavy->observe(t3);
  const float amax = heavy->amax().item<float>();
  const float max_abs = t3.abs().max().item<float>();
  CHECK(amax < 0.5f * max_abs);
  CHECK(amax > 3.0f);  // keeps the bulk (99.9 % of |t3| is below ~12.9; 95 % below 3.2)
  CHECK(heavy->qparams().scale.item<float>() == amax / 127.5f);

  torch::manual_seed(12);
  const auto u = torch::rand({200000}) * 2 - 1;
  auto uniform = make_observer(options_for(ObserverKind::kEntropy));
  uniform->observe(u);
  CHECK(uniform->amax().item<float>() >= 0.95f * u.abs().max().item<float>());

  // Only zeros: amax 0, scale eps.
  auto zero = make_observer(options_for(ObserverKind::kEntropy));
  zero->observe(torch::zeros({10}));
  CHECK(zero->amax().item<float>() == 0.0f);
  CHECK(zero->qparams().scale.item<float>() == vlmopt::quant::kScaleEps);
  CHECK_FALSE(zero->histogram().has_value());
  // Non-finite input is reported.
  auto bad = make_observer(options_for(ObserverKind::kEntropy));
  CHECK_THROWS_AS(bad->observe(torch::tensor({1.0f, std::numeric_limits<float>::infinity()})), vlmopt::InputError);
}

TEST_CASE("mse: shrinks an outlier-stretched range and lowers the quantization error") {
  torch::manual_seed(13);
  auto w = torch::randn({8, 256});
  w.index_put_({torch::indexing::Slice(), 0}, 12.0f);  // one outlier per row
  auto minmax = make_observer(options_for(ObserverKind::kMinMax, Strategy::kChannel, ObserverTarget::kWeight));
  auto mse = make_observer(options_for(ObserverKind::kMse, Strategy::kChannel, ObserverTarget::kWeight));
  minmax->observe(w);
  mse->observe(w);
  const auto raw = minmax->max_vals();
  const auto shrunk = mse->max_vals();
  CHECK((shrunk <= raw).all().item<bool>());
  CHECK((shrunk >= raw * 0.8).all().item<bool>());  // at most 20 % shrink
  const auto& args = mse->options().args;
  const auto err = [&](const vlmopt::calib::Observer& o) {
    const auto fq = vlmopt::quant::fake_quantize(w, o.qparams(), args, Convention::kCompressedTensors);
    return (fq - w).abs().pow(2.4).sum().item<double>();
  };
  CHECK(err(*mse) <= err(*minmax));
}
