// Fused row statistics (calib/row_stats) against the torch reference ops, the
// observers' reduced-input entry point against observe(x), and the collector's
// fused CPU path against statistics computed from the tapped tensor.
#include "calib/collector.hpp"
#include "calib/fp16_safety.hpp"
#include "calib/observers.hpp"
#include "calib/row_stats.hpp"
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
#include "model/llava.hpp"
#include "test_support.hpp"

#include <ATen/Parallel.h>
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace vlmopt::calib;
using vlmopt::quant::Convention;
using vlmopt::quant::Strategy;

// Same dtype, shape and bytes (so +0 / -0 differ, and NaN equals the same NaN).
bool bit_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto ca = a.contiguous().cpu();
  const auto cb = b.contiguous().cpu();
  return std::memcmp(ca.const_data_ptr(), cb.const_data_ptr(), ca.nbytes()) == 0;
}

// Equal bit for bit where not NaN, NaN in the same places (NaN payloads are not compared).
bool same_values(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const auto nan_a = a.isnan(), nan_b = b.isnan();
  if (!torch::equal(nan_a, nan_b)) return false;
  return bit_equal(torch::where(nan_a, torch::zeros_like(a), a), torch::where(nan_b, torch::zeros_like(b), b));
}

bool same_double(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

void check_fp16(const Fp16Safety& got, const Fp16Safety& want) {
  CHECK(got.elements == want.elements);
  CHECK(got.overflow == want.overflow);
  CHECK(got.subnormal == want.subnormal);
  CHECK(got.underflow == want.underflow);
  CHECK(same_double(got.max_abs, want.max_abs));
  CHECK(same_double(got.min_abs_nonzero, want.min_abs_nonzero));
}

// Activations with what FP16 safety and min / max must get right: large values
// (beyond fp16's 65504), tiny ones (subnormal and below fp16's smallest), zeros of
// both signs, negatives; a `zero_column` whose values are all +0 / -0 (ties).
torch::Tensor nasty_rows(int64_t n, int64_t c, uint64_t seed) {
  torch::manual_seed(seed);
  auto x = torch::randn({n, c}) * 3;
  if (n * c == 0) return x;
  const auto pick = torch::rand({n, c});
  x = torch::where(pick < 0.01, torch::full({}, 7.0e4f), x);
  x = torch::where((pick >= 0.01) & (pick < 0.02), torch::full({}, -1.0e30f), x);
  x = torch::where((pick >= 0.02) & (pick < 0.04), x * 1e-5f, x);   // subnormal in fp16
  x = torch::where((pick >= 0.04) & (pick < 0.06), x * 1e-9f, x);   // flushed in fp16
  x = torch::where((pick >= 0.06) & (pick < 0.08), torch::zeros({}), x);
  x = torch::where((pick >= 0.08) & (pick < 0.10), torch::full({}, -0.0f), x);
  x = torch::where((pick >= 0.10) & (pick < 0.11), torch::full({}, 1e-45f), x);  // float32 denormal
  // Column 0: zeros only, signs at random; min and max are ties between +0 and -0.
  const auto signs = torch::rand({n}) < 0.5;
  x.select(1, 0).copy_(torch::where(signs, torch::full({}, -0.0f), torch::zeros({})));
  return x;
}

// The reference for one class: torch's aminmax over that class's rows and Fp16Counter over them.
void check_against_torch(const torch::Tensor& rows, const torch::Tensor& classes, int num_classes) {
  const auto stats = row_stats(rows, classes, num_classes);
  REQUIRE(stats.size() == static_cast<std::size_t>(num_classes));
  for (int k = 1; k <= num_classes; ++k) {
    CAPTURE(k);
    const auto part = classes.defined() ? rows.index({classes == k}) : rows;
    const auto& got = stats[static_cast<std::size_t>(k - 1)];
    CHECK(got.rows == part.size(0));
    if (part.size(0) == 0) {
      CHECK_FALSE(got.min.defined());
      CHECK(got.fp16.elements == 0);
      continue;
    }
    const auto [mn, mx] = torch::aminmax(part, 0);
    CHECK(same_values(got.min, mn.to(torch::kFloat32)));
    CHECK(same_values(got.max, mx.to(torch::kFloat32)));
    Fp16Counter counter;
    counter.observe(part);
    check_fp16(got.fp16, counter.result());
  }
}

// Runs `fn` with `threads` intra-op threads, restoring the previous setting.
template <typename Fn>
void with_threads(int threads, Fn&& fn) {
  const int before = at::get_num_threads();
  at::set_num_threads(threads);
  try {
    fn();
  } catch (...) {
    at::set_num_threads(before);
    throw;
  }
  at::set_num_threads(before);
}

ObserverOptions activation_options(ObserverKind kind, Strategy strategy, bool symmetric, Convention convention) {
  ObserverOptions o;
  o.kind = kind;
  o.args.strategy = strategy;
  o.args.symmetric = symmetric;
  o.convention = convention;
  o.target = ObserverTarget::kActivation;
  return o;
}

// The batch of rows of class `value`, with its min / max from row_stats (as the collector builds it).
ActivationBatch batch_of(const torch::Tensor& rows, const torch::Tensor& classes, uint8_t value) {
  const auto stats = row_stats(rows, classes, 2);
  const auto& s = stats[value - 1];
  ActivationBatch b;
  b.rows = rows;
  b.row_class = classes;
  b.row_class_value = value;
  b.count = s.rows;
  b.channel_min = s.min;
  b.channel_max = s.max;
  return b;
}

void check_same_observer(const Observer& got, const Observer& want) {
  CHECK(got.count() == want.count());
  CHECK(bit_equal(got.min_vals(), want.min_vals()));
  CHECK(bit_equal(got.max_vals(), want.max_vals()));
  const auto qg = got.qparams(), qw = want.qparams();
  CHECK(bit_equal(qg.scale, qw.scale));
  CHECK(bit_equal(qg.zero_point, qw.zero_point));
  const auto hg = got.histogram(), hw = want.histogram();
  REQUIRE(hg.has_value() == hw.has_value());
  if (hg) {
    CHECK(hg->width_exponent == hw->width_exponent);
    CHECK(bit_equal(hg->counts, hw->counts));
  }
}

}  // namespace

TEST_CASE("row_stats: per-class min / max and FP16 figures equal torch's ops, bit for bit") {
  // N = 0 and 1, C not a multiple of 8 (the vector width), several chunks per thread count.
  const std::pair<int64_t, int64_t> shapes[] = {{0, 5},    {1, 1},      {1, 13},    {3, 7},
                                                {64, 8},   {257, 33},   {1031, 100}, {4099, 61}};
  uint64_t seed = 10;
  for (const auto& [n, c] : shapes) {
    CAPTURE(n);
    CAPTURE(c);
    const auto rows = nasty_rows(n, c, ++seed);
    // Random classes, 0 = skipped (padding), 1 = image, 2 = text.
    const auto classes = torch::randint(0, 3, {n}, torch::kUInt8);
    for (int threads : {1, 2, 5}) {
      CAPTURE(threads);
      with_threads(threads, [&] {
        check_against_torch(rows, classes, 2);
        check_against_torch(rows, torch::Tensor(), 1);  // no classes: one class of every row
      });
    }
    // A class that never occurs, and every row skipped.
    check_against_torch(rows, torch::zeros({n}, torch::kUInt8), 2);
  }
}

TEST_CASE("row_stats: bfloat16 and half rows give the statistics of their float32 values") {
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const auto rows = (torch::randn({300, 45}) * 100).to(dtype);
    const auto classes = torch::randint(0, 3, {300}, torch::kUInt8);
    check_against_torch(rows, classes, 2);
    const auto as_float = row_stats(rows.to(torch::kFloat32), classes, 2);
    const auto direct = row_stats(rows, classes, 2);
    for (int k = 0; k < 2; ++k) {
      CHECK(bit_equal(direct[k].min, as_float[k].min));
      CHECK(bit_equal(direct[k].max, as_float[k].max));
    }
  }
}

TEST_CASE("row_stats: NaN makes its channel's min / max NaN, inf counts as overflow, as in torch") {
  auto rows = torch::randn({40, 9});
  rows.index_put_({5, 2}, std::numeric_limits<float>::quiet_NaN());
  rows.index_put_({33, 2}, std::numeric_limits<float>::quiet_NaN());
  rows.index_put_({17, 4}, std::numeric_limits<float>::infinity());
  rows.index_put_({19, 6}, -std::numeric_limits<float>::infinity());
  const auto classes = (torch::arange(40) % 3).to(torch::kUInt8);
  check_against_torch(rows, classes, 2);
  const auto stats = row_stats(rows, classes, 2);
  // Classes are row % 3: row 5 is text, row 33 skipped, so only text sees the NaN;
  // +inf (row 17) is text, -inf (row 19) image.
  CHECK(std::isnan(stats[1].min[2].item<float>()));
  CHECK(std::isnan(stats[1].fp16.max_abs));
  CHECK_FALSE(std::isnan(stats[0].min[2].item<float>()));
  CHECK(stats[0].fp16.overflow == 1);
  CHECK(stats[1].fp16.overflow == 1);
  // A NaN in a skipped row changes nothing.
  CHECK_FALSE(std::isnan(stats[0].fp16.max_abs));
}

TEST_CASE("row_stats: rejects what it does not handle") {
  CHECK_FALSE(row_stats_supported(torch::zeros({4})));
  CHECK_FALSE(row_stats_supported(torch::zeros({4, 2}, torch::kDouble)));
  CHECK(row_stats_supported(torch::zeros({4, 2}, torch::kHalf)));
  CHECK_THROWS(row_stats(torch::zeros({4, 2}), torch::zeros({3}, torch::kUInt8), 2));       // wrong length
  CHECK_THROWS(row_stats(torch::zeros({4, 2}), torch::full({4}, 3, torch::kUInt8), 2));     // class 3 of 2
  CHECK_THROWS(row_stats(torch::zeros({4, 2}), torch::zeros({4}, torch::kInt64), 2));       // not uint8
}

TEST_CASE("add_abs_histogram: equals torch's floor(|x| * 2^-e) bincount, per class") {
  for (int e : {-6, -3, 0, 2}) {
    CAPTURE(e);
    const auto rows = torch::randn({513, 27}) * 5;
    const auto classes = torch::randint(0, 3, {513}, torch::kUInt8);
    const int64_t bins = static_cast<int64_t>(std::floor(std::ldexp(rows.abs().max().item<double>(), -e))) + 3;
    for (uint8_t value : {1, 2}) {
      const auto part = rows.index({classes == value});
      const auto index = torch::floor(part.abs().flatten() * std::ldexp(1.0, -e)).to(torch::kLong);
      const auto want = torch::bincount(index, {}, bins) + 7;
      auto counts = torch::full({bins}, 7, torch::kLong);  // adds to what is there
      add_abs_histogram(rows, classes, value, e, counts);
      CHECK(torch::equal(counts, want));
    }
    auto all = torch::zeros({bins}, torch::kLong);
    add_abs_histogram(rows.to(torch::kBFloat16), {}, 0, e, all);
    const auto index = torch::floor(rows.to(torch::kBFloat16).to(torch::kFloat).abs().flatten() * std::ldexp(1.0, -e))
                           .to(torch::kLong);
    CHECK(torch::equal(all, torch::bincount(index, {}, bins)));
  }
  auto small = torch::zeros({2}, torch::kLong);
  CHECK_THROWS(add_abs_histogram(torch::tensor({{1.0f, 5.0f}}), {}, 0, 0, small));  // 5 is beyond 2 bins of width 1
  CHECK_THROWS(add_abs_histogram(torch::tensor({{1.0f, std::numeric_limits<float>::quiet_NaN()}}), {}, 0, 0, small));
  CHECK(small.sum().item<int64_t>() == 0);  // nothing was added
}

TEST_CASE("fp16 counter: add() of precomputed figures equals observe() of the batches") {
  torch::manual_seed(3);
  Fp16Counter observed, added;
  for (int i = 0; i < 4; ++i) {
    auto x = nasty_rows(50, 6, 100 + i);
    if (i == 2) x.index_put_({3, 3}, std::numeric_limits<float>::quiet_NaN());
    if (i == 3) x.zero_();  // no nonzero values at all
    observed.observe(x);
    added.add(row_stats(x, {}, 1)[0].fp16);
  }
  check_fp16(added.result(), observed.result());
  CHECK(std::isnan(added.result().max_abs));  // NaN sticks across batches, as torch::maximum does
  check_fp16(Fp16Counter().result(), Fp16Safety{});
}

TEST_CASE("observers: the reduced-input entry point gives the state observe(x) gives, bit for bit") {
  const ObserverKind kinds[] = {ObserverKind::kMinMax, ObserverKind::kMovingAverage, ObserverKind::kPercentile,
                                ObserverKind::kEntropy, ObserverKind::kMse};
  for (ObserverKind kind : kinds) {
    const bool per_tensor_only = kind == ObserverKind::kPercentile || kind == ObserverKind::kEntropy;
    for (Strategy strategy : {Strategy::kTensor, Strategy::kChannel}) {
      if (per_tensor_only && strategy == Strategy::kChannel) continue;
      for (bool symmetric : {true, false}) {
        for (Convention convention : {Convention::kCompressedTensors, Convention::kTorchAo}) {
          CAPTURE(to_string(kind));
          CAPTURE(static_cast<int>(strategy));
          CAPTURE(symmetric);
          CAPTURE(static_cast<int>(convention));
          const auto options = activation_options(kind, strategy, symmetric, convention);
          auto reference = make_observer(options);
          auto reduced = make_observer(options);
          // Batches with growing ranges (histograms grow and coarsen), a skipped class and ties at zero.
          for (int b = 0; b < 5; ++b) {
            auto rows = nasty_rows(120 + 13 * b, 24, 40 + b);
            rows = torch::where(rows.abs() > 1e4, torch::full({}, 1e4f), rows) * std::pow(3.0, b);  // moderate outliers
            const auto classes = torch::randint(0, 3, {rows.size(0)}, torch::kUInt8);
            for (uint8_t value : {1, 2}) {
              reference->observe(rows.index({classes == value}));
              reduced->observe(batch_of(rows, classes, value));
            }
          }
          check_same_observer(*reduced, *reference);
        }
      }
    }
  }
}

TEST_CASE("observers: minmax and moving-average take the batch's min / max alone, never its rows") {
  for (ObserverKind kind : {ObserverKind::kMinMax, ObserverKind::kMovingAverage}) {
    for (Strategy strategy : {Strategy::kTensor, Strategy::kChannel}) {
      CAPTURE(to_string(kind));
      const auto options = activation_options(kind, strategy, false, Convention::kCompressedTensors);
      auto reference = make_observer(options);
      auto reduced = make_observer(options);
      for (int b = 0; b < 3; ++b) {
        const auto x = torch::randn({30, 12}) * (b + 1);
        reference->observe(x);
        const auto [mn, mx] = torch::aminmax(x, 0);
        ActivationBatch batch;
        // Rows of NaN: any read of them would turn the statistics into NaN.
        batch.rows = torch::full({30, 12}, std::numeric_limits<float>::quiet_NaN());
        batch.count = 30;
        batch.channel_min = mn;
        batch.channel_max = mx;
        reduced->observe(batch);
      }
      check_same_observer(*reduced, *reference);
    }
  }
}

TEST_CASE("observers: reduced input with no classes, bfloat16 rows, and empty batches") {
  for (ObserverKind kind : {ObserverKind::kMinMax, ObserverKind::kMovingAverage, ObserverKind::kEntropy}) {
    CAPTURE(to_string(kind));
    const auto options = activation_options(kind, Strategy::kTensor, true, Convention::kCompressedTensors);
    auto reference = make_observer(options);
    auto reduced = make_observer(options);
    for (int b = 0; b < 3; ++b) {
      const auto rows = (torch::randn({77, 16}) * (b + 1)).to(torch::kBFloat16);
      reference->observe(rows);
      const auto s = row_stats(rows, {}, 1)[0];
      ActivationBatch batch;
      batch.rows = rows;
      batch.count = s.rows;
      batch.channel_min = s.min;
      batch.channel_max = s.max;
      reduced->observe(batch);
      ActivationBatch empty;
      empty.rows = rows;
      empty.row_class = torch::zeros({77}, torch::kUInt8);
      reduced->observe(empty);  // count 0: ignored
    }
    check_same_observer(*reduced, *reference);
  }
}

TEST_CASE("collector: the fused CPU path keeps every statistic of the per-modality torch reference") {
  using namespace vlmopt;
  const auto dir = vlmopt::testing::fixture_dir("clip_llama_old");
  auto model = model::LlavaModel::load(dir, torch::kCPU);
  const auto ref = io::Checkpoint::open(dir / "reference.safetensors");
  model::ForwardInputs inputs;
  inputs.input_ids = io::load_tensor(ref, "input_ids");
  inputs.pixel_values = io::load_tensor(ref, "pixel_values");
  inputs.attention_mask = io::load_tensor(ref, "attention_mask");
  const std::string q = "model.language_model.layers.1.self_attn.q_proj";

  for (ObserverKind kind : {ObserverKind::kMinMax, ObserverKind::kEntropy, ObserverKind::kMse}) {
    CAPTURE(to_string(kind));
    torch::Tensor captured, image_mask, token_mask;
    const int id = model.taps().subscribe(q + ".input", [&](std::string_view, const torch::Tensor& x,
                                                            const model::TapContext& ctx) {
      captured = x.clone();
      image_mask = ctx.image_mask ? ctx.image_mask->clone() : torch::Tensor();
      token_mask = ctx.attention_mask ? ctx.attention_mask->clone() : torch::Tensor();
    });
    CollectorOptions options;
    options.observer.kind = kind;
    options.sample_tokens = 5;  // fewer than either modality's rows: the sample takes image rows only
    ActivationCollector collector(model, {q}, options);
    (void)model.forward(inputs);
    model.taps().unsubscribe(id);
    collector.detach();
    REQUIRE(captured.defined());
    REQUIRE(image_mask.defined());

    const auto rows = captured.reshape({-1, captured.size(-1)});
    const auto img = image_mask.reshape({-1});
    const auto valid = token_mask.defined() ? token_mask.reshape({-1}) != 0 : torch::ones_like(img);
    const auto image_rows = rows.index({img & valid});
    const auto text_rows = rows.index({valid & img.logical_not()});
    const auto& stats = collector.stats_for(q);
    REQUIRE(image_rows.size(0) > 5);
    CHECK(stats.image_tokens == image_rows.size(0));
    CHECK(stats.text_tokens == text_rows.size(0));
    const auto [imin, imax] = torch::aminmax(image_rows, 0);
    const auto [tmin, tmax] = torch::aminmax(text_rows, 0);
    CHECK(bit_equal(stats.channel_min, torch::minimum(imin, tmin)));
    CHECK(bit_equal(stats.channel_max, torch::maximum(imax, tmax)));
    CHECK(bit_equal(stats.image_range, torch::stack({imin.min(), imax.max()})));
    CHECK(bit_equal(stats.text_range, torch::stack({tmin.min(), tmax.max()})));
    Fp16Counter fp16;
    fp16.observe(image_rows);
    fp16.observe(text_rows);
    check_fp16(stats.fp16_safety(), fp16.result());
    CHECK(bit_equal(stats.sample, image_rows.slice(0, 0, 5)));
    auto image_observer = make_observer(options.observer);
    image_observer->observe(image_rows);
    auto text_observer = make_observer(options.observer);
    text_observer->observe(text_rows);
    check_same_observer(*stats.image, *image_observer);
    check_same_observer(*stats.text, *text_observer);
  }
}
