#include "tokenizer/json_view.hpp"

#include "tokenizer/unicode.hpp"
#include "util/error.hpp"

#include <fmt/format.h>

namespace vlmopt::tokenizer {

void JsonView::fail(std::string_view what) const {
  if (path_.empty()) throw_file_error(*file_, "{}", what);
  throw_file_error(*file_, "field '{}': {}", path_, what);
}

std::string JsonView::as_string() const {
  if (!value_->is_string()) fail(fmt::format("expected a string, got {}", value_->type_name()));
  return value_->get<std::string>();
}

bool JsonView::as_bool() const {
  if (!value_->is_boolean()) fail(fmt::format("expected a boolean, got {}", value_->type_name()));
  return value_->get<bool>();
}

int64_t JsonView::as_int(int64_t min, int64_t max) const {
  if (!value_->is_number_integer()) fail(fmt::format("expected an integer, got {}", value_->dump()));
  if (value_->is_number_unsigned() && value_->get<uint64_t>() > static_cast<uint64_t>(max)) {
    fail(fmt::format("expected an integer in [{}, {}], got {}", min, max, value_->dump()));
  }
  const auto value = value_->get<int64_t>();
  if (value < min || value > max) fail(fmt::format("expected an integer in [{}, {}], got {}", min, max, value));
  return value;
}

char32_t JsonView::as_char() const {
  const std::string text = as_string();
  if (text.empty() || unicode::count_code_points(text) != 1) {
    fail(fmt::format("expected a single character, got \"{}\"", text));
  }
  std::size_t pos = 0;
  return unicode::next_code_point(text, pos);
}

void JsonView::expect_object() const {
  if (!value_->is_object()) fail(fmt::format("expected an object, got {}", value_->type_name()));
}

void JsonView::expect_array() const {
  if (!value_->is_array()) fail(fmt::format("expected an array, got {}", value_->type_name()));
}

JsonView JsonView::at(std::string_view key) const {
  expect_object();
  const std::string child_path = path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
  const auto it = value_->find(key);
  if (it == value_->end()) JsonView(*value_, *file_, child_path).fail("missing");
  if (it->is_null()) JsonView(*value_, *file_, child_path).fail("must not be null");
  return JsonView(*it, *file_, child_path);
}

std::optional<JsonView> JsonView::find(std::string_view key) const {
  expect_object();
  const auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) return std::nullopt;
  return JsonView(*it, *file_, path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key));
}

bool JsonView::bool_or(std::string_view key, bool fallback) const {
  const auto member = find(key);
  return member ? member->as_bool() : fallback;
}

std::vector<JsonView> JsonView::elements() const {
  expect_array();
  std::vector<JsonView> items;
  items.reserve(value_->size());
  for (std::size_t i = 0; i < value_->size(); ++i) {
    items.emplace_back((*value_)[i], *file_, fmt::format("{}[{}]", path_, i));
  }
  return items;
}

}  // namespace vlmopt::tokenizer
