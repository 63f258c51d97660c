#include "tests/service_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace hap::testing {

std::string Runfile(const std::string& path) {
  const char* src = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  if (src && ws) return absl::StrCat(src, "/", ws, "/", path);
  return path;
}

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base ? base : "/tmp", "/", name, "-", getpid(), "-",
                                 absl::ToUnixMicros(absl::Now()));
  std::filesystem::create_directories(dir);
  return dir;
}

Process::~Process() {
  if (pid_ > 0 && Running()) Stop(SIGKILL, absl::Seconds(5));
  if (fd_ >= 0) close(fd_);
}

absl::Status Process::Start(const std::vector<std::string>& argv,
                            const std::vector<std::string>& env) {
  int p[2];
  if (pipe(p) != 0) return absl::InternalError("pipe failed");
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    dup2(p[1], 1);
    dup2(p[1], 2);
    close(p[0]);
    close(p[1]);
    for (const auto& e : env) putenv(strdup(e.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(strdup(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::cerr << "cannot exec " << argv[0] << "\n";
    _exit(127);
  }
  close(p[1]);
  fd_ = p[0];
  pid_ = pid;
  return absl::OkStatus();
}

absl::StatusOr<std::string> Process::WaitForLine(const std::string& prefix,
                                                 absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    size_t nl;
    while ((nl = buffer_.find('\n')) != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      if (absl::StartsWith(line, prefix)) return line.substr(prefix.size());
    }
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("no line starting with '", prefix, "'; output so far:\n", out_));
    }
    pollfd pf{fd_, POLLIN, 0};
    int r = poll(&pf, 1, static_cast<int>(absl::ToInt64Milliseconds(left)));
    if (r <= 0) continue;
    char buf[4096];
    ssize_t n = read(fd_, buf, sizeof(buf));
    if (n <= 0) {
      return absl::UnavailableError(
          absl::StrCat("the process ended before '", prefix, "'; output:\n", out_));
    }
    out_.append(buf, n);
    buffer_.append(buf, n);
  }
}

bool Process::Running() {
  if (pid_ <= 0) return false;
  int status;
  return waitpid(pid_, &status, WNOHANG) == 0;
}

int Process::Stop(int sig, absl::Duration timeout) {
  if (pid_ <= 0) return -1;
  kill(pid_, sig);
  absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (true) {
    // Drain output so the child never blocks on a full pipe.
    char buf[4096];
    pollfd pf{fd_, POLLIN, 0};
    while (poll(&pf, 1, 0) > 0) {
      ssize_t n = read(fd_, buf, sizeof(buf));
      if (n <= 0) break;
      out_.append(buf, n);
    }
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) break;
    if (absl::Now() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  pid_ = -1;
  return status;
}

int FreePort() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(s);
  return port;
}

int ConnectLoopback(int port, absl::Duration timeout) {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) return -1;
  timeval tv{static_cast<time_t>(absl::ToInt64Seconds(timeout)), 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(s);
    return -1;
  }
  return s;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path, absl::Duration timeout,
                                    const std::string& bearer) {
  const int s = ConnectLoopback(port, timeout);
  if (s < 0) return absl::UnavailableError(absl::StrCat("cannot connect to 127.0.0.1:", port));
  std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n",
                                 bearer.empty() ? "" : absl::StrCat("Authorization: Bearer ",
                                                                    bearer, "\r\n"),
                                 "\r\n");
  (void)!write(s, req.data(), req.size());
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = read(s, buf, sizeof(buf))) > 0) resp.append(buf, n);
  close(s);
  size_t body = resp.find("\r\n\r\n");
  if (body == std::string::npos) return absl::UnavailableError("no HTTP response");
  if (resp.find(" 200 ") == std::string::npos || resp.find(" 200 ") > resp.find("\r\n")) {
    return absl::UnavailableError(absl::StrCat("HTTP error: ", resp.substr(0, resp.find("\r\n"))));
  }
  return resp.substr(body + 4);
}

}  // namespace hap::testing
