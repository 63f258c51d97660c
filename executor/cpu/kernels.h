// CPU kernels: the forward and backward of every IR op (planner/graph
// ops_*.cc), and the runtime's own kernels (copies, optimizer updates).
// Matrix products go through OpenBLAS. A rank's program (plan.proto
// RankProgram) names kernels by these strings; the CUDA backend implements
// the same names and contracts.
//
// Contract, for every kernel:
// - Shapes come from the views (rank-local shapes), never from attributes
//   that describe the single-device tensor: reshape/flatten/expand write
//   their output view's shape, whatever the IR attribute "shape" says.
// - Floating kernels support float32 and float64 (float64 is what the
//   finite-difference tests use); ids and targets are int64 or int32.
// - Forward kernel "T" for IR op type T: inputs and outputs as in the IR;
//   outputs are overwritten. An absent input (data == nullptr) is zero:
//   linear/conv2d without bias, add/sub with one operand absent (out = the
//   other operand, or its negation for sub's first operand absent).
// - Backward kernel "T_grad": inputs are [the op's inputs (n), its outputs
//   (m), the gradients of its outputs (m)]; outputs are the gradients of its
//   n inputs. Gradients ACCUMULATE (+=) into present outputs; an absent
//   output is not computed; an absent output gradient input is zero.
//   Inputs the op does not differentiate (ids, targets, masks, the MoE
//   combine weights where the op says so) get no gradient (pass absent).
// - Attributes the lowering adds to IR attributes for sharded execution
//   (each defaults to the single-device meaning):
//     dropout            "rng_key" (int): mask key; element with global flat
//                        index g at step s is kept iff
//                        CounterUniform(CounterKey(rng_key, s), g) >= p;
//                        "global_shape" (ints) and "offsets" (ints, start of
//                        the local slice per dimension) map local elements
//                        to g (defaults: the local shape, zeros).
//     nll_loss,          "global_rows" (int): the loss is the sum over the
//     cross_entropy      local rows divided by this (default: local rows).
//     mean               "global_count" (int): elements averaged per output
//                        element on one device (default: local count).
//     embedding          "vocab_offset" (int): the local table holds rows
//                        [offset, offset + local rows); other ids give zero
//                        rows (vocabulary parallel). "vocab_size" (int): ids
//                        outside [0, vocab_size) are InvalidArgument
//                        (default: local rows when offset is 0).
//     moe_dispatch_idx,  "expert_offset" (int): the local [experts, capacity,
//     moe_combine_idx    d] holds experts [offset, offset + local experts)
//                        of "experts" (int, the global count); route
//                        entries of other experts are skipped (defaults: 0,
//                        the local count).
// - Mixed precision (PlanOptions.precision BF16): attribute "bf16" (bool,
//   float32 calls only; InvalidArgument on float64) on linear, matmul,
//   conv2d and their _grad kernels makes every matrix product read bf16
//   roundings (to nearest even) of its operands, sum in float32 and round
//   its result to bf16: forward y = bf16(x_b @ w_b^T + b_b); backward each
//   gradient product (bias gradient: the column sums of bf16(dy)) is
//   rounded to bf16, then added (+=) in float32. PyTorch's bf16 autocast
//   computes these products so (oneDNN on the CPU, kernels_bf16.cc).
// - Runtime kernels:
//     "fill_zero"    () -> (out)              out = 0
//     "copy"         (x) -> (out)             out = x (same element count)
//     "accumulate"   (x) -> (out)             out += x
//     "sq_norm"      (g0, g1, ...) -> (acc)   acc[0] += sum of squares, in
//                                             double, acc a f64 [1] tensor
//     "sgd_update"   (param, grad, norm_sq?) -> (param, momentum?)
//                    PyTorch SGD: g = grad * clip + weight_decay * param;
//                    momentum buffer m = momentum * m + g (buffers start at
//                    zero, so the first step gives m = g); param -= lr * m
//                    (or lr * g without momentum). Attributes
//                    "learning_rate", "momentum", "weight_decay",
//                    "clip_global_norm" (0 = no clipping). With clipping and
//                    norm_sq (f64 [1], the global sum of squares) present:
//                    clip = min(1, clip_global_norm / (sqrt(norm_sq) + 1e-6))
//                    as torch.nn.utils.clip_grad_norm_.
//     "adam_update"  (param, grad, norm_sq?) -> (param, m, v)
//                    PyTorch AdamW: param *= 1 - lr * weight_decay; m, v
//                    moments with "beta1", "beta2"; bias correction with
//                    t = ctx.step + 1; param -= lr * mhat / (sqrt(vhat) +
//                    "epsilon"). Clipping as sgd_update.
//   Optimizer kernels update param/m/v in place (the output views alias the
//   state buffers; the `param` input and output are the same buffer).
//
// Errors: InvalidArgument naming the kernel and the offending input (wrong
// arity, dtype, shape, an id out of range); NotFound for an unknown kernel.
// Thread-safety: kernels are reentrant; `ctx.num_threads` bounds the threads
// one call uses (OpenBLAS included).
#ifndef HAP_EXECUTOR_CPU_KERNELS_H_
#define HAP_EXECUTOR_CPU_KERNELS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "executor/runtime/kernel_context.h"
#include "executor/runtime/tensor.h"
#include "planner/graph/types.h"

namespace hap::executor {

absl::Status RunCpuKernel(const std::string& name, const KernelContext& ctx,
                          const graph::Attrs& attrs,
                          absl::Span<const TensorView> inputs,
                          absl::Span<const TensorView> outputs);

bool HasCpuKernel(const std::string& name);
std::vector<std::string> CpuKernelNames();  // sorted

// Sets OpenBLAS's thread count (process-wide).
void SetBlasThreads(int n);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_CPU_KERNELS_H_
