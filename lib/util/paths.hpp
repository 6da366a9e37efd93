// Where vlmopt finds the files it ships (the builtin model) and how a --model
// spec becomes a directory.
#pragma once

#include <filesystem>
#include <string>

namespace vlmopt {

// The embedded default model: $VLMOPT_BUILTIN_MODEL if set, else models/builtin
// of the source tree this binary was built from. InputError when absent.
std::filesystem::path builtin_model_dir();

// "builtin" -> builtin_model_dir(); anything else must be a directory holding
// config.json (InputError "<spec>: ..." otherwise).
std::filesystem::path resolve_model_dir(const std::string& spec);

}  // namespace vlmopt
