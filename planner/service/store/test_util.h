// Helpers for the store tests: small messages, a fresh temporary directory
// and a protobuf equality matcher.
#ifndef HAP_PLANNER_SERVICE_STORE_TEST_UTIL_H_
#define HAP_PLANNER_SERVICE_STORE_TEST_UTIL_H_

#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/plan.pb.h"
#include "hap/v1/planner_service.pb.h"

namespace hap::service::store::testing {

hap::v1::Node TestNode(const std::string& name, const std::string& address = "127.0.0.1:1");
hap::v1::Plan TestPlan(const std::string& name, int64_t create_seconds, int32_t create_nanos = 0);
hap::v1::Deployment TestDeployment(const std::string& name, int64_t create_seconds);
hap::v1::StepMetric TestMetric(int64_t step, int32_t rank, double loss);

// A new empty directory under $TEST_TMPDIR (or /tmp); "" on failure.
std::string NewTempDir();

MATCHER_P(EqualsProto, expected, "equals " + expected.ShortDebugString()) {
  std::string diff;
  google::protobuf::util::MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  if (differencer.Compare(expected, arg)) return true;
  *result_listener << "differs: " << diff;
  return false;
}

}  // namespace hap::service::store::testing

#endif  // HAP_PLANNER_SERVICE_STORE_TEST_UTIL_H_
