#include "executor/cuda/cuda_device.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <random>

#include "common/status_matchers.h"
#include "executor/cpu/kernels.h"
#include "executor/runtime/device.h"
#include "executor/runtime/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// No GPU needed: the table is built without touching the device.
TEST(CudaKernelNamesTest, SameKernelsAsTheCpu) {
  const std::vector<std::string> cuda = CudaKernelNames();
  const std::vector<std::string> cpu = CpuKernelNames();
  std::vector<std::string> missing, extra;
  std::set_difference(cpu.begin(), cpu.end(), cuda.begin(), cuda.end(),
                      std::back_inserter(missing));
  std::set_difference(cuda.begin(), cuda.end(), cpu.begin(), cpu.end(),
                      std::back_inserter(extra));
  EXPECT_THAT(missing, ::testing::IsEmpty()) << "CPU kernels without CUDA ones";
  EXPECT_THAT(extra, ::testing::IsEmpty()) << "CUDA kernels the CPU lacks";
}

TEST(CudaAvailableTest, OkOrUnavailableWithAReason) {
  absl::Status s = CudaAvailable();
  if (!s.ok()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
    EXPECT_FALSE(s.message().empty());
    EXPECT_THAT(NewCudaDevice(0), StatusIs(absl::StatusCode::kUnavailable,
                                           HasSubstr(std::string(s.message()))));
  }
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status s = CudaAvailable();
    if (!s.ok()) GTEST_SKIP() << "no GPU: " << s.message();
    auto d = NewCudaDevice(0);
    ASSERT_THAT(d, IsOk());
    device_ = std::move(*d);
  }

  // A device buffer holding `h`.
  TensorView Upload(const HostTensor& h) {
    TensorView v{h.dtype(), h.shape(), nullptr};
    auto p = device_->Allocate(std::max<int64_t>(v.bytes(), 1));
    EXPECT_THAT(p, IsOk());
    v.data = p.ok() ? *p : nullptr;
    owned_.push_back(v.data);
    EXPECT_THAT(device_->CopyFromHost(h.data(), v), IsOk());
    return v;
  }
  HostTensor Download(const TensorView& v) {
    HostTensor h(v.dtype, v.shape);
    EXPECT_THAT(device_->CopyToHost(v, h.data()), IsOk());
    return h;
  }
  void TearDown() override {
    if (device_ == nullptr) return;
    for (void* p : owned_) device_->Free(p);
  }

  std::unique_ptr<Device> device_;
  std::vector<void*> owned_;
};

HostTensor Iota(DType t, Shape s) {
  HostTensor h(t, std::move(s));
  const int64_t n = h.num_elements();
  for (int64_t i = 0; i < n; ++i) {
    switch (t) {
      case DType::kFloat32:
        h.as<float>()[i] = 0.5f * static_cast<float>(i) - 3;
        break;
      case DType::kFloat64:
        h.as<double>()[i] = 0.25 * static_cast<double>(i) - 7;
        break;
      case DType::kInt32:
        h.as<int32_t>()[i] = static_cast<int32_t>(i * 3 - 5);
        break;
      case DType::kInt64:
        h.as<int64_t>()[i] = (int64_t{1} << 40) + i;
        break;
      default:  // 2-byte types: raw bit patterns
        reinterpret_cast<uint16_t*>(h.data())[i] = static_cast<uint16_t>(i * 7);
    }
  }
  return h;
}

bool SameBytes(const HostTensor& a, const HostTensor& b) {
  const int64_t n = a.num_elements() * graph::DTypeBytes(a.dtype());
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), n) == 0;
}

TEST_F(CudaDeviceTest, NameStreamAndOrdinal) {
  EXPECT_EQ(device_->name(), "cuda:0");
  EXPECT_NE(CudaComputeStream(*device_), nullptr);
  EXPECT_EQ(CudaOrdinal(*device_), 0);
  EXPECT_THAT(NewCudaDevice(1 << 20),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("out of range")));
}

TEST_F(CudaDeviceTest, CopiesRoundTripEveryDtype) {
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kInt32,
                  DType::kInt64, DType::kFloat16}) {
    for (Shape s : {Shape{}, Shape{1}, Shape{1023}, Shape{3, 5, 7}}) {
      HostTensor h = Iota(t, s);
      EXPECT_TRUE(SameBytes(Download(Upload(h)), h))
          << graph::DTypeName(t) << graph::ShapeString(s);
    }
  }
}

TEST_F(CudaDeviceTest, AllocatorReusesFreedMemory) {
  auto a = device_->Allocate(1000);
  ASSERT_THAT(a, IsOk());
  device_->Free(*a);
  auto b = device_->Allocate(1000);
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*b) % 64, 0u);
  device_->Free(*b);
  auto z = device_->Allocate(0);
  ASSERT_THAT(z, IsOk());
  EXPECT_NE(*z, nullptr);
  device_->Free(*z);
}

TEST_F(CudaDeviceTest, MemoryLimitIsResourceExhaustedNamingTheBytes) {
  CudaDeviceOptions o;
  o.memory_limit_bytes = 8 << 20;
  auto d = NewCudaDevice(0, o);
  ASSERT_THAT(d, IsOk());
  auto a = (*d)->Allocate(6 << 20);
  ASSERT_THAT(a, IsOk());
  EXPECT_THAT((*d)->Allocate(4 << 20),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("cuda:0"), HasSubstr("4194304 bytes"),
                             HasSubstr("6291456 bytes held"),
                             HasSubstr("limit 8388608"))));
  (*d)->Free(*a);
  // The freed block is cached; a different size class still fits after the
  // cache is released.
  auto b = (*d)->Allocate(7 << 20);
  EXPECT_THAT(b, IsOk());
  if (b.ok()) (*d)->Free(*b);
}

TEST_F(CudaDeviceTest, MoreThanTheGpuHasIsResourceExhausted) {
  EXPECT_THAT(device_->Allocate(int64_t{1} << 50),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("bytes held")));
  // The device still works afterwards.
  HostTensor h = Iota(DType::kFloat32, {17});
  EXPECT_TRUE(SameBytes(Download(Upload(h)), h));
}

TEST_F(CudaDeviceTest, FillEveryDtype) {
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kInt32,
                  DType::kInt64}) {
    for (double value : {0.0, 2.0, -3.0}) {
      TensorView v = Upload(Iota(t, {5, 301}));
      ASSERT_THAT(device_->Fill(v, value), IsOk());
      HostTensor got = Download(v);
      for (int64_t i = 0; i < got.num_elements(); ++i) {
        double g = 0;
        switch (t) {
          case DType::kFloat32:
            g = got.as<float>()[i];
            break;
          case DType::kFloat64:
            g = got.as<double>()[i];
            break;
          case DType::kInt32:
            g = got.as<int32_t>()[i];
            break;
          default:
            g = static_cast<double>(got.as<int64_t>()[i]);
        }
        ASSERT_EQ(g, value) << graph::DTypeName(t) << " element " << i;
      }
    }
  }
  TensorView half = Upload(Iota(DType::kFloat16, {8}));
  EXPECT_THAT(device_->Fill(half, 0), IsOk());
  EXPECT_THAT(device_->Fill(half, 1),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("f16")));
}

// CopyBox against HostCopyBox on the same data.
void ExpectCopyBoxMatchesHost(Device& device, DType dtype,
                              Shape src_shape, Shape dst_shape,
                              std::vector<int64_t> src_start,
                              std::vector<int64_t> dst_start,
                              std::vector<int64_t> extent) {
  HostTensor src = Iota(dtype, src_shape);
  HostTensor dst(dtype, dst_shape);  // zeros
  HostTensor want(dtype, dst_shape);
  ASSERT_THAT(HostCopyBox(src.view(), src_start, want.view(), dst_start,
                          extent),
              IsOk());
  std::vector<void*> owned;
  auto up = [&](const HostTensor& h) {
    TensorView v{h.dtype(), h.shape(), nullptr};
    auto p = device.Allocate(std::max<int64_t>(v.bytes(), 1));
    EXPECT_THAT(p, IsOk());
    v.data = *p;
    owned.push_back(*p);
    EXPECT_THAT(device.CopyFromHost(h.data(), v), IsOk());
    return v;
  };
  TensorView s = up(src), d = up(dst);
  ASSERT_THAT(device.CopyBox(s, src_start, d, dst_start, extent), IsOk());
  HostTensor got(dtype, dst_shape);
  ASSERT_THAT(device.CopyToHost(d, got.data()), IsOk());
  EXPECT_TRUE(SameBytes(got, want))
      << graph::DTypeName(dtype) << " " << graph::ShapeString(src_shape)
      << " -> " << graph::ShapeString(dst_shape);
  for (void* p : owned) device.Free(p);
}

TEST_F(CudaDeviceTest, CopyBoxMatchesTheHost) {
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kInt64,
                  DType::kFloat16}) {
    // A strided box inside both.
    ExpectCopyBoxMatchesHost(*device_, t, {4, 5, 6}, {3, 7, 6},
                             {1, 0, 2}, {0, 2, 1}, {3, 4, 3});
    // Whole rows: contiguous runs merged into wide units.
    ExpectCopyBoxMatchesHost(*device_, t, {8, 64}, {5, 64}, {2, 0},
                             {1, 0}, {4, 64});
    // Everything, and a column.
    ExpectCopyBoxMatchesHost(*device_, t, {33, 17}, {33, 17}, {0, 0},
                             {0, 0}, {33, 17});
    ExpectCopyBoxMatchesHost(*device_, t, {33, 17}, {40, 3}, {0, 5},
                             {7, 2}, {33, 1});
    // Rank 0 and an empty box.
    ExpectCopyBoxMatchesHost(*device_, t, {}, {}, {}, {}, {});
    ExpectCopyBoxMatchesHost(*device_, t, {4, 5}, {4, 5}, {1, 1},
                             {0, 0}, {0, 3});
  }
  // Many dimensions (beyond what merging removes).
  ExpectCopyBoxMatchesHost(*device_, DType::kFloat32,
                           {2, 3, 2, 3, 2, 3, 2, 5}, {3, 3, 3, 3, 3, 3, 3, 6},
                           {0, 1, 0, 1, 0, 1, 0, 1}, {1, 0, 1, 0, 1, 0, 1, 0},
                           {2, 2, 2, 2, 2, 2, 2, 4});
}

TEST_F(CudaDeviceTest, CopyBoxOutOfRangeIsInvalidArgument) {
  TensorView a = Upload(Iota(DType::kFloat32, {4, 4}));
  TensorView b = Upload(Iota(DType::kFloat32, {4, 4}));
  EXPECT_THAT(device_->CopyBox(a, {2, 0}, b, {0, 0}, {3, 4}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dimension 0 out of range")));
  TensorView c = Upload(Iota(DType::kFloat64, {4, 4}));
  EXPECT_THAT(device_->CopyBox(a, {0, 0}, c, {0, 0}, {1, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dtypes differ")));
}

TEST_F(CudaDeviceTest, UnknownKernelIsNotFound) {
  EXPECT_FALSE(device_->HasKernel("no_such_kernel"));
  EXPECT_TRUE(device_->HasKernel("matmul"));
  EXPECT_THAT(device_->RunKernel("no_such_kernel", {}, {}, {}, {}),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("no_such_kernel")));
}

TEST_F(CudaDeviceTest, TargetOutOfRangeFailsTheNextSynchronizeNamingTheKernel) {
  HostTensor x = Iota(DType::kFloat32, {3, 4});
  HostTensor target(DType::kInt64, {3});
  target.as<int64_t>()[0] = 1;
  target.as<int64_t>()[1] = 4;  // out of [0, 4)
  target.as<int64_t>()[2] = 0;
  TensorView in[] = {Upload(x), Upload(target)};
  TensorView out[] = {Upload(HostTensor(DType::kFloat32, {}))};
  ASSERT_THAT(device_->RunKernel("copy", {}, {}, {in[0]}, {Upload(x)}), IsOk());
  ASSERT_THAT(device_->RunKernel("nll_loss", {}, {}, in, out), IsOk());
  EXPECT_THAT(device_->Synchronize(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'nll_loss'"), HasSubstr("cuda:0"),
                             HasSubstr("out of range"))));
  EXPECT_THAT(device_->Synchronize(), IsOk());  // reported once
  target.as<int64_t>()[1] = 3;
  TensorView good[] = {in[0], Upload(target)};
  ASSERT_THAT(device_->RunKernel("nll_loss", {}, {}, good, out), IsOk());
  EXPECT_THAT(device_->Synchronize(), IsOk());
}

TEST(CudaAccessorsTest, OtherDevicesHaveNoStreamOrOrdinal) {
  // A Device that is not CUDA's: the accessors say so.
  class Other : public Device {
   public:
    std::string name() const override { return "other"; }
    absl::StatusOr<void*> Allocate(int64_t) override { return nullptr; }
    void Free(void*) override {}
    absl::Status CopyFromHost(const void*, TensorView) override {
      return absl::OkStatus();
    }
    absl::Status CopyToHost(TensorView, void*) override {
      return absl::OkStatus();
    }
    absl::Status Fill(TensorView, double) override { return absl::OkStatus(); }
    absl::Status CopyBox(TensorView, absl::Span<const int64_t>, TensorView,
                         absl::Span<const int64_t>,
                         absl::Span<const int64_t>) override {
      return absl::OkStatus();
    }
    bool HasKernel(const std::string&) const override { return false; }
    absl::Status RunKernel(const std::string&, const KernelContext&,
                           const graph::Attrs&, absl::Span<const TensorView>,
                           absl::Span<const TensorView>) override {
      return absl::OkStatus();
    }
    absl::Status Synchronize() override { return absl::OkStatus(); }
  } other;
  EXPECT_EQ(CudaComputeStream(other), nullptr);
  EXPECT_EQ(CudaOrdinal(other), -1);
}

}  // namespace
}  // namespace hap::executor
