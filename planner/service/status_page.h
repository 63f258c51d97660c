// A read-only status page for people, served by the planner on its HTTP
// (metrics) port. Server-rendered HTML with inline CSS and SVG: no
// scripts, fonts or stylesheets from anywhere, so it works offline.
//
//   /, /status                 nodes (devices, FLOP/s, memory, links) and
//                              plans (state, predicted and measured step
//                              time, synthesis time) and deployments
//   /status/plans/{id}         one plan: devices with ratios and memory,
//                              the per-op sharding table
//   /status/deployments/{id}   step time and loss charts of a deployment
//   /status/jobs/{id}          an elastic job and its timeline: each
//                              (re)start, its reason, downtime, steps lost
//
// Unknown paths and bad or unknown ids get a 404 page saying what was not
// found; a source that fails gets a 500 page with its status. Everything
// taken from the state (names, addresses, errors) is HTML-escaped.
#ifndef HAP_PLANNER_SERVICE_STATUS_PAGE_H_
#define HAP_PLANNER_SERVICE_STATUS_PAGE_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "hap/v1/planner_service.pb.h"
#include "planner/service/core/planner_core.h"
#include "planner/service/grpc/planner_service_impl.h"
#include "planner/service/metrics/metrics_http.h"

namespace hap::service {

// Where the page reads the state from; every function must be set and be
// safe to call from several threads at once.
struct StatusSources {
  // The registered nodes (stale ones included) and measured links.
  std::function<hap::v1::Cluster()> cluster;
  // Every plan, without programs or rank programs.
  std::function<absl::StatusOr<std::vector<hap::v1::Plan>>()> plans;
  // One plan by name ("plans/{id}") with its program and ratios; NotFound
  // or InvalidArgument when there is none by that name.
  std::function<absl::StatusOr<hap::v1::Plan>(const std::string& name)> plan;
  // Every deployment.
  std::function<std::vector<hap::v1::Deployment>()> deployments;
  // A deployment's step metrics ("deployments/{id}"); NotFound when there
  // is no such deployment.
  std::function<absl::StatusOr<std::vector<hap::v1::StepMetric>>(const std::string& name)>
      step_metrics;
  // Every elastic job; may be unset (no jobs section).
  std::function<std::vector<hap::v1::Job>()> jobs;
};

// Sources reading `core` and `service`, which must outlive every call.
StatusSources StatusSourcesFor(PlannerCore* core, const PlannerServiceImpl* service);

// The page for `path` (percent-decoded, no query string).
metrics::HttpResponse ServeStatusPage(const StatusSources& sources, absl::string_view path);

// `text` with &, <, >, " and ' replaced by character references.
std::string HtmlEscape(absl::string_view text);

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_STATUS_PAGE_H_
