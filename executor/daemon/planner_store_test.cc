// The rendezvous store over the planner's Store RPCs, against a fake
// planner on 127.0.0.1.
#include "executor/comm/planner_store.h"

#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "executor/daemon/fake_planner.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

class PlannerStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&planner_);
    server_ = b.BuildAndStart();
    ASSERT_NE(port_, 0);
  }
  void TearDown() override {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }
  std::unique_ptr<RendezvousStore> Store(int64_t generation) {
    PlannerStoreOptions o;
    o.deployment = "deployments/x";
    o.generation = generation;
    auto s = NewPlannerStore(absl::StrCat("127.0.0.1:", port_), o);
    EXPECT_THAT(s, IsOk());
    return s.ok() ? *std::move(s) : nullptr;
  }

  testing::FakePlanner planner_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(PlannerStoreTest, SetThenGet) {
  auto store = Store(2);
  ASSERT_THAT(store->Set("rank0", std::string("addr\0bytes", 10)), IsOk());
  auto v = store->Get("rank0", absl::Seconds(5));
  ASSERT_THAT(v, IsOk());
  EXPECT_EQ(*v, std::string("addr\0bytes", 10));
  EXPECT_EQ(planner_.keys_under("deployments/x", 2), 1);
}

TEST_F(PlannerStoreTest, GetWaitsForALaterSet) {
  auto reader = Store(2), writer = Store(2);
  absl::StatusOr<std::string> got;
  std::thread t([&] { got = reader->Get("late", absl::Seconds(30)); });
  ASSERT_THAT(writer->Set("late", "v"), IsOk());
  t.join();
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(*got, "v");
}

TEST_F(PlannerStoreTest, GenerationsDoNotMix) {
  ASSERT_THAT(Store(1)->Set("k", "old"), IsOk());
  EXPECT_THAT(Store(2)->Get("k", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("'k' of deployments/x generation 2")));
}

TEST_F(PlannerStoreTest, MissingKeyTimesOutNamingIt) {
  EXPECT_THAT(Store(2)->Get("never", absl::Milliseconds(200)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'never'")));
}

TEST(PlannerStoreNoServerTest, UnreachablePlannerIsDeadlineExceeded) {
  PlannerStoreOptions o;
  o.deployment = "deployments/x";
  o.grace = absl::Milliseconds(100);
  auto store = NewPlannerStore("127.0.0.1:1", o);
  ASSERT_THAT(store, IsOk());
  EXPECT_THAT((*store)->Get("k", absl::Milliseconds(200)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'k'")));
}

TEST(PlannerStoreNoServerTest, NeedsADeployment) {
  EXPECT_THAT(NewPlannerStore("127.0.0.1:1", PlannerStoreOptions()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("deployment")));
}

}  // namespace
}  // namespace hap::executor
