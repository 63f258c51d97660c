// libFuzzer target: safetensors files (checkpoint shards, weights files)
// through SafetensorsFile::Open, then every tensor's view and a pread of
// its last byte: whatever Open accepts must be readable within the file.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "executor/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    std::atexit([] {  // libFuzzer ends with exit()
      std::remove(("/tmp/hap-safetensors-fuzz-" + std::to_string(getpid())).c_str());
    });
    return "/tmp/hap-safetensors-fuzz-" + std::to_string(getpid());
  }();
  FILE* out = std::fopen(path.c_str(), "wb");  // no fsync: thousands of runs a second
  if (out == nullptr) return 0;
  const bool written = std::fwrite(data, 1, size, out) == size;
  if (std::fclose(out) != 0 || !written) return 0;
  auto f = hap::executor::checkpoint::SafetensorsFile::Open(path);
  if (!f.ok()) return 0;
  for (const auto& [name, t] : (*f)->tensors()) {
    auto v = (*f)->View(name);
    if (!v.ok()) __builtin_trap();
    const int64_t bytes = t.end - t.begin;
    if (bytes > 0) {
      volatile char last = static_cast<const char*>(v->data)[bytes - 1];
      (void)last;
      char c;
      if (!(*f)->ReadBytes(name, bytes - 1, 1, &c).ok()) __builtin_trap();
    }
  }
  return 0;
}
