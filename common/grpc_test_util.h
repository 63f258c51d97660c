// Tests' side of the gRPC convention (grpc_util.h): a call to any method by
// name with raw request bytes and chosen metadata, and the check that a
// service refuses every one of its methods to callers without the token.
#ifndef HAP_COMMON_GRPC_TEST_UTIL_H_
#define HAP_COMMON_GRPC_TEST_UTIL_H_

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace hap::service::testing {

// Calls `method` ("/package.Service/Method") with `request` as its bytes
// and each of `authorization` as an "authorization" header; the call's
// status. A unary call whatever the method's kind: a streaming method gets
// one message and the end of the stream, and its first answer is dropped.
inline absl::Status RawCall(const std::shared_ptr<grpc::Channel>& channel,
                            const std::string& method, const std::string& request,
                            const std::vector<std::string>& authorization) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  for (const std::string& a : authorization) ctx.AddMetadata("authorization", a);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&ctx, method, request_buffer, &cq);
  call->StartCall();
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return FromGrpc(status);
}

// "authorization" headers a server started with `token` must refuse: none,
// a wrong token, the token one character longer or shorter, without its
// scheme, in another scheme or case.
inline std::vector<std::vector<std::string>> WrongAuthorizations(const std::string& token) {
  return {{},
          {"Bearer wrong"},
          {absl::StrCat("Bearer ", token, "x")},
          {absl::StrCat("Bearer ", token.substr(1))},
          {token},
          {"Bearer"},
          {absl::StrCat("bearer ", token, "X")},
          {absl::StrCat("Basic ", token)}};
}

// Calls every method of `service` on `channel`, with an empty request and
// each of WrongAuthorizations(token): one line ("/pkg.Service/Method with
// 'header': status") for each call not refused with UNAUTHENTICATED. Empty
// when every call was refused.
inline std::vector<std::string> CallsNotRefused(const std::shared_ptr<grpc::Channel>& channel,
                                                const google::protobuf::ServiceDescriptor& service,
                                                const std::string& token) {
  std::vector<std::string> not_refused;
  for (int i = 0; i < service.method_count(); ++i) {
    const std::string method =
        absl::StrCat("/", service.full_name(), "/", service.method(i)->name());
    for (const std::vector<std::string>& auth : WrongAuthorizations(token)) {
      absl::Status s = RawCall(channel, method, "", auth);
      if (s.code() != absl::StatusCode::kUnauthenticated) {
        not_refused.push_back(
            absl::StrCat(method, " with '", auth.empty() ? "" : auth[0], "': ", s.ToString()));
      }
    }
  }
  return not_refused;
}

// CallsNotRefused on `handlers` served alone on 127.0.0.1:0 with plaintext
// credentials and no auth filter: what the handlers' own token checks let
// through.
inline std::vector<std::string> HandlerCallsNotRefused(
    grpc::Service* handlers, const google::protobuf::ServiceDescriptor& service,
    const std::string& token) {
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(handlers);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return {"the handlers' server did not start"};
  std::vector<std::string> not_refused = CallsNotRefused(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()),
      service, token);
  server->Shutdown();
  return not_refused;
}

}  // namespace hap::service::testing

#endif  // HAP_COMMON_GRPC_TEST_UTIL_H_
