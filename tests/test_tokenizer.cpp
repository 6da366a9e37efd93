// Unit tests of lib/tokenizer on small tokenizer.json files written here. Expected ids are
// worked out by hand from each file's vocabulary and merges (the derivation is in the
// comments); tests/test_tokenizer_interop.cpp compares against the `tokenizers` library.
#include "tokenizer/prompt.hpp"
#include "tokenizer/tokenizer.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

using nlohmann::json;
using vlmopt::InputError;
using vlmopt::tokenizer::Tokenizer;
using Ids = std::vector<int64_t>;

json added_token(int64_t id, const std::string& content, bool special, bool normalized = false) {
  return {{"id", id},         {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false},  {"normalized", normalized}, {"special", special}};
}

json template_single(const std::vector<std::string>& pieces, const json& special_tokens) {
  json single = json::array();
  for (const std::string& piece : pieces) {
    if (piece == "$A") {
      single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
    } else {
      single.push_back({{"SpecialToken", {{"id", piece}, {"type_id", 0}}}});
    }
  }
  return {{"type", "TemplateProcessing"}, {"single", single}, {"pair", single}, {"special_tokens", special_tokens}};
}

// WordLevel, NFC + Lowercase, Whitespace pre-tokenizer, "<s> $A".
json wordlevel_json() {
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {added_token(0, "[UNK]", true), added_token(5, "<s>", true), added_token(8, "<image>", true)}},
      {"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Lowercase"}}}}}},
      {"pre_tokenizer", {{"type", "Whitespace"}}},
      {"post_processor", template_single({"<s>", "$A"}, {{"<s>", {{"id", "<s>"}, {"ids", {5}}, {"tokens", {"<s>"}}}}})},
      {"decoder", nullptr},
      {"model",
       {{"type", "WordLevel"},
        {"unk_token", "[UNK]"},
        {"vocab", {{"[UNK]", 0}, {"hello", 1}, {"world", 2}, {",", 3}, {"!", 4}, {"<s>", 5}, {"café", 6}, {"?!", 7}}}}},
  };
}

// LLaMA-style BPE: Metaspace pre-tokenizer, byte fallback, decoder Replace/ByteFallback/Fuse/Strip.
//   ids: 0 <unk>, 1 <s>, 2 </s>, 3 <0x21> '!', 4..6 the bytes of '€' (E2 82 AC), 7 ▁,
//        8 l, 9 o, 10 w, 11 e, 12 r, 13 lo, 14 low, 15 ▁low, 16 er, 17 ▁lower
//   merges by rank: l o, lo w, ▁ low, e r, ▁low er
json llama_bpe_json(bool merges_as_pairs) {
  json merges = json::array();
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"l", "o"}, {"lo", "w"}, {"▁", "low"}, {"e", "r"}, {"▁low", "er"}};
  for (const auto& [left, right] : pairs) {
    if (merges_as_pairs) {
      merges.push_back({left, right});
    } else {
      merges.push_back(left + " " + right);
    }
  }
  const json strip_space = {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}};
  const json replace_marker = {{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}};
  return {
      {"version", "1.0"},
      {"added_tokens", {added_token(0, "<unk>", true), added_token(1, "<s>", true), added_token(2, "</s>", true)}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "always"}, {"split", true}}},
      {"post_processor", template_single({"<s>", "$A"}, {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}})},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders", {replace_marker, {{"type", "ByteFallback"}}, {{"type", "Fuse"}}, strip_space}}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", "<unk>"},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab",
         {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}, {"<0x21>", 3}, {"<0xE2>", 4}, {"<0x82>", 5}, {"<0xAC>", 6},
          {"▁", 7}, {"l", 8}, {"o", 9}, {"w", 10}, {"e", 11}, {"r", 12}, {"lo", 13}, {"low", 14},
          {"▁low", 15}, {"er", 16}, {"▁lower", 17}}},
        {"merges", merges}}},
  };
}

Tokenizer parse(const json& document) { return Tokenizer::from_json(document.dump()); }

// The message of the InputError that loading `document` throws ("" if none).
std::string load_error(const json& document) {
  try {
    parse(document);
  } catch (const InputError& error) {
    return error.what();
  }
  return "";
}

// A fresh directory under the system temp dir, removed at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           ("vlmopt_tokenizer_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
  }
};

}  // namespace

TEST_CASE("WordLevel: normalizers, Whitespace pre-tokenizer, template, unknown words") {
  const Tokenizer tok = parse(wordlevel_json());
  // "hello, world!" -> hello , world ! ; "<s>" first from the template.
  CHECK(tok.encode("Hello, World!") == Ids{5, 1, 3, 2, 4});
  CHECK(tok.encode("Hello, World!", false) == Ids{1, 3, 2, 4});
  // "there" is not in the vocabulary.
  CHECK(tok.encode("hello there") == Ids{5, 1, 0});
  // [^\w\s]+ keeps "?!" together; "É" lowercases to "é" and NFC composes e + U+0301.
  CHECK(tok.encode("CAFÉ?! cafe\u0301", false) == Ids{6, 7, 6});
  CHECK(tok.encode("", true) == Ids{5});
  CHECK(tok.encode(" \t\n ", false).empty());
  // An added special token is cut out before normalization, whatever surrounds it.
  CHECK(tok.encode("<image>hello<image>", false) == Ids{8, 1, 8});
  CHECK(tok.encode("<IMAGE>", false) == Ids{0, 0, 0});  // not the token: "<", "image", ">"

  // No decoder: tokens joined with spaces; special tokens skipped unless asked.
  const Ids ids = tok.encode("Hello, World!");
  CHECK(tok.decode(ids) == "hello , world !");
  CHECK(tok.decode(ids, false) == "<s> hello , world !");
  const Ids with_unknown_ids = {1, 99, -3, 2};
  CHECK(tok.decode(with_unknown_ids) == "hello world");

  CHECK(tok.token_to_id("world") == 2);
  CHECK(tok.token_to_id("<image>") == 8);
  CHECK_FALSE(tok.token_to_id("nope").has_value());
  CHECK(tok.id_to_token(6) == "café");
  CHECK(tok.id_to_token(8) == "<image>");
  CHECK_THROWS_AS(tok.id_to_token(42), InputError);
  CHECK(tok.vocab_size() == 9);  // 8 model tokens + <image>
  CHECK(tok.is_special(5));
  CHECK_FALSE(tok.is_special(1));
  CHECK(tok.bos_id() == 5);
  CHECK_FALSE(tok.eos_id().has_value());
  CHECK(tok.unk_id() == 0);
  CHECK_FALSE(tok.pad_id().has_value());
  CHECK_THROWS_AS(tok.encode("bad \xC3\x28 utf8"), InputError);
}

TEST_CASE("added tokens: lstrip, rstrip, single_word, normalized") {
  json doc = wordlevel_json();
  doc["normalizer"] = {{"type", "Lowercase"}};
  doc["pre_tokenizer"] = nullptr;  // every piece between added tokens is one word
  doc["post_processor"] = nullptr;
  doc["model"]["vocab"] = {{"[UNK]", 0}, {"a", 1}, {"a   ", 2}, {" b", 3}, {"b", 4}, {" cab", 5}, {"<s>", 6}};
  json mask = added_token(7, "<mask>", true);
  json mask_stripping = added_token(8, "<MASK>", true);
  mask_stripping["lstrip"] = true;
  mask_stripping["rstrip"] = true;
  json word = added_token(9, "ab", false);
  word["single_word"] = true;
  json yesterday = added_token(10, "Yesterday", false, /*normalized=*/true);
  doc["added_tokens"] = {added_token(0, "[UNK]", true), added_token(6, "<s>", true), mask, mask_stripping, word, yesterday};
  const Tokenizer tok = parse(doc);

  CHECK(tok.encode("a   <mask> b") == Ids{2, 7, 3});
  // lstrip/rstrip take the spaces around into the token.
  CHECK(tok.encode("a   <MASK> b") == Ids{1, 8, 4});
  // single_word: "ab" only where no word character touches it; the match inside "cab" is skipped.
  CHECK(tok.encode("ab cab") == Ids{9, 5});
  // normalized=true: matched in the lowercased text.
  CHECK(tok.encode("YESTERDAY") == Ids{10});
  CHECK(tok.encode("yesterday") == Ids{10});
  // decode gives the normalized form of a normalized added token (as `tokenizers` does).
  CHECK(tok.decode(Ids{10, 9}) == "yesterday ab");
}

TEST_CASE("BPE with byte fallback and Metaspace, merges as strings and as pairs") {
  for (const bool pairs : {false, true}) {
    CAPTURE(pairs);
    const Tokenizer tok = parse(llama_bpe_json(pairs));
    // "lower lower! €" -> "▁lower" "▁lower!" "▁€" (Metaspace splits before each ▁).
    // ▁ l o w e r: l+o (rank 0), lo+w (1), ▁+low (2), e+r (3), ▁low+er (4) -> ▁lower.
    // "!" and "€" are not in the vocabulary: their bytes are.
    CHECK(tok.encode("lower lower! €") == Ids{1, 17, 17, 3, 7, 4, 5, 6});
    CHECK(tok.encode("low") == Ids{1, 15});
    CHECK(tok.encode("lowe", false) == Ids{15, 11});
    // "z" has neither a token nor byte tokens: <unk>, and fuse_unk makes "zz" one <unk>.
    CHECK(tok.encode("zz lo", false) == Ids{7, 0, 7, 13});
    // Decoding undoes the pipeline: ▁ -> space, bytes -> UTF-8, joined, first space stripped.
    CHECK(tok.decode(tok.encode("lower lower! €")) == "lower lower! €");
    CHECK(tok.decode(Ids{1, 15, 5}, false) == "<s> low\xEF\xBF\xBD");  // a lone continuation byte: U+FFFD
    CHECK(tok.bos_id() == 1);
    CHECK(tok.unk_id() == 0);
  }
}

TEST_CASE("BPE LLaMA legacy form: Prepend + Replace normalizer, no pre-tokenizer") {
  json doc = llama_bpe_json(false);
  doc["pre_tokenizer"] = nullptr;
  doc["normalizer"] = {{"type", "Sequence"},
                       {"normalizers",
                        {{{"type", "Prepend"}, {"prepend", "▁"}},
                         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}};
  const Tokenizer tok = parse(doc);
  // One piece "▁lower▁lower": no merge joins "r" and "▁".
  CHECK(tok.encode("lower lower", false) == Ids{17, 17});
  // Each piece between special tokens gets its own "▁": "▁low" <s> "▁low".
  CHECK(tok.encode("low<s>low", false) == Ids{15, 1, 15});
  CHECK(tok.decode(tok.encode("lower lower")) == "lower lower");
}

TEST_CASE("Metaspace prepend_scheme first only marks the start of the input") {
  json doc = llama_bpe_json(true);
  doc["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"}, {"split", false}};
  const Tokenizer tok = parse(doc);
  // "low</s>low": the piece after the special token starts at offset 7, so no "▁" there:
  // "▁low" -> 15, "low" -> l+o, lo+w -> 14.
  CHECK(tok.encode("low</s>low", false) == Ids{15, 2, 14});
  // split=false: "▁lower▁lower" stays one piece, as in the legacy form.
  CHECK(tok.encode("lower lower", false) == Ids{17, 17});
}

// Known issue (see the issue note): on main the EOS from tokenizer_config.json's add_eos_token is still
// appended here although transformers 5 ignores it; kept visible as may_fail until it is fixed.
TEST_CASE("tokenizer_config.json names the specials; tokenizer.json alone decides the encoding" * doctest::may_fail()) {
  TempDir dir;
  dir.write("tokenizer.json", llama_bpe_json(false).dump());
  dir.write("tokenizer_config.json",
            json{{"bos_token", "<s>"},
                 {"eos_token", {{"content", "</s>"}, {"__type", "AddedToken"}}},
                 {"unk_token", "<unk>"},
                 {"pad_token", nullptr},
                 {"add_bos_token", true},
                 {"add_eos_token", true}}
                .dump());
  const Tokenizer tok = Tokenizer::load(dir.path);
  CHECK(tok.eos_id() == 2);  // the template alone names no EOS
  CHECK(tok.bos_id() == 1);
  CHECK(tok.unk_id() == 0);
  CHECK_FALSE(tok.pad_id().has_value());
  // transformers 5 drops add_eos_token when a tokenizer.json exists: "<s> $A" stays.
  CHECK(tok.encode("low") == Ids{1, 15});
  CHECK(Tokenizer::load(dir.path / "tokenizer.json").eos_id() == 2);
  CHECK_FALSE(Tokenizer::from_json(llama_bpe_json(false).dump()).eos_id().has_value());

  // special_tokens_map.json is read too; tokenizer_config.json wins where both name a token.
  dir.write("special_tokens_map.json", json{{"pad_token", "</s>"}, {"bos_token", "</s>"}}.dump());
  const Tokenizer with_map = Tokenizer::load(dir.path);
  CHECK(with_map.pad_id() == 2);
  CHECK(with_map.bos_id() == 1);
}

TEST_CASE("build_llava_input expands each <image> to image_seq_length image tokens") {
  const Tokenizer tok = parse(wordlevel_json());
  const Ids ids = vlmopt::tokenizer::build_llava_input(tok, "hello <image> world", 8, 3);
  CHECK(ids == Ids{5, 1, 8, 8, 8, 2});
  const Ids two = vlmopt::tokenizer::build_llava_input(tok, "<image><image>!", 8, 2);
  CHECK(two == Ids{5, 8, 8, 8, 8, 4});
  CHECK(vlmopt::tokenizer::build_llava_input(tok, "no image", 8, 4) == Ids{5, 0, 0});
  CHECK_THROWS_AS(vlmopt::tokenizer::build_llava_input(tok, "<image>", 8, 0), InputError);
  CHECK_THROWS_AS(vlmopt::tokenizer::build_llava_input(tok, "<image>", 1234, 2), InputError);
  // "hello" is a plain vocabulary word, not an added token: the expansion does not survive.
  CHECK_THROWS_AS(vlmopt::tokenizer::build_llava_input(tok, "hello", 1, 2), InputError);
}

TEST_CASE("truncation and padding of tokenizer.json apply to single sequences") {
  json doc = wordlevel_json();
  doc["truncation"] = {{"direction", "Right"}, {"max_length", 3}, {"strategy", "LongestFirst"}, {"stride", 0}};
  doc["padding"] = {{"strategy", {{"Fixed", 5}}}, {"direction", "Left"}, {"pad_to_multiple_of", nullptr},
                    {"pad_id", 0}, {"pad_type_id", 0}, {"pad_token", "[UNK]"}};
  const Tokenizer tok = parse(doc);
  // 4 words, room for 3 - 1 (the <s> the template adds), then left padding to 5.
  CHECK(tok.encode("hello , world !") == Ids{0, 0, 5, 1, 3});
  CHECK(tok.encode("hello , world !", false) == Ids{0, 0, 1, 3, 2});
  CHECK(tok.pad_id() == 0);
}

TEST_CASE("tokenizers are shared and safe to use from several threads") {
  const Tokenizer tok = parse(llama_bpe_json(true));
  const Ids expected = tok.encode("lower lower! € zz");
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, copy = tok] {
      for (int i = 0; i < 200; ++i) mismatches += copy.encode("lower lower! € zz") != expected;
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(mismatches == 0);
}

TEST_CASE("corrupt or unsupported tokenizer.json files give one clear InputError") {
  CHECK(load_error(json::parse("{}")).find("field 'model': missing") != std::string::npos);
  CHECK_THROWS_WITH_AS(Tokenizer::from_json("{\"model\": ", "x/tokenizer.json"),
                       doctest::Contains("x/tokenizer.json: not valid JSON"), InputError);

  json doc = wordlevel_json();
  doc["model"]["vocab"] = json::array({"hello"});
  CHECK(load_error(doc).find("tokenizer.json: field 'model.vocab': expected an object, got array") !=
        std::string::npos);

  doc = wordlevel_json();
  doc["model"]["vocab"]["again"] = 1;
  CHECK(load_error(doc).find("id 1 is given to both") != std::string::npos);

  doc = wordlevel_json();
  doc["model"]["vocab"]["negative"] = -4;
  CHECK(load_error(doc).find("field 'model.vocab[\"negative\"]': expected an integer in [0, 2147483647], got -4") !=
        std::string::npos);

  doc = wordlevel_json();
  doc["model"]["vocab"]["text"] = "7";
  CHECK(load_error(doc).find("expected an integer") != std::string::npos);

  doc = wordlevel_json();
  doc["model"]["type"] = "Unigram";
  const std::string unsupported_model = load_error(doc);
  CHECK(unsupported_model.find("field 'model.type': unsupported model type 'Unigram' (supported: BPE, WordLevel, "
                               "WordPiece)") != std::string::npos);

  doc = wordlevel_json();
  doc["normalizer"]["normalizers"][1] = {{"type", "Precompiled"}, {"precompiled_charsmap", "AAAA"}};
  const std::string unsupported_normalizer = load_error(doc);
  CHECK(unsupported_normalizer.find("field 'normalizer.normalizers[1].type': unsupported normalizer type "
                                    "'Precompiled'") != std::string::npos);
  CHECK(unsupported_normalizer.find("Lowercase") != std::string::npos);

  doc = wordlevel_json();
  doc["pre_tokenizer"] = {{"type", "UnicodeScripts"}};
  CHECK(load_error(doc).find("unsupported pre-tokenizer type 'UnicodeScripts' (supported: ") != std::string::npos);

  doc = wordlevel_json();
  doc["decoder"] = {{"type", "Strip"}, {"content", "ab"}, {"start", 1}, {"stop", 0}};
  CHECK(load_error(doc).find("field 'decoder.content': expected a single character") != std::string::npos);

  doc = wordlevel_json();
  doc["model"].erase("unk_token");
  CHECK(load_error(doc).find("field 'model.unk_token': missing") != std::string::npos);

  doc = wordlevel_json();
  doc["added_tokens"][2]["id"] = 11;  // <image> is the first token beyond the vocabulary: id 8
  CHECK(load_error(doc).find("added token '<image>' has id 11 but gets id 8") != std::string::npos);

  // With a hole in the vocabulary ids, the id an added token gets may already be taken.
  doc = wordlevel_json();
  doc["model"]["vocab"].erase("café");
  doc["added_tokens"][2]["id"] = 7;
  CHECK(load_error(doc).find("gets id 7, which model token '?!' already has") != std::string::npos);

  doc = wordlevel_json();
  doc["post_processor"]["single"][0]["SpecialToken"]["id"] = "<bos>";
  CHECK(load_error(doc).find("'<bos>' is not defined in post_processor.special_tokens") != std::string::npos);

  doc = wordlevel_json();
  doc["post_processor"]["special_tokens"]["<s>"]["ids"] = {500};
  CHECK(load_error(doc).find("id 500 is not in the vocabulary") != std::string::npos);

  doc = llama_bpe_json(false);
  doc["model"]["merges"][1] = "lo wx";
  CHECK(load_error(doc).find("field 'model.merges[1]': token 'wx' is not in model.vocab") != std::string::npos);

  doc = llama_bpe_json(false);
  doc["model"]["merges"][0] = "l o w";
  CHECK(load_error(doc).find("exactly one space") != std::string::npos);

  doc = llama_bpe_json(true);
  doc["model"]["merges"][3] = {"o", "w"};  // "ow" is not a token
  CHECK(load_error(doc).find("merged token 'ow' is not in model.vocab") != std::string::npos);

  doc = llama_bpe_json(true);
  doc["model"]["dropout"] = 0.1;
  CHECK(load_error(doc).find("dropout") != std::string::npos);

  doc = llama_bpe_json(true);
  doc["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"},
                          {"invert", false}};
  CHECK(load_error(doc).find("field 'pre_tokenizer.pattern.Regex': regex '(unclosed' does not compile") !=
        std::string::npos);

  doc = llama_bpe_json(true);
  doc["pre_tokenizer"]["prepend_scheme"] = "sometimes";
  CHECK(load_error(doc).find("unknown prepend_scheme 'sometimes'") != std::string::npos);

  doc = wordlevel_json();
  doc["version"] = "2.0";
  CHECK(load_error(doc).find("unsupported tokenizer.json version '2.0'") != std::string::npos);

  // A missing file or directory names the path it looked for.
  CHECK_THROWS_WITH_AS(Tokenizer::load("/nonexistent/model"),
                       doctest::Contains("/nonexistent/model: not found"), InputError);
  TempDir dir;
  CHECK_THROWS_WITH_AS(Tokenizer::load(dir.path), doctest::Contains("tokenizer.json: not found"), InputError);
  dir.write("tokenizer.json", "[1, 2");
  CHECK_THROWS_WITH_AS(Tokenizer::load(dir.path), doctest::Contains("not valid JSON"), InputError);
}
