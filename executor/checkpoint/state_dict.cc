// The state_dict form of a checkpoint: how a model's state_dict tensors map
// onto the graph's (the exporter's state_dict_slices), weights read from a
// safetensors file of that form (--init-weights), and a committed sharded
// checkpoint exported to one such file (hapctl checkpoint export). The
// sharded form itself (saving, committing, the reader) is checkpoint.cc.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/json_struct.h"
#include "common/status_macros.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/checkpoint/checkpoint_internal.h"
#include "executor/checkpoint/file_util.h"
#include "google/protobuf/struct.pb.h"
#include "planner/graph/graph_proto.h"

namespace hap::executor::checkpoint {
namespace {

namespace v1 = ::hap::v1;
namespace fs = std::filesystem;

bool IsConstantInit(const graph::Initializer& i) {
  using K = graph::Initializer::Kind;
  return i.kind == K::kZeros || i.kind == K::kOnes || i.kind == K::kConstant ||
         i.kind == K::kValues;
}

namespace pb = ::google::protobuf;

// A count: a non-negative integer that a double holds exactly.
bool Count(const pb::Value& v, int64_t* out) {
  if (v.kind_case() != pb::Value::kNumberValue) return false;
  const double x = v.number_value();
  if (!(x >= 0) || x > 9007199254740992.0 || x != std::floor(x)) return false;
  *out = static_cast<int64_t>(x);
  return true;
}

// A "folded" entry: {"dtype", "shape", "runs": [[count, hex bytes], ...]},
// and "parameter": true for an unused parameter.
absl::StatusOr<FoldedBuffer> ParseFoldedBuffer(const pb::Value& v) {
  if (v.kind_case() != pb::Value::kStructValue) return absl::InvalidArgumentError("not an object");
  const auto& f = v.struct_value().fields();
  auto dtype = f.find("dtype");
  auto shape = f.find("shape");
  auto runs = f.find("runs");
  if (dtype == f.end() || dtype->second.kind_case() != pb::Value::kStringValue ||
      shape == f.end() || shape->second.kind_case() != pb::Value::kListValue || runs == f.end() ||
      runs->second.kind_case() != pb::Value::kListValue) {
    return absl::InvalidArgumentError("needs a string dtype, lists shape and runs");
  }
  FoldedBuffer out;
  if (auto parameter = f.find("parameter"); parameter != f.end()) {
    if (parameter->second.kind_case() != pb::Value::kBoolValue) {
      return absl::InvalidArgumentError("parameter is not true or false");
    }
    out.parameter = parameter->second.bool_value();
  }
  out.dtype = dtype->second.string_value();
  const int64_t width = SafetensorsDTypeWidth(out.dtype);
  if (width == 0)
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", out.dtype, "'"));
  for (const auto& d : shape->second.list_value().values()) {
    int64_t n = 0;
    if (!Count(d, &n)) return absl::InvalidArgumentError("shape holds a non-count");
    out.shape.push_back(n);
  }
  int64_t elements = 1;
  for (int64_t d : out.shape) {
    if (d != 0 && elements > (int64_t{1} << 40) / d) {
      return absl::InvalidArgumentError("too many elements");
    }
    elements *= d;
  }
  if (elements > (int64_t{1} << 30) / width) {
    return absl::InvalidArgumentError("over 1 GiB of values");
  }
  for (const auto& run : runs->second.list_value().values()) {
    int64_t n = 0;
    const bool pair = run.kind_case() == pb::Value::kListValue &&
                      run.list_value().values_size() == 2 &&
                      Count(run.list_value().values(0), &n) &&
                      run.list_value().values(1).kind_case() == pb::Value::kStringValue;
    const std::string hex = pair ? run.list_value().values(1).string_value() : "";
    if (!pair || static_cast<int64_t>(hex.size()) != 2 * width ||
        !std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
      return absl::InvalidArgumentError(
          absl::StrCat("a run is not [count, ", width, " bytes in hex]"));
    }
    if (n > elements - static_cast<int64_t>(out.bytes.size()) / width) {
      return absl::InvalidArgumentError(
          absl::StrCat("the runs hold more than the ", elements, " elements of its shape"));
    }
    const std::string element = absl::HexStringToBytes(hex);
    for (int64_t i = 0; i < n; ++i) out.bytes += element;
  }
  if (static_cast<int64_t>(out.bytes.size()) != elements * width) {
    return absl::InvalidArgumentError(absl::StrCat("the runs hold ", out.bytes.size() / width,
                                                   " elements, its shape ", elements));
  }
  return out;
}

}  // namespace

absl::StatusOr<StateDictSlices> ParseStateDictSlices(const std::string& json) {
  namespace pb = ::google::protobuf;
  pb::Struct root;
  if (!JsonToStruct(json, &root).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the graph's ", kStateDictSlicesKey, " metadata is not a JSON object"));
  }
  StateDictSlices out;
  for (const auto& [name, v] : root.fields()) {
    // Through an init-capture: C++17 lambdas cannot capture a structured
    // binding itself (clang 14 refuses it; scripts/fuzz.sh builds this file).
    auto bad = [&, &entry = name](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat(kStateDictSlicesKey, " entry '", entry, "': ", what));
    };
    if (v.kind_case() != pb::Value::kStructValue) return bad("not an object");
    const auto& f = v.struct_value().fields();
    auto source = f.find("source");
    auto axis = f.find("axis");
    auto offset = f.find("offset");
    auto shape = f.find("source_shape");
    if (source == f.end() || source->second.kind_case() != pb::Value::kStringValue ||
        axis == f.end() || axis->second.kind_case() != pb::Value::kNumberValue ||
        offset == f.end() || offset->second.kind_case() != pb::Value::kNumberValue ||
        shape == f.end() || shape->second.kind_case() != pb::Value::kListValue) {
      return bad("needs a string source, numbers axis and offset, a list source_shape");
    }
    StateDictSlice s;
    s.source = source->second.string_value();
    int64_t axis_value = 0;
    if (!Count(axis->second, &axis_value) || !Count(offset->second, &s.offset)) {
      return bad("axis or offset is not a non-negative integer");
    }
    for (const auto& d : shape->second.list_value().values()) {
      int64_t n = 0;
      if (!Count(d, &n)) return bad("source_shape holds a non-count");
      s.source_shape.push_back(n);
    }
    if (axis_value >= static_cast<int64_t>(s.source_shape.size())) {
      return bad("axis or offset out of range");
    }
    s.axis = static_cast<int>(axis_value);
    if (s.axis < 0 || s.axis >= static_cast<int>(s.source_shape.size()) || s.offset < 0 ||
        s.source.empty()) {
      return bad("axis or offset out of range");
    }
    out.emplace(name, std::move(s));
  }
  return out;
}

absl::StatusOr<StateDictExtras> ParseStateDictExtras(const std::string& json) {
  namespace pb = ::google::protobuf;
  StateDictExtras out;
  if (json.empty()) return out;
  pb::Struct root;
  auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("the graph's ", kStateDictExtrasKey, " metadata: ", what));
  };
  if (!JsonToStruct(json, &root).ok()) return bad("not a JSON object");
  const auto& f = root.fields();
  if (auto it = f.find("aliases"); it != f.end()) {
    if (it->second.kind_case() != pb::Value::kStructValue) return bad("aliases is not an object");
    for (const auto& [alias, held] : it->second.struct_value().fields()) {
      if (held.kind_case() != pb::Value::kStringValue || held.string_value().empty()) {
        return bad(absl::StrCat("alias '", alias, "' does not name a tensor"));
      }
      out.aliases.emplace(alias, held.string_value());
    }
  }
  if (auto it = f.find("counters"); it != f.end()) {
    if (it->second.kind_case() != pb::Value::kStructValue) return bad("counters is not an object");
    for (const auto& [name, v] : it->second.struct_value().fields()) {
      int64_t n = 0;
      const bool ok = v.kind_case() == pb::Value::kStructValue &&
                      v.struct_value().fields().count("per_step") &&
                      Count(v.struct_value().fields().at("per_step"), &n);
      if (!ok) {
        return bad(absl::StrCat("counter '", name, "' has no per_step (a non-negative integer)"));
      }
      out.counters.emplace(name, n);
    }
  }
  if (auto it = f.find("folded"); it != f.end()) {
    if (it->second.kind_case() != pb::Value::kStructValue) return bad("folded is not an object");
    for (const auto& [name, v] : it->second.struct_value().fields()) {
      auto folded = ParseFoldedBuffer(v);
      if (!folded.ok()) {
        return bad(absl::StrCat("folded buffer '", name, "': ", folded.status().message()));
      }
      out.folded.emplace(name, *std::move(folded));
    }
  }
  for (const char* key : {"constants", "unheld"}) {
    auto it = f.find(key);
    if (it == f.end()) continue;
    if (it->second.kind_case() != pb::Value::kListValue) {
      return bad(absl::StrCat(key, " is not a list"));
    }
    for (const auto& v : it->second.list_value().values()) {
      if (v.kind_case() != pb::Value::kStringValue) {
        return bad(absl::StrCat(key, " holds a non-string"));
      }
      if (std::string(key) == "constants") {
        out.constants.insert(v.string_value());
      } else {
        out.unheld.push_back(v.string_value());
      }
    }
  }
  return out;
}

absl::StatusOr<StateDictSlices> GraphStateDictSlices(const graph::Graph& g) {
  auto it = g.metadata().find(kStateDictSlicesKey);
  if (it == g.metadata().end()) return StateDictSlices{};
  HAP_ASSIGN_OR_RETURN(StateDictSlices slices, ParseStateDictSlices(it->second));
  for (const auto& [name, s] : slices) {
    auto id = g.FindTensor(name);
    if (!id.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kStateDictSlicesKey, " names '", name, "', not a tensor of the graph"));
    }
    const Shape& shape = g.tensor(*id).type.shape;
    bool fits = shape.size() == s.source_shape.size();
    for (size_t d = 0; fits && d < shape.size(); ++d) {
      fits = static_cast<int>(d) == s.axis ? s.offset + shape[d] <= s.source_shape[d]
                                           : shape[d] == s.source_shape[d];
    }
    if (!fits) {
      return absl::InvalidArgumentError(absl::StrCat(kStateDictSlicesKey, " entry '", name, "' ",
                                                     graph::ShapeString(shape), " does not fit in ",
                                                     s.source, graph::ShapeString(s.source_shape),
                                                     " at offset ", s.offset, " of axis ", s.axis));
    }
  }
  return slices;
}

namespace {

// "name (F32[2] in the file, F32[3] in the model)".
std::string Mismatch(const std::string& name, absl::string_view file_dtype, const Shape& file_shape,
                     DType model_dtype, const Shape& model_shape) {
  return absl::StrCat(name, " (", file_dtype, graph::ShapeString(file_shape), " in the file, ",
                      SafetensorsDType(model_dtype), graph::ShapeString(model_shape),
                      " in the model)");
}

std::string FoldedMismatch(const std::string& name, const FoldedBuffer& b) {
  if (b.parameter) {
    // The run does not hold it: exports give back its values at export,
    // which would not be the ones the run started from.
    return absl::StrCat(name,
                        " (a parameter forward does not use, recorded at export so that exports "
                        "give it back as PyTorch's training leaves it; other values in the file: "
                        "export the model again with these)");
  }
  return absl::StrCat(name,
                      " (a buffer the graph's constants were built from at export, other values "
                      "in the file: export the model again with these)");
}

}  // namespace

absl::StatusOr<StateDictExtras> GraphStateDictExtras(const graph::Graph& g) {
  auto it = g.metadata().find(kStateDictExtrasKey);
  if (it == g.metadata().end()) return StateDictExtras{};
  return ParseStateDictExtras(it->second);
}

absl::StatusOr<std::unique_ptr<WeightsReader>> WeightsReader::Open(const std::string& path,
                                                                   StateDictSlices slices,
                                                                   StateDictExtras extras) {
  std::unique_ptr<WeightsReader> r(new WeightsReader);
  HAP_ASSIGN_OR_RETURN(r->file_, SafetensorsFile::Open(path));
  r->slices_ = std::move(slices);
  r->extras_ = std::move(extras);
  return r;
}

absl::StatusOr<std::unique_ptr<WeightsReader>> WeightsReader::OpenFor(const std::string& path,
                                                                      const graph::Graph& g) {
  HAP_ASSIGN_OR_RETURN(StateDictSlices slices, GraphStateDictSlices(g));
  HAP_ASSIGN_OR_RETURN(StateDictExtras extras, GraphStateDictExtras(g));
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<WeightsReader> r,
                       Open(path, std::move(slices), std::move(extras)));
  HAP_RETURN_IF_ERROR(r->CheckGraph(g));
  return r;
}

std::string WeightsReader::FileName(const std::string& name) const {
  if (file_->tensors().count(name)) return name;
  for (const auto& [alias, held] : extras_.aliases) {
    if (held == name && file_->tensors().count(alias)) return alias;
  }
  return name;
}

absl::Status WeightsReader::CheckGraph(const graph::Graph& g) const {
  std::set<std::string> model;
  std::vector<std::string> missing, extra, mismatched;
  for (graph::TensorId id : g.Parameters()) {
    const graph::Tensor& t = g.tensor(id);
    auto slice = slices_.find(t.name);
    if (slice != slices_.end()) {
      // Read from a slice of its source tensor, which must be there whole.
      const StateDictSlice& s = slice->second;
      model.insert(s.source);
      auto it = file_->tensors().find(FileName(s.source));
      if (it == file_->tensors().end()) {
        if (std::find(missing.begin(), missing.end(), s.source) == missing.end()) {
          missing.push_back(s.source);
        }
      } else if (it->second.shape != s.source_shape || it->second.dtype != t.type.dtype) {
        mismatched.push_back(Mismatch(s.source, SafetensorsDType(it->second.dtype),
                                      it->second.shape, t.type.dtype, s.source_shape));
      }
      continue;
    }
    model.insert(t.name);
    auto it = file_->tensors().find(FileName(t.name));
    if (auto other = file_->others().find(t.name); other != file_->others().end()) {
      mismatched.push_back(
          Mismatch(t.name, other->second.dtype, other->second.shape, t.type.dtype, t.type.shape));
    } else if (it == file_->tensors().end()) {
      // The exporter's constants (frozen, constant initialisers) are not
      // PyTorch parameters: they start from their initialiser.
      if (!(t.frozen && IsConstantInit(t.init))) missing.push_back(t.name);
    } else if (it->second.shape != t.type.shape || it->second.dtype != t.type.dtype) {
      mismatched.push_back(Mismatch(t.name, SafetensorsDType(it->second.dtype), it->second.shape,
                                    t.type.dtype, t.type.shape));
    }
  }
  // Tied names (equal to the tensor they name) and state_dict entries the
  // graph does not hold: what model.state_dict() has beyond the graph.
  HAP_ASSIGN_OR_RETURN(StateDictExtras extras, GraphStateDictExtras(g));
  const std::set<std::string> unheld(extras.unheld.begin(), extras.unheld.end());
  for (const auto& [name, t] : file_->tensors()) {
    if (model.count(name) || unheld.count(name)) continue;
    if (extras.counters.count(name)) {
      if (t.dtype != DType::kInt64 || !t.shape.empty()) {
        mismatched.push_back(absl::StrCat(name, " (", SafetensorsDType(t.dtype),
                                          graph::ShapeString(t.shape),
                                          " in the file, an I64 scalar counter in the model)"));
      }
      continue;
    }
    if (auto folded = extras.folded.find(name); folded != extras.folded.end()) {
      auto v = file_->View(name);
      const FoldedBuffer& b = folded->second;
      if (!v.ok() || SafetensorsDType(v->dtype) != b.dtype || v->shape != b.shape ||
          std::memcmp(v->data, b.bytes.data(), b.bytes.size()) != 0) {
        mismatched.push_back(FoldedMismatch(name, folded->second));
      }
      continue;
    }
    auto alias = extras.aliases.find(name);
    if (alias == extras.aliases.end()) {
      extra.push_back(name);
      continue;
    }
    auto held = file_->tensors().find(alias->second);
    if (held == file_->tensors().end()) continue;  // stands in for it
    auto a = file_->View(name);
    auto h = file_->View(alias->second);
    if (!a.ok() || !h.ok() || a->dtype != h->dtype || a->shape != h->shape ||
        std::memcmp(a->data, h->data, a->bytes()) != 0) {
      mismatched.push_back(absl::StrCat(name, " (tied to ", alias->second,
                                        " in the model, other values in the file)"));
    }
  }
  // Entries of dtypes we do not train with (a model's BOOL or U8 buffers):
  // folded buffers with their recorded values, or unheld.
  for (const auto& [name, other] : file_->others()) {
    if (model.count(name) || unheld.count(name)) continue;  // a parameter: named above
    auto folded = extras.folded.find(name);
    if (folded == extras.folded.end()) {
      extra.push_back(absl::StrCat(name, " (", other.dtype, ")"));
    } else if (other.dtype != folded->second.dtype || other.shape != folded->second.shape ||
               other.bytes != folded->second.bytes) {
      mismatched.push_back(FoldedMismatch(name, folded->second));
    }
  }
  if (missing.empty() && extra.empty() && mismatched.empty()) return absl::OkStatus();
  std::string msg = absl::StrCat("the weights ", file_->path(), " do not fit the model");
  if (!missing.empty()) absl::StrAppend(&msg, "; missing: ", absl::StrJoin(missing, ", "));
  if (!extra.empty()) absl::StrAppend(&msg, "; not in the model: ", absl::StrJoin(extra, ", "));
  if (!mismatched.empty()) {
    absl::StrAppend(&msg, "; other shape or dtype: ", absl::StrJoin(mismatched, ", "));
  }
  return absl::FailedPreconditionError(msg);
}

bool WeightsReader::Has(const std::string& name) const {
  auto slice = slices_.find(name);
  return file_->tensors().count(FileName(slice != slices_.end() ? slice->second.source : name)) > 0;
}

absl::Status WeightsReader::Read(const std::string& name, const Shape& global,
                                 absl::Span<const int64_t> offsets, TensorView dst) {
  auto slice = slices_.find(name);
  if (slice != slices_.end()) {
    const StateDictSlice& s = slice->second;
    HAP_RETURN_IF_ERROR(VerifyChecksum(*file_, FileName(s.source), &verified_));
    HAP_ASSIGN_OR_RETURN(TensorView whole, file_->View(FileName(s.source)));
    HAP_RETURN_IF_ERROR(CheckRequest(s.source, whole.dtype, whole.shape, s.source_shape,
                                     std::vector<int64_t>(s.source_shape.size(), 0),
                                     TensorView{dst.dtype, s.source_shape, nullptr},
                                     file_->path()));
    if (global.size() != s.source_shape.size() || offsets.size() != global.size()) {
      return absl::InvalidArgumentError(absl::StrCat("a malformed piece of '", name, "'"));
    }
    // The graph parameter is the box [offset, offset + global[axis]) of the
    // source along `axis`; the piece asked for lies inside it.
    std::vector<int64_t> in_source(offsets.begin(), offsets.end());
    in_source[s.axis] += s.offset;
    const std::vector<int64_t> zero(global.size(), 0);
    return CopyOverlap(whole, zero, dst, in_source).status();
  }
  HAP_RETURN_IF_ERROR(VerifyChecksum(*file_, FileName(name), &verified_));
  HAP_ASSIGN_OR_RETURN(TensorView whole, file_->View(FileName(name)));
  HAP_RETURN_IF_ERROR(
      CheckRequest(name, whole.dtype, whole.shape, global, offsets, dst, file_->path()));
  const std::vector<int64_t> zero(global.size(), 0);
  return CopyOverlap(whole, zero, dst, offsets).status();
}

namespace {

// InvalidArgument when writing `out` would replace a file of the checkpoint
// in `step_dir` (a shard, the index, through a link or a hard link too) or
// add one to it.
absl::Status CheckNotInCheckpoint(const std::string& out, const std::string& step_dir) {
  std::error_code ec;
  const fs::path parent = fs::absolute(out, ec).parent_path();
  bool inside = !ec && fs::equivalent(parent, step_dir, ec);
  for (fs::directory_iterator it(step_dir, ec), end; !inside && !ec && it != end;
       it.increment(ec)) {
    std::error_code eq;
    inside = fs::equivalent(out, it->path(), eq);
  }
  if (!inside) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("the export's output ", out, " is part of the checkpoint ", step_dir,
                   " (it would overwrite or add to its own input): write it elsewhere"));
}

// Writes the safetensors file `out` whole or not at all: into a temporary
// file next to it, renamed over `out` once synced. On failure `out` is as
// it was and the temporary file is gone.
absl::Status WriteSafetensorsAtomically(const std::string& out,
                                        const std::vector<SafetensorsEntry>& entries,
                                        const std::map<std::string, std::string>& metadata) {
  const fs::path path(out);
  const fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  const std::string tmp =
      (dir / absl::StrCat(".tmp-", path.filename().string(), ".", ::getpid())).string();
  absl::Status s = WriteSafetensors(tmp, entries, metadata);
  std::error_code ec;
  if (s.ok()) {
    fs::rename(tmp, out, ec);
    if (ec)
      s = absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", out, ": ", ec.message()));
  }
  if (!s.ok()) {
    fs::remove(tmp, ec);
    return s;
  }
  return SyncDirectory(dir.string());
}

}  // namespace

absl::StatusOr<int64_t> ExportCheckpoint(CheckpointReader& reader, const std::string& out,
                                         bool with_optimizer_state) {
  HAP_RETURN_IF_ERROR(CheckNotInCheckpoint(out, reader.step_dir()));
  StateDictSlices slices;
  if (!reader.trainer().state_dict_slices().empty()) {
    const std::string where = (fs::path(reader.step_dir()) / kTrainerFile).string();
    auto parsed = ParseStateDictSlices(reader.trainer().state_dict_slices());
    if (!parsed.ok()) {
      return absl::DataLossError(absl::StrCat("the checkpoint file ", where,
                                              " is corrupted: ", parsed.status().message()));
    }
    slices = *std::move(parsed);
    // The pieces of each source tensor tile it exactly (nothing is
    // allocated for a source before this holds).
    std::map<std::string, v1::CheckpointIndex::Tensor> sources;
    for (const auto& t : reader.index().tensors()) {
      auto slice = slices.find(t.name());
      if (slice == slices.end() || (t.optimizer_state() && !with_optimizer_state)) continue;
      const StateDictSlice& s = slice->second;
      v1::CheckpointIndex::Tensor& source = sources[s.source];
      if (source.name().empty()) {
        source.set_name(s.source);
        source.set_dtype(t.dtype());
        for (int64_t d : s.source_shape) source.add_shape(d);
      }
      if (t.dtype() != source.dtype() || t.shape_size() != source.shape_size()) {
        return absl::DataLossError(
            absl::StrCat("the checkpoint file ", where, " is corrupted: '", t.name(), "' (",
                         t.dtype(), ") cannot be a slice of '", s.source, "' (", source.dtype(),
                         ", ", source.shape_size(), " dimensions)"));
      }
      v1::CheckpointIndex::Slice* piece = source.add_slices();
      piece->set_file(t.name());
      for (int d = 0; d < t.shape_size(); ++d) piece->add_offsets(d == s.axis ? s.offset : 0);
      *piece->mutable_extents() = t.shape();
    }
    for (const auto& [name, source] : sources) {
      if (const std::string why = TilingError(source); !why.empty()) {
        return absl::DataLossError(absl::StrCat("the checkpoint file ", where,
                                                " is corrupted: the state_dict slices of '", name,
                                                "' ", why));
      }
    }
  }
  StateDictExtras extras;
  if (!reader.trainer().state_dict_extras().empty()) {
    auto parsed = ParseStateDictExtras(reader.trainer().state_dict_extras());
    if (!parsed.ok()) {
      return absl::DataLossError(absl::StrCat("the checkpoint file ",
                                              (fs::path(reader.step_dir()) / kTrainerFile).string(),
                                              " is corrupted: ", parsed.status().message()));
    }
    extras = *std::move(parsed);
  }
  std::map<std::string, HostTensor> tensors;  // by the name written
  for (const auto& t : reader.index().tensors()) {
    if (t.optimizer_state() && !with_optimizer_state) continue;
    // The exporter's constants are not the model's (nor their state).
    const std::string param = t.name().substr(0, t.name().find('#'));
    if (extras.constants.count(param)) continue;
    HAP_ASSIGN_OR_RETURN(DType dtype, FromSafetensorsDType(t.dtype()));
    const Shape shape(t.shape().begin(), t.shape().end());
    const std::vector<int64_t> zero(shape.size(), 0);
    auto slice = slices.find(t.name());
    if (slice == slices.end()) {
      HostTensor& whole = tensors.try_emplace(t.name(), dtype, shape).first->second;
      HAP_RETURN_IF_ERROR(reader.Read(t.name(), shape, zero, whole.view()));
      continue;
    }
    // A slice of a PyTorch parameter (q of in_proj_weight): into its source.
    const StateDictSlice& s = slice->second;
    HostTensor part(dtype, shape);
    HAP_RETURN_IF_ERROR(reader.Read(t.name(), shape, zero, part.view()));
    HostTensor& source = tensors.try_emplace(s.source, dtype, s.source_shape).first->second;
    std::vector<int64_t> at(shape.size(), 0);
    at[s.axis] = s.offset;
    if (source.shape() != s.source_shape || source.dtype() != dtype ||
        shape.size() != s.source_shape.size()) {
      return absl::DataLossError(absl::StrCat("the slices of '", s.source, "' disagree"));
    }
    HAP_RETURN_IF_ERROR(HostCopyBox(part.view(), zero, source.view(), at, shape));
  }
  // The state_dict entries the graph does not hold but the checkpoint
  // knows: BatchNorm's counters, the buffers folded into constants and the
  // parameters forward does not use (as they were at export).
  for (const auto& [name, value] : reader.trainer().num_batches_tracked()) {
    if (!extras.counters.count(name) || tensors.count(name)) continue;
    HostTensor& counter = tensors.try_emplace(name, DType::kInt64, Shape{}).first->second;
    counter.as<int64_t>()[0] = value;
  }
  std::vector<SafetensorsEntry> entries;
  int64_t bytes = 0;
  for (const auto& [name, b] : extras.folded) {
    if (tensors.count(name)) continue;
    entries.emplace_back(
        name, TensorView{DType::kFloat32, b.shape, const_cast<char*>(b.bytes.data())}, b.dtype);
    bytes += static_cast<int64_t>(b.bytes.size());
  }
  for (const auto& [name, t] : tensors) {
    entries.push_back({name, t.view()});
    bytes += t.view().bytes();
  }
  // Each further name of a tied tensor, as load_state_dict wants them all.
  for (const auto& [alias, held] : extras.aliases) {
    auto it = tensors.find(held);
    if (it == tensors.end() || tensors.count(alias)) continue;
    entries.push_back({alias, it->second.view()});
    bytes += it->second.view().bytes();
  }
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"hap_step", std::to_string(reader.trainer().step())},
      {"hap_graph", reader.trainer().graph_name()},
      {"hap_graph_hash", reader.trainer().graph_hash()}};
  AddChecksums(entries, &metadata);  // checked by --init-weights
  HAP_RETURN_IF_ERROR(WriteSafetensorsAtomically(out, entries, metadata));
  return bytes;
}

absl::Status SetStartCounters(const v1::TrainerState* resumed, const WeightsReader* weights,
                              v1::TrainerState* trainer) {
  constexpr int64_t kMostCounter = int64_t{1} << 62;
  HAP_ASSIGN_OR_RETURN(StateDictExtras extras, ParseStateDictExtras(trainer->state_dict_extras()));
  if (resumed != nullptr) trainer->set_step(resumed->step());
  auto& start = *trainer->mutable_num_batches_tracked();
  start.clear();
  for (const auto& [name, per_step] : extras.counters) {
    int64_t value = 0;
    if (resumed != nullptr) {
      auto it = resumed->num_batches_tracked().find(name);
      // Written without counters: as many as the steps made. A step read
      // from a damaged trainer.json must not overflow into a counter.
      if (it == resumed->num_batches_tracked().end() && per_step > 0 &&
          resumed->step() > std::numeric_limits<int64_t>::max() / per_step) {
        return absl::DataLossError(absl::StrCat(
            "the resumed checkpoint's trainer.json is corrupted: its step ", resumed->step(),
            " times the ", per_step, " forwards a step of counter '", name, "' overflows 64 bits"));
      }
      value = it != resumed->num_batches_tracked().end() ? it->second : resumed->step() * per_step;
    } else if (weights != nullptr && weights->file().tensors().count(name)) {
      HAP_ASSIGN_OR_RETURN(TensorView v, weights->file().View(name));
      if (v.dtype != DType::kInt64 || !v.shape.empty()) {
        return absl::FailedPreconditionError(absl::StrCat("the weights ", weights->file().path(),
                                                          " hold ", name,
                                                          " as other than an I64 scalar"));
      }
      std::memcpy(&value, v.data, sizeof(value));
    }
    // A counter counts forward passes: one below 0 or past 2^62 (which the
    // saves would carry on adding to, past 2^63) is a damaged file's.
    if (value < 0 || value > kMostCounter) {
      const std::string what =
          absl::StrCat("counter '", name, "' is ", value, ", outside [0, 2^62]");
      if (resumed != nullptr) {
        return absl::DataLossError(
            absl::StrCat("the resumed checkpoint's trainer.json is corrupted: its ", what));
      }
      return absl::FailedPreconditionError(
          absl::StrCat("the weights ", weights->file().path(), " are damaged: their ", what));
    }
    start[name] = value;
  }
  return absl::OkStatus();
}

}  // namespace hap::executor::checkpoint
