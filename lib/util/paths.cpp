#include "util/paths.hpp"

#include "util/error.hpp"

#include <cstdlib>

#ifndef VLMOPT_SOURCE_DIR
#error "VLMOPT_SOURCE_DIR must be defined by the build"
#endif

namespace vlmopt {

std::filesystem::path builtin_model_dir() {
  std::filesystem::path dir;
  if (const char* env = std::getenv("VLMOPT_BUILTIN_MODEL"); env != nullptr && *env != '\0') {
    dir = env;
  } else {
    dir = std::filesystem::path(VLMOPT_SOURCE_DIR) / "models" / "builtin";
  }
  if (!std::filesystem::is_regular_file(dir / "config.json")) {
    throw InputError(fmt::format("builtin model: {} has no config.json (train it with scripts/train_builtin.py "
                                 "or set VLMOPT_BUILTIN_MODEL)",
                                 dir.string()));
  }
  return dir;
}

std::filesystem::path resolve_model_dir(const std::string& spec) {
  if (spec == "builtin") return builtin_model_dir();
  const std::filesystem::path dir(spec);
  if (!std::filesystem::is_directory(dir)) throw InputError(fmt::format("{}: model directory does not exist", spec));
  if (!std::filesystem::is_regular_file(dir / "config.json"))
    throw InputError(fmt::format("{}: not a Hugging Face model directory (no config.json)", spec));
  return dir;
}

}  // namespace vlmopt
