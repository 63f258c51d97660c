// A plan of two ranks for the backend tests: rank 0 on node0/gpu1 (a GPU,
// local index 1), rank 1 on node0/cpu0. Header-only, so both backend_test
// and backend_without_cuda_test (which links backend.cc built without CUDA)
// take it without a library that links either backend.
#ifndef HAP_EXECUTOR_TRAIN_GPU_AND_CPU_PLAN_H_
#define HAP_EXECUTOR_TRAIN_GPU_AND_CPU_PLAN_H_

#include "hap/v1/plan.pb.h"

namespace hap::executor {

inline hap::v1::Plan GpuAndCpuPlan() {
  hap::v1::Plan plan;
  plan.add_devices("node0/gpu1");
  plan.add_devices("node0/cpu0");
  hap::v1::Node* node = plan.mutable_cluster()->add_nodes();
  hap::v1::Device* gpu = node->add_devices();
  gpu->set_id("node0/gpu1");
  gpu->set_kind(hap::v1::GPU);
  gpu->set_local_index(1);
  hap::v1::Device* cpu = node->add_devices();
  cpu->set_id("node0/cpu0");
  cpu->set_kind(hap::v1::CPU);
  return plan;
}

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_TRAIN_GPU_AND_CPU_PLAN_H_
