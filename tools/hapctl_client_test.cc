// hapctl's client commands against a planner that misbehaves: an
// in-process hap.v1.Planner on 127.0.0.1:0 whose calls never end or whose
// list pages never do.
#include "tools/hapctl_client.h"

#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"

namespace hap::tools {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

namespace v1 = ::hap::v1;

// Answers a watch with one message and then nothing until the client goes
// (a planner stuck, or stopped after the connection was made); answers
// every page of ListPlans with the same next_page_token; has a plan
// created in the year 33658 (JSON has no Timestamp for it) with a ratio
// for one of its two devices, and no nodes;
// never answers GetJob; one node with labels YAML would misread.
class FakePlanner final : public v1::Planner::Service {
 public:
  grpc::Status WatchPlan(grpc::ServerContext* ctx, const v1::WatchPlanRequest* r,
                         grpc::ServerWriter<v1::Plan>* w) override {
    v1::Plan p;
    p.set_name(r->name());
    p.set_state(v1::Plan::RUNNING);
    w->Write(p);
    return WaitUntilCancelled(ctx);
  }
  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* r,
                        grpc::ServerWriter<v1::Job>* w) override {
    v1::Job j;
    j.set_name(r->name());
    w->Write(j);
    return WaitUntilCancelled(ctx);
  }
  grpc::Status ListPlans(grpc::ServerContext*, const v1::ListPlansRequest*,
                         v1::ListPlansResponse* out) override {
    out->add_plans()->set_name("plans/p");
    out->set_next_page_token("again");
    return grpc::Status::OK;
  }
  grpc::Status GetPlan(grpc::ServerContext*, const v1::GetPlanRequest* r, v1::Plan* p) override {
    p->set_name(r->name());
    p->set_state(v1::Plan::SUCCEEDED);
    p->mutable_create_time()->set_seconds(int64_t{1'000'000'000'000});
    // Two devices, one ratio: the second's is not there.
    p->add_devices("n1/cpu0");
    p->add_devices("n1/cpu1");
    p->add_ratios()->add_ratios(1.0);
    return grpc::Status::OK;
  }
  grpc::Status ListNodes(grpc::ServerContext*, const v1::ListNodesRequest*,
                         v1::ListNodesResponse* out) override {
    v1::Node* n = out->add_nodes();
    n->set_name(std::string("n\x01") + "1");
    (*n->mutable_labels())["zone: a"] = "x\ry";
    (*n->mutable_labels())["true"] = "1";
    (*n->mutable_labels())["rack"] = "r1";
    return grpc::Status::OK;
  }
  grpc::Status GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest*, v1::Job*) override {
    return WaitUntilCancelled(ctx);
  }
  grpc::Status GetCluster(grpc::ServerContext*, const v1::GetClusterRequest*,
                          v1::Cluster*) override {
    return grpc::Status::OK;
  }
  grpc::Status DeployPlan(grpc::ServerContext*, const v1::DeployPlanRequest* r,
                          v1::Deployment* d) override {
    absl::MutexLock l(&mu_);
    deployed_ = *r;
    d->set_name("deployments/p-g1");
    return grpc::Status::OK;
  }
  v1::DeployPlanRequest deployed() {
    absl::MutexLock l(&mu_);
    return deployed_;
  }
  grpc::Status CreatePlan(grpc::ServerContext*, const v1::CreatePlanRequest* r,
                          v1::Plan* p) override {
    absl::MutexLock l(&mu_);
    created_ = *r;
    p->set_name("plans/p");
    return grpc::Status::OK;
  }
  v1::CreatePlanRequest created() {
    absl::MutexLock l(&mu_);
    return created_;
  }

 private:
  static grpc::Status WaitUntilCancelled(grpc::ServerContext* ctx) {
    // The client's deadline or its going away cancels the call; a poll of
    // the flag, as the synchronous API has no notification of it.
    while (!ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client went");
  }
  absl::Mutex mu_;
  v1::DeployPlanRequest deployed_ ABSL_GUARDED_BY(mu_);
  v1::CreatePlanRequest created_ ABSL_GUARDED_BY(mu_);
};

class HapctlClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  // hapctl VERB ARGS... --server (this planner); the exit code, with what
  // it printed in `out` and `err`.
  int Hapctl(const std::string& verb, std::vector<std::string> args, std::string* out,
             std::string* err) {
    args.push_back(absl::StrCat("--server=127.0.0.1:", port_));
    ::testing::internal::CaptureStdout();
    ::testing::internal::CaptureStderr();
    const int rc = RunClient(verb, args);
    *out = ::testing::internal::GetCapturedStdout();
    *err = ::testing::internal::GetCapturedStderr();
    return rc;
  }

  FakePlanner service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// `watch` had no deadline whatever --timeout said: a planner that stopped
// answering held hapctl for ever. An explicit --timeout bounds the watch.
TEST_F(HapctlClientTest, WatchPlanEndsAtAnExplicitTimeout) {
  std::string out, err;
  EXPECT_EQ(Hapctl("watch", {"plan", "p", "--timeout", "1"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("DEADLINE_EXCEEDED"));
  EXPECT_THAT(err, HasSubstr("--timeout 1"));
}

TEST_F(HapctlClientTest, WatchJobEndsAtAnExplicitTimeoutGivenFirst) {
  std::string out, err;
  // As `hapctl --timeout=1 watch job j` passes it (main moves it behind).
  EXPECT_EQ(Hapctl("watch", {"job", "j", "--timeout=1"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("DEADLINE_EXCEEDED"));
}

// A call the planner does not answer ends at --timeout, and the error says
// so (it was "DEADLINE_EXCEEDED: Deadline Exceeded" alone).
TEST_F(HapctlClientTest, AnUnansweredCallNamesTheTimeout) {
  std::string out, err;
  EXPECT_EQ(Hapctl("describe", {"job", "j", "--timeout", "0.5"}, &out, &err), 1);
  EXPECT_THAT(err,
              HasSubstr("DEADLINE_EXCEEDED: no answer from the planner within --timeout 0.5 s"));
}

// A planner that answers every page with the same next_page_token: `get`
// asked for that page again for ever, its list growing without bound.
TEST_F(HapctlClientTest, GetStopsAtARepeatedPageToken) {
  std::string out, err;
  EXPECT_EQ(Hapctl("get", {"plans", "--timeout", "5"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("page token 'again' twice"));
  EXPECT_THAT(out, Not(HasSubstr("plans/p")));
}

// -o json|yaml of a record JSON cannot hold: the conversion's error was
// dropped, and hapctl printed nothing and exited 0.
TEST_F(HapctlClientTest, ARecordJsonCannotHoldIsAnError) {
  for (const std::string format : {"json", "yaml"}) {
    std::string out, err;
    EXPECT_EQ(Hapctl("describe", {"plan", "far", "-o", format}, &out, &err), 1) << format;
    EXPECT_THAT(err, HasSubstr("cannot print the planner's Plan as " + format)) << format;
    EXPECT_EQ(out, "") << format;
  }
  // The table shows it.
  std::string out, err;
  EXPECT_EQ(Hapctl("describe", {"plan", "far"}, &out, &err), 0) << err;
  EXPECT_THAT(out, HasSubstr("plans/far"));
  // A device the plan has no ratio for: '-' (the ratios were read past
  // their end).
  EXPECT_THAT(out, ContainsRegex("n1/cpu0 +1.0000 +-\n"));
  EXPECT_THAT(out, ContainsRegex("n1/cpu1 +- +-\n"));
}

// -o yaml of labels and names YAML would misread: keys that end early
// ('zone: a'), read as a bool ('true'), control characters. They were
// written as they were.
TEST_F(HapctlClientTest, YamlQuotesWhatItWouldMisread) {
  std::string out, err;
  ASSERT_EQ(Hapctl("get", {"nodes", "-o", "yaml"}, &out, &err), 0) << err;
  EXPECT_THAT(out, HasSubstr("\"zone: a\": \"x\\ry\"\n"));
  EXPECT_THAT(out, HasSubstr("\"true\": \"1\"\n"));
  EXPECT_THAT(out, HasSubstr(" rack: \"r1\"\n"));
  EXPECT_THAT(out, HasSubstr("name: \"n\\x011\"\n"));
}

// A node the planner does not have: an error as every other (it had no
// "error:" before it).
// Without --threads a deployment names no thread count, so each executor
// uses its own --threads (the threads its node's agent measured with); it
// sent 1, which overrode the executors' and ran CPU ranks several times
// slower than the plan predicted.
TEST_F(HapctlClientTest, DeployWithoutThreadsLeavesThemToTheExecutors) {
  std::string out, err;
  ASSERT_EQ(Hapctl("deploy", {"plan", "p", "--executor", "n1/cpu0=127.0.0.1:7101"}, &out, &err), 0)
      << err;
  EXPECT_EQ(service_.deployed().training().threads_per_rank(), 0);
  ASSERT_EQ(
      Hapctl("deploy", {"plan", "p", "--executor", "n1/cpu0=127.0.0.1:7101", "--threads", "8"},
             &out, &err),
      0)
      << err;
  EXPECT_EQ(service_.deployed().training().threads_per_rank(), 8);
}

// training.log_every: how often each executor daemon logs its rank's step
// (0, not given: every 100th). hapctl had no flag for it.
TEST_F(HapctlClientTest, DeployTakesTheExecutorsLogEvery) {
  std::string out, err;
  const std::vector<std::string> deploy = {"plan", "p", "--executor", "n1/cpu0=127.0.0.1:7101"};
  ASSERT_EQ(Hapctl("deploy", deploy, &out, &err), 0) << err;
  EXPECT_EQ(service_.deployed().training().log_every(), 0);
  std::vector<std::string> every = deploy;
  every.insert(every.end(), {"--log-every", "10"});
  ASSERT_EQ(Hapctl("deploy", every, &out, &err), 0) << err;
  EXPECT_EQ(service_.deployed().training().log_every(), 10);
  every.back() = "0";
  EXPECT_EQ(Hapctl("deploy", every, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("flag --log-every must be an integer from 1"));
}

TEST_F(HapctlClientTest, DescribeAMissingNodeIsAnError) {
  std::string out, err;
  EXPECT_EQ(Hapctl("describe", {"node", "n9"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("error: NOT_FOUND: no node 'n9' is registered with the planner"));
}

// create plan --graph read the file twice, once to check it and once to
// send it: from a pipe ('--graph <(python3 export.py)') the second read
// found nothing, and an empty graph went to the planner. The graph sent is
// the one checked.
TEST_F(HapctlClientTest, CreatePlanSendsTheGraphOfAPipe) {
  auto g = graph::BuildZooModel("mlp", {{"layers", 1}, {"hidden", 8}, {"batch", 8}});
  ASSERT_TRUE(g.ok()) << g.status();
  const std::string json = graph::GraphToJson(*g);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ASSERT_LT(json.size(), 60000u);  // fits the pipe's buffer: written before it is read
  ASSERT_EQ(::write(fds[1], json.data(), json.size()), static_cast<ssize_t>(json.size()));
  ::close(fds[1]);
  std::string out, err;
  const int rc =
      Hapctl("create", {"plan", "--graph", absl::StrCat("/dev/fd/", fds[0]), "--timeout", "10"},
             &out, &err);
  ::close(fds[0]);
  ASSERT_EQ(rc, 0) << err;
  const v1::CreatePlanRequest created = service_.created();
  const v1::Graph& sent = created.model().graph();
  EXPECT_EQ(sent.name(), g->name());
  EXPECT_EQ(sent.ops_size(), static_cast<int>(g->ops().size()));
  EXPECT_TRUE(graph::FromProto(sent).ok());
}

}  // namespace
}  // namespace hap::tools
