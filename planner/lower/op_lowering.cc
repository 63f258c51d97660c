#include "planner/lower/op_lowering.h"

namespace hap::lower::internal {

OpLowering AttrsOnly(decltype(OpLowering::attrs) attrs) {
  OpLowering h;
  h.attrs = attrs;
  return h;
}

OpLowering Bf16ProductOnly(decltype(OpLowering::bf16_product) bf16_product) {
  OpLowering h;
  h.bf16_product = bf16_product;
  return h;
}

const OpLowering* FindOpLowering(absl::string_view type) {
  using Family = const OpLowering* (*)(absl::string_view);
  static constexpr Family kFamilies[] = {
      ConvolutionLowering, ElementwiseLowering,   LinearLowering,    LossLowering,
      MoeLowering,         NormalizationLowering, ReductionLowering, ShapeLowering,
  };
  for (Family family : kFamilies) {
    if (const OpLowering* hooks = family(type)) return hooks;
  }
  return nullptr;
}

}  // namespace hap::lower::internal
