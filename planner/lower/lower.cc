#include "planner/lower/lower.h"

#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/lower/dim_classes.h"
#include "planner/lower/rank_builder.h"
#include "planner/synth/gradients.h"

namespace hap::lower {

using internal::Analysis;
using internal::DimClasses;
using internal::RankBuilder;
namespace v1 = ::hap::v1;
using graph::TensorId;
using synth::Form;

namespace {

// The ratios Lower uses (even when empty); InvalidArgument when they are not
// one per rank, non-negative and summing to 1, when the devices are not one
// per rank (or none), or when the gradient bucket size is negative.
absl::StatusOr<std::vector<double>> CheckedRatios(const LowerOptions& options) {
  const int n = options.world_size;
  if (n < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size must be at least 1, got ", n));
  }
  if (options.gradient_bucket_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the gradient bucket size must not be negative, got ", options.gradient_bucket_bytes));
  }
  if (!options.devices.empty() && options.devices.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("got ", options.devices.size(), " devices for a world of ", n));
  }
  std::vector<double> ratios = options.ratios;
  if (ratios.empty()) ratios.assign(n, 1.0 / n);
  if (static_cast<int>(ratios.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("got ", ratios.size(), " sharding ratios for a world of ", n));
  }
  double sum = 0;
  for (double r : ratios) {
    if (!(r >= 0) || !std::isfinite(r)) {
      return absl::InvalidArgumentError(
          absl::StrCat("sharding ratio ", r, " is not a finite non-negative number"));
    }
    sum += r;
  }
  if (std::abs(sum - 1) > 1e-6) {
    return absl::InvalidArgumentError(absl::StrCat("sharding ratios sum to ", sum, ", not 1"));
  }
  return ratios;
}

// Steps k of `program` must be ops first + k; the tensors they load and
// communicate the graph's, and every form one a tensor can have (a split
// along one of its dimensions): the layout reads the split dimension's
// length.
absl::Status CheckSteps(const graph::Graph& g, const synth::Program& program, int first) {
  const int ntensors = static_cast<int>(g.tensors().size());
  for (size_t k = 0; k < program.steps.size(); ++k) {
    const synth::OpStep& s = program.steps[k];
    const graph::Op& op = g.op(first + static_cast<int>(k));
    if (s.op != first + static_cast<int>(k) || s.rule.inputs.size() != op.inputs.size() ||
        s.rule.outputs.size() != op.outputs.size() ||
        s.rule.replicated_grad.size() != op.inputs.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("program step ", k, " does not match op '", op.name, "'"));
    }
    const std::string step = absl::StrCat("program step ", k, " (op '", op.name, "')");
    auto fits = [&](TensorId t, Form f) -> absl::Status {
      const size_t rank = g.tensor(t).type.shape.size();
      if (f.is_sharded() && static_cast<size_t>(f.dim()) >= rank) {
        return absl::InvalidArgumentError(absl::StrCat(step, " holds '", g.tensor(t).name, "' (",
                                                       rank, " dimensions) as ", f.ToString()));
      }
      return absl::OkStatus();
    };
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      HAP_RETURN_IF_ERROR(fits(op.inputs[j], s.rule.inputs[j]));
    }
    for (size_t j = 0; j < op.outputs.size(); ++j) {
      HAP_RETURN_IF_ERROR(fits(op.outputs[j], s.rule.outputs[j]));
    }
    // A tensor the step `verb`s (loads, communicates) must be the graph's.
    auto known = [&](TensorId t, const char* verb) -> absl::Status {
      if (t >= 0 && t < ntensors) return absl::OkStatus();
      return absl::InvalidArgumentError(
          absl::StrCat(step, " ", verb, " tensor ", t, ", not one of the graph's"));
    };
    for (const synth::SourceLoad& l : s.loads) {
      HAP_RETURN_IF_ERROR(known(l.tensor, "loads"));
      HAP_RETURN_IF_ERROR(fits(l.tensor, l.form));
      HAP_RETURN_IF_ERROR(fits(l.tensor, l.storage_form));
    }
    for (const synth::CommStep& c : s.comms) {
      HAP_RETURN_IF_ERROR(known(c.tensor, "communicates"));
      HAP_RETURN_IF_ERROR(fits(c.tensor, c.from));
      HAP_RETURN_IF_ERROR(fits(c.tensor, c.to));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::RankProgram>> LowerChecked(const graph::Graph& g,
                                                          const synth::Program& program,
                                                          const LowerOptions& options,
                                                          const std::vector<double>& ratios,
                                                          const StageSpec* stage) {
  DimClasses dims(g);
  LinkDims(g, program, dims);
  dims.Solve(ratios);
  Analysis analysis = synth::AnalyzeGradients(g, program);
  std::vector<v1::RankProgram> out;
  for (int r = 0; r < options.world_size; ++r) {
    RankBuilder b(g, program, options, dims, analysis, r, stage);
    HAP_ASSIGN_OR_RETURN(v1::RankProgram p, b.Build());
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<v1::RankProgram>> Lower(const graph::Graph& g,
                                                   const synth::Program& program,
                                                   const LowerOptions& options) {
  HAP_ASSIGN_OR_RETURN(std::vector<double> ratios, CheckedRatios(options));
  if (program.steps.size() != g.ops().size()) {
    return absl::InvalidArgumentError(absl::StrCat("the program has ", program.steps.size(),
                                                   " steps for a graph of ", g.ops().size(),
                                                   " ops"));
  }
  HAP_RETURN_IF_ERROR(CheckSteps(g, program, 0));
  return LowerChecked(g, program, options, ratios, nullptr);
}

absl::StatusOr<std::vector<v1::RankProgram>> LowerStage(const graph::Graph& g,
                                                        const synth::Program& program,
                                                        const StageSpec& stage,
                                                        const LowerOptions& options) {
  HAP_ASSIGN_OR_RETURN(std::vector<double> ratios, CheckedRatios(options));
  const int nops = static_cast<int>(g.ops().size());
  if (stage.begin_op < 0 || stage.end_op > nops || stage.begin_op >= stage.end_op) {
    return absl::InvalidArgumentError(absl::StrCat("stage ops [", stage.begin_op, ", ",
                                                   stage.end_op, ") are not a range of the ", nops,
                                                   " ops"));
  }
  if (static_cast<int>(program.steps.size()) != stage.end_op - stage.begin_op) {
    return absl::InvalidArgumentError(absl::StrCat("the stage program has ", program.steps.size(),
                                                   " steps for ops [", stage.begin_op, ", ",
                                                   stage.end_op, ")"));
  }
  if (stage.microbatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a stage needs at least 1 microbatch, got ", stage.microbatches));
  }
  HAP_RETURN_IF_ERROR(CheckSteps(g, program, stage.begin_op));
  const int ntensors = static_cast<int>(g.tensors().size());
  auto produced_in = [&](TensorId t, int begin, int end) {
    if (t < 0 || t >= ntensors) return false;
    const graph::Tensor& x = g.tensor(t);
    return x.kind == graph::TensorKind::kActivation && x.producer >= begin && x.producer < end;
  };
  if (stage.input >= 0 && !produced_in(stage.input, 0, stage.begin_op)) {
    return absl::InvalidArgumentError(absl::StrCat("the stage's input (tensor ", stage.input,
                                                   ") is not an activation produced before op ",
                                                   stage.begin_op));
  }
  if (stage.output >= 0 && !produced_in(stage.output, stage.begin_op, stage.end_op)) {
    return absl::InvalidArgumentError(absl::StrCat("the stage's output (tensor ", stage.output,
                                                   ") is not produced by ops [", stage.begin_op,
                                                   ", ", stage.end_op, ")"));
  }
  if (stage.input >= 0) {
    // Received in input_form, so read in it: by an op, or by a collective
    // changing it to what an op reads (else its buffer would be laid out
    // along a split no step of the stage makes).
    bool read = false;
    for (const synth::OpStep& s : program.steps) {
      const graph::Op& op = g.op(s.op);
      for (size_t j = 0; j < op.inputs.size(); ++j) {
        read = read || (op.inputs[j] == stage.input && s.rule.inputs[j] == stage.input_form);
      }
      for (const synth::CommStep& c : s.comms) {
        read = read || (c.tensor == stage.input && c.from == stage.input_form);
      }
    }
    if (!read) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the stage reads its input (tensor ", stage.input, ", '", g.tensor(stage.input).name,
          "') in no step as ", stage.input_form.ToString(), ", the form it receives it in"));
    }
  }
  if (stage.output < 0 && !produced_in(g.loss(), stage.begin_op, stage.end_op)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a stage without output must compute the loss, which ops [", stage.begin_op,
                     ", ", stage.end_op, ") do not"));
  }
  // SFB computes a weight's gradient from the step's gathered inputs and
  // output gradients after backward, which microbatches cannot share: such
  // weights get their partial gradients all-reduced instead (summed over
  // the microbatches first).
  synth::Program p = program;
  for (synth::OpStep& s : p.steps) {
    for (synth::SourceLoad& l : s.loads) l.sfb = false;
  }
  return LowerChecked(g, p, options, ratios, &stage);
}

synth::Program SingleDeviceProgram(const graph::Graph& g) {
  synth::Program p;
  synth::RuleContext ctx;
  ctx.num_devices = 1;
  std::set<TensorId> loaded;
  for (size_t k = 0; k < g.ops().size(); ++k) {
    synth::OpStep s;
    s.op = static_cast<int>(k);
    s.rule = synth::RulesFor(g, s.op, ctx).front();  // replicated
    for (TensorId t : g.op(s.op).inputs) {
      const graph::Tensor& tensor = g.tensor(t);
      if (tensor.kind == graph::TensorKind::kActivation || !loaded.insert(t).second) {
        continue;
      }
      synth::SourceLoad l;
      l.tensor = t;
      l.form = Form::R();
      l.parameter = tensor.kind == graph::TensorKind::kParameter;
      l.storage = synth::ParamStorage::kReplicated;
      l.storage_form = Form::R();
      s.loads.push_back(l);
    }
    p.steps.push_back(std::move(s));
  }
  return p;
}

}  // namespace hap::lower
