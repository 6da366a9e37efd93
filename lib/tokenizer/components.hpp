// The stages of a tokenizer.json pipeline (normalizer, pre-tokenizer, model,
// post-processor, decoder) and their parsers. Internal to lib/tokenizer.
#pragma once

#include "tokenizer/json_view.hpp"
#include "tokenizer/normalized_string.hpp"

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::tokenizer {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(NormalizedString& text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  // Appends the ids of one pre-token (never empty).
  virtual void tokenize(std::string_view word, std::vector<int64_t>& ids) const = 0;
  virtual std::optional<int64_t> token_to_id(std::string_view token) const = 0;
  virtual const std::string* id_to_token(int64_t id) const = 0;  // nullptr when unknown
  virtual std::size_t vocab_size() const = 0;
  virtual std::optional<std::string> unk_token() const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Number of ids process() adds to a single sequence when asked to add special tokens.
  virtual std::size_t added_tokens() const = 0;
  virtual void process(std::vector<int64_t>& ids, bool add_special_tokens) const = 0;
  // Ids placed before / after a single sequence (to guess BOS/EOS when no config names them).
  virtual void surrounding_ids(std::vector<int64_t>& before, std::vector<int64_t>& after) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual std::vector<std::string> decode_chain(std::vector<std::string> tokens) const = 0;
};

// Each parser accepts the JSON object of one component (its "type" says which) and throws
// InputError for unknown types, listing the supported ones, and for bad fields.
std::unique_ptr<Normalizer> parse_normalizer(const JsonView& json);
std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const JsonView& json);
std::unique_ptr<Model> parse_model(const JsonView& json);
std::unique_ptr<PostProcessor> parse_post_processor(const JsonView& json);
std::unique_ptr<Decoder> parse_decoder(const JsonView& json);

// Shared parsing helpers.
[[noreturn]] void fail_unsupported_type(const JsonView& json, std::string_view kind, std::string_view type,
                                        std::initializer_list<std::string_view> supported);
TextPattern parse_pattern(const JsonView& json);  // {"String": "..."} or {"Regex": "..."}
SplitBehavior parse_split_behavior(const JsonView& json);

// Metaspace "prepend_scheme" (pre-tokenizer and decoder), with the legacy add_prefix_space.
enum class PrependScheme { kFirst, kNever, kAlways };
PrependScheme parse_prepend_scheme(const JsonView& json);

// The GPT-2 byte <-> printable character table of the ByteLevel components.
char32_t byte_to_char(unsigned char byte);
std::optional<unsigned char> char_to_byte(char32_t c);

}  // namespace vlmopt::tokenizer
