#include "executor/train/in_process_comm.h"

#include <cstring>
#include <numeric>

#include "absl/synchronization/mutex.h"
#include "executor/runtime/bf16.h"

namespace hap::executor {
namespace {

struct Shared {
  explicit Shared(int n) : n(n), ptrs(n, nullptr) {}
  int n;
  absl::Mutex mu;
  absl::CondVar cv;
  int arrived = 0;
  int64_t generation = 0;
  std::vector<void*> ptrs;

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
    Publish(mine.data());
    std::memset(buf.data, 0, buf.bytes());
    for (int r = 0; r < size(); ++r) Add(buf.dtype, buf.data, s_->ptrs[r], buf.num_elements());
    s_->Barrier();
    return absl::OkStatus();
  }
  absl::Status AllGather(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                         CommMethod) override {
    Publish(in.data);
    const int64_t es = graph::DTypeBytes(in.dtype);
    int64_t at = 0;
    for (int r = 0; r < size(); ++r) {
      if (counts[r]) std::memcpy(static_cast<char*>(out.data) + at * es, s_->ptrs[r], counts[r] * es);
      at += counts[r];
    }
    s_->Barrier();
    return absl::OkStatus();
  }
  absl::Status ReduceScatter(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                             CommMethod) override {
    Publish(in.data);
    const int64_t es = graph::DTypeBytes(in.dtype);
    int64_t at = std::accumulate(counts.begin(), counts.begin() + rank_, int64_t{0});
    std::memset(out.data, 0, counts[rank_] * es);
    for (int r = 0; r < size(); ++r) {
      Add(in.dtype, out.data, static_cast<char*>(s_->ptrs[r]) + at * es, counts[rank_]);
    }
    s_->Barrier();
    return absl::OkStatus();
  }
  absl::Status AllToAll(TensorView in, absl::Span<const int64_t> send_counts, TensorView out,
                        absl::Span<const int64_t> recv_counts) override {
    // Publish the send buffer; peers read the part addressed to them. The
    // sender's offsets are recomputed from its counts, shared alongside.
    std::vector<int64_t> sc(send_counts.begin(), send_counts.end());
    struct Msg { void* data; int64_t* counts; } m{in.data, sc.data()};
    Publish(&m);
    const int64_t es = graph::DTypeBytes(in.dtype);
    int64_t at = 0;
    for (int r = 0; r < size(); ++r) {
      Msg* peer = static_cast<Msg*>(s_->ptrs[r]);
      int64_t off = std::accumulate(peer->counts, peer->counts + rank_, int64_t{0});
      if (recv_counts[r]) {
        std::memcpy(static_cast<char*>(out.data) + at * es,
                    static_cast<char*>(peer->data) + off * es, recv_counts[r] * es);
      }
      at += recv_counts[r];
    }
    s_->Barrier();
    return absl::OkStatus();
  }
  absl::Status Broadcast(TensorView buf, int root) override {
    Publish(buf.data);
    if (rank_ != root && buf.bytes()) std::memcpy(buf.data, s_->ptrs[root], buf.bytes());
    s_->Barrier();
    return absl::OkStatus();
  }
  absl::Status Reduce(TensorView in, TensorView out, int root) override {
    Publish(in.data);
    if (rank_ == root) {
      std::memset(out.data, 0, out.bytes());
      for (int r = 0; r < size(); ++r) Add(in.dtype, out.data, s_->ptrs[r], in.num_elements());
    }
    s_->Barrier();
    return absl::OkStatus();
  }
  absl::Status Barrier() override {
    s_->Barrier();
    return absl::OkStatus();
  }

 private:
  void Publish(void* p) {
    {
      absl::MutexLock l(&s_->mu);
      s_->ptrs[rank_] = p;
    }
    s_->Barrier();
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
