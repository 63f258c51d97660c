// The helpers of kernels_internal.h: argument checks, the backward-kernel
// layout, the parallel-for and strided loops.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"

namespace hap::executor::cpu {

KernelFn FloatKernel(TypedKernel f32, TypedKernel f64) {
  return FloatDispatch<KernelArgs>(f32, f64);
}

KernelFn AnyKernel(TypedKernel f32, TypedKernel f64, TypedKernel i32,
                   TypedKernel i64) {
  return AnyDispatch<KernelArgs>(f32, f64, i32, i64);
}

std::string Describe(const TensorView& v) {
  if (!v.present()) return "absent";
  return absl::StrCat(graph::DTypeName(v.dtype), graph::ShapeString(v.shape));
}

std::string InLabel(const KernelArgs& a, int i) {
  return absl::StrCat("input ", i, " (", Describe(a.in[i]), ")");
}

std::string OutLabel(const KernelArgs& a, int i) {
  return absl::StrCat("output ", i, " (", Describe(a.out[i]), ")");
}

absl::Status CheckArity(const KernelArgs& a, int min_in, int max_in,
                        int num_out) {
  const int n = static_cast<int>(a.in.size());
  if (n < min_in || (max_in >= 0 && n > max_in)) {
    return Invalid(a, "takes ",
                   max_in == min_in ? absl::StrCat(min_in)
                   : max_in < 0     ? absl::StrCat("at least ", min_in)
                                    : absl::StrCat(min_in, " to ", max_in),
                   " inputs, got ", n);
  }
  if (static_cast<int>(a.out.size()) != num_out) {
    return Invalid(a, "takes ", num_out, " outputs, got ", a.out.size());
  }
  return absl::OkStatus();
}

absl::Status CheckInput(const KernelArgs& a, int i, DType t) {
  if (!a.in[i].present()) return Invalid(a, "input ", i, " is absent");
  if (a.in[i].dtype != t) {
    return Invalid(a, InLabel(a, i), " must be ", graph::DTypeName(t));
  }
  return absl::OkStatus();
}

absl::Status CheckIdsInput(const KernelArgs& a, int i) {
  if (!a.in[i].present()) return Invalid(a, "input ", i, " is absent");
  if (a.in[i].dtype != DType::kInt64 && a.in[i].dtype != DType::kInt32) {
    return Invalid(a, InLabel(a, i), " must be i64 or i32");
  }
  return absl::OkStatus();
}

absl::Status CheckOutput(const KernelArgs& a, int i, DType t,
                         const Shape& shape) {
  if (!a.out[i].present()) return Invalid(a, "output ", i, " is absent");
  if (a.out[i].dtype != t) {
    return Invalid(a, OutLabel(a, i), " must be ", graph::DTypeName(t));
  }
  return CheckShape(a, a.out[i], absl::StrCat("output ", i), shape);
}

absl::Status CheckUnary(const KernelArgs& a, DType t) {
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  return CheckInput(a, 0, t);
}

absl::Status CheckElementwise(const KernelArgs& a, DType t) {
  HAP_RETURN_IF_ERROR(CheckUnary(a, t));
  return CheckOutput(a, 0, t, a.in[0].shape);
}

absl::Status CheckBias(const KernelArgs& a, DType t, bool has_slot,
                       int64_t n) {
  if (!has_slot || !a.in[2].present()) return absl::OkStatus();
  HAP_RETURN_IF_ERROR(CheckInput(a, 2, t));
  return CheckShape(a, a.in[2], "bias (input 2)", {n});
}

absl::Status CheckShape(const KernelArgs& a, const TensorView& v,
                        absl::string_view label, const Shape& want) {
  if (v.shape != want) {
    return Invalid(a, label, " (", Describe(v), ") must have shape ",
                   graph::ShapeString(want));
  }
  return absl::OkStatus();
}

namespace {

template <typename T>
absl::StatusOr<T> Annotated(const KernelArgs& a, absl::StatusOr<T> v) {
  if (v.ok()) return v;
  return Annotate(v.status(), absl::StrCat("kernel '", a.name, "'"));
}

}  // namespace

absl::StatusOr<int64_t> AttrInt(const KernelArgs& a, const std::string& name,
                                int64_t def) {
  return Annotated(a, a.attrs.Int(name, def));
}
absl::StatusOr<int64_t> AttrInt(const KernelArgs& a, const std::string& name) {
  return Annotated(a, a.attrs.Int(name));
}
absl::StatusOr<double> AttrFloat(const KernelArgs& a, const std::string& name,
                                 double def) {
  return Annotated(a, a.attrs.Float(name, def));
}
absl::StatusOr<double> AttrFloat(const KernelArgs& a, const std::string& name) {
  return Annotated(a, a.attrs.Float(name));
}
absl::StatusOr<bool> AttrBool(const KernelArgs& a, const std::string& name,
                              bool def) {
  return Annotated(a, a.attrs.Bool(name, def));
}
absl::StatusOr<std::vector<int64_t>> AttrInts(const KernelArgs& a,
                                              const std::string& name) {
  return Annotated(a, a.attrs.Ints(name));
}
absl::StatusOr<std::vector<int64_t>> AttrInts(
    const KernelArgs& a, const std::string& name,
    const std::vector<int64_t>& def) {
  return Annotated(a, a.attrs.Ints(name, def));
}

absl::StatusOr<int> NormalizeAxis(const KernelArgs& a, int64_t axis, int rank,
                                  absl::string_view what) {
  if (axis < -rank || axis >= rank) {
    return Invalid(a, what, " ", axis, " is out of range for rank ", rank);
  }
  return static_cast<int>(axis < 0 ? axis + rank : axis);
}

// --- GradArgs -----------------------------------------------------------------

absl::StatusOr<GradArgs> GradArgs::Make(const KernelArgs& a, int min_n,
                                        int max_n, int num_y) {
  GradArgs g;
  g.a_ = &a;
  g.n_ = static_cast<int>(a.out.size());
  const int in = static_cast<int>(a.in.size());
  if (g.n_ < min_n || g.n_ > max_n) {
    return Invalid(a, "takes ",
                   min_n == max_n ? absl::StrCat(min_n)
                                  : absl::StrCat(min_n, " to ", max_n),
                   " outputs (one gradient per forward input), got ", g.n_);
  }
  if (num_y < 0) {
    if (in <= g.n_ || (in - g.n_) % 2 != 0) {
      return Invalid(a, "takes the forward inputs, outputs and output "
                        "gradients; got ", in, " inputs for ", g.n_,
                     " forward inputs");
    }
    g.m_ = (in - g.n_) / 2;
  } else {
    g.m_ = num_y;
    if (in != g.n_ + 2 * num_y) {
      return Invalid(a, "takes ", g.n_ + 2 * num_y, " inputs (", g.n_,
                     " forward inputs, ", num_y, " outputs, ", num_y,
                     " output gradients), got ", in);
    }
  }
  return g;
}

absl::StatusOr<GradArgs> GradArgs::Unary(const KernelArgs& a, DType t) {
  HAP_ASSIGN_OR_RETURN(GradArgs g, Make(a, 1, 1, 1));
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  return g;
}

absl::StatusOr<GradArgs> GradArgs::Elementwise(const KernelArgs& a, DType t) {
  HAP_ASSIGN_OR_RETURN(GradArgs g, Unary(a, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {g.x(0).shape}));
  return g;
}

bool GradArgs::any_dy() const {
  for (int j = 0; j < m_; ++j) {
    if (dy(j).present()) return true;
  }
  return false;
}

bool GradArgs::any_dx() const {
  for (int i = 0; i < n_; ++i) {
    if (dx(i).present()) return true;
  }
  return false;
}

absl::Status GradArgs::Check(DType t, const std::vector<Shape>& y_shapes) const {
  const KernelArgs& a = *a_;
  for (int j = 0; j < m_; ++j) {
    for (int idx : {n_ + j, n_ + m_ + j}) {
      const TensorView& v = a.in[idx];
      if (!v.present()) continue;
      if (v.dtype != t) {
        return Invalid(a, InLabel(a, idx), " must be ", graph::DTypeName(t));
      }
      HAP_RETURN_IF_ERROR(
          CheckShape(a, v, absl::StrCat("input ", idx), y_shapes[j]));
    }
  }
  for (int i = 0; i < n_; ++i) {
    if (!dx(i).present()) continue;
    if (!x(i).present()) {
      return Invalid(a, "output ", i, " asks for the gradient of input ", i,
                     ", which is absent");
    }
    if (dx(i).dtype != t) {
      return Invalid(a, OutLabel(a, i), " must be ", graph::DTypeName(t));
    }
    HAP_RETURN_IF_ERROR(
        CheckShape(a, dx(i), absl::StrCat("output ", i), x(i).shape));
  }
  return absl::OkStatus();
}

absl::Status GradArgs::CheckNoGrad(std::initializer_list<int> no_grad) const {
  for (int i : no_grad) {
    if (i < n_ && dx(i).present()) {
      return Invalid(*a_, "input ", i,
                     " is not differentiable; its gradient output must be "
                     "absent");
    }
  }
  return absl::OkStatus();
}

// --- parallel loops -----------------------------------------------------------

int NumChunks(int threads, int64_t n, int64_t grain) {
  if (threads <= 1 || n <= grain) return 1;
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(threads, n / grain)));
}

namespace {

// The workers RunChunks hands chunks to: threads made once and kept (a
// thread made per call cost more than the small kernels' whole work, and
// each new thread's OpenMP state cost oneDNN its thread team). One queue
// for the process (ranks run as threads of one process in tests). A
// caller waiting for its chunks runs queued chunks itself, so progress
// never depends on a free worker; a chunk that calls RunChunks again runs
// its chunks in line (no nesting on the workers).
class ChunkPool {
 public:
  struct Batch {
    int left;  // guarded by the pool's mutex
    std::condition_variable done;
  };
  struct Task {
    const std::function<void(int, int64_t, int64_t)>* fn;
    int chunk;
    int64_t begin, end;
    Batch* batch;
  };

  static ChunkPool& Get() {
    static ChunkPool* pool = new ChunkPool;  // never destroyed: workers outlive main
    return *pool;
  }
  static bool OnWorker() { return on_worker_; }

  // Queues tasks, making workers up to `want` (at most kMaxWorkers).
  void Submit(const std::vector<Task>& tasks, int want) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Task& t : tasks) queue_.push_back(t);
    while (workers_ < std::min(want, kMaxWorkers)) {
      std::thread([this] { Work(); }).detach();
      ++workers_;
    }
    work_.notify_all();
  }

  // Until `batch` is done, running queued tasks meanwhile.
  void Wait(Batch& batch) {
    std::unique_lock<std::mutex> lock(mu_);
    while (batch.left > 0) {
      if (!queue_.empty()) {
        Task t = queue_.front();
        queue_.pop_front();
        lock.unlock();
        Run(t);
        lock.lock();
        continue;
      }
      batch.done.wait(lock);
    }
  }

 private:
  static constexpr int kMaxWorkers = 64;

  void Run(const Task& t) {
    const bool was = on_worker_;
    on_worker_ = true;
    (*t.fn)(t.chunk, t.begin, t.end);
    on_worker_ = was;
    std::lock_guard<std::mutex> lock(mu_);
    if (--t.batch->left == 0) t.batch->done.notify_all();
  }

  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_.wait(lock, [this] { return !queue_.empty(); });
      Task t = queue_.front();
      queue_.pop_front();
      lock.unlock();
      Run(t);
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable work_;
  std::deque<Task> queue_;
  int workers_ = 0;
  static thread_local bool on_worker_;
};

thread_local bool ChunkPool::on_worker_ = false;

}  // namespace

void RunChunks(int chunks, int64_t n,
               const std::function<void(int, int64_t, int64_t)>& fn) {
  auto bound = [&](int c) { return n / chunks * c + n % chunks * c / chunks; };
  if (chunks <= 1) {
    fn(0, 0, n);
    return;
  }
  if (ChunkPool::OnWorker()) {
    for (int c = 0; c < chunks; ++c) fn(c, bound(c), bound(c + 1));
    return;
  }
  ChunkPool& pool = ChunkPool::Get();
  ChunkPool::Batch batch;
  batch.left = chunks - 1;
  std::vector<ChunkPool::Task> tasks;
  tasks.reserve(chunks - 1);
  for (int c = 1; c < chunks; ++c) tasks.push_back({&fn, c, bound(c), bound(c + 1), &batch});
  pool.Submit(tasks, chunks - 1);
  fn(0, 0, bound(1));
  pool.Wait(batch);
}

void ParallelFor(int threads, int64_t n, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn) {
  RunChunks(NumChunks(threads, n, grain), n,
            [&](int, int64_t b, int64_t e) { fn(b, e); });
}

// --- strided loops ------------------------------------------------------------

std::vector<int64_t> ContiguousStrides(const Shape& s) {
  std::vector<int64_t> st(s.size());
  int64_t acc = 1;
  for (int d = static_cast<int>(s.size()) - 1; d >= 0; --d) {
    st[d] = acc;
    acc *= s[d];
  }
  return st;
}

bool BroadcastsTo(const Shape& small, const Shape& big) {
  if (small.size() > big.size()) return false;
  const size_t lead = big.size() - small.size();
  for (size_t i = 0; i < small.size(); ++i) {
    if (small[i] != 1 && small[i] != big[lead + i]) return false;
  }
  return true;
}

absl::StatusOr<Shape> BroadcastShape(const Shape& a, const Shape& b) {
  const size_t r = std::max(a.size(), b.size());
  Shape out(r);
  for (size_t i = 0; i < r; ++i) {
    int64_t da = i + a.size() >= r ? a[i + a.size() - r] : 1;
    int64_t db = i + b.size() >= r ? b[i + b.size() - r] : 1;
    if (da != db && da != 1 && db != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(graph::ShapeString(a), " and ", graph::ShapeString(b),
                       " do not broadcast"));
    }
    out[i] = da == 1 ? db : da;
  }
  return out;
}

std::vector<int64_t> BroadcastStrides(const Shape& small, const Shape& big) {
  std::vector<int64_t> own = ContiguousStrides(small);
  std::vector<int64_t> st(big.size(), 0);
  const size_t lead = big.size() - small.size();
  for (size_t i = 0; i < small.size(); ++i) {
    st[lead + i] = small[i] == big[lead + i] ? own[i] : 0;
  }
  return st;
}

StridedLoop::StridedLoop(const Shape& shape,
                         const std::vector<std::vector<int64_t>>& strides) {
  // Dimensions, innermost first, with size-1 ones dropped and mergeable
  // neighbours merged.
  std::vector<int64_t> dims;
  std::vector<std::array<int64_t, kMax>> st;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    if (shape[d] == 1) continue;
    std::array<int64_t, kMax> s = {0, 0, 0};
    for (size_t k = 0; k < strides.size() && k < kMax; ++k) s[k] = strides[k][d];
    if (!dims.empty()) {
      bool merge = true;
      for (int k = 0; k < kMax; ++k) {
        merge = merge && s[k] == st.back()[k] * dims.back();
      }
      if (merge) {
        dims.back() *= shape[d];
        continue;
      }
    }
    dims.push_back(shape[d]);
    st.push_back(s);
  }
  if (dims.empty()) return;  // one element
  inner_ = dims[0];
  for (int k = 0; k < kMax; ++k) inner_stride_[k] = st[0][k];
  for (size_t i = dims.size(); i-- > 1;) {
    outer_.push_back(dims[i]);
    outer_stride_.push_back(st[i]);
    rows_ *= dims[i];
  }
}

absl::StatusOr<std::vector<int64_t>> MaskCounterStrides(const KernelArgs& a,
                                                        const Shape& global) {
  if (a.name.rfind("drop_path", 0) != 0) return ContiguousStrides(global);
  HAP_ASSIGN_OR_RETURN(std::string mode, a.attrs.String("mode", "row"));
  std::vector<int64_t> strides(global.size(), 0);
  if (mode == "row") {
    if (!strides.empty()) strides[0] = 1;
  } else if (mode != "batch") {
    return Invalid(a, "attribute 'mode' must be \"row\" or \"batch\", got \"",
                   mode, "\"");
  }
  return strides;
}

}  // namespace hap::executor::cpu
