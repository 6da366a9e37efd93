// A compiled regular expression for the `Regex` patterns of tokenizer.json (HF `tokenizers`
// compiles them with Oniguruma; ICU's syntax covers what tokenizer files use: \p{L}, \p{N},
// look-ahead, (?i:...)).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct URegularExpression;

namespace vlmopt::tokenizer {

class IcuRegex {
 public:
  // Throws std::invalid_argument with ICU's reason when the pattern does not compile.
  explicit IcuRegex(std::string_view pattern);
  IcuRegex(IcuRegex&&) noexcept;
  IcuRegex& operator=(IcuRegex&&) noexcept;
  ~IcuRegex();

  // Byte ranges [begin, end) of the successive non-overlapping matches in UTF-8 `text`.
  // Safe to call from several threads at once.
  std::vector<std::pair<std::size_t, std::size_t>> find_all(std::string_view text) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Closer {
    void operator()(URegularExpression* regex) const;
  };
  std::string pattern_;
  std::unique_ptr<URegularExpression, Closer> compiled_;
};

// Oniguruma's `\s`/`\S` mean the White_Space property, ICU's a narrower set
// ([\t\n\f\r\p{Z}]); rewrites them so the compiled pattern matches like Oniguruma.
std::string onig_to_icu_pattern(std::string_view onig_pattern);

}  // namespace vlmopt::tokenizer
