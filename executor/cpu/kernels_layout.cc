// Layout kernels: transpose, reshape, flatten, concat, split, slice, expand,
// and the embedding lookup. Sizes come from the views (rank-local shapes).
// The forward kernels move integer tensors too (the lowering slices ids).
#include <cstring>
#include <limits>

#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"

namespace hap::executor::cpu {

// --- shared with executor/cuda (declared in kernels_internal.h) ------------

absl::StatusOr<std::vector<int>> Perm(const KernelArgs& a, int rank) {
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> perm, AttrInts(a, "perm"));
  if (static_cast<int>(perm.size()) != rank) {
    return Invalid(a, "attribute 'perm' has ", perm.size(), " entries for ",
                   InLabel(a, 0));
  }
  std::vector<int> p(rank);
  std::vector<bool> seen(rank, false);
  for (int i = 0; i < rank; ++i) {
    HAP_ASSIGN_OR_RETURN(p[i], NormalizeAxis(a, perm[i], rank, "perm entry"));
    if (seen[p[i]]) return Invalid(a, "attribute 'perm' is not a permutation");
    seen[p[i]] = true;
  }
  return p;
}

Permuted PermuteShape(const Shape& in, const std::vector<int>& perm) {
  std::vector<int64_t> st = ContiguousStrides(in);
  Permuted p;
  for (int d : perm) {
    p.shape.push_back(in[d]);
    p.in_strides.push_back(st[d]);
  }
  return p;
}

AxisView AroundAxis(const Shape& s, int axis) {
  AxisView v;
  for (int d = 0; d < axis; ++d) v.outer *= s[d];
  v.len = s[axis];
  for (size_t d = axis + 1; d < s.size(); ++d) v.inner *= s[d];
  return v;
}

// Shapes equal except along `axis`.
bool SameOffAxis(const Shape& x, const Shape& y, int axis) {
  if (x.size() != y.size()) return false;
  for (size_t d = 0; d < x.size(); ++d) {
    if (static_cast<int>(d) != axis && x[d] != y[d]) return false;
  }
  return true;
}

// The parts of a concat (its inputs) or split (its outputs): the whole's
// axis and each part's size along it. `parts[i]` may be absent when
// `fallback_sizes` gives its size.
absl::StatusOr<std::vector<int64_t>> PartSizes(
    const KernelArgs& a, const TensorView& whole, int axis,
    const std::vector<const TensorView*>& parts, absl::string_view what,
    const std::vector<int64_t>& fallback_sizes) {
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const TensorView& p = *parts[i];
    if (p.present()) {
      if (!SameOffAxis(p.shape, whole.shape, axis)) {
        return Invalid(a, what, " ", i, " (", Describe(p), ") does not match ",
                       Describe(whole), " outside axis ", axis);
      }
      sizes.push_back(p.shape[axis]);
    } else if (i < fallback_sizes.size()) {
      sizes.push_back(fallback_sizes[i]);
    } else {
      return Invalid(a, what, " ", i, " is absent and its size is unknown");
    }
    total += sizes.back();
  }
  if (total != whole.shape[axis]) {
    return Invalid(a, "the ", what, "s' sizes along axis ", axis, " sum to ",
                   total, " but ", Describe(whole), " has ", whole.shape[axis]);
  }
  return sizes;
}

absl::StatusOr<int> AxisAttr(const KernelArgs& a, const TensorView& x) {
  HAP_ASSIGN_OR_RETURN(int64_t axis, AttrInt(a, "axis"));
  return NormalizeAxis(a, axis, x.rank(), "axis");
}

absl::StatusOr<SliceRange> CheckSlice(const KernelArgs& a,
                                      const TensorView& x) {
  SliceRange r;
  HAP_ASSIGN_OR_RETURN(r.axis, AxisAttr(a, x));
  HAP_ASSIGN_OR_RETURN(r.start, AttrInt(a, "start"));
  HAP_ASSIGN_OR_RETURN(r.end, AttrInt(a, "end"));
  if (r.start < 0 || r.end <= r.start || r.end > x.shape[r.axis]) {
    return Invalid(a, "slice [", r.start, ", ", r.end,
                   ") is empty or out of range for axis ", r.axis, " of ",
                   Describe(x));
  }
  return r;
}

namespace {

// --- transpose --------------------------------------------------------------------

template <typename T>
absl::Status TransposeForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckUnary(a, t));
  HAP_ASSIGN_OR_RETURN(std::vector<int> perm, Perm(a, a.in[0].rank()));
  Permuted p = PermuteShape(a.in[0].shape, perm);
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, p.shape));
  StridedCopy<T, T>(a.ctx.num_threads, p.shape, a.out[0].as<T>(),
                    ContiguousStrides(p.shape), a.in[0].as<const T>(),
                    p.in_strides, false);
  return absl::OkStatus();
}

template <typename T>
absl::Status TransposeBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Unary(a, t));
  HAP_ASSIGN_OR_RETURN(std::vector<int> perm, Perm(a, g.x(0).rank()));
  Permuted p = PermuteShape(g.x(0).shape, perm);
  HAP_RETURN_IF_ERROR(g.Check(t, {p.shape}));
  if (!g.active()) return absl::OkStatus();
  // dx, read in dy's (the output's) order, += dy.
  StridedCopy<T, T>(a.ctx.num_threads, p.shape, g.dx(0).as<T>(), p.in_strides,
                    g.dy(0).as<const T>(), ContiguousStrides(p.shape), true);
  return absl::OkStatus();
}

// --- reshape, flatten: the same elements in a new shape ---------------------------

template <typename T>
absl::Status ReshapeForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckUnary(a, t));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, a.out[0].shape));
  if (a.out[0].num_elements() != a.in[0].num_elements()) {
    return Invalid(a, OutLabel(a, 0), " and ", InLabel(a, 0),
                   " differ in element count");
  }
  if (a.out[0].data != a.in[0].data) {
    std::memcpy(a.out[0].data, a.in[0].data, a.in[0].bytes());
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ReshapeBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Unary(a, t));
  if (!g.active()) return absl::OkStatus();
  HAP_RETURN_IF_ERROR(g.Check(t, {g.dy(0).shape}));
  if (g.dy(0).num_elements() != g.x(0).num_elements()) {
    return Invalid(a, "the output gradient ", InLabel(a, 2), " and ",
                   InLabel(a, 0), " differ in element count");
  }
  AddTo(g.dx(0).as<T>(), g.dy(0).as<const T>(), g.x(0).num_elements());
  return absl::OkStatus();
}

// stop_gradient's backward: no gradient flows through it, so it adds nothing
// to the input's (gradients accumulate); its arguments are still checked.
template <typename T>
absl::Status StopGradientBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Unary(a, t));
  if (!g.active()) return absl::OkStatus();
  return g.Check(t, {g.dy(0).shape});
}

// --- concat, split, slice: blocks along one axis ----------------------------------

// For each of `outer` rows: dst[row, dst_at : dst_at + n] (+)=
// src[row, src_at : src_at + n], rows `src_len` and `dst_len` long (all in
// units of the axis, times `inner` elements).
template <typename T>
void CopyAlongAxis(const KernelArgs& a, int64_t outer, int64_t inner,
                   const T* src, int64_t src_len, int64_t src_at, T* dst,
                   int64_t dst_len, int64_t dst_at, int64_t n,
                   bool accumulate) {
  const int64_t block = n * inner;
  ParallelFor(a.ctx.num_threads, outer, GrainFor(block),
              [&](int64_t b, int64_t e) {
                for (int64_t o = b; o < e; ++o) {
                  const T* s = src + (o * src_len + src_at) * inner;
                  T* d = dst + (o * dst_len + dst_at) * inner;
                  if (accumulate) {
                    AddTo(d, s, block);
                  } else {
                    std::memcpy(d, s, block * sizeof(T));
                  }
                }
              });
}

// Moves every part into (to_whole) or out of the whole along the axis.
template <typename T>
void Scatter(const KernelArgs& a, const TensorView& whole, int axis,
             const std::vector<const TensorView*>& parts,
             const std::vector<int64_t>& sizes, bool to_whole,
             bool accumulate) {
  AxisView w = AroundAxis(whole.shape, axis);
  int64_t at = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i]->present()) {
      T* wp = whole.as<T>();
      T* pp = parts[i]->as<T>();
      if (to_whole) {
        CopyAlongAxis<T>(a, w.outer, w.inner, pp, sizes[i], 0, wp, w.len, at,
                         sizes[i], accumulate);
      } else {
        CopyAlongAxis<T>(a, w.outer, w.inner, wp, w.len, at, pp, sizes[i], 0,
                         sizes[i], accumulate);
      }
    }
    at += sizes[i];
  }
}

template <typename T>
absl::Status ConcatForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, -1, 1));
  std::vector<const TensorView*> parts;
  for (int i = 0; i < static_cast<int>(a.in.size()); ++i) {
    HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
    parts.push_back(&a.in[i]);
  }
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, a.out[0].shape));
  HAP_ASSIGN_OR_RETURN(int axis, AxisAttr(a, a.out[0]));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> sizes,
                       PartSizes(a, a.out[0], axis, parts, "input", {}));
  Scatter<T>(a, a.out[0], axis, parts, sizes, true, false);
  return absl::OkStatus();
}

template <typename T>
absl::Status ConcatBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 1, 1 << 20, 1));
  std::vector<const TensorView*> xs, dxs;
  for (int i = 0; i < g.n(); ++i) {
    HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
    xs.push_back(&g.x(i));
    dxs.push_back(&g.dx(i));
  }
  if (!g.dy(0).present()) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(int axis, AxisAttr(a, g.dy(0)));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> sizes,
                       PartSizes(a, g.dy(0), axis, xs, "input", {}));
  HAP_RETURN_IF_ERROR(g.Check(t, {g.dy(0).shape}));
  Scatter<T>(a, g.dy(0), axis, dxs, sizes, false, true);
  return absl::OkStatus();
}

template <typename T>
absl::Status SplitForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  if (a.in.size() != 1 || a.out.empty()) {
    return Invalid(a, "takes 1 input and at least 1 output, got ", a.in.size(),
                   " and ", a.out.size());
  }
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  std::vector<const TensorView*> parts;
  for (int j = 0; j < static_cast<int>(a.out.size()); ++j) {
    HAP_RETURN_IF_ERROR(CheckOutput(a, j, t, a.out[j].shape));
    parts.push_back(&a.out[j]);
  }
  HAP_ASSIGN_OR_RETURN(int axis, AxisAttr(a, a.in[0]));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> sizes,
                       PartSizes(a, a.in[0], axis, parts, "output", {}));
  Scatter<T>(a, a.in[0], axis, parts, sizes, false, false);
  return absl::OkStatus();
}

template <typename T>
absl::Status SplitBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 1, 1, -1));
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_ASSIGN_OR_RETURN(int axis, AxisAttr(a, g.x(0)));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> attr_sizes,
                       AttrInts(a, "sizes", {}));
  // A part's size: from its value, else its gradient, else the attribute.
  std::vector<const TensorView*> shapes, dys;
  std::vector<Shape> y_shapes;
  for (int j = 0; j < g.m(); ++j) {
    shapes.push_back(g.y(j).present() ? &g.y(j) : &g.dy(j));
    dys.push_back(&g.dy(j));
  }
  HAP_ASSIGN_OR_RETURN(
      std::vector<int64_t> sizes,
      PartSizes(a, g.x(0), axis, shapes, "output", attr_sizes));
  for (int j = 0; j < g.m(); ++j) {
    y_shapes.push_back(g.x(0).shape);
    y_shapes.back()[axis] = sizes[j];
  }
  HAP_RETURN_IF_ERROR(g.Check(t, y_shapes));
  if (!g.dx(0).present()) return absl::OkStatus();
  Scatter<T>(a, g.dx(0), axis, dys, sizes, true, true);
  return absl::OkStatus();
}

template <typename T>
absl::Status SliceForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckUnary(a, t));
  HAP_ASSIGN_OR_RETURN(SliceRange r, CheckSlice(a, a.in[0]));
  Shape s = a.in[0].shape;
  s[r.axis] = r.end - r.start;
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, s));
  AxisView x = AroundAxis(a.in[0].shape, r.axis);
  CopyAlongAxis<T>(a, x.outer, x.inner, a.in[0].as<const T>(), x.len, r.start,
                   a.out[0].as<T>(), s[r.axis], 0, s[r.axis], false);
  return absl::OkStatus();
}

template <typename T>
absl::Status SliceBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Unary(a, t));
  HAP_ASSIGN_OR_RETURN(SliceRange r, CheckSlice(a, g.x(0)));
  Shape s = g.x(0).shape;
  s[r.axis] = r.end - r.start;
  HAP_RETURN_IF_ERROR(g.Check(t, {s}));
  if (!g.active()) return absl::OkStatus();
  AxisView x = AroundAxis(g.x(0).shape, r.axis);
  CopyAlongAxis<T>(a, x.outer, x.inner, g.dy(0).as<const T>(), s[r.axis], 0,
                   g.dx(0).as<T>(), x.len, r.start, s[r.axis], true);
  return absl::OkStatus();
}

// --- expand -----------------------------------------------------------------------

template <typename T>
absl::Status ExpandForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckUnary(a, t));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, a.out[0].shape));
  const Shape& s = a.out[0].shape;
  if (!BroadcastsTo(a.in[0].shape, s)) {
    return Invalid(a, InLabel(a, 0), " does not broadcast to ", OutLabel(a, 0));
  }
  StridedCopy<T, T>(a.ctx.num_threads, s, a.out[0].as<T>(),
                    ContiguousStrides(s), a.in[0].as<const T>(),
                    BroadcastStrides(a.in[0].shape, s), false);
  return absl::OkStatus();
}

template <typename T>
absl::Status ExpandBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Unary(a, t));
  if (!g.active()) return absl::OkStatus();
  const Shape& s = g.dy(0).shape;
  HAP_RETURN_IF_ERROR(g.Check(t, {s}));
  if (!BroadcastsTo(g.x(0).shape, s)) {
    return Invalid(a, InLabel(a, 0), " does not broadcast to ",
                   InLabel(a, 2));
  }
  StridedCopy<T, T>(a.ctx.num_threads, s, g.dx(0).as<T>(),
                    BroadcastStrides(g.x(0).shape, s), g.dy(0).as<const T>(),
                    ContiguousStrides(s), true);
  return absl::OkStatus();
}

// --- embedding --------------------------------------------------------------------

// ids[...] int, table[rows, d]: the local table holds rows [offset, offset +
// rows) of the vocabulary (kernels.h).
struct EmbeddingDims {
  int64_t n = 0, rows = 0, d = 0, offset = 0;
  Shape y;
};

absl::StatusOr<EmbeddingDims> CheckEmbedding(const KernelArgs& a, DType t) {
  HAP_RETURN_IF_ERROR(CheckIdsInput(a, 0));
  HAP_RETURN_IF_ERROR(CheckInput(a, 1, t));
  if (a.in[1].rank() != 2) return Invalid(a, "table ", InLabel(a, 1), " must have rank 2");
  EmbeddingDims e;
  e.n = a.in[0].num_elements();
  e.rows = a.in[1].shape[0];
  e.d = a.in[1].shape[1];
  e.y = a.in[0].shape;
  e.y.push_back(e.d);
  HAP_ASSIGN_OR_RETURN(e.offset, AttrInt(a, "vocab_offset", 0));
  // Without "vocab_size", a shard at a nonzero offset checks the lower bound
  // only (it cannot know the vocabulary).
  HAP_ASSIGN_OR_RETURN(
      int64_t vocab,
      AttrInt(a, "vocab_size",
              e.offset == 0 ? e.rows : std::numeric_limits<int64_t>::max()));
  if (e.offset < 0 || e.offset + e.rows > vocab) {
    return Invalid(a, "table rows [", e.offset, ", ", e.offset + e.rows,
                   ") do not fit in the vocabulary of ", vocab);
  }
  for (int64_t i = 0; i < e.n; ++i) {
    const int64_t id = IdAt(a.in[0], i);
    if (id < 0 || id >= vocab) {
      return Invalid(a, "id ", id, " at position ", i, " of ", InLabel(a, 0),
                     " is outside the vocabulary [0, ", vocab, ")");
    }
  }
  return e;
}

template <typename T>
absl::Status EmbeddingForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(EmbeddingDims e, CheckEmbedding(a, t));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, e.y));
  const T* table = a.in[1].as<const T>();
  T* y = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, e.n, GrainFor(e.d), [&](int64_t b, int64_t f) {
    for (int64_t i = b; i < f; ++i) {
      const int64_t row = IdAt(a.in[0], i) - e.offset;
      T* yr = y + i * e.d;
      if (row >= 0 && row < e.rows) {
        std::memcpy(yr, table + row * e.d, e.d * sizeof(T));
      } else {
        std::fill(yr, yr + e.d, T(0));
      }
    }
  });
  return absl::OkStatus();
}

template <typename T>
absl::Status EmbeddingBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 2, 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({0}));
  HAP_ASSIGN_OR_RETURN(EmbeddingDims e, CheckEmbedding(a, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {e.y}));
  if (!g.dy(0).present() || !g.dx(1).present()) return absl::OkStatus();
  const T* dy = g.dy(0).as<const T>();
  T* dtable = g.dx(1).as<T>();
  for (int64_t i = 0; i < e.n; ++i) {
    const int64_t row = IdAt(g.x(0), i) - e.offset;
    if (row >= 0 && row < e.rows) AddTo(dtable + row * e.d, dy + i * e.d, e.d);
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterLayoutKernels(KernelTable& t) {
  t["transpose"] = HAP_ANY_KERNEL(TransposeForward);
  t["transpose_grad"] = HAP_FLOAT_KERNEL(TransposeBackward);
  t["reshape"] = HAP_ANY_KERNEL(ReshapeForward);
  t["reshape_grad"] = HAP_FLOAT_KERNEL(ReshapeBackward);
  t["flatten"] = HAP_ANY_KERNEL(ReshapeForward);
  t["flatten_grad"] = HAP_FLOAT_KERNEL(ReshapeBackward);
  t["stop_gradient"] = HAP_ANY_KERNEL(ReshapeForward);  // a copy
  t["stop_gradient_grad"] = HAP_FLOAT_KERNEL(StopGradientBackward);
  t["concat"] = HAP_ANY_KERNEL(ConcatForward);
  t["concat_grad"] = HAP_FLOAT_KERNEL(ConcatBackward);
  t["split"] = HAP_ANY_KERNEL(SplitForward);
  t["split_grad"] = HAP_FLOAT_KERNEL(SplitBackward);
  t["slice"] = HAP_ANY_KERNEL(SliceForward);
  t["slice_grad"] = HAP_FLOAT_KERNEL(SliceBackward);
  t["expand"] = HAP_ANY_KERNEL(ExpandForward);
  t["expand_grad"] = HAP_FLOAT_KERNEL(ExpandBackward);
  t["embedding"] = HAP_FLOAT_KERNEL(EmbeddingForward);
  t["embedding_grad"] = HAP_FLOAT_KERNEL(EmbeddingBackward);
}

}  // namespace hap::executor::cpu
