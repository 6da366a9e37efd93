// HDF5 packs: a dataset frozen into one file, read sample by sample
// (hyperslabs; never the whole file). Layout, version 1 (docs/datasets.md):
//
//   /                 attributes format="vlmopt-pack", version=1 (int32), source (string)
//   /images           uint8 [N, H, W, 3]   RGB; H, W = the largest height and width in the
//                                          pack; sample i sits at the top-left of its slot,
//                                          the rest is 0. Chunked per sample, deflate.
//   /image_shapes     uint32 [N, 3]        (height, width, 3) of sample i
//   /ids /questions /answers /question_types /meta
//                     variable-length UTF-8 strings [N]  (meta: one JSON object per sample)
//
// Packs of same-sized images (all builtin splits) are therefore plain
// [N, H, W, 3] arrays for h5py users; photos of different sizes keep their own
// size without resizing.
#pragma once

#include "datasets/source.hpp"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace vlmopt::datasets {

inline constexpr std::string_view kPackFormat = "vlmopt-pack";
inline constexpr int kPackVersion = 1;
inline constexpr int kPackMaxImageSide = 32768;  // px; larger shapes are treated as corruption

// Writes a pack to a temporary file next to `target`; commit() makes it appear
// atomically (fsync + rename + directory fsync). Destroying an uncommitted
// writer removes the temporary file.
class PackWriter {
 public:
  // count: exactly how many samples will be appended (>= 1).
  // deflate_level: 0 (off) to 9.
  PackWriter(const std::filesystem::path& target, std::size_t count, const std::string& source_description,
             int deflate_level = 3);
  ~PackWriter();
  PackWriter(const PackWriter&) = delete;
  PackWriter& operator=(const PackWriter&) = delete;

  // InputError for samples a pack cannot hold (no image, extra frames, non-RGB8).
  void append(const Sample& sample);
  std::size_t appended() const;
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A pack opened for reading. The constructor validates format, version, and
// the presence, types and sizes of every dataset; get() validates the
// sample's own shape and byte range before allocating.
class PackSource final : public DatasetSource {
 public:
  explicit PackSource(const std::filesystem::path& path);
  ~PackSource() override;

  std::size_t size() const override;
  Sample get(std::size_t i) const override;
  std::string describe() const override;
  const std::string& source_description() const;  // the "source" attribute

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// True when the file starts with the HDF5 signature (used to sniff specs without an extension).
bool looks_like_hdf5(const std::filesystem::path& path);

}  // namespace vlmopt::datasets
