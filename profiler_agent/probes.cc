// Host facts (memory, cgroup limits) and the assembly of a node profile.
// The CPU's BLAS measurements live in cpu_prober.cc.
#include "profiler_agent/probes.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace hap::agent {
namespace {

class RealSystemFiles : public SystemFiles {
 public:
  absl::StatusOr<std::string> Read(const std::string& path) const override {
    std::ifstream f(path);
    if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", path));
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
};

// Limits at or above this are cgroup v1's way of saying "no limit"
// (9223372036854771712, the page-aligned INT64_MAX).
constexpr int64_t kNoLimit = int64_t{1} << 60;

// The cgroup directories whose limits apply to this process for one
// controller, leaf first: for each line of /proc/self/cgroup naming the
// controller (cgroup v1) or the unified hierarchy (v2, "0::"), its path under
// each mount point, then every parent up to the mount root. Inside a
// container the path of /proc/self/cgroup may not exist under the mount (it
// is the host's); walking up still reaches the container's own root.
std::vector<std::string> CgroupDirs(const SystemFiles& files, const std::string& controller,
                                    const std::vector<std::string>& v1_mounts) {
  std::vector<std::string> dirs;
  auto add_walk = [&dirs](const std::string& mount, std::string path) {
    while (true) {
      dirs.push_back(path == "/" ? mount : mount + path);
      if (path == "/" || path.empty()) break;
      size_t slash = path.rfind('/');
      path = slash == 0 ? "/" : path.substr(0, slash);
    }
  };
  auto cgroup = files.Read("/proc/self/cgroup");
  if (!cgroup.ok()) {
    for (const auto& m : v1_mounts) dirs.push_back(m);
    dirs.push_back("/sys/fs/cgroup");
    return dirs;
  }
  for (absl::string_view line : absl::StrSplit(*cgroup, '\n', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3 || parts[2].empty() || parts[2][0] != '/') continue;
    if (parts[0] == "0" && parts[1].empty()) {
      add_walk("/sys/fs/cgroup", parts[2]);
      continue;
    }
    for (absl::string_view c : absl::StrSplit(parts[1], ',')) {
      if (c != controller) continue;
      for (const auto& m : v1_mounts) add_walk(m, parts[2]);
    }
  }
  return dirs;
}

// A limit file's number; nullopt for "max", a missing file, garbage or a
// value meaning "no limit".
std::optional<int64_t> ReadLimit(const SystemFiles& files, const std::string& path) {
  auto text = files.Read(path);
  if (!text.ok()) return std::nullopt;
  int64_t v;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &v) || v <= 0 || v >= kNoLimit) {
    return std::nullopt;
  }
  return v;
}

}  // namespace

const SystemFiles& SystemFiles::Real() {
  static const SystemFiles* const real = new RealSystemFiles();
  return *real;
}

absl::StatusOr<int64_t> ReadMemoryBytes(const SystemFiles& files) {
  HAP_ASSIGN_OR_RETURN(std::string meminfo, files.Read("/proc/meminfo"));
  int64_t total = -1;
  for (absl::string_view line : absl::StrSplit(meminfo, '\n', absl::SkipEmpty())) {
    if (!absl::ConsumePrefix(&line, "MemTotal:")) continue;
    line = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumeSuffix(&line, "kB")) break;
    int64_t kib;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib) && kib > 0) {
      // Past this, kB x 1024 overflowed (18014398509481985 kB came out as 1 KiB).
      if (kib > std::numeric_limits<int64_t>::max() / 1024) {
        return absl::InternalError(
            absl::StrCat("/proc/meminfo says MemTotal ", kib, " kB, more bytes than 64 bits hold"));
      }
      total = kib * 1024;
    }
    break;
  }
  if (total <= 0) {
    return absl::InternalError("/proc/meminfo has no readable 'MemTotal: N kB' line");
  }
  for (const std::string& dir : CgroupDirs(files, "memory", {"/sys/fs/cgroup/memory"})) {
    for (const char* file : {"/memory.limit_in_bytes", "/memory.max"}) {
      if (auto limit = ReadLimit(files, dir + file)) total = std::min(total, *limit);
    }
  }
  return total;
}

std::optional<double> ReadCpuQuota(const SystemFiles& files) {
  std::optional<double> cpus;
  auto take = [&cpus](double quota, double period) {
    if (quota > 0 && period > 0) cpus = std::min(cpus.value_or(quota / period), quota / period);
  };
  for (const std::string& dir :
       CgroupDirs(files, "cpu", {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"})) {
    // cgroup v1: quota -1 means none.
    auto quota = ReadLimit(files, dir + "/cpu.cfs_quota_us");
    auto period = ReadLimit(files, dir + "/cpu.cfs_period_us");
    if (quota && period) take(static_cast<double>(*quota), static_cast<double>(*period));
    // cgroup v2: "max 100000" or "50000 100000".
    if (auto v2 = files.Read(dir + "/cpu.max"); v2.ok()) {
      std::vector<std::string> f =
          absl::StrSplit(absl::StripAsciiWhitespace(*v2), ' ', absl::SkipEmpty());
      double q, p;
      if (f.size() == 2 && absl::SimpleAtod(f[0], &q) && absl::SimpleAtod(f[1], &p)) take(q, p);
    }
  }
  return cpus;
}

absl::Status CheckNotStopped(const ProbeOptions& options, const std::string& what) {
  if (!options.stop || !options.stop()) return absl::OkStatus();
  return absl::CancelledError(
      absl::StrCat("the probe was stopped (the agent shuts down) before ", what));
}

absl::StatusOr<hap::v1::Node> ProbeNode(const std::string& name, const std::string& address,
                                        absl::Span<DeviceProber* const> probers,
                                        const ProbeOptions& options) {
  hap::v1::Node node;
  node.set_name(name);
  node.set_address(address);
  for (size_t i = 0; i < probers.size(); ++i) {
    auto devices = probers[i]->Probe(name, options);
    if (!devices.ok()) {
      return Annotate(devices.status(), absl::StrCat("probing devices (prober ", i, ")"));
    }
    for (auto& d : *devices) *node.add_devices() = std::move(d);
  }
  if (node.devices().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("node '", name, "': the probes found no device"));
  }
  return node;
}

absl::StatusOr<std::vector<hap::v1::Link>> ProbeNodeLinks(const std::string& name,
                                                          absl::Span<DeviceProber* const> probers,
                                                          const ProbeOptions& options) {
  std::vector<hap::v1::Link> links;
  for (size_t i = 0; i < probers.size(); ++i) {
    auto some = probers[i]->ProbeLinks(name, options);
    if (!some.ok()) {
      return Annotate(some.status(),
                      absl::StrCat("probing links between devices (prober ", i, ")"));
    }
    for (auto& l : *some) links.push_back(std::move(l));
  }
  return links;
}

}  // namespace hap::agent
