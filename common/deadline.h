// A deadline `seconds` after `start` on a steady clock, saturating: a time
// budget of any finite size (a request may give 1e300 s) is a deadline
// rather than a conversion to the clock's 64-bit nanoseconds that
// overflows (undefined behaviour; in practice a deadline in the past, so
// the work stopped at once).
#ifndef HAP_COMMON_DEADLINE_H_
#define HAP_COMMON_DEADLINE_H_

#include <chrono>
#include <cmath>

namespace hap {

// Budgets past this (about 31 years) are no deadline at all.
inline constexpr double kNoDeadlineSeconds = 1e9;

// start + seconds (negative: start); Clock::time_point::max() for a budget
// of kNoDeadlineSeconds or more, infinite or NaN.
template <typename Clock = std::chrono::steady_clock>
typename Clock::time_point DeadlineAfter(typename Clock::time_point start, double seconds) {
  if (!(seconds < kNoDeadlineSeconds)) return Clock::time_point::max();
  return start + std::chrono::duration_cast<typename Clock::duration>(
                     std::chrono::duration<double>(seconds > 0 ? seconds : 0.0));
}

}  // namespace hap

#endif  // HAP_COMMON_DEADLINE_H_
