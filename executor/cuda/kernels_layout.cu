// Device code of the layout kernels (launch_layout.h).
#include <cub/device/device_radix_sort.cuh>

#include "executor/cuda/kernels_b_device.cuh"
#include "executor/cuda/launch_layout.h"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::GridStart;
using dev::GridStep;
using dev::kThreads;

// --- copies ------------------------------------------------------------------

// Offsets of element i (row-major over the space) in operands 0 and 1.
__device__ inline void Offsets2(const StridedSpace& s, int64_t i, int64_t* dst,
                                int64_t* src) {
  int64_t d0 = 0, d1 = 0;
  for (int d = s.rank - 1; d >= 0; --d) {
    const int64_t idx = i % s.shape[d];
    i /= s.shape[d];
    d0 += idx * s.stride[0][d];
    d1 += idx * s.stride[1][d];
  }
  *dst = d0;
  *src = d1;
}

template <typename T, bool kAccumulate>
__global__ void StridedCopyKernel(StridedSpace s, const T* src, T* dst) {
  for (int64_t i = GridStart(); i < s.count; i += GridStep()) {
    int64_t od, os;
    Offsets2(s, i, &od, &os);
    if constexpr (kAccumulate) {
      dst[od] += src[os];
    } else {
      dst[od] = src[os];
    }
  }
}

template <typename T, bool kAccumulate>
__global__ void AxisCopyKernel(int64_t outer, int64_t block, int64_t inner,
                               const T* src, int64_t src_len, int64_t src_at,
                               T* dst, int64_t dst_len, int64_t dst_at) {
  const int64_t total = outer * block;
  for (int64_t i = GridStart(); i < total; i += GridStep()) {
    const int64_t o = i / block;
    const int64_t r = i - o * block;
    const T v = src[(o * src_len + src_at) * inner + r];
    T* d = dst + (o * dst_len + dst_at) * inner + r;
    if constexpr (kAccumulate) {
      *d += v;
    } else {
      *d = v;
    }
  }
}

template <typename T>
__global__ void AccumulateKernel(const T* src, T* dst, int64_t n) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) dst[i] += src[i];
}

// --- embedding ---------------------------------------------------------------

__device__ inline void RaiseFault(FaultWord f) {
  if (f.word != nullptr) atomicCAS(f.word, 0, f.code);
}

template <typename T, typename I>
__global__ void EmbeddingKernel(const I* ids, int64_t n, const T* table,
                                int64_t rows, int64_t d, int64_t offset,
                                int64_t vocab, T* y, FaultWord fault) {
  const int64_t total = n * d;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t i = k / d;
    const int64_t j = k - i * d;
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (j == 0 && (id < 0 || id >= vocab)) RaiseFault(fault);
    const int64_t row = id - offset;
    y[k] = row >= 0 && row < rows ? table[row * d + j] : T(0);
  }
}

template <typename I>
__global__ void CheckIdsKernel(const I* ids, int64_t n, int64_t vocab,
                               FaultWord fault) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= vocab) RaiseFault(fault);
  }
}

// Sort keys: the local row of each id, or `rows` (after every real row)
// for ids outside the shard; values: the id's position.
template <typename I>
__global__ void EmbeddingKeysKernel(const I* ids, int64_t n, int64_t rows,
                                    int64_t offset, int64_t vocab,
                                    int64_t* keys, int64_t* pos,
                                    FaultWord fault) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= vocab) RaiseFault(fault);
    const int64_t row = id - offset;
    keys[i] = row >= 0 && row < rows ? row : rows;
    pos[i] = i;
  }
}

// One block per sorted position s that starts a run of equal keys: the
// block sums the run's gradient rows in position order (stable sort) and
// adds the sum to the table row.
template <typename T>
__global__ void EmbeddingGradRunsKernel(const int64_t* keys, const int64_t* pos,
                                        int64_t n, const T* dy, int64_t rows,
                                        int64_t d, T* dtable) {
  for (int64_t s = blockIdx.x; s < n; s += gridDim.x) {
    const int64_t key = keys[s];
    // Uniform over the block: every thread reads the same keys.
    if (key >= rows || (s > 0 && keys[s - 1] == key)) continue;
    int64_t e = s + 1;
    while (e < n && keys[e] == key) ++e;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      T acc = T(0);
      for (int64_t p = s; p < e; ++p) acc += dy[pos[p] * d + j];
      dtable[key * d + j] += acc;
    }
  }
}

// Scratch layout of the gradient: four int64 arrays of n (keys and
// positions, before and after the sort), then CUB's temporary storage.
constexpr size_t kAlign = 256;
size_t AlignUp(size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

int KeyBits(int64_t rows) {  // bits of the largest key, `rows`
  int bits = 1;
  while (bits < 63 && (int64_t{1} << bits) <= rows) ++bits;
  return bits;
}

size_t SortTempBytes(int64_t n, int64_t rows) {
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(
      nullptr, temp, static_cast<const int64_t*>(nullptr),
      static_cast<int64_t*>(nullptr), static_cast<const int64_t*>(nullptr),
      static_cast<int64_t*>(nullptr), n, 0, KeyBits(rows));
  return temp;
}

}  // namespace

template <typename T>
void LaunchStridedCopy(const StridedSpace& space, const T* src, T* dst,
                       bool accumulate, cudaStream_t stream) {
  if (space.count == 0) return;
  const unsigned blocks = BlocksFor(space.count, kThreads);
  if (accumulate) {
    StridedCopyKernel<T, true>
        <<<blocks, kThreads, 0, stream>>>(space, src, dst);
  } else {
    StridedCopyKernel<T, false>
        <<<blocks, kThreads, 0, stream>>>(space, src, dst);
  }
}

template <typename T>
void LaunchAxisCopy(int64_t outer, int64_t inner, const T* src, int64_t src_len,
                    int64_t src_at, T* dst, int64_t dst_len, int64_t dst_at,
                    int64_t n, bool accumulate, cudaStream_t stream) {
  const int64_t block = n * inner;
  if (outer * block == 0) return;
  const unsigned blocks = BlocksFor(outer * block, kThreads);
  if (accumulate) {
    AxisCopyKernel<T, true><<<blocks, kThreads, 0, stream>>>(
        outer, block, inner, src, src_len, src_at, dst, dst_len, dst_at);
  } else {
    AxisCopyKernel<T, false><<<blocks, kThreads, 0, stream>>>(
        outer, block, inner, src, src_len, src_at, dst, dst_len, dst_at);
  }
}

template <typename T>
void LaunchAccumulate(const T* src, T* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  AccumulateKernel<T>
      <<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(src, dst, n);
}

template <typename T, typename I>
void LaunchEmbedding(const I* ids, int64_t n, const T* table, int64_t rows,
                     int64_t d, int64_t offset, int64_t vocab, T* y,
                     FaultWord fault, cudaStream_t stream) {
  if (n == 0) return;
  if (d == 0) {  // no rows to copy, but the ids are still checked
    CheckIdsKernel<I>
        <<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(ids, n, vocab, fault);
    return;
  }
  EmbeddingKernel<T, I><<<BlocksFor(n * d, kThreads), kThreads, 0, stream>>>(
      ids, n, table, rows, d, offset, vocab, y, fault);
}

size_t EmbeddingGradScratchBytes(int64_t n, int64_t rows) {
  if (n == 0) return 0;
  return 4 * AlignUp(n * sizeof(int64_t)) + SortTempBytes(n, rows);
}

template <typename T, typename I>
cudaError_t LaunchEmbeddingGrad(const I* ids, int64_t n, const T* dy,
                                int64_t rows, int64_t d, int64_t offset,
                                int64_t vocab, T* dtable, void* scratch,
                                size_t scratch_bytes, FaultWord fault,
                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  char* base = static_cast<char*>(scratch);
  const size_t array = AlignUp(n * sizeof(int64_t));
  int64_t* keys_in = reinterpret_cast<int64_t*>(base);
  int64_t* keys_out = reinterpret_cast<int64_t*>(base + array);
  int64_t* pos_in = reinterpret_cast<int64_t*>(base + 2 * array);
  int64_t* pos_out = reinterpret_cast<int64_t*>(base + 3 * array);
  void* temp = base + 4 * array;
  size_t temp_bytes = scratch_bytes - 4 * array;
  EmbeddingKeysKernel<I><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(
      ids, n, rows, offset, vocab, keys_in, pos_in, fault);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  e = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out,
                                      pos_in, pos_out, n, 0, KeyBits(rows),
                                      stream);
  if (e != cudaSuccess) return e;
  if (d == 0 || rows == 0) return cudaSuccess;
  const unsigned blocks =
      static_cast<unsigned>(n < 65535 * 16 ? n : 65535 * 16);
  const int threads = d >= 256 ? 256 : (d >= 128 ? 128 : 64);
  EmbeddingGradRunsKernel<T><<<blocks, threads, 0, stream>>>(
      keys_out, pos_out, n, dy, rows, d, dtable);
  return cudaGetLastError();
}

#define HAP_INSTANTIATE_COPY(T)                                               \
  template void LaunchStridedCopy<T>(const StridedSpace&, const T*, T*, bool, \
                                     cudaStream_t);                           \
  template void LaunchAxisCopy<T>(int64_t, int64_t, const T*, int64_t,        \
                                  int64_t, T*, int64_t, int64_t, int64_t,     \
                                  bool, cudaStream_t);
HAP_INSTANTIATE_COPY(float)
HAP_INSTANTIATE_COPY(double)
HAP_INSTANTIATE_COPY(int32_t)
HAP_INSTANTIATE_COPY(int64_t)

#define HAP_INSTANTIATE_EMBEDDING(T, I)                                     \
  template void LaunchEmbedding<T, I>(const I*, int64_t, const T*, int64_t, \
                                      int64_t, int64_t, int64_t, T*,        \
                                      FaultWord, cudaStream_t);             \
  template cudaError_t LaunchEmbeddingGrad<T, I>(                           \
      const I*, int64_t, const T*, int64_t, int64_t, int64_t, int64_t, T*,  \
      void*, size_t, FaultWord, cudaStream_t);
HAP_INSTANTIATE_EMBEDDING(float, int32_t)
HAP_INSTANTIATE_EMBEDDING(float, int64_t)
HAP_INSTANTIATE_EMBEDDING(double, int32_t)
HAP_INSTANTIATE_EMBEDDING(double, int64_t)

template void LaunchAccumulate<float>(const float*, float*, int64_t,
                                      cudaStream_t);
template void LaunchAccumulate<double>(const double*, double*, int64_t,
                                       cudaStream_t);

}  // namespace hap::executor::cuda
