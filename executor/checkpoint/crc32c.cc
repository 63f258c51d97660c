#include "executor/checkpoint/crc32c.h"

#include <array>
#include <cstring>

#include "absl/strings/str_format.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace hap::executor::checkpoint {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // 0x1EDC6F41 bit-reversed

// tables[k][b]: the CRC of byte b followed by k zero bytes (slicing by 8).
using Tables = std::array<std::array<uint32_t, 256>, 8>;

const Tables& CrcTables() {
  static const Tables* tables = [] {
    auto* t = new Tables;
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int bit = 0; bit < 8; ++bit) c = (c >> 1) ^ ((c & 1) ? kPolynomial : 0);
      (*t)[0][b] = c;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        const uint32_t prev = (*t)[k - 1][b];
        (*t)[k][b] = (prev >> 8) ^ (*t)[0][prev & 0xff];
      }
    }
    return t;
  }();
  return *tables;
}

// On the inverted register (no pre/post conditioning).
uint32_t PortableRaw(uint32_t c, const unsigned char* p, size_t n) {
  const Tables& t = CrcTables();
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);  // little-endian: x86-64, aarch64
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) c = (c >> 8) ^ t[0][(c ^ *p) & 0xff];
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t HardwareRaw(uint32_t c, const unsigned char* p,
                                                       size_t n) {
  for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c64 = _mm_crc32_u64(c64, word);
  }
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  return c;
}

bool HasSse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n) {
  return ~PortableRaw(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  if (HasSse42()) return ~HardwareRaw(~crc, static_cast<const unsigned char*>(data), n);
#endif
  return Crc32cPortable(crc, data, n);
}

std::string Crc32cHex(uint32_t crc) { return absl::StrFormat("%08x", crc); }

}  // namespace hap::executor::checkpoint
