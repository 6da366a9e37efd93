// HDF5 packs (datasets/hdf5_pack.hpp): round trips of builtin and mixed-size
// JSONL data, atomic writing, and clear errors for invalid or corrupt packs.
#include "test_support.hpp"
#include "datasets/commands.hpp"
#include "datasets/hdf5_pack.hpp"
#include "datasets/scenes.hpp"
#include "datasets/source.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <opencv2/imgcodecs.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

namespace {
using vlmopt::testing::TempDir;
using vlmopt::testing::read_bytes;
using vlmopt::testing::write_bytes;

namespace fs = std::filesystem;
using namespace vlmopt::datasets;

std::size_t find_unique(const std::string& haystack, std::string_view needle) {
  const auto pos = haystack.find(needle);
  REQUIRE(pos != std::string::npos);
  REQUIRE(haystack.find(needle, pos + 1) == std::string::npos);
  return pos;
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const vlmopt::InputError& e) {
    return e.what();
  }
  FAIL("expected an InputError");
  return {};
}

void check_same(const Sample& a, const Sample& b) {
  INFO(a.id);
  CHECK(a.id == b.id);
  CHECK(a.question == b.question);
  CHECK(a.answer == b.answer);
  CHECK(a.question_type == b.question_type);
  CHECK(a.meta == b.meta);
  REQUIRE(a.image.size() == b.image.size());
  REQUIRE(b.image.type() == CV_8UC3);
  CHECK(cv::norm(a.image, b.image, cv::NORM_INF) == 0.0);
}

fs::path make_pack(const TempDir& dir, const std::string& name = "calib.h5", std::size_t limit = 24) {
  PackOptions options;
  options.spec = "builtin:calib";
  options.output = dir / name;
  options.limit = limit;
  const auto result = pack(options);
  CHECK(result.at("samples") == limit);
  CHECK(result.at("sha256").get<std::string>().size() == 64);
  return options.output;
}

}  // namespace

TEST_CASE("pack: builtin round trip, atomic output, streaming reads") {
  TempDir dir;
  const fs::path file = make_pack(dir);
  CHECK(entries(dir.path()) == std::vector<std::string>{"calib.h5"});  // no temp files left behind

  const auto packed = open_dataset(file.string());
  REQUIRE(packed->size() == 24);
  CHECK(packed->describe().find("builtin:calib") != std::string::npos);
  const auto original = open_dataset("builtin:calib");
  for (std::size_t i : {23u, 0u, 7u, 12u}) check_same(original->get(i), packed->get(i));  // any order
  CHECK_THROWS_AS(packed->get(24), vlmopt::InputError);

  // Same spec, same bytes (no timestamps in the file).
  const fs::path again = make_pack(dir, "again.h5");
  CHECK(read_bytes(again) == read_bytes(file));

  // Concurrent readers see the same samples as a sequential one.
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (std::size_t i = static_cast<std::size_t>(t); i < 24; i += 2) {
        const Sample a = packed->get(i);
        const Sample b = original->get(i);
        if (a.question != b.question || cv::norm(a.image, b.image, cv::NORM_INF) != 0.0) ++mismatches[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(mismatches == std::vector<int>(4, 0));

  // Packs are recognised by content when the name has no .h5 extension.
  fs::copy_file(file, dir / "pack.data");
  fs::remove(again);
  CHECK(open_dataset((dir / "pack.data").string())->size() == 24);
}

TEST_CASE("pack: images of different sizes keep their own size") {
  TempDir dir;
  std::string jsonl;
  const std::vector<cv::Size> sizes = {{30, 20}, {50, 10}, {12, 60}, {7, 7}};
  std::mt19937 rng(7);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    cv::Mat image(sizes[i], CV_8UC3);
    cv::randu(image, 0, 256);
    REQUIRE(cv::imwrite((dir / fmt::format("{}.png", i)).string(), image));
    jsonl += nlohmann::json{{"image", fmt::format("{}.png", i)},
                            {"question_type", "t"},
                            {"conversations", {{{"from", "human"}, {"value", "<image>\nq é"}},
                                               {{"from", "gpt"}, {"value", fmt::format("a{}", i)}}}}}
                 .dump() +
             "\n";
  }
  write_bytes(dir / "data.jsonl", jsonl);
  PackOptions options;
  options.spec = (dir / "data.jsonl").string();
  options.output = dir / "mixed.h5";
  options.deflate_level = 0;
  pack(options);
  const auto original = open_dataset(options.spec);
  const auto packed = open_dataset(options.output.string());
  REQUIRE(packed->size() == sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    check_same(original->get(i), packed->get(i));
    CHECK(packed->get(i).image.size() == sizes[i]);
    CHECK(packed->get(i).question == "q é");  // UTF-8 survives
  }
}

TEST_CASE("pack: failures leave no output and no temporary file") {
  TempDir dir;
  cv::Mat image(4, 4, CV_8UC3, cv::Scalar(1, 2, 3));
  REQUIRE(cv::imwrite((dir / "ok.png").string(), image));
  write_bytes(dir / "broken.png", "not an image");
  const auto line = [](const std::string& img) {
    return nlohmann::json{{"image", img},
                          {"conversations", {{{"from", "human"}, {"value", "q"}}, {{"from", "gpt"}, {"value", "a"}}}}}
               .dump() +
           "\n";
  };
  write_bytes(dir / "data.jsonl", line("ok.png") + line("broken.png"));
  const auto before = entries(dir.path());

  PackOptions options;
  options.spec = (dir / "data.jsonl").string();
  options.output = dir / "out.h5";
  CHECK(error_of([&] { pack(options); }).find("data.jsonl:2") != std::string::npos);
  CHECK(entries(dir.path()) == before);

  options.limit = 0;
  CHECK(error_of([&] { pack(options); }).find("nothing to pack") != std::string::npos);
  options.limit.reset();
  options.output = dir / "no/such/dir/out.h5";
  CHECK(error_of([&] { pack(options); }).find("does not exist") != std::string::npos);
  CHECK(entries(dir.path()) == before);
}

TEST_CASE("pack reader: invalid and corrupt files give one clear error") {
  TempDir dir;
  const fs::path good = make_pack(dir, "good.h5", 4);
  const std::string bytes = read_bytes(good);

  SUBCASE("not an HDF5 file") {
    write_bytes(dir / "text.h5", "just some text, not HDF5\n");
    const auto message = error_of([&] { PackSource reader((dir / "text.h5").string()); });
    CHECK(message.find("text.h5") != std::string::npos);
    CHECK(message.find("not an HDF5 file") != std::string::npos);
  }
  SUBCASE("missing file") {
    CHECK(error_of([&] { open_dataset((dir / "absent.h5").string()); }).find("absent.h5") != std::string::npos);
  }
  SUBCASE("truncated") {
    write_bytes(dir / "cut.h5", std::string_view(bytes).substr(0, bytes.size() * 6 / 10));
    const auto message = error_of([&] {
      PackSource reader(dir / "cut.h5");
      for (std::size_t i = 0; i < reader.size(); ++i) reader.get(i);
    });
    CHECK(message.find("cut.h5") != std::string::npos);
  }
  SUBCASE("another HDF5 format") {
    std::string patched = bytes;
    const auto pos = find_unique(patched, kPackFormat);
    std::memcpy(patched.data() + pos, "vlmopt-junk", kPackFormat.size());
    write_bytes(dir / "other.h5", patched);
    const auto message = error_of([&] { PackSource reader(dir / "other.h5"); });
    CHECK(message.find("other.h5") != std::string::npos);
    CHECK(message.find("expected 'vlmopt-pack', got 'vlmopt-junk'") != std::string::npos);
  }
  SUBCASE("no format attribute") {
    std::string patched = bytes;
    const auto pos = find_unique(patched, std::string_view("format\0", 7));
    patched[pos + 5] = 'x';  // rename the attribute to "formax"
    write_bytes(dir / "noformat.h5", patched);
    CHECK(error_of([&] { PackSource reader(dir / "noformat.h5"); }).find("attribute 'format' is missing") !=
          std::string::npos);
  }
  SUBCASE("unsupported version") {
    // Attribute message (HDF5 file format spec, version 1): version, reserved,
    // name size, datatype size, dataspace size (u16 each), then name,
    // datatype and dataspace each padded to 8 bytes, then the value.
    std::string patched = bytes;
    const auto name = find_unique(patched, std::string_view("version\0", 8));
    const auto header = name - 8;
    REQUIRE(static_cast<uint8_t>(patched[header]) == 1);
    const auto u16 = [&](std::size_t at) {
      return static_cast<std::size_t>(static_cast<uint8_t>(patched[at])) |
             (static_cast<std::size_t>(static_cast<uint8_t>(patched[at + 1])) << 8);
    };
    const auto pad8 = [](std::size_t n) { return (n + 7) / 8 * 8; };
    REQUIRE(u16(header + 2) == 8);
    const auto value = name + pad8(u16(header + 2)) + pad8(u16(header + 4)) + pad8(u16(header + 6));
    REQUIRE(patched.compare(value, 4, std::string_view("\x01\0\0\0", 4)) == 0);
    patched[value] = 7;
    write_bytes(dir / "v7.h5", patched);
    CHECK(error_of([&] { PackSource reader(dir / "v7.h5"); }).find("unsupported pack version (expected 1, got 7)") !=
          std::string::npos);
  }
}
