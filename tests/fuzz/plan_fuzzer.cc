// libFuzzer target: plan files (binary hap.v1.Plan) as an executor checks
// them before running a rank: CheckPlanForRank for each rank, then the
// plan's graph through FromProto.
#include <cstddef>
#include <cstdint>

#include "planner/graph/graph_proto.h"
#include "planner/lower/plan_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hap::v1::Plan plan;
  if (!plan.ParseFromArray(data, static_cast<int>(size))) return 0;
  const int world = plan.rank_programs_size();
  bool any = false;
  for (int rank = -1; rank <= world && rank < 8; ++rank) {
    any |= hap::lower::CheckPlanForRank(plan, rank, world).ok();
  }
  if (any) (void)hap::graph::FromProto(plan.graph());
  return 0;
}
