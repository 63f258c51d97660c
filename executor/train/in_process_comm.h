// A communicator among threads of one process, through shared memory (test
// only): the fake for testing collective_call.cc's shard mapping and the
// interpreter without sockets. The real one is Gloo (executor/comm).
#ifndef HAP_EXECUTOR_TRAIN_IN_PROCESS_COMM_H_
#define HAP_EXECUTOR_TRAIN_IN_PROCESS_COMM_H_

#include <memory>
#include <vector>

#include "executor/comm/communicator.h"

namespace hap::executor {

// `n` communicators, one per rank, to be driven by n threads. They honour
// the contract on calls of Gloo's with check_calls (communicator.h): a call
// refused by its rank's own checks, or calls that differ across ranks, end
// InvalidArgument on every rank with Gloo's messages, before any data moves,
// and the group stays in step and usable. Point-to-point is Unimplemented.
std::vector<std::unique_ptr<Communicator>> NewInProcessGroup(int n);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_TRAIN_IN_PROCESS_COMM_H_
