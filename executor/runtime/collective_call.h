// Runs a plan's CollectiveCall (plan.proto) on a communicator: shards along
// any dimension are mapped onto the communicator's flat per-rank chunks
// through staging buffers, and copied back into place.
#ifndef HAP_EXECUTOR_RUNTIME_COLLECTIVE_CALL_H_
#define HAP_EXECUTOR_RUNTIME_COLLECTIVE_CALL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "executor/comm/communicator.h"
#include "executor/runtime/device.h"
#include "executor/runtime/tensor.h"
#include "hap/v1/plan.pb.h"

namespace hap::executor {

// Device memory reused across collectives (grows, never shrinks).
class Staging {
 public:
  explicit Staging(Device* device) : device_(device) {}
  ~Staging();
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  // Independent regions of at least `bytes` each: 0 and 1 (send, receive)
  // for the collectives' restaging, 2 and 3 for bf16 on the wire.
  static constexpr int kRegions = 4;
  absl::StatusOr<void*> Get(int which, int64_t bytes);

 private:
  Device* device_;
  void* buf_[kRegions] = {};
  int64_t size_[kRegions] = {};
};

// `in` and `out` are the call's input and output buffers on this rank;
// `coalesced` the views of call.coalesced() (ALL_REDUCE: packed with `out`
// into one staging buffer, summed in one call, copied back) and
// `coalesced_outputs` those of call.coalesced_outputs() (ALL_GATHER and
// REDUCE_SCATTER along dim 0: every pair's shards packed per rank into one
// flat transfer). The program runner has checked the shapes.
// call.wire_dtype BFLOAT16 (ALL_REDUCE and REDUCE_SCATTER of float32
// buffers): the transfers run in bf16 (Device::Convert into staging regions
// 2 and 3, the communicator's bf16 sum, widened back).
// Errors: the communicator's, annotated with the collective and tensor;
// InvalidArgument for a wire dtype the call cannot use.
absl::Status RunCollective(const hap::v1::CollectiveCall& call, TensorView in,
                           TensorView out, Device& device, Communicator& comm,
                           Staging& staging,
                           absl::Span<const TensorView> coalesced = {},
                           absl::Span<const TensorView> coalesced_outputs = {});

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_COLLECTIVE_CALL_H_
