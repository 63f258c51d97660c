// NewInMemoryStore: a StateStore in maps, for tests of the planner service
// (it keeps nothing across a restart). Same contract, order and page tokens
// as the SQLite store. Thread-safe.
#ifndef HAP_PLANNER_SERVICE_STORE_MEMORY_STORE_H_
#define HAP_PLANNER_SERVICE_STORE_MEMORY_STORE_H_

#include <memory>

#include "planner/service/store/state_store.h"

namespace hap::service::store {

std::unique_ptr<StateStore> NewInMemoryStore();

}  // namespace hap::service::store

#endif  // HAP_PLANNER_SERVICE_STORE_MEMORY_STORE_H_
