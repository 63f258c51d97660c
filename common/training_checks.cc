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
  if (t.log_every() < 0) return bad("log_every", t.log_every(), "0 (every 100th step) or more");
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

absl::Status CheckNewTrainingConfig(const hap::v1::TrainingConfig& t) {
  if (absl::Status s = CheckTrainingConfig(t); !s.ok()) return s;
  if (!t.data_path().empty() &&
      (!t.data_spec().empty() || t.data() != hap::v1::TrainingConfig::WIKITEXT2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "training.data_path ('", t.data_path(),
        "') names the WikiText-2 file, read only with data WIKITEXT2 and no data_spec; here ",
        t.data_spec().empty()
            ? absl::StrCat("data is ", hap::v1::TrainingConfig::DataSource_Name(t.data()))
            : absl::StrCat("data_spec is '", t.data_spec(), "'"),
        ", which would train without it"));
  }
  if (t.checkpoint_dir().empty() && (t.checkpoint_every() > 0 || t.checkpoint_keep() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("training.checkpoint_every (", t.checkpoint_every(), ") and checkpoint_keep (",
                     t.checkpoint_keep(),
                     ") apply to checkpoints in checkpoint_dir, which is empty: nothing "
                     "would be saved"));
  }
  return absl::OkStatus();
}

}  // namespace hap
