// Hugging Face tokenizer.json in C++: encode and decode with the same ids and text as the
// `tokenizers` library (docs/tokenizer.md lists the supported components).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::tokenizer {

namespace detail {
struct TokenizerImpl;
}

class Tokenizer {
 public:
  // A tokenizer.json file, or an HF model directory holding one. tokenizer_config.json (or
  // special_tokens_map.json) next to it names the BOS/EOS/UNK/PAD tokens; encoding follows
  // tokenizer.json alone (transformers 5 ignores add_bos_token/add_eos_token when it exists).
  // Throws InputError for a missing, malformed or unsupported file.
  static Tokenizer load(const std::filesystem::path& tokenizer_json_or_dir);
  // The text of a tokenizer.json; `source` only names it in error messages.
  static Tokenizer from_json(std::string_view json_text,
                             const std::filesystem::path& source = "tokenizer.json");

  // `text` must be UTF-8 (InputError otherwise).
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Unknown ids are skipped, as by `tokenizers`.
  std::string decode(std::span<const int64_t> ids, bool skip_special_tokens = true) const;

  std::optional<int64_t> token_to_id(std::string_view token) const;
  // Throws InputError for an id that names no token.
  std::string id_to_token(int64_t id) const;
  // Distinct ids of the model vocabulary and the added tokens (HF get_vocab_size(true)).
  int64_t vocab_size() const;
  // Whether `id` is an added token marked special (skipped by decode).
  bool is_special(int64_t id) const;

  std::optional<int64_t> bos_id() const;
  std::optional<int64_t> eos_id() const;
  std::optional<int64_t> unk_id() const;
  std::optional<int64_t> pad_id() const;

  const std::filesystem::path& source() const;

 private:
  explicit Tokenizer(std::shared_ptr<const detail::TokenizerImpl> impl);
  // Immutable once loaded: copies share it, and const calls are thread-safe.
  std::shared_ptr<const detail::TokenizerImpl> impl_;
};

}  // namespace vlmopt::tokenizer
