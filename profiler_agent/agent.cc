#include "profiler_agent/agent.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/host_port.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "hap/v1/executor_service.grpc.pb.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/core/profile_checks.h"
#include "profiler_agent/agent_service.h"

namespace hap::agent {
namespace {

namespace v1 = hap::v1;
using hap::service::FromGrpc;

constexpr char kAgentVersion[] = "hap-agent/1";
constexpr absl::Duration kDefaultHeartbeat = absl::Seconds(5);
// hap-planner's --heartbeat-seconds range.
constexpr absl::Duration kMinHeartbeat = absl::Milliseconds(10);
constexpr absl::Duration kMaxHeartbeat = absl::Hours(1);
// Devices taken from a peer's profile (the planner's limit per node).
constexpr int kMaxPeerDevices = 1024;

// One line to stderr, written at once so that threads do not interleave.
void Log(const std::string& message) {
  std::cerr << absl::StrCat("hap-agent ",
                            absl::FormatTime("%H:%M:%E3S", absl::Now(), absl::LocalTimeZone()),
                            ": ", message, "\n")
            << std::flush;
}

// A planner's answer that refuses what a call carried (the devices of a
// heartbeat), rather than one that may pass if the call is made again.
bool RefusesTheDevices(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsResourceExhausted(s) || absl::IsAlreadyExists(s) ||
         absl::IsFailedPrecondition(s) || absl::IsOutOfRange(s);
}

// OK for a link the planner takes (service::CheckLinkMeasurement, what
// PlannerCore::ReportLinks checks): the planner refuses a whole report for
// one such link, so one broken timing lost every link reported with it.
absl::Status CheckLink(const v1::Link& l) {
  return service::CheckLinkMeasurement(l, absl::StrCat("link ", l.src(), " -> ", l.dst(), ": "));
}

absl::Status Validate(const AgentOptions& o) {
  if (o.planner.empty()) {
    return absl::InvalidArgumentError("the planner address is required (--planner HOST:PORT)");
  }
  if (o.name.empty()) return absl::InvalidArgumentError("the node name must not be empty");
  // The planner refuses any other name at every registration: the agent
  // would run, retrying forever, as a node that never joins.
  if (!service::ValidNodeName(o.name)) {
    return absl::InvalidArgumentError(absl::StrCat("the node name '", o.name,
                                                   "' must be 1-253 letters, digits, '-', "
                                                   "'.' or '_' (the planner takes no other)"));
  }
  if (!(o.drift >= 0) || !std::isfinite(o.drift)) {
    return absl::InvalidArgumentError(
        absl::StrCat("drift must be a non-negative fraction, got ", o.drift));
  }
  if (o.heartbeat_interval < absl::ZeroDuration() ||
      o.drift_check_interval <= absl::ZeroDuration() ||
      o.link_probe_interval <= absl::ZeroDuration() || o.rpc_timeout <= absl::ZeroDuration() ||
      o.initial_backoff <= absl::ZeroDuration() || o.max_backoff < o.initial_backoff) {
    return absl::InvalidArgumentError(
        "intervals, timeouts and backoffs must be positive (max_backoff >= initial_backoff)");
  }
  if (o.probe.max_duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the probe duration must be positive");
  }
  return absl::OkStatus();
}

bool NotCancelled() { return false; }

}  // namespace

struct Agent::Impl : public ProfileSource {
  AgentOptions o;
  std::vector<std::unique_ptr<DeviceProber>> probers;
  std::unique_ptr<AgentServer> server;
  std::string address;
  // Notified once `address` is set: the server takes calls before (its port
  // is picked when it starts), and a Probe reads the address.
  absl::Notification address_known;
  std::thread heartbeat_thread, link_thread, probe_thread;
  std::atomic<bool> shut_down{false};
  absl::Notification shutdown_done;  // the first Shutdown has finished

  // Shutdown, for WaitFor: a std::condition_variable waits on the
  // monotonic clock (absl::Mutex's timed waits, in our Abseil 20220623,
  // turn the timeout into a wall-clock deadline).
  std::mutex wait_mu;
  std::condition_variable wait_cv;
  bool wait_stop = false;  // guarded by wait_mu
  // The node registered again after the planner had lost it (unknown_node),
  // and its links with it: the link thread measures them now, as after the
  // first registration. Guarded by wait_mu.
  bool links_lost = false;
  // The latest heartbeat was answered unknown_node (the heartbeat thread's).
  bool planner_lost_node = false;
  // A re-probe the planner asked for, run once the node registered again
  // (the heartbeat thread's).
  bool probe_after_register = false;
  // The planner refused the devices the latest heartbeat carried (the
  // heartbeat thread's): the next one goes without them.
  bool devices_refused = false;

  // o.random's stand-in (the heartbeat thread's).
  absl::BitGen bitgen;

  // One probe or link measurement at a time: they would disturb each other.
  absl::Mutex probe_mu;

  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  bool registered ABSL_GUARDED_BY(mu) = false;
  // The agent the planner's latest heartbeat answer said holds the node
  // (registered_by; empty: this one): links measured here would be taken as
  // the holder's.
  std::string held_by ABSL_GUARDED_BY(mu);
  // A re-probe the planner or a drift asked for, run by probe_thread so
  // that heartbeats go on while it measures.
  bool probe_wanted ABSL_GUARDED_BY(mu) = false;
  bool drift_check_wanted ABSL_GUARDED_BY(mu) = false;  // a drift check, likewise
  // Drift checks in a row that found a drift (a probe needs two).
  int drift_checks_in_a_row ABSL_GUARDED_BY(probe_mu) = 0;
  std::optional<v1::ProbeResponse> profile ABSL_GUARDED_BY(mu);
  // Why the latest probe failed (OK after one that did not): served while
  // there is no profile, so that callers learn the device error.
  absl::Status probe_error ABSL_GUARDED_BY(mu);
  std::vector<double> quick_baseline ABSL_GUARDED_BY(mu);
  // Profiles probed and profiles the planner has: devices are pending while
  // they differ.
  int64_t profile_generation ABSL_GUARDED_BY(mu) = 0;
  int64_t sent_generation ABSL_GUARDED_BY(mu) = 0;
  // Executors of o.executors that did not answer at the last registration
  // (the heartbeat thread's alone).
  int executors_unresolved = 0;
  // The planner's latest heartbeat said a deployment runs on this node.
  bool planner_says_training ABSL_GUARDED_BY(mu) = false;
  // What each measurement paused for training last said it waits for.
  std::map<std::string, std::string> paused_for ABSL_GUARDED_BY(mu);
  absl::Duration heartbeat_interval = kDefaultHeartbeat;  // the latest (heartbeat thread's)
  bool interval_warned = false;  // PlannersInterval said it clamps (heartbeat thread's)
  // HeartbeatIntervalFor said o.heartbeat_interval is held to the planner's
  // (heartbeat thread's).
  bool own_interval_held = false;
  std::set<grpc::ClientContext*> calls ABSL_GUARDED_BY(mu);
  std::shared_ptr<v1::Planner::Stub> planner_stub ABSL_GUARDED_BY(mu);

  std::shared_ptr<v1::Planner::Stub> Planner() {
    absl::MutexLock l(&mu);
    return planner_stub;
  }

  // A fresh channel to the planner. gRPC's own reconnect backoff grows to
  // minutes while a peer is down; a new channel dials at once, so the
  // registration retries keep to our backoff.
  absl::Status ConnectPlanner() {
    HAP_ASSIGN_OR_RETURN(auto channel, hap::service::MakeChannel(o.planner, o.security));
    std::shared_ptr<v1::Planner::Stub> stub = v1::Planner::NewStub(channel);
    absl::MutexLock l(&mu);
    planner_stub = std::move(stub);
    return absl::OkStatus();
  }

  // A client context for one outgoing call, cancelled by Shutdown.
  class Call {
   public:
    Call(Impl* impl, absl::Duration timeout) : impl_(impl) {
      hap::service::PrepareClientContext(&ctx_, impl->o.security, timeout);
      absl::MutexLock l(&impl->mu);
      if (impl->stopping) ctx_.TryCancel();
      impl->calls.insert(&ctx_);
    }
    ~Call() {
      absl::MutexLock l(&impl_->mu);
      impl_->calls.erase(&ctx_);
    }
    grpc::ClientContext* ctx() { return &ctx_; }

   private:
    Impl* impl_;
    grpc::ClientContext ctx_;
  };

  // No other agent holds the node, as the planner's latest heartbeat answer
  // said.
  bool HeldByThisAgent() {
    absl::MutexLock l(&mu);
    return held_by.empty();
  }

  // Shutdown has begun, or the process was asked to stop before it could
  // be called (o.stop_requested).
  bool Stopping() {
    if (o.stop_requested && o.stop_requested()) return true;
    absl::MutexLock l(&mu);
    return stopping;
  }

  // Waits for `d` (infinite: until Shutdown) on the monotonic clock, until
  // Shutdown, or until *wake (guarded by wait_mu) is set; false when
  // stopping.
  bool WaitFor(absl::Duration d, const bool* wake = nullptr) {
    const absl::Time end = MonotonicNow() + d;
    std::unique_lock<std::mutex> l(wait_mu);
    for (absl::Duration left = d; !wait_stop && !(wake && *wake) && left > absl::ZeroDuration();
         left = end - MonotonicNow()) {
      // A day at most per wait: steady_clock's time points overflow at
      // an infinite one.
      wait_cv.wait_for(l, absl::ToChronoNanoseconds(std::min(left, absl::Hours(24))));
    }
    return !wait_stop;
  }

  std::vector<DeviceProber*> RawProbers() {
    std::vector<DeviceProber*> raw;
    for (auto& p : probers) raw.push_back(p.get());
    return raw;
  }

  // Quick FLOP/s of every device, in ProbeNode's order. Needs probe_mu.
  // Shutdown ends it at its next run, as it ends a probe (given o.probe's
  // stop, which never says so, a drift check of many GPUs held the exit
  // for all of it).
  absl::StatusOr<std::vector<double>> QuickFlopsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(probe_mu) {
    ProbeOptions opts = o.probe;
    opts.stop = [this] { return Stopping(); };
    std::vector<double> all;
    for (auto& p : probers) {
      HAP_ASSIGN_OR_RETURN(std::vector<double> f, p->QuickFlops(opts));
      all.insert(all.end(), f.begin(), f.end());
    }
    return all;
  }

  // A full probe; the new profile replaces the last one and becomes pending
  // for the planner.
  // DeadlineExceeded, probing nothing, when `deadline` has passed once the
  // probes before this one are done (a caller of Probe that gave up);
  // Cancelled when `cancelled()` says so then, or during the probe, which
  // then ends at its next run and keeps the last profile.
  absl::Status ProbeDevices(absl::Duration max_duration,
                            absl::Time deadline = absl::InfiniteFuture(),
                            const std::function<bool()>& cancelled = NotCancelled) {
    absl::MutexLock probing(&probe_mu);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          "the call's deadline passed while another probe ran; nothing was probed");
    }
    if (cancelled()) {
      return absl::CancelledError(
          "the caller cancelled while another probe ran; nothing was probed");
    }
    // Probes that waited for the lock when Shutdown came: each ran a full
    // probe after the other, delaying the exit by their sum.
    if (Stopping()) return absl::UnavailableError("the agent is shutting down; nothing was probed");
    drift_checks_in_a_row = 0;  // a new baseline
    ProbeOptions opts = o.probe;
    if (max_duration > absl::ZeroDuration()) opts.max_duration = max_duration;
    // Shutdown, or a stop asked for before it (SIGTERM during the first
    // probe, inside Start), ends a probe at its next run.
    opts.stop = [this, &cancelled] { return Stopping() || cancelled(); };
    // The caller's going ends its probe, not the profile the agent serves.
    auto caller_gone = [this, &cancelled] { return !Stopping() && cancelled(); };
    const absl::Status gone = absl::CancelledError(
        "the caller cancelled during the probe; it was stopped and the last profile kept");
    const absl::Time start = MonotonicNow();
    auto node = ProbeNode(o.name, address, RawProbers(), opts);
    if (caller_gone()) return gone;
    // A measurement the planner refuses (a FLOP/s below its minimum or not
    // a number) is a failed probe: sent, it failed every heartbeat that
    // carried it (the node went STALE for good) or every registration.
    std::set<std::string> ids;
    absl::Status s = node.ok() ? Annotate(service::ValidateDevices(o.name, node->devices(), &ids),
                                          "the probe measured what the planner refuses (not sent)")
                               : node.status();
    if (!s.ok()) {
      s = Annotate(s, "probing this node");
      absl::MutexLock l(&mu);
      probe_error = s;
      return s;
    }
    node->set_agent_version(kAgentVersion);
    // Links between local devices (GPU peers) are part of the profile; a
    // failure there leaves them out rather than failing the devices.
    std::vector<v1::Link> local_links;
    if (auto l = ProbeNodeLinks(o.name, RawProbers(), opts); l.ok()) {
      for (v1::Link& link : *l) {
        if (absl::Status c = CheckLink(link); !c.ok()) {
          Log(absl::StrCat("probing the links between this node's devices: ", c.message(),
                           "; left out (the planner would refuse it, and the links reported "
                           "with it)"));
          continue;
        }
        local_links.push_back(std::move(link));
      }
    } else if (caller_gone()) {
      return gone;  // not a profile without its links
    } else {
      Log(absl::StrCat("probing the links between this node's devices: ", l.status().ToString()));
    }
    std::vector<double> baseline;
    if (o.drift > 0) {
      auto quick = QuickFlopsLocked();
      if (quick.ok()) {
        baseline = std::move(*quick);
      } else if (!Stopping()) {
        Log(
            absl::StrCat("quick FLOP/s check failed, drift detection is off until the next "
                         "probe: ",
                         quick.status().ToString()));
      }
    }
    v1::ProbeResponse r;
    *r.mutable_node() = std::move(*node);
    for (auto& l : local_links) *r.add_links() = std::move(l);
    *r.mutable_probe_duration() = service::ToProto(MonotonicNow() - start);
    absl::MutexLock l(&mu);
    profile = std::move(r);
    probe_error = absl::OkStatus();
    quick_baseline = std::move(baseline);
    ++profile_generation;
    return absl::OkStatus();
  }

  // True when a quick check differs from the baseline by more than `drift`.
  bool Drifted() {
    std::vector<double> baseline;
    {
      absl::MutexLock l(&mu);
      baseline = quick_baseline;
    }
    if (baseline.empty()) return false;
    absl::MutexLock probing(&probe_mu);
    if (Stopping()) return false;  // as ProbeDevices
    auto quick = QuickFlopsLocked();
    if (!quick.ok()) {
      if (!Stopping()) Log(absl::StrCat("quick FLOP/s check failed: ", quick.status().ToString()));
      return false;
    }
    if (quick->size() != baseline.size()) return true;  // devices came or went
    // A drift is probed again only when the next check finds it too: one
    // check that ran beside a burst of other work (another agent's probe,
    // a job starting) re-probed the node every minute on a shared host,
    // each full probe slowing whatever trained there.
    for (size_t i = 0; i < baseline.size(); ++i) {
      if (std::abs((*quick)[i] - baseline[i]) > o.drift * baseline[i]) {
        if (++drift_checks_in_a_row < 2) {
          Log(absl::StrCat("device ", i, " FLOP/s drifted from ", baseline[i], " to ", (*quick)[i],
                           " (more than ", o.drift * 100,
                           "%); probing again if the next check finds it too"));
          return false;
        }
        Log(absl::StrCat("device ", i, " FLOP/s drifted from ", baseline[i], " to ", (*quick)[i],
                         " (more than ", o.drift * 100,
                         "%) in two checks in a row; probing again"));
        drift_checks_in_a_row = 0;
        return true;
      }
    }
    drift_checks_in_a_row = 0;
    return false;
  }

  // The status of the executor daemon at `address`, asked within `timeout`.
  absl::StatusOr<v1::ExecutorStatus> ExecutorStatusOf(const std::string& address,
                                                      absl::Duration timeout) {
    HAP_ASSIGN_OR_RETURN(auto channel, hap::service::MakeChannel(address, o.security));
    auto stub = v1::Executor::NewStub(channel);
    v1::ExecutorStatus st;
    Call call(this, timeout);
    HAP_RETURN_IF_ERROR(FromGrpc(stub->GetStatus(call.ctx(), v1::GetStatusRequest(), &st)));
    return st;
  }

  // Every executor of o.executors asked at once, each within `budget`.
  std::vector<absl::StatusOr<v1::ExecutorStatus>> AskExecutors(absl::Duration budget) {
    std::vector<absl::StatusOr<v1::ExecutorStatus>> statuses(o.executors.size(),
                                                             v1::ExecutorStatus());
    std::vector<std::thread> lookups;
    for (size_t i = 0; i < o.executors.size(); ++i) {
      lookups.emplace_back(
          [this, budget, i, &statuses] { statuses[i] = ExecutorStatusOf(o.executors[i], budget); });
    }
    for (std::thread& t : lookups) t.join();
    return statuses;
  }

  // What trains on this node, as "the executor at A (device) trains D" or
  // "a deployment runs on this node (the planner's heartbeat)", or "" when
  // the planner's latest heartbeat says none runs here and none of
  // o.executors that answers has a deployment loaded or training (an agent
  // that knows its executors sees a job start before the planner's next
  // heartbeat does). A device that trains is not measured again: a quick check
  // beside the job's kernels reads the contention as a drift (two in a row,
  // every minute, while any job trains) and the full probe it starts, or a
  // link probe's transfers, slow the job and report the shared device or
  // link as the node's; the job's own step profiles watch it meanwhile.
  std::string Training() {
    {
      absl::MutexLock l(&mu);
      if (planner_says_training) return "a deployment runs on this node (the planner's heartbeat)";
    }
    const auto statuses = AskExecutors(o.rpc_timeout);
    for (size_t i = 0; i < statuses.size(); ++i) {
      if (!statuses[i].ok()) continue;
      const v1::ExecutorStatus& st = *statuses[i];
      if (st.state() == v1::ExecutorStatus::LOADED || st.state() == v1::ExecutorStatus::TRAINING) {
        return absl::StrCat("the executor at ", o.executors[i], " (", st.device(), ") trains ",
                            st.deployment().empty() ? "a deployment" : st.deployment());
      }
    }
    return "";
  }

  // True, and said once, while something trains on this node: `what`
  // (drift checks, link re-probes) waits for it to end.
  bool PausedForTraining(const std::string& what) {
    const std::string busy = Training();
    absl::MutexLock l(&mu);
    std::string& said = paused_for[what];
    if (busy.empty()) {
      if (!said.empty()) Log(absl::StrCat(what, " resumed: nothing trains on this node now"));
      said.clear();
      return false;
    }
    if (said != busy) Log(absl::StrCat(what, " paused while ", busy));
    said = busy;
    return true;
  }

  // "hap.executor/<device>" = address for each executor of o.executors that
  // answers naming a device of this node; `unresolved` counts the others
  // (asked again at each heartbeat). One that serves a device this node does
  // not report (another node's; node/cpu0 beside an agent measuring the
  // GPUs) is not labelled: the planner refuses a registration with that
  // label, and the node never joined. The heartbeat thread
  // asks them: all of them at once, within half a heartbeat interval (or
  // rpc_timeout, if shorter), so that a hung executor cannot delay the
  // heartbeats until the planner takes the node for stale, nor spend the
  // time of the executors listed after it (asked one after another, they
  // were left 1 ms each and never labelled).
  std::map<std::string, std::string> ExecutorLabels(int* unresolved) {
    std::map<std::string, std::string> labels;
    *unresolved = 0;
    const auto statuses = AskExecutors(std::min(o.rpc_timeout, heartbeat_interval / 2));
    std::set<std::string> ours;
    {
      absl::MutexLock l(&mu);
      if (profile) {
        for (const v1::Device& d : profile->node().devices()) ours.insert(d.id());
      }
    }
    for (size_t i = 0; i < o.executors.size(); ++i) {
      const std::string& address = o.executors[i];
      absl::Status s = statuses[i].status();
      if (s.ok() && statuses[i]->device().empty()) {
        s = absl::FailedPreconditionError("the executor names no device it serves");
      } else if (s.ok() && !ours.count(statuses[i]->device())) {
        const std::string& device = statuses[i]->device();
        s = absl::FailedPreconditionError(
            absl::StrCat("the executor serves '", absl::CHexEscape(device.substr(0, 80)),
                         device.size() > 80 ? "...'" : "'", ", not a device of this node (",
                         absl::StrJoin(ours, ", "), "); the node is not labelled with it"));
      }
      if (s.ok()) {
        // Two serving one device (one executor under two addresses, or a
        // second one started there): the one listed first, said (the label
        // silently went to the last).
        const auto [it, added] = labels.emplace("hap.executor/" + statuses[i]->device(), address);
        if (!added) {
          Log(absl::StrCat("the executor at ", address, " (--executor) serves ",
                           statuses[i]->device(), ", as the one at ", it->second,
                           " does: the node is labelled with ", it->second));
        }
      } else {
        ++*unresolved;
        if (!Stopping()) {
          Log(absl::StrCat("the executor at ", address, " (--executor): ", s.ToString(),
                           "; asking again at the next heartbeat"));
        }
      }
    }
    return labels;
  }

  // The heartbeat interval the planner answered (a registration or a
  // heartbeat), within the range hap-planner takes: a planner answering
  // 1 ns would have us call it in a loop, one answering years would have us
  // never heartbeat. Zero when it answered none.
  absl::Duration PlannersInterval(const google::protobuf::Duration& answered) {
    const absl::Duration interval = service::FromProto(answered);
    const absl::Duration taken = std::clamp(interval, kMinHeartbeat, kMaxHeartbeat);
    if (interval <= absl::ZeroDuration()) return absl::ZeroDuration();
    if (taken == interval) interval_warned = false;
    if (taken != interval && !interval_warned) {
      Log(absl::StrCat("the planner's heartbeat interval ", absl::FormatDuration(interval),
                       " is outside [", absl::FormatDuration(kMinHeartbeat), ", ",
                       absl::FormatDuration(kMaxHeartbeat), "]; heartbeating every ",
                       absl::FormatDuration(taken)));
      interval_warned = true;  // heartbeats answer it too: said once
    }
    return taken;
  }

  // The interval to heartbeat at, given the planner's (zero: it answered
  // none): o.heartbeat_interval when set, but never longer than the
  // planner's, which takes a node that misses a few heartbeats for STALE
  // and asks a STALE node to probe again at every heartbeat (a longer
  // --heartbeat-seconds made that a full probe each time); else the
  // planner's, else kDefaultHeartbeat.
  absl::Duration HeartbeatIntervalFor(absl::Duration planners) {
    if (o.heartbeat_interval == absl::ZeroDuration()) {
      return planners > absl::ZeroDuration() ? planners : kDefaultHeartbeat;
    }
    const bool held = planners > absl::ZeroDuration() && planners < o.heartbeat_interval;
    if (held && !own_interval_held) {
      Log(absl::StrCat("--heartbeat-seconds asks for a heartbeat every ",
                       absl::FormatDuration(o.heartbeat_interval), ", but the planner at ",
                       o.planner, " expects one every ", absl::FormatDuration(planners),
                       " (it takes a node that misses a few for STALE): heartbeating every ",
                       absl::FormatDuration(planners)));
    }
    own_interval_held = held;
    return held ? planners : o.heartbeat_interval;
  }

  // RegisterNode with the current profile; the heartbeat interval to use.
  absl::StatusOr<absl::Duration> Register() {
    v1::RegisterNodeRequest req;
    int64_t generation;
    {
      absl::MutexLock l(&mu);
      *req.mutable_node() = profile->node();
      generation = profile_generation;
    }
    int unresolved = 0;
    for (auto& [k, v] : ExecutorLabels(&unresolved)) (*req.mutable_node()->mutable_labels())[k] = v;
    executors_unresolved = unresolved;
    v1::RegisterNodeResponse resp;
    Call call(this, o.rpc_timeout);
    HAP_RETURN_IF_ERROR(FromGrpc(Planner()->RegisterNode(call.ctx(), req, &resp)));
    const absl::Duration interval =
        HeartbeatIntervalFor(PlannersInterval(resp.heartbeat_interval()));
    absl::MutexLock l(&mu);
    registered = true;
    held_by.clear();
    sent_generation = generation;
    return interval;
  }

  // True when the planner answered.
  bool HeartbeatOnce() {
    v1::HeartbeatRequest req;
    req.set_name("nodes/" + o.name);
    req.set_address(address);  // the planner takes only the registered agent's
    int64_t generation;
    {
      absl::MutexLock l(&mu);
      generation = profile_generation;
      if (generation != sent_generation && !devices_refused) {
        *req.mutable_devices() = profile->node().devices();
      }
    }
    devices_refused = false;
    v1::HeartbeatResponse resp;
    Call call(this, o.rpc_timeout);
    absl::Status s = FromGrpc(Planner()->Heartbeat(call.ctx(), req, &resp));
    std::string previous_holder;  // held_by before this answer
    if (!s.ok() && req.devices_size() > 0 && RefusesTheDevices(s)) {
      // Sent with every heartbeat, they failed each one until the node went
      // STALE: the next heartbeat goes without them (the planner keeps the
      // devices it has), the one after offers them again.
      Log(absl::StrCat("the planner at ", o.planner, " refused the devices of the last probe: ",
                       s.ToString(), "; the next heartbeat goes without them"));
      devices_refused = true;
      return false;
    }
    if (!s.ok()) {
      if (!Stopping()) {
        Log(absl::StrCat("heartbeat to the planner at ", o.planner, " failed: ", s.ToString()));
      }
      return false;
    }
    {
      absl::MutexLock l(&mu);
      if (req.devices_size() > 0) sent_generation = generation;
      if (resp.unknown_node()) registered = false;
      planner_says_training = resp.training();
      previous_holder = std::exchange(held_by, resp.registered_by());
    }
    if (resp.has_heartbeat_interval()) {
      // A planner restarted with another --heartbeat-seconds, its database
      // kept: at the interval of the registration, a longer one, the node
      // went STALE between heartbeats.
      const absl::Duration planners = PlannersInterval(resp.heartbeat_interval());
      const absl::Duration want =
          planners > absl::ZeroDuration() ? HeartbeatIntervalFor(planners) : heartbeat_interval;
      if (want != heartbeat_interval) {
        Log(absl::StrCat("the planner at ", o.planner, " now expects a heartbeat every ",
                         absl::FormatDuration(want), " (was ",
                         absl::FormatDuration(heartbeat_interval), ")"));
        heartbeat_interval = want;
      }
    }
    if (resp.registered_by() != previous_holder) {
      // Not registering again: the two agents would take the node in turns.
      // The planner says unknown_node once the other goes silent.
      const std::string& registered_by = resp.registered_by();
      Log(registered_by.empty()
              ? absl::StrCat("the planner takes this agent's heartbeats for node '", o.name,
                             "' again")
              : absl::StrCat(
                    "node '", o.name, "' is registered by the agent at ", registered_by,
                    ", not this one (", address,
                    "): the planner does not take this agent's heartbeats. Two agents "
                    "share the name (give each its own --name), or this one was "
                    "replaced; it measures no links meanwhile, and takes the node over if that "
                    "agent goes silent"));
    }
    if (resp.unknown_node()) {
      Log(absl::StrCat("the planner does not know node '", o.name,
                       "'; registering again, then measuring the links again"));
      planner_lost_node = true;
    }
    if (resp.reprobe() && !resp.unknown_node() && !resp.has_heartbeat_interval()) {
      // The node was STALE: an older planner (whose answers carry no
      // interval) may have restarted with a shorter heartbeat interval than
      // the one the node registered with (its database kept, so no
      // unknown_node), and every heartbeat at the old one would find the
      // node STALE again and ask for another probe. Registering again takes
      // its interval; the probe follows.
      Log("the planner asked for a new probe; registering again first (for its heartbeat "
          "interval)");
      probe_after_register = true;
      absl::MutexLock l(&mu);
      registered = false;
    } else if (resp.reprobe()) {
      Log("the planner asked for a new probe");
      absl::MutexLock l(&mu);
      probe_wanted = true;
    }
    return true;
  }

  // Heartbeats (and drift checks) are scheduled on the monotonic clock: on
  // the wall clock, a step back of an hour (NTP, `date -s`) stopped them for
  // an hour, and the planner took the node for STALE.
  void RunHeartbeats() {
    absl::Duration backoff = o.initial_backoff;
    absl::Duration interval = kDefaultHeartbeat;
    absl::Time next_heartbeat = MonotonicNow(),
               next_drift = MonotonicNow() + o.drift_check_interval;
    // A heartbeat answered since the last registration: until then the
    // agent does not know whether a deployment runs on the node, and drift
    // checks wait (before, they drifted twice before the first heartbeat
    // and probed a node that trained).
    bool planner_answered = false;
    auto fail_and_wait = [&](const std::string& message) {
      if (Stopping()) return false;
      // A random part of the backoff, from half to all: agents started
      // together (a DaemonSet rolled out while the planner is down) retried
      // in step, all of them at once at each doubling.
      const double u = o.random ? o.random() : absl::Uniform<double>(bitgen, 0, 1);
      const absl::Duration wait = backoff * (0.5 + 0.5 * std::clamp(u, 0.0, 1.0));
      Log(absl::StrCat(message, "; retrying in ", absl::FormatDuration(wait)));
      bool go_on = WaitFor(wait);
      backoff = std::min(backoff * 2, o.max_backoff);
      return go_on;
    };
    while (!Stopping()) {
      bool have_profile, is_registered;
      {
        absl::MutexLock l(&mu);
        have_profile = profile.has_value();
        is_registered = registered;
      }
      if (!have_profile) {
        absl::Status s = ProbeDevices(absl::ZeroDuration());
        if (!s.ok() && !fail_and_wait(s.ToString())) break;
        // The registration's retries start afresh: from the probes' backoff,
        // its first retry waited up to max_backoff.
        if (s.ok()) backoff = o.initial_backoff;
        continue;
      }
      if (!is_registered) {
        auto r = Register();
        if (!r.ok() && absl::IsUnavailable(r.status())) {
          if (absl::Status c = ConnectPlanner(); !c.ok()) Log(c.ToString());
        }
        if (!r.ok()) {
          if (!fail_and_wait(absl::StrCat("registering with the planner at ", o.planner, ": ",
                                          r.status().ToString()))) {
            break;
          }
          continue;
        }
        Log(absl::StrCat("registered node '", o.name, "' (", address, ") with the planner at ",
                         o.planner, "; heartbeat every ", absl::FormatDuration(*r)));
        backoff = o.initial_backoff;
        if (probe_after_register) {
          probe_after_register = false;
          absl::MutexLock l(&mu);
          probe_wanted = true;
        }
        if (planner_lost_node) {
          planner_lost_node = false;
          std::lock_guard<std::mutex> l(wait_mu);
          links_lost = true;
          wait_cv.notify_all();
        }
        interval = heartbeat_interval = *r;
        // With drift checks on, the first heartbeat goes at once: they wait
        // for its answer (whether the node trains).
        next_heartbeat = MonotonicNow() + (o.drift > 0 ? absl::ZeroDuration() : interval);
        planner_answered = false;
        continue;
      }
      // Not while another agent holds the node: a probe would not be sent.
      const bool check_drift = o.drift > 0 && planner_answered && HeldByThisAgent();
      if (check_drift && MonotonicNow() >= next_drift) {
        absl::MutexLock l(&mu);
        drift_check_wanted = true;
        next_drift = MonotonicNow() + o.drift_check_interval;
      }
      if (MonotonicNow() >= next_heartbeat) {
        planner_answered = HeartbeatOnce() || planner_answered;
        interval = heartbeat_interval;  // the planner's, when it answered another
        next_heartbeat = MonotonicNow() + interval;
        {
          absl::MutexLock l(&mu);
          if (!registered) continue;  // unknown_node: register again at once
        }
        // Not while another agent holds the node: registering again for
        // the labels took the node back from it.
        if (executors_unresolved > 0 && HeldByThisAgent()) {
          int unresolved = 0;
          ExecutorLabels(&unresolved);
          if (unresolved == 0) {  // every executor answers now: register with the labels
            absl::MutexLock l(&mu);
            registered = false;
            continue;
          }
        }
      }
      const absl::Time next =
          o.drift > 0 && planner_answered ? std::min(next_heartbeat, next_drift) : next_heartbeat;
      if (!WaitFor(std::max(next - MonotonicNow(), absl::ZeroDuration()))) break;
    }
  }

  // `timeout`, or less where `deadline` (a caller's) comes first.
  static absl::Duration Within(absl::Duration timeout, absl::Time deadline) {
    return std::min(timeout, deadline - absl::Now());
  }

  // The devices of a peer agent, from its profile.
  absl::StatusOr<std::vector<std::string>> PeerDevices(const std::string& peer_address,
                                                       absl::Time deadline) {
    HAP_ASSIGN_OR_RETURN(auto channel, hap::service::MakeChannel(peer_address, o.security));
    auto stub = v1::Agent::NewStub(channel);
    v1::ProbeResponse r;
    Call call(this, Within(o.rpc_timeout, deadline));
    HAP_RETURN_IF_ERROR(FromGrpc(stub->GetProfile(call.ctx(), v1::GetProfileRequest(), &r)));
    if (r.node().devices_size() > kMaxPeerDevices) {
      // The planner takes no more from a node; each would be a link of ours.
      return absl::FailedPreconditionError(
          absl::StrCat("the peer reports ", r.node().devices_size(), " devices; at most ",
                       kMaxPeerDevices, " are taken"));
    }
    std::vector<std::string> ids;
    for (const auto& d : r.node().devices()) ids.push_back(d.id());
    if (ids.empty()) return absl::FailedPreconditionError("the peer reports no devices");
    return ids;
  }

  // Reports `links` (`what` for the log) to the planner, by `deadline` (a
  // Probe caller's); a refusal is logged and returned. The planner takes a
  // report whole or not at all.
  absl::Status ReportLinks(const std::vector<v1::Link>& links, const std::string& what,
                           absl::Time deadline) {
    if (links.empty()) return absl::OkStatus();
    v1::ReportLinksRequest report;
    report.set_node(o.name);
    report.set_address(address);
    for (const auto& l : links) *report.add_links() = l;
    v1::ReportLinksResponse ignored;
    Call call(this, Within(o.rpc_timeout, deadline));
    absl::Status s = FromGrpc(Planner()->ReportLinks(call.ctx(), report, &ignored));
    if (!s.ok() && !Stopping()) {
      Log(absl::StrCat("reporting ", what, " to ", o.planner, ": ", s.ToString()));
    }
    return s;
  }

  // The peers the planner assigns this node to measure, asked by `deadline`;
  // the planner's error naming it.
  absl::StatusOr<v1::GetProbeAssignmentsResponse> ProbeAssignments(absl::Time deadline) {
    v1::GetProbeAssignmentsRequest req;
    req.set_node(o.name);
    v1::GetProbeAssignmentsResponse assignments;
    Call call(this, Within(o.rpc_timeout, deadline));
    HAP_RETURN_IF_ERROR(
        Annotate(FromGrpc(Planner()->GetProbeAssignments(call.ctx(), req, &assignments)),
                 absl::StrCat("getting probe assignments from the planner at ", o.planner)));
    return assignments;
  }

  // Measures each peer of `assignments` and reports the links, with those
  // between this node's own devices (from the last probe). A failing peer is
  // logged and skipped. Each peer's links are a report of their own, so that
  // one the planner refuses (a peer listing a device the planner does not
  // know) loses only its own. Returns the peer links the planner took (a
  // Probe caller's answer: one that held links the planner refused had its
  // caller believe the planner held them). The calls to the
  // planner and the peers end by `deadline` (a Probe caller's): those peers
  // not measured by then are not.
  std::vector<v1::Link> MeasurePeers(const v1::GetProbeAssignmentsResponse& assignments,
                                     absl::Time deadline = absl::InfiniteFuture(),
                                     const std::function<bool()>& cancelled = NotCancelled) {
    std::vector<v1::Link> links;
    std::vector<std::string> local;
    std::vector<v1::Link> local_links;
    {
      absl::MutexLock l(&mu);
      if (profile) {
        for (const auto& d : profile->node().devices()) local.push_back(d.id());
        local_links.assign(profile->links().begin(), profile->links().end());
      }
    }
    for (const v1::ProbeAssignment& a : assignments.assignments()) {
      if (Stopping() || absl::Now() >= deadline || cancelled()) break;
      auto peer_devices = PeerDevices(a.peer_address(), deadline);
      if (!peer_devices.ok()) {
        Log(absl::StrCat("link probe to ", a.peer_node(), " at ", a.peer_address(), ": ",
                         peer_devices.status().ToString()));
        continue;
      }
      absl::StatusOr<LinkMeasurement> m;
      {
        absl::MutexLock probing(&probe_mu);
        Call call(this, Within(o.link.timeout, deadline));  // cancelled by Shutdown
        m = MeasureLink(a.peer_address(), a.bytes() > 0 ? a.bytes() : o.link.max_bytes, o.security,
                        o.link, call.ctx());
      }
      if (!m.ok()) {
        if (!Stopping()) {
          Log(absl::StrCat("link probe to ", a.peer_node(), ": ", m.status().ToString()));
        }
        continue;
      }
      // One network path serves every device pair of the two nodes.
      v1::LinkKind kind = LinkKindBetween(address, a.peer_address());
      std::vector<v1::Link> peer_links;
      for (const auto& src : local) {
        for (const auto& dst : *peer_devices) peer_links.push_back(MakeLink(src, dst, *m, kind));
      }
      // One measurement for all of them: one refused, all are.
      if (absl::Status c = peer_links.empty() ? absl::OkStatus() : CheckLink(peer_links.front());
          !c.ok()) {
        Log(absl::StrCat("link probe to ", a.peer_node(), ": ", c.message(),
                         "; not reported (the planner would refuse it)"));
        continue;
      }
      if (!ReportLinks(peer_links, absl::StrCat("the links to ", a.peer_node()), deadline).ok()) {
        continue;  // left out, as a peer that failed
      }
      links.insert(links.end(), peer_links.begin(), peer_links.end());
    }
    ReportLinks(local_links, "this node's own links", deadline).IgnoreError();
    return links;
  }

  bool ProbeWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return stopping || probe_wanted || drift_check_wanted;
  }
  // Re-probes and drift checks, off the heartbeat thread.
  void RunProbes() {
    while (true) {
      mu.LockWhen(absl::Condition(this, &Impl::ProbeWork));
      const bool stop = stopping, probe = probe_wanted, check = drift_check_wanted;
      probe_wanted = drift_check_wanted = false;
      mu.Unlock();
      if (stop) break;
      if (!probe && check && PausedForTraining("drift checks")) {
        absl::MutexLock probing(&probe_mu);
        drift_checks_in_a_row = 0;  // a drift seen before it must be seen again after
        continue;
      }
      if (probe || (check && Drifted())) {
        if (absl::Status p = ProbeDevices(absl::ZeroDuration()); !p.ok()) Log(p.ToString());
      }
    }
  }

  // A link report names only the node: while another agent holds it, the
  // planner took this agent's measurements (another machine's) as the
  // holder's, so none are made.
  bool StoppingOrHoldingTheNode() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return stopping || (registered && held_by.empty());
  }

  void RunLinkProbes() {
    bool first = true;
    while (true) {
      mu.LockWhen(absl::Condition(this, &Impl::StoppingOrHoldingTheNode));
      bool stop = stopping;
      mu.Unlock();
      if (stop) break;
      if (first && o.link_probe_delay > absl::ZeroDuration() && !WaitFor(o.link_probe_delay)) {
        break;
      }
      if (first || !PausedForTraining("link re-probes")) {
        if (auto assignments = ProbeAssignments(absl::InfiniteFuture()); assignments.ok()) {
          MeasurePeers(*assignments);
        } else if (!Stopping()) {
          Log(assignments.status().ToString());
        }
      }
      if (!WaitFor(o.link_probe_interval, &links_lost)) break;
      std::lock_guard<std::mutex> l(wait_mu);
      first = links_lost;  // measured as after the first registration
      links_lost = false;
    }
  }

  // ProfileSource.
  absl::StatusOr<v1::ProbeResponse> ProbeNow(absl::Duration max_duration, bool include_links,
                                             absl::Time deadline,
                                             const std::function<bool()>& cancelled) override {
    if (!address_known.HasBeenNotified()) {
      return absl::UnavailableError("the agent is starting (its address is not known yet)");
    }
    // Asked first: a caller who wants the links learns at once, probing
    // nothing, that the planner does not answer (before, the call probed
    // the devices, measured no peer and answered OK, as for a cluster
    // without peers).
    std::optional<v1::GetProbeAssignmentsResponse> assignments;
    if (include_links) {
      {
        absl::MutexLock l(&mu);
        if (!held_by.empty()) {
          // Its reports, naming only the node, were taken as the holder's.
          return absl::FailedPreconditionError(
              absl::StrCat("include_links: node '", o.name, "' is registered by the agent at ",
                           held_by, ", not this one (", address,
                           "), which reports no links for it; nothing was "
                           "probed"));
        }
      }
      auto a = ProbeAssignments(deadline);
      if (!a.ok()) return Annotate(a.status(), "include_links: nothing was probed");
      assignments = *std::move(a);
    }
    HAP_RETURN_IF_ERROR(ProbeDevices(max_duration, deadline, cancelled));
    HAP_ASSIGN_OR_RETURN(v1::ProbeResponse r, LastProfile());
    if (assignments) {
      for (auto& l : MeasurePeers(*assignments, deadline, cancelled)) *r.add_links() = std::move(l);
    }
    return r;
  }

  absl::StatusOr<v1::ProbeResponse> LastProfile() override {
    absl::MutexLock l(&mu);
    if (!profile && !probe_error.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the agent has no profile: its last probe failed (it probes again): ",
                       probe_error.ToString()));
    }
    if (!profile) {
      return absl::FailedPreconditionError("the agent has not finished its first probe yet");
    }
    return *profile;
  }
};

std::string LocalOnlyAddressWarning(const std::string& advertised, const std::string& planner) {
  if (!service::IsLocalOnlyAddress(advertised) || service::IsLocalOnlyAddress(planner)) return "";
  return absl::StrCat("warning: this node registers ", advertised,
                      ", which only this machine reaches, with the planner at ", planner,
                      ": the planner's Probe calls and peers measuring links from other hosts "
                      "cannot reach it. Give --listen 0.0.0.0:PORT or --advertise HOST:PORT");
}

absl::StatusOr<std::unique_ptr<Agent>> Agent::Start(
    AgentOptions options, std::vector<std::unique_ptr<DeviceProber>> probers) {
  HAP_RETURN_IF_ERROR(Validate(options));
  std::string devices_note;
  if (probers.empty()) {
    HAP_ASSIGN_OR_RETURN(probers, MakeDeviceProbers(options.devices, &devices_note));
  }
  std::unique_ptr<Agent> agent(new Agent());
  agent->impl_ = std::make_unique<Impl>();
  Impl& impl = *agent->impl_;
  impl.o = std::move(options);
  impl.probers = std::move(probers);
  if (!devices_note.empty()) Log(devices_note);
  HAP_RETURN_IF_ERROR(impl.ConnectPlanner());
  HAP_ASSIGN_OR_RETURN(impl.server, AgentServer::Start(impl.o.listen, impl.o.security, &impl));
  impl.address = impl.o.advertise.empty() ? hap::service::AdvertisedAddress(impl.server->address())
                                          : impl.o.advertise;
  impl.address_known.Notify();
  if (const std::string w = LocalOnlyAddressWarning(impl.address, impl.o.planner); !w.empty()) {
    Log(w);
  }
  if (absl::Status s = impl.ProbeDevices(absl::ZeroDuration()); !s.ok()) Log(s.ToString());
  impl.heartbeat_thread = std::thread([&impl] { impl.RunHeartbeats(); });
  impl.link_thread = std::thread([&impl] { impl.RunLinkProbes(); });
  impl.probe_thread = std::thread([&impl] { impl.RunProbes(); });
  return agent;
}

Agent::~Agent() { Shutdown(absl::ZeroDuration()); }

std::string Agent::listen_address() const { return impl_->server->address(); }
int Agent::port() const { return impl_->server->port(); }
std::string Agent::address() const { return impl_->address; }

void Agent::Shutdown(absl::Duration deadline) {
  if (!impl_) return;
  // A second caller (a signal's, the destructor's) waits for the first: it
  // returned at once, and could destroy the agent under the first.
  if (impl_->shut_down.exchange(true)) {
    impl_->shutdown_done.WaitForNotification();
    return;
  }
  {
    absl::MutexLock l(&impl_->mu);
    impl_->stopping = true;
    for (grpc::ClientContext* c : impl_->calls) c->TryCancel();
  }
  {
    std::lock_guard<std::mutex> l(impl_->wait_mu);
    impl_->wait_stop = true;
  }
  impl_->wait_cv.notify_all();
  if (impl_->heartbeat_thread.joinable()) impl_->heartbeat_thread.join();
  if (impl_->link_thread.joinable()) impl_->link_thread.join();
  if (impl_->probe_thread.joinable()) impl_->probe_thread.join();
  // No server when Start failed before it was up.
  if (impl_->server) impl_->server->Shutdown(deadline);
  impl_->shutdown_done.Notify();
}

}  // namespace hap::agent
