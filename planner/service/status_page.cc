#include "planner/service/status_page.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/proto_time.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;

constexpr char kStyle[] =
    "body{font-family:sans-serif;margin:1.5em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}"
    "th,td{border:1px solid #bbb;padding:.25em .6em;text-align:left;"
    "vertical-align:top}"
    "th{background:#eee}td.n{text-align:right;font-variant-numeric:tabular-nums}"
    ".SUCCEEDED,.READY,.RUNNING{color:#060}.FAILED,.STALE{color:#a00}"
    ".RECOVERING,.PLANNING,.PENDING{color:#a60}"
    ".muted{color:#777}code{font-size:.9em}nav a{margin-right:1em}";

// ---------------------------------------------------------------- format --

// 3 significant digits with an SI prefix: 5e10 -> "50.0 G".
std::string Si(double v, const char* unit) {
  if (!std::isfinite(v)) return absl::StrCat(v, " ", unit);
  static const char* const kPrefixes[] = {"", "k", "M", "G", "T", "P", "E"};
  int i = 0;
  double x = std::fabs(v);
  while (x >= 999.5 && i < 6) {
    x /= 1000;
    ++i;
  }
  const int decimals = x >= 99.95 ? 0 : x >= 9.995 ? 1 : 2;
  return absl::StrFormat("%s%.*f %s%s", v < 0 ? "-" : "", decimals, x, kPrefixes[i], unit);
}

// 2 decimals in the largest binary unit it is 1 or more of, after
// rounding: (1 << 30) - 1 -> "1.00 GiB", not "1024.00 MiB".
std::string Bytes(double v) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int i = 0;
  while (std::fabs(v) >= 1023.995 && i < 5) {
    v /= 1024;
    ++i;
  }
  return absl::StrFormat(i == 0 ? "%.0f %s" : "%.2f %s", v, kUnits[i]);
}

// µs, ms or s, the unit picked after rounding (0.9999996 -> "1.000 s",
// not "1000.00 ms").
std::string Seconds(double s) {
  if (!std::isfinite(s)) return absl::StrCat(s);
  if (s == 0) return "0 s";
  if (std::fabs(s) * 1e6 < 999.95) return absl::StrFormat("%.1f µs", s * 1e6);
  if (std::fabs(s) * 1e3 < 999.995) return absl::StrFormat("%.2f ms", s * 1e3);
  return absl::StrFormat("%.3f s", s);
}

std::string Form(const v1::TensorForm& f) {
  switch (f.kind()) {
    case v1::TensorForm::REPLICATED:
      return "R";
    case v1::TensorForm::SHARDED:
      return absl::StrCat("S(", f.dim(), ")");
    case v1::TensorForm::PARTIAL:
      return "P";
    default:
      return "?";
  }
}

std::string Forms(const google::protobuf::RepeatedPtrField<v1::TensorForm>& forms) {
  std::vector<std::string> parts;
  for (const auto& f : forms) parts.push_back(Form(f));
  return parts.empty() ? "-" : absl::StrJoin(parts, ", ");
}

// "plans/abc" -> "abc".
std::string Id(absl::string_view name) {
  const size_t slash = name.find('/');
  return std::string(slash == absl::string_view::npos ? name : name.substr(slash + 1));
}

std::string PlanLink(const std::string& plan_name) {
  const std::string e = HtmlEscape(plan_name);
  return absl::StrCat("<a href=\"/status/plans/", HtmlEscape(Id(plan_name)), "\">", e, "</a>");
}

std::string DeploymentLink(const std::string& name) {
  return absl::StrCat("<a href=\"/status/deployments/", HtmlEscape(Id(name)), "\">",
                      HtmlEscape(name), "</a>");
}

std::string State(absl::string_view state) {
  return absl::StrCat("<span class=\"", HtmlEscape(state), "\">", HtmlEscape(state), "</span>");
}

// ------------------------------------------------------------------ page --

metrics::HttpResponse Page(int status, absl::string_view title, absl::string_view body,
                           bool refresh = false) {
  metrics::HttpResponse r;
  r.status = status;
  r.body = absl::StrCat(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
      refresh ? "<meta http-equiv=\"refresh\" content=\"15\">" : "",
      "<meta name=\"viewport\" content=\"width=device-width\"><title>", HtmlEscape(title),
      " · HAP planner</title><style>", kStyle, "</style></head><body>",
      "<nav><a href=\"/status\">Status</a><a href=\"/metrics\">Metrics</a></nav><h1>",
      HtmlEscape(title), "</h1>\n", body, "</body></html>\n");
  return r;
}

metrics::HttpResponse NotFound(absl::string_view what) {
  return Page(404, "Not found",
              absl::StrCat("<p id=\"error\">", HtmlEscape(what),
                           "</p><p><a href=\"/status\">Back to the status page</a></p>"));
}

metrics::HttpResponse Failed(absl::string_view what, const absl::Status& s) {
  return Page(500, "Error",
              absl::StrCat("<p id=\"error\">", HtmlEscape(what), ": ",
                           HtmlEscape(s.ToString()), "</p>"));
}

// The median of the newest deployment of each plan that has measured steps.
std::map<std::string, const v1::Deployment*> MeasuredByPlan(
    const std::vector<v1::Deployment>& deployments) {
  std::map<std::string, const v1::Deployment*> out;
  for (const auto& d : deployments) {
    if (d.median_step_seconds() <= 0) continue;
    const v1::Deployment*& best = out[d.plan()];
    if (best == nullptr || d.generation() > best->generation()) best = &d;
  }
  return out;
}

// Links are measured between devices, so a cluster has up to one per
// ordered pair of its devices (512 devices: 261,632): the page showed
// every one, tens of MB of HTML at every refresh (15 s) of every open page.
constexpr int kMaxLinkRows = 500;

std::string NodesSection(const v1::Cluster& cluster) {
  std::string h = absl::StrCat("<h2>Nodes (", cluster.nodes_size(), ")</h2>");
  if (cluster.nodes_size() == 0) return h + "<p class=\"muted\">No nodes registered.</p>";
  absl::StrAppend(&h,
                  "<table id=\"nodes\"><tr><th>Node</th><th>State</th><th>Address</th>"
                  "<th>Device</th><th>Kind / model</th><th>float32 FLOP/s</th>"
                  "<th>Memory</th><th>Last heartbeat</th></tr>");
  for (const auto& n : cluster.nodes()) {
    const int rows = std::max(1, n.devices_size());
    const std::string span = absl::StrCat(" rowspan=\"", rows, "\"");
    const std::string heartbeat =
        n.has_last_heartbeat()
            ? absl::FormatTime("%Y-%m-%d %H:%M:%S UTC",
                               absl::FromUnixSeconds(n.last_heartbeat().seconds()),
                               absl::UTCTimeZone())
            : "-";
    absl::StrAppend(&h, "<tr><td", span, ">", HtmlEscape(n.name()), "</td><td", span, ">",
                    State(v1::Node::State_Name(n.state())), "</td><td", span, ">",
                    HtmlEscape(n.address()), "</td>");
    if (n.devices_size() == 0) absl::StrAppend(&h, "<td colspan=\"4\">-</td>");
    for (int i = 0; i < n.devices_size(); ++i) {
      const v1::Device& d = n.devices(i);
      if (i > 0) absl::StrAppend(&h, "<tr>");
      std::string flops = "-";
      for (const auto& f : d.flops()) {
        if (f.dtype() == v1::FLOAT32) flops = Si(f.flops(), "FLOP/s");
      }
      absl::StrAppend(&h, "<td>", HtmlEscape(d.id()), "</td><td>",
                      HtmlEscape(v1::DeviceKind_Name(d.kind())),
                      d.model().empty() ? "" : " · ", HtmlEscape(d.model()),
                      "</td><td class=\"n\">", flops, "</td><td class=\"n\">",
                      Bytes(static_cast<double>(d.memory_bytes())), "</td>");
      if (i == 0) absl::StrAppend(&h, "<td", span, ">", HtmlEscape(heartbeat), "</td>");
      absl::StrAppend(&h, "</tr>");
    }
    if (n.devices_size() == 0) absl::StrAppend(&h, "<td>", HtmlEscape(heartbeat), "</td></tr>");
  }
  absl::StrAppend(&h, "</table>");

  absl::StrAppend(&h, "<h2>Links</h2>");
  if (cluster.links_size() == 0) {
    const v1::LinkDefaults& def = cluster.defaults();
    absl::StrAppend(&h, "<p class=\"muted\">No measured links; plans assume ",
                    Si(def.intra_node_bandwidth_bytes_per_second(), "B/s"),
                    " inside a node and ",
                    Si(def.inter_node_bandwidth_bytes_per_second(), "B/s"),
                    " between nodes.</p>");
    return h;
  }
  absl::StrAppend(&h,
                  "<table id=\"links\"><tr><th>From</th><th>To</th><th>Kind</th>"
                  "<th>Bandwidth</th><th>Latency</th></tr>");
  const int shown = std::min(cluster.links_size(), kMaxLinkRows);
  for (int i = 0; i < shown; ++i) {
    const v1::Link& l = cluster.links(i);
    absl::StrAppend(&h, "<tr><td>", HtmlEscape(l.src()), "</td><td>", HtmlEscape(l.dst()),
                    "</td><td>", HtmlEscape(v1::LinkKind_Name(l.kind())),
                    "</td><td class=\"n\">", Si(l.bandwidth_bytes_per_second(), "B/s"),
                    "</td><td class=\"n\">", Seconds(l.latency_seconds()), "</td></tr>");
  }
  absl::StrAppend(&h, "</table>");
  if (shown < cluster.links_size()) {
    absl::StrAppend(&h, "<p class=\"muted\" id=\"links-cut\">The first ", shown, " of ",
                    cluster.links_size(),
                    " measured links; the others are not shown (GetCluster returns them).</p>");
  }
  return h;
}

std::string PlansSection(std::vector<v1::Plan> plans,
                         const std::vector<v1::Deployment>& deployments) {
  std::string h = absl::StrCat("<h2>Plans (", plans.size(), ")</h2>");
  if (plans.empty()) return h + "<p class=\"muted\">No plans yet.</p>";
  std::sort(plans.begin(), plans.end(), [](const v1::Plan& a, const v1::Plan& b) {
    if (a.create_time().seconds() != b.create_time().seconds()) {
      return a.create_time().seconds() > b.create_time().seconds();
    }
    return a.name() < b.name();
  });
  const auto measured = MeasuredByPlan(deployments);
  absl::StrAppend(&h,
                  "<table id=\"plans\"><tr><th>Plan</th><th>State</th><th>Devices</th>"
                  "<th>Predicted step</th><th>Measured median step</th>"
                  "<th>Synthesis</th></tr>");
  for (const auto& p : plans) {
    const bool done = p.state() == v1::Plan::SUCCEEDED;
    auto m = measured.find(p.name());
    absl::StrAppend(
        &h, "<tr><td>", PlanLink(p.name()), "</td><td>", State(v1::Plan::State_Name(p.state())),
        p.error().empty() ? "" : absl::StrCat("<br><small>", HtmlEscape(p.error()), "</small>"),
        "</td><td class=\"n\">", p.devices_size(), "</td><td class=\"n\">",
        done ? Seconds(p.prediction().step_seconds()) : "-", "</td><td class=\"n\">",
        m == measured.end()
            ? "-"
            : absl::StrCat(Seconds(m->second->median_step_seconds()), " (",
                           DeploymentLink(m->second->name()), ")"),
        "</td><td class=\"n\">", done ? Seconds(p.synthesis_seconds()) : "-", "</td></tr>");
  }
  absl::StrAppend(&h, "</table>");
  return h;
}

std::string DeploymentsSection(const std::vector<v1::Deployment>& deployments) {
  std::string h = absl::StrCat("<h2>Deployments (", deployments.size(), ")</h2>");
  if (deployments.empty()) return h + "<p class=\"muted\">No deployments.</p>";
  absl::StrAppend(&h,
                  "<table id=\"deployments\"><tr><th>Deployment</th><th>Plan</th>"
                  "<th>State</th><th>Steps</th><th>Last loss</th>"
                  "<th>Median step</th></tr>");
  for (const auto& d : deployments) {
    absl::StrAppend(&h, "<tr><td>", DeploymentLink(d.name()), "</td><td>", PlanLink(d.plan()),
                    "</td><td>", State(v1::Deployment::State_Name(d.state())),
                    "</td><td class=\"n\">", d.steps_completed(), "</td><td class=\"n\">",
                    d.steps_completed() > 0 ? absl::StrFormat("%.4g", d.last_loss()) : "-",
                    "</td><td class=\"n\">",
                    d.median_step_seconds() > 0 ? Seconds(d.median_step_seconds()) : "-",
                    "</td></tr>");
  }
  absl::StrAppend(&h, "</table>");
  return h;
}

std::string JobLink(const std::string& name) {
  return absl::StrCat("<a href=\"/status/jobs/", HtmlEscape(Id(name)), "\">", HtmlEscape(name),
                      "</a>");
}

std::string JobsSection(const std::vector<v1::Job>& jobs) {
  std::string h = absl::StrCat("<h2>Elastic jobs (", jobs.size(), ")</h2>");
  if (jobs.empty()) return h + "<p class=\"muted\">No jobs.</p>";
  absl::StrAppend(&h,
                  "<table id=\"jobs\"><tr><th>Job</th><th>State</th><th>Generation</th>"
                  "<th>Devices</th><th>Steps</th><th>Re-plans</th><th>Deployment</th>"
                  "<th>Message</th></tr>");
  for (const auto& j : jobs) {
    const v1::JobStatus& s = j.status();
    absl::StrAppend(&h, "<tr><td>", JobLink(j.name()), "</td><td>",
                    State(v1::JobStatus::State_Name(s.state())), "</td><td class=\"n\">",
                    s.generation(), "</td><td class=\"n\">", s.devices_size(),
                    "</td><td class=\"n\">", s.steps_done(), " / ", j.spec().training().steps(),
                    "</td><td class=\"n\">", s.replans(), "</td><td>",
                    s.deployment().empty() ? "-" : DeploymentLink(s.deployment()), "</td><td>",
                    HtmlEscape(s.message()), "</td></tr>");
  }
  absl::StrAppend(&h, "</table>");
  return h;
}

metrics::HttpResponse IndexPage(const StatusSources& src) {
  absl::StatusOr<std::vector<v1::Plan>> plans = src.plans();
  if (!plans.ok()) return Failed("listing plans", plans.status());
  const std::vector<v1::Deployment> deployments = src.deployments();
  return Page(200, "HAP planner status",
              absl::StrCat(NodesSection(src.cluster()), PlansSection(*plans, deployments),
                           DeploymentsSection(deployments),
                           src.jobs ? JobsSection(src.jobs()) : ""),
              /*refresh=*/true);
}

// --------------------------------------------------------------- one plan --

std::string SummaryRow(absl::string_view key, absl::string_view value_html) {
  return absl::StrCat("<tr><th>", key, "</th><td>", value_html, "</td></tr>");
}

std::string PlanDevices(const v1::Plan& p) {
  std::map<std::string, const v1::Device*> by_id;
  for (const auto& n : p.cluster().nodes()) {
    for (const auto& d : n.devices()) by_id[d.id()] = &d;
  }
  std::string h =
      "<h2>Devices and ratios</h2><table id=\"devices\"><tr><th>Rank</th><th>Device</th>"
      "<th>float32 FLOP/s</th>";
  for (const auto& seg : p.ratios()) {
    absl::StrAppend(&h, "<th>Ratio", p.ratios_size() > 1 ? absl::StrCat(" (segment ", seg.segment(), ")") : "",
                    "</th>");
  }
  absl::StrAppend(&h, "<th>Predicted memory</th><th>Device memory</th></tr>");
  for (int r = 0; r < p.devices_size(); ++r) {
    auto it = by_id.find(p.devices(r));
    const v1::Device* d = it == by_id.end() ? nullptr : it->second;
    std::string flops = "-";
    if (d != nullptr) {
      for (const auto& f : d->flops()) {
        if (f.dtype() == v1::FLOAT32) flops = Si(f.flops(), "FLOP/s");
      }
    }
    absl::StrAppend(&h, "<tr><td class=\"n\">", r, "</td><td>", HtmlEscape(p.devices(r)),
                    "</td><td class=\"n\">", flops, "</td>");
    for (const auto& seg : p.ratios()) {
      absl::StrAppend(&h, "<td class=\"n\">",
                      r < seg.ratios_size() ? absl::StrFormat("%.4f", seg.ratios(r)) : "-",
                      "</td>");
    }
    const auto& mem = p.prediction().memory_bytes_per_device();
    absl::StrAppend(&h, "<td class=\"n\">",
                    r < mem.size() ? Bytes(static_cast<double>(mem[r])) : "-",
                    "</td><td class=\"n\">",
                    d != nullptr ? Bytes(static_cast<double>(d->memory_bytes())) : "-",
                    "</td></tr>");
  }
  absl::StrAppend(&h, "</table>");
  return h;
}

std::string Communication(const v1::Instruction& c) {
  std::string s = absl::StrCat(HtmlEscape(v1::Collective_Name(c.collective())), " <code>",
                               HtmlEscape(c.op()), "</code> ", Forms(c.input_forms()), " → ",
                               Forms(c.output_forms()));
  if (c.method() != v1::COLLECTIVE_METHOD_UNSPECIFIED) {
    absl::StrAppend(&s, " (", HtmlEscape(v1::CollectiveMethod_Name(c.method())), ")");
  }
  return s;
}

std::string OpsSection(const v1::Plan& p) {
  const auto& ins = p.program().instructions();
  if (ins.empty()) return "<h2>Sharding</h2><p class=\"muted\">No program (yet).</p>";
  std::string h =
      "<h2>Sharding</h2><table id=\"ops\"><tr><th>#</th><th>Op</th><th>Rule</th>"
      "<th>Input forms</th><th>Output forms</th><th>Communication before it</th>"
      "<th>Compute</th><th>Communication</th></tr>";
  std::vector<std::string> pending;
  int index = 0;
  for (const auto& i : ins) {
    if (i.kind() == v1::Instruction::COMMUNICATE) {
      pending.push_back(Communication(i));
      continue;
    }
    if (i.kind() != v1::Instruction::COMPUTE) continue;
    std::string extras;
    if (i.storage() != v1::Instruction::STORAGE_UNSPECIFIED) {
      extras = absl::StrCat(" <small>", HtmlEscape(v1::Instruction::Storage_Name(i.storage())),
                            "</small>");
    }
    if (i.sfb()) absl::StrAppend(&extras, " <small>SFB</small>");
    absl::StrAppend(&h, "<tr><td class=\"n\">", index++, "</td><td><code>", HtmlEscape(i.op()),
                    "</code></td><td>", HtmlEscape(i.rule()), extras, "</td><td>",
                    Forms(i.input_forms()), "</td><td>", Forms(i.output_forms()), "</td><td>",
                    pending.empty() ? "-" : absl::StrJoin(pending, "<br>"),
                    "</td><td class=\"n\">", Seconds(i.predicted_compute_seconds()),
                    "</td><td class=\"n\">", Seconds(i.predicted_comm_seconds()), "</td></tr>");
    pending.clear();
  }
  if (!pending.empty()) {
    absl::StrAppend(&h, "<tr><td></td><td class=\"muted\">(after the last op)</td><td></td>"
                        "<td></td><td></td><td>",
                    absl::StrJoin(pending, "<br>"), "</td><td></td><td></td></tr>");
  }
  absl::StrAppend(&h, "</table>");
  return h;
}

metrics::HttpResponse PlanPage(const StatusSources& src, const std::string& id) {
  const std::string name = absl::StrCat("plans/", id);
  absl::StatusOr<v1::Plan> plan = src.plan(name);
  if (absl::IsNotFound(plan.status()) || absl::IsInvalidArgument(plan.status())) {
    return NotFound(absl::StrCat("There is no plan \"", name, "\"."));
  }
  if (!plan.ok()) return Failed(absl::StrCat("reading ", name), plan.status());
  const v1::Plan& p = *plan;
  const bool done = p.state() == v1::Plan::SUCCEEDED;
  std::string h = "<table id=\"summary\">";
  absl::StrAppend(&h, SummaryRow("State", State(v1::Plan::State_Name(p.state()))));
  if (!p.graph().name().empty()) {
    absl::StrAppend(&h, SummaryRow("Model", HtmlEscape(p.graph().name())));
  }
  absl::StrAppend(&h, SummaryRow("Global batch", absl::StrCat(p.global_batch())));
  if (done) {
    absl::StrAppend(
        &h,
        SummaryRow("Predicted step",
                   absl::StrCat(Seconds(p.prediction().step_seconds()), " (compute ",
                                Seconds(p.prediction().compute_seconds()), ", communication ",
                                Seconds(p.prediction().communication_seconds()), ")")),
        SummaryRow("Synthesis", absl::StrCat(Seconds(p.synthesis_seconds()), ", ",
                                             p.states_expanded(), " states, ",
                                             p.optimal() ? "optimal" : "budget-limited")));
  }
  if (!p.error().empty()) absl::StrAppend(&h, SummaryRow("Error", HtmlEscape(p.error())));
  std::vector<std::string> deployed;
  for (const auto& d : src.deployments()) {
    if (d.plan() == p.name()) deployed.push_back(DeploymentLink(d.name()));
  }
  if (!deployed.empty()) absl::StrAppend(&h, SummaryRow("Deployments", absl::StrJoin(deployed, ", ")));
  absl::StrAppend(&h, "</table>", PlanDevices(p), OpsSection(p));
  return Page(200, name, h);
}

// ------------------------------------------------------------ deployment --

struct Point {
  double x, y;
};

// A line chart of `points` (finite ones only) as inline SVG.
std::string Chart(absl::string_view id, absl::string_view title, const std::vector<Point>& all,
                  const std::function<std::string(double)>& label) {
  std::vector<Point> points;
  for (const Point& p : all) {
    if (std::isfinite(p.x) && std::isfinite(p.y)) points.push_back(p);
  }
  std::string h = absl::StrCat("<h2>", HtmlEscape(title), "</h2>");
  if (points.size() < all.size()) {
    absl::StrAppend(&h, "<p class=\"FAILED\">", all.size() - points.size(),
                    " non-finite values left out.</p>");
  }
  if (points.empty()) return h + "<p class=\"muted\">No data.</p>";
  constexpr double kW = 720, kH = 220, kLeft = 70, kRight = 10, kTop = 10, kBottom = 30;
  double x0 = points[0].x, x1 = x0, y0 = points[0].y, y1 = y0;
  for (const Point& p : points) {
    x0 = std::min(x0, p.x), x1 = std::max(x1, p.x);
    y0 = std::min(y0, p.y), y1 = std::max(y1, p.y);
  }
  if (y0 > 0 && y0 < (y1 - y0)) y0 = 0;  // start at zero unless it flattens the line
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + (y0 == 0 ? 1 : std::fabs(y0) * 0.1);
  auto sx = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * (kW - kLeft - kRight); };
  auto sy = [&](double y) { return kTop + (y1 - y) / (y1 - y0) * (kH - kTop - kBottom); };
  std::string line;
  auto vertex = [&](const Point& p) {
    absl::StrAppendFormat(&line, "%.1f,%.1f ", sx(p.x), sy(p.y));
  };
  // At most 2001 vertices, so the page stays small for long runs: each run
  // of `stride` points is drawn as its lowest and highest (in step order),
  // and the last point is always drawn. (Every stride-th point alone left
  // out the spikes a step-time chart is read for, and the line's end.)
  const size_t stride = std::max<size_t>(1, (points.size() + 999) / 1000);
  size_t drawn = 0;  // the last point drawn
  for (size_t i = 0; i < points.size(); i += stride) {
    const size_t end = std::min(points.size(), i + stride);
    size_t lo = i, hi = i;
    for (size_t k = i; k < end; ++k) {
      if (points[k].y < points[lo].y) lo = k;
      if (points[k].y > points[hi].y) hi = k;
    }
    vertex(points[std::min(lo, hi)]);
    if (lo != hi) vertex(points[std::max(lo, hi)]);
    drawn = std::max(lo, hi);
  }
  if (drawn + 1 < points.size()) vertex(points.back());
  absl::StrAppendFormat(
      &h,
      "<svg id=\"%s\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "role=\"img\" aria-label=\"%s\">"
      "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"#fafafa\" "
      "stroke=\"#bbb\"/>",
      HtmlEscape(id), kW, kH, HtmlEscape(title), kLeft, kTop, kW - kLeft - kRight,
      kH - kTop - kBottom);
  const auto text = [&](double x, double y, const char* anchor, const std::string& s) {
    absl::StrAppendFormat(&h,
                          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"%s\">%s"
                          "</text>",
                          x, y, anchor, HtmlEscape(s));
  };
  text(kLeft - 4, kTop + 10, "end", label(y1));
  text(kLeft - 4, kH - kBottom, "end", label(y0));
  // Steps are whole numbers: "%.0f", as StrCat's six significant digits
  // made a million-step run's axis "step 1e+06" to "step 1e+06".
  text(kLeft, kH - kBottom + 16, "start", absl::StrFormat("step %.0f", x0));
  text(kW - kRight, kH - kBottom + 16, "end", absl::StrFormat("step %.0f", x1));
  absl::StrAppendFormat(&h,
                        "<polyline fill=\"none\" stroke=\"#1f5fa8\" stroke-width=\"1.5\" "
                        "points=\"%s\"/></svg>",
                        line);
  return h;
}

metrics::HttpResponse DeploymentPage(const StatusSources& src, const std::string& id) {
  const std::string name = absl::StrCat("deployments/", id);
  absl::StatusOr<std::vector<v1::StepMetric>> metrics = src.step_metrics(name);
  if (absl::IsNotFound(metrics.status()) || absl::IsInvalidArgument(metrics.status())) {
    return NotFound(absl::StrCat("There is no deployment \"", name, "\"."));
  }
  if (!metrics.ok()) return Failed(absl::StrCat("reading ", name), metrics.status());
  std::string h;
  for (const auto& d : src.deployments()) {
    if (d.name() != name) continue;
    absl::StrAppend(&h, "<table id=\"summary\">",
                    SummaryRow("State", State(v1::Deployment::State_Name(d.state()))),
                    SummaryRow("Plan", PlanLink(d.plan())),
                    SummaryRow("Generation", absl::StrCat(d.generation())),
                    SummaryRow("Ranks", absl::StrCat(d.ranks_size())),
                    SummaryRow("Steps completed", absl::StrCat(d.steps_completed())));
    if (d.median_step_seconds() > 0) {
      absl::StrAppend(&h, SummaryRow("Median step", Seconds(d.median_step_seconds())));
    }
    if (!d.error().empty()) absl::StrAppend(&h, SummaryRow("Error", HtmlEscape(d.error())));
    absl::StrAppend(&h, "</table>");
  }
  // A step takes as long as its slowest rank; the loss is rank 0's (the
  // loss is replicated, so any rank's when rank 0 has not reported).
  struct StepRow {
    double seconds = 0;
    double loss = 0;
    bool rank0 = false;
    bool has_loss = false;
  };
  std::map<int64_t, StepRow> steps;
  for (const auto& m : *metrics) {
    StepRow& s = steps[m.step()];
    s.seconds = std::max(s.seconds, m.step_seconds());
    if (!s.has_loss || (m.rank() == 0 && !s.rank0)) {
      s.loss = m.loss();
      s.has_loss = true;
      s.rank0 = m.rank() == 0;
    }
  }
  std::vector<Point> times, losses;
  for (const auto& [step, s] : steps) {
    times.push_back({static_cast<double>(step), s.seconds});
    losses.push_back({static_cast<double>(step), s.loss});
  }
  absl::StrAppend(&h, Chart("step-time", "Step time (slowest rank)", times, Seconds),
                  Chart("loss", "Loss", losses,
                        [](double v) { return absl::StrFormat("%.4g", v); }));
  return Page(200, name, h);
}

// ---------------------------------------------------------------- one job --

std::string TimeText(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0 && t.nanos() == 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", FromProto(t), absl::UTCTimeZone());
}

// The job's life on one time axis: from its creation to its last update,
// each (re)start's downtime (detected to training again; the first start's
// is detected at the creation) in red over the training time in green.
std::string TimelineSvg(const v1::Job& j) {
  constexpr double kWidth = 720, kHeight = 28;
  const absl::Time start = FromProto(j.create_time());
  const absl::Time end = std::max(FromProto(j.status().update_time()), start + absl::Seconds(1));
  const double span = absl::ToDoubleSeconds(end - start);
  auto x = [&](absl::Time t) {
    return std::clamp(absl::ToDoubleSeconds(t - start) / span, 0.0, 1.0) * kWidth;
  };
  std::string h = absl::StrFormat(
      "<svg id=\"timeline\" width=\"%.0f\" height=\"%.0f\" role=\"img\" "
      "aria-label=\"timeline\"><rect x=\"0\" y=\"4\" width=\"%.0f\" height=\"20\" "
      "fill=\"#cfc\"/>",
      kWidth, kHeight, kWidth);
  auto down = [&](const v1::JobEvent& e, absl::Time until) {
    const double a = x(FromProto(e.detect_time())), b = x(until);
    absl::StrAppend(&h, absl::StrFormat("<rect x=\"%.1f\" y=\"4\" width=\"%.1f\" height=\"20\" "
                                        "fill=\"#e88\"><title>%s</title></rect>",
                                        a, std::max(1.0, b - a),
                                        HtmlEscape(v1::JobEvent::Reason_Name(e.reason()))));
  };
  // A switch cut short by a loss has no resume_time (it never trained),
  // only its downtime up to the loss.
  for (const auto& e : j.status().events()) {
    down(e, e.has_resume_time() ? FromProto(e.resume_time())
                                : FromProto(e.detect_time()) + absl::Seconds(e.downtime_seconds()));
  }
  if (j.status().has_pending()) down(j.status().pending(), end);
  absl::StrAppend(&h, "</svg><p class=\"muted\">", TimeText(j.create_time()), " to ",
                  TimeText(j.status().update_time()),
                  ": green training, red from its creation, a failure or a switch until "
                  "training (again).</p>");
  return h;
}

std::string EventRow(const v1::JobEvent& e, bool ongoing) {
  return absl::StrCat(
      "<tr><td>", TimeText(e.detect_time()), "</td><td>",
      HtmlEscape(v1::JobEvent::Reason_Name(e.reason())), "</td><td class=\"n\">",
      ongoing ? "ongoing" : Seconds(e.downtime_seconds()), "</td><td class=\"n\">",
      e.steps_done_before(), "</td><td class=\"n\">", e.resume_step(),
      "</td><td class=\"n\">", e.steps_lost(), "</td><td class=\"n\">",
      e.predicted_step_before() > 0 ? Seconds(e.predicted_step_before()) : "-", " &rarr; ",
      e.predicted_step_after() > 0 ? Seconds(e.predicted_step_after()) : "-",
      "</td><td class=\"n\">", e.devices_before_size(), " &rarr; ", e.devices_after_size(),
      "</td><td>", e.deployment().empty() ? "-" : DeploymentLink(e.deployment()), "</td><td>",
      HtmlEscape(e.detail()), "</td></tr>");
}

metrics::HttpResponse JobPage(const StatusSources& src, const std::string& id) {
  const std::string name = absl::StrCat("jobs/", id);
  if (!src.jobs) return NotFound(absl::StrCat("There is no job \"", name, "\"."));
  for (const v1::Job& j : src.jobs()) {
    if (j.name() != name) continue;
    const v1::JobStatus& s = j.status();
    std::string h = absl::StrCat(
        "<table id=\"summary\">", SummaryRow("State", State(v1::JobStatus::State_Name(s.state()))),
        SummaryRow("Steps", absl::StrCat(s.steps_done(), " / ", j.spec().training().steps())),
        SummaryRow("Latest checkpoint",
                   s.checkpoint_step() < 0 ? "none" : absl::StrCat("step ", s.checkpoint_step())),
        SummaryRow("Plan", s.plan().empty() ? "-" : PlanLink(s.plan())),
        SummaryRow("Deployment", s.deployment().empty() ? "-" : DeploymentLink(s.deployment())),
        SummaryRow("Generation", absl::StrCat(s.generation())),
        SummaryRow("Devices", HtmlEscape(absl::StrJoin(s.devices(), ", "))),
        SummaryRow("Re-plans", absl::StrCat(s.replans())));
    if (s.predicted_step_seconds() > 0) {
      absl::StrAppend(&h, SummaryRow("Predicted step", Seconds(s.predicted_step_seconds())));
    }
    if (s.measured_step_seconds() > 0) {
      absl::StrAppend(&h, SummaryRow("Measured step", Seconds(s.measured_step_seconds())));
    }
    if (!s.message().empty()) absl::StrAppend(&h, SummaryRow("Message", HtmlEscape(s.message())));
    for (const std::string& d : s.damaged_checkpoints()) {
      absl::StrAppend(&h, SummaryRow("Damaged checkpoint (set aside)", HtmlEscape(d)));
    }
    absl::StrAppend(&h, "</table><h2>Timeline</h2>", TimelineSvg(j),
                    "<table id=\"events\"><tr><th>Detected</th><th>Reason</th><th>Downtime</th>"
                    "<th>Steps before</th><th>Resumed from</th><th>Steps lost</th>"
                    "<th>Predicted step</th><th>Devices</th><th>Deployment</th><th>Detail</th>"
                    "</tr>");
    for (const auto& e : s.events()) absl::StrAppend(&h, EventRow(e, false));
    if (s.has_pending()) absl::StrAppend(&h, EventRow(s.pending(), true));
    absl::StrAppend(&h, "</table>");
    return Page(200, name, h, /*refresh=*/true);
  }
  return NotFound(absl::StrCat("There is no job \"", name, "\"."));
}

// "abc" from "/status/plans/abc" after the prefix; empty when it is not
// a single path segment.
std::string Segment(absl::string_view rest) {
  if (rest.empty() || absl::StrContains(rest, '/')) return "";
  return std::string(rest);
}

}  // namespace

std::string HtmlEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

StatusSources StatusSourcesFor(PlannerCore* core, const PlannerServiceImpl* service) {
  StatusSources s;
  s.cluster = [core] { return core->GetCluster(/*include_stale=*/true); };
  s.plans = [core]() -> absl::StatusOr<std::vector<v1::Plan>> {
    std::vector<v1::Plan> out;
    std::string token;
    do {
      absl::StatusOr<v1::ListPlansResponse> page = core->ListPlans(1000, token);
      if (!page.ok()) return page.status();
      for (auto& p : *page->mutable_plans()) out.push_back(std::move(p));
      token = page->next_page_token();
    } while (!token.empty());
    return out;
  };
  s.plan = [core](const std::string& name) { return core->GetPlan(name, /*full=*/false); };
  s.deployments = [service] { return service->Deployments(); };
  s.step_metrics = [service](const std::string& name) { return service->StepMetrics(name); };
  s.jobs = [service] { return service->Jobs(); };
  return s;
}

metrics::HttpResponse ServeStatusPage(const StatusSources& sources, absl::string_view path) {
  if (path == "/" || path == "/status" || path == "/status/") return IndexPage(sources);
  constexpr absl::string_view kPlans = "/status/plans/";
  constexpr absl::string_view kDeployments = "/status/deployments/";
  if (absl::StartsWith(path, kPlans)) {
    const std::string id = Segment(path.substr(kPlans.size()));
    if (id.empty()) return NotFound("A plan page is /status/plans/{id}.");
    return PlanPage(sources, id);
  }
  constexpr absl::string_view kJobs = "/status/jobs/";
  if (absl::StartsWith(path, kJobs)) {
    const std::string id = Segment(path.substr(kJobs.size()));
    if (id.empty()) return NotFound("A job page is /status/jobs/{id}.");
    return JobPage(sources, id);
  }
  if (absl::StartsWith(path, kDeployments)) {
    const std::string id = Segment(path.substr(kDeployments.size()));
    if (id.empty()) return NotFound("A deployment page is /status/deployments/{id}.");
    return DeploymentPage(sources, id);
  }
  return NotFound(absl::StrCat("There is no page at ", path, "."));
}

}  // namespace hap::service
