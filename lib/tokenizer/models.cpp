// Models of tokenizer.json: WordLevel, BPE (HF tokenizers/src/models/bpe), WordPiece.
#include "tokenizer/components.hpp"

#include "util/error.hpp"

#include <fmt/format.h>

#include <limits>
#include <queue>
#include <unordered_map>

namespace vlmopt::tokenizer {

namespace {

constexpr int64_t kMaxId = std::numeric_limits<int32_t>::max();

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view text) const noexcept { return std::hash<std::string_view>{}(text); }
};

// Token <-> id, with unique ids.
class Vocabulary {
 public:
  static Vocabulary parse(const JsonView& json) {
    json.expect_object();
    Vocabulary vocabulary;
    vocabulary.ids_.reserve(json.raw().size());
    vocabulary.tokens_.reserve(json.raw().size());
    for (const auto& [token, value] : json.raw().items()) {
      const JsonView entry(value, json.file(), fmt::format("{}[\"{}\"]", json.path(), token));
      const int64_t id = entry.as_int(0, kMaxId);
      const auto [it, inserted] = vocabulary.tokens_.emplace(id, token);
      if (!inserted) json.fail(fmt::format("id {} is given to both '{}' and '{}'", id, it->second, token));
      vocabulary.ids_.emplace(token, id);
    }
    return vocabulary;
  }

  std::optional<int64_t> find(std::string_view token) const {
    const auto it = ids_.find(token);
    if (it == ids_.end()) return std::nullopt;
    return it->second;
  }
  const std::string* token(int64_t id) const {
    const auto it = tokens_.find(id);
    return it == tokens_.end() ? nullptr : &it->second;
  }
  std::size_t size() const { return ids_.size(); }

 private:
  std::unordered_map<std::string, int64_t, StringHash, std::equal_to<>> ids_;
  std::unordered_map<int64_t, std::string> tokens_;
};

[[noreturn]] void fail_missing_unk(const std::string& source, const std::optional<std::string>& unk_token,
                                   std::string_view word) {
  if (!unk_token) {
    throw InputError(fmt::format("{}: the model has no unk_token and cannot encode \"{}\"", source, word));
  }
  throw InputError(fmt::format("{}: field 'model.unk_token': '{}' is not in model.vocab, needed to encode \"{}\"",
                               source, *unk_token, word));
}

class WordLevel final : public Model {
 public:
  WordLevel(Vocabulary vocabulary, std::string unk_token, std::string source)
      : vocabulary_(std::move(vocabulary)), unk_token_(std::move(unk_token)), source_(std::move(source)) {}

  void tokenize(std::string_view word, std::vector<int64_t>& ids) const override {
    if (const auto id = vocabulary_.find(word)) {
      ids.push_back(*id);
    } else if (const auto unk = vocabulary_.find(unk_token_)) {
      ids.push_back(*unk);
    } else {
      fail_missing_unk(source_, unk_token_, word);
    }
  }
  std::optional<int64_t> token_to_id(std::string_view token) const override { return vocabulary_.find(token); }
  const std::string* id_to_token(int64_t id) const override { return vocabulary_.token(id); }
  std::size_t vocab_size() const override { return vocabulary_.size(); }
  std::optional<std::string> unk_token() const override { return unk_token_; }

 private:
  Vocabulary vocabulary_;
  std::string unk_token_;
  std::string source_;
};

class WordPiece final : public Model {
 public:
  WordPiece(Vocabulary vocabulary, std::string unk_token, std::string prefix, std::size_t max_chars,
            std::string source)
      : vocabulary_(std::move(vocabulary)),
        unk_token_(std::move(unk_token)),
        prefix_(std::move(prefix)),
        max_chars_(max_chars),
        source_(std::move(source)) {}

  void tokenize(std::string_view word, std::vector<int64_t>& ids) const override {
    std::vector<int64_t> pieces;
    bool ok = unicode::count_code_points(word) <= max_chars_;
    // Greedy longest match first, continuations carrying the prefix.
    for (std::size_t start = 0; ok && start < word.size();) {
      std::size_t end = word.size();
      std::optional<int64_t> found;
      while (start < end) {
        const std::string candidate =
            start > 0 ? prefix_ + std::string(word.substr(start, end - start)) : std::string(word.substr(start, end - start));
        if ((found = vocabulary_.find(candidate))) break;
        do {
          --end;
        } while (end > start && (static_cast<unsigned char>(word[end]) & 0xC0) == 0x80);
      }
      if (!found) {
        ok = false;
        break;
      }
      pieces.push_back(*found);
      start = end;
    }
    if (ok) {
      ids.insert(ids.end(), pieces.begin(), pieces.end());
      return;
    }
    const auto unk = vocabulary_.find(unk_token_);
    if (!unk) fail_missing_unk(source_, unk_token_, word);
    ids.push_back(*unk);
  }
  std::optional<int64_t> token_to_id(std::string_view token) const override { return vocabulary_.find(token); }
  const std::string* id_to_token(int64_t id) const override { return vocabulary_.token(id); }
  std::size_t vocab_size() const override { return vocabulary_.size(); }
  std::optional<std::string> unk_token() const override { return unk_token_; }

 private:
  Vocabulary vocabulary_;
  std::string unk_token_;
  std::string prefix_;
  std::size_t max_chars_;
  std::string source_;
};

struct BpeOptions {
  std::optional<std::string> unk_token;
  std::optional<std::string> continuing_subword_prefix;
  std::optional<std::string> end_of_word_suffix;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

class Bpe final : public Model {
 public:
  struct Merge {
    int64_t rank;
    int64_t new_id;
  };

  Bpe(Vocabulary vocabulary, std::unordered_map<uint64_t, Merge> merges, BpeOptions options, std::string source)
      : vocabulary_(std::move(vocabulary)),
        merges_(std::move(merges)),
        options_(std::move(options)),
        source_(std::move(source)) {}

  static uint64_t pair_key(int64_t left, int64_t right) {
    return (static_cast<uint64_t>(left) << 32) | static_cast<uint64_t>(right);
  }

  void tokenize(std::string_view word, std::vector<int64_t>& ids) const override {
    if (options_.ignore_merges) {
      if (const auto id = vocabulary_.find(word)) {
        ids.push_back(*id);
        return;
      }
    }
    std::vector<Symbol> symbols = initial_symbols(word);
    merge_all(symbols);
    for (const Symbol& symbol : symbols) {
      if (symbol.length != 0) ids.push_back(symbol.id);
    }
  }

  std::optional<int64_t> token_to_id(std::string_view token) const override { return vocabulary_.find(token); }
  const std::string* id_to_token(int64_t id) const override { return vocabulary_.token(id); }
  std::size_t vocab_size() const override { return vocabulary_.size(); }
  std::optional<std::string> unk_token() const override { return options_.unk_token; }

 private:
  // A symbol of the word being merged; merged-away symbols keep length 0.
  struct Symbol {
    int64_t id;
    int64_t prev;
    int64_t next;
    std::size_t length;  // bytes of the word it covers
  };

  static void add_symbol(std::vector<Symbol>& symbols, int64_t id, std::size_t length) {
    const auto count = static_cast<int64_t>(symbols.size());
    if (!symbols.empty()) symbols.back().next = count;
    symbols.push_back({id, count - 1, -1, length});
  }

  int64_t unk_id(std::string_view word) const {
    const auto id = vocabulary_.find(*options_.unk_token);
    if (!id) fail_missing_unk(source_, options_.unk_token, word);
    return *id;
  }

  // One symbol per character (with the subword prefix / word suffix), unknown characters
  // as byte tokens <0xXX> or the unk token, as HF BPE::merge_word does.
  std::vector<Symbol> initial_symbols(std::string_view word) const {
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    // An unknown run waiting to be added (fuse_unk grows it): its id and bytes covered.
    bool has_pending_unk = false;
    int64_t pending_unk_id = 0;
    std::size_t pending_unk_length = 0;
    std::size_t pos = 0;
    while (pos < word.size()) {
      const std::size_t start = pos;
      unicode::next_code_point(word, pos);
      const std::size_t byte_length = pos - start;
      std::string symbol(word.substr(start, byte_length));
      if (start > 0 && options_.continuing_subword_prefix) symbol = *options_.continuing_subword_prefix + symbol;
      if (pos == word.size() && options_.end_of_word_suffix) symbol += *options_.end_of_word_suffix;

      if (const auto id = vocabulary_.find(symbol)) {
        if (has_pending_unk) {
          add_symbol(symbols, pending_unk_id, pending_unk_length);
          has_pending_unk = false;
        }
        add_symbol(symbols, *id, byte_length);
        continue;
      }
      if (options_.byte_fallback) {
        std::vector<int64_t> byte_ids;
        for (const char byte : symbol) {
          const auto id = vocabulary_.find(fmt::format("<0x{:02X}>", static_cast<unsigned char>(byte)));
          if (!id) break;
          byte_ids.push_back(*id);
        }
        if (byte_ids.size() == symbol.size()) {
          for (const int64_t id : byte_ids) add_symbol(symbols, id, 1);
          continue;
        }
      }
      if (options_.unk_token) {
        if (has_pending_unk && options_.fuse_unk) {
          pending_unk_length += byte_length;
        } else {
          if (has_pending_unk) add_symbol(symbols, pending_unk_id, pending_unk_length);
          has_pending_unk = true;
          pending_unk_id = unk_id(word);
          pending_unk_length = byte_length;
        }
      }
    }
    if (has_pending_unk) add_symbol(symbols, pending_unk_id, pending_unk_length);
    return symbols;
  }

  const Merge* find_merge(int64_t left, int64_t right) const {
    const auto it = merges_.find(pair_key(left, right));
    return it == merges_.end() ? nullptr : &it->second;
  }

  // Applies merges lowest rank first (ties: leftmost), as HF Word::merge_all.
  void merge_all(std::vector<Symbol>& symbols) const {
    struct Candidate {
      std::size_t pos;
      int64_t rank;
      int64_t new_id;
    };
    auto later = [](const Candidate& a, const Candidate& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
    for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
      if (const Merge* merge = find_merge(symbols[i].id, symbols[i + 1].id)) {
        queue.push({i, merge->rank, merge->new_id});
      }
    }
    const auto count = static_cast<int64_t>(symbols.size());
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& current = symbols[top.pos];
      if (current.length == 0 || current.next == -1) continue;
      const auto next_pos = static_cast<std::size_t>(current.next);
      const Symbol right = symbols[next_pos];
      // Skip entries made stale by an earlier merge.
      const Merge* merge = find_merge(current.id, right.id);
      if (merge == nullptr || merge->new_id != top.new_id) continue;

      current.id = top.new_id;
      current.length += right.length;
      current.next = right.next;
      symbols[next_pos].length = 0;
      if (right.next > -1 && right.next < count) symbols[static_cast<std::size_t>(right.next)].prev = static_cast<int64_t>(top.pos);

      if (current.prev >= 0) {
        const auto prev = static_cast<std::size_t>(current.prev);
        if (const Merge* left_merge = find_merge(symbols[prev].id, current.id)) {
          queue.push({prev, left_merge->rank, left_merge->new_id});
        }
      }
      if (current.next >= 0 && current.next < count) {
        if (const Merge* right_merge = find_merge(current.id, symbols[static_cast<std::size_t>(current.next)].id)) {
          queue.push({top.pos, right_merge->rank, right_merge->new_id});
        }
      }
    }
  }

  Vocabulary vocabulary_;
  std::unordered_map<uint64_t, Merge> merges_;
  BpeOptions options_;
  std::string source_;
};

std::optional<std::string> optional_string(const JsonView& json, std::string_view key) {
  const auto field = json.find(key);
  if (!field) return std::nullopt;
  return field->as_string();
}

std::unique_ptr<Model> parse_bpe(const JsonView& json) {
  BpeOptions options;
  if (const auto dropout = json.find("dropout")) {
    if (!dropout->raw().is_number()) dropout->fail(fmt::format("expected a number, got {}", dropout->raw().type_name()));
    if (dropout->raw().get<double>() != 0.0) dropout->fail("BPE dropout is random and not supported (expected null or 0)");
  }
  options.unk_token = optional_string(json, "unk_token");
  options.continuing_subword_prefix = optional_string(json, "continuing_subword_prefix");
  options.end_of_word_suffix = optional_string(json, "end_of_word_suffix");
  options.fuse_unk = json.bool_or("fuse_unk", false);
  options.byte_fallback = json.bool_or("byte_fallback", false);
  options.ignore_merges = json.bool_or("ignore_merges", false);
  Vocabulary vocabulary = Vocabulary::parse(json.at("vocab"));

  const JsonView merges_json = json.at("merges");
  std::unordered_map<uint64_t, Bpe::Merge> merges;
  merges.reserve(merges_json.raw().size());
  const std::string prefix = options.continuing_subword_prefix.value_or("");
  int64_t rank = 0;
  for (const JsonView& entry : merges_json.elements()) {
    std::string left, right;
    if (entry.raw().is_string()) {  // "a b"
      const std::string line = entry.as_string();
      if (line.starts_with("#version")) continue;
      const std::size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        entry.fail(fmt::format("expected \"<left> <right>\" with exactly one space, got \"{}\"", line));
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (entry.raw().is_array() && entry.raw().size() == 2) {  // ["a", "b"]
      const auto parts = entry.elements();
      left = parts[0].as_string();
      right = parts[1].as_string();
    } else {
      entry.fail(fmt::format("expected \"a b\" or [\"a\", \"b\"], got {}", entry.raw().dump()));
    }
    const auto left_id = vocabulary.find(left);
    const auto right_id = vocabulary.find(right);
    if (!left_id || !right_id) {
      entry.fail(fmt::format("token '{}' is not in model.vocab", left_id ? right : left));
    }
    if (!right.starts_with(prefix)) {
      entry.fail(fmt::format("'{}' does not start with continuing_subword_prefix '{}'", right, prefix));
    }
    const std::string merged = left + right.substr(prefix.size());
    const auto merged_id = vocabulary.find(merged);
    if (!merged_id) entry.fail(fmt::format("merged token '{}' is not in model.vocab", merged));
    // A repeated pair keeps its last rank, as when HF collects the merges into a map.
    merges.insert_or_assign(Bpe::pair_key(*left_id, *right_id), Bpe::Merge{rank, *merged_id});
    ++rank;
  }
  return std::make_unique<Bpe>(std::move(vocabulary), std::move(merges), std::move(options), json.file().string());
}

}  // namespace

std::unique_ptr<Model> parse_model(const JsonView& json) {
  const std::string type = json.type();
  if (type == "WordLevel") {
    return std::make_unique<WordLevel>(Vocabulary::parse(json.at("vocab")), json.string_at("unk_token"),
                                       json.file().string());
  }
  if (type == "BPE") return parse_bpe(json);
  if (type == "WordPiece") {
    return std::make_unique<WordPiece>(Vocabulary::parse(json.at("vocab")), json.string_at("unk_token"),
                                       json.string_at("continuing_subword_prefix"),
                                       static_cast<std::size_t>(json.at("max_input_chars_per_word").as_int(0, kMaxId)),
                                       json.file().string());
  }
  fail_unsupported_type(json, "model", type, {"BPE", "WordLevel", "WordPiece"});
}

}  // namespace vlmopt::tokenizer
