#include "profiler_agent/agent_flags.h"

#include <cstdlib>
#include <fstream>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::agent {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

absl::StatusOr<AgentOptions> FromArgv(const std::vector<std::string>& argv) {
  auto args = hap::tools::Args::Parse(argv, AgentValueFlags(), {"help"});
  if (!args.ok()) return args.status();
  return AgentOptionsFromArgs(*args);
}

TEST(AgentFlagsTest, ANodeNameThePlannerRefusesIsAFlagError) {
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--name", "bad name/x"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("--name (or HAP_NAME) 'bad name/x'"),
                                        HasSubstr("1-253 letters, digits"))));
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--name", "node-0.rack_1"}), IsOk());
}

TEST(AgentFlagsTest, DefaultsAndTheFlagWinningOverTheEnvironment) {
  setenv("HAP_PLANNER", "env-planner:1", 1);
  setenv("HAP_DRIFT", "0.5", 1);
  auto o = FromArgv({"--planner", "flag-planner:2", "--heartbeat-seconds=1.5"});
  unsetenv("HAP_PLANNER");
  unsetenv("HAP_DRIFT");
  ASSERT_THAT(o, IsOk());
  EXPECT_EQ(o->planner, "flag-planner:2");
  EXPECT_EQ(o->drift, 0.5);
  EXPECT_EQ(o->heartbeat_interval, absl::Milliseconds(1500));
  EXPECT_FALSE(o->name.empty());  // the hostname
  EXPECT_EQ(o->listen, "127.0.0.1:0");
  EXPECT_EQ(o->probe.max_duration, absl::Seconds(2));
  EXPECT_EQ(o->probe.threads, 0);
  EXPECT_TRUE(o->security.token.empty());
  EXPECT_EQ(o->devices, DeviceSelection::kAuto);
}

TEST(AgentFlagsTest, DevicesFromTheFlagOrHapDevices) {
  setenv("HAP_DEVICES", "gpu", 1);
  auto from_env = FromArgv({"--planner", "p:1"});
  auto from_flag = FromArgv({"--planner", "p:1", "--devices", "cpu"});
  unsetenv("HAP_DEVICES");
  ASSERT_THAT(from_env, IsOk());
  EXPECT_EQ(from_env->devices, DeviceSelection::kGpu);
  ASSERT_THAT(from_flag, IsOk());
  EXPECT_EQ(from_flag->devices, DeviceSelection::kCpu);
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--devices", "tpu"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--devices (or HAP_DEVICES) must be auto, cpu or gpu")));
}

TEST(AgentFlagsTest, LinkProbeDelay) {
  auto none = FromArgv({"--planner", "p:1"});
  ASSERT_THAT(none, IsOk());
  EXPECT_EQ(none->link_probe_delay, absl::ZeroDuration());
  auto later = FromArgv({"--planner", "p:1", "--link-probe-delay", "90"});
  ASSERT_THAT(later, IsOk());
  EXPECT_EQ(later->link_probe_delay, absl::Seconds(90));
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--link-probe-delay", "-1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--link-probe-delay")));
}

TEST(AgentFlagsTest, Executors) {
  auto o = FromArgv({"--planner", "p:1", "--executor", "127.0.0.1:7101", "--executor=h:7102"});
  ASSERT_THAT(o, IsOk());
  EXPECT_EQ(o->executors, (std::vector<std::string>{"127.0.0.1:7101", "h:7102"}));
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--executor", "7101"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--executor (or HAP_EXECUTOR) '7101' must be HOST:PORT")));
}

// An argument that is no flag's value is an error naming it: it was dropped
// without a word, so `--executor A B` labelled the node with A alone and
// `--planner P node0` ran as the hostname, not node0.
TEST(AgentFlagsTest, AnArgumentThatIsNoFlagsValueIsAnErrorNamingIt) {
  EXPECT_THAT(
      FromArgv({"--planner", "p:1", "--executor", "h:7101", "h:7102"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unexpected argument 'h:7102'")));
  EXPECT_THAT(
      FromArgv({"--planner", "p:1", "node0"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unexpected argument 'node0'")));
}

// --listen, --advertise and --executor are HOST:PORT with a port in range:
// gRPC bound "127.0.0.1" at port 443 and "127.0.0.1:99999" at 34463 (the
// port modulo 65536), and the agent printed that as if asked for it; an
// advertised port 0 or none is one no peer can dial.
TEST(AgentFlagsTest, AddressesAreHostAndPortInRange) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"listen", "127.0.0.1"},    {"listen", "127.0.0.1:99999"}, {"listen", "127.0.0.1:-5"},
      {"listen", ":7000"},        {"listen", "127.0.0.1:x"},     {"advertise", "node-a"},
      {"advertise", "node-a:0"},  {"advertise", "node-a:70000"}, {"executor", "h:99999"},
      {"executor", "127.0.0.1:0"}};
  for (const auto& [flag, value] : bad) {
    EXPECT_THAT(FromArgv({"--planner", "p:1", "--" + flag, value}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr("--" + flag), HasSubstr("'" + value + "'"),
                                          HasSubstr("HOST:PORT"))))
        << flag << " " << value;
  }
  auto o = FromArgv({"--planner", "p:1", "--listen", "[::1]:0", "--advertise", "[fe80::1]:7000",
                     "--executor", "h:65535"});
  ASSERT_THAT(o, IsOk());
  EXPECT_EQ(o->listen, "[::1]:0");
  EXPECT_EQ(o->advertise, "[fe80::1]:7000");
  // The manifests' $(POD_IP):7071 and $(HOST_IP):7100 on an IPv6 cluster:
  // the host without brackets (refused before: every agent pod exited 2).
  o = FromArgv({"--planner", "p:1", "--advertise", "fd00::5:7071", "--executor", "fd00::9:7100"});
  ASSERT_THAT(o, IsOk());
  EXPECT_EQ(o->advertise, "[fd00::5]:7071");
  EXPECT_EQ(o->executors, std::vector<std::string>{"[fd00::9]:7100"});
}

// --planner was taken as given: without a port gRPC dialled 443, past 65535
// the port modulo 65536 ('p:99999' is p:34463), and the agent retried a
// registration there for ever, its log saying only UNAVAILABLE. It is now
// checked as hap-executor checks its --planner.
TEST(AgentFlagsTest, ThePlannerIsHostAndPortInRangeOrATarget) {
  for (const std::string bad :
       {"127.0.0.1", "p:99999", "p:0", "p:", "planner:http", "dns:///p:70000", "a b:1"}) {
    EXPECT_THAT(FromArgv({"--planner", bad}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr("--planner (or HAP_PLANNER)"),
                                          HasSubstr("'" + bad + "'"), HasSubstr("HOST:PORT"))))
        << bad;
  }
  for (const std::string good : {"p:1", "planner.hap.svc:7070", "[::1]:7070", "dns:///planner:7070",
                                 "unix:/run/hap/planner.sock"}) {
    auto o = FromArgv({"--planner", good});
    ASSERT_THAT(o, IsOk()) << good;
    EXPECT_EQ(o->planner, good);
  }
}

TEST(AgentFlagsTest, ReadsTheTokenFile) {
  std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/token";
  std::ofstream(path) << "s3cret\n";
  auto o = FromArgv({"--planner", "p:1", "--token-file", path});
  ASSERT_THAT(o, IsOk());
  EXPECT_EQ(o->security.token, "s3cret");
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--token-file", path + ".missing"}),
              StatusIs(absl::StatusCode::kNotFound,
                       ::testing::AllOf(HasSubstr("--token-file (or HAP_TOKEN_FILE)"),
                                        HasSubstr(path + ".missing"))));
  // A directory, or a file of no token, names the flag too.
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--token-file", std::getenv("TEST_TMPDIR")}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("--token-file"), HasSubstr("is a directory"))));
}

// TLS files that cannot serve (a certificate without its key, a file that
// is not there) are flag errors naming the flag (exit 2): they stopped the
// agent only at start (exit 1), naming neither flag.
TEST(AgentFlagsTest, TlsFilesThatCannotServeAreFlagErrors) {
  const std::string missing = std::string(std::getenv("TEST_TMPDIR")) + "/missing.pem";
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--tls-cert-file", missing}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("--tls-cert-file"), HasSubstr("--tls-key-file"),
                                        HasSubstr("both a certificate and a key"))));
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--tls-cert-file", missing, "--tls-key-file", missing}),
              StatusIs(absl::StatusCode::kNotFound,
                       ::testing::AllOf(HasSubstr("--tls-cert-file"), HasSubstr(missing))));
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--tls-ca-file", missing}),
              StatusIs(absl::StatusCode::kNotFound,
                       ::testing::AllOf(HasSubstr("--tls-ca-file"), HasSubstr(missing))));
}

TEST(AgentFlagsTest, ErrorsNameTheFlag) {
  EXPECT_THAT(FromArgv({}), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("--planner HOST:PORT (or HAP_PLANNER)")));
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--probe-seconds", "0"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--probe-seconds")));
  EXPECT_THAT(FromArgv({"--planner", "p:1", "--threads", "many"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("HAP_THREADS")));
}

// --heartbeat-seconds is 0 (the planner's) or within hap-planner's own range
// (1e-9 heartbeated in a loop, 1e300 never); --threads is a whole number up
// to 4096 (2.5 ran 2 threads, 1e9 4096, silently).
TEST(AgentFlagsTest, NumbersOutOfRangeAreRefusedNamingTheFlagAndValue) {
  const std::vector<std::pair<std::string, std::string>> bad = {{"heartbeat-seconds", "1e-9"},
                                                                {"heartbeat-seconds", "0.001"},
                                                                {"heartbeat-seconds", "1e300"},
                                                                {"heartbeat-seconds", "7200"},
                                                                {"threads", "2.5"},
                                                                {"threads", "1e9"},
                                                                {"threads", "-1"}};
  for (const auto& [flag, value] : bad) {
    EXPECT_THAT(FromArgv({"--planner", "p:1", "--" + flag, value}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr("--" + flag), HasSubstr("'" + value + "'"))))
        << flag << " " << value;
  }
  for (const std::string value : {"0", "0.01", "3600"}) {
    auto o = FromArgv({"--planner", "p:1", "--heartbeat-seconds", value, "--threads", "4096"});
    ASSERT_THAT(o, IsOk()) << value;
    EXPECT_EQ(o->probe.threads, 4096);
  }
}

}  // namespace
}  // namespace hap::agent
