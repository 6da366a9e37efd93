// SHA-256 (OpenSSL EVP) of bytes and files, as lowercase hex.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace vlmopt::io {

std::string sha256_hex(std::span<const std::byte> bytes);
std::string sha256_hex(std::string_view text);
std::string sha256_file(const std::filesystem::path& path);  // streams; throws InputError if unreadable

}  // namespace vlmopt::io
