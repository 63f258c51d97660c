#include "executor/train/random_programs.h"

#include <cstdlib>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "executor/train/test_programs.h"
#include "planner/synth/checker.h"
#include "planner/synth/search.h"

namespace hap::testing {

absl::StatusOr<synth::Program> RandomTestProgram(const graph::Graph& g, int n,
                                                 const std::vector<double>& ratios, uint64_t seed) {
  synth::SearchOptions o;
  o.ratios = ratios;
  auto p = synth::RandomProgram(g, SlowDevicesFastLinks(n), o, seed);
  if (!p.ok()) return p.status();
  // The search takes the cheaper of padded and grouped; either is valid.
  std::mt19937_64 rng(seed ^ 0x6d6574686f64ULL);
  auto draw = [&](synth::Method* m) {
    if (*m != synth::Method::kNone) {
      *m = rng() % 2 == 0 ? synth::Method::kPadded : synth::Method::kGrouped;
    }
  };
  for (synth::OpStep& s : p->steps) {
    for (synth::SourceLoad& l : s.loads) draw(&l.method);
    for (synth::CommStep& c : s.comms) draw(&c.method);
  }
  absl::Status check = synth::CheckProgram(g, *p, n);
  if (!check.ok()) return check;
  return p;
}

std::string DescribeProgram(const graph::Graph& g, const synth::Program& p) {
  auto forms = [](const std::vector<synth::Form>& f) {
    return absl::StrJoin(
        f, ",", [](std::string* out, const synth::Form& x) { absl::StrAppend(out, x.ToString()); });
  };
  std::string out;
  for (const synth::OpStep& s : p.steps) {
    const graph::Op& op = g.op(s.op);
    absl::StrAppend(&out, "  op ", s.op, " '", op.name, "' (", op.type, "): rule ", s.rule_index,
                    " '", s.rule.name, "' [", forms(s.rule.inputs), "] -> [", forms(s.rule.outputs),
                    "]");
    for (const synth::SourceLoad& l : s.loads) {
      absl::StrAppend(&out, "; load '", g.tensor(l.tensor).name, "' as ", l.form.ToString());
      if (l.parameter) {
        absl::StrAppend(&out, " ", synth::StorageName(l.storage),
                        l.grad_allreduce ? " allreduce" : "", l.sfb ? " sfb" : "",
                        l.gather_once ? " once" : "",
                        l.grad_reduce_scatter ? " reduce_scatter" : "");
      }
      if (l.method != synth::Method::kNone) {
        absl::StrAppend(&out, " ", synth::MethodName(l.method));
      }
    }
    for (const synth::CommStep& c : s.comms) {
      absl::StrAppend(&out, "; '", g.tensor(c.tensor).name, "' ", c.from.ToString(), "->",
                      c.to.ToString(), " ", synth::CollectiveName(c.forward));
      if (c.method != synth::Method::kNone) {
        absl::StrAppend(&out, " ", synth::MethodName(c.method));
      }
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

namespace {

// The rank counts a seed picks from: 2 and 3, or HAP_RANDOM_PROGRAMS_RANKS.
const std::vector<int>& RankCounts() {
  static const auto* counts = [] {
    auto* c = new std::vector<int>();
    const char* v = std::getenv("HAP_RANDOM_PROGRAMS_RANKS");
    for (absl::string_view x : absl::StrSplit(v != nullptr ? v : "", ',', absl::SkipEmpty())) {
      int n;
      if (absl::SimpleAtoi(x, &n) && n >= 2) c->push_back(n);
    }
    if (c->empty()) *c = {2, 3};
    return c;
  }();
  return *counts;
}

int64_t EnvCount(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoll(v, nullptr, 10) : fallback;
}

}  // namespace

int RandomCaseRanks(uint64_t seed) { return RankCounts()[seed % RankCounts().size()]; }
bool RandomCaseUneven(uint64_t seed) { return seed % 4 != 1; }
bool RandomCaseAdam(uint64_t seed) { return (seed / 2) % 2 == 1; }
bool RandomCaseOverlap(uint64_t seed) { return seed % 3 == 2; }

std::vector<double> RandomCaseRatios(uint64_t seed) {
  const int n = RandomCaseRanks(seed);
  if (!RandomCaseUneven(seed)) return EquivalenceRatios(n, false);
  std::mt19937_64 rng(seed ^ 0x726174696f73ULL);
  std::vector<double> r(n);
  double sum = 0;
  for (double& x : r) {
    x = rng() % 4 == 0 ? 0.01 : 0.05 + 0.95 * static_cast<double>(rng() % 1000) / 1000;
    sum += x;
  }
  for (double& x : r) x /= sum;
  return r;
}

void PrintTo(const RandomCase& c, std::ostream* os) { *os << c.model << " seed " << c.seed; }

std::string RandomCaseName(const RandomCase& c) {
  const uint64_t s = c.seed;
  return absl::StrCat(c.model, "_seed", s, "_", RandomCaseRanks(s), "ranks",
                      RandomCaseUneven(s) ? "_uneven" : "_even",
                      RandomCaseAdam(s) ? "_adam" : "_sgd", RandomCaseOverlap(s) ? "_overlap" : "");
}

lower::LowerOptions RandomCaseLowering(int n, const std::vector<double>& ratios, bool adam,
                                       bool overlap, bool bf16) {
  lower::LowerOptions lo;
  lo.world_size = n;
  lo.ratios = ratios;
  lo.optimizer = EquivalenceOptimizer(adam);
  lo.seed = 1234;
  lo.overlap = overlap;
  lo.gradient_bucket_bytes = overlap ? 2048 : 0;
  lo.bf16 = bf16;
  return lo;
}

std::string RandomCaseRepro(const graph::Graph& g, const RandomCase& c,
                            const std::vector<double>& ratios, const synth::Program& p) {
  return absl::StrCat("model ", c.model, " seed ", c.seed, " (", RandomCaseName(c), "), ratios ",
                      absl::StrJoin(ratios, " "), ", program:\n", DescribeProgram(g, p));
}

std::vector<RandomCase> RandomCaseSweep(int64_t per_model, const std::string& models) {
  std::vector<RandomCase> out;
  const int64_t count = EnvCount("HAP_RANDOM_PROGRAMS", per_model);
  const int64_t first = EnvCount("HAP_RANDOM_PROGRAMS_FIRST", 0);
  const char* chosen = std::getenv("HAP_RANDOM_PROGRAMS_MODELS");
  for (absl::string_view model :
       absl::StrSplit(chosen != nullptr ? chosen : models, ',', absl::SkipEmpty())) {
    for (int64_t i = 0; i < count; ++i) {
      out.push_back({std::string(model), static_cast<uint64_t>(first + i)});
    }
  }
  return out;
}

}  // namespace hap::testing
