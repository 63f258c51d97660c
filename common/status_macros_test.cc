// Annotate keeps what a status carries besides its message: the code and
// the payloads (executor/comm marks a lost peer with one, which hap-launch
// reads after every layer above the communicator has annotated it).
#include "common/status_macros.h"

#include "gtest/gtest.h"

namespace hap {
namespace {

TEST(AnnotateTest, PrefixesTheMessageKeepingTheCodeAndPayloads) {
  absl::Status s = absl::UnavailableError("connection reset");
  s.SetPayload("type.hap.dev/test.A", absl::Cord("a"));
  s.SetPayload("type.hap.dev/test.B", absl::Cord("b"));
  const absl::Status out = Annotate(Annotate(s, "allreduce"), "step 3");
  EXPECT_EQ(out.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(out.message(), "step 3: allreduce: connection reset");
  ASSERT_TRUE(out.GetPayload("type.hap.dev/test.A").has_value());
  EXPECT_EQ(std::string(*out.GetPayload("type.hap.dev/test.A")), "a");
  ASSERT_TRUE(out.GetPayload("type.hap.dev/test.B").has_value());
  EXPECT_EQ(std::string(*out.GetPayload("type.hap.dev/test.B")), "b");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "x").ok());
}

}  // namespace
}  // namespace hap
