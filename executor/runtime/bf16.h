// bfloat16 conversions on the host: float32 -> bf16 bits rounded to nearest
// even (NaN stays a quiet NaN, values beyond bf16's largest finite round to
// infinity) and back (exact). Used for bf16 on the wire
// (CollectiveCall.wire_dtype) and by the bf16 kernels.
#ifndef HAP_EXECUTOR_RUNTIME_BF16_H_
#define HAP_EXECUTOR_RUNTIME_BF16_H_

#include <cstdint>
#include <cstring>

namespace hap::executor {

inline uint16_t Bf16Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : r);
}

inline float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_BF16_H_
