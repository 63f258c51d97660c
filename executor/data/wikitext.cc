#include "executor/data/wikitext.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "executor/checkpoint/file_util.h"

namespace hap::data {
namespace {

constexpr char kEos[] = "<eos>";
constexpr char kUnk[] = "<unk>";

// Calls fn for every word of every line of `file`, then for an <eos> a line
// (std::getline's lines: a last line without '\n' counts, nothing after a
// final '\n').
template <typename Fn>
absl::Status ForEachWord(const std::string& file, Fn fn) {
  // A directory or a named pipe is an error naming it (std::ifstream opened
  // a directory and read nothing, and waited on a pipe for a writer).
  HAP_ASSIGN_OR_RETURN(const std::string text, executor::checkpoint::ReadFile(file));
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  for (absl::string_view line : lines) {
    for (absl::string_view w :
         absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty())) {
      fn(std::string(w));
    }
    fn(kEos);
  }
  return absl::OkStatus();
}

}  // namespace

int64_t Vocabulary::Add(const std::string& w) {
  auto [it, inserted] = ids_.emplace(w, size());
  if (inserted) words_.push_back(w);
  return it->second;
}

int64_t Vocabulary::Id(const std::string& w) const {
  auto it = ids_.find(w);
  return it == ids_.end() ? -1 : it->second;
}

absl::StatusOr<Vocabulary> Vocabulary::Build(
    const std::vector<std::string>& files) {
  Vocabulary v;
  for (const std::string& f : files) {
    absl::Status s = ForEachWord(f, [&](const std::string& w) { v.Add(w); });
    if (!s.ok()) return s;
  }
  return v;
}

absl::StatusOr<std::vector<int64_t>> Vocabulary::Encode(
    const std::string& file) const {
  std::vector<int64_t> ids;
  int64_t unk = Id(kUnk);
  bool missing = false;
  absl::Status s = ForEachWord(file, [&](const std::string& w) {
    int64_t id = Id(w);
    if (id < 0) {
      id = unk;
      missing = missing || unk < 0;
    }
    ids.push_back(id);
  });
  if (!s.ok()) return s;
  if (missing) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", file, "' has words outside the vocabulary and no <unk> entry"));
  }
  return ids;
}

std::vector<std::string> WikiText2Files(const std::string& dir) {
  return {absl::StrCat(dir, "/valid.txt"), absl::StrCat(dir, "/test.txt")};
}

}  // namespace hap::data
