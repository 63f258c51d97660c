// Checks our exposition output with Prometheus' own linter:
// `promtool check metrics` (Debian package `prometheus`, installed by
// scripts/setup.sh) reads the text on stdin and exits 0 when it parses and
// passes the lint rules (help text, _total on counters, base units, ...).
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "planner/service/metrics/metrics.h"

namespace hap::metrics {
namespace {

// promtool on PATH, or where Debian installs it (Bazel's strict test
// environment has a short PATH); empty when absent.
std::string FindPromtool() {
  std::vector<std::string> dirs;
  if (const char* path = getenv("PATH")) dirs = absl::StrSplit(path, ':');
  dirs.push_back("/usr/bin");
  dirs.push_back("/usr/local/bin");
  for (const std::string& dir : dirs) {
    if (dir.empty()) continue;
    const std::string candidate = absl::StrCat(dir, "/promtool");
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

struct PromtoolResult {
  int exit_code = -1;
  std::string output;
};

// Pipes `text` into `promtool check metrics`; its output goes to a file in
// the test's temporary directory so a failure can show it.
PromtoolResult CheckMetrics(const std::string& promtool,
                            const std::string& text) {
  const char* tmp = getenv("TEST_TMPDIR");
  const std::string out_path = absl::StrCat(tmp != nullptr ? tmp : "/tmp",
                                            "/promtool_out_", getpid(), ".txt");
  const std::string command =
      absl::StrCat(promtool, " check metrics > ", out_path, " 2>&1");
  PromtoolResult result;
  // A promtool that exits before reading everything is a failed check, not
  // a test killed by SIGPIPE.
  signal(SIGPIPE, SIG_IGN);
  FILE* pipe = popen(command.c_str(), "w");
  if (pipe == nullptr) {
    result.output = "popen failed";
    return result;
  }
  fwrite(text.data(), 1, text.size(), pipe);
  const int status = pclose(pipe);
  if (status != -1 && WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  std::ifstream in(out_path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  result.output = buffer.str();
  unlink(out_path.c_str());
  return result;
}

// A registry shaped like the planner's: every kind of metric, labels that
// need escaping, special values.
std::string ServiceLikeExposition() {
  MetricsRegistry registry;
  Family<Counter>* plans =
      registry
          .AddCounterFamily("hap_plans_total",
                            "Plans that reached a final state, by result.",
                            {"result"})
          .value();
  plans->Get({"ok"}).value()->Increment(12);
  plans->Get({"resource_exhausted"}).value()->Increment();
  Histogram* plan_duration =
      registry
          .AddHistogram("hap_plan_duration_seconds",
                        "Wall time from plan creation to a final state.")
          .value();
  for (double s : {0.002, 0.3, 4.0, 75.0, 1000.0}) plan_duration->Observe(s);
  Family<Gauge>* predicted =
      registry
          .AddGaugeFamily("hap_plan_predicted_step_seconds",
                          "Predicted time of one training step of a plan.",
                          {"plan"})
          .value();
  predicted->Get({"plans/gpt-\"small\"\\1\nx"}).value()->Set(0.0123);
  Family<Gauge>* flops =
      registry
          .AddGaugeFamily("hap_device_peak_flops",
                          "Measured peak FLOP/s of a device.", {"device"})
          .value();
  flops->Get({"node-1/cpu:0"}).value()->Set(1.2e11);
  flops->Get({"node-2/cpu:0"})
      .value()
      ->Set(std::numeric_limits<double>::quiet_NaN());
  Histogram* step =
      registry
          .AddHistogram("hap_executor_step_seconds", "Executor step time.",
                        ExponentialBuckets(0.01, 2, 12).value())
          .value();
  step->Observe(0.2);
  Gauge* loss =
      registry.AddGauge("hap_training_loss", "Last reported loss.").value();
  loss->Set(-std::numeric_limits<double>::infinity());
  Family<Counter>* started =
      registry
          .AddCounterFamily("grpc_server_started_total",
                            "Total number of RPCs started on the server.",
                            {"grpc_type", "grpc_service", "grpc_method"})
          .value();
  started->Get({"unary", "hap.v1.Planner", "CreatePlan"}).value()->Increment();
  started->Get({"server_stream", "hap.v1.Planner", "WatchPlan"})
      .value()
      ->Increment();
  Family<Counter>* handled =
      registry
          .AddCounterFamily(
              "grpc_server_handled_total",
              "Total number of RPCs completed on the server, regardless of "
              "success or failure.",
              {"grpc_type", "grpc_service", "grpc_method", "grpc_code"})
          .value();
  handled->Get({"unary", "hap.v1.Planner", "CreatePlan", "OK"})
      .value()
      ->Increment();
  Family<Histogram>* handling =
      registry
          .AddHistogramFamily("grpc_server_handling_seconds",
                              "Histogram of response latency (seconds) of "
                              "gRPC that had been application-level handled "
                              "by the server.",
                              {"grpc_type", "grpc_service", "grpc_method"})
          .value();
  handling->Get({"unary", "hap.v1.Planner", "CreatePlan"})
      .value()
      ->Observe(0.04);
  EXPECT_TRUE(
      registry
          .AddCallbackGaugeFamily(
              "hap_nodes", "Registered nodes by state.", {"state"},
              [] {
                return std::vector<LabeledValue>{{{"live"}, 3}, {{"stale"}, 1}};
              })
          .ok());
  EXPECT_TRUE(registry
                  .AddCallbackGauge("hap_plans_running",
                                    "Plans being searched.", [] { return 2.0; })
                  .ok());
  return registry.Serialize();
}

TEST(PromtoolTest, CheckMetricsPassesOnEveryKindOfMetric) {
  const std::string promtool = FindPromtool();
  ASSERT_FALSE(promtool.empty())
      << "promtool not found on PATH or in /usr/bin: install Debian's "
         "`prometheus` package (bash scripts/setup.sh does)";
  const std::string text = ServiceLikeExposition();
  // Every kind is really there.
  for (const char* expected :
       {"# TYPE hap_plans_total counter", "# TYPE hap_nodes gauge",
        "# TYPE hap_plan_duration_seconds histogram",
        "hap_plan_duration_seconds_bucket{le=\"+Inf\"} 5",
        "hap_device_peak_flops{device=\"node-2/cpu:0\"} NaN",
        "hap_training_loss -Inf", "hap_plans_running 2"}) {
    EXPECT_NE(text.find(expected), std::string::npos) << expected;
  }
  const PromtoolResult result = CheckMetrics(promtool, text);
  EXPECT_EQ(result.exit_code, 0) << "promtool check metrics said:\n"
                                 << result.output << "\non:\n"
                                 << text;
}

// The check above is only worth something if promtool does reject bad
// input this way.
TEST(PromtoolTest, CheckMetricsRejectsLintProblems) {
  const std::string promtool = FindPromtool();
  ASSERT_FALSE(promtool.empty())
      << "promtool not found on PATH or in /usr/bin: install Debian's "
         "`prometheus` package (bash scripts/setup.sh does)";
  const PromtoolResult result =
      CheckMetrics(promtool,
                   "# HELP hap_plans h\n# TYPE hap_plans counter\n"
                   "hap_plans 1\n");
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("_total"), std::string::npos) << result.output;
}

}  // namespace
}  // namespace hap::metrics
