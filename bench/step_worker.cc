// Our side of the training-step benchmark (bench/step_bench.py): one zoo
// model, lowered as the single-device program (world size 1), run by the
// rank-program interpreter on a CPU device with a 1-rank Gloo communicator,
// SGD with momentum (lr 0.01, momentum 0.9). bench/torch_step.py is the
// PyTorch side with the same command line and protocol.
//
//   step_worker --model gpt --threads 1 --layers 2 --hidden 256 ...
//       [--steps 10] [--warmup 2] [--breakdown] [--serve]
//       [--precision fp32|bf16] [--dump FILE.json]
//
// --precision bf16 lowers the program with bf16 mixed precision
// (PlanOptions.precision, README "Precision"). --dump (without --serve)
// writes the graph (proto3 JSON), the initial parameters, every step's batch
// and loss (warm-up steps included) to FILE.json, for
// tests/bf16_autocast_test.py to replay the same training in PyTorch.
//
// Every `--NAME VALUE` other than the flags below is a zoo parameter.
// A step's time is RunStep's wall time (loading the batch into the arena,
// forward, backward, optimizer); making the batch is not timed.
//
// Output, one JSON line per block of steps: {"seconds": [...], "losses":
// [...]}. Without --serve: `--warmup` steps untimed, then one block of
// `--steps`; --breakdown then adds a Markdown table of time per step by
// kernel name over those steps. With --serve: reads a step count a line
// from stdin and answers each with one block (the driver interleaves two
// workers this way); EOF ends it.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "executor/runtime/timing_device.h"
#include "executor/comm/communicator.h"
#include "executor/cpu/cpu_device.h"
#include "executor/data/batches.h"
#include "executor/runtime/program_runner.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace {

using hap::executor::ProgramRunner;

struct Flags {
  std::string model = "mlp";
  int threads = 1;
  int steps = 10;
  int warmup = 2;
  bool serve = false;
  bool breakdown = false;
  bool bf16 = false;
  std::string dump;
  std::map<std::string, double> params;  // zoo parameters
};

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError("unexpected argument " + a);
    }
    std::string key = a.substr(2);
    if (key == "serve") {
      f.serve = true;
      continue;
    }
    if (key == "breakdown") {
      f.breakdown = true;
      continue;
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(a + " needs a value");
    std::string v = argv[++i];
    if (key == "model") {
      f.model = v;
    } else if (key == "threads") {
      f.threads = std::atoi(v.c_str());
    } else if (key == "steps") {
      f.steps = std::atoi(v.c_str());
    } else if (key == "warmup") {
      f.warmup = std::atoi(v.c_str());
    } else if (key == "precision") {
      if (v != "fp32" && v != "bf16") {
        return absl::InvalidArgumentError("--precision must be fp32 or bf16, got '" + v + "'");
      }
      f.bf16 = v == "bf16";
    } else if (key == "dump") {
      f.dump = v;
    } else {
      f.params[key] = std::atof(v.c_str());
    }
  }
  return f;
}

// A tensor as JSON: {"dtype": "f32"|"i64"|..., "shape": [...], "data": [...]}.
std::string TensorJson(const hap::executor::HostTensor& t) {
  std::string out = "{\"dtype\": \"" + std::string(hap::graph::DTypeName(t.dtype())) +
                    "\", \"shape\": [";
  for (size_t i = 0; i < t.shape().size(); ++i) {
    out += (i ? ", " : "") + std::to_string(t.shape()[i]);
  }
  out += "], \"data\": [";
  char buf[32];
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    switch (t.dtype()) {
      case hap::graph::DType::kFloat32:
        std::snprintf(buf, sizeof buf, "%.9g", t.as<float>()[i]);
        break;
      case hap::graph::DType::kFloat64:
        std::snprintf(buf, sizeof buf, "%.17g", t.as<double>()[i]);
        break;
      case hap::graph::DType::kInt32:
        std::snprintf(buf, sizeof buf, "%d", t.as<int32_t>()[i]);
        break;
      default:
        std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(t.as<int64_t>()[i]));
    }
    out += (i ? ", " : "");
    out += buf;
  }
  return out + "]}";
}

// Runs `n` steps from step `*next` on; returns a JSON line of their times
// and losses. `batches_json` (when not null) gets each step's batch.
absl::StatusOr<std::string> RunBlock(ProgramRunner& runner,
                                     hap::data::BatchSource& batches, int n,
                                     int64_t* next,
                                     std::vector<std::string>* batches_json = nullptr) {
  std::string seconds, losses;
  for (int i = 0; i < n; ++i) {
    const int64_t step = (*next)++;
    absl::StatusOr<hap::data::GlobalBatch> batch = batches.Get(step);
    if (!batch.ok()) return batch.status();
    if (batches_json != nullptr) {
      std::string b;
      for (const auto& [name, t] : *batch) {
        b += (b.empty() ? "{\"" : ", \"") + name + "\": " + TensorJson(t);
      }
      batches_json->push_back(b + "}");
    }
    auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<double> loss = runner.RunStep(*batch, step);
    double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    if (!loss.ok()) return loss.status();
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s%.6g", i ? ", " : "", s);
    seconds += buf;
    std::snprintf(buf, sizeof buf, "%s%.6g", i ? ", " : "", *loss);
    losses += buf;
  }
  return "{\"seconds\": [" + seconds + "], \"losses\": [" + losses + "]}";
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "step_worker: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = ParseFlags(argc, argv);
  if (!flags.ok()) return Fail(flags.status());
  absl::StatusOr<hap::graph::Graph> g =
      hap::graph::BuildZooModel(flags->model, flags->params);
  if (!g.ok()) return Fail(g.status());

  hap::lower::LowerOptions lo;
  lo.world_size = 1;
  lo.seed = 1;
  lo.optimizer.set_kind(hap::v1::OptimizerConfig::SGD);
  lo.optimizer.set_learning_rate(0.01);
  lo.optimizer.set_momentum(0.9);
  lo.bf16 = flags->bf16;
  auto programs =
      hap::lower::Lower(*g, hap::lower::SingleDeviceProgram(*g), lo);
  if (!programs.ok()) return Fail(programs.status());

  char dir[] = "/tmp/hap-step-bench-XXXXXX";
  if (mkdtemp(dir) == nullptr)
    return Fail(absl::InternalError("mkdtemp failed"));
  auto store = hap::executor::NewFileStore(dir);
  if (!store.ok()) return Fail(store.status());
  hap::executor::GlooOptions go;  // rank 0 of 1
  auto comm = hap::executor::ConnectGloo(go, **store);
  std::filesystem::remove_all(dir);  // the rendezvous is over
  if (!comm.ok()) return Fail(comm.status());

  std::unique_ptr<hap::executor::Device> cpu =
      hap::executor::NewCpuDevice(flags->threads);
  hap::executor::TimingDevice timing(cpu.get());
  hap::executor::Device* device = flags->breakdown ? &timing : cpu.get();
  auto runner = ProgramRunner::Create((*programs)[0], *g, device, comm->get());
  if (!runner.ok()) return Fail(runner.status());
  if (absl::Status s = (*runner)->InitializeParameters(); !s.ok())
    return Fail(s);
  std::unique_ptr<hap::data::BatchSource> batches =
      hap::data::NewSyntheticBatches(*g, 1);

  int64_t next = 0;
  std::string params_json;
  if (!flags->dump.empty()) {
    absl::StatusOr<std::vector<hap::executor::ParameterShard>> params =
        (*runner)->Parameters();
    if (!params.ok()) return Fail(params.status());
    for (const auto& p : *params) {
      params_json += (params_json.empty() ? "{\"" : ", \"") + p.name + "\": " +
                     TensorJson(p.value);
    }
    params_json += "}";
  }
  std::vector<std::string> batches_json;
  std::vector<std::string>* record = flags->dump.empty() ? nullptr : &batches_json;
  if (flags->serve) {
    std::string line;
    while (std::getline(std::cin, line)) {
      absl::StatusOr<std::string> out =
          RunBlock(**runner, *batches, std::atoi(line.c_str()), &next);
      if (!out.ok()) return Fail(out.status());
      std::printf("%s\n", out->c_str());
      std::fflush(stdout);
    }
    return 0;
  }
  absl::StatusOr<std::string> warm =
      RunBlock(**runner, *batches, flags->warmup, &next, record);
  if (!warm.ok()) return Fail(warm.status());
  timing.Reset();
  absl::StatusOr<std::string> out = RunBlock(**runner, *batches, flags->steps, &next, record);
  if (!out.ok()) return Fail(out.status());
  std::printf("%s\n", out->c_str());
  if (!flags->dump.empty()) {
    std::FILE* f = std::fopen(flags->dump.c_str(), "w");
    if (f == nullptr) return Fail(absl::NotFoundError("cannot write " + flags->dump));
    std::string batches_list;
    for (const std::string& b : batches_json) {
      batches_list += (batches_list.empty() ? "" : ",\n") + b;
    }
    std::fprintf(f,
                 "{\"graph\": %s,\n\"params\": %s,\n\"batches\": [%s],\n"
                 "\"warmup\": %s,\n\"timed\": %s}\n",
                 hap::graph::GraphToJson(*g).c_str(), params_json.c_str(),
                 batches_list.c_str(), warm->c_str(), out->c_str());
    if (std::fclose(f) != 0) return Fail(absl::InternalError("writing " + flags->dump));
  }
  if (flags->breakdown) {
    std::printf("%s", timing.Table(flags->steps).c_str());
  }
  return 0;
}
