// Lowering hooks of the convolution family (planner/graph/ops_convolution.cc).
#include "planner/lower/op_lowering.h"

namespace hap::lower::internal {
namespace {

// bf16 mixed precision rounds a convolution's products; grouped
// convolutions have no bf16 kernels and stay float32.
bool UngroupedConvolution(const graph::Op& op) {
  return op.attrs.Int("groups", 1).value_or(1) == 1;
}

}  // namespace

const OpLowering* ConvolutionLowering(absl::string_view type) {
  static const OpLowering kConv = Bf16ProductOnly(UngroupedConvolution);
  return type == "conv2d" || type == "conv3d" ? &kConv : nullptr;
}

}  // namespace hap::lower::internal
