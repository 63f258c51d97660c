#include "executor/comm/gloo_peer_name.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "gloo/common/logging.h"
#include "gloo/transport/tcp/address.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

// A listening socket on 127.0.0.1 at a free port.
int Listen(sockaddr_in* at) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 4) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return -1;
  }
  *at = addr;
  return fd;
}

// Connects to `at`, then closes with a reset (zero linger) or a FIN.
void ConnectAndClose(const sockaddr_in& at, bool reset) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&at), sizeof(at)), 0)
      << std::strerror(errno);
  if (reset) {
    linger off{};
    off.l_onoff = 1;
    off.l_linger = 0;
    ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_LINGER, &off, sizeof(off)), 0);
  }
  close(fd);
}

class GlooPeerNameTest : public ::testing::Test {
 protected:
  void SetUp() override {
    listener_ = Listen(&at_);
    ASSERT_GE(listener_, 0) << std::strerror(errno);
  }
  void TearDown() override {
    if (accepted_ >= 0) close(accepted_);
    if (listener_ >= 0) close(listener_);
  }
  // A connection accepted after its client closed it (reset or not).
  void AcceptClosed(bool reset) {
    ConnectAndClose(at_, reset);
    accepted_ = accept(listener_, nullptr, nullptr);
    ASSERT_GE(accepted_, 0) << std::strerror(errno);
  }
  sockaddr_in at_{};
  int listener_ = -1;
  int accepted_ = -1;
};

// The case that ended processes: Gloo's peer-name lookup of a connection
// reset before it was accepted. It used to throw (and, on Gloo's loop
// thread, terminate); now it gives an empty address.
TEST_F(GlooPeerNameTest, GlooLooksUpAResetConnectionAndGetsAnEmptyAddress) {
  AcceptClosed(/*reset=*/true);
  const int64_t before = GlooResetPeerLookups();
  gloo::transport::tcp::Address peer;
  ASSERT_NO_THROW(peer = gloo::transport::tcp::Address::fromPeerName(accepted_));
  EXPECT_EQ(peer.getSockaddr().ss_family, AF_UNSPEC);
  EXPECT_EQ(peer.str(), "[none]");
  EXPECT_EQ(GlooResetPeerLookups(), before + 1);
}

// Anyone else asking about the same connection hears what the C library
// says: it has no peer.
TEST_F(GlooPeerNameTest, OtherCallersStillGetENOTCONN) {
  AcceptClosed(/*reset=*/true);
  const int64_t before = GlooResetPeerLookups();
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  errno = 0;
  EXPECT_EQ(getpeername(accepted_, reinterpret_cast<sockaddr*>(&ss), &len), -1);
  EXPECT_EQ(errno, ENOTCONN);
  EXPECT_EQ(GlooResetPeerLookups(), before);
}

// A connection that is still there (closed with a FIN, so half open) gives
// Gloo its real peer: the client's address.
TEST_F(GlooPeerNameTest, GlooGetsTheRealPeerOfAConnectionThatIsThere) {
  AcceptClosed(/*reset=*/false);
  const gloo::transport::tcp::Address peer = gloo::transport::tcp::Address::fromPeerName(accepted_);
  ASSERT_EQ(peer.getSockaddr().ss_family, AF_INET);
  const auto& in = reinterpret_cast<const sockaddr_in&>(peer.getSockaddr());
  EXPECT_EQ(in.sin_addr.s_addr, htonl(INADDR_LOOPBACK));
  EXPECT_NE(in.sin_port, 0);
}

// Errors other than ENOTCONN reach Gloo as before (a descriptor that is not
// a socket: Gloo's check throws, as it always did).
TEST_F(GlooPeerNameTest, OtherErrorsReachGlooUnchanged) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  EXPECT_THROW(gloo::transport::tcp::Address::fromPeerName(pipe_fds[0]), gloo::EnforceNotMet);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
}

TEST(IsGlooPeerNameLookupTest, OnlyGloosLookupIsRecognised) {
  EXPECT_FALSE(IsGlooPeerNameLookup(nullptr));
  EXPECT_FALSE(IsGlooPeerNameLookup(reinterpret_cast<const void*>(&Listen)));
  EXPECT_FALSE(IsGlooPeerNameLookup(__builtin_return_address(0)));
}

}  // namespace
}  // namespace hap::executor
