// How hapctl shows the planner's records: tables, kubectl-style describe
// views, and whole records as JSON or YAML.
#include "tools/hapctl_output.h"

#include <cmath>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/time_util.h"

namespace hap::tools {
namespace {

namespace v1 = ::hap::v1;

// JSON -> YAML through protobuf's Struct (no YAML library in Debian's C++).
void Yaml(const google::protobuf::Value& v, int indent, std::ostringstream& o, bool in_list);

std::string Scalar(const google::protobuf::Value& v) {
  switch (v.kind_case()) {
    case google::protobuf::Value::kNullValue:
      return "null";
    case google::protobuf::Value::kBoolValue:
      return v.bool_value() ? "true" : "false";
    case google::protobuf::Value::kNumberValue:
      return absl::StrFormat("%.17g", v.number_value());
    case google::protobuf::Value::kStringValue: {
      // Characters YAML does not print (control characters, DEL) escaped:
      // a label or message holding one, written as it was, was no YAML.
      std::string out = "\"";
      for (char c : v.string_value()) {
        const auto u = static_cast<unsigned char>(c);
        if (c == '"' || c == '\\') {
          out += '\\';
          out += c;
        } else if (c == '\n') {
          out += "\\n";
        } else if (c == '\t') {
          out += "\\t";
        } else if (c == '\r') {
          out += "\\r";
        } else if (u < 0x20 || u == 0x7f) {
          out += absl::StrFormat("\\x%02x", u);
        } else {
          out += c;
        }
      }
      return out + "\"";
    }
    default:
      return "";
  }
}

// A mapping key: plain when YAML reads it back as the same string, else
// quoted ('zone: a' or '#x' ended the key or began a comment, 'true' and
// '1' were read as a bool and a number). Map fields (labels) hold any key.
std::string YamlKey(const std::string& k) {
  static const auto* const kWords =
      new std::set<std::string>{"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"};
  const bool plain =
      !k.empty() && absl::ascii_isalpha(k[0]) && !kWords->count(absl::AsciiStrToLower(k)) &&
      absl::c_all_of(k, [](char ch) {
        return absl::ascii_isalnum(ch) || ch == '_' || ch == '-' || ch == '.' || ch == '/';
      });
  if (plain) return k;
  google::protobuf::Value quoted;
  quoted.set_string_value(k);
  return Scalar(quoted);
}

void Yaml(const google::protobuf::Value& v, int indent, std::ostringstream& o, bool in_list) {
  std::string pad(indent, ' ');
  if (v.has_struct_value()) {
    bool first = true;
    if (v.struct_value().fields().empty()) {
      o << "{}\n";
      return;
    }
    std::map<std::string, google::protobuf::Value> sorted(v.struct_value().fields().begin(),
                                                          v.struct_value().fields().end());
    for (const auto& [k, x] : sorted) {
      o << (first && in_list ? "" : pad) << YamlKey(k) << ":";
      first = false;
      if (x.has_struct_value() || x.has_list_value()) {
        bool empty = x.has_struct_value() ? x.struct_value().fields().empty()
                                          : x.list_value().values().empty();
        if (empty) {
          o << (x.has_struct_value() ? " {}\n" : " []\n");
        } else {
          o << "\n";
          Yaml(x, indent + 2, o, false);
        }
      } else {
        o << " " << Scalar(x) << "\n";
      }
    }
  } else if (v.has_list_value()) {
    for (const auto& x : v.list_value().values()) {
      o << pad << "- ";
      if (x.has_struct_value()) {
        Yaml(x, indent + 2, o, true);
      } else if (x.has_list_value()) {
        o << "\n";
        Yaml(x, indent + 2, o, false);
      } else {
        o << Scalar(x) << "\n";
      }
    }
  } else {
    o << pad << Scalar(v) << "\n";
  }
}

// A rate as "12.3 GFLOP/s" or "1.25 GB/s" (`unit` after the prefix).
std::string Rate(double x, const char* unit) {
  const char* prefixes[] = {"", "k", "M", "G", "T", "P"};
  int i = 0;
  while (i < 5 && std::abs(x) >= 1000) {
    x /= 1000;
    ++i;
  }
  return absl::StrFormat("%.3g %s%s", x, prefixes[i], unit);
}

}  // namespace

int Fail(const absl::Status& s) {
  std::cerr << "error: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  return 1;
}

// Prints `m` as JSON or YAML; 0, or 1 with the error when it cannot be
// converted (a Timestamp past year 9999, say: the conversion's status was
// dropped, and hapctl printed nothing and exited 0).
int PrintMessage(const google::protobuf::Message& m, const std::string& format) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  if (auto s = google::protobuf::util::MessageToJsonString(m, &json, options); !s.ok()) {
    return Fail(
        absl::InternalError(absl::StrCat("cannot print the planner's ", m.GetDescriptor()->name(),
                                         " as ", format, ": ", s.message().as_string())));
  }
  if (format == "yaml") {
    google::protobuf::Value v;
    if (auto s = google::protobuf::util::JsonStringToMessage(json, &v); !s.ok()) {
      return Fail(
          absl::InternalError(absl::StrCat("cannot print the planner's ", m.GetDescriptor()->name(),
                                           " as yaml: ", s.message().as_string())));
    }
    std::ostringstream o;
    Yaml(v, 0, o, false);
    std::cout << o.str();
  } else {
    std::cout << json;
  }
  return 0;
}

std::string Ts(const google::protobuf::Timestamp& t) {
  return t.seconds() == 0 ? "-" : google::protobuf::util::TimeUtil::ToString(t);
}

void PrintPlanRow(const v1::Plan& p) {
  std::cout << absl::StrFormat(
      "%-28s %-10s %-14s %8d %12.4f %10.3f %s\n", p.name(), v1::Plan::State_Name(p.state()),
      p.graph_hash().substr(0, 12), p.devices_size(), p.prediction().step_seconds(),
      p.synthesis_seconds(), p.state() == v1::Plan::FAILED ? p.error() : Ts(p.create_time()));
}

std::string JobState(const v1::Job& j) { return v1::JobStatus::State_Name(j.status().state()); }

void PrintJobHeader() {
  std::cout << absl::StrFormat("%-24s %-10s %4s %8s %9s %8s %12s %s\n", "NAME", "STATE", "GEN",
                               "DEVICES", "STEPS", "REPLANS", "PRED STEP S", "MESSAGE");
}

void PrintJobRow(const v1::Job& j) {
  const v1::JobStatus& s = j.status();
  std::cout << absl::StrFormat("%-24s %-10s %4d %8d %4d/%-4d %8d %12.4f %s\n", j.name(),
                               JobState(j), s.generation(), s.devices_size(), s.steps_done(),
                               j.spec().training().steps(), s.replans(), s.predicted_step_seconds(),
                               s.message());
}

// The job and its timeline: one line per (re)start.
void DescribeJob(const v1::Job& j) {
  PrintJobHeader();
  PrintJobRow(j);
  const v1::JobStatus& s = j.status();
  std::cout << "plan: " << (s.plan().empty() ? "-" : s.plan())
            << "  deployment: " << (s.deployment().empty() ? "-" : s.deployment())
            << "  checkpoint: "
            << (s.checkpoint_step() < 0 ? std::string("none")
                                        : absl::StrCat("step ", s.checkpoint_step()))
            << "\ndevices: " << absl::StrJoin(s.devices(), ",") << "\n";
  if (s.measured_step_seconds() > 0) {
    std::cout << absl::StrFormat("step time: predicted %.4f s, measured %.4f s (median)\n",
                                 s.predicted_step_seconds(), s.measured_step_seconds());
  }
  for (const auto& d : s.damaged_checkpoints()) {
    std::cout << "damaged checkpoint (set aside): " << d << "\n";
  }
  std::cout << absl::StrFormat("\n%-24s %-18s %10s %8s %10s %21s  %s\n", "TIME", "REASON",
                               "DOWNTIME S", "LOST", "FROM STEP", "PRED STEP S BEFORE->AFTER",
                               "DEVICES / DETAIL");
  auto row = [](const v1::JobEvent& e, bool pending) {
    std::string detail = e.detail();
    if (e.measured_step_seconds() > 0) {
      absl::StrAppend(&detail,
                      absl::StrFormat(" [%s prediction %.4f s, measured %.4f s]",
                                      e.calibrated() ? "calibrated" : "uncalibrated",
                                      e.predicted_step_after(), e.measured_step_seconds()));
    }
    std::cout << absl::StrFormat(
        "%-24s %-18s %10s %8d %10d %10.4f -> %-7.4f  %d -> %d: %s\n", Ts(e.detect_time()),
        v1::JobEvent::Reason_Name(e.reason()),
        pending ? std::string("(ongoing)") : absl::StrFormat("%.2f", e.downtime_seconds()),
        e.steps_lost(), e.resume_step(), e.predicted_step_before(), e.predicted_step_after(),
        e.devices_before_size(), e.devices_after_size(), detail);
  };
  for (const auto& e : s.events()) row(e, false);
  if (s.has_pending()) row(s.pending(), true);
}

void PrintDeploymentHeader() {
  std::cout << absl::StrFormat("%-32s %-24s %-10s %6s %8s %10s %10s\n", "NAME", "PLAN", "STATE",
                               "RANKS", "STEPS", "LOSS", "STEP S");
}

void PrintDeploymentRow(const v1::Deployment& d) {
  std::cout << absl::StrFormat("%-32s %-24s %-10s %6d %8d %10.4f %10.4f\n", d.name(), d.plan(),
                               v1::Deployment::State_Name(d.state()), d.ranks_size(),
                               d.steps_completed(), d.last_loss(), d.median_step_seconds());
}

// The deployment as kubectl describe would show it: its row, when, what it
// trains, its step time against the plan's prediction (`predicted`, 0 when
// the plan is gone), why it failed, and one line per rank.
void DescribeDeployment(const v1::Deployment& d, double predicted) {
  PrintDeploymentHeader();
  PrintDeploymentRow(d);
  std::cout << "generation: " << d.generation() << "  created: " << Ts(d.create_time())
            << "  ended: " << Ts(d.end_time()) << "\n";
  const v1::TrainingConfig& t = d.training();
  std::string data = t.data_spec().empty()
                         ? v1::TrainingConfig::DataSource_Name(
                               t.data() == v1::TrainingConfig::DATA_SOURCE_UNSPECIFIED
                                   ? v1::TrainingConfig::SYNTHETIC
                                   : t.data())
                         : t.data_spec();
  if (t.shuffle()) absl::StrAppend(&data, " (shuffled, seed ", t.shuffle_seed(), ")");
  std::cout << "training: to step " << t.steps() << ", data " << data;
  if (!t.resume().empty()) std::cout << ", resumed from " << t.resume();
  if (!t.init_weights().empty()) std::cout << ", weights from " << t.init_weights();
  std::cout << "\ncheckpoints: ";
  if (t.checkpoint_dir().empty()) {
    std::cout << "none";
  } else {
    std::cout << (t.checkpoint_every() > 0
                      ? absl::StrCat("every ", t.checkpoint_every(), " steps and the last")
                      : std::string("the last only"))
              << " into " << t.checkpoint_dir() << ", keeping "
              << (t.checkpoint_keep() > 0 ? t.checkpoint_keep() : 3);
  }
  std::cout << "\n";
  std::cout << "step time: predicted "
            << (predicted > 0 ? absl::StrFormat("%.4g s", predicted)
                              : std::string("- (plan gone)"));
  if (d.median_step_seconds() > 0) {
    std::cout << absl::StrFormat(", median %.4g s", d.median_step_seconds());
  }
  if (d.recent_step_seconds() > 0) {
    std::cout << absl::StrFormat(", latest 20 steps %.4g s", d.recent_step_seconds());
    if (predicted > 0) {
      std::cout << absl::StrFormat(" (%.2fx the prediction)", d.recent_step_seconds() / predicted);
    }
  }
  std::cout << "\n";
  if (!d.error().empty()) std::cout << "error: " << d.error() << "\n";
  if (d.failed_ranks_size() > 0) {
    std::cout << "failed ranks: " << absl::StrJoin(d.failed_ranks(), ",") << "\n";
  }
  if (!d.damaged_checkpoint().empty()) {
    std::cout << "damaged checkpoint: " << d.damaged_checkpoint()
              << " (the checkpoint it resumed from could not be read)\n";
  }
  std::map<int, const v1::StepProfile*> profiles;
  for (const auto& p : d.rank_profiles()) profiles[p.rank()] = &p;
  std::cout << absl::StrFormat("\n%-5s %-24s %-24s %-8s %16s\n", "RANK", "DEVICE", "EXECUTOR",
                               "BACKEND", "PROFILED STEP S");
  for (const auto& r : d.ranks()) {
    auto it = profiles.find(r.rank());
    std::cout << absl::StrFormat("%-5d %-24s %-24s %-8s %16s\n", r.rank(), r.device(),
                                 r.executor_address(), r.backend().empty() ? "-" : r.backend(),
                                 it != profiles.end() && it->second->steps() > 0
                                     ? absl::StrFormat("%.4f", it->second->step_seconds_median())
                                     : std::string("-"));
  }
}

// The node as kubectl describe would show it: state, address, labels, each
// device (its measured rates, memory and the planner's calibration), its
// links grouped by peer node and kind (bandwidth and latency ranges), and
// the deployments not finished that have a rank on it.
void DescribeNode(const v1::Node& n, const v1::Cluster& cluster,
                  const std::vector<v1::Deployment>& deployments) {
  std::cout << "name: " << n.name() << "\nstate: " << v1::Node::State_Name(n.state())
            << "  last heartbeat: " << Ts(n.last_heartbeat()) << "\naddress: " << n.address()
            << "  agent: " << (n.agent_version().empty() ? "-" : n.agent_version()) << "\n";
  std::cout << "labels:" << (n.labels().empty() ? " none" : "") << "\n";
  for (const auto& [k, v] :
       std::map<std::string, std::string>(n.labels().begin(), n.labels().end())) {
    std::cout << "  " << k << "=" << v << "\n";
  }
  std::set<std::string> mine;
  std::cout << absl::StrFormat("\n%-24s %-5s %-30s %10s  %s\n", "DEVICE", "KIND", "MODEL",
                               "MEMORY GiB", "FLOP/S");
  for (const auto& d : n.devices()) {
    mine.insert(d.id());
    std::vector<std::string> rates;
    for (const auto& f : d.flops()) {
      rates.push_back(absl::StrCat(absl::AsciiStrToLower(v1::DType_Name(f.dtype())), " ",
                                   Rate(f.flops(), "FLOP/s")));
    }
    if (d.tf32_flops() > 0) rates.push_back(absl::StrCat("tf32 ", Rate(d.tf32_flops(), "FLOP/s")));
    std::cout << absl::StrFormat("%-24s %-5s %-30s %10.2f  %s\n", d.id(),
                                 v1::DeviceKind_Name(d.kind()), d.model(),
                                 d.memory_bytes() / double(1 << 30), absl::StrJoin(rates, ", "));
    if (d.has_calibration()) {
      const v1::DeviceCalibration& c = d.calibration();
      std::cout << absl::StrFormat(
          "  calibrated from %s (%s) at %s: median step %.4g s, optimizer %.3g s/element, "
          "step overhead %.3g s, %d op time scales\n",
          c.deployment(), c.plan(), Ts(c.fit_time()), c.measured_step_seconds(),
          c.optimizer_seconds_per_element(), c.step_overhead_seconds(), c.op_time_scale_size());
    } else {
      std::cout << "  not calibrated (no deployment profiled it)\n";
    }
  }
  // Links from and to its devices, by (direction, peer node, kind).
  std::map<std::string, std::string> node_of;
  for (const auto& other : cluster.nodes()) {
    for (const auto& d : other.devices()) node_of[d.id()] = other.name();
  }
  struct Group {
    int count = 0;
    double bw_min = 0, bw_max = 0, lat_min = 0, lat_max = 0;
  };
  std::map<std::tuple<std::string, std::string, std::string>, Group> groups;
  for (const auto& l : cluster.links()) {
    const bool out = mine.count(l.src()) > 0, in = mine.count(l.dst()) > 0;
    if (!out && !in) continue;
    const std::string& peer = out ? l.dst() : l.src();
    auto it = node_of.find(peer);
    const std::string where = it == node_of.end() ? "(gone)" : it->second;
    Group& g = groups[{out && in ? "within"
                       : out     ? "to"
                                 : "from",
                       where, v1::LinkKind_Name(l.kind())}];
    const double bw = l.bandwidth_bytes_per_second(), lat = l.latency_seconds();
    if (g.count++ == 0) {
      g.bw_min = g.bw_max = bw;
      g.lat_min = g.lat_max = lat;
    }
    g.bw_min = std::min(g.bw_min, bw);
    g.bw_max = std::max(g.bw_max, bw);
    g.lat_min = std::min(g.lat_min, lat);
    g.lat_max = std::max(g.lat_max, lat);
  }
  std::cout << "\nlinks:" << (groups.empty() ? " none measured (the planner's defaults apply)" : "")
            << "\n";
  for (const auto& [key, g] : groups) {
    const auto& [dir, peer, kind] = key;
    auto range = [](double lo, double hi, const std::string& a, const std::string& b) {
      return lo == hi ? a : absl::StrCat(a, " - ", b);
    };
    std::cout << absl::StrFormat(
        "  %-6s %-20s %-13s %4d link(s)  %s, latency %s\n", dir, peer, kind, g.count,
        range(g.bw_min, g.bw_max, Rate(g.bw_min, "B/s"), Rate(g.bw_max, "B/s")),
        range(g.lat_min, g.lat_max, absl::StrFormat("%.3g s", g.lat_min),
              absl::StrFormat("%.3g s", g.lat_max)));
  }
  std::cout << "\ndeployments on it:";
  bool any = false;
  for (const auto& d : deployments) {
    if (d.state() != v1::Deployment::PENDING && d.state() != v1::Deployment::RUNNING) continue;
    for (const auto& r : d.ranks()) {
      if (!mine.count(r.device())) continue;
      std::cout << absl::StrFormat("\n  %s (%s) rank %d on %s", d.name(),
                                   v1::Deployment::State_Name(d.state()), r.rank(), r.device());
      any = true;
    }
  }
  std::cout << (any ? "\n" : " none\n");
}

void PrintPlanHeader() {
  std::cout << absl::StrFormat("%-28s %-10s %-14s %8s %12s %10s %s\n", "NAME", "STATE", "GRAPH",
                               "DEVICES", "PRED STEP S", "SYNTH S", "CREATED/ERROR");
}

void DescribePlan(const v1::Plan& p) {
  PrintPlanHeader();
  PrintPlanRow(p);
  std::cout << absl::StrFormat(
      "\nprediction: step %.4f s = compute %.4f s + communication %.4f s\n",
      p.prediction().step_seconds(), p.prediction().compute_seconds(),
      p.prediction().communication_seconds());
  std::cout << absl::StrFormat(
      "search: %d states, %s, %d joint iteration(s)\n", p.states_expanded(),
      p.optimal() ? "proven optimal" : "not proven optimal", p.joint_iterations());
  for (const std::string& note : p.notes()) std::cout << "note: " << note << "\n";
  std::cout << absl::StrFormat("%-28s %10s %14s\n", "DEVICE", "RATIO", "MEMORY GiB");
  // A ratio or memory the plan does not hold is "-": a pipelined plan has
  // no plan-wide ratios, and a plan with fewer ratios than devices was read
  // past its end.
  for (int i = 0; i < p.devices_size(); ++i) {
    const std::string ratio = p.ratios_size() > 0 && i < p.ratios(0).ratios_size()
                                  ? absl::StrFormat("%.4f", p.ratios(0).ratios(i))
                                  : std::string("-");
    const std::string mem =
        i < p.prediction().memory_bytes_per_device_size()
            ? absl::StrFormat("%.2f", p.prediction().memory_bytes_per_device(i) / double(1 << 30))
            : std::string("-");
    std::cout << absl::StrFormat("%-28s %10s %14s\n", p.devices(i), ratio, mem);
  }
  int comms = 0;
  for (const auto& ins : p.program().instructions())
    comms += ins.kind() == v1::Instruction::COMMUNICATE;
  std::cout << absl::StrFormat("program: %d instructions, %d communications\n",
                               p.program().instructions_size(), comms);
  const v1::PipelinePlan& pp = p.pipeline();
  if (pp.stages_size() > 0) {
    std::cout << absl::StrFormat(
        "pipeline: %d stages, %d microbatches of %d (%s), step %.4f s, bubble %.4f s, best SPMD "
        "plan %.4f s\n",
        pp.stages_size(), pp.microbatches(), pp.microbatch_size(), pp.schedule(), pp.step_seconds(),
        pp.bubble_seconds(), pp.spmd_step_seconds());
    for (const v1::PipelineStage& st : pp.stages()) {
      std::cout << absl::StrFormat(
          "  stage %d: ops %s .. %s on %s; fwd %.4f s, bwd %.4f s, send %.4f s per microbatch, "
          "sync %.4f s\n",
          st.index(), st.first_op(), st.last_op(), absl::StrJoin(st.devices(), ","),
          st.forward_seconds(), st.backward_seconds(), st.send_seconds(), st.sync_seconds());
    }
  }
  if (!p.error().empty()) std::cout << "error: " << p.error() << "\n";
}

}  // namespace hap::tools
