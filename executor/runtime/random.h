// Counter-based random numbers: every value is a pure function of a key and
// a counter, so a shard of a tensor draws exactly the values the
// single-device tensor has at the same global positions (parameter
// initialisation, dropout masks), whatever the sharding.
#ifndef HAP_EXECUTOR_RUNTIME_RANDOM_H_
#define HAP_EXECUTOR_RUNTIME_RANDOM_H_

#include <cmath>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace hap::executor {

// SplitMix64's finaliser: a bijective 64-bit mix.
inline uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// 64-bit FNV-1a of a name (a parameter's or an op's), for keys.
inline uint64_t HashName(absl::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

// A key from a seed and up to two more words (e.g. a name hash and a step).
inline uint64_t CounterKey(uint64_t seed, uint64_t a, uint64_t b = 0) {
  return Mix64(Mix64(seed ^ Mix64(a)) ^ Mix64(b + 0x632be59bd9b4e019ULL));
}

// Uniform in [0, 1) with 53 random bits.
inline double CounterUniform(uint64_t key, uint64_t counter) {
  uint64_t r = Mix64(key ^ Mix64(counter));
  return static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0);
}

// Standard normal by Box-Muller on two uniforms drawn at 2c and 2c+1.
inline double CounterNormal(uint64_t key, uint64_t counter) {
  double u1 = CounterUniform(key, 2 * counter);
  double u2 = CounterUniform(key, 2 * counter + 1);
  double r = std::sqrt(-2.0 * std::log(1.0 - u1));  // 1-u1 in (0, 1]
  return r * std::cos(6.283185307179586 * u2);
}

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_RANDOM_H_
