// Atomic writes: temp file next to the target, fsync, rename, fsync the directory.
// An interrupted run leaves the old file (or none), never half a file.
// Also the small POSIX file-descriptor owner the io readers share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace vlmopt::io {

// Owns a POSIX file descriptor; closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset();  // closes (errors ignored: nothing useful can be done in cleanup)

 private:
  int fd_ = -1;
};

// Opens an existing regular file read-only (O_CLOEXEC); throws InputError
// "<path>: cannot open: <reason>" or "<path>: not a regular file".
UniqueFd open_regular_file(const std::filesystem::path& path);

// The whole contents of a regular file, refusing files over `max_bytes` before
// reading them (InputError "<path>: file too large (expected at most N bytes, got M)").
std::string read_whole_file(const std::filesystem::path& path, std::uint64_t max_bytes);

class AtomicFileWriter {
 public:
  // Creates `.<name>.tmp.<pid>.<random>` next to `target` (InputError if the directory is not writable).
  explicit AtomicFileWriter(std::filesystem::path target);
  ~AtomicFileWriter();  // removes the temp file unless commit() succeeded
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(std::span<const std::byte> bytes);
  void write(std::string_view text);
  // Zero bytes up to `alignment` of the bytes written so far (for aligned sections).
  void pad_to(std::size_t alignment);
  std::size_t bytes_written() const { return written_; }
  const std::filesystem::path& target() const { return target_; }
  const std::filesystem::path& temp_path() const { return temp_; }
  void commit();  // fsync, close, rename over the target, fsync the directory

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  UniqueFd fd_;
  std::size_t written_ = 0;
  bool committed_ = false;
};

void write_file_atomic(const std::filesystem::path& target, std::string_view contents);
void write_file_atomic(const std::filesystem::path& target, std::span<const std::byte> contents);
// fsync a directory so a rename inside it is durable (no-op where the file system cannot).
void fsync_directory(const std::filesystem::path& dir);

}  // namespace vlmopt::io
