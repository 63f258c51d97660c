#include "planner/service/metrics/metrics.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::metrics {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

TEST(MetricsRegistryTest, SerializesExactTextFormat) {
  MetricsRegistry registry;
  // Registered out of name order: the output is sorted by family name.
  Family<Counter>* plans =
      registry
          .AddCounterFamily("hap_plans_total", "Plans finished, by result.",
                            {"result"})
          .value();
  Gauge* loss = registry.AddGauge("hap_training_loss", "Last loss.").value();
  Family<Gauge>* flops =
      registry
          .AddGaugeFamily("hap_device_peak_flops",
                          "Measured peak FLOP/s per device.", {"device"})
          .value();
  Histogram* duration = registry
                            .AddHistogram("hap_plan_duration_seconds",
                                          "Time to plan.", {0.25, 1, 10})
                            .value();
  Family<Counter>* handled =
      registry
          .AddCounterFamily(
              "grpc_server_handled_total", "RPCs completed on the server.",
              {"grpc_type", "grpc_service", "grpc_method", "grpc_code"})
          .value();
  Family<Histogram>* handling =
      registry
          .AddHistogramFamily(
              "grpc_server_handling_seconds", "RPC handling time.",
              {"grpc_type", "grpc_service", "grpc_method"}, {0.5})
          .value();

  plans->Get({"ok"}).value()->Increment(3);
  plans->Get({"error"}).value()->Increment();
  loss->Set(0.25);
  flops->Get({"cpu:1"}).value()->Set(2e12);
  flops->Get({"cpu:0"}).value()->Set(1.5e12);
  for (double seconds : {0.125, 0.5, 0.5, 20.0}) duration->Observe(seconds);
  handled->Get({"unary", "hap.v1.Planner", "GetPlan", "NotFound"})
      .value()
      ->Increment();
  handled->Get({"unary", "hap.v1.Planner", "CreatePlan", "OK"})
      .value()
      ->Increment(2);
  handling->Get({"unary", "hap.v1.Planner", "CreatePlan"})
      .value()
      ->Observe(0.75);

  EXPECT_EQ(registry.Serialize(),
            R"(# HELP grpc_server_handled_total RPCs completed on the server.
# TYPE grpc_server_handled_total counter
grpc_server_handled_total{grpc_type="unary",grpc_service="hap.v1.Planner",grpc_method="CreatePlan",grpc_code="OK"} 2
grpc_server_handled_total{grpc_type="unary",grpc_service="hap.v1.Planner",grpc_method="GetPlan",grpc_code="NotFound"} 1
# HELP grpc_server_handling_seconds RPC handling time.
# TYPE grpc_server_handling_seconds histogram
grpc_server_handling_seconds_bucket{grpc_type="unary",grpc_service="hap.v1.Planner",grpc_method="CreatePlan",le="0.5"} 0
grpc_server_handling_seconds_bucket{grpc_type="unary",grpc_service="hap.v1.Planner",grpc_method="CreatePlan",le="+Inf"} 1
grpc_server_handling_seconds_sum{grpc_type="unary",grpc_service="hap.v1.Planner",grpc_method="CreatePlan"} 0.75
grpc_server_handling_seconds_count{grpc_type="unary",grpc_service="hap.v1.Planner",grpc_method="CreatePlan"} 1
# HELP hap_device_peak_flops Measured peak FLOP/s per device.
# TYPE hap_device_peak_flops gauge
hap_device_peak_flops{device="cpu:0"} 1.5e+12
hap_device_peak_flops{device="cpu:1"} 2e+12
# HELP hap_plan_duration_seconds Time to plan.
# TYPE hap_plan_duration_seconds histogram
hap_plan_duration_seconds_bucket{le="0.25"} 1
hap_plan_duration_seconds_bucket{le="1"} 3
hap_plan_duration_seconds_bucket{le="10"} 3
hap_plan_duration_seconds_bucket{le="+Inf"} 4
hap_plan_duration_seconds_sum 21.125
hap_plan_duration_seconds_count 4
# HELP hap_plans_total Plans finished, by result.
# TYPE hap_plans_total counter
hap_plans_total{result="error"} 1
hap_plans_total{result="ok"} 3
# HELP hap_training_loss Last loss.
# TYPE hap_training_loss gauge
hap_training_loss 0.25
)");
}

TEST(MetricsRegistryTest, UnlabelledMetricsAppearAtZeroAndEmptyFamiliesDoNot) {
  MetricsRegistry registry;
  ASSERT_THAT(registry.AddCounter("hap_restarts_total", "Restarts."), IsOk());
  ASSERT_THAT(
      registry.AddCounterFamily("hap_plans_total", "Plans.", {"result"}),
      IsOk());
  EXPECT_EQ(registry.Serialize(),
            "# HELP hap_restarts_total Restarts.\n"
            "# TYPE hap_restarts_total counter\n"
            "hap_restarts_total 0\n");
}

TEST(MetricsRegistryTest, EscapesHelpAndLabelValues) {
  MetricsRegistry registry;
  Family<Gauge>* family =
      registry
          .AddGaugeFamily("hap_escape_test",
                          "Back\\slash, \"quotes\" stay,\nnewline.", {"path"})
          .value();
  family->Get({"C:\\dir \"x\"\nnext"}).value()->Set(1);
  EXPECT_EQ(
      registry.Serialize(),
      "# HELP hap_escape_test Back\\\\slash, \"quotes\" stay,\\nnewline.\n"
      "# TYPE hap_escape_test gauge\n"
      "hap_escape_test{path=\"C:\\\\dir \\\"x\\\"\\nnext\"} 1\n");
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(EscapeHelp("a\\b\"c\nd"), "a\\\\b\"c\\nd");
}

TEST(FormatValueTest, ShortestRoundTripAndPrometheusSpecials) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(1), "1");
  EXPECT_EQ(FormatValue(-3), "-3");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(FormatValue(1e21), "1e+21");
  EXPECT_EQ(FormatValue(10), "10");
  EXPECT_EQ(FormatValue(100000), "100000");
  EXPECT_EQ(FormatValue(1e6), "1e+06");
  EXPECT_EQ(FormatValue(123456789), "123456789");
  EXPECT_EQ(FormatValue(0.0001), "0.0001");
  EXPECT_EQ(FormatValue(0.00001), "1e-05");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
  for (double v : {DBL_MAX, DBL_MIN, std::numeric_limits<double>::denorm_min(),
                   1.0 / 3, -2.0 / 7, 6.02214076e23}) {
    double back = 0;
    ASSERT_TRUE(absl::SimpleAtod(FormatValue(v), &back)) << FormatValue(v);
    EXPECT_EQ(back, v) << FormatValue(v);
  }
}

TEST(MetricsRegistryTest, RejectsBadMetricNames) {
  MetricsRegistry registry;
  for (const char* name :
       {"", "1abc_total", "a-b_total", "a b_total", "h\xc3\xa9_total"}) {
    EXPECT_THAT(registry.AddCounter(name, "help"),
                StatusIs(kInvalid, HasSubstr("does not match")))
        << name;
  }
  EXPECT_THAT(registry.AddCounter("hap_plans", "help"),
              StatusIs(kInvalid, HasSubstr("must end in _total")));
  EXPECT_THAT(registry.AddGauge("hap_nodes_total", "help"),
              StatusIs(kInvalid, HasSubstr("must not end in _total")));
  EXPECT_THAT(registry.AddGauge("hap_steps_count", "help"),
              StatusIs(kInvalid, HasSubstr("must not end in _count")));
  EXPECT_THAT(registry.AddGauge("hap_nodes", ""),
              StatusIs(kInvalid, HasSubstr("help text")));
  EXPECT_THAT(registry.AddGauge("hap_nodes", "bad \xff utf-8"),
              StatusIs(kInvalid, HasSubstr("help text")));
  // Colons are allowed (recording-rule style) by the name grammar.
  EXPECT_THAT(registry.AddGauge("hap:nodes:ratio", "help"), IsOk());
  EXPECT_EQ(registry.Serialize(),
            "# HELP hap:nodes:ratio help\n# TYPE hap:nodes:ratio gauge\n"
            "hap:nodes:ratio 0\n");
}

TEST(MetricsRegistryTest, RejectsBadLabelNames) {
  MetricsRegistry registry;
  for (const char* label : {"", "__reserved", "1x", "a-b", "a:b"}) {
    EXPECT_THAT(registry.AddGaugeFamily("hap_g", "help", {label}),
                StatusIs(kInvalid, HasSubstr("label name")))
        << label;
  }
  EXPECT_THAT(registry.AddGaugeFamily("hap_g", "help", {"device", "device"}),
              StatusIs(kInvalid, HasSubstr("label device repeated")));
  EXPECT_THAT(registry.AddHistogramFamily("hap_h_seconds", "help", {"le"}),
              StatusIs(kInvalid, HasSubstr("le is reserved")));
  // "le" is an ordinary label on other kinds; "_x" is a fine label.
  EXPECT_THAT(registry.AddGaugeFamily("hap_g", "help", {"le", "_x"}), IsOk());
}

TEST(MetricsRegistryTest, RejectsDuplicatesAndCollisions) {
  MetricsRegistry registry;
  ASSERT_THAT(registry.AddCounter("hap_plans_total", "help"), IsOk());
  EXPECT_THAT(registry.AddCounterFamily("hap_plans_total", "other", {"x"}),
              StatusIs(kInvalid, HasSubstr("already registered")));
  ASSERT_THAT(registry.AddHistogram("hap_step_seconds", "help"), IsOk());
  EXPECT_THAT(registry.AddGauge("hap_step_seconds", "help"),
              StatusIs(kInvalid, HasSubstr("already registered")));
  // A histogram "hap_step_seconds" owns hap_step_seconds_sum.
  EXPECT_THAT(registry.AddHistogram("hap_step_seconds_sum", "help"),
              StatusIs(kInvalid, HasSubstr("collides")));
  EXPECT_THAT(
      registry.AddCallbackGauge("hap_step_seconds", "help", [] { return 1.0; }),
      StatusIs(kInvalid, HasSubstr("already registered")));
}

TEST(MetricsRegistryTest, ValidatesHistogramBuckets) {
  MetricsRegistry registry;
  EXPECT_THAT(registry.AddHistogram("hap_a_seconds", "help", {1, 1}),
              StatusIs(kInvalid, HasSubstr("increase strictly")));
  EXPECT_THAT(registry.AddHistogram("hap_a_seconds", "help", {2, 1}),
              StatusIs(kInvalid, HasSubstr("increase strictly")));
  EXPECT_THAT(
      registry.AddHistogram("hap_a_seconds", "help", {1, std::nan(""), 3}),
      StatusIs(kInvalid, HasSubstr("not finite")));
  // A trailing +Inf is implicit and dropped; no bounds at all is +Inf only.
  Histogram* h = registry
                     .AddHistogram("hap_b_seconds", "help",
                                   {1, std::numeric_limits<double>::infinity()})
                     .value();
  Histogram* only_inf =
      registry.AddHistogram("hap_c_seconds", "help", {}).value();
  h->Observe(1);             // le is inclusive
  h->Observe(std::nan(""));  // ignored
  only_inf->Observe(-5);
  EXPECT_EQ(registry.Serialize(),
            "# HELP hap_b_seconds help\n# TYPE hap_b_seconds histogram\n"
            "hap_b_seconds_bucket{le=\"1\"} 1\n"
            "hap_b_seconds_bucket{le=\"+Inf\"} 1\n"
            "hap_b_seconds_sum 1\nhap_b_seconds_count 1\n"
            "# HELP hap_c_seconds help\n# TYPE hap_c_seconds histogram\n"
            "hap_c_seconds_bucket{le=\"+Inf\"} 1\n"
            "hap_c_seconds_sum -5\nhap_c_seconds_count 1\n");
}

TEST(BucketsTest, DefaultAndExponential) {
  const std::vector<double> defaults = DefaultDurationBuckets();
  ASSERT_FALSE(defaults.empty());
  EXPECT_EQ(defaults.front(), 0.001);
  EXPECT_EQ(defaults.back(), 300);
  EXPECT_TRUE(std::is_sorted(defaults.begin(), defaults.end()));
  absl::StatusOr<std::vector<double>> exponential =
      ExponentialBuckets(0.5, 2, 4);
  ASSERT_THAT(exponential, IsOk());
  EXPECT_THAT(*exponential, ::testing::ElementsAre(0.5, 1, 2, 4));
  EXPECT_THAT(ExponentialBuckets(0, 2, 4),
              StatusIs(kInvalid, HasSubstr("start > 0")));
  EXPECT_THAT(ExponentialBuckets(1, 1, 4),
              StatusIs(kInvalid, HasSubstr("factor > 1")));
  EXPECT_THAT(ExponentialBuckets(1, 2, 0),
              StatusIs(kInvalid, HasSubstr("count >= 1")));
}

TEST(FamilyTest, LabelCountMismatchAndBadUtf8AreInvalidArgument) {
  MetricsRegistry registry;
  Family<Counter>* family =
      registry.AddCounterFamily("hap_plans_total", "help", {"result"}).value();
  EXPECT_THAT(
      family->Get({}),
      StatusIs(kInvalid, HasSubstr("takes 1 label values (result), got 0")));
  EXPECT_THAT(family->Get({"ok", "extra"}),
              StatusIs(kInvalid, HasSubstr("got 2")));
  EXPECT_THAT(family->Get({"\xc3"}),
              StatusIs(kInvalid, HasSubstr("not valid UTF-8")));
  EXPECT_THAT(family->Get({"\xed\xa0\x80"}),  // a UTF-16 surrogate
              StatusIs(kInvalid, HasSubstr("not valid UTF-8")));
  EXPECT_THAT(family->Get({"\xc0\xaf"}),  // overlong '/'
              StatusIs(kInvalid, HasSubstr("not valid UTF-8")));
  EXPECT_THAT(family->Get({"gr\xc3\xbc\xc3\x9f \xe2\x9c\x93 \xf0\x9f\x9a\x80"}),
              IsOk());
  // The same values give the same child.
  EXPECT_EQ(family->Get({"ok"}).value(), family->Get({"ok"}).value());
}

TEST(FamilyTest, CardinalityBoundRefusesNewLabelSets) {
  MetricsRegistryOptions options;
  options.max_label_sets_per_family = 3;
  MetricsRegistry registry(options);
  Family<Counter>* family =
      registry.AddCounterFamily("hap_requests_total", "help", {"peer"}).value();
  for (const char* peer : {"a", "b", "c"}) {
    ASSERT_THAT(family->Get({peer}), IsOk());
  }
  EXPECT_THAT(family->Get({"d"}),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("already has 3 label sets")));
  // Existing children keep working after the bound is hit.
  ASSERT_THAT(family->Get({"b"}), IsOk());
  family->Get({"b"}).value()->Increment();
  EXPECT_EQ(
      registry.Serialize(),
      "# HELP hap_requests_total help\n# TYPE hap_requests_total counter\n"
      "hap_requests_total{peer=\"a\"} 0\n"
      "hap_requests_total{peer=\"b\"} 1\n"
      "hap_requests_total{peer=\"c\"} 0\n");

  // Default bound: 1000.
  MetricsRegistry defaults;
  Family<Gauge>* gauges =
      defaults.AddGaugeFamily("hap_g", "help", {"i"}).value();
  for (int i = 0; i < 1000; ++i) {
    ASSERT_THAT(gauges->Get({absl::StrCat(i)}), IsOk()) << i;
  }
  EXPECT_THAT(
      gauges->Get({"1000"}),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("1000")));
}

TEST(FamilyTest, LongLabelValuesAreCutSoAScrapeStaysSmall) {
  MetricsRegistryOptions options;
  options.max_label_value_bytes = 16;
  MetricsRegistry registry(options);
  Family<Gauge>* family =
      registry.AddGaugeFamily("hap_g", "help", {"model"}).value();
  // A 1 MiB value is kept as 16 bytes; a value of that size is whole.
  family->Get({std::string(1 << 20, 'm')}).value()->Set(1);
  family->Get({"exactly-16-bytes"}).value()->Set(2);
  // Cut at a character boundary: "é" is two bytes.
  family->Get({"aaaaaaaaaaaa\xc3\xa9\xc3\xa9\xc3\xa9"}).value()->Set(3);
  const std::string text = registry.Serialize();
  EXPECT_LT(text.size(), 200u);
  EXPECT_THAT(text, HasSubstr("hap_g{model=\"mmmmmmmmmmmmm...\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("hap_g{model=\"exactly-16-bytes\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("hap_g{model=\"aaaaaaaaaaaa...\"} 3\n"));
  // The same long value finds the same child.
  family->Get({std::string(1 << 20, 'm')}).value()->Increment();
  EXPECT_THAT(registry.Serialize(),
              HasSubstr("hap_g{model=\"mmmmmmmmmmmmm...\"} 2\n"));
  // Callback rows are cut too.
  ASSERT_THAT(
      registry.AddCallbackGaugeFamily(
          "hap_cb", "help", {"node"},
          [] {
            return std::vector<LabeledValue>{{{std::string(5000, 'n')}, 7}};
          }),
      IsOk());
  EXPECT_THAT(registry.Serialize(),
              HasSubstr("hap_cb{node=\"nnnnnnnnnnnnn...\"} 7\n"));
  // The default bound.
  EXPECT_EQ(MetricsRegistryOptions().max_label_value_bytes, 256u);
  EXPECT_EQ(TruncateLabelValue(std::string(300, 'x'), 256).size(), 256u);
}

TEST(MetricsTest, CounterIgnoresNegativeAndNaN) {
  Counter counter;
  counter.Increment(2.5);
  counter.Increment(-1);
  counter.Increment(std::nan(""));
  EXPECT_EQ(counter.Value(), 2.5);
  Gauge gauge;
  gauge.Increment(3);
  gauge.Decrement(5);
  EXPECT_EQ(gauge.Value(), -2);
  gauge.Set(std::numeric_limits<double>::infinity());
  EXPECT_EQ(FormatValue(gauge.Value()), "+Inf");
}

TEST(MetricsTest, ConcurrentUpdatesSumCorrectly) {
  MetricsRegistry registry;
  Family<Counter>* requests =
      registry.AddCounterFamily("hap_requests_total", "help", {"worker"})
          .value();
  Counter* total = registry.AddCounter("hap_all_total", "help").value();
  Gauge* in_flight = registry.AddGauge("hap_in_flight", "help").value();
  Histogram* latency =
      registry.AddHistogram("hap_latency_seconds", "help", {0.5, 1.5}).value();
  constexpr int kThreads = 8;
  constexpr int kIterations = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Counter* mine = requests->Get({absl::StrCat("w", t % 4)}).value();
      for (int i = 0; i < kIterations; ++i) {
        total->Increment();
        mine->Increment(0.5);
        in_flight->Increment();
        latency->Observe(i % 2);  // 0 and 1 alternate
        in_flight->Decrement();
        // Lookups and scrapes race with the updates.
        if (i % 1000 == 0) {
          EXPECT_THAT(requests->Get({absl::StrCat("w", (t + 1) % 4)}), IsOk());
          EXPECT_FALSE(registry.Serialize().empty());
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  EXPECT_EQ(total->Value(), kThreads * kIterations);
  EXPECT_EQ(in_flight->Value(), 0);
  for (int w = 0; w < 4; ++w) {
    // Two threads per worker label, 0.5 each time: exact in binary.
    EXPECT_EQ(requests->Get({absl::StrCat("w", w)}).value()->Value(),
              2 * kIterations * 0.5);
  }
  const Histogram::Snapshot snap = latency->Collect();
  EXPECT_EQ(snap.count, uint64_t{kThreads * kIterations});
  EXPECT_THAT(
      snap.cumulative,
      ::testing::ElementsAre(kThreads * kIterations / 2, kThreads * kIterations,
                             kThreads * kIterations));
  EXPECT_EQ(snap.sum, kThreads * kIterations / 2);
}

TEST(CallbackGaugeTest, ComputedAtScrapeTime) {
  MetricsRegistry registry;
  std::atomic<int> live{2};
  ASSERT_THAT(registry.AddCallbackGauge("hap_live_nodes", "Live nodes.",
                                        [&] { return double(live.load()); }),
              IsOk());
  EXPECT_THAT(registry.Serialize(), HasSubstr("\nhap_live_nodes 2\n"));
  live = 5;
  EXPECT_THAT(registry.Serialize(), HasSubstr("\nhap_live_nodes 5\n"));
  EXPECT_THAT(registry.AddCallbackGauge("hap_x", "help", nullptr),
              StatusIs(kInvalid, HasSubstr("no callback")));
}

TEST(CallbackGaugeTest, LabelledRowsAreSortedCheckedAndBounded) {
  MetricsRegistryOptions options;
  options.max_label_sets_per_family = 3;
  MetricsRegistry registry(options);
  ASSERT_THAT(
      registry.AddCallbackGaugeFamily(
          "hap_nodes", "Nodes by state.", {"state"},
          [] {
            return std::vector<LabeledValue>{
                {{"stale"}, 1},       {{"live"}, 3},
                {{"too", "many"}, 7},                 // wrong arity: left out
                {{"live"}, 9},                        // repeat: the first wins
                {{"\xff"}, 2},                        // not UTF-8: left out
                {{"draining"}, 0},    {{"gone"}, 4},  // beyond the bound of 3
            };
          }),
      IsOk());
  EXPECT_EQ(registry.Serialize(),
            "# HELP hap_nodes Nodes by state.\n# TYPE hap_nodes gauge\n"
            "hap_nodes{state=\"draining\"} 0\n"
            "hap_nodes{state=\"live\"} 3\n"
            "hap_nodes{state=\"stale\"} 1\n");
}

TEST(CallbackGaugeTest, CallbackMayUseTheRegistry) {
  MetricsRegistry registry;
  Counter* scrapes = registry.AddCounter("hap_scrapes_total", "help").value();
  ASSERT_THAT(registry.AddCallbackGauge("hap_a_gauge_of_scrapes", "help",
                                        [scrapes] {
                                          scrapes->Increment();
                                          return scrapes->Value();
                                        }),
              IsOk());
  // No deadlock: callbacks run without the registry's lock.
  EXPECT_THAT(registry.Serialize(), HasSubstr("hap_a_gauge_of_scrapes 1\n"));
  EXPECT_THAT(registry.Serialize(), Not(HasSubstr("hap_scrapes_total 0\n")));
}

}  // namespace
}  // namespace hap::metrics
