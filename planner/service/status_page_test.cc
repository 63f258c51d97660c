// The status page over hand-built state: what each page shows, escaping,
// and 404/500 pages for bad ids and failing sources.
#include "planner/service/status_page.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

class StatusPageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::Node* n = cluster_.add_nodes();
    n->set_name("node<a>");
    n->set_address("10.0.0.1:7000");
    n->set_state(v1::Node::READY);
    v1::Device* d = n->add_devices();
    d->set_id("node<a>/cpu0");
    d->set_kind(v1::CPU);
    d->set_memory_bytes(int64_t{8} << 30);
    auto* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(5e10);
    v1::Link* l = cluster_.add_links();
    l->set_src("node<a>/cpu0");
    l->set_dst("b/cpu0");
    l->set_bandwidth_bytes_per_second(1.25e9);

    plan_.set_name("plans/p1");
    plan_.set_state(v1::Plan::SUCCEEDED);
    plan_.add_devices("node<a>/cpu0");
    plan_.add_devices("b/cpu0");
    *plan_.mutable_cluster() = cluster_;
    auto* r = plan_.add_ratios();
    r->add_ratios(0.625);
    r->add_ratios(0.375);
    plan_.mutable_prediction()->set_step_seconds(0.0125);
    plan_.mutable_prediction()->add_memory_bytes_per_device(1 << 20);
    auto* comm = plan_.mutable_program()->add_instructions();
    comm->set_kind(v1::Instruction::COMMUNICATE);
    comm->set_op("x");
    comm->set_collective(v1::ALL_GATHER);
    comm->add_input_forms()->set_kind(v1::TensorForm::SHARDED);
    comm->add_output_forms()->set_kind(v1::TensorForm::REPLICATED);
    auto* op = plan_.mutable_program()->add_instructions();
    op->set_kind(v1::Instruction::COMPUTE);
    op->set_op("dense0.matmul");
    op->set_rule("column");
    op->add_input_forms()->set_kind(v1::TensorForm::REPLICATED);
    auto* out = op->add_output_forms();
    out->set_kind(v1::TensorForm::SHARDED);
    out->set_dim(1);

    deployment_.set_name("deployments/d1");
    deployment_.set_plan("plans/p1");
    deployment_.set_state(v1::Deployment::RUNNING);
    deployment_.set_median_step_seconds(0.02);
    for (int step = 0; step < 5; ++step) {
      for (int rank = 0; rank < 2; ++rank) {
        v1::StepMetric m;
        m.set_deployment("deployments/d1");
        m.set_rank(rank);
        m.set_step(step);
        m.set_loss(2.0 - 0.1 * step);
        m.set_step_seconds(0.02 + 0.001 * rank);
        metrics_.push_back(m);
      }
    }

    sources_.cluster = [this] { return cluster_; };
    sources_.plans = [this]() -> absl::StatusOr<std::vector<v1::Plan>> {
      if (!plans_ok_) return absl::UnavailableError("store <down>");
      return std::vector<v1::Plan>{plan_};
    };
    sources_.plan = [this](const std::string& name) -> absl::StatusOr<v1::Plan> {
      if (name == plan_.name()) return plan_;
      return absl::NotFoundError(name + " does not exist");
    };
    sources_.deployments = [this] { return std::vector<v1::Deployment>{deployment_}; };
    sources_.step_metrics =
        [this](const std::string& name) -> absl::StatusOr<std::vector<v1::StepMetric>> {
      if (name == deployment_.name()) return metrics_;
      return absl::NotFoundError(name);
    };
  }

  v1::Cluster cluster_;
  v1::Plan plan_;
  v1::Deployment deployment_;
  std::vector<v1::StepMetric> metrics_;
  bool plans_ok_ = true;
  StatusSources sources_;
};

TEST_F(StatusPageTest, IndexShowsNodesLinksPlansAndDeployments) {
  for (const char* path : {"/", "/status", "/status/"}) {
    metrics::HttpResponse r = ServeStatusPage(sources_, path);
    EXPECT_EQ(r.status, 200) << path;
    EXPECT_EQ(r.content_type, "text/html; charset=utf-8");
    EXPECT_THAT(r.body, AllOf(HasSubstr("node&lt;a&gt;"), Not(HasSubstr("node<a>")),
                              HasSubstr("10.0.0.1:7000"), HasSubstr("50.0 GFLOP/s"),
                              HasSubstr("8.00 GiB"), HasSubstr("1.25 GB/s"),
                              HasSubstr("<a href=\"/status/plans/p1\">plans/p1</a>"),
                              HasSubstr("SUCCEEDED"), HasSubstr("12.50 ms"),
                              HasSubstr("20.00 ms"), HasSubstr("deployments/d1")));
    EXPECT_THAT(r.body, Not(HasSubstr("<script")));
  }
}

// Links are measured between devices: a cluster of 512 devices has up to
// 261,632, and the page listed every one at each 15 s refresh. It shows the
// first 500 and says how many there are.
TEST_F(StatusPageTest, TheLinksTableIsBounded) {
  for (int i = 0; i < 3000; ++i) {
    v1::Link* l = cluster_.add_links();
    l->set_src(absl::StrCat("n", i / 64, "/gpu", i % 64));
    l->set_dst("b/cpu0");
    l->set_bandwidth_bytes_per_second(1e9);
  }
  const metrics::HttpResponse r = ServeStatusPage(sources_, "/status");
  EXPECT_EQ(r.status, 200);
  const size_t start = r.body.find("<table id=\"links\">");
  ASSERT_NE(start, std::string::npos);
  const std::string links = r.body.substr(start, r.body.find("</table>", start) - start);
  size_t rows = 0;
  for (size_t at = links.find("<tr>"); at != std::string::npos; at = links.find("<tr>", at + 1)) {
    ++rows;
  }
  EXPECT_EQ(rows, 1u + 500u);  // the header and 500 links
  EXPECT_NE(r.body.find("The first 500 of 3001 measured links"), std::string::npos);
}

TEST_F(StatusPageTest, PlanPageShowsRatiosAndShardingTable) {
  metrics::HttpResponse r = ServeStatusPage(sources_, "/status/plans/p1");
  EXPECT_EQ(r.status, 200);
  EXPECT_THAT(r.body, AllOf(HasSubstr("0.6250"), HasSubstr("0.3750"),
                            HasSubstr("dense0.matmul"), HasSubstr("column"),
                            HasSubstr("S(1)"), HasSubstr("ALL_GATHER <code>x</code> S(0) → R"),
                            HasSubstr("1.00 MiB")));
}

TEST_F(StatusPageTest, DeploymentPageChartsStepTimeAndLoss) {
  metrics::HttpResponse r = ServeStatusPage(sources_, "/status/deployments/d1");
  EXPECT_EQ(r.status, 200);
  EXPECT_THAT(r.body, AllOf(HasSubstr("<svg id=\"step-time\""), HasSubstr("<svg id=\"loss\""),
                            HasSubstr("<polyline"), HasSubstr("21.00 ms"), HasSubstr("RUNNING")));
}

TEST_F(StatusPageTest, JobsAreListedAndAJobPageShowsItsTimeline) {
  v1::Job j;
  j.set_name("jobs/train<x>");
  j.mutable_create_time()->set_seconds(1000);
  j.mutable_spec()->mutable_training()->set_steps(300);
  v1::JobStatus& s = *j.mutable_status();
  s.set_state(v1::JobStatus::RECOVERING);
  s.set_steps_done(47);
  s.set_replans(2);
  s.set_checkpoint_step(40);
  s.mutable_update_time()->set_seconds(1100);
  v1::JobEvent* e = s.add_events();
  e->set_reason(v1::JobEvent::EXECUTOR_LOST);
  e->mutable_detect_time()->set_seconds(1020);
  e->mutable_resume_time()->set_seconds(1024);
  e->set_downtime_seconds(4);
  e->set_steps_lost(7);
  e->set_predicted_step_before(0.5);
  e->set_predicted_step_after(0.75);
  e->set_detail("rank 2 <gone>");
  v1::JobEvent* p = s.mutable_pending();
  p->set_reason(v1::JobEvent::NODE_STALE);
  p->mutable_detect_time()->set_seconds(1090);
  s.add_damaged_checkpoints("/ck/step-00000050 -> /ck/damaged-step-00000050: <crc>");
  sources_.jobs = [j] { return std::vector<v1::Job>{j}; };
  metrics::HttpResponse index = ServeStatusPage(sources_, "/status");
  EXPECT_THAT(index.body, AllOf(HasSubstr("Elastic jobs (1)"),
                                HasSubstr("<a href=\"/status/jobs/train&lt;x&gt;\">"),
                                HasSubstr("47 / 300"), HasSubstr("RECOVERING")));
  // Its page (an id as the planner makes them):
  j.set_name("jobs/train");
  sources_.jobs = [j] { return std::vector<v1::Job>{j}; };
  metrics::HttpResponse r = ServeStatusPage(sources_, "/status/jobs/train");
  EXPECT_EQ(r.status, 200);
  EXPECT_THAT(r.body, AllOf(HasSubstr("<svg id=\"timeline\""), HasSubstr("EXECUTOR_LOST"),
                            HasSubstr("NODE_STALE"), HasSubstr("ongoing"),
                            HasSubstr("rank 2 &lt;gone&gt;"), HasSubstr("step 40"),
                            HasSubstr("4.000 s"), HasSubstr("x=\"144.0\""),
                            HasSubstr("/ck/damaged-step-00000050: &lt;crc&gt;"),
                            Not(HasSubstr("<script"))));
  EXPECT_EQ(ServeStatusPage(sources_, "/status/jobs/none").status, 404);
  EXPECT_EQ(ServeStatusPage(sources_, "/status/jobs/").status, 404);
  sources_.jobs = nullptr;  // a page without jobs
  EXPECT_EQ(ServeStatusPage(sources_, "/status/jobs/train").status, 404);
  EXPECT_THAT(ServeStatusPage(sources_, "/status").body, Not(HasSubstr("Elastic jobs")));
}

// The first start is a downtime like a re-start (detected at the job's
// creation, until its first deployment trains) and is drawn red; the
// legend called the wait before it green.
TEST_F(StatusPageTest, TheTimelinesLegendSaysTheWaitToStartIsRed) {
  v1::Job j;
  j.set_name("jobs/train");
  j.mutable_create_time()->set_seconds(1000);
  v1::JobStatus& s = *j.mutable_status();
  s.set_state(v1::JobStatus::RUNNING);
  s.mutable_update_time()->set_seconds(1100);
  v1::JobEvent* e = s.add_events();
  e->set_reason(v1::JobEvent::STARTED);
  *e->mutable_detect_time() = j.create_time();
  e->mutable_resume_time()->set_seconds(1010);
  sources_.jobs = [j] { return std::vector<v1::Job>{j}; };
  const metrics::HttpResponse r = ServeStatusPage(sources_, "/status/jobs/train");
  EXPECT_EQ(r.status, 200);
  EXPECT_THAT(r.body,
              AllOf(HasSubstr("<rect x=\"0.0\" y=\"4\" width=\"72.0\" height=\"20\" "
                              "fill=\"#e88\"><title>STARTED</title>"),
                    HasSubstr("red from its creation"), Not(HasSubstr("(or waiting to start)"))));
}

// A switch cut short by a loss (no resume_time, its downtime up to the
// loss) is drawn red for that downtime, not from the epoch.
TEST_F(StatusPageTest, ASwitchCutShortIsDrawnForItsDowntime) {
  v1::Job j;
  j.set_name("jobs/train");
  j.mutable_create_time()->set_seconds(1000);
  v1::JobStatus& s = *j.mutable_status();
  s.set_state(v1::JobStatus::RUNNING);
  s.mutable_update_time()->set_seconds(1100);
  v1::JobEvent* e = s.add_events();
  e->set_reason(v1::JobEvent::SLOWDOWN);
  e->mutable_detect_time()->set_seconds(1050);
  e->set_downtime_seconds(5);
  sources_.jobs = [j] { return std::vector<v1::Job>{j}; };
  const metrics::HttpResponse r = ServeStatusPage(sources_, "/status/jobs/train");
  EXPECT_THAT(r.body, HasSubstr("<rect x=\"360.0\" y=\"4\" width=\"36.0\" height=\"20\" "
                                "fill=\"#e88\"><title>SLOWDOWN</title>"));
}

TEST_F(StatusPageTest, NonFiniteLossIsLeftOutAndSaid) {
  metrics_[0].set_loss(std::nan(""));
  metrics_[1].set_loss(std::nan(""));
  metrics::HttpResponse r = ServeStatusPage(sources_, "/status/deployments/d1");
  EXPECT_EQ(r.status, 200);
  EXPECT_THAT(r.body, HasSubstr("1 non-finite values left out"));
}

// The vertices of the polyline of the chart `id` ("x,y" each).
std::vector<std::string> Vertices(const std::string& body, const std::string& id) {
  const size_t svg = body.find(absl::StrCat("<svg id=\"", id, "\""));
  if (svg == std::string::npos) return {};
  const size_t start = body.find("points=\"", svg);
  if (start == std::string::npos) return {};
  const size_t end = body.find('"', start + 8);
  return absl::StrSplit(body.substr(start + 8, end - start - 8), ' ', absl::SkipEmpty());
}

// A long run is drawn with fewer vertices than steps, but neither a spike
// nor the last step is left out: every `stride`-th step was drawn, so a
// step 500 times slower than the others could be missing from the chart
// whose axis it set, and the line could stop before the axis' last step.
TEST_F(StatusPageTest, ALongRunsChartKeepsSpikesAndTheLastStep) {
  metrics_.clear();
  for (int step = 0; step < 4002; ++step) {
    v1::StepMetric m;
    m.set_deployment("deployments/d1");
    m.set_step(step);
    m.set_loss(1);
    m.set_step_seconds(step == 1001 ? 10 : 0.02);
    metrics_.push_back(m);
  }
  const metrics::HttpResponse r = ServeStatusPage(sources_, "/status/deployments/d1");
  EXPECT_EQ(r.status, 200);
  const std::vector<std::string> vertices = Vertices(r.body, "step-time");
  ASSERT_FALSE(vertices.empty());
  EXPECT_LE(vertices.size(), 2001u);
  // The chart is 720 wide with 70 and 10 of margins, 220 high with 10 and
  // 30: the slowest step is at the top (y 10), the last step at x 710.
  EXPECT_THAT(vertices, ::testing::Contains(::testing::EndsWith(",10.0")));
  EXPECT_THAT(vertices.back(), ::testing::StartsWith("710.0,"));
}

// The unit is picked after rounding: a value just under a unit's limit
// showed as "1000.00 ms", "1000.0 µs" or "1024.00 MiB".
TEST_F(StatusPageTest, UnitsArePickedAfterRounding) {
  plan_.mutable_prediction()->set_step_seconds(0.9999996);
  cluster_.mutable_nodes(0)->mutable_devices(0)->set_memory_bytes((int64_t{1} << 30) - 1);
  cluster_.mutable_links(0)->set_latency_seconds(0.0009999996);
  metrics::HttpResponse r = ServeStatusPage(sources_, "/status");
  EXPECT_EQ(r.status, 200);
  EXPECT_THAT(r.body, AllOf(HasSubstr(">1.000 s<"), HasSubstr(">1.00 GiB<"), HasSubstr(">1.00 ms<"),
                            Not(HasSubstr("1000.00 ms")), Not(HasSubstr("1024.00 MiB")),
                            Not(HasSubstr("1000.0 µs"))));
}

// The step axis is labelled with step numbers as they are: a run past a
// million steps was labelled "step 1e+06" to "step 1e+06" (six significant
// digits), every label the same.
TEST_F(StatusPageTest, StepAxisLabelsAreWholeStepNumbers) {
  for (v1::StepMetric& m : metrics_) m.set_step(m.step() + 1234567);
  metrics::HttpResponse r = ServeStatusPage(sources_, "/status/deployments/d1");
  EXPECT_EQ(r.status, 200);
  EXPECT_THAT(r.body, AllOf(HasSubstr(">step 1234567<"), HasSubstr(">step 1234571<"),
                            Not(HasSubstr("e+06"))));
}

TEST_F(StatusPageTest, UnknownAndBadIdsAre404WithTheReason) {
  EXPECT_THAT(ServeStatusPage(sources_, "/status/plans/nope").body,
              HasSubstr("There is no plan &quot;plans/nope&quot;"));
  EXPECT_EQ(ServeStatusPage(sources_, "/status/plans/nope").status, 404);
  EXPECT_EQ(ServeStatusPage(sources_, "/status/plans/").status, 404);
  EXPECT_EQ(ServeStatusPage(sources_, "/status/plans/a/b").status, 404);
  EXPECT_EQ(ServeStatusPage(sources_, "/status/deployments/zz").status, 404);
  metrics::HttpResponse r = ServeStatusPage(sources_, "/status/<img>");
  EXPECT_EQ(r.status, 404);
  EXPECT_THAT(r.body, AllOf(HasSubstr("/status/&lt;img&gt;"), Not(HasSubstr("<img>"))));
}

TEST_F(StatusPageTest, FailingSourceIs500WithItsStatus) {
  plans_ok_ = false;
  metrics::HttpResponse r = ServeStatusPage(sources_, "/status");
  EXPECT_EQ(r.status, 500);
  EXPECT_THAT(r.body, HasSubstr("store &lt;down&gt;"));
}

TEST(HtmlEscapeTest, EscapesTheFiveSpecialCharacters) {
  EXPECT_EQ(HtmlEscape("a&b<c>d\"e'f"), "a&amp;b&lt;c&gt;d&quot;e&#39;f");
}

}  // namespace
}  // namespace hap::service
