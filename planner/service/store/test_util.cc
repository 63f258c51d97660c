#include "planner/service/store/test_util.h"

#include <stdlib.h>

#include <vector>

namespace hap::service::store::testing {

hap::v1::Node TestNode(const std::string& name, const std::string& address) {
  hap::v1::Node node;
  node.set_name(name);
  node.set_address(address);
  hap::v1::Device* device = node.add_devices();
  device->set_id(name + "/cpu0");
  device->set_node(name);
  device->set_memory_bytes(int64_t{8} << 30);
  (*node.mutable_labels())["zone"] = "a";
  node.mutable_last_heartbeat()->set_seconds(1700000000);
  return node;
}

hap::v1::Plan TestPlan(const std::string& name, int64_t create_seconds, int32_t create_nanos) {
  hap::v1::Plan plan;
  plan.set_name(name);
  plan.set_uid("uid-" + name);
  plan.mutable_create_time()->set_seconds(create_seconds);
  plan.mutable_create_time()->set_nanos(create_nanos);
  plan.add_devices("n0/cpu0");
  plan.add_devices("n1/cpu0");
  plan.set_global_batch(64);
  return plan;
}

hap::v1::Deployment TestDeployment(const std::string& name, int64_t create_seconds) {
  hap::v1::Deployment deployment;
  deployment.set_name(name);
  deployment.set_plan("plans/p");
  deployment.set_generation(1);
  deployment.set_state(hap::v1::Deployment::RUNNING);
  deployment.mutable_create_time()->set_seconds(create_seconds);
  hap::v1::Deployment::RankAssignment* rank = deployment.add_ranks();
  rank->set_rank(0);
  rank->set_device("n0/cpu0");
  rank->set_executor_address("127.0.0.1:2");
  return deployment;
}

hap::v1::StepMetric TestMetric(int64_t step, int32_t rank, double loss) {
  hap::v1::StepMetric m;
  m.set_rank(rank);
  m.set_step(step);
  m.set_loss(loss);
  m.set_step_seconds(0.25);
  return m;
}

std::string NewTempDir() {
  const char* base = getenv("TEST_TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/hap_store_XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) return "";
  return buf.data();
}

}  // namespace hap::service::store::testing
