#include "executor/train/backend.h"

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "executor/cpu/cpu_device.h"
#include "planner/lower/plan_file.h"

#ifdef HAP_WITH_CUDA
#include "executor/cuda/cuda_device.h"
#include "executor/cuda/nccl_communicator.h"
#endif

namespace hap::executor {

namespace v1 = ::hap::v1;

std::string DeviceSpec::ToString() const {
  return kind == Kind::kCpu ? "cpu" : absl::StrCat("cuda:", ordinal);
}

absl::StatusOr<DeviceSpec> ParseDeviceSpec(const std::string& text) {
  DeviceSpec spec;
  if (text == "cpu") return spec;
  absl::string_view rest = text;
  if (absl::ConsumePrefix(&rest, "cuda")) {
    spec.kind = DeviceSpec::Kind::kCuda;
    if (rest.empty()) return spec;
    int ordinal = -1;
    if (absl::ConsumePrefix(&rest, ":") && absl::SimpleAtoi(rest, &ordinal) && ordinal >= 0) {
      spec.ordinal = ordinal;
      return spec;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device '", text, "' is not cpu, cuda or cuda:N (N a GPU index)"));
}

bool CudaBuilt() {
#ifdef HAP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

DeviceSpec PlannedDevice(const v1::Plan& plan, int rank) {
  DeviceSpec spec;
  if (rank < 0 || rank >= plan.devices_size()) return spec;
  const std::string& id = plan.devices(rank);
  for (const v1::Node& node : plan.cluster().nodes()) {
    for (const v1::Device& d : node.devices()) {
      if (d.id() != id) continue;
      if (d.kind() == v1::GPU) {
        spec.kind = DeviceSpec::Kind::kCuda;
        spec.ordinal = d.local_index();
      }
      return spec;
    }
  }
  return spec;
}

absl::StatusOr<DeviceSpec> ChooseDevice(const std::string& requested, const v1::Plan& plan,
                                        int rank, std::string* note) {
  if (!requested.empty()) return ParseDeviceSpec(requested);
  DeviceSpec planned = PlannedDevice(plan, rank);
  if (CudaBuilt()) {
    // NCCL (between GPUs) and Gloo (between CPUs) do not talk to each other,
    // and Gloo cannot read GPU memory: a plan is all GPUs or all CPUs.
    for (int r = 0; r < plan.devices_size(); ++r) {
      if (PlannedDevice(plan, r).kind != planned.kind) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the plan puts rank ", rank, " on ", planned.ToString(), " but rank ", r, " on ",
            PlannedDevice(plan, r).ToString(),
            ": plans mixing GPU and CPU ranks cannot run (NCCL and Gloo do not talk to each "
            "other); run every rank with --device cpu"));
      }
    }
  }
  if (planned.kind == DeviceSpec::Kind::kCuda && !CudaBuilt()) {
    if (note != nullptr) {
      *note = absl::StrCat("the plan places rank ", rank, " on a GPU (", planned.ToString(),
                           ") but this build has no CUDA support; running it on the CPU");
    }
    return DeviceSpec{};
  }
  return planned;
}

absl::StatusOr<std::unique_ptr<Device>> MakeDevice(const DeviceSpec& spec, int threads) {
  if (spec.kind == DeviceSpec::Kind::kCpu) return NewCpuDevice(threads);
#ifdef HAP_WITH_CUDA
  absl::StatusOr<std::unique_ptr<Device>> d = NewCudaDevice(spec.ordinal);
  if (!d.ok()) return Annotate(d.status(), absl::StrCat("device ", spec.ToString()));
  return d;
#else
  return absl::FailedPreconditionError(absl::StrCat(
      "device ", spec.ToString(), ": this build has no CUDA support; rebuild with --config=cuda"));
#endif
}

#ifdef HAP_WITH_CUDA
// NCCL's options from Gloo's (the same rank, size, prefix and timeout).
NcclOptions NcclOptionsOf(Device& device, const GlooOptions& options) {
  NcclOptions n;
  n.rank = options.rank;
  n.size = options.size;
  n.prefix = options.prefix;
  n.timeout = options.timeout;
  n.device = &device;
  return n;
}
#endif

absl::StatusOr<std::unique_ptr<Communicator>> ConnectBackend(Device& device,
                                                             const GlooOptions& options,
                                                             RendezvousStore& store) {
#ifdef HAP_WITH_CUDA
  if (CudaOrdinal(device) >= 0) return ConnectNccl(NcclOptionsOf(device, options), store);
#else
  (void)device;
#endif
  return ConnectGloo(options, store);
}

bool HasAsyncCollectives(const v1::RankProgram& program) {
  for (const v1::Step& s : program.steps()) {
    if (s.has_collective() && s.collective().async()) return true;
  }
  return false;
}

absl::StatusOr<std::unique_ptr<AsyncCollectives>> ConnectOverlap(Device& device,
                                                                 const GlooOptions& options,
                                                                 RendezvousStore& store) {
  GlooOptions o = options;
  o.prefix = absl::StrCat(options.prefix, "/overlap");
  std::unique_ptr<Communicator> comm;
#ifdef HAP_WITH_CUDA
  if (CudaOrdinal(device) >= 0) {
    NcclOptions n = NcclOptionsOf(device, o);
    n.order_compute_after = false;
    HAP_ASSIGN_OR_RETURN(comm, ConnectNccl(n, store));
  }
#endif
  if (comm == nullptr) {
    // The main context's event loop stays as configured; this one serves a
    // thread that overlaps compute, so it keeps the default policy.
    o.idle_progress_thread = false;
    HAP_ASSIGN_OR_RETURN(comm, ConnectGloo(o, store));
  }
  return NewCommThread(&device, std::move(comm));
}

absl::Status CheckProgramsAgree(const v1::RankProgram& program, const GlooOptions& world,
                                RendezvousStore& store) {
  if (world.size <= 1) return absl::OkStatus();
  auto key = [&](int rank) { return absl::StrCat(world.prefix, "/program-signature/", rank); };
  const std::string mine = lower::CollectiveSignature(program);
  HAP_RETURN_IF_ERROR(store.Set(key(world.rank), mine));
  const absl::Time deadline = absl::Now() + world.timeout;
  std::vector<int> others;
  if (world.rank == 0) {
    for (int r = 1; r < world.size; ++r) others.push_back(r);
  } else {
    others.push_back(0);
  }
  std::vector<int> differ;
  std::string theirs_first;
  for (int r : others) {
    absl::StatusOr<std::string> theirs =
        store.Get(key(r), std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!theirs.ok()) {
      return absl::Status(theirs.status().code(), absl::StrCat("comparing the ranks' programs: ",
                                                               theirs.status().message()));
    }
    if (*theirs != mine) {
      if (differ.empty()) theirs_first = *theirs;
      differ.push_back(r);
    }
  }
  if (differ.empty()) return absl::OkStatus();
  const size_t shown = std::min<size_t>(differ.size(), 8);
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", world.rank, "'s program issues other collectives than rank",
      differ.size() > 1 ? "s " : " ", absl::StrJoin(differ.begin(), differ.begin() + shown, ", "),
      differ.size() > shown ? absl::StrCat(" and ", differ.size() - shown, " more") : "",
      " (collective signature ", mine.substr(0, 12), " against ", theirs_first.substr(0, 12),
      "): the ranks would wait for each other or exchange wrong data. A lowering fault, or ranks "
      "given different plans"));
}

absl::StatusOr<Backend> MakeBackend(const DeviceSpec& spec, int threads, const GlooOptions& options,
                                    RendezvousStore& store) {
  Backend b;
  HAP_ASSIGN_OR_RETURN(b.device, MakeDevice(spec, threads));
  HAP_ASSIGN_OR_RETURN(b.comm, ConnectBackend(*b.device, options, store));
  return b;
}

}  // namespace hap::executor
