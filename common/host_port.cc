#include "common/host_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace hap::service {

bool IsHostPort(const std::string& address, int min_port, bool schemes) {
  absl::string_view a = address;
  if (schemes) {
    for (const char* local : {"unix:", "unix-abstract:", "vsock:"}) {
      if (absl::StartsWith(a, local)) return true;
    }
    // The port of a resolved or literal target is checked as a plain one's.
    absl::ConsumePrefix(&a, "dns:///") || absl::ConsumePrefix(&a, "dns:") ||
        absl::ConsumePrefix(&a, "ipv4:") || absl::ConsumePrefix(&a, "ipv6:");
  }
  const size_t colon = a.rfind(':');
  if (colon == absl::string_view::npos) return false;
  const absl::string_view host = a.substr(0, colon);
  const absl::string_view port = a.substr(colon + 1);
  const bool host_ok =
      !host.empty() && std::none_of(host.begin(), host.end(), absl::ascii_isspace) &&
      (host.find(':') == absl::string_view::npos || (host.front() == '[' && host.back() == ']'));
  int number = -1;
  const bool port_ok = !port.empty() && port.size() <= 5 &&
                       std::all_of(port.begin(), port.end(), absl::ascii_isdigit) &&
                       absl::SimpleAtoi(port, &number) && number >= min_port && number <= 65535;
  return host_ok && port_ok;
}

std::string BracketIpv6Host(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || address.empty() || address.front() == '[') return address;
  const std::string host = address.substr(0, colon);
  in6_addr parsed;
  if (host.find(':') == std::string::npos || inet_pton(AF_INET6, host.c_str(), &parsed) != 1) {
    return address;
  }
  return absl::StrCat("[", host, "]", address.substr(colon));
}

bool IsLocalOnlyAddress(const std::string& address) {
  absl::string_view a = address;
  for (const char* local : {"unix:", "unix-abstract:", "vsock:"}) {
    if (absl::StartsWith(a, local)) return true;
  }
  absl::ConsumePrefix(&a, "dns:///") || absl::ConsumePrefix(&a, "dns:") ||
      absl::ConsumePrefix(&a, "ipv4:") || absl::ConsumePrefix(&a, "ipv6:");
  const size_t colon = a.rfind(':');
  const absl::string_view host = colon == absl::string_view::npos ? a : a.substr(0, colon);
  return absl::StartsWith(host, "127.") || absl::EqualsIgnoreCase(host, "localhost") ||
         host == "[::1]";
}

std::string AdvertisedAddress(const std::string& bound) {
  const size_t colon = bound.rfind(':');
  std::string host = bound.substr(0, colon == std::string::npos ? bound.size() : colon);
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::") {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') host = name;
  }
  return colon == std::string::npos ? host : absl::StrCat(host, bound.substr(colon));
}

}  // namespace hap::service
