// Portable deterministic randomness for the dataset generators. The standard
// <random> distributions differ between standard libraries, so the same seed
// would give different scenes on different machines; these helpers do not.
#pragma once

#include <cstdint>
#include <string_view>

namespace vlmopt::datasets {

__extension__ typedef unsigned __int128 uint128;  // GCC/Clang extension, silences -Wpedantic

// SplitMix64 finaliser: a bijective 64-bit mix used for seeding and hashing.
constexpr uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// FNV-1a over bytes, then mixed: a stable hash of a name.
constexpr uint64_t hash_name(std::string_view name) {
  uint64_t h = 0xCBF29CE484222325ULL;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001B3ULL;
  }
  return mix64(h);
}

// xoshiro256** seeded through SplitMix64.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& word : state_) {
      seed += 0x9E3779B97F4A7C15ULL;
      word = mix64(seed);
    }
  }

  uint64_t next() {
    const uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform integer in [0, n), unbiased (Lemire's multiply-and-reject). n > 0.
  uint64_t below(uint64_t n) {
    uint128 m = static_cast<uint128>(next()) * n;
    auto low = static_cast<uint64_t>(m);
    if (low < n) {
      const uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        m = static_cast<uint128>(next()) * n;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

  // Uniform integer in [lo, hi] (inclusive); requires lo <= hi.
  int uniform_int(int lo, int hi) { return lo + static_cast<int>(below(static_cast<uint64_t>(hi - lo) + 1)); }

  // Uniform double in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

  bool chance(double p) { return uniform() < p; }

  template <typename Container>
  const auto& pick(const Container& items) {
    return items[below(items.size())];
  }

 private:
  static constexpr uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t state_[4];
};

// A fixed pseudo-random bijection of [0, n): a 4-round Feistel network on the
// smallest even number of bits covering n, cycle-walking values >= n back in.
class IndexPermutation {
 public:
  IndexPermutation(uint64_t n, uint64_t key) : n_(n), key_(key) {
    while ((uint64_t{1} << (2 * half_bits_)) < n_) ++half_bits_;
    mask_ = (uint64_t{1} << half_bits_) - 1;
  }

  uint64_t operator()(uint64_t i) const {
    uint64_t x = i;
    do {
      x = encrypt(x);
    } while (x >= n_);
    return x;
  }

 private:
  uint64_t encrypt(uint64_t x) const {
    uint64_t left = x >> half_bits_;
    uint64_t right = x & mask_;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = mix64(key_ ^ (round << 56) ^ right) & mask_;
      const uint64_t next_right = left ^ f;
      left = right;
      right = next_right;
    }
    return (left << half_bits_) | right;
  }

  uint64_t n_;
  uint64_t key_;
  int half_bits_ = 1;
  uint64_t mask_ = 1;
};

}  // namespace vlmopt::datasets
