// The NCCL communicator on real GPUs, against values computed on the host.
//
// Every rank runs in a forked child process with its own GPU: a CUDA
// context does not survive fork(), so this process itself never touches
// CUDA; a child reports "ok" or what went wrong through a pipe. Ranks meet
// through a file store in a fresh temporary directory.
//
//   OneRank            every collective on a 1-rank communicator (one GPU)
//   EveryGpu           every collective, one rank per visible GPU (needs 2)
//   DuplicateGpu       two ranks on GPU 0: NCCL refuses them ("Duplicate GPU
//                      detected"), which is why a one-GPU machine can only
//                      test 1-rank communicators
//   Connect*           a missing peer: DeadlineExceeded within the timeout
//   DeadPeer           a peer that dies after connecting: the collective
//                      fails (DeadlineExceeded or Unavailable), then every
//                      call is FailedPrecondition naming it (needs 2 GPUs)
//   Options            argument errors (no GPU needed)
//
// Without a GPU the GPU cases skip, naming the reason.
#include "executor/cuda/nccl_communicator.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "executor/comm/communicator.h"
#include "executor/cpu/cpu_device.h"
#include "executor/cuda/cuda_device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  static int counter = 0;
  std::string dir =
      absl::StrCat(::testing::TempDir(), "/nccl_", name, "_", getpid(), "_", counter++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// --- ranks as child processes ------------------------------------------

// Runs body(r) for r in [0, n) in n forked children and returns what each
// returned ("ok" by convention), or "killed: ..." for a child that did not
// finish within `limit` or died.
std::vector<std::string> RunRanks(int n, const std::function<std::string(int)>& body,
                                  absl::Duration limit = absl::Seconds(120)) {
  std::vector<pid_t> pids(n, -1);
  std::vector<int> fds(n, -1);
  std::vector<std::string> out(n);
  for (int r = 0; r < n; ++r) {
    int p[2];
    if (pipe(p) != 0) {
      out[r] = "pipe failed";
      continue;
    }
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      // Tests talk over loopback only: NCCL's bootstrap sockets too.
      setenv("NCCL_SOCKET_IFNAME", "lo", /*overwrite=*/0);
      std::string result = body(r);
      size_t at = 0;
      while (at < result.size()) {
        ssize_t w = write(p[1], result.data() + at, result.size() - at);
        if (w <= 0) break;
        at += static_cast<size_t>(w);
      }
      close(p[1]);
      _exit(0);  // no atexit handlers or static destructors of the parent's
    }
    close(p[1]);
    pids[r] = pid;
    fds[r] = p[0];
  }
  const absl::Time deadline = absl::Now() + limit;
  int open = 0;
  for (int fd : fds) open += fd >= 0;
  while (open > 0) {
    std::vector<pollfd> polls;
    std::vector<int> ranks;
    for (int r = 0; r < n; ++r) {
      if (fds[r] < 0) continue;
      polls.push_back({fds[r], POLLIN, 0});
      ranks.push_back(r);
    }
    int left_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (left_ms <= 0 || poll(polls.data(), polls.size(), left_ms) <= 0) break;
    for (size_t i = 0; i < polls.size(); ++i) {
      if (polls[i].revents == 0) continue;
      char buf[4096];
      ssize_t got = read(polls[i].fd, buf, sizeof(buf));
      if (got > 0) {
        out[ranks[i]].append(buf, static_cast<size_t>(got));
      } else {
        close(polls[i].fd);
        fds[ranks[i]] = -1;
        --open;
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    if (fds[r] >= 0) {  // still running at the deadline
      close(fds[r]);
      if (pids[r] > 0) kill(pids[r], SIGKILL);
      out[r] = absl::StrCat("killed: rank ", r, " did not finish within ",
                            absl::FormatDuration(limit), "; so far: ", out[r]);
    }
    if (pids[r] <= 0) continue;
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) && out[r].rfind("killed", 0) != 0) {
      out[r] = absl::StrCat("killed: rank ", r, " died (signal ",
                            WIFSIGNALED(status) ? WTERMSIG(status) : 0, "); output: ", out[r]);
    }
  }
  return out;
}

// The number of visible GPUs, found in a child; 0 (and `why`) without one.
int VisibleGpus(std::string* why) {
  static int count = -1;
  static std::string reason;
  if (count < 0) {
    std::string r = RunRanks(1, [](int) -> std::string {
      absl::Status s = CudaAvailable();
      if (!s.ok()) return absl::StrCat("0 ", s.message());
      int n = 0;
      cudaError_t e = cudaGetDeviceCount(&n);
      if (e != cudaSuccess) return absl::StrCat("0 ", cudaGetErrorString(e));
      return absl::StrCat(n, " GPUs");
    })[0];
    count = std::atoi(r.c_str());
    reason = r.substr(r.find(' ') + 1);
  }
  if (why) *why = reason;
  return count;
}

#define SKIP_WITHOUT_GPUS(n)                                                     \
  do {                                                                           \
    std::string why;                                                             \
    const int gpus = VisibleGpus(&why);                                          \
    if (gpus == 0) GTEST_SKIP() << "no GPU visible: " << why;                    \
    if (gpus < (n)) {                                                            \
      GTEST_SKIP() << "needs " << (n) << " GPUs, " << gpus                       \
                   << " visible: NCCL refuses two ranks of one communicator on " \
                      "one GPU (\"Duplicate GPU detected\", see DuplicateGpu)";  \
    }                                                                            \
  } while (0)

// --- inside a rank: buffers and checks -----------------------------------

// Failures of one rank, collected as text (the child cannot report to
// gtest directly).
class Report {
 public:
  explicit Report(int rank) : rank_(rank) {}
  void Fail(const std::string& m) {
    if (failures_.size() < 20) failures_.push_back(absl::StrCat("rank ", rank_, ": ", m));
  }
  void Check(const absl::Status& s, const std::string& what) {
    if (!s.ok()) Fail(absl::StrCat(what, ": ", s.ToString()));
  }
  template <typename T>
  void Equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
    if (got.size() != want.size()) {
      return Fail(absl::StrCat(what, ": ", got.size(), " elements, want ", want.size()));
    }
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want[i]) {
        return Fail(absl::StrCat(what, ": element ", i, " is ", got[i], ", want ", want[i]));
      }
    }
  }
  std::string Result() const { return failures_.empty() ? "ok" : absl::StrJoin(failures_, "\n"); }

 private:
  int rank_;
  std::vector<std::string> failures_;
};

template <typename T>
constexpr DType DTypeOf() {
  if (std::is_same<T, double>::value) return DType::kFloat64;
  if (std::is_same<T, int64_t>::value) return DType::kInt64;
  return DType::kFloat32;
}

// Device buffers of one rank, freed together.
class Buffers {
 public:
  explicit Buffers(Device& d) : d_(d) {}
  ~Buffers() {
    for (void* p : owned_) d_.Free(p);
  }
  template <typename T>
  TensorView Upload(const std::vector<T>& host, Report& report) {
    TensorView v{DTypeOf<T>(), {static_cast<int64_t>(host.size())}, nullptr};
    auto p = d_.Allocate(std::max<int64_t>(v.bytes(), 64));
    if (!p.ok()) {
      report.Check(p.status(), "Allocate");
      return v;
    }
    owned_.push_back(*p);
    v.data = *p;
    if (!host.empty()) report.Check(d_.CopyFromHost(host.data(), v), "CopyFromHost");
    return v;
  }
  template <typename T>
  std::vector<T> Download(const TensorView& v, Report& report) {
    std::vector<T> host(v.num_elements());
    if (!host.empty()) report.Check(d_.CopyToHost(v, host.data()), "CopyToHost");
    return host;
  }

 private:
  Device& d_;
  std::vector<void*> owned_;
};

std::vector<int64_t> Offsets(const std::vector<int64_t>& c) {
  std::vector<int64_t> off(c.size(), 0);
  for (size_t i = 1; i < c.size(); ++i) off[i] = off[i - 1] + c[i - 1];
  return off;
}

int64_t Sum(const std::vector<int64_t>& c) {
  int64_t s = 0;
  for (int64_t x : c) s += x;
  return s;
}

// Count patterns for n ranks: uneven, uneven with an empty chunk, even.
std::vector<std::vector<int64_t>> CountSets(int n) {
  std::vector<std::vector<int64_t>> sets(3);
  for (int r = 0; r < n; ++r) {
    sets[0].push_back(2 * r + 3);
    sets[1].push_back(r == 0 ? 0 : 1000 * r + 7);
    sets[2].push_back(5);
  }
  return sets;
}

// Rank r's element i: small integers and halves, exact in float32 sums.
template <typename T>
T Value(int r, int64_t i) {
  return static_cast<T>(r + 1) + static_cast<T>(i % 977) * static_cast<T>(0.5);
}

template <typename T>
void CheckAllReduce(Communicator& c, Buffers& b, Report& rep, int64_t len) {
  const int n = c.size(), r = c.rank();
  std::vector<T> mine(len), want(len);
  for (int64_t i = 0; i < len; ++i) {
    mine[i] = Value<T>(r, i);
    T s = 0;
    for (int q = 0; q < n; ++q) s += Value<T>(q, i);
    want[i] = s;
  }
  TensorView v = b.Upload(mine, rep);
  rep.Check(c.AllReduce(v), "all-reduce");
  rep.Equal(b.Download<T>(v, rep), want, absl::StrCat("all-reduce of ", len));
}

template <typename T>
void CheckAllGather(Communicator& c, Buffers& b, Report& rep, const std::vector<int64_t>& counts,
                    CommMethod method) {
  const int n = c.size(), r = c.rank();
  std::vector<int64_t> off = Offsets(counts);
  std::vector<T> mine(counts[r]), want(Sum(counts));
  for (int q = 0; q < n; ++q) {
    for (int64_t i = 0; i < counts[q]; ++i) {
      want[off[q] + i] = static_cast<T>(1000 * q + i);
      if (q == r) mine[i] = static_cast<T>(1000 * q + i);
    }
  }
  TensorView in = b.Upload(mine, rep);
  TensorView out = b.Upload(std::vector<T>(want.size(), T(-1)), rep);
  std::string what =
      absl::StrCat("all-gather ", method == CommMethod::kPadded ? "padded" : "grouped", " [",
                   absl::StrJoin(counts, ","), "]");
  rep.Check(c.AllGather(in, out, counts, method), what);
  rep.Equal(b.Download<T>(out, rep), want, what);
}

template <typename T>
void CheckReduceScatter(Communicator& c, Buffers& b, Report& rep,
                        const std::vector<int64_t>& counts, CommMethod method) {
  const int n = c.size(), r = c.rank();
  std::vector<int64_t> off = Offsets(counts);
  const int64_t total = Sum(counts);
  std::vector<T> mine(total), want(counts[r]);
  for (int64_t i = 0; i < total; ++i) mine[i] = Value<T>(r, i);
  for (int64_t i = 0; i < counts[r]; ++i) {
    T s = 0;
    for (int q = 0; q < n; ++q) s += Value<T>(q, off[r] + i);
    want[i] = s;
  }
  TensorView in = b.Upload(mine, rep);
  TensorView out = b.Upload(std::vector<T>(counts[r], T(-1)), rep);
  std::string what =
      absl::StrCat("reduce-scatter ", method == CommMethod::kPadded ? "padded" : "grouped", " [",
                   absl::StrJoin(counts, ","), "]");
  rep.Check(c.ReduceScatter(in, out, counts, method), what);
  rep.Equal(b.Download<T>(out, rep), want, what);
  // The input is left as it was.
  rep.Equal(b.Download<T>(in, rep), mine, what + " (input)");
}

void CheckAllToAll(Communicator& c, Buffers& b, Report& rep) {
  const int n = c.size(), r = c.rank();
  // Rank q sends 1 + (q + j) % 3 elements to rank j: symmetric counts.
  auto count = [](int q, int j) -> int64_t { return 1 + (q + j) % 3 + (q == j ? 4 : 0); };
  auto value = [](int from, int to, int64_t k) {
    return static_cast<float>(10000 * from + 100 * to + k);
  };
  std::vector<int64_t> send_counts, recv_counts;
  std::vector<float> send, want;
  for (int j = 0; j < n; ++j) {
    send_counts.push_back(count(r, j));
    recv_counts.push_back(count(j, r));
    for (int64_t k = 0; k < count(r, j); ++k) send.push_back(value(r, j, k));
    for (int64_t k = 0; k < count(j, r); ++k) want.push_back(value(j, r, k));
  }
  TensorView in = b.Upload(send, rep);
  TensorView out = b.Upload(std::vector<float>(want.size(), -1.f), rep);
  rep.Check(c.AllToAll(in, send_counts, out, recv_counts), "all-to-all");
  rep.Equal(b.Download<float>(out, rep), want, "all-to-all");
}

void CheckBroadcastReduce(Communicator& c, Buffers& b, Report& rep) {
  const int n = c.size(), r = c.rank();
  for (int root : {0, n - 1}) {
    std::vector<int64_t> want(333), mine(333, -1);
    for (int64_t i = 0; i < 333; ++i) want[i] = 7 + 2 * i + root;
    if (r == root) mine = want;
    TensorView v = b.Upload(mine, rep);
    rep.Check(c.Broadcast(v, root), absl::StrCat("broadcast from ", root));
    rep.Equal(b.Download<int64_t>(v, rep), want, absl::StrCat("broadcast from ", root));

    std::vector<double> in(517), sum(517);
    for (int64_t i = 0; i < 517; ++i) {
      in[i] = Value<double>(r, i);
      for (int q = 0; q < n; ++q) sum[i] += Value<double>(q, i);
    }
    TensorView iv = b.Upload(in, rep);
    TensorView ov{DType::kFloat64, {517}, nullptr};  // absent off the root
    if (r == root) ov = b.Upload(std::vector<double>(517, -1), rep);
    rep.Check(c.Reduce(iv, ov, root), absl::StrCat("reduce to ", root));
    if (r == root) rep.Equal(b.Download<double>(ov, rep), sum, absl::StrCat("reduce to ", root));
    rep.Equal(b.Download<double>(iv, rep), in, absl::StrCat("reduce to ", root, " (input)"));
  }
}

// Argument errors: found before any traffic (every rank makes the same bad
// calls), and the communicator stays usable.
void CheckArgumentErrors(Communicator& c, Buffers& b, Report& rep) {
  const int n = c.size();
  auto expect = [&](const absl::Status& s, const std::string& substr, const std::string& what) {
    if (s.code() != absl::StatusCode::kInvalidArgument ||
        s.message().find(substr) == absl::string_view::npos) {
      rep.Fail(
          absl::StrCat(what, ": want InvalidArgument with '", substr, "', got ", s.ToString()));
    }
  };
  TensorView v = b.Upload(std::vector<float>(4 * n, 1.f), rep);
  TensorView part = b.Upload(std::vector<float>(4, 1.f), rep);
  std::vector<int64_t> wrong(n + 1, 1);
  expect(c.AllGather(part, v, wrong, CommMethod::kPadded), "counts for", "all-gather counts");
  expect(c.ReduceScatter(v, part, std::vector<int64_t>(n, 3), CommMethod::kGrouped), "sum to",
         "reduce-scatter sum");
  TensorView ints = b.Upload(std::vector<int64_t>(4, 1), rep);
  expect(c.AllReduce(ints), "only float32, float64 and bfloat16", "all-reduce of int64");
  expect(c.Broadcast(v, n), "out of range", "broadcast root");
  std::vector<float> host(4, 1.f);
  TensorView on_host{DType::kFloat32, {4}, host.data()};
  expect(c.AllReduce(on_host), "host memory", "all-reduce of host memory");
  rep.Check(c.Barrier(), "barrier after argument errors");
  CheckAllReduce<float>(c, b, rep, 3);
}

// Every collective on rank `rank` of `n` on GPU `ordinal`.
std::string EveryCollective(int rank, int n, int ordinal, const std::string& dir) {
  Report rep(rank);
  auto device = NewCudaDevice(ordinal);
  if (!device.ok())
    return absl::StrCat("NewCudaDevice(", ordinal, "): ", device.status().ToString());
  auto store = NewFileStore(dir);
  if (!store.ok()) return store.status().ToString();
  NcclOptions o;
  o.rank = rank;
  o.size = n;
  o.prefix = "every";
  o.timeout = absl::Seconds(60);
  o.device = device->get();
  auto comm = ConnectNccl(o, **store);
  if (!comm.ok()) return absl::StrCat("ConnectNccl: ", comm.status().ToString());
  Communicator& c = **comm;
  if (c.rank() != rank || c.size() != n) rep.Fail("rank() or size() is wrong");
  {
    Buffers b(**device);
    CheckAllReduce<float>(c, b, rep, 1037);
    CheckAllReduce<float>(c, b, rep, (1 << 20) + 3);
    CheckAllReduce<double>(c, b, rep, 4099);
    for (const auto& counts : CountSets(n)) {
      for (CommMethod m : {CommMethod::kPadded, CommMethod::kGrouped}) {
        CheckAllGather<float>(c, b, rep, counts, m);
        CheckAllGather<int64_t>(c, b, rep, counts, m);
        CheckReduceScatter<float>(c, b, rep, counts, m);
        CheckReduceScatter<double>(c, b, rep, counts, m);
      }
    }
    CheckAllToAll(c, b, rep);
    CheckBroadcastReduce(c, b, rep);
    rep.Check(c.Barrier(), "barrier");
    CheckArgumentErrors(c, b, rep);
    // The device's compute stream sees the results: a kernel after a
    // collective (Fill) then a copy.
    TensorView v = b.Upload(std::vector<float>(8, 1.f), rep);
    rep.Check(c.AllReduce(v), "all-reduce before fill");
    rep.Check((*device)->Fill(v, 2.0), "fill");
    rep.Equal(b.Download<float>(v, rep), std::vector<float>(8, 2.f), "fill after all-reduce");
  }
  comm->reset();  // before the device
  return rep.Result();
}

TEST(NcclCommunicatorTest, OneRankRunsEveryCollective) {
  SKIP_WITHOUT_GPUS(1);
  std::string dir = FreshDir("one");
  auto out = RunRanks(1, [&](int r) { return EveryCollective(r, 1, 0, dir); });
  EXPECT_EQ(out[0], "ok");
}

TEST(NcclCommunicatorTest, EveryGpuRunsEveryCollective) {
  SKIP_WITHOUT_GPUS(2);
  const int n = std::min(VisibleGpus(nullptr), 8);
  std::string dir = FreshDir("every");
  auto out = RunRanks(n, [&](int r) { return EveryCollective(r, n, r, dir); });
  for (int r = 0; r < n; ++r) EXPECT_EQ(out[r], "ok") << "rank " << r;
}

// What NCCL does with two ranks of one communicator on one GPU: it refuses
// them at set-up ("Duplicate GPU detected"). Were that ever to change, this
// test fails and says so, and the multi-rank cases could run on one GPU.
TEST(NcclCommunicatorTest, DuplicateGpuIsRefused) {
  SKIP_WITHOUT_GPUS(1);
  std::string dir = FreshDir("dup");
  auto out = RunRanks(2, [&](int r) -> std::string {
    setenv("NCCL_DEBUG", "WARN", 1);  // NCCL's own account in the test log
    auto device = NewCudaDevice(0);
    if (!device.ok()) return device.status().ToString();
    auto store = NewFileStore(dir);
    if (!store.ok()) return store.status().ToString();
    NcclOptions o;
    o.rank = r;
    o.size = 2;
    o.prefix = "dup";
    o.timeout = absl::Seconds(30);
    o.device = device->get();
    auto comm = ConnectNccl(o, **store);
    if (comm.ok()) return "connected";
    return comm.status().ToString();
  });
  std::cout << "NCCL "
            << "with two ranks on GPU 0: rank 0: " << out[0] << "\nrank 1: " << out[1] << std::endl;
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(out[r], "connected")
        << "NCCL accepted two ranks on one GPU: the multi-rank cases could run here";
    // NCCL's reason ("Duplicate GPU detected") when its last-error text has
    // it, else at least its code for that refusal (ncclInvalidUsage).
    EXPECT_THAT(out[r], AllOf(HasSubstr("connecting rank"),
                              AnyOf(HasSubstr("Duplicate GPU"), HasSubstr("invalid usage"))))
        << "rank " << r;
  }
}

TEST(NcclCommunicatorTest, ConnectTimesOutWithoutPeers) {
  SKIP_WITHOUT_GPUS(1);
  std::string dir = FreshDir("alone");
  // Rank 0 of 2 publishes its id and waits in NCCL's set-up for rank 1.
  auto out = RunRanks(1, [&](int) -> std::string {
    auto device = NewCudaDevice(0);
    if (!device.ok()) return device.status().ToString();
    auto store = NewFileStore(dir);
    if (!store.ok()) return store.status().ToString();
    NcclOptions o;
    o.size = 2;
    o.prefix = "alone";
    o.timeout = absl::Seconds(3);
    o.device = device->get();
    absl::Time start = absl::Now();
    auto comm = ConnectNccl(o, **store);
    std::string took = absl::StrCat(" after ", absl::FormatDuration(absl::Now() - start));
    return comm.ok() ? "connected" : comm.status().ToString() + took;
  });
  EXPECT_THAT(out[0], AllOf(HasSubstr("DEADLINE_EXCEEDED"), HasSubstr("connecting rank 0 of 2"),
                            HasSubstr("set-up")));
  // Rank 1 of 2 waits for rank 0's id, which never comes.
  std::string dir2 = FreshDir("no_root");
  out = RunRanks(1, [&](int) -> std::string {
    auto device = NewCudaDevice(0);
    if (!device.ok()) return device.status().ToString();
    auto store = NewFileStore(dir2);
    if (!store.ok()) return store.status().ToString();
    NcclOptions o;
    o.rank = 1;
    o.size = 2;
    o.prefix = "no_root";
    o.timeout = absl::Seconds(2);
    o.device = device->get();
    auto comm = ConnectNccl(o, **store);
    return comm.ok() ? "connected" : comm.status().ToString();
  });
  EXPECT_THAT(out[0], AllOf(HasSubstr("DEADLINE_EXCEEDED"), HasSubstr("connecting rank 1 of 2"),
                            HasSubstr("nccl-unique-id")));
}

// Rank 1 dies right after connecting; rank 0's all-reduce fails within the
// timeout, and every later call names that failure.
TEST(NcclCommunicatorTest, DeadPeer) {
  SKIP_WITHOUT_GPUS(2);
  std::string dir = FreshDir("dead");
  auto out = RunRanks(2, [&](int r) -> std::string {
    auto device = NewCudaDevice(r);
    if (!device.ok()) return device.status().ToString();
    auto store = NewFileStore(dir);
    if (!store.ok()) return store.status().ToString();
    NcclOptions o;
    o.rank = r;
    o.size = 2;
    o.prefix = "dead";
    o.timeout = absl::Seconds(5);
    o.device = device->get();
    auto comm = ConnectNccl(o, **store);
    if (!comm.ok()) return comm.status().ToString();
    if (r == 1) _exit(0);  // dies: no destructor, no goodbye
    Report rep(r);
    Buffers b(**device);
    TensorView v = b.Upload(std::vector<float>(1 << 16, 1.f), rep);
    absl::Status first = (*comm)->AllReduce(v);
    absl::Status then = (*comm)->Barrier();
    return absl::StrCat("first: ", first.ToString(), "\nthen: ", then.ToString());
  });
  EXPECT_THAT(out[0],
              AllOf(HasSubstr("all-reduce (rank 0 of 2)"),
                    AnyOf(HasSubstr("first: DEADLINE_EXCEEDED"), HasSubstr("first: UNAVAILABLE")),
                    HasSubstr("then: FAILED_PRECONDITION: barrier: the communicator "
                              "failed earlier: all-reduce")));
}

// Argument errors need no GPU: they are found before NCCL is touched.
TEST(NcclCommunicatorTest, Options) {
  auto store = NewFileStore(FreshDir("options"));
  ASSERT_TRUE(store.ok());
  std::unique_ptr<Device> cpu = NewCpuDevice(1);
  NcclOptions o;
  o.device = cpu.get();
  EXPECT_THAT(
      ConnectNccl(o, **store).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NCCL needs a CUDA device, got cpu")));
  o.device = nullptr;
  EXPECT_THAT(ConnectNccl(o, **store).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got none")));
  o.rank = 2;
  o.size = 2;
  EXPECT_THAT(ConnectNccl(o, **store).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of range")));
  o.rank = 0;
  o.timeout = absl::ZeroDuration();
  EXPECT_THAT(ConnectNccl(o, **store).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
}

}  // namespace
}  // namespace hap::executor
