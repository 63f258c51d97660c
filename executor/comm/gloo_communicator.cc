// The Gloo backend of the communicator (communicator.h). Gloo reports
// failures by throwing; every call into it happens inside Guard(), which
// turns exceptions into statuses — nothing else in the project sees one.
#include <algorithm>
#include <csignal>
#include <chrono>
#include <cstring>
#include <exception>
#include <numeric>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "executor/comm/communicator.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/math.h"
#include "gloo/reduce.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "planner/util/status_macros.h"

namespace hap::executor {
namespace {

// Runs `fn`, mapping Gloo's exceptions to statuses named by `what`.
template <typename Fn>
absl::Status Guard(const std::string& what, Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const gloo::IoException& e) {
    std::string msg = e.what();
    if (absl::StrContains(msg, "Timed out") || absl::StrContains(msg, "timed out") ||
        absl::StrContains(msg, "timeout")) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": timed out waiting for a peer (", msg, ")"));
    }
    return absl::UnavailableError(
        absl::StrCat(what, ": connection to a peer failed (", msg, ")"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, ": unknown failure in Gloo"));
  }
}

// Our store as Gloo's: keys prefixed, waits bounded by the timeout. Gloo
// expects exceptions from a store; they are caught by Guard around connect.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(RendezvousStore& store, std::string prefix, absl::Duration timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_.Set(Key(key), std::string(data.begin(), data.end()));
    if (!s.ok()) throw gloo::IoException(std::string(s.message()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.Get(Key(key), timeout_);
    if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const auto& k : keys) {
      auto v = store_.Get(Key(k), absl::Milliseconds(timeout.count()));
      if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
    }
  }

 private:
  std::string Key(const std::string& k) const { return absl::StrCat(prefix_, "/", k); }
  RendezvousStore& store_;
  std::string prefix_;
  absl::Duration timeout_;
};

size_t ElementSize(const TensorView& v) {
  return static_cast<size_t>(graph::DTypeBytes(v.dtype));
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> ctx, std::chrono::milliseconds timeout)
      : ctx_(std::move(ctx)), timeout_(timeout) {}

  int rank() const override { return ctx_->rank; }
  int size() const override { return ctx_->size; }

  absl::Status AllReduce(TensorView buf) override {
    HAP_RETURN_IF_ERROR(CheckFloat("all-reduce", buf));
    if (buf.num_elements() == 0) return absl::OkStatus();
    return Run("all-reduce", [&] { AllReduceRaw(buf.data, buf.num_elements(), buf.dtype); });
  }

  absl::Status AllGather(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                         CommMethod method) override {
    HAP_RETURN_IF_ERROR(CheckCounts("all-gather", counts, in, out, /*gather=*/true));
    const size_t es = ElementSize(in);
    std::vector<int64_t> off = Offsets(counts);
    if (method == CommMethod::kGrouped) {
      return Run("all-gather (grouped)", [&] {
        char* o = static_cast<char*>(out.data);
        std::memcpy(o + off[rank()] * es, in.data, counts[rank()] * es);
        for (int r = 0; r < size(); ++r) {
          if (counts[r] == 0) continue;
          gloo::BroadcastOptions opts(ctx_);
          opts.setOutput(reinterpret_cast<uint8_t*>(o + off[r] * es), counts[r] * es);
          opts.setRoot(r);
          opts.setTimeout(timeout_);
          gloo::broadcast(opts);
        }
      });
    }
    const int64_t m = *std::max_element(counts.begin(), counts.end());
    if (m == 0) return absl::OkStatus();
    return Run("all-gather (padded)", [&] {
      std::vector<char> send(m * es, 0), recv(m * es * size());
      std::memcpy(send.data(), in.data, counts[rank()] * es);
      gloo::AllgatherOptions opts(ctx_);
      opts.setInput(reinterpret_cast<uint8_t*>(send.data()), send.size());
      opts.setOutput(reinterpret_cast<uint8_t*>(recv.data()), recv.size());
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
      for (int r = 0; r < size(); ++r) {
        std::memcpy(static_cast<char*>(out.data) + off[r] * es, recv.data() + r * m * es,
                    counts[r] * es);
      }
    });
  }

  absl::Status ReduceScatter(TensorView in, TensorView out,
                             absl::Span<const int64_t> counts, CommMethod method) override {
    HAP_RETURN_IF_ERROR(CheckFloat("reduce-scatter", in));
    HAP_RETURN_IF_ERROR(CheckCounts("reduce-scatter", counts, out, in, /*gather=*/true));
    const size_t es = ElementSize(in);
    std::vector<int64_t> off = Offsets(counts);
    if (method == CommMethod::kGrouped) {
      return Run("reduce-scatter (grouped)", [&] {
        const int64_t m = *std::max_element(counts.begin(), counts.end());
        std::vector<char> scratch(std::max<int64_t>(m, 1) * es);
        for (int r = 0; r < size(); ++r) {
          if (counts[r] == 0) continue;
          std::vector<char> chunk(counts[r] * es);
          std::memcpy(chunk.data(), static_cast<char*>(in.data) + off[r] * es, chunk.size());
          void* dst = r == rank() ? out.data : scratch.data();
          ReduceRaw(chunk.data(), dst, counts[r], in.dtype, r);
        }
      });
    }
    const int64_t m = *std::max_element(counts.begin(), counts.end());
    if (m == 0) return absl::OkStatus();
    return Run("reduce-scatter (padded)", [&] {
      // Every chunk padded to the largest; one all-reduce; keep ours.
      std::vector<char> buf(m * es * size(), 0);
      for (int r = 0; r < size(); ++r) {
        std::memcpy(buf.data() + r * m * es, static_cast<char*>(in.data) + off[r] * es,
                    counts[r] * es);
      }
      AllReduceRaw(buf.data(), m * size(), in.dtype);
      std::memcpy(out.data, buf.data() + rank() * m * es, counts[rank()] * es);
    });
  }

  absl::Status AllToAll(TensorView in, absl::Span<const int64_t> send_counts,
                        TensorView out, absl::Span<const int64_t> recv_counts) override {
    HAP_RETURN_IF_ERROR(CheckCounts("all-to-all", send_counts, TensorView{}, in, false));
    HAP_RETURN_IF_ERROR(CheckCounts("all-to-all", recv_counts, TensorView{}, out, false));
    if (in.dtype != out.dtype) return Invalid("all-to-all: dtypes differ");
    const size_t es = ElementSize(in);
    return Run("all-to-all", [&] {
      // Gloo wants non-null buffers even when a side is empty.
      uint8_t dummy_in = 0, dummy_out = 0;
      gloo::AlltoallvOptions opts(ctx_);
      // In bytes: the typed setters are the public ones.
      std::vector<int64_t> s, r;
      for (int64_t c : send_counts) s.push_back(c * static_cast<int64_t>(es));
      for (int64_t c : recv_counts) r.push_back(c * static_cast<int64_t>(es));
      opts.setInput(static_cast<uint8_t*>(in.data ? in.data : &dummy_in), s);
      opts.setOutput(static_cast<uint8_t*>(out.data ? out.data : &dummy_out), r);
      opts.setTimeout(timeout_);
      gloo::alltoallv(opts);
    });
  }

  absl::Status Broadcast(TensorView buf, int root) override {
    if (root < 0 || root >= size()) return Invalid(absl::StrCat("broadcast: root ", root, " out of range"));
    if (buf.bytes() == 0) return absl::OkStatus();
    return Run("broadcast", [&] {
      gloo::BroadcastOptions opts(ctx_);
      opts.setOutput(static_cast<uint8_t*>(buf.data), buf.bytes());
      opts.setRoot(root);
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  absl::Status Reduce(TensorView in, TensorView out, int root) override {
    HAP_RETURN_IF_ERROR(CheckFloat("reduce", in));
    if (root < 0 || root >= size()) return Invalid(absl::StrCat("reduce: root ", root, " out of range"));
    if (rank() == root && out.num_elements() != in.num_elements()) {
      return Invalid("reduce: output and input sizes differ");
    }
    if (in.num_elements() == 0) return absl::OkStatus();
    return Run("reduce", [&] {
      std::vector<char> copy(in.bytes()), scratch(in.bytes());
      std::memcpy(copy.data(), in.data, in.bytes());
      ReduceRaw(copy.data(), rank() == root ? out.data : scratch.data(), in.num_elements(),
                in.dtype, root);
    });
  }

  absl::Status Barrier() override {
    return Run("barrier", [&] {
      gloo::BarrierOptions opts(ctx_);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  static absl::Status Invalid(const std::string& m) { return absl::InvalidArgumentError(m); }

  static std::vector<int64_t> Offsets(absl::Span<const int64_t> counts) {
    std::vector<int64_t> off(counts.size(), 0);
    for (size_t i = 1; i < counts.size(); ++i) off[i] = off[i - 1] + counts[i - 1];
    return off;
  }

  absl::Status CheckFloat(const char* what, const TensorView& v) const {
    if (v.dtype != DType::kFloat32 && v.dtype != DType::kFloat64) {
      return Invalid(absl::StrCat(what, ": only float32 and float64 are summed, got ",
                                  graph::DTypeName(v.dtype)));
    }
    return absl::OkStatus();
  }

  // counts: one per rank, non-negative; `part` holds counts[rank()] and
  // `whole` their sum (either may be unchecked: an empty view).
  absl::Status CheckCounts(const char* what, absl::Span<const int64_t> counts,
                           const TensorView& part, const TensorView& whole,
                           bool check_part) const {
    if (static_cast<int>(counts.size()) != size()) {
      return Invalid(absl::StrCat(what, ": ", counts.size(), " counts for ", size(), " ranks"));
    }
    int64_t sum = 0;
    for (int64_t c : counts) {
      if (c < 0) return Invalid(absl::StrCat(what, ": negative count ", c));
      sum += c;
    }
    if (sum != whole.num_elements()) {
      return Invalid(absl::StrCat(what, ": counts [", absl::StrJoin(counts, ","),
                                  "] sum to ", sum, " but the buffer holds ",
                                  whole.num_elements(), " elements"));
    }
    if (check_part && counts[rank()] != part.num_elements()) {
      return Invalid(absl::StrCat(what, ": rank ", rank(), " holds ", part.num_elements(),
                                  " elements, its count is ", counts[rank()]));
    }
    return absl::OkStatus();
  }

  void AllReduceRaw(void* data, int64_t n, DType t) {
    gloo::AllreduceOptions opts(ctx_);
    opts.setTimeout(timeout_);
    if (t == DType::kFloat64) {
      opts.setOutput(static_cast<double*>(data), n);
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
          &gloo::sum<double>));
    } else {
      opts.setOutput(static_cast<float*>(data), n);
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
          &gloo::sum<float>));
    }
    gloo::allreduce(opts);
  }

  void ReduceRaw(void* in, void* out, int64_t n, DType t, int root) {
    gloo::ReduceOptions opts(ctx_);
    opts.setTimeout(timeout_);
    opts.setRoot(root);
    if (t == DType::kFloat64) {
      opts.setInput(static_cast<double*>(in), n);
      opts.setOutput(static_cast<double*>(out), n);
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
          &gloo::sum<double>));
    } else {
      opts.setInput(static_cast<float*>(in), n);
      opts.setOutput(static_cast<float*>(out), n);
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
          &gloo::sum<float>));
    }
    gloo::reduce(opts);
  }

  // Runs a collective unless an earlier one failed; remembers a failure.
  template <typename Fn>
  absl::Status Run(const std::string& what, Fn&& fn) {
    if (!failed_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": the communicator failed earlier: ", failed_.message()));
    }
    absl::Status s = Guard(what, std::forward<Fn>(fn));
    if (!s.ok()) failed_ = s;
    return s;
  }

  std::shared_ptr<gloo::Context> ctx_;
  std::chrono::milliseconds timeout_;
  absl::Status failed_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(const GlooOptions& o,
                                                          RendezvousStore& store) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", o.rank, " is out of range for a world of ", o.size));
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the communicator timeout must be positive");
  }
  // A peer that dies leaves sockets that raise SIGPIPE on the next write;
  // without this the whole process would be killed instead of getting an
  // error it can report.
  static const bool sigpipe_ignored = [] {
    std::signal(SIGPIPE, SIG_IGN);
    return true;
  }();
  (void)sigpipe_ignored;
  std::chrono::milliseconds timeout(absl::ToInt64Milliseconds(o.timeout));
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  absl::Status s = Guard(absl::StrCat("connecting rank ", o.rank, " of ", o.size), [&] {
    gloo::transport::tcp::attr attr(o.hostname.c_str());
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    ctx = std::make_shared<gloo::rendezvous::Context>(o.rank, o.size);
    ctx->setTimeout(timeout);
    StoreAdapter adapter(store, o.prefix, o.timeout);
    ctx->connectFullMesh(adapter, dev);
  });
  if (!s.ok()) {
    // A store that gave up waiting for a peer's address: the peer is missing.
    if (absl::StrContains(s.message(), "did not appear")) {
      return absl::DeadlineExceededError(s.message());
    }
    return s;
  }
  return std::unique_ptr<Communicator>(new GlooCommunicator(ctx, timeout));
}

}  // namespace hap::executor
