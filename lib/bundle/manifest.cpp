#include "bundle/manifest.hpp"

#include "io/atomic_file.hpp"
#include "io/hash.hpp"
#include "io/hf_config.hpp"
#include "util/error.hpp"

#include <algorithm>
#include <set>

namespace vlmopt::bundle {

namespace fs = std::filesystem;

namespace {

bool is_hex_sha256(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// A relative path that stays inside the bundle: no root, no '.', '..' or empty components.
bool is_safe_relative(const std::string& path) {
  if (path.empty() || path.front() == '/' || path.back() == '/') return false;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t end = std::min(path.find('/', start), path.size());
    const std::string_view part(path.data() + start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return path.find('\0') == std::string::npos && path.find('\\') == std::string::npos;
}

const nlohmann::json& field(const nlohmann::json& j, const char* name, const std::string& source) {
  if (!j.contains(name)) throw_file_error(source, "field '{}': expected a value, got nothing", name);
  return j.at(name);
}

std::string string_field(const nlohmann::json& j, const char* name, const std::string& source) {
  const auto& v = field(j, name, source);
  if (!v.is_string()) throw_file_error(source, "field '{}': expected a string, got {}", name, v.type_name());
  return v.get<std::string>();
}

uint64_t uint_field(const nlohmann::json& j, const char* name, const std::string& source) {
  const auto& v = field(j, name, source);
  if (!v.is_number_unsigned())
    throw_file_error(source, "field '{}': expected a non-negative integer, got {}", name, v.dump());
  return v.get<uint64_t>();
}

}  // namespace

nlohmann::json Manifest::to_json() const {
  nlohmann::json files_json = nlohmann::json::array();
  for (const auto& f : files) files_json.push_back({{"path", f.path}, {"size", f.size}, {"sha256", f.sha256}});
  return {{"format_version", format_version},
          {"vlmopt_version", vlmopt_version},
          {"source_model_sha256", source_model_sha256},
          {"dataset_hash", dataset_hash},
          {"max_shard_bytes", max_shard_bytes},
          {"steps", steps},
          {"files", std::move(files_json)}};
}

Manifest Manifest::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) throw_file_error(source, "expected a JSON object, got {}", j.type_name());
  static const std::set<std::string> known{"format_version", "vlmopt_version", "source_model_sha256",
                                           "dataset_hash",   "max_shard_bytes", "steps", "files"};
  for (const auto& [key, value] : j.items()) {
    if (!known.contains(key)) throw_file_error(source, "field '{}': expected one of the manifest fields, got an unknown one", key);
  }
  Manifest m;
  const auto& version = field(j, "format_version", source);
  if (!version.is_number_integer() || version.get<int64_t>() != kBundleFormatVersion)
    throw_file_error(source, "field 'format_version': expected {}, got {}", kBundleFormatVersion, version.dump());
  m.vlmopt_version = string_field(j, "vlmopt_version", source);
  m.source_model_sha256 = string_field(j, "source_model_sha256", source);
  if (!is_hex_sha256(m.source_model_sha256))
    throw_file_error(source, "field 'source_model_sha256': expected 64 lowercase hex digits, got '{}'",
                     m.source_model_sha256);
  m.dataset_hash = string_field(j, "dataset_hash", source);
  m.max_shard_bytes = uint_field(j, "max_shard_bytes", source);
  m.steps = field(j, "steps", source);
  if (!m.steps.is_array()) throw_file_error(source, "field 'steps': expected an array, got {}", m.steps.type_name());
  for (size_t i = 0; i < m.steps.size(); ++i) {
    const auto& s = m.steps[i];
    if (!s.is_object() || !s.contains("step") || !s["step"].is_string() || !s.contains("options") || s.size() != 2)
      throw_file_error(source, "field 'steps[{}]': expected {{\"step\": name, \"options\": ...}}, got {}", i, s.dump());
  }
  const auto& files = field(j, "files", source);
  if (!files.is_array()) throw_file_error(source, "field 'files': expected an array, got {}", files.type_name());
  for (size_t i = 0; i < files.size(); ++i) {
    const auto& f = files[i];
    const std::string where = fmt::format("files[{}]", i);
    if (!f.is_object() || f.size() != 3)
      throw_file_error(source, "field '{}': expected {{path, size, sha256}}, got {}", where, f.dump());
    FileEntry e;
    const std::string src = fmt::format("{}: {}", source, where);
    e.path = string_field(f, "path", src);
    e.size = uint_field(f, "size", src);
    e.sha256 = string_field(f, "sha256", src);
    if (!is_safe_relative(e.path) || e.path == kManifestPath)
      throw_file_error(source, "field '{}.path': expected a relative path inside the bundle, got '{}'", where, e.path);
    if (!is_hex_sha256(e.sha256))
      throw_file_error(source, "field '{}.sha256': expected 64 lowercase hex digits, got '{}'", where, e.sha256);
    if (!m.files.empty() && !(m.files.back().path < e.path))
      throw_file_error(source, "field '{}.path': expected paths sorted and unique, got '{}' after '{}'", where, e.path,
                       m.files.back().path);
    m.files.push_back(std::move(e));
  }
  return m;
}

Manifest read_manifest(const fs::path& bundle) {
  const auto path = bundle / kManifestPath;
  if (!fs::is_regular_file(path)) throw_file_error(path, "missing (not a vlmopt bundle?)");
  return Manifest::from_json(io::load_json_file(path, kMaxManifestBytes), path.string());
}

void write_manifest(const fs::path& root, const Manifest& manifest) {
  fs::create_directories(root / "vlmopt");
  io::write_file_atomic(root / kManifestPath, manifest.to_json().dump(2) + "\n");
}

std::vector<std::string> list_files(const fs::path& root) {
  std::vector<std::string> out;
  for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator(); ++it) {
    if (it->is_directory() && !it->is_symlink()) continue;
    auto rel = fs::relative(it->path(), root).generic_string();
    if (rel != kManifestPath) out.push_back(std::move(rel));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<FileEntry> scan_files(const fs::path& root) {
  std::vector<FileEntry> out;
  for (const auto& rel : list_files(root)) {
    const auto path = root / rel;
    if (fs::is_symlink(path) || !fs::is_regular_file(path))
      throw_file_error(path, "expected a regular file in the bundle, got another kind of entry");
    out.push_back({rel, static_cast<uint64_t>(fs::file_size(path)), io::sha256_file(path)});
  }
  return out;
}

std::string source_model_hash(const fs::path& model_dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(model_dir)) {
    if (!entry.is_regular_file()) continue;
    const auto name = entry.path().filename().string();
    if (name == "config.json" || name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json"))
      names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  std::string lines;
  for (const auto& name : names) lines += name + " " + io::sha256_file(model_dir / name) + "\n";
  return io::sha256_hex(lines);
}

}  // namespace vlmopt::bundle
