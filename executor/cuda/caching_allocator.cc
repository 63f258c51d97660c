#include "executor/cuda/caching_allocator.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hap::executor::cuda {
namespace {

constexpr int64_t kMiB = 1 << 20;

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

CachingAllocator::CachingAllocator(MemoryBackend backend, int64_t limit_bytes,
                                   std::string name)
    : backend_(std::move(backend)),
      limit_(limit_bytes > 0 ? limit_bytes : 0),
      name_(std::move(name)) {}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  ReleaseCacheLocked();
  for (auto& [p, size] : in_use_) backend_.release(p);
  in_use_.clear();
}

int64_t CachingAllocator::RoundSize(int64_t bytes) {
  if (bytes <= 0) return 512;
  if (bytes < kMiB) return RoundUp(bytes, 512);
  if (bytes < 64 * kMiB) return RoundUp(bytes, kMiB);
  return RoundUp(bytes, 8 * kMiB);
}

// The smallest cached block of at least `size` bytes and at most twice it
// (a bigger one would strand memory a larger request could use).
void* CachingAllocator::TakeCachedLocked(int64_t size) {
  auto it = free_.lower_bound(size);
  if (it == free_.end() || it->first > 2 * size) return nullptr;
  void* p = it->second;
  const int64_t got = it->first;
  free_.erase(it);
  in_use_[p] = got;
  in_use_bytes_ += got;
  return p;
}

absl::StatusOr<void*> CachingAllocator::Allocate(int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": cannot allocate a negative size (", bytes, ")"));
  }
  const int64_t size = RoundSize(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (void* p = TakeCachedLocked(size)) return p;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1) {
      if (free_.empty()) break;  // nothing to give back: retrying is futile
      ReleaseCacheLocked();
    }
    if (limit_ > 0 && held_ + size > limit_) continue;
    void* p = backend_.allocate(size);
    if (p == nullptr) continue;
    held_ += size;
    in_use_[p] = size;
    in_use_bytes_ += size;
    return p;
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      name_, ": out of memory allocating ", bytes, " bytes (", size,
      " rounded): ", held_, " bytes held, ", in_use_bytes_, " in use",
      limit_ > 0 ? absl::StrCat(", limit ", limit_, " bytes")
                 : std::string(", no limit set")));
}

void CachingAllocator::Free(void* p) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_use_.find(p);
  if (it == in_use_.end()) return;
  free_.emplace(it->second, p);
  in_use_bytes_ -= it->second;
  in_use_.erase(it);
}

void CachingAllocator::ReleaseCache() {
  std::lock_guard<std::mutex> lock(mu_);
  ReleaseCacheLocked();
}

void CachingAllocator::ReleaseCacheLocked() {
  if (free_.empty()) return;
  if (backend_.synchronize) backend_.synchronize();
  for (auto& [size, p] : free_) {
    backend_.release(p);
    held_ -= size;
  }
  free_.clear();
}

int64_t CachingAllocator::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

int64_t CachingAllocator::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_bytes_;
}

}  // namespace hap::executor::cuda
