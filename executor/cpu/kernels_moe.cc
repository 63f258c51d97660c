// Mixture-of-experts kernels (GShard formulation): the top-k gate producing
// combine weights [tokens, experts, capacity], and the dispatch and combine
// einsums around the experts. Dispatch and combine walk the nonzero entries
// of `combine` (at most k per token) instead of multiplying dense one-hots.
// The compact form has the same routing without the dense tensor: moe_route
// (int64 slot indices [tokens, k]), moe_route_weights ([tokens, k]) and the
// index gather/scatter moe_dispatch_idx / moe_combine_idx.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"

namespace hap::executor::cpu {
namespace {

// --- moe_gate ---------------------------------------------------------------------

struct GateDims {
  int64_t tokens = 0, experts = 0, k = 2, capacity = 1;
  // Grouped routing (moe_route's "group_size"): tokens route in runs of
  // `group`, each run q (counted from `first_group`) filling slots
  // [q * group_capacity, (q + 1) * group_capacity) of every expert. One
  // group of all tokens by default.
  int64_t group = 0, group_capacity = 0, first_group = 0;
};

absl::StatusOr<GateDims> CheckGate(const KernelArgs& a, DType t,
                                   bool capacity = true) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  if (a.in[0].rank() != 2) return Invalid(a, InLabel(a, 0), " must be [tokens, experts]");
  GateDims d;
  d.tokens = a.in[0].shape[0];
  d.experts = a.in[0].shape[1];
  HAP_ASSIGN_OR_RETURN(d.k, AttrInt(a, "k", 2));
  if (capacity) {
    HAP_ASSIGN_OR_RETURN(d.capacity, AttrInt(a, "capacity"));
  }
  if (d.k < 1 || d.k > d.experts) {
    return Invalid(a, "attribute 'k' = ", d.k, " must be in [1, experts = ",
                   d.experts, "]");
  }
  if (d.capacity < 1) return Invalid(a, "attribute 'capacity' must be >= 1");
  d.group = d.tokens;
  d.group_capacity = d.capacity;
  return d;
}

absl::Status GroupRoute(const KernelArgs& a, GateDims& d) {
  HAP_ASSIGN_OR_RETURN(MoeGroups g, CheckMoeGroups(a, d.tokens, d.capacity));
  d.group = g.group;
  d.group_capacity = g.group_capacity;
  d.first_group = g.first_group;
  return absl::OkStatus();
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
// experts (in top-k order) while the expert has capacity (in its group:
// GateDims' groups; slots then count from the group's first).
template <typename T>
std::vector<TokenRoute> Route(const GateDims& d, const T* logits) {
  std::vector<TokenRoute> routes(d.tokens);
  std::vector<int64_t> fill(d.experts, 0);
  std::vector<int64_t> order(d.experts);
  for (int64_t t = 0; t < d.tokens; ++t) {
    if (t > 0 && t % d.group == 0) std::fill(fill.begin(), fill.end(), 0);
    const int64_t base = (d.first_group + t / d.group) * d.group_capacity;
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
    // Probability descending, a NaN (from a NaN or infinite logit) below
    // every number so that the order is total, ties to the lower index (as
    // executor/cuda/kernels_b_index.h TopK).
    auto key = [&](int64_t e) { return std::isnan(r.probs[e]) ? -1.0 : r.probs[e]; };
    std::partial_sort(order.begin(), order.begin() + d.k, order.end(), [&](int64_t x, int64_t y) {
      return key(x) > key(y) || (key(x) == key(y) && x < y);
    });
    r.experts.assign(order.begin(), order.begin() + d.k);
    for (int64_t e : r.experts) r.top_sum += r.probs[e];
    for (int64_t e : r.experts) {
      r.weights.push_back(d.k > 1 ? r.probs[e] / r.top_sum : r.probs[e]);
      r.slots.push_back(fill[e] < d.group_capacity ? base + fill[e]++ : -1);
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

// dl[e] += d loss / d logit e of one token, given gw[j] = d loss / d w_j:
// through w_j = p_j / S (k > 1, S the top-k sum) or p_j (k = 1), then the
// softmax. dp is scratch of `experts` entries.
template <typename T>
void WeightsGrad(const GateDims& d, const TokenRoute& r,
                 const std::vector<double>& gw, std::vector<double>& dp,
                 T* dl) {
  std::fill(dp.begin(), dp.end(), 0.0);
  double gw_dot_p = 0;
  for (int64_t j = 0; j < d.k; ++j) gw_dot_p += gw[j] * r.probs[r.experts[j]];
  for (int64_t j = 0; j < d.k; ++j) {
    dp[r.experts[j]] =
        d.k > 1 ? gw[j] / r.top_sum - gw_dot_p / (r.top_sum * r.top_sum)
                : gw[j];
  }
  double dot = 0;
  for (int64_t e = 0; e < d.experts; ++e) dot += dp[e] * r.probs[e];
  for (int64_t e = 0; e < d.experts; ++e) {
    dl[e] += static_cast<T>(r.probs[e] * (dp[e] - dot));
  }
}

// Through the placed entries' weights (WeightsGrad; dropped ones get none).
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
    std::vector<double> gw(d.k, 0.0);  // d loss / d w_j
    for (int64_t j = 0; j < d.k; ++j) {
      if (r.slots[j] >= 0) {
        gw[j] = dcombine[(tok * d.experts + r.experts[j]) * d.capacity +
                         r.slots[j]];
      }
    }
    WeightsGrad(d, r, gw, dp, dlogits + tok * d.experts);
  }
  return absl::OkStatus();
}

// --- the compact form: moe_route, moe_route_weights -------------------------------

// route[t, j] = expert * capacity + slot of choice j, -1 when dropped.
template <typename T>
absl::Status RouteForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t));
  HAP_RETURN_IF_ERROR(GroupRoute(a, d));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, DType::kInt64, {d.tokens, d.k}));
  int64_t* route = a.out[0].as<int64_t>();
  std::vector<TokenRoute> routes = Route(d, a.in[0].as<const T>());
  for (int64_t tok = 0; tok < d.tokens; ++tok) {
    const TokenRoute& r = routes[tok];
    for (int64_t j = 0; j < d.k; ++j) {
      route[tok * d.k + j] =
          r.slots[j] < 0 ? -1 : r.experts[j] * d.capacity + r.slots[j];
    }
  }
  return absl::OkStatus();
}

// The route is piecewise constant in the logits: a zero gradient, nothing
// to add.
template <typename T>
absl::Status RouteBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 1, 1, 1));
  HAP_RETURN_IF_ERROR(CheckGate(a, t).status());
  if (g.dx(0).present() && g.dx(0).shape != g.x(0).shape) {
    return Invalid(a, "the logits' gradient ", Describe(g.dx(0)),
                   " must have the logits' shape");
  }
  return absl::OkStatus();
}

// The top-k choice and weights of a token do not depend on the others (the
// slots do): the weights need no capacity and split by tokens.
template <typename T>
absl::Status RouteWeightsForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t, false));
  d.capacity = d.tokens * d.k + 1;  // slots are not read
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, {d.tokens, d.k}));
  T* w = a.out[0].as<T>();
  std::vector<TokenRoute> routes = Route(d, a.in[0].as<const T>());
  for (int64_t tok = 0; tok < d.tokens; ++tok) {
    for (int64_t j = 0; j < d.k; ++j) {
      w[tok * d.k + j] = static_cast<T>(routes[tok].weights[j]);
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status RouteWeightsBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t, false));
  d.capacity = d.tokens * d.k + 1;
  HAP_RETURN_IF_ERROR(g.Check(t, {{d.tokens, d.k}}));
  if (!g.active()) return absl::OkStatus();
  const T* dw = g.dy(0).as<const T>();
  T* dlogits = g.dx(0).as<T>();
  std::vector<TokenRoute> routes = Route(d, g.x(0).as<const T>());
  std::vector<double> dp(d.experts), gw(d.k);
  for (int64_t tok = 0; tok < d.tokens; ++tok) {
    for (int64_t j = 0; j < d.k; ++j) gw[j] = dw[tok * d.k + j];
    WeightsGrad(d, routes[tok], gw, dp, dlogits + tok * d.experts);
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


// --- moe_dispatch_idx, moe_combine_idx --------------------------------------------

// A rank's route (MoeIdxDims): which entry (token * k + choice) each local
// slot holds, and each token's local slots in ascending order (the dense
// form's summation order). Entries that are no slot, or slots taken twice,
// are InvalidArgument.
struct LocalRoute {
  int64_t tokens = 0, k = 0, experts = 0, capacity = 0;
  std::vector<int64_t> slot_entry;  // [experts * capacity], -1: empty
  std::vector<int64_t> tok_slot;    // [tokens * k] local slot, -1 after
  std::vector<int64_t> tok_choice;  // [tokens * k] the choice j of tok_slot
};

absl::StatusOr<LocalRoute> MakeLocalRoute(const KernelArgs& a,
                                          const TensorView& route,
                                          const MoeIdxDims& m) {
  LocalRoute r;
  r.tokens = m.tokens;
  r.k = m.k;
  r.experts = m.experts;
  r.capacity = m.capacity;
  r.slot_entry.assign(m.experts * m.capacity, -1);
  r.tok_slot.assign(m.tokens * m.k, -1);
  r.tok_choice.assign(m.tokens * m.k, -1);
  const int64_t* v = route.as<const int64_t>();
  for (int64_t tok = 0; tok < m.tokens; ++tok) {
    int64_t n = 0;
    int64_t* ts = r.tok_slot.data() + tok * m.k;
    int64_t* tc = r.tok_choice.data() + tok * m.k;
    for (int64_t j = 0; j < m.k; ++j) {
      const int64_t i = tok * m.k + j, s = v[i];
      if (s == -1) continue;
      if (s < -1 || s >= m.global * m.global_capacity) {
        return Invalid(a, "route entry [", tok, ", ", j, "] = ", s,
                       " is not a slot of ", m.global, " experts x ",
                       m.global_capacity);
      }
      const int64_t e = s / m.global_capacity, row = s % m.global_capacity;
      if (e < m.offset || e >= m.offset + m.experts || row < m.capacity_offset ||
          row >= m.capacity_offset + m.capacity) {
        continue;
      }
      const int64_t ls = (e - m.offset) * m.capacity + row - m.capacity_offset;
      if (r.slot_entry[ls] >= 0) {
        return Invalid(a, "route entries ", r.slot_entry[ls], " and ", i,
                       " (token * k + choice) both take slot ", s);
      }
      r.slot_entry[ls] = i;
      // Insert keeping ts[0..n) ascending.
      int64_t p = n++;
      for (; p > 0 && ts[p - 1] > ls; --p) {
        ts[p] = ts[p - 1];
        tc[p] = tc[p - 1];
      }
      ts[p] = ls;
      tc[p] = j;
    }
  }
  return r;
}

absl::StatusOr<LocalRoute> DispatchRoute(const KernelArgs& a, DType t,
                                         const TensorView& x,
                                         const TensorView& route,
                                         const TensorView& out) {
  HAP_ASSIGN_OR_RETURN(MoeIdxDims m, CheckMoeDispatchIdx(a, t, x, route, out));
  return MakeLocalRoute(a, route, m);
}

absl::StatusOr<LocalRoute> CombineRoute(const KernelArgs& a, DType t,
                                        const TensorView& y,
                                        const TensorView& route,
                                        const TensorView& w) {
  HAP_ASSIGN_OR_RETURN(MoeIdxDims m, CheckMoeCombineIdx(a, t, y, route, w));
  return MakeLocalRoute(a, route, m);
}

template <typename T>
absl::Status DispatchIdxForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(LocalRoute r,
                       DispatchRoute(a, t, a.in[0], a.in[1], a.out[0]));
  const int64_t d = a.in[0].shape[1];
  const T* x = a.in[0].as<const T>();
  T* y = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, r.experts * r.capacity, GrainFor(d),
              [&](int64_t b, int64_t e) {
                for (int64_t s = b; s < e; ++s) {
                  T* ys = y + s * d;
                  const int64_t i = r.slot_entry[s];
                  if (i < 0) {
                    std::fill(ys, ys + d, T(0));
                  } else {
                    std::copy(x + (i / r.k) * d, x + (i / r.k + 1) * d, ys);
                  }
                }
              });
  return absl::OkStatus();
}

// dx[t] += dy[s] over the token's slots here.
template <typename T>
absl::Status DispatchIdxBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 2, 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  if (!g.active()) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(LocalRoute r,
                       DispatchRoute(a, t, g.x(0), g.x(1), g.dy(0)));
  HAP_RETURN_IF_ERROR(g.Check(t, {g.dy(0).shape}));
  const int64_t d = g.x(0).shape[1];
  const T* dy = g.dy(0).as<const T>();
  T* dx = g.dx(0).as<T>();
  ParallelFor(a.ctx.num_threads, r.tokens, GrainFor(d * r.k),
              [&](int64_t b, int64_t e) {
                for (int64_t tok = b; tok < e; ++tok) {
                  for (int64_t j = 0; j < r.k; ++j) {
                    const int64_t s = r.tok_slot[tok * r.k + j];
                    if (s < 0) break;
                    AddTo(dx + tok * d, dy + s * d, d);
                  }
                }
              });
  return absl::OkStatus();
}

template <typename T>
absl::Status CombineIdxForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(LocalRoute r,
                       CombineRoute(a, t, a.in[0], a.in[1], a.in[2]));
  const int64_t d = a.in[0].shape[2];
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, {r.tokens, d}));
  const T* y = a.in[0].as<const T>();
  const T* w = a.in[2].as<const T>();
  T* out = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, r.tokens, GrainFor(d * r.k),
              [&](int64_t b, int64_t e) {
                for (int64_t tok = b; tok < e; ++tok) {
                  T* o = out + tok * d;
                  std::fill(o, o + d, T(0));
                  for (int64_t j = 0; j < r.k; ++j) {
                    const int64_t s = r.tok_slot[tok * r.k + j];
                    if (s < 0) break;
                    const T wj = w[tok * r.k + r.tok_choice[tok * r.k + j]];
                    const T* ys = y + s * d;
                    for (int64_t c = 0; c < d; ++c) o[c] += wj * ys[c];
                  }
                }
              });
  return absl::OkStatus();
}

// dy[s] += w * dout[t] for the token t in slot s; dweights[t, j] +=
// dout[t] . y[s] for its placed choices here (dropped ones get nothing).
template <typename T>
absl::Status CombineIdxBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 3, 3, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  HAP_ASSIGN_OR_RETURN(LocalRoute r,
                       CombineRoute(a, t, g.x(0), g.x(1), g.x(2)));
  const int64_t d = g.x(0).shape[2];
  HAP_RETURN_IF_ERROR(g.Check(t, {{r.tokens, d}}));
  if (!g.dy(0).present()) return absl::OkStatus();
  const T* y = g.x(0).as<const T>();
  const T* w = g.x(2).as<const T>();
  const T* dout = g.dy(0).as<const T>();
  if (g.dx(0).present()) {
    T* dy = g.dx(0).as<T>();
    ParallelFor(a.ctx.num_threads, r.experts * r.capacity, GrainFor(d),
                [&](int64_t b, int64_t e) {
                  for (int64_t s = b; s < e; ++s) {
                    const int64_t i = r.slot_entry[s];
                    if (i < 0) continue;
                    const T wi = w[i];
                    const T* go = dout + (i / r.k) * d;
                    T* ds = dy + s * d;
                    for (int64_t c = 0; c < d; ++c) ds[c] += wi * go[c];
                  }
                });
  }
  if (g.dx(2).present()) {
    T* dw = g.dx(2).as<T>();
    ParallelFor(a.ctx.num_threads, r.tokens, GrainFor(d * r.k),
                [&](int64_t b, int64_t e) {
                  for (int64_t tok = b; tok < e; ++tok) {
                    const T* go = dout + tok * d;
                    for (int64_t j = 0; j < r.k; ++j) {
                      const int64_t s = r.tok_slot[tok * r.k + j];
                      if (s < 0) break;
                      const T* ys = y + s * d;
                      T dot = 0;
                      for (int64_t c = 0; c < d; ++c) dot += go[c] * ys[c];
                      dw[tok * r.k + r.tok_choice[tok * r.k + j]] += dot;
                    }
                  }
                });
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MoeGroups> CheckMoeGroups(const KernelArgs& a, int64_t tokens, int64_t capacity) {
  HAP_ASSIGN_OR_RETURN(const int64_t g, AttrInt(a, "group_size", 0));
  HAP_ASSIGN_OR_RETURN(const int64_t global, AttrInt(a, "global_tokens", tokens));
  HAP_ASSIGN_OR_RETURN(const int64_t offset, AttrInt(a, "token_offset", 0));
  if (offset < 0 || offset + tokens > global) {
    return Invalid(a, "tokens [", offset, ", ", offset + tokens, ") are not within the ", global,
                   " tokens");
  }
  MoeGroups m{tokens, capacity, 0};
  if (g == 0) {
    if (global != tokens) {
      return Invalid(a, "routing all ", global, " tokens as one group needs all of them, not ",
                     tokens, " (attribute 'group_size' = 0)");
    }
    return m;
  }
  // No tokens are no groups: any capacity divides among them.
  const int64_t groups = g > 0 ? global / g : 0;
  if (g < 0 || global % g != 0 || (groups > 0 && capacity % groups != 0)) {
    return Invalid(a, "attribute 'group_size' = ", g, " must divide the ", global,
                   " tokens into groups that share 'capacity' = ", capacity, " evenly");
  }
  if (offset % g != 0 || tokens % g != 0) {
    return Invalid(a, "tokens [", offset, ", ", offset + tokens,
                   ") are not whole groups of 'group_size' = ", g);
  }
  m.group = g;
  m.group_capacity = groups > 0 ? capacity / groups : capacity;
  m.first_group = offset / g;
  return m;
}

// Route int64 [tokens, k]; this rank's experts within the attributes'.
absl::StatusOr<MoeIdxDims> CheckMoeRoute(const KernelArgs& a,
                                         const TensorView& route,
                                         int64_t tokens, int64_t experts,
                                         int64_t capacity, int64_t d) {
  if (!route.present() || route.dtype != DType::kInt64 || route.rank() != 2 ||
      route.shape[0] != tokens) {
    return Invalid(a, "the route (", Describe(route),
                   ") must be int64 [tokens = ", tokens, ", k]");
  }
  MoeIdxDims m;
  m.tokens = tokens;
  m.k = route.shape[1];
  m.experts = experts;
  m.capacity = capacity;
  m.d = d;
  HAP_ASSIGN_OR_RETURN(m.offset, AttrInt(a, "expert_offset", 0));
  HAP_ASSIGN_OR_RETURN(m.global, AttrInt(a, "experts", experts));
  HAP_ASSIGN_OR_RETURN(m.global_capacity, AttrInt(a, "capacity", capacity));
  HAP_ASSIGN_OR_RETURN(m.capacity_offset, AttrInt(a, "capacity_offset", 0));
  if (m.offset < 0 || m.offset + experts > m.global || m.capacity_offset < 0 ||
      m.capacity_offset + capacity > m.global_capacity) {
    return Invalid(a, "experts [", m.offset, ", ", m.offset + experts, ") and slots [",
                   m.capacity_offset, ", ", m.capacity_offset + capacity,
                   ") do not fit attributes 'experts' = ", m.global,
                   ", 'capacity' = ", m.global_capacity);
  }
  return m;
}

absl::StatusOr<MoeIdxDims> CheckMoeDispatchIdx(const KernelArgs& a, DType t,
                                               const TensorView& x,
                                               const TensorView& route,
                                               const TensorView& out) {
  if (!x.present() || x.dtype != t || x.rank() != 2 || !out.present() ||
      out.dtype != t || out.rank() != 3 || out.shape[2] != x.shape[1]) {
    return Invalid(a, "tokens ", Describe(x), " and dispatched ",
                   Describe(out), " must be [t, d] and [experts, capacity, d]");
  }
  return CheckMoeRoute(a, route, x.shape[0], out.shape[0], out.shape[1],
                       x.shape[1]);
}

absl::StatusOr<MoeIdxDims> CheckMoeCombineIdx(const KernelArgs& a, DType t,
                                              const TensorView& y,
                                              const TensorView& route,
                                              const TensorView& w) {
  if (!y.present() || y.dtype != t || y.rank() != 3) {
    return Invalid(a, "expert outputs ", Describe(y),
                   " must be [experts, capacity, d]");
  }
  if (!w.present() || w.dtype != t || w.shape != route.shape) {
    return Invalid(a, "weights ", Describe(w), " must match the route ",
                   Describe(route));
  }
  const int64_t tokens = route.rank() == 2 ? route.shape[0] : -1;
  return CheckMoeRoute(a, route, tokens, y.shape[0], y.shape[1], y.shape[2]);
}

void RegisterMoeKernels(KernelTable& t) {
  t["moe_gate"] = HAP_FLOAT_KERNEL(GateForward);
  t["moe_gate_grad"] = HAP_FLOAT_KERNEL(GateBackward);
  t["moe_dispatch"] = HAP_FLOAT_KERNEL(DispatchForward);
  t["moe_dispatch_grad"] = HAP_FLOAT_KERNEL(DispatchBackward);
  t["moe_combine"] = HAP_FLOAT_KERNEL(CombineForward);
  t["moe_combine_grad"] = HAP_FLOAT_KERNEL(CombineBackward);
  t["moe_route"] = HAP_FLOAT_KERNEL(RouteForward);
  t["moe_route_grad"] = HAP_FLOAT_KERNEL(RouteBackward);
  t["moe_route_weights"] = HAP_FLOAT_KERNEL(RouteWeightsForward);
  t["moe_route_weights_grad"] = HAP_FLOAT_KERNEL(RouteWeightsBackward);
  t["moe_dispatch_idx"] = HAP_FLOAT_KERNEL(DispatchIdxForward);
  t["moe_dispatch_idx_grad"] = HAP_FLOAT_KERNEL(DispatchIdxBackward);
  t["moe_combine_idx"] = HAP_FLOAT_KERNEL(CombineIdxForward);
  t["moe_combine_idx_grad"] = HAP_FLOAT_KERNEL(CombineIdxBackward);
}

}  // namespace hap::executor::cpu
