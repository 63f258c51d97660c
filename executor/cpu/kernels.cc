// The kernel registry and its entry points. Each family file registers its
// kernels (kernels_internal.h); this file only looks them up and runs them.
#include "executor/cpu/kernels.h"

#include "absl/strings/str_cat.h"
#include "executor/cpu/kernels_internal.h"

namespace hap::executor {
namespace {

const cpu::KernelTable& Table() {
  static const cpu::KernelTable* table = [] {
    auto* t = new cpu::KernelTable;
    cpu::RegisterDenseKernels(*t);
    cpu::RegisterConvolutionKernels(*t);
    cpu::RegisterElementwiseKernels(*t);
    cpu::RegisterNormalizationKernels(*t);
    cpu::RegisterBatchNormKernels(*t);
    cpu::RegisterLayoutKernels(*t);
    cpu::RegisterReductionKernels(*t);
    cpu::RegisterLossKernels(*t);
    cpu::RegisterMoeKernels(*t);
    cpu::RegisterLstmKernels(*t);
    cpu::RegisterRuntimeKernels(*t);
    return t;
  }();
  return *table;
}

}  // namespace

absl::Status RunCpuKernel(const std::string& name, const KernelContext& ctx,
                          const graph::Attrs& attrs,
                          absl::Span<const TensorView> inputs,
                          absl::Span<const TensorView> outputs) {
  const cpu::KernelTable& t = Table();
  auto it = t.find(name);
  if (it == t.end()) {
    return absl::NotFoundError(absl::StrCat("no CPU kernel '", name, "'"));
  }
  SetBlasThreads(ctx.num_threads);
  return it->second(cpu::KernelArgs{name, ctx, attrs, inputs, outputs});
}

bool HasCpuKernel(const std::string& name) { return Table().count(name) > 0; }

std::vector<std::string> CpuKernelNames() {
  std::vector<std::string> names;
  for (const auto& [name, fn] : Table()) names.push_back(name);
  return names;  // std::map: sorted
}

}  // namespace hap::executor
