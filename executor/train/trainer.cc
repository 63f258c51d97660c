#include "executor/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "executor/cpu/cpu_device.h"
#include "executor/train/backend.h"

namespace hap::executor {

absl::StatusOr<TrainResult> TrainRank(ProgramRunner& runner,
                                      data::BatchSource& batches,
                                      const TrainOptions& options) {
  return TrainRankWith(
      runner, [&](const Batch& b, int64_t step) { return runner.RunStep(b, step); }, batches,
      options);
}

absl::StatusOr<TrainResult> TrainRankWith(
    ProgramRunner& runner,
    const std::function<absl::StatusOr<double>(const Batch&, int64_t)>& run_step,
    data::BatchSource& batches, const TrainOptions& options) {
  if (options.initialize) {
    HAP_RETURN_IF_ERROR(options.initialize(runner));
  } else {
    HAP_RETURN_IF_ERROR(runner.InitializeParameters());
  }
  TrainResult result;
  for (int64_t i = 0; i < options.steps; ++i) {
    if (options.cancelled && options.cancelled()) {
      return absl::CancelledError(absl::StrCat("training cancelled before step ",
                                               options.first_step + i));
    }
    const int64_t step = options.first_step + i;
    HAP_ASSIGN_OR_RETURN(data::GlobalBatch batch, batches.Get(step));
    auto start = std::chrono::steady_clock::now();
    HAP_ASSIGN_OR_RETURN(double loss, run_step(batch, step));
    double seconds = std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - start).count();
    if (!std::isfinite(loss)) {
      return absl::AbortedError(absl::StrCat(
          "training stopped: the loss is ", loss, " at step ", step,
          " (rank ", runner.program().rank(), ")"));
    }
    result.losses.push_back(loss);
    result.step_seconds.push_back(seconds);
    if (options.on_step) options.on_step(step, loss, seconds);
    if (options.after_step) HAP_RETURN_IF_ERROR(options.after_step(runner, step + 1));
  }
  if (options.return_parameters) {
    HAP_ASSIGN_OR_RETURN(result.parameters, runner.Parameters());
  }
  return result;
}

absl::StatusOr<std::vector<TrainResult>> RunLocalRanks(
    const std::vector<hap::v1::RankProgram>& programs, const graph::Graph& g,
    const std::function<std::unique_ptr<data::BatchSource>(int rank)>& batches,
    const TrainOptions& train, const LocalRanksOptions& options) {
  const int n = static_cast<int>(programs.size());
  std::vector<absl::StatusOr<TrainResult>> results(
      n, absl::UnknownError("rank did not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      results[r] = [&]() -> absl::StatusOr<TrainResult> {
        std::unique_ptr<Device> device = NewCpuDevice(options.threads_per_rank);
        std::unique_ptr<Communicator> comm;
        std::unique_ptr<AsyncCollectives> async;
        RunnerOptions ro = options.runner;
        if (options.connect) {
          HAP_ASSIGN_OR_RETURN(comm, options.connect(r));
        } else {
          HAP_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousStore> store,
                               NewFileStore(options.rendezvous_dir));
          GlooOptions go;
          go.rank = r;
          go.size = n;
          go.prefix = options.prefix;
          go.timeout = options.timeout;
          HAP_ASSIGN_OR_RETURN(comm, ConnectGloo(go, *store));
          HAP_RETURN_IF_ERROR(CheckProgramsAgree(programs[r], go, *store));
          if (options.overlap && HasAsyncCollectives(programs[r])) {
            HAP_ASSIGN_OR_RETURN(async, ConnectOverlap(*device, go, *store));
            ro.async = async.get();
          }
        }
        HAP_ASSIGN_OR_RETURN(std::unique_ptr<ProgramRunner> runner,
                             ProgramRunner::Create(programs[r], g, device.get(), comm.get(), ro));
        std::unique_ptr<data::BatchSource> source = batches(r);
        return TrainRank(*runner, *source, train);
      }();
    });
  }
  for (auto& t : threads) t.join();
  std::vector<TrainResult> out;
  for (int r = 0; r < n; ++r) {
    if (!results[r].ok()) return Annotate(results[r].status(), absl::StrCat("rank ", r));
    out.push_back(*std::move(results[r]));
  }
  return out;
}

absl::StatusOr<std::map<std::string, HostTensor>> AssembleParameters(
    const std::vector<std::vector<ParameterShard>>& per_rank) {
  std::map<std::string, HostTensor> out;
  // Per parameter and element: 1 once a piece has set it. Counting each
  // piece's elements instead let two copies of one half stand for both.
  std::map<std::string, HostTensor> covered;
  for (const auto& shards : per_rank) {
    for (const ParameterShard& s : shards) {
      auto it = out.find(s.name);
      if (it == out.end()) {
        it = out.emplace(s.name, HostTensor(s.value.dtype(), s.global_shape)).first;
        covered.emplace(s.name, HostTensor(DType::kInt32, s.global_shape));
      }
      if (it->second.shape() != s.global_shape || it->second.dtype() != s.value.dtype()) {
        return absl::InvalidArgumentError(
            absl::StrCat("pieces of parameter '", s.name, "' disagree in shape"));
      }
      // What earlier pieces set of this piece's elements must be what it
      // holds: a replica that diverged is an error, not overwritten.
      HostTensor& mask = covered.at(s.name);
      const std::vector<int64_t> zero(s.offsets.size(), 0);
      HostTensor seen(DType::kInt32, s.value.shape()), before(s.value.dtype(), s.value.shape());
      HAP_RETURN_IF_ERROR(HostCopyBox(mask.view(), s.offsets, seen.view(), zero, s.value.shape()));
      HAP_RETURN_IF_ERROR(
          HostCopyBox(it->second.view(), s.offsets, before.view(), zero, s.value.shape()));
      const int64_t esize = graph::DTypeBytes(s.value.dtype());
      const auto* now = static_cast<const char*>(s.value.data());
      const auto* was = static_cast<const char*>(before.data());
      for (int64_t i = 0; i < s.value.num_elements(); ++i) {
        if (seen.as<int32_t>()[i] && std::memcmp(now + i * esize, was + i * esize, esize) != 0) {
          return absl::DataLossError(absl::StrCat(
              "the pieces of parameter '", s.name, "' disagree: element ", i, " of the piece at ",
              graph::ShapeString(s.offsets), " differs from an earlier piece's copy"));
        }
        seen.as<int32_t>()[i] = 1;
      }
      HAP_RETURN_IF_ERROR(
          HostCopyBox(s.value.view(), zero, it->second.view(), s.offsets, s.value.shape()));
      HAP_RETURN_IF_ERROR(HostCopyBox(seen.view(), zero, mask.view(), s.offsets, s.value.shape()));
    }
  }
  for (const auto& [name, mask] : covered) {
    const int32_t* m = mask.as<int32_t>();
    if (std::find(m, m + mask.num_elements(), 0) != m + mask.num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the pieces of parameter '", name, "' leave elements uncovered"));
    }
  }
  return out;
}

}  // namespace hap::executor
