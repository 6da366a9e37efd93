#include "io/atomic_file.hpp"

#include "util/error.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <random>
#include <system_error>

namespace vlmopt::io {
namespace {

std::string errno_text(int err) { return std::generic_category().message(err); }

// Write failures are not the user's input at fault (disk full, I/O error).
[[noreturn]] void throw_io_failure(const std::filesystem::path& file, std::string_view what, int err) {
  throw Error(ExitCode::kFailure, fmt::format("{}: {}: {}", file.string(), what, errno_text(err)));
}

int fsync_retrying(int fd) {
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  return rc;
}

std::filesystem::path directory_of(const std::filesystem::path& target) {
  auto dir = target.parent_path();
  return dir.empty() ? std::filesystem::path(".") : dir;
}

// ".<name>.tmp.<pid>.<16 hex digits>": hidden, unique per process and attempt.
std::filesystem::path temp_name_for(const std::filesystem::path& target) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return directory_of(target) /
         fmt::format(".{}.tmp.{}.{:016x}", target.filename().string(), static_cast<long>(::getpid()), rng());
}

}  // namespace

void UniqueFd::reset() {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
}

UniqueFd open_regular_file(const std::filesystem::path& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw InputError(fmt::format("{}: cannot open: {}", path.string(), errno_text(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw InputError(fmt::format("{}: cannot stat: {}", path.string(), errno_text(errno)));
  if (!S_ISREG(st.st_mode)) throw InputError(fmt::format("{}: not a regular file", path.string()));
  return fd;
}

std::string read_whole_file(const std::filesystem::path& path, std::uint64_t max_bytes) {
  const UniqueFd fd = open_regular_file(path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw InputError(fmt::format("{}: cannot stat: {}", path.string(), errno_text(errno)));
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes) {
    throw InputError(fmt::format("{}: file too large (expected at most {} bytes, got {})", path.string(), max_bytes, size));
  }
  std::string contents(size, '\0');
  std::size_t filled = 0;
  while (filled < contents.size()) {
    const ssize_t n = ::read(fd.get(), contents.data() + filled, contents.size() - filled);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw InputError(fmt::format("{}: read failed: {}", path.string(), errno_text(errno)));
    }
    if (n == 0) break;  // the file shrank while we read it
    filled += static_cast<std::size_t>(n);
  }
  contents.resize(filled);
  return contents;
}

AtomicFileWriter::AtomicFileWriter(std::filesystem::path target) : target_(std::move(target)) {
  VLMOPT_CHECK_INPUT(!target_.filename().empty(), "{}: not a file path (it has no file name)", target_.string());
  constexpr int kAttempts = 16;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    temp_ = temp_name_for(target_);
    // Mode 0666 & ~umask, like any newly created file; O_EXCL so we never reuse someone's file.
    fd_ = UniqueFd(::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
    if (fd_) return;
    if (errno != EEXIST && errno != EINTR) {
      const int err = errno;
      temp_.clear();
      throw InputError(fmt::format("{}: cannot create a temporary file in '{}': {}", target_.string(),
                                   directory_of(target_).string(), errno_text(err)));
    }
  }
  temp_.clear();
  throw InputError(
      fmt::format("{}: no free temporary file name after {} attempts", target_.string(), kAttempts));
}

AtomicFileWriter::~AtomicFileWriter() {
  fd_.reset();
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFileWriter::write(std::span<const std::byte> bytes) {
  VLMOPT_CHECK(fd_ && !committed_, "write to '{}' after commit", target_.string());
  const std::byte* cursor = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_.get(), cursor, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_io_failure(temp_, "write failed", errno);
    }
    // A short write is not an error: write the rest.
    cursor += n;
    left -= static_cast<std::size_t>(n);
    written_ += static_cast<std::size_t>(n);
  }
}

void AtomicFileWriter::write(std::string_view text) {
  write(std::as_bytes(std::span<const char>(text.data(), text.size())));
}

void AtomicFileWriter::pad_to(std::size_t alignment) {
  VLMOPT_CHECK(alignment > 0, "alignment must be positive, got {}", alignment);
  static constexpr std::array<std::byte, 4096> kZeros{};
  std::size_t missing = (alignment - written_ % alignment) % alignment;
  while (missing > 0) {
    const std::size_t n = std::min(missing, kZeros.size());
    write(std::span<const std::byte>(kZeros.data(), n));
    missing -= n;
  }
}

void AtomicFileWriter::commit() {
  VLMOPT_CHECK(fd_ && !committed_, "commit of '{}' called twice", target_.string());
  if (fsync_retrying(fd_.get()) != 0) throw_io_failure(temp_, "fsync failed", errno);
  // close() can report deferred write errors (e.g. NFS); never retry it (the fd is gone either way).
  if (::close(fd_.release()) != 0 && errno != EINTR) throw_io_failure(temp_, "close failed", errno);
  if (::rename(temp_.c_str(), target_.c_str()) != 0) {
    throw_io_failure(target_, "cannot rename the temporary file over it", errno);
  }
  committed_ = true;
  fsync_directory(directory_of(target_));
}

void write_file_atomic(const std::filesystem::path& target, std::string_view contents) {
  AtomicFileWriter writer(target);
  writer.write(contents);
  writer.commit();
}

void write_file_atomic(const std::filesystem::path& target, std::span<const std::byte> contents) {
  AtomicFileWriter writer(target);
  writer.write(contents);
  writer.commit();
}

void fsync_directory(const std::filesystem::path& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) throw_io_failure(dir, "cannot open the directory to fsync it", errno);
  // Some file systems cannot fsync directories (EINVAL); the rename has happened regardless.
  if (fsync_retrying(fd.get()) != 0 && errno != EINVAL && errno != ENOTSUP) {
    throw_io_failure(dir, "fsync of the directory failed", errno);
  }
}

}  // namespace vlmopt::io
