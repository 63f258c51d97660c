// Our side of the checkpoint benchmark (bench/checkpoint_bench.py runs it,
// interleaved with the baselines). One operation per run; the time printed
// covers that operation only (not building the model or the plan):
//
//   save --ranks N --dir D      the paper-size GPT's parameters and Adam
//                               state, ZeRO-sharded over N ranks (threads,
//                               in-process communicator): SaveCheckpoint
//   restore --ranks M --dir D   every persistent buffer of an M-rank plan
//                               read from D's checkpoint (a different world
//                               size reshards); page cache dropped first
//   plain-write --bytes B --file F   B bytes, one write stream, fsync
//   plain-read --file F              F sequentially into one fresh allocation;
//                                    page cache dropped first
//
// Output: one JSON line {"op", "seconds", "bytes"}.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <thread>

#include "absl/strings/str_format.h"
#include "common/cli_args.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/checkpoint/file_util.h"
#include "executor/train/in_process_comm.h"
#include "executor/train/test_programs.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
namespace ckpt = ::hap::executor::checkpoint;
using executor::HostTensor;
using executor::ParameterShard;
using graph::Shape;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void DropCache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

absl::StatusOr<std::vector<v1::RankProgram>> Programs(const graph::Graph& g, int n) {
  std::vector<double> ratios(n, 1.0 / n);
  synth::Program p = lower::SingleDeviceProgram(g);
  if (n > 1) {
    auto q = testing::ProgramOfKind(g, n, "zero", ratios);
    if (!q.ok()) return q.status();
    p = *q;
  }
  lower::LowerOptions lo;
  lo.world_size = n;
  lo.ratios = ratios;
  lo.optimizer.set_kind(v1::OptimizerConfig::ADAM);
  lo.optimizer.set_learning_rate(1e-4);
  return lower::Lower(g, p, lo);
}

// Rank r's persistent buffers, filled with a pattern.
std::vector<ParameterShard> State(const v1::RankProgram& program) {
  std::vector<ParameterShard> out;
  for (const v1::Buffer& b : program.buffers()) {
    if (b.role() != v1::Buffer::PARAMETER && b.role() != v1::Buffer::OPTIMIZER_STATE) continue;
    ParameterShard s;
    s.name = b.tensor();
    s.global_shape.assign(b.global_shape().begin(), b.global_shape().end());
    s.offsets.assign(b.offsets().begin(), b.offsets().end());
    s.value = HostTensor(graph::FromProtoDType(b.dtype()),
                         Shape(b.shape().begin(), b.shape().end()));
    float* f = s.value.as<float>();
    for (int64_t i = 0; i < s.value.num_elements(); ++i) f[i] = static_cast<float>(i % 977) * 1e-3f;
    out.push_back(std::move(s));
  }
  return out;
}

int Main(const tools::Args& a) {
  const std::string op = a.positional().empty() ? "" : a.positional()[0];
  auto fail = [](const absl::Status& s) {
    std::cerr << "error: " << s.message() << "\n";
    return 1;
  };
  int64_t bytes = 0;
  double seconds = 0;
  if (op == "plain-write") {
    bytes = static_cast<int64_t>(*a.Number("bytes", 0));
    // The bytes live in memory, all of them, as a model's state does (not a
    // small buffer written again and again, which the CPU caches hold).
    std::unique_ptr<char[]> buf(new char[bytes]);
    for (int64_t i = 0; i < bytes; ++i) buf[i] = static_cast<char>(i % 251);
    // A new file, as every checkpoint file is (overwriting an existing
    // file's blocks is several times faster on some file systems).
    std::filesystem::remove(a.Get("file"));
    const double t0 = Now();
    auto w = ckpt::FileWriter::Create(a.Get("file"));
    if (!w.ok()) return fail(w.status());
    constexpr int64_t kChunk = 64 << 20;
    for (int64_t at = 0; at < bytes; at += kChunk) {
      auto s = w->Write(buf.get() + at, static_cast<size_t>(std::min(kChunk, bytes - at)));
      if (!s.ok()) return fail(s);
    }
    if (auto s = w->SyncAndClose(); !s.ok()) return fail(s);
    seconds = Now() - t0;
  } else if (op == "plain-read") {
    const std::string file = a.Get("file");
    DropCache(file);
    // Into memory that holds all the bytes afterwards, as any load must,
    // touched before the clock starts (our restore's timing includes
    // allocating and zeroing its host buffers: stricter for us).
    const int64_t size = static_cast<int64_t>(std::filesystem::file_size(file));
    std::unique_ptr<char[]> buf(new char[size]);
    for (int64_t i = 0; i < size; ++i) buf[i] = static_cast<char>(i % 253);
    const double t0 = Now();
    int fd = ::open(file.c_str(), O_RDONLY);
    if (fd < 0) return fail(absl::NotFoundError(file));
    ssize_t n;
    constexpr int64_t kChunk = 64 << 20;
    while (bytes < size &&
           (n = ::read(fd, buf.get() + bytes, std::min(kChunk, size - bytes))) > 0) {
      bytes += n;
    }
    ::close(fd);
    seconds = Now() - t0;
  } else if (op == "save" || op == "restore") {
    const int n = static_cast<int>(*a.Number("ranks", 2));
    auto g = graph::BuildZooModel("gpt", {});
    if (!g.ok()) return fail(g.status());
    auto programs = Programs(*g, n);
    if (!programs.ok()) return fail(programs.status());
    auto comms = executor::NewInProcessGroup(n);
    std::vector<absl::Status> status(n);
    std::vector<std::thread> threads;
    const std::string dir = a.Get("dir");
    if (op == "save") {
      std::vector<std::vector<ParameterShard>> state;
      for (const auto& p : *programs) state.push_back(State(p));
      for (const auto& s : state) {
        for (const auto& p : s) bytes += p.value.view().bytes();
      }
      const double t0 = Now();
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          ckpt::SaveRequest req;
          req.dir = dir;
          req.keep = 1;
          req.rank = r;
          req.programs = &*programs;
          req.trainer.set_step(1);
          status[r] = ckpt::SaveCheckpoint(req, state[r], *comms[r]).status();
        });
      }
      for (auto& t : threads) t.join();
      seconds = Now() - t0;
    } else {
      auto found = ckpt::FindCheckpoint(dir);
      if (!found.ok()) return fail(found.status());
      for (const auto& e : std::filesystem::directory_iterator(*found)) DropCache(e.path());
      const double t0 = Now();
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          status[r] = [&]() -> absl::Status {
            auto reader = ckpt::CheckpointReader::Open(dir);
            if (!reader.ok()) return reader.status();
            for (const v1::Buffer& b : (*programs)[r].buffers()) {
              if (b.role() != v1::Buffer::PARAMETER &&
                  b.role() != v1::Buffer::OPTIMIZER_STATE) {
                continue;
              }
              HostTensor host(graph::FromProtoDType(b.dtype()),
                              Shape(b.shape().begin(), b.shape().end()));
              auto s = (*reader)->Read(b.tensor(),
                                       Shape(b.global_shape().begin(), b.global_shape().end()),
                                       b.offsets(), host.view());
              if (!s.ok()) return s;
            }
            return absl::OkStatus();
          }();
        });
      }
      for (auto& t : threads) t.join();
      seconds = Now() - t0;
      for (const auto& p : *programs) {
        for (const auto& b : p.buffers()) {
          if (b.persistent()) {
            int64_t e = 1;
            for (int64_t d : b.shape()) e *= d;
            bytes += e * 4;
          }
        }
      }
    }
    for (const auto& s : status) {
      if (!s.ok()) return fail(s);
    }
  } else {
    std::cerr << "usage: checkpoint_worker save|restore|plain-write|plain-read ...\n";
    return 2;
  }
  std::cout << absl::StrFormat("{\"op\": \"%s\", \"seconds\": %.6f, \"bytes\": %d}\n", op, seconds,
                               bytes);
  return 0;
}

}  // namespace
}  // namespace hap

int main(int argc, char** argv) {
  auto a = hap::tools::Args::Parse(std::vector<std::string>(argv + 1, argv + argc),
                                   {"ranks", "dir", "bytes", "file"}, {});
  if (!a.ok()) {
    std::cerr << "error: " << a.status().message() << "\n";
    return 2;
  }
  return hap::Main(*a);
}
