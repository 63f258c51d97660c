// What jobs.cc and job_reconcile.cc share: the reconciliation pass over
// one job and the few rules both sides apply. Internal to
// //planner/service/core:jobs.
#ifndef HAP_PLANNER_SERVICE_CORE_JOB_RECONCILE_H_
#define HAP_PLANNER_SERVICE_CORE_JOB_RECONCILE_H_

#include <cstddef>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "absl/time/time.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/planner_service.pb.h"
#include "planner/service/core/jobs.h"

namespace hap::service::job_internal {

namespace v1 = ::hap::v1;
using Reason = v1::JobEvent::Reason;

inline constexpr absl::Duration kDefaultJoinStable = absl::Seconds(30);

// How long a device must stay READY under one agent before a join counts.
absl::Duration JoinStable(const v1::JobSpec& s);
// The devices of READY nodes, each with its node's agent address (a node
// registered again by a new agent comes back at another one).
std::map<std::string, std::string> ReadyDevices(const v1::Cluster& c);

// What one pass sees and may call.
struct PassEnv {
  JobBackend* backend;
  absl::Time now;
  v1::Cluster cluster;
  std::set<std::string> ready;   // devices of READY nodes
  std::set<std::string> stable;  // ... READY (one agent) for at least join_stable
  // Devices other jobs hold or are planning on (ClaimedDevices): this job
  // does not plan on them, so two jobs whose selectors overlap do not both
  // deploy on one device; the one reconciled first (by name) gets it.
  std::set<std::string> taken;
  std::function<bool(const v1::Job&)> commit;
  std::function<void(const v1::Job&, Reason)> on_replan;
  std::function<void(const v1::Job&, const v1::JobEvent&)> on_resumed;
  size_t max_events;
};

// The devices `job` holds or is about to (none once it is final): those it
// runs on and those of the plans it is making (next_plan, candidate_plan).
std::set<std::string> ClaimedDevices(const v1::Job& job, JobBackend& backend);

// One reconciliation pass over `job`: observe, decide, act, save (through
// env.commit).
void RunPass(v1::Job job, PassEnv env);

}  // namespace hap::service::job_internal

#endif  // HAP_PLANNER_SERVICE_CORE_JOB_RECONCILE_H_
