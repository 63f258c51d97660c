// Our getpeername, which keeps a connection reset while Gloo sets it up
// from ending the process (gloo_peer_name.cc says how and why). Linking
// //executor/comm:gloo_peer_name into a binary is all it takes.
#ifndef HAP_EXECUTOR_COMM_GLOO_PEER_NAME_H_
#define HAP_EXECUTOR_COMM_GLOO_PEER_NAME_H_

namespace hap::executor {

// Whether a call returning to `return_address` is Gloo's
// Address::fromPeerName, the one caller whose failed lookups we answer.
bool IsGlooPeerNameLookup(const void* return_address);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_GLOO_PEER_NAME_H_
