// JSON text into a google.protobuf.Struct, for the free-form JSON we read
// (safetensors headers, state-dict slice metadata, rank profiles).
//
// protobuf's JSON parser takes time quadratic in the nesting depth when it
// builds Struct/Value messages: 1,000 nested '[' take 17 ms, the 2^20 a
// 2 MiB header can hold would take hours and wedge the reader. Every
// document we read is a few levels deep, so the nesting is checked first.
#ifndef HAP_COMMON_JSON_STRUCT_H_
#define HAP_COMMON_JSON_STRUCT_H_

#include <string_view>

#include "absl/status/status.h"
#include "google/protobuf/struct.pb.h"

namespace hap {

// The deepest nesting of objects and arrays JsonToStruct accepts.
inline constexpr int kMaxJsonNesting = 64;

// OK, or InvalidArgument naming the byte offset where objects and arrays
// nest deeper than `max_depth`. Brackets inside strings do not count.
absl::Status CheckJsonNesting(std::string_view json, int max_depth = kMaxJsonNesting);

// Parses `json` (an object) into `out` after CheckJsonNesting.
// InvalidArgument with the parser's or the nesting check's message.
absl::Status JsonToStruct(std::string_view json, google::protobuf::Struct* out);

}  // namespace hap

#endif  // HAP_COMMON_JSON_STRUCT_H_
