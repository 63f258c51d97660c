// The NCCL backend of the communicator (nccl_communicator.h). NCCL and the
// CUDA runtime calls it needs live in this file only; every call goes
// through HAP_NCCL / HAP_CUDA, which turn a failure into a status naming the
// call, the line and the library's own message.
//
// Non-blocking NCCL (ncclConfig_t.blocking = 0): set-up and group launches
// may return ncclInProgress, and the host then polls ncclCommGetAsyncError,
// so every wait here is bounded by the timeout. Each collective is one NCCL
// group (even a single call), so "queued" has one meaning: ncclGroupEnd
// returned and, if it said ncclInProgress, the communicator became ready.
#include "executor/cuda/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "executor/comm/call_checks.h"
#include "executor/cuda/cuda_device.h"
#include "executor/cuda/cuda_status.h"

namespace hap::executor {
namespace {

// What a failed CUDA call's status says was being done.
constexpr char kCudaContext[] = "NCCL communicator";

// NCCL's result as a status. Remote and system failures (a peer that died,
// a socket that closed) are Unavailable; everything else is Internal, since
// the arguments were checked before any call. ncclGetLastError holds the
// reason NCCL logged (e.g. "Duplicate GPU detected ..."), which the result
// code alone does not say.
absl::Status NcclStatus(ncclResult_t r, const char* expr, int line, ncclComm_t comm) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  std::string msg =
      absl::StrCat("NCCL error ", static_cast<int>(r), " (", ncclGetErrorString(r), ")");
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') absl::StrAppend(&msg, ": ", last);
  if (expr != nullptr) {
    absl::StrAppend(&msg, " in ", expr, " at nccl_communicator.cc:", line);
  }
  if (r == ncclRemoteError || r == ncclSystemError) {
    return LostPeerError(absl::StrCat("connection to a peer failed: ", msg));
  }
  return absl::InternalError(msg);
}

#define HAP_NCCL(expr, comm) HAP_RETURN_IF_ERROR(NcclStatus((expr), #expr, __LINE__, (comm)))

// Polls `done` until it returns true, yielding first and then sleeping, so a
// short wait costs little latency and a long one little CPU.
class Poller {
 public:
  void Pause() {
    if (++polls_ < 2000) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(polls_ < 20000 ? 20 : 500));
    }
  }

 private:
  int64_t polls_ = 0;
};

// Waits until NCCL's state of `comm` is no longer ncclInProgress (set-up, a
// group launch). OK when it became ncclSuccess; DeadlineExceeded at
// `deadline`; NCCL's error otherwise.
absl::Status WaitNcclReady(ncclComm_t comm, absl::Time deadline, const std::string& doing) {
  Poller poller;
  while (true) {
    ncclResult_t state = ncclSuccess;
    HAP_NCCL(ncclCommGetAsyncError(comm, &state), comm);
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclStatus(state, nullptr, 0, comm);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          doing, " did not finish within the timeout (a peer that died or never joined?)"));
    }
    poller.Pause();
  }
}

size_t ElementSize(const TensorView& v) { return static_cast<size_t>(graph::DTypeBytes(v.dtype)); }

char* At(const TensorView& v, int64_t elements) {
  return static_cast<char*>(v.data) + elements * graph::DTypeBytes(v.dtype);
}

std::vector<int64_t> Offsets(absl::Span<const int64_t> counts) {
  std::vector<int64_t> off(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) off[i] = off[i - 1] + counts[i - 1];
  return off;
}

int64_t Largest(absl::Span<const int64_t> counts) {
  return counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
}

bool AllEqual(absl::Span<const int64_t> counts) {
  return std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
}

ncclDataType_t SumType(DType t) {
  return t == DType::kFloat64    ? ncclFloat64
         : t == DType::kBFloat16 ? ncclBfloat16
                                 : ncclFloat32;
}

absl::Status Invalid(const std::string& m) { return absl::InvalidArgumentError(m); }

std::string Ptr(const void* p) { return absl::StrFormat("%p", p); }

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int ordinal, cudaStream_t compute,
                   absl::Duration timeout, bool order_compute_after)
      : comm_(comm),
        rank_(rank),
        size_(size),
        ordinal_(ordinal),
        compute_(compute),
        timeout_(timeout),
        order_compute_after_(order_compute_after) {}

  // Streams, events and the barrier's element; called once before use.
  absl::Status Init() {
    HAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_), kCudaContext);
    HAP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                             kCudaContext);
    HAP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming),
                             kCudaContext);
    HAP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming),
                             kCudaContext);
    HAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&one_, sizeof(float)), kCudaContext);
    HAP_CUDA_RETURN_IF_ERROR(cudaMemset(one_, 0, sizeof(float)), kCudaContext);
    return absl::OkStatus();
  }

  ~NcclCommunicator() override {
    cudaSetDevice(ordinal_);
    if (comm_ != nullptr) {
      bool finalized = false;
      if (failed_.ok()) {
        // Flushes what NCCL still holds; bounded, since a peer that is gone
        // may keep it from finishing.
        ncclResult_t r = ncclCommFinalize(comm_);
        if (r == ncclSuccess || r == ncclInProgress) {
          absl::Duration wait = std::min(timeout_, absl::Seconds(10));
          finalized = WaitNcclReady(comm_, absl::Now() + wait, "finalizing").ok();
        }
      }
      if (finalized) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (void* p : scratch_) {
      if (p != nullptr) cudaFree(p);
    }
    if (one_ != nullptr) cudaFree(one_);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduce(TensorView buf) override {
    HAP_RETURN_IF_ERROR(Usable("all-reduce"));
    HAP_RETURN_IF_ERROR(AllReduceCall(buf).status());
    const int64_t n = buf.num_elements();
    if (n == 0) return absl::OkStatus();
    HAP_RETURN_IF_ERROR(OnDevice("all-reduce", {buf}));
    return Run("all-reduce", [&]() -> absl::Status {
      return Group([&]() -> absl::Status {
        HAP_NCCL(ncclAllReduce(buf.data, buf.data, n, SumType(buf.dtype), ncclSum, comm_, stream_),
                 comm_);
        return absl::OkStatus();
      });
    });
  }

  absl::Status AllGather(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                         CommMethod method) override {
    HAP_RETURN_IF_ERROR(Usable("all-gather"));
    HAP_RETURN_IF_ERROR(AllGatherCall(in, out, counts, method, rank_, size_).status());
    const int64_t m = Largest(counts);
    if (m == 0) return absl::OkStatus();
    HAP_RETURN_IF_ERROR(OnDevice("all-gather", {in, out}));
    const size_t es = ElementSize(out);
    const std::vector<int64_t> off = Offsets(counts);
    if (method == CommMethod::kGrouped) {
      // One broadcast per rank, rooted at the chunk's owner, straight into
      // place: the owner's source is its input.
      return Run("all-gather (grouped)", [&]() -> absl::Status {
        return Group([&]() -> absl::Status {
          for (int r = 0; r < size_; ++r) {
            if (counts[r] == 0) continue;
            char* dst = At(out, off[r]);
            const void* src = r == rank_ ? in.data : dst;
            HAP_NCCL(ncclBroadcast(src, dst, counts[r] * es, ncclUint8, r, comm_, stream_), comm_);
          }
          return absl::OkStatus();
        });
      });
    }
    if (AllEqual(counts)) {
      return Run("all-gather (padded)", [&]() -> absl::Status {
        return Group([&]() -> absl::Status {
          HAP_NCCL(ncclAllGather(in.data, out.data, m * es, ncclUint8, comm_, stream_), comm_);
          return absl::OkStatus();
        });
      });
    }
    // Every chunk padded to the largest; one all-gather; the chunks copied
    // out of the padded slots. The padding's bytes are never read.
    HAP_ASSIGN_OR_RETURN(char* send, Scratch(0, m * es));
    HAP_ASSIGN_OR_RETURN(char* recv, Scratch(1, m * es * size_));
    return Run("all-gather (padded)", [&]() -> absl::Status {
      if (counts[rank_] > 0) {
        HAP_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(send, in.data, counts[rank_] * es, cudaMemcpyDeviceToDevice, stream_),
            kCudaContext);
      }
      HAP_RETURN_IF_ERROR(Group([&]() -> absl::Status {
        HAP_NCCL(ncclAllGather(send, recv, m * es, ncclUint8, comm_, stream_), comm_);
        return absl::OkStatus();
      }));
      for (int r = 0; r < size_; ++r) {
        if (counts[r] == 0) continue;
        HAP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At(out, off[r]), recv + r * m * es, counts[r] * es,
                                                 cudaMemcpyDeviceToDevice, stream_),
                                 kCudaContext);
      }
      return absl::OkStatus();
    });
  }

  absl::Status ReduceScatter(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                             CommMethod method) override {
    HAP_RETURN_IF_ERROR(Usable("reduce-scatter"));
    HAP_RETURN_IF_ERROR(ReduceScatterCall(in, out, counts, method, rank_, size_).status());
    const int64_t m = Largest(counts);
    if (m == 0) return absl::OkStatus();
    HAP_RETURN_IF_ERROR(OnDevice("reduce-scatter", {in, out}));
    const size_t es = ElementSize(in);
    const ncclDataType_t type = SumType(in.dtype);
    const std::vector<int64_t> off = Offsets(counts);
    if (method == CommMethod::kGrouped) {
      // One reduce per rank, rooted at the chunk's owner. Off the root NCCL
      // documents the receive buffer as unused; scratch is passed anyway
      // (shared by those reduces), so that the input stays as it was even
      // if an algorithm did write there.
      HAP_ASSIGN_OR_RETURN(char* unused, Scratch(1, m * es));
      return Run("reduce-scatter (grouped)", [&]() -> absl::Status {
        return Group([&]() -> absl::Status {
          for (int r = 0; r < size_; ++r) {
            if (counts[r] == 0) continue;
            char* src = At(in, off[r]);
            void* dst = r == rank_ ? out.data : unused;
            HAP_NCCL(ncclReduce(src, dst, counts[r], type, ncclSum, r, comm_, stream_), comm_);
          }
          return absl::OkStatus();
        });
      });
    }
    if (AllEqual(counts)) {
      return Run("reduce-scatter (padded)", [&]() -> absl::Status {
        return Group([&]() -> absl::Status {
          HAP_NCCL(ncclReduceScatter(in.data, out.data, m, type, ncclSum, comm_, stream_), comm_);
          return absl::OkStatus();
        });
      });
    }
    // Every chunk copied into a zeroed slot of the largest size; one
    // reduce-scatter; this rank's chunk copied out of its slot.
    HAP_ASSIGN_OR_RETURN(char* send, Scratch(0, m * es * size_));
    HAP_ASSIGN_OR_RETURN(char* recv, Scratch(1, m * es));
    return Run("reduce-scatter (padded)", [&]() -> absl::Status {
      HAP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(send, 0, m * es * size_, stream_), kCudaContext);
      for (int r = 0; r < size_; ++r) {
        if (counts[r] == 0) continue;
        HAP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(send + r * m * es, At(in, off[r]), counts[r] * es,
                                                 cudaMemcpyDeviceToDevice, stream_),
                                 kCudaContext);
      }
      HAP_RETURN_IF_ERROR(Group([&]() -> absl::Status {
        HAP_NCCL(ncclReduceScatter(send, recv, m, type, ncclSum, comm_, stream_), comm_);
        return absl::OkStatus();
      }));
      if (counts[rank_] > 0) {
        HAP_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(out.data, recv, counts[rank_] * es, cudaMemcpyDeviceToDevice, stream_),
            kCudaContext);
      }
      return absl::OkStatus();
    });
  }

  absl::Status AllToAll(TensorView in, absl::Span<const int64_t> send_counts, TensorView out,
                        absl::Span<const int64_t> recv_counts) override {
    HAP_RETURN_IF_ERROR(Usable("all-to-all"));
    HAP_RETURN_IF_ERROR(AllToAllCall(in, send_counts, out, recv_counts, size_).status());
    if (send_counts[rank_] != recv_counts[rank_]) {
      return Invalid(absl::StrCat("all-to-all: rank ", rank_, " sends ", send_counts[rank_],
                                  " elements to itself but expects ", recv_counts[rank_]));
    }
    if (in.num_elements() == 0 && out.num_elements() == 0) return absl::OkStatus();
    HAP_RETURN_IF_ERROR(OnDevice("all-to-all", {in, out}));
    const size_t es = ElementSize(in);
    const std::vector<int64_t> soff = Offsets(send_counts), roff = Offsets(recv_counts);
    return Run("all-to-all", [&]() -> absl::Status {
      if (send_counts[rank_] > 0) {  // this rank's own chunk: a copy
        HAP_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(At(out, roff[rank_]), At(in, soff[rank_]), send_counts[rank_] * es,
                            cudaMemcpyDeviceToDevice, stream_),
            kCudaContext);
      }
      return Group([&]() -> absl::Status {
        for (int j = 0; j < size_; ++j) {
          if (j == rank_) continue;
          if (send_counts[j] > 0) {
            HAP_NCCL(ncclSend(At(in, soff[j]), send_counts[j] * es, ncclUint8, j, comm_, stream_),
                     comm_);
          }
          if (recv_counts[j] > 0) {
            HAP_NCCL(ncclRecv(At(out, roff[j]), recv_counts[j] * es, ncclUint8, j, comm_, stream_),
                     comm_);
          }
        }
        return absl::OkStatus();
      });
    });
  }

  absl::Status Broadcast(TensorView buf, int root) override {
    HAP_RETURN_IF_ERROR(Usable("broadcast"));
    HAP_RETURN_IF_ERROR(BroadcastCall(buf, root, size_).status());
    if (buf.bytes() == 0) return absl::OkStatus();
    HAP_RETURN_IF_ERROR(OnDevice("broadcast", {buf}));
    return Run("broadcast", [&]() -> absl::Status {
      return Group([&]() -> absl::Status {
        HAP_NCCL(ncclBroadcast(buf.data, buf.data, buf.bytes(), ncclUint8, root, comm_, stream_),
                 comm_);
        return absl::OkStatus();
      });
    });
  }

  absl::Status Reduce(TensorView in, TensorView out, int root) override {
    HAP_RETURN_IF_ERROR(Usable("reduce"));
    HAP_RETURN_IF_ERROR(ReduceCall(in, out, root, rank_, size_).status());
    const int64_t n = in.num_elements();
    if (n == 0) return absl::OkStatus();
    HAP_RETURN_IF_ERROR(rank_ == root ? OnDevice("reduce", {in, out}) : OnDevice("reduce", {in}));
    char* unused = nullptr;  // the receive buffer off the root (see ReduceScatter)
    if (rank_ != root) {
      HAP_ASSIGN_OR_RETURN(unused, Scratch(1, in.bytes()));
    }
    return Run("reduce", [&]() -> absl::Status {
      return Group([&]() -> absl::Status {
        void* dst = rank_ == root ? out.data : unused;
        HAP_NCCL(ncclReduce(in.data, dst, n, SumType(in.dtype), ncclSum, root, comm_, stream_),
                 comm_);
        return absl::OkStatus();
      });
    });
  }

  // Point-to-point on device buffers: NCCL has no tags, so messages between
  // two ranks match in call order (the tag is checked only); each call
  // completes before it returns (a send waits for its receive), so callers
  // order sends and receives without cycles.
  absl::Status Send(TensorView buf, int peer, int64_t tag) override {
    HAP_RETURN_IF_ERROR(Usable("send"));
    HAP_RETURN_IF_ERROR(CheckPeer("send", peer, tag));
    if (buf.bytes() == 0) return absl::OkStatus();
    HAP_RETURN_IF_ERROR(OnDevice("send", {buf}));
    return Run(absl::StrCat("send to rank ", peer), [&]() -> absl::Status {
      return Group([&]() -> absl::Status {
        HAP_NCCL(ncclSend(buf.data, buf.bytes(), ncclUint8, peer, comm_, stream_), comm_);
        return absl::OkStatus();
      });
    });
  }

  absl::Status Recv(TensorView buf, int peer, int64_t tag) override {
    HAP_RETURN_IF_ERROR(Usable("receive"));
    HAP_RETURN_IF_ERROR(CheckPeer("receive", peer, tag));
    if (buf.bytes() == 0) return absl::OkStatus();
    HAP_RETURN_IF_ERROR(OnDevice("receive", {buf}));
    return Run(absl::StrCat("receive from rank ", peer), [&]() -> absl::Status {
      return Group([&]() -> absl::Status {
        HAP_NCCL(ncclRecv(buf.data, buf.bytes(), ncclUint8, peer, comm_, stream_), comm_);
        return absl::OkStatus();
      });
    });
  }

  absl::Status WaitSends() override { return Usable("send"); }

  absl::Status Barrier() override {
    HAP_RETURN_IF_ERROR(Usable("barrier"));
    return Run("barrier", [&]() -> absl::Status {
      return Group([&]() -> absl::Status {
        HAP_NCCL(ncclAllReduce(one_, one_, 1, ncclFloat32, ncclSum, comm_, stream_), comm_);
        return absl::OkStatus();
      });
    });
  }

 private:
  // --- argument checks (before any traffic; they leave the communicator
  // usable, as in the Gloo backend) ---

  absl::Status CheckPeer(const char* what, int peer, int64_t tag) const {
    if (peer < 0 || peer >= size_ || peer == rank_) {
      return Invalid(absl::StrCat(what, ": peer ", peer, " is not another of ", size_,
                                  " ranks (this is rank ", rank_, ")"));
    }
    if (tag < 0 || tag > 0xffffffffLL) {
      return Invalid(absl::StrCat(what, ": tag ", tag, " is outside [0, 2^32)"));
    }
    return absl::OkStatus();
  }

  // Every non-empty buffer must be memory of this rank's GPU: NCCL given a
  // host pointer faults on the GPU instead of failing the call.
  absl::Status OnDevice(const char* what, std::initializer_list<TensorView> views) const {
    for (const TensorView& v : views) {
      if (v.bytes() == 0) continue;
      if (v.data == nullptr) {
        return Invalid(
            absl::StrCat(what, ": a buffer of ", v.num_elements(), " elements is absent"));
      }
      cudaPointerAttributes a;
      cudaError_t e = cudaPointerGetAttributes(&a, v.data);
      if (e != cudaSuccess) {
        cudaGetLastError();  // not sticky; do not leave it for the next check
        return Invalid(absl::StrCat(what, ": cannot tell where buffer ", Ptr(v.data), " lives (",
                                    cudaGetErrorString(e), ")"));
      }
      if (a.type == cudaMemoryTypeManaged) continue;
      if (a.type != cudaMemoryTypeDevice) {
        return Invalid(absl::StrCat(what, ": buffer ", Ptr(v.data),
                                    " is host memory, not memory of GPU ", ordinal_));
      }
      if (a.device != ordinal_) {
        return Invalid(absl::StrCat(what, ": buffer ", Ptr(v.data), " is memory of GPU ", a.device,
                                    ", not of this rank's GPU ", ordinal_));
      }
    }
    return absl::OkStatus();
  }

  // Scratch device memory `which` (0 or 1) of at least `bytes`, kept for the
  // communicator's lifetime. Every collective has completed when the next
  // starts, so an old buffer can be freed at once. ResourceExhausted when it
  // does not fit (before any traffic: the communicator stays usable).
  absl::StatusOr<char*> Scratch(int which, int64_t bytes) {
    if (bytes <= scratch_size_[which]) return static_cast<char*>(scratch_[which]);
    HAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_), kCudaContext);
    if (scratch_[which] != nullptr)
      HAP_CUDA_RETURN_IF_ERROR(cudaFree(scratch_[which]), kCudaContext);
    scratch_[which] = nullptr;
    scratch_size_[which] = 0;
    cudaError_t e = cudaMalloc(&scratch_[which], bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      scratch_[which] = nullptr;
      return absl::ResourceExhaustedError(absl::StrCat("NCCL scratch of ", bytes, " bytes on GPU ",
                                                       ordinal_, ": ", cudaGetErrorString(e)));
    }
    scratch_size_[which] = bytes;
    return static_cast<char*>(scratch_[which]);
  }

  // --- running a collective ---

  // Every call starts here, even one with nothing to send: after a failure
  // the group is out of step and NCCL's communicator is gone.
  absl::Status Usable(const std::string& what) const {
    if (failed_.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the communicator failed earlier: ", failed_.message()));
  }

  // `calls` between ncclGroupStart and ncclGroupEnd; waits while the launch
  // is in progress (non-blocking communicator).
  absl::Status Group(const std::function<absl::Status()>& calls) {
    HAP_NCCL(ncclGroupStart(), comm_);
    absl::Status s = calls();
    ncclResult_t end = ncclGroupEnd();  // always closes the group
    HAP_RETURN_IF_ERROR(s);
    HAP_NCCL(end, comm_);
    if (end == ncclInProgress) {
      return WaitNcclReady(comm_, deadline_, "launching the collective");
    }
    return absl::OkStatus();
  }

  // Waits until the work queued on our stream has completed on the GPU, or
  // NCCL reports an error, or the deadline passes.
  absl::Status WaitForCompletion() {
    Poller poller;
    while (true) {
      cudaError_t e = cudaEventQuery(done_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) return cuda::CudaStatus(e, "cudaEventQuery(done_)", kCudaContext);
      ncclResult_t state = ncclSuccess;
      HAP_NCCL(ncclCommGetAsyncError(comm_, &state), comm_);
      if (state != ncclSuccess && state != ncclInProgress) {
        return NcclStatus(state, nullptr, 0, comm_);
      }
      if (absl::Now() > deadline_) {
        return absl::DeadlineExceededError(absl::StrCat(
            "timed out after ", absl::FormatDuration(timeout_),
            " waiting for the peers (a rank that died or did not make the same call)"));
      }
      poller.Pause();
    }
    // An error NCCL found while the work completed (e.g. a peer's abort).
    ncclResult_t state = ncclSuccess;
    HAP_NCCL(ncclCommGetAsyncError(comm_, &state), comm_);
    if (state != ncclSuccess && state != ncclInProgress) {
      return NcclStatus(state, nullptr, 0, comm_);
    }
    return absl::OkStatus();
  }

  // Orders our stream after the compute stream, queues `queue` (copies and
  // NCCL groups on stream_), orders the compute stream after it, and waits
  // for completion. A failure aborts NCCL's communicator and is remembered.
  absl::Status Run(const std::string& what, const std::function<absl::Status()>& queue) {
    deadline_ = absl::Now() + timeout_;
    absl::Status s = [&]() -> absl::Status {
      HAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_), kCudaContext);
      HAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready_, compute_), kCudaContext);
      HAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ready_, 0), kCudaContext);
      HAP_RETURN_IF_ERROR(queue());
      HAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_, stream_), kCudaContext);
      if (order_compute_after_)
        HAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, done_, 0), kCudaContext);
      return WaitForCompletion();
    }();
    if (s.ok()) return s;
    s = Annotate(s, absl::StrCat(what, " (rank ", rank_, " of ", size_, ")"));
    failed_ = s;
    // Ends NCCL's kernels, so that nothing queued after them on either
    // stream waits forever.
    ncclCommAbort(comm_);
    comm_ = nullptr;
    return s;
  }

  ncclComm_t comm_;
  const int rank_;
  const int size_;
  const int ordinal_;
  cudaStream_t compute_;  // the device's; not owned
  const absl::Duration timeout_;
  const bool order_compute_after_;  // NcclOptions::order_compute_after
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;  // on compute_: what the collective waits for
  cudaEvent_t done_ = nullptr;   // on stream_: the collective's completion
  float* one_ = nullptr;         // the barrier's element
  void* scratch_[2] = {nullptr, nullptr};
  int64_t scratch_size_[2] = {0, 0};
  absl::Time deadline_;  // of the collective in progress
  absl::Status failed_;
};

}  // namespace

std::string NcclVersion() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // Since 2.9: major * 10000 + minor * 100 + patch.
  return absl::StrCat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectNccl(const NcclOptions& o,
                                                          RendezvousStore& store) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return Invalid(absl::StrCat("rank ", o.rank, " is out of range for a world of ", o.size));
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return Invalid("the communicator timeout must be positive");
  }
  const int ordinal = o.device == nullptr ? -1 : CudaOrdinal(*o.device);
  if (ordinal < 0) {
    return Invalid(absl::StrCat("NCCL needs a CUDA device, got ",
                                o.device == nullptr ? "none" : o.device->name()));
  }
  const std::string what =
      absl::StrCat("connecting rank ", o.rank, " of ", o.size, " over NCCL on GPU ", ordinal);
  const absl::Time deadline = absl::Now() + o.timeout;
  absl::StatusOr<ncclComm_t> comm = [&]() -> absl::StatusOr<ncclComm_t> {
    HAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal), kCudaContext);
    ncclUniqueId id;
    const std::string key = absl::StrCat(o.prefix, "/nccl-unique-id");
    if (o.rank == 0) {
      HAP_NCCL(ncclGetUniqueId(&id), nullptr);
      HAP_RETURN_IF_ERROR(store.Set(key, std::string(id.internal, sizeof(id.internal))));
    } else {
      absl::StatusOr<std::string> v = store.Get(key, o.timeout);
      if (!v.ok()) return Annotate(v.status(), "waiting for rank 0's NCCL id");
      if (v->size() != sizeof(id.internal)) {
        return absl::InternalError(absl::StrCat("the value of '", key, "' holds ", v->size(),
                                                " bytes, not an NCCL id of ", sizeof(id.internal)));
      }
      std::memcpy(id.internal, v->data(), sizeof(id.internal));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every wait below is ours, bounded by the timeout
    ncclComm_t c = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&c, o.size, id, o.rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      absl::Status s = NcclStatus(r, "ncclCommInitRankConfig", __LINE__, c);
      if (c != nullptr) ncclCommAbort(c);
      return s;
    }
    absl::Status s = WaitNcclReady(
        c, deadline, absl::StrCat("NCCL's set-up (waiting for all ", o.size, " ranks)"));
    if (!s.ok()) {
      ncclCommAbort(c);
      return s;
    }
    return c;
  }();
  if (!comm.ok()) return Annotate(comm.status(), what);
  auto nccl = std::make_unique<NcclCommunicator>(*comm, o.rank, o.size, ordinal,
                                                 CudaComputeStream(*o.device), o.timeout,
                                                 o.order_compute_after);
  HAP_RETURN_IF_ERROR(Annotate(nccl->Init(), what));
  return std::unique_ptr<Communicator>(std::move(nccl));
}

}  // namespace hap::executor
