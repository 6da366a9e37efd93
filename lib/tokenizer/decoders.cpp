// Decoders of tokenizer.json (HF tokenizers/src/decoders). Each maps the token strings to
// new strings; the tokenizer joins the final list without separator.
#include "tokenizer/components.hpp"

#include <fmt/format.h>

#include <limits>

namespace vlmopt::tokenizer {

namespace {

class ByteFallback final : public Decoder {
 public:
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    std::vector<std::string> out;
    std::string pending_bytes;  // consecutive <0xXX> tokens form one UTF-8 string
    auto flush = [&] {
      if (pending_bytes.empty()) return;
      if (unicode::find_invalid_utf8(pending_bytes)) {
        for (std::size_t i = 0; i < pending_bytes.size(); ++i) out.emplace_back("\xEF\xBF\xBD");  // U+FFFD per byte
      } else {
        out.push_back(pending_bytes);
      }
      pending_bytes.clear();
    };
    for (std::string& token : tokens) {
      if (const auto byte = parse_byte_token(token)) {
        pending_bytes.push_back(static_cast<char>(*byte));
        continue;
      }
      flush();
      out.push_back(std::move(token));
    }
    flush();
    return out;
  }

 private:
  // "<0x41>" -> 0x41 (two hex digits, or '+' and one, as Rust's u8::from_str_radix reads them).
  static std::optional<unsigned char> parse_byte_token(std::string_view token) {
    if (token.size() != 6 || !token.starts_with("<0x") || token.back() != '>') return std::nullopt;
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int high = token[3] == '+' ? 0 : hex(token[3]);
    const int low = hex(token[4]);
    if (high < 0 || low < 0) return std::nullopt;
    return static_cast<unsigned char>(high * 16 + low);
  }
};

class Fuse final : public Decoder {
 public:
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    std::string joined;
    for (const std::string& token : tokens) joined += token;
    return {std::move(joined)};
  }
};

// Removes up to `start` leading and `stop` trailing `content` characters of each token.
class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, std::size_t start, std::size_t stop) : content_(content), start_(start), stop_(stop) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (std::string& token : tokens) {
      std::u32string chars;
      for (std::size_t pos = 0; pos < token.size();) chars.push_back(unicode::next_code_point(token, pos));
      std::size_t begin = 0;
      while (begin < start_ && begin < chars.size() && chars[begin] == content_) ++begin;
      std::size_t end = chars.size();
      for (std::size_t i = 0; i < stop_ && end > begin && chars[end - 1] == content_; ++i) --end;
      std::string stripped;
      for (std::size_t i = begin; i < end; ++i) unicode::append_utf8(stripped, chars[i]);
      token = std::move(stripped);
    }
    return tokens;
  }

 private:
  char32_t content_;
  std::size_t start_, stop_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(TextPattern pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (std::string& token : tokens) {
      std::string replaced;
      for (const Span& span : pattern_.find_matches(token)) {
        replaced += span.is_match ? content_ : token.substr(span.begin, span.end - span.begin);
      }
      token = std::move(replaced);
    }
    return tokens;
  }

 private:
  TextPattern pattern_;
  std::string content_;
};

// Metaspace markers become spaces; in the first token they are dropped unless the
// pre-tokenizer never prepends one.
class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, PrependScheme scheme) : replacement_(replacement), scheme_(scheme) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      std::string decoded;
      const std::string& token = tokens[i];
      for (std::size_t pos = 0; pos < token.size();) {
        const char32_t c = unicode::next_code_point(token, pos);
        if (c != replacement_) {
          unicode::append_utf8(decoded, c);
        } else if (!(i == 0 && scheme_ != PrependScheme::kNever)) {
          decoded.push_back(' ');
        }
      }
      tokens[i] = std::move(decoded);
    }
    return tokens;
  }

 private:
  char32_t replacement_;
  PrependScheme scheme_;
};

// GPT-2 byte characters back to bytes, then UTF-8 with U+FFFD for invalid sequences.
class ByteLevelDecoder final : public Decoder {
 public:
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    std::string bytes;
    for (const std::string& token : tokens) {
      std::string token_bytes;
      bool all_mapped = true;
      for (std::size_t pos = 0; pos < token.size() && all_mapped;) {
        const auto byte = char_to_byte(unicode::next_code_point(token, pos));
        if (byte) {
          token_bytes.push_back(static_cast<char>(*byte));
        } else {
          all_mapped = false;
        }
      }
      bytes += all_mapped ? token_bytes : token;
    }
    return {unicode::decode_utf8_lossy(bytes)};
  }
};

std::string replace_all(std::string text, std::string_view from, std::string_view to) {
  if (from.empty()) return text;
  std::string out;
  std::size_t last = 0;
  for (std::size_t at = text.find(from); at != std::string::npos; at = text.find(from, last)) {
    out.append(text, last, at - last);
    out += to;
    last = at + from.size();
  }
  out.append(text, last, std::string::npos);
  return out;
}

// The spacing fixes of BERT's WordPiece decoder, in its order.
std::string wordpiece_cleanup(std::string text) {
  static constexpr std::pair<std::string_view, std::string_view> kFixes[] = {
      {" .", "."},    {" ?", "?"},     {" !", "!"},           {" ,", ","},     {" ' ", "'"},    {" n't", "n't"},
      {" 'm", "'m"}, {" do not", " don't"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kFixes) text = replace_all(std::move(text), from, to);
  return text;
}

class WordPieceDecoder final : public Decoder {
 public:
  WordPieceDecoder(std::string prefix, bool cleanup) : prefix_(std::move(prefix)), cleanup_(cleanup) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      std::string& token = tokens[i];
      if (i != 0) token = token.starts_with(prefix_) ? token.substr(prefix_.size()) : " " + token;
      if (cleanup_) token = wordpiece_cleanup(std::move(token));
    }
    return tokens;
  }

 private:
  std::string prefix_;
  bool cleanup_;
};

// BPE end-of-word suffixes become spaces (the last one disappears).
class BpeDecoder final : public Decoder {
 public:
  explicit BpeDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = replace_all(std::move(tokens[i]), suffix_, i + 1 == tokens.size() ? "" : " ");
    }
    return tokens;
  }

 private:
  std::string suffix_;
};

class CtcDecoder final : public Decoder {
 public:
  CtcDecoder(std::string pad, std::string word_delimiter, bool cleanup)
      : pad_(std::move(pad)), word_delimiter_(std::move(word_delimiter)), cleanup_(cleanup) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    std::vector<std::string> out;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0 && tokens[i] == tokens[i - 1]) continue;  // repeated CTC emissions
      std::string token = replace_all(tokens[i], pad_, "");
      if (cleanup_) token = replace_all(wordpiece_cleanup(std::move(token)), word_delimiter_, " ");
      if (!token.empty()) out.push_back(std::move(token));
    }
    return out;
  }

 private:
  std::string pad_, word_delimiter_;
  bool cleanup_;
};

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (const auto& step : steps_) tokens = step->decode_chain(std::move(tokens));
    return tokens;
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

}  // namespace

std::unique_ptr<Decoder> parse_decoder(const JsonView& json) {
  const std::string type = json.type();
  if (type == "ByteFallback") return std::make_unique<ByteFallback>();
  if (type == "Fuse") return std::make_unique<Fuse>();
  if (type == "Strip") {
    constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();
    return std::make_unique<StripDecoder>(json.at("content").as_char(),
                                          static_cast<std::size_t>(json.at("start").as_int(0, kMaxCount)),
                                          static_cast<std::size_t>(json.at("stop").as_int(0, kMaxCount)));
  }
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(parse_pattern(json.at("pattern")), json.string_at("content"));
  }
  if (type == "Metaspace") {
    return std::make_unique<MetaspaceDecoder>(json.at("replacement").as_char(), parse_prepend_scheme(json));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "WordPiece") {
    return std::make_unique<WordPieceDecoder>(json.string_at("prefix"), json.bool_at("cleanup"));
  }
  if (type == "BPEDecoder") return std::make_unique<BpeDecoder>(json.string_at("suffix"));
  if (type == "CTC") {
    return std::make_unique<CtcDecoder>(json.string_at("pad_token"), json.string_at("word_delimiter_token"),
                                        json.bool_at("cleanup"));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> steps;
    for (const JsonView& step : json.at("decoders").elements()) steps.push_back(parse_decoder(step));
    return std::make_unique<SequenceDecoder>(std::move(steps));
  }
  fail_unsupported_type(json, "decoder", type,
                        {"BPEDecoder", "ByteFallback", "ByteLevel", "CTC", "Fuse", "Metaspace", "Replace", "Sequence",
                         "Strip", "WordPiece"});
}

}  // namespace vlmopt::tokenizer
