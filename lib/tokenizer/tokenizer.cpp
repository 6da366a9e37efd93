#include "tokenizer/tokenizer.hpp"

#include "tokenizer/components.hpp"
#include "util/error.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <fstream>
#include <limits>
#include <map>
#include <unordered_map>
#include <unordered_set>

namespace vlmopt::tokenizer {

namespace {

constexpr int64_t kMaxId = std::numeric_limits<int32_t>::max();
constexpr std::uintmax_t kMaxFileBytes = std::uintmax_t{1} << 30;  // 1 GiB: far above any real tokenizer.json

struct AddedToken {
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// Byte trie of the added tokens' texts, for leftmost-longest search.
class TokenTrie {
 public:
  // False when `pattern` is already present.
  bool insert(std::string_view pattern, int64_t id) {
    int32_t node = 0;
    for (const char byte : pattern) {
      const auto key = static_cast<unsigned char>(byte);
      int32_t child = find_child(node, key);
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_[static_cast<std::size_t>(node)].children.emplace_back(key, child);
        nodes_.emplace_back();
      }
      node = child;
    }
    Node& end = nodes_[static_cast<std::size_t>(node)];
    if (end.id >= 0) return false;
    end.id = id;
    return true;
  }

  bool empty() const { return nodes_.size() == 1; }

  // The longest pattern starting at text[pos]: {byte length, id}.
  std::optional<std::pair<std::size_t, int64_t>> longest_at(std::string_view text, std::size_t pos) const {
    std::optional<std::pair<std::size_t, int64_t>> best;
    int32_t node = 0;
    for (std::size_t i = pos; i < text.size(); ++i) {
      node = find_child(node, static_cast<unsigned char>(text[i]));
      if (node < 0) break;
      const int64_t id = nodes_[static_cast<std::size_t>(node)].id;
      if (id >= 0) best = std::make_pair(i + 1 - pos, id);
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int64_t id = -1;
  };
  int32_t find_child(int32_t node, unsigned char key) const {
    for (const auto& [child_key, child] : nodes_[static_cast<std::size_t>(node)].children) {
      if (child_key == key) return child;
    }
    return -1;
  }
  std::vector<Node> nodes_{1};
};

// Tokens added on top of the model vocabulary ("added_tokens"): found in the text before
// the model sees it (HF AddedVocabulary).
class AddedVocabulary {
 public:
  // Registers `token` with the id HF assigns it; returns that id.
  int64_t add(AddedToken token, const Model& model, const Normalizer* normalizer, const JsonView& where) {
    int64_t id = 0;
    if (const auto it = ids_.find(token.content); it != ids_.end()) {
      id = it->second;
    } else if (const auto model_id = model.token_to_id(token.content)) {
      id = *model_id;
    } else {
      id = next_id_++;
      // Only possible when the model's ids have holes: HF would give one id two tokens.
      if (const std::string* taken = model.id_to_token(id)) {
        where.fail(fmt::format("added token '{}' gets id {}, which model token '{}' already has", token.content, id,
                               *taken));
      }
    }
    if (token.normalized && normalizer != nullptr) {
      NormalizedString text(token.content);
      normalizer->normalize(text);
      if (text.get() != token.content) normalized_forms_.insert_or_assign(id, text.get());
    }
    ids_.insert_or_assign(token.content, id);
    if (token.special) special_contents_.insert(token.content);
    tokens_.insert_or_assign(id, std::move(token));
    return id;
  }

  void set_first_new_id(int64_t id) { next_id_ = id; }

  // Builds the two search tries once every token is in.
  void finish(const JsonView& where) {
    for (const auto& [id, token] : tokens_) {
      std::string_view pattern = token.content;
      if (token.normalized) {
        if (const auto it = normalized_forms_.find(id); it != normalized_forms_.end()) pattern = it->second;
      }
      if (pattern.empty()) where.fail(fmt::format("added token '{}' normalizes to an empty string", token.content));
      TokenTrie& trie = token.normalized ? normalized_trie_ : raw_trie_;
      if (!trie.insert(pattern, id)) {
        where.fail(fmt::format("two added tokens match the same text '{}' (id {} and another)", pattern, id));
      }
    }
  }

  std::optional<int64_t> find(std::string_view content) const {
    const auto it = ids_.find(std::string(content));
    if (it == ids_.end()) return std::nullopt;
    return it->second;
  }

  // The text decode() uses for `id`: the normalized form for normalized tokens.
  const std::string* token_text(int64_t id) const {
    if (const auto it = normalized_forms_.find(id); it != normalized_forms_.end()) return &it->second;
    if (const auto it = tokens_.find(id); it != tokens_.end()) return &it->second.content;
    return nullptr;
  }

  bool is_special_text(const std::string& text) const { return special_contents_.contains(text); }
  bool is_special_id(int64_t id) const {
    const auto it = tokens_.find(id);
    return it != tokens_.end() && it->second.special;
  }

  std::size_t size() const { return ids_.size(); }
  const std::unordered_map<std::string, int64_t>& contents() const { return ids_; }

  // Splits the input: first the tokens matched on the raw text, then, after normalizing
  // each remaining piece, those matched on normalized text.
  std::vector<Piece> extract_and_normalize(const Normalizer* normalizer, std::string_view text) const {
    std::vector<Piece> pieces;
    pieces.push_back(Piece{NormalizedString(std::string(text)), std::nullopt});
    split_pieces(pieces, [this](NormalizedString&& piece) { return split_on(piece, raw_trie_); });
    split_pieces(pieces, [this, normalizer](NormalizedString&& piece) {
      if (normalizer != nullptr) normalizer->normalize(piece);
      return split_on(piece, normalized_trie_);
    });
    return pieces;
  }

 private:
  std::vector<Piece> split_on(const NormalizedString& piece, const TokenTrie& trie) const {
    std::vector<Piece> parts;
    const std::string& text = piece.get();
    if (text.empty() || trie.empty()) {
      parts.push_back(Piece{piece.slice(0, text.size()), std::nullopt});
      return parts;
    }
    std::size_t unmatched_from = 0;
    std::size_t pos = 0;
    while (pos < text.size()) {
      const auto match = trie.longest_at(text, pos);
      if (!match) {
        ++pos;  // token texts are UTF-8, so they only match at character starts
        continue;
      }
      std::size_t start = pos;
      std::size_t stop = pos + match->first;
      pos = stop;  // the search resumes after the match even when it is discarded below
      const AddedToken& token = tokens_.at(match->second);
      if (token.single_word) {
        const bool space_before = start == 0 || !ends_with_word(std::string_view(text).substr(0, start));
        const bool space_after = stop == text.size() || !starts_with_word(std::string_view(text).substr(stop));
        if (!space_before || !space_after) continue;
      }
      if (token.lstrip) start = std::max(trailing_space_start(std::string_view(text).substr(0, start)), unmatched_from);
      if (token.rstrip) stop += leading_space_length(std::string_view(text).substr(stop));
      if (unmatched_from < start) parts.push_back(Piece{piece.slice(unmatched_from, start), std::nullopt});
      parts.push_back(Piece{piece.slice(start, stop), std::vector<int64_t>{match->second}});
      unmatched_from = stop;
    }
    if (unmatched_from != text.size()) parts.push_back(Piece{piece.slice(unmatched_from, text.size()), std::nullopt});
    return parts;
  }

  static bool ends_with_word(std::string_view text) {
    if (text.empty()) return false;
    std::size_t start = text.size() - 1;
    while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    return unicode::is_word(unicode::next_code_point(text, start));
  }
  static bool starts_with_word(std::string_view text) {
    std::size_t pos = 0;
    return !text.empty() && unicode::is_word(unicode::next_code_point(text, pos));
  }
  static std::size_t leading_space_length(std::string_view text) {
    std::size_t pos = 0;
    while (pos < text.size()) {
      std::size_t next = pos;
      if (!unicode::is_whitespace(unicode::next_code_point(text, next))) break;
      pos = next;
    }
    return pos;
  }
  static std::size_t trailing_space_start(std::string_view text) {
    std::size_t end = text.size();
    while (end > 0) {
      std::size_t start = end - 1;
      while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
      std::size_t probe = start;
      if (!unicode::is_whitespace(unicode::next_code_point(text, probe))) break;
      end = start;
    }
    return end;
  }

  std::unordered_map<std::string, int64_t> ids_;
  std::map<int64_t, AddedToken> tokens_;
  std::unordered_map<int64_t, std::string> normalized_forms_;  // only where normalizing changes the text
  std::unordered_set<std::string> special_contents_;
  TokenTrie raw_trie_, normalized_trie_;
  int64_t next_id_ = 0;
};

enum class Side { kLeft, kRight };

struct Truncation {
  std::size_t max_length = 0;
  Side direction = Side::kRight;
  bool only_second = false;  // "OnlySecond" cannot truncate a single sequence
  bool only_first = false;
};

struct Padding {
  std::optional<std::size_t> fixed_length;  // BatchLongest: a single sequence is its own longest
  std::size_t multiple_of = 0;
  Side direction = Side::kRight;
  int64_t pad_id = 0;
};

Side parse_side(const JsonView& json) {
  const std::string name = json.as_string();
  if (name == "Left") return Side::kLeft;
  if (name == "Right") return Side::kRight;
  json.fail(fmt::format("expected Left or Right, got '{}'", name));
}

Truncation parse_truncation(const JsonView& json) {
  Truncation truncation;
  truncation.max_length = static_cast<std::size_t>(json.at("max_length").as_int(0, kMaxId));
  if (const auto direction = json.find("direction")) truncation.direction = parse_side(*direction);
  const std::string strategy = json.string_at("strategy");
  if (strategy == "OnlySecond") {
    truncation.only_second = true;
  } else if (strategy == "OnlyFirst") {
    truncation.only_first = true;
  } else if (strategy != "LongestFirst") {
    json.at("strategy").fail(fmt::format("expected LongestFirst, OnlyFirst or OnlySecond, got '{}'", strategy));
  }
  json.at("stride").as_int(0, kMaxId);
  return truncation;
}

Padding parse_padding(const JsonView& json) {
  Padding padding;
  const JsonView strategy = json.at("strategy");
  if (strategy.raw().is_object()) {
    padding.fixed_length = static_cast<std::size_t>(strategy.at("Fixed").as_int(0, kMaxId));
  } else if (strategy.as_string() != "BatchLongest") {
    strategy.fail(fmt::format("expected \"BatchLongest\" or {{\"Fixed\": n}}, got '{}'", strategy.as_string()));
  }
  padding.direction = parse_side(json.at("direction"));
  if (const auto multiple = json.find("pad_to_multiple_of")) {
    padding.multiple_of = static_cast<std::size_t>(multiple->as_int(0, kMaxId));
  }
  padding.pad_id = json.at("pad_id").as_int(0, kMaxId);
  return padding;
}

AddedToken parse_added_token(const JsonView& json) {
  AddedToken token;
  token.content = json.string_at("content");
  token.single_word = json.bool_or("single_word", false);
  token.lstrip = json.bool_or("lstrip", false);
  token.rstrip = json.bool_or("rstrip", false);
  token.normalized = json.bool_or("normalized", true);
  token.special = json.bool_or("special", false);
  return token;
}

std::string read_text_file(const std::filesystem::path& path) {
  std::error_code error;
  const auto size = std::filesystem::file_size(path, error);
  if (error) throw_file_error(path, "cannot read ({})", error.message());
  if (size > kMaxFileBytes) throw_file_error(path, "too large for a tokenizer file ({} bytes, expected at most {})", size, kMaxFileBytes);
  std::ifstream stream(path, std::ios::binary);
  if (!stream) throw_file_error(path, "cannot open");
  std::string text(static_cast<std::size_t>(size), '\0');
  stream.read(text.data(), static_cast<std::streamsize>(size));
  if (!stream) throw_file_error(path, "read failed");
  return text;
}

nlohmann::json parse_json_text(std::string_view text, const std::filesystem::path& source) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& error) {
    throw_file_error(source, "not valid JSON ({})", error.what());
  }
}

// Token names of tokenizer_config.json / special_tokens_map.json: "<s>" or {"content": "<s>", ...}.
std::optional<std::string> special_token_name(const JsonView& config, std::string_view key) {
  const auto field = config.find(key);
  if (!field) return std::nullopt;
  if (field->raw().is_object()) return field->string_at("content");
  return field->as_string();
}

}  // namespace

namespace detail {

struct TokenizerImpl {
  std::filesystem::path source;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Model> model;
  std::unique_ptr<PostProcessor> post_processor;
  std::unique_ptr<Decoder> decoder;
  AddedVocabulary added;
  std::optional<Truncation> truncation;
  std::optional<Padding> padding;
  std::optional<int64_t> bos, eos, unk, pad;

  std::optional<int64_t> token_to_id(std::string_view token) const {
    if (const auto id = added.find(token)) return id;
    return model->token_to_id(token);
  }
  const std::string* id_to_token(int64_t id) const {
    if (const std::string* text = added.token_text(id)) return text;
    return model->id_to_token(id);
  }
};

}  // namespace detail

namespace {

using detail::TokenizerImpl;

std::unique_ptr<TokenizerImpl> parse_tokenizer_json(const nlohmann::json& document, const std::filesystem::path& source);

// The tokenizer of a parsed tokenizer.json, specials guessed without config files: UNK
// from the model, BOS/EOS from what the post-processor adds, PAD from "padding".
std::unique_ptr<TokenizerImpl> build(const nlohmann::json& document, const std::filesystem::path& source) {
  auto impl = parse_tokenizer_json(document, source);
  if (const auto unk = impl->model->unk_token()) impl->unk = impl->token_to_id(*unk);
  if (impl->post_processor) {
    std::vector<int64_t> before, after;
    impl->post_processor->surrounding_ids(before, after);
    if (before.size() == 1) impl->bos = before.front();
    if (after.size() == 1) impl->eos = after.front();
  }
  if (impl->padding) impl->pad = impl->padding->pad_id;
  return impl;
}

}  // namespace

Tokenizer::Tokenizer(std::shared_ptr<const TokenizerImpl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::filesystem::path& source) {
  return Tokenizer(build(parse_json_text(json_text, source), source));
}

Tokenizer Tokenizer::load(const std::filesystem::path& tokenizer_json_or_dir) {
  std::error_code error;
  const bool is_dir = std::filesystem::is_directory(tokenizer_json_or_dir, error);
  const std::filesystem::path file = is_dir ? tokenizer_json_or_dir / "tokenizer.json" : tokenizer_json_or_dir;
  if (!std::filesystem::exists(file, error)) {
    throw_file_error(file, "not found{}", is_dir ? " (expected a tokenizer.json in the model directory)" : "");
  }
  std::unique_ptr<TokenizerImpl> impl = build(parse_json_text(read_text_file(file), file), file);

  // transformers reads the special token names from tokenizer_config.json, older
  // checkpoints from special_tokens_map.json.
  const std::filesystem::path dir = file.parent_path();
  for (const char* config_name : {"special_tokens_map.json", "tokenizer_config.json"}) {
    const std::filesystem::path config_path = dir / config_name;
    if (!std::filesystem::exists(config_path, error)) continue;
    const nlohmann::json config_document = parse_json_text(read_text_file(config_path), config_path);
    const JsonView config(config_document, config_path);
    config.expect_object();
    const std::pair<const char*, std::optional<int64_t>*> slots[] = {
        {"bos_token", &impl->bos}, {"eos_token", &impl->eos}, {"unk_token", &impl->unk}, {"pad_token", &impl->pad}};
    for (const auto& [key, id] : slots) {
      const auto name = special_token_name(config, key);
      if (!name) continue;
      *id = impl->token_to_id(*name);
      if (!*id) {
        spdlog::warn("{}: {} '{}' is not in the vocabulary of {}; ignoring it", config_path.string(), key, *name,
                     file.string());
      }
    }
    // add_bos_token / add_eos_token are not applied: with a tokenizer.json present,
    // transformers 5 drops them and keeps the file's post-processor.
  }
  return Tokenizer(std::move(impl));
}

namespace {

std::unique_ptr<TokenizerImpl> parse_tokenizer_json(const nlohmann::json& document,
                                                   const std::filesystem::path& source) {
  const JsonView root(document, source);
  root.expect_object();
  if (const auto version = root.find("version"); version && version->as_string() != "1.0") {
    version->fail(fmt::format("unsupported tokenizer.json version '{}' (expected 1.0)", version->as_string()));
  }
  auto impl = std::make_unique<TokenizerImpl>();
  impl->source = source;
  impl->model = parse_model(root.at("model"));
  if (const auto json = root.find("normalizer")) impl->normalizer = parse_normalizer(*json);
  if (const auto json = root.find("pre_tokenizer")) impl->pre_tokenizer = parse_pre_tokenizer(*json);
  if (const auto json = root.find("post_processor")) impl->post_processor = parse_post_processor(*json);
  if (const auto json = root.find("decoder")) impl->decoder = parse_decoder(*json);
  if (const auto json = root.find("truncation")) impl->truncation = parse_truncation(*json);
  if (const auto json = root.find("padding")) impl->padding = parse_padding(*json);

  // Ids of added tokens are not read but assigned (HF AddedVocabulary::add_tokens): the
  // model's id when the model knows the text, else the next free id after the model's.
  // A file whose ids disagree would encode differently from what it claims: rejected.
  impl->added.set_first_new_id(static_cast<int64_t>(impl->model->vocab_size()));
  if (const auto added_tokens = root.find("added_tokens")) {
    for (const JsonView& entry : added_tokens->elements()) {
      AddedToken token = parse_added_token(entry);
      if (token.content.empty()) continue;  // HF ignores these
      const int64_t file_id = entry.at("id").as_int(0, kMaxId);
      const int64_t id = impl->added.add(std::move(token), *impl->model, impl->normalizer.get(), entry);
      if (id != file_id) {
        entry.at("id").fail(fmt::format("added token '{}' has id {} but gets id {} (expected the model's id for a "
                                        "known token, else ids counting up from the model's vocabulary size)",
                                        entry.string_at("content"), file_id, id));
      }
    }
    impl->added.finish(*added_tokens);
  }

  // Ids the post-processor or padding inserts must name tokens.
  auto check_id = [&](int64_t id, const JsonView& where) {
    if (impl->id_to_token(id) == nullptr) where.fail(fmt::format("id {} is not in the vocabulary", id));
  };
  if (impl->post_processor) {
    std::vector<int64_t> before, after;
    impl->post_processor->surrounding_ids(before, after);
    for (const int64_t id : before) check_id(id, root.at("post_processor"));
    for (const int64_t id : after) check_id(id, root.at("post_processor"));
  }
  if (impl->padding) check_id(impl->padding->pad_id, root.at("padding").at("pad_id"));
  return impl;
}

}  // namespace

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const TokenizerImpl& impl = *impl_;
  if (const auto bad = unicode::find_invalid_utf8(text)) {
    throw InputError(fmt::format("text to tokenize is not valid UTF-8 (at byte {})", *bad));
  }
  std::vector<Piece> pieces = impl.added.extract_and_normalize(impl.normalizer.get(), text);
  if (impl.pre_tokenizer) impl.pre_tokenizer->pre_tokenize(pieces);
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (const Piece& piece : pieces) {
    if (piece.ids) {
      ids.insert(ids.end(), piece.ids->begin(), piece.ids->end());
    } else {
      impl.model->tokenize(piece.normalized.get(), ids);
    }
  }

  if (impl.truncation) {
    const Truncation& truncation = *impl.truncation;
    const std::size_t added = impl.post_processor && add_special_tokens ? impl.post_processor->added_tokens() : 0;
    if (truncation.max_length < added) {
      throw InputError(fmt::format("{}: truncation.max_length {} is smaller than the {} special tokens added",
                                   impl.source.string(), truncation.max_length, added));
    }
    const std::size_t limit = truncation.max_length - added;
    if (ids.size() > limit) {
      if (truncation.only_second) {
        throw InputError(fmt::format("{}: truncation strategy OnlySecond needs a second sequence", impl.source.string()));
      }
      if (truncation.only_first && limit == 0 && truncation.max_length != 0) {
        throw InputError(fmt::format("{}: the sequence is too short to truncate to max_length {}", impl.source.string(),
                                     truncation.max_length));
      }
      if (truncation.direction == Side::kRight) {
        ids.resize(limit);
      } else {
        ids.erase(ids.begin(), ids.end() - static_cast<std::ptrdiff_t>(limit));
      }
    }
  }
  if (impl.post_processor) impl.post_processor->process(ids, add_special_tokens);
  if (impl.padding) {
    const Padding& padding = *impl.padding;
    std::size_t length = padding.fixed_length.value_or(ids.size());
    if (padding.multiple_of > 0 && length % padding.multiple_of != 0) length += padding.multiple_of - length % padding.multiple_of;
    if (ids.size() < length) {
      const auto missing = static_cast<std::ptrdiff_t>(length - ids.size());
      ids.insert(padding.direction == Side::kRight ? ids.end() : ids.begin(), static_cast<std::size_t>(missing),
                 padding.pad_id);
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int64_t> ids, bool skip_special_tokens) const {
  const TokenizerImpl& impl = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int64_t id : ids) {
    const std::string* token = impl.id_to_token(id);
    if (token == nullptr) continue;
    if (skip_special_tokens && impl.added.is_special_text(*token)) continue;
    tokens.push_back(*token);
  }
  std::string text;
  if (impl.decoder) {
    for (const std::string& part : impl.decoder->decode_chain(std::move(tokens))) text += part;
    return text;
  }
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0) text.push_back(' ');
    text += tokens[i];
  }
  return text;
}

std::optional<int64_t> Tokenizer::token_to_id(std::string_view token) const { return impl_->token_to_id(token); }

std::string Tokenizer::id_to_token(int64_t id) const {
  const std::string* token = impl_->id_to_token(id);
  if (token == nullptr) {
    throw InputError(fmt::format("{}: token id {} is not in the vocabulary (size {})", impl_->source.string(), id,
                                 vocab_size()));
  }
  return *token;
}

int64_t Tokenizer::vocab_size() const {
  const TokenizerImpl& impl = *impl_;
  std::size_t overlapping = 0;
  for (const auto& [content, id] : impl.added.contents()) overlapping += impl.model->token_to_id(content).has_value();
  return static_cast<int64_t>(impl.model->vocab_size() + impl.added.size() - overlapping);
}

bool Tokenizer::is_special(int64_t id) const { return impl_->added.is_special_id(id); }

std::optional<int64_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int64_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<int64_t> Tokenizer::unk_id() const { return impl_->unk; }
std::optional<int64_t> Tokenizer::pad_id() const { return impl_->pad; }
const std::filesystem::path& Tokenizer::source() const { return impl_->source; }

}  // namespace vlmopt::tokenizer
