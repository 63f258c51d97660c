// Convolutions and max / average pooling over NCHW images (conv2d, the 2-D
// pools) and NCDHW volumes (conv3d, max_pool3d, avg_pool3d); adaptive
// average pooling over NCHW images.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {
namespace {

absl::StatusOr<std::pair<int64_t, int64_t>> Pair(const Attrs& a,
                                                 const std::string& name,
                                                 std::vector<int64_t> def,
                                                 int64_t min_value) {
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> v, def.empty()
                                                   ? a.Ints(name)
                                                   : a.Ints(name, def));
  if (v.size() == 1) v.push_back(v[0]);
  if (v.size() != 2 || v[0] < min_value || v[1] < min_value) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attribute '", name, "' must be 1 or 2 integers >= ", min_value));
  }
  return std::make_pair(v[0], v[1]);
}

absl::StatusOr<int64_t> OutSize(int64_t in, int64_t k, int64_t s, int64_t p, const char* what,
                                int64_t d = 1) {
  // Attributes are unbounded: padding or dilation near 2^62 must not
  // overflow. A dilated kernel spans (k - 1) * d + 1.
  if (__builtin_mul_overflow(k - 1, d, &k) || __builtin_add_overflow(k, 1, &k)) {
    return absl::InvalidArgumentError(absl::StrCat("dilation ", d, " is too large"));
  }
  int64_t span;
  if (__builtin_mul_overflow(p, 2, &span) ||
      __builtin_add_overflow(span, in, &span)) {
    return absl::InvalidArgumentError(
        absl::StrCat("padding ", p, " is too large"));
  }
  span -= k;
  if (span < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kernel ", k, " is larger than the padded ", what, " ", in + 2 * p));
  }
  return span / s + 1;
}

// Pooling output size (PyTorch's pooling_output_shape): with ceil_mode the
// last window may hang over the padded input but must start inside the
// input or its left padding.
absl::StatusOr<int64_t> PoolOutSize(int64_t in, int64_t k, int64_t s,
                                    int64_t p, bool ceil_mode,
                                    const char* what) {
  HAP_ASSIGN_OR_RETURN(int64_t out, OutSize(in, k, s, p, what));
  if (ceil_mode && (in + 2 * p - k) % s != 0) {
    ++out;
    if ((out - 1) * s >= in + p) --out;
  }
  return out;
}

// A convolution's window attribute over `spatial` axes: 1 or `spatial`
// integers >= min_value, `fill` on every axis by default.
absl::StatusOr<std::vector<int64_t>> Axes(const Attrs& a, const std::string& name, int spatial,
                                          int64_t fill, int64_t min_value) {
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> v, a.Ints(name, std::vector<int64_t>(spatial, fill)));
  if (v.size() == 1) v.assign(spatial, v[0]);
  bool ok = static_cast<int>(v.size()) == spatial;
  for (int64_t x : v) ok = ok && x >= min_value;
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("attribute '", name, "' must be 1 or ", spatial, " integers >= ", min_value));
  }
  return v;
}

// Shape rule of conv2d (spatial = 2: x [n, c, h, w]) and conv3d (3: x [n,
// c, d, h, w]); the weight is [o, c / groups, kernel...].
absl::StatusOr<std::vector<TensorType>> InferConv(const OpCall& c, int spatial) {
  HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
  HAP_RETURN_IF_ERROR(ExpectRank(c, 0, spatial + 2));
  HAP_RETURN_IF_ERROR(ExpectRank(c, 1, spatial + 2));
  HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, 1));
  HAP_ASSIGN_OR_RETURN(int64_t groups, c.attrs.Int("groups", 1));
  int64_t o = c.shape(1)[0];
  if (groups < 1 || c.shape(0)[1] % groups != 0 || o % groups != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("attribute 'groups' ", groups, " must be positive and divide the ",
                     c.shape(0)[1], " input and ", o, " output channels"));
  }
  if (c.shape(1)[1] * groups != c.shape(0)[1]) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight ", c.Describe(1), " expects ", c.shape(1)[1] * groups,
                     " input channels (", c.shape(1)[1], " per group, ", groups, " groups) but ",
                     c.Describe(0), " has ", c.shape(0)[1]));
  }
  if (c.inputs.size() == 3 && c.shape(2) != Shape{o}) {
    return absl::InvalidArgumentError(
        absl::StrCat("bias ", c.Describe(2), " must have shape [", o, "]"));
  }
  HAP_ASSIGN_OR_RETURN(auto stride, Axes(c.attrs, "stride", spatial, 1, 1));
  HAP_ASSIGN_OR_RETURN(auto pad, Axes(c.attrs, "padding", spatial, 0, 0));
  HAP_ASSIGN_OR_RETURN(auto dil, Axes(c.attrs, "dilation", spatial, 1, 1));
  static const char* const kAxes[] = {"depth", "height", "width"};
  Shape out = {c.shape(0)[0], o};
  for (int a = 0; a < spatial; ++a) {
    HAP_ASSIGN_OR_RETURN(int64_t n, OutSize(c.shape(0)[2 + a], c.shape(1)[2 + a], stride[a], pad[a],
                                            kAxes[a + 3 - spatial], dil[a]));
    out.push_back(n);
  }
  return std::vector<TensorType>{{c.in(0).dtype, out}};
}

// 2 multiply-adds per output and tap of its group's input channels, plus
// the bias.
double ConvFlops(const OpCall& c) {
  double out = static_cast<double>(c.outputs[0].num_elements());
  double k = 1;
  for (size_t i = 1; i < c.shape(1).size(); ++i) k *= static_cast<double>(c.shape(1)[i]);
  return 2.0 * out * k + (c.inputs.size() == 3 ? out : 0);
}

// Shape rule of max_pool2d and avg_pool2d (spatial = 2) and of max_pool3d
// and avg_pool3d (3): kernel, stride (default: the kernel) and padding per
// axis, padding at most half the kernel.
absl::StatusOr<std::vector<TensorType>> InferPool(const OpCall& c, int spatial) {
  HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
  HAP_RETURN_IF_ERROR(ExpectRank(c, 0, spatial + 2));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> k, c.attrs.Ints("kernel"));
  if (k.size() == 1) k.assign(spatial, k[0]);
  bool ok = static_cast<int>(k.size()) == spatial;
  for (int64_t x : k) ok = ok && x >= 1;
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("attribute 'kernel' must be 1 or ", spatial, " integers >= 1"));
  }
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> s, c.attrs.Ints("stride", k));
  if (s.size() == 1) s.assign(spatial, s[0]);
  ok = static_cast<int>(s.size()) == spatial;
  for (int64_t x : s) ok = ok && x >= 1;
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("attribute 'stride' must be 1 or ", spatial, " integers >= 1"));
  }
  HAP_ASSIGN_OR_RETURN(auto p, Axes(c.attrs, "padding", spatial, 0, 0));
  HAP_ASSIGN_OR_RETURN(bool ceil_mode, c.attrs.Bool("ceil_mode", false));
  static const char* const kAxes[] = {"depth", "height", "width"};
  Shape out = {c.shape(0)[0], c.shape(0)[1]};
  for (int a = 0; a < spatial; ++a) {
    if (p[a] > k[a] / 2)
      return absl::InvalidArgumentError("padding must be at most half the kernel");
    HAP_ASSIGN_OR_RETURN(int64_t n, PoolOutSize(c.shape(0)[2 + a], k[a], s[a], p[a], ceil_mode,
                                                kAxes[a + 3 - spatial]));
    out.push_back(n);
  }
  return std::vector<TensorType>{{c.in(0).dtype, out}};
}

// Elements of a pooling window over `spatial` axes; `infer` accepted the
// kernel (1 or `spatial` positive integers).
double WindowElements(const OpCall& c, int spatial) {
  auto k = c.attrs.Ints("kernel").value();
  double n = 1;
  for (int a = 0; a < spatial; ++a) n *= static_cast<double>(k.size() == 1 ? k[0] : k[a]);
  return n;
}

}  // namespace

void RegisterConvolutionOps(OpRegistry& r) {
  {
    OpDef d;
    d.type = "conv2d";
    d.attrs = {"stride", "padding", "dilation", "groups"};
    d.summary =
        "conv2d(x[n, c, h, w], w[o, c/groups, kh, kw], b[o]?; stride=[1,1], "
        "padding=[0,0], dilation=[1,1], groups=1) -> [n, o, h', w'] (tap "
        "(i, j) reads x[oy*sh - ph + i*dh][ox*sw - pw + j*dw]; groups > 1: "
        "output channels of group g read input channels of group g; groups "
        "= c: depthwise)";
    d.min_inputs = 2;
    d.max_inputs = 3;
    d.infer = [](const OpCall& c) { return InferConv(c, 2); };
    d.flops = ConvFlops;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "conv3d";
    d.attrs = {"stride", "padding", "dilation", "groups"};
    d.summary =
        "conv3d(x[n, c, d, h, w], w[o, c/groups, kt, kh, kw], b[o]?; "
        "stride=[1,1,1], padding=[0,0,0], dilation=[1,1,1], groups=1) -> "
        "[n, o, d', h', w'] (tap (t, i, j) reads x[oz*sd - pd + t*dd][oy*sh - "
        "ph + i*dh][ox*sw - pw + j*dw]; groups as conv2d's)";
    d.min_inputs = 2;
    d.max_inputs = 3;
    d.infer = [](const OpCall& c) { return InferConv(c, 3); };
    d.flops = ConvFlops;
    r.Register(std::move(d));
  }
  for (int spatial : {2, 3}) {
    const std::string dims = spatial == 3 ? "d, h, w" : "h, w";
    const std::string out_dims = spatial == 3 ? "d', h', w'" : "h', w'";
    const std::string zeros = spatial == 3 ? "[0,0,0]" : "[0,0]";
    {
      OpDef d;
      d.type = absl::StrCat("max_pool", spatial, "d");
      d.attrs = {"kernel", "stride", "padding", "ceil_mode"};
      d.summary =
          absl::StrCat(d.type, "(x[n, c, ", dims, "]; kernel, stride=kernel, padding=", zeros,
                       ", ceil_mode=false) -> [n, c, ", out_dims, "] (PyTorch's output size)");
      d.infer = [spatial](const OpCall& c) { return InferPool(c, spatial); };
      d.flops = [spatial](const OpCall& c) {
        return WindowElements(c, spatial) * static_cast<double>(c.outputs[0].num_elements());
      };
      d.backward_flops_multiple = 1.0;
      r.Register(std::move(d));
    }
    {
      OpDef d;
      d.type = absl::StrCat("avg_pool", spatial, "d");
      d.attrs = {"kernel", "stride", "padding", "ceil_mode", "count_include_pad"};
      d.summary =
          absl::StrCat(d.type, "(x[n, c, ", dims, "]; kernel, stride=kernel, padding=", zeros,
                       ", ceil_mode=false, count_include_pad=true) -> [n, c, ", out_dims,
                       "] (PyTorch's windows and divisors)");
      d.infer = [spatial](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
        HAP_RETURN_IF_ERROR(c.attrs.Bool("count_include_pad", true).status());
        return InferPool(c, spatial);
      };
      d.flops = [spatial](const OpCall& c) {
        return WindowElements(c, spatial) * static_cast<double>(c.outputs[0].num_elements());
      };
      d.backward_flops_multiple = 1.0;
      r.Register(std::move(d));
    }
  }
  {
    OpDef d;
    d.type = "adaptive_avg_pool2d";
    d.attrs = {"output_size"};
    d.summary =
        "adaptive_avg_pool2d(x[n, c, h, w]; output_size) -> [n, c, oh, ow] "
        "(PyTorch's window rule)";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 4));
      HAP_ASSIGN_OR_RETURN(auto o, Pair(c.attrs, "output_size", {}, 1));
      return std::vector<TensorType>{
          {c.in(0).dtype, {c.shape(0)[0], c.shape(0)[1], o.first, o.second}}};
    };
    d.flops = [](const OpCall& c) {
      return static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
}

}  // namespace hap::graph::internal
