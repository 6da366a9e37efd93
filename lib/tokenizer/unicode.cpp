#include "tokenizer/unicode.hpp"

#include <unicode/uchar.h>
#include <unicode/ustring.h>

#include <array>

namespace vlmopt::tokenizer::unicode {

namespace {

constexpr char32_t kReplacementCharacter = 0xFFFD;

bool is_continuation(unsigned char byte) { return (byte & 0xC0) == 0x80; }

// Length of the well-formed sequence at `pos`, or 0 when it is not well formed.
// Also reports how many bytes form the maximal invalid subpart (Unicode §3.9, "U+FFFD
// substitution of maximal subparts"), which is what Rust and Python replace at once.
std::size_t well_formed_length(std::string_view bytes, std::size_t pos, std::size_t& invalid_subpart) {
  const auto lead = static_cast<unsigned char>(bytes[pos]);
  invalid_subpart = 1;
  if (lead < 0x80) return 1;
  std::size_t length = 0;
  unsigned char second_min = 0x80, second_max = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) second_min = 0xA0;  // no overlong forms
    if (lead == 0xED) second_max = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) second_min = 0x90;  // no overlong forms
    if (lead == 0xF4) second_max = 0x8F;  // nothing above U+10FFFF
  } else {
    return 0;  // continuation byte, C0, C1 or F5..FF: never starts a sequence
  }
  for (std::size_t i = 1; i < length; ++i) {
    if (pos + i >= bytes.size()) return 0;
    const auto byte = static_cast<unsigned char>(bytes[pos + i]);
    const bool ok = i == 1 ? (byte >= second_min && byte <= second_max) : is_continuation(byte);
    if (!ok) return 0;
    invalid_subpart = i + 1;
  }
  return length;
}

uint32_t general_category_mask(char32_t c) { return U_GET_GC_MASK(static_cast<UChar32>(c)); }

}  // namespace

std::optional<std::size_t> find_invalid_utf8(std::string_view bytes) {
  std::size_t pos = 0;
  std::size_t invalid_subpart = 0;
  while (pos < bytes.size()) {
    const std::size_t length = well_formed_length(bytes, pos, invalid_subpart);
    if (length == 0) return pos;
    pos += length;
  }
  return std::nullopt;
}

std::size_t sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

char32_t next_code_point(std::string_view text, std::size_t& pos) {
  const auto lead = static_cast<unsigned char>(text[pos]);
  const std::size_t length = std::min(sequence_length(lead), text.size() - pos);
  char32_t c = length == 1 ? lead : (lead & (0x7F >> length));
  for (std::size_t i = 1; i < length; ++i) c = (c << 6) | (static_cast<unsigned char>(text[pos + i]) & 0x3F);
  pos += length;
  return c;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string to_utf8(char32_t c) {
  std::string out;
  append_utf8(out, c);
  return out;
}

std::size_t count_code_points(std::string_view text) {
  std::size_t count = 0;
  for (const char byte : text) count += !is_continuation(static_cast<unsigned char>(byte));
  return count;
}

std::string decode_utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  std::size_t pos = 0;
  std::size_t invalid_subpart = 0;
  while (pos < bytes.size()) {
    const std::size_t length = well_formed_length(bytes, pos, invalid_subpart);
    if (length == 0) {
      append_utf8(out, kReplacementCharacter);
      pos += invalid_subpart;
    } else {
      out.append(bytes.substr(pos, length));
      pos += length;
    }
  }
  return out;
}

bool is_whitespace(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE); }

bool is_word(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  const auto uc = static_cast<UChar32>(c);
  return u_hasBinaryProperty(uc, UCHAR_ALPHABETIC) || u_hasBinaryProperty(uc, UCHAR_JOIN_CONTROL) ||
         (general_category_mask(c) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}

bool is_punctuation(char32_t c) {
  if (c < 0x80) {
    return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
           (c >= 0x7B && c <= 0x7E);
  }
  return (general_category_mask(c) & U_GC_P_MASK) != 0;
}

bool is_numeric(char32_t c) { return (general_category_mask(c) & U_GC_N_MASK) != 0; }
bool is_mark(char32_t c) { return (general_category_mask(c) & U_GC_M_MASK) != 0; }
bool is_nonspacing_mark(char32_t c) { return (general_category_mask(c) & U_GC_MN_MASK) != 0; }
bool is_other(char32_t c) {
  // HF's BertNormalizer asks the unicode_categories crate, whose "other" has no Cn.
  return (general_category_mask(c) & (U_GC_CC_MASK | U_GC_CF_MASK | U_GC_CO_MASK | U_GC_CS_MASK)) != 0;
}

bool is_chinese_ideograph(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

std::u32string lowercase(char32_t c) {
  if (c < 0x80) return std::u32string(1, (c >= 'A' && c <= 'Z') ? c + 32 : c);
  // One code point in the root locale: no language rules and no neighbours, so ICU's full
  // mapping equals the per-character one (final sigma needs a preceding letter).
  std::array<UChar, 2> source{};
  int32_t source_length = 0;
  UBool error = false;
  U16_APPEND(source.data(), source_length, 2, static_cast<UChar32>(c), error);
  std::array<UChar, 16> lowered{};
  UErrorCode status = U_ZERO_ERROR;
  const int32_t lowered_length =
      u_strToLower(lowered.data(), static_cast<int32_t>(lowered.size()), source.data(), source_length, "", &status);
  if (error || U_FAILURE(status)) return std::u32string(1, c);
  std::u32string out;
  for (int32_t i = 0; i < lowered_length;) {
    UChar32 cp = 0;
    U16_NEXT(lowered.data(), i, lowered_length, cp);
    out.push_back(static_cast<char32_t>(cp));
  }
  return out;
}

}  // namespace vlmopt::tokenizer::unicode
