// LLaVA prompts: the input ids the HF LlavaProcessor makes from a prompt with image placeholders.
#pragma once

#include "tokenizer/tokenizer.hpp"

#include <cstdint>
#include <string_view>
#include <vector>

namespace vlmopt::tokenizer {

// Expands every occurrence of the image token's text (id_to_token(image_token_id),
// "<image>" in LLaVA checkpoints) in `prompt` into `image_seq_length` copies, then encodes
// the whole text with special tokens, as LlavaProcessor does. The ids must then hold
// exactly image_seq_length ids `image_token_id` per placeholder (the processor's own
// check); InputError otherwise, e.g. when the image token is not an added token.
std::vector<int64_t> build_llava_input(const Tokenizer& tokenizer, std::string_view prompt_with_image_placeholder,
                                       int64_t image_token_id, int64_t image_seq_length);

}  // namespace vlmopt::tokenizer
