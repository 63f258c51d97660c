// What hap-executor (one rank, run_plan.cc) and hap-launch (its ranks on
// this machine, launch.cc) share: their flags, the plan file, the checks of
// a run's flags before anything connects, standard streams, and the file by
// which a rank says it lost a peer.
#ifndef HAP_EXECUTOR_CLI_RUN_FLAGS_H_
#define HAP_EXECUTOR_CLI_RUN_FLAGS_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cli_args.h"
#include "hap/v1/plan.pb.h"

namespace hap::executor {

// Steps a --profile run leaves out (warm-up) before it times kernels.
inline constexpr int64_t kProfileWarmup = 2;

inline constexpr char kClosedStdout[] =
    "standard output is closed; the run writes its losses and final line there (redirect it, "
    "to /dev/null to drop them)";

// The file in the rendezvous directory by which rank R says that its
// training failed because a peer's connection did: the peer failed first,
// and hap-launch names that one (the rank exits 1 all the same).
std::string LostPeerMarker(const std::string& rendezvous, int64_t rank);

// The plan file: InvalidArgument for one that is not a regular file (a
// FIFO, a pipe: every rank reads it itself) or not a hap.v1.Plan.
absl::StatusOr<hap::v1::Plan> ReadPlan(const std::string& path);

// The flags of a command line (hap-executor's and hap-launch's value flags,
// `bool_flags`); a word that is not a flag or a flag's value is refused.
absl::StatusOr<tools::Args> ParseFlags(const std::vector<std::string>& argv,
                                       const std::set<std::string>& bool_flags);

// Writes `text` to `fd` in one write where the system allows (the ranks of
// hap-launch share one standard error).
void WriteWhole(int fd, absl::string_view text);

// OK when directory `dir` exists or can be made by this process; otherwise
// InvalidArgument naming `flag` and that path.
absl::Status CheckWritableDir(const std::string& flag, const std::string& dir);

// The run's flags that need neither the plan nor a peer, checked before
// anything connects (by hap-executor, and by hap-launch once before it
// starts any rank). `last_rank`: the highest rank that runs with them.
absl::Status CheckRunFlags(const tools::Args& a, int64_t last_rank);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_CLI_RUN_FLAGS_H_
