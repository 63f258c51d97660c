// The counter-based generator's core (random.h), free of Abseil and
// annotated for CUDA so that device code (executor/cuda dropout) draws
// bit-for-bit the values the host does: integer mixing and one exact
// int-to-double conversion, nothing that rounds differently on a GPU.
#ifndef HAP_EXECUTOR_RUNTIME_COUNTER_RANDOM_H_
#define HAP_EXECUTOR_RUNTIME_COUNTER_RANDOM_H_

#include <cstdint>

#if defined(__CUDACC__)
#define HAP_HOST_DEVICE __host__ __device__
#else
#define HAP_HOST_DEVICE
#endif

namespace hap::executor {

// SplitMix64's finaliser: a bijective 64-bit mix.
HAP_HOST_DEVICE inline uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A key from a seed and up to two more words (e.g. a name hash and a step).
HAP_HOST_DEVICE inline uint64_t CounterKey(uint64_t seed, uint64_t a,
                                           uint64_t b = 0) {
  return Mix64(Mix64(seed ^ Mix64(a)) ^ Mix64(b + 0x632be59bd9b4e019ULL));
}

// Uniform in [0, 1) with 53 random bits (exact: r >> 11 < 2^53).
HAP_HOST_DEVICE inline double CounterUniform(uint64_t key, uint64_t counter) {
  uint64_t r = Mix64(key ^ Mix64(counter));
  return static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0);
}

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_COUNTER_RANDOM_H_
