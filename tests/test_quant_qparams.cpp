// Quantization parameter math, quantize / dequantize / fake-quantize (lib/quant).
#include "quant/qparams.hpp"
#include "quant/scheme.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace vlmopt::quant;

QuantArgs int_args(int bits, bool symmetric, Strategy strategy = Strategy::kTensor, int64_t group_size = 0) {
  QuantArgs args;
  args.num_bits = bits;
  args.symmetric = symmetric;
  args.strategy = strategy;
  args.group_size = group_size;
  return args;
}

QuantArgs fp8_args() {
  QuantArgs args;
  args.type = QuantType::kFloat;
  return args;
}

torch::Tensor scalar(float v) { return torch::tensor(v); }

float only(const torch::Tensor& t) {
  REQUIRE(t.numel() == 1);
  return t.item<float>();
}

int only_int(const torch::Tensor& t) {
  REQUIRE(t.numel() == 1);
  return static_cast<int>(t.item<int64_t>());
}

std::vector<float> floats(const torch::Tensor& t) {
  const auto c = t.to(torch::kFloat).contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

std::vector<int> ints(const torch::Tensor& t) {
  const auto c = t.to(torch::kInt).contiguous();
  return {c.data_ptr<int>(), c.data_ptr<int>() + c.numel()};
}

constexpr Convention kBoth[] = {Convention::kTorchAo, Convention::kCompressedTensors};

}  // namespace

TEST_CASE("scheme names, presets and integer ranges") {
  CHECK(parse_scheme("w8a8") == SchemeKind::kW8A8);
  CHECK(parse_scheme("w8a16") == SchemeKind::kW8A16);
  CHECK(parse_scheme("w4a16") == SchemeKind::kW4A16);
  CHECK(parse_scheme("fp8") == SchemeKind::kFP8);
  CHECK(parse_convention("torch-ao") == Convention::kTorchAo);
  CHECK(parse_convention("compressed-tensors") == Convention::kCompressedTensors);
  CHECK(to_string(Convention::kTorchAo) == "torch-ao");
  try {
    parse_scheme("w3a3");
    FAIL("expected an InputError");
  } catch (const vlmopt::InputError& e) {
    const std::string message = e.what();
    CHECK(message.find("'w3a3'") != std::string::npos);
    CHECK(message.find("w4a16") != std::string::npos);
  }
  CHECK_THROWS_AS(parse_convention("tensorrt"), vlmopt::InputError);

  const Scheme w8a8 = Scheme::preset(SchemeKind::kW8A8);
  CHECK(w8a8.name() == "w8a8");
  CHECK(w8a8.weights.strategy == Strategy::kChannel);
  REQUIRE(w8a8.input_activations.has_value());
  CHECK(w8a8.input_activations->strategy == Strategy::kTensor);
  CHECK_FALSE(w8a8.input_activations->dynamic);
  CHECK_FALSE(Scheme::preset(SchemeKind::kW8A16).input_activations.has_value());
  const Scheme w4 = Scheme::preset(SchemeKind::kW4A16);
  CHECK(w4.weights.num_bits == 4);
  CHECK(w4.weights.group_size == 128);
  CHECK(w4.weights.strategy == Strategy::kGroup);
  const Scheme fp8 = Scheme::preset(SchemeKind::kFP8);
  CHECK(fp8.weights.type == QuantType::kFloat);
  CHECK(fp8.input_activations->type == QuantType::kFloat);

  CHECK(int_args(8, true).qmin() == -128);
  CHECK(int_args(8, false).qmax() == 127);
  CHECK(int_args(4, true).qmin() == -8);
  CHECK(int_args(4, true).qmax() == 7);
  CHECK(fp8_args().qmin() == -448);
  CHECK(fp8_args().qmax() == 448);
}

TEST_CASE("symmetric int8 scale is amax / 127.5 in both conventions") {
  for (Convention conv : kBoth) {
    CAPTURE(to_string(conv));
    const QParams qp = compute_qparams(scalar(-1.0f), scalar(2.0f), int_args(8, true), conv);
    CHECK(qp.scale.sizes() == std::vector<int64_t>{1});
    CHECK((qp.scale.scalar_type() == torch::kFloat));
    CHECK((qp.zero_point.scalar_type() == torch::kInt));
    CHECK(only(qp.scale) == 2.0f / 127.5f);
    CHECK(only_int(qp.zero_point) == 0);
    // A negative side dominating.
    CHECK(only(compute_qparams(scalar(-3.0f), scalar(1.0f), int_args(8, true), conv).scale) == 3.0f / 127.5f);
  }
}

TEST_CASE("affine int8: scale = range / 255, zero point = qmin - round(mn / scale)") {
  for (Convention conv : kBoth) {
    CAPTURE(to_string(conv));
    // range 255 -> scale 1; mn = -10 -> zp = -128 + 10.
    QParams qp = compute_qparams(scalar(-10.0f), scalar(245.0f), int_args(8, false), conv);
    CHECK(only(qp.scale) == 1.0f);
    CHECK(only_int(qp.zero_point) == -118);
    // -1 .. 3: scale 4/255, mn / scale = -63.75 -> zp = -128 + 64.
    qp = compute_qparams(scalar(-1.0f), scalar(3.0f), int_args(8, false), conv);
    CHECK(only(qp.scale) == 4.0f / 255.0f);
    CHECK(only_int(qp.zero_point) == -64);
    // All-positive data: the range is widened to include 0, zp pins 0 to qmin.
    qp = compute_qparams(scalar(0.5f), scalar(2.0f), int_args(8, false), conv);
    CHECK(only(qp.scale) == 2.0f / 255.0f);
    CHECK(only_int(qp.zero_point) == -128);
    // All-negative data: zp at qmax.
    qp = compute_qparams(scalar(-2.0f), scalar(-0.5f), int_args(8, false), conv);
    CHECK(only(qp.scale) == 2.0f / 255.0f);
    CHECK(only_int(qp.zero_point) == 127);
  }
}

TEST_CASE("all-positive symmetric data uses max as amax") {
  for (Convention conv : kBoth) {
    const QParams qp = compute_qparams(scalar(0.5f), scalar(2.0f), int_args(8, true), conv);
    CHECK(only(qp.scale) == 2.0f / 127.5f);
    CHECK(only_int(qp.zero_point) == 0);
  }
}

TEST_CASE("zero data and tiny ranges: where the two conventions differ") {
  const float eps = 1.1920928955078125e-07f;  // torch.finfo(torch.float32).eps
  CHECK(kScaleEps == eps);
  // Zero range: both give eps. Affine zero point: torch.ao computes qmin - round(0 / eps) = qmin;
  // compressed-tensors computes 0/0 before replacing the scale, and its int8 cast makes that 0.
  CHECK(only(compute_qparams(scalar(0), scalar(0), int_args(8, true), Convention::kTorchAo).scale) == eps);
  CHECK(only(compute_qparams(scalar(0), scalar(0), int_args(8, true), Convention::kCompressedTensors).scale) == eps);
  QParams ao = compute_qparams(scalar(0), scalar(0), int_args(8, false), Convention::kTorchAo);
  QParams ct = compute_qparams(scalar(0), scalar(0), int_args(8, false), Convention::kCompressedTensors);
  CHECK(only(ao.scale) == eps);
  CHECK(only_int(ao.zero_point) == -128);
  CHECK(only(ct.scale) == eps);
  CHECK(only_int(ct.zero_point) == 0);
  // A non-zero range smaller than 127.5 * eps: torch.ao clamps to eps, compressed-tensors keeps it.
  ao = compute_qparams(scalar(-1e-6f), scalar(1e-6f), int_args(8, true), Convention::kTorchAo);
  ct = compute_qparams(scalar(-1e-6f), scalar(1e-6f), int_args(8, true), Convention::kCompressedTensors);
  CHECK(only(ao.scale) == eps);
  CHECK(only(ct.scale) == 1e-6f / 127.5f);
}

TEST_CASE("int4 and fp8 scales") {
  for (Convention conv : kBoth) {
    CAPTURE(to_string(conv));
    // int4: (qmax - qmin) / 2 = 7.5.
    QParams qp = compute_qparams(scalar(-7.5f), scalar(3.0f), int_args(4, true), conv);
    CHECK(only(qp.scale) == 1.0f);
    qp = compute_qparams(scalar(-1.0f), scalar(14.0f), int_args(4, false), conv);
    CHECK(only(qp.scale) == 1.0f);  // range 15 over 15 steps
    CHECK(only_int(qp.zero_point) == -7);
    // fp8 e4m3: amax / 448.
    qp = compute_qparams(scalar(-1.0f), scalar(2.0f), fp8_args(), conv);
    CHECK(only(qp.scale) == 2.0f / 448.0f);
    CHECK(only_int(qp.zero_point) == 0);
  }
  QuantArgs affine_fp8 = fp8_args();
  affine_fp8.symmetric = false;
  CHECK_THROWS_AS(compute_qparams(scalar(-1), scalar(1), affine_fp8, Convention::kCompressedTensors),
                  vlmopt::InputError);
}

TEST_CASE("qparams keep the caller's layout: channel [out,1], group [out,G], activation channel [in]") {
  const auto mins = torch::tensor({-1.0f, -2.0f, 0.5f}).reshape({3, 1});
  const auto maxs = torch::tensor({1.0f, 0.5f, 4.0f}).reshape({3, 1});
  const QParams qp = compute_qparams(mins, maxs, int_args(8, true, Strategy::kChannel), Convention::kTorchAo);
  CHECK(qp.scale.sizes() == std::vector<int64_t>{3, 1});
  CHECK(floats(qp.scale) == std::vector<float>{1.0f / 127.5f, 2.0f / 127.5f, 4.0f / 127.5f});
  const QParams group = compute_qparams(torch::full({4, 2}, -1.0f), torch::full({4, 2}, 1.0f),
                                        int_args(4, true, Strategy::kGroup, 16), Convention::kCompressedTensors);
  CHECK(group.scale.sizes() == std::vector<int64_t>{4, 2});
  CHECK(group.zero_point.sizes() == std::vector<int64_t>{4, 2});
}

TEST_CASE("quantize rounds half to even and clamps, in each convention's formula") {
  const auto x = torch::tensor({-8.6f, -0.5f, 0.5f, 1.5f, 2.5f, 7.4f, 9.0f});
  for (Convention conv : kBoth) {
    CAPTURE(to_string(conv));
    // int4 symmetric with scale 1.
    const QuantArgs args = int_args(4, true);
    const QParams qp = compute_qparams(scalar(-7.5f), scalar(7.5f), args, conv);
    const auto q = quantize(x, qp, args, conv);
    CHECK((q.scalar_type() == torch::kChar));
    CHECK(ints(q) == std::vector<int>{-8, 0, 0, 2, 2, 7, 7});
    CHECK(floats(dequantize(q, qp, args)) == std::vector<float>{-8, 0, 0, 2, 2, 7, 7});

    // int8 affine with scale 1 and zp -118: q = round(x) - 118 (torch.ao) / round(x - 118) (c-t): same here.
    const QuantArgs affine = int_args(8, false);
    const QParams aq = compute_qparams(scalar(-10.0f), scalar(245.0f), affine, conv);
    const auto xa = torch::tensor({2.5f, 3.5f, -10.0f, -20.0f, 300.0f});
    CHECK(ints(quantize(xa, aq, affine, conv)) == std::vector<int>{-116, -114, -128, -128, 127});
    CHECK(floats(dequantize(quantize(xa, aq, affine, conv), aq, affine)) == std::vector<float>{2, 4, -10, -10, 245});
  }
}

TEST_CASE("fp8 quantize casts to e4m3 with round-to-nearest-even and saturates at 448") {
  for (Convention conv : kBoth) {
    const QuantArgs args = fp8_args();
    const QParams qp = compute_qparams(scalar(-448.0f), scalar(448.0f), args, conv);
    REQUIRE(only(qp.scale) == 1.0f);
    // e4m3 spacing is 0.125 in [1, 2) and 0.25 in [2, 4): 1.0625 is a tie (-> 1.0), 1.1875 a tie (-> 1.25).
    const auto x = torch::tensor({1.0625f, 1.1875f, -3.3f, 500.0f, -1000.0f});
    const auto q = quantize(x, qp, args, conv);
    CHECK((q.scalar_type() == torch::kFloat8_e4m3fn));
    CHECK(floats(q) == std::vector<float>{1.0f, 1.25f, -3.25f, 448.0f, -448.0f});
    CHECK(floats(dequantize(q, qp, args)) == std::vector<float>{1.0f, 1.25f, -3.25f, 448.0f, -448.0f});
  }
}

TEST_CASE("round trip error is at most half a step inside the range") {
  torch::manual_seed(3);
  const auto w = torch::randn({16, 64});
  for (Convention conv : kBoth) {
    for (bool symmetric : {true, false}) {
      CAPTURE(symmetric);
      const QuantArgs args = int_args(8, symmetric, Strategy::kChannel);
      auto [mn, mx] = torch::aminmax(w, 1, true);
      const QParams qp = compute_qparams(mn, mx, args, conv);
      const auto back = dequantize(quantize(w, qp, args, conv), qp, args);
      const auto err = (back - w).abs();
      // Half a step, plus float32 rounding of x / scale and of (q - zp) * scale.
      CHECK((err <= qp.scale * 0.5f * (1.0f + 1e-4f)).all().item<bool>());
      CHECK(sqnr_db(w, back) > 35.0);
    }
  }
}

TEST_CASE("group quantization: one scale per row and group of columns") {
  // Ranges chosen so that every scale (amax / 7.5) is a power of two and every
  // x / scale below is exact: row 0 spans 3.75 and 15, row 1 spans 7.5 and 30.
  auto w = torch::zeros({2, 8});
  w.index_put_({0, 0}, 3.75f);
  w.index_put_({0, 5}, -15.0f);
  w.index_put_({1, 2}, -7.5f);
  w.index_put_({1, 7}, 30.0f);
  w.index_put_({1, 6}, 7.0f);
  const QuantArgs args = int_args(4, true, Strategy::kGroup, 4);
  auto [mn, mx] = torch::aminmax(w.reshape({2, 2, 4}), 2);
  const QParams qp = compute_qparams(mn, mx, args, Convention::kCompressedTensors);
  REQUIRE(qp.scale.sizes() == std::vector<int64_t>{2, 2});
  CHECK(floats(qp.scale) == std::vector<float>{0.5f, 2.0f, 1.0f, 4.0f});
  const auto q = quantize(w, qp, args, Convention::kCompressedTensors);
  CHECK(q.sizes() == w.sizes());
  // -15 / 2 = -7.5 -> -8 (even); 30 / 4 = 7.5 -> clamped to 7 first; 7 / 4 = 1.75 -> 2.
  CHECK(q.index({0, 5}).item<int>() == -8);
  CHECK(q.index({1, 7}).item<int>() == 7);
  CHECK(q.index({1, 6}).item<int>() == 2);
  CHECK(q.index({0, 0}).item<int>() == 7);
  const auto back = dequantize(q, qp, args);
  CHECK(back.index({1, 6}).item<float>() == 8.0f);
  CHECK(back.index({1, 7}).item<float>() == 28.0f);
  // A width that is not a multiple of the group size is rejected.
  CHECK_THROWS_AS(quantize(torch::zeros({2, 6}), qp, args, Convention::kCompressedTensors), vlmopt::InputError);
  // Scales that do not fit the tensor are rejected.
  CHECK_THROWS_AS(quantize(torch::zeros({3, 8}), qp, args, Convention::kCompressedTensors), vlmopt::InputError);
}

TEST_CASE("per-tensor and per-channel parameters broadcast over activations [B, T, C]") {
  torch::manual_seed(5);
  const auto x = torch::randn({2, 3, 4});
  const QuantArgs tensor_args = int_args(8, true);
  const QParams qt = compute_qparams(scalar(-4.0f), scalar(4.0f), tensor_args, Convention::kTorchAo);
  CHECK(quantize(x, qt, tensor_args, Convention::kTorchAo).sizes() == x.sizes());
  const QuantArgs channel_args = int_args(8, true, Strategy::kChannel);
  auto [mn, mx] = torch::aminmax(x.reshape({-1, 4}), 0);
  const QParams qc = compute_qparams(mn, mx, channel_args, Convention::kTorchAo);
  CHECK(qc.scale.sizes() == std::vector<int64_t>{4});
  const auto q = quantize(x, qc, channel_args, Convention::kTorchAo);
  CHECK(q.sizes() == x.sizes());
  // Each channel's extreme maps to +-127 or +-128 in its own scale.
  CHECK((q.to(torch::kInt).reshape({-1, 4}).abs().amax(0) >= 127).all().item<bool>());
  CHECK_THROWS_AS(quantize(torch::zeros({2, 5}), qc, channel_args, Convention::kTorchAo), vlmopt::InputError);
}

TEST_CASE("fake_quantize keeps x's dtype and passes gradients straight through") {
  const QuantArgs args = int_args(8, true);
  const QParams qp = compute_qparams(scalar(-127.5f), scalar(127.5f), args, Convention::kCompressedTensors);
  auto x = torch::tensor({0.4f, 1.6f, -2.5f, 300.0f}).set_requires_grad(true);
  const auto y = fake_quantize(x, qp, args, Convention::kCompressedTensors);
  CHECK(floats(y.detach()) == std::vector<float>{0.0f, 2.0f, -2.0f, 127.0f});
  CHECK(y.requires_grad());
  y.mul(torch::tensor({1.0f, 2.0f, 3.0f, 4.0f})).sum().backward();
  REQUIRE(x.grad().defined());
  CHECK(floats(x.grad()) == std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f});

  const auto half = torch::tensor({0.4f, 1.6f}).to(torch::kHalf);
  const auto yh = fake_quantize(half, qp, args, Convention::kTorchAo);
  CHECK((yh.scalar_type() == torch::kHalf));
  CHECK_FALSE(yh.requires_grad());
  CHECK(floats(yh) == std::vector<float>{0.0f, 2.0f});
}

TEST_CASE("sqnr_db") {
  const auto ref = torch::tensor({1.0f, 1.0f});
  CHECK(std::isinf(sqnr_db(ref, ref)));
  CHECK(sqnr_db(ref, ref) > 0);
  // signal 2, noise 0.01 + 0.01 -> 10 log10(100) = 20 dB.
  CHECK(sqnr_db(ref, torch::tensor({1.1f, 0.9f})) == doctest::Approx(20.0).epsilon(1e-5));
  CHECK(sqnr_db(torch::zeros({2}), ref) == -std::numeric_limits<double>::infinity());
}
