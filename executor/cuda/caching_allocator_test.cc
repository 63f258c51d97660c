#include "executor/cuda/caching_allocator.h"

#include <cstdlib>
#include <map>
#include <set>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor::cuda {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// A backend over malloc that counts calls and can be told to fail.
struct FakeMemory {
  int allocs = 0, releases = 0, syncs = 0;
  int64_t capacity = -1;  // < 0: unbounded
  int64_t live = 0;
  std::set<void*> blocks;

  MemoryBackend Backend() {
    MemoryBackend b;
    b.allocate = [this](int64_t bytes) -> void* {
      if (capacity >= 0 && live + bytes > capacity) return nullptr;
      ++allocs;
      live += bytes;
      void* p = std::malloc(static_cast<size_t>(bytes));
      blocks.insert(p);
      sizes[p] = bytes;
      return p;
    };
    b.release = [this](void* p) {
      ++releases;
      live -= sizes[p];
      blocks.erase(p);
      std::free(p);
    };
    b.synchronize = [this] { ++syncs; };
    return b;
  }
  std::map<void*, int64_t> sizes;
};

TEST(CachingAllocatorTest, RoundsToSizeClasses) {
  EXPECT_EQ(CachingAllocator::RoundSize(0), 512);
  EXPECT_EQ(CachingAllocator::RoundSize(1), 512);
  EXPECT_EQ(CachingAllocator::RoundSize(513), 1024);
  EXPECT_EQ(CachingAllocator::RoundSize((1 << 20) + 1), 2 << 20);
  EXPECT_EQ(CachingAllocator::RoundSize((64 << 20) + 1), 72 << 20);
}

TEST(CachingAllocatorTest, ReusesFreedBlocksWithoutTheBackend) {
  FakeMemory mem;
  CachingAllocator alloc(mem.Backend(), 0, "fake:0");
  auto a = alloc.Allocate(1000);
  ASSERT_THAT(a, IsOk());
  alloc.Free(*a);
  EXPECT_EQ(alloc.in_use_bytes(), 0);
  EXPECT_EQ(alloc.held_bytes(), 1024);
  auto b = alloc.Allocate(900);  // same size class
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(*b, *a);
  EXPECT_EQ(mem.allocs, 1);
  // A second live block of the class needs the backend again.
  auto c = alloc.Allocate(1000);
  ASSERT_THAT(c, IsOk());
  EXPECT_NE(*c, *b);
  EXPECT_EQ(mem.allocs, 2);
  EXPECT_EQ(alloc.in_use_bytes(), 2048);
}

TEST(CachingAllocatorTest, ReusesSomewhatLargerBlocksOnly) {
  FakeMemory mem;
  CachingAllocator alloc(mem.Backend(), 0, "fake:0");
  auto big = alloc.Allocate(4096);
  ASSERT_THAT(big, IsOk());
  alloc.Free(*big);
  auto half = alloc.Allocate(2048);  // within 2x: reused
  ASSERT_THAT(half, IsOk());
  EXPECT_EQ(*half, *big);
  alloc.Free(*half);
  auto tiny = alloc.Allocate(512);  // 8x smaller: a fresh block
  ASSERT_THAT(tiny, IsOk());
  EXPECT_NE(*tiny, *big);
  EXPECT_EQ(mem.allocs, 2);
}

TEST(CachingAllocatorTest, LimitReleasesTheCacheThenFailsNamingTheBytes) {
  FakeMemory mem;
  CachingAllocator alloc(mem.Backend(), 4096, "fake:0");
  auto a = alloc.Allocate(2048);
  auto b = alloc.Allocate(1024);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  alloc.Free(*b);  // cached: 3072 held, 2048 in use
  // 2048 more does not fit beside the cache: the cache goes, then it fits.
  auto c = alloc.Allocate(2048);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(mem.releases, 1);
  EXPECT_GE(mem.syncs, 1);  // the stream is drained before memory goes back
  EXPECT_EQ(alloc.held_bytes(), 4096);
  EXPECT_THAT(alloc.Allocate(1),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("fake:0"), HasSubstr("allocating 1 bytes"),
                             HasSubstr("4096 bytes held"),
                             HasSubstr("4096 in use"),
                             HasSubstr("limit 4096"))));
  alloc.Free(*a);
  EXPECT_THAT(alloc.Allocate(1), IsOk());  // reuses a's block
}

TEST(CachingAllocatorTest, BackendFailureRetriesAfterReleasingTheCache) {
  FakeMemory mem;
  mem.capacity = 2048;
  CachingAllocator alloc(mem.Backend(), 0, "fake:0");
  auto a = alloc.Allocate(1024);
  ASSERT_THAT(a, IsOk());
  alloc.Free(*a);
  auto b = alloc.Allocate(2048);  // backend full with the cached 1024
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(mem.releases, 1);
  EXPECT_THAT(alloc.Allocate(512),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("2048 bytes held"),
                             HasSubstr("no limit set"))));
}

TEST(CachingAllocatorTest, IgnoresNullAndUnknownPointersAndNegativeSizes) {
  FakeMemory mem;
  CachingAllocator alloc(mem.Backend(), 0, "fake:0");
  alloc.Free(nullptr);
  int x = 0;
  alloc.Free(&x);
  EXPECT_EQ(alloc.held_bytes(), 0);
  EXPECT_THAT(alloc.Allocate(-1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative")));
}

TEST(CachingAllocatorTest, DestructorReleasesEverything) {
  FakeMemory mem;
  {
    CachingAllocator alloc(mem.Backend(), 0, "fake:0");
    auto a = alloc.Allocate(100);
    auto b = alloc.Allocate(100 << 20);
    ASSERT_THAT(a, IsOk());
    ASSERT_THAT(b, IsOk());
    alloc.Free(*a);
  }
  EXPECT_TRUE(mem.blocks.empty());
  EXPECT_EQ(mem.releases, 2);
}

}  // namespace
}  // namespace hap::executor::cuda
