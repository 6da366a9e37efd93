// lib/tokenizer against the HF `tokenizers` library and transformers' LlavaProcessor:
// tests/interop/tokenizer_reference.py builds tokenizers in Python, encodes and decodes
// a few hundred strings with each and saves the files and the results; the same files
// loaded here must give the same ids and the same text.
// Needs python3 with tokenizers + transformers (VLMOPT_PYTHON picks the interpreter).
#include "tokenizer/prompt.hpp"
#include "tokenizer/tokenizer.hpp"
#include "test_support.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

using nlohmann::json;
using vlmopt::tokenizer::Tokenizer;
using Ids = std::vector<int64_t>;

std::string read_file(const std::filesystem::path& path) {
  std::ifstream stream(path, std::ios::binary);
  std::ostringstream text;
  text << stream.rdbuf();
  return text.str();
}

// Removes the reference directory when the test process ends.
struct RemoveAtExit {
  std::filesystem::path path;
  ~RemoveAtExit() {
    std::error_code ignored;
    if (!path.empty()) std::filesystem::remove_all(path, ignored);
  }
};

// Runs the Python reference once per process; returns its output directory.
const std::filesystem::path& reference_dir() {
  static RemoveAtExit cleanup;
  static const std::filesystem::path dir = [] {
    const std::filesystem::path out =
        std::filesystem::temp_directory_path() / ("vlmopt_tokenizer_interop_" + std::to_string(::getpid()));
    std::filesystem::remove_all(out);
    std::filesystem::create_directories(out);
    cleanup.path = out;
    const char* python = std::getenv("VLMOPT_PYTHON");
    const std::string command = fmt::format(
        "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 '{}' '{}/tests/interop/tokenizer_reference.py' --out '{}' > '{}' 2>&1",
        python != nullptr ? python : "python3", vlmopt::testing::source_dir().string(), out.string(),
        (out / "log.txt").string());
    const int status = std::system(command.c_str());
    INFO("python log:\n", read_file(out / "log.txt"));
    REQUIRE_MESSAGE(status == 0, "the Python reference failed: ", command);
    return out;
  }();
  return dir;
}

// Printable form of a string for failure messages.
std::string quoted(const std::string& text) { return json(text).dump(); }

struct Failures {
  std::vector<std::string> lines;
  std::size_t count = 0;
  void add(std::string line) {
    if (lines.size() < 12) lines.push_back(std::move(line));
    ++count;
  }
  std::string report() const { return fmt::format("{} mismatches, first:\n{}", count, fmt::join(lines, "\n")); }
};

}  // namespace

TEST_CASE("encode and decode match the tokenizers library") {
  const std::filesystem::path dir = reference_dir();
  const json reference = json::parse(read_file(dir / "cases.json"));
  MESSAGE("reference: tokenizers ", reference["tokenizers_version"].get<std::string>(), ", transformers ",
          reference["transformers_version"].get<std::string>());
  REQUIRE(reference["tokenizers"].size() >= 8);

  for (const json& entry : reference["tokenizers"]) {
    const std::string file = entry["file"];
    CAPTURE(file);
    const Tokenizer tok = Tokenizer::load(dir / file);
    CHECK(tok.vocab_size() == entry["vocab_size"].get<int64_t>());
    for (const auto& pair : entry["vocab_sample"]) {
      CHECK(tok.token_to_id(pair[0].get<std::string>()) == pair[1].get<int64_t>());
      CHECK(tok.id_to_token(pair[1].get<int64_t>()) == pair[0].get<std::string>());
    }

    const json& cases = entry["cases"];
    CHECK(cases.size() >= 200);
    Failures failures;
    for (const json& c : cases) {
      const std::string text = c["text"];
      const Ids expected = c["ids"].get<Ids>();
      const Ids ids = tok.encode(text, true);
      if (ids != expected) {
        failures.add(fmt::format("encode {}: got [{}], expected [{}]", quoted(text), fmt::join(ids, ","),
                                 fmt::join(expected, ",")));
      }
      const Ids plain = tok.encode(text, false);
      if (plain != c["ids_no_special"].get<Ids>()) failures.add(fmt::format("encode without specials {}", quoted(text)));
      const std::string decoded = tok.decode(expected, true);
      if (decoded != c["decoded"].get<std::string>()) {
        failures.add(fmt::format("decode of {}: got {}, expected {}", quoted(text), quoted(decoded),
                                 quoted(c["decoded"].get<std::string>())));
      }
      if (tok.decode(expected, false) != c["decoded_with_special"].get<std::string>()) {
        failures.add(fmt::format("decode with specials of {}", quoted(text)));
      }
    }
    for (const json& d : entry["decodes"]) {
      const Ids ids = d["ids"].get<Ids>();
      const std::string decoded = tok.decode(ids, true);
      if (decoded != d["decoded"].get<std::string>()) {
        failures.add(fmt::format("decode [{}]: got {}, expected {}", fmt::join(ids, ","), quoted(decoded),
                                 quoted(d["decoded"].get<std::string>())));
      }
      if (tok.decode(ids, false) != d["decoded_with_special"].get<std::string>()) {
        failures.add(fmt::format("decode with specials [{}]", fmt::join(ids, ",")));
      }
    }
    CHECK_MESSAGE(failures.count == 0, failures.report());
  }
}

TEST_CASE("build_llava_input matches LlavaProcessor") {
  const std::filesystem::path dir = reference_dir();
  const json reference = json::parse(read_file(dir / "cases.json"));
  REQUIRE(reference["llava"].size() >= 2);
  for (const json& entry : reference["llava"]) {
    const std::string name = entry["dir"];
    CAPTURE(name);
    const Tokenizer tok = Tokenizer::load(dir / name);
    const auto image_token_id = entry["image_token_id"].get<int64_t>();
    const auto image_seq_length = entry["image_seq_length"].get<int64_t>();
    CHECK(tok.token_to_id("<image>") == image_token_id);
    // BOS/EOS/UNK/PAD as the transformers tokenizer saved in the directory reports them.
    const json& specials = entry["specials"];
    const std::pair<const char*, std::optional<int64_t>> ours[] = {
        {"bos", tok.bos_id()}, {"eos", tok.eos_id()}, {"unk", tok.unk_id()}, {"pad", tok.pad_id()}};
    for (const auto& [key, id] : ours) {
      CAPTURE(key);
      CHECK(id.has_value() == !specials[key].is_null());
      if (id && !specials[key].is_null()) CHECK(*id == specials[key].get<int64_t>());
    }
    for (const json& c : entry["cases"]) {
      const std::string prompt = c["prompt"];
      CAPTURE(prompt);
      const Ids ids = vlmopt::tokenizer::build_llava_input(tok, prompt, image_token_id, image_seq_length);
      CHECK(ids == c["ids"].get<Ids>());
    }
  }
}
