// hapctl subcommands about models: `ops`, `zoo`, `validate`.
#ifndef HAP_TOOLS_HAPCTL_GRAPH_H_
#define HAP_TOOLS_HAPCTL_GRAPH_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/cli_args.h"
#include "hap/v1/graph.pb.h"
#include "planner/graph/graph.h"

namespace hap::tools {

// Every zoo parameter name, accepted as a flag (--layers 24), also with
// hyphens for underscores (--moe-group-size as --moe_group_size).
std::set<std::string> ZooParamFlags();

// A zoo parameter's flag as flags are written: '_' -> '-'.
std::string ZooParamFlag(const std::string& param);
// Zoo parameter overrides from flags (--layers 24) and --set k=v.
absl::StatusOr<std::map<std::string, double>> ZooOverrides(const Args& args);
// The model of --model NAME (zoo) or --graph FILE (JSON/text/binary).
absl::StatusOr<graph::Graph> LoadModel(const Args& args);
// --graph FILE as the file holds it, read once and checked as LoadModel
// checks it (--model or a zoo parameter beside it is refused).
absl::StatusOr<hap::v1::Graph> LoadGraphFile(const Args& args);

int RunOps(const std::vector<std::string>& argv);
int RunZoo(const std::vector<std::string>& argv);
int RunValidate(const std::vector<std::string>& argv);

// `s` escaped for a JSON string ('"', '\\' and control characters).
std::string JsonEscape(const std::string& s);

// One-line JSON object summarising a graph (name, parameters, FLOPs, ops).
std::string GraphSummaryJson(const graph::Graph& g);

}  // namespace hap::tools

#endif  // HAP_TOOLS_HAPCTL_GRAPH_H_
