// Normalizers of tokenizer.json (HF tokenizers/src/normalizers).
#include "tokenizer/components.hpp"

#include <fmt/format.h>

namespace vlmopt::tokenizer {

namespace {

class Lowercase final : public Normalizer {
 public:
  void normalize(NormalizedString& text) const override { text.lowercase(); }
};

class UnicodeNormalization final : public Normalizer {
 public:
  explicit UnicodeNormalization(unicode::NormalForm form) : form_(form) {}
  void normalize(NormalizedString& text) const override { text.normalize_unicode(form_); }

 private:
  unicode::NormalForm form_;
};

class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  void normalize(NormalizedString& text) const override { text.strip(left_, right_); }

 private:
  bool left_, right_;
};

class StripAccents final : public Normalizer {
 public:
  void normalize(NormalizedString& text) const override {
    text.map_characters([](char32_t c) { return unicode::is_mark(c) ? std::u32string() : std::u32string(1, c); });
  }
};

class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(NormalizedString& text) const override { text.prepend(prefix_); }

 private:
  std::string prefix_;
};

class Replace final : public Normalizer {
 public:
  Replace(TextPattern pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void normalize(NormalizedString& text) const override { text.replace(pattern_.find_matches(text.get()), content_); }

 private:
  TextPattern pattern_;
  std::string content_;
};

// SentencePiece's NMT normalization: drops control characters, maps odd spaces to ' '.
class Nmt final : public Normalizer {
 public:
  void normalize(NormalizedString& text) const override {
    text.map_characters([](char32_t c) -> std::u32string {
      if ((c >= 0x0001 && c <= 0x0008) || c == 0x000B || (c >= 0x000E && c <= 0x001F) || c == 0x007F ||
          c == 0x008F || c == 0x009F) {
        return {};
      }
      if (c == 0x0009 || c == 0x000A || c == 0x000C || c == 0x000D || c == 0x1680 || (c >= 0x200B && c <= 0x200F) ||
          c == 0x2028 || c == 0x2029 || c == 0x2581 || c == 0xFEFF || c == 0xFFFD) {
        return U" ";
      }
      return std::u32string(1, c);
    });
  }
};

class BertNormalizer final : public Normalizer {
 public:
  BertNormalizer(bool clean_text, bool handle_chinese_chars, bool strip_accents, bool lowercase)
      : clean_text_(clean_text),
        handle_chinese_chars_(handle_chinese_chars),
        strip_accents_(strip_accents),
        lowercase_(lowercase) {}

  void normalize(NormalizedString& text) const override {
    if (clean_text_) {
      text.map_characters([](char32_t c) -> std::u32string {
        const bool bert_whitespace = c == '\t' || c == '\n' || c == '\r' || unicode::is_whitespace(c);
        const bool bert_control = c != '\t' && c != '\n' && c != '\r' && unicode::is_other(c);
        if (c == 0 || c == 0xFFFD || bert_control) return {};
        return bert_whitespace ? std::u32string(U" ") : std::u32string(1, c);
      });
    }
    if (handle_chinese_chars_) {
      text.map_characters([](char32_t c) {
        return unicode::is_chinese_ideograph(c) ? std::u32string{U' ', c, U' '} : std::u32string(1, c);
      });
    }
    if (strip_accents_) {
      text.normalize_unicode(unicode::NormalForm::kNFD);
      text.map_characters(
          [](char32_t c) { return unicode::is_nonspacing_mark(c) ? std::u32string() : std::u32string(1, c); });
    }
    if (lowercase_) text.lowercase();
  }

 private:
  bool clean_text_, handle_chinese_chars_, strip_accents_, lowercase_;
};

// Bytes of the UTF-8 text as GPT-2 byte characters.
class ByteLevelNormalizer final : public Normalizer {
 public:
  void normalize(NormalizedString& text) const override {
    text.map_characters([](char32_t c) {
      const std::string bytes = unicode::to_utf8(c);
      std::u32string mapped;
      for (const char byte : bytes) mapped.push_back(byte_to_char(static_cast<unsigned char>(byte)));
      return mapped;
    });
  }
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void normalize(NormalizedString& text) const override {
    for (const auto& step : steps_) step->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

}  // namespace

std::unique_ptr<Normalizer> parse_normalizer(const JsonView& json) {
  const std::string type = json.type();
  if (type == "Lowercase") return std::make_unique<Lowercase>();
  if (type == "NFC") return std::make_unique<UnicodeNormalization>(unicode::NormalForm::kNFC);
  if (type == "NFD") return std::make_unique<UnicodeNormalization>(unicode::NormalForm::kNFD);
  if (type == "NFKC") return std::make_unique<UnicodeNormalization>(unicode::NormalForm::kNFKC);
  if (type == "NFKD") return std::make_unique<UnicodeNormalization>(unicode::NormalForm::kNFKD);
  if (type == "Strip") return std::make_unique<Strip>(json.bool_at("strip_left"), json.bool_at("strip_right"));
  if (type == "StripAccents") return std::make_unique<StripAccents>();
  if (type == "Prepend") return std::make_unique<Prepend>(json.string_at("prepend"));
  if (type == "Replace") return std::make_unique<Replace>(parse_pattern(json.at("pattern")), json.string_at("content"));
  if (type == "Nmt") return std::make_unique<Nmt>();
  if (type == "ByteLevel") return std::make_unique<ByteLevelNormalizer>();
  if (type == "BertNormalizer") {
    const bool lowercase = json.bool_at("lowercase");
    // strip_accents: null means "same as lowercase".
    return std::make_unique<BertNormalizer>(json.bool_at("clean_text"), json.bool_at("handle_chinese_chars"),
                                            json.bool_or("strip_accents", lowercase), lowercase);
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (const JsonView& step : json.at("normalizers").elements()) steps.push_back(parse_normalizer(step));
    return std::make_unique<SequenceNormalizer>(std::move(steps));
  }
  fail_unsupported_type(json, "normalizer", type,
                        {"BertNormalizer", "ByteLevel", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Nmt", "Prepend",
                         "Replace", "Sequence", "Strip", "StripAccents"});
}

}  // namespace vlmopt::tokenizer
