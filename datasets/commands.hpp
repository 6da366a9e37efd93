// What `vlmopt datasets show|pack|vocab` do, as plain functions over option
// structs (the CLI only binds options and prints the result).
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>

namespace vlmopt::datasets {

struct ShowOptions {
  std::string spec;
  std::size_t limit = 5;                            // samples to print
  std::optional<std::filesystem::path> dump_dir;    // write those samples' images as PNG here
};

// {"spec", "description", "size", "samples": [{"index", "id", "width", "height",
//  "frames", "question", "answer", "question_type", "meta", "image_file"?, "frame_files"?}]}
// (frames: extra frames after the image; frame_files: their PNGs with --dump, frames only)
nlohmann::json show(const ShowOptions& options);
std::string format_show(const nlohmann::json& result);  // human-readable form of show()'s result

struct PackOptions {
  std::string spec;
  std::filesystem::path output;                     // the .h5 file to write (atomically)
  std::optional<std::size_t> limit;                 // first N samples; all when unset
  int deflate_level = 3;                            // 0..9
};

// {"spec", "description", "output", "samples", "bytes", "sha256", "seconds"}
nlohmann::json pack(const PackOptions& options);
std::string format_pack(const nlohmann::json& result);

// {"words": builtin_vocabulary(), "question_types": [...], "answers": {type: [...]}}
nlohmann::json vocab();
std::string format_vocab(const nlohmann::json& result);

}  // namespace vlmopt::datasets
