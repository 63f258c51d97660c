#include "executor/runtime/collective_call.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;

std::vector<int64_t> Offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) off[i] = off[i - 1] + sizes[i - 1];
  return off;
}

// The view of `v` with dimension `dim` replaced by `len`, at `data`.
TensorView WithDim(const TensorView& v, int dim, int64_t len, void* data) {
  TensorView t = v;
  t.shape[dim] = len;
  t.data = data;
  return t;
}

char* At(void* base, int64_t bytes) { return static_cast<char*>(base) + bytes; }

CommMethod Method(const v1::CollectiveCall& c) {
  return c.method() == v1::GROUPED ? CommMethod::kGrouped : CommMethod::kPadded;
}

// Elements before dimension `dim` (the number of chunks a shard along `dim`
// breaks into in row-major order).
int64_t Outer(const TensorView& v, int dim) {
  int64_t n = 1;
  for (int d = 0; d < dim; ++d) n *= v.shape[d];
  return n;
}

// Elements of each rank's chunk: its shard length times the elements of
// one slice along `dim` of the whole tensor.
std::vector<int64_t> Counts(const TensorView& whole, int dim,
                            const std::vector<int64_t>& sizes) {
  const int64_t per = whole.num_elements() / (whole.shape[dim] == 0 ? 1 : whole.shape[dim]);
  std::vector<int64_t> counts;
  for (int64_t s : sizes) counts.push_back(s * per);
  return counts;
}

// Copies between the whole tensor and `buf`, which holds every rank's shard
// along `dim` as one contiguous chunk in rank order: into the chunks
// (`to_chunks`) or back out of them.
absl::Status Restage(const TensorView& whole, int dim, const std::vector<int64_t>& sizes,
                     void* buf, bool to_chunks, Device& dev) {
  std::vector<int64_t> off = Offsets(sizes);
  std::vector<int64_t> counts = Counts(whole, dim, sizes);
  const int64_t esize = graph::DTypeBytes(whole.dtype);
  int64_t at = 0;
  for (size_t r = 0; r < sizes.size(); ++r) {
    TensorView chunk = WithDim(whole, dim, sizes[r], At(buf, at * esize));
    std::vector<int64_t> zero(whole.rank(), 0), start(whole.rank(), 0);
    start[dim] = off[r];
    HAP_RETURN_IF_ERROR(to_chunks ? dev.CopyBox(whole, start, chunk, zero, chunk.shape)
                                  : dev.CopyBox(chunk, zero, whole, start, chunk.shape));
    at += counts[r];
  }
  return absl::OkStatus();
}

absl::Status AllGather(const v1::CollectiveCall& c, TensorView in, TensorView out,
                       Device& dev, Communicator& comm, Staging& st) {
  const int dim = c.dim();
  std::vector<int64_t> sizes(c.shard_sizes().begin(), c.shard_sizes().end());
  std::vector<int64_t> counts = Counts(out, dim, sizes);
  if (Outer(out, dim) == 1) return comm.AllGather(in, out, counts, Method(c));
  HAP_ASSIGN_OR_RETURN(void* buf, st.Get(0, out.bytes()));
  TensorView flat{out.dtype, {out.num_elements()}, buf};
  HAP_RETURN_IF_ERROR(comm.AllGather(in, flat, counts, Method(c)));
  return Restage(out, dim, sizes, buf, /*to_chunks=*/false, dev);
}

absl::Status ReduceScatter(const v1::CollectiveCall& c, TensorView in,
                           TensorView out, Device& dev, Communicator& comm,
                           Staging& st) {
  const int dim = c.dim();
  std::vector<int64_t> sizes(c.shard_sizes().begin(), c.shard_sizes().end());
  std::vector<int64_t> counts = Counts(in, dim, sizes);
  if (Outer(in, dim) == 1) return comm.ReduceScatter(in, out, counts, Method(c));
  HAP_ASSIGN_OR_RETURN(void* buf, st.Get(0, in.bytes()));
  HAP_RETURN_IF_ERROR(Restage(in, dim, sizes, buf, /*to_chunks=*/true, dev));
  TensorView flat{in.dtype, {in.num_elements()}, buf};
  return comm.ReduceScatter(flat, out, counts, Method(c));
}

// in: S(from_dim) with to-dim whole; out: S(to_dim) with from-dim whole.
absl::Status AllToAll(const v1::CollectiveCall& c, TensorView in, TensorView out,
                      Device& dev, Communicator& comm, Staging& st) {
  const int to = c.dim(), from = c.from_dim();
  std::vector<int64_t> to_sizes(c.shard_sizes().begin(), c.shard_sizes().end());
  std::vector<int64_t> from_sizes(c.from_shard_sizes().begin(),
                                  c.from_shard_sizes().end());
  std::vector<int64_t> to_off = Offsets(to_sizes), from_off = Offsets(from_sizes);
  const int n = static_cast<int>(to_sizes.size());
  const int64_t esize = graph::DTypeBytes(in.dtype);
  HAP_ASSIGN_OR_RETURN(void* send, st.Get(0, in.bytes()));
  HAP_ASSIGN_OR_RETURN(void* recv, st.Get(1, out.bytes()));
  std::vector<int64_t> send_counts, recv_counts;
  int64_t at = 0;
  for (int r = 0; r < n; ++r) {  // rank r gets its to-dim range of my shard
    TensorView chunk = WithDim(in, to, to_sizes[r], At(send, at * esize));
    std::vector<int64_t> src(in.rank(), 0), zero(in.rank(), 0);
    src[to] = to_off[r];
    HAP_RETURN_IF_ERROR(dev.CopyBox(in, src, chunk, zero, chunk.shape));
    send_counts.push_back(chunk.num_elements());
    at += chunk.num_elements();
  }
  for (int r = 0; r < n; ++r) {
    recv_counts.push_back(WithDim(out, from, from_sizes[r], nullptr).num_elements());
  }
  TensorView send_v{in.dtype, {in.num_elements()}, send};
  TensorView recv_v{out.dtype, {out.num_elements()}, recv};
  HAP_RETURN_IF_ERROR(comm.AllToAll(send_v, send_counts, recv_v, recv_counts));
  at = 0;
  for (int r = 0; r < n; ++r) {  // rank r's from-dim shard of my to-range
    TensorView chunk = WithDim(out, from, from_sizes[r], At(recv, at * esize));
    std::vector<int64_t> dst(out.rank(), 0), zero(out.rank(), 0);
    dst[from] = from_off[r];
    HAP_RETURN_IF_ERROR(dev.CopyBox(chunk, zero, out, dst, chunk.shape));
    at += recv_counts[r];
  }
  return absl::OkStatus();
}

// Sums `first` and every buffer of `rest` over ranks in one call: packed
// into the send staging region, all-reduced, copied back.
absl::Status CoalescedAllReduce(TensorView first, absl::Span<const TensorView> rest,
                                Device& dev, Communicator& comm, Staging& st) {
  std::vector<TensorView> all = {first};
  all.insert(all.end(), rest.begin(), rest.end());
  int64_t total = 0;
  for (const TensorView& v : all) total += v.num_elements();
  const int64_t esize = graph::DTypeBytes(first.dtype);
  HAP_ASSIGN_OR_RETURN(void* packed, st.Get(0, std::max<int64_t>(total * esize, 1)));
  TensorView bucket{first.dtype, {total}, packed};
  auto flat = [](const TensorView& v) {
    return TensorView{v.dtype, {v.num_elements()}, v.data};
  };
  int64_t at = 0;
  for (const TensorView& v : all) {
    HAP_RETURN_IF_ERROR(dev.CopyBox(flat(v), {0}, bucket, {at}, {v.num_elements()}));
    at += v.num_elements();
  }
  HAP_RETURN_IF_ERROR(comm.AllReduce(bucket));
  at = 0;
  for (const TensorView& v : all) {
    HAP_RETURN_IF_ERROR(dev.CopyBox(bucket, {at}, flat(v), {0}, {v.num_elements()}));
    at += v.num_elements();
  }
  return absl::OkStatus();
}

// One tensor of a coalesced dim-0 ALL_GATHER / REDUCE_SCATTER: the whole
// tensor, this rank's shard, every rank's length along dim 0, and elements
// per dim-0 row.
struct Dim0Member {
  TensorView whole, part;
  std::vector<int64_t> sizes, offsets;
  int64_t row = 1;
};

std::vector<Dim0Member> Dim0Members(const v1::CollectiveCall& c, TensorView whole,
                                    TensorView part,
                                    absl::Span<const TensorView> wholes,
                                    absl::Span<const TensorView> parts) {
  const size_t world = c.shard_sizes_size();
  std::vector<Dim0Member> m;
  auto add = [&](const TensorView& w, const TensorView& p, std::vector<int64_t> sizes) {
    Dim0Member x;
    x.whole = TensorView{w.dtype, {w.num_elements()}, w.data};
    x.part = TensorView{p.dtype, {p.num_elements()}, p.data};
    x.row = w.shape.empty() || w.shape[0] == 0 ? 1 : w.num_elements() / w.shape[0];
    x.offsets = Offsets(sizes);
    x.sizes = std::move(sizes);
    m.push_back(std::move(x));
  };
  add(whole, part, {c.shard_sizes().begin(), c.shard_sizes().end()});
  for (size_t i = 0; i < wholes.size(); ++i) {
    auto from = c.coalesced_shard_sizes().begin() + i * world;
    add(wholes[i], parts[i], {from, from + world});
  }
  return m;
}

// Elements of rank r's chunk of the flat transfer: its shard of every member.
std::vector<int64_t> Dim0Counts(const std::vector<Dim0Member>& m) {
  std::vector<int64_t> counts(m.front().sizes.size(), 0);
  for (const Dim0Member& x : m) {
    for (size_t r = 0; r < counts.size(); ++r) counts[r] += x.sizes[r] * x.row;
  }
  return counts;
}

// Copies rank r's rows of every member between the wholes and `flat` (whose
// chunk for rank r starts at element `at`): into the chunk or out of it.
absl::Status Dim0Restage(const std::vector<Dim0Member>& m, size_t r, TensorView flat,
                         int64_t at, bool to_chunk, Device& dev) {
  for (const Dim0Member& x : m) {
    const int64_t n = x.sizes[r] * x.row, off = x.offsets[r] * x.row;
    if (n > 0) {
      HAP_RETURN_IF_ERROR(to_chunk ? dev.CopyBox(x.whole, {off}, flat, {at}, {n})
                                   : dev.CopyBox(flat, {at}, x.whole, {off}, {n}));
    }
    at += n;
  }
  return absl::OkStatus();
}

// One call for every member: gather (ALL_GATHER) puts each member's shards
// into its whole tensor; otherwise (REDUCE_SCATTER) each member's whole
// tensor is summed over ranks into this rank's shard of it.
absl::Status CoalescedDim0(const v1::CollectiveCall& c, TensorView whole, TensorView part,
                           absl::Span<const TensorView> wholes,
                           absl::Span<const TensorView> parts, bool gather, Device& dev,
                           Communicator& comm, Staging& st) {
  std::vector<Dim0Member> m = Dim0Members(c, whole, part, wholes, parts);
  std::vector<int64_t> counts = Dim0Counts(m);
  const int64_t mine = counts[comm.rank()];
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  const int64_t es = graph::DTypeBytes(whole.dtype);
  // Every rank's chunk in rank order, and this rank's chunk.
  HAP_ASSIGN_OR_RETURN(void* all, st.Get(0, std::max<int64_t>(total * es, 1)));
  HAP_ASSIGN_OR_RETURN(void* own, st.Get(1, std::max<int64_t>(mine * es, 1)));
  TensorView all_v{whole.dtype, {total}, all};
  TensorView own_v{whole.dtype, {mine}, own};
  auto restage_all = [&](bool to_chunk) -> absl::Status {
    int64_t at = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      HAP_RETURN_IF_ERROR(Dim0Restage(m, r, all_v, at, to_chunk, dev));
      at += counts[r];
    }
    return absl::OkStatus();
  };
  auto restage_own = [&](bool to_chunk) -> absl::Status {
    int64_t at = 0;
    for (const Dim0Member& x : m) {
      const int64_t n = x.part.num_elements();
      if (n > 0) {
        HAP_RETURN_IF_ERROR(to_chunk ? dev.CopyBox(x.part, {0}, own_v, {at}, {n})
                                     : dev.CopyBox(own_v, {at}, x.part, {0}, {n}));
      }
      at += n;
    }
    return absl::OkStatus();
  };
  if (gather) {
    HAP_RETURN_IF_ERROR(restage_own(/*to_chunk=*/true));
    HAP_RETURN_IF_ERROR(comm.AllGather(own_v, all_v, counts, Method(c)));
    return restage_all(/*to_chunk=*/false);
  }
  HAP_RETURN_IF_ERROR(restage_all(/*to_chunk=*/true));
  HAP_RETURN_IF_ERROR(comm.ReduceScatter(all_v, own_v, counts, Method(c)));
  return restage_own(/*to_chunk=*/false);
}

// The communicator seen through bf16 on the wire (CollectiveCall.wire_dtype
// BFLOAT16): AllReduce and ReduceScatter of float32 views round them into
// bf16 staging (regions 2 and 3), run `inner`'s bf16 sum and widen the
// result back; the other collectives are not sums and pass through.
class Bf16Wire final : public Communicator {
 public:
  Bf16Wire(Communicator& inner, Device& dev, Staging& st) : inner_(inner), dev_(dev), st_(st) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  absl::Status AllReduce(TensorView buf) override {
    HAP_ASSIGN_OR_RETURN(TensorView wire, Narrow(buf, 2));
    HAP_RETURN_IF_ERROR(inner_.AllReduce(wire));
    return dev_.Convert(wire, Flat(buf));
  }
  absl::Status ReduceScatter(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                             CommMethod method) override {
    HAP_ASSIGN_OR_RETURN(TensorView wire_in, Narrow(in, 2));
    HAP_ASSIGN_OR_RETURN(void* o, st_.Get(3, std::max<int64_t>(out.num_elements() * 2, 1)));
    TensorView wire_out{DType::kBFloat16, {out.num_elements()}, o};
    HAP_RETURN_IF_ERROR(inner_.ReduceScatter(wire_in, wire_out, counts, method));
    return dev_.Convert(wire_out, Flat(out));
  }
  absl::Status AllGather(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                         CommMethod method) override {
    return inner_.AllGather(in, out, counts, method);
  }
  absl::Status AllToAll(TensorView in, absl::Span<const int64_t> send_counts, TensorView out,
                        absl::Span<const int64_t> recv_counts) override {
    return inner_.AllToAll(in, send_counts, out, recv_counts);
  }
  absl::Status Broadcast(TensorView buf, int root) override {
    return inner_.Broadcast(buf, root);
  }
  absl::Status Reduce(TensorView in, TensorView out, int root) override {
    return inner_.Reduce(in, out, root);
  }
  absl::Status Barrier() override { return inner_.Barrier(); }

 private:
  static TensorView Flat(const TensorView& v) {
    return TensorView{v.dtype, {v.num_elements()}, v.data};
  }
  // `v` (float32) rounded to bf16 into staging region `which`.
  absl::StatusOr<TensorView> Narrow(const TensorView& v, int which) {
    if (v.dtype != DType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "wire dtype BFLOAT16 needs float32 buffers, got ", graph::DTypeName(v.dtype)));
    }
    HAP_ASSIGN_OR_RETURN(void* w, st_.Get(which, std::max<int64_t>(v.num_elements() * 2, 1)));
    TensorView wire{DType::kBFloat16, {v.num_elements()}, w};
    HAP_RETURN_IF_ERROR(dev_.Convert(Flat(v), wire));
    return wire;
  }
  Communicator& inner_;
  Device& dev_;
  Staging& st_;
};

}  // namespace

Staging::~Staging() {
  for (void* b : buf_) {
    if (b) device_->Free(b);
  }
}

absl::StatusOr<void*> Staging::Get(int which, int64_t bytes) {
  if (which < 0 || which >= kRegions) {
    return absl::InternalError(absl::StrCat("staging region ", which, " does not exist"));
  }
  if (bytes > size_[which] || buf_[which] == nullptr) {
    if (buf_[which]) device_->Free(buf_[which]);
    buf_[which] = nullptr;
    size_[which] = 0;
    HAP_ASSIGN_OR_RETURN(buf_[which], device_->Allocate(bytes));
    size_[which] = bytes;
  }
  return buf_[which];
}

absl::Status RunCollective(const v1::CollectiveCall& c, TensorView in,
                           TensorView out, Device& dev, Communicator& comm,
                           Staging& st, absl::Span<const TensorView> coalesced,
                           absl::Span<const TensorView> coalesced_outputs) {
  absl::Status s;
  std::optional<Bf16Wire> bf16;
  if (c.wire_dtype() == v1::BFLOAT16) {
    if (c.collective() != v1::ALL_REDUCE && c.collective() != v1::REDUCE_SCATTER) {
      return absl::InvalidArgumentError(absl::StrCat(
          v1::Collective_Name(c.collective()), " of '", c.tensor(),
          "': wire dtype BFLOAT16 is for ALL_REDUCE and REDUCE_SCATTER (sums) only"));
    }
    bf16.emplace(comm, dev, st);
  } else if (c.wire_dtype() != v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat(v1::Collective_Name(c.collective()), " of '", c.tensor(), "': wire dtype ",
                     v1::DType_Name(c.wire_dtype()), " is not supported (BFLOAT16 only)"));
  }
  Communicator& wire = bf16 ? static_cast<Communicator&>(*bf16) : comm;
  switch (c.collective()) {
    case v1::ALL_REDUCE:
      if (in.data != out.data) {
        s = dev.CopyBox(in, std::vector<int64_t>(in.rank(), 0), out,
                        std::vector<int64_t>(out.rank(), 0), out.shape);
      }
      if (!s.ok()) break;
      if (coalesced.empty()) {
        s = wire.AllReduce(out);
      } else {
        s = CoalescedAllReduce(out, coalesced, dev, wire, st);
      }
      break;
    case v1::ALL_GATHER:
      s = coalesced.empty() ? AllGather(c, in, out, dev, comm, st)
                            : CoalescedDim0(c, out, in, coalesced_outputs, coalesced,
                                            /*gather=*/true, dev, comm, st);
      break;
    case v1::REDUCE_SCATTER:
      s = coalesced.empty() ? ReduceScatter(c, in, out, dev, wire, st)
                            : CoalescedDim0(c, in, out, coalesced, coalesced_outputs,
                                            /*gather=*/false, dev, wire, st);
      break;
    case v1::ALL_TO_ALL:
      s = AllToAll(c, in, out, dev, comm, st);
      break;
    default:
      s = absl::UnimplementedError(absl::StrCat(
          "collective ", v1::Collective_Name(c.collective()), " in a program"));
  }
  return Annotate(s, absl::StrCat(v1::Collective_Name(c.collective()), " of '",
                                  c.tensor(), "'"));
}

}  // namespace hap::executor
