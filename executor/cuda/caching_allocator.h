// Internal to executor/cuda: the caching allocator behind CudaDevice's
// Allocate/Free. Blocks are rounded to size classes and kept on per-size
// free lists when freed, so a training step's allocations after the first
// come from the cache instead of cudaMalloc (which synchronizes the device).
//
// Reuse is stream-ordered: every user of the memory runs on the device's one
// compute stream, so a block freed while queued work still reads it can be
// handed to later work at once; the stream runs them in order. Memory used
// from another stream (NCCL) must be ordered before the compute stream's
// later work by the user (events) before it is freed.
//
// Thread-safety: every method may be called from any thread.
#ifndef HAP_EXECUTOR_CUDA_CACHING_ALLOCATOR_H_
#define HAP_EXECUTOR_CUDA_CACHING_ALLOCATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace hap::executor::cuda {

// Where memory comes from: cudaMalloc/cudaFree on a device, a fake in tests.
struct MemoryBackend {
  // A block of `bytes`, or nullptr when there is no memory.
  std::function<void*(int64_t bytes)> allocate;
  std::function<void(void* p)> release;
  // Waits until no queued work can use a cached block (called before cached
  // blocks go back to the backend).
  std::function<void()> synchronize;
};

class CachingAllocator {
 public:
  // `limit_bytes` > 0 bounds the bytes held (in use + cached); 0: no bound
  // beyond what the backend gives. `name` prefixes errors ("cuda:0").
  CachingAllocator(MemoryBackend backend, int64_t limit_bytes,
                   std::string name);
  // Releases every block, in use or cached.
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` (0 gives a minimal block, never nullptr),
  // from the cache when one fits. When the limit or the backend refuses,
  // the cache is released and the allocation retried once; then
  // ResourceExhausted naming the bytes requested, held, in use and the
  // limit. InvalidArgument for negative `bytes`.
  absl::StatusOr<void*> Allocate(int64_t bytes);
  // Returns a block from Allocate to the cache. Null and unknown pointers
  // are ignored.
  void Free(void* p);
  // Gives every cached block back to the backend (after synchronize).
  void ReleaseCache();

  int64_t held_bytes() const;    // in use + cached
  int64_t in_use_bytes() const;  // handed out and not freed
  int64_t limit_bytes() const { return limit_; }

  // The size class of a request: multiples of 512 bytes below 1 MiB,
  // of 1 MiB below 64 MiB, of 8 MiB above.
  static int64_t RoundSize(int64_t bytes);

 private:
  void ReleaseCacheLocked();
  void* TakeCachedLocked(int64_t size);

  MemoryBackend backend_;
  const int64_t limit_;
  const std::string name_;
  mutable std::mutex mu_;
  std::multimap<int64_t, void*> free_;            // size -> cached block
  std::unordered_map<void*, int64_t> in_use_;     // block -> size
  int64_t held_ = 0, in_use_bytes_ = 0;
};

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_CACHING_ALLOCATOR_H_
