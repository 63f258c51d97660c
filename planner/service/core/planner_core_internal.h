// The planner core's state, shared by its sources: planner_core.cc (plans:
// jobs, the cache, cancel, delete, retention), planner_core_reads.cc (plan
// reads: views, encodings, pages) and planner_core_nodes.cc (the node
// registry: registration, heartbeats, liveness, links, calibration).
// Internal to //planner/service/core:planner_core.
#ifndef HAP_PLANNER_SERVICE_CORE_PLANNER_CORE_INTERNAL_H_
#define HAP_PLANNER_SERVICE_CORE_PLANNER_CORE_INTERNAL_H_

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/proto_time.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/plan.pb.h"
#include "planner/service/core/planner_core.h"

namespace hap::service {

// A plan as the core serves it: immutable snapshots, replaced (never
// changed) on each change, so that reads copy them outside the core's lock.
// `summary` is the plan without its rank programs, graph and program (the
// list view), kept so that lists and watches copy a kilobyte, not the
// megabytes of a plan's programs.
struct PlanEntry {
  // Null for a finished plan loaded at start as its summary until a read
  // needs the rest (PlannerCore::Whole loads it then).
  std::shared_ptr<const hap::v1::Plan> full;
  std::shared_ptr<const hap::v1::Plan> summary;  // always

  // A finished plan's summary alone (PlannerCoreOptions::load_plan).
  static PlanEntry Summary(hap::v1::Plan summary) {
    PlanEntry e;
    e.summary = std::make_shared<const hap::v1::Plan>(std::move(summary));
    return e;
  }
  explicit PlanEntry(hap::v1::Plan plan) {
    // The big fields step aside (pointer moves) while the rest is copied.
    google::protobuf::RepeatedPtrField<hap::v1::RankProgram> ranks;
    ranks.Swap(plan.mutable_rank_programs());
    hap::v1::Graph* graph = plan.has_graph() ? plan.release_graph() : nullptr;
    hap::v1::SynthesizedProgram* program = plan.has_program() ? plan.release_program() : nullptr;
    summary = std::make_shared<const hap::v1::Plan>(plan);
    ranks.Swap(plan.mutable_rank_programs());
    if (graph) plan.set_allocated_graph(graph);
    if (program) plan.set_allocated_program(program);
    full = std::make_shared<const hap::v1::Plan>(std::move(plan));
  }
  // The whole plan: only for plans known whole (not finished, or made or
  // loaded in this run); Whole() for any.
  const hap::v1::Plan& operator*() const { return *full; }
  // The summary's fields (state, name, times, options...).
  const hap::v1::Plan* operator->() const { return summary.get(); }

  // The wire form of the BASIC view (GetPlan) and of the summary
  // (ListPlans), each serialized by the first read that needs it and shared
  // by every copy of this snapshot; a change makes a new entry, so they
  // never go stale. Null after its once: too large to serialize.
  struct Encoded {
    absl::once_flag basic_once, summary_once;
    std::shared_ptr<const std::string> basic, summary;
  };
  std::shared_ptr<Encoded> encoded = std::make_shared<Encoded>();

 private:
  PlanEntry() = default;
};

struct PlannerCore::State {
  absl::Mutex mu;
  absl::CondVar changed;
  int64_t version = 0;  // bumps on every plan change
  std::map<std::string, hap::v1::Node> nodes;
  std::map<std::string, PlanEntry> plans;
  // Names of cached copies being written to the sink (outside mu): taken,
  // not yet served.
  std::set<std::string> creating;
  std::map<std::string, std::shared_ptr<Job>> jobs;  // not yet final
  std::deque<std::shared_ptr<Job>> queue;
  // Cache key -> the newest SUCCEEDED plan with it; plan name -> its key.
  std::map<std::string, std::string> cache;
  std::map<std::string, std::string> cached_key;
  // Cache key -> the job searching for it (merging).
  std::map<std::string, std::shared_ptr<Job>> in_flight;
  std::map<std::pair<std::string, std::string>, hap::v1::Link> links;  // (src, dst)
  std::map<std::string, int> pins;  // plan -> deploys holding it (PinPlan)
  uint64_t unpins = 0;              // UnpinPlan calls so far (EnforceRetention)
  bool stopping = false;
  std::vector<std::thread> workers;
  // When this planner started: a node is not blamed for heartbeats sent
  // while no planner ran (silence counts from the later of its last
  // heartbeat and this).
  absl::Time started = absl::InfinitePast();

  // Plan `name` SUCCEEDED with `key`: the next request with that key gets
  // a copy of it.
  void Cache(const std::string& name, const std::string& key) {
    cache[key] = name;
    cached_key[name] = key;
  }
  // Serves `plan` (replacing a plan of its name).
  void Put(hap::v1::Plan plan) {
    std::string name = plan.name();
    plans.insert_or_assign(std::move(name), PlanEntry(std::move(plan)));
  }
  void Uncache(const std::string& name) {
    auto k = cached_key.find(name);
    if (k == cached_key.end()) return;
    auto c = cache.find(k->second);
    if (c != cache.end() && c->second == name) cache.erase(c);
    cached_key.erase(k);
  }
};

// The BASIC view of GetPlan: everything but the rank programs (the
// summary, with the whole plan's graph and program); BasicView of an entry
// known whole (planner_core_reads.cc).
void FillBasicView(const hap::v1::Plan& summary, const hap::v1::Plan& whole, hap::v1::Plan* out);
hap::v1::Plan BasicView(const PlanEntry& e);

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_PLANNER_CORE_INTERNAL_H_
