// WikiText-2, word level (../shared/data/wikitext-2): the vocabulary is built
// by splitting lines on whitespace and appending one <eos> a line, in order
// of first appearance over the given files; a corpus is the id sequence.
#ifndef HAP_EXECUTOR_DATA_WIKITEXT_H_
#define HAP_EXECUTOR_DATA_WIKITEXT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace hap::data {

class Vocabulary {
 public:
  // Reads every file in order; NotFound naming a missing file,
  // InvalidArgument naming one that is not a regular file (a named pipe is
  // not waited on), and otherwise an error naming the file and the
  // system's reason (a directory: "Is a directory").
  static absl::StatusOr<Vocabulary> Build(const std::vector<std::string>& files);

  int64_t size() const { return static_cast<int64_t>(words_.size()); }
  // -1 for a word not in the vocabulary.
  int64_t Id(const std::string& word) const;
  const std::string& Word(int64_t id) const { return words_[id]; }

  // The ids of a file's words (with <eos> a line); words outside the
  // vocabulary map to <unk>, which must then be in it.
  absl::StatusOr<std::vector<int64_t>> Encode(const std::string& file) const;

 private:
  int64_t Add(const std::string& w);
  std::vector<std::string> words_;
  absl::flat_hash_map<std::string, int64_t> ids_;
};

// The standard files of a WikiText-2 directory: valid.txt then test.txt.
std::vector<std::string> WikiText2Files(const std::string& dir);

}  // namespace hap::data

#endif  // HAP_EXECUTOR_DATA_WIKITEXT_H_
