// SHA-256 (OpenSSL EVP) of bytes and files, as lowercase hex.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include <memory>

struct evp_md_ctx_st;

namespace vlmopt::io {

// Incremental SHA-256 (e.g. over the samples a calibration run used).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  void update(const void* data, std::size_t size);
  void update(std::string_view text) { update(text.data(), text.size()); }
  std::string hex_digest();  // finalizes; call once

 private:
  struct Deleter {
    void operator()(evp_md_ctx_st* ctx) const;
  };
  std::unique_ptr<evp_md_ctx_st, Deleter> ctx_;
};

std::string sha256_hex(std::span<const std::byte> bytes);
std::string sha256_hex(std::string_view text);
std::string sha256_file(const std::filesystem::path& path);  // streams; throws InputError if unreadable

}  // namespace vlmopt::io
