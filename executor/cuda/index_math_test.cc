// The host-side index math of the CUDA kernels, checked without a GPU: the
// spaces MakeSpace/MakeReduceSpace build, walked with the very functions the
// kernels use (SpaceOffsets, ReducedSum, BoxOffsets), against direct
// multi-index loops and HostCopyBox, on random shapes.
#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "executor/cpu/kernels.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/cuda/box_copy.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/launch_elementwise.h"
#include "executor/runtime/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor::cuda {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

class NoScratch : public Scratch {
 public:
  absl::StatusOr<void*> Get(int64_t) override {
    return absl::UnimplementedError("no scratch");
  }
};

struct Call {
  std::string name = "test_kernel";
  KernelContext ctx;
  graph::Attrs attrs;
  NoScratch scratch;
  KernelArgs args() {
    return KernelArgs{name, ctx, attrs, {}, {}, nullptr, nullptr, false,
                      scratch};
  }
};

int64_t Count(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Offset of multi-index `idx` with `strides`.
int64_t Dot(const std::vector<int64_t>& idx, const std::vector<int64_t>& st) {
  int64_t o = 0;
  for (size_t d = 0; d < idx.size(); ++d) o += idx[d] * st[d];
  return o;
}

std::vector<int64_t> Unflatten(int64_t i, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (int d = static_cast<int>(s.size()) - 1; d >= 0; --d) {
    idx[d] = i % s[d];
    i /= s[d];
  }
  return idx;
}

// A random shape of rank [1, max_rank] with extents in [1, 5], and a random
// shape that broadcasts to it (dropped leading dims, ones).
Shape RandomShape(std::mt19937& rng, int max_rank) {
  const int rank = std::uniform_int_distribution<int>(1, max_rank)(rng);
  Shape s(rank);
  for (int64_t& d : s) d = std::uniform_int_distribution<int>(1, 5)(rng);
  return s;
}
Shape BroadcastingTo(std::mt19937& rng, const Shape& big) {
  const int drop = std::uniform_int_distribution<int>(
      0, static_cast<int>(big.size()))(rng);
  Shape s(big.begin() + drop, big.end());
  for (int64_t& d : s) {
    if (std::uniform_int_distribution<int>(0, 2)(rng) == 0) d = 1;
  }
  return s;
}

TEST(IndexMathTest, SpaceOffsetsMatchDirectIndexing) {
  std::mt19937 rng(7);
  Call call;
  for (int trial = 0; trial < 500; ++trial) {
    const Shape s = RandomShape(rng, 7);
    const Shape p = BroadcastingTo(rng, s), q = BroadcastingTo(rng, s);
    const std::vector<std::vector<int64_t>> strides = {
        cpu::ContiguousStrides(s), cpu::BroadcastStrides(p, s),
        cpu::BroadcastStrides(q, s)};
    auto space = MakeSpace(call.args(), s, strides);
    ASSERT_THAT(space, IsOk());
    ASSERT_EQ(space->count, Count(s));
    for (int64_t i = 0; i < space->count; ++i) {
      int64_t off[3];
      SpaceOffsets<3>(*space, i, off);
      const std::vector<int64_t> idx = Unflatten(i, s);
      for (int k = 0; k < 3; ++k) {
        ASSERT_EQ(off[k], Dot(idx, strides[k]))
            << "trial " << trial << " element " << i << " operand " << k
            << " shape " << graph::ShapeString(s);
      }
    }
  }
}

TEST(IndexMathTest, TooManyDimensionsIsInvalidArgument) {
  Call call;
  const Shape s = {2, 2, 2, 2, 2, 2, 2, 2, 2};
  // Operand 1's strides grow inwards, so no neighbours merge.
  std::vector<int64_t> odd(9);
  for (int d = 0; d < 9; ++d) odd[d] = int64_t{1} << d;
  EXPECT_THAT(MakeSpace(call.args(), s, {cpu::ContiguousStrides(s), odd}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("test_kernel")));
}

// out[o] = sum over the reduced dims of a * b, directly.
std::vector<double> DirectReduce(const Shape& s, const std::vector<bool>& red,
                                 const std::vector<double>& a,
                                 const std::vector<int64_t>& a_st,
                                 const std::vector<double>* b,
                                 const std::vector<int64_t>& b_st) {
  Shape kept;
  for (size_t d = 0; d < s.size(); ++d) {
    if (!red[d]) kept.push_back(s[d]);
  }
  std::vector<double> out(Count(kept), 0.0);
  const std::vector<int64_t> ks = cpu::ContiguousStrides(kept);
  for (int64_t i = 0; i < Count(s); ++i) {
    const std::vector<int64_t> idx = Unflatten(i, s);
    int64_t o = 0;
    for (size_t d = 0, k = 0; d < s.size(); ++d) {
      if (!red[d]) o += idx[d] * ks[k++];
    }
    double v = a[Dot(idx, a_st)];
    if (b != nullptr) v *= (*b)[Dot(idx, b_st)];
    out[o] += v;
  }
  return out;
}

TEST(IndexMathTest, ReductionsMatchDirectSums) {
  std::mt19937 rng(11);
  Call call;
  for (int trial = 0; trial < 400; ++trial) {
    const Shape s = RandomShape(rng, 6);
    std::vector<bool> red(s.size());
    Shape kept;
    for (size_t d = 0; d < s.size(); ++d) {
      red[d] = std::uniform_int_distribution<int>(0, 1)(rng) == 1;
      if (!red[d]) kept.push_back(s[d]);
    }
    const std::vector<int64_t> ks = cpu::ContiguousStrides(kept);
    std::vector<int64_t> out_st;
    for (size_t d = 0, k = 0; d < s.size(); ++d) {
      out_st.push_back(red[d] ? 0 : ks[k++]);
    }
    // a: x itself (contiguous) or broadcast; b: a broadcast operand or none.
    const bool with_b = trial % 2 == 1;
    const Shape as = trial % 3 == 0 ? BroadcastingTo(rng, s) : s;
    const Shape bs = BroadcastingTo(rng, s);
    std::vector<double> a(Count(as)), b(Count(bs));
    for (double& v : a) v = std::uniform_real_distribution<double>(-1, 1)(rng);
    for (double& v : b) v = std::uniform_real_distribution<double>(-1, 1)(rng);
    const std::vector<int64_t> a_st = cpu::BroadcastStrides(as, s);
    const std::vector<int64_t> b_st = cpu::BroadcastStrides(bs, s);
    const std::vector<double> want =
        DirectReduce(s, red, a, a_st, with_b ? &b : nullptr, b_st);
    auto space = MakeReduceSpace(call.args(), s, out_st, a_st,
                                 with_b ? b_st : std::vector<int64_t>{});
    ASSERT_THAT(space, IsOk());
    ASSERT_EQ(space->kept.count, static_cast<int64_t>(want.size()));
    for (int64_t o = 0; o < space->kept.count; ++o) {
      int64_t base[3];
      SpaceOffsets<3>(space->kept, o, base);
      // The thread-per-output kernel's sum.
      const double thread_sum =
          ReducedSum(*space, a.data(), with_b ? b.data() : nullptr, base);
      // The block-per-output kernel's terms, summed in order.
      double block_sum = 0;
      for (int64_t k = 0; k < space->reduced.count; ++k) {
        int64_t off[3];
        SpaceOffsets<3>(space->reduced, k, off);
        double v = a[base[1] + off[1]];
        if (with_b) v *= b[base[2] + off[2]];
        block_sum += v;
      }
      ASSERT_LT(base[0], static_cast<int64_t>(want.size()));
      const double w = want[base[0]];
      ASSERT_NEAR(thread_sum, w, 1e-12)
          << "trial " << trial << " output " << o << " shape "
          << graph::ShapeString(s);
      ASSERT_NEAR(block_sum, w, 1e-12) << "trial " << trial;
    }
  }
}

// Long reductions over few outputs, split into chunks (SplitFor) and
// combined in chunk order as the two-stage kernels do.
TEST(IndexMathTest, SplitReductionsMatchDirectSums) {
  std::mt19937 rng(3);
  Call call;
  struct C {
    Shape s;
    std::vector<bool> red;
    bool with_b;
  };
  const std::vector<C> cases = {{{3, 70000}, {false, true}, false},
                                {{100000}, {true}, true},
                                {{5, 40000, 2}, {false, true, false}, true},
                                {{2, 300, 3, 250}, {true, false, true, true}, false},
                                {{1025, 70}, {false, true}, false}};
  for (const C& c : cases) {
    Shape kept;
    for (size_t d = 0; d < c.s.size(); ++d) {
      if (!c.red[d]) kept.push_back(c.s[d]);
    }
    const std::vector<int64_t> ks = cpu::ContiguousStrides(kept);
    std::vector<int64_t> out_st;
    for (size_t d = 0, k = 0; d < c.s.size(); ++d) {
      out_st.push_back(c.red[d] ? 0 : ks[k++]);
    }
    std::vector<double> a(Count(c.s)), b(Count(c.s));
    for (double& v : a) v = std::uniform_real_distribution<double>(-1, 1)(rng);
    for (double& v : b) v = std::uniform_real_distribution<double>(-1, 1)(rng);
    const std::vector<int64_t> st = cpu::ContiguousStrides(c.s);
    const std::vector<double> want =
        DirectReduce(c.s, c.red, a, st, c.with_b ? &b : nullptr, st);
    auto space = MakeReduceSpace(call.args(), c.s, out_st, st,
                                 c.with_b ? st : std::vector<int64_t>{});
    ASSERT_THAT(space, IsOk());
    const ReduceSplit split = SplitFor(*space);
    const int64_t outs = space->kept.count, k = space->reduced.count;
    if (outs > kSplitMaxOutputs || k < kSplitMinReduced) {
      EXPECT_EQ(split.chunks, 1);
      EXPECT_EQ(ReduceScratchDoubles(*space), 0);
      continue;
    }
    ASSERT_GT(split.chunks, 1) << graph::ShapeString(c.s);
    EXPECT_GE(split.chunks * split.chunk_len, k);
    EXPECT_LT((split.chunks - 1) * split.chunk_len, k);  // no empty chunk
    EXPECT_LE(split.chunks * outs, kSplitMaxPartials);
    EXPECT_EQ(ReduceScratchDoubles(*space), split.chunks * outs);
    std::vector<double> partial(split.chunks * outs, 0.0);
    for (int64_t o = 0; o < outs; ++o) {  // stage 1
      int64_t base[3];
      SpaceOffsets<3>(space->kept, o, base);
      for (int64_t ch = 0; ch < split.chunks; ++ch) {
        const int64_t k0 = ch * split.chunk_len;
        const int64_t k1 = std::min(k, k0 + split.chunk_len);
        for (int64_t kk = k0; kk < k1; ++kk) {
          int64_t off[3];
          SpaceOffsets<3>(space->reduced, kk, off);
          double v = a[base[1] + off[1]];
          if (c.with_b) v *= b[base[2] + off[2]];
          partial[o * split.chunks + ch] += v;
        }
      }
    }
    for (int64_t o = 0; o < outs; ++o) {  // stage 2
      int64_t base[3];
      SpaceOffsets<3>(space->kept, o, base);
      double acc = 0;
      for (int64_t ch = 0; ch < split.chunks; ++ch) {
        acc += partial[o * split.chunks + ch];
      }
      ASSERT_NEAR(acc, want[base[0]], 1e-9) << graph::ShapeString(c.s);
    }
  }
}

// The box copy as the kernel does it (BoxOffsets, unit-sized moves) on host
// memory, against HostCopyBox.
void ExpectPlannedCopyMatches(DType t, const Shape& src_shape,
                              const Shape& dst_shape,
                              const std::vector<int64_t>& src_start,
                              const std::vector<int64_t>& dst_start,
                              const std::vector<int64_t>& extent,
                              int misalign) {
  const int64_t es = graph::DTypeBytes(t);
  std::vector<unsigned char> sbuf(Count(src_shape) * es), dbuf(Count(dst_shape) * es);
  for (size_t i = 0; i < sbuf.size(); ++i) {
    sbuf[i] = static_cast<unsigned char>(i * 31 + 7);
  }
  // Views at an offset from 64-byte aligned storage (misaligned starts).
  auto aligned = [](std::vector<unsigned char>& v) {
    auto p = reinterpret_cast<uintptr_t>(v.data());
    return v.data() + ((64 - p % 64) % 64);
  };
  std::vector<unsigned char> sstore(sbuf.size() + 128), dstore(dbuf.size() + 128),
      wstore(dbuf.size() + 128);
  unsigned char* sp = aligned(sstore) + misalign;
  unsigned char* dp = aligned(dstore) + misalign;
  unsigned char* wp = aligned(wstore) + misalign;
  std::memcpy(sp, sbuf.data(), Count(src_shape) * es);
  TensorView src{t, src_shape, sp}, dst{t, dst_shape, dp}, wv{t, dst_shape, wp};
  ASSERT_THAT(HostCopyBox(src, src_start, wv, dst_start, extent), IsOk());
  auto plan = PlanBoxCopy(src, src_start, dst, dst_start, extent);
  ASSERT_THAT(plan, IsOk());
  if (!plan->empty) {
    const BoxCopy& box = plan->box;
    ASSERT_GE(box.rank, 1);
    ASSERT_LE(box.rank, kMaxDims + 1);
    ASSERT_LE(box.unit, 16);
    ASSERT_EQ((reinterpret_cast<uintptr_t>(sp) + plan->src_offset) % box.unit, 0u);
    ASSERT_EQ((reinterpret_cast<uintptr_t>(dp) + plan->dst_offset) % box.unit, 0u);
    for (int64_t i = 0; i < box.count; ++i) {
      int64_t so, to;
      BoxOffsets(box, i, &so, &to);
      std::memcpy(dp + plan->dst_offset + to * box.unit,
                  sp + plan->src_offset + so * box.unit, box.unit);
    }
  }
  EXPECT_EQ(std::memcmp(dp, wp, Count(dst_shape) * es), 0)
      << graph::DTypeName(t) << " " << graph::ShapeString(src_shape) << " -> "
      << graph::ShapeString(dst_shape) << " misalign " << misalign;
}

TEST(IndexMathTest, PlannedBoxCopiesMatchHostCopyBox) {
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kInt64,
                  DType::kFloat16}) {
    for (int misalign : {0, 2, 4, 8}) {
      if (misalign % graph::DTypeBytes(t) != 0) continue;
      ExpectPlannedCopyMatches(t, {4, 5, 6}, {3, 7, 6}, {1, 0, 2}, {0, 2, 1},
                               {3, 4, 3}, misalign);
      ExpectPlannedCopyMatches(t, {8, 64}, {5, 64}, {2, 0}, {1, 0}, {4, 64},
                               misalign);
      ExpectPlannedCopyMatches(t, {33, 17}, {40, 3}, {0, 5}, {7, 2}, {33, 1},
                               misalign);
      ExpectPlannedCopyMatches(t, {}, {}, {}, {}, {}, misalign);
      ExpectPlannedCopyMatches(t, {4, 5}, {4, 5}, {1, 1}, {0, 0}, {0, 3},
                               misalign);
      ExpectPlannedCopyMatches(t, {2, 3, 2, 3, 2, 3, 2, 5},
                               {3, 3, 3, 3, 3, 3, 3, 6},
                               {0, 1, 0, 1, 0, 1, 0, 1},
                               {1, 0, 1, 0, 1, 0, 1, 0},
                               {2, 2, 2, 2, 2, 2, 2, 4}, misalign);
    }
  }
  // Random boxes.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const Shape s = RandomShape(rng, 6);
    Shape d = s;
    std::vector<int64_t> ss(s.size()), ds(s.size()), ext(s.size());
    for (size_t k = 0; k < s.size(); ++k) {
      d[k] = s[k] + std::uniform_int_distribution<int>(0, 2)(rng);
      ext[k] = std::uniform_int_distribution<int>(1, static_cast<int>(s[k]))(rng);
      ss[k] = std::uniform_int_distribution<int>(0, static_cast<int>(s[k] - ext[k]))(rng);
      ds[k] = std::uniform_int_distribution<int>(0, static_cast<int>(d[k] - ext[k]))(rng);
    }
    ExpectPlannedCopyMatches(trial % 2 ? DType::kFloat32 : DType::kFloat16, s,
                             d, ss, ds, ext, 0);
  }
}

// The device's mask function against the CPU's dropout of a tensor of ones
// (kept elements become 1 / (1 - p), dropped ones 0), sharded and not.
TEST(IndexMathTest, DropoutKeepsWhatTheCpuKeeps) {
  struct Shard {
    Shape local, global;
    std::vector<int64_t> offsets;
  };
  const std::vector<Shard> shards = {{{4, 33}, {8, 40}, {2, 5}},
                                     {{1000}, {1000}, {0}},
                                     {{2, 3, 7}, {5, 3, 9}, {3, 0, 2}},
                                     {{}, {}, {}}};
  for (const Shard& sh : shards) {
    for (int64_t step : {0, 3}) {
      const double p = 0.3;
      graph::Attrs attrs{{"p", p},
                         {"rng_key", int64_t{11}},
                         {"global_shape", sh.global},
                         {"offsets", sh.offsets}};
      HostTensor ones(DType::kFloat64, sh.local), out(DType::kFloat64, sh.local);
      const int64_t n = ones.num_elements();
      for (int64_t i = 0; i < n; ++i) ones.as<double>()[i] = 1;
      KernelContext ctx;
      ctx.step = step;
      TensorView in[] = {ones.view()};
      TensorView outs[] = {out.view()};
      ASSERT_THAT(RunCpuKernel("dropout", ctx, attrs, in, outs), IsOk());
      DropoutMask m;
      m.p = p;
      m.key = CounterKey(11, static_cast<uint64_t>(step));
      m.rank = static_cast<int>(sh.local.size());
      const std::vector<int64_t> gs = cpu::ContiguousStrides(sh.global);
      for (int d = 0; d < m.rank; ++d) {
        m.local[d] = sh.local[d];
        m.offsets[d] = sh.offsets[d];
        m.global_strides[d] = gs[d];
      }
      int kept = 0;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(DropoutKeeps(m, i), out.as<double>()[i] != 0)
            << graph::ShapeString(sh.local) << " element " << i;
        kept += DropoutKeeps(m, i);
      }
      if (n >= 100) {
        EXPECT_GT(kept, n / 2);  // about 70% kept
        EXPECT_LT(kept, n);
      }
    }
  }
}

TEST(IndexMathTest, BoxCopyErrorsAreHostCopyBoxs) {
  HostTensor a(DType::kFloat32, {4, 4}), b(DType::kFloat32, {4, 4}),
      c(DType::kFloat64, {4, 4});
  EXPECT_THAT(PlanBoxCopy(a.view(), {2, 0}, b.view(), {0, 0}, {3, 4}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dimension 0 out of range")));
  EXPECT_THAT(PlanBoxCopy(a.view(), {0, 0}, c.view(), {0, 0}, {1, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dtypes differ")));
}

}  // namespace
}  // namespace hap::executor::cuda
