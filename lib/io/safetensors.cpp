#include "io/safetensors.hpp"

#include "io/atomic_file.hpp"
#include "io/hf_config.hpp"  // parse_json_strict, load_json_file
#include "util/error.hpp"

#include <nlohmann/json.hpp>

#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <numeric>
#include <regex>
#include <set>
#include <system_error>

namespace vlmopt::io {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; big-endian hosts need byte swapping");

using nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
constexpr std::string_view kSingleFileName = "model.safetensors";

std::string all_dtype_names() {
  std::string names;
  for (DType d : kAllDTypes) {
    if (!names.empty()) names += ", ";
    names += dtype_name(d);
  }
  return names;
}

// numel of a shape, or nullopt when it overflows int64.
std::optional<int64_t> checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

// numel * itemsize in bytes, or nullopt on overflow.
std::optional<uint64_t> checked_nbytes(const std::vector<int64_t>& shape, DType dtype) {
  const auto numel = checked_numel(shape);
  if (!numel) return std::nullopt;
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(*numel), static_cast<uint64_t>(dtype_size(dtype)), &bytes)) {
    return std::nullopt;
  }
  return bytes;
}

// The JSON text of a value as it appeared (for "got ..." in messages), shortened.
std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  constexpr std::size_t kMax = 80;
  if (text.size() > kMax) text = text.substr(0, kMax) + "...";
  return text;
}

[[noreturn]] void throw_field_error(const std::filesystem::path& path, const std::string& tensor, std::string_view field,
                                   const std::string& what) {
  throw InputError(fmt::format("{}: tensor '{}' field '{}': {}", path.string(), tensor, field, what));
}

// Parses one header entry (everything but __metadata__) into a TensorInfo.
TensorInfo parse_tensor_entry(const std::filesystem::path& path, const std::string& name, const json& entry) {
  const auto fail = [&](std::string_view field, const std::string& what) { throw_field_error(path, name, field, what); };
  if (!entry.is_object()) {
    throw InputError(fmt::format("{}: tensor '{}': expected an object with dtype, shape, data_offsets, got {}",
                                 path.string(), name, shown(entry)));
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(field)) fail(field, "missing");
  }
  TensorInfo info;
  info.name = name;

  const json& dtype = entry["dtype"];
  if (!dtype.is_string()) fail("dtype", fmt::format("expected a string, got {}", shown(dtype)));
  const auto parsed = parse_dtype(dtype.get_ref<const std::string&>());
  if (!parsed) fail("dtype", fmt::format("unknown dtype {} (expected one of {})", shown(dtype), all_dtype_names()));
  info.dtype = *parsed;

  const json& shape = entry["shape"];
  if (!shape.is_array()) fail("shape", fmt::format("expected an array of non-negative integers, got {}", shown(shape)));
  info.shape.reserve(shape.size());
  for (const json& dim : shape) {
    // number_unsigned is how nlohmann stores non-negative integers; negatives are number_integer.
    if (!dim.is_number_unsigned() || dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail("shape", fmt::format("expected non-negative integers, got {} in {}", shown(dim), shown(shape)));
    }
    info.shape.push_back(dim.get<int64_t>());
  }
  const auto expected_bytes = checked_nbytes(info.shape, info.dtype);
  if (!expected_bytes) fail("shape", fmt::format("{} x {} overflows 64 bits", shown(shape), dtype_name(info.dtype)));

  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    fail("data_offsets", fmt::format("expected [begin, end] non-negative integers, got {}", shown(offsets)));
  }
  info.begin = offsets[0].get<uint64_t>();
  info.end = offsets[1].get<uint64_t>();
  if (info.begin > info.end) {
    fail("data_offsets", fmt::format("begin > end (expected begin <= end, got [{}, {}])", info.begin, info.end));
  }
  if (info.end - info.begin != *expected_bytes) {
    fail("data_offsets", fmt::format("[{}, {}] holds {} bytes, but shape {} x {} needs {} (expected {} bytes, got {})",
                                     info.begin, info.end, info.end - info.begin, shown(shape),
                                     dtype_name(info.dtype), *expected_bytes, *expected_bytes, info.end - info.begin));
  }
  return info;
}

// A plain file name inside the checkpoint directory (no separators, no "..").
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

std::string shard_file_name(std::size_t index, std::size_t count) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", index + 1, count);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Reading

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated against overflow when the file was opened
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<std::byte*>(map_), file_size_);
}

std::shared_ptr<const SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
  // Owned from here on: if validation throws, the destructor unmaps.
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  const std::string where = path.string();

  {
    const UniqueFd fd = open_regular_file(path);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      throw InputError(fmt::format("{}: cannot stat: {}", where, std::generic_category().message(errno)));
    }
    const auto size = static_cast<uint64_t>(st.st_size);
    if (size < 8) {
      throw InputError(fmt::format("{}: file too short for a safetensors header length (expected at least 8 bytes, got {})",
                                   where, size));
    }
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (map == MAP_FAILED) {
      throw InputError(fmt::format("{}: cannot mmap {} bytes: {}", where, size, std::generic_category().message(errno)));
    }
    file->map_ = static_cast<const std::byte*>(map);
    file->file_size_ = size;
  }  // the mapping stays valid after the descriptor is closed

  uint64_t header_length = 0;
  std::memcpy(&header_length, file->map_, sizeof header_length);  // little-endian u64 (host is little-endian)
  if (header_length > kMaxHeaderBytes) {
    throw InputError(fmt::format("{}: header length {} exceeds the limit (expected at most {} bytes, got {})", where,
                                 header_length, kMaxHeaderBytes, header_length));
  }
  if (header_length > file->file_size_ - 8) {
    throw InputError(fmt::format("{}: header length runs past the end of the file (expected at most {} bytes, got {})",
                                 where, file->file_size_ - 8, header_length));
  }
  file->data_start_ = 8 + header_length;
  const std::string_view header_text(reinterpret_cast<const char*>(file->map_) + 8, header_length);
  if (header_text.empty() || header_text.front() != '{') {
    throw InputError(fmt::format("{}: header is not a JSON object (expected it to start with '{{', got {})", where,
                                 header_text.empty() ? std::string("an empty header")
                                                     : shown(json(std::string(header_text.substr(0, 1))))));
  }
  const json header = parse_json_strict(header_text, where, "header");
  if (!header.is_object()) {
    throw InputError(fmt::format("{}: header is not a JSON object (got {})", where, shown(header)));
  }

  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) {
        throw InputError(fmt::format("{}: field '__metadata__': expected an object of strings, got {}", where, shown(value)));
      }
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) {
          throw InputError(fmt::format("{}: field '__metadata__.{}': expected a string, got {}", where, meta_key,
                                       shown(meta_value)));
        }
        file->metadata_.emplace(meta_key, meta_value.get<std::string>());
      }
      continue;
    }
    file->tensors_.push_back(parse_tensor_entry(path, key, value));
  }

  // Sorted by offset, the tensors must tile [0, data size) exactly.
  const uint64_t data_size = file->file_size_ - file->data_start_;
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(file->tensors_.size());
  for (const auto& t : file->tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo* t : by_offset) {
    if (t->begin > covered) {
      throw InputError(fmt::format("{}: tensor '{}' field 'data_offsets' [{}, {}] leaves a hole after {} (expected begin {}, got {})",
                                   where, t->name, t->begin, t->end,
                                   previous ? fmt::format("tensor '{}'", previous->name) : std::string("the header"),
                                   covered, t->begin));
    }
    if (t->begin < covered) {
      throw InputError(fmt::format("{}: tensor '{}' field 'data_offsets' [{}, {}] overlaps tensor '{}' (expected begin {}, got {})",
                                   where, t->name, t->begin, t->end, previous ? previous->name : std::string("?"),
                                   covered, t->begin));
    }
    if (t->end > data_size) {
      throw InputError(fmt::format("{}: tensor '{}' field 'data_offsets' [{}, {}] exceeds the data buffer; file truncated "
                                   "(expected file size {}, got {})",
                                   where, t->name, t->begin, t->end, file->data_start_ + t->end, file->file_size_));
    }
    covered = t->end;
    previous = t;
  }
  if (covered != data_size) {
    throw InputError(fmt::format("{}: {} trailing bytes after the last tensor's data_offsets end {} (expected file size {}, got {})",
                                 where, data_size - covered, covered, file->data_start_ + covered, file->file_size_));
  }

  std::sort(file->tensors_.begin(), file->tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  for (std::size_t i = 0; i < file->tensors_.size(); ++i) file->position_.emplace(file->tensors_[i].name, i);
  return file;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = position_.find(name);
  return it == position_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::at(std::string_view name) const {
  const TensorInfo* info = find(name);
  if (info == nullptr) throw InputError(fmt::format("{}: no tensor named '{}'", path_.string(), name));
  return *info;
}

void SafetensorsFile::release_pages(const TensorInfo& info) const {
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = data_start_ + info.begin;
  const uint64_t end = data_start_ + info.end;
  // Only whole pages inside the tensor: neighbours sharing a page stay resident.
  const uint64_t first = (begin + page - 1) / page * page;
  const uint64_t last = end / page * page;
  if (last <= first) return;
  // Advice only: a failure leaves the pages resident, which is harmless.
  (void)::madvise(const_cast<std::byte*>(map_) + first, last - first, MADV_DONTNEED);
}

std::span<const std::byte> SafetensorsFile::bytes(const TensorInfo& info) const {
  VLMOPT_CHECK(info.begin <= info.end && info.end <= file_size_ - data_start_,
               "tensor '{}' [{}, {}] is not inside the data of {}", info.name, info.begin, info.end, path_.string());
  return {map_ + data_start_ + info.begin, static_cast<std::size_t>(info.end - info.begin)};
}

// ---------------------------------------------------------------------------------------------
// Writing

void write_safetensors(const std::filesystem::path& path, std::vector<TensorToWrite> tensors,
                       std::map<std::string, std::string> metadata) {
  const std::string where = path.string();
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorToWrite& t = tensors[i];
    if (t.name.empty() || t.name == kMetadataKey) {
      throw InputError(fmt::format("{}: invalid tensor name '{}'", where, t.name));
    }
    if (i > 0 && tensors[i - 1].name == t.name) {
      throw InputError(fmt::format("{}: duplicate tensor name '{}'", where, t.name));
    }
    const auto nbytes = checked_nbytes(t.shape, t.dtype);
    if (!nbytes) {
      throw InputError(fmt::format("{}: tensor '{}': invalid shape [{}] (negative or overflowing)", where, t.name,
                                   fmt::join(t.shape, ", ")));
    }
    if (*nbytes != t.data.size()) {
      throw InputError(fmt::format("{}: tensor '{}': data size does not match shape [{}] x {} (expected {} bytes, got {})",
                                   where, t.name, fmt::join(t.shape, ", "), dtype_name(t.dtype), *nbytes,
                                   t.data.size()));
    }
  }
  metadata.try_emplace("format", "pt");

  // Fixed layout: __metadata__ first, then tensors by name, keys dtype/shape/data_offsets, no spaces.
  std::string header;
  try {
    header = "{\"__metadata__\":" + json(metadata).dump();
    uint64_t offset = 0;
    for (const TensorToWrite& t : tensors) {
      header += fmt::format(",{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}", json(t.name).dump(),
                            dtype_name(t.dtype), fmt::join(t.shape, ","), offset, offset + t.data.size());
      offset += t.data.size();
    }
    header += "}";
  } catch (const json::type_error& e) {  // invalid UTF-8 in a name or metadata string
    throw InputError(fmt::format("{}: tensor name or metadata is not valid UTF-8: {}", where, e.what()));
  }
  header.append((8 - header.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  if (header.size() > SafetensorsFile::kMaxHeaderBytes) {
    throw InputError(fmt::format("{}: header would be {} bytes (expected at most {})", where, header.size(),
                                 SafetensorsFile::kMaxHeaderBytes));
  }

  AtomicFileWriter out(path);
  std::array<std::byte, 8> length_bytes{};
  const uint64_t header_length = header.size();
  std::memcpy(length_bytes.data(), &header_length, sizeof header_length);  // little-endian host
  out.write(length_bytes);
  out.write(header);
  for (const TensorToWrite& t : tensors) out.write(t.data);
  out.commit();
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

Checkpoint Checkpoint::open(const std::filesystem::path& dir) {
  Checkpoint ckpt;
  ckpt.dir_ = dir;
  std::error_code ec;
  if (std::filesystem::is_regular_file(dir, ec)) {  // a single .safetensors file given directly
    ckpt.dir_ = dir.parent_path();
    ckpt.files_.push_back(SafetensorsFile::open(dir));
    for (const TensorInfo& t : ckpt.files_[0]->tensors()) ckpt.by_name_.emplace(t.name, std::pair{0, &t});
    return ckpt;
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    throw InputError(fmt::format("{}: checkpoint directory does not exist", dir.string()));
  }

  const auto single = dir / kSingleFileName;
  const auto index_path = dir / kIndexFileName;
  if (std::filesystem::exists(single, ec)) {  // same preference as transformers: the single file first
    ckpt.files_.push_back(SafetensorsFile::open(single));
    for (const TensorInfo& t : ckpt.files_[0]->tensors()) ckpt.by_name_.emplace(t.name, std::pair{0, &t});
    return ckpt;
  }
  if (!std::filesystem::exists(index_path, ec)) {
    throw InputError(fmt::format("{}: no {} or {} in the checkpoint directory", dir.string(), kSingleFileName,
                                 kIndexFileName));
  }

  const std::string where = index_path.string();
  const json index = load_json_file(index_path);
  if (!index.is_object()) throw InputError(fmt::format("{}: expected a JSON object, got {}", where, shown(index)));
  if (index.contains("metadata")) {
    const json& meta = index["metadata"];
    if (!meta.is_object() && !meta.is_null()) {
      throw InputError(fmt::format("{}: field 'metadata': expected an object, got {}", where, shown(meta)));
    }
    if (meta.is_object() && meta.contains("total_size") && !meta["total_size"].is_number_unsigned() &&
        !meta["total_size"].is_null()) {
      throw InputError(fmt::format("{}: field 'metadata.total_size': expected a non-negative integer, got {}", where,
                                   shown(meta["total_size"])));
    }
  }
  if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw InputError(fmt::format("{}: field 'weight_map': expected an object of tensor name -> file name, got {}", where,
                                 index.contains("weight_map") ? shown(index["weight_map"]) : "nothing"));
  }
  const json& weight_map = index["weight_map"];
  std::map<std::string, std::size_t> file_slot;  // shard file name -> index in files_
  for (const auto& [name, file_value] : weight_map.items()) {
    if (!file_value.is_string()) {
      throw InputError(fmt::format("{}: field 'weight_map.{}': expected a file name string, got {}", where, name,
                                   shown(file_value)));
    }
    const auto& file_name = file_value.get_ref<const std::string&>();
    if (!is_plain_file_name(file_name)) {
      throw InputError(fmt::format("{}: field 'weight_map.{}': expected a file name in the checkpoint directory, got '{}'",
                                   where, name, file_name));
    }
    file_slot.emplace(file_name, 0);
  }
  for (auto& [file_name, slot] : file_slot) {
    const auto shard_path = dir / file_name;
    if (!std::filesystem::exists(shard_path, ec)) {
      throw InputError(fmt::format("{}: field 'weight_map' names file '{}', which does not exist in {}", where,
                                   file_name, dir.string()));
    }
    slot = ckpt.files_.size();
    ckpt.files_.push_back(SafetensorsFile::open(shard_path));
  }
  for (std::size_t i = 0; i < ckpt.files_.size(); ++i) {
    for (const TensorInfo& t : ckpt.files_[i]->tensors()) {
      const auto [it, inserted] = ckpt.by_name_.emplace(t.name, std::pair{i, &t});
      if (!inserted) {
        throw InputError(fmt::format("{}: tensor '{}' is in two shards ('{}' and '{}')", where, t.name,
                                     ckpt.files_[it->second.first]->path().filename().string(),
                                     ckpt.files_[i]->path().filename().string()));
      }
    }
  }
  for (const auto& [name, file_value] : weight_map.items()) {
    const auto& file_name = file_value.get_ref<const std::string&>();
    const auto it = ckpt.by_name_.find(name);
    if (it == ckpt.by_name_.end()) {
      throw InputError(fmt::format("{}: field 'weight_map.{}': tensor not found in '{}'", where, name, file_name));
    }
    if (it->second.first != file_slot.at(file_name)) {
      throw InputError(fmt::format("{}: field 'weight_map.{}': expected the tensor in '{}', got it in '{}'", where, name,
                                   file_name, ckpt.files_[it->second.first]->path().filename().string()));
    }
  }
  return ckpt;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(by_name_.size());
  for (const auto& [name, _] : by_name_) out.push_back(name);
  return out;  // std::map keeps them sorted
}

bool Checkpoint::contains(std::string_view name) const { return by_name_.find(name) != by_name_.end(); }

std::pair<const SafetensorsFile*, const TensorInfo*> Checkpoint::locate(std::string_view name) const {
  const auto it = by_name_.find(name);
  if (it == by_name_.end()) throw InputError(fmt::format("{}: checkpoint has no tensor '{}'", dir_.string(), name));
  return {files_[it->second.first].get(), it->second.second};
}

std::vector<std::string> write_checkpoint(const std::filesystem::path& dir, std::vector<TensorToWrite> tensors,
                                          uint64_t max_shard_bytes, std::map<std::string, std::string> metadata) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw InputError(fmt::format("{}: cannot create the checkpoint directory: {}", dir.string(), ec.message()));

  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  uint64_t total_bytes = 0;
  for (const auto& t : tensors) total_bytes += t.data.size();

  std::vector<std::string> written;
  if (max_shard_bytes == 0 || total_bytes <= max_shard_bytes) {
    write_safetensors(dir / kSingleFileName, std::move(tensors), metadata);
    written.emplace_back(kSingleFileName);
  } else {
    // Greedy by name: a shard closes when the next tensor would push it past the limit;
    // a tensor larger than the limit gets a shard of its own.
    std::vector<std::vector<TensorToWrite>> shards(1);
    uint64_t shard_bytes = 0;
    for (auto& t : tensors) {
      if (!shards.back().empty() && shard_bytes + t.data.size() > max_shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shard_bytes += t.data.size();
      shards.back().push_back(std::move(t));
    }
    json weight_map = json::object();
    for (std::size_t i = 0; i < shards.size(); ++i) {
      const std::string file_name = shard_file_name(i, shards.size());
      for (const auto& t : shards[i]) weight_map[t.name] = file_name;
      write_safetensors(dir / file_name, std::move(shards[i]), metadata);
      written.push_back(file_name);
    }
    // Same layout as transformers' save_pretrained: sorted keys, indent 2, trailing newline.
    const json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", std::move(weight_map)}};
    write_file_atomic(dir / kIndexFileName, index.dump(2) + "\n");
    written.emplace_back(kIndexFileName);
  }

  // Files of an earlier layout would shadow or contradict the new one (model.safetensors wins over an
  // index): remove them now that the new files are complete.
  static const std::regex kShardPattern(R"(model-\d{5}-of-\d{5}\.safetensors)");
  std::vector<std::filesystem::path> stale;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name == kSingleFileName || name == kIndexFileName || std::regex_match(name, kShardPattern);
    if (ours && std::find(written.begin(), written.end(), name) == written.end()) stale.push_back(entry.path());
  }
  for (const auto& p : stale) std::filesystem::remove(p, ec);
  if (!stale.empty()) fsync_directory(dir);
  return written;
}

}  // namespace vlmopt::io
