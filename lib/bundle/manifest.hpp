// vlmopt/manifest.json: what a bundle holds and how it was made (design.md §5).
//
//   {"format_version": 1, "vlmopt_version": "0.1.0",
//    "source_model_sha256": "<hex>", "dataset_hash": "<text>",
//    "max_shard_bytes": 2147483648,
//    "steps": [{"step": "export", "options": {...}}, {"step": "compensate", ...}],
//    "files": [{"path": "config.json", "size": 1234, "sha256": "<hex>"}, ...]}
//
// `files` lists every regular file of the bundle except the manifest itself,
// sorted by path (relative, '/'-separated). Written with sorted keys and a
// trailing newline so the same content gives the same bytes.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace vlmopt::bundle {

inline constexpr int kBundleFormatVersion = 1;
inline constexpr const char* kManifestPath = "vlmopt/manifest.json";
inline constexpr uint64_t kMaxManifestBytes = 64ull << 20;

struct FileEntry {
  std::string path;  // relative to the bundle root, '/'-separated
  uint64_t size = 0;
  std::string sha256;  // lowercase hex
  bool operator==(const FileEntry&) const = default;
};

struct Manifest {
  int format_version = kBundleFormatVersion;
  std::string vlmopt_version;
  std::string source_model_sha256;
  std::string dataset_hash;
  uint64_t max_shard_bytes = 0;  // how model.safetensors was sharded (update_bundle keeps it)
  nlohmann::json steps = nlohmann::json::array();  // [{"step": name, "options": {...}}] in the order run
  std::vector<FileEntry> files;                    // sorted by path

  nlohmann::json to_json() const;
  // Validates the schema; InputError "<source>: field '<name>': expected X, got Y".
  static Manifest from_json(const nlohmann::json& j, const std::string& source);
};

// Reads and validates <bundle>/vlmopt/manifest.json.
Manifest read_manifest(const std::filesystem::path& bundle);
// Writes <root>/vlmopt/manifest.json atomically (creating vlmopt/).
void write_manifest(const std::filesystem::path& root, const Manifest& manifest);
// Every regular file under `root` except the manifest, sorted by path, with size and sha256.
// Throws InputError for anything that is neither a regular file nor a directory (links, fifos).
std::vector<FileEntry> scan_files(const std::filesystem::path& root);
// Relative '/'-separated paths of every non-directory entry under `root` except the manifest, sorted.
std::vector<std::string> list_files(const std::filesystem::path& root);
// sha256 identifying a source checkpoint: over config.json and every *.safetensors /
// *.safetensors.index.json file in `model_dir` (sorted by name), as
// sha256 of the lines "<name> <sha256 of the file>\n".
std::string source_model_hash(const std::filesystem::path& model_dir);

}  // namespace vlmopt::bundle
