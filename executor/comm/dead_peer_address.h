// For tests of a rank that published its address and died: Gloo's
// full-mesh rendezvous value of a rank (its pairs' addresses, each a
// sockaddr first) with the first address's port set to 65535, where nobody
// listens. A peer that reads it as another rank's address waits in Gloo's
// connect for a connection that never comes. Empty when `published` holds
// no IPv4 address or has that port already.
#ifndef HAP_EXECUTOR_COMM_DEAD_PEER_ADDRESS_H_
#define HAP_EXECUTOR_COMM_DEAD_PEER_ADDRESS_H_

#include <netinet/in.h>

#include <cstring>
#include <string>

namespace hap::executor {

inline std::string AtAPortNobodyListensOn(std::string published) {
  sockaddr_in addr{};
  if (published.size() < sizeof(addr)) return "";
  std::memcpy(&addr, published.data(), sizeof(addr));
  if (addr.sin_family != AF_INET || addr.sin_port == 0xffff) return "";
  addr.sin_port = 0xffff;
  std::memcpy(published.data(), &addr, sizeof(addr));
  return published;
}

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_DEAD_PEER_ADDRESS_H_
