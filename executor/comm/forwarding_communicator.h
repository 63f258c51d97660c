// A communicator that forwards every call to another: the base for
// wrappers that change one or two calls (tests inject a failure or a hook
// before a call; the rest passes through).
#ifndef HAP_EXECUTOR_COMM_FORWARDING_COMMUNICATOR_H_
#define HAP_EXECUTOR_COMM_FORWARDING_COMMUNICATOR_H_

#include <memory>
#include <utility>

#include "executor/comm/communicator.h"

namespace hap::executor {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status AllReduce(TensorView buf) override { return inner_->AllReduce(buf); }
  absl::Status AllGather(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                         CommMethod method) override {
    return inner_->AllGather(in, out, counts, method);
  }
  absl::Status ReduceScatter(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                             CommMethod method) override {
    return inner_->ReduceScatter(in, out, counts, method);
  }
  absl::Status AllToAll(TensorView in, absl::Span<const int64_t> send_counts, TensorView out,
                        absl::Span<const int64_t> recv_counts) override {
    return inner_->AllToAll(in, send_counts, out, recv_counts);
  }
  absl::Status Broadcast(TensorView buf, int root) override { return inner_->Broadcast(buf, root); }
  absl::Status Reduce(TensorView in, TensorView out, int root) override {
    return inner_->Reduce(in, out, root);
  }
  absl::Status Barrier() override { return inner_->Barrier(); }
  absl::Status Send(TensorView buf, int peer, int64_t tag) override {
    return inner_->Send(buf, peer, tag);
  }
  absl::Status Recv(TensorView buf, int peer, int64_t tag) override {
    return inner_->Recv(buf, peer, tag);
  }
  absl::Status WaitSends() override { return inner_->WaitSends(); }

 private:
  std::unique_ptr<Communicator> inner_;
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_FORWARDING_COMMUNICATOR_H_
