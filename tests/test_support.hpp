// Helpers every test file shares: self-deleting temp directories, whole-file
// reads and writes, and the fixture paths.
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <string_view>

namespace vlmopt::testing {

namespace fs = std::filesystem;

// The checkout's root and tests/fixtures (support_paths.cpp, the only file built with them).
fs::path source_dir();
fs::path fixtures_dir();

inline fs::path fixture_dir(const std::string& name) { return fixtures_dir() / name; }

// A fresh directory under the system temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  explicit TempDir(std::string_view prefix = "vlmopt_test") {
    std::random_device rd;
    path_ = fs::temp_directory_path() / fmt::format("{}_{:08x}{:08x}", prefix, rd(), rd());
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

inline std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
inline std::string read_text(const fs::path& path) { return read_bytes(path); }

inline void write_bytes(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace vlmopt::testing
