// A small argument parser for hapctl's subcommands: "--flag value",
// "--flag=value", boolean "--flag", repeated "--set k=v", positionals.
#ifndef HAP_COMMON_CLI_ARGS_H_
#define HAP_COMMON_CLI_ARGS_H_

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace hap::tools {

// A command-line argument as Args::Parse reads a flag: the NAME of -NAME,
// --NAME, -NAME=VALUE or --NAME=VALUE, with the VALUE when given inline;
// nullopt for anything else ("-", a positional argument).
struct FlagArg {
  std::string name;
  std::optional<std::string> value;
};
std::optional<FlagArg> ParseFlagArg(const std::string& arg);

class Args {
 public:
  // `value_flags` take a value; `bool_flags` do not. Anything else starting
  // with "--" is an error naming the flag.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& argv,
                                    const std::set<std::string>& value_flags,
                                    const std::set<std::string>& bool_flags);

  bool Has(const std::string& flag) const { return values_.count(flag) > 0; }
  std::string Get(const std::string& flag, const std::string& def = "") const;
  // The convention of every HAP binary: --some-flag, else the environment
  // variable HAP_SOME_FLAG, else `def`.
  std::string GetOrEnv(const std::string& flag, const std::string& def = "") const;
  static std::string EnvName(const std::string& flag);  // "some-flag" -> "HAP_SOME_FLAG"
  std::vector<std::string> GetAll(const std::string& flag) const;
  bool Bool(const std::string& flag) const { return Has(flag); }
  absl::StatusOr<double> Number(const std::string& flag, double def) const;
  // A number from --flag, else HAP_FLAG, else `def`: finite, from `lo` to
  // `hi` (no upper bound when `hi` is infinite) and whole when `whole`;
  // otherwise an error naming the flag, the variable, the range and the
  // value (the bounds keep casts defined and durations finite).
  absl::StatusOr<double> NumberOrEnv(const std::string& flag, double def, double lo,
                                     double hi = std::numeric_limits<double>::infinity(),
                                     bool whole = false) const;
  // A whole number in [min, max] ("12", or "1e3" as a Number); anything
  // else (fractions, nan, out of range) is an error naming the flag.
  absl::StatusOr<int64_t> Integer(const std::string& flag, int64_t def, int64_t min,
                                  int64_t max) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::multimap<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// The bytes of an input file a flag names; a missing, unreadable or empty
// file or a directory is an error naming it, `what` first ("plan " -> "plan
// 'p.pb' is empty"): an empty string parses as an empty proto, which then
// fails for a reason that names nothing, or passes. One over `max_bytes`
// is an error too, found by reading at most that much (a device such as
// /dev/zero, or a pipe that does not end, was read until memory ran out and
// the process aborted); the default is protobuf's own bound on a message.
inline constexpr int64_t kMaxInputFileBytes = (int64_t{1} << 31) - 1;
absl::StatusOr<std::string> ReadInputFile(const std::string& path, const std::string& what = "",
                                          int64_t max_bytes = kMaxInputFileBytes);

// Writes `bytes` to the output file a flag names (replacing it), closes it
// and checks both: a full disk shows at the close for a small file, so a
// write is only reported done once the close succeeded. A regular file (or
// a new one) is written beside the path and renamed over it, keeping the
// old file's mode: a failed write leaves the old file as it was. A device,
// a pipe or a symbolic link is written in place. The error names `what`
// ("plan file "), the path and the system's reason.
absl::Status WriteOutputFile(const std::string& path, std::string_view bytes,
                             const std::string& what = "");

}  // namespace hap::tools

#endif  // HAP_COMMON_CLI_ARGS_H_
