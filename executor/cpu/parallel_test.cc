// RunChunks and ParallelFor (kernels_util.cc) on the persistent worker
// pool: every chunk runs once with its bounds, from one caller and from
// many callers at once (ranks run as threads of one process), and a chunk
// that runs chunks itself (nested) completes.
#include <atomic>
#include <thread>
#include <vector>

#include "executor/cpu/kernels_internal.h"
#include "gtest/gtest.h"

namespace hap::executor::cpu {
namespace {

// Chunks of [0, n) cover it once, in order of their indices.
void ExpectCover(int chunks, int64_t n) {
  std::vector<std::atomic<int>> hits(n);
  std::vector<int64_t> begin(chunks, -1), end(chunks, -1);
  RunChunks(chunks, n, [&](int c, int64_t b, int64_t e) {
    begin[c] = b;
    end[c] = e;
    for (int64_t i = b; i < e; ++i) hits[i]++;
  });
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "item " << i;
  EXPECT_EQ(begin[0], 0);
  EXPECT_EQ(end[chunks - 1], n);
  for (int c = 1; c < chunks; ++c) EXPECT_EQ(begin[c], end[c - 1]) << "chunk " << c;
}

TEST(ParallelTest, ChunksCoverTheRangeOnce) {
  for (int chunks : {1, 2, 3, 7, 16}) {
    for (int64_t n : {16, 17, 1000}) ExpectCover(chunks, n);
  }
}

TEST(ParallelTest, ManyCallersAtOnce) {
  std::vector<std::thread> callers;
  std::atomic<int64_t> total{0};
  for (int t = 0; t < 8; ++t) {
    callers.emplace_back([&] {
      for (int round = 0; round < 200; ++round) {
        ParallelFor(4, 1000, 1, [&](int64_t b, int64_t e) { total += e - b; });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(total.load(), int64_t{8} * 200 * 1000);
}

TEST(ParallelTest, NestedChunksComplete) {
  std::atomic<int64_t> total{0};
  ParallelFor(4, 64, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      ParallelFor(4, 100, 1, [&](int64_t x, int64_t y) { total += y - x; });
    }
  });
  EXPECT_EQ(total.load(), int64_t{64} * 100);
}

}  // namespace
}  // namespace hap::executor::cpu
