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
  auto aligned = [](int64_t x) {
    return (x + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
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
    int64_t at = 0;
    for (const auto& [b, e] : busy) {
      if (at + r.bytes <= b) break;
      at = std::max(at, aligned(e));
    }
    out.offsets[i] = at;
    out.total_bytes = std::max(out.total_bytes, aligned(at + r.bytes));
    placed.push_back(i);
  }
  return out;
}

}  // namespace hap::lower
