// What the fuzz targets that read files share: an input's bytes written to a
// file, a scratch directory of the process, and the small MLP their seeds
// are made for. Header-only: scripts/fuzz.sh compiles each target from its
// one source.
#ifndef HAP_TESTS_FUZZ_FUZZ_UTIL_H_
#define HAP_TESTS_FUZZ_FUZZ_UTIL_H_

#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>

#include "planner/graph/zoo.h"

namespace hap::fuzz {

// Writes `size` bytes to `path` (no fsync: thousands of runs a second).
inline bool WriteFile(const std::string& path, const void* data, size_t size) {
  FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) return false;
  const bool written = std::fwrite(data, 1, size, out) == size;
  return std::fclose(out) == 0 && written;
}

// hap-NAME-fuzz-PID in /dev/shm when there is one (a tmpfs: the files a
// run writes, and the syncs of those it exports, cost no disk), else in
// /tmp; created on the first call and removed when the process exits
// (libFuzzer ends with exit()). One name a process: later calls return the
// first call's directory whatever their name.
inline const std::string& ScratchDir(const std::string& name) {
  static const std::string* const dir = [&] {
    std::error_code shm;
    const std::string parent = std::filesystem::is_directory("/dev/shm", shm) ? "/dev/shm" : "/tmp";
    auto* d = new std::string(parent + "/hap-" + name + "-fuzz-" + std::to_string(getpid()));
    std::error_code ignored;
    std::filesystem::create_directories(*d, ignored);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(*dir, ignored);
    });
    return d;
  }();
  return *dir;
}

// The zoo MLP of 1 layer, 4 hidden units, 3 inputs, 5 classes, batch 4: the
// model of the npy target's files and of the checkpoint target's seeds.
inline const graph::Graph& SeedMlp() {
  static const graph::Graph* const g = [] {
    auto built = graph::BuildZooModel(
        "mlp", {{"layers", 1}, {"hidden", 4}, {"input", 3}, {"classes", 5}, {"batch", 4}});
    if (!built.ok()) __builtin_trap();
    return new graph::Graph(*std::move(built));
  }();
  return *g;
}

}  // namespace hap::fuzz

#endif  // HAP_TESTS_FUZZ_FUZZ_UTIL_H_
