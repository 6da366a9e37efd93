// UTF-8 helpers and the Unicode character classes the HF `tokenizers` components use
// (their Rust definitions named per function), answered by ICU.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace vlmopt::tokenizer::unicode {

// Byte offset of the first byte that does not start a well-formed UTF-8 sequence, if any.
std::optional<std::size_t> find_invalid_utf8(std::string_view bytes);

// Decodes the code point starting at `pos` of well-formed UTF-8 and moves `pos` past it.
char32_t next_code_point(std::string_view text, std::size_t& pos);

// Length in bytes of the UTF-8 sequence whose first byte is `lead` (1 for a stray byte).
std::size_t sequence_length(unsigned char lead);

void append_utf8(std::string& out, char32_t code_point);
std::string to_utf8(char32_t code_point);
std::size_t count_code_points(std::string_view text);

// Arbitrary bytes to UTF-8, each maximal invalid subsequence becoming U+FFFD
// (Rust's String::from_utf8_lossy, Python's errors="replace").
std::string decode_utf8_lossy(std::string_view bytes);

bool is_whitespace(char32_t c);         // White_Space property (Rust char::is_whitespace)
bool is_word(char32_t c);               // Rust regex `\w`: Alphabetic, M, Nd, Pc, Join_Control
bool is_punctuation(char32_t c);        // ASCII punctuation or General_Category P*
bool is_numeric(char32_t c);            // General_Category N* (Rust char::is_numeric)
bool is_mark(char32_t c);               // General_Category M*
bool is_nonspacing_mark(char32_t c);    // General_Category Mn
bool is_other(char32_t c);              // Cc, Cf, Co, Cs (unassigned code points are not "other" to BERT)
bool is_chinese_ideograph(char32_t c);  // the CJK blocks BERT pads with spaces

// Full lowercase mapping of one code point, without context (Rust char::to_lowercase):
// usually one code point, e.g. U+0130 gives two.
std::u32string lowercase(char32_t c);

enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };

}  // namespace vlmopt::tokenizer::unicode
