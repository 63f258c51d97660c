#include "executor/train/backend.h"

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
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

namespace {

// The part of a published value that ranks compare: up to the first
// newline (what follows describes it for messages).
absl::string_view Compared(absl::string_view value) { return value.substr(0, value.find('\n')); }

// Publishes `mine` under `name` and returns the ranks whose value differs
// from it (Compared): rank 0 compares with every rank, the others with
// rank 0. `first` gets the first differing value. The store's errors as
// "comparing `what`: ...".
absl::StatusOr<std::vector<int>> RanksThatDiffer(const GlooOptions& world, RendezvousStore& store,
                                                 const std::string& name, const std::string& what,
                                                 const std::string& mine, std::string* first) {
  std::vector<int> differ;
  if (world.size <= 1) return differ;
  auto key = [&](int rank) { return absl::StrCat(world.prefix, "/", name, "/", rank); };
  HAP_RETURN_IF_ERROR(store.Set(key(world.rank), mine));
  const absl::Time deadline = absl::Now() + world.timeout;
  std::vector<int> others;
  if (world.rank == 0) {
    for (int r = 1; r < world.size; ++r) others.push_back(r);
  } else {
    others.push_back(0);
  }
  for (int r : others) {
    absl::StatusOr<std::string> theirs =
        store.Get(key(r), std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!theirs.ok()) {
      return absl::Status(theirs.status().code(),
                          absl::StrCat("comparing ", what, ": ", theirs.status().message()));
    }
    if (Compared(*theirs) != Compared(mine)) {
      if (differ.empty()) *first = *theirs;
      differ.push_back(r);
    }
  }
  return differ;
}

// "rank 2", "ranks 1, 2, 3 and 5 more".
std::string NameRanks(const std::vector<int>& ranks) {
  const size_t shown = std::min<size_t>(ranks.size(), 8);
  return absl::StrCat(
      ranks.size() > 1 ? "ranks " : "rank ",
      absl::StrJoin(ranks.begin(), ranks.begin() + shown, ", "),
      ranks.size() > shown ? absl::StrCat(" and ", ranks.size() - shown, " more") : "");
}

}  // namespace

absl::Status CheckProgramsAgree(const v1::RankProgram& program, const GlooOptions& world,
                                RendezvousStore& store) {
  const std::string mine = lower::CollectiveSignature(program);
  std::string theirs_first;
  HAP_ASSIGN_OR_RETURN(std::vector<int> differ,
                       RanksThatDiffer(world, store, "program-signature", "the ranks' programs",
                                       mine, &theirs_first));
  if (differ.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", world.rank, "'s program issues other collectives than ", NameRanks(differ),
      " (collective signature ", mine.substr(0, 12), " against ", theirs_first.substr(0, 12),
      "): the ranks would wait for each other or exchange wrong data. A lowering fault, or ranks "
      "given different plans"));
}

std::string TrainingStart::Published() const {
  return absl::StrCat(absl::StrReplaceAll(key, {{"\n", " "}}), "\n", description);
}

TrainingStart InitializersStart(uint64_t seed) {
  return {absl::StrCat("initializers seed ", seed),
          absl::StrCat("the initializers (seed ", seed, ")")};
}

TrainingStart CheckpointStart(const v1::TrainerState& trainer, const std::string& step_dir) {
  return {
      absl::StrCat("checkpoint step ", trainer.step(), " of plan ", trainer.plan_hash(), " seed ",
                   trainer.seed(), " on ", trainer.world_size(), " ranks written ", trainer.time()),
      absl::StrCat("checkpoint ", step_dir, " (step ", trainer.step(), ")")};
}

absl::Status CheckStartsAgree(const TrainingStart& start, const GlooOptions& world,
                              RendezvousStore& store) {
  std::string theirs_first;
  HAP_ASSIGN_OR_RETURN(std::vector<int> differ,
                       RanksThatDiffer(world, store, "training-start", "where the ranks start",
                                       start.Published(), &theirs_first));
  if (differ.empty()) return absl::OkStatus();
  const size_t nl = theirs_first.find('\n');
  const std::string theirs_description =
      nl == std::string::npos ? theirs_first : theirs_first.substr(nl + 1);
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", world.rank, " starts from ", start.description, " but ", NameRanks(differ),
      differ.size() > 1 ? " (the first of them)" : "", " from ", theirs_description,
      ": the ranks would train from different states. Each rank opens its --resume directory "
      "itself and takes the newest complete checkpoint it finds there: give every rank the same "
      "checkpoint (DIR/step-N) on storage they share"));
}

absl::StatusOr<Backend> MakeBackend(const DeviceSpec& spec, int threads, const GlooOptions& options,
                                    RendezvousStore& store) {
  Backend b;
  HAP_ASSIGN_OR_RETURN(b.device, MakeDevice(spec, threads));
  HAP_ASSIGN_OR_RETURN(b.comm, ConnectBackend(*b.device, options, store));
  return b;
}

}  // namespace hap::executor
