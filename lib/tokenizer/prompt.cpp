#include "tokenizer/prompt.hpp"

#include "util/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace vlmopt::tokenizer {

std::vector<int64_t> build_llava_input(const Tokenizer& tokenizer, std::string_view prompt, int64_t image_token_id,
                                       int64_t image_seq_length) {
  constexpr int64_t kMaxImageTokens = std::numeric_limits<int32_t>::max();
  if (image_seq_length < 1 || image_seq_length > kMaxImageTokens) {
    throw InputError(fmt::format("image_seq_length must be in [1, {}] (got {})", kMaxImageTokens, image_seq_length));
  }
  const std::string placeholder = tokenizer.id_to_token(image_token_id);
  if (placeholder.empty()) throw InputError(fmt::format("image token id {} has an empty text", image_token_id));

  // Left-to-right, non-overlapping occurrences, each replaced by the repeated token text.
  constexpr std::size_t kMaxPromptBytes = std::size_t{1} << 31;
  const std::size_t expansion_bytes = placeholder.size() * static_cast<std::size_t>(image_seq_length);
  std::string expanded;
  int64_t placeholders = 0;
  std::size_t last = 0;
  for (std::size_t at = prompt.find(placeholder); at != std::string_view::npos;
       at = prompt.find(placeholder, last)) {
    expanded.append(prompt.substr(last, at - last));
    if (expanded.size() + expansion_bytes > kMaxPromptBytes) {
      throw InputError(fmt::format("prompt longer than {} bytes after expanding '{}' {} times", kMaxPromptBytes,
                                   placeholder, image_seq_length));
    }
    for (int64_t i = 0; i < image_seq_length; ++i) expanded += placeholder;
    ++placeholders;
    last = at + placeholder.size();
  }
  expanded.append(prompt.substr(last));

  std::vector<int64_t> ids = tokenizer.encode(expanded, /*add_special_tokens=*/true);
  const auto image_ids = std::count(ids.begin(), ids.end(), image_token_id);
  if (image_ids != placeholders * image_seq_length) {
    throw InputError(fmt::format(
        "the prompt has {} '{}' placeholders, {} image tokens expected, but the tokenizer made {} ids {} "
        "(is '{}' an added token of {}?)",
        placeholders, placeholder, placeholders * image_seq_length, image_ids, image_token_id, placeholder,
        tokenizer.source().string()));
  }
  return ids;
}

}  // namespace vlmopt::tokenizer
