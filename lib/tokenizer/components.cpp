#include "tokenizer/components.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <stdexcept>

namespace vlmopt::tokenizer {

void fail_unsupported_type(const JsonView& json, std::string_view kind, std::string_view type,
                           std::initializer_list<std::string_view> supported) {
  json.at("type").fail(fmt::format("unsupported {} type '{}' (supported: {})", kind, type, fmt::join(supported, ", ")));
}

TextPattern parse_pattern(const JsonView& json) {
  json.expect_object();
  if (json.raw().size() != 1) json.fail("expected {\"String\": ...} or {\"Regex\": ...}");
  if (const auto literal = json.find("String")) {
    const std::string text = literal->as_string();
    if (text.empty()) literal->fail("an empty pattern is not supported");
    return TextPattern::literal(text);
  }
  if (const auto regex = json.find("Regex")) {
    try {
      return TextPattern::regex(IcuRegex(onig_to_icu_pattern(regex->as_string())));
    } catch (const std::invalid_argument& error) {
      regex->fail(error.what());
    }
  }
  json.fail("expected {\"String\": ...} or {\"Regex\": ...}");
}

SplitBehavior parse_split_behavior(const JsonView& json) {
  const std::string name = json.as_string();
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  json.fail(fmt::format("unknown split behavior '{}' (expected Removed, Isolated, MergedWithPrevious, "
                        "MergedWithNext or Contiguous)",
                        name));
}

namespace {

// GPT-2's table: printable Latin-1 bytes map to themselves, the 68 others to U+0100 upwards.
struct ByteTable {
  std::array<char32_t, 256> to_char{};
  std::array<int16_t, 512> to_byte{};  // every mapped character is below U+0200
  ByteTable() {
    to_byte.fill(-1);
    char32_t next_extra = 256;
    for (int byte = 0; byte < 256; ++byte) {
      const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE);
      to_char[static_cast<std::size_t>(byte)] = printable ? static_cast<char32_t>(byte) : next_extra++;
      to_byte[to_char[static_cast<std::size_t>(byte)]] = static_cast<int16_t>(byte);
    }
  }
};

const ByteTable& byte_table() {
  static const ByteTable table;
  return table;
}

}  // namespace

char32_t byte_to_char(unsigned char byte) { return byte_table().to_char[byte]; }

std::optional<unsigned char> char_to_byte(char32_t c) {
  if (c >= 512) return std::nullopt;
  const int16_t byte = byte_table().to_byte[c];
  if (byte < 0) return std::nullopt;
  return static_cast<unsigned char>(byte);
}

}  // namespace vlmopt::tokenizer
