#include "tokenizer/icu_regex.hpp"

#include <fmt/format.h>
#include <unicode/uregex.h>
#include <unicode/utext.h>

#include <stdexcept>

namespace vlmopt::tokenizer {

namespace {

struct UTextCloser {
  void operator()(UText* text) const { utext_close(text); }
};
using UTextPtr = std::unique_ptr<UText, UTextCloser>;

UTextPtr open_utf8(std::string_view text, UErrorCode& status) {
  return UTextPtr(utext_openUTF8(nullptr, text.data(), static_cast<int64_t>(text.size()), &status));
}

}  // namespace

void IcuRegex::Closer::operator()(URegularExpression* regex) const { uregex_close(regex); }

IcuRegex::IcuRegex(std::string_view pattern) : pattern_(pattern) {
  UErrorCode status = U_ZERO_ERROR;
  UTextPtr pattern_text = open_utf8(pattern_, status);
  UParseError parse_error{};
  // Oniguruma (Ruby syntax) treats ^ and $ as line anchors: ICU's MULTILINE.
  URegularExpression* compiled = nullptr;
  if (U_SUCCESS(status)) compiled = uregex_openUText(pattern_text.get(), UREGEX_MULTILINE, &parse_error, &status);
  if (U_FAILURE(status)) {
    if (compiled != nullptr) uregex_close(compiled);
    throw std::invalid_argument(
        fmt::format("regex '{}' does not compile ({} at offset {})", pattern_, u_errorName(status), parse_error.offset));
  }
  compiled_.reset(compiled);
}

IcuRegex::IcuRegex(IcuRegex&&) noexcept = default;
IcuRegex& IcuRegex::operator=(IcuRegex&&) noexcept = default;
IcuRegex::~IcuRegex() = default;

std::vector<std::pair<std::size_t, std::size_t>> IcuRegex::find_all(std::string_view text) const {
  std::vector<std::pair<std::size_t, std::size_t>> matches;
  UErrorCode status = U_ZERO_ERROR;
  // A matcher holds its input and position: each call gets its own clone (the compiled
  // pattern is shared), which keeps const calls thread-safe.
  std::unique_ptr<URegularExpression, Closer> matcher(uregex_clone(compiled_.get(), &status));
  UTextPtr input = open_utf8(text, status);
  if (U_SUCCESS(status)) uregex_setUText(matcher.get(), input.get(), &status);
  while (U_SUCCESS(status) && uregex_findNext(matcher.get(), &status)) {
    // With a UTF-8 UText, ICU reports native indices: byte offsets.
    const int64_t begin = uregex_start64(matcher.get(), 0, &status);
    const int64_t end = uregex_end64(matcher.get(), 0, &status);
    if (U_FAILURE(status)) break;
    matches.emplace_back(static_cast<std::size_t>(begin), static_cast<std::size_t>(end));
  }
  if (U_FAILURE(status)) {
    throw std::runtime_error(fmt::format("regex '{}' failed on the input ({})", pattern_, u_errorName(status)));
  }
  return matches;
}

std::string onig_to_icu_pattern(std::string_view onig_pattern) {
  std::string out;
  out.reserve(onig_pattern.size() + 16);
  for (std::size_t i = 0; i < onig_pattern.size(); ++i) {
    const char c = onig_pattern[i];
    if (c != '\\' || i + 1 == onig_pattern.size()) {
      out.push_back(c);
      continue;
    }
    const char escaped = onig_pattern[++i];  // an escape is always two characters at its start
    if (escaped == 's') {
      out += "\\p{White_Space}";
    } else if (escaped == 'S') {
      out += "\\P{White_Space}";
    } else {
      out.push_back('\\');
      out.push_back(escaped);
    }
  }
  return out;
}

}  // namespace vlmopt::tokenizer
