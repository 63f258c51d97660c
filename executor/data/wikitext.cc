#include "executor/data/wikitext.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hap::data {
namespace {

constexpr char kEos[] = "<eos>";
constexpr char kUnk[] = "<unk>";

template <typename Fn>
absl::Status ForEachWord(const std::string& file, Fn fn) {
  std::ifstream in(file);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read '", file, "'"));
  }
  std::string line;
  while (std::getline(in, line)) {
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
