#include "tools/hapctl_graph.h"

#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/op_registry.h"
#include "planner/graph/zoo.h"

namespace hap::tools {

namespace {

int Fail(const absl::Status& s) {
  std::cerr << "error: " << s.message() << "\n";
  return 1;
}


// -o (or --output) of zoo, ops and validate: table (the default) or json;
// anything else is refused, as `hapctl plan` refuses it.
absl::StatusOr<std::string> TableOrJson(const Args& args) {
  std::string fmt = args.Get("o", args.Get("output", "table"));
  if (fmt != "table" && fmt != "json") {
    return absl::InvalidArgumentError(absl::StrCat("-o must be table or json, got '", fmt, "'"));
  }
  return fmt;
}

}  // namespace

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
    } else {
      out += c;
    }
  }
  return out;
}

std::string ZooParamFlag(const std::string& param) {
  std::string flag = param;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

std::set<std::string> ZooParamFlags() {
  std::set<std::string> out;
  for (const auto& m : graph::ZooModels()) {
    for (const auto& [k, v] : m.defaults) {
      out.insert(k);
      out.insert(ZooParamFlag(k));
    }
  }
  return out;
}

absl::StatusOr<std::map<std::string, double>> ZooOverrides(const Args& args) {
  std::map<std::string, double> out;
  for (const auto& m : graph::ZooModels()) {
    for (const auto& [k, def] : m.defaults) {
      if (out.count(k)) continue;  // a parameter of several models
      // --moe-group-size as every other flag is written, or the
      // parameter's own name (--moe_group_size); not both.
      const std::string flag = ZooParamFlag(k);
      const bool both = flag != k && args.Has(flag) && args.Has(k);
      if (both) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag, " and --", k, " are one zoo parameter; give it once"));
      }
      const std::string given = args.Has(flag) ? flag : k;
      // '--layers 2 --layers 3' built 3 layers (the last one given).
      if (const std::vector<std::string> all = args.GetAll(given); all.size() > 1) {
        return absl::InvalidArgumentError(absl::StrCat("zoo parameter '", k,
                                                       "' is given twice (--", given, " ", all[0],
                                                       " and --", given, " ", all[1],
                                                       "); give it once"));
      }
      if (args.Has(given)) {
        HAP_ASSIGN_OR_RETURN(double v, args.Number(given, 0));
        out[k] = v;
      }
    }
  }
  for (const std::string& kv : args.GetAll("set")) {
    auto eq = kv.find('=');
    double v;
    if (eq == std::string::npos || !absl::SimpleAtod(kv.substr(eq + 1), &v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--set wants name=number, got '", kv, "'"));
    }
    // '--layers 3 --set layers=2' built 2 layers, whichever came last.
    const std::string k = kv.substr(0, eq);
    if (!out.emplace(k, v).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "zoo parameter '", k, "' is given twice (--set ", kv, " and ",
          args.Has(ZooParamFlag(k)) || args.Has(k) ? absl::StrCat("--", ZooParamFlag(k))
                                                   : std::string("another --set"),
          "); give it once"));
    }
  }
  return out;
}

absl::StatusOr<hap::v1::Graph> LoadGraphFile(const Args& args) {
  // A graph file has its own model and shapes: --model and zoo parameters
  // beside it were dropped ('--graph g.json --layers 4' planned g.json's
  // layers).
  if (args.Has("model")) {
    return absl::InvalidArgumentError(absl::StrCat("--graph '", args.Get("graph"),
                                                   "' and --model '", args.Get("model"),
                                                   "' are two models: give one"));
  }
  HAP_ASSIGN_OR_RETURN(auto overrides, ZooOverrides(args));
  if (!overrides.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", overrides.begin()->first, "' is a zoo model's parameter; the graph file '",
        args.Get("graph"), "' has its own shapes (drop it, or plan --model NAME)"));
  }
  HAP_ASSIGN_OR_RETURN(std::string bytes, ReadInputFile(args.Get("graph"), "graph file "));
  absl::StatusOr<hap::v1::Graph> p = graph::ParseGraphProto(bytes, graph::GraphFormat::kAuto);
  if (p.ok()) {
    if (absl::StatusOr<graph::Graph> g = graph::FromProto(*p); !g.ok()) p = g.status();
  }
  if (!p.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph file '", args.Get("graph"), "': ", p.status().message()));
  }
  return p;
}

absl::StatusOr<graph::Graph> LoadModel(const Args& args) {
  if (args.Has("graph")) {
    HAP_ASSIGN_OR_RETURN(hap::v1::Graph p, LoadGraphFile(args));
    return graph::FromProto(p);
  }
  HAP_ASSIGN_OR_RETURN(auto overrides, ZooOverrides(args));
  return graph::BuildZooModel(args.Get("model", "gpt"), overrides);
}

std::string GraphSummaryJson(const graph::Graph& g) {
  std::map<std::string, int> op_types;
  for (const auto& op : g.ops()) op_types[op.type]++;
  std::string types;
  for (const auto& [t, n] : op_types) {
    absl::StrAppend(&types, types.empty() ? "" : ", ", "\"", t, "\": ", n);
  }
  return absl::StrFormat(
      "{\"name\": \"%s\", \"parameters\": %d, \"trainable_parameters\": %d, "
      "\"forward_flops\": %.17g, \"training_flops\": %.17g, \"ops\": %d, "
      "\"tensors\": %d, \"op_types\": {%s}}",
      JsonEscape(g.name()), g.ParameterCount(), g.TrainableParameterCount(),
      g.ForwardFlops(), g.TrainingFlops(), g.ops().size(), g.tensors().size(),
      types);
}

int RunOps(const std::vector<std::string>& argv) {
  auto args = Args::Parse(argv, {"o", "output"}, {"help"});
  if (!args.ok()) return Fail(args.status());
  if (args->Bool("help")) {
    std::cout << "usage: hapctl ops [-o table|json]\n"
                 "Lists the ops of the IR with their signatures (json: also their attributes\n"
                 "and backward FLOPs multiple).\n";
    return 0;
  }
  if (!args->positional().empty()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("hapctl ops: unexpected argument '", args->positional()[0], "'")));
  }
  auto format = TableOrJson(*args);
  if (!format.ok()) return Fail(format.status());
  const std::string fmt = *format;
  auto ops = graph::OpRegistry::Global().All();
  if (fmt == "json") {
    std::cout << "[";
    for (size_t i = 0; i < ops.size(); ++i) {
      std::cout << (i ? ",\n " : "") << "{\"type\": \"" << ops[i]->type
                << "\", \"summary\": \"" << JsonEscape(ops[i]->summary)
                << "\", \"attrs\": [";
      for (size_t a = 0; a < ops[i]->attrs.size(); ++a) {
        std::cout << (a ? ", " : "") << "\"" << ops[i]->attrs[a] << "\"";
      }
      std::cout << "], \"backward_flops_multiple\": "
                << ops[i]->backward_flops_multiple << "}";
    }
    std::cout << "]\n";
    return 0;
  }
  for (const auto* d : ops) {
    std::cout << absl::StrFormat("%-20s %s\n", d->type, d->summary);
  }
  return 0;
}

int RunZoo(const std::vector<std::string>& argv) {
  std::set<std::string> value_flags = ZooParamFlags();
  value_flags.insert({"o", "output", "set", "export"});
  auto args = Args::Parse(argv, value_flags, {"help"});
  if (!args.ok()) return Fail(args.status());
  if (args->Bool("help")) {
    std::cout << "usage: hapctl zoo [MODEL] [--layers N ...] [--set k=v] "
                 "[-o table|json] [--export FILE.json]\n"
                 "With one MODEL, the table also lists its parameters as flags with their\n"
                 "defaults (hapctl plan, create plan and create job take the same flags).\n";
    return 0;
  }
  auto format = TableOrJson(*args);
  if (!format.ok()) return Fail(format.status());
  const std::string fmt = *format;
  std::vector<std::string> names = args->positional();
  // One file holds one graph: with every model (or several) each export
  // replaced the one before, and the file held the last model alone.
  if (args->Has("export") && names.size() != 1) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--export writes one model's graph: name one model (hapctl zoo MODEL --export FILE), got ",
        names.empty() ? std::string("none") : absl::StrJoin(names, ", "))));
  }
  if (names.empty()) {
    for (const auto& m : graph::ZooModels()) names.push_back(m.name);
  }
  // Printed once every model was built: a model that fails left a header
  // or half a JSON list on stdout.
  std::ostringstream out;
  auto overrides = ZooOverrides(*args);
  if (!overrides.ok()) return Fail(overrides.status());
  // With several models each takes the parameters it has; one that none of
  // them has was dropped ('hapctl zoo --set foo=1' listed the defaults).
  if (names.size() > 1) {
    for (const auto& [k, v] : *overrides) {
      bool taken = false;
      for (const auto& m : graph::ZooModels()) {
        taken = taken || (m.defaults.count(k) > 0 &&
                          std::find(names.begin(), names.end(), m.name) != names.end());
      }
      if (!taken) {
        return Fail(absl::InvalidArgumentError(
            absl::StrCat("zoo parameter '", k, "' is a parameter of none of the models listed (",
                         absl::StrJoin(names, ", "), ")")));
      }
    }
  }
  if (fmt == "table") {
    out << absl::StrFormat("%-12s %14s %16s %16s %6s\n", "MODEL", "PARAMETERS", "FWD GFLOP/STEP",
                           "TRAIN GFLOP/STEP", "OPS");
  }
  if (fmt == "json") out << "[";
  for (size_t i = 0; i < names.size(); ++i) {
    // Overrides apply to each model that takes them.
    std::map<std::string, double> mine;
    for (const auto& m : graph::ZooModels()) {
      if (m.name != names[i]) continue;
      for (const auto& [k, v] : *overrides) {
        if (m.defaults.count(k) || names.size() == 1) mine[k] = v;
      }
    }
    auto g = graph::BuildZooModel(names[i], names.size() == 1 ? *overrides : mine);
    if (!g.ok()) return Fail(g.status());
    if (args->Has("export")) {
      absl::Status w =
          WriteOutputFile(args->Get("export"), graph::GraphToJson(*g), "--export file ");
      if (!w.ok()) return Fail(w);
    }
    if (fmt == "json") {
      out << (i ? ",\n " : "") << GraphSummaryJson(*g);
    } else {
      out << absl::StrFormat("%-12s %14d %16.1f %16.1f %6d\n", g->name(), g->ParameterCount(),
                             g->ForwardFlops() / 1e9, g->TrainingFlops() / 1e9, g->ops().size());
    }
  }
  if (fmt == "json") out << "]\n";
  if (fmt == "table" && names.size() == 1) {
    for (const auto& m : graph::ZooModels()) {
      if (m.name != names[0]) continue;
      out << "\nparameters (flags, defaults):";
      for (const auto& [k, v] : m.defaults) {
        out << " --" << ZooParamFlag(k) << " " << absl::StrCat(v);
      }
      out << "\n";
    }
  }
  std::cout << out.str();
  return 0;
}

int RunValidate(const std::vector<std::string>& argv) {
  auto args = Args::Parse(argv, {"o", "output"}, {"help"});
  if (!args.ok()) return Fail(args.status());
  constexpr char kValidateUsage[] = "usage: hapctl validate GRAPH_FILE [-o table|json]\n";
  if (args->Bool("help")) {
    std::cout << kValidateUsage;
    return 0;
  }
  if (args->positional().size() != 1) {
    std::cerr << (args->positional().empty()
                      ? std::string("error: hapctl validate: no GRAPH_FILE\n")
                      : absl::StrCat("error: hapctl validate: unexpected argument '",
                                     args->positional()[1], "' (one GRAPH_FILE)\n"))
              << kValidateUsage;
    return 1;
  }
  auto format = TableOrJson(*args);
  if (!format.ok()) return Fail(format.status());
  auto bytes = ReadInputFile(args->positional()[0], "graph file ");
  if (!bytes.ok()) return Fail(bytes.status());
  auto g = graph::ParseGraph(*bytes, graph::GraphFormat::kAuto);
  if (!g.ok()) return Fail(g.status());
  if (*format == "json") {
    std::cout << GraphSummaryJson(*g) << "\n";
  } else {
    std::cout << absl::StrFormat(
        "graph '%s' is valid: %d ops, %d parameters, %.3f GFLOP forward\n",
        g->name(), g->ops().size(), g->ParameterCount(),
        g->ForwardFlops() / 1e9);
  }
  return 0;
}

}  // namespace hap::tools
