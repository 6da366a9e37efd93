#include "io/hash.hpp"

#include "io/atomic_file.hpp"
#include "util/error.hpp"

#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <system_error>
#include <vector>

namespace vlmopt::io {
void Sha256::Deleter::operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  VLMOPT_CHECK(ctx_ != nullptr, "EVP_MD_CTX_new failed");
  VLMOPT_CHECK(EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1, "EVP_DigestInit_ex(sha256) failed");
}
Sha256::~Sha256() = default;
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;

void Sha256::update(const void* data, std::size_t size) {
  VLMOPT_CHECK(EVP_DigestUpdate(ctx_.get(), data, size) == 1, "EVP_DigestUpdate failed");
}

std::string Sha256::hex_digest() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  VLMOPT_CHECK(EVP_DigestFinal_ex(ctx_.get(), digest, &length) == 1, "EVP_DigestFinal_ex failed");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * length);
  for (unsigned int i = 0; i < length; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 0xF]);
  }
  return out;
}

std::string sha256_hex(std::span<const std::byte> bytes) {
  Sha256 sha;
  sha.update(bytes.data(), bytes.size());
  return sha.hex_digest();
}

std::string sha256_hex(std::string_view text) {
  Sha256 sha;
  sha.update(text.data(), text.size());
  return sha.hex_digest();
}

std::string sha256_file(const std::filesystem::path& path) {
  const UniqueFd fd = open_regular_file(path);
  Sha256 sha;
  std::vector<std::byte> buffer(std::size_t{1} << 20);  // 1 MiB chunks: memory stays flat for any file size
  for (;;) {
    const ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw InputError(fmt::format("{}: read failed: {}", path.string(), std::generic_category().message(errno)));
    }
    if (n == 0) break;
    sha.update(buffer.data(), static_cast<std::size_t>(n));
  }
  return sha.hex_digest();
}

}  // namespace vlmopt::io
