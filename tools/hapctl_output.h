// How hapctl shows the planner's records: one-line table rows with their
// headers, kubectl-style describe views, and whole records as JSON or YAML
// (-o json|yaml). Everything goes to standard output; errors to stderr.
#ifndef HAP_TOOLS_HAPCTL_OUTPUT_H_
#define HAP_TOOLS_HAPCTL_OUTPUT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "google/protobuf/timestamp.pb.h"
#include "hap/v1/planner_service.pb.h"

namespace hap::tools {

// Prints "error: CODE: message" to stderr; returns 1 (the exit code).
int Fail(const absl::Status& s);

// Prints `m` as JSON or YAML; 0, or 1 with the error when it cannot be
// converted (a record JSON cannot hold).
int PrintMessage(const google::protobuf::Message& m, const std::string& format);

// A timestamp as RFC 3339, "-" when unset.
std::string Ts(const google::protobuf::Timestamp& t);
// A job's state as `get jobs` shows it.
std::string JobState(const hap::v1::Job& j);

void PrintPlanHeader();
void PrintPlanRow(const hap::v1::Plan& p);
void PrintJobHeader();
void PrintJobRow(const hap::v1::Job& j);
void PrintDeploymentHeader();
void PrintDeploymentRow(const hap::v1::Deployment& d);

// kubectl describe's views. `predicted`: the plan's predicted step seconds
// (0 unknown); `deployments`: those not finished, for the node's.
void DescribePlan(const hap::v1::Plan& p);
void DescribeJob(const hap::v1::Job& j);
void DescribeDeployment(const hap::v1::Deployment& d, double predicted);
void DescribeNode(const hap::v1::Node& n, const hap::v1::Cluster& cluster,
                  const std::vector<hap::v1::Deployment>& deployments);

}  // namespace hap::tools

#endif  // HAP_TOOLS_HAPCTL_OUTPUT_H_
