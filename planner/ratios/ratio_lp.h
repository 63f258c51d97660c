// The sharding-ratio linear program (docs/design.md §6), as plain data: a request
// in, a result out, and an independent evaluator. No graph, no program: the
// synthesizer (planner/synth) turns a program into cost terms.
//
// Variables: b[s][i] >= 0, the fraction of every sharded dimension of segment
// s held by device i; sum_i b[s][i] = 1 for every segment s.
//
// Each cost term k is   weight_k * max_i ( coef_k[i] * b[seg_k][i] + constant_k[i] ).
// (A device's compute time of a sharded op, a padded collective's time, a
// constant replicated op: all have this form.)
//
//   minimise    sum_k weight_k * t_k
//   subject to  t_k >= coef_k[i] * b[seg_k][i] + constant_k[i]   for all k, i
//               sum_i b[s][i] = 1                                for all s
//               b[s][i] >= 0
//               memory: sum_s mem_coef[s][i] * b[s][i] + mem_constant[i]
//                         <= capacity[i]                          for all i
//
// A step whose communication overlaps its compute is priced as a critical
// path (CriticalPath): event times E_j are further variables, 0 = the step's
// start, with precedence rows
//               E_to >= E_from + sum_{k in edge} value_k + constant_edge
// (value_k = weight_k * max_i(...), term k's t_k) and path.weight * E_last
// in the objective in place of the terms the edges name. Linear: a max over
// the compute and the communication resource is two edges into one event.
//
// Thread-safety: SolveRatioLp is thread-safe (GLPK state is per call).
#ifndef HAP_PLANNER_RATIOS_RATIO_LP_H_
#define HAP_PLANNER_RATIOS_RATIO_LP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hap::ratios {

struct CostTerm {
  int segment = 0;
  std::vector<double> coef;      // per device
  std::vector<double> constant;  // per device
  double weight = 1.0;           // identical terms merged: weight = count
};

struct MemoryConstraint {
  std::vector<std::vector<double>> coef;  // [segment][device], bytes per unit ratio
  std::vector<double> constant;           // [device], bytes independent of ratios
  std::vector<double> capacity;           // [device], bytes
  std::vector<std::string> device_names;  // for error messages
};

// E[to] >= E[from] + the named terms' values + constant (from < to).
struct Precedence {
  int from = 0;
  int to = 0;
  std::vector<int> terms;  // indices into RatioLpRequest::terms
  double constant = 0;     // seconds
};

// Events 0 .. num_events-1 in an order where every edge goes forward; event
// 0 is the start (time 0), the last event the end whose time counts.
struct CriticalPath {
  int num_events = 0;
  std::vector<Precedence> edges;
  double weight = 1.0;
};

struct RatioLpRequest {
  int num_devices = 0;
  int num_segments = 1;
  std::vector<CostTerm> terms;
  // Terms named by its edges count through the path only.
  std::optional<CriticalPath> path;
  std::optional<MemoryConstraint> memory;
  double time_limit_seconds = 10;  // GLPK's time limit
};

struct RatioLpResult {
  std::vector<std::vector<double>> ratios;  // [segment][device]
  double objective = 0;                     // predicted seconds
};

// Solves the LP with GLPK's simplex. Errors: InvalidArgument for malformed
// requests (sizes, NaN/negative numbers); ResourceExhausted "does not fit"
// naming the device and bytes when memory makes it infeasible;
// DeadlineExceeded when GLPK's time limit is hit.
absl::StatusOr<RatioLpResult> SolveRatioLp(const RatioLpRequest& request);

// The objective for given ratios, computed directly (not by GLPK).
double EvaluateObjective(const RatioLpRequest& request,
                         const std::vector<std::vector<double>>& ratios);
// The earliest time of every event of `path` given each term's value
// (weight included); empty when an edge is malformed.
std::vector<double> EventTimes(const CriticalPath& path,
                               const std::vector<double>& term_values);
// Checks ratios against the constraints (sum 1, >= 0, memory); tolerance
// relative 1e-6.
absl::Status CheckRatios(const RatioLpRequest& request,
                         const std::vector<std::vector<double>>& ratios);

// Integer shard lengths for a dimension of `length` split by `ratios`:
// floor(b_i * length / granularity) units of `granularity`, then the
// remaining units to the devices with the largest deficit (ties to the
// lower index). Sum equals length when length % granularity == 0; the last
// partial unit (if any) goes to the device with the largest ratio.
std::vector<int64_t> RoundShards(int64_t length,
                                 const std::vector<double>& ratios,
                                 int64_t granularity = 1);

// RoundShards(length, ratios), then, where `length` has at least one unit
// per device, every device left with none given one, taken from the device
// with the most (the first of them): the split the lowering lays out
// (planner/lower DimClasses), so that no kernel sees an empty shard.
std::vector<int64_t> RoundShardsAtLeastOne(int64_t length, const std::vector<double>& ratios);

}  // namespace hap::ratios

#endif  // HAP_PLANNER_RATIOS_RATIO_LP_H_
