// absl::Time <-> google.protobuf.Timestamp, as the core's resources store
// their times.
#ifndef HAP_PLANNER_SERVICE_CORE_PROTO_TIME_H_
#define HAP_PLANNER_SERVICE_CORE_PROTO_TIME_H_

#include "absl/time/time.h"
#include "google/protobuf/timestamp.pb.h"
#include "google/protobuf/util/time_util.h"

namespace hap::service {

inline google::protobuf::Timestamp ToProto(absl::Time t) {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(t));
}
inline absl::Time FromProto(const google::protobuf::Timestamp& t) {
  return absl::FromUnixNanos(google::protobuf::util::TimeUtil::TimestampToNanoseconds(t));
}

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_PROTO_TIME_H_
