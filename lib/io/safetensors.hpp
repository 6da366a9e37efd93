// safetensors reading (memory-mapped, validated before anything is trusted) and
// writing (padded header, deterministic order, atomic temp + fsync + rename).
// Format and validity rules: docs/reference.md §1. This header is torch-free.
#pragma once

#include "io/dtype.hpp"

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::io {

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data buffer
  uint64_t end = 0;
  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

// Read-only, memory-mapped safetensors file. Every rule of reference.md §1 is
// checked in open(); a violation throws InputError "<path>: <what>".
class SafetensorsFile {
 public:
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;

  static std::shared_ptr<const SafetensorsFile> open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Tensors in header order sorted by name (deterministic).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(std::string_view name) const;  // nullptr if absent
  const TensorInfo& at(std::string_view name) const;    // throws InputError if absent
  // Raw little-endian bytes of one tensor; not necessarily aligned.
  std::span<const std::byte> bytes(const TensorInfo& info) const;
  // Drops the mapped pages of one tensor from this process's resident set
  // (madvise MADV_DONTNEED; the data is read again from the file if touched).
  // Layer-by-layer calibration calls it after copying a layer's weights, so
  // file-backed pages do not make peak RSS grow with depth.
  void release_pages(const TensorInfo& info) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t file_size() const { return file_size_; }

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  const std::byte* map_ = nullptr;
  uint64_t file_size_ = 0;
  uint64_t data_start_ = 0;  // 8 + header length
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> position_;  // name -> index in tensors_
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: name, dtype, shape, and its bytes (little-endian, contiguous).
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;
};

// Writes a safetensors file atomically. Tensors are written sorted by name;
// the header is padded with spaces to a multiple of 8; `metadata` always gets
// "format": "pt" unless it sets "format" itself. Throws on duplicate names or
// data sizes that disagree with shape * dtype.
void write_safetensors(const std::filesystem::path& path, std::vector<TensorToWrite> tensors,
                       std::map<std::string, std::string> metadata = {});

// A checkpoint directory: model.safetensors, or model.safetensors.index.json
// with its shards. Tensor names are unique across shards (checked).
class Checkpoint {
 public:
  // `dir` may also be a single .safetensors file. model.safetensors wins over an
  // index when both exist (as in transformers). The index is validated: weight_map
  // is an object of plain file names that exist, every name in it is in the file it
  // names, no tensor is in two shards; tensors a shard holds beyond weight_map are
  // included. Errors are InputError "<index path>: field 'weight_map.<name>': ...".
  static Checkpoint open(const std::filesystem::path& dir);
  const std::filesystem::path& dir() const { return dir_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(std::string_view name) const;
  // The file holding `name` and its info; throws InputError naming the checkpoint if absent.
  std::pair<const SafetensorsFile*, const TensorInfo*> locate(std::string_view name) const;
  const std::vector<std::shared_ptr<const SafetensorsFile>>& files() const { return files_; }

 private:
  std::filesystem::path dir_;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::map<std::string, std::pair<std::size_t, const TensorInfo*>, std::less<>> by_name_;
};

// Writes tensors as one file, or as shards `model-0000i-of-0000n.safetensors`
// plus model.safetensors.index.json when the total exceeds `max_shard_bytes`
// (0: never shard). Shards are filled greedily in name order; a tensor larger than
// the limit gets a shard of its own. The index has metadata.total_size (sum of
// tensor bytes) and weight_map, written like save_pretrained (sorted, indent 2).
// Creates `dir` if needed; afterwards removes model.safetensors / index / shard
// files of an earlier layout that were not written now. Each file is atomic.
// Returns the file names written (relative to dir), the index last.
std::vector<std::string> write_checkpoint(const std::filesystem::path& dir, std::vector<TensorToWrite> tensors,
                                          uint64_t max_shard_bytes,
                                          std::map<std::string, std::string> metadata = {});

}  // namespace vlmopt::io
