// Lowering hooks of the linear family (planner/graph/ops_linear.cc): bf16
// mixed precision rounds its products.
#include "planner/lower/op_lowering.h"

namespace hap::lower::internal {
namespace {

bool Always(const graph::Op&) { return true; }

}  // namespace

const OpLowering* LinearLowering(absl::string_view type) {
  static const OpLowering kProduct = Bf16ProductOnly(Always);
  return type == "linear" || type == "matmul" ? &kProduct : nullptr;
}

}  // namespace hap::lower::internal
