#include "common/proto_time.h"

#include "gtest/gtest.h"

namespace hap::service {
namespace {

TEST(ProtoTimeTest, TimesAndDurationsRoundTrip) {
  const absl::Time t = absl::FromUnixNanos(1'800'000'000'123'456'789);
  const google::protobuf::Timestamp ts = ToProto(t);
  EXPECT_EQ(ts.seconds(), 1'800'000'000);
  EXPECT_EQ(ts.nanos(), 123'456'789);
  EXPECT_EQ(FromProto(ts), t);
  EXPECT_EQ(FromProto(google::protobuf::Timestamp()), absl::UnixEpoch());

  for (absl::Duration d : {absl::Milliseconds(1500), -absl::Milliseconds(1500),
                           absl::ZeroDuration(), absl::Nanoseconds(7)}) {
    const google::protobuf::Duration p = ToProto(d);
    EXPECT_EQ(FromProto(p), d) << d;
    // Normalized: seconds and nanos carry the same sign.
    EXPECT_TRUE(p.seconds() * p.nanos() >= 0) << p.seconds() << " " << p.nanos();
  }
  google::protobuf::Duration p;
  p.set_seconds(2);
  p.set_nanos(500'000'000);
  EXPECT_EQ(FromProto(p), absl::Milliseconds(2500));
}

}  // namespace
}  // namespace hap::service
