// The NCCL backend of the communicator (executor/comm/communicator.h) for
// ranks on GPUs: every buffer is device memory of the rank's CUDA device
// (cuda_device.h), one GPU per rank.
//
// Streams: NCCL runs on the communicator's own stream. Each call orders that
// stream after the work already queued on the device's compute stream (an
// event), queues the collective, and orders the compute stream after it (an
// event), so kernels queued later see the result. The call then waits on
// the host until the collective has completed on the GPU, bounded by the
// timeout: errors come from the call that failed, as the interface promises.
//
// Uneven chunks: PADDED pads every chunk to the largest in scratch device
// memory and runs one ncclAllGather / ncclReduceScatter (no copies when the
// chunks are even); GROUPED runs one ncclBroadcast (all-gather) or
// ncclReduce (reduce-scatter) per rank with a non-empty chunk, inside one
// NCCL group. All-to-all is a group of ncclSend/ncclRecv, the rank's own
// chunk a device copy. Barrier is an all-reduce of one element.
//
// Errors (the interface's): InvalidArgument before any traffic for
// inconsistent sizes, unsummable dtypes, roots out of range and buffers
// that are not memory of this rank's GPU; DeadlineExceeded when a collective
// does not complete within the timeout (a peer that died or never called
// it); Unavailable when NCCL reports a remote or system failure (a broken
// connection); Internal for any other NCCL or CUDA failure. Each names the
// collective and carries NCCL's own message. On any of these the NCCL
// communicator is aborted (ncclCommAbort) and every later call returns
// FailedPrecondition naming the first error.
//
// NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU
// detected"): ConnectNccl then fails (Internal, NCCL's message included).
//
// Thread-safety: one thread at a time (collectives are matched by call
// order across ranks); any thread may make the calls.
#ifndef HAP_EXECUTOR_CUDA_NCCL_COMMUNICATOR_H_
#define HAP_EXECUTOR_CUDA_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "executor/comm/communicator.h"
#include "executor/runtime/device.h"

namespace hap::executor {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  // Prefix of the rendezvous key (a plan's name and generation), so that
  // restarted or concurrent plans never mix. The unique id is stored under
  // "<prefix>/nccl-unique-id".
  std::string prefix = "hap";
  // Per collective, and for connecting (the rendezvous and NCCL's set-up).
  absl::Duration timeout = absl::Seconds(60);
  // The rank's device, made by NewCudaDevice; not owned. It must outlive the
  // communicator. Its compute stream and GPU are the communicator's.
  Device* device = nullptr;
  // Whether each call orders the compute stream after the collective (an
  // event). False for the communicator of the asynchronous collectives
  // (train/backend.h ConnectOverlap): kernels queued meanwhile by another
  // thread run on, overlapping the collective; the call still returns only
  // once the collective completed (the host waits), so what its caller
  // queues on the compute stream afterwards (copies out of staging) sees
  // the result.
  bool order_compute_after = true;
};

// Connects rank `options.rank` of `options.size`: rank 0 creates NCCL's
// unique id and sets it in `store`, the others get it (waiting up to the
// timeout), then every rank initialises its NCCL communicator (non-blocking
// mode, polled up to the timeout). The store must outlive the call only.
// Errors: InvalidArgument for a rank out of range, a timeout that is not
// positive or a device that is not a CUDA device; DeadlineExceeded when a
// peer does not show up within the timeout; the store's errors; Internal or
// Unavailable when NCCL fails (naming NCCL's reason).
absl::StatusOr<std::unique_ptr<Communicator>> ConnectNccl(const NcclOptions& options,
                                                          RendezvousStore& store);

// NCCL's version as "2.28.9" (the library linked at run time).
std::string NcclVersion();

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_CUDA_NCCL_COMMUNICATOR_H_
