// Waits against a deadline in Gloo's terms (whole milliseconds on
// std::chrono clocks), shared by the Gloo communicator's point-to-point
// receives and its agreement on the call (call_agreement.h).
#ifndef HAP_EXECUTOR_COMM_DEADLINE_H_
#define HAP_EXECUTOR_COMM_DEADLINE_H_

#include <algorithm>
#include <chrono>

namespace hap::executor {

// The whole milliseconds left until `deadline`, rounded up (at least 1): a
// wait that starts at once waits (and Gloo's message says) the group's
// timeout.
inline std::chrono::milliseconds MillisecondsLeft(std::chrono::steady_clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(
                                                    deadline - std::chrono::steady_clock::now()));
}

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_DEADLINE_H_
