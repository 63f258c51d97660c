// Token files, TLS files and the server-side token check as operators meet
// them: a token file as editors and `echo` write it, one readable by every
// user, one that is a directory or holds two lines; a TLS key that does not
// belong to its certificate; a server whose every method, unknown ones
// included, refuses a call without the token or with a wrong one, while the
// health checks stay open.
#include "common/grpc_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/grpc_test_util.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
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
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("cannot open token file")));
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

// A self-signed certificate and its key for 127.0.0.1 in `dir` (openssl,
// as tests/planner_service_test does): {cert, key}.
std::pair<std::string, std::string> MakeCertificate(const std::string& dir,
                                                    const std::string& name) {
  const std::string cert = dir + "/" + name + ".crt", key = dir + "/" + name + ".key";
  const std::string cmd =
      absl::StrCat("openssl req -x509 -newkey rsa:2048 -nodes -keyout ", key, " -out ", cert,
                   " -days 2 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 2>/dev/null");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "openssl could not make a test certificate";
  EXPECT_EQ(chmod(key.c_str(), 0600), 0);
  return {cert, key};
}

TEST(MakeServerCredentialsTest, AKeyThatIsNotTheCertificatesIsRefusedAtStart) {
  const std::string dir = TempDir("tls_mismatch");
  auto [cert_a, key_a] = MakeCertificate(dir, "a");
  auto [cert_b, key_b] = MakeCertificate(dir, "b");
  Security s;
  s.tls_cert_file = cert_a;
  s.tls_key_file = key_a;
  EXPECT_THAT(MakeServerCredentials(s), IsOk());
  s.tls_key_file = key_b;
  EXPECT_THAT(MakeServerCredentials(s),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(key_b), HasSubstr(cert_a), HasSubstr("does not match"))));
}

TEST(MakeServerCredentialsTest, FilesThatHoldNoPemAreRefusedAtStart) {
  const std::string dir = TempDir("tls_garbage");
  auto [cert, key] = MakeCertificate(dir, "a");
  const std::string junk = WriteFile(dir, "junk", "not a PEM file\n");
  Security s;
  s.tls_cert_file = junk;
  s.tls_key_file = key;
  EXPECT_THAT(MakeServerCredentials(s),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(junk), HasSubstr("no PEM certificate"))));
  s.tls_cert_file = cert;
  s.tls_key_file = junk;
  EXPECT_THAT(MakeServerCredentials(s),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(junk), HasSubstr("no PEM private key"))));
}

TEST(MakeServerCredentialsTest, AKeyOthersCanReadIsWarnedAbout) {
  const std::string dir = TempDir("tls_mode");
  auto [cert, key] = MakeCertificate(dir, "a");
  ASSERT_EQ(chmod(key.c_str(), 0644), 0);
  Security s;
  s.tls_cert_file = cert;
  s.tls_key_file = key;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds;
  EXPECT_THAT(StderrOf([&] { creds = MakeServerCredentials(s); }),
              AllOf(HasSubstr("warning"), HasSubstr(key), HasSubstr("0644")));
  EXPECT_THAT(creds, IsOk());
  ASSERT_EQ(chmod(key.c_str(), 0600), 0);
  EXPECT_THAT(StderrOf([&] { creds = MakeServerCredentials(s); }), IsEmpty());
}

// A client and a server that disagree about TLS, or a gRPC client at an
// HTTP port, got gRPC's transport message alone ("Socket closed", "wrong
// version number", "Trying to connect an http1.x server"): the error now
// says what to change.
TEST(FromGrpcTest, TransportErrorsSayWhatToChange) {
  const std::string dir = TempDir("tls_mismatch_hint");
  auto [cert, key] = MakeCertificate(dir, "a");
  grpc::EnableDefaultHealthCheckService(true);
  auto serve = [](const Security& s, int* port) {
    auto creds = MakeServerCredentials(s);
    EXPECT_THAT(creds, IsOk());
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", *creds, port);
    return b.BuildAndStart();
  };
  auto health = [](const std::string& address, const Security& s) {
    auto channel = MakeChannel(address, s);
    EXPECT_THAT(channel, IsOk());
    return testing::RawCall(*channel, "/grpc.health.v1.Health/Check", "", {});
  };
  Security tls;
  tls.tls_cert_file = cert;
  tls.tls_key_file = key;
  int tls_port = 0, plain_port = 0;
  auto tls_server = serve(tls, &tls_port);
  auto plain_server = serve(Security{}, &plain_port);
  ASSERT_NE(tls_server, nullptr);
  ASSERT_NE(plain_server, nullptr);
  const std::string tls_address = absl::StrCat("127.0.0.1:", tls_port);
  const std::string plain_address = absl::StrCat("127.0.0.1:", plain_port);
  Security verifying;
  verifying.tls_ca_file = cert;
  // Matching sides work.
  EXPECT_THAT(health(tls_address, verifying), IsOk());
  EXPECT_THAT(health(plain_address, {}), IsOk());
  // A plaintext client at a TLS server; a TLS client at a plaintext one.
  EXPECT_THAT(health(tls_address, {}),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("Socket closed"), HasSubstr("--tls-ca-file"))));
  EXPECT_THAT(health(plain_address, verifying),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("wrong version number"), HasSubstr("does not serve TLS"))));
  // An HTTP/1 server (the planner's /metrics port, say).
  int http_fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(http_fd, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(http_fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(listen(http_fd, 4), 0);
  socklen_t len = sizeof sa;
  ASSERT_EQ(getsockname(http_fd, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  std::thread http([http_fd] {
    int c = accept(http_fd, nullptr, nullptr);
    if (c < 0) return;
    const char reply[] = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
    (void)!write(c, reply, sizeof reply - 1);
    char buf[512];
    while (read(c, buf, sizeof buf) > 0) {
    }
    close(c);
  });
  EXPECT_THAT(health(absl::StrCat("127.0.0.1:", ntohs(sa.sin_port)), {}),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("http1.x"), HasSubstr("serves HTTP, not gRPC"))));
  shutdown(http_fd, SHUT_RDWR);
  close(http_fd);
  http.join();
  tls_server->Shutdown();
  plain_server->Shutdown();
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
  absl::Status Call(const std::string& method, const std::vector<std::string>& authorization) {
    return testing::RawCall(channel_, method, "", authorization);
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
    for (const std::vector<std::string>& auth : testing::WrongAuthorizations(kToken)) {
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
