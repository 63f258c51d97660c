// Whole samples (docs/design.md §6): the lowering runs
// RoundShardsAtLeastOne(batch, ratios) samples per device (every device at
// least one, also where the ratios give it none), so a plan is predicted and
// reported at those. For the search's own result the split is also moved by
// one sample from one device to another where the model predicts that
// faster.
//
// The rounded split m (m_d samples on device d) and its one-sample moves
// m - e_i + e_j (i != j, m_i >= 2) are candidates; the first of them in the
// order  m, then (i, j) lexicographically  whose predicted step
//
//   T(m) = sum_k w_k max_d (coef_k[d] m_d / batch + constant_k[d])
//
// is below the best so far by a relative 1e-9, and whose devices all hold at
// least one sample and fit in memory, wins.
//
// Devices that look the same to every block term and to memory and hold the
// same m_d form a group; a move's cost depends only on the groups of i and j,
// so the N(N-1) moves reduce to G^2 group moves, each represented by its
// first (i, j) in the order above (a group's first device, and for a move
// inside a group its second). Each is evaluated in O(K) for K merged block
// terms from a per-term table of every group's value at m_d - 1, m_d, m_d + 1
// and the three largest values over groups: the term's maximum without the
// two groups a move touches is the first of those three outside them. Nothing
// is materialised per move, so time is O(N K log N + G^2 K) and memory
// O((N + G) K).
//
// With overlap (Program::overlap) the step is EvaluateProgram's critical path,
// not a sum of maxima: devices are grouped by its terms (AddProgramTerms) and
// each group move is priced whole, in O(K N).
//
// Thread-safety: pure functions of their arguments.
#ifndef HAP_PLANNER_SYNTH_SNAP_H_
#define HAP_PLANNER_SYNTH_SNAP_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "planner/ratios/ratio_lp.h"
#include "planner/synth/program.h"

namespace hap::synth {

struct SnapRequest {
  const Program* program = nullptr;
  std::vector<double> ratios;  // per device, e.g. the LP's
  int64_t batch = 0;           // samples of the global batch, >= devices
  // Memory per device (MemoryModel); none = memory not checked.
  const ratios::MemoryConstraint* memory = nullptr;
  // false: only round (a baseline keeps its split).
  bool neighbours = true;
  // Moves are evaluated until then; the best found so far is returned.
  std::optional<std::chrono::steady_clock::time_point> deadline;
};

struct SnapResult {
  // Whole samples / batch per device; empty when no candidate is valid
  // (a device with no sample or over its memory in all of them).
  std::vector<double> ratios;
  double cost = 0;              // T at `ratios` (the critical path with overlap)
  int groups = 0;               // G
  int64_t moves_evaluated = 0;  // group moves, not device pairs
  bool complete = true;         // false: the deadline cut the moves
};

SnapResult SnapToSamples(const SnapRequest& request);

}  // namespace hap::synth

#endif  // HAP_PLANNER_SYNTH_SNAP_H_
