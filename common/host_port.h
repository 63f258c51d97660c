// Network addresses as flags and requests give them.
#ifndef HAP_COMMON_HOST_PORT_H_
#define HAP_COMMON_HOST_PORT_H_

#include <string>

namespace hap::service {

// True for an address gRPC reads as it is meant: HOST:PORT (an IPv6 host in
// brackets, no spaces) with a port from `min_port` to 65535, or, when
// `schemes`, a target with its scheme: unix:PATH (unix-abstract:, vsock:),
// or dns:///H:P, dns:H:P, ipv4:A:P, ipv6:[A]:P with the port checked.
// gRPC takes a port past 65535 modulo 65536 ('127.0.0.1:99999' is port
// 34463), none or a word as port 0, and binds a listen address without a
// port at 443; each would be used as if it were what was asked for.
bool IsHostPort(const std::string& address, int min_port = 1, bool schemes = false);

// A bound HOST:PORT as others should dial it: a wildcard or empty host
// (0.0.0.0, [::], ::) becomes this machine's host name (gethostname), which
// a peer can resolve; any other address is returned as it is.
std::string AdvertisedAddress(const std::string& bound);

// `address` with an IPv6 host put in brackets when it came without
// ("fd00::5:7071" -> "[fd00::5]:7071"; the last group is the port): what a
// Kubernetes manifest's "$(POD_IP):PORT" gives on an IPv6 cluster, which
// cannot add the brackets only there. Anything else is returned as it is.
std::string BracketIpv6Host(const std::string& address);

// Whether the host of `address` (HOST:PORT, or a gRPC target with its
// scheme: dns:///, ipv4:, ipv6:, unix: ...) is this machine only: 127.x.x.x,
// localhost, [::1], or a local socket (unix:, unix-abstract:, vsock:).
bool IsLocalOnlyAddress(const std::string& address);

}  // namespace hap::service

#endif  // HAP_COMMON_HOST_PORT_H_
