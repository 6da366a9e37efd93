// `vlmopt inspect`: what a path holds, summarised without loading weights.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

namespace vlmopt::bundle {

// Dispatches on what `path` is: an HF LLaVA checkpoint directory, a
// .safetensors file, or an MP-Cache file (any name; recognised by its magic).
// InputError for anything else.
nlohmann::json inspect(const std::filesystem::path& path);
// Human-readable rendering of inspect()'s result.
std::string format_inspect(const nlohmann::json& summary);

// The pieces, for callers that know what they have.
nlohmann::json inspect_model_dir(const std::filesystem::path& dir);
nlohmann::json inspect_safetensors(const std::filesystem::path& file);
// quant::summarize_mp_cache of the validated file, with "path" and the file layout.
nlohmann::json inspect_mp_cache(const std::filesystem::path& file);

}  // namespace vlmopt::bundle
