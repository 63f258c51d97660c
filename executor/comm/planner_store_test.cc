// The planner store against planners that do not answer: nothing listening
// on the port, or a listener that never speaks. (Against a fake planner that
// answers: executor/daemon/planner_store_test.cc.)
#include "executor/comm/planner_store.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// A TCP socket bound to a free port of 127.0.0.1, listening (its
// connections are queued by the kernel and never answered) or not (they
// are refused). Closed on destruction.
class SilentPort {
 public:
  explicit SilentPort(bool listening) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        (listening && listen(fd_, 16) != 0) ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;
    }
    port_ = ntohs(addr.sin_port);
  }
  ~SilentPort() {
    if (fd_ >= 0) close(fd_);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

std::unique_ptr<RendezvousStore> StoreAt(int port) {
  PlannerStoreOptions o;
  o.deployment = "deployments/x";
  o.generation = 3;
  o.set_timeout = absl::Milliseconds(300);
  o.grace = absl::Milliseconds(100);
  auto store = NewPlannerStore(absl::StrCat("127.0.0.1:", port), o);
  EXPECT_THAT(store, IsOk());
  return store.ok() ? *std::move(store) : nullptr;
}

// A planner that is not there, or does not answer, is named as such: the
// error used to say that the key was not set in time, as if the planner had
// been asked and answered so.
TEST(PlannerStoreTest, APlannerThatDoesNotAnswerIsNamed) {
  for (bool listening : {false, true}) {
    SilentPort planner(listening);
    ASSERT_NE(planner.port(), 0);
    auto store = StoreAt(planner.port());
    ASSERT_NE(store, nullptr);
    EXPECT_THAT(store->Get("rank0", absl::Milliseconds(200)),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         AllOf(HasSubstr("StoreGet 'rank0'"), HasSubstr("generation 3"),
                               HasSubstr("the planner did not answer within 300ms"))))
        << (listening ? "a silent listener" : "nothing listening");
    EXPECT_THAT(store->Set("rank0", "v"),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         AllOf(HasSubstr("StoreSet 'rank0'"),
                               HasSubstr("the planner did not answer within 300ms"))))
        << (listening ? "a silent listener" : "nothing listening");
  }
}

}  // namespace
}  // namespace hap::executor
