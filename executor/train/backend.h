// A rank's backend (docs/design.md §10): the device its program runs on and the
// communicator its collectives go through. `cpu` is the CPU device (OpenBLAS
// and our kernels) with Gloo over TCP; `cuda[:N]` is GPU N (cuBLAS and our
// CUDA kernels) with NCCL. The CUDA half exists only in builds made with
// `--config=cuda`; elsewhere asking for it is an error that says so.
#ifndef HAP_EXECUTOR_TRAIN_BACKEND_H_
#define HAP_EXECUTOR_TRAIN_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "executor/comm/communicator.h"
#include "executor/runtime/async_collectives.h"
#include "executor/runtime/device.h"
#include "hap/v1/checkpoint.pb.h"
#include "hap/v1/plan.pb.h"

namespace hap::executor {

struct DeviceSpec {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int ordinal = 0;  // the GPU, for kCuda

  std::string ToString() const;  // "cpu", "cuda:1"
  bool operator==(const DeviceSpec& o) const {
    return kind == o.kind && (kind == Kind::kCpu || ordinal == o.ordinal);
  }
};

// "cpu", "cuda" (GPU 0) or "cuda:N". InvalidArgument naming the text
// otherwise.
absl::StatusOr<DeviceSpec> ParseDeviceSpec(const std::string& text);

// Whether this build has the CUDA backend (built with --config=cuda).
bool CudaBuilt();

// The device the plan places `rank` on: cuda:<its index on the node> when
// the plan's cluster profile says that device is a GPU, else cpu.
DeviceSpec PlannedDevice(const hap::v1::Plan& plan, int rank);

// The device to run `rank` on: `requested` ("--device") when not empty,
// else the plan's. A GPU the plan asks for in a build without CUDA falls
// back to the CPU, and `*note` (when given) says so; an explicit request
// for cuda there is FailedPrecondition (MakeDevice). In a CUDA build, a plan
// mixing GPU and CPU ranks is FailedPrecondition without `requested`: NCCL
// and Gloo ranks cannot talk to each other.
absl::StatusOr<DeviceSpec> ChooseDevice(const std::string& requested, const hap::v1::Plan& plan,
                                        int rank, std::string* note = nullptr);

// The device of `spec`; `threads` kernel threads on the CPU. CUDA: NCCL
// needs one GPU per rank, so ranks of one plan on one machine pass
// different ordinals. FailedPrecondition "this build has no CUDA support;
// rebuild with --config=cuda" for cuda in a build without it; the CUDA
// device's errors (Unavailable without a GPU, InvalidArgument for an
// ordinal out of range).
absl::StatusOr<std::unique_ptr<Device>> MakeDevice(const DeviceSpec& spec, int threads);

// Connects `device`'s communicator: NCCL for a CUDA device, Gloo for any
// other. `options` are Gloo's (hostname is Gloo's alone); NCCL takes the
// same rank, size, prefix and timeout. `device` must outlive the result.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectBackend(Device& device,
                                                             const GlooOptions& options,
                                                             RendezvousStore& store);

// Whether `program` has asynchronous collectives (a plan lowered with
// overlap): its runner then wants ConnectOverlap's communication thread.
bool HasAsyncCollectives(const hap::v1::RankProgram& program);

// The communication thread (async_collectives.h) of the asynchronous
// collectives, with a communicator of its own: Gloo, a second context from
// the same store under "<prefix>/overlap"; NCCL, a second communicator
// (its own unique id under that prefix and its own stream) that orders its
// stream after the compute stream's work but not the compute stream after
// it, so kernels run on while it communicates (the thread waits for the
// collective, then queues the copies out of staging). Every rank of a plan
// calls it, or none. Errors: those of ConnectBackend.
absl::StatusOr<std::unique_ptr<AsyncCollectives>> ConnectOverlap(Device& device,
                                                                 const GlooOptions& options,
                                                                 RendezvousStore& store);

// Every rank of `world` (its rank, size, prefix and timeout) publishes the
// CollectiveSignature of its `program` in `store` and compares: rank 0
// with every rank, the others with rank 0. FailedPrecondition naming the
// ranks whose programs issue other collectives (a lowering fault, or ranks
// given different plans), which would otherwise wait for each other until
// the timeout or exchange wrong data; the store's errors (DeadlineExceeded
// for a rank that never published) otherwise. Called once the
// communicator is connected, so every rank has published by then.
absl::Status CheckProgramsAgree(const hap::v1::RankProgram& program, const GlooOptions& world,
                                RendezvousStore& store);

// Where a rank's training starts: `key` says what ranks must agree on (a
// checkpoint's step and the run that wrote it, or the initializers and
// their seed), `description` names it for people (the checkpoint's path).
struct TrainingStart {
  std::string key;
  std::string description;
  std::string Published() const;  // key (one line), newline, description
};

// The start from the initializers (with the plan's `seed`), and from a
// checkpoint (its trainer state and step directory): the key is its step
// and the run that wrote it (plan, seed, when it was written, world size),
// not its path, so one checkpoint copied to each node agrees with itself.
TrainingStart InitializersStart(uint64_t seed);
TrainingStart CheckpointStart(const hap::v1::TrainerState& trainer, const std::string& step_dir);

// Like CheckProgramsAgree, for where the ranks start: FailedPrecondition
// naming the ranks that start elsewhere (each rank resolves --resume DIR
// to the newest complete checkpoint it sees, which differs between nodes
// whose directories differ, or while a checkpoint is being committed), so
// that they never train on from different states. Ranks that start from
// one checkpoint at different paths agree.
absl::Status CheckStartsAgree(const TrainingStart& start, const GlooOptions& world,
                              RendezvousStore& store);

// A device and its communicator. Members are destroyed in reverse order:
// the communication thread, then the communicator, then the device they use.
struct Backend {
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<AsyncCollectives> async;  // ConnectOverlap; may be null
};

// MakeDevice, then ConnectBackend.
absl::StatusOr<Backend> MakeBackend(const DeviceSpec& spec, int threads, const GlooOptions& options,
                                    RendezvousStore& store);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_TRAIN_BACKEND_H_
