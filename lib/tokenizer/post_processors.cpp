// Post-processors of tokenizer.json (HF tokenizers/src/processors), single sequences only.
#include "tokenizer/components.hpp"

#include <fmt/format.h>

#include <limits>
#include <map>
#include <variant>

namespace vlmopt::tokenizer {

namespace {

constexpr int64_t kMaxId = std::numeric_limits<int32_t>::max();

// Template "pieces": the sequence itself, or the ids of a special token.
using TemplateItem = std::variant<std::monostate, std::vector<int64_t>>;

class TemplateProcessing final : public PostProcessor {
 public:
  explicit TemplateProcessing(std::vector<TemplateItem> single) : single_(std::move(single)) {}

  std::size_t added_tokens() const override {
    std::size_t count = 0;
    for (const TemplateItem& item : single_) {
      if (const auto* ids = std::get_if<std::vector<int64_t>>(&item)) count += ids->size();
    }
    return count;
  }

  void process(std::vector<int64_t>& ids, bool add_special_tokens) const override {
    std::vector<int64_t> out;
    out.reserve(ids.size() + added_tokens());
    for (const TemplateItem& item : single_) {
      if (const auto* special = std::get_if<std::vector<int64_t>>(&item)) {
        if (add_special_tokens) out.insert(out.end(), special->begin(), special->end());
      } else {
        out.insert(out.end(), ids.begin(), ids.end());
      }
    }
    ids = std::move(out);
  }

  void surrounding_ids(std::vector<int64_t>& before, std::vector<int64_t>& after) const override {
    bool seen_sequence = false;
    for (const TemplateItem& item : single_) {
      if (const auto* special = std::get_if<std::vector<int64_t>>(&item)) {
        auto& target = seen_sequence ? after : before;
        target.insert(target.end(), special->begin(), special->end());
      } else {
        seen_sequence = true;
      }
    }
  }

 private:
  std::vector<TemplateItem> single_;
};

// BertProcessing and RobertaProcessing: cls $A sep.
class ClsSepProcessing final : public PostProcessor {
 public:
  ClsSepProcessing(int64_t cls, int64_t sep) : cls_(cls), sep_(sep) {}
  std::size_t added_tokens() const override { return 2; }
  void process(std::vector<int64_t>& ids, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    ids.insert(ids.begin(), cls_);
    ids.push_back(sep_);
  }
  void surrounding_ids(std::vector<int64_t>& before, std::vector<int64_t>& after) const override {
    before.push_back(cls_);
    after.push_back(sep_);
  }

 private:
  int64_t cls_, sep_;
};

// ByteLevel as a post-processor only trims offsets: ids stay as they are.
class IdentityProcessing final : public PostProcessor {
 public:
  std::size_t added_tokens() const override { return 0; }
  void process(std::vector<int64_t>&, bool) const override {}
  void surrounding_ids(std::vector<int64_t>&, std::vector<int64_t>&) const override {}
};

class SequenceProcessing final : public PostProcessor {
 public:
  explicit SequenceProcessing(std::vector<std::unique_ptr<PostProcessor>> steps) : steps_(std::move(steps)) {}
  std::size_t added_tokens() const override {
    std::size_t count = 0;
    for (const auto& step : steps_) count += step->added_tokens();
    return count;
  }
  void process(std::vector<int64_t>& ids, bool add_special_tokens) const override {
    for (const auto& step : steps_) step->process(ids, add_special_tokens);
  }
  void surrounding_ids(std::vector<int64_t>& before, std::vector<int64_t>& after) const override {
    // Later steps wrap what earlier ones produced.
    for (const auto& step : steps_) {
      std::vector<int64_t> step_before, step_after;
      step->surrounding_ids(step_before, step_after);
      before.insert(before.begin(), step_before.begin(), step_before.end());
      after.insert(after.end(), step_after.begin(), step_after.end());
    }
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

// ["[CLS]", 101]
int64_t parse_token_pair(const JsonView& json) {
  const auto parts = json.elements();
  if (parts.size() != 2) json.fail(fmt::format("expected [token, id], got {}", json.raw().dump()));
  parts[0].as_string();
  return parts[1].as_int(0, kMaxId);
}

std::unique_ptr<PostProcessor> parse_template(const JsonView& json) {
  std::map<std::string, std::vector<int64_t>, std::less<>> specials;
  const JsonView specials_json = json.at("special_tokens");
  specials_json.expect_object();
  for (const auto& [name, value] : specials_json.raw().items()) {
    const JsonView special(value, json.file(), fmt::format("{}[\"{}\"]", specials_json.path(), name));
    std::vector<int64_t> ids;
    for (const JsonView& id : special.at("ids").elements()) ids.push_back(id.as_int(0, kMaxId));
    const auto tokens = special.at("tokens").elements();
    if (tokens.size() != ids.size()) {
      special.fail(fmt::format("has {} ids but {} tokens (expected as many)", ids.size(), tokens.size()));
    }
    specials.emplace(name, std::move(ids));
  }

  std::vector<TemplateItem> single;
  for (const JsonView& piece : json.at("single").elements()) {
    piece.expect_object();
    if (const auto sequence = piece.find("Sequence")) {
      const std::string id = sequence->string_at("id");
      if (id != "A") sequence->at("id").fail(fmt::format("a single-sequence template can only use A, got '{}'", id));
      sequence->at("type_id").as_int(0, kMaxId);
      single.emplace_back(std::monostate{});
    } else if (const auto special = piece.find("SpecialToken")) {
      const std::string id = special->string_at("id");
      special->at("type_id").as_int(0, kMaxId);
      const auto it = specials.find(id);
      if (it == specials.end()) {
        special->at("id").fail(fmt::format("'{}' is not defined in {}", id, specials_json.path()));
      }
      single.emplace_back(it->second);
    } else {
      piece.fail(fmt::format("expected {{\"Sequence\": ...}} or {{\"SpecialToken\": ...}}, got {}", piece.raw().dump()));
    }
  }
  return std::make_unique<TemplateProcessing>(std::move(single));
}

}  // namespace

std::unique_ptr<PostProcessor> parse_post_processor(const JsonView& json) {
  const std::string type = json.type();
  if (type == "TemplateProcessing") return parse_template(json);
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    return std::make_unique<ClsSepProcessing>(parse_token_pair(json.at("cls")), parse_token_pair(json.at("sep")));
  }
  if (type == "ByteLevel") return std::make_unique<IdentityProcessing>();
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PostProcessor>> steps;
    for (const JsonView& step : json.at("processors").elements()) steps.push_back(parse_post_processor(step));
    return std::make_unique<SequenceProcessing>(std::move(steps));
  }
  fail_unsupported_type(json, "post-processor", type,
                        {"BertProcessing", "ByteLevel", "RobertaProcessing", "Sequence", "TemplateProcessing"});
}

}  // namespace vlmopt::tokenizer
