#include "datasets/hdf5_pack.hpp"

#include "datasets/hdf5_handles.hpp"
#include "io/atomic_file.hpp"
#include "util/error.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <random>
#include <vector>

namespace vlmopt::datasets {

namespace fs = std::filesystem;

namespace {

constexpr std::array<const char*, 5> kStringDatasets = {"ids", "questions", "answers", "question_types", "meta"};
constexpr hsize_t kStringChunk = 1024;       // strings per chunk
constexpr hsize_t kMaxChunkSide = 1024;       // px; bounds one image chunk to 3 MiB

[[noreturn]] void write_failed(const fs::path& file, const std::string& what) {
  throw Error(ExitCode::kFailure, fmt::format("{}: HDF5 write failed: {} (disk full or not writable?)", file.string(), what));
}

// Transfer properties for string reads and writes: HDF5's default 1 MiB
// type-conversion buffer is allocated and zeroed on every call, which made
// per-sample string I/O dominate packing time. Strings go one at a time.
h5::PropertyList small_conversion_buffer() {
  h5::PropertyList transfer(H5Pcreate(H5P_DATASET_XFER));
  H5Pset_buffer(transfer.get(), 64 * 1024, nullptr, nullptr);
  return transfer;
}

h5::Datatype vlen_utf8_string() {
  h5::Datatype type(H5Tcopy(H5T_C_S1));
  H5Tset_size(type.get(), H5T_VARIABLE);
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  return type;
}

void write_string_attribute(hid_t object, const char* name, const std::string& value, const fs::path& file) {
  h5::Datatype type(H5Tcopy(H5T_C_S1));
  H5Tset_size(type.get(), std::max<std::size_t>(value.size(), 1));  // fixed length; 0 is not allowed
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  H5Tset_strpad(type.get(), H5T_STR_NULLPAD);
  h5::Dataspace space(H5Screate(H5S_SCALAR));
  h5::Attribute attribute(H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT));
  std::string padded = value.empty() ? std::string(1, '\0') : value;
  if (!attribute || H5Awrite(attribute.get(), type.get(), padded.data()) < 0) {
    write_failed(file, fmt::format("attribute '{}'", name));
  }
}

void write_int_attribute(hid_t object, const char* name, int32_t value, const fs::path& file) {
  h5::Dataspace space(H5Screate(H5S_SCALAR));
  h5::Attribute attribute(H5Acreate2(object, name, H5T_STD_I32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (!attribute || H5Awrite(attribute.get(), H5T_NATIVE_INT32, &value) < 0) {
    write_failed(file, fmt::format("attribute '{}'", name));
  }
}

// Selects a hyperslab of `dataset` and returns the (file space, memory space) pair.
std::pair<h5::Dataspace, h5::Dataspace> select(hid_t dataset, const std::vector<hsize_t>& start,
                                               const std::vector<hsize_t>& count) {
  h5::Dataspace file_space(H5Dget_space(dataset));
  h5::Dataspace memory_space(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr));
  if (!file_space || !memory_space ||
      H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr) < 0) {
    return {};
  }
  return {std::move(file_space), std::move(memory_space)};
}

std::vector<hsize_t> dims_of(hid_t dataset) {
  h5::Dataspace space(H5Dget_space(dataset));
  const int rank = space ? H5Sget_simple_extent_ndims(space.get()) : -1;
  if (rank < 0) return {};
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  return dims;
}

std::string read_string_attribute(hid_t object, const char* name, const fs::path& file) {
  h5::Attribute attribute(H5Aopen(object, name, H5P_DEFAULT));
  h5::Datatype type(attribute ? H5Aget_type(attribute.get()) : H5I_INVALID_HID);
  if (!type || H5Tget_class(type.get()) != H5T_STRING) {
    throw_file_error(file, "attribute '{}' is not a string", name);
  }
  h5::Dataspace space(H5Aget_space(attribute.get()));
  if (H5Sget_simple_extent_npoints(space.get()) != 1) throw_file_error(file, "attribute '{}' is not a scalar", name);
  if (H5Tis_variable_str(type.get()) > 0) {
    h5::Datatype memory = vlen_utf8_string();
    char* text = nullptr;
    if (H5Aread(attribute.get(), memory.get(), &text) < 0) throw_file_error(file, "cannot read attribute '{}'", name);
    std::string value = text != nullptr ? text : "";
    H5free_memory(text);
    return value;
  }
  const std::size_t size = H5Tget_size(type.get());
  if (size == 0 || size > (1u << 20)) throw_file_error(file, "attribute '{}' has an implausible size {}", name, size);
  h5::Datatype memory(H5Tcopy(type.get()));
  std::string value(size, '\0');
  if (H5Aread(attribute.get(), memory.get(), value.data()) < 0) {
    throw_file_error(file, "cannot read attribute '{}'", name);
  }
  value.erase(std::find(value.begin(), value.end(), '\0'), value.end());  // NULLPAD / NULLTERM
  return value;
}

}  // namespace

// ---------------------------------------------------------------------------
// Writer

struct PackWriter::Impl {
  fs::path target;
  fs::path temp;
  std::size_t count = 0;
  std::size_t next = 0;
  hsize_t max_height = 0;
  hsize_t max_width = 0;
  std::vector<uint32_t> shapes;  // 3 per sample, written at commit
  h5::Datatype vlen;
  h5::PropertyList transfer;
  h5::File file;
  h5::Dataset images;
  std::array<h5::Dataset, kStringDatasets.size()> strings;
  int deflate_level = 0;
  bool committed = false;

  void write_string(std::size_t which, std::size_t index, const std::string& value) {
    auto [file_space, memory_space] = select(strings[which].get(), {index}, {1});
    const char* text = value.c_str();
    if (!file_space || H5Dwrite(strings[which].get(), vlen.get(), memory_space.get(), file_space.get(),
                                transfer.get(), &text) < 0) {
      write_failed(temp, fmt::format("/{}[{}]", kStringDatasets[which], index));
    }
  }

  void close_all() {
    images.reset();
    for (auto& s : strings) s.reset();
    vlen.reset();
    transfer.reset();
    file.reset();
  }
};


PackWriter::PackWriter(const fs::path& target, std::size_t count, const std::string& source_description,
                       int deflate_level)
    : impl_(std::make_unique<Impl>()) {
  VLMOPT_CHECK(count >= 1, "a pack holds at least one sample (got {})", count);
  VLMOPT_CHECK(deflate_level >= 0 && deflate_level <= 9, "deflate level {} not in 0..9", deflate_level);
  Impl& w = *impl_;
  w.target = target;
  w.count = count;
  w.deflate_level = deflate_level;
  w.shapes.reserve(count * 3);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw_file_error(target, "output directory {} does not exist", dir.string());
  w.temp = dir / fmt::format(".{}.tmp.{}.{:08x}", target.filename().string(), ::getpid(), std::random_device{}());

  h5::Session session;
  // No modification times in object headers: the same data gives the same bytes.
  h5::PropertyList file_create(H5Pcreate(H5P_FILE_CREATE));
  H5Pset_obj_track_times(file_create.get(), false);
  w.file = h5::File(H5Fcreate(w.temp.c_str(), H5F_ACC_EXCL, file_create.get(), H5P_DEFAULT));
  if (!w.file) {
    throw_file_error(target, "cannot create temporary pack file {} (directory not writable?)", w.temp.string());
  }
  try {
    w.vlen = vlen_utf8_string();
    w.transfer = small_conversion_buffer();
    write_string_attribute(w.file.get(), "format", std::string(kPackFormat), w.temp);
    write_int_attribute(w.file.get(), "version", kPackVersion, w.temp);
    write_string_attribute(w.file.get(), "source", source_description, w.temp);

    const hsize_t n = count;
    for (std::size_t k = 0; k < kStringDatasets.size(); ++k) {
      h5::Dataspace space(H5Screate_simple(1, &n, nullptr));
      h5::PropertyList create(H5Pcreate(H5P_DATASET_CREATE));
      H5Pset_obj_track_times(create.get(), false);
      const hsize_t chunk = std::min(n, kStringChunk);
      H5Pset_chunk(create.get(), 1, &chunk);
      w.strings[k] = h5::Dataset(H5Dcreate2(w.file.get(), kStringDatasets[k], w.vlen.get(), space.get(),
                                            H5P_DEFAULT, create.get(), H5P_DEFAULT));
      if (!w.strings[k]) write_failed(w.temp, fmt::format("create /{}", kStringDatasets[k]));
    }
  } catch (...) {
    w.close_all();
    fs::remove(w.temp, ec);
    throw;
  }
}

PackWriter::~PackWriter() {
  if (!impl_) return;
  {
    h5::Session session;
    impl_->close_all();
  }
  if (!impl_->committed) {
    std::error_code ec;
    fs::remove(impl_->temp, ec);
  }
}

std::size_t PackWriter::appended() const { return impl_->next; }

void PackWriter::append(const Sample& sample) {
  Impl& w = *impl_;
  VLMOPT_CHECK(!w.committed, "append after commit");
  VLMOPT_CHECK(w.next < w.count, "pack was created for {} samples; append #{} is one too many", w.count, w.next + 1);
  const std::string what = fmt::format("{}: sample '{}'", w.target.string(), sample.id);
  if (sample.image.empty()) throw InputError(fmt::format("{}: has no image", what));
  if (sample.image.type() != CV_8UC3) {
    throw InputError(fmt::format("{}: image must be RGB uint8 (expected CV_8UC3, got type {})", what, sample.image.type()));
  }
  if (!sample.frames.empty()) {
    throw InputError(fmt::format("{}: has {} extra frames; pack version {} stores one image per sample", what,
                                 sample.frames.size(), kPackVersion));
  }
  if (sample.image.rows > kPackMaxImageSide || sample.image.cols > kPackMaxImageSide) {
    throw InputError(fmt::format("{}: image {}x{} exceeds the pack limit of {} px per side", what, sample.image.cols,
                                 sample.image.rows, kPackMaxImageSide));
  }
  const cv::Mat image = sample.image.isContinuous() ? sample.image : sample.image.clone();
  const auto h = static_cast<hsize_t>(image.rows);
  const auto wd = static_cast<hsize_t>(image.cols);
  const std::size_t index = w.next;

  h5::Session session;
  if (!w.images) {
    // The first image sets the chunk shape: one chunk per (same-sized) sample.
    const hsize_t n = w.count;
    const std::array<hsize_t, 4> dims = {n, h, wd, 3};
    const std::array<hsize_t, 4> max_dims = {n, H5S_UNLIMITED, H5S_UNLIMITED, 3};
    const std::array<hsize_t, 4> chunk = {1, std::min(h, kMaxChunkSide), std::min(wd, kMaxChunkSide), 3};
    h5::Dataspace space(H5Screate_simple(4, dims.data(), max_dims.data()));
    h5::PropertyList create(H5Pcreate(H5P_DATASET_CREATE));
    H5Pset_obj_track_times(create.get(), false);
    H5Pset_chunk(create.get(), 4, chunk.data());
    if (w.deflate_level > 0 && H5Zfilter_avail(H5Z_FILTER_DEFLATE) > 0) H5Pset_deflate(create.get(), w.deflate_level);
    w.images = h5::Dataset(
        H5Dcreate2(w.file.get(), "images", H5T_STD_U8LE, space.get(), H5P_DEFAULT, create.get(), H5P_DEFAULT));
    if (!w.images) write_failed(w.temp, "create /images");
    w.max_height = h;
    w.max_width = wd;
  } else if (h > w.max_height || wd > w.max_width) {
    w.max_height = std::max(w.max_height, h);
    w.max_width = std::max(w.max_width, wd);
    const std::array<hsize_t, 4> dims = {w.count, w.max_height, w.max_width, 3};
    if (H5Dset_extent(w.images.get(), dims.data()) < 0) write_failed(w.temp, "grow /images");
  }
  auto [file_space, memory_space] = select(w.images.get(), {index, 0, 0, 0}, {1, h, wd, 3});
  if (!file_space || H5Dwrite(w.images.get(), H5T_NATIVE_UINT8, memory_space.get(), file_space.get(), H5P_DEFAULT,
                              image.data) < 0) {
    write_failed(w.temp, fmt::format("/images[{}]", index));
  }
  const std::string meta =
      (sample.meta.is_null() ? nlohmann::json::object() : sample.meta).dump(-1, ' ', false,
                                                                            nlohmann::json::error_handler_t::replace);
  const std::array<const std::string*, kStringDatasets.size()> values = {&sample.id, &sample.question, &sample.answer,
                                                                         &sample.question_type, &meta};
  for (std::size_t k = 0; k < values.size(); ++k) w.write_string(k, index, *values[k]);
  w.shapes.insert(w.shapes.end(), {static_cast<uint32_t>(h), static_cast<uint32_t>(wd), 3u});
  ++w.next;
}

void PackWriter::commit() {
  Impl& w = *impl_;
  VLMOPT_CHECK(!w.committed, "commit called twice");
  VLMOPT_CHECK(w.next == w.count, "pack was created for {} samples but {} were appended", w.count, w.next);
  {
    h5::Session session;
    const std::array<hsize_t, 2> dims = {w.count, 3};
    h5::Dataspace space(H5Screate_simple(2, dims.data(), nullptr));
    h5::PropertyList create(H5Pcreate(H5P_DATASET_CREATE));
    H5Pset_obj_track_times(create.get(), false);
    h5::Dataset shapes(
        H5Dcreate2(w.file.get(), "image_shapes", H5T_STD_U32LE, space.get(), H5P_DEFAULT, create.get(), H5P_DEFAULT));
    if (!shapes || H5Dwrite(shapes.get(), H5T_NATIVE_UINT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, w.shapes.data()) < 0) {
      write_failed(w.temp, "/image_shapes");
    }
    shapes.reset();
    if (H5Fflush(w.file.get(), H5F_SCOPE_GLOBAL) < 0) write_failed(w.temp, "flush");
    w.images.reset();
    for (auto& s : w.strings) s.reset();
    w.vlen.reset();
    w.transfer.reset();
    if (w.file.close() < 0) write_failed(w.temp, "close");
  }
  // HDF5 wrote through its own descriptor; make the bytes durable before the rename.
  {
    io::UniqueFd fd(::open(w.temp.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd || ::fsync(fd.get()) != 0) write_failed(w.temp, "fsync");
  }
  std::error_code ec;
  fs::rename(w.temp, w.target, ec);
  if (ec) throw Error(ExitCode::kFailure, fmt::format("{}: cannot rename {} over it: {}", w.target.string(), w.temp.string(), ec.message()));
  w.committed = true;
  io::fsync_directory(w.target.parent_path().empty() ? fs::path(".") : w.target.parent_path());
}

// ---------------------------------------------------------------------------
// Reader

struct PackSource::Impl {
  fs::path path;
  std::string source;
  std::size_t count = 0;
  hsize_t max_height = 0;
  hsize_t max_width = 0;
  h5::File file;
  h5::Dataset images;
  h5::Dataset shapes;
  std::array<h5::Dataset, kStringDatasets.size()> strings;
  h5::Datatype vlen;
  h5::PropertyList transfer;

  h5::Dataset open_checked(const char* name, H5T_class_t expected_class, const char* expected_text) const {
    if (H5Lexists(file.get(), name, H5P_DEFAULT) <= 0) throw_file_error(path, "dataset '/{}' is missing", name);
    h5::Dataset dataset(H5Dopen2(file.get(), name, H5P_DEFAULT));
    h5::Datatype type(dataset ? H5Dget_type(dataset.get()) : H5I_INVALID_HID);
    if (!type) throw_file_error(path, "cannot open dataset '/{}'", name);
    const bool ok = H5Tget_class(type.get()) == expected_class &&
                    (expected_class != H5T_STRING || H5Tis_variable_str(type.get()) > 0);
    if (!ok) throw_file_error(path, "dataset '/{}' has the wrong type (expected {})", name, expected_text);
    return dataset;
  }

  std::string read_string(std::size_t which, std::size_t index) const {
    auto [file_space, memory_space] = select(strings[which].get(), {index}, {1});
    char* text = nullptr;
    if (!file_space || H5Dread(strings[which].get(), vlen.get(), memory_space.get(), file_space.get(),
                               transfer.get(), &text) < 0) {
      throw_file_error(path, "sample {}: cannot read '/{}' (file corrupt?)", index, kStringDatasets[which]);
    }
    std::string value = text != nullptr ? text : "";
#if H5_VERSION_GE(1, 12, 0)
    H5Treclaim(vlen.get(), memory_space.get(), H5P_DEFAULT, &text);
#else
    H5Dvlen_reclaim(vlen.get(), memory_space.get(), H5P_DEFAULT, &text);
#endif
    return value;
  }
};

PackSource::PackSource(const fs::path& path) : impl_(std::make_unique<Impl>()) {
  Impl& r = *impl_;
  r.path = path;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) throw_file_error(path, "no such pack file");

  h5::Session session;
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    throw_file_error(path, "not an HDF5 file (expected a pack written by 'vlmopt datasets pack')");
  }
  r.file = h5::File(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!r.file) throw_file_error(path, "cannot open the HDF5 file (truncated or corrupt?)");

  if (H5Aexists(r.file.get(), "format") <= 0) throw_file_error(path, "not a vlmopt pack (attribute 'format' is missing)");
  const std::string format = read_string_attribute(r.file.get(), "format", path);
  if (format != kPackFormat) {
    throw_file_error(path, "not a vlmopt pack (attribute 'format': expected '{}', got '{}')", kPackFormat, format);
  }
  if (H5Aexists(r.file.get(), "version") <= 0) throw_file_error(path, "attribute 'version' is missing");
  {
    h5::Attribute attribute(H5Aopen(r.file.get(), "version", H5P_DEFAULT));
    h5::Datatype type(attribute ? H5Aget_type(attribute.get()) : H5I_INVALID_HID);
    h5::Dataspace space(attribute ? H5Aget_space(attribute.get()) : H5I_INVALID_HID);
    int64_t version = -1;
    if (!type || H5Tget_class(type.get()) != H5T_INTEGER || H5Sget_simple_extent_npoints(space.get()) != 1 ||
        H5Aread(attribute.get(), H5T_NATIVE_INT64, &version) < 0) {
      throw_file_error(path, "attribute 'version' is not an integer scalar");
    }
    if (version != kPackVersion) {
      throw_file_error(path, "unsupported pack version (expected {}, got {})", kPackVersion, version);
    }
  }
  if (H5Aexists(r.file.get(), "source") > 0) r.source = read_string_attribute(r.file.get(), "source", path);

  for (std::size_t k = 0; k < kStringDatasets.size(); ++k) {
    r.strings[k] = r.open_checked(kStringDatasets[k], H5T_STRING, "variable-length strings");
  }
  r.images = r.open_checked("images", H5T_INTEGER, "uint8");
  r.shapes = r.open_checked("image_shapes", H5T_INTEGER, "unsigned integers");
  {
    h5::Datatype type(H5Dget_type(r.images.get()));
    if (H5Tget_size(type.get()) != 1 || H5Tget_sign(type.get()) != H5T_SGN_NONE) {
      throw_file_error(path, "dataset '/images' has the wrong type (expected uint8)");
    }
  }
  const auto id_dims = dims_of(r.strings[0].get());
  if (id_dims.size() != 1) throw_file_error(path, "dataset '/ids' has rank {} (expected 1)", id_dims.size());
  r.count = id_dims[0];
  if (r.count == 0) throw_file_error(path, "pack holds no samples");
  for (std::size_t k = 1; k < kStringDatasets.size(); ++k) {
    const auto dims = dims_of(r.strings[k].get());
    if (dims.size() != 1 || dims[0] != r.count) {
      throw_file_error(path, "dataset '/{}' has shape [{}] (expected [{}], the length of '/ids')", kStringDatasets[k],
                       fmt::join(dims, ", "), r.count);
    }
  }
  const auto image_dims = dims_of(r.images.get());
  if (image_dims.size() != 4 || image_dims[0] != r.count || image_dims[3] != 3 || image_dims[1] == 0 ||
      image_dims[2] == 0) {
    throw_file_error(path, "dataset '/images' has shape [{}] (expected [{}, H, W, 3])", fmt::join(image_dims, ", "),
                     r.count);
  }
  r.max_height = image_dims[1];
  r.max_width = image_dims[2];
  const auto shape_dims = dims_of(r.shapes.get());
  if (shape_dims.size() != 2 || shape_dims[0] != r.count || shape_dims[1] != 3) {
    throw_file_error(path, "dataset '/image_shapes' has shape [{}] (expected [{}, 3])", fmt::join(shape_dims, ", "),
                     r.count);
  }
  r.vlen = vlen_utf8_string();
  r.transfer = small_conversion_buffer();
}

PackSource::~PackSource() {
  if (!impl_) return;
  h5::Session session;
  impl_.reset();
}

std::size_t PackSource::size() const { return impl_->count; }

const std::string& PackSource::source_description() const { return impl_->source; }

std::string PackSource::describe() const {
  return fmt::format("{} (vlmopt pack v{}, {} samples, from {})", impl_->path.string(), kPackVersion, impl_->count,
                     impl_->source.empty() ? "unknown source" : impl_->source);
}

Sample PackSource::get(std::size_t i) const {
  const Impl& r = *impl_;
  check_index(i, r.count, r.path.string());
  h5::Session session;

  std::array<uint32_t, 3> shape{};
  {
    auto [file_space, memory_space] = select(r.shapes.get(), {i, 0}, {1, 3});
    if (!file_space || H5Dread(r.shapes.get(), H5T_NATIVE_UINT32, memory_space.get(), file_space.get(), H5P_DEFAULT,
                               shape.data()) < 0) {
      throw_file_error(r.path, "sample {}: cannot read '/image_shapes' (file corrupt?)", i);
    }
  }
  const hsize_t h = shape[0], w = shape[1];
  if (h == 0 || w == 0 || shape[2] != 3 || h > r.max_height || w > r.max_width) {
    throw_file_error(r.path, "sample {}: image shape {}x{}x{} does not fit '/images' (expected 1..{} x 1..{} x 3)", i,
                     shape[0], shape[1], shape[2], r.max_height, r.max_width);
  }
  cv::Mat image(static_cast<int>(h), static_cast<int>(w), CV_8UC3);
  {
    auto [file_space, memory_space] = select(r.images.get(), {i, 0, 0, 0}, {1, h, w, 3});
    if (!file_space || H5Dread(r.images.get(), H5T_NATIVE_UINT8, memory_space.get(), file_space.get(), H5P_DEFAULT,
                               image.data) < 0) {
      throw_file_error(r.path, "sample {}: cannot read '/images' (file corrupt?)", i);
    }
  }
  Sample sample;
  sample.image = std::move(image);
  sample.id = r.read_string(0, i);
  sample.question = r.read_string(1, i);
  sample.answer = r.read_string(2, i);
  sample.question_type = r.read_string(3, i);
  const std::string meta = r.read_string(4, i);
  sample.meta = nlohmann::json::parse(meta, nullptr, /*allow_exceptions=*/false);
  if (sample.meta.is_discarded() || !sample.meta.is_object()) {
    throw_file_error(r.path, "sample {}: '/meta' is not a JSON object", i);
  }
  return sample;
}

bool looks_like_hdf5(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  h5::Session session;
  return H5Fis_hdf5(path.c_str()) > 0;
}

}  // namespace vlmopt::datasets
