// Reductions: sum and mean over a set of axes (all when none are given).
// Sums accumulate in double.
#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"

namespace hap::executor::cpu {

absl::StatusOr<Reduced> CheckReduction(const KernelArgs& a,
                                       const TensorView& x) {
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> axes, AttrInts(a, "axes", {}));
  HAP_ASSIGN_OR_RETURN(bool keep, AttrBool(a, "keepdims", false));
  const int rank = x.rank();
  std::vector<bool> reduced(rank, axes.empty());
  for (int64_t ax : axes) {
    HAP_ASSIGN_OR_RETURN(int d, NormalizeAxis(a, ax, rank, "axis"));
    if (reduced[d]) return Invalid(a, "axis ", ax, " is listed twice");
    reduced[d] = true;
  }
  Reduced r;
  Shape kept;
  for (int d = 0; d < rank; ++d) {
    if (reduced[d]) {
      r.count *= x.shape[d];
      if (keep) r.out.push_back(1);
    } else {
      r.out.push_back(x.shape[d]);
      kept.push_back(x.shape[d]);
    }
  }
  std::vector<int64_t> ks = ContiguousStrides(kept);
  for (int d = 0, k = 0; d < rank; ++d) {
    r.strides.push_back(reduced[d] ? 0 : ks[k++]);
  }
  return r;
}

namespace {


template <typename T, bool kMean>
absl::Status ReduceForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckUnary(a, t));
  HAP_ASSIGN_OR_RETURN(Reduced r, CheckReduction(a, a.in[0]));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, r.out));
  HAP_ASSIGN_OR_RETURN(double factor, Factor<kMean>(a, r));
  std::vector<double> sums(a.out[0].num_elements(), 0.0);
  StridedCopy<double, T>(a.ctx.num_threads, a.in[0].shape, sums.data(),
                         r.strides, a.in[0].as<const T>(),
                         ContiguousStrides(a.in[0].shape), true);
  T* y = a.out[0].as<T>();
  for (size_t i = 0; i < sums.size(); ++i) {
    y[i] = static_cast<T>(sums[i] * factor);
  }
  return absl::OkStatus();
}

template <typename T, bool kMean>
absl::Status ReduceBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Unary(a, t));
  HAP_ASSIGN_OR_RETURN(Reduced r, CheckReduction(a, g.x(0)));
  HAP_RETURN_IF_ERROR(g.Check(t, {r.out}));
  HAP_ASSIGN_OR_RETURN(double factor, Factor<kMean>(a, r));
  if (!g.active()) return absl::OkStatus();
  const Shape& s = g.x(0).shape;
  StridedCopy<T, T>(a.ctx.num_threads, s, g.dx(0).as<T>(),
                    ContiguousStrides(s), g.dy(0).as<const T>(), r.strides,
                    true, static_cast<T>(factor));
  return absl::OkStatus();
}

}  // namespace

void RegisterReductionKernels(KernelTable& t) {
  t["sum"] = FloatKernel(&ReduceForward<float, false>,
                         &ReduceForward<double, false>);
  t["sum_grad"] = FloatKernel(&ReduceBackward<float, false>,
                              &ReduceBackward<double, false>);
  t["mean"] = FloatKernel(&ReduceForward<float, true>,
                          &ReduceForward<double, true>);
  t["mean_grad"] = FloatKernel(&ReduceBackward<float, true>,
                               &ReduceBackward<double, true>);
}

}  // namespace hap::executor::cpu
