// What a checkpoint directory keeps (checkpoint.h, "Crash safety" in the
// README): after each commit, the newest --checkpoint-keep checkpoints, the
// later steps of a replaced run set aside, and killed saves' leftovers
// swept; the temporary directories' run-specific names.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "executor/checkpoint/checkpoint_internal.h"
#include "executor/checkpoint/crc32c.h"
#include "executor/checkpoint/file_util.h"
#include "executor/checkpoint/layout.h"

namespace hap::executor::checkpoint {
namespace {

namespace fs = std::filesystem;

void Warn(absl::string_view what) { std::cerr << "hap checkpoint: " << what << "\n" << std::flush; }

// True only when `path` is known not to exist: a lookup that fails (EIO,
// ESTALE on a network file system, EACCES) is not taken for an absence.
bool Absent(const std::string& path) {
  std::error_code ec;
  return fs::status(path, ec).type() == fs::file_type::not_found;
}

// How long another run's temporary directory must stay unchanged before a
// save takes it for a killed save's leftover.
constexpr absl::Duration kForeignTmpAge = absl::Hours(1);

// Whether nothing in `dir` (it, and what it holds directly) was modified
// for `age`; false when any of it cannot be looked up.
bool Untouched(const fs::path& dir, absl::Duration age) {
  std::error_code ec;
  auto newest = fs::last_write_time(dir, ec);
  if (ec) return false;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto t = fs::last_write_time(it->path(), ec);
    if (ec) return false;
    newest = std::max(newest, t);
  }
  if (ec) return false;
  const auto now = fs::file_time_type::clock::now();
  return now - newest > std::chrono::seconds(absl::ToInt64Seconds(age));
}

// A committed checkpoint removed: its COMMITTED first (made durable), then
// the rest, so that a removal that stops part way (a crash, a file that
// cannot be removed) leaves an incomplete step, which nothing resumes from
// and the next save drops, never a step that counts as complete with files
// gone.
absl::Status RemoveCheckpoint(const std::string& step_dir) {
  std::error_code ec;
  fs::remove(fs::path(step_dir) / kCommittedFile, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot remove ", step_dir, "/", kCommittedFile, ": ", ec.message()));
  }
  HAP_RETURN_IF_ERROR(SyncDirectory(step_dir));
  return RemoveAll(step_dir);
}

}  // namespace

// What ends a run's temporary directories' names: "" without a run id,
// else "-ID" (characters other than [A-Za-z0-9._-] as '_', and then, or
// for an id past 64 characters, its first 55 and its CRC-32C: the name
// stays short, the same in every process, and two ids that differ only in
// replaced characters, a/b and a_b, stay apart).
std::string RunSuffix(const std::string& run_id) {
  if (run_id.empty()) return "";
  std::string id = run_id;
  bool replaced = false;
  for (char& c : id) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      c = '_';
      replaced = true;
    }
  }
  if (replaced || id.size() > 64) {
    id = absl::StrCat(id.substr(0, 55), "~", Crc32cHex(Crc32c(0, run_id.data(), run_id.size())));
  }
  return absl::StrCat("-", id);
}

absl::Status RemoveAll(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot remove ", path, ": ", ec.message()));
  return absl::OkStatus();
}

// Sets aside the committed checkpoints in `dir` past `step` (those of a
// run that one resumed from `step` replaces): renamed superseded-step-N,
// kept, never resumed from or counted. Failures are reported, not returned.
void SetAsideAfter(const std::string& dir, int64_t step) {
  std::map<int64_t, std::string> committed = CommittedSteps(dir);
  std::vector<std::string> aside;
  std::error_code ec;
  for (auto it = committed.upper_bound(step); it != committed.end(); ++it) {
    const std::string to = SetAsidePath(dir, kSupersededPrefix, it->first);
    fs::rename(it->second, to, ec);
    if (ec) {
      Warn(absl::StrCat("cannot set aside ", it->second,
                        " (a later step of a replaced run): ", ec.message()));
      continue;
    }
    aside.push_back(absl::StrCat(it->second, " -> ", fs::path(to).filename().string()));
  }
  if (!aside.empty()) {
    if (absl::Status s = SyncDirectory(dir); !s.ok()) Warn(s.message());
    Warn(absl::StrCat(
        "the committed checkpoints after step ", step,
        " belong to a run that one resumed from an earlier step replaces; they are ",
        "set aside (kept, not resumed from, not counted): ", absl::StrJoin(aside, ", ")));
  }
}

// After the checkpoint of `step` committed in r.dir: sets aside the
// committed checkpoints past it (a run this one abandoned by resuming from
// an earlier step), keeps the newest `keep` of the rest (the one just
// committed always), and drops what killed saves left. Nothing here can
// undo the commit: failures are reported, not returned.
void Retain(const SaveRequest& r, int64_t step) {
  std::error_code ec;
  SetAsideAfter(r.dir, step);
  // The newest `keep` of the steps up to this one.
  std::vector<std::string> older;  // ascending
  for (const auto& [s, path] : CommittedSteps(r.dir)) {
    if (s < step) older.push_back(path);
  }
  const int64_t extra = static_cast<int64_t>(older.size()) + 1 - std::max(1, r.keep);
  for (int64_t i = 0; i < extra; ++i) {
    if (absl::Status s = RemoveCheckpoint(older[i]); !s.ok()) Warn(s.message());
  }
  const std::string own = RunSuffix(r.run_id);
  for (fs::directory_iterator it(r.dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // This run's leftovers go at once. Another run's only once nothing in
    // them changed for kForeignTmpAge: a replaced run's rank still saving
    // (a Stop gave up on it) removed the new run's save in progress here,
    // and the new run would remove the old one's.
    bool leftover = false;
    if (name.rfind(kTmpPrefix, 0) == 0) {
      const size_t digits = name.find_first_not_of("0123456789", sizeof(kTmpPrefix) - 1);
      const std::string suffix = digits == std::string::npos ? "" : name.substr(digits);
      leftover = suffix == own || Untouched(it->path(), kForeignTmpAge);
    } else if (StepOf(name) >= 0 && StepOf(name) < step) {
      // A killed save's step without COMMITTED; one whose COMMITTED cannot
      // be looked up (EIO, ESTALE) is kept.
      leftover = Absent((it->path() / kCommittedFile).string());
    }
    if (leftover) {
      if (absl::Status s = RemoveAll(it->path().string()); !s.ok()) Warn(s.message());
    }
  }
}

}  // namespace hap::executor::checkpoint
