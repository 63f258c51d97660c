#include "planner/lower/arena.h"

#include <algorithm>
#include <numeric>
#include <utility>

namespace hap::lower {

ArenaLayout PlanArena(const std::vector<ArenaRequest>& requests) {
  const size_t n = requests.size();
  ArenaLayout out;
  out.offsets.assign(n, 0);
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return requests[a].bytes > requests[b].bytes;
  });
  // x rounded up to the alignment, or false when that passes INT64_MAX.
  auto aligned = [](int64_t x, int64_t* out) {
    if (__builtin_add_overflow(x, kArenaAlignment - 1, out)) return false;
    *out = *out / kArenaAlignment * kArenaAlignment;
    return true;
  };
  std::vector<size_t> placed;
  std::vector<std::pair<int64_t, int64_t>> busy;  // [begin, end) in bytes
  for (size_t i : order) {
    const ArenaRequest& r = requests[i];
    if (r.bytes <= 0) continue;
    busy.clear();
    for (size_t j : placed) {
      const ArenaRequest& q = requests[j];
      if (q.first <= r.last && r.first <= q.last) {
        busy.emplace_back(out.offsets[j], out.offsets[j] + q.bytes);
      }
    }
    std::sort(busy.begin(), busy.end());
    int64_t at = 0, end = 0;
    for (const auto& [b, e] : busy) {
      if (r.bytes <= b - at) break;  // at + r.bytes <= b, without overflow
      int64_t e_up = 0;
      aligned(e, &e_up);  // (a placed buffer's end rounds up: checked below)
      at = std::max(at, e_up);
    }
    if (__builtin_add_overflow(at, r.bytes, &end) || !aligned(end, &end)) {
      out.overflow = true;
      return out;
    }
    out.offsets[i] = at;
    out.total_bytes = std::max(out.total_bytes, end);
    placed.push_back(i);
  }
  return out;
}

}  // namespace hap::lower
