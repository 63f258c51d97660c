// libFuzzer target: model graph files (JSON, text or binary hap.v1.Graph)
// through ParseGraph, the parser and validator every entry point uses
// (hapctl, the planner's CreatePlan, executors). A graph it accepts must
// survive ToProto -> FromProto unchanged in size; anything else must be an
// error, never a crash, a sanitizer report or a hang.
#include <cstddef>
#include <cstdint>

#include "planner/graph/graph_proto.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto g = hap::graph::ParseGraph(bytes, hap::graph::GraphFormat::kAuto);
  if (!g.ok()) return 0;
  auto again = hap::graph::FromProto(hap::graph::ToProto(*g));
  if (!again.ok() || again->tensors().size() != g->tensors().size() ||
      again->ops().size() != g->ops().size()) {
    __builtin_trap();  // an accepted graph must round-trip
  }
  return 0;
}
