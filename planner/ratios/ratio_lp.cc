// The sharding-ratio LP (see ratio_lp.h for the formulation) solved with
// GLPK's simplex. GLPK's C API is used in this file only, inside class GlpkLp:
// the rest of the file speaks 0-based rows and columns and plain statuses.
//
// GLPK conventions kept in here:
//  * 1-based row/column indices and 1-based sparse arrays (slot 0 unused):
//    OneBasedVector below.
//  * Global state: GLPK 5.0 as built by Debian keeps its environment in
//    thread-local storage, so concurrent calls from different threads are
//    independent. We delete every problem we create (RAII) but never call
//    glp_free_env(): it frees *everything* the calling thread's environment
//    owns, including problems some other code on the same thread may still
//    hold. The cost is one small environment per thread that ever solved.
//  * Terminal output is switched off per call (glp_term_out is per
//    environment, i.e. per thread) and msg_lev is GLP_MSG_OFF.
//  * GLPK reports invalid arguments by printing and abort()ing. Everything
//    handed to it is therefore validated first (finite numbers, consistent
//    bounds, no duplicate matrix entries).
#include "planner/ratios/ratio_lp.h"

#include <glpk.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/deadline.h"
#include "common/status_macros.h"

namespace hap::ratios {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------
// Request validation.
// ---------------------------------------------------------------------------

absl::Status CheckSize(size_t actual, int expected, absl::string_view field,
                       absl::string_view expected_name) {
  if (actual == static_cast<size_t>(expected)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has ", actual, " entries, expected ", expected_name,
                   " = ", expected));
}

// A value that must be finite and >= 0 (times, bytes, coefficients).
absl::Status CheckNonNegative(double v, absl::string_view field) {
  if (std::isfinite(v) && v >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " = ", v, "; expected a finite value >= 0"));
}

absl::Status CheckNonNegativeVector(const std::vector<double>& v,
                                    absl::string_view field) {
  for (size_t i = 0; i < v.size(); ++i) {
    HAP_RETURN_IF_ERROR(
        CheckNonNegative(v[i], absl::StrCat(field, "[", i, "]")));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const RatioLpRequest& r) {
  if (r.num_devices < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_devices = ", r.num_devices, "; expected >= 1"));
  }
  if (r.num_segments < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_segments = ", r.num_segments, "; expected >= 1"));
  }
  if (std::isnan(r.time_limit_seconds) || r.time_limit_seconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("time_limit_seconds = ", r.time_limit_seconds,
                     "; expected > 0 (infinity means no limit)"));
  }
  for (size_t k = 0; k < r.terms.size(); ++k) {
    const CostTerm& t = r.terms[k];
    const std::string name = absl::StrCat("terms[", k, "]");
    if (t.segment < 0 || t.segment >= r.num_segments) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".segment = ", t.segment, " is out of range [0, ",
                       r.num_segments, ")"));
    }
    HAP_RETURN_IF_ERROR(CheckSize(t.coef.size(), r.num_devices,
                                  absl::StrCat(name, ".coef"), "num_devices"));
    HAP_RETURN_IF_ERROR(CheckSize(t.constant.size(), r.num_devices,
                                  absl::StrCat(name, ".constant"),
                                  "num_devices"));
    HAP_RETURN_IF_ERROR(
        CheckNonNegativeVector(t.coef, absl::StrCat(name, ".coef")));
    HAP_RETURN_IF_ERROR(
        CheckNonNegativeVector(t.constant, absl::StrCat(name, ".constant")));
    if (!std::isfinite(t.weight) || t.weight <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ".weight = ", t.weight, "; expected a finite value > 0"));
    }
  }
  if (r.path.has_value()) {
    const CriticalPath& p = *r.path;
    if (p.num_events < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "path.num_events = ", p.num_events, "; expected >= 2 (start and end)"));
    }
    if (!std::isfinite(p.weight) || p.weight <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "path.weight = ", p.weight, "; expected a finite value > 0"));
    }
    for (size_t e = 0; e < p.edges.size(); ++e) {
      const Precedence& x = p.edges[e];
      const std::string name = absl::StrCat("path.edges[", e, "]");
      if (x.from < 0 || x.to <= x.from || x.to >= p.num_events) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, " goes from event ", x.from, " to ", x.to,
            "; expected 0 <= from < to < num_events = ", p.num_events));
      }
      for (int k : x.terms) {
        if (k < 0 || k >= static_cast<int>(r.terms.size())) {
          return absl::InvalidArgumentError(absl::StrCat(
              name, " names term ", k, ", out of range [0, ", r.terms.size(), ")"));
        }
      }
      HAP_RETURN_IF_ERROR(CheckNonNegative(x.constant, absl::StrCat(name, ".constant")));
    }
  }
  if (r.memory.has_value()) {
    const MemoryConstraint& m = *r.memory;
    HAP_RETURN_IF_ERROR(CheckSize(m.coef.size(), r.num_segments, "memory.coef",
                                  "num_segments"));
    for (size_t s = 0; s < m.coef.size(); ++s) {
      const std::string name = absl::StrCat("memory.coef[", s, "]");
      HAP_RETURN_IF_ERROR(
          CheckSize(m.coef[s].size(), r.num_devices, name, "num_devices"));
      HAP_RETURN_IF_ERROR(CheckNonNegativeVector(m.coef[s], name));
    }
    HAP_RETURN_IF_ERROR(CheckSize(m.constant.size(), r.num_devices,
                                  "memory.constant", "num_devices"));
    HAP_RETURN_IF_ERROR(CheckNonNegativeVector(m.constant, "memory.constant"));
    HAP_RETURN_IF_ERROR(CheckSize(m.capacity.size(), r.num_devices,
                                  "memory.capacity", "num_devices"));
    HAP_RETURN_IF_ERROR(CheckNonNegativeVector(m.capacity, "memory.capacity"));
    // Names are only used in messages: empty means "device <i>".
    if (!m.device_names.empty()) {
      HAP_RETURN_IF_ERROR(CheckSize(m.device_names.size(), r.num_devices,
                                    "memory.device_names",
                                    "num_devices (or 0)"));
    }
  }
  return absl::OkStatus();
}

std::string DeviceName(const RatioLpRequest& r, int i) {
  if (r.memory.has_value() && !r.memory->device_names.empty()) {
    return r.memory->device_names[i];
  }
  return absl::StrCat("device ", i);
}

// Bytes that device i holds under `ratios` (shapes already checked).
double MemoryUse(const MemoryConstraint& m,
                 const std::vector<std::vector<double>>& ratios, int i) {
  double bytes = m.constant[i];
  for (size_t s = 0; s < m.coef.size(); ++s) {
    bytes += m.coef[s][i] * ratios[s][i];
  }
  return bytes;
}

// The largest value device i's memory row can take (all segments at ratio 1);
// the scale of that row for tolerances.
double MemoryRowScale(const MemoryConstraint& m, int i) {
  double scale = std::max(m.capacity[i], m.constant[i]);
  double sum_coef = 0;
  for (const auto& seg : m.coef) sum_coef += seg[i];
  return std::max(scale, m.constant[i] + sum_coef);
}

std::string FormatBytes(double bytes) {
  return absl::StrFormat("%.1f GiB (%.0f bytes)",
                         bytes / (1024.0 * 1024 * 1024), std::round(bytes));
}

// ---------------------------------------------------------------------------
// GLPK, behind a small 0-based interface.
// ---------------------------------------------------------------------------

// One nonzero of a sparse row (index = column) or column (index = row).
struct Entry {
  int index;  // 0-based
  double value;
};

enum class LpOutcome {
  kOptimal,
  kInfeasible,
  kUnbounded,
  kUnboundedOrInfeasible,  // GLPK's presolver cannot tell which
};

// GLPK's arrays for one sparse row or column: 1-based, slot 0 unused.
class OneBasedVector {
 public:
  explicit OneBasedVector(const std::vector<Entry>& entries) {
    ind_.reserve(entries.size() + 1);
    val_.reserve(entries.size() + 1);
    ind_.push_back(0);
    val_.push_back(0);
    for (const Entry& e : entries) {
      if (e.value == 0) continue;  // GLPK would store it; no use
      ind_.push_back(e.index + 1);
      val_.push_back(e.value);
    }
  }
  int size() const { return static_cast<int>(ind_.size()) - 1; }
  const int* ind() const { return ind_.data(); }
  const double* val() const { return val_.data(); }

 private:
  std::vector<int> ind_;
  std::vector<double> val_;
};

struct GlpProbDeleter {
  void operator()(glp_prob* p) const { glp_delete_prob(p); }
};

// GLPK's bound type for [lb, ub] (either may be infinite; lb <= ub).
int GlpBoundType(double lb, double ub) {
  const bool has_lb = std::isfinite(lb), has_ub = std::isfinite(ub);
  if (has_lb && has_ub) return lb == ub ? GLP_FX : GLP_DB;
  if (has_lb) return GLP_LO;
  if (has_ub) return GLP_UP;
  return GLP_FR;
}

int TimeLimitMs(double seconds) {
  const double ms = std::ceil(seconds * 1000.0);
  if (!(ms < static_cast<double>(INT_MAX))) return INT_MAX;  // also +inf
  return std::max(1, static_cast<int>(ms));
}

// One GLPK problem: minimise or maximise obj . x subject to row and column
// bounds, built with 0-based indices. Owned by one call of one thread.
class GlpkLp {
 public:
  struct SolveOptions {
    bool presolve = true;
    int method = GLP_PRIMAL;   // GLP_PRIMAL, GLP_DUALP or GLP_DUAL
    int pricing = GLP_PT_PSE;  // GLP_PT_PSE (steepest edge) or GLP_PT_STD
  };

  explicit GlpkLp(bool maximize = false) {
    glp_term_out(GLP_OFF);  // per thread environment; see the file comment
    prob_.reset(glp_create_prob());
    glp_set_obj_dir(prob_.get(), maximize ? GLP_MAX : GLP_MIN);
  }

  // Returns the 0-based column index. `entries` index existing rows, each
  // at most once.
  int AddColumn(double lb, double ub, double cost,
                const std::vector<Entry>& entries = {}) {
    const int j = glp_add_cols(prob_.get(), 1);
    if (!ValidBounds(lb, ub) || !std::isfinite(cost) ||
        !ValidEntries(entries, num_rows_)) {
      Invalid(absl::StrCat("column ", num_cols_, " has invalid data"));
      return num_cols_++;  // left empty and fixed at 0
    }
    glp_set_col_bnds(prob_.get(), j, GlpBoundType(lb, ub), lb, ub);
    glp_set_obj_coef(prob_.get(), j, cost);
    const OneBasedVector col(entries);
    glp_set_mat_col(prob_.get(), j, col.size(), col.ind(), col.val());
    return num_cols_++;
  }

  // Returns the 0-based row index. `entries` index existing columns, each at
  // most once.
  int AddRow(double lb, double ub, const std::vector<Entry>& entries) {
    const int i = glp_add_rows(prob_.get(), 1);
    if (!ValidBounds(lb, ub) || !ValidEntries(entries, num_cols_)) {
      Invalid(absl::StrCat("row ", num_rows_, " has invalid data"));
      return num_rows_++;  // left empty and free
    }
    glp_set_row_bnds(prob_.get(), i, GlpBoundType(lb, ub), lb, ub);
    const OneBasedVector row(entries);
    glp_set_mat_row(prob_.get(), i, row.size(), row.ind(), row.val());
    return num_rows_++;
  }

  // `what` names the LP in error messages.
  absl::StatusOr<LpOutcome> Solve(double time_limit_seconds,
                                  const SolveOptions& options,
                                  absl::string_view what) {
    if (!invalid_.ok()) return Annotate(invalid_, what);
    glp_smcp parm;
    glp_init_smcp(&parm);
    parm.msg_lev = GLP_MSG_OFF;
    parm.tm_lim = TimeLimitMs(time_limit_seconds);
    parm.presolve = options.presolve ? GLP_ON : GLP_OFF;
    parm.meth = options.method;
    parm.pricing = options.pricing;
    const int rc = glp_simplex(prob_.get(), &parm);
    switch (rc) {
      case 0:
        break;  // the solver finished; the status below says how
      case GLP_ETMLIM:
        return absl::DeadlineExceededError(
            absl::StrCat(what, ": GLPK's time limit was reached"));
      case GLP_ENOPFS:
        // Only with presolve: the presolver proved primal infeasibility and
        // left no basic solution (glp_get_status is GLP_UNDEF then).
        return LpOutcome::kInfeasible;
      case GLP_ENODFS:
        // Only with presolve: the presolver proved dual infeasibility, i.e.
        // the LP is unbounded *or* primal infeasible; it cannot tell which.
        return LpOutcome::kUnboundedOrInfeasible;
      case GLP_EBADB:
      case GLP_ESING:
      case GLP_ECOND:
        // About the initial basis: we always start from GLPK's standard
        // (all-slack) basis, which is valid and perfectly conditioned.
        return absl::InternalError(absl::StrCat(
            what, ": GLPK rejected the initial basis (code ", rc, ")"));
      case GLP_EBOUND:
        // A double-bounded variable with lb > ub: AddColumn/AddRow
        // exclude it.
        return absl::InternalError(
            absl::StrCat(what, ": GLPK found invalid bounds"));
      case GLP_EFAIL:
        // Numerical trouble inside the solver, or (with presolve) a problem
        // the presolver reduced to nothing that GLPK could not handle.
        return absl::InternalError(
            absl::StrCat(what, ": GLPK's simplex failed (GLP_EFAIL)"));
      case GLP_EITLIM:
      case GLP_EOBJLL:
      case GLP_EOBJUL:
        // Iteration and objective limits are left at their defaults (off).
        return absl::InternalError(absl::StrCat(
            what, ": GLPK stopped at a limit that was not set (code ", rc,
            ")"));
      default:
        return absl::InternalError(
            absl::StrCat(what, ": glp_simplex returned unexpected code ", rc));
    }
    switch (glp_get_status(prob_.get())) {
      case GLP_OPT:
        return LpOutcome::kOptimal;
      case GLP_NOFEAS:
        return LpOutcome::kInfeasible;
      case GLP_UNBND:
        return LpOutcome::kUnbounded;
      default:  // GLP_UNDEF, GLP_FEAS, GLP_INFEAS after rc == 0: should not be
        return absl::InternalError(
            absl::StrCat(what, ": GLPK finished without an optimum (status ",
                         glp_get_status(prob_.get()), ")"));
    }
  }

  // After an optimal Solve.
  double value(int col) const { return glp_get_col_prim(prob_.get(), col + 1); }
  // d objective / d (active bound of the row); for a maximisation, >= 0 at a
  // binding upper bound.
  double row_dual(int row) const {
    return glp_get_row_dual(prob_.get(), row + 1);
  }
  double objective() const { return glp_get_obj_val(prob_.get()); }

 private:
  // GLPK abort()s on NaN bounds, lb > ub (an empty interval would simply be
  // infeasible), out-of-range or duplicate indices; we check all but
  // duplicates, which the builders below never produce.
  static bool ValidBounds(double lb, double ub) {
    return !std::isnan(lb) && !std::isnan(ub) && lb <= ub && lb < kInf &&
           ub > -kInf;
  }
  static bool ValidEntries(const std::vector<Entry>& entries, int size) {
    for (const Entry& e : entries) {
      if (!std::isfinite(e.value) || e.index < 0 || e.index >= size) {
        return false;
      }
    }
    return true;
  }
  void Invalid(std::string message) {
    if (invalid_.ok()) invalid_ = absl::InternalError(std::move(message));
  }

  std::unique_ptr<glp_prob, GlpProbDeleter> prob_;
  int num_cols_ = 0;
  int num_rows_ = 0;
  absl::Status invalid_;
};

// ---------------------------------------------------------------------------
// The ratio LP and the memory diagnosis LP.
// ---------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;

// Seconds left until `deadline` (may be <= 0); +inf without a deadline.
double SecondsLeft(std::optional<Clock::time_point> deadline) {
  if (!deadline.has_value()) return kInf;
  return std::chrono::duration<double>(*deadline - Clock::now()).count();
}

// The memory diagnosis LP's columns b[s][i] come first, segment-major; the
// same index order is used for a request's ratios in ExtractRatios.
int RatioColumn(const RatioLpRequest& r, int s, int i) {
  return s * r.num_devices + i;
}

void AddRatioColumnsAndSimplexRows(const RatioLpRequest& r, GlpkLp& lp) {
  for (int s = 0; s < r.num_segments; ++s) {
    for (int i = 0; i < r.num_devices; ++i) lp.AddColumn(0, kInf, 0);
  }
  for (int s = 0; s < r.num_segments; ++s) {
    std::vector<Entry> row;
    for (int i = 0; i < r.num_devices; ++i) {
      row.push_back({RatioColumn(r, s, i), 1});
    }
    lp.AddRow(1, 1, row);  // sum_i b[s][i] = 1
  }
}

// value(j) is b[s][i] for j = RatioColumn(r, s, i).
template <typename Value>
std::vector<std::vector<double>> ExtractRatios(const RatioLpRequest& r,
                                               Value value) {
  std::vector<std::vector<double>> ratios(
      r.num_segments, std::vector<double>(r.num_devices, 0));
  for (int s = 0; s < r.num_segments; ++s) {
    double sum = 0;
    for (int i = 0; i < r.num_devices; ++i) {
      // Basic variables can come back as -1e-17 and the like.
      const double b = std::clamp(value(RatioColumn(r, s, i)), 0.0, 1.0);
      ratios[s][i] = b;
      sum += b;
    }
    if (sum > 0) {
      for (double& b : ratios[s]) b /= sum;
    } else {  // cannot happen for an optimum; any split is feasible then
      std::fill(ratios[s].begin(), ratios[s].end(), 1.0 / r.num_devices);
    }
  }
  return ratios;
}

// Called when memory makes the ratio LP infeasible. Solves
//
//   minimise    z
//   subject to  sum_i b[s][i] = 1                                  for all s
//               sum_s mem_coef[s][i] * b[s][i] + mem_constant[i]
//                 - capacity[i] <= z                               for all i
//
// (z in units of `scale` bytes so the rows are O(1)), i.e. the split that
// minimises the largest absolute overflow, and names the device with the
// largest overflow at that optimum.
absl::Status DiagnoseMemory(const RatioLpRequest& r,
                            std::optional<Clock::time_point> deadline) {
  const MemoryConstraint& m = *r.memory;
  double scale = 1;
  for (int i = 0; i < r.num_devices; ++i) {
    scale = std::max(scale, MemoryRowScale(m, i));
  }
  GlpkLp lp;
  AddRatioColumnsAndSimplexRows(r, lp);
  const int z = lp.AddColumn(-kInf, kInf, 1);
  for (int i = 0; i < r.num_devices; ++i) {
    std::vector<Entry> row;
    for (int s = 0; s < r.num_segments; ++s) {
      row.push_back({RatioColumn(r, s, i), m.coef[s][i] / scale});
    }
    row.push_back({z, -1});
    lp.AddRow(-kInf, (m.capacity[i] - m.constant[i]) / scale, row);
  }
  const double left = SecondsLeft(deadline);
  if (left <= 0) {
    return absl::DeadlineExceededError(
        "memory diagnosis LP: the time limit was reached");
  }
  HAP_ASSIGN_OR_RETURN(LpOutcome outcome, lp.Solve(left, GlpkLp::SolveOptions(),
                                                   "memory diagnosis LP"));
  if (outcome != LpOutcome::kOptimal) {
    // Any split is feasible for a large enough z, and z is bounded below by
    // the constant parts, so neither outcome can happen.
    return absl::InternalError(
        "memory diagnosis LP has no optimum, which cannot happen");
  }
  const std::vector<std::vector<double>> ratios =
      ExtractRatios(r, [&](int j) { return lp.value(j); });
  std::vector<double> overflow(r.num_devices);
  double worst_overflow = -kInf;
  int num_over = 0;
  for (int i = 0; i < r.num_devices; ++i) {
    overflow[i] = MemoryUse(m, ratios, i) - m.capacity[i];
    if (overflow[i] > 1e-9 * scale) ++num_over;
    worst_overflow = std::max(worst_overflow, overflow[i]);
  }
  // Minimising the largest overflow typically ties several devices; name the
  // first of those within rounding of the worst, so the message is stable.
  int worst = 0;
  while (overflow[worst] < worst_overflow - 1e-9 * scale) ++worst;
  std::string message = absl::StrCat(
      "model does not fit: device '", DeviceName(r, worst), "' needs at least ",
      FormatBytes(MemoryUse(m, ratios, worst)), " but has ",
      FormatBytes(m.capacity[worst]));
  if (num_over > 1) {
    absl::StrAppend(&message, " (", num_over,
                    " devices are over capacity at the split that minimises "
                    "the largest overflow)");
  }
  if (worst_overflow <= 0) {
    // The ratio LP was infeasible but this one finds a split within
    // capacity: the memory rows are feasible only within solver tolerance.
    absl::StrAppend(&message, " (memory is at the limit of solver tolerance)");
  }
  return absl::ResourceExhaustedError(message);
}

// ---------------------------------------------------------------------------
// Exact reductions before the LP.
// ---------------------------------------------------------------------------

// Devices that look the same to every term and to memory (bitwise equal
// coefficients, constants, memory coefficients, constant and capacity) form
// a class. The LP is convex and symmetric under swapping such devices, so
// averaging any optimum over those swaps gives an optimum with equal ratios
// within each class: solve for one ratio per class. A cluster of 64 GPUs of
// three types has three classes.
struct DeviceClasses {
  std::vector<int> class_of;        // [device]
  std::vector<int> representative;  // [class], its first device
  std::vector<int> size;            // [class]
  int num_classes() const { return static_cast<int>(size.size()); }
};

DeviceClasses ClassifyDevices(const RatioLpRequest& r) {
  DeviceClasses out;
  std::map<std::vector<double>, int> index;
  std::vector<double> signature;
  for (int i = 0; i < r.num_devices; ++i) {
    signature.clear();
    for (const CostTerm& t : r.terms) {
      signature.push_back(t.coef[i]);
      signature.push_back(t.constant[i]);
    }
    if (r.memory.has_value()) {
      for (const auto& seg : r.memory->coef) signature.push_back(seg[i]);
      signature.push_back(r.memory->constant[i]);
      signature.push_back(r.memory->capacity[i]);
    }
    auto [it, inserted] = index.try_emplace(signature, out.num_classes());
    if (inserted) {
      out.representative.push_back(i);
      out.size.push_back(0);
    }
    out.class_of.push_back(it->second);
    ++out.size[it->second];
  }
  return out;
}

// A cost term reduced to its shape over device classes c:
// weight * max_c (v_c x_c + u_c) with max_c v_c = 1 and min_c u_c = 0, where
// x_c is the ratio of each device of class c. Term k equals
//   w_k * (alpha_k * max_c (v_c x_c + u_c) + beta_k)
// with alpha_k = max coef_k, beta_k = min constant_k, v = coef / alpha,
// u = (constant - beta) / alpha, so terms of one segment with the same
// (v, u) merge into one with weight sum_k w_k alpha_k, and sum_k w_k beta_k
// is a constant. The compute terms of a segment (coef F_k / FLOPS_i) share
// one shape, and so do the padded collectives with a uniform latency: real
// programs reduce to a handful of shapes per segment.
struct Shape {
  int segment;
  std::vector<double> v, u;  // [class]
  double weight;
};

// x with its mantissa rounded to 40 bits: keys that merge shapes differing
// only by rounding (F/FLOPS computed per op), changing the objective by a
// relative 1e-12 at most.
double RoundForKey(double x) {
  if (x == 0 || !std::isfinite(x)) return x;
  int exponent;
  const double mantissa = std::frexp(x, &exponent);
  return std::ldexp(std::round(std::ldexp(mantissa, 40)), exponent - 40);
}

// Returns the shapes of the terms not on the critical path (in_path[k]
// false); adds their constant parts to *constant.
std::vector<Shape> ReduceTerms(const RatioLpRequest& r,
                               const DeviceClasses& classes,
                               const std::vector<bool>& in_path,
                               double* constant) {
  const int n = classes.num_classes();
  std::vector<Shape> shapes;
  std::map<std::pair<int, std::vector<double>>, size_t> index;
  std::vector<double> key(2 * n);
  for (size_t k = 0; k < r.terms.size(); ++k) {
    if (in_path[k]) continue;
    const CostTerm& t = r.terms[k];
    const double alpha = *std::max_element(t.coef.begin(), t.coef.end());
    if (alpha == 0) {  // replicated: no ratio dependence
      *constant +=
          t.weight * *std::max_element(t.constant.begin(), t.constant.end());
      continue;
    }
    const double beta = *std::min_element(t.constant.begin(), t.constant.end());
    *constant += t.weight * beta;
    Shape shape{t.segment, std::vector<double>(n), std::vector<double>(n),
                t.weight * alpha};
    for (int c = 0; c < n; ++c) {
      const int i = classes.representative[c];
      shape.v[c] = t.coef[i] / alpha;
      shape.u[c] = (t.constant[i] - beta) / alpha;
      key[c] = RoundForKey(shape.v[c]);
      key[n + c] = RoundForKey(shape.u[c]);
    }
    auto [it, inserted] = index.try_emplace({t.segment, key}, shapes.size());
    if (inserted) {
      shapes.push_back(std::move(shape));
    } else {
      shapes[it->second].weight += shape.weight;
    }
  }
  return shapes;
}

}  // namespace

// The LP of ratio_lp.h is solved in a reduced form and through its dual.
//
// Reduced form: devices merge into classes c of size n_c with one ratio x_c
// per device (DeviceClasses), terms into shapes g (Shape): t_g >=
// v_gc x[s_g][c] + u_gc, weight W_g, plus a constant. A class with
// v_gc == 0 only bounds t_g from below, so t_g = lb_g + t'_g with lb_g =
// max(0, max of u_gc over those classes) and no row. Weights are divided by
// ws = max_g W_g, and class c's memory row by its scale M_c: m_sc =
// mem_coef[s][c]/M_c, R_c = (capacity[c] - mem_constant[c])/M_c. A memory row
// is left out when even ratio 1 in every segment fits; R_c < 0 cannot fit at
// all. The primal:
//
//   minimise    sum_g (W_g/ws) t'_g                   (+ sum_g (W_g/ws) lb_g)
//   subject to  sum_c n_c x[s][c] = 1                              [u_s free]
//               t'_g - v_gc x[s_g][c] >= u_gc - lb_g  (v_gc > 0)  [y_gc >= 0]
//               -sum_s m_sc x[s][c] >= -R_c                       [z_c >= 0]
//               x, t' >= 0
//
// has a row per (shape, class): up to 320k rows for 5,000 x 64 when nothing
// merges, and GLPK's simplex factorises a basis of that size (12-18 s for
// 2,000 x 64 measured). Its dual has a row per shape and per (segment,
// class), so a small basis, and a column per (shape, class), cheap to price
// (about 1 s for 2,000 x 64):
//
//   maximise    sum_s u_s + sum_{g,c} (u_gc - lb_g) y_gc - sum_c R_c z_c
//   subject to  sum_c y_gc <= W_g/ws                           [row of t'_g]
//               n_c u_s - sum_{g in s} v_gc y_gc - m_sc z_c <= 0
//                                                          [row of x[s][c]]
//               y, z >= 0, u free
//
// It is feasible (all zero), so it is unbounded exactly when memory makes the
// primal infeasible. x[s][c] is the dual value of the row of x[s][c] (>= 0:
// a binding <= row of a maximisation), and by strong duality the primal
// objective is ws * (dual objective + sum_g (W_g/ws) lb_g) + the constants.
absl::StatusOr<RatioLpResult> SolveRatioLp(const RatioLpRequest& request) {
  HAP_RETURN_IF_ERROR(ValidateRequest(request));
  const RatioLpRequest& r = request;
  std::optional<Clock::time_point> deadline;
  if (r.time_limit_seconds < kNoDeadlineSeconds) {
    deadline = DeadlineAfter<Clock>(Clock::now(), r.time_limit_seconds);
  }

  const DeviceClasses classes = ClassifyDevices(r);
  const int nc = classes.num_classes();
  auto x_row = [nc](int s, int c) { return s * nc + c; };
  double constant = 0;
  std::vector<bool> in_path(r.terms.size(), false);
  if (r.path.has_value()) {
    for (const Precedence& e : r.path->edges) {
      for (int k : e.terms) in_path[k] = true;
    }
  }
  const std::vector<Shape> shapes = ReduceTerms(r, classes, in_path, &constant);
  double weight_scale = 0;
  for (const Shape& g : shapes) weight_scale = std::max(weight_scale, g.weight);
  if (weight_scale == 0) weight_scale = 1;

  GlpkLp dual(/*maximize=*/true);
  // Rows of x[s][c] first, so that their duals are rows 0 .. S*C-1.
  for (int s = 0; s < r.num_segments; ++s) {
    for (int c = 0; c < nc; ++c) dual.AddRow(-kInf, 0, {});
  }
  std::vector<Entry> column;  // columns are added whole
  for (int s = 0; s < r.num_segments; ++s) {
    column.clear();
    for (int c = 0; c < nc; ++c) {
      column.push_back({x_row(s, c), static_cast<double>(classes.size[c])});
    }
    dual.AddColumn(-kInf, kInf, 1, column);  // u_s
  }
  double offset = 0;  // sum_g (W_g/ws) lb_g
  for (const Shape& g : shapes) {
    const double w = g.weight / weight_scale;
    double lower = 0;
    for (int c = 0; c < nc; ++c) {
      if (g.v[c] == 0) lower = std::max(lower, g.u[c]);
    }
    offset += w * lower;
    const int t_row = dual.AddRow(-kInf, w, {});
    for (int c = 0; c < nc; ++c) {
      if (g.v[c] == 0) continue;
      dual.AddColumn(0, kInf, g.u[c] - lower,  // y_gc
                     {{t_row, 1}, {x_row(g.segment, c), -g.v[c]}});
    }
  }
  // Critical-path terms, each its own shape: value_k = scale_k * t'_k +
  // fixed_k with t'_k >= max_c(v_c x_c + u_c) - lb_k >= 0 (one row of the
  // dual, rhs 0: its y columns are paid for by the edges' pi columns).
  std::vector<int> path_row(r.terms.size(), -1);
  std::vector<double> path_scale(r.terms.size(), 0), path_fixed(r.terms.size(), 0);
  for (size_t k = 0; k < r.terms.size(); ++k) {
    if (!in_path[k]) continue;
    const CostTerm& t = r.terms[k];
    const double alpha = *std::max_element(t.coef.begin(), t.coef.end());
    if (alpha == 0) {
      path_fixed[k] = t.weight * *std::max_element(t.constant.begin(), t.constant.end());
      continue;
    }
    const double beta = *std::min_element(t.constant.begin(), t.constant.end());
    double lower = 0;
    std::vector<double> v(nc), u(nc);
    for (int c = 0; c < nc; ++c) {
      const int i = classes.representative[c];
      v[c] = t.coef[i] / alpha;
      u[c] = (t.constant[i] - beta) / alpha;
      if (v[c] == 0) lower = std::max(lower, u[c]);
    }
    path_scale[k] = t.weight * alpha;
    path_fixed[k] = t.weight * (alpha * lower + beta);
    path_row[k] = dual.AddRow(-kInf, 0, {});
    for (int c = 0; c < nc; ++c) {
      if (v[c] == 0) continue;
      dual.AddColumn(0, kInf, u[c] - lower,  // y_kc
                     {{path_row[k], 1}, {x_row(t.segment, c), -v[c]}});
    }
  }
  if (r.path.has_value()) {
    // Rows of E_j (j >= 1): sum of pi into j - sum of pi out of j <= the
    // objective's weight on E_j (only the last event's). Columns pi_e:
    // E_to - E_from - sum_k scale_k t'_k >= constant_e + sum_k fixed_k.
    const CriticalPath& cp = *r.path;
    std::vector<int> event_row(cp.num_events, -1);
    for (int j = 1; j < cp.num_events; ++j) {
      event_row[j] = dual.AddRow(
          -kInf, j == cp.num_events - 1 ? cp.weight / weight_scale : 0, {});
    }
    for (const Precedence& e : cp.edges) {
      std::map<int, double> entries;
      double kappa = e.constant;
      entries[event_row[e.to]] += 1;
      if (e.from > 0) entries[event_row[e.from]] -= 1;
      for (int k : e.terms) {
        kappa += path_fixed[k];
        if (path_row[k] >= 0) entries[path_row[k]] -= path_scale[k];
      }
      column.clear();
      for (const auto& [row, value] : entries) column.push_back({row, value});
      dual.AddColumn(0, kInf, kappa, column);  // pi_e
    }
  }
  if (r.memory.has_value()) {
    const MemoryConstraint& m = *r.memory;
    for (int c = 0; c < nc; ++c) {
      const int i = classes.representative[c];
      const double room = m.capacity[i] - m.constant[i];
      double full = 0;  // bytes at ratio 1 in every segment
      for (int s = 0; s < r.num_segments; ++s) full += m.coef[s][i];
      if (full <= room) continue;                        // never binding
      if (room < 0) return DiagnoseMemory(r, deadline);  // not even at 0
      const double scale = MemoryRowScale(m, i);
      column.clear();
      for (int s = 0; s < r.num_segments; ++s) {
        column.push_back({x_row(s, c), -m.coef[s][i] / scale});
      }
      dual.AddColumn(0, kInf, -room / scale, column);  // z_c
    }
  }

  // Measured on 5,000 terms x 64 distinct devices (320k columns): the primal
  // simplex with Dantzig pricing 3-4 s, with steepest edge (GLPK's default,
  // which keeps a weight per column) 8-13 s; the dual simplex, minutes.
  GlpkLp::SolveOptions options;
  options.presolve = true;
  options.method = GLP_PRIMAL;
  options.pricing = GLP_PT_STD;
  const double left = SecondsLeft(deadline);
  if (left <= 0) {
    return absl::DeadlineExceededError(
        "ratio LP: the time limit was reached while building the LP");
  }
  HAP_ASSIGN_OR_RETURN(LpOutcome outcome,
                       dual.Solve(left, options, "ratio LP (dual)"));
  switch (outcome) {
    case LpOutcome::kOptimal:
      break;
    case LpOutcome::kUnbounded:
    case LpOutcome::kUnboundedOrInfeasible:  // the dual is feasible: unbounded
      if (r.memory.has_value()) return DiagnoseMemory(r, deadline);
      return absl::InternalError(
          "ratio LP is infeasible without memory constraints, which cannot "
          "happen");
    case LpOutcome::kInfeasible:
      return absl::InternalError(
          "the dual of the ratio LP is infeasible, which cannot happen");
  }
  RatioLpResult result;
  result.ratios = ExtractRatios(r, [&](int j) {
    const int s = j / r.num_devices, i = j % r.num_devices;
    return dual.row_dual(x_row(s, classes.class_of[i]));
  });
  result.objective = (dual.objective() + offset) * weight_scale + constant;
  return result;
}

std::vector<double> EventTimes(const CriticalPath& path,
                               const std::vector<double>& term_values) {
  if (path.num_events < 1) return {};
  std::vector<std::vector<const Precedence*>> into(path.num_events);
  for (const Precedence& e : path.edges) {
    if (e.from < 0 || e.to <= e.from || e.to >= path.num_events) return {};
    into[e.to].push_back(&e);
  }
  std::vector<double> t(path.num_events, 0);
  for (int j = 1; j < path.num_events; ++j) {
    for (const Precedence* e : into[j]) {
      double len = t[e->from] + e->constant;
      for (int k : e->terms) {
        if (k < 0 || k >= static_cast<int>(term_values.size())) return {};
        len += term_values[k];
      }
      t[j] = std::max(t[j], len);
    }
  }
  return t;
}

// Returns NaN when `ratios` does not have the request's shape.
double EvaluateObjective(const RatioLpRequest& request,
                         const std::vector<std::vector<double>>& ratios) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (ratios.size() != static_cast<size_t>(request.num_segments)) return nan;
  for (const auto& seg : ratios) {
    if (seg.size() != static_cast<size_t>(request.num_devices)) return nan;
  }
  std::vector<bool> in_path(request.terms.size(), false);
  if (request.path.has_value()) {
    for (const Precedence& e : request.path->edges) {
      for (int k : e.terms) {
        if (k < 0 || k >= static_cast<int>(in_path.size())) return nan;
        in_path[k] = true;
      }
    }
  }
  double total = 0;
  std::vector<double> value(request.terms.size(), 0);
  for (size_t k = 0; k < request.terms.size(); ++k) {
    const CostTerm& t = request.terms[k];
    if (t.segment < 0 || t.segment >= request.num_segments ||
        t.coef.size() != ratios[t.segment].size() ||
        t.constant.size() != ratios[t.segment].size()) {
      return nan;
    }
    double worst = -kInf;
    for (int i = 0; i < request.num_devices; ++i) {
      worst = std::max(worst, t.coef[i] * ratios[t.segment][i] + t.constant[i]);
    }
    value[k] = t.weight * worst;
    if (!in_path[k]) total += value[k];
  }
  if (request.path.has_value()) {
    const std::vector<double> times = EventTimes(*request.path, value);
    if (times.empty()) return nan;
    total += request.path->weight * times.back();
  }
  return total;
}

// InvalidArgument for a malformed request or ratios of the wrong shape, a
// non-finite or negative ratio, or a segment not summing to 1;
// ResourceExhausted for a device over its memory capacity.
absl::Status CheckRatios(const RatioLpRequest& request,
                         const std::vector<std::vector<double>>& ratios) {
  constexpr double kTol = 1e-6;
  HAP_RETURN_IF_ERROR(ValidateRequest(request));
  const RatioLpRequest& r = request;
  HAP_RETURN_IF_ERROR(
      CheckSize(ratios.size(), r.num_segments, "ratios", "num_segments"));
  for (int s = 0; s < r.num_segments; ++s) {
    HAP_RETURN_IF_ERROR(CheckSize(ratios[s].size(), r.num_devices,
                                  absl::StrCat("ratios[", s, "]"),
                                  "num_devices"));
    double sum = 0;
    for (int i = 0; i < r.num_devices; ++i) {
      const double b = ratios[s][i];
      if (!std::isfinite(b) || b < -kTol) {
        return absl::InvalidArgumentError(
            absl::StrCat("ratios[", s, "][", i, "] = ", b,
                         "; expected a finite value >= 0"));
      }
      sum += b;
    }
    if (std::abs(sum - 1) > kTol) {
      return absl::InvalidArgumentError(
          absl::StrCat("ratios[", s, "] sums to ", sum, "; expected 1"));
    }
  }
  if (r.memory.has_value()) {
    const MemoryConstraint& m = *r.memory;
    for (int i = 0; i < r.num_devices; ++i) {
      const double use = MemoryUse(m, ratios, i);
      if (use - m.capacity[i] > kTol * MemoryRowScale(m, i)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "device '", DeviceName(r, i), "' uses ", FormatBytes(use),
            " but has ", FormatBytes(m.capacity[i])));
      }
    }
  }
  return absl::OkStatus();
}

// Ratios are normalised to sum 1 first; negative and non-finite ratios count
// as 0, and if none is positive the split is even. length <= 0 gives zeros;
// granularity < 1 is treated as 1.
std::vector<int64_t> RoundShards(int64_t length,
                                 const std::vector<double>& ratios,
                                 int64_t granularity) {
  const size_t n = ratios.size();
  std::vector<int64_t> lengths(n, 0);
  if (n == 0 || length <= 0) return lengths;
  const int64_t g = std::max<int64_t>(granularity, 1);

  std::vector<double> b(n, 0);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    b[i] = std::isfinite(ratios[i]) && ratios[i] > 0 ? ratios[i] : 0;
    sum += b[i];
  }
  if (!(sum > 0) || !std::isfinite(sum)) {
    std::fill(b.begin(), b.end(), 1.0);
    sum = static_cast<double>(n);
  }
  for (double& x : b) x /= sum;

  const int64_t units = length / g;
  const int64_t partial = length % g;
  // deficit[i]: device i's exact share, in units of g, minus what it has.
  std::vector<double> deficit(n);
  std::vector<int64_t> given(n);
  // Unsigned: near 2^63 the floors' sum can pass INT64_MAX before the
  // surplus is taken back (each is at most `units`, their sum about it).
  uint64_t assigned = 0;
  const uint64_t all_units = static_cast<uint64_t>(units);
  for (size_t i = 0; i < n; ++i) {
    const double target =
        b[i] * static_cast<double>(length) / static_cast<double>(g);
    // A target of `units` or more (up to 2^63, which no int64 holds) is
    // `units`; below it the floor converts.
    given[i] =
        target >= static_cast<double>(units) ? units : static_cast<int64_t>(std::floor(target));
    deficit[i] = target - static_cast<double>(given[i]);
    assigned += static_cast<uint64_t>(given[i]);
  }
  // Rounding can in principle push the floors past `units`; take back from
  // the largest surplus (smallest deficit, ties to the higher index).
  while (assigned > all_units) {
    size_t best = n;
    for (size_t i = 0; i < n; ++i) {
      if (given[i] > 0 && (best == n || deficit[i] <= deficit[best])) best = i;
    }
    --given[best];
    deficit[best] += 1;
    --assigned;
  }
  // Remaining whole units: one at a time to the largest deficit among the
  // devices with a positive ratio, ties to the lower index.
  for (; assigned < all_units; ++assigned) {
    size_t best = n;
    for (size_t i = 0; i < n; ++i) {
      if (b[i] > 0 && (best == n || deficit[i] > deficit[best])) best = i;
    }
    ++given[best];
    deficit[best] -= 1;
  }
  size_t largest = 0;
  for (size_t i = 1; i < n; ++i) {
    if (b[i] > b[largest]) largest = i;
  }
  for (size_t i = 0; i < n; ++i) lengths[i] = given[i] * g;
  lengths[largest] += partial;
  return lengths;
}

std::vector<int64_t> RoundShardsAtLeastOne(int64_t length, const std::vector<double>& ratios) {
  std::vector<int64_t> m = RoundShards(length, ratios);
  const int64_t n = static_cast<int64_t>(m.size());
  if (n == 0 || length < n) return m;
  for (int64_t& x : m) {
    while (x == 0) {
      --*std::max_element(m.begin(), m.end());
      ++x;
    }
  }
  return m;
}

}  // namespace hap::ratios
