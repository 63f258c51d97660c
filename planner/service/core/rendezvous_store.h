// The rendezvous store that a deployment's ranks meet through (hap.v1's
// StoreSet, StoreGet and StoreAdd): string keys per (deployment,
// generation). No gRPC; the one implementation the planner and the
// executors' tests share.
//
// A deployment's rendezvous is open at one generation until it is closed:
// the planner (DeploymentManager) opens it when it makes or reloads the
// deployment and closes it when the deployment finishes, and its keys go
// then (a planner that served many deployments would otherwise keep them
// all). A store made with `open_on_use` admits any deployment at any
// generation instead (a fake planner in tests, where no deployment is made).
//
// Counters do not wrap. Thread-safe.
#ifndef HAP_PLANNER_SERVICE_CORE_RENDEZVOUS_STORE_H_
#define HAP_PLANNER_SERVICE_CORE_RENDEZVOUS_STORE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace hap::service {

class RendezvousStore {
 public:
  struct Options {
    // Admit every deployment and generation (no Open needed).
    bool open_on_use = false;
    // Closed rendezvous remembered (their calls fail naming why); older
    // ones are forgotten, so that a long-running planner's memory does not
    // grow with every deployment it ever made (a forgotten one's calls are
    // NotFound).
    int64_t max_closed = 10000;
    // What one deployment's rendezvous may hold (keys and their values'
    // bytes): beyond it Set and Add are ResourceExhausted. Gloo and NCCL
    // set a few small keys a rank; a client that knows a deployment's name
    // must not grow the planner's memory without end.
    int64_t max_keys_per_deployment = 1 << 20;
    int64_t max_bytes_per_deployment = int64_t{256} << 20;
  };
  RendezvousStore() : RendezvousStore(Options{}) {}
  explicit RendezvousStore(Options options) : o_(options) {}

  // `deployment`'s rendezvous is open at `generation` (keys of another
  // generation of it go).
  void Open(const std::string& deployment, int64_t generation);
  // `deployment`'s rendezvous at `generation` is closed: its keys go, and
  // every call for it fails with FailedPrecondition(`why`), waits included.
  void Close(const std::string& deployment, int64_t generation, std::string why);
  // Every wait ends with Unavailable, and so does every later one.
  void Shutdown();

  // InvalidArgument without a deployment or key; NotFound for a deployment
  // never opened, FailedPrecondition for another generation of it or a
  // closed one.
  absl::Status Set(const std::string& deployment, int64_t generation, const std::string& key,
                   const std::string& value);
  // The values of `keys`, once every one is set: DeadlineExceeded naming the
  // missing keys at `deadline`, Cancelled when `cancelled()` (checked at
  // least every 200 ms), Unavailable after Shutdown, and the errors of Set,
  // also for a rendezvous closed while waiting.
  absl::StatusOr<std::vector<std::string>> Get(const std::string& deployment, int64_t generation,
                                               const std::vector<std::string>& keys,
                                               absl::Time deadline,
                                               const std::function<bool()>& cancelled);
  // Adds `delta` to the counter at `key` (absent = 0) and returns the sum:
  // FailedPrecondition when the key holds no counter, OutOfRange when the
  // sum overflows (the counter is left as it was); the errors of Set.
  absl::StatusOr<int64_t> Add(const std::string& deployment, int64_t generation,
                              const std::string& key, int64_t delta);

  // Keys held, of every deployment; of one deployment's generation.
  int64_t size() const;
  int64_t keys(const std::string& deployment, int64_t generation) const;

 private:
  struct Rendezvous {
    int64_t generation = 0;
    bool closed = false;
    std::string why;  // when closed
  };
  using Key = std::tuple<std::string, int64_t, std::string>;

  absl::Status Check(const std::string& deployment, int64_t generation) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Stores `value` at `k`, within the deployment's limits (Options).
  absl::Status Put(const Key& k, std::string value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Drop(const std::string& deployment) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options o_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, Rendezvous> rendezvous_ ABSL_GUARDED_BY(mu_);
  std::map<Key, std::string> kv_ ABSL_GUARDED_BY(mu_);
  struct Usage {
    int64_t keys = 0;
    int64_t bytes = 0;  // keys' and values' sizes
  };
  std::map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);  // by deployment
  // Closed rendezvous in the order they closed (an entry whose rendezvous
  // was opened again since is skipped when it comes up).
  std::deque<std::pair<std::string, int64_t>> closed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_RENDEZVOUS_STORE_H_
