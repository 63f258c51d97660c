// Token files, TLS files and the server-side token check as operators meet
// them: a token file as editors and `echo` write it, one readable by every
// user, one that is a directory or holds two lines; a TLS key that does not
// belong to its certificate; a server whose every method, unknown ones
// included, refuses a call without the token or with a wrong one, while the
// health checks stay open.
#include "common/grpc_util.h"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"

namespace hap::service {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

// A fresh directory under the test's temporary directory.
std::string TempDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  std::filesystem::path dir =
      std::filesystem::path(root != nullptr ? root : "/tmp") / ("grpc_util_test_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// Writes `content` to `dir`/`name` with permissions `mode`; its path.
std::string WriteFile(const std::string& dir, const std::string& name, const std::string& content,
                      mode_t mode = 0600) {
  const std::string path = dir + "/" + name;
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << content;
  }
  EXPECT_EQ(chmod(path.c_str(), mode), 0) << path;
  return path;
}

// What `fn` wrote to stderr.
template <typename Fn>
std::string StderrOf(Fn fn) {
  ::testing::internal::CaptureStderr();
  fn();
  return ::testing::internal::GetCapturedStderr();
}

TEST(ReadTokenFileTest, DropsTheLineEndAndSurroundingWhitespace) {
  const std::string dir = TempDir("token_ws");
  EXPECT_EQ(*ReadTokenFile(WriteFile(dir, "lf", "s3cret\n")), "s3cret");
  EXPECT_EQ(*ReadTokenFile(WriteFile(dir, "crlf", "s3cret\r\n")), "s3cret");
  EXPECT_EQ(*ReadTokenFile(WriteFile(dir, "blank", "s3cret \t\n\n")), "s3cret");
  EXPECT_EQ(*ReadTokenFile(""), "");
}

TEST(ReadTokenFileTest, LeadingWhitespaceIsDroppedToo) {
  // An HTTP client's "Authorization: Bearer  s3cret" reaches the status
  // page as "s3cret": a token kept with its leading blank would never match.
  const std::string dir = TempDir("token_lead");
  auto t = ReadTokenFile(WriteFile(dir, "lead", "  s3cret\n"));
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ(*t, "s3cret");
}

TEST(ReadTokenFileTest, AnEmptyTokenIsRefused) {
  const std::string dir = TempDir("token_empty");
  const std::string empty = WriteFile(dir, "empty", "");
  EXPECT_THAT(ReadTokenFile(empty),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'" + empty + "' is empty")));
  const std::string blank = WriteFile(dir, "blank", " \n\n");
  EXPECT_THAT(ReadTokenFile(blank),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'" + blank + "' is empty")));
  EXPECT_THAT(ReadTokenFile(dir + "/none"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("cannot read token file")));
}

TEST(ReadTokenFileTest, ADirectoryIsRefusedAsADirectory) {
  const std::string dir = TempDir("token_dir");
  EXPECT_THAT(ReadTokenFile(dir), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr(dir), HasSubstr("is a directory"))));
}

TEST(ReadTokenFileTest, ATokenThatCannotGoInAHeaderIsRefused) {
  // Two lines (a token and a comment, or two tokens pasted) would be sent
  // as one header value that gRPC refuses on every call.
  const std::string dir = TempDir("token_lines");
  const std::string two = WriteFile(dir, "two", "s3cret\nother\n");
  EXPECT_THAT(ReadTokenFile(two), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr(two), HasSubstr("printable ASCII"))));
  const std::string ctl = WriteFile(dir, "ctl", std::string("s3\0cret", 7));
  EXPECT_THAT(ReadTokenFile(ctl),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("printable ASCII")));
}

TEST(ReadTokenFileTest, AFileOthersCanReadIsWarnedAbout) {
  const std::string dir = TempDir("token_mode");
  const std::string open = WriteFile(dir, "open", "s3cret\n", 0644);
  absl::StatusOr<std::string> token;
  const std::string warning = StderrOf([&] { token = ReadTokenFile(open); });
  EXPECT_THAT(token, IsOk());
  EXPECT_THAT(warning,
              AllOf(HasSubstr("warning"), HasSubstr(open), HasSubstr("0644"), HasSubstr("chmod")));
  // Owner and group only (Kubernetes' secret volumes with defaultMode 0440):
  // no warning.
  const std::string group = WriteFile(dir, "group", "s3cret\n", 0440);
  EXPECT_THAT(StderrOf([&] { token = ReadTokenFile(group); }), IsEmpty());
  EXPECT_THAT(token, IsOk());
}

// A server with the token and the health service only, on 127.0.0.1:0.
class TokenServerTest : public ::testing::Test {
 protected:
  static constexpr char kToken[] = "s3cret";
  void SetUp() override {
    Security s;
    s.token = kToken;
    auto creds = MakeServerCredentials(s);
    ASSERT_THAT(creds, IsOk());
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", *creds, &port_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port_), {});
    ASSERT_THAT(channel, IsOk());
    channel_ = *channel;
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }
  // `method` with an empty request and these "authorization" values.
  absl::Status Call(const std::string& method, const std::vector<std::string>& authorization) {
    grpc::GenericStub stub(channel_);
    grpc::ClientContext ctx;
    for (const std::string& a : authorization) ctx.AddMetadata("authorization", a);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::ByteBuffer request, response;
    grpc::Status status;
    grpc::CompletionQueue cq;
    auto call = stub.PrepareUnaryCall(&ctx, method, request, &cq);
    call->StartCall();
    call->Finish(&response, &status, reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return FromGrpc(status);
  }

  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(TokenServerTest, EveryPathButHealthNeedsTheExactToken) {
  const std::string want = absl::StrCat("Bearer ", kToken);
  for (const char* path : {"/hap.v1.Planner/ListNodes", "/no.Such/Method",
                           "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                           "/grpc.health.v1.Health/Check/", "/grpc.health.v1.health/Check"}) {
    for (const std::vector<std::string>& auth : std::vector<std::vector<std::string>>{
             {},
             {"Bearer wrong"},
             {absl::StrCat("Bearer ", kToken, "x")},
             {absl::StrCat("Bearer ", std::string(kToken).substr(1))},
             {kToken},
             {"Bearer"},
             {"bearer s3creT"},
             {absl::StrCat("Basic ", kToken)},
         }) {
      EXPECT_THAT(Call(path, auth), StatusIs(absl::StatusCode::kUnauthenticated,
                                             HasSubstr("requires a bearer token")))
          << path << " with " << (auth.empty() ? "no token" : auth[0]);
    }
    // With the token (also after a wrong one) the call gets past the check.
    EXPECT_THAT(Call(path, {want}), Not(StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_)))
        << path;
    EXPECT_THAT(Call(path, {"Bearer wrong", want}),
                Not(StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_)))
        << path;
  }
  // Load balancers check health without credentials.
  EXPECT_THAT(Call("/grpc.health.v1.Health/Check", {}),
              Not(StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_)));
}

}  // namespace
}  // namespace hap::service
