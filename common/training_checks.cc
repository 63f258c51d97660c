#include "common/training_checks.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace hap {

absl::Status CheckTrainingConfig(const hap::v1::TrainingConfig& t) {
  auto bad = [](absl::string_view field, auto value, absl::string_view want) {
    return absl::InvalidArgumentError(
        absl::StrCat("training.", field, " must be ", want, ", got ", value));
  };
  if (t.steps() < 0) return bad("steps", t.steps(), "0 (100 steps) or more");
  if (t.threads_per_rank() < 0 || t.threads_per_rank() > kMaxThreadsPerRank) {
    return bad("threads_per_rank", t.threads_per_rank(),
               absl::StrCat("0 (the executor's --threads) to ", kMaxThreadsPerRank));
  }
  if (t.checkpoint_every() < 0) return bad("checkpoint_every", t.checkpoint_every(), "0 or more");
  if (t.checkpoint_keep() < 0) return bad("checkpoint_keep", t.checkpoint_keep(), "0 or more");
  if (!hap::v1::TrainingConfig::DataSource_IsValid(t.data())) {
    return bad("data", static_cast<int>(t.data()), "SYNTHETIC or WIKITEXT2");
  }
  if (!t.resume().empty() && !t.init_weights().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("training.resume ('", t.resume(),
                                                   "') and init_weights ('", t.init_weights(),
                                                   "') exclude each other"));
  }
  if (t.shuffle() && t.data_spec().empty()) {
    return absl::InvalidArgumentError(
        "training.shuffle applies to data_spec (npy:, tokens:) data only; data_spec is empty");
  }
  return absl::OkStatus();
}

}  // namespace hap
