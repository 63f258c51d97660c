// Memory planning for a rank's buffers: each buffer gets an offset in one
// arena so that buffers alive at the same time never overlap. Greedy:
// largest first, each at the lowest 64-byte aligned offset free over its
// whole lifetime (the classic offset-assignment heuristic for static
// tensor lifetimes).
#ifndef HAP_PLANNER_LOWER_ARENA_H_
#define HAP_PLANNER_LOWER_ARENA_H_

#include <cstdint>
#include <vector>

namespace hap::lower {

struct ArenaRequest {
  int64_t bytes = 0;
  int first = 0;  // first step using it (inclusive)
  int last = 0;   // last step using it (inclusive)
};

struct ArenaLayout {
  std::vector<int64_t> offsets;  // per request
  int64_t total_bytes = 0;
  // Buffers alive together need more than an int64 of bytes: the layout is
  // incomplete (offsets of the later buffers are 0) and unusable.
  bool overflow = false;
};

inline constexpr int64_t kArenaAlignment = 64;

ArenaLayout PlanArena(const std::vector<ArenaRequest>& requests);

}  // namespace hap::lower

#endif  // HAP_PLANNER_LOWER_ARENA_H_
