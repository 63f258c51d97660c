// The StateStore contract, run against every implementation: the in-memory
// fake, SQLite in memory and SQLite in a file.
#include "planner/service/store/state_store.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/service/store/memory_store.h"
#include "planner/service/store/sqlite_store.h"
#include "planner/service/store/test_util.h"

namespace hap::service::store {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::_;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using testing::EqualsProto;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing::TestDeployment;
using testing::TestMetric;
using testing::TestNode;
using testing::TestPlan;

struct InMemoryFactory {
  static absl::StatusOr<std::unique_ptr<StateStore>> Open() { return NewInMemoryStore(); }
};
struct SqliteMemoryFactory {
  static absl::StatusOr<std::unique_ptr<StateStore>> Open() { return OpenSqliteStore(":memory:"); }
};
struct SqliteFileFactory {
  static absl::StatusOr<std::unique_ptr<StateStore>> Open() {
    std::string dir = testing::NewTempDir();
    if (dir.empty()) return absl::InternalError("no temporary directory");
    return OpenSqliteStore(dir + "/state.db");
  }
};

class FactoryNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    if (std::is_same_v<T, InMemoryFactory>) return "InMemory";
    if (std::is_same_v<T, SqliteMemoryFactory>) return "SqliteMemory";
    return "SqliteFile";
  }
};

template <typename Factory>
class StateStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<StateStore>> store = Factory::Open();
    ASSERT_THAT(store, IsOk());
    store_ = std::move(*store);
  }
  std::unique_ptr<StateStore> store_;
};

using Factories = ::testing::Types<InMemoryFactory, SqliteMemoryFactory, SqliteFileFactory>;
TYPED_TEST_SUITE(StateStoreTest, Factories, FactoryNames);

std::string NameOf(const v1::Node& m) { return m.name(); }
std::string NameOf(const v1::Plan& m) { return m.name(); }
std::string NameOf(const v1::Deployment& m) { return m.name(); }
std::string NameOf(const v1::Job& m) { return m.name(); }

// Follows next_page_token to the end; returns the names in order and the
// number of pages, or the first error.
template <typename T>
struct Listed {
  std::vector<std::string> names;
  int pages = 0;
};
template <typename T>
absl::StatusOr<Listed<T>> ListAll(
    const std::function<absl::StatusOr<Page<T>>(int, const std::string&)>& list, int page_size) {
  Listed<T> out;
  std::string token;
  do {
    absl::StatusOr<Page<T>> page = list(page_size, token);
    if (!page.ok()) return page.status();
    ++out.pages;
    if (out.pages > 1000) return absl::InternalError("pagination does not end");
    for (const T& item : page->items) out.names.push_back(NameOf(item));
    token = page->next_page_token;
  } while (!token.empty());
  return out;
}

// --- Nodes -------------------------------------------------------------

TYPED_TEST(StateStoreTest, NodeRoundTrips) {
  v1::Node node = TestNode("nodes/a");
  ASSERT_THAT(this->store_->UpsertNode(node), IsOk());
  absl::StatusOr<v1::Node> got = this->store_->GetNode("nodes/a");
  ASSERT_THAT(got, IsOk());
  EXPECT_THAT(*got, EqualsProto(node));
}

TYPED_TEST(StateStoreTest, UpsertNodeReplacesWithoutDuplicating) {
  ASSERT_THAT(this->store_->UpsertNode(TestNode("nodes/a", "10.0.0.1:1")), IsOk());
  ASSERT_THAT(this->store_->UpsertNode(TestNode("nodes/b")), IsOk());
  v1::Node again = TestNode("nodes/a", "10.0.0.2:7");
  ASSERT_THAT(this->store_->UpsertNode(again), IsOk());

  absl::StatusOr<v1::Node> got = this->store_->GetNode("nodes/a");
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(got->address(), "10.0.0.2:7");
  absl::StatusOr<Page<v1::Node>> page = this->store_->ListNodes(0, "");
  ASSERT_THAT(page, IsOk());
  ASSERT_EQ(page->items.size(), 2u);
  EXPECT_THAT(page->items[0], EqualsProto(again));
  EXPECT_EQ(page->next_page_token, "");
}

TYPED_TEST(StateStoreTest, DeleteNode) {
  ASSERT_THAT(this->store_->UpsertNode(TestNode("nodes/a")), IsOk());
  ASSERT_THAT(this->store_->DeleteNode("nodes/a"), IsOk());
  EXPECT_THAT(this->store_->GetNode("nodes/a"), StatusIs(absl::StatusCode::kNotFound, _));
  EXPECT_THAT(this->store_->DeleteNode("nodes/a"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("node 'nodes/a' not found")));
}

TYPED_TEST(StateStoreTest, ListNodesPagesInNameOrder) {
  for (const char* name : {"nodes/d", "nodes/b", "nodes/e", "nodes/a", "nodes/c"}) {
    ASSERT_THAT(this->store_->UpsertNode(TestNode(name)), IsOk());
  }
  auto list = [&](int size, const std::string& token) {
    return this->store_->ListNodes(size, token);
  };
  const std::vector<std::string> want = {"nodes/a", "nodes/b", "nodes/c", "nodes/d", "nodes/e"};
  for (int page_size : {1, 2, 5, 0}) {
    SCOPED_TRACE(absl::StrCat("page_size ", page_size));
    absl::StatusOr<Listed<v1::Node>> all = ListAll<v1::Node>(list, page_size);
    ASSERT_THAT(all, IsOk());
    EXPECT_THAT(all->names, ElementsAreArray(want));
    // A full last page ends the list only when nothing follows it.
    EXPECT_EQ(all->pages, page_size == 0 ? 1 : (5 + page_size - 1) / page_size);
  }
}

TYPED_TEST(StateStoreTest, ListNodesWhenEmpty) {
  absl::StatusOr<Page<v1::Node>> page = this->store_->ListNodes(2, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(page->items, IsEmpty());
  EXPECT_EQ(page->next_page_token, "");
}

// The token remembers where the page ended, not an offset: rows added
// before that point or removed do not shift the rest.
TYPED_TEST(StateStoreTest, PageTokenSurvivesWritesBetweenPages) {
  for (const char* name : {"nodes/b", "nodes/d", "nodes/f", "nodes/h"}) {
    ASSERT_THAT(this->store_->UpsertNode(TestNode(name)), IsOk());
  }
  absl::StatusOr<Page<v1::Node>> first = this->store_->ListNodes(2, "");
  ASSERT_THAT(first, IsOk());
  ASSERT_EQ(first->items.size(), 2u);
  ASSERT_NE(first->next_page_token, "");
  ASSERT_THAT(this->store_->UpsertNode(TestNode("nodes/a")), IsOk());
  ASSERT_THAT(this->store_->DeleteNode("nodes/d"), IsOk());
  ASSERT_THAT(this->store_->UpsertNode(TestNode("nodes/g")), IsOk());
  absl::StatusOr<Page<v1::Node>> second = this->store_->ListNodes(10, first->next_page_token);
  ASSERT_THAT(second, IsOk());
  std::vector<std::string> names;
  for (const v1::Node& n : second->items) names.push_back(n.name());
  EXPECT_THAT(names, ElementsAre("nodes/f", "nodes/g", "nodes/h"));
  EXPECT_EQ(second->next_page_token, "");
}

TYPED_TEST(StateStoreTest, BadPageRequestsAreInvalidArgument) {
  for (const char* name : {"nodes/a", "nodes/b", "nodes/c"}) {
    ASSERT_THAT(this->store_->UpsertNode(TestNode(name)), IsOk());
  }
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/a", 1), ""), IsOk());
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/b", 2), ""), IsOk());
  absl::StatusOr<Page<v1::Node>> page = this->store_->ListNodes(1, "");
  ASSERT_THAT(page, IsOk());
  const std::string good = page->next_page_token;
  ASSERT_NE(good, "");

  std::string tampered = good;
  tampered[tampered.size() / 2] = tampered[tampered.size() / 2] == 'A' ? 'B' : 'A';
  const std::vector<std::string> bad = {
      "garbage",
      "!!!not base64!!!",
      absl::WebSafeBase64Escape("hapstore1:nodes:0:0:nodes/a#0000000000000000"),
      tampered,
      good.substr(0, good.size() - 4),
  };
  for (const std::string& token : bad) {
    SCOPED_TRACE(token);
    EXPECT_THAT(this->store_->ListNodes(1, token),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  }
  // A token of one list is not one of another.
  EXPECT_THAT(this->store_->ListPlans(1, good),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listing plans")));
  EXPECT_THAT(this->store_->ListDeployments(1, good),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listing deployments")));
  EXPECT_THAT(this->store_->ListNodes(-1, ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_size")));
  EXPECT_THAT(this->store_->ListPlans(-5, ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("-5")));
  // The good token still works after all that.
  EXPECT_THAT(this->store_->ListNodes(1, good), IsOk());
}

TYPED_TEST(StateStoreTest, EmptyNamesAreInvalidArgument) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  StateStore& s = *this->store_;
  EXPECT_THAT(s.UpsertNode(v1::Node()), StatusIs(kInvalid, HasSubstr("node name is empty")));
  EXPECT_THAT(s.GetNode(""), StatusIs(kInvalid, HasSubstr("node name is empty")));
  EXPECT_THAT(s.DeleteNode(""), StatusIs(kInvalid, HasSubstr("node name is empty")));
  EXPECT_THAT(s.PutPlan(v1::Plan(), "k"), StatusIs(kInvalid, HasSubstr("plan name is empty")));
  EXPECT_THAT(s.GetPlan(""), StatusIs(kInvalid, HasSubstr("plan name is empty")));
  EXPECT_THAT(s.DeletePlan(""), StatusIs(kInvalid, HasSubstr("plan name is empty")));
  EXPECT_THAT(s.FindPlanByCacheKey(""), StatusIs(kInvalid, HasSubstr("cache key is empty")));
  EXPECT_THAT(s.PutDeployment(v1::Deployment()),
              StatusIs(kInvalid, HasSubstr("deployment name is empty")));
  EXPECT_THAT(s.GetDeployment(""), StatusIs(kInvalid, HasSubstr("deployment name is empty")));
  EXPECT_THAT(s.DeleteDeployment(""), StatusIs(kInvalid, HasSubstr("deployment name is empty")));
  EXPECT_THAT(s.AppendStepMetrics("", {TestMetric(0, 0, 1)}),
              StatusIs(kInvalid, HasSubstr("deployment name is empty")));
  EXPECT_THAT(s.ListStepMetrics("", 0, 10),
              StatusIs(kInvalid, HasSubstr("deployment name is empty")));
  EXPECT_THAT(s.LastStepMetricStep(""), StatusIs(kInvalid, HasSubstr("deployment name is empty")));
  EXPECT_THAT(s.DeleteStepMetrics("", 0, 10),
              StatusIs(kInvalid, HasSubstr("deployment name is empty")));
  EXPECT_THAT(s.LastDeploymentGeneration(""), StatusIs(kInvalid, HasSubstr("plan name is empty")));
}

TYPED_TEST(StateStoreTest, MissingResourcesAreNotFoundByName) {
  const auto kNotFound = absl::StatusCode::kNotFound;
  StateStore& s = *this->store_;
  EXPECT_THAT(s.GetNode("nodes/x"), StatusIs(kNotFound, HasSubstr("node 'nodes/x' not found")));
  EXPECT_THAT(s.GetPlan("plans/x"), StatusIs(kNotFound, HasSubstr("plan 'plans/x' not found")));
  EXPECT_THAT(s.DeletePlan("plans/x"), StatusIs(kNotFound, HasSubstr("plan 'plans/x' not found")));
  EXPECT_THAT(s.FindPlanByCacheKey("k1"),
              StatusIs(kNotFound, HasSubstr("plan with cache key 'k1' not found")));
  EXPECT_THAT(s.GetDeployment("deployments/x"),
              StatusIs(kNotFound, HasSubstr("deployment 'deployments/x' not found")));
  EXPECT_THAT(s.DeleteDeployment("deployments/x"),
              StatusIs(kNotFound, HasSubstr("deployment 'deployments/x' not found")));
  EXPECT_THAT(s.AppendStepMetrics("deployments/x", {TestMetric(0, 0, 1)}),
              StatusIs(kNotFound, HasSubstr("deployment 'deployments/x' not found")));
  EXPECT_THAT(s.ListStepMetrics("deployments/x", 0, 10),
              StatusIs(kNotFound, HasSubstr("deployment 'deployments/x' not found")));
}

// --- Plans -------------------------------------------------------------

TYPED_TEST(StateStoreTest, PlanRoundTripsAndIsReplaced) {
  v1::Plan plan = TestPlan("plans/p", 100);
  plan.set_state(v1::Plan::RUNNING);
  ASSERT_THAT(this->store_->PutPlan(plan, "key"), IsOk());
  absl::StatusOr<v1::Plan> got = this->store_->GetPlan("plans/p");
  ASSERT_THAT(got, IsOk());
  EXPECT_THAT(*got, EqualsProto(plan));

  plan.set_state(v1::Plan::SUCCEEDED);
  plan.set_synthesis_seconds(1.5);
  ASSERT_THAT(this->store_->PutPlan(plan, "key"), IsOk());
  got = this->store_->GetPlan("plans/p");
  ASSERT_THAT(got, IsOk());
  EXPECT_THAT(*got, EqualsProto(plan));
  absl::StatusOr<Page<v1::Plan>> page = this->store_->ListPlans(0, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_EQ(page->items.size(), 1u);

  ASSERT_THAT(this->store_->DeletePlan("plans/p"), IsOk());
  EXPECT_THAT(this->store_->GetPlan("plans/p"), StatusIs(absl::StatusCode::kNotFound, _));
  EXPECT_THAT(this->store_->FindPlanByCacheKey("key"), StatusIs(absl::StatusCode::kNotFound, _));
}

// A plan with the fields a summary leaves out.
v1::Plan BigPlan(const std::string& name, int64_t seconds) {
  v1::Plan plan = TestPlan(name, seconds);
  plan.set_state(v1::Plan::SUCCEEDED);
  plan.add_rank_programs()->set_rank(0);
  plan.add_rank_programs()->set_rank(1);
  plan.mutable_graph()->set_name("graph of " + name);
  plan.mutable_program()->add_instructions();
  plan.add_notes("a note");
  return plan;
}

TYPED_TEST(StateStoreTest, PlanSummariesLeaveOutProgramsAndGraph) {
  ASSERT_THAT(this->store_->PutPlan(BigPlan("plans/b", 20), "key"), IsOk());
  ASSERT_THAT(this->store_->PutPlan(BigPlan("plans/a", 10), ""), IsOk());
  absl::StatusOr<Page<v1::Plan>> page = this->store_->ListPlanSummaries(1, "");
  ASSERT_THAT(page, IsOk());
  ASSERT_EQ(page->items.size(), 1u);
  EXPECT_THAT(page->items[0], EqualsProto(PlanSummary(BigPlan("plans/a", 10))));
  EXPECT_EQ(page->items[0].rank_programs_size(), 0);
  EXPECT_FALSE(page->items[0].has_graph());
  EXPECT_FALSE(page->items[0].has_program());
  EXPECT_EQ(page->items[0].notes_size(), 1);
  page = this->store_->ListPlanSummaries(1, page->next_page_token);
  ASSERT_THAT(page, IsOk());
  ASSERT_EQ(page->items.size(), 1u);
  EXPECT_THAT(page->items[0], EqualsProto(PlanSummary(BigPlan("plans/b", 20))));
  EXPECT_EQ(page->next_page_token, "");
  // The whole plan is still what GetPlan reads.
  absl::StatusOr<v1::Plan> whole = this->store_->GetPlan("plans/b");
  ASSERT_THAT(whole, IsOk());
  EXPECT_THAT(*whole, EqualsProto(BigPlan("plans/b", 20)));
}

TYPED_TEST(StateStoreTest, ListPlansByCreateTimeThenName) {
  // Inserted out of order; ties in create_time are broken by name.
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/z", 10), ""), IsOk());
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/b", 20), ""), IsOk());
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/a", 20), ""), IsOk());
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/c", 20, 5), ""), IsOk());
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/y", 5), ""), IsOk());
  const std::vector<std::string> want = {"plans/y", "plans/z", "plans/a", "plans/b", "plans/c"};
  auto list = [&](int size, const std::string& token) {
    return this->store_->ListPlans(size, token);
  };
  for (int page_size : {1, 2, 0}) {
    SCOPED_TRACE(absl::StrCat("page_size ", page_size));
    absl::StatusOr<Listed<v1::Plan>> all = ListAll<v1::Plan>(list, page_size);
    ASSERT_THAT(all, IsOk());
    EXPECT_THAT(all->names, ElementsAreArray(want));
    EXPECT_EQ(all->pages, page_size == 0 ? 1 : (5 + page_size - 1) / page_size);
  }

  // A plan whose create_time changes moves in the order.
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/y", 30), ""), IsOk());
  absl::StatusOr<Listed<v1::Plan>> all = ListAll<v1::Plan>(list, 2);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(all->names, ElementsAre("plans/z", "plans/a", "plans/b", "plans/c", "plans/y"));
}

TYPED_TEST(StateStoreTest, FindPlanByCacheKey) {
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/old", 1), "graph:cluster:opts"), IsOk());
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/new", 2), "graph:cluster:opts"), IsOk());
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/other", 3), "graph:cluster:other"), IsOk());
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/none", 4), ""), IsOk());

  // Of several, the latest.
  absl::StatusOr<v1::Plan> found = this->store_->FindPlanByCacheKey("graph:cluster:opts");
  ASSERT_THAT(found, IsOk());
  EXPECT_THAT(*found, EqualsProto(TestPlan("plans/new", 2)));
  found = this->store_->FindPlanByCacheKey("graph:cluster:other");
  ASSERT_THAT(found, IsOk());
  EXPECT_EQ(found->name(), "plans/other");

  // Putting a plan again with "" drops its key.
  ASSERT_THAT(this->store_->PutPlan(TestPlan("plans/new", 2), ""), IsOk());
  found = this->store_->FindPlanByCacheKey("graph:cluster:opts");
  ASSERT_THAT(found, IsOk());
  EXPECT_EQ(found->name(), "plans/old");

  ASSERT_THAT(this->store_->DeletePlan("plans/old"), IsOk());
  EXPECT_THAT(this->store_->FindPlanByCacheKey("graph:cluster:opts"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("graph:cluster:opts")));
}

// --- Deployments ---------------------------------------------------------

TYPED_TEST(StateStoreTest, DeploymentRoundTripsAndLists) {
  v1::Deployment d = TestDeployment("deployments/b", 7);
  ASSERT_THAT(this->store_->PutDeployment(d), IsOk());
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment("deployments/a", 7)), IsOk());
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment("deployments/c", 3)), IsOk());
  absl::StatusOr<v1::Deployment> got = this->store_->GetDeployment("deployments/b");
  ASSERT_THAT(got, IsOk());
  EXPECT_THAT(*got, EqualsProto(d));

  d.set_state(v1::Deployment::SUCCEEDED);
  d.set_steps_completed(20);
  d.set_generation(2);
  ASSERT_THAT(this->store_->PutDeployment(d), IsOk());
  got = this->store_->GetDeployment("deployments/b");
  ASSERT_THAT(got, IsOk());
  EXPECT_THAT(*got, EqualsProto(d));

  auto list = [&](int size, const std::string& token) {
    return this->store_->ListDeployments(size, token);
  };
  for (int page_size : {1, 2}) {
    absl::StatusOr<Listed<v1::Deployment>> all = ListAll<v1::Deployment>(list, page_size);
    ASSERT_THAT(all, IsOk());
    EXPECT_THAT(all->names, ElementsAre("deployments/c", "deployments/a", "deployments/b"));
  }
  ASSERT_THAT(this->store_->DeleteDeployment("deployments/a"), IsOk());
  absl::StatusOr<Listed<v1::Deployment>> all = ListAll<v1::Deployment>(list, 0);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(all->names, ElementsAre("deployments/c", "deployments/b"));
}

// --- Jobs ----------------------------------------------------------------

v1::Job TestJob(const std::string& name, int64_t create_seconds) {
  v1::Job j;
  j.set_name(name);
  j.mutable_create_time()->set_seconds(create_seconds);
  j.mutable_spec()->mutable_model()->mutable_zoo()->set_name("gpt");
  j.mutable_spec()->mutable_training()->set_checkpoint_dir("/c");
  j.mutable_status()->set_state(v1::JobStatus::RUNNING);
  return j;
}

TYPED_TEST(StateStoreTest, JobRoundTripsAndLists) {
  v1::Job j = TestJob("jobs/b", 7);
  ASSERT_THAT(this->store_->PutJob(j), IsOk());
  ASSERT_THAT(this->store_->PutJob(TestJob("jobs/a", 7)), IsOk());
  ASSERT_THAT(this->store_->PutJob(TestJob("jobs/c", 3)), IsOk());
  j.mutable_status()->set_state(v1::JobStatus::RECOVERING);
  v1::JobEvent* e = j.mutable_status()->add_events();
  e->set_reason(v1::JobEvent::NODE_STALE);
  e->set_steps_lost(4);
  ASSERT_THAT(this->store_->PutJob(j), IsOk());
  absl::StatusOr<v1::Job> got = this->store_->GetJob("jobs/b");
  ASSERT_THAT(got, IsOk());
  EXPECT_THAT(*got, EqualsProto(j));
  auto list = [&](int size, const std::string& token) { return this->store_->ListJobs(size, token); };
  for (int page_size : {1, 2}) {
    absl::StatusOr<Listed<v1::Job>> all = ListAll<v1::Job>(list, page_size);
    ASSERT_THAT(all, IsOk());
    EXPECT_THAT(all->names, ElementsAre("jobs/c", "jobs/a", "jobs/b"));
  }
  ASSERT_THAT(this->store_->DeleteJob("jobs/a"), IsOk());
  EXPECT_THAT(this->store_->GetJob("jobs/a"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("jobs/a")));
  EXPECT_THAT(this->store_->DeleteJob("jobs/a"), StatusIs(absl::StatusCode::kNotFound, _));
  EXPECT_THAT(this->store_->PutJob(v1::Job()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job name is empty")));
  // A deployment's page token is not a job list's.
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment("deployments/a", 1)), IsOk());
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment("deployments/b", 2)), IsOk());
  absl::StatusOr<Page<v1::Deployment>> page = this->store_->ListDeployments(1, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(this->store_->ListJobs(1, page->next_page_token),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("jobs")));
}

// --- Step metrics --------------------------------------------------------

std::vector<std::pair<int64_t, int32_t>> StepsAndRanks(const std::vector<v1::StepMetric>& ms) {
  std::vector<std::pair<int64_t, int32_t>> out;
  for (const v1::StepMetric& m : ms) out.emplace_back(m.step(), m.rank());
  return out;
}

// The highest generation of a plan's deployments is kept when they are
// deleted: a restarted planner goes on from it (no name used twice).
TYPED_TEST(StateStoreTest, TheLastDeploymentGenerationOutlivesItsDeployments) {
  EXPECT_EQ(this->store_->LastDeploymentGeneration("plans/p").value_or(-1), 0);
  for (int64_t gen : {1, 3, 2}) {  // a later put of an older one lowers nothing
    v1::Deployment d = TestDeployment(absl::StrCat("deployments/p-g", gen), gen);
    d.set_generation(gen);
    ASSERT_THAT(this->store_->PutDeployment(d), IsOk());
  }
  v1::Deployment other = TestDeployment("deployments/q-g5", 9);
  other.set_plan("plans/q");
  other.set_generation(5);
  ASSERT_THAT(this->store_->PutDeployment(other), IsOk());
  EXPECT_EQ(this->store_->LastDeploymentGeneration("plans/p").value_or(-1), 3);
  EXPECT_EQ(this->store_->LastDeploymentGeneration("plans/q").value_or(-1), 5);
  for (const char* name : {"deployments/p-g1", "deployments/p-g2", "deployments/p-g3"}) {
    ASSERT_THAT(this->store_->DeleteDeployment(name), IsOk());
  }
  EXPECT_EQ(this->store_->LastDeploymentGeneration("plans/p").value_or(-1), 3);
}

// DeleteStepMetrics: the steps [from, to) of one deployment, every rank;
// other steps and deployments stay.
TYPED_TEST(StateStoreTest, DeleteStepMetricsRemovesARangeOfSteps) {
  const std::string d = "deployments/d", other = "deployments/other";
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment(d, 1)), IsOk());
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment(other, 1)), IsOk());
  for (const std::string& name : {d, other}) {
    std::vector<v1::StepMetric> ms;
    for (int64_t step = 0; step < 6; ++step) {
      for (int32_t rank = 0; rank < 2; ++rank) ms.push_back(TestMetric(step, rank, 1.0));
    }
    ASSERT_THAT(this->store_->AppendStepMetrics(name, ms), IsOk());
  }
  ASSERT_THAT(this->store_->DeleteStepMetrics(d, 1, 4), IsOk());
  ASSERT_THAT(this->store_->DeleteStepMetrics(d, 5, 5), IsOk());  // empty range
  using P = std::pair<int64_t, int32_t>;
  absl::StatusOr<std::vector<v1::StepMetric>> left = this->store_->ListStepMetrics(d, 0, 100);
  ASSERT_THAT(left, IsOk());
  EXPECT_THAT(StepsAndRanks(*left),
              ElementsAre(P{0, 0}, P{0, 1}, P{4, 0}, P{4, 1}, P{5, 0}, P{5, 1}));
  absl::StatusOr<std::vector<v1::StepMetric>> untouched =
      this->store_->ListStepMetrics(other, 0, 100);
  ASSERT_THAT(untouched, IsOk());
  EXPECT_EQ(untouched->size(), 12u);
  EXPECT_THAT(this->store_->DeleteStepMetrics("deployments/none", 0, 1),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TYPED_TEST(StateStoreTest, StepMetricsInStepAndRankOrder) {
  const std::string d = "deployments/d";
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment(d, 1)), IsOk());
  EXPECT_EQ(this->store_->LastStepMetricStep(d).value_or(-2), -1);
  EXPECT_THAT(this->store_->LastStepMetricStep("deployments/none"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  // Reports arrive per rank and out of order.
  ASSERT_THAT(this->store_->AppendStepMetrics(
                  d, {TestMetric(1, 1, 2.0), TestMetric(0, 1, 3.0), TestMetric(2, 1, 1.0)}),
              IsOk());
  ASSERT_THAT(this->store_->AppendStepMetrics(
                  d, {TestMetric(0, 0, 3.0), TestMetric(1, 0, 2.0), TestMetric(2, 0, 1.0)}),
              IsOk());
  ASSERT_THAT(this->store_->AppendStepMetrics(d, {}), IsOk());
  EXPECT_EQ(this->store_->LastStepMetricStep(d).value_or(-2), 2);

  absl::StatusOr<std::vector<v1::StepMetric>> all = this->store_->ListStepMetrics(d, 0, 100);
  ASSERT_THAT(all, IsOk());
  using P = std::pair<int64_t, int32_t>;
  EXPECT_THAT(StepsAndRanks(*all),
              ElementsAre(P{0, 0}, P{0, 1}, P{1, 0}, P{1, 1}, P{2, 0}, P{2, 1}));
  v1::StepMetric want = TestMetric(1, 0, 2.0);
  want.set_deployment(d);  // filled in
  EXPECT_THAT((*all)[2], EqualsProto(want));

  absl::StatusOr<std::vector<v1::StepMetric>> tail = this->store_->ListStepMetrics(d, 1, 3);
  ASSERT_THAT(tail, IsOk());
  EXPECT_THAT(StepsAndRanks(*tail), ElementsAre(P{1, 0}, P{1, 1}, P{2, 0}));
  tail = this->store_->ListStepMetrics(d, 3, 3);
  ASSERT_THAT(tail, IsOk());
  EXPECT_THAT(*tail, IsEmpty());

  // A (step, rank) reported again replaces the earlier report.
  v1::StepMetric again = TestMetric(1, 1, 9.0);
  again.set_deployment(d);
  ASSERT_THAT(this->store_->AppendStepMetrics(d, {again}), IsOk());
  all = this->store_->ListStepMetrics(d, 0, 100);
  ASSERT_THAT(all, IsOk());
  ASSERT_EQ(all->size(), 6u);
  EXPECT_THAT((*all)[3], EqualsProto(again));
}

TYPED_TEST(StateStoreTest, StepMetricsOfAnotherDeploymentAreRefusedWhole) {
  const std::string d = "deployments/d";
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment(d, 1)), IsOk());
  v1::StepMetric foreign = TestMetric(1, 0, 1.0);
  foreign.set_deployment("deployments/other");
  EXPECT_THAT(this->store_->AppendStepMetrics(d, {TestMetric(0, 0, 1.0), foreign}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is for deployment 'deployments/other'")));
  absl::StatusOr<std::vector<v1::StepMetric>> all = this->store_->ListStepMetrics(d, 0, 10);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(*all, IsEmpty());
  EXPECT_THAT(this->store_->ListStepMetrics(d, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("limit must be positive")));
  EXPECT_THAT(this->store_->ListStepMetrics(d, 0, -1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("limit")));
}

TYPED_TEST(StateStoreTest, DeletingADeploymentDeletesItsMetrics) {
  const std::string d = "deployments/d";
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment(d, 1)), IsOk());
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment("deployments/e", 1)), IsOk());
  ASSERT_THAT(this->store_->AppendStepMetrics(d, {TestMetric(0, 0, 1.0)}), IsOk());
  ASSERT_THAT(this->store_->AppendStepMetrics("deployments/e", {TestMetric(0, 0, 1.0)}), IsOk());
  ASSERT_THAT(this->store_->DeleteDeployment(d), IsOk());
  EXPECT_THAT(this->store_->ListStepMetrics(d, 0, 10), StatusIs(absl::StatusCode::kNotFound, _));
  ASSERT_THAT(this->store_->PutDeployment(TestDeployment(d, 2)), IsOk());
  absl::StatusOr<std::vector<v1::StepMetric>> all = this->store_->ListStepMetrics(d, 0, 10);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(*all, IsEmpty());
  all = this->store_->ListStepMetrics("deployments/e", 0, 10);
  ASSERT_THAT(all, IsOk());
  EXPECT_EQ(all->size(), 1u);
}

// --- Threads -------------------------------------------------------------

TYPED_TEST(StateStoreTest, ConcurrentWritersAndReaders) {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 20;
  std::vector<std::thread> threads;
  std::vector<absl::Status> errors(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread && errors[t].ok(); ++i) {
        errors[t] = this->store_->UpsertNode(TestNode(absl::StrCat("nodes/t", t, "-", i)));
        if (errors[t].ok()) errors[t] = this->store_->ListNodes(3, "").status();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : errors) EXPECT_THAT(s, IsOk());
  auto list = [&](int size, const std::string& token) {
    return this->store_->ListNodes(size, token);
  };
  absl::StatusOr<Listed<v1::Node>> all = ListAll<v1::Node>(list, 7);
  ASSERT_THAT(all, IsOk());
  EXPECT_EQ(all->names.size(), static_cast<size_t>(kThreads * kPerThread));
  EXPECT_TRUE(std::is_sorted(all->names.begin(), all->names.end()));
}

}  // namespace
}  // namespace hap::service::store
