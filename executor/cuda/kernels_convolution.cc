// Convolution and pooling over NCHW images and NCDHW volumes on the GPU,
// with the contracts and argument checks of
// executor/cpu/kernels_convolution.cc. conv2d and conv3d (one code path, a
// 2-D window having one depth slice) are im2col / vol2col
// (kernels_convolution.cu) + cuBLAS strided-batched GEMMs over groups
// of images sized to bound the im2col scratch; a 1x1, stride-1, unpadded
// convolution multiplies the images directly. Backward: dw through one GEMM
// per group over the images side by side, dx through w^T @ dy per image and
// a gathering col2im. No atomics anywhere: results are deterministic.
// bf16 mixed precision (attribute "bf16", ungrouped convolutions as on the
// CPU): the products on bf16 tensor cores, rounded as the CPU rounds them
// (gemm.h), the gradients' partial sums rounded per group of images as the
// CPU groups them.
#include <algorithm>
#include <type_traits>

#include "common/status_macros.h"
#include "executor/cpu/pool_window.h"
#include "executor/cuda/gemm.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/kernels_b_util.h"
#include "executor/cuda/launch_convolution.h"
#include "executor/cuda/launch_runtime.h"

namespace hap::executor::cuda {
namespace {

// An attribute of 1 or 2 integers >= min_value, as a (height, width) pair.
absl::StatusOr<std::pair<int64_t, int64_t>> Pair(
    const KernelArgs& a, const std::string& name,
    const std::vector<int64_t>& def, int64_t min_value) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(
      std::vector<int64_t> v,
      def.empty() ? cpu::AttrInts(c, name) : cpu::AttrInts(c, name, def));
  if (v.size() == 1) v.push_back(v[0]);
  if (v.size() != 2 || v[0] < min_value || v[1] < min_value) {
    return Invalid(a, "attribute '", name,
                   "' must be 1 or 2 integers >= ", min_value);
  }
  return std::make_pair(v[0], v[1]);
}

// A window attribute of a convolution over `spatial` axes: 1 or `spatial`
// integers >= min_value, default `fill` on every axis (as the CPU's).
absl::StatusOr<std::vector<int64_t>> Axes(const KernelArgs& a, const std::string& name, int spatial,
                                          int64_t fill, int64_t min_value) {
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> v,
                       cpu::AttrInts(CpuArgs(a), name, std::vector<int64_t>(spatial, fill)));
  if (!pool::SpatialValues(&v, spatial, min_value)) {
    return Invalid(a, "attribute '", name, "' must be 1 or ", spatial, " integers >= ", min_value);
  }
  return v;
}

// The layout an input of `spatial` axes must have.
const char* Layout(int spatial) { return spatial == 3 ? "NCDHW (rank 5)" : "NCHW (rank 4)"; }

// The window of x (rank spatial + 2), its output sizes and errors as the
// CPU's (pool::FitWindow).
absl::StatusOr<Window> MakeWindow(const KernelArgs& a, const TensorView& x, int spatial,
                                  const std::vector<int64_t>& k, const std::vector<int64_t>& s,
                                  const std::vector<int64_t>& p, bool ceil_mode = false,
                                  std::vector<int64_t> d = {}) {
  const cpu::KernelArgs c = CpuArgs(a);
  if (x.rank() != spatial + 2) {
    return Invalid(a, cpu::InLabel(c, 0), " must be ", Layout(spatial));
  }
  if (d.empty()) d.assign(spatial, 1);
  Window g;
  const std::string error =
      pool::FitWindow(x.shape, spatial, k, s, p, d, ceil_mode, cpu::InLabel(c, 0), &g);
  if (!error.empty()) return Invalid(a, error);
  return g;
}

// --- conv2d ------------------------------------------------------------------

// The most elements an im2col (or gradient staging) buffer may hold; groups
// of images are sized to it.
constexpr int64_t kMaxScratchElements = int64_t{1} << 25;
// The CPU's grouping constants, for the same size checks (CheckFitsBlas).
constexpr int64_t kCpuGemmColumns = 512;
constexpr int64_t kCpuMaxColElements = int64_t{1} << 23;

struct Conv {
  Window g;
  int64_t o = 0, ckk = 0, op = 0;
  int64_t groups = 1;  // > 1: grouped, the direct kernels (as the CPU's)
  bool direct = false;  // 1x1, stride 1, no padding: x is its own im2col
  int64_t group = 1;    // images per GEMM batch
  // The CPU's images per GEMM (1 when direct): bf16 gradients round each
  // group's partial sums, so their GEMMs group images as the CPU does.
  int64_t cpu_group = 1;
  // Images per GEMM within the scratch bound: the backward's (whose dw stages
  // dy and x side by side even when direct).
  int64_t bounded_group = 1;
  Shape y;

  // fn(first image, images) for each group of images.
  template <typename F>
  absl::Status ForEachGroup(F fn) const {
    for (int64_t i0 = 0; i0 < g.n; i0 += group) {
      HAP_RETURN_IF_ERROR(fn(i0, std::min(group, g.n - i0)));
    }
    return absl::OkStatus();
  }
};

// conv2d (spatial = 2) and conv3d (spatial = 3), as the CPU's: a 2-D
// convolution is a 3-D one of depth 1.
absl::StatusOr<Conv> CheckConv(const KernelArgs& a, DType t, bool has_bias_slot, int spatial) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 1, t));
  const TensorView& w = a.in[1];
  if (a.in[0].rank() != spatial + 2) {
    return Invalid(a, "image ", cpu::InLabel(c, 0), " must be ", Layout(spatial));
  }
  if (w.rank() != spatial + 2) {
    return Invalid(a, "weight ", cpu::InLabel(c, 1), " must have rank ", spatial + 2,
                   " ([out, in / groups, ", spatial == 3 ? "kt, " : "", "kh, kw])");
  }
  if (w.shape[1] < 1 || a.in[0].shape[1] < w.shape[1] || a.in[0].shape[1] % w.shape[1] != 0 ||
      w.shape[0] % (a.in[0].shape[1] / w.shape[1]) != 0) {
    return Invalid(a, "weight ", cpu::InLabel(c, 1), " does not fit image ",
                   cpu::InLabel(c, 0),
                   " (its channels must be a whole number of groups of the "
                   "weight's input channels, dividing its output channels)");
  }
  const std::vector<int64_t> kernel(w.shape.begin() + 2, w.shape.end());
  for (int64_t k : kernel) {
    if (k < 1) return Invalid(a, "weight ", cpu::InLabel(c, 1), " has an empty kernel");
  }
  HAP_ASSIGN_OR_RETURN(auto stride, Axes(a, "stride", spatial, 1, 1));
  HAP_ASSIGN_OR_RETURN(auto pad, Axes(a, "padding", spatial, 0, 0));
  HAP_ASSIGN_OR_RETURN(auto dil, Axes(a, "dilation", spatial, 1, 1));
  Conv cv;
  HAP_ASSIGN_OR_RETURN(cv.g, MakeWindow(a, a.in[0], spatial, kernel, stride, pad, false, dil));
  const Window& g = cv.g;
  cv.o = w.shape[0];
  cv.groups = a.in[0].shape[1] / w.shape[1];
  cv.ckk = w.shape[1] * g.taps();
  cv.op = g.out_plane();
  cv.direct =
      g.taps() == 1 && g.sd == 1 && g.sh == 1 && g.sw == 1 && g.pd == 0 && g.ph == 0 && g.pw == 0;
  // The CPU's group, only for its size check.
  int64_t cpu_group = 1;
  if (!cv.direct && cv.op > 0 && cv.ckk > 0) {
    cpu_group =
        std::min({g.n, std::max<int64_t>(1, kCpuGemmColumns / cv.op),
                  std::max<int64_t>(1, kCpuMaxColElements / (cv.ckk * cv.op))});
  }
  cv.cpu_group = cpu_group;
  cv.y = spatial == 3 ? Shape{g.n, cv.o, g.od, g.oh, g.ow} : Shape{g.n, cv.o, g.oh, g.ow};
  HAP_RETURN_IF_ERROR(cpu::CheckBias(c, t, has_bias_slot, cv.o));
  HAP_RETURN_IF_ERROR(cpu::CheckFitsBlas(c, {cv.o, cv.ckk, cpu_group * cv.op}));
  // Ours: as many images as the scratch bound allows (all of them in a
  // direct forward, which needs no scratch), and GEMM columns (group * op)
  // within int.
  const int64_t per_image =
      std::max<int64_t>(1, std::max(cv.ckk, cv.o) * cv.op);
  cv.bounded_group =
      std::clamp<int64_t>(kMaxScratchElements / per_image, 1, std::max<int64_t>(1, g.n));
  cv.group = cv.direct ? std::max<int64_t>(1, g.n) : cv.bounded_group;
  return cv;
}

// bf16 mixed precision: as the CPU, ungrouped convolutions only (the planner
// keeps grouped ones in float32, planner/lower/lower_ops_convolution.cc).
template <typename T>
absl::StatusOr<bool> Bf16Conv(const KernelArgs& a, const Conv& cv) {
  HAP_ASSIGN_OR_RETURN(bool bf16, cpu::Bf16Attr<T>(CpuArgs(a)));
  if (bf16 && cv.groups > 1) {
    return absl::UnimplementedError(
        absl::StrCat("kernel '", a.name, "': bf16 (mixed precision) with groups > 1"));
  }
  return bf16;
}

// y[m] = bf16(w_b @ col_b[m] + bf16(bias)), the CPU's bf16 forward: y set to
// the rounded bias first, then each group's products fused into it.
absl::Status ConvForwardBf16(const KernelArgs& a, const Conv& cv, const float* x, const float* w,
                             const float* bias, float* y) {
  const Window& g = cv.g;
  const int64_t plane = g.c * g.plane();
  Bf16Mode mode = Bf16Mode::kOverwrite;
  if (bias != nullptr) {
    const int64_t count = g.n * cv.o * cv.op;
    HAP_RETURN_IF_ERROR(KernelCudaStatus(a, cudaMemsetAsync(y, 0, count * sizeof(float), a.stream),
                                         "cudaMemsetAsync"));
    LaunchAddBias<float>(bias, g.n, cv.o, cv.op, y, a.stream);
    LaunchRoundBf16(y, count, a.stream);
    HAP_RETURN_IF_ERROR(CheckLaunch(a));
    mode = Bf16Mode::kFused;
  }
  if (cv.direct) {  // every image at once: x[m] is [c, op]
    return ProductBf16(a, mode, false, false, cv.o, cv.op, cv.ckk, w, cv.ckk, x, cv.op, y, g.n, 0,
                       plane);
  }
  HAP_ASSIGN_OR_RETURN(float* col, ScratchArray<float>(a, cv.ckk * cv.group * cv.op));
  Bf16Scratch staging;
  return cv.ForEachGroup([&](int64_t i0, int64_t m) -> absl::Status {
    LaunchIm2Col<float>(g, x + i0 * plane, m, cv.op, cv.ckk * cv.op, col, a.stream);
    HAP_RETURN_IF_ERROR(CheckLaunch(a));
    return ProductBf16(a, mode, false, false, cv.o, cv.op, cv.ckk, w, cv.ckk, col, cv.op,
                       y + i0 * cv.o * cv.op, m, 0, cv.ckk * cv.op, &staging);
  });
}

// The CPU's bf16 backward, group by group of its images (cpu_group):
//   dw += bf16(dy_g @ col_g^T), db += bf16(sum of bf16(dy_g)) per channel
//   (dy_g @ ones on the bf16 path), and dx += col2im(bf16(w^T @ dy[m]))
//   (direct: dx[m] += bf16(w^T @ dy[m])).
absl::Status ConvBackwardBf16(const KernelArgs& a, Conv cv, const float* x, const float* w,
                              const float* dy, float* dx, float* dw, float* db) {
  const Window& g = cv.g;
  const int64_t plane = g.c * g.plane();
  cv.group = cv.cpu_group;
  const int64_t max_cols = cv.group * cv.op;
  float* col = nullptr;
  float* dyg = nullptr;
  float* ones = nullptr;
  if (dw != nullptr || (dx != nullptr && !cv.direct)) {
    HAP_ASSIGN_OR_RETURN(col, ScratchArray<float>(a, cv.ckk * max_cols));
  }
  if (dw != nullptr || db != nullptr) {
    HAP_ASSIGN_OR_RETURN(dyg, ScratchArray<float>(a, cv.o * max_cols));
  }
  if (db != nullptr) {
    HAP_ASSIGN_OR_RETURN(ones, ScratchArray<float>(a, max_cols));
    LaunchFill<float>(1.0f, ones, max_cols, a.stream);
    HAP_RETURN_IF_ERROR(CheckLaunch(a));
  }
  Bf16Scratch staging;  // the products' bf16 operands and sums, reused
  return cv.ForEachGroup([&](int64_t i0, int64_t m) -> absl::Status {
    const float* xi = x + i0 * plane;
    const float* dyi = dy + i0 * cv.o * cv.op;
    const int64_t cols = m * cv.op;
    if (dyg != nullptr) {  // dy_g: [o, m * op]
      LaunchChannelsFirst<float>(dyi, m, cv.o, cv.op, dyg, a.stream);
      HAP_RETURN_IF_ERROR(CheckLaunch(a));
    }
    if (dw != nullptr) {
      LaunchIm2Col<float>(g, xi, m, cols, cv.op, col, a.stream);
      HAP_RETURN_IF_ERROR(CheckLaunch(a));
      HAP_RETURN_IF_ERROR(ProductBf16(a, Bf16Mode::kAccumulate, false, true, cv.o, cv.ckk, cols,
                                      dyg, cols, col, cols, dw, 1, 0, 0, &staging));
    }
    if (db != nullptr) {
      HAP_RETURN_IF_ERROR(ProductBf16(a, Bf16Mode::kAccumulate, false, false, cv.o, 1, cols, dyg,
                                      cols, ones, 1, db, 1, 0, 0, &staging));
    }
    if (dx == nullptr) return absl::OkStatus();
    float* dxi = dx + i0 * plane;
    if (cv.direct) {
      return ProductBf16(a, Bf16Mode::kAccumulate, true, false, cv.ckk, cv.op, cv.o, w, cv.ckk, dyi,
                         cv.op, dxi, m, 0, cv.o * cv.op, &staging);
    }
    HAP_RETURN_IF_ERROR(ProductBf16(a, Bf16Mode::kOverwrite, true, false, cv.ckk, cv.op, cv.o, w,
                                    cv.ckk, dyi, cv.op, col, m, 0, cv.o * cv.op, &staging));
    LaunchCol2Im<float>(g, col, m, cv.op, cv.ckk * cv.op, dxi, a.stream);
    return CheckLaunch(a);
  });
}

// y[m] = w @ im2col(x[m]) (+ bias): one strided-batched GEMM per group.
template <typename T, int kSpatial>
absl::Status ConvForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 2, 3, 1));
  HAP_ASSIGN_OR_RETURN(Conv cv, CheckConv(a, t, a.in.size() == 3, kSpatial));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, cv.y));
  HAP_ASSIGN_OR_RETURN(bool bf16, Bf16Conv<T>(a, cv));
  const T* bias =
      a.in.size() == 3 && a.in[2].present() ? a.in[2].as<const T>() : nullptr;
  const Window& g = cv.g;
  const int64_t plane = g.c * g.plane();
  const T* x = a.in[0].as<const T>();
  const T* w = a.in[1].as<const T>();
  T* y = a.out[0].as<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (bf16) return ConvForwardBf16(a, cv, x, w, bias, y);
  }
  if (cv.groups > 1) {
    LaunchGroupedConv<T>(g, cv.groups, cv.o, x, w, bias, y, a.stream);
    return CheckLaunch(a);
  }
  T* col = nullptr;
  if (!cv.direct) {
    HAP_ASSIGN_OR_RETURN(col, ScratchArray<T>(a, cv.ckk * cv.group * cv.op));
  }
  HAP_RETURN_IF_ERROR(cv.ForEachGroup([&](int64_t i0, int64_t m) {
    const T* xi = x + i0 * plane;
    T* yi = y + i0 * cv.o * cv.op;
    const T* b = xi;  // direct: the image is [c, op]
    if (!cv.direct) {
      LaunchIm2Col<T>(g, xi, m, cv.op, cv.ckk * cv.op, col, a.stream);
      HAP_RETURN_IF_ERROR(CheckLaunch(a));
      b = col;
    }
    return BatchedGemm<T>(a, false, false, cv.o, cv.op, cv.ckk, w, cv.ckk, 0, b,
                          cv.op, cv.direct ? plane : cv.ckk * cv.op, T(0), yi,
                          cv.op, cv.o * cv.op, m);
  }));
  if (bias != nullptr) {
    LaunchAddBias<T>(bias, g.n, cv.o, cv.op, y, a.stream);
    return CheckLaunch(a);
  }
  return absl::OkStatus();
}

template <typename T, int kSpatial>
absl::Status ConvBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs gr, cpu::GradArgs::Make(c, 2, 3, 1));
  HAP_ASSIGN_OR_RETURN(Conv cv, CheckConv(a, t, gr.n() == 3, kSpatial));
  HAP_RETURN_IF_ERROR(gr.Check(t, {cv.y}));
  if (!gr.dy(0).present()) return absl::OkStatus();  // as the CPU, before bf16's checks
  HAP_ASSIGN_OR_RETURN(bool bf16, Bf16Conv<T>(a, cv));
  cv.group = cv.bounded_group;
  const Window& g = cv.g;
  const int64_t plane = g.c * g.plane();
  const T* x = gr.x(0).as<const T>();
  const T* w = gr.x(1).as<const T>();
  const T* dy = gr.dy(0).as<const T>();
  T* dx = gr.dx(0).present() ? gr.dx(0).as<T>() : nullptr;
  T* dw = gr.dx(1).present() ? gr.dx(1).as<T>() : nullptr;
  T* db = gr.n() == 3 && gr.dx(2).present() ? gr.dx(2).as<T>() : nullptr;
  if constexpr (std::is_same_v<T, float>) {
    if (bf16) return ConvBackwardBf16(a, cv, x, w, dy, dx, dw, db);
  }
  if (cv.groups > 1) {
    LaunchGroupedConvGrad<T>(g, cv.groups, cv.o, x, w, dy, dx, dw, a.stream);
    if (db != nullptr) LaunchBiasGrad<T>(dy, g.n, cv.o, cv.op, db, a.stream);
    return CheckLaunch(a);
  }
  T* col = nullptr;
  T* dyg = nullptr;
  if (dw != nullptr || (dx != nullptr && !cv.direct)) {
    HAP_ASSIGN_OR_RETURN(col, ScratchArray<T>(a, cv.ckk * cv.group * cv.op));
  }
  if (dw != nullptr) {
    HAP_ASSIGN_OR_RETURN(dyg, ScratchArray<T>(a, cv.o * cv.group * cv.op));
  }
  HAP_RETURN_IF_ERROR(
      cv.ForEachGroup([&](int64_t i0, int64_t m) -> absl::Status {
        const T* xi = x + i0 * plane;
        const T* dyi = dy + i0 * cv.o * cv.op;
        const int64_t cols = m * cv.op;
        if (dw != nullptr) {
          // dw += dy_g @ col_g^T, the group's images side by side: dy_g is
          // [o, m * op], col_g [ckk, m * op].
          LaunchChannelsFirst<T>(dyi, m, cv.o, cv.op, dyg, a.stream);
          LaunchIm2Col<T>(g, xi, m, cols, cv.op, col, a.stream);
          HAP_RETURN_IF_ERROR(CheckLaunch(a));
          HAP_RETURN_IF_ERROR(BatchedGemm<T>(a, false, true, cv.o, cv.ckk, cols,
                                             dyg, cols, 0, col, cols, 0, T(1),
                                             dw, cv.ckk, 0, 1));
        }
        if (dx != nullptr) {
          T* dxi = dx + i0 * plane;
          if (cv.direct) {  // dx[m] += w^T @ dy[m]
            return BatchedGemm<T>(a, true, false, cv.ckk, cv.op, cv.o, w,
                                  cv.ckk, 0, dyi, cv.op, cv.o * cv.op, T(1),
                                  dxi, cv.op, plane, m);
          }
          // dcol[m] = w^T @ dy[m] (one matrix an image), gathered into dx.
          HAP_RETURN_IF_ERROR(BatchedGemm<T>(
              a, true, false, cv.ckk, cv.op, cv.o, w, cv.ckk, 0, dyi, cv.op,
              cv.o * cv.op, T(0), col, cv.op, cv.ckk * cv.op, m));
          LaunchCol2Im<T>(g, col, m, cv.op, cv.ckk * cv.op, dxi, a.stream);
          HAP_RETURN_IF_ERROR(CheckLaunch(a));
        }
        return absl::OkStatus();
      }));
  if (db != nullptr) {
    LaunchBiasGrad<T>(dy, g.n, cv.o, cv.op, db, a.stream);
    return CheckLaunch(a);
  }
  return absl::OkStatus();
}

// --- pooling -----------------------------------------------------------------

// Validates a pooling op's input and attributes; returns its window.
using PoolCheck = absl::StatusOr<Window> (*)(const KernelArgs&, DType);

// max_pool2d / max_pool3d (kSpatial 2 / 3), as the CPU's: kernel, stride
// (default: the kernel) and padding (at most half the kernel) per axis.
template <int kSpatial>
absl::StatusOr<Window> CheckMaxPool(const KernelArgs& a, DType t) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> k, cpu::AttrInts(c, "kernel"));
  if (!pool::SpatialValues(&k, kSpatial, 1)) {
    return Invalid(a, "attribute 'kernel' must be 1 or ", kSpatial, " integers >= 1");
  }
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> s, cpu::AttrInts(c, "stride", k));
  if (!pool::SpatialValues(&s, kSpatial, 1)) {
    return Invalid(a, "attribute 'stride' must be 1 or ", kSpatial, " integers >= 1");
  }
  HAP_ASSIGN_OR_RETURN(auto p, Axes(a, "padding", kSpatial, 0, 0));
  HAP_ASSIGN_OR_RETURN(bool ceil_mode, cpu::AttrBool(c, "ceil_mode", false));
  for (int i = 0; i < kSpatial; ++i) {
    if (p[i] > k[i] / 2) return Invalid(a, "padding must be at most half the kernel");
  }
  return MakeWindow(a, a.in[0], kSpatial, k, s, p, ceil_mode);
}

template <int kSpatial>
absl::StatusOr<Window> CheckAvgPool(const KernelArgs& a, DType t) {
  HAP_ASSIGN_OR_RETURN(Window g, CheckMaxPool<kSpatial>(a, t));
  HAP_ASSIGN_OR_RETURN(g.count_include_pad,
                       cpu::AttrBool(CpuArgs(a), "count_include_pad", true));
  return g;
}

// A pooling op's output shape: [n, c, (od,) oh, ow].
Shape PoolShape(const Window& g) {
  return g.spatial == 3 ? Shape{g.n, g.c, g.od, g.oh, g.ow} : Shape{g.n, g.c, g.oh, g.ow};
}

absl::StatusOr<Window> CheckAdaptive(const KernelArgs& a, DType t) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  HAP_ASSIGN_OR_RETURN(auto o, Pair(a, "output_size", {}, 1));
  if (a.in[0].rank() != 4) {
    return Invalid(a, cpu::InLabel(c, 0), " must be ", Layout(2));
  }
  Window g;
  g.n = a.in[0].shape[0];
  g.c = a.in[0].shape[1];
  g.h = a.in[0].shape[2];
  g.w = a.in[0].shape[3];
  std::tie(g.oh, g.ow) = o;
  return g;
}

template <typename T>
absl::StatusOr<Window> PoolForwardChecks(const KernelArgs& a, PoolCheck check) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(Window g, check(a, t));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, PoolShape(g)));
  return g;
}

// The window, or nullopt-like: `active` false when there is nothing to do.
template <typename T>
absl::StatusOr<Window> PoolBackwardChecks(const KernelArgs& a, PoolCheck check,
                                          bool* active) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs gr, cpu::GradArgs::Make(c, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(Window g, check(a, t));
  HAP_RETURN_IF_ERROR(gr.Check(t, {PoolShape(g)}));
  *active = gr.active();
  return g;
}

template <typename T, int kSpatial>
absl::Status MaxPoolForward(const KernelArgs& a) {
  HAP_ASSIGN_OR_RETURN(Window g, PoolForwardChecks<T>(a, CheckMaxPool<kSpatial>));
  LaunchMaxPool<T>(g, a.in[0].as<const T>(), a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

// Inputs (x, y, dy): y is not needed (the maxima are found again).
template <typename T, int kSpatial>
absl::Status MaxPoolBackward(const KernelArgs& a) {
  bool active = false;
  HAP_ASSIGN_OR_RETURN(Window g, PoolBackwardChecks<T>(a, CheckMaxPool<kSpatial>, &active));
  if (!active) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(int64_t * argmax, ScratchArray<int64_t>(a, g.n * g.c * g.out_plane()));
  LaunchMaxPoolGrad<T>(g, a.in[0].as<const T>(), a.in[2].as<const T>(),
                       a.out[0].as<T>(), argmax, a.stream);
  return CheckLaunch(a);
}

template <typename T, int kSpatial>
absl::Status AvgPoolForward(const KernelArgs& a) {
  HAP_ASSIGN_OR_RETURN(Window g, PoolForwardChecks<T>(a, CheckAvgPool<kSpatial>));
  LaunchAvgPool<T>(g, a.in[0].as<const T>(), a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

template <typename T, int kSpatial>
absl::Status AvgPoolBackward(const KernelArgs& a) {
  bool active = false;
  HAP_ASSIGN_OR_RETURN(Window g, PoolBackwardChecks<T>(a, CheckAvgPool<kSpatial>, &active));
  if (!active) return absl::OkStatus();
  LaunchAvgPoolGrad<T>(g, a.in[2].as<const T>(), a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status AdaptivePoolForward(const KernelArgs& a) {
  HAP_ASSIGN_OR_RETURN(Window g, PoolForwardChecks<T>(a, CheckAdaptive));
  LaunchAdaptiveAvgPool<T>(g, a.in[0].as<const T>(), a.out[0].as<T>(),
                           a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status AdaptivePoolBackward(const KernelArgs& a) {
  bool active = false;
  HAP_ASSIGN_OR_RETURN(Window g,
                       PoolBackwardChecks<T>(a, CheckAdaptive, &active));
  if (!active) return absl::OkStatus();
  LaunchAdaptiveAvgPoolGrad<T>(g, a.in[2].as<const T>(), a.out[0].as<T>(),
                               a.stream);
  return CheckLaunch(a);
}

}  // namespace

void RegisterConvolutionKernels(KernelTable& t) {
  t["conv2d"] = HAP_CUDA_FLOAT_KERNEL_N(ConvForward, 2);
  t["conv2d_grad"] = HAP_CUDA_FLOAT_KERNEL_N(ConvBackward, 2);
  t["conv3d"] = HAP_CUDA_FLOAT_KERNEL_N(ConvForward, 3);
  t["conv3d_grad"] = HAP_CUDA_FLOAT_KERNEL_N(ConvBackward, 3);
  t["max_pool2d"] = HAP_CUDA_FLOAT_KERNEL_N(MaxPoolForward, 2);
  t["max_pool2d_grad"] = HAP_CUDA_FLOAT_KERNEL_N(MaxPoolBackward, 2);
  t["avg_pool2d"] = HAP_CUDA_FLOAT_KERNEL_N(AvgPoolForward, 2);
  t["avg_pool2d_grad"] = HAP_CUDA_FLOAT_KERNEL_N(AvgPoolBackward, 2);
  t["max_pool3d"] = HAP_CUDA_FLOAT_KERNEL_N(MaxPoolForward, 3);
  t["max_pool3d_grad"] = HAP_CUDA_FLOAT_KERNEL_N(MaxPoolBackward, 3);
  t["avg_pool3d"] = HAP_CUDA_FLOAT_KERNEL_N(AvgPoolForward, 3);
  t["avg_pool3d_grad"] = HAP_CUDA_FLOAT_KERNEL_N(AvgPoolBackward, 3);
  t["adaptive_avg_pool2d"] = HAP_CUDA_FLOAT_KERNEL(AdaptivePoolForward);
  t["adaptive_avg_pool2d_grad"] = HAP_CUDA_FLOAT_KERNEL(AdaptivePoolBackward);
}

}  // namespace hap::executor::cuda
