#include "planner/graph/graph_proto.h"

#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"

namespace hap::graph {

DType FromProtoDType(hap::v1::DType d) {
  switch (d) {
    case hap::v1::FLOAT16:
      return DType::kFloat16;
    case hap::v1::BFLOAT16:
      return DType::kBFloat16;
    case hap::v1::FLOAT64:
      return DType::kFloat64;
    case hap::v1::INT32:
      return DType::kInt32;
    case hap::v1::INT64:
      return DType::kInt64;
    default:
      return DType::kFloat32;
  }
}

hap::v1::DType ToProtoDType(DType d) {
  switch (d) {
    case DType::kFloat32:
      return hap::v1::FLOAT32;
    case DType::kFloat16:
      return hap::v1::FLOAT16;
    case DType::kBFloat16:
      return hap::v1::BFLOAT16;
    case DType::kFloat64:
      return hap::v1::FLOAT64;
    case DType::kInt32:
      return hap::v1::INT32;
    case DType::kInt64:
      return hap::v1::INT64;
  }
  return hap::v1::FLOAT32;
}

void AttrToProto(const AttrValue& v, hap::v1::AttrValue* p) {
  if (auto* i = std::get_if<int64_t>(&v)) {
    p->set_i(*i);
  } else if (auto* f = std::get_if<double>(&v)) {
    p->set_f(*f);
  } else if (auto* s = std::get_if<std::string>(&v)) {
    p->set_s(*s);
  } else if (auto* b = std::get_if<bool>(&v)) {
    p->set_b(*b);
  } else if (auto* is = std::get_if<std::vector<int64_t>>(&v)) {
    // mutable_*() first: an empty list is still a list (perm=[], shape=[]).
    auto* list = p->mutable_ints();
    for (int64_t x : *is) list->add_values(x);
  } else if (auto* fs = std::get_if<std::vector<double>>(&v)) {
    auto* list = p->mutable_floats();
    for (double x : *fs) list->add_values(x);
  }
}

absl::StatusOr<AttrValue> AttrFromProto(const hap::v1::AttrValue& p) {
  switch (p.value_case()) {
    case hap::v1::AttrValue::kI:
      return AttrValue(p.i());
    case hap::v1::AttrValue::kF:
      return AttrValue(p.f());
    case hap::v1::AttrValue::kS:
      return AttrValue(p.s());
    case hap::v1::AttrValue::kB:
      return AttrValue(p.b());
    case hap::v1::AttrValue::kInts:
      return AttrValue(
          std::vector<int64_t>(p.ints().values().begin(), p.ints().values().end()));
    case hap::v1::AttrValue::kFloats:
      return AttrValue(std::vector<double>(p.floats().values().begin(),
                                           p.floats().values().end()));
    case hap::v1::AttrValue::VALUE_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("has no value");
}

namespace {

void SpecToProto(const std::string& name, const TensorType& t,
                 hap::v1::TensorSpec* p) {
  p->set_name(name);
  for (int64_t d : t.shape) p->add_shape(d);
  p->set_dtype(ToProtoDType(t.dtype));
}

absl::StatusOr<TensorType> SpecFromProto(const hap::v1::TensorSpec& p,
                                         absl::string_view what) {
  if (p.name().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has an empty name"));
  }
  if (p.dtype() == hap::v1::DTYPE_UNSPECIFIED ||
      !hap::v1::DType_IsValid(p.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", p.name(), "' has no valid dtype"));
  }
  TensorType t{FromProtoDType(p.dtype()), Shape(p.shape().begin(), p.shape().end())};
  auto n = CheckedNumElements(t.shape);
  if (!n.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", p.name(), "': ", n.status().message()));
  }
  return t;
}

Initializer InitFromProto(const hap::v1::Initializer& p) {
  Initializer i;
  switch (p.kind()) {
    case hap::v1::Initializer::ONES:
      i.kind = Initializer::Kind::kOnes;
      break;
    case hap::v1::Initializer::CONSTANT:
      i.kind = Initializer::Kind::kConstant;
      break;
    case hap::v1::Initializer::NORMAL:
      i.kind = Initializer::Kind::kNormal;
      break;
    case hap::v1::Initializer::UNIFORM:
      i.kind = Initializer::Kind::kUniform;
      break;
    case hap::v1::Initializer::VALUES:
      i.kind = Initializer::Kind::kValues;
      i.values.assign(p.values().begin(), p.values().end());
      i.counts.assign(p.counts().begin(), p.counts().end());
      break;
    default:  // ZEROS, KIND_UNSPECIFIED; others are refused in FromProto
      i.kind = Initializer::Kind::kZeros;
  }
  i.value = p.value();
  i.mean = p.mean();
  i.stddev = p.stddev();
  i.low = p.low();
  i.high = p.high();
  return i;
}

void InitToProto(const Initializer& i, hap::v1::Initializer* p) {
  switch (i.kind) {
    case Initializer::Kind::kZeros:
      p->set_kind(hap::v1::Initializer::ZEROS);
      break;
    case Initializer::Kind::kOnes:
      p->set_kind(hap::v1::Initializer::ONES);
      break;
    case Initializer::Kind::kConstant:
      p->set_kind(hap::v1::Initializer::CONSTANT);
      break;
    case Initializer::Kind::kNormal:
      p->set_kind(hap::v1::Initializer::NORMAL);
      break;
    case Initializer::Kind::kUniform:
      p->set_kind(hap::v1::Initializer::UNIFORM);
      break;
    case Initializer::Kind::kValues:
      p->set_kind(hap::v1::Initializer::VALUES);
      p->mutable_values()->Add(i.values.begin(), i.values.end());
      p->mutable_counts()->Add(i.counts.begin(), i.counts.end());
      break;
  }
  if (i.value != 0) p->set_value(i.value);
  if (i.mean != 0) p->set_mean(i.mean);
  if (i.stddev != 0) p->set_stddev(i.stddev);
  if (i.low != 0) p->set_low(i.low);
  if (i.high != 0) p->set_high(i.high);
}

absl::Status CheckInitializer(const std::string& name, const Initializer& i) {
  bool ok = std::isfinite(i.value) && std::isfinite(i.mean) &&
            std::isfinite(i.stddev) && std::isfinite(i.low) &&
            std::isfinite(i.high);
  if (ok && i.kind == Initializer::Kind::kNormal) ok = i.stddev >= 0;
  if (ok && i.kind == Initializer::Kind::kUniform) ok = i.low <= i.high;
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter '", name,
        "' has an invalid initializer (non-finite, negative stddev or "
        "low > high)"));
  }
  return absl::OkStatus();
}

}  // namespace

hap::v1::Graph ToProto(const Graph& g) {
  hap::v1::Graph p;
  p.set_name(g.name());
  for (const Tensor& t : g.tensors()) {
    if (t.kind == TensorKind::kInput) {
      auto* in = p.add_inputs();
      SpecToProto(t.name, t.type, in->mutable_tensor());
      in->set_role(t.role == InputRole::kLabels ? hap::v1::Input::LABELS
                                                : hap::v1::Input::FEATURES);
    } else if (t.kind == TensorKind::kParameter) {
      auto* par = p.add_parameters();
      SpecToProto(t.name, t.type, par->mutable_tensor());
      InitToProto(t.init, par->mutable_init());
      par->set_frozen(t.frozen);
    }
  }
  for (const Op& op : g.ops()) {
    auto* o = p.add_ops();
    o->set_name(op.name);
    o->set_type(op.type);
    for (TensorId t : op.inputs) o->add_inputs(g.tensor(t).name);
    for (TensorId t : op.outputs) o->add_outputs(g.tensor(t).name);
    for (const auto& [k, v] : op.attrs.values()) {
      AttrToProto(v, &(*o->mutable_attrs())[k]);
    }
    if (!op.scope.empty()) o->set_scope(op.scope);
  }
  p.set_loss(g.tensor(g.loss()).name);
  for (const auto& [k, v] : g.metadata()) (*p.mutable_metadata())[k] = v;
  return p;
}

absl::StatusOr<Graph> FromProto(const hap::v1::Graph& p) {
  GraphBuilder b(p.name().empty() ? "graph" : p.name());
  absl::flat_hash_map<std::string, TensorId> ids;
  for (const auto& in : p.inputs()) {
    // An unknown value (a newer exporter's, or a corrupt file) was read as
    // FEATURES: refused, naming it.
    if (!hap::v1::Input::Role_IsValid(in.role())) {
      return absl::InvalidArgumentError(absl::StrCat("input '", in.tensor().name(), "' has role ",
                                                     in.role(), ", not one of FEATURES or LABELS"));
    }
    HAP_ASSIGN_OR_RETURN(TensorType t, SpecFromProto(in.tensor(), "input"));
    TensorId id = b.Input(in.tensor().name(), t,
                          in.role() == hap::v1::Input::LABELS
                              ? InputRole::kLabels
                              : InputRole::kFeatures);
    HAP_RETURN_IF_ERROR(b.status());
    ids[in.tensor().name()] = id;
  }
  for (const auto& par : p.parameters()) {
    // An unknown kind was initialised as ZEROS without a word.
    if (!hap::v1::Initializer::Kind_IsValid(par.init().kind())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", par.tensor().name(), "' has initializer kind ", par.init().kind(),
          ", not one of ZEROS, ONES, CONSTANT, NORMAL, UNIFORM, VALUES"));
    }
    HAP_ASSIGN_OR_RETURN(TensorType t,
                         SpecFromProto(par.tensor(), "parameter"));
    Initializer init = InitFromProto(par.init());
    HAP_RETURN_IF_ERROR(CheckInitializer(par.tensor().name(), init));
    TensorId id = b.Parameter(par.tensor().name(), t, init, par.frozen());
    HAP_RETURN_IF_ERROR(b.status());
    ids[par.tensor().name()] = id;
  }

  // Which op produces each name; then a stable topological order (Kahn's
  // algorithm, ready ops taken in declaration order).
  const int n = p.ops_size();
  absl::flat_hash_map<std::string, int> producer;
  for (int i = 0; i < n; ++i) {
    const auto& op = p.ops(i);
    if (op.name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("op #", i, " (", op.type(), ") has no name"));
    }
    if (op.outputs_size() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("op '", op.name(), "' (", op.type(), ") has no outputs"));
    }
    for (const auto& out : op.outputs()) {
      if (out.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("op '", op.name(), "' (", op.type(),
                         ") has an output with an empty name"));
      }
      if (ids.count(out) || producer.count(out)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", out, "' (output of op '", op.name(),
            "') is defined twice"));
      }
      producer[out] = i;
    }
  }
  std::vector<int> pending(n, 0);
  std::vector<std::vector<int>> users(n);
  for (int i = 0; i < n; ++i) {
    const auto& op = p.ops(i);
    for (const auto& in : op.inputs()) {
      if (ids.count(in)) continue;
      auto it = producer.find(in);
      if (it == producer.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "op '", op.name(), "' (", op.type(), ") reads tensor '", in,
            "', which is not an input, a parameter or any op's output"));
      }
      ++pending[i];
      users[it->second].push_back(i);
    }
  }
  std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
  for (int i = 0; i < n; ++i) {
    if (pending[i] == 0) ready.push(i);
  }
  std::vector<int> order;
  while (!ready.empty()) {
    int i = ready.top();
    ready.pop();
    order.push_back(i);
    for (int u : users[i]) {
      if (--pending[u] == 0) ready.push(u);
    }
  }
  if (static_cast<int>(order.size()) != n) {
    std::vector<std::string> stuck;
    for (int i = 0; i < n && stuck.size() < 5; ++i) {
      if (pending[i] > 0) stuck.push_back(absl::StrCat("'", p.ops(i).name(), "'"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "the graph has a cycle through op(s) ", absl::StrJoin(stuck, ", ")));
  }

  for (int i : order) {
    const auto& op = p.ops(i);
    std::vector<TensorId> inputs;
    for (const auto& in : op.inputs()) inputs.push_back(ids.at(in));
    Attrs attrs;
    for (const auto& [k, v] : op.attrs()) {
      auto a = AttrFromProto(v);
      if (!a.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "op '", op.name(), "' (", op.type(), "): attribute '", k, "' ",
            a.status().message()));
      }
      attrs.Set(k, *a);
    }
    if (!op.scope().empty()) b.PushScope(op.scope());
    auto outs = b.AddOp(op.type(), op.name(), inputs, std::move(attrs),
                        std::vector<std::string>(op.outputs().begin(),
                                                 op.outputs().end()));
    if (!op.scope().empty()) b.PopScope();
    HAP_RETURN_IF_ERROR(b.status());
    for (int j = 0; j < op.outputs_size(); ++j) ids[op.outputs(j)] = outs[j];
  }
  for (const auto& vi : p.value_info()) {
    HAP_ASSIGN_OR_RETURN(TensorType t, SpecFromProto(vi, "value_info entry"));
    b.ExpectType(vi.name(), t);
  }
  HAP_RETURN_IF_ERROR(b.status());
  if (p.loss().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph '", p.name(), "' names no loss tensor"));
  }
  auto loss = ids.find(p.loss());
  if (loss == ids.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the loss '", p.loss(), "' is not a tensor of the graph"));
  }
  b.SetLoss(loss->second);
  for (const auto& [k, v] : p.metadata()) b.SetMetadata(k, v);
  return b.Build();
}

absl::StatusOr<hap::v1::Graph> ParseGraphProto(absl::string_view bytes,
                                               GraphFormat format) {
  if (format == GraphFormat::kAuto) {
    size_t i = 0;
    while (i < bytes.size() && isspace(static_cast<unsigned char>(bytes[i]))) ++i;
    bool printable = true;
    for (char c : bytes.substr(0, 4096)) {
      unsigned char u = static_cast<unsigned char>(c);
      if (u < 0x09 || (u > 0x0d && u < 0x20)) printable = false;
    }
    // Binary can start "\n{" too (a 123-byte graph name), so JSON must also
    // be printable.
    if (printable && i < bytes.size() && bytes[i] == '{') {
      format = GraphFormat::kJson;
    } else {
      format = printable ? GraphFormat::kText : GraphFormat::kBinary;
    }
  }
  hap::v1::Graph p;
  switch (format) {
    case GraphFormat::kJson: {
      google::protobuf::util::JsonParseOptions opts;
      opts.ignore_unknown_fields = false;
      auto st = google::protobuf::util::JsonStringToMessage(
          std::string(bytes), &p, opts);
      if (!st.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "graph JSON does not parse (truncated or malformed?): ",
            st.message().as_string()));
      }
      break;
    }
    case GraphFormat::kText: {
      struct Collector : google::protobuf::io::ErrorCollector {
        std::string first;
        void AddError(int line, int column, const std::string& msg) override {
          if (first.empty()) {
            first = absl::StrCat("line ", line + 1, ", column ", column + 1,
                                 ": ", msg);
          }
        }
      } errors;
      google::protobuf::TextFormat::Parser parser;
      parser.RecordErrorsTo(&errors);
      if (!parser.ParseFromString(std::string(bytes), &p)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "graph text format does not parse (truncated or malformed?): ",
            errors.first));
      }
      break;
    }
    case GraphFormat::kBinary:
    case GraphFormat::kAuto:
      if (!p.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
        return absl::InvalidArgumentError(
            "graph protobuf does not parse (truncated or not a hap.v1.Graph)");
      }
      break;
  }
  return p;
}

absl::StatusOr<Graph> ParseGraph(absl::string_view bytes, GraphFormat format) {
  HAP_ASSIGN_OR_RETURN(hap::v1::Graph p, ParseGraphProto(bytes, format));
  return FromProto(p);
}

std::string GraphToJson(const Graph& g) {
  std::string out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(ToProto(g), &out, opts);
  return out;
}

}  // namespace hap::graph
