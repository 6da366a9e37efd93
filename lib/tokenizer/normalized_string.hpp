// The string a tokenizer pipeline works on, piece by piece.
//
// Each piece remembers where it starts in the text given to encode() and, per byte,
// where the character it came from starts in that piece. HF `tokenizers` keeps the same
// bookkeeping; one component reads it (Metaspace with prepend_scheme "first" only adds
// its marker to the piece that starts the input), so every edit here moves it the same way.
#pragma once

#include "tokenizer/icu_regex.hpp"
#include "tokenizer/unicode.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::tokenizer {

// One part of a pattern search over a text: bytes [begin, end), and whether it matched.
// A search returns parts that cover the whole text, in order.
struct Span {
  std::size_t begin = 0;
  std::size_t end = 0;
  bool is_match = false;
};

// What a split does with the parts that matched (tokenizer.json "behavior").
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Every character for which `predicate` holds is one match.
std::vector<Span> match_characters(std::string_view text, const std::function<bool(char32_t)>& predicate);
// Matches given as byte ranges (ascending, non-overlapping), gaps filled in as non-matches.
std::vector<Span> spans_from_ranges(std::string_view text, const std::vector<std::pair<std::size_t, std::size_t>>& ranges);
void invert(std::vector<Span>& spans);

// A tokenizer.json pattern: {"String": literal} or {"Regex": pattern}.
class TextPattern {
 public:
  static TextPattern literal(std::string text);  // `text` must not be empty
  static TextPattern regex(IcuRegex regex);
  std::vector<Span> find_matches(std::string_view text) const;

 private:
  TextPattern() = default;
  std::string literal_;
  std::optional<IcuRegex> regex_;
};

class NormalizedString {
 public:
  NormalizedString() = default;
  explicit NormalizedString(std::string original);

  const std::string& get() const { return text_; }
  bool empty() const { return text_.empty(); }
  // Byte offset in the encoded input where this piece starts (HF offsets_original().0).
  std::size_t original_offset() const { return static_cast<std::size_t>(shift_); }

  // Replaces each character by `map(c)` (possibly several, possibly none).
  void map_characters(const std::function<std::u32string(char32_t)>& map);
  void lowercase();
  void normalize_unicode(unicode::NormalForm form);
  void strip(bool left, bool right);
  void prepend(std::string_view prefix);  // no-op on an empty string
  // Replaces every matched span by `content`.
  void replace(const std::vector<Span>& spans, std::string_view content);

  NormalizedString slice(std::size_t begin, std::size_t end) const;
  // The pieces left by `behavior` around the matched spans (empty pieces included).
  std::vector<NormalizedString> split(const std::vector<Span>& spans, SplitBehavior behavior) const;

 private:
  class Builder;
  std::string text_;
  std::vector<int64_t> alignment_;  // per byte of text_: start of its source character in this piece
  int64_t shift_ = 0;               // start of this piece in the encoded input
};

// A piece of the input during encoding: text still to tokenize, or tokens already fixed
// (an added token, or the model's output).
struct Piece {
  NormalizedString normalized;
  std::optional<std::vector<int64_t>> ids;
};

// Replaces every piece without ids by what `split_fn` makes of it, dropping empty pieces
// (HF PreTokenizedString::split).
void split_pieces(std::vector<Piece>& pieces, const std::function<std::vector<Piece>(NormalizedString&&)>& split_fn);
// Same for a function that only produces text pieces.
void split_pieces_text(std::vector<Piece>& pieces,
                       const std::function<std::vector<NormalizedString>(NormalizedString&&)>& split_fn);

}  // namespace vlmopt::tokenizer
