#include "planner/service/core/rendezvous_store.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace hap::service {

void RendezvousStore::Open(const std::string& deployment, int64_t generation) {
  absl::MutexLock l(&mu_);
  auto it = rendezvous_.find(deployment);
  if (it != rendezvous_.end() && it->second.generation != generation) Drop(deployment);
  rendezvous_[deployment] = Rendezvous{generation, false, ""};
  changed_.SignalAll();
}

void RendezvousStore::Close(const std::string& deployment, int64_t generation, std::string why) {
  absl::MutexLock l(&mu_);
  // Closed already (its record changed again): one place among max_closed.
  if (auto it = rendezvous_.find(deployment);
      it != rendezvous_.end() && it->second.closed && it->second.generation == generation) {
    it->second.why = std::move(why);
    return;
  }
  Drop(deployment);
  rendezvous_[deployment] = Rendezvous{generation, true, std::move(why)};
  closed_.emplace_back(deployment, generation);
  while (static_cast<int64_t>(closed_.size()) > std::max<int64_t>(0, o_.max_closed)) {
    auto it = rendezvous_.find(closed_.front().first);
    if (it != rendezvous_.end() && it->second.closed &&
        it->second.generation == closed_.front().second) {
      rendezvous_.erase(it);
    }
    closed_.pop_front();
  }
  changed_.SignalAll();
}

void RendezvousStore::Shutdown() {
  absl::MutexLock l(&mu_);
  shutdown_ = true;
  changed_.SignalAll();
}

void RendezvousStore::Drop(const std::string& deployment) {
  auto k = kv_.lower_bound({deployment, std::numeric_limits<int64_t>::min(), ""});
  while (k != kv_.end() && std::get<0>(k->first) == deployment) k = kv_.erase(k);
  usage_.erase(deployment);
}

absl::Status RendezvousStore::Put(const Key& k, std::string value) {
  const std::string& deployment = std::get<0>(k);
  Usage& u = usage_[deployment];
  auto it = kv_.find(k);
  const int64_t key_bytes = static_cast<int64_t>(std::get<2>(k).size());
  const int64_t old_bytes =
      it == kv_.end() ? 0 : key_bytes + static_cast<int64_t>(it->second.size());
  const int64_t keys = u.keys + (it == kv_.end() ? 1 : 0);
  const int64_t bytes = u.bytes - old_bytes + key_bytes + static_cast<int64_t>(value.size());
  if (keys > o_.max_keys_per_deployment || bytes > o_.max_bytes_per_deployment) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the rendezvous of ", deployment, " would hold ", keys, " keys and ", bytes,
                     " bytes; it may hold ", o_.max_keys_per_deployment, " keys and ",
                     o_.max_bytes_per_deployment, " bytes"));
  }
  u.keys = keys;
  u.bytes = bytes;
  if (it == kv_.end()) {
    kv_.emplace(k, std::move(value));
  } else {
    it->second = std::move(value);
  }
  return absl::OkStatus();
}

absl::Status RendezvousStore::Check(const std::string& deployment, int64_t generation) const {
  if (o_.open_on_use) return absl::OkStatus();
  auto it = rendezvous_.find(deployment);
  if (it == rendezvous_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "deployment '", deployment,
        "' does not exist (rendezvous keys belong to a deployment the planner made; finished ones "
        "are forgotten after ",
        o_.max_closed, " more have finished)"));
  }
  if (it->second.generation != generation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "deployment '", deployment, "' is generation ", it->second.generation, ", not ",
        generation));
  }
  if (it->second.closed) return absl::FailedPreconditionError(it->second.why);
  return absl::OkStatus();
}

absl::Status RendezvousStore::Set(const std::string& deployment, int64_t generation,
                                  const std::string& key, const std::string& value) {
  if (deployment.empty() || key.empty()) {
    return absl::InvalidArgumentError("StoreSet needs a deployment and a key");
  }
  absl::MutexLock l(&mu_);
  HAP_RETURN_IF_ERROR(Check(deployment, generation));
  HAP_RETURN_IF_ERROR(Put({deployment, generation, key}, value));
  changed_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> RendezvousStore::Get(
    const std::string& deployment, int64_t generation, const std::vector<std::string>& keys,
    absl::Time deadline, const std::function<bool()>& cancelled) {
  if (deployment.empty() || keys.empty()) {
    return absl::InvalidArgumentError("StoreGet needs a deployment and at least one key");
  }
  absl::MutexLock l(&mu_);
  while (true) {
    // Again after each wait: a rendezvous closed meanwhile answers.
    HAP_RETURN_IF_ERROR(Check(deployment, generation));
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (!kv_.count({deployment, generation, k})) missing.push_back(k);
    }
    if (missing.empty()) break;
    if (shutdown_) return absl::UnavailableError("the planner is shutting down");
    if (cancelled()) return absl::CancelledError("the client cancelled");
    if (absl::Now() >= deadline) {
      // The first few named: a message of every key a client asked for
      // could pass gRPC's trailer limit and arrive as a transport error.
      constexpr size_t kNamed = 16;
      std::string named =
          absl::StrJoin(missing.begin(), missing.begin() + std::min(kNamed, missing.size()), ", ");
      if (named.size() > 1024) named = absl::StrCat(named.substr(0, 1024), "...");
      if (missing.size() > kNamed)
        absl::StrAppend(&named, " and ", missing.size() - kNamed, " more");
      return absl::DeadlineExceededError(absl::StrCat("rendezvous keys not set in time for ",
                                                      deployment, " generation ", generation, ": ",
                                                      named));
    }
    // Short waits, so a cancelled caller is noticed promptly.
    changed_.WaitWithDeadline(&mu_, std::min(deadline, absl::Now() + absl::Milliseconds(200)));
  }
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const auto& k : keys) values.push_back(kv_[{deployment, generation, k}]);
  return values;
}

absl::StatusOr<int64_t> RendezvousStore::Add(const std::string& deployment, int64_t generation,
                                             const std::string& key, int64_t delta) {
  if (deployment.empty() || key.empty()) {
    return absl::InvalidArgumentError("StoreAdd needs a deployment and a key");
  }
  absl::MutexLock l(&mu_);
  HAP_RETURN_IF_ERROR(Check(deployment, generation));
  Key k{deployment, generation, key};
  auto it = kv_.find(k);
  int64_t n = 0;
  if (it != kv_.end() && !it->second.empty() && !absl::SimpleAtoi(it->second, &n)) {
    return absl::FailedPreconditionError(
        absl::StrCat("key '", key, "' holds a value that is not a counter"));
  }
  int64_t sum = 0;
  if (__builtin_add_overflow(n, delta, &sum)) {
    return absl::OutOfRangeError(absl::StrCat("key '", key, "' holds ", n, ": adding ", delta,
                                              " overflows a 64-bit counter"));
  }
  HAP_RETURN_IF_ERROR(Put(k, absl::StrCat(sum)));
  changed_.SignalAll();
  return sum;
}

int64_t RendezvousStore::size() const {
  absl::MutexLock l(&mu_);
  return static_cast<int64_t>(kv_.size());
}

int64_t RendezvousStore::keys(const std::string& deployment, int64_t generation) const {
  absl::MutexLock l(&mu_);
  auto from = kv_.lower_bound({deployment, generation, ""});
  int64_t n = 0;
  for (auto k = from; k != kv_.end() && std::get<0>(k->first) == deployment &&
                      std::get<1>(k->first) == generation;
       ++k) {
    ++n;
  }
  return n;
}

}  // namespace hap::service
