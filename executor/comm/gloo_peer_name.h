// Our getpeername, which keeps a connection reset while Gloo sets it up
// from ending the process (gloo_peer_name.cc says how and why). Linking
// //executor/comm:gloo_peer_name into a binary is all it takes.
#ifndef HAP_EXECUTOR_COMM_GLOO_PEER_NAME_H_
#define HAP_EXECUTOR_COMM_GLOO_PEER_NAME_H_

#include <cstdint>

namespace hap::executor {

// Whether a call returning to `return_address` is Gloo's
// Address::fromPeerName, the one caller whose failed lookups we answer.
bool IsGlooPeerNameLookup(const void* return_address);

// How many of Gloo's lookups of a reset connection were answered with an
// empty address in this process (tests: that the case was met).
int64_t GlooResetPeerLookups();

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_GLOO_PEER_NAME_H_
