// Counter-based random numbers: every value is a pure function of a key and
// a counter, so a shard of a tensor draws exactly the values the
// single-device tensor has at the same global positions (parameter
// initialisation, dropout masks), whatever the sharding. The generator
// itself (Mix64, CounterKey, CounterUniform) is counter_random.h, shared
// with CUDA device code.
#ifndef HAP_EXECUTOR_RUNTIME_RANDOM_H_
#define HAP_EXECUTOR_RUNTIME_RANDOM_H_

#include <cmath>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "executor/runtime/counter_random.h"

namespace hap::executor {

// 64-bit FNV-1a of a name (a parameter's or an op's), for keys.
inline uint64_t HashName(absl::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
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
