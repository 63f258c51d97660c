#include "executor/cuda/kernel_compare.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "executor/cpu/cpu_device.h"

namespace hap::executor {
namespace {

double At(const HostTensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kFloat32:
      return t.as<float>()[i];
    case DType::kFloat64:
      return t.as<double>()[i];
    case DType::kInt32:
      return t.as<int32_t>()[i];
    case DType::kInt64:
      return static_cast<double>(t.as<int64_t>()[i]);
    default:
      return NAN;
  }
}

int64_t Count(const HostTensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  return n;
}

bool Present(const std::vector<bool>& flags, size_t i) {
  return flags.empty() || flags[i];
}

// What a kernel call left: its outputs, and its inputs (which some kernels
// change in place: batch norm's running statistics).
struct After {
  std::vector<HostTensor> outputs, inputs;
};

// Copies the present tensors of `views` back to the host (absent ones stay
// empty-shaped as they were).
absl::Status Download(Device& device, const std::vector<TensorView>& views,
                      std::vector<HostTensor>* out) {
  for (const TensorView& v : views) {
    HostTensor h(v.dtype, v.shape);
    if (v.present()) HAP_RETURN_IF_ERROR(device.CopyToHost(v, h.data()));
    out->push_back(std::move(h));
  }
  return absl::OkStatus();
}

// Runs the case on `device`; returns what it left, copied back to the host.
absl::StatusOr<After> RunOn(Device& device, const KernelCase& c) {
  std::vector<void*> owned;
  auto release = [&] {
    for (void* p : owned) device.Free(p);
  };
  auto upload = [&](const HostTensor& h, bool present,
                    TensorView* v) -> absl::Status {
    *v = TensorView{h.dtype(), h.shape(), nullptr};
    if (!present) return absl::OkStatus();
    auto p = device.Allocate(std::max<int64_t>(v->bytes(), 1));
    if (!p.ok()) return p.status();
    owned.push_back(*p);
    v->data = *p;
    return device.CopyFromHost(h.data(), *v);
  };
  std::vector<TensorView> in(c.inputs.size()), out(c.outputs.size());
  absl::Status s;
  for (size_t i = 0; s.ok() && i < in.size(); ++i) {
    s = upload(c.inputs[i], Present(c.input_present, i), &in[i]);
  }
  for (size_t i = 0; s.ok() && i < out.size(); ++i) {
    s = upload(c.outputs[i], Present(c.output_present, i), &out[i]);
  }
  if (s.ok()) s = device.RunKernel(c.kernel, c.ctx, c.attrs, in, out);
  if (s.ok()) s = device.Synchronize();
  After result;
  if (s.ok()) s = Download(device, out, &result.outputs);
  if (s.ok()) s = Download(device, in, &result.inputs);
  release();
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("on ", device.name(), ": ",
                                               s.message()));
  }
  return result;
}

// OK when `got` agrees with `want` within the case's tolerances.
absl::Status CompareTensor(const KernelCase& c, const std::string& what, const HostTensor& want,
                           const HostTensor& got) {
  const int64_t n = Count(want);
  double scale = 0;
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(At(want, i)));
  double worst = 0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::fabs(At(got, i) - At(want, i));
    const double bound = c.atol + c.rtol * std::max(std::fabs(At(want, i)), scale);
    if (!(err <= bound) && (worst_i < 0 || !(err <= worst))) {
      worst = err;
      worst_i = i;
    }
  }
  if (worst_i < 0) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("kernel '", c.kernel, "' ", what, " differs from the CPU: element ", worst_i,
                   " got ", At(got, worst_i), " want ", At(want, worst_i), " (|error| ", worst,
                   ", rtol ", c.rtol, ", atol ", c.atol, ", scale ", scale, ")"));
}

}  // namespace

absl::Status CompareWithCpu(Device& device, const KernelCase& c) {
  std::unique_ptr<Device> cpu = NewCpuDevice(1);
  auto want = RunOn(*cpu, c);
  if (!want.ok()) return want.status();
  auto got = RunOn(device, c);
  if (!got.ok()) return got.status();
  for (size_t o = 0; o < want->outputs.size(); ++o) {
    if (!Present(c.output_present, o)) continue;
    HAP_RETURN_IF_ERROR(
        CompareTensor(c, absl::StrCat("output ", o), want->outputs[o], got->outputs[o]));
  }
  // Inputs a kernel changes in place (running statistics) must agree too;
  // the others are unchanged on both.
  for (size_t i = 0; i < want->inputs.size(); ++i) {
    if (!Present(c.input_present, i)) continue;
    HAP_RETURN_IF_ERROR(CompareTensor(c, absl::StrCat("input ", i, " (after the call)"),
                                      want->inputs[i], got->inputs[i]));
  }
  return absl::OkStatus();
}

HostTensor RandomTensor(DType dtype, Shape shape, double lo, double hi,
                        uint64_t seed) {
  HostTensor t(dtype, std::move(shape));
  std::mt19937_64 rng(seed);
  const int64_t n = Count(t);
  for (int64_t i = 0; i < n; ++i) {
    const double u = std::uniform_real_distribution<double>(lo, hi)(rng);
    switch (dtype) {
      case DType::kFloat32:
        t.as<float>()[i] = static_cast<float>(u);
        break;
      case DType::kFloat64:
        t.as<double>()[i] = u;
        break;
      case DType::kInt32:
        t.as<int32_t>()[i] = static_cast<int32_t>(std::floor(u));
        break;
      case DType::kInt64:
        t.as<int64_t>()[i] = static_cast<int64_t>(std::floor(u));
        break;
      default:
        break;
    }
  }
  return t;
}

}  // namespace hap::executor
