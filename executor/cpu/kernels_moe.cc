// Mixture-of-experts kernels (GShard formulation): the top-k gate producing
// combine weights [tokens, experts, capacity], and the dispatch and combine
// einsums around the experts. Dispatch and combine walk the nonzero entries
// of `combine` (at most k per token) instead of multiplying dense one-hots.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "executor/cpu/kernels_internal.h"
#include "planner/util/status_macros.h"

namespace hap::executor::cpu {
namespace {

// --- moe_gate ---------------------------------------------------------------------

struct GateDims {
  int64_t tokens = 0, experts = 0, k = 2, capacity = 1;
};

absl::StatusOr<GateDims> CheckGate(const KernelArgs& a, DType t) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  if (a.in[0].rank() != 2) return Invalid(a, InLabel(a, 0), " must be [tokens, experts]");
  GateDims d;
  d.tokens = a.in[0].shape[0];
  d.experts = a.in[0].shape[1];
  HAP_ASSIGN_OR_RETURN(d.k, AttrInt(a, "k", 2));
  HAP_ASSIGN_OR_RETURN(d.capacity, AttrInt(a, "capacity"));
  if (d.k < 1 || d.k > d.experts) {
    return Invalid(a, "attribute 'k' = ", d.k, " must be in [1, experts = ",
                   d.experts, "]");
  }
  if (d.capacity < 1) return Invalid(a, "attribute 'capacity' must be >= 1");
  return d;
}

// One token's routing: its softmax over experts, its top-k experts (by
// probability, ties to the lower index) with their weights (renormalised
// over the k when k > 1), and the slot each landed in (-1: dropped).
struct TokenRoute {
  std::vector<double> probs;
  std::vector<int64_t> experts, slots;
  std::vector<double> weights;
  double top_sum = 0;
};

// Routes every token in order; each takes the next free slot of each of its
// experts (in top-k order) while the expert has capacity.
template <typename T>
std::vector<TokenRoute> Route(const GateDims& d, const T* logits) {
  std::vector<TokenRoute> routes(d.tokens);
  std::vector<int64_t> fill(d.experts, 0);
  std::vector<int64_t> order(d.experts);
  for (int64_t t = 0; t < d.tokens; ++t) {
    TokenRoute& r = routes[t];
    const T* row = logits + t * d.experts;
    const double mx = *std::max_element(row, row + d.experts);
    r.probs.resize(d.experts);
    double sum = 0;
    for (int64_t e = 0; e < d.experts; ++e) {
      r.probs[e] = std::exp(row[e] - mx);
      sum += r.probs[e];
    }
    for (double& p : r.probs) p /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + d.k, order.end(),
                      [&](int64_t x, int64_t y) {
                        return r.probs[x] > r.probs[y] ||
                               (r.probs[x] == r.probs[y] && x < y);
                      });
    r.experts.assign(order.begin(), order.begin() + d.k);
    for (int64_t e : r.experts) r.top_sum += r.probs[e];
    for (int64_t e : r.experts) {
      r.weights.push_back(d.k > 1 ? r.probs[e] / r.top_sum : r.probs[e]);
      r.slots.push_back(fill[e] < d.capacity ? fill[e]++ : -1);
    }
  }
  return routes;
}

template <typename T>
absl::Status GateForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t));
  HAP_RETURN_IF_ERROR(
      CheckOutput(a, 0, t, {d.tokens, d.experts, d.capacity}));
  T* combine = a.out[0].as<T>();
  std::fill(combine, combine + a.out[0].num_elements(), T(0));
  std::vector<TokenRoute> routes = Route(d, a.in[0].as<const T>());
  for (int64_t tok = 0; tok < d.tokens; ++tok) {
    const TokenRoute& r = routes[tok];
    for (int64_t j = 0; j < d.k; ++j) {
      if (r.slots[j] < 0) continue;
      combine[(tok * d.experts + r.experts[j]) * d.capacity + r.slots[j]] =
          static_cast<T>(r.weights[j]);
    }
  }
  return absl::OkStatus();
}

// Through the placed entries' weights: w_j = p_j / S (k > 1, S the top-k
// sum) or p_j (k = 1), then the softmax.
template <typename T>
absl::Status GateBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {{d.tokens, d.experts, d.capacity}}));
  if (!g.active()) return absl::OkStatus();
  const T* dcombine = g.dy(0).as<const T>();
  T* dlogits = g.dx(0).as<T>();
  std::vector<TokenRoute> routes = Route(d, g.x(0).as<const T>());
  std::vector<double> dp(d.experts);
  for (int64_t tok = 0; tok < d.tokens; ++tok) {
    const TokenRoute& r = routes[tok];
    std::fill(dp.begin(), dp.end(), 0.0);
    std::vector<double> gw(d.k, 0.0);  // d loss / d w_j
    double gw_dot_p = 0;
    for (int64_t j = 0; j < d.k; ++j) {
      if (r.slots[j] >= 0) {
        gw[j] = dcombine[(tok * d.experts + r.experts[j]) * d.capacity +
                         r.slots[j]];
      }
      gw_dot_p += gw[j] * r.probs[r.experts[j]];
    }
    for (int64_t j = 0; j < d.k; ++j) {
      dp[r.experts[j]] =
          d.k > 1 ? gw[j] / r.top_sum - gw_dot_p / (r.top_sum * r.top_sum)
                  : gw[j];
    }
    double dot = 0;
    for (int64_t e = 0; e < d.experts; ++e) dot += dp[e] * r.probs[e];
    T* dl = dlogits + tok * d.experts;
    for (int64_t e = 0; e < d.experts; ++e) {
      dl[e] += static_cast<T>(r.probs[e] * (dp[e] - dot));
    }
  }
  return absl::OkStatus();
}

// --- moe_dispatch, moe_combine ----------------------------------------------------

// The nonzero entries of combine[t, e, c], indexed both by token and by slot
// (s = e * capacity + c).
struct Routes {
  std::vector<int64_t> tok_begin;   // [tokens + 1] into tok_slot
  std::vector<int64_t> tok_slot;
  std::vector<int64_t> slot_begin;  // [slots + 1] into slot_tok
  std::vector<int64_t> slot_tok;
};

template <typename T>
Routes Nonzeros(const T* combine, int64_t tokens, int64_t slots) {
  Routes r;
  r.tok_begin.push_back(0);
  std::vector<int64_t> count(slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const T* row = combine + t * slots;
    for (int64_t s = 0; s < slots; ++s) {
      if (row[s] != T(0)) {
        r.tok_slot.push_back(s);
        ++count[s + 1];
      }
    }
    r.tok_begin.push_back(static_cast<int64_t>(r.tok_slot.size()));
  }
  std::partial_sum(count.begin(), count.end(), count.begin());
  r.slot_begin = count;
  r.slot_tok.resize(r.tok_slot.size());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = r.tok_begin[t]; i < r.tok_begin[t + 1]; ++i) {
      r.slot_tok[count[r.tok_slot[i]]++] = t;
    }
  }
  return r;
}

struct MoeDims {
  int64_t tokens = 0, experts = 0, capacity = 0, d = 0;
  int64_t slots() const { return experts * capacity; }
};

// moe_dispatch: x[t, d], combine[t, e, c]; moe_combine: y[e, c, d],
// combine[t, e, c].
absl::StatusOr<MoeDims> CheckMoe(const KernelArgs& a, DType t, bool combine) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_RETURN_IF_ERROR(CheckInput(a, 1, t));
  const Shape& x = a.in[0].shape;
  const Shape& c = a.in[1].shape;
  MoeDims m;
  bool ok = c.size() == 3;
  if (ok) {
    m.tokens = c[0];
    m.experts = c[1];
    m.capacity = c[2];
  }
  if (combine) {
    ok = ok && x.size() == 3 && x[0] == m.experts && x[1] == m.capacity;
  } else {
    ok = ok && x.size() == 2 && x[0] == m.tokens;
  }
  if (!ok) {
    return Invalid(a, InLabel(a, 0), " does not fit combine weights ",
                   InLabel(a, 1));
  }
  m.d = x.back();
  return m;
}

template <typename T>
absl::Status DispatchForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MoeDims m, CheckMoe(a, t, false));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, {m.experts, m.capacity, m.d}));
  Routes r = Nonzeros(a.in[1].as<const T>(), m.tokens, m.slots());
  const T* x = a.in[0].as<const T>();
  T* y = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, m.slots(), GrainFor(m.d),
              [&](int64_t b, int64_t e) {
                for (int64_t s = b; s < e; ++s) {
                  T* ys = y + s * m.d;
                  std::fill(ys, ys + m.d, T(0));
                  for (int64_t i = r.slot_begin[s]; i < r.slot_begin[s + 1]; ++i) {
                    AddTo(ys, x + r.slot_tok[i] * m.d, m.d);
                  }
                }
              });
  return absl::OkStatus();
}

template <typename T>
absl::Status DispatchBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 2, 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  HAP_ASSIGN_OR_RETURN(MoeDims m, CheckMoe(a, t, false));
  HAP_RETURN_IF_ERROR(g.Check(t, {{m.experts, m.capacity, m.d}}));
  if (!g.active()) return absl::OkStatus();
  Routes r = Nonzeros(g.x(1).as<const T>(), m.tokens, m.slots());
  const T* dy = g.dy(0).as<const T>();
  T* dx = g.dx(0).as<T>();
  ParallelFor(a.ctx.num_threads, m.tokens, GrainFor(m.d),
              [&](int64_t b, int64_t e) {
                for (int64_t tok = b; tok < e; ++tok) {
                  for (int64_t i = r.tok_begin[tok]; i < r.tok_begin[tok + 1]; ++i) {
                    AddTo(dx + tok * m.d, dy + r.tok_slot[i] * m.d, m.d);
                  }
                }
              });
  return absl::OkStatus();
}

template <typename T>
absl::Status CombineForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MoeDims m, CheckMoe(a, t, true));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, {m.tokens, m.d}));
  const T* y = a.in[0].as<const T>();
  const T* combine = a.in[1].as<const T>();
  Routes r = Nonzeros(combine, m.tokens, m.slots());
  T* out = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, m.tokens, GrainFor(m.d),
              [&](int64_t b, int64_t e) {
                for (int64_t tok = b; tok < e; ++tok) {
                  T* o = out + tok * m.d;
                  std::fill(o, o + m.d, T(0));
                  for (int64_t i = r.tok_begin[tok]; i < r.tok_begin[tok + 1]; ++i) {
                    const int64_t s = r.tok_slot[i];
                    const T w = combine[tok * m.slots() + s];
                    const T* ys = y + s * m.d;
                    for (int64_t j = 0; j < m.d; ++j) o[j] += w * ys[j];
                  }
                }
              });
  return absl::OkStatus();
}

// dy[s] += sum_t combine[t, s] * dout[t] (nonzeros only);
// dcombine[t, s] += dout[t] . y[s] for every entry (a GEMM).
template <typename T>
absl::Status CombineBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MoeDims m, CheckMoe(a, t, true));
  HAP_RETURN_IF_ERROR(g.Check(t, {{m.tokens, m.d}}));
  if (!g.dy(0).present()) return absl::OkStatus();
  const T* y = g.x(0).as<const T>();
  const T* combine = g.x(1).as<const T>();
  const T* dout = g.dy(0).as<const T>();
  if (g.dx(0).present()) {
    Routes r = Nonzeros(combine, m.tokens, m.slots());
    T* dy = g.dx(0).as<T>();
    ParallelFor(a.ctx.num_threads, m.slots(), GrainFor(m.d),
                [&](int64_t b, int64_t e) {
                  for (int64_t s = b; s < e; ++s) {
                    T* ds = dy + s * m.d;
                    for (int64_t i = r.slot_begin[s]; i < r.slot_begin[s + 1]; ++i) {
                      const int64_t tok = r.slot_tok[i];
                      const T w = combine[tok * m.slots() + s];
                      const T* go = dout + tok * m.d;
                      for (int64_t j = 0; j < m.d; ++j) ds[j] += w * go[j];
                    }
                  }
                });
  }
  if (g.dx(1).present()) {
    HAP_RETURN_IF_ERROR(CheckFitsBlas(a, {m.tokens, m.slots(), m.d}));
    Gemm<T>(false, true, m.tokens, m.slots(), m.d, T(1), dout, m.d, y, m.d,
            T(1), g.dx(1).as<T>(), m.slots());
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterMoeKernels(KernelTable& t) {
  t["moe_gate"] = HAP_FLOAT_KERNEL(GateForward);
  t["moe_gate_grad"] = HAP_FLOAT_KERNEL(GateBackward);
  t["moe_dispatch"] = HAP_FLOAT_KERNEL(DispatchForward);
  t["moe_dispatch_grad"] = HAP_FLOAT_KERNEL(DispatchBackward);
  t["moe_combine"] = HAP_FLOAT_KERNEL(CombineForward);
  t["moe_combine_grad"] = HAP_FLOAT_KERNEL(CombineBackward);
}

}  // namespace hap::executor::cpu
