// CUDA MP-Cache dequantization kernel (lib/quant/cuda) against the CPU reference,
// bit for bit. Label gpu: without a CUDA device it prints the skip line and passes
// (ctest reports it as skipped through SKIP_REGULAR_EXPRESSION).
#include "quant/dequant.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <random>

namespace {

using namespace vlmopt::quant;

struct Config {
  const char* label;
  MpRole role;
  MpQDType qdtype;
  int32_t axis;
  uint32_t group_size;
  int64_t rows;
  int64_t cols;
  bool per_row_entries;  // params.rows = the dimension other than the axis
};

// Random parameters: scales over several decades (large ones overflow fp16 to inf,
// which both sides must agree on), zero points over the dtype's range, ~6 % masked channels.
MpCacheTensor random_params(const Config& c, std::mt19937& rng) {
  MpCacheTensor t;
  t.name = c.label;
  t.role = c.role;
  t.qdtype = c.qdtype;
  t.axis = c.axis;
  t.group_size = c.group_size;
  t.channels = static_cast<uint64_t>(c.axis == 0 ? c.rows : c.cols);
  t.rows = c.per_row_entries ? static_cast<uint64_t>(c.axis == 0 ? c.cols : c.rows) : 1;
  std::uniform_real_distribution<float> log_scale(-12.f, 10.f);
  const int lo = c.qdtype == MpQDType::kInt4 ? -8 : -128;
  const int hi = c.qdtype == MpQDType::kInt4 ? 7 : 127;
  std::uniform_int_distribution<int> zp(lo, hi);
  std::bernoulli_distribution masked(0.06);
  t.entries.resize(t.expected_entry_count());
  for (std::size_t i = 0; i < t.entries.size(); ++i) {
    auto& e = t.entries[i];
    e.scale = std::exp2(log_scale(rng));
    e.zero_point = zp(rng);
    const uint64_t group = i % t.groups_per_row();
    const uint64_t width = std::min<uint64_t>(t.group_size, t.channels - group * t.group_size);
    for (uint32_t b = 0; b < width; ++b)
      if (masked(rng)) e.set_masked(b);
  }
  return t;
}

}  // namespace

TEST_CASE("CUDA MP-Cache dequantization equals the CPU reference bit for bit") {
  if (!torch::cuda::is_available()) {
    MESSAGE("SKIPPED: CUDA not available");
    return;
  }
  const auto cuda = torch::Device(torch::kCUDA, 0);
  if (!have_cuda_dequant_kernel()) {
    // A GPU, but vlmopt built without its kernels: the error must say so.
    MpCacheTensor t;
    t.name = "w";
    t.channels = 1;
    t.entries.resize(1);
    std::string message;
    try {
      dequantize(torch::zeros({1, 1}, torch::TensorOptions(torch::kInt8).device(cuda)), t);
    } catch (const vlmopt::InputError& e) {
      message = e.what();
    }
    CHECK(message.find("built without CUDA kernels") != std::string::npos);
    return;
  }

  const Config configs[] = {
      {"per-channel weights", MpRole::kWeight, MpQDType::kInt8, 0, 1, 257, 129, false},
      {"group weights", MpRole::kWeight, MpQDType::kInt4, 1, 128, 67, 300, true},
      {"odd groups along rows, per-column entries", MpRole::kWeight, MpQDType::kInt8, 0, 7, 50, 33, true},
      {"activations", MpRole::kActivation, MpQDType::kInt8, -1, 256, 97, 1000, false},
      {"large activations", MpRole::kActivation, MpQDType::kInt8, -1, 256, 1024, 4099, false},
  };
  std::mt19937 rng(20261130);
  torch::manual_seed(11);
  for (const auto& c : configs) {
    CAPTURE(c.label);
    const auto params = random_params(c, rng);
    const int lo = c.qdtype == MpQDType::kInt4 ? -8 : -128;
    const int hi = c.qdtype == MpQDType::kInt4 ? 8 : 128;
    const auto q = torch::randint(lo, hi, {c.rows, c.cols}, torch::kInt8);
    const auto passthrough = torch::randn({c.rows, c.cols}).mul(100).to(torch::kHalf);
    const auto expected = dequantize_reference(q, params, passthrough);
    const auto got = dequantize(q.to(cuda), params, passthrough.to(cuda));
    REQUIRE(got.device().is_cuda());
    CHECK((got.scalar_type() == torch::kHalf));
    // Compare the fp16 bit patterns (exact, and NaN/-0 safe).
    CHECK(torch::equal(got.cpu().view(torch::kInt16), expected.view(torch::kInt16)));

    // Non-contiguous inputs give the same values.
    const auto q_t = q.t().contiguous().t();
    const auto got_t = dequantize(q_t.to(cuda), params, passthrough.to(cuda));
    CHECK(torch::equal(got_t.cpu().view(torch::kInt16), expected.view(torch::kInt16)));
  }

  SUBCASE("no mask bit: passthrough may be undefined") {
    MpCacheTensor t;
    t.name = "plain";
    t.axis = 1;
    t.group_size = 16;
    t.channels = 40;
    t.entries = {MpCacheEntry{0.5f, 1, {}}, MpCacheEntry{0.25f, -1, {}}, MpCacheEntry{2.f, 0, {}}};
    const auto q = torch::randint(-128, 128, {5, 40}, torch::kInt8);
    const auto expected = dequantize_reference(q, t);
    CHECK(torch::equal(dequantize(q.to(cuda), t).cpu().view(torch::kInt16), expected.view(torch::kInt16)));
  }
}
