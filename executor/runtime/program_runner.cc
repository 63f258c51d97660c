#include "executor/runtime/program_runner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "executor/runtime/random.h"
#include "planner/graph/graph_proto.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;

std::string StepName(const v1::RankProgram& p, int i) {
  const v1::Step& s = p.steps(i);
  if (s.has_wait()) {
    return absl::StrCat("step ", i, " (wait for step ", s.wait().start_step(), ")");
  }
  if (s.has_kernel()) {
    return absl::StrCat("step ", i, " (kernel '", s.kernel().kernel(), "'",
                        s.kernel().op().empty() ? "" : " of op '",
                        s.kernel().op(), s.kernel().op().empty() ? "" : "'", ")");
  }
  return absl::StrCat("step ", i, " (",
                      v1::Collective_Name(s.collective().collective()), " of '",
                      s.collective().tensor(), "')");
}

// The value of element `g` (global flat index) of a parameter; `ends`: for
// kValues, the end of each run (the running sum of init.counts).
double InitValue(const graph::Initializer& init, const std::vector<int64_t>& ends, uint64_t key,
                 uint64_t g) {
  using K = graph::Initializer::Kind;
  switch (init.kind) {
    case K::kZeros:
      return 0;
    case K::kOnes:
      return 1;
    case K::kConstant:
      return init.value;
    case K::kNormal:
      return init.mean + init.stddev * CounterNormal(key, g);
    case K::kUniform:
      return init.low + (init.high - init.low) * CounterUniform(key, g);
    case K::kValues: {
      // The run holding element g (the graph checked that the counts add
      // up to the tensor's elements).
      auto run = std::upper_bound(ends.begin(), ends.end(), static_cast<int64_t>(g));
      return run == ends.end() ? 0 : init.values[run - ends.begin()];
    }
  }
  return 0;
}

template <typename T>
void FillInit(HostTensor& t, const graph::Initializer& init, uint64_t key,
              const Shape& global, const std::vector<int64_t>& offsets) {
  const Shape& local = t.shape();
  const int rank = static_cast<int>(local.size());
  T* out = t.as<T>();
  std::vector<int64_t> idx(rank, 0);
  std::vector<int64_t> ends;
  if (init.kind == graph::Initializer::Kind::kValues) {
    int64_t end = 0;
    for (int64_t c : init.counts) ends.push_back(end += c);
  }
  const int64_t n = t.num_elements();
  for (int64_t i = 0; i < n; ++i) {
    uint64_t g = 0;
    for (int d = 0; d < rank; ++d) {
      g = g * static_cast<uint64_t>(global[d]) +
          static_cast<uint64_t>(idx[d] + offsets[d]);
    }
    out[i] = static_cast<T>(InitValue(init, ends, key, g));
    for (int d = rank - 1; d >= 0 && ++idx[d] == local[d]; --d) idx[d] = 0;
  }
}

}  // namespace

ProgramRunner::ProgramRunner(const v1::RankProgram& program, const graph::Graph& graph,
                             Device* device, Communicator* comm, const RunnerOptions& options)
    : program_(program),
      graph_(graph),
      device_(device),
      comm_(comm),
      staging_(device),
      options_(options) {}

ProgramRunner::~ProgramRunner() {
  // Collectives still running write into the arena.
  if (options_.async != nullptr) options_.async->WaitAll().IgnoreError();
  if (arena_) device_->Free(arena_);
}

absl::StatusOr<std::unique_ptr<ProgramRunner>> ProgramRunner::Create(const v1::RankProgram& program,
                                                                     const graph::Graph& graph,
                                                                     Device* device,
                                                                     Communicator* comm,
                                                                     const RunnerOptions& options) {
  std::unique_ptr<ProgramRunner> r(new ProgramRunner(program, graph, device, comm, options));
  HAP_RETURN_IF_ERROR(r->Validate());
  HAP_ASSIGN_OR_RETURN(r->arena_, device->Allocate(program.arena_bytes()));
  for (TensorView& v : r->views_) {
    v.data = static_cast<char*>(r->arena_) +
             program.buffers(static_cast<int>(&v - r->views_.data())).offset_bytes();
  }
  return r;
}

absl::Status ProgramRunner::Validate() {
  const v1::RankProgram& p = program_;
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("invalid rank program: ", what));
  };
  if (p.world_size() != comm_->size() || p.rank() != comm_->rank()) {
    return bad(absl::StrCat("it is rank ", p.rank(), " of ", p.world_size(),
                            " but this executor is rank ", comm_->rank(), " of ",
                            comm_->size()));
  }
  if (p.arena_bytes() < 0) return bad("negative arena size");
  const int nb = p.buffers_size();
  for (int i = 0; i < nb; ++i) {
    const v1::Buffer& b = p.buffers(i);
    std::string name = absl::StrCat("buffer ", i, " ('", b.tensor(), "')");
    if (b.id() != i) return bad(absl::StrCat(name, " has id ", b.id()));
    if (!v1::DType_IsValid(b.dtype()) || b.dtype() == v1::DTYPE_UNSPECIFIED) {
      return bad(absl::StrCat(name, " has no valid dtype"));
    }
    if (b.global_shape_size() != b.shape_size() || b.offsets_size() != b.shape_size()) {
      return bad(absl::StrCat(name, ": shape, global shape and offsets differ in rank"));
    }
    int64_t n = 1, whole = 1;  // elements of the piece and of its tensor
    for (int d = 0; d < b.shape_size(); ++d) {
      if (b.global_shape(d) < 0 || b.shape(d) < 0 || b.offsets(d) < 0 ||
          b.shape(d) > b.global_shape(d) - b.offsets(d)) {
        return bad(absl::StrCat(name, ": dimension ", d, " (", b.shape(d), " at ",
                                b.offsets(d), ") is outside its tensor (",
                                b.global_shape(d), ")"));
      }
      if (__builtin_mul_overflow(n, b.shape(d), &n)) {
        return bad(absl::StrCat(name, " overflows"));
      }
      if (__builtin_mul_overflow(whole, b.global_shape(d), &whole)) {
        return bad(absl::StrCat(name, ": its whole tensor overflows"));
      }
    }
    graph::DType dt = graph::FromProtoDType(b.dtype());
    int64_t bytes = 0, end = 0;
    // Held on the host whole (a pipeline stage's transfers), rounded up to
    // 64-byte blocks.
    if (__builtin_mul_overflow(whole, graph::DTypeBytes(dt), &bytes) ||
        bytes > std::numeric_limits<int64_t>::max() - 64) {
      return bad(absl::StrCat(name, ": its whole tensor overflows"));
    }
    if (__builtin_mul_overflow(n, graph::DTypeBytes(dt), &bytes) || b.offset_bytes() < 0 ||
        __builtin_add_overflow(b.offset_bytes(), bytes, &end) || end > p.arena_bytes()) {
      return bad(absl::StrCat(name, " lies outside the arena"));
    }
    if (b.role() == v1::Buffer::NORM && (dt != graph::DType::kFloat64 || n != 1)) {
      // Read and written whole as one double (the pipeline's sum over stages).
      return bad(absl::StrCat(name, ": a clipping norm must be f64[1], not ",
                              graph::TypeString({dt, Shape(b.shape().begin(), b.shape().end())})));
    }
    if (b.role() == v1::Buffer::PARAMETER || b.role() == v1::Buffer::INPUT) {
      auto t = graph_.FindTensor(b.tensor());
      auto want = b.role() == v1::Buffer::PARAMETER ? graph::TensorKind::kParameter
                                                    : graph::TensorKind::kInput;
      if (!t || graph_.tensor(*t).kind != want) {
        return bad(absl::StrCat(name, " names no ",
                                b.role() == v1::Buffer::PARAMETER ? "parameter" : "input",
                                " of model '", graph_.name(), "'"));
      }
      const graph::TensorType& type = graph_.tensor(*t).type;
      if (type.dtype != dt ||
          !std::equal(type.shape.begin(), type.shape.end(), b.global_shape().begin(),
                      b.global_shape().end())) {
        return bad(absl::StrCat(name, " does not match the model's ",
                                graph::TypeString(type)));
      }
    }
    views_.push_back(TensorView{dt, Shape(b.shape().begin(), b.shape().end()), nullptr});
  }
  if (p.loss_buffer() < 0 || p.loss_buffer() >= nb ||
      p.buffers(p.loss_buffer()).role() != v1::Buffer::LOSS) {
    return bad("the loss buffer is missing");
  }
  {  // read into one value after every step
    const TensorView& l = views_[p.loss_buffer()];
    if (l.num_elements() != 1 ||
        (l.dtype != graph::DType::kFloat32 && l.dtype != graph::DType::kFloat64)) {
      return bad(absl::StrCat("the loss buffer must hold one float32 or float64 value, not ",
                              graph::TypeString({l.dtype, l.shape})));
    }
  }
  auto id_ok = [&](int id, bool optional) {
    return (optional && id == -1) || (id >= 0 && id < nb);
  };
  for (int i = 0; i < p.steps_size(); ++i) {
    const v1::Step& s = p.steps(i);
    graph::Attrs attrs;
    if (s.has_kernel()) {
      const v1::KernelCall& k = s.kernel();
      if (k.kernel() != "fill" && !device_->HasKernel(k.kernel())) {
        return bad(absl::StrCat(StepName(p, i), ": no such kernel on ", device_->name()));
      }
      for (int id : k.inputs()) {
        if (!id_ok(id, true)) return bad(absl::StrCat(StepName(p, i), ": buffer ", id, " does not exist"));
      }
      for (int id : k.outputs()) {
        if (!id_ok(id, true)) return bad(absl::StrCat(StepName(p, i), ": buffer ", id, " does not exist"));
      }
      if (k.kernel() == "fill" && (k.outputs_size() != 1 || k.outputs(0) < 0)) {
        return bad(absl::StrCat(StepName(p, i), ": fill needs one output"));
      }
      for (const auto& [name, v] : k.attrs()) {
        auto a = graph::AttrFromProto(v);
        if (!a.ok()) return bad(absl::StrCat(StepName(p, i), ": attribute '", name, "' ", a.status().message()));
        attrs.Set(name, *a);
      }
      if (k.kernel() == "fill") {
        if (auto v = attrs.Float("value", 0.0); !v.ok()) {
          return bad(absl::StrCat(StepName(p, i), ": attribute 'value' ", v.status().message()));
        }
      }
    } else if (s.has_collective()) {
      const v1::CollectiveCall& c = s.collective();
      if (!id_ok(c.input(), false) || !id_ok(c.output(), false)) {
        return bad(absl::StrCat(StepName(p, i), ": a buffer does not exist"));
      }
      const TensorView& in = views_[c.input()];
      const TensorView& out = views_[c.output()];
      if (in.dtype != out.dtype) return bad(absl::StrCat(StepName(p, i), ": dtypes differ"));
      auto check_sizes = [&](int dim, const auto& sizes, const TensorView& whole,
                             const TensorView& part) -> absl::Status {
        if (dim < 0 || dim >= whole.rank() || whole.rank() != part.rank() ||
            static_cast<int64_t>(sizes.size()) != p.world_size()) {
          return bad(absl::StrCat(StepName(p, i), ": dimension or shard sizes do not fit"));
        }
        int64_t sum = 0;
        for (int r = 0; r < p.world_size(); ++r) {
          if (sizes[r] < 0) {
            return bad(absl::StrCat(StepName(p, i), ": shard size ", sizes[r], " of rank ", r,
                                    " is negative"));
          }
          if (__builtin_add_overflow(sum, sizes[r], &sum)) {
            return bad(absl::StrCat(StepName(p, i), ": shard sizes overflow at rank ", r));
          }
        }
        if (sum != whole.shape[dim] || sizes[p.rank()] != part.shape[dim]) {
          return bad(absl::StrCat(StepName(p, i), ": shard sizes do not add up to dimension ", dim));
        }
        return absl::OkStatus();
      };
      // The pieces of `a` and `b` along dimensions d1 and d2 (d1 == d2: one)
      // are the collective's; every other dimension is the same in both.
      auto same_beyond = [&](const TensorView& a, const TensorView& b, int d1,
                             int d2) -> absl::Status {
        for (int d = 0; d < a.rank(); ++d) {
          if (d == d1 || d == d2 || a.shape[d] == b.shape[d]) continue;
          return bad(absl::StrCat(
              StepName(p, i), ": ", graph::TypeString({a.dtype, a.shape}), " and ",
              graph::TypeString({b.dtype, b.shape}), " differ beyond dimension",
              d1 == d2 ? absl::StrCat(" ", d1)
                       : absl::StrCat("s ", std::min(d1, d2), " and ", std::max(d1, d2))));
        }
        return absl::OkStatus();
      };
      const bool dim0 = c.collective() == v1::ALL_GATHER || c.collective() == v1::REDUCE_SCATTER;
      if (c.coalesced_size() > 0 && !dim0 &&
          (c.collective() != v1::ALL_REDUCE || c.input() != c.output())) {
        return bad(absl::StrCat(StepName(p, i),
                                ": coalesced buffers are for in-place ALL_REDUCE, ALL_GATHER "
                                "and REDUCE_SCATTER only"));
      }
      const int extra_outputs = dim0 ? c.coalesced_size() : 0;
      if (c.coalesced_outputs_size() != extra_outputs ||
          c.coalesced_shard_sizes_size() != extra_outputs * p.world_size()) {
        return bad(absl::StrCat(StepName(p, i), ": ", c.coalesced_size(), " coalesced buffers, ",
                                c.coalesced_outputs_size(), " coalesced outputs and ",
                                c.coalesced_shard_sizes_size(),
                                " coalesced shard sizes do not match (world ", p.world_size(),
                                ")"));
      }
      if (c.coalesced_size() > 0 && dim0 && c.dim() != 0) {
        return bad(absl::StrCat(StepName(p, i), ": a coalesced ",
                                v1::Collective_Name(c.collective()), " must be along dim 0"));
      }
      for (int k = 0; k < c.coalesced_size(); ++k) {
        for (int id : {c.coalesced(k), dim0 ? c.coalesced_outputs(k) : c.coalesced(k)}) {
          if (!id_ok(id, false)) {
            return bad(absl::StrCat(StepName(p, i), ": coalesced buffer ", id, " does not exist"));
          }
          if (views_[id].dtype != out.dtype) {
            return bad(absl::StrCat(StepName(p, i), ": coalesced buffer ", id,
                                    " has another dtype than the call's"));
          }
        }
        if (!dim0) continue;
        std::vector<int64_t> sizes(c.coalesced_shard_sizes().begin() + k * p.world_size(),
                                   c.coalesced_shard_sizes().begin() + (k + 1) * p.world_size());
        const TensorView& a = views_[c.coalesced(k)];
        const TensorView& b = views_[c.coalesced_outputs(k)];
        const bool gather = c.collective() == v1::ALL_GATHER;
        HAP_RETURN_IF_ERROR(check_sizes(0, sizes, gather ? b : a, gather ? a : b));
        HAP_RETURN_IF_ERROR(same_beyond(a, b, 0, 0));
      }
      switch (c.collective()) {
        case v1::ALL_REDUCE:
          if (in.shape != out.shape) return bad(absl::StrCat(StepName(p, i), ": shapes differ"));
          break;
        case v1::ALL_GATHER:
          HAP_RETURN_IF_ERROR(check_sizes(c.dim(), c.shard_sizes(), out, in));
          HAP_RETURN_IF_ERROR(same_beyond(in, out, c.dim(), c.dim()));
          break;
        case v1::REDUCE_SCATTER:
          HAP_RETURN_IF_ERROR(check_sizes(c.dim(), c.shard_sizes(), in, out));
          HAP_RETURN_IF_ERROR(same_beyond(in, out, c.dim(), c.dim()));
          break;
        case v1::ALL_TO_ALL:
          HAP_RETURN_IF_ERROR(check_sizes(c.dim(), c.shard_sizes(), in, out));
          HAP_RETURN_IF_ERROR(check_sizes(c.from_dim(), c.from_shard_sizes(), out, in));
          HAP_RETURN_IF_ERROR(same_beyond(in, out, c.dim(), c.from_dim()));
          break;
        default:
          return bad(absl::StrCat(StepName(p, i), ": unsupported collective"));
      }
    } else if (!s.has_wait()) {
      return bad(absl::StrCat("step ", i, " has no call"));
    }
    attrs_.push_back(std::move(attrs));
  }
  // Whether buffers a and b have arena bytes in common.
  auto share_bytes = [&](int a, int b) {
    const int64_t a0 = p.buffers(a).offset_bytes(), b0 = p.buffers(b).offset_bytes();
    return views_[a].bytes() > 0 && views_[b].bytes() > 0 && a0 < b0 + views_[b].bytes() &&
           b0 < a0 + views_[a].bytes();
  };
  // Asynchronous collectives: each waited for once, later, and no step in
  // between touches its buffers (they are the communication thread's).
  std::map<int, int> busy;                  // buffer -> start step
  std::map<int, std::vector<int>> running;  // start step -> buffers
  for (int i = 0; i < p.steps_size(); ++i) {
    const v1::Step& s = p.steps(i);
    if (s.has_wait()) {
      auto it = running.find(s.wait().start_step());
      if (it == running.end()) {
        return bad(absl::StrCat(StepName(p, i), ": no asynchronous collective started at step ",
                                s.wait().start_step(), " is running there"));
      }
      for (int b : it->second) busy.erase(b);
      running.erase(it);
      continue;
    }
    std::vector<int> ids = StepBuffers(s);
    // A step's buffers are alive together: distinct ones never overlap.
    for (auto a = ids.begin(); a != ids.end(); ++a) {
      for (auto b = std::next(a); b != ids.end(); ++b) {
        if (share_bytes(*a, *b)) {
          return bad(absl::StrCat(StepName(p, i), " touches buffers ", *a, " ('",
                                  p.buffers(*a).tensor(), "') and ", *b, " ('",
                                  p.buffers(*b).tensor(), "'), which share arena bytes"));
        }
      }
    }
    for (int id : ids) {
      auto it = busy.find(id);
      if (it != busy.end()) {
        return bad(absl::StrCat(StepName(p, i), " touches buffer ", id, " ('",
                                p.buffers(id).tensor(), "') of the asynchronous ",
                                StepName(p, it->second), " before its wait"));
      }
      // Nor memory of theirs under another buffer (the arena is shared).
      for (const auto& [other, start] : busy) {
        if (share_bytes(id, other)) {
          return bad(absl::StrCat(
              StepName(p, i), " touches buffer ", id, " ('", p.buffers(id).tensor(),
              "'), which shares arena bytes with buffer ", other, " ('", p.buffers(other).tensor(),
              "') of the asynchronous ", StepName(p, start), " before its wait"));
        }
      }
    }
    if (s.has_collective() && s.collective().async()) {
      for (int id : ids) busy[id] = i;
      running[i] = std::move(ids);
    }
  }
  if (!running.empty()) {
    return bad(
        absl::StrCat("asynchronous ", StepName(p, running.begin()->first), " is never waited for"));
  }
  return absl::OkStatus();
}

std::vector<int> StepBuffers(const v1::Step& step) {
  std::vector<int> ids;
  if (step.has_kernel()) {
    ids.assign(step.kernel().inputs().begin(), step.kernel().inputs().end());
    ids.insert(ids.end(), step.kernel().outputs().begin(), step.kernel().outputs().end());
  } else if (step.has_collective()) {
    const v1::CollectiveCall& c = step.collective();
    ids = {c.input(), c.output()};
    ids.insert(ids.end(), c.coalesced().begin(), c.coalesced().end());
    ids.insert(ids.end(), c.coalesced_outputs().begin(), c.coalesced_outputs().end());
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  if (!ids.empty() && ids.front() == -1) ids.erase(ids.begin());
  return ids;
}

absl::Status ProgramRunner::RunCollectiveStep(int i, Communicator& comm, Staging& staging) {
  const v1::CollectiveCall& c = program_.steps(i).collective();
  std::vector<TensorView> coalesced, coalesced_outputs;
  for (int id : c.coalesced()) coalesced.push_back(views_[id]);
  for (int id : c.coalesced_outputs()) coalesced_outputs.push_back(views_[id]);
  return RunCollective(c, views_[c.input()], views_[c.output()], *device_, comm, staging, coalesced,
                       coalesced_outputs);
}

absl::Status ProgramRunner::StartAsync(int i) {
  if (options_.test_hold_until_wait) {
    const v1::CollectiveCall& c = program_.steps(i).collective();
    std::set<int> inputs = {c.input()};
    const bool in_place = c.collective() == v1::ALL_REDUCE;
    for (int id : c.coalesced()) inputs.insert(id);
    std::vector<int> outputs = {c.output()};
    if (!in_place)
      outputs.insert(outputs.end(), c.coalesced_outputs().begin(), c.coalesced_outputs().end());
    for (int id : outputs) {
      const TensorView& v = views_[id];
      if (inputs.count(id) || (v.dtype != DType::kFloat32 && v.dtype != DType::kFloat64)) {
        continue;
      }
      HAP_RETURN_IF_ERROR(device_->Fill(v, std::nan("")));
    }
    held_[i] = true;
    return absl::OkStatus();
  }
  if (options_.async == nullptr) return RunCollectiveStep(i, *comm_, staging_);
  return options_.async->Start(i, [this, i](Communicator& comm, Staging& staging) {
    return RunCollectiveStep(i, comm, staging);
  });
}

absl::Status ProgramRunner::WaitAsync(int start) {
  auto held = held_.find(start);
  if (held != held_.end()) {
    held_.erase(held);
    if (options_.async == nullptr) return RunCollectiveStep(start, *comm_, staging_);
    HAP_RETURN_IF_ERROR(
        options_.async->Start(start, [this, start](Communicator& comm, Staging& staging) {
          return RunCollectiveStep(start, comm, staging);
        }));
  }
  if (options_.async == nullptr) return absl::OkStatus();
  return options_.async->Wait(start);
}

absl::Status ProgramRunner::FinishAsync() {
  absl::Status first;
  while (!held_.empty()) {
    const int start = held_.begin()->first;
    first.Update(Annotate(WaitAsync(start), StepName(program_, start)));
  }
  if (options_.async != nullptr) first.Update(options_.async->WaitAll());
  return first;
}

absl::Status ProgramRunner::InitializeParameters() {
  for (const v1::Buffer& b : program_.buffers()) {
    const TensorView& v = views_[b.id()];
    if (b.role() == v1::Buffer::OPTIMIZER_STATE) {
      HAP_RETURN_IF_ERROR(device_->Fill(v, 0));
      continue;
    }
    if (b.role() != v1::Buffer::PARAMETER) continue;
    const graph::Tensor& t = graph_.tensor(*graph_.FindTensor(b.tensor()));
    HostTensor host(v.dtype, v.shape);
    uint64_t key = CounterKey(program_.seed(), HashName(t.name));
    Shape global(b.global_shape().begin(), b.global_shape().end());
    std::vector<int64_t> offsets(b.offsets().begin(), b.offsets().end());
    if (v.dtype == DType::kFloat64) {
      FillInit<double>(host, t.init, key, global, offsets);
    } else if (v.dtype == DType::kFloat32) {
      FillInit<float>(host, t.init, key, global, offsets);
    } else {
      return absl::UnimplementedError(absl::StrCat(
          "parameter '", t.name, "' of dtype ", graph::DTypeName(v.dtype)));
    }
    HAP_RETURN_IF_ERROR(device_->CopyFromHost(host.data(), v));
  }
  return absl::OkStatus();
}

absl::Status ProgramRunner::LoadInputs(const Batch& batch) {
  for (const v1::Buffer& b : program_.buffers()) {
    if (b.role() != v1::Buffer::INPUT) continue;
    auto it = batch.find(b.tensor());
    if (it == batch.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the batch has no input '", b.tensor(), "'"));
    }
    const HostTensor& whole = it->second;
    const TensorView& v = views_[b.id()];
    Shape global(b.global_shape().begin(), b.global_shape().end());
    if (whole.shape() != global || whole.dtype() != v.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", b.tensor(), "' is ", graph::DTypeName(whole.dtype()),
          graph::ShapeString(whole.shape()), " but the model expects ",
          graph::DTypeName(v.dtype), graph::ShapeString(global)));
    }
    HostTensor part(v.dtype, v.shape);
    std::vector<int64_t> start(b.offsets().begin(), b.offsets().end());
    HAP_RETURN_IF_ERROR(HostCopyBox(whole.view(), start, part.view(),
                                    std::vector<int64_t>(v.rank(), 0), v.shape));
    HAP_RETURN_IF_ERROR(device_->CopyFromHost(part.data(), v));
  }
  return absl::OkStatus();
}

absl::Status ProgramRunner::RunKernelStep(int index, const v1::KernelCall& k,
                                          int64_t step) {
  if (k.kernel() == "fill") {
    HAP_ASSIGN_OR_RETURN(double v, attrs_[index].Float("value", 0.0));  // checked at Create
    return device_->Fill(views_[k.outputs(0)], v);
  }
  std::vector<TensorView> in, out;
  for (int id : k.inputs()) in.push_back(id >= 0 ? views_[id] : TensorView{});
  for (int id : k.outputs()) out.push_back(id >= 0 ? views_[id] : TensorView{});
  KernelContext ctx;
  ctx.step = step;
  return device_->RunKernel(k.kernel(), ctx, attrs_[index], in, out);
}

absl::StatusOr<double> ProgramRunner::RunStep(const Batch& batch, int64_t step) {
  // A step that failed left its collectives: held ones are dropped, and
  // those still running finish (or fail: the communicator is then unusable,
  // and so is this step) before this step touches the arena.
  HAP_RETURN_IF_ERROR(BeginSteps(step));
  HAP_RETURN_IF_ERROR(LoadInputs(batch));
  HAP_RETURN_IF_ERROR(RunSteps(0, program_.steps_size(), step));
  // Nothing runs across steps: the held collectives (tests) and any not
  // waited for yet complete here.
  HAP_RETURN_IF_ERROR(EndSteps(step));
  HAP_RETURN_IF_ERROR(device_->Synchronize());
  const TensorView& loss = views_[program_.loss_buffer()];
  if (loss.dtype == DType::kFloat64) {
    double v = 0;
    HAP_RETURN_IF_ERROR(device_->CopyToHost(loss, &v));
    return v;
  }
  float v = 0;
  HAP_RETURN_IF_ERROR(device_->CopyToHost(loss, &v));
  return static_cast<double>(v);
}

namespace {

absl::StatusOr<std::vector<ParameterShard>> CopyPersistent(
    const v1::RankProgram& program, const std::vector<TensorView>& views, Device* device,
    bool with_optimizer_state) {
  std::vector<ParameterShard> out;
  for (const v1::Buffer& b : program.buffers()) {
    const bool state = b.role() == v1::Buffer::OPTIMIZER_STATE;
    if (b.role() != v1::Buffer::PARAMETER && !(state && with_optimizer_state)) continue;
    const TensorView& v = views[b.id()];
    ParameterShard s;
    s.name = b.tensor();
    s.global_shape.assign(b.global_shape().begin(), b.global_shape().end());
    s.offsets.assign(b.offsets().begin(), b.offsets().end());
    s.value = HostTensor(v.dtype, v.shape);
    s.optimizer_state = state;
    HAP_RETURN_IF_ERROR(device->CopyToHost(v, s.value.data()));
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

absl::Status ProgramRunner::RunSteps(int begin, int end, int64_t step) {
  for (int i = begin; i < end; ++i) {
    const v1::Step& s = program_.steps(i);
    absl::Status st;
    if (s.has_kernel()) {
      st = RunKernelStep(i, s.kernel(), step);
    } else if (s.has_wait()) {
      if (!options_.test_skip_waits) st = WaitAsync(s.wait().start_step());
    } else if (s.collective().async()) {
      st = StartAsync(i);
    } else {
      st = RunCollectiveStep(i, *comm_, staging_);
    }
    if (!st.ok()) {
      return Annotate(st, absl::StrCat("training step ", step, ", ", StepName(program_, i)));
    }
  }
  return absl::OkStatus();
}

absl::Status ProgramRunner::BeginSteps(int64_t step) {
  held_.clear();
  if (options_.async == nullptr) return absl::OkStatus();
  return Annotate(options_.async->WaitAll(),
                  absl::StrCat("training step ", step, ", before it starts"));
}

absl::Status ProgramRunner::EndSteps(int64_t step) {
  return Annotate(FinishAsync(), absl::StrCat("training step ", step));
}

void ProgramRunner::SetMicrobatch(int m, int microbatches) {
  for (int i = 0; i < program_.steps_size(); ++i) {
    const v1::Step& step = program_.steps(i);
    if (!step.has_kernel()) continue;
    const auto& attrs = step.kernel().attrs();
    auto gs = attrs.find("global_shape");
    auto off = attrs.find("offsets");
    if (attrs.find("rng_key") == attrs.end() || gs == attrs.end() || off == attrs.end() ||
        gs->second.ints().values_size() == 0 || off->second.ints().values_size() == 0) {
      continue;
    }
    std::vector<int64_t> shape(gs->second.ints().values().begin(),
                               gs->second.ints().values().end());
    std::vector<int64_t> offsets(off->second.ints().values().begin(),
                                 off->second.ints().values().end());
    offsets[0] += static_cast<int64_t>(m) * shape[0];
    shape[0] *= microbatches;
    attrs_[i].Set("global_shape", shape);
    attrs_[i].Set("offsets", offsets);
  }
}

void ProgramRunner::OverrideSeed(uint64_t seed) {
  if (seed == program_.seed()) return;
  program_.set_seed(seed);
  for (int i = 0; i < program_.steps_size(); ++i) {
    v1::Step* step = program_.mutable_steps(i);
    if (!step->has_kernel()) continue;
    auto& attrs = *step->mutable_kernel()->mutable_attrs();
    auto it = attrs.find("rng_key");
    if (it == attrs.end()) continue;
    // planner/lower: rng_key = CounterKey(seed, HashName(op name)).
    const auto key = static_cast<int64_t>(CounterKey(seed, HashName(step->kernel().op())));
    it->second.set_i(key);
    attrs_[i].Set("rng_key", key);
  }
}

absl::StatusOr<std::vector<ParameterShard>> ProgramRunner::Parameters() const {
  return CopyPersistent(program_, views_, device_, /*with_optimizer_state=*/false);
}

absl::StatusOr<std::vector<ParameterShard>> ProgramRunner::PersistentState() const {
  return CopyPersistent(program_, views_, device_, /*with_optimizer_state=*/true);
}

absl::Status ProgramRunner::SetPersistentState(
    const std::function<absl::Status(const v1::Buffer&, HostTensor&)>& fill,
    const std::function<bool(const v1::Buffer&)>& select) {
  for (const v1::Buffer& b : program_.buffers()) {
    if (b.role() != v1::Buffer::PARAMETER && b.role() != v1::Buffer::OPTIMIZER_STATE) continue;
    if (select && !select(b)) continue;
    const TensorView& v = views_[b.id()];
    HostTensor host(v.dtype, v.shape);
    HAP_RETURN_IF_ERROR(fill(b, host));
    HAP_RETURN_IF_ERROR(device_->CopyFromHost(host.data(), v));
  }
  return absl::OkStatus();
}

}  // namespace hap::executor
