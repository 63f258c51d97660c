// libFuzzer target: model graph files (JSON, text or binary hap.v1.Graph)
// through ParseGraph, the parser and validator every entry point uses
// (hapctl, the planner's CreatePlan, executors). A graph it accepts must
// survive ToProto -> FromProto unchanged in size, and a VALUES initializer
// it accepts must list its tensor's elements exactly (executors read the
// run holding each element) and come back from the proto as it was;
// anything else must be an error, never a crash, a sanitizer report or a
// hang.
#include <cstddef>
#include <cstdint>

#include "planner/graph/graph_proto.h"

namespace {

// Runs of positive counts, one per value, adding up to the tensor's
// elements without overflow.
bool ListsItsElements(const hap::graph::Tensor& t) {
  const hap::graph::Initializer& i = t.init;
  if (i.values.size() != i.counts.size()) return false;
  int64_t total = 0;
  for (int64_t c : i.counts) {
    if (c < 1 || __builtin_add_overflow(total, c, &total)) return false;
  }
  return total == t.type.num_elements();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto g = hap::graph::ParseGraph(bytes, hap::graph::GraphFormat::kAuto);
  if (!g.ok()) return 0;
  auto again = hap::graph::FromProto(hap::graph::ToProto(*g));
  if (!again.ok() || again->tensors().size() != g->tensors().size() ||
      again->ops().size() != g->ops().size()) {
    __builtin_trap();  // an accepted graph must round-trip
  }
  for (size_t i = 0; i < g->tensors().size(); ++i) {
    const hap::graph::Tensor& t = g->tensors()[i];
    if (t.kind != hap::graph::TensorKind::kParameter ||
        t.init.kind != hap::graph::Initializer::Kind::kValues) {
      continue;
    }
    const hap::graph::Initializer& back = again->tensors()[i].init;
    if (!ListsItsElements(t) || back.kind != t.init.kind || back.values != t.init.values ||
        back.counts != t.init.counts) {
      __builtin_trap();  // an accepted VALUES initializer that lists other elements
    }
  }
  return 0;
}
