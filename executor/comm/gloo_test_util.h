// Tests only: the Gloo communicator's tests' helpers (gloo_communicator_test,
// gloo_connect_test, file_store_test): ranks as threads over a file store.
#ifndef HAP_EXECUTOR_COMM_GLOO_TEST_UTIL_H_
#define HAP_EXECUTOR_COMM_GLOO_TEST_UTIL_H_

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "executor/comm/communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor::gloo_test {

inline std::string FreshDir(const std::string& name) {
  static int counter = 0;
  std::string dir = absl::StrCat(::testing::TempDir(), "/", name, "_", getpid(), "_", counter++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline GlooOptions Rank(int rank, int size, absl::Duration timeout) {
  GlooOptions o;
  o.rank = rank;
  o.size = size;
  o.timeout = timeout;
  return o;
}

// Runs fn(rank, comm) on n threads, each with its own Gloo communicator.
inline void WithRanks(int n, const std::function<void(int, Communicator&)>& fn,
                      absl::Duration timeout = absl::Seconds(20), bool check_calls = true) {
  std::string dir = FreshDir("ranks");
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto store = NewFileStore(dir);
      ASSERT_TRUE(store.ok()) << store.status();
      GlooOptions o = Rank(r, n, timeout);
      o.check_calls = check_calls;
      auto comm = ConnectGloo(o, **store);
      ASSERT_TRUE(comm.ok()) << comm.status();
      fn(r, **comm);
    });
  }
  for (auto& t : threads) t.join();
}

// Rank r's value at element i: distinct per rank and element.
inline double Value(int r, int64_t i) { return 1000.0 * (r + 1) + static_cast<double>(i) * 0.5; }

template <typename T>
TensorView View(std::vector<T>& v) {
  return TensorView{std::is_same<T, double>::value ? DType::kFloat64 : DType::kFloat32,
                    {static_cast<int64_t>(v.size())},
                    v.empty() ? nullptr : v.data()};
}

// A collective that a broken group must fail: Unavailable (the connection
// closed) or DeadlineExceeded (nothing arrived in time), naming itself.
inline ::testing::Matcher<absl::Status> PeerFailure(const std::string& what) {
  using ::hap::testing::StatusIs;
  using ::testing::HasSubstr;
  return ::testing::AnyOf(StatusIs(absl::StatusCode::kUnavailable, HasSubstr(what)),
                          StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr(what)));
}

}  // namespace hap::executor::gloo_test

#endif  // HAP_EXECUTOR_COMM_GLOO_TEST_UTIL_H_
