// Asynchronous collectives (plan.proto CollectiveCall.async): a rank
// program's collective started at one step and waited for (WaitCall) at a
// later one runs behind the kernels in between. The program runner hands
// each one here as work over a communicator and staging memory of this
// object's own, so nothing it touches is shared with the in-line
// collectives.
//
// Thread-safety: Start, Wait and WaitAll are called by one thread (the
// runner's); the work runs on another.
#ifndef HAP_EXECUTOR_RUNTIME_ASYNC_COLLECTIVES_H_
#define HAP_EXECUTOR_RUNTIME_ASYNC_COLLECTIVES_H_

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "executor/comm/communicator.h"
#include "executor/runtime/collective_call.h"
#include "executor/runtime/device.h"

namespace hap::executor {

class AsyncCollectives {
 public:
  using Work = std::function<absl::Status(Communicator& comm, Staging& staging)>;
  virtual ~AsyncCollectives() = default;

  // Queues `work` under `id` (unique among the ids not waited for yet) and
  // returns at once. FailedPrecondition, naming the first error, once any
  // work has failed (the communicator is then unusable); InvalidArgument
  // for an id already running.
  virtual absl::Status Start(int id, Work work) = 0;
  // Blocks until the work of `id` has run; its error, if it failed, or
  // FailedPrecondition when it was not run because earlier work failed.
  // NotFound for an id that is not running.
  virtual absl::Status Wait(int id) = 0;
  // Waits for all work started; the first error among them.
  virtual absl::Status WaitAll() = 0;
};

// Runs the work on one communication thread, in the order started, with
// `comm` and staging memory on `device`. `comm` must be a communicator of
// its own (a second Gloo context from the same rendezvous store under
// another prefix, or a second NCCL communicator): collectives are matched
// by call order across ranks, per communicator. `device` must allow copies
// and allocations from another thread while kernels run (the CPU and CUDA
// devices do), and outlive the result. The destructor drops work not begun
// and joins the thread: work in progress ends, or fails at the
// communicator's timeout when a peer is gone.
std::unique_ptr<AsyncCollectives> NewCommThread(Device* device, std::unique_ptr<Communicator> comm);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_ASYNC_COLLECTIVES_H_
