// Atomic writes: temp file next to the target, fsync, rename, fsync the directory.
// An interrupted run leaves the old file (or none), never half a file.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string_view>

namespace vlmopt::io {

class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path target);
  ~AtomicFileWriter();  // removes the temp file unless commit() succeeded
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(std::span<const std::byte> bytes);
  void write(std::string_view text);
  // Zero bytes up to `alignment` of the bytes written so far (for aligned sections).
  void pad_to(std::size_t alignment);
  std::size_t bytes_written() const { return written_; }
  void commit();  // flush, fsync, rename over the target, fsync the directory

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
  std::size_t written_ = 0;
  bool committed_ = false;
};

void write_file_atomic(const std::filesystem::path& target, std::string_view contents);
void write_file_atomic(const std::filesystem::path& target, std::span<const std::byte> contents);
void fsync_directory(const std::filesystem::path& dir);

}  // namespace vlmopt::io
