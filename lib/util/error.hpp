// Typed errors thrown by every vlmopt library; `main` catches them once and
// maps them to the documented exit codes (docs/cli.md).
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <stdexcept>
#include <string>

namespace vlmopt {

enum class ExitCode : int {
  kOk = 0,
  kFailure = 1,      // the operation failed for a reason other than its inputs
  kUsage = 2,        // bad command line (CLI11 parse errors)
  kBadInput = 3,     // a file or dataset is missing, malformed or inconsistent
  kGateFailed = 4,   // a CI gate (--fail-on, verify) was not met
  kInternal = 5,     // a bug: an invariant of vlmopt itself did not hold
};

class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ExitCode code() const noexcept { return code_; }

 private:
  ExitCode code_;
};

// A problem with something the user gave us: file, field, dataset, option value.
class InputError : public Error {
 public:
  explicit InputError(const std::string& message) : Error(ExitCode::kBadInput, message) {}
};

// A gate the user asked for did not pass (verify, diagnose-align --fail-on).
class GateError : public Error {
 public:
  explicit GateError(const std::string& message) : Error(ExitCode::kGateFailed, message) {}
};

// "<file>: <message>" — the one-line form every file error uses.
template <typename... Args>
[[noreturn]] void throw_file_error(const std::filesystem::path& file, fmt::format_string<Args...> fmt_str,
                                   Args&&... args) {
  throw InputError(fmt::format("{}: {}", file.string(), fmt::format(fmt_str, std::forward<Args>(args)...)));
}

}  // namespace vlmopt

// Invariant check inside vlmopt (not for user input): expected vs got in the message.
#define VLMOPT_CHECK(cond, ...)                                                                  \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      throw ::vlmopt::Error(::vlmopt::ExitCode::kInternal,                                       \
                            ::fmt::format("{}:{}: check '{}' failed: {}", __FILE__, __LINE__,    \
                                          #cond, ::fmt::format(__VA_ARGS__)));                   \
    }                                                                                            \
  } while (0)

// Check on user-supplied data: becomes an InputError (exit 3).
#define VLMOPT_CHECK_INPUT(cond, ...)                                  \
  do {                                                                 \
    if (!(cond)) throw ::vlmopt::InputError(::fmt::format(__VA_ARGS__)); \
  } while (0)
