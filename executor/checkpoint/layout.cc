#include "executor/checkpoint/layout.h"

#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hap::executor::checkpoint {
namespace {

namespace fs = std::filesystem;

bool Exists(const fs::path& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

}  // namespace

std::string StepDirName(int64_t step) { return absl::StrFormat("%s%08d", kStepPrefix, step); }

int64_t StepOf(const std::string& name) {
  constexpr size_t kPrefix = sizeof(kStepPrefix) - 1;
  int64_t step = 0;
  if (name.rfind(kStepPrefix, 0) != 0 || name.size() == kPrefix ||
      name.find_first_not_of("0123456789", kPrefix) != std::string::npos ||
      !absl::SimpleAtoi(name.substr(kPrefix), &step)) {
    return -1;
  }
  return step;
}

std::map<int64_t, std::string> CommittedSteps(const std::string& dir, std::error_code* error) {
  std::map<int64_t, std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const int64_t step = StepOf(it->path().filename().string());
    if (step >= 0 && Exists(it->path() / kCommittedFile)) out[step] = it->path().string();
  }
  if (error != nullptr) *error = ec;
  return out;
}

std::string SetAsidePath(const std::string& dir, const std::string& prefix, int64_t step) {
  const std::string base = absl::StrCat(prefix, StepDirName(step));
  fs::path path = fs::path(dir) / base;
  for (int k = 1; Exists(path); ++k) path = fs::path(dir) / absl::StrCat(base, "-", k);
  return path.string();
}

}  // namespace hap::executor::checkpoint
