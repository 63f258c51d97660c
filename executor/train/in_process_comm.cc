#include "executor/train/in_process_comm.h"

#include <cstring>
#include <numeric>

#include "absl/synchronization/mutex.h"
#include "executor/comm/call_agreement.h"
#include "executor/comm/call_checks.h"
#include "executor/runtime/bf16.h"

namespace hap::executor {
namespace {

struct Shared {
  explicit Shared(int n) : n(n), ptrs(n, nullptr), calls(n) {}
  int n;
  absl::Mutex mu;
  absl::CondVar cv;
  int arrived = 0;
  int64_t generation = 0;
  // By rank: the data and the encoded call of the collective under way.
  std::vector<void*> ptrs;
  std::vector<EncodedCall> calls;

  // All ranks publish a pointer, then all may read everyone's.
  void Barrier() {
    absl::MutexLock l(&mu);
    int64_t gen = generation;
    if (++arrived == n) {
      arrived = 0;
      ++generation;
      cv.SignalAll();
      return;
    }
    while (generation == gen) cv.Wait(&mu);
  }
};

template <typename T>
void AddInto(T* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void Add(DType t, void* dst, const void* src, int64_t n) {
  if (t == DType::kBFloat16) {
    // Each partial sum rounded to bf16, as a bf16 all-reduce.
    auto* d = static_cast<uint16_t*>(dst);
    const auto* x = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) d[i] = Bf16Bits(Bf16ToFloat(d[i]) + Bf16ToFloat(x[i]));
  } else if (t == DType::kFloat64) {
    AddInto(static_cast<double*>(dst), static_cast<const double*>(src), n);
  } else {
    AddInto(static_cast<float*>(dst), static_cast<const float*>(src), n);
  }
}

class InProcess : public Communicator {
 public:
  InProcess(std::shared_ptr<Shared> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->n; }

  absl::Status AllReduce(TensorView buf) override {
    std::vector<char> mine(buf.bytes());
    if (buf.bytes()) std::memcpy(mine.data(), buf.data, buf.bytes());
    return Collective("all-reduce", AllReduceCall(buf), mine.data(), [&] {
      std::memset(buf.data, 0, buf.bytes());
      for (int r = 0; r < size(); ++r) Add(buf.dtype, buf.data, s_->ptrs[r], buf.num_elements());
    });
  }
  absl::Status AllGather(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                         CommMethod method) override {
    return Collective(
        "all-gather", AllGatherCall(in, out, counts, method, rank_, size()), in.data, [&] {
          const int64_t es = graph::DTypeBytes(in.dtype);
          int64_t at = 0;
          for (int r = 0; r < size(); ++r) {
            if (counts[r]) {
              std::memcpy(static_cast<char*>(out.data) + at * es, s_->ptrs[r], counts[r] * es);
            }
            at += counts[r];
          }
        });
  }
  absl::Status ReduceScatter(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                             CommMethod method) override {
    return Collective(
        "reduce-scatter", ReduceScatterCall(in, out, counts, method, rank_, size()), in.data, [&] {
          const int64_t es = graph::DTypeBytes(in.dtype);
          int64_t at = std::accumulate(counts.begin(), counts.begin() + rank_, int64_t{0});
          std::memset(out.data, 0, counts[rank_] * es);
          for (int r = 0; r < size(); ++r) {
            Add(in.dtype, out.data, static_cast<char*>(s_->ptrs[r]) + at * es, counts[rank_]);
          }
        });
  }
  absl::Status AllToAll(TensorView in, absl::Span<const int64_t> send_counts, TensorView out,
                        absl::Span<const int64_t> recv_counts) override {
    // Peers read the part of the send buffer addressed to them, at the
    // offset the sender's counts (in its published call) give.
    return Collective(
        "all-to-all", AllToAllCall(in, send_counts, out, recv_counts, size()), in.data, [&] {
          const int64_t es = graph::DTypeBytes(in.dtype);
          int64_t at = 0;
          for (int r = 0; r < size(); ++r) {
            const int64_t* sent = s_->calls[r].data() + kCallFields;
            const int64_t off = std::accumulate(sent, sent + rank_, int64_t{0});
            if (recv_counts[r]) {
              std::memcpy(static_cast<char*>(out.data) + at * es,
                          static_cast<char*>(s_->ptrs[r]) + off * es, recv_counts[r] * es);
            }
            at += recv_counts[r];
          }
        });
  }
  absl::Status Broadcast(TensorView buf, int root) override {
    return Collective("broadcast", BroadcastCall(buf, root, size()), buf.data, [&] {
      if (rank_ != root && buf.bytes()) std::memcpy(buf.data, s_->ptrs[root], buf.bytes());
    });
  }
  absl::Status Reduce(TensorView in, TensorView out, int root) override {
    return Collective("reduce", ReduceCall(in, out, root, rank_, size()), in.data, [&] {
      if (rank_ != root) return;
      std::memset(out.data, 0, out.bytes());
      for (int r = 0; r < size(); ++r) Add(in.dtype, out.data, s_->ptrs[r], in.num_elements());
    });
  }
  absl::Status Barrier() override {
    return Collective("barrier", BarrierCall(), nullptr, [] {});
  }

 private:
  // One collective, as Gloo's with check_calls (call_agreement.h): this
  // rank's own checks have given `call` or refused it; it publishes its
  // call (kRefused when refused) and `data` in one step, then every rank
  // compares all the calls. When they match, `work` reads the peers' data;
  // either way a last barrier keeps the pointers and calls until every
  // rank is done with them, and the group in step. A refused rank returns
  // its own error, its peers the mismatch naming it.
  template <typename Fn>
  absl::Status Collective(const std::string& what, const absl::StatusOr<Call>& call, void* data,
                          Fn&& work) {
    {
      absl::MutexLock l(&s_->mu);
      s_->ptrs[rank_] = call.ok() ? data : nullptr;
      s_->calls[rank_] = EncodeCall(call.ok() ? *call : RefusedCall(), size());
    }
    s_->Barrier();
    // No rank writes the calls again before the barrier below.
    absl::Status agreed = CheckCallsMatch(what, s_->calls);
    if (call.ok() && agreed.ok()) work();
    s_->Barrier();
    return call.ok() ? agreed : call.status();
  }

  std::shared_ptr<Shared> s_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> NewInProcessGroup(int n) {
  auto shared = std::make_shared<Shared>(n);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) out.push_back(std::make_unique<InProcess>(shared, r));
  return out;
}

}  // namespace hap::executor
