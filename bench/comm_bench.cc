// Collective cost under a CPU quota: each rank spins `--work_ms` x its
// `--work_scale` of CPU time, then runs one collective on `--bytes` of
// float32, `--iters` times; prints the wall time per iteration beyond the
// fast rank's work. Run one process per rank (rank 0 prints), e.g. through
// bench/comm_bench.sh, which puts rank 1 in a throttled cgroup.
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "executor/comm/communicator.h"

namespace {

double Now(clockid_t c) {
  timespec t;
  clock_gettime(c, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

volatile double sink;
void Spin(double seconds) {
  const double start = Now(CLOCK_THREAD_CPUTIME_ID);
  double x = 1;
  while (Now(CLOCK_THREAD_CPUTIME_ID) - start < seconds) {
    for (int i = 0; i < 1000; ++i) x = x * 1.0000001 + 1e-9;
  }
  sink = x;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr,
                 "usage: comm_bench RANK SIZE STORE_DIR OP BYTES WORK_MS "
                 "WORK_SCALE ITERS (OP: allreduce|allgather|none)\n");
    return 2;
  }
  using namespace hap::executor;
  GlooOptions o;
  o.rank = std::atoi(argv[1]);
  o.size = std::atoi(argv[2]);
  if (const char* e = std::getenv("COMM_BENCH_DEFAULT_LOOP")) o.idle_progress_thread = e[0] != '1';
  if (const char* e = std::getenv("COMM_BENCH_NO_CALL_CHECK")) o.check_calls = e[0] != '1';
  const std::string op = argv[4];
  const long bytes = std::atol(argv[5]);
  const double work = std::atof(argv[6]) / 1000;
  const double scale = std::atof(argv[7]);
  const int iters = std::atoi(argv[8]);
  auto store = NewFileStore(argv[3]);
  if (!store.ok()) return 1;
  auto comm = ConnectGloo(o, **store);
  if (!comm.ok()) {
    std::fprintf(stderr, "%s\n", std::string(comm.status().message()).c_str());
    return 1;
  }
  const int64_t n = bytes / 4;
  std::vector<float> a(n, 1.0f), g(n * o.size, 0.0f);
  TensorView va{hap::graph::DType::kFloat32, {n}, a.data()};
  TensorView vg{hap::graph::DType::kFloat32, {n * o.size}, g.data()};
  double t0 = 0;
  for (int it = 0; it < iters + 3; ++it) {
    if (it == 3) t0 = Now(CLOCK_MONOTONIC);
    Spin(work * scale);
    absl::Status s;
    if (op == "allreduce") s = (*comm)->AllReduce(va);
    else if (op == "allgather") {
      std::vector<int64_t> counts(o.size, n);
      s = (*comm)->AllGather(va, vg, counts, CommMethod::kPadded);
    }
    else s = (*comm)->Barrier();
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  const double per = (Now(CLOCK_MONOTONIC) - t0) / iters;
  if (o.rank == 0)
    std::printf("%s %ld bytes, work %.1f ms: %.2f ms/iter, beyond work %.4f ms\n", op.c_str(),
                bytes, work * 1e3, per * 1e3, (per - work) * 1e3);
  return 0;
}
