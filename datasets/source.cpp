#include "datasets/source.hpp"

#include "datasets/clips.hpp"
#include "datasets/hdf5_pack.hpp"
#include "datasets/jsonl.hpp"
#include "datasets/scenes.hpp"
#include "util/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

namespace vlmopt::datasets {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kBuiltinPrefix = "builtin:";
constexpr std::string_view kSpecHelp = "expected builtin:train|calib|eval|stress|clips, a .jsonl file or a .h5 pack";

std::string lowercase_extension(const fs::path& path) {
  std::string ext = path.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext;
}

}  // namespace

void check_index(std::size_t i, std::size_t size, const std::string& what) {
  if (i >= size) {
    throw InputError(fmt::format("{}: sample index out of range (expected < {}, got {})", what, size, i));
  }
}

std::unique_ptr<DatasetSource> open_dataset(const std::string& spec) {
  if (spec.empty()) throw InputError(fmt::format("dataset spec is empty ({})", kSpecHelp));
  if (spec == kClipsSpec) return std::make_unique<ClipSource>();
  if (spec.starts_with(kBuiltinPrefix)) {
    const std::string_view split_name = std::string_view(spec).substr(kBuiltinPrefix.size());
    const auto split = parse_builtin_split(split_name);
    if (!split) {
      throw InputError(fmt::format("dataset spec '{}': unknown builtin split '{}' ({})", spec, split_name, kSpecHelp));
    }
    return std::make_unique<BuiltinSource>(*split);
  }
  const fs::path path(spec);
  const std::string ext = lowercase_extension(path);
  if (ext == ".jsonl") return std::make_unique<JsonlSource>(path);
  if (ext == ".h5" || ext == ".hdf5") return std::make_unique<PackSource>(path);
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InputError(fmt::format("dataset spec '{}': no such file ({})", spec, kSpecHelp));
  if (looks_like_hdf5(path)) return std::make_unique<PackSource>(path);
  throw InputError(fmt::format("dataset spec '{}': not a dataset ({})", spec, kSpecHelp));
}

}  // namespace vlmopt::datasets
