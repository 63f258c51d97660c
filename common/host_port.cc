#include "common/host_port.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"

namespace hap::service {

bool IsHostPort(const std::string& address, int min_port, bool schemes) {
  if (schemes) {
    for (const char* scheme : {"dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:"}) {
      if (absl::StartsWith(address, scheme)) return true;
    }
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  const std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  const bool host_ok =
      !host.empty() && std::none_of(host.begin(), host.end(), absl::ascii_isspace) &&
      (host.find(':') == std::string::npos || (host.front() == '[' && host.back() == ']'));
  int number = -1;
  const bool port_ok = !port.empty() && port.size() <= 5 &&
                       std::all_of(port.begin(), port.end(), absl::ascii_isdigit) &&
                       absl::SimpleAtoi(port, &number) && number >= min_port && number <= 65535;
  return host_ok && port_ok;
}

}  // namespace hap::service
