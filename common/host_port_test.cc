#include "common/host_port.h"

#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace hap::service {
namespace {

TEST(IsHostPortTest, TakesWhatGrpcReadsAsMeant) {
  EXPECT_TRUE(IsHostPort("127.0.0.1:7070"));
  EXPECT_TRUE(IsHostPort("node-3.cluster.local:1"));
  EXPECT_TRUE(IsHostPort("[::1]:65535"));
  EXPECT_TRUE(IsHostPort("0.0.0.0:0", /*min_port=*/0));
  EXPECT_TRUE(IsHostPort("unix:/run/hap.sock", 1, /*schemes=*/true));
  EXPECT_TRUE(IsHostPort("dns:///planner:7070", 1, /*schemes=*/true));
}

// Each of these gRPC dials or binds as something else than written.
TEST(IsHostPortTest, RefusesWhatGrpcWouldReadOtherwise) {
  EXPECT_FALSE(IsHostPort("127.0.0.1:99999"));  // port 34463
  EXPECT_FALSE(IsHostPort("127.0.0.1:65536"));
  EXPECT_FALSE(IsHostPort("127.0.0.1:0"));  // min_port 1
  EXPECT_FALSE(IsHostPort("127.0.0.1"));    // no port: 443 when bound
  EXPECT_FALSE(IsHostPort("127.0.0.1:"));
  EXPECT_FALSE(IsHostPort(":7070"));
  EXPECT_FALSE(IsHostPort("127.0.0.1:http"));
  EXPECT_FALSE(IsHostPort("127.0.0.1:+80"));
  EXPECT_FALSE(IsHostPort("127.0.0.1:000080"));
  EXPECT_FALSE(IsHostPort("::1:7070"));  // an IPv6 host without brackets
  EXPECT_FALSE(IsHostPort("my host:7070"));
  EXPECT_FALSE(IsHostPort(""));
  EXPECT_FALSE(IsHostPort("unix:/run/hap.sock"));  // schemes not asked for
  EXPECT_FALSE(IsHostPort("dns:///planner:99999", 1, /*schemes=*/true));
  EXPECT_FALSE(IsHostPort("ipv4:10.0.0.1", 1, /*schemes=*/true));
  EXPECT_TRUE(IsHostPort("ipv6:[::1]:7070", 1, /*schemes=*/true));
}

TEST(BracketIpv6HostTest, AnUnbracketedIpv6HostGetsBracketsAndTheRestStays) {
  EXPECT_EQ(BracketIpv6Host("fd00::5:7071"), "[fd00::5]:7071");
  EXPECT_EQ(BracketIpv6Host("2001:db8::1:7100"), "[2001:db8::1]:7100");
  EXPECT_TRUE(IsHostPort(BracketIpv6Host("fd00::5:7071")));
  for (const std::string same : {"[fd00::5]:7071", "10.0.0.1:7071", "node-a:7071", "fd00:7071",
                                 "unix:/run/hap.sock", "", ":7071", "::"}) {
    EXPECT_EQ(BracketIpv6Host(same), same);
  }
}

TEST(IsLocalOnlyAddressTest, LoopbackHostsAndLocalSocketsAreThisMachineOnly) {
  for (const std::string local :
       {"127.0.0.1:7070", "127.1.2.3:1", "localhost:7070", "LOCALHOST:1", "[::1]:7070",
        "ipv4:127.0.0.1:7070", "dns:///localhost:7070", "unix:/run/hap.sock"}) {
    EXPECT_TRUE(IsLocalOnlyAddress(local)) << local;
  }
  for (const std::string remote :
       {"10.0.0.1:7070", "planner:7070", "[fd00::1]:7070", "dns:///planner.example:7070",
        "0.0.0.0:7070", "node-127.example:1"}) {
    EXPECT_FALSE(IsLocalOnlyAddress(remote)) << remote;
  }
}

TEST(AdvertisedAddressTest, AWildcardHostIsThisMachinesName) {
  char name[256] = {};
  ASSERT_EQ(gethostname(name, sizeof(name) - 1), 0);
  for (const std::string bound : {"0.0.0.0:7000", "[::]:7000", ":::7000", ":7000"}) {
    EXPECT_EQ(AdvertisedAddress(bound), std::string(name) + ":7000") << bound;
  }
  EXPECT_EQ(AdvertisedAddress("127.0.0.1:7000"), "127.0.0.1:7000");
  EXPECT_EQ(AdvertisedAddress("[::1]:7000"), "[::1]:7000");
  EXPECT_EQ(AdvertisedAddress("planner.example:7070"), "planner.example:7070");
}

}  // namespace
}  // namespace hap::service
