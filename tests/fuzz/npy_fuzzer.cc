// libFuzzer target: training data in `.npy` files (hap-executor --data
// npy:DIR), through OpenUserDataSet and then a batch of every step of the
// first epoch and one past it. The first byte picks the file the rest is
// written to (the MLP's input x or its labels); the other file is a valid
// one. Whatever OpenUserDataSet accepts must give whole batches of the
// graph's shapes, and labels within the classes.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "executor/data/user_data.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

// A version 1.0 .npy file of `descr` and `shape` holding `data`.
std::string Npy(const std::string& descr, const std::string& shape, const std::string& data) {
  std::string header =
      "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::string out = "\x93NUMPY\x01";
  out.push_back('\0');
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  return out + header + data;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const hap::graph::Graph* const g = &hap::fuzz::SeedMlp();
  const std::string& dir = hap::fuzz::ScratchDir("npy");
  if (size < 1) return 0;
  // Valid files for 8 samples: x f32[8, 3], labels i64[8] in 0..4.
  float x[24];
  for (int i = 0; i < 24; ++i) x[i] = 0.25f * static_cast<float>(i);
  int64_t y[8];
  for (int i = 0; i < 8; ++i) y[i] = i % 5;
  const std::string valid_x =
      Npy("<f4", "(8, 3)", std::string(reinterpret_cast<const char*>(x), sizeof x));
  const std::string valid_y =
      Npy("<i8", "(8,)", std::string(reinterpret_cast<const char*>(y), sizeof y));
  const bool fuzz_x = data[0] % 2 == 0;
  if (!hap::fuzz::WriteFile(dir + "/x.npy",
                            fuzz_x ? data + 1 : reinterpret_cast<const uint8_t*>(valid_x.data()),
                            fuzz_x ? size - 1 : valid_x.size()) ||
      !hap::fuzz::WriteFile(dir + "/labels.npy",
                            fuzz_x ? reinterpret_cast<const uint8_t*>(valid_y.data()) : data + 1,
                            fuzz_x ? valid_y.size() : size - 1)) {
    return 0;
  }
  hap::data::DataOptions o;
  if (data[0] & 2) o.shuffle_seed = data[0];
  auto set = hap::data::OpenUserDataSet("npy:" + dir, *g, o);
  if (!set.ok()) return 0;
  const int64_t n = (*set)->num_samples(), b = (*set)->batch_size();
  if (n < b || b != 4) __builtin_trap();
  for (int64_t step = 0; step <= n / b; ++step) {
    auto batch = (*set)->Get(step);
    if (!batch.ok() || batch->size() != 2) __builtin_trap();
    for (const auto& [name, t] : *batch) {
      if (t.shape().empty() || t.shape()[0] != b) __builtin_trap();
      for (int64_t i = 0; name == "labels" && i < t.shape()[0]; ++i) {
        const int64_t label = t.dtype() == hap::graph::DType::kInt64 ? t.as<int64_t>()[i]
                                                                     : int64_t{t.as<int32_t>()[i]};
        if (label < 0 || label >= 5) __builtin_trap();
      }
    }
  }
  return 0;
}
