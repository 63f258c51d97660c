// Tests only: .npy files written by hand (independent of the reader), for
// the user data tests and the executors' tests that train on such data.
#ifndef HAP_EXECUTOR_DATA_NPY_TEST_UTIL_H_
#define HAP_EXECUTOR_DATA_NPY_TEST_UTIL_H_

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace hap::data::npy_files {

template <typename T>
inline std::string Raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// The bytes of a .npy file: magic, version, little-endian header length, the
// dict padded with spaces to a multiple of 64 and ended by '\n', the data.
inline std::string Npy(const std::string& descr, const std::vector<int64_t>& shape,
                const std::string& data, int major = 1, bool fortran = false) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) {
    dims += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
    if (i + 1 < shape.size()) dims += " ";
  }
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
                     ", 'shape': (" + dims + "), }";
  const size_t prefix = 8 + (major == 1 ? 2 : 4);
  const size_t unpadded = prefix + dict.size() + 1;
  dict.append((unpadded + 63) / 64 * 64 - unpadded, ' ');
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  const uint32_t len = static_cast<uint32_t>(dict.size());
  for (size_t i = 0; i < prefix - 8; ++i) out += static_cast<char>((len >> (8 * i)) & 0xff);
  return out + dict + data;
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

}  // namespace hap::data::npy_files

#endif  // HAP_EXECUTOR_DATA_NPY_TEST_UTIL_H_
