// Pre-tokenizers of tokenizer.json (HF tokenizers/src/pre_tokenizers).
#include "tokenizer/components.hpp"

#include <fmt/format.h>

namespace vlmopt::tokenizer {

namespace {

// Splits every text piece at the characters `predicate` accepts.
void split_at_characters(std::vector<Piece>& pieces, bool (*predicate)(char32_t), SplitBehavior behavior) {
  split_pieces_text(pieces, [&](NormalizedString&& text) {
    return text.split(match_characters(text.get(), predicate), behavior);
  });
}

class WhitespaceSplit final : public PreTokenizer {
 public:
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_at_characters(pieces, unicode::is_whitespace, SplitBehavior::kRemoved);
  }
};

// Keeps the matches of \w+|[^\w\s]+ (Rust regex, Unicode classes): runs of word characters
// and runs of other non-space characters; whitespace goes.
class Whitespace final : public PreTokenizer {
 public:
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces_text(pieces, [](NormalizedString&& text) {
      const std::string& s = text.get();
      std::vector<std::pair<std::size_t, std::size_t>> runs;
      enum class Kind { kSpace, kWord, kOther };
      auto kind_of = [](char32_t c) {
        if (unicode::is_word(c)) return Kind::kWord;
        return unicode::is_whitespace(c) ? Kind::kSpace : Kind::kOther;
      };
      std::size_t pos = 0;
      while (pos < s.size()) {
        const std::size_t start = pos;
        const Kind kind = kind_of(unicode::next_code_point(s, pos));
        if (kind == Kind::kSpace) continue;
        std::size_t end = pos;
        while (end < s.size()) {
          std::size_t next = end;
          if (kind_of(unicode::next_code_point(s, next)) != kind) break;
          end = next;
        }
        runs.emplace_back(start, end);
        pos = end;
      }
      std::vector<Span> spans = spans_from_ranges(s, runs);
      invert(spans);
      return text.split(spans, SplitBehavior::kRemoved);
    });
  }
};

class Punctuation final : public PreTokenizer {
 public:
  explicit Punctuation(SplitBehavior behavior) : behavior_(behavior) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_at_characters(pieces, unicode::is_punctuation, behavior_);
  }

 private:
  SplitBehavior behavior_;
};

class Digits final : public PreTokenizer {
 public:
  explicit Digits(bool individual_digits) : individual_digits_(individual_digits) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_at_characters(pieces, unicode::is_numeric,
                        individual_digits_ ? SplitBehavior::kIsolated : SplitBehavior::kContiguous);
  }

 private:
  bool individual_digits_;
};

class BertPreTokenizer final : public PreTokenizer {
 public:
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_at_characters(pieces, unicode::is_whitespace, SplitBehavior::kRemoved);
    split_at_characters(pieces, unicode::is_punctuation, SplitBehavior::kIsolated);
  }
};

class CharDelimiterSplit final : public PreTokenizer {
 public:
  explicit CharDelimiterSplit(char32_t delimiter) : delimiter_(delimiter) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces_text(pieces, [this](NormalizedString&& text) {
      return text.split(match_characters(text.get(), [this](char32_t c) { return c == delimiter_; }),
                        SplitBehavior::kRemoved);
    });
  }

 private:
  char32_t delimiter_;
};

class Split final : public PreTokenizer {
 public:
  Split(TextPattern pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces_text(pieces, [this](NormalizedString&& text) {
      std::vector<Span> spans = pattern_.find_matches(text.get());
      if (invert_) invert(spans);
      return text.split(spans, behavior_);
    });
  }

 private:
  TextPattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

class FixedLength final : public PreTokenizer {
 public:
  explicit FixedLength(std::size_t length) : length_(length) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces_text(pieces, [this](NormalizedString&& text) {
      std::vector<NormalizedString> chunks;
      const std::string& s = text.get();
      std::size_t pos = 0;
      while (pos < s.size()) {
        const std::size_t start = pos;
        for (std::size_t i = 0; i < length_ && pos < s.size(); ++i) unicode::next_code_point(s, pos);
        chunks.push_back(text.slice(start, pos));
      }
      return chunks;
    });
  }

 private:
  std::size_t length_;
};

// Spaces become `replacement` (LLaMA's U+2581), which is also prepended, and each word
// starts at one.
class Metaspace final : public PreTokenizer {
 public:
  Metaspace(char32_t replacement, PrependScheme scheme, bool split)
      : replacement_(replacement), marker_(unicode::to_utf8(replacement)), scheme_(scheme), split_(split) {}

  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces_text(pieces, [this](NormalizedString&& text) {
      text.replace(match_characters(text.get(), [](char32_t c) { return c == U' '; }), marker_);
      const bool starts_with_marker = text.get().starts_with(marker_);
      const bool prepend = scheme_ == PrependScheme::kAlways ||
                           (scheme_ == PrependScheme::kFirst && text.original_offset() == 0);
      if (prepend && !starts_with_marker) text.prepend(marker_);
      if (!split_) return std::vector<NormalizedString>{std::move(text)};
      return text.split(match_characters(text.get(), [this](char32_t c) { return c == replacement_; }),
                        SplitBehavior::kMergedWithNext);
    });
  }

 private:
  char32_t replacement_;
  std::string marker_;
  PrependScheme scheme_;
  bool split_;
};

// GPT-2: optional leading space, the GPT-2 word regex, then bytes as printable characters.
class ByteLevel final : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space),
        use_regex_(use_regex),
        words_(onig_to_icu_pattern(
            R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)")) {}

  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces_text(pieces, [this](NormalizedString&& text) {
      if (add_prefix_space_ && !text.get().starts_with(' ')) text.prepend(" ");
      if (!use_regex_) return std::vector<NormalizedString>{std::move(text)};
      return text.split(spans_from_ranges(text.get(), words_.find_all(text.get())), SplitBehavior::kIsolated);
    });
    for (Piece& piece : pieces) {
      if (piece.ids) continue;
      piece.normalized.map_characters([](char32_t c) {
        const std::string bytes = unicode::to_utf8(c);
        std::u32string mapped;
        for (const char byte : bytes) mapped.push_back(byte_to_char(static_cast<unsigned char>(byte)));
        return mapped;
      });
    }
  }

 private:
  bool add_prefix_space_;
  bool use_regex_;
  IcuRegex words_;
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& step : steps_) step->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

}  // namespace

PrependScheme parse_prepend_scheme(const JsonView& json) {
  PrependScheme scheme = PrependScheme::kAlways;
  if (const auto field = json.find("prepend_scheme")) {
    const std::string name = field->as_string();
    if (name == "first") {
      scheme = PrependScheme::kFirst;
    } else if (name == "never") {
      scheme = PrependScheme::kNever;
    } else if (name == "always") {
      scheme = PrependScheme::kAlways;
    } else {
      field->fail(fmt::format("unknown prepend_scheme '{}' (expected first, never or always)", name));
    }
  }
  // Files from before prepend_scheme existed say add_prefix_space: false for "never".
  if (const auto legacy = json.find("add_prefix_space"); legacy && !legacy->as_bool()) {
    if (scheme != PrependScheme::kNever) legacy->fail("add_prefix_space false contradicts prepend_scheme");
    scheme = PrependScheme::kNever;
  }
  return scheme;
}


std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const JsonView& json) {
  const std::string type = json.type();
  if (type == "WhitespaceSplit") return std::make_unique<WhitespaceSplit>();
  if (type == "Whitespace") return std::make_unique<Whitespace>();
  if (type == "BertPreTokenizer") return std::make_unique<BertPreTokenizer>();
  if (type == "Punctuation") {
    const auto behavior = json.find("behavior");
    return std::make_unique<Punctuation>(behavior ? parse_split_behavior(*behavior) : SplitBehavior::kIsolated);
  }
  if (type == "Digits") return std::make_unique<Digits>(json.bool_at("individual_digits"));
  if (type == "CharDelimiterSplit" || type == "Delimiter") {
    return std::make_unique<CharDelimiterSplit>(json.at("delimiter").as_char());
  }
  if (type == "Split") {
    return std::make_unique<Split>(parse_pattern(json.at("pattern")), parse_split_behavior(json.at("behavior")),
                                   json.bool_at("invert"));
  }
  if (type == "FixedLength") {
    const auto length = json.find("length");
    return std::make_unique<FixedLength>(length ? static_cast<std::size_t>(length->as_int(1, 1 << 20)) : 5);
  }
  if (type == "Metaspace") {
    return std::make_unique<Metaspace>(json.at("replacement").as_char(), parse_prepend_scheme(json),
                                       json.bool_or("split", true));
  }
  if (type == "ByteLevel") {
    json.bool_at("trim_offsets");  // offsets only; still required, as by HF
    return std::make_unique<ByteLevel>(json.bool_at("add_prefix_space"), json.bool_or("use_regex", true));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (const JsonView& step : json.at("pretokenizers").elements()) steps.push_back(parse_pre_tokenizer(step));
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  fail_unsupported_type(json, "pre-tokenizer", type,
                        {"BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Digits", "FixedLength", "Metaspace",
                         "Punctuation", "Sequence", "Split", "Whitespace", "WhitespaceSplit"});
}

}  // namespace vlmopt::tokenizer
