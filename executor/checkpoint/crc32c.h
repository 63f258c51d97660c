// CRC-32C (Castagnoli, the polynomial of iSCSI, ext4 and Google's storage
// formats): the checksum checkpoint shards record per tensor so that a read
// detects damage within a file's bytes. With SSE4.2 (x86-64, checked at run
// time) through the crc32 instruction, else from tables.
#ifndef HAP_EXECUTOR_CHECKPOINT_CRC32C_H_
#define HAP_EXECUTOR_CHECKPOINT_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace hap::executor::checkpoint {

// The CRC-32C of `crc`'s bytes followed by `n` bytes at `data`: start with
// 0; Crc32c(Crc32c(0, a, n), b, m) is the CRC-32C of a then b.
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);

// The software form alone (the tables), for tests against the hardware one.
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n);

// 8 lowercase hex digits.
std::string Crc32cHex(uint32_t crc);

}  // namespace hap::executor::checkpoint

#endif  // HAP_EXECUTOR_CHECKPOINT_CRC32C_H_
