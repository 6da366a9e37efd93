#include "tokenizer/normalized_string.hpp"

#include <unicode/unorm2.h>
#include <unicode/utf16.h>

#include <algorithm>
#include <stdexcept>

namespace vlmopt::tokenizer {

std::vector<Span> match_characters(std::string_view text, const std::function<bool(char32_t)>& predicate) {
  if (text.empty()) return {{0, 0, false}};
  std::vector<Span> spans;
  std::size_t run_start = 0;  // start of the current run of non-matching characters
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t char_start = pos;
    const char32_t c = unicode::next_code_point(text, pos);
    if (predicate(c)) {
      if (run_start < char_start) spans.push_back({run_start, char_start, false});
      spans.push_back({char_start, pos, true});
      run_start = pos;
    }
  }
  if (run_start < text.size()) spans.push_back({run_start, text.size(), false});
  return spans;
}

std::vector<Span> spans_from_ranges(std::string_view text,
                                    const std::vector<std::pair<std::size_t, std::size_t>>& ranges) {
  if (text.empty()) return {{0, 0, false}};
  std::vector<Span> spans;
  std::size_t previous_end = 0;
  for (const auto& [begin, end] : ranges) {
    if (previous_end != begin) spans.push_back({previous_end, begin, false});
    spans.push_back({begin, end, true});
    previous_end = end;
  }
  if (previous_end != text.size()) spans.push_back({previous_end, text.size(), false});
  return spans;
}

void invert(std::vector<Span>& spans) {
  for (Span& span : spans) span.is_match = !span.is_match;
}

TextPattern TextPattern::literal(std::string text) {
  if (text.empty()) throw std::invalid_argument("an empty string pattern matches nothing");
  TextPattern pattern;
  pattern.literal_ = std::move(text);
  return pattern;
}

TextPattern TextPattern::regex(IcuRegex regex) {
  TextPattern pattern;
  pattern.regex_.emplace(std::move(regex));
  return pattern;
}

std::vector<Span> TextPattern::find_matches(std::string_view text) const {
  if (regex_) return spans_from_ranges(text, regex_->find_all(text));
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  for (std::size_t at = text.find(literal_); at != std::string_view::npos; at = text.find(literal_, at + literal_.size())) {
    ranges.emplace_back(at, at + literal_.size());
  }
  return spans_from_ranges(text, ranges);
}

// Accumulates a new text with its alignments.
class NormalizedString::Builder {
 public:
  void add(char32_t c, int64_t alignment) {
    const std::size_t before = text.size();
    unicode::append_utf8(text, c);
    alignments.insert(alignments.end(), text.size() - before, alignment);
  }
  void add_bytes(std::string_view bytes, const int64_t* source_alignments) {
    text.append(bytes);
    alignments.insert(alignments.end(), source_alignments, source_alignments + bytes.size());
  }
  std::string text;
  std::vector<int64_t> alignments;
};

NormalizedString::NormalizedString(std::string original) : text_(std::move(original)) {
  alignment_.resize(text_.size());
  std::size_t pos = 0;
  while (pos < text_.size()) {
    const std::size_t start = pos;
    unicode::next_code_point(text_, pos);
    for (std::size_t i = start; i < pos; ++i) alignment_[i] = static_cast<int64_t>(start);
  }
}

void NormalizedString::map_characters(const std::function<std::u32string(char32_t)>& map) {
  Builder out;
  out.text.reserve(text_.size());
  std::size_t pos = 0;
  while (pos < text_.size()) {
    const int64_t alignment = alignment_[pos];  // every output of a character keeps its alignment
    const char32_t c = unicode::next_code_point(text_, pos);
    for (const char32_t mapped : map(c)) out.add(mapped, alignment);
  }
  text_ = std::move(out.text);
  alignment_ = std::move(out.alignments);
}

void NormalizedString::lowercase() {
  bool ascii_only = true;
  for (const char byte : text_) ascii_only = ascii_only && static_cast<unsigned char>(byte) < 0x80;
  if (ascii_only) {  // same bytes, same alignments
    for (char& byte : text_) {
      if (byte >= 'A' && byte <= 'Z') byte = static_cast<char>(byte + 32);
    }
    return;
  }
  map_characters(unicode::lowercase);
}

void NormalizedString::normalize_unicode(unicode::NormalForm form) {
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* normalizer = nullptr;
  switch (form) {
    case unicode::NormalForm::kNFC: normalizer = unorm2_getNFCInstance(&status); break;
    case unicode::NormalForm::kNFD: normalizer = unorm2_getNFDInstance(&status); break;
    case unicode::NormalForm::kNFKC: normalizer = unorm2_getNFKCInstance(&status); break;
    case unicode::NormalForm::kNFKD: normalizer = unorm2_getNFKDInstance(&status); break;
  }
  if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU normalizer unavailable: ") + u_errorName(status));

  // Normalize segment by segment (a segment starts at each character that never interacts
  // with what precedes it), so each output character can take the alignment of the input
  // character at the same position in its segment, as HF's alignment-tracking NFC does.
  Builder out;
  out.text.reserve(text_.size());
  std::vector<UChar> segment;
  std::vector<int64_t> segment_alignments;  // one per code point of the segment
  std::vector<UChar> normalized(64);
  auto flush = [&] {
    if (segment.empty()) return;
    int32_t length = 0;
    for (;;) {
      status = U_ZERO_ERROR;
      length = unorm2_normalize(normalizer, segment.data(), static_cast<int32_t>(segment.size()), normalized.data(),
                                static_cast<int32_t>(normalized.size()), &status);
      if (status != U_BUFFER_OVERFLOW_ERROR) break;
      normalized.resize(static_cast<std::size_t>(length) + 1);
    }
    if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU normalization failed: ") + u_errorName(status));
    std::size_t index = 0;
    for (int32_t i = 0; i < length; ++index) {
      UChar32 c = 0;
      U16_NEXT(normalized.data(), i, length, c);
      out.add(static_cast<char32_t>(c), segment_alignments[std::min(index, segment_alignments.size() - 1)]);
    }
    segment.clear();
    segment_alignments.clear();
  };
  std::size_t pos = 0;
  while (pos < text_.size()) {
    const int64_t alignment = alignment_[pos];
    const char32_t c = unicode::next_code_point(text_, pos);
    if (unorm2_hasBoundaryBefore(normalizer, static_cast<UChar32>(c))) flush();
    if (c < 0x10000) {
      segment.push_back(static_cast<UChar>(c));
    } else {
      segment.push_back(static_cast<UChar>(U16_LEAD(c)));
      segment.push_back(static_cast<UChar>(U16_TRAIL(c)));
    }
    segment_alignments.push_back(alignment);
  }
  flush();
  text_ = std::move(out.text);
  alignment_ = std::move(out.alignments);
}

void NormalizedString::strip(bool left, bool right) {
  std::size_t begin = 0;
  std::size_t end = text_.size();
  if (left) {
    while (begin < end) {
      std::size_t next = begin;
      if (!unicode::is_whitespace(unicode::next_code_point(text_, next))) break;
      begin = next;
    }
  }
  if (right) {
    while (end > begin) {
      std::size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(text_[start]) & 0xC0) == 0x80) --start;
      std::size_t probe = start;
      if (!unicode::is_whitespace(unicode::next_code_point(text_, probe))) break;
      end = start;
    }
  }
  text_ = text_.substr(begin, end - begin);
  alignment_ = std::vector<int64_t>(alignment_.begin() + static_cast<std::ptrdiff_t>(begin),
                                    alignment_.begin() + static_cast<std::ptrdiff_t>(end));
}

void NormalizedString::prepend(std::string_view prefix) {
  if (text_.empty() || prefix.empty()) return;
  // The prefix stands in for the first character: it takes that character's alignment.
  text_.insert(0, prefix);
  alignment_.insert(alignment_.begin(), prefix.size(), alignment_.front());
}

void NormalizedString::replace(const std::vector<Span>& spans, std::string_view content) {
  Builder out;
  out.text.reserve(text_.size());
  for (const Span& span : spans) {
    if (!span.is_match) {
      out.add_bytes(std::string_view(text_).substr(span.begin, span.end - span.begin), alignment_.data() + span.begin);
      continue;
    }
    // Inserted text takes the alignment of the byte before the end of the match.
    const int64_t alignment = span.end == 0 ? 0 : alignment_[span.end - 1];
    std::size_t pos = 0;
    while (pos < content.size()) out.add(unicode::next_code_point(content, pos), alignment);
  }
  text_ = std::move(out.text);
  alignment_ = std::move(out.alignments);
}

NormalizedString NormalizedString::slice(std::size_t begin, std::size_t end) const {
  NormalizedString piece;
  if (begin >= end) {
    piece.shift_ = shift_ + static_cast<int64_t>(begin);
    return piece;
  }
  const int64_t piece_start = alignment_[begin];
  piece.text_ = text_.substr(begin, end - begin);
  piece.alignment_.reserve(end - begin);
  for (std::size_t i = begin; i < end; ++i) piece.alignment_.push_back(alignment_[i] - piece_start);
  piece.shift_ = shift_ + piece_start;
  return piece;
}

std::vector<NormalizedString> NormalizedString::split(const std::vector<Span>& spans, SplitBehavior behavior) const {
  struct Part {
    std::size_t begin, end;
    bool removed;
  };
  std::vector<Part> parts;
  parts.reserve(spans.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Span& span : spans) parts.push_back({span.begin, span.end, false});
      break;
    case SplitBehavior::kRemoved:
      for (const Span& span : spans) parts.push_back({span.begin, span.end, span.is_match});
      break;
    case SplitBehavior::kContiguous:
      for (const Span& span : spans) {
        if (span.is_match == previous_match && !parts.empty()) {
          parts.back().end = span.end;
        } else {
          parts.push_back({span.begin, span.end, false});
        }
        previous_match = span.is_match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Span& span : spans) {
        if (span.is_match && !previous_match && !parts.empty()) {
          parts.back().end = span.end;
        } else {
          parts.push_back({span.begin, span.end, false});
        }
        previous_match = span.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !parts.empty()) {
          parts.back().begin = it->begin;
        } else {
          parts.push_back({it->begin, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(parts.begin(), parts.end());
      break;
  }
  std::vector<NormalizedString> pieces;
  pieces.reserve(parts.size());
  for (const Part& part : parts) {
    if (!part.removed) pieces.push_back(slice(part.begin, part.end));
  }
  return pieces;
}

void split_pieces(std::vector<Piece>& pieces, const std::function<std::vector<Piece>(NormalizedString&&)>& split_fn) {
  std::vector<Piece> result;
  result.reserve(pieces.size());
  for (Piece& piece : pieces) {
    if (piece.ids) {
      result.push_back(std::move(piece));
      continue;
    }
    for (Piece& part : split_fn(std::move(piece.normalized))) {
      if (!part.normalized.empty()) result.push_back(std::move(part));
    }
  }
  pieces = std::move(result);
}

void split_pieces_text(std::vector<Piece>& pieces,
                       const std::function<std::vector<NormalizedString>(NormalizedString&&)>& split_fn) {
  std::vector<Piece> result;
  result.reserve(pieces.size());
  for (Piece& piece : pieces) {
    if (piece.ids) {
      result.push_back(std::move(piece));
      continue;
    }
    for (NormalizedString& part : split_fn(std::move(piece.normalized))) {
      if (!part.empty()) result.push_back(Piece{std::move(part), std::nullopt});
    }
  }
  pieces = std::move(result);
}

}  // namespace vlmopt::tokenizer
