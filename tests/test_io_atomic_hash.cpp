// Atomic file writing and SHA-256 hashing (lib/io).
#include "test_support.hpp"
#include "io/atomic_file.hpp"
#include "io/hash.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>

#include <dlfcn.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <vector>

namespace {
using vlmopt::testing::TempDir;
using vlmopt::testing::read_text;

namespace fs = std::filesystem;
using namespace vlmopt::io;

void write_text(const fs::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("AtomicFileWriter: commit replaces the target and leaves no temporary file") {
  TempDir dir;
  const auto target = dir / "manifest.json";
  write_text(target, "old contents");
  {
    AtomicFileWriter writer(target);
    // The temp file lives next to the target, hidden, and is distinct from it.
    CHECK(writer.temp_path().parent_path() == dir.path());
    CHECK(writer.temp_path().filename().string().rfind(".manifest.json.tmp.", 0) == 0);
    CHECK(fs::exists(writer.temp_path()));
    writer.write(std::string_view("new "));
    const std::string tail = "contents";
    writer.write(std::as_bytes(std::span<const char>(tail.data(), tail.size())));
    CHECK(writer.bytes_written() == 12);
    CHECK(read_text(target) == "old contents");  // nothing visible before commit
    writer.commit();
  }
  CHECK(read_text(target) == "new contents");
  CHECK(entries(dir.path()) == std::vector<std::string>{"manifest.json"});
}

TEST_CASE("AtomicFileWriter: destruction without commit keeps the old file and removes the temp") {
  TempDir dir;
  const auto target = dir / "model.safetensors";
  write_text(target, "previous");
  fs::path temp;
  {
    AtomicFileWriter writer(target);
    temp = writer.temp_path();
    writer.write(std::string_view("half a file"));
    CHECK(fs::exists(temp));
  }  // e.g. an exception unwound past the writer
  CHECK_FALSE(fs::exists(temp));
  CHECK(read_text(target) == "previous");
  CHECK(entries(dir.path()) == std::vector<std::string>{"model.safetensors"});

  {
    AtomicFileWriter writer(dir / "never.bin");
    writer.write(std::string_view("x"));
  }
  CHECK_FALSE(fs::exists(dir / "never.bin"));
  CHECK(entries(dir.path()) == std::vector<std::string>{"model.safetensors"});
}

TEST_CASE("AtomicFileWriter: two writers to one target use distinct temp files; the last commit wins") {
  TempDir dir;
  const auto target = dir / "out.txt";
  AtomicFileWriter first(target);
  AtomicFileWriter second(target);
  CHECK(first.temp_path() != second.temp_path());
  first.write(std::string_view("first"));
  second.write(std::string_view("second"));
  first.commit();
  CHECK(read_text(target) == "first");
  second.commit();
  CHECK(read_text(target) == "second");
  CHECK(entries(dir.path()) == std::vector<std::string>{"out.txt"});
}

TEST_CASE("AtomicFileWriter: pad_to writes zeros up to the alignment") {
  TempDir dir;
  const auto target = dir / "aligned.bin";
  AtomicFileWriter writer(target);
  writer.write(std::string_view("abc"));
  writer.pad_to(8);
  CHECK(writer.bytes_written() == 8);
  writer.pad_to(8);  // already aligned: nothing added
  CHECK(writer.bytes_written() == 8);
  writer.write(std::string_view("d"));
  writer.pad_to(4096);
  CHECK(writer.bytes_written() == 4096);
  writer.commit();
  const std::string bytes = read_text(target);
  REQUIRE(bytes.size() == 4096);
  CHECK(bytes.substr(0, 3) == "abc");
  CHECK(bytes.substr(3, 5) == std::string(5, '\0'));
  CHECK(bytes[8] == 'd');
  CHECK(bytes.find_first_not_of('\0', 9) == std::string::npos);
}

TEST_CASE("write_file_atomic and read_whole_file") {
  TempDir dir;
  write_file_atomic(dir / "a.txt", std::string_view("hello"));
  CHECK(read_whole_file(dir / "a.txt", 100) == "hello");
  const std::string too_big = [&] {
    try {
      read_whole_file(dir / "a.txt", 4);
    } catch (const vlmopt::InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  CHECK(too_big.find("a.txt") != std::string::npos);
  CHECK(too_big.find("expected at most 4 bytes, got 5") != std::string::npos);

  // An output directory that does not exist is a user error naming the target.
  try {
    write_file_atomic(dir / "missing_dir" / "x.txt", std::string_view("x"));
    FAIL("expected an InputError");
  } catch (const vlmopt::InputError& e) {
    CHECK(std::string(e.what()).find("x.txt") != std::string::npos);
  }
  CHECK_THROWS_AS(read_whole_file(dir / "nope.txt", 10), vlmopt::InputError);
  CHECK_THROWS_AS(read_whole_file(dir.path(), 10), vlmopt::InputError);  // a directory
}

TEST_CASE("sha256 matches the FIPS 180-2 test vectors, in memory and streamed from files") {
  CHECK(sha256_hex(std::string_view("")) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex(std::string_view("abc")) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha256_hex(std::string_view("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million_a(1'000'000, 'a');
  CHECK(sha256_hex(std::as_bytes(std::span<const char>(million_a.data(), million_a.size()))) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");

  TempDir dir;
  write_text(dir / "a.bin", million_a);
  CHECK(sha256_file(dir / "a.bin") == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Larger than the 1 MiB read chunk: the streamed hash equals the one-shot hash.
  std::string random_bytes(3 * (1 << 20) + 123, '\0');
  std::mt19937 rng(11);
  for (char& c : random_bytes) c = static_cast<char>(rng());
  write_text(dir / "r.bin", random_bytes);
  CHECK(sha256_file(dir / "r.bin") == sha256_hex(std::string_view(random_bytes)));
  write_text(dir / "empty.bin", "");
  CHECK(sha256_file(dir / "empty.bin") == sha256_hex(std::string_view("")));
  try {
    sha256_file(dir / "missing.bin");
    FAIL("expected an InputError");
  } catch (const vlmopt::InputError& e) {
    CHECK(std::string(e.what()).find("missing.bin") != std::string::npos);
  }
}

// torch's wheels export copies of libstdc++'s std::filesystem functions; if our calls bound to
// them, torch 2.11's remove_all() crashed every TempDir and `vlmopt pipeline` (jump to a null
// pointer). cmake/VlmoptTorch.cmake puts libstdc++ first among the needed libraries: the address
// our code takes of remove_all must lie in libstdc++, whatever torch version is installed.
TEST_CASE("std::filesystem calls bind to libstdc++, not to the copies the torch libraries export") {
  using RemoveAll = std::uintmax_t (*)(const fs::path&, std::error_code&);
  using TempPath = fs::path (*)();
  const RemoveAll remove_all = &fs::remove_all;
  const TempPath temp_path = &fs::temp_directory_path;
  for (const void* fn : {reinterpret_cast<const void*>(remove_all), reinterpret_cast<const void*>(temp_path)}) {
    Dl_info info{};
    REQUIRE(dladdr(fn, &info) != 0);
    REQUIRE(info.dli_fname != nullptr);
    const std::string library = fs::path(info.dli_fname).filename().string();
    CAPTURE(info.dli_fname);
    CHECK(library.rfind("libstdc++", 0) == 0);
  }
}
