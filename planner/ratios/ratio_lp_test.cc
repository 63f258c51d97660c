#include "planner/ratios/ratio_lp.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::ratios {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr double kGiB = 1024.0 * 1024 * 1024;

using ::hap::testing::StatusIs;

CostTerm Term(std::vector<double> coef, std::vector<double> constant = {},
              double weight = 1, int segment = 0) {
  CostTerm t;
  t.segment = segment;
  if (constant.empty()) constant.assign(coef.size(), 0.0);
  t.coef = std::move(coef);
  t.constant = std::move(constant);
  t.weight = weight;
  return t;
}

// A sharded op of `flops` on devices of the given speeds: time F / FLOPS_i.
CostTerm ComputeTerm(double flops, const std::vector<double>& device_flops,
                     int segment = 0) {
  std::vector<double> coef;
  for (double f : device_flops) coef.push_back(flops / f);
  return Term(coef, {}, 1, segment);
}

RatioLpRequest Request(int num_devices, std::vector<CostTerm> terms,
                       int num_segments = 1) {
  RatioLpRequest r;
  r.num_devices = num_devices;
  r.num_segments = num_segments;
  r.terms = std::move(terms);
  return r;
}

MemoryConstraint Memory(std::vector<std::vector<double>> coef,
                        std::vector<double> constant,
                        std::vector<double> capacity) {
  MemoryConstraint m;
  m.coef = std::move(coef);
  m.constant = std::move(constant);
  m.capacity = std::move(capacity);
  for (size_t i = 0; i < m.capacity.size(); ++i) {
    m.device_names.push_back(absl::StrCat("node", i, "/gpu0"));
  }
  return m;
}

double RelDiff(double a, double b) {
  return std::abs(a - b) / std::max({std::abs(a), std::abs(b), 1e-300});
}

// Every LP answer must be feasible and its objective must be what the
// independent evaluator computes for its ratios.
void ExpectConsistent(const RatioLpRequest& r, const RatioLpResult& result) {
  EXPECT_TRUE(CheckRatios(r, result.ratios).ok())
      << CheckRatios(r, result.ratios);
  const double eval = EvaluateObjective(r, result.ratios);
  EXPECT_LE(RelDiff(eval, result.objective), 1e-7)
      << "evaluated " << eval << " vs LP " << result.objective;
}

// ---------------------------------------------------------------------------
// (a) Compute-bound instances.
// ---------------------------------------------------------------------------

TEST(RatioLpTest, EqualFlopsGiveEqualRatios) {
  const double kF = 3e12;
  for (int n : {1, 2, 4, 7}) {
    const std::vector<double> flops(n, 100e12);
    RatioLpRequest r = Request(n, {ComputeTerm(kF, flops)});
    absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->ratios.size(), 1u);
    for (double b : result->ratios[0]) EXPECT_NEAR(b, 1.0 / n, 1e-6);
    EXPECT_NEAR(result->objective, kF / (100e12 * n), 1e-12);
    ExpectConsistent(r, *result);
  }
}

TEST(RatioLpTest, FlopsTwoToOneGiveTwoThirdsOneThird) {
  const std::vector<double> flops = {200e12, 100e12};
  // Several ops of one segment: each is balanced by the same split.
  RatioLpRequest r =
      Request(2, {ComputeTerm(1e12, flops), ComputeTerm(5e12, flops),
                  ComputeTerm(2e11, flops)});
  absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NEAR(result->ratios[0][0], 2.0 / 3, 1e-6);
  EXPECT_NEAR(result->ratios[0][1], 1.0 / 3, 1e-6);
  EXPECT_NEAR(result->objective, 6.2e12 / 300e12, 1e-12);
  ExpectConsistent(r, *result);
}

TEST(RatioLpTest, NoTermsGivesZeroObjective) {
  RatioLpRequest r = Request(3, {});
  absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->objective, 0);
  ExpectConsistent(r, *result);
}

TEST(RatioLpTest, ConstantTermsAddUp) {
  // A replicated op (no coefficient) costs its slowest device's constant.
  RatioLpRequest r =
      Request(2, {Term({0, 0}, {0.5, 0.25}, 2), Term({1, 1}, {0, 0})});
  absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NEAR(result->objective, 2 * 0.5 + 0.5, 1e-9);
  ExpectConsistent(r, *result);
}

// ---------------------------------------------------------------------------
// (b) Random instances against a brute-force grid over the ratio simplex.
// ---------------------------------------------------------------------------

// All points of the simplex {b >= 0, sum b = 1} in `n` dimensions with
// coordinates in multiples of 1/steps.
std::vector<std::vector<double>> SimplexGrid(int n, int steps) {
  std::vector<std::vector<double>> points;
  std::vector<int> counts(n, 0);
  std::function<void(int, int)> rec = [&](int i, int left) {
    if (i == n - 1) {
      counts[i] = left;
      std::vector<double> p(n);
      for (int j = 0; j < n; ++j) p[j] = static_cast<double>(counts[j]) / steps;
      points.push_back(p);
      return;
    }
    for (int c = 0; c <= left; ++c) {
      counts[i] = c;
      rec(i + 1, left - c);
    }
  };
  rec(0, steps);
  return points;
}

bool MemoryFeasible(const RatioLpRequest& r,
                    const std::vector<std::vector<double>>& ratios) {
  if (!r.memory.has_value()) return true;
  const MemoryConstraint& m = *r.memory;
  for (int i = 0; i < r.num_devices; ++i) {
    double use = m.constant[i];
    for (int s = 0; s < r.num_segments; ++s) use += m.coef[s][i] * ratios[s][i];
    if (use > m.capacity[i]) return false;
  }
  return true;
}

struct GridResult {
  double best = std::numeric_limits<double>::infinity();
  int feasible_points = 0;
};

GridResult GridSearch(const RatioLpRequest& r, int steps) {
  const std::vector<std::vector<double>> grid =
      SimplexGrid(r.num_devices, steps);
  GridResult out;
  std::vector<std::vector<double>> ratios(r.num_segments);
  std::function<void(int)> rec = [&](int s) {
    if (s == r.num_segments) {
      if (!MemoryFeasible(r, ratios)) return;
      ++out.feasible_points;
      out.best = std::min(out.best, EvaluateObjective(r, ratios));
      return;
    }
    for (const auto& p : grid) {
      ratios[s] = p;
      rec(s + 1);
    }
  };
  rec(0);
  return out;
}

// How far the grid optimum can be above the true optimum. f is Lipschitz in
// the max-norm of b with constant L = sum_k w_k max_i coef_k[i]; rounding any
// point of the simplex to the grid moves each coordinate by less than one
// step. With memory rows, first move the optimum a fraction lambda towards
// the (feasible) uniform split so that it has enough slack for rounding:
// lambda = max_i step * sum_s mem_coef[s][i] / slack_i(uniform).
double GridTolerance(const RatioLpRequest& r, int steps) {
  const double step = 1.0 / steps;
  double lipschitz = 0;
  for (const CostTerm& t : r.terms) {
    lipschitz += t.weight * *std::max_element(t.coef.begin(), t.coef.end());
  }
  double lambda = 0;
  if (r.memory.has_value()) {
    const MemoryConstraint& m = *r.memory;
    for (int i = 0; i < r.num_devices; ++i) {
      double use = m.constant[i], sum_coef = 0;
      for (int s = 0; s < r.num_segments; ++s) {
        use += m.coef[s][i] / r.num_devices;
        sum_coef += m.coef[s][i];
      }
      const double slack = m.capacity[i] - use;
      lambda = std::max(lambda, step * sum_coef / slack);
    }
  }
  return lipschitz * (step + std::min(lambda, 1.0)) * 1.001 + 1e-9;
}

RatioLpRequest RandomInstance(std::mt19937& rng, int num_devices,
                              int num_segments, bool with_memory) {
  std::uniform_real_distribution<double> u01(0, 1);
  auto uniform = [&](double lo, double hi) {
    return lo + (hi - lo) * u01(rng);
  };
  RatioLpRequest r;
  r.num_devices = num_devices;
  r.num_segments = num_segments;
  std::vector<double> flops(num_devices);
  for (double& f : flops) f = uniform(1, 4);
  const int num_terms = 3 + static_cast<int>(rng() % 10);
  for (int k = 0; k < num_terms; ++k) {
    CostTerm t;
    t.segment = static_cast<int>(rng() % num_segments);
    t.weight = (rng() % 2) ? 1.0 : uniform(0.5, 3);
    t.coef.resize(num_devices);
    t.constant.resize(num_devices);
    switch (rng() % 4) {
      case 0:
      case 1: {  // compute of a sharded op (occasionally per-op speeds)
        const double work = uniform(0.5, 2);
        const bool jitter = rng() % 3 == 0;
        for (int i = 0; i < num_devices; ++i) {
          t.coef[i] = work / (flops[i] * (jitter ? uniform(0.7, 1.3) : 1));
          t.constant[i] = (rng() % 2) ? 0 : uniform(0, 0.05);
        }
        break;
      }
      case 2: {  // padded collective: n * max b_i, plus a latency
        const double c = uniform(0.1, 1.5);
        const double latency = uniform(0, 0.1);
        for (int i = 0; i < num_devices; ++i) {
          t.coef[i] = c;
          t.constant[i] = latency;
        }
        break;
      }
      default:  // replicated op: constant only
        for (int i = 0; i < num_devices; ++i) t.constant[i] = uniform(0, 0.3);
        break;
    }
    r.terms.push_back(t);
  }
  if (with_memory) {
    MemoryConstraint m;
    m.coef.assign(num_segments, std::vector<double>(num_devices));
    m.constant.resize(num_devices);
    m.capacity.resize(num_devices);
    for (int i = 0; i < num_devices; ++i) {
      double sum_coef = 0;
      for (int s = 0; s < num_segments; ++s) {
        m.coef[s][i] = uniform(1, 10) * kGiB;
        sum_coef += m.coef[s][i];
      }
      m.constant[i] = uniform(0, 2) * kGiB;
      // Between comfortably above the uniform split and "never binding".
      const double share =
          num_devices == 2 ? uniform(0.6, 1.1) : uniform(0.45, 1.0);
      m.capacity[i] = m.constant[i] + share * sum_coef;
      m.device_names.push_back(absl::StrCat("dev", i));
    }
    r.memory = m;
  }
  return r;
}

void CheckAgainstGrid(int num_devices, int steps, int num_instances,
                      uint32_t seed) {
  std::mt19937 rng(seed);
  for (int n = 0; n < num_instances; ++n) {
    const int num_segments = num_devices == 2 ? 1 + n % 2 : 1;
    const bool with_memory = n % 3 != 0;
    const RatioLpRequest r =
        RandomInstance(rng, num_devices, num_segments, with_memory);
    SCOPED_TRACE(absl::StrCat("devices ", num_devices, " instance ", n,
                              " segments ", num_segments, " memory ",
                              with_memory));
    absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
    ASSERT_TRUE(result.ok()) << result.status();
    ExpectConsistent(r, *result);
    const GridResult grid = GridSearch(r, steps);
    ASSERT_GT(grid.feasible_points, 0);
    const double tol = GridTolerance(r, steps);
    EXPECT_LE(result->objective, grid.best + 1e-9 * std::abs(grid.best) + 1e-12)
        << "LP is worse than a grid point";
    EXPECT_GE(result->objective, grid.best - tol)
        << "LP " << result->objective << " grid " << grid.best << " tol "
        << tol;
  }
}

TEST(RatioLpTest, MatchesGridSearchOnTwoDevices) {
  CheckAgainstGrid(/*num_devices=*/2, /*steps=*/200, /*num_instances=*/30,
                   /*seed=*/12345);
}

TEST(RatioLpTest, MatchesGridSearchOnThreeDevices) {
  CheckAgainstGrid(/*num_devices=*/3, /*steps=*/60, /*num_instances=*/30,
                   /*seed=*/777);
}

// ---------------------------------------------------------------------------
// Critical paths (communication overlapping compute).
// ---------------------------------------------------------------------------

TEST(RatioLpTest, CriticalPathIsTheMaxOfComputeAndOverlappedCommunication) {
  // Compute 2 b0 vs 1 b1 (best alone: b = 1/3, 2/3, time 2/3) overlapped
  // with a collective of `comm` seconds: the step is max(compute, comm).
  for (double comm : {0.5, 0.9}) {
    RatioLpRequest r = Request(2, {Term({2, 1}), Term({0, 0}, {comm, comm})});
    CriticalPath path;
    path.num_events = 2;
    path.edges = {{0, 1, {0}, 0}, {0, 1, {1}, 0}};
    r.path = path;
    absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
    ASSERT_TRUE(result.ok()) << result.status();
    ExpectConsistent(r, *result);
    EXPECT_NEAR(result->objective, std::max(comm, 2.0 / 3), 1e-9);
    // Summed instead (no path): compute + comm.
    r.path.reset();
    EXPECT_NEAR(SolveRatioLp(r)->objective, 2.0 / 3 + comm, 1e-9);
  }
}

TEST(RatioLpTest, CriticalPathThroughALaunchPoint) {
  // A collective launched after the first part of the compute (prefix term
  // 1 b0 | 0.5 b1) runs 0.6 s; the rest of the compute follows: the step is
  // max(prefix + comm, whole compute) with whole = 2 b0 | 1 b1 (+ a 0.1 s
  // tail on the wait edge's side as a constant).
  RatioLpRequest r = Request(2, {Term({1, 0.5}), Term({0, 0}, {0.6, 0.6}),
                                 Term({2, 1})});
  CriticalPath path;
  path.num_events = 3;  // 0 start, 1 launch, 2 end
  path.edges = {{0, 1, {0}, 0}, {1, 2, {1}, 0.1}, {0, 2, {2}, 0}};
  r.path = path;
  absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
  ASSERT_TRUE(result.ok()) << result.status();
  ExpectConsistent(r, *result);
  // At b = 1/3, 2/3: prefix 1/3, + 0.6 + 0.1 = 1.0333; whole 2/3. Both
  // terms are minimised by the same split, so the optimum is 1/3 + 0.7.
  EXPECT_NEAR(result->objective, 1.0 / 3 + 0.7, 1e-9);
  EXPECT_NEAR(result->ratios[0][0], 1.0 / 3, 1e-6);
  std::vector<double> values = {1.0 / 3, 0.6, 2.0 / 3};
  std::vector<double> times = EventTimes(path, values);
  ASSERT_EQ(times.size(), 3u);
  EXPECT_NEAR(times[2], 1.0 / 3 + 0.7, 1e-12);
}

void AddRandomPath(std::mt19937& rng, RatioLpRequest* r) {
  std::uniform_real_distribution<double> u01(0, 1);
  CriticalPath path;
  path.num_events = 2 + static_cast<int>(rng() % 4);
  for (int j = 0; j + 1 < path.num_events; ++j) {
    path.edges.push_back({j, j + 1, {}, 0.1 * u01(rng)});
  }
  for (size_t k = 0; k < r->terms.size(); ++k) {
    if (rng() % 3 == 0) continue;  // stays outside the path
    const int from = static_cast<int>(rng() % (path.num_events - 1));
    const int to = from + 1 + static_cast<int>(rng() % (path.num_events - 1 - from));
    path.edges.push_back({from, to, {static_cast<int>(k)}, 0});
  }
  r->path = path;
}

TEST(RatioLpTest, CriticalPathsMatchGridSearch) {
  std::mt19937 rng(4242);
  for (int n = 0; n < 40; ++n) {
    const int devices = 2 + n % 2;
    RatioLpRequest r = RandomInstance(rng, devices, devices == 2 ? 1 + n % 2 : 1, n % 3 != 0);
    AddRandomPath(rng, &r);
    SCOPED_TRACE(absl::StrCat("instance ", n));
    absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
    ASSERT_TRUE(result.ok()) << result.status();
    ExpectConsistent(r, *result);
    const int steps = devices == 2 ? 200 : 60;
    const GridResult grid = GridSearch(r, steps);
    ASSERT_GT(grid.feasible_points, 0);
    const double tol = GridTolerance(r, steps);
    EXPECT_LE(result->objective, grid.best + 1e-9 * std::abs(grid.best) + 1e-12);
    EXPECT_GE(result->objective, grid.best - tol)
        << "LP " << result->objective << " grid " << grid.best;
  }
}

TEST(RatioLpTest, RejectsMalformedPaths) {
  RatioLpRequest r = Request(2, {Term({1, 1})});
  CriticalPath path;
  path.num_events = 2;
  path.edges = {{1, 1, {0}, 0}};
  r.path = path;
  EXPECT_THAT(SolveRatioLp(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("path.edges[0] goes from event 1 to 1")));
  r.path->edges = {{0, 1, {3}, 0}};
  EXPECT_THAT(SolveRatioLp(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("names term 3")));
  r.path->edges = {{0, 1, {0}, -1}};
  EXPECT_THAT(SolveRatioLp(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("path.edges[0].constant")));
  r.path->num_events = 1;
  EXPECT_THAT(SolveRatioLp(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("path.num_events")));
}

// ---------------------------------------------------------------------------
// (c) Memory.
// ---------------------------------------------------------------------------

TEST(RatioLpTest, SmallDeviceGetsOnlyWhatFits) {
  // Equal speeds want 0.5 / 0.5, but device 1 holds only 3 of 10 GiB.
  RatioLpRequest r = Request(2, {Term({1, 1})});
  r.memory = Memory({{10 * kGiB, 10 * kGiB}}, {0, 0}, {16 * kGiB, 3 * kGiB});
  absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::vector<double>& b = result->ratios[0];
  EXPECT_LE(10 * kGiB * b[1], 3 * kGiB * (1 + 1e-9));  // the memory row
  EXPECT_NEAR(b[0], 0.7, 1e-6);
  EXPECT_NEAR(b[1], 0.3, 1e-6);
  EXPECT_NEAR(result->objective, 0.7, 1e-6);
  ExpectConsistent(r, *result);
}

TEST(RatioLpTest, MemoryAcrossSegmentsAndConstants) {
  // Two segments share device 1's memory (1 GiB fixed + 2 + 4 GiB per unit
  // ratio, 3 GiB capacity): 2 x + 4 y <= 2 for its shares x, y. The cost
  // max(x, 1-x) + max(y, 1-y) is best at x = 0.5, y = 0.25: taking d off x
  // costs d and buys only d/2 off y.
  const std::vector<double> flops = {1, 1};
  RatioLpRequest r =
      Request(2, {ComputeTerm(1, flops, 0), ComputeTerm(1, flops, 1)}, 2);
  r.memory = Memory({{2 * kGiB, 2 * kGiB}, {4 * kGiB, 4 * kGiB}}, {0, 1 * kGiB},
                    {100 * kGiB, 3 * kGiB});
  absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
  ASSERT_TRUE(result.ok()) << result.status();
  const auto& b = result->ratios;
  EXPECT_LE(1 * kGiB + 2 * kGiB * b[0][1] + 4 * kGiB * b[1][1],
            3 * kGiB * (1 + 1e-9));
  EXPECT_NEAR(b[0][1], 0.5, 1e-6);
  EXPECT_NEAR(b[1][1], 0.25, 1e-6);
  EXPECT_NEAR(result->objective, 1.25, 1e-6);
  ExpectConsistent(r, *result);
}

TEST(RatioLpTest, ConstantOverCapacityDoesNotFit) {
  // Device 1's fixed 10 GiB exceed its 8 GiB whatever the split.
  RatioLpRequest r = Request(2, {Term({1, 1})});
  r.memory =
      Memory({{12 * kGiB, 12 * kGiB}}, {0, 10 * kGiB}, {16 * kGiB, 8 * kGiB});
  EXPECT_THAT(SolveRatioLp(r),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("does not fit"), HasSubstr("node1/gpu0"),
                             HasSubstr("10.0 GiB (10737418240 bytes)"),
                             HasSubstr("8.0 GiB (8589934592 bytes)"))));
}

TEST(RatioLpTest, TotalOverCapacityDoesNotFit) {
  // 10 GiB to split over 4 + 2 GiB: the smallest largest overflow is at
  // 0.6 / 0.4 (2 GiB over on both); the first such device is named.
  RatioLpRequest r = Request(2, {Term({1, 1})});
  r.memory = Memory({{10 * kGiB, 10 * kGiB}}, {0, 0}, {4 * kGiB, 2 * kGiB});
  EXPECT_THAT(
      SolveRatioLp(r),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("does not fit"), HasSubstr("node0/gpu0"),
                     HasSubstr("needs at least 6.0 GiB"),
                     HasSubstr("has 4.0 GiB"), HasSubstr("2 devices"))));
}

TEST(RatioLpTest, UnnamedDeviceInMessage) {
  RatioLpRequest r = Request(3, {Term({1, 1, 1})});
  r.memory = Memory({{30 * kGiB, 30 * kGiB, 30 * kGiB}}, {0, 0, 0},
                    {1 * kGiB, 1 * kGiB, 1 * kGiB});
  r.memory->device_names.clear();
  EXPECT_THAT(SolveRatioLp(r), StatusIs(absl::StatusCode::kResourceExhausted,
                                        AllOf(HasSubstr("does not fit"),
                                              HasSubstr("device 'device 0'"))));
}

TEST(RatioLpTest, CheckRatiosReportsMemoryAndSums) {
  RatioLpRequest r = Request(2, {Term({1, 1})});
  r.memory = Memory({{10 * kGiB, 10 * kGiB}}, {0, 0}, {16 * kGiB, 3 * kGiB});
  EXPECT_TRUE(CheckRatios(r, {{0.7, 0.3}}).ok());
  EXPECT_THAT(
      CheckRatios(r, {{0.5, 0.5}}),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("node1/gpu0")));
  EXPECT_THAT(CheckRatios(r, {{0.5, 0.4}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ratios[0] sums to")));
  EXPECT_THAT(
      CheckRatios(r, {{1.1, -0.1}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ratios[0][1]")));
  EXPECT_THAT(CheckRatios(r, {{1.0}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ratios[0] has 1 entries")));
  EXPECT_THAT(CheckRatios(r, {}), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("ratios has 0 entries")));
}

TEST(RatioLpTest, EvaluateObjectiveByHand) {
  RatioLpRequest r =
      Request(2, {Term({2, 4}, {0, 1}, 3), Term({1, 1}, {0.5, 0}, 1, 1)}, 2);
  // Term 0: 3 * max(2*0.25, 4*0.75 + 1) = 12; term 1: max(0.5+0.5, 0.5) = 1.
  EXPECT_DOUBLE_EQ(EvaluateObjective(r, {{0.25, 0.75}, {0.5, 0.5}}), 13);
  EXPECT_TRUE(std::isnan(EvaluateObjective(r, {{0.25, 0.75}})));
}

// ---------------------------------------------------------------------------
// (d) Malformed requests.
// ---------------------------------------------------------------------------

TEST(RatioLpTest, RejectsMalformedRequests) {
  const auto bad = [](const RatioLpRequest& r, const std::string& field) {
    EXPECT_THAT(SolveRatioLp(r),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field)));
    EXPECT_THAT(CheckRatios(r, {{0.5, 0.5}}),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field)));
  };
  const RatioLpRequest good = Request(2, {Term({1, 1}), Term({1, 2}, {1, 1})});
  ASSERT_TRUE(SolveRatioLp(good).ok());

  RatioLpRequest r = good;
  r.num_devices = 0;
  bad(r, "num_devices = 0");
  r = good;
  r.num_segments = 0;
  bad(r, "num_segments = 0");
  r = good;
  r.terms[1].coef = {1, 2, 3};
  bad(r, "terms[1].coef has 3 entries, expected num_devices = 2");
  r = good;
  r.terms[0].constant = {1};
  bad(r, "terms[0].constant has 1 entries");
  r = good;
  r.terms[1].coef[0] = std::nan("");
  bad(r, "terms[1].coef[0] = nan");
  r = good;
  r.terms[1].constant[1] = std::numeric_limits<double>::infinity();
  bad(r, "terms[1].constant[1] = inf");
  r = good;
  r.terms[0].coef[1] = -1;
  bad(r, "terms[0].coef[1] = -1");
  r = good;
  r.terms[1].segment = 1;
  bad(r, "terms[1].segment = 1 is out of range [0, 1)");
  r = good;
  r.terms[0].segment = -1;
  bad(r, "terms[0].segment = -1");
  r = good;
  r.terms[0].weight = 0;
  bad(r, "terms[0].weight = 0");
  r = good;
  r.terms[0].weight = std::nan("");
  bad(r, "terms[0].weight = nan");
  r = good;
  r.time_limit_seconds = 0;
  bad(r, "time_limit_seconds");

  const MemoryConstraint mem =
      Memory({{1 * kGiB, 1 * kGiB}}, {0, 0}, {2 * kGiB, 2 * kGiB});
  r = good;
  r.memory = mem;
  ASSERT_TRUE(SolveRatioLp(r).ok());
  r.memory->capacity[1] = -1;
  bad(r, "memory.capacity[1] = -1");
  r.memory = mem;
  r.memory->capacity.pop_back();
  bad(r, "memory.capacity has 1 entries");
  r.memory = mem;
  r.memory->coef.push_back({0, 0});
  bad(r, "memory.coef has 2 entries, expected num_segments = 1");
  r.memory = mem;
  r.memory->coef[0] = {1};
  bad(r, "memory.coef[0] has 1 entries");
  r.memory = mem;
  r.memory->coef[0][0] = std::nan("");
  bad(r, "memory.coef[0][0] = nan");
  r.memory = mem;
  r.memory->constant = {0, -5};
  bad(r, "memory.constant[1] = -5");
  r.memory = mem;
  r.memory->device_names = {"only-one"};
  bad(r, "memory.device_names has 1 entries");
}

// ---------------------------------------------------------------------------
// (e) RoundShards.
// ---------------------------------------------------------------------------

TEST(RoundShardsTest, Examples) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(RoundShards(10, {0.5, 0.5}), (V{5, 5}));
  // Equal deficits: the remainder goes to the lower index.
  EXPECT_EQ(RoundShards(10, {1.0 / 3, 1.0 / 3, 1.0 / 3}), (V{4, 3, 3}));
  EXPECT_EQ(RoundShards(11, {1.0 / 3, 1.0 / 3, 1.0 / 3}), (V{4, 4, 3}));
  // Largest deficit wins: 2.1 / 4.9 -> the 0.9 deficit.
  EXPECT_EQ(RoundShards(7, {0.3, 0.7}), (V{2, 5}));
  // Granularity 8: 5.6 and 2.4 units -> 6 and 2 units.
  EXPECT_EQ(RoundShards(64, {0.7, 0.3}, 8), (V{48, 16}));
  // 70 = 8 units of 8 + 6: the partial unit goes to the largest ratio
  // (a tie here: the lower index).
  EXPECT_EQ(RoundShards(70, {0.5, 0.5}, 8), (V{38, 32}));
  EXPECT_EQ(RoundShards(70, {0.25, 0.75}, 8), (V{16, 54}));
  // Zero ratios get zero.
  EXPECT_EQ(RoundShards(100, {0, 0.5, 0, 0.5}), (V{0, 50, 0, 50}));
  EXPECT_EQ(RoundShards(7, {0, 1}), (V{0, 7}));
  EXPECT_EQ(RoundShards(3, {0.0, 0.1, 0.0, 0.1, 0.8}), (V{0, 0, 0, 0, 3}));
  // Degenerate inputs.
  EXPECT_EQ(RoundShards(0, {0.5, 0.5}), (V{0, 0}));
  EXPECT_EQ(RoundShards(5, {}), (V{}));
  EXPECT_EQ(RoundShards(4, {0, 0}), (V{2, 2}));         // no positive ratio
  EXPECT_EQ(RoundShards(4, {0.5, 0.5}, 0), (V{2, 2}));  // granularity < 1
  // Ratios not summing to 1 are normalised.
  EXPECT_EQ(RoundShards(9, {2, 1}), (V{6, 3}));
  // A shorter dimension than the granularity: everything is the partial.
  EXPECT_EQ(RoundShards(5, {0.4, 0.6}, 8), (V{0, 5}));
  // Lengths near 2^63, whose double is 2^63 itself (no int64 holds it):
  // the shares and their sum stay exact (they looped about 2^64 times).
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(RoundShards(kMax, {1.0}), (V{kMax}));
  EXPECT_EQ(RoundShards(kMax, {0, 1}), (V{0, kMax}));
  const V halves = RoundShards(kMax, {0.5, 0.5});
  ASSERT_EQ(halves.size(), 2u);
  EXPECT_EQ(halves[0] + (halves[1] - kMax), 0);      // sums to kMax
  EXPECT_LE(std::abs(halves[0] - halves[1]), 2048);  // a double's spacing there
  EXPECT_EQ(RoundShards(kMax, {1.0}, 1000), (V{kMax}));
}

// Every device holds at least one unit where there are enough, taken from
// the device with the most, as the lowering lays shards out.
TEST(RoundShardsTest, AtLeastOneEach) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(RoundShardsAtLeastOne(16, {1, 0, 0}), (V{14, 1, 1}));
  EXPECT_EQ(RoundShardsAtLeastOne(16, {0, 0.5, 0.5}), (V{1, 7, 8}));
  EXPECT_EQ(RoundShardsAtLeastOne(10, {0.3, 0.7}), (V{3, 7}));  // as rounded
  EXPECT_EQ(RoundShardsAtLeastOne(3, {0, 0, 1}), (V{1, 1, 1}));
  EXPECT_EQ(RoundShardsAtLeastOne(2, {1, 0, 0}), (V{2, 0, 0}));  // too few
  EXPECT_EQ(RoundShardsAtLeastOne(5, {}), (V{}));
}

TEST(RoundShardsTest, RandomProperties) {
  std::mt19937 rng(4242);
  std::uniform_real_distribution<double> u01(0, 1);
  const int64_t grans[] = {1, 2, 8, 64, 128};
  for (int iter = 0; iter < 5000; ++iter) {
    const int n = 1 + static_cast<int>(rng() % 9);
    std::vector<double> ratios(n);
    for (double& b : ratios) b = rng() % 4 == 0 ? 0 : u01(rng);
    if (std::all_of(ratios.begin(), ratios.end(),
                    [](double b) { return b == 0; })) {
      ratios[rng() % n] = 1;
    }
    double sum = 0;
    for (double b : ratios) sum += b;
    for (double& b : ratios) b /= sum;
    const int64_t g = grans[rng() % 5];
    int64_t length = g * static_cast<int64_t>(rng() % 5000);
    if (rng() % 3 == 0) length += static_cast<int64_t>(rng() % g);
    const int64_t partial = length % g;
    const size_t largest =
        std::max_element(ratios.begin(), ratios.end()) - ratios.begin();

    SCOPED_TRACE(
        absl::StrCat("iter ", iter, " n ", n, " g ", g, " length ", length));
    const std::vector<int64_t> lengths = RoundShards(length, ratios, g);
    ASSERT_EQ(lengths.size(), static_cast<size_t>(n));
    EXPECT_EQ(RoundShards(length, ratios, g), lengths);  // deterministic
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      total += lengths[i];
      EXPECT_GE(lengths[i], 0);
      const bool gets_partial = static_cast<size_t>(i) == largest;
      EXPECT_EQ((lengths[i] - (gets_partial ? partial : 0)) % g, 0);
      EXPECT_LT(std::abs(static_cast<double>(lengths[i]) - ratios[i] * length),
                static_cast<double>(g + (gets_partial ? partial : 0)) + 1e-6);
      if (ratios[i] == 0) {
        EXPECT_EQ(lengths[i], 0);
      }
    }
    EXPECT_EQ(total, length);
  }
}

// ---------------------------------------------------------------------------
// (f) Segments are split independently.
// ---------------------------------------------------------------------------

TEST(RatioLpTest, SegmentsGetTheirOwnRatios) {
  // Segment 0 runs best at 2/3 : 1/3, segment 1 at 1/4 : 3/4 (e.g. an op
  // family that device 1 is much faster at).
  RatioLpRequest r = Request(
      2,
      {Term({1, 2}, {}, 1, 0), Term({3, 1}, {}, 2, 1), Term({2, 4}, {}, 1, 0)},
      2);
  absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->ratios.size(), 2u);
  EXPECT_NEAR(result->ratios[0][0], 2.0 / 3, 1e-6);
  EXPECT_NEAR(result->ratios[0][1], 1.0 / 3, 1e-6);
  EXPECT_NEAR(result->ratios[1][0], 1.0 / 4, 1e-6);
  EXPECT_NEAR(result->ratios[1][1], 3.0 / 4, 1e-6);
  EXPECT_NEAR(result->objective, 2.0 / 3 + 2 * 0.75 + 4.0 / 3, 1e-9);
  ExpectConsistent(r, *result);
}

// ---------------------------------------------------------------------------
// Exact reductions: identical devices and proportional terms.
// ---------------------------------------------------------------------------

// Three fast and three slow devices; the slow ones short of memory.
RatioLpRequest TwoTypeCluster(double perturbation) {
  const std::vector<double> flops = {2, 2, 2, 1, 1, 1};
  RatioLpRequest r;
  r.num_devices = 6;
  r.num_segments = 2;
  for (int k = 0; k < 12; ++k) {
    CostTerm t = ComputeTerm(1 + k % 5, flops, k % 2);
    if (k % 3 == 0)
      t = Term(std::vector<double>(6, 0.4 + 0.1 * k),
               std::vector<double>(6, 0.01), 1, k % 2);
    if (k == 7) t.constant = {0.3, 0.3, 0.3, 0, 0, 0};
    // Make every device distinct (so nothing merges) without changing the
    // optimum beyond ~1e-12.
    for (int i = 0; i < 6; ++i) t.coef[i] *= 1 + perturbation * i;
    r.terms.push_back(t);
  }
  r.memory =
      Memory({{8 * kGiB, 8 * kGiB, 8 * kGiB, 8 * kGiB, 8 * kGiB, 8 * kGiB},
              {4 * kGiB, 4 * kGiB, 4 * kGiB, 4 * kGiB, 4 * kGiB, 4 * kGiB}},
             std::vector<double>(6, 0.5 * kGiB),
             {80 * kGiB, 80 * kGiB, 80 * kGiB, 2 * kGiB, 2 * kGiB, 2 * kGiB});
  return r;
}

TEST(RatioLpTest, IdenticalDevicesGetEqualRatiosAndTheSameOptimum) {
  const RatioLpRequest merged = TwoTypeCluster(0);
  const RatioLpRequest distinct = TwoTypeCluster(1e-13);
  absl::StatusOr<RatioLpResult> a = SolveRatioLp(merged);
  absl::StatusOr<RatioLpResult> b = SolveRatioLp(distinct);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectConsistent(merged, *a);
  ExpectConsistent(distinct, *b);
  EXPECT_LE(RelDiff(a->objective, b->objective), 1e-9);
  for (int s = 0; s < 2; ++s) {
    const std::vector<double>& x = a->ratios[s];
    EXPECT_EQ(x[0], x[1]);
    EXPECT_EQ(x[0], x[2]);
    EXPECT_EQ(x[3], x[4]);
    EXPECT_EQ(x[3], x[5]);
    // The unmerged solve may split a type unevenly, but not differently in
    // total.
    const std::vector<double>& y = b->ratios[s];
    EXPECT_NEAR(y[0] + y[1] + y[2], 3 * x[0], 1e-6);
  }
  // Memory binds the slow devices: 0.5 + 8 x0 + 4 x1 <= 2 (GiB).
  EXPECT_LE(0.5 + 8 * a->ratios[0][3] + 4 * a->ratios[1][3], 2 * (1 + 1e-9));
}

TEST(RatioLpTest, ProportionalTermsActLikeOneTerm) {
  // w * max(coef b + constant) scaled by 3 and shifted by 0.5 on every device
  // is 3 * the term + 0.5: the solve must see exactly that.
  const CostTerm base = Term({1, 2, 0.5}, {0, 0.1, 0.2}, 2);
  CostTerm scaled = base;
  for (double& c : scaled.coef) c *= 3;
  for (double& c : scaled.constant) c = 3 * c + 0.5;
  RatioLpRequest one = Request(3, {base});
  RatioLpRequest two = Request(3, {base, scaled});
  absl::StatusOr<RatioLpResult> a = SolveRatioLp(one);
  absl::StatusOr<RatioLpResult> b = SolveRatioLp(two);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectConsistent(two, *b);
  EXPECT_NEAR(b->objective, 4 * a->objective + 2 * 0.5, 1e-9);
}

// ---------------------------------------------------------------------------
// (g) A large instance, the time limit, and concurrent solves.
// ---------------------------------------------------------------------------

RatioLpRequest LargeInstance(int num_terms, int num_devices, int num_segments,
                             uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u01(0, 1);
  RatioLpRequest r;
  r.num_devices = num_devices;
  r.num_segments = num_segments;
  std::vector<double> flops(num_devices);
  for (double& f : flops)
    f = (rng() % 2 ? 312e12 : 125e12) * (0.9 + 0.2 * u01(rng));
  for (int k = 0; k < num_terms; ++k) {
    CostTerm t;
    t.segment = k * num_segments / num_terms;  // layers in order
    t.weight = 1 + static_cast<double>(rng() % 3);
    t.coef.resize(num_devices);
    t.constant.resize(num_devices);
    if (k % 3 == 2) {  // padded collective
      const double c = 1e-4 * (0.5 + u01(rng));
      for (int i = 0; i < num_devices; ++i) {
        t.coef[i] = c * num_devices;
        t.constant[i] = 2e-5;
      }
    } else {  // compute, per-op speed variation
      const double work = 1e10 * (0.1 + u01(rng));
      for (int i = 0; i < num_devices; ++i) {
        t.coef[i] = work / (flops[i] * (0.8 + 0.4 * u01(rng)));
        t.constant[i] = k % 7 == 0 ? 1e-5 * u01(rng) : 0;
      }
    }
    r.terms.push_back(t);
  }
  MemoryConstraint m;
  m.coef.assign(num_segments, std::vector<double>(num_devices));
  m.constant.assign(num_devices, 1 * kGiB);
  m.capacity.resize(num_devices);
  for (int i = 0; i < num_devices; ++i) {
    for (int s = 0; s < num_segments; ++s) m.coef[s][i] = 40 * kGiB;
    m.capacity[i] = (i % 4 == 0 ? 8 : 80) * kGiB;
    m.device_names.push_back(absl::StrCat("node", i / 8, "/gpu", i % 8));
  }
  r.memory = m;
  return r;
}

TEST(RatioLpTest, LargeInstanceSolves) {
  const RatioLpRequest r = LargeInstance(2000, 64, 4, 99);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::cout << "2000 terms x 64 devices x 4 segments: solved in " << seconds
            << " s" << std::endl;
  RecordProperty("solve_seconds", std::to_string(seconds));
  ASSERT_TRUE(result.ok()) << result.status();
  ExpectConsistent(r, *result);
  // Better than the uniform split, and the small devices are memory-bound.
  std::vector<std::vector<double>> uniform(4,
                                           std::vector<double>(64, 1.0 / 64));
  EXPECT_LE(result->objective, EvaluateObjective(r, uniform) * (1 + 1e-9));
}

TEST(RatioLpTest, TinyTimeLimitIsDeadlineExceeded) {
  RatioLpRequest r = LargeInstance(2000, 64, 4, 99);
  r.time_limit_seconds = 1e-3;
  EXPECT_THAT(SolveRatioLp(r), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                        HasSubstr("time limit")));
}

TEST(RatioLpTest, ConcurrentSolvesAgreeWithSerialOnes) {
  std::vector<RatioLpRequest> requests;
  std::mt19937 rng(5);
  for (int n = 0; n < 8; ++n) {
    requests.push_back(RandomInstance(rng, 3, 1, n % 2 == 0));
  }
  requests.push_back(LargeInstance(300, 16, 2, 7));
  std::vector<double> serial;
  for (const auto& r : requests) {
    absl::StatusOr<RatioLpResult> result = SolveRatioLp(r);
    ASSERT_TRUE(result.ok()) << result.status();
    serial.push_back(result->objective);
  }
  std::vector<double> parallel(requests.size() * 4, -1);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t n = 0; n < requests.size(); ++n) {
        absl::StatusOr<RatioLpResult> result = SolveRatioLp(requests[n]);
        parallel[t * requests.size() + n] =
            result.ok() ? result->objective : -2;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) {
    for (size_t n = 0; n < requests.size(); ++n) {
      EXPECT_LE(RelDiff(parallel[t * requests.size() + n], serial[n]), 1e-9)
          << "thread " << t << " request " << n;
    }
  }
}

}  // namespace
}  // namespace hap::ratios
