#include "quant/mp_cache.hpp"

#include "io/atomic_file.hpp"
#include "io/hash.hpp"
#include "util/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace vlmopt::quant {
namespace {

static_assert(std::endian::native == std::endian::little, "MP-Cache fields are little-endian; big-endian hosts need byte swapping");

// Header field offsets (docs/mp-cache.md "Header").
constexpr std::size_t kOffMagic = 0;
constexpr std::size_t kOffVersion = 8;
constexpr std::size_t kOffHeaderSize = 12;
constexpr std::size_t kOffFileSize = 16;
constexpr std::size_t kOffTensorCount = 24;
constexpr std::size_t kOffFlags = 28;
constexpr std::size_t kOffDirectoryOffset = 32;
constexpr std::size_t kOffDirectorySize = 40;
constexpr std::size_t kOffStringsOffset = 48;
constexpr std::size_t kOffStringsSize = 56;
constexpr std::size_t kOffWeightOffset = 64;
constexpr std::size_t kOffWeightSize = 72;
constexpr std::size_t kOffActivationOffset = 80;
constexpr std::size_t kOffActivationSize = 88;
constexpr std::size_t kOffChecksum = 96;
constexpr std::size_t kChecksumSize = 32;
static_assert(kOffChecksum + kChecksumSize == kMpCacheHeaderSize);

// Directory record field offsets (docs/mp-cache.md "Tensor directory").
constexpr std::size_t kRecNameOffset = 0;
constexpr std::size_t kRecNameLength = 4;
constexpr std::size_t kRecRole = 8;
constexpr std::size_t kRecQDType = 9;
constexpr std::size_t kRecReserved16 = 10;
constexpr std::size_t kRecAxis = 12;
constexpr std::size_t kRecGroupSize = 16;
constexpr std::size_t kRecReserved32 = 20;
constexpr std::size_t kRecChannels = 24;
constexpr std::size_t kRecRows = 32;
constexpr std::size_t kRecEntryCount = 40;
constexpr std::size_t kRecEntryOffset = 48;
static_assert(kRecEntryOffset + 8 == kMpCacheDirectoryRecordSize);

constexpr uint64_t kEntrySize = sizeof(MpCacheEntry);
constexpr uint32_t kMaxNameBytes = 4096;
// Files are read whole (the entries are copied out anyway); refuse absurd sizes up front.
constexpr uint64_t kMaxFileBytes = uint64_t{16} << 30;

template <typename T>
void put(std::string& buf, std::size_t offset, T value) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::memcpy(buf.data() + offset, &value, sizeof(T));
}

template <typename T>
T get(std::string_view buf, std::size_t offset) {
  T value;
  std::memcpy(&value, buf.data() + offset, sizeof(T));
  return value;
}

uint64_t align_up(uint64_t value, uint64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

[[noreturn]] void throw_field(std::string_view where, std::string_view field, const std::string& expected,
                              const std::string& got) {
  throw InputError(fmt::format("{}: {}: expected {}, got {}", where, field, expected, got));
}

std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  uint64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

std::optional<uint64_t> checked_add(uint64_t a, uint64_t b) {
  uint64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// Decodes UTF-8 and refuses control characters; returns the problem or "".
std::string name_problem(std::string_view name) {
  if (name.empty()) return "a non-empty name";
  if (name.size() > kMaxNameBytes) return fmt::format("at most {} bytes", kMaxNameBytes);
  std::size_t i = 0;
  while (i < name.size()) {
    const auto lead = static_cast<unsigned char>(name[i]);
    uint32_t cp = 0;
    std::size_t len = 0;
    if (lead < 0x80) {
      cp = lead;
      len = 1;
    } else if ((lead & 0xE0) == 0xC0) {
      cp = lead & 0x1F;
      len = 2;
    } else if ((lead & 0xF0) == 0xE0) {
      cp = lead & 0x0F;
      len = 3;
    } else if ((lead & 0xF8) == 0xF0) {
      cp = lead & 0x07;
      len = 4;
    } else {
      return fmt::format("valid UTF-8 (bad lead byte 0x{:02x} at byte {})", lead, i);
    }
    if (i + len > name.size()) return fmt::format("valid UTF-8 (truncated sequence at byte {})", i);
    for (std::size_t k = 1; k < len; ++k) {
      const auto cont = static_cast<unsigned char>(name[i + k]);
      if ((cont & 0xC0) != 0x80) return fmt::format("valid UTF-8 (bad continuation byte at byte {})", i + k);
      cp = (cp << 6) | (cont & 0x3F);
    }
    static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return fmt::format("valid UTF-8 (overlong or invalid code point at byte {})", i);
    }
    if (cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp < 0xA0)) {
      return fmt::format("printable characters (control character U+{:04X} at byte {})", cp, i);
    }
    i += len;
  }
  return "";
}

// What a name looks like in a message: printable ASCII kept, everything else escaped, shortened.
std::string shown_name(std::string_view name) {
  std::string out;
  for (char c : name.substr(0, 120)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7F) {
      out.push_back(c);
    } else {
      out += fmt::format("\\x{:02x}", u);
    }
  }
  if (name.size() > 120) out += "...";
  return out;
}

std::pair<int64_t, int64_t> zero_point_range(MpQDType qdtype) {
  switch (qdtype) {
    case MpQDType::kInt8: return {-128, 127};
    case MpQDType::kInt4: return {-8, 7};
    case MpQDType::kFp8E4M3: return {0, 0};  // fp8 is symmetric only
  }
  return {0, 0};
}

std::string quoted_bytes(std::string_view bytes) {
  std::string out = "\"";
  for (char c : bytes) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7F && c != '"' && c != '\\') {
      out.push_back(c);
    } else {
      out += fmt::format("\\x{:02x}", u);
    }
  }
  return out + "\"";
}

std::string hex_of(std::string_view bytes) {
  std::string out;
  for (char c : bytes) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return out;
}

std::string bytes_of_hex(std::string_view hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

// SHA-256 of the whole file with the checksum field read as zeros (`bytes` is modified and restored).
std::string file_checksum_hex(std::string& bytes) {
  std::string stored = bytes.substr(kOffChecksum, kChecksumSize);
  std::memset(bytes.data() + kOffChecksum, 0, kChecksumSize);
  std::string digest = io::sha256_hex(std::string_view(bytes));
  std::memcpy(bytes.data() + kOffChecksum, stored.data(), kChecksumSize);
  return digest;
}

struct Region {
  std::string_view name;
  uint64_t offset;
  uint64_t size;
};

}  // namespace

std::string_view to_string(MpRole role) { return role == MpRole::kWeight ? "weight" : "activation"; }

std::string_view to_string(MpQDType qdtype) {
  switch (qdtype) {
    case MpQDType::kInt8: return "int8";
    case MpQDType::kInt4: return "int4";
    case MpQDType::kFp8E4M3: return "fp8_e4m3";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// In-memory model

torch::Tensor MpCacheTensor::mask_tensor() const {
  VLMOPT_CHECK(entries.size() == expected_entry_count(), "entries {} for {} rows x {} groups", entries.size(), rows,
               groups_per_row());
  auto mask = torch::zeros({static_cast<int64_t>(rows), static_cast<int64_t>(channels)}, torch::kBool);
  auto* out = mask.data_ptr<bool>();
  const uint64_t groups = groups_per_row();
  for (uint64_t r = 0; r < rows; ++r) {
    for (uint64_t c = 0; c < channels; ++c) {
      out[r * channels + c] = entries[r * groups + c / group_size].masked(static_cast<uint32_t>(c % group_size));
    }
  }
  return rows == 1 ? mask.reshape({static_cast<int64_t>(channels)}) : mask;
}

torch::Tensor MpCacheTensor::scales() const {
  VLMOPT_CHECK(entries.size() == expected_entry_count(), "entries {} for {} rows x {} groups", entries.size(), rows,
               groups_per_row());
  auto out = torch::empty({static_cast<int64_t>(rows), static_cast<int64_t>(groups_per_row())}, torch::kFloat32);
  auto* p = out.data_ptr<float>();
  for (std::size_t i = 0; i < entries.size(); ++i) p[i] = entries[i].scale;
  return out;
}

torch::Tensor MpCacheTensor::zero_points() const {
  VLMOPT_CHECK(entries.size() == expected_entry_count(), "entries {} for {} rows x {} groups", entries.size(), rows,
               groups_per_row());
  auto out = torch::empty({static_cast<int64_t>(rows), static_cast<int64_t>(groups_per_row())}, torch::kInt32);
  auto* p = out.data_ptr<int32_t>();
  for (std::size_t i = 0; i < entries.size(); ++i) p[i] = entries[i].zero_point;
  return out;
}

uint64_t MpCacheTensor::masked_channel_count() const {
  uint64_t n = 0;
  for (const auto& e : entries)
    for (uint8_t byte : e.channel_mask) n += static_cast<uint64_t>(std::popcount(byte));
  return n;
}

const MpCacheTensor* MpCache::find(std::string_view name, MpRole role) const {
  for (const auto& t : tensors)
    if (t.role == role && t.name == name) return &t;
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Validation shared by writer and reader

void validate_mp_cache_tensor(const MpCacheTensor& t, std::string_view where) {
  const std::string who = fmt::format("{}: tensor '{}' ({})", where, shown_name(t.name), to_string(t.role));
  const auto fail = [&](std::string_view field, const std::string& expected, const std::string& got) {
    throw_field(who, field, expected, got);
  };
  if (const auto problem = name_problem(t.name); !problem.empty()) fail("name", problem, fmt::format("\"{}\"", shown_name(t.name)));
  if (t.role != MpRole::kWeight && t.role != MpRole::kActivation) {
    fail("role", "0 (weight) or 1 (activation)", std::to_string(static_cast<int>(t.role)));
  }
  if (t.qdtype != MpQDType::kInt8 && t.qdtype != MpQDType::kInt4 && t.qdtype != MpQDType::kFp8E4M3) {
    fail("qdtype", "0 (int8), 1 (int4) or 2 (fp8_e4m3)", std::to_string(static_cast<int>(t.qdtype)));
  }
  if (t.role == MpRole::kWeight && t.axis != 0 && t.axis != 1) fail("axis", "0 or 1 for a weight", std::to_string(t.axis));
  if (t.role == MpRole::kActivation && t.axis != -1) fail("axis", "-1 for activations", std::to_string(t.axis));
  if (t.group_size < 1 || t.group_size > kMpMaxGroupSize) {
    fail("group_size", fmt::format("1..{}", kMpMaxGroupSize), std::to_string(t.group_size));
  }
  if (t.channels < 1) fail("channels", "at least 1", std::to_string(t.channels));
  if (t.rows < 1) fail("rows", "at least 1", std::to_string(t.rows));
  if (t.role == MpRole::kActivation && t.rows != 1) fail("rows", "1 for activations", std::to_string(t.rows));
  const auto expected_entries = checked_mul(t.rows, t.groups_per_row());
  if (!expected_entries) fail("rows", "rows * ceil(channels / group_size) within 64 bits", std::to_string(t.rows));
  if (t.entries.size() != *expected_entries) {
    fail("entry_count", fmt::format("{} (rows {} * ceil({} channels / group_size {}))", *expected_entries, t.rows,
                                    t.channels, t.group_size),
         std::to_string(t.entries.size()));
  }
  const auto [zp_min, zp_max] = zero_point_range(t.qdtype);
  const uint64_t groups = t.groups_per_row();
  for (std::size_t i = 0; i < t.entries.size(); ++i) {
    const auto& e = t.entries[i];
    if (!std::isfinite(e.scale) || !(e.scale > 0.0f)) {
      fail(fmt::format("entries[{}].scale", i), "a finite value > 0", fmt::format("{}", e.scale));
    }
    if (e.zero_point < zp_min || e.zero_point > zp_max) {
      fail(fmt::format("entries[{}].zero_point", i), fmt::format("{}..{} for {}", zp_min, zp_max, to_string(t.qdtype)),
           std::to_string(e.zero_point));
    }
    // Bits past the channels this group covers must be clear (the last group may be partial).
    const uint64_t group = i % groups;
    const uint64_t width = std::min<uint64_t>(t.group_size, t.channels - group * t.group_size);
    for (uint64_t byte = width / 8; byte < e.channel_mask.size(); ++byte) {
      // Bits of this byte at or past `width` (all of them for bytes wholly past it).
      const unsigned first = byte * 8 >= width ? 0u : static_cast<unsigned>(width - byte * 8);
      const unsigned stray = e.channel_mask[byte] & (0xFFu << first) & 0xFFu;
      if (stray != 0) {
        fail(fmt::format("entries[{}].channel_mask", i), fmt::format("only bits 0..{} set (group of {} channels)", width - 1, width),
             fmt::format("bit {}", byte * 8 + static_cast<uint64_t>(std::countr_zero(stray))));
      }
    }
  }
}

namespace {

void check_unique(const std::vector<MpCacheTensor>& tensors, std::string_view where) {
  std::set<std::pair<std::string_view, MpRole>> seen;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!seen.emplace(tensors[i].name, tensors[i].role).second) {
      throw InputError(fmt::format("{}: directory[{}].name: expected a (name, role) pair not used before, got '{}' ({}) twice",
                                   where, i, shown_name(tensors[i].name), to_string(tensors[i].role)));
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Writing

MpCacheLayout write_mp_cache(const std::filesystem::path& path, const MpCache& cache) {
  const std::string where = path.string();
  for (const auto& t : cache.tensors) validate_mp_cache_tensor(t, where);
  check_unique(cache.tensors, where);
  VLMOPT_CHECK_INPUT(cache.tensors.size() <= std::numeric_limits<uint32_t>::max(),
                     "{}: tensor_count: expected at most {}, got {}", where, std::numeric_limits<uint32_t>::max(),
                     cache.tensors.size());

  MpCacheLayout layout;
  layout.version = kMpCacheVersion;
  layout.directory_offset = kMpCacheHeaderSize;
  layout.directory_size = cache.tensors.size() * kMpCacheDirectoryRecordSize;
  layout.strings_offset = layout.directory_offset + layout.directory_size;
  for (const auto& t : cache.tensors) layout.strings_size += t.name.size();
  layout.weight_offset = align_up(layout.strings_offset + layout.strings_size, kMpCacheSectionAlignment);
  for (const auto& t : cache.tensors)
    if (t.role == MpRole::kWeight) layout.weight_size += t.entries.size() * kEntrySize;
  layout.activation_offset = align_up(layout.weight_offset + layout.weight_size, kMpCacheSectionAlignment);
  for (const auto& t : cache.tensors)
    if (t.role == MpRole::kActivation) layout.activation_size += t.entries.size() * kEntrySize;
  layout.file_size = layout.activation_offset + layout.activation_size;

  // The whole file is built in memory: the checksum covers everything, and the
  // parameters of even large models are a few hundred MB at most.
  std::string bytes(layout.file_size, '\0');
  std::memcpy(bytes.data() + kOffMagic, kMpCacheMagic.data(), kMpCacheMagic.size());
  put<uint32_t>(bytes, kOffVersion, kMpCacheVersion);
  put<uint32_t>(bytes, kOffHeaderSize, static_cast<uint32_t>(kMpCacheHeaderSize));
  put<uint64_t>(bytes, kOffFileSize, layout.file_size);
  put<uint32_t>(bytes, kOffTensorCount, static_cast<uint32_t>(cache.tensors.size()));
  put<uint32_t>(bytes, kOffFlags, 0);
  put<uint64_t>(bytes, kOffDirectoryOffset, layout.directory_offset);
  put<uint64_t>(bytes, kOffDirectorySize, layout.directory_size);
  put<uint64_t>(bytes, kOffStringsOffset, layout.strings_offset);
  put<uint64_t>(bytes, kOffStringsSize, layout.strings_size);
  put<uint64_t>(bytes, kOffWeightOffset, layout.weight_offset);
  put<uint64_t>(bytes, kOffWeightSize, layout.weight_size);
  put<uint64_t>(bytes, kOffActivationOffset, layout.activation_offset);
  put<uint64_t>(bytes, kOffActivationSize, layout.activation_size);

  uint64_t name_cursor = 0;
  uint64_t section_cursor[2] = {0, 0};  // bytes used so far in the weight / activation section
  for (std::size_t i = 0; i < cache.tensors.size(); ++i) {
    const auto& t = cache.tensors[i];
    const std::size_t rec = layout.directory_offset + i * kMpCacheDirectoryRecordSize;
    const auto role_index = static_cast<std::size_t>(t.role);
    put<uint32_t>(bytes, rec + kRecNameOffset, static_cast<uint32_t>(name_cursor));
    put<uint32_t>(bytes, rec + kRecNameLength, static_cast<uint32_t>(t.name.size()));
    put<uint8_t>(bytes, rec + kRecRole, static_cast<uint8_t>(t.role));
    put<uint8_t>(bytes, rec + kRecQDType, static_cast<uint8_t>(t.qdtype));
    put<uint16_t>(bytes, rec + kRecReserved16, 0);
    put<int32_t>(bytes, rec + kRecAxis, t.axis);
    put<uint32_t>(bytes, rec + kRecGroupSize, t.group_size);
    put<uint32_t>(bytes, rec + kRecReserved32, 0);
    put<uint64_t>(bytes, rec + kRecChannels, t.channels);
    put<uint64_t>(bytes, rec + kRecRows, t.rows);
    put<uint64_t>(bytes, rec + kRecEntryCount, t.entries.size());
    put<uint64_t>(bytes, rec + kRecEntryOffset, section_cursor[role_index]);
    std::memcpy(bytes.data() + layout.strings_offset + name_cursor, t.name.data(), t.name.size());
    name_cursor += t.name.size();
    const uint64_t section = t.role == MpRole::kWeight ? layout.weight_offset : layout.activation_offset;
    std::size_t at = section + section_cursor[role_index];
    for (const auto& e : t.entries) {
      put<float>(bytes, at, e.scale);
      put<int32_t>(bytes, at + 4, e.zero_point);
      std::memcpy(bytes.data() + at + 8, e.channel_mask.data(), e.channel_mask.size());
      at += kEntrySize;
    }
    section_cursor[role_index] += t.entries.size() * kEntrySize;
  }
  // Checksum field is zero while hashing (the std::string started zeroed).
  layout.sha256 = io::sha256_hex(std::string_view(bytes));
  const std::string digest = bytes_of_hex(layout.sha256);
  std::memcpy(bytes.data() + kOffChecksum, digest.data(), kChecksumSize);

  io::write_file_atomic(path, std::string_view(bytes));
  return layout;
}

// ---------------------------------------------------------------------------------------------
// Reading

bool is_mp_cache_file(const std::filesystem::path& path) {
  try {
    const io::UniqueFd fd = io::open_regular_file(path);
    char magic[8];
    std::size_t filled = 0;
    while (filled < sizeof magic) {
      const ssize_t n = ::read(fd.get(), magic + filled, sizeof magic - filled);
      if (n <= 0) return false;
      filled += static_cast<std::size_t>(n);
    }
    return std::string_view(magic, sizeof magic) == kMpCacheMagic;
  } catch (const InputError&) {
    return false;
  }
}

MpCache read_mp_cache(const std::filesystem::path& path, MpCacheLayout* layout_out) {
  const std::string where = path.string();
  const auto fail = [&](std::string_view field, const std::string& expected, const std::string& got) {
    throw_field(where, field, expected, got);
  };
  std::string bytes = io::read_whole_file(path, kMaxFileBytes);
  const uint64_t size = bytes.size();
  const std::string_view view(bytes);

  // --- header
  if (size < kMpCacheHeaderSize) {
    fail("header", fmt::format("at least {} bytes (truncated header)", kMpCacheHeaderSize), fmt::format("{} bytes", size));
  }
  if (view.substr(kOffMagic, 8) != kMpCacheMagic) {
    fail("header.magic", quoted_bytes(kMpCacheMagic), quoted_bytes(view.substr(kOffMagic, 8)));
  }
  const auto version = get<uint32_t>(view, kOffVersion);
  if (version != kMpCacheVersion) fail("header.version", std::to_string(kMpCacheVersion), std::to_string(version));
  const auto header_size = get<uint32_t>(view, kOffHeaderSize);
  if (header_size != kMpCacheHeaderSize) fail("header.header_size", std::to_string(kMpCacheHeaderSize), std::to_string(header_size));
  const auto recorded_size = get<uint64_t>(view, kOffFileSize);
  if (recorded_size != size) {
    fail("header.file_size", fmt::format("{} (the size on disk; truncated or extended file?)", size), std::to_string(recorded_size));
  }
  const auto flags = get<uint32_t>(view, kOffFlags);
  if (flags != 0) fail("header.flags", "0 (no flags are defined in version 1)", fmt::format("0x{:08x}", flags));
  const uint64_t tensor_count = get<uint32_t>(view, kOffTensorCount);

  MpCacheLayout layout;
  layout.version = version;
  layout.file_size = size;
  layout.directory_offset = get<uint64_t>(view, kOffDirectoryOffset);
  layout.directory_size = get<uint64_t>(view, kOffDirectorySize);
  layout.strings_offset = get<uint64_t>(view, kOffStringsOffset);
  layout.strings_size = get<uint64_t>(view, kOffStringsSize);
  layout.weight_offset = get<uint64_t>(view, kOffWeightOffset);
  layout.weight_size = get<uint64_t>(view, kOffWeightSize);
  layout.activation_offset = get<uint64_t>(view, kOffActivationOffset);
  layout.activation_size = get<uint64_t>(view, kOffActivationSize);
  layout.sha256 = hex_of(view.substr(kOffChecksum, kChecksumSize));

  // --- regions: every count and offset against the file size, before anything is allocated
  const auto expected_dir = checked_mul(tensor_count, kMpCacheDirectoryRecordSize);
  if (layout.directory_size != *expected_dir) {  // tensor_count < 2^32, so no overflow
    fail("header.directory_size", fmt::format("{} (tensor_count {} * {} bytes)", *expected_dir, tensor_count,
                                              kMpCacheDirectoryRecordSize),
         std::to_string(layout.directory_size));
  }
  const auto check_region = [&](std::string_view name, uint64_t offset, uint64_t region_size, uint64_t alignment) {
    if (offset % alignment != 0) {
      fail(fmt::format("header.{}_offset", name), fmt::format("a multiple of {}", alignment), std::to_string(offset));
    }
    if (offset < kMpCacheHeaderSize && region_size > 0) {
      fail(fmt::format("header.{}_offset", name), fmt::format("at least {} (after the header)", kMpCacheHeaderSize),
           std::to_string(offset));
    }
    const auto end = checked_add(offset, region_size);
    if (!end || *end > size) {
      fail(fmt::format("header.{}", name), fmt::format("a range inside the file's {} bytes", size),
           fmt::format("[{}, {})", offset, end ? std::to_string(*end) : std::string("past 2^64")));
    }
  };
  check_region("directory", layout.directory_offset, layout.directory_size, 8);
  check_region("strings", layout.strings_offset, layout.strings_size, 1);
  check_region("weight", layout.weight_offset, layout.weight_size, kMpCacheSectionAlignment);
  check_region("activation", layout.activation_offset, layout.activation_size, kMpCacheSectionAlignment);
  if (layout.weight_size % kEntrySize != 0) {
    fail("header.weight_size", fmt::format("a multiple of {} (whole entries)", kEntrySize), std::to_string(layout.weight_size));
  }
  if (layout.activation_size % kEntrySize != 0) {
    fail("header.activation_size", fmt::format("a multiple of {} (whole entries)", kEntrySize),
         std::to_string(layout.activation_size));
  }
  std::vector<Region> regions = {{"header", 0, kMpCacheHeaderSize},
                                 {"directory", layout.directory_offset, layout.directory_size},
                                 {"strings", layout.strings_offset, layout.strings_size},
                                 {"weight", layout.weight_offset, layout.weight_size},
                                 {"activation", layout.activation_offset, layout.activation_size}};
  std::erase_if(regions, [](const Region& r) { return r.size == 0; });
  // Stable: among regions starting at the same offset, the later one in file order is reported.
  std::stable_sort(regions.begin(), regions.end(), [](const Region& a, const Region& b) { return a.offset < b.offset; });
  for (std::size_t i = 1; i < regions.size(); ++i) {
    const auto& prev = regions[i - 1];
    const auto& cur = regions[i];
    if (cur.offset < prev.offset + prev.size) {
      fail(fmt::format("header.{}_offset", cur.name),
           fmt::format("a region not overlapping {} [{}, {})", prev.name, prev.offset, prev.offset + prev.size),
           fmt::format("[{}, {})", cur.offset, cur.offset + cur.size));
    }
  }

  // --- checksum (before any directory content is believed)
  const std::string actual = file_checksum_hex(bytes);
  if (actual != layout.sha256) fail("header.checksum", fmt::format("sha256 {}", actual), layout.sha256);

  // --- directory
  MpCache cache;
  cache.tensors.reserve(tensor_count);  // bounded: the directory fits in the file
  const std::string_view strings = view.substr(layout.strings_offset, layout.strings_size);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    const std::size_t rec = layout.directory_offset + i * kMpCacheDirectoryRecordSize;
    const std::string field = fmt::format("directory[{}]", i);
    const auto name_offset = get<uint32_t>(view, rec + kRecNameOffset);
    const auto name_length = get<uint32_t>(view, rec + kRecNameLength);
    if (uint64_t{name_offset} + name_length > layout.strings_size) {
      fail(field + ".name_offset", fmt::format("a name inside the {}-byte string table", layout.strings_size),
           fmt::format("[{}, {})", name_offset, uint64_t{name_offset} + name_length));
    }
    MpCacheTensor t;
    t.name = std::string(strings.substr(name_offset, name_length));
    if (const auto problem = name_problem(t.name); !problem.empty()) {
      fail(field + ".name", problem, fmt::format("\"{}\"", shown_name(t.name)));
    }
    const std::string who = fmt::format("{} '{}'", field, shown_name(t.name));
    const auto role = get<uint8_t>(view, rec + kRecRole);
    if (role > 1) fail(who + ".role", "0 (weight) or 1 (activation)", std::to_string(role));
    t.role = static_cast<MpRole>(role);
    const auto qdtype = get<uint8_t>(view, rec + kRecQDType);
    if (qdtype > 2) fail(who + ".qdtype", "0 (int8), 1 (int4) or 2 (fp8_e4m3)", std::to_string(qdtype));
    t.qdtype = static_cast<MpQDType>(qdtype);
    if (get<uint16_t>(view, rec + kRecReserved16) != 0 || get<uint32_t>(view, rec + kRecReserved32) != 0) {
      fail(who + ".reserved", "zero bytes", fmt::format("0x{:04x} / 0x{:08x}", get<uint16_t>(view, rec + kRecReserved16),
                                                          get<uint32_t>(view, rec + kRecReserved32)));
    }
    t.axis = get<int32_t>(view, rec + kRecAxis);
    t.group_size = get<uint32_t>(view, rec + kRecGroupSize);
    if (t.group_size < 1 || t.group_size > kMpMaxGroupSize) {
      fail(who + ".group_size", fmt::format("1..{}", kMpMaxGroupSize), std::to_string(t.group_size));
    }
    t.channels = get<uint64_t>(view, rec + kRecChannels);
    t.rows = get<uint64_t>(view, rec + kRecRows);
    const auto entry_count = get<uint64_t>(view, rec + kRecEntryCount);
    const auto entry_offset = get<uint64_t>(view, rec + kRecEntryOffset);
    const auto expected_entries = checked_mul(t.rows, t.groups_per_row());
    if (!expected_entries || entry_count != *expected_entries) {
      fail(who + ".entry_count",
           expected_entries ? fmt::format("{} (rows {} * ceil({} channels / group_size {}))", *expected_entries, t.rows,
                                          t.channels, t.group_size)
                            : std::string("rows * ceil(channels / group_size) within 64 bits"),
           std::to_string(entry_count));
    }
    const uint64_t section_offset = t.role == MpRole::kWeight ? layout.weight_offset : layout.activation_offset;
    const uint64_t section_size = t.role == MpRole::kWeight ? layout.weight_size : layout.activation_size;
    if (entry_offset % kEntrySize != 0) {
      fail(who + ".entry_offset", fmt::format("a multiple of {}", kEntrySize), std::to_string(entry_offset));
    }
    const auto entry_bytes = checked_mul(entry_count, kEntrySize);
    const auto entry_end = entry_bytes ? checked_add(entry_offset, *entry_bytes) : std::nullopt;
    if (!entry_end || *entry_end > section_size) {
      fail(who + ".entry_offset", fmt::format("entries inside the {} section's {} bytes", to_string(t.role), section_size),
           fmt::format("[{}, {})", entry_offset, entry_end ? std::to_string(*entry_end) : std::string("overflow")));
    }
    t.entries.resize(entry_count);  // bounded by the section, which lies inside the file
    for (uint64_t k = 0; k < entry_count; ++k) {
      const std::size_t at = section_offset + entry_offset + k * kEntrySize;
      auto& e = t.entries[k];
      e.scale = get<float>(view, at);
      e.zero_point = get<int32_t>(view, at + 4);
      std::memcpy(e.channel_mask.data(), view.data() + at + 8, e.channel_mask.size());
    }
    validate_mp_cache_tensor(t, where);
    cache.tensors.push_back(std::move(t));
  }
  check_unique(cache.tensors, where);
  if (layout_out != nullptr) *layout_out = layout;
  return cache;
}

// ---------------------------------------------------------------------------------------------
// From a QuantPlan

namespace {

MpQDType qdtype_of(const QuantArgs& args, std::string_view what) {
  if (args.type == QuantType::kInt && args.num_bits == 8) return MpQDType::kInt8;
  if (args.type == QuantType::kInt && args.num_bits == 4) return MpQDType::kInt4;
  if (args.type == QuantType::kFloat && args.num_bits == 8) return MpQDType::kFp8E4M3;
  throw InputError(fmt::format("quant plan: {}: expected int8, int4 or fp8 (8-bit float), got {} {}-bit", what,
                               args.type == QuantType::kInt ? "int" : "float", args.num_bits));
}

std::string shape_text(const torch::Tensor& t) {
  return t.defined() ? fmt::format("[{}]", fmt::join(t.sizes(), ", ")) : "undefined";
}

// Flattened float32 / int32 CPU copies of scale and zero point (zero when no zero point is stored).
std::pair<std::vector<float>, std::vector<int32_t>> flat_params(const QParams& p) {
  const auto scale = p.scale.to(torch::kCPU, torch::kFloat32).contiguous().reshape({-1});
  std::vector<float> scales(scale.data_ptr<float>(), scale.data_ptr<float>() + scale.numel());
  std::vector<int32_t> zps(scales.size(), 0);
  if (p.zero_point.defined()) {
    const auto zp = p.zero_point.to(torch::kCPU, torch::kInt32).contiguous().reshape({-1});
    VLMOPT_CHECK_INPUT(zp.numel() == scale.numel(), "quant plan: zero_point: expected {} values like the scale, got {}",
                       scale.numel(), zp.numel());
    std::copy(zp.data_ptr<int32_t>(), zp.data_ptr<int32_t>() + zp.numel(), zps.begin());
  }
  return {std::move(scales), std::move(zps)};
}

}  // namespace

MpCache mp_cache_from_plan(const QuantPlan& plan) {
  MpCache cache;
  const auto& wargs = plan.scheme.weights;
  for (const auto& layer : plan.layers) {
    const std::string who = fmt::format("quant plan: layer '{}'", layer.name);
    const auto& scale = layer.weight.scale;
    VLMOPT_CHECK_INPUT(scale.defined(), "{}: weight scale: expected a tensor, got undefined", who);
    const int64_t in_features = layer.outlier_channels.defined() ? layer.outlier_channels.numel() : -1;

    MpCacheTensor w;
    w.name = layer.name;
    w.role = MpRole::kWeight;
    w.qdtype = qdtype_of(wargs, who + ": weights");
    switch (wargs.strategy) {
      case Strategy::kChannel:
        // [out, 1]: one entry per output channel, group of 1 along axis 0.
        VLMOPT_CHECK_INPUT(scale.dim() == 1 || (scale.dim() == 2 && scale.size(1) == 1),
                           "{}: weight scale: expected [out, 1] for per-channel weights, got {}", who, shape_text(scale));
        w.axis = 0;
        w.group_size = 1;
        w.channels = static_cast<uint64_t>(scale.size(0));
        w.rows = 1;
        break;
      case Strategy::kGroup: {
        // [out, groups]: entry row * groups + g covers input columns [g*G, min((g+1)*G, in)).
        const int64_t group = wargs.group_size;
        VLMOPT_CHECK_INPUT(group >= 1 && group <= kMpMaxGroupSize,
                           "{}: weights group_size: expected 1..{} (one MP-Cache entry per group), got {}", who,
                           kMpMaxGroupSize, group);
        VLMOPT_CHECK_INPUT(scale.dim() == 2, "{}: weight scale: expected [out, in/group_size], got {}", who, shape_text(scale));
        const int64_t groups = scale.size(1);
        const int64_t in = in_features >= 0 ? in_features : groups * group;
        VLMOPT_CHECK_INPUT((in + group - 1) / group == groups,
                           "{}: weight scale: expected {} groups (ceil({} input channels / {})), got {}", who,
                           (in + group - 1) / group, in, group, groups);
        w.axis = 1;
        w.group_size = static_cast<uint32_t>(group);
        w.channels = static_cast<uint64_t>(in);
        w.rows = static_cast<uint64_t>(scale.size(0));
        break;
      }
      case Strategy::kTensor:
        throw InputError(fmt::format("{}: weights strategy: expected channel or group (MP-Cache entries need the axis "
                                     "length, which a per-tensor scale does not give), got tensor",
                                     who));
    }
    const auto [scales, zps] = flat_params(layer.weight);
    w.entries.resize(scales.size());
    VLMOPT_CHECK(w.entries.size() == w.expected_entry_count(), "{} entries for {} rows x {} groups", w.entries.size(), w.rows,
                 w.groups_per_row());
    for (std::size_t i = 0; i < scales.size(); ++i) {
      w.entries[i].scale = scales[i];
      w.entries[i].zero_point = zps[i];
    }
    cache.tensors.push_back(std::move(w));

    if (!layer.input) continue;
    VLMOPT_CHECK_INPUT(plan.scheme.input_activations.has_value(),
                       "{}: input activations: expected a scheme with input_activations, got a weight-only scheme", who);
    VLMOPT_CHECK_INPUT(in_features > 0, "{}: outlier_channels: expected bool [in_features], got {}", who,
                       shape_text(layer.outlier_channels));
    const auto [in_scales, in_zps] = flat_params(*layer.input);
    VLMOPT_CHECK_INPUT(in_scales.size() == 1, "{}: input scale: expected [1] (static per-tensor), got {}", who,
                       shape_text(layer.input->scale));
    MpCacheTensor a;
    a.name = layer.name;
    a.role = MpRole::kActivation;
    a.qdtype = qdtype_of(*plan.scheme.input_activations, who + ": input activations");
    a.axis = -1;
    a.group_size = kMpMaxGroupSize;
    a.channels = static_cast<uint64_t>(in_features);
    a.rows = 1;
    a.entries.assign(a.groups_per_row(), MpCacheEntry{in_scales[0], in_zps[0], {}});
    const auto outliers = layer.outlier_channels.to(torch::kCPU, torch::kBool).contiguous().reshape({-1});
    const bool* is_outlier = outliers.data_ptr<bool>();
    for (int64_t c = 0; c < in_features; ++c) {
      if (is_outlier[c]) a.entries[c / kMpMaxGroupSize].set_masked(static_cast<uint32_t>(c % kMpMaxGroupSize));
    }
    cache.tensors.push_back(std::move(a));
  }
  return cache;
}

// ---------------------------------------------------------------------------------------------
// Summary

nlohmann::json summarize_mp_cache(const MpCache& cache, const MpCacheLayout* layout) {
  using nlohmann::json;
  struct RoleTotals {
    uint64_t tensors = 0, entries = 0, masked = 0;
    std::map<std::string, uint64_t> dtypes;
    std::optional<float> scale_min, scale_max;
  };
  RoleTotals totals[2];
  json tensors = json::array();
  for (const auto& t : cache.tensors) {
    json row = {{"name", t.name},         {"role", to_string(t.role)},  {"dtype", to_string(t.qdtype)},
                {"axis", t.axis},         {"group_size", t.group_size}, {"channels", t.channels},
                {"rows", t.rows},         {"entries", t.entries.size()}, {"masked_channels", t.masked_channel_count()},
                {"scale_min", nullptr},   {"scale_max", nullptr},       {"zero_point_min", nullptr},
                {"zero_point_max", nullptr}};
    auto& total = totals[static_cast<std::size_t>(t.role)];
    ++total.tensors;
    total.entries += t.entries.size();
    total.masked += t.masked_channel_count();
    ++total.dtypes[std::string(to_string(t.qdtype))];
    if (!t.entries.empty()) {
      const auto [smin, smax] = std::minmax_element(t.entries.begin(), t.entries.end(),
                                                    [](const auto& a, const auto& b) { return a.scale < b.scale; });
      const auto [zmin, zmax] = std::minmax_element(t.entries.begin(), t.entries.end(),
                                                    [](const auto& a, const auto& b) { return a.zero_point < b.zero_point; });
      row["scale_min"] = smin->scale;
      row["scale_max"] = smax->scale;
      row["zero_point_min"] = zmin->zero_point;
      row["zero_point_max"] = zmax->zero_point;
      total.scale_min = std::min(total.scale_min.value_or(smin->scale), smin->scale);
      total.scale_max = std::max(total.scale_max.value_or(smax->scale), smax->scale);
    }
    tensors.push_back(std::move(row));
  }
  json roles = json::object();
  for (const auto role : {MpRole::kWeight, MpRole::kActivation}) {
    const auto& t = totals[static_cast<std::size_t>(role)];
    roles[std::string(to_string(role))] = {{"tensors", t.tensors},
                                           {"entries", t.entries},
                                           {"masked_channels", t.masked},
                                           {"dtypes", t.dtypes},
                                           {"scale_min", t.scale_min ? json(*t.scale_min) : json(nullptr)},
                                           {"scale_max", t.scale_max ? json(*t.scale_max) : json(nullptr)}};
  }
  json out = {{"kind", "mp_cache"}, {"tensor_count", cache.tensors.size()}, {"roles", std::move(roles)},
              {"tensors", std::move(tensors)}};
  if (layout != nullptr) {
    const auto region = [](uint64_t offset, uint64_t size) { return json{{"offset", offset}, {"size", size}}; };
    out["file"] = {{"format_version", layout->version},
                   {"file_size", layout->file_size},
                   {"sha256", layout->sha256},
                   {"sections",
                    {{"directory", region(layout->directory_offset, layout->directory_size)},
                     {"strings", region(layout->strings_offset, layout->strings_size)},
                     {"weight", region(layout->weight_offset, layout->weight_size)},
                     {"activation", region(layout->activation_offset, layout->activation_size)}}}};
  }
  return out;
}

}  // namespace vlmopt::quant
