// RAII for HDF5 C identifiers, private to vlmopt_datasets (hdf5.h is not on
// the include path of other targets; public headers stay HDF5-free).
#pragma once

#include <hdf5.h>

#include <mutex>
#include <utility>

namespace vlmopt::datasets::h5 {

// Owns one hid_t and closes it with `Close` (H5Fclose, H5Dclose, ...).
template <herr_t (*Close)(hid_t)>
class Id {
 public:
  Id() = default;
  explicit Id(hid_t id) : id_(id) {}
  ~Id() { reset(); }
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  Id(Id&& other) noexcept : id_(std::exchange(other.id_, H5I_INVALID_HID)) {}
  Id& operator=(Id&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = std::exchange(other.id_, H5I_INVALID_HID);
    }
    return *this;
  }

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  explicit operator bool() const { return valid(); }

  void reset() {
    if (id_ >= 0) Close(id_);
    id_ = H5I_INVALID_HID;
  }
  // Closes now and reports failure (used where a failed close means lost data).
  herr_t close() {
    herr_t status = id_ >= 0 ? Close(id_) : 0;
    id_ = H5I_INVALID_HID;
    return status;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
};

using File = Id<&H5Fclose>;
using Dataset = Id<&H5Dclose>;
using Dataspace = Id<&H5Sclose>;
using Datatype = Id<&H5Tclose>;
using PropertyList = Id<&H5Pclose>;
using Attribute = Id<&H5Aclose>;

// Serialises our HDF5 calls (portable even to non-thread-safe builds) and
// keeps HDF5 from printing its error stack: we turn failures into one-line
// InputErrors ourselves.
class Session {
 public:
  Session() : lock_(mutex()) {
    H5Eget_auto2(H5E_DEFAULT, &old_func_, &old_data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~Session() { H5Eset_auto2(H5E_DEFAULT, old_func_, old_data_); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

 private:
  static std::recursive_mutex& mutex() {
    static std::recursive_mutex m;
    return m;
  }
  std::unique_lock<std::recursive_mutex> lock_;
  H5E_auto2_t old_func_ = nullptr;
  void* old_data_ = nullptr;
};

}  // namespace vlmopt::datasets::h5
