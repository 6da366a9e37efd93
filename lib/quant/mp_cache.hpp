// MP-Cache: vlmopt's binary file of calibration parameters (scales, zero points,
// FP16 outlier-channel masks), laid out for a runtime to mmap and copy to a GPU.
// The byte-exact format is docs/mp-cache.md (design.md §4); this header is the
// in-memory model, the writer, the validating reader and the plan conversion.
#pragma once

#include "quant/scheme.hpp"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::quant {

// One group of up to 256 consecutive channels along a tensor's quantization axis.
// On disk: exactly these 40 bytes, each field little-endian.
struct MpCacheEntry {
  float scale = 1.0f;
  int32_t zero_point = 0;
  // Bit b of byte k set: channel k*8+b of the group stays FP16 (an outlier channel).
  std::array<uint8_t, 32> channel_mask{};

  bool masked(uint32_t channel_in_group) const {
    return (channel_mask[channel_in_group / 8] >> (channel_in_group % 8)) & 1u;
  }
  void set_masked(uint32_t channel_in_group) {
    channel_mask[channel_in_group / 8] = static_cast<uint8_t>(channel_mask[channel_in_group / 8] | (1u << (channel_in_group % 8)));
  }
  bool operator==(const MpCacheEntry&) const = default;
};
static_assert(sizeof(MpCacheEntry) == 40, "MP-Cache entries are exactly 40 bytes on disk");
static_assert(offsetof(MpCacheEntry, zero_point) == 4 && offsetof(MpCacheEntry, channel_mask) == 8);

enum class MpRole : uint8_t { kWeight = 0, kActivation = 1 };
// How the values these parameters dequantize are stored.
enum class MpQDType : uint8_t { kInt8 = 0, kInt4 = 1, kFp8E4M3 = 2 };

std::string_view to_string(MpRole role);      // "weight" | "activation"
std::string_view to_string(MpQDType qdtype);  // "int8" | "int4" | "fp8_e4m3"

// Maximum channels one entry covers (bits in channel_mask).
inline constexpr uint32_t kMpMaxGroupSize = 256;

// The parameters of one tensor: a Linear's weight [out, in] or its input activations [..., in].
//
// Entry indexing: the tensor is viewed as 2-D with the quantization axis of length
// `channels` and `rows` independent slices along the other dimension. Channel c of
// slice r uses entry  r * groups_per_row() + c / group_size,  and mask bit c % group_size
// of that entry. rows == 1 means every slice shares the same entries.
//   per-channel weights: axis 0, group_size 1, channels = out, rows 1
//   group weights (w4a16): axis 1, group_size G, channels = in, rows = out  (entry = row * ceil(in/G) + col/G)
//   per-tensor activations: axis -1, group_size 256, channels = in, rows 1 (one scale repeated)
struct MpCacheTensor {
  std::string name;  // canonical Linear name, e.g. model.language_model.layers.0.self_attn.q_proj
  MpRole role = MpRole::kWeight;
  MpQDType qdtype = MpQDType::kInt8;
  int32_t axis = 0;          // weights: 0 or 1 of [out, in]; activations: -1 (last dimension)
  uint32_t group_size = 1;   // channels per entry, 1..256
  uint64_t channels = 0;     // length of the quantization axis
  uint64_t rows = 1;         // slices with their own entries (see above)
  std::vector<MpCacheEntry> entries;

  uint64_t groups_per_row() const {  // 0 for an invalid group_size of 0
    return group_size == 0 ? 0 : channels / group_size + (channels % group_size != 0 ? 1 : 0);
  }
  uint64_t expected_entry_count() const { return rows * groups_per_row(); }  // callers check overflow
  // Masked (FP16) channels: bool [channels] when rows == 1, else [rows, channels].
  torch::Tensor mask_tensor() const;
  // float32 / int32 [rows, groups_per_row()], entry order.
  torch::Tensor scales() const;
  torch::Tensor zero_points() const;
  uint64_t masked_channel_count() const;

  bool operator==(const MpCacheTensor&) const = default;
};

struct MpCache {
  std::vector<MpCacheTensor> tensors;  // file order: weights and activations interleaved as given

  const MpCacheTensor* find(std::string_view name, MpRole role) const;  // nullptr if absent
  bool operator==(const MpCache&) const = default;
};

// Where things lie in a written or read file (byte offsets from the start of the file).
struct MpCacheLayout {
  uint32_t version = 0;
  uint64_t file_size = 0;
  uint64_t directory_offset = 0, directory_size = 0;
  uint64_t strings_offset = 0, strings_size = 0;
  uint64_t weight_offset = 0, weight_size = 0;
  uint64_t activation_offset = 0, activation_size = 0;
  std::string sha256;  // hex of the checksum field
};

inline constexpr std::string_view kMpCacheMagic{"VLMOMPC\0", 8};
inline constexpr uint32_t kMpCacheVersion = 1;
inline constexpr uint64_t kMpCacheHeaderSize = 128;
inline constexpr uint64_t kMpCacheDirectoryRecordSize = 56;
inline constexpr uint64_t kMpCacheSectionAlignment = 4096;

// Checks one tensor's invariants (what the reader checks after parsing, and the
// writer before writing). Throws InputError "<where>: tensor '<name>' (<role>): <field>: expected X, got Y".
void validate_mp_cache_tensor(const MpCacheTensor& tensor, std::string_view where);

// Writes atomically; deterministic (same MpCache, same bytes). Validates every tensor
// and (name, role) uniqueness first. Returns the layout written.
MpCacheLayout write_mp_cache(const std::filesystem::path& path, const MpCache& cache);

// Validates everything (docs/mp-cache.md "Reader validation") before trusting or
// allocating; one InputError "<path>: <field>: expected X, got Y" on the first problem.
MpCache read_mp_cache(const std::filesystem::path& path, MpCacheLayout* layout = nullptr);

// True when the file starts with the MP-Cache magic (false for short or unreadable files).
bool is_mp_cache_file(const std::filesystem::path& path);

// The MP-Cache a plan implies: per Linear, its weight parameters, and its static input
// activation parameters (QuantPlan's `input`, the range without the outlier channels)
// with mask bits set for `outlier_channels`. Throws InputError for what MP-Cache cannot
// hold (per-tensor weights, groups over 256 channels, shapes that disagree).
MpCache mp_cache_from_plan(const QuantPlan& plan);

// Summary for `vlmopt inspect`: tensors by role, dtypes, entry counts, outlier channels,
// scale ranges; section offsets when `layout` is given.
nlohmann::json summarize_mp_cache(const MpCache& cache, const MpCacheLayout* layout = nullptr);

}  // namespace vlmopt::quant
