// safetensors reader/writer, torch bridge and sharded checkpoints (lib/io).
#include "test_support.hpp"
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
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

namespace fs = std::filesystem;
using namespace vlmopt::io;

// A fresh directory under the system temp dir, removed with everything in it.
void write_bytes(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A handcrafted safetensors file: `claimed_length` (default: the real header length)
// as the little-endian u64 prefix, then the header text, then `data`.
void write_raw_safetensors(const fs::path& path, std::string_view header, std::string_view data,
                           std::optional<uint64_t> claimed_length = std::nullopt) {
  const uint64_t length = claimed_length.value_or(header.size());
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((length >> (8 * i)) & 0xFF);
  bytes.append(header);
  bytes.append(data);
  write_bytes(path, bytes);
}

// The InputError message of `action` ("" plus a failed check when it does not throw one).
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

std::string open_error(const fs::path& path) {
  return input_error_of([&] { SafetensorsFile::open(path); });
}

std::string hex_to_bytes(std::string_view hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}

bool same_bytes(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.nbytes() == b.nbytes() &&
         std::memcmp(a.const_data_ptr(), b.const_data_ptr(), a.nbytes()) == 0;
}

// Random contents of any dtype: random bytes reinterpreted (0/1 for bool).
torch::Tensor random_tensor(DType dtype, std::vector<int64_t> shape) {
  const auto type = to_torch(dtype);
  if (type == torch::kBool) return torch::randint(0, 2, shape, torch::kUInt8).to(torch::kBool);
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  const auto bytes = torch::randint(0, 256, {numel * static_cast<int64_t>(dtype_size(dtype))}, torch::kUInt8);
  return bytes.view(type).reshape(shape).clone();
}

}  // namespace

TEST_CASE("dtype names and sizes match the safetensors spellings") {
  for (DType d : kAllDTypes) {
    CHECK(parse_dtype(dtype_name(d)) == d);
    CHECK(from_torch(to_torch(d)) == d);
    CHECK(dtype_size(d) == c10::elementSize(to_torch(d)));
  }
  CHECK(parse_dtype("F8_E4M3") == DType::kF8_E4M3);
  CHECK((to_torch(DType::kF8_E4M3) == torch::kFloat8_e4m3fn));
  CHECK((to_torch(DType::kF8_E5M2) == torch::kFloat8_e5m2));
  CHECK_FALSE(parse_dtype("f32").has_value());
  CHECK_FALSE(parse_dtype("F17").has_value());
  CHECK_THROWS_AS(from_torch(torch::kComplexFloat), vlmopt::InputError);
}

TEST_CASE("every dtype round-trips through writer, reader and torch bridge, unaligned included") {
  TempDir dir;
  torch::manual_seed(7);
  std::vector<std::pair<std::string, torch::Tensor>> originals;
  // "aaa" sorts first and is 3 bytes long, so every following tensor starts at an odd offset.
  originals.emplace_back("aaa_odd", random_tensor(DType::kU8, {3}));
  for (DType d : kAllDTypes) {
    originals.emplace_back(fmt::format("t_{}", dtype_name(d)), random_tensor(d, {3, 5}));
    originals.emplace_back(fmt::format("t_{}_scalar", dtype_name(d)), random_tensor(d, {}));
    originals.emplace_back(fmt::format("t_{}_empty", dtype_name(d)), random_tensor(d, {0, 4}));
  }
  std::vector<TensorToWrite> to_save;
  for (const auto& [name, t] : originals) to_save.push_back(to_write(name, t));
  const auto path = dir / "all.safetensors";
  write_safetensors(path, to_save, {{"producer", "vlmopt-test"}});

  const auto file = SafetensorsFile::open(path);
  CHECK(file->metadata().at("format") == "pt");
  CHECK(file->metadata().at("producer") == "vlmopt-test");
  REQUIRE(file->tensors().size() == originals.size());
  for (std::size_t i = 1; i < file->tensors().size(); ++i) CHECK(file->tensors()[i - 1].name < file->tensors()[i].name);
  for (const auto& [name, original] : originals) {
    CAPTURE(name);
    const TensorInfo& info = file->at(name);
    CHECK(info.dtype == from_torch(original.scalar_type()));
    CHECK(info.shape == original.sizes().vec());
    CHECK(info.numel() == original.numel());
    const torch::Tensor loaded = load_tensor(*file, info);
    CHECK(same_bytes(loaded, original));
  }
  CHECK(file->find("missing") == nullptr);
  const std::string missing = input_error_of([&] { file->at("missing"); });
  CHECK(missing.find("all.safetensors") != std::string::npos);
  CHECK(missing.find("'missing'") != std::string::npos);
}

TEST_CASE("reader and writer agree byte for byte with the Python safetensors package") {
  // Produced by safetensors 0.8.0: save({"b": tensor([0.5,-1,2]), "a": tensor([[1.5,-2],[0.25,3]]),
  // "c": zeros(0)}, metadata={"format": "pt"}).
  const std::string python_same_dtype = hex_to_bytes(
      "c8000000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a227074227d2c2261223a7b226474797065223a2246"
      "3332222c227368617065223a5b322c325d2c22646174615f6f666673657473223a5b302c31365d7d2c2262223a7b226474797065223a22"
      "463332222c227368617065223a5b335d2c22646174615f6f666673657473223a5b31362c32385d7d2c2263223a7b226474797065223a22"
      "463332222c227368617065223a5b305d2c22646174615f6f666673657473223a5b32382c32385d7d7d20200000c03f000000c00000803e"
      "000040400000003f000080bf00000040");
  // save({"x": int8 [-3,0,7], "y": bfloat16 [1,-0.5], "s": float64 scalar 2.5}, metadata={"format": "pt"});
  // Python orders data by alignment (s, y, x), not by name.
  const std::string python_mixed = hex_to_bytes(
      "c8000000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a227074227d2c2273223a7b226474797065223a2246"
      "3634222c227368617065223a5b5d2c22646174615f6f666673657473223a5b302c385d7d2c2279223a7b226474797065223a2242463136"
      "222c227368617065223a5b325d2c22646174615f6f666673657473223a5b382c31325d7d2c2278223a7b226474797065223a224938222c"
      "227368617065223a5b335d2c22646174615f6f666673657473223a5b31322c31355d7d7d202020202020200000000000000440803f00bf"
      "fd0007");
  TempDir dir;
  write_bytes(dir / "py_mixed.safetensors", python_mixed);
  const auto mixed = SafetensorsFile::open(dir / "py_mixed.safetensors");
  CHECK(load_tensor(*mixed, mixed->at("x")).equal(torch::tensor({-3, 0, 7}, torch::kInt8)));
  CHECK(load_tensor(*mixed, mixed->at("y")).equal(torch::tensor({1.0, -0.5}).to(torch::kBFloat16)));
  const auto s = load_tensor(*mixed, mixed->at("s"));
  CHECK(s.dim() == 0);
  CHECK(s.item<double>() == 2.5);

  write_bytes(dir / "py_same.safetensors", python_same_dtype);
  const auto same = SafetensorsFile::open(dir / "py_same.safetensors");
  const auto a = load_tensor(*same, same->at("a"));
  const auto b = load_tensor(*same, same->at("b"));
  const auto c = load_tensor(*same, same->at("c"));
  CHECK(a.equal(torch::tensor({1.5f, -2.0f, 0.25f, 3.0f}).reshape({2, 2})));
  CHECK(b.equal(torch::tensor({0.5f, -1.0f, 2.0f})));
  CHECK(c.numel() == 0);
  write_safetensors(dir / "ours.safetensors", {to_write("b", b), to_write("c", c), to_write("a", a)});
  CHECK(read_bytes(dir / "ours.safetensors") == python_same_dtype);
}

TEST_CASE("the writer is deterministic: input order and repeated runs give identical bytes") {
  TempDir dir;
  const auto w = torch::arange(12, torch::kFloat32).reshape({3, 4});
  const auto bias = torch::tensor({1, 2, 3}, torch::kInt32);
  const auto flag = torch::tensor(true);
  write_safetensors(dir / "one.safetensors", {to_write("w", w), to_write("bias", bias), to_write("flag", flag)},
                    {{"z", "1"}, {"a", "2"}});
  write_safetensors(dir / "two.safetensors", {to_write("flag", flag), to_write("w", w), to_write("bias", bias)},
                    {{"a", "2"}, {"z", "1"}});
  const std::string one = read_bytes(dir / "one.safetensors");
  CHECK(one == read_bytes(dir / "two.safetensors"));

  uint64_t header_length = 0;
  std::memcpy(&header_length, one.data(), 8);
  CHECK(header_length % 8 == 0);
  const std::string header = one.substr(8, header_length);
  CHECK(header.rfind(R"({"__metadata__":{"a":"2","format":"pt","z":"1"},"bias":{"dtype":"I32","shape":[3],"data_offsets":[0,12]},)", 0) == 0);
  CHECK(header.find_last_not_of(' ') == header.find_last_of('}'));
  CHECK(one.size() == 8 + header_length + 12 + 1 + 48);
  // No temporary files are left next to the output.
  CHECK(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()) == 2);
}

TEST_CASE("the writer rejects duplicate names and data that disagrees with its shape") {
  TempDir dir;
  const auto t = torch::zeros({2, 2});
  const std::string dup = input_error_of([&] { write_safetensors(dir / "d.safetensors", {to_write("x", t), to_write("x", t)}); });
  CHECK(dup.find("duplicate tensor name 'x'") != std::string::npos);
  TensorToWrite wrong = to_write("y", t);
  wrong.shape = {2, 3};
  const std::string size = input_error_of([&] { write_safetensors(dir / "s.safetensors", {wrong}); });
  CHECK(size.find("'y'") != std::string::npos);
  CHECK(size.find("expected 24 bytes, got 16") != std::string::npos);
  CHECK_FALSE(fs::exists(dir / "d.safetensors"));
  CHECK_FALSE(fs::exists(dir / "s.safetensors"));
}

TEST_CASE("sharded checkpoints round-trip through write_checkpoint and Checkpoint") {
  TempDir dir;
  torch::manual_seed(3);
  std::map<std::string, torch::Tensor> originals;
  for (int i = 0; i < 7; ++i) originals[fmt::format("layer.{}.weight", i)] = torch::randn({4, 2 + i});  // 32..128 bytes
  originals["scale"] = torch::tensor(0.5, torch::kFloat64);
  std::vector<TensorToWrite> tensors;
  uint64_t total = 0;
  for (const auto& [name, t] : originals) {
    tensors.push_back(to_write(name, t));
    total += t.nbytes();
  }

  const auto files = write_checkpoint(dir.path(), tensors, /*max_shard_bytes=*/128);
  REQUIRE(files.size() >= 3);
  CHECK(files.back() == "model.safetensors.index.json");
  const std::size_t shards = files.size() - 1;
  for (std::size_t i = 0; i < shards; ++i) {
    CHECK(files[i] == fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards));
    CHECK(SafetensorsFile::open(dir / files[i])->file_size() > 0);
  }
  const auto index = nlohmann::json::parse(read_bytes(dir / "model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"].get<uint64_t>() == total);
  CHECK(index["weight_map"].size() == originals.size());
  // No shard holds more than the limit unless a single tensor is bigger.
  for (std::size_t i = 0; i < shards; ++i) {
    const auto shard = SafetensorsFile::open(dir / files[i]);
    uint64_t bytes = 0;
    for (const auto& t : shard->tensors()) {
      bytes += t.nbytes();
      CHECK(index["weight_map"].at(t.name) == files[i]);
    }
    CHECK((bytes <= 128 || shard->tensors().size() == 1));
  }

  const Checkpoint ckpt = Checkpoint::open(dir.path());
  CHECK(ckpt.files().size() == shards);
  std::vector<std::string> expected_names;
  for (const auto& [name, _] : originals) expected_names.push_back(name);
  CHECK(ckpt.names() == expected_names);
  for (const auto& [name, t] : originals) {
    CAPTURE(name);
    CHECK(ckpt.contains(name));
    CHECK(same_bytes(load_tensor(ckpt, name), t));
  }
  CHECK_FALSE(ckpt.contains("nope"));
  CHECK(input_error_of([&] { ckpt.locate("nope"); }).find("'nope'") != std::string::npos);

  // Rewriting as one file removes the shards and the index, so nothing stale remains.
  CHECK(write_checkpoint(dir.path(), tensors, 0) == std::vector<std::string>{"model.safetensors"});
  CHECK(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()) == 1);
  const Checkpoint single = Checkpoint::open(dir.path());
  CHECK(single.names() == expected_names);
  CHECK(same_bytes(load_tensor(single, "layer.3.weight"), originals["layer.3.weight"]));
  // A .safetensors path opens directly too.
  CHECK(Checkpoint::open(dir / "model.safetensors").names() == expected_names);
}

TEST_CASE("Checkpoint validates the shard index") {
  TempDir dir;
  const auto t = torch::ones({2});
  write_safetensors(dir / "model-00001-of-00002.safetensors", {to_write("a", t), to_write("b", t)});
  write_safetensors(dir / "model-00002-of-00002.safetensors", {to_write("c", t)});
  const auto write_index = [&](const std::string& weight_map) {
    write_bytes(dir / "model.safetensors.index.json",
                R"({"metadata": {"total_size": 24}, "weight_map": )" + weight_map + "}");
  };

  SUBCASE("a valid index opens") {
    write_index(R"({"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                    "c": "model-00002-of-00002.safetensors"})");
    CHECK(Checkpoint::open(dir.path()).names() == std::vector<std::string>{"a", "b", "c"});
  }
  SUBCASE("index pointing at a missing file") {
    write_index(R"({"a": "model-00001-of-00002.safetensors", "c": "model-00003-of-00003.safetensors"})");
    const std::string msg = input_error_of([&] { Checkpoint::open(dir.path()); });
    CHECK(msg.find("model.safetensors.index.json") != std::string::npos);
    CHECK(msg.find("'model-00003-of-00003.safetensors'") != std::string::npos);
    CHECK(msg.find("does not exist") != std::string::npos);
  }
  SUBCASE("index naming a tensor its file does not have") {
    write_index(R"({"a": "model-00001-of-00002.safetensors", "ghost": "model-00002-of-00002.safetensors"})");
    const std::string msg = input_error_of([&] { Checkpoint::open(dir.path()); });
    CHECK(msg.find("model.safetensors.index.json") != std::string::npos);
    CHECK(msg.find("weight_map.ghost") != std::string::npos);
  }
  SUBCASE("index putting a tensor in the wrong file") {
    write_index(R"({"a": "model-00002-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"})");
    const std::string msg = input_error_of([&] { Checkpoint::open(dir.path()); });
    CHECK(msg.find("weight_map.a") != std::string::npos);
  }
  SUBCASE("a tensor in two shards") {
    write_safetensors(dir / "model-00002-of-00002.safetensors", {to_write("a", t)});
    write_index(R"({"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})");
    const std::string msg = input_error_of([&] { Checkpoint::open(dir.path()); });
    CHECK(msg.find("tensor 'a' is in two shards") != std::string::npos);
  }
  SUBCASE("duplicate key in the weight map") {
    write_index(R"({"a": "model-00001-of-00002.safetensors", "a": "model-00002-of-00002.safetensors"})");
    const std::string msg = input_error_of([&] { Checkpoint::open(dir.path()); });
    CHECK(msg.find("duplicate key 'weight_map.a'") != std::string::npos);
  }
  SUBCASE("a file name escaping the directory") {
    write_index(R"({"a": "../model-00001-of-00002.safetensors"})");
    CHECK(input_error_of([&] { Checkpoint::open(dir.path()); }).find("weight_map.a") != std::string::npos);
  }
  SUBCASE("no weights at all") {
    TempDir empty;
    CHECK(input_error_of([&] { Checkpoint::open(empty.path()); }).find("model.safetensors") != std::string::npos);
  }
}

TEST_CASE("corrupt safetensors files are rejected with the file and the field named") {
  TempDir dir;
  const std::string eight(8, '\x01');
  const auto entry = [](const std::string& name, const std::string& dtype, const std::string& shape, uint64_t b,
                        uint64_t e) {
    return fmt::format(R"("{}":{{"dtype":"{}","shape":{},"data_offsets":[{},{}]}})", name, dtype, shape, b, e);
  };
  // Writes the case's file and returns the error message of opening it.
  const auto reject = [&](const std::string& file_name, std::string_view header, std::string_view data,
                          std::optional<uint64_t> claimed = std::nullopt) {
    write_raw_safetensors(dir / file_name, header, data, claimed);
    const std::string msg = open_error(dir / file_name);
    CHECK_MESSAGE(msg.find(file_name) != std::string::npos, msg);
    return msg;
  };
  const auto contains = [](const std::string& msg, std::string_view part) {
    CHECK_MESSAGE(msg.find(part) != std::string::npos, "'" << part << "' not in: " << msg);
  };

  // The well-formed baseline the corrupt cases deviate from.
  write_raw_safetensors(dir / "good.safetensors", "{" + entry("w", "F32", "[2]", 0, 8) + "}", eight);
  CHECK(SafetensorsFile::open(dir / "good.safetensors")->tensors().size() == 1);
  write_raw_safetensors(dir / "empty.safetensors", "{}", "");
  CHECK(SafetensorsFile::open(dir / "empty.safetensors")->tensors().empty());

  SUBCASE("truncated data") {
    const auto msg = reject("truncated.safetensors", "{" + entry("w", "F32", "[4]", 0, 16) + "}", eight);
    contains(msg, "tensor 'w' field 'data_offsets'");
    contains(msg, "truncated");
  }
  SUBCASE("header length past the end of the file") {
    const auto msg = reject("past_end.safetensors", "{" + entry("w", "F32", "[2]", 0, 8) + "}", eight, 1000);
    contains(msg, "header length runs past the end of the file");
    contains(msg, "got 1000");
  }
  SUBCASE("huge header length") {
    const auto msg = reject("huge_header.safetensors", "{}", "", 200'000'000);
    contains(msg, "header length 200000000 exceeds the limit");
  }
  SUBCASE("file shorter than 8 bytes") {
    write_bytes(dir / "short.safetensors", std::string_view("\x02\0\0\0\0", 5));
    const auto msg = open_error(dir / "short.safetensors");
    contains(msg, "short.safetensors");
    contains(msg, "expected at least 8 bytes, got 5");
  }
  SUBCASE("invalid JSON") {
    const auto msg = reject("bad_json.safetensors", R"({"w":{"dtype":"F32",)", "");
    contains(msg, "header: not valid JSON");
  }
  SUBCASE("invalid UTF-8 in the header") {
    const auto msg = reject("bad_utf8.safetensors", "{\"w\xff\":{}}", "");
    contains(msg, "not valid JSON");
  }
  SUBCASE("header not an object") {
    const auto msg = reject("not_object.safetensors", "[1, 2]  ", "");
    contains(msg, "header is not a JSON object");
  }
  SUBCASE("overlapping offsets") {
    const auto msg = reject("overlap.safetensors",
                            "{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 4, 12) + "}",
                            std::string(12, '\0'));
    contains(msg, "tensor 'b' field 'data_offsets' [4, 12] overlaps tensor 'a'");
  }
  SUBCASE("a hole between tensors") {
    const auto msg = reject("hole.safetensors",
                            "{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 12, 20) + "}",
                            std::string(20, '\0'));
    contains(msg, "tensor 'b' field 'data_offsets' [12, 20] leaves a hole after tensor 'a'");
  }
  SUBCASE("data size does not match shape x dtype") {
    const auto msg = reject("size_mismatch.safetensors", "{" + entry("w", "F32", "[3]", 0, 8) + "}", eight);
    contains(msg, "tensor 'w' field 'data_offsets'");
    contains(msg, "expected 12 bytes, got 8");
  }
  SUBCASE("unknown dtype") {
    const auto msg = reject("bad_dtype.safetensors", "{" + entry("w", "F17", "[2]", 0, 8) + "}", eight);
    contains(msg, "tensor 'w' field 'dtype': unknown dtype \"F17\"");
  }
  SUBCASE("duplicate tensor names") {
    const auto msg = reject("duplicate.safetensors",
                            "{" + entry("w", "F32", "[1]", 0, 4) + "," + entry("w", "F32", "[1]", 4, 8) + "}", eight);
    contains(msg, "duplicate key 'w'");
  }
  SUBCASE("negative shape") {
    const auto msg = reject("negative_shape.safetensors", "{" + entry("w", "F32", "[-2]", 0, 8) + "}", eight);
    contains(msg, "tensor 'w' field 'shape'");
    contains(msg, "-2");
  }
  SUBCASE("non-integer shape") {
    const auto msg = reject("float_shape.safetensors", "{" + entry("w", "F32", "[2.0]", 0, 8) + "}", eight);
    contains(msg, "tensor 'w' field 'shape'");
  }
  SUBCASE("overflowing shape") {
    const auto msg = reject("overflow_shape.safetensors",
                            "{" + entry("w", "F32", "[4294967296, 4294967296]", 0, 8) + "}", eight);
    contains(msg, "tensor 'w' field 'shape'");
    contains(msg, "overflows");
  }
  SUBCASE("begin > end") {
    const auto msg = reject("begin_after_end.safetensors", "{" + entry("w", "F32", "[2]", 8, 0) + "}", eight);
    contains(msg, "tensor 'w' field 'data_offsets': begin > end");
  }
  SUBCASE("trailing bytes after the last tensor") {
    const auto msg = reject("trailing.safetensors", "{" + entry("w", "F32", "[2]", 0, 8) + "}", eight + "xyz");
    contains(msg, "3 trailing bytes");
  }
  SUBCASE("non-string metadata value") {
    const auto msg = reject("bad_metadata.safetensors",
                            R"({"__metadata__":{"format":"pt","step":1},)" + entry("w", "F32", "[2]", 0, 8) + "}", eight);
    contains(msg, "field '__metadata__.step': expected a string, got 1");
  }
  SUBCASE("missing field") {
    const auto msg = reject("no_offsets.safetensors", R"({"w":{"dtype":"F32","shape":[2]}})", eight);
    contains(msg, "tensor 'w' field 'data_offsets': missing");
  }
}
