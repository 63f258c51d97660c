#include "executor/train/random_programs.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

}  // namespace hap::testing
