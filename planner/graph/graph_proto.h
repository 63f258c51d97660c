// Conversion between the IR (graph.h) and the wire format (hap.v1.Graph),
// and parsing of graph files: protobuf JSON, text format, binary.
#ifndef HAP_PLANNER_GRAPH_GRAPH_PROTO_H_
#define HAP_PLANNER_GRAPH_GRAPH_PROTO_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "hap/v1/graph.pb.h"
#include "planner/graph/graph.h"

namespace hap::graph {

hap::v1::Graph ToProto(const Graph& g);

// Validates and converts. Ops may come in any order. Errors
// (InvalidArgument) name the op or tensor and what is wrong: an unknown op
// type, a tensor read but never defined, a cycle, mismatched shapes, a
// missing or non-scalar loss, non-positive or overflowing dimensions.
absl::StatusOr<Graph> FromProto(const hap::v1::Graph& proto);

enum class GraphFormat { kAuto, kJson, kText, kBinary };

// Parses bytes into a proto without validating the graph. kAuto picks JSON
// for text starting with '{', binary for non-text bytes, else text format.
absl::StatusOr<hap::v1::Graph> ParseGraphProto(absl::string_view bytes,
                                               GraphFormat format);
// ParseGraphProto followed by FromProto.
absl::StatusOr<Graph> ParseGraph(absl::string_view bytes, GraphFormat format);

std::string GraphToJson(const Graph& g);

DType FromProtoDType(hap::v1::DType d);
void AttrToProto(const AttrValue& v, hap::v1::AttrValue* p);
// InvalidArgument "has no value" for an empty oneof.
absl::StatusOr<AttrValue> AttrFromProto(const hap::v1::AttrValue& p);
hap::v1::DType ToProtoDType(DType d);

}  // namespace hap::graph

#endif  // HAP_PLANNER_GRAPH_GRAPH_PROTO_H_
