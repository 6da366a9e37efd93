// MP-Cache file format (lib/quant/mp_cache), CPU dequantization reference
// (lib/quant/dequant) and `vlmopt inspect` of an MP-Cache file (lib/bundle/inspect).
#include "test_support.hpp"
#include "bundle/inspect.hpp"
#include "io/hash.hpp"
#include "quant/dequant.hpp"
#include "quant/mp_cache.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <random>

namespace {
using vlmopt::testing::TempDir;
using vlmopt::testing::read_bytes;
using vlmopt::testing::write_bytes;

namespace fs = std::filesystem;
using namespace vlmopt::quant;

template <typename T>
T get_le(const std::string& bytes, std::size_t offset) {
  T value;
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  return value;
}

template <typename T>
void put_le(std::string& bytes, std::size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

// Recomputes the checksum field (bytes 96..127: SHA-256 of the file with that field zeroed),
// so a corrupted file reaches the check it is meant to hit rather than the checksum.
void reseal(std::string& bytes) {
  std::memset(bytes.data() + 96, 0, 32);
  const auto hex = vlmopt::io::sha256_hex(std::string_view(bytes));
  for (std::size_t i = 0; i < 32; ++i) bytes[96 + i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
}

std::string input_error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const vlmopt::InputError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected an InputError, got another exception: " << e.what());
    return {};
  }
  FAIL("expected an InputError, nothing was thrown");
  return {};
}

MpCacheEntry entry(float scale, int32_t zero_point, std::initializer_list<uint32_t> masked = {}) {
  MpCacheEntry e;
  e.scale = scale;
  e.zero_point = zero_point;
  for (uint32_t bit : masked) e.set_masked(bit);
  return e;
}

// Three tensors: per-channel int8 weights, int4 group weights (2 rows x 2 groups),
// and per-tensor activations over 300 channels with outliers 3 and 257.
MpCache sample_cache() {
  MpCache cache;
  MpCacheTensor w;
  w.name = "model.language_model.layers.0.self_attn.q_proj";
  w.role = MpRole::kWeight;
  w.qdtype = MpQDType::kInt8;
  w.axis = 0;
  w.group_size = 1;
  w.channels = 3;
  w.entries = {entry(0.5f, 0), entry(0.25f, 0), entry(2.0f, 0)};
  cache.tensors.push_back(w);

  MpCacheTensor a;
  a.name = w.name;
  a.role = MpRole::kActivation;
  a.qdtype = MpQDType::kInt8;
  a.axis = -1;
  a.group_size = 256;
  a.channels = 300;
  a.entries = {entry(0.125f, -3, {3}), entry(0.125f, -3, {1})};
  cache.tensors.push_back(a);

  MpCacheTensor g;
  g.name = "model.language_model.layers.0.mlp.down_proj";
  g.role = MpRole::kWeight;
  g.qdtype = MpQDType::kInt4;
  g.axis = 1;
  g.group_size = 4;
  g.channels = 6;
  g.rows = 2;
  g.entries = {entry(1.0f, 0), entry(0.5f, 1), entry(0.25f, -1), entry(4.0f, 0, {1})};
  cache.tensors.push_back(g);
  return cache;
}

// Byte offsets of the header fields and directory records (docs/mp-cache.md).
constexpr std::size_t kTensorCount = 24, kDirOffset = 32, kDirSize = 40, kWeightOffset = 64, kWeightSize = 72,
                      kActOffset = 80, kActSize = 88;
constexpr std::size_t kRecord = 56;
std::size_t record(std::size_t i) { return 128 + i * kRecord; }

}  // namespace

TEST_CASE("MP-Cache entries are 40 bytes with fields at offsets 0, 4, 8") {
  CHECK(sizeof(MpCacheEntry) == 40);
  CHECK(offsetof(MpCacheEntry, scale) == 0);
  CHECK(offsetof(MpCacheEntry, zero_point) == 4);
  CHECK(offsetof(MpCacheEntry, channel_mask) == 8);
  MpCacheEntry e;
  e.set_masked(0);
  e.set_masked(13);
  e.set_masked(255);
  CHECK(e.channel_mask[0] == 0x01);
  CHECK(e.channel_mask[1] == 0x20);  // channel 13 = byte 1, bit 5
  CHECK(e.channel_mask[31] == 0x80);
  CHECK(e.masked(13));
  CHECK_FALSE(e.masked(12));
}

TEST_CASE("MP-Cache round trip, byte determinism and section alignment") {
  TempDir dir;
  const auto cache = sample_cache();
  const auto layout = write_mp_cache(dir / "a.bin", cache);
  write_mp_cache(dir / "b.bin", cache);
  const auto bytes = read_bytes(dir / "a.bin");
  CHECK(bytes == read_bytes(dir / "b.bin"));

  MpCacheLayout read_layout;
  const auto back = read_mp_cache(dir / "a.bin", &read_layout);
  CHECK(back == cache);
  CHECK(back.find("model.language_model.layers.0.mlp.down_proj", MpRole::kWeight) != nullptr);
  CHECK(back.find("model.language_model.layers.0.mlp.down_proj", MpRole::kActivation) == nullptr);
  CHECK(read_layout.sha256 == layout.sha256);

  // Writing what was read gives the same bytes again.
  write_mp_cache(dir / "c.bin", back);
  CHECK(read_bytes(dir / "c.bin") == bytes);

  SUBCASE("header and sections, checked on the bytes") {
    CHECK(bytes.substr(0, 8) == std::string("VLMOMPC\0", 8));
    CHECK(get_le<uint32_t>(bytes, 8) == 1);
    CHECK(get_le<uint32_t>(bytes, 12) == 128);
    CHECK(get_le<uint64_t>(bytes, 16) == bytes.size());
    CHECK(get_le<uint32_t>(bytes, kTensorCount) == 3);
    CHECK(get_le<uint64_t>(bytes, kDirOffset) == 128);
    CHECK(get_le<uint64_t>(bytes, kDirSize) == 3 * kRecord);
    const auto w_off = get_le<uint64_t>(bytes, kWeightOffset);
    const auto a_off = get_le<uint64_t>(bytes, kActOffset);
    CHECK(w_off % 4096 == 0);
    CHECK(a_off % 4096 == 0);
    CHECK(w_off > 0);
    CHECK(a_off > w_off);
    // 3 + 4 weight entries, 2 activation entries, 40 bytes each.
    CHECK(get_le<uint64_t>(bytes, kWeightSize) == 7 * 40);
    CHECK(get_le<uint64_t>(bytes, kActSize) == 2 * 40);
    CHECK(a_off + 2 * 40 == bytes.size());
    // The first weight entry (q_proj channel 0) starts the weight section; the
    // down_proj entries follow q_proj's three (its directory entry_offset is 120).
    CHECK(get_le<float>(bytes, w_off) == 0.5f);
    CHECK(get_le<uint64_t>(bytes, record(2) + 48) == 3 * 40);
    CHECK(get_le<float>(bytes, w_off + 3 * 40 + 40) == 0.5f);
    CHECK(get_le<int32_t>(bytes, w_off + 3 * 40 + 44) == 1);
    // Activation entry 0: scale, zero point -3, mask bit 3 of byte 0; entry 1: bit 1 (channel 257).
    CHECK(get_le<float>(bytes, a_off) == 0.125f);
    CHECK(get_le<int32_t>(bytes, a_off + 4) == -3);
    CHECK(static_cast<uint8_t>(bytes[a_off + 8]) == 0x08);
    CHECK(static_cast<uint8_t>(bytes[a_off + 40 + 8]) == 0x02);
    // Records: role and qdtype bytes, axis, group size, channels, rows, entry count.
    CHECK(static_cast<uint8_t>(bytes[record(1) + 8]) == 1);
    CHECK(static_cast<uint8_t>(bytes[record(2) + 9]) == 1);
    CHECK(get_le<int32_t>(bytes, record(1) + 12) == -1);
    CHECK(get_le<uint32_t>(bytes, record(2) + 16) == 4);
    CHECK(get_le<uint64_t>(bytes, record(1) + 24) == 300);
    CHECK(get_le<uint64_t>(bytes, record(2) + 32) == 2);
    CHECK(get_le<uint64_t>(bytes, record(2) + 40) == 4);
    // Checksum: SHA-256 of the file with the checksum field zeroed.
    std::string zeroed = bytes;
    std::memset(zeroed.data() + 96, 0, 32);
    CHECK(vlmopt::io::sha256_hex(std::string_view(zeroed)) == layout.sha256);
  }

  SUBCASE("an empty cache is valid too") {
    write_mp_cache(dir / "empty.bin", MpCache{});
    CHECK(read_mp_cache(dir / "empty.bin").tensors.empty());
  }
}

TEST_CASE("MP-Cache tensor helpers: masks, scales, zero points") {
  const auto cache = sample_cache();
  const auto& act = cache.tensors[1];
  const auto mask = act.mask_tensor();
  REQUIRE(mask.sizes() == torch::IntArrayRef({300}));
  CHECK(mask.sum().item<int64_t>() == 2);
  CHECK(mask[3].item<bool>());
  CHECK(mask[257].item<bool>());
  CHECK(act.masked_channel_count() == 2);
  const auto& group = cache.tensors[2];
  CHECK(group.mask_tensor().sizes() == torch::IntArrayRef({2, 6}));
  CHECK(group.mask_tensor()[1][5].item<bool>());
  CHECK(group.scales().sizes() == torch::IntArrayRef({2, 2}));
  CHECK(group.scales()[1][0].item<float>() == 0.25f);
  CHECK(group.zero_points()[0][1].item<int32_t>() == 1);
}

TEST_CASE("MP-Cache writer refuses invalid caches") {
  TempDir dir;
  const auto path = dir / "bad.bin";
  auto cache = sample_cache();
  SUBCASE("entry count") {
    cache.tensors[0].entries.pop_back();
    CHECK(input_error_of([&] { write_mp_cache(path, cache); }).find("entry_count: expected 3") != std::string::npos);
  }
  SUBCASE("duplicate (name, role)") {
    cache.tensors[2].name = cache.tensors[0].name;
    CHECK(input_error_of([&] { write_mp_cache(path, cache); }).find("twice") != std::string::npos);
  }
  SUBCASE("mask bit past the group") {
    cache.tensors[0].entries[0].set_masked(1);  // group of one channel: only bit 0 exists
    CHECK(input_error_of([&] { write_mp_cache(path, cache); }).find("channel_mask: expected only bits 0..0") !=
          std::string::npos);
  }
  SUBCASE("mask bit past the last partial group") {
    cache.tensors[1].entries[1].set_masked(44);  // channels 256..299: bits 0..43 only
    CHECK(input_error_of([&] { write_mp_cache(path, cache); }).find("got bit 44") != std::string::npos);
  }
  SUBCASE("zero point out of the int4 range") {
    cache.tensors[2].entries[0].zero_point = 8;
    CHECK(input_error_of([&] { write_mp_cache(path, cache); }).find("zero_point: expected -8..7") != std::string::npos);
  }
  SUBCASE("non-finite scale") {
    cache.tensors[0].entries[1].scale = std::numeric_limits<float>::quiet_NaN();
    CHECK(input_error_of([&] { write_mp_cache(path, cache); }).find("scale: expected a finite value > 0") !=
          std::string::npos);
  }
  SUBCASE("activation axis") {
    cache.tensors[1].axis = 0;
    CHECK(input_error_of([&] { write_mp_cache(path, cache); }).find("axis: expected -1") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(path));
}

TEST_CASE("MP-Cache reader rejects every corruption with one clear message") {
  TempDir dir;
  const auto good_path = dir / "good.bin";
  write_mp_cache(good_path, sample_cache());
  const std::string good = read_bytes(good_path);
  const auto path = dir / "corrupt.bin";
  // Writes `bytes` and returns the reader's message; every message names the file and says expected/got.
  const auto error_of = [&](const std::string& bytes) {
    write_bytes(path, bytes);
    auto message = input_error_of([&] { read_mp_cache(path); });
    CHECK(message.starts_with(path.string() + ": "));
    CHECK(message.find("expected") != std::string::npos);
    CHECK(message.find("got") != std::string::npos);
    return message;
  };
  const auto contains = [](const std::string& text, std::string_view part) {
    INFO(text);
    CHECK(text.find(part) != std::string::npos);
  };
  std::string b = good;
  const auto w_off = get_le<uint64_t>(good, kWeightOffset);
  const auto a_off = get_le<uint64_t>(good, kActOffset);

  SUBCASE("bad magic") {
    b[3] = 'X';
    contains(error_of(b), "header.magic: expected \"VLMOMPC\\x00\", got \"VLMXMPC\\x00\"");
  }
  SUBCASE("bad version") {
    put_le<uint32_t>(b, 8, 2);
    reseal(b);
    contains(error_of(b), "header.version: expected 1, got 2");
  }
  SUBCASE("truncated header") {
    contains(error_of(good.substr(0, 100)), "header: expected at least 128 bytes (truncated header), got 100 bytes");
  }
  SUBCASE("truncated file") {
    contains(error_of(good.substr(0, good.size() - 40)), "header.file_size: expected " + std::to_string(good.size() - 40));
  }
  SUBCASE("counts past the end of the file") {
    put_le<uint32_t>(b, kTensorCount, 1000);
    put_le<uint64_t>(b, kDirSize, 1000 * kRecord);
    reseal(b);
    contains(error_of(b), "header.directory: expected a range inside the file's");
  }
  SUBCASE("huge tensor count") {
    put_le<uint32_t>(b, kTensorCount, 0xFFFFFFFFu);
    reseal(b);
    contains(error_of(b), "header.directory_size: expected 240518168520 (tensor_count 4294967295 * 56 bytes), got 168");
  }
  SUBCASE("huge entry count inside a record") {
    // rows 2^40 x 2 groups: the count is consistent, but its entries lie far outside the section.
    put_le<uint64_t>(b, record(2) + 32, uint64_t{1} << 40);
    put_le<uint64_t>(b, record(2) + 40, uint64_t{1} << 41);
    reseal(b);
    contains(error_of(b), "directory[2] 'model.language_model.layers.0.mlp.down_proj'.entry_offset: expected entries "
                          "inside the weight section's 280 bytes");
  }
  SUBCASE("section offset out of bounds") {
    put_le<uint64_t>(b, kWeightOffset, uint64_t{1} << 40);
    reseal(b);
    contains(error_of(b), "header.weight: expected a range inside the file's");
  }
  SUBCASE("section size overflowing 64 bits") {
    put_le<uint64_t>(b, kActSize, 0xFFFFFFFFFFFFFF00ull);
    reseal(b);
    contains(error_of(b), "past 2^64");
  }
  SUBCASE("misaligned section") {
    put_le<uint64_t>(b, kActOffset, a_off - 40);
    reseal(b);
    contains(error_of(b), "header.activation_offset: expected a multiple of 4096, got " + std::to_string(a_off - 40));
  }
  SUBCASE("overlapping sections") {
    put_le<uint64_t>(b, kActOffset, w_off);
    reseal(b);
    contains(error_of(b), "expected a region not overlapping");
  }
  SUBCASE("section overlapping the directory") {
    put_le<uint64_t>(b, kDirOffset, w_off);
    reseal(b);
    contains(error_of(b), "header.weight_offset: expected a region not overlapping directory [4096, 4264)");
  }
  SUBCASE("entry range outside its section") {
    put_le<uint64_t>(b, record(1) + 48, 40);  // activation tensor: 2 entries from byte 40 of an 80-byte section
    reseal(b);
    contains(error_of(b), "directory[1] 'model.language_model.layers.0.self_attn.q_proj'.entry_offset: expected entries "
                          "inside the activation section's 80 bytes, got [40, 120)");
  }
  SUBCASE("bad role") {
    b[record(0) + 8] = 7;
    reseal(b);
    contains(error_of(b), "directory[0] 'model.language_model.layers.0.self_attn.q_proj'.role: expected 0 (weight) or 1 "
                          "(activation), got 7");
  }
  SUBCASE("bad qdtype") {
    b[record(2) + 9] = 9;
    reseal(b);
    contains(error_of(b), ".qdtype: expected 0 (int8), 1 (int4) or 2 (fp8_e4m3), got 9");
  }
  SUBCASE("group_size 0") {
    put_le<uint32_t>(b, record(0) + 16, 0);
    reseal(b);
    contains(error_of(b), "directory[0] 'model.language_model.layers.0.self_attn.q_proj'.group_size: expected 1..256, got 0");
  }
  SUBCASE("group_size over 256") {
    put_le<uint32_t>(b, record(1) + 16, 257);
    reseal(b);
    contains(error_of(b), ".group_size: expected 1..256, got 257");
  }
  SUBCASE("duplicate names") {
    // down_proj's record points at q_proj's name: a second weight named q_proj.
    put_le<uint32_t>(b, record(2) + 0, get_le<uint32_t>(good, record(0) + 0));
    put_le<uint32_t>(b, record(2) + 4, get_le<uint32_t>(good, record(0) + 4));
    reseal(b);
    contains(error_of(b), "directory[2].name: expected a (name, role) pair not used before, got "
                          "'model.language_model.layers.0.self_attn.q_proj' (weight) twice");
  }
  SUBCASE("name not UTF-8") {
    const auto strings = get_le<uint64_t>(good, 48);
    b[strings + 2] = static_cast<char>(0xFF);
    reseal(b);
    contains(error_of(b), "directory[0].name: expected valid UTF-8 (bad lead byte 0xff at byte 2)");
  }
  SUBCASE("name outside the string table") {
    put_le<uint32_t>(b, record(2) + 4, 10000);
    reseal(b);
    contains(error_of(b), "directory[2].name_offset: expected a name inside the");
  }
  SUBCASE("nonzero reserved bytes") {
    put_le<uint32_t>(b, record(0) + 20, 1);
    reseal(b);
    contains(error_of(b), ".reserved: expected zero bytes");
  }
  SUBCASE("mask bit past the group") {
    b[w_off + 8] = 0x02;  // q_proj channel 0: group of one channel
    reseal(b);
    contains(error_of(b), "entries[0].channel_mask: expected only bits 0..0 set (group of 1 channels), got bit 1");
  }
  SUBCASE("checksum mismatch") {
    b[a_off + 4] ^= 0x01;  // an entry byte, not resealed
    const auto message = error_of(b);
    contains(message, "header.checksum: expected sha256 ");
  }
  SUBCASE("appended bytes") {
    contains(error_of(good + std::string(4096, '\0')), "header.file_size");
  }
  SUBCASE("not a regular file") {
    const auto message = input_error_of([&] { read_mp_cache(dir / "missing.bin"); });
    contains(message, "cannot open");
  }
}

TEST_CASE("mp_cache_from_plan maps weights, groups and activations with outlier masks") {
  QuantPlan plan;
  plan.scheme.kind = SchemeKind::kW8A8;
  plan.scheme.weights = QuantArgs{8, QuantType::kInt, true, Strategy::kChannel, 0, false};
  plan.scheme.input_activations = QuantArgs{8, QuantType::kInt, true, Strategy::kTensor, 0, false};
  LinearQuant q;
  q.name = "model.language_model.layers.0.self_attn.q_proj";
  q.weight.scale = torch::tensor({0.5f, 0.25f, 1.5f, 3.0f}).reshape({4, 1});
  q.weight.zero_point = torch::zeros({4, 1}, torch::kInt32);
  q.outlier_channels = torch::zeros({600}, torch::kBool);
  q.outlier_channels[5] = true;
  q.outlier_channels[511] = true;
  q.outlier_channels[512] = true;
  q.input = QParams{torch::tensor({0.0625f}), torch::zeros({1}, torch::kInt32)};
  plan.layers.push_back(q);

  const auto cache = mp_cache_from_plan(plan);
  REQUIRE(cache.tensors.size() == 2);
  const auto* w = cache.find(q.name, MpRole::kWeight);
  REQUIRE(w != nullptr);
  CHECK(w->axis == 0);
  CHECK(w->group_size == 1);
  CHECK(w->channels == 4);
  REQUIRE(w->entries.size() == 4);
  CHECK(w->entries[2].scale == 1.5f);
  CHECK(w->masked_channel_count() == 0);
  const auto* a = cache.find(q.name, MpRole::kActivation);
  REQUIRE(a != nullptr);
  CHECK(a->axis == -1);
  CHECK(a->group_size == 256);
  CHECK(a->channels == 600);
  REQUIRE(a->entries.size() == 3);  // ceil(600 / 256)
  for (const auto& e : a->entries) CHECK(e.scale == 0.0625f);
  CHECK(torch::equal(a->mask_tensor(), q.outlier_channels));
  CHECK(a->entries[1].masked(255));  // channel 511
  CHECK(a->entries[2].masked(0));    // channel 512

  SUBCASE("w4a16 groups: entry = row * groups + column / group_size") {
    QuantPlan g;
    g.scheme.kind = SchemeKind::kW4A16;
    g.scheme.weights = QuantArgs{4, QuantType::kInt, true, Strategy::kGroup, 128, false};
    LinearQuant l;
    l.name = "model.language_model.layers.0.mlp.down_proj";
    l.weight.scale = torch::arange(1, 7, torch::kFloat32).reshape({2, 3}) / 8;  // [out 2, 3 groups of 128 over 300]
    l.outlier_channels = torch::zeros({300}, torch::kBool);
    g.layers.push_back(l);
    const auto gc = mp_cache_from_plan(g);
    REQUIRE(gc.tensors.size() == 1);
    const auto& t = gc.tensors[0];
    CHECK(t.qdtype == MpQDType::kInt4);
    CHECK(t.axis == 1);
    CHECK(t.group_size == 128);
    CHECK(t.channels == 300);
    CHECK(t.rows == 2);
    REQUIRE(t.entries.size() == 6);
    CHECK(t.entries[4].scale == 5.0f / 8);  // row 1, group 1
    TempDir dir;
    write_mp_cache(dir / "g.bin", gc);
    CHECK(read_mp_cache(dir / "g.bin") == gc);
  }
  SUBCASE("per-tensor weights cannot be expressed") {
    plan.scheme.weights.strategy = Strategy::kTensor;
    plan.layers[0].weight.scale = torch::tensor({0.5f});
    plan.layers[0].weight.zero_point = torch::zeros({1}, torch::kInt32);
    const auto message = input_error_of([&] { mp_cache_from_plan(plan); });
    INFO(message);
    CHECK(message.find("weights strategy: expected channel or group") != std::string::npos);
  }
}

TEST_CASE("dequantize_reference matches a hand computation, masked channels from the passthrough") {
  SUBCASE("per-channel weights along axis 0, row 1 masked") {
    MpCacheTensor t;
    t.name = "w";
    t.axis = 0;
    t.group_size = 1;
    t.channels = 3;
    t.entries = {entry(0.5f, 0), entry(0.25f, 1, {0}), entry(2.0f, -2)};
    const auto q = torch::tensor({1, 2, 3, -4, 5, 6, 7, 8, -1, 0, 1, 2}, torch::kInt8).reshape({3, 4});
    const auto passthrough = torch::tensor({9.f, 9.f, 9.f, 9.f, 10.f, 11.f, 12.f, 13.f, 9.f, 9.f, 9.f, 9.f}, torch::kHalf)
                                 .reshape({3, 4});
    const auto out = dequantize_reference(q, t, passthrough);
    // Row 0: 0.5 * q; row 1: passthrough; row 2: 2 * (q + 2).
    const auto expected = torch::tensor({0.5f, 1.f, 1.5f, -2.f, 10.f, 11.f, 12.f, 13.f, 2.f, 4.f, 6.f, 8.f}).reshape({3, 4});
    CHECK((out.scalar_type() == torch::kHalf));
    CHECK(torch::equal(out.to(torch::kFloat32), expected));
    CHECK(torch::equal(dequantize(q, t, passthrough), out));
    // Passthrough required when a bit is set.
    CHECK(input_error_of([&] { dequantize_reference(q, t); }).find("passthrough: expected a float16 tensor for the 1 masked") !=
          std::string::npos);
  }
  SUBCASE("groups along axis 1 with per-row entries") {
    MpCacheTensor t;
    t.name = "g";
    t.qdtype = MpQDType::kInt4;
    t.axis = 1;
    t.group_size = 4;
    t.channels = 6;
    t.rows = 2;
    // (row 0, cols 0-3), (row 0, cols 4-5), (row 1, cols 0-3), (row 1, cols 4-5; col 5 masked)
    t.entries = {entry(1.0f, 0), entry(0.5f, 1), entry(0.25f, -1), entry(4.0f, 0, {1})};
    const auto q = torch::tensor({-8, -1, 0, 7, 3, -3, 1, 2, 3, 4, 5, 6}, torch::kInt8).reshape({2, 6});
    const auto passthrough = torch::full({2, 6}, -7.5, torch::kHalf);
    const auto out = dequantize_reference(q, t, passthrough).to(torch::kFloat32);
    const auto expected = torch::tensor({-8.f, -1.f, 0.f, 7.f, 1.f, -2.f,  // 0.5 * (3 - 1), 0.5 * (-3 - 1)
                                         0.5f, 0.75f, 1.f, 1.25f, 20.f, -7.5f})  // 0.25 * (q + 1); 4 * 5; masked
                              .reshape({2, 6});
    CHECK(torch::equal(out, expected));
  }
  SUBCASE("activations along the last axis, outliers in two groups, fp16 rounding") {
    MpCacheTensor t;
    t.name = "a";
    t.role = MpRole::kActivation;
    t.axis = -1;
    t.group_size = 256;
    t.channels = 300;
    t.entries = {entry(0.1f, 3, {3}), entry(0.1f, 3, {1})};
    auto q = torch::zeros({2, 300}, torch::kInt8);
    q[0][0] = 13;    // 0.1f * 10 = 1.0000000149f -> fp16 1.0
    q[1][299] = 100; // 0.1f * 97 = 9.7 -> fp16 9.703125 (nearest of 9.6953125 / 9.703125)
    auto passthrough = torch::zeros({2, 300}, torch::kHalf);
    passthrough[0][3] = 1000;
    passthrough[1][257] = -0.5;
    const auto out = dequantize_reference(q, t, passthrough).to(torch::kFloat32);
    CHECK(out[0][0].item<float>() == 1.0f);
    CHECK(out[1][299].item<float>() == 9.703125f);
    CHECK(out[0][1].item<float>() == -0.300048828125f);  // fp16 nearest to 0.1f * (0 - 3)
    CHECK(out[0][3].item<float>() == 1000.f);
    CHECK(out[1][3].item<float>() == 0.f);
    CHECK(out[1][257].item<float>() == -0.5f);
    CHECK(out[0][257].item<float>() == 0.f);
    CHECK(out[0][256].item<float>() == -0.300048828125f);
  }
  SUBCASE("argument errors") {
    MpCacheTensor t;
    t.name = "w";
    t.axis = 0;
    t.channels = 2;
    t.entries = {entry(1.f, 0), entry(1.f, 0)};
    CHECK(input_error_of([&] { dequantize_reference(torch::zeros({3, 4}, torch::kInt8), t); })
              .find("expected 2 channels along axis 0, got 3") != std::string::npos);
    CHECK(input_error_of([&] { dequantize_reference(torch::zeros({2, 4}, torch::kFloat32), t); })
              .find("q dtype: expected int8") != std::string::npos);
    t.qdtype = MpQDType::kFp8E4M3;
    CHECK(input_error_of([&] { dequantize_reference(torch::zeros({2, 4}, torch::kInt8), t); })
              .find("qdtype: expected int8 or int4, got fp8_e4m3") != std::string::npos);
  }
}

TEST_CASE("inspect summarizes an MP-Cache file by its magic") {
  TempDir dir;
  const auto path = dir / "mp_cache.bin";
  const auto layout = write_mp_cache(path, sample_cache());
  const auto s = vlmopt::bundle::inspect(path);
  CHECK(s.at("kind") == "mp_cache");
  CHECK(s.at("path") == path.string());
  CHECK(s.at("tensor_count") == 3);
  const auto& weight = s.at("roles").at("weight");
  CHECK(weight.at("tensors") == 2);
  CHECK(weight.at("entries") == 7);
  CHECK(weight.at("masked_channels") == 1);
  CHECK(weight.at("dtypes") == nlohmann::json({{"int4", 1}, {"int8", 1}}));
  CHECK(weight.at("scale_min").get<float>() == 0.25f);
  CHECK(weight.at("scale_max").get<float>() == 4.0f);
  const auto& act = s.at("roles").at("activation");
  CHECK(act.at("tensors") == 1);
  CHECK(act.at("masked_channels") == 2);
  CHECK(act.at("scale_min").get<float>() == 0.125f);
  const auto& t1 = s.at("tensors").at(1);
  CHECK(t1.at("role") == "activation");
  CHECK(t1.at("channels") == 300);
  CHECK(t1.at("zero_point_min") == -3);
  const auto& sections = s.at("file").at("sections");
  const auto bytes = read_bytes(path);
  CHECK(sections.at("weight").at("offset") == get_le<uint64_t>(bytes, kWeightOffset));
  CHECK(sections.at("activation").at("offset") == get_le<uint64_t>(bytes, kActOffset));
  CHECK(sections.at("activation").at("size") == 80);
  CHECK(s.at("file").at("file_size") == bytes.size());
  CHECK(s.at("file").at("sha256") == layout.sha256);
  CHECK(s.at("file").at("format_version") == 1);
  const auto text = vlmopt::bundle::format_inspect(s);
  CHECK(text.find("MP-Cache v1") != std::string::npos);
  CHECK(text.find("model.language_model.layers.0.mlp.down_proj") != std::string::npos);

  // A corrupt MP-Cache is reported as such, not as "not something vlmopt can inspect".
  auto corrupt = bytes;
  corrupt[bytes.size() - 1] ^= 0x10;
  write_bytes(dir / "corrupt.bin", corrupt);
  CHECK(input_error_of([&] { vlmopt::bundle::inspect(dir / "corrupt.bin"); }).find("header.checksum") != std::string::npos);
}
