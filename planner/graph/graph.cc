#include "planner/graph/graph.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "planner/graph/op_registry.h"

namespace hap::graph {

std::string ValuesInitError(const Initializer& init, int64_t num_elements) {
  if (init.values.size() != init.counts.size()) {
    return absl::StrCat("its VALUES initializer has ", init.values.size(), " values but ",
                        init.counts.size(), " counts (one per value)");
  }
  int64_t total = 0;
  for (size_t i = 0; i < init.values.size(); ++i) {
    if (!std::isfinite(init.values[i])) {
      return absl::StrCat("its VALUES initializer's value ", i, " is not finite");
    }
    if (init.counts[i] < 1) {
      return absl::StrCat("its VALUES initializer's count ", i, " is ", init.counts[i],
                          " (each value repeats at least once)");
    }
    if (__builtin_add_overflow(total, init.counts[i], &total)) {
      return "its VALUES initializer's counts overflow";
    }
  }
  if (total != num_elements) {
    return absl::StrCat("its VALUES initializer's counts add up to ", total, " elements, not its ",
                        num_elements);
  }
  return "";
}

std::optional<TensorId> Graph::FindTensor(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

std::vector<TensorId> Graph::Inputs() const {
  std::vector<TensorId> out;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].kind == TensorKind::kInput) out.push_back(i);
  }
  return out;
}

std::vector<TensorId> Graph::Parameters() const {
  std::vector<TensorId> out;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].kind == TensorKind::kParameter) out.push_back(i);
  }
  return out;
}

int64_t Graph::ParameterCount() const {
  int64_t n = 0;
  for (const Tensor& t : tensors_) {
    if (t.kind == TensorKind::kParameter) n += t.type.num_elements();
  }
  return n;
}

int64_t Graph::TrainableParameterCount() const {
  int64_t n = 0;
  for (const Tensor& t : tensors_) {
    if (t.kind == TensorKind::kParameter && !t.frozen) {
      n += t.type.num_elements();
    }
  }
  return n;
}

double Graph::OpForwardFlops(OpId id) const {
  const Op& op = ops_[id];
  const OpDef* def = OpRegistry::Global().Find(op.type);
  OpCall call{op.type, op.attrs, {}, {}, {}};
  for (TensorId t : op.inputs) {
    call.input_names.push_back(tensors_[t].name);
    call.inputs.push_back(tensors_[t].type);
  }
  for (TensorId t : op.outputs) call.outputs.push_back(tensors_[t].type);
  return def->flops(call);
}

double Graph::ForwardFlops() const {
  double f = 0;
  for (size_t i = 0; i < ops_.size(); ++i) f += OpForwardFlops(i);
  return f;
}

double Graph::TrainingFlops() const {
  double f = 0;
  for (size_t i = 0; i < ops_.size(); ++i) {
    const OpDef* def = OpRegistry::Global().Find(ops_[i].type);
    f += OpForwardFlops(i) * (1.0 + def->backward_flops_multiple);
  }
  return f;
}

GraphBuilder::GraphBuilder(std::string name) { g_.name_ = std::move(name); }

void GraphBuilder::Fail(absl::Status s) {
  if (status_.ok()) status_ = std::move(s);
}

TensorId GraphBuilder::AddTensor(Tensor t) {
  if (!status_.ok()) return -1;
  if (t.name.empty()) {
    Fail(absl::InvalidArgumentError("a tensor has an empty name"));
    return -1;
  }
  if (g_.by_name_.count(t.name)) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name, "' is defined twice")));
    return -1;
  }
  auto n = CheckedNumElements(t.type.shape);
  if (!n.ok()) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name, "': ", n.status().message())));
    return -1;
  }
  TensorId id = static_cast<TensorId>(g_.tensors_.size());
  g_.by_name_[t.name] = id;
  g_.tensors_.push_back(std::move(t));
  return id;
}

TensorId GraphBuilder::Input(const std::string& name, TensorType type,
                             InputRole role) {
  Tensor t;
  t.name = name;
  t.type = std::move(type);
  t.kind = TensorKind::kInput;
  t.role = role;
  return AddTensor(std::move(t));
}

TensorId GraphBuilder::Parameter(const std::string& name, TensorType type,
                                 Initializer init, bool frozen) {
  if (status_.ok() && !IsFloating(type.dtype)) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
        "parameter '", name, "' must be floating point, is ",
        TypeString(type))));
    return -1;
  }
  if (status_.ok() && init.kind == Initializer::Kind::kValues) {
    std::string why = ValuesInitError(init, type.num_elements());
    if (!why.empty()) {
      Fail(absl::InvalidArgumentError(absl::StrCat("parameter '", name, "': ", why)));
      return -1;
    }
  }
  // A VALUES value past the parameter's dtype started it as inf (and
  // converting the double was undefined behaviour); the exporter lists
  // values of the dtype. (CONSTANT keeps what it took: a float16 model's
  // x * 1e5 exports one.)
  if (status_.ok() && init.kind == Initializer::Kind::kValues) {
    const double largest = type.dtype == DType::kFloat16    ? 65504.0
                           : type.dtype == DType::kBFloat16 ? 3.3895313892515355e38
                           : type.dtype == DType::kFloat32  ? 3.4028234663852886e38
                                                            : HUGE_VAL;
    for (size_t i = 0; i < init.values.size(); ++i) {
      if (std::abs(init.values[i]) <= largest) continue;
      Fail(absl::InvalidArgumentError(
          absl::StrCat("parameter '", name, "': its VALUES initializer's value ", i, " (",
                       init.values[i], ") does not fit its dtype ", DTypeName(type.dtype),
                       " (largest magnitude ", largest, ")")));
      return -1;
    }
  }
  Tensor t;
  t.name = name;
  t.type = std::move(type);
  t.kind = TensorKind::kParameter;
  t.init = init;
  t.frozen = frozen;
  return AddTensor(std::move(t));
}

void GraphBuilder::PushScope(const std::string& scope) {
  scopes_.push_back(scope);
}
void GraphBuilder::PopScope() {
  if (!scopes_.empty()) scopes_.pop_back();
}
std::string GraphBuilder::Scoped(const std::string& name) const {
  if (scopes_.empty()) return name;
  return absl::StrCat(absl::StrJoin(scopes_, "/"), "/", name);
}

std::vector<TensorId> GraphBuilder::AddOp(
    const std::string& type, const std::string& name,
    const std::vector<TensorId>& inputs, Attrs attrs,
    std::vector<std::string> output_names) {
  if (!status_.ok()) return {};
  if (name.empty()) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("an op of type '", type, "' has an empty name")));
    return {};
  }
  if (!op_names_.insert(name).second) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("op name '", name, "' is used by two ops")));
    return {};
  }
  std::vector<std::string> in_names;
  std::vector<TensorType> in_types;
  for (TensorId t : inputs) {
    if (t < 0 || t >= static_cast<TensorId>(g_.tensors_.size())) {
      Fail(absl::InvalidArgumentError(
          absl::StrCat("op '", name, "' (", type, "): input id ", t,
                       " does not name a tensor")));
      return {};
    }
    in_names.push_back(g_.tensors_[t].name);
    in_types.push_back(g_.tensors_[t].type);
  }
  auto out_types = InferOp(name, type, attrs, in_names, in_types);
  if (!out_types.ok()) {
    Fail(out_types.status());
    return {};
  }
  if (output_names.empty()) {
    if (out_types->size() == 1) {
      output_names.push_back(name);
    } else {
      for (size_t i = 0; i < out_types->size(); ++i) {
        output_names.push_back(absl::StrCat(name, ":", i));
      }
    }
  }
  if (output_names.size() != out_types->size()) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
        "op '", name, "' (", type, ") produces ", out_types->size(),
        " outputs but ", output_names.size(), " are named")));
    return {};
  }
  Op op;
  op.name = name;
  op.type = type;
  op.inputs = inputs;
  op.attrs = std::move(attrs);
  op.scope = scopes_.empty() ? "" : absl::StrJoin(scopes_, "/");
  OpId op_id = static_cast<OpId>(g_.ops_.size());
  for (size_t i = 0; i < out_types->size(); ++i) {
    Tensor t;
    t.name = output_names[i];
    t.type = (*out_types)[i];
    t.kind = TensorKind::kActivation;
    t.producer = op_id;
    t.producer_output = static_cast<int>(i);
    TensorId id = AddTensor(std::move(t));
    if (id < 0) return {};
    op.outputs.push_back(id);
  }
  for (TensorId t : inputs) g_.tensors_[t].consumers.push_back(op_id);
  std::vector<TensorId> outs = op.outputs;
  g_.ops_.push_back(std::move(op));
  return outs;
}

TensorId GraphBuilder::Add(const std::string& type, const std::string& name,
                           const std::vector<TensorId>& inputs, Attrs attrs) {
  auto out = AddOp(type, name, inputs, std::move(attrs));
  if (out.empty()) return -1;
  if (out.size() != 1) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
        "op '", name, "' (", type, ") has ", out.size(),
        " outputs; use AddOp")));
    return -1;
  }
  return out[0];
}

void GraphBuilder::SetLoss(TensorId loss) {
  if (status_.ok()) g_.loss_ = loss;
}

void GraphBuilder::SetMetadata(const std::string& key,
                               const std::string& value) {
  g_.metadata_[key] = value;
}

void GraphBuilder::ExpectType(const std::string& tensor,
                              const TensorType& declared) {
  if (!status_.ok()) return;
  auto it = g_.by_name_.find(tensor);
  if (it == g_.by_name_.end()) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
        "value_info names tensor '", tensor, "', which no op produces")));
    return;
  }
  const TensorType& inferred = g_.tensors_[it->second].type;
  if (inferred != declared) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor, "' is declared ", TypeString(declared),
        " but shape inference gives ", TypeString(inferred))));
  }
}

const TensorType* GraphBuilder::TypeOf(TensorId id) const {
  if (id < 0 || id >= static_cast<TensorId>(g_.tensors_.size())) {
    return nullptr;
  }
  return &g_.tensors_[id].type;
}

absl::StatusOr<Graph> GraphBuilder::Build() {
  if (!status_.ok()) return status_;
  if (g_.ops_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph '", g_.name_, "' has no ops"));
  }
  if (g_.loss_ < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph '", g_.name_, "' has no loss"));
  }
  if (g_.loss_ >= static_cast<TensorId>(g_.tensors_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("graph '", g_.name_,
                                                   "': loss id ", g_.loss_,
                                                   " does not name a tensor"));
  }
  const Tensor& loss = g_.tensors_[g_.loss_];
  if (loss.kind != TensorKind::kActivation) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss '", loss.name, "' must be produced by an op, not be ",
        loss.kind == TensorKind::kInput ? "an input" : "a parameter"));
  }
  if (loss.type.rank() != 0 || !IsFloating(loss.type.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss '", loss.name, "' must be a float scalar, is ",
                     TypeString(loss.type)));
  }
  Graph out = std::move(g_);
  g_ = Graph();
  return out;
}

}  // namespace hap::graph
