// Checked reads of a parsed tokenizer.json: every failure is an InputError naming the file
// and the field, "tokenizer.json: field 'model.vocab': expected object, got array".
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::tokenizer {

// A view: the JSON value and the file path must outlive it.
class JsonView {
 public:
  JsonView(const nlohmann::json& value, const std::filesystem::path& file, std::string path = {})
      : value_(&value), file_(&file), path_(std::move(path)) {}

  const nlohmann::json& raw() const { return *value_; }
  const std::string& path() const { return path_; }
  const std::filesystem::path& file() const { return *file_; }
  bool is_null() const { return value_->is_null(); }

  [[noreturn]] void fail(std::string_view what) const;

  std::string as_string() const;
  bool as_bool() const;
  int64_t as_int(int64_t min, int64_t max) const;
  char32_t as_char() const;  // a string of exactly one character
  void expect_object() const;
  void expect_array() const;

  // Object members. at(): present and not null; find(): nullopt when absent or null.
  JsonView at(std::string_view key) const;
  std::optional<JsonView> find(std::string_view key) const;
  std::string string_at(std::string_view key) const { return at(key).as_string(); }
  bool bool_at(std::string_view key) const { return at(key).as_bool(); }
  bool bool_or(std::string_view key, bool fallback) const;
  // The "type" tag of a component.
  std::string type() const { return at("type").as_string(); }

  std::vector<JsonView> elements() const;  // array items, paths "x[0]", "x[1]", ...

 private:
  const nlohmann::json* value_;
  const std::filesystem::path* file_;
  std::string path_;
};

}  // namespace vlmopt::tokenizer
