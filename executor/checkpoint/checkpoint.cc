#include "executor/checkpoint/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <mutex>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "executor/checkpoint/checkpoint_internal.h"
#include "executor/checkpoint/crc32c.h"
#include "executor/checkpoint/file_util.h"
#include "executor/runtime/device.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "planner/graph/graph_proto.h"

namespace hap::executor::checkpoint {
namespace {

namespace v1 = ::hap::v1;
namespace fs = std::filesystem;

constexpr char kIndexFile[] = "index.json";
// Next to a rank's file in the temporary directory when its write failed:
// holds the error.
constexpr char kFailedSuffix[] = ".failed";

bool IsPersistent(const v1::Buffer& b) {
  return b.role() == v1::Buffer::PARAMETER || b.role() == v1::Buffer::OPTIMIZER_STATE;
}

bool Exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

// A checkpoint file that cannot be read: DataLoss when it is missing or
// malformed (the checkpoint is damaged, and the planner sets it aside);
// otherwise the I/O error as it is, an Internal one (EMFILE, EIO, a failed
// mmap) as Unavailable: the checkpoint is not to blame, and is tried again.
absl::Status ReadFailure(const absl::Status& s, std::string message) {
  switch (s.code()) {
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kInvalidArgument:
      return absl::DataLossError(std::move(message));
    case absl::StatusCode::kInternal:
      return absl::UnavailableError(std::move(message));
    default:
      return absl::Status(s.code(), std::move(message));
  }
}

// `m` as JSON; the printer's error fails the commit rather than leaving an
// empty or partial file that COMMITTED would then vouch for.
absl::StatusOr<std::string> ToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  std::string out;
  const auto printed = google::protobuf::util::MessageToJsonString(m, &out, o);
  if (!printed.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot write ", m.GetDescriptor()->name(), " as JSON: ", printed.ToString()));
  }
  return out;
}

// What COMMITTED records of the checkpoint's other files: after the step's
// line, one line "NAME BYTES CRC32C" for index.json and trainer.json.
struct Recorded {
  int64_t bytes = 0;
  std::string crc;  // Crc32cHex
};
using Manifest = std::map<std::string, Recorded>;

std::string ManifestLine(const std::string& name, absl::string_view contents) {
  return absl::StrCat(name, " ", contents.size(), " ",
                      Crc32cHex(Crc32c(0, contents.data(), contents.size())), "\n");
}

// The records of `dir`'s COMMITTED (none in the step alone, which older
// writers wrote). A last line without its newline (a cut write) is not
// read; DataLoss naming the file for a malformed record.
absl::StatusOr<Manifest> ReadManifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kCommittedFile).string();
  auto text = ReadFile(path);
  if (!text.ok()) {
    return ReadFailure(text.status(), absl::StrCat("the checkpoint file ", path,
                                                   " cannot be read: ", text.status().message()));
  }
  std::vector<std::string> lines = absl::StrSplit(*text, '\n');
  lines.pop_back();  // after the last newline: empty, or a line cut short
  Manifest out;
  for (size_t i = 1; i < lines.size(); ++i) {
    std::vector<std::string> fields = absl::StrSplit(lines[i], ' ');
    Recorded r;
    if (fields.size() != 3 || fields[0].empty() || !absl::SimpleAtoi(fields[1], &r.bytes) ||
        r.bytes < 0 || fields[2].size() != 8 ||
        fields[2].find_first_not_of("0123456789abcdef") != std::string::npos) {
      return absl::DataLossError(absl::StrCat("the checkpoint file ", path,
                                              " is corrupted: its line '", lines[i],
                                              "' is not 'FILE BYTES CRC32C'"));
    }
    r.crc = fields[2];
    out[fields[0]] = r;
  }
  return out;
}

absl::Status FromJsonFile(const std::string& path, google::protobuf::Message* m,
                          const Manifest& manifest) {
  auto text = ReadFile(path);
  if (!text.ok()) {
    return ReadFailure(text.status(), absl::StrCat("the checkpoint file ", path,
                                                   " cannot be read: ", text.status().message()));
  }
  google::protobuf::util::JsonParseOptions o;
  o.ignore_unknown_fields = true;  // newer writers may add fields
  auto s = google::protobuf::util::JsonStringToMessage(*text, m, o);
  if (!s.ok()) {
    return absl::DataLossError(absl::StrCat("the checkpoint file ", path, " is corrupted: ",
                                            std::string(s.message())));
  }
  // Valid JSON, and yet not what was written (a flipped digit, or a
  // field's name the parser then ignores).
  if (auto r = manifest.find(fs::path(path).filename().string()); r != manifest.end()) {
    const std::string crc = Crc32cHex(Crc32c(0, text->data(), text->size()));
    if (static_cast<int64_t>(text->size()) != r->second.bytes || crc != r->second.crc) {
      return absl::DataLossError(absl::StrCat(
          path, " is damaged: it has ", text->size(), " bytes of CRC-32C ", crc, ", ",
          kCommittedFile, " records ", r->second.bytes, " bytes of CRC-32C ", r->second.crc));
    }
  }
  return absl::OkStatus();
}

// The step of a checkpoint being opened, as trainer.json says, checked
// against index.json, the directory's name (a link resolved) and the
// samples it implies: DataLoss naming trainer.json otherwise. A resumed run
// starts from this step.
absl::Status CheckStep(const std::string& dir, const v1::CheckpointIndex& index,
                       const v1::TrainerState& trainer) {
  const std::string file = (fs::path(dir) / kTrainerFile).string();
  const int64_t step = trainer.step();
  if (step < 0) return absl::DataLossError(absl::StrCat(file, ": step ", step, " is negative"));
  if (index.step() != step) {
    return absl::DataLossError(absl::StrCat(file, " says step ", step, ", ",
                                            (fs::path(dir) / kIndexFile).string(), " says step ",
                                            index.step()));
  }
  std::error_code ec;
  fs::path resolved = fs::canonical(dir, ec);
  if (ec) resolved = fs::path(dir).lexically_normal();
  if (resolved.filename().empty()) resolved = resolved.parent_path();
  if (const int64_t named = StepOf(resolved.filename().string()); named >= 0 && named != step) {
    return absl::DataLossError(
        absl::StrCat(file, " says step ", step, ", the directory's name says step ", named));
  }
  const int64_t batch = trainer.global_batch();
  if (batch < 0) {
    return absl::DataLossError(absl::StrCat(file, ": global batch ", batch, " is negative"));
  }
  if (batch > 0 && step > std::numeric_limits<int64_t>::max() / batch) {
    return absl::DataLossError(absl::StrCat(file, ": step ", step, " times the global batch of ",
                                            batch, " (the samples seen) overflows 64 bits"));
  }
  return absl::OkStatus();
}

// A shard records the step, rank and world size it was written for
// (SaveCheckpoint's metadata): one of another checkpoint, copied in, holds
// tensors of the same names and shapes. DataLoss naming the file.
absl::Status CheckShardOrigin(const SafetensorsFile& f, int64_t step, int rank, int world) {
  auto recorded = [&](const char* key, int64_t want) -> std::optional<std::string> {
    auto it = f.metadata().find(key);
    if (it == f.metadata().end() || it->second == std::to_string(want)) return std::nullopt;
    return it->second;
  };
  if (auto v = recorded("step", step)) {
    return absl::DataLossError(absl::StrCat(f.path(), " was written for step ", *v,
                                            ", the checkpoint is of step ", step,
                                            " (a shard of another checkpoint?)"));
  }
  if (auto v = recorded("rank", rank)) {
    return absl::DataLossError(absl::StrCat(f.path(), " was written for rank ", *v, ", not rank ",
                                            rank, " as its name says"));
  }
  if (auto v = recorded("world_size", world)) {
    return absl::DataLossError(absl::StrCat(f.path(), " was written for ", *v,
                                            " ranks, the checkpoint's world is ", world));
  }
  return absl::OkStatus();
}

// Creates `dir` and its missing parents, and fsyncs the parent of each
// directory it created, so that the new names persist.
absl::Status CreateDirectoriesSynced(const std::string& dir) {
  std::vector<fs::path> missing;  // deepest first
  fs::path p = fs::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  for (; !p.empty() && !Exists(p.string()); p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create the checkpoint directory ", dir, ": ", ec.message()));
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    const fs::path parent = it->parent_path().empty() ? fs::path(".") : it->parent_path();
    HAP_RETURN_IF_ERROR(SyncDirectory(parent.string()));
  }
  return absl::OkStatus();
}

// A slice's tensor as its shard holds it (`dtype`, `shape`) against the
// index: DataLoss naming the file otherwise.
absl::Status CheckSliceShape(const std::string& path, const v1::CheckpointIndex::Tensor& t,
                             const v1::CheckpointIndex::Slice& s, absl::string_view dtype,
                             const Shape& shape) {
  const Shape extents(s.extents().begin(), s.extents().end());
  if (shape == extents && dtype == t.dtype()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(path, " holds '", t.name(), "' as ", dtype,
                                          graph::ShapeString(shape), ", the index says ", t.dtype(),
                                          graph::ShapeString(extents)));
}

// Every slice of the index placed in `f` (named `file` in the index) is
// there, of the index's dtype and shape: DataLoss naming the file otherwise.
// `dir` names the checkpoint.
absl::Status CheckSlicesInShard(const v1::CheckpointIndex& index, const std::string& file,
                                const SafetensorsFile& f, const std::string& dir) {
  for (const auto& t : index.tensors()) {
    for (const auto& s : t.slices()) {
      if (s.file() != file) continue;
      auto it = f.tensors().find(t.name());
      if (it == f.tensors().end()) {
        return absl::DataLossError(absl::StrCat(f.path(), " lacks '", t.name(),
                                                "', which the index of ", dir, " places there"));
      }
      HAP_RETURN_IF_ERROR(
          CheckSliceShape(f.path(), t, s, SafetensorsDType(it->second.dtype), it->second.shape));
    }
  }
  return absl::OkStatus();
}

// Rank 0, after every rank wrote its file: checks them, writes the index
// and the trainer state, and commits.
absl::StatusOr<std::string> Commit(const SaveRequest& r, const v1::CheckpointIndex& index,
                                   const std::string& tmp, const std::string& final_dir) {
  const int world = static_cast<int>(r.programs->size());
  // A rank whose write failed left its error next to where its file was.
  for (int rank = 0; rank < world; ++rank) {
    const std::string marker =
        (fs::path(tmp) / absl::StrCat(RankFileName(rank, world), kFailedSuffix)).string();
    if (!Exists(marker)) continue;
    auto error = ReadFile(marker);
    return absl::AbortedError(absl::StrCat(
        "rank ", rank, " could not write its checkpoint file: ",
        error.ok() ? *error
                   : absl::StrCat("(its error is unreadable: ", error.status().message(), ")")));
  }
  for (int rank = 0; rank < world; ++rank) {
    const std::string file = (fs::path(tmp) / RankFileName(rank, world)).string();
    auto opened = SafetensorsFile::Open(file);
    if (!opened.ok()) {
      return absl::AbortedError(absl::StrCat("rank ", rank, " did not write its checkpoint file (",
                                             opened.status().message(), ")"));
    }
    // What its program wrote against the index the plan made: a mismatch
    // is committed as a checkpoint no resume can open.
    HAP_RETURN_IF_ERROR(CheckSlicesInShard(index, RankFileName(rank, world), **opened, final_dir));
  }
  v1::TrainerState trainer = r.trainer;
  trainer.set_format_version(kCheckpointFormatVersion);
  trainer.set_world_size(world);
  trainer.set_time(absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone()));
  HAP_ASSIGN_OR_RETURN(const std::string index_json, ToJson(index));
  HAP_ASSIGN_OR_RETURN(const std::string trainer_json, ToJson(trainer));
  HAP_RETURN_IF_ERROR(WriteFileSynced((fs::path(tmp) / kIndexFile).string(), index_json));
  HAP_RETURN_IF_ERROR(WriteFileSynced((fs::path(tmp) / kTrainerFile).string(), trainer_json));
  HAP_RETURN_IF_ERROR(SyncDirectory(tmp));
  // A directory of this step left without COMMITTED (a crash after the
  // rename) is replaced; a committed one is never overwritten in place.
  if (Exists(final_dir)) {
    if (Exists((fs::path(final_dir) / kCommittedFile).string())) {
      return absl::AlreadyExistsError(
          absl::StrCat("a complete checkpoint ", final_dir, " exists already"));
    }
    HAP_RETURN_IF_ERROR(RemoveAll(final_dir));
  }
  std::error_code ec;
  fs::rename(tmp, final_dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp, " to ", final_dir, ": ", ec.message()));
  }
  HAP_RETURN_IF_ERROR(SyncDirectory(r.dir));
  // COMMITTED exists only when it is durable: the other ranks take its
  // presence for success.
  const std::string committed_file = (fs::path(final_dir) / kCommittedFile).string();
  absl::Status commit = WriteFileSynced(
      committed_file, absl::StrCat(trainer.step(), "\n", ManifestLine(kIndexFile, index_json),
                                   ManifestLine(kTrainerFile, trainer_json)));
  if (commit.ok()) commit = SyncDirectory(final_dir);
  if (!commit.ok()) {
    fs::remove(committed_file, ec);
    return commit;
  }
  Retain(r, trainer.step());
  return final_dir;
}

}  // namespace

std::string TilingError(const v1::CheckpointIndex::Tensor& t) {
  const int rank = t.shape_size();
  const Shape shape(t.shape().begin(), t.shape().end());
  int64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && elements > std::numeric_limits<int64_t>::max() / d)) {
      return absl::StrCat("have an invalid global shape ", graph::ShapeString(shape));
    }
    elements *= d;
  }
  std::vector<int> live;  // slices with elements, by their first offset
  int64_t covered = 0;
  for (int i = 0; i < t.slices_size(); ++i) {
    const auto& s = t.slices(i);
    if (s.offsets_size() != rank || s.extents_size() != rank) {
      return absl::StrCat("have a slice of another number of dimensions (in ", s.file(), ")");
    }
    int64_t n = 1;
    for (int d = 0; d < rank; ++d) {
      if (s.offsets(d) < 0 || s.extents(d) < 0 || s.offsets(d) > shape[d] - s.extents(d)) {
        return absl::StrCat("lie outside ", graph::ShapeString(shape), " (a slice in ", s.file(),
                            ")");
      }
      n *= s.extents(d);  // at most `elements`: no overflow
    }
    if (n > 0) live.push_back(i);
  }
  if (rank > 0) {
    std::sort(live.begin(), live.end(),
              [&](int a, int b) { return t.slices(a).offsets(0) < t.slices(b).offsets(0); });
  }
  for (size_t i = 0; i < live.size(); ++i) {
    const auto& a = t.slices(live[i]);
    for (size_t j = i + 1; j < live.size(); ++j) {
      const auto& b = t.slices(live[j]);
      if (rank > 0 && b.offsets(0) >= a.offsets(0) + a.extents(0)) break;  // and the rest
      bool overlap = true;
      for (int d = 0; overlap && d < rank; ++d) {
        overlap = a.offsets(d) < b.offsets(d) + b.extents(d) &&
                  b.offsets(d) < a.offsets(d) + a.extents(d);
      }
      if (overlap) {
        return absl::StrCat("overlap (slices in ", a.file(), " and ", b.file(), ")");
      }
    }
    int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= a.extents(d);
    covered += n;  // disjoint boxes inside the tensor: at most `elements`
  }
  if (covered != elements) {
    return absl::StrCat("leave elements uncovered (", covered, " of ", elements, ")");
  }
  return "";
}

std::string RankFileName(int rank, int world_size) {
  return absl::StrFormat("rank-%05d-of-%05d.safetensors", rank, world_size);
}

absl::StatusOr<v1::CheckpointIndex> BuildIndex(const std::vector<v1::RankProgram>& programs,
                                               int64_t step) {
  v1::CheckpointIndex index;
  index.set_format_version(kCheckpointFormatVersion);
  index.set_step(step);
  const int world = static_cast<int>(programs.size());
  std::map<std::string, v1::CheckpointIndex::Tensor> tensors;
  int64_t total = 0;
  for (int rank = 0; rank < world; ++rank) {
    for (const v1::Buffer& b : programs[rank].buffers()) {
      if (!IsPersistent(b)) continue;
      const graph::DType dtype = graph::FromProtoDType(b.dtype());
      const std::string dname(SafetensorsDType(dtype));
      auto [it, fresh] = tensors.try_emplace(b.tensor());
      v1::CheckpointIndex::Tensor& t = it->second;
      if (fresh) {
        t.set_name(b.tensor());
        t.set_dtype(dname);
        *t.mutable_shape() = b.global_shape();
        t.set_optimizer_state(b.role() == v1::Buffer::OPTIMIZER_STATE);
      } else if (t.dtype() != dname ||
                 !std::equal(t.shape().begin(), t.shape().end(), b.global_shape().begin(),
                             b.global_shape().end())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the pieces of '", b.tensor(), "' disagree in global shape or dtype (rank ", rank, ")"));
      }
      if (b.offsets_size() != b.global_shape_size() || b.shape_size() != b.global_shape_size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("buffer of '", b.tensor(), "' on rank ", rank, " has malformed offsets"));
      }
      bool duplicate = false;
      for (const auto& s : t.slices()) {
        if (std::equal(s.offsets().begin(), s.offsets().end(), b.offsets().begin(),
                       b.offsets().end()) &&
            std::equal(s.extents().begin(), s.extents().end(), b.shape().begin(),
                       b.shape().end())) {
          duplicate = true;  // replicated: its lowest rank writes it
          break;
        }
      }
      if (duplicate) continue;
      v1::CheckpointIndex::Slice* s = t.add_slices();
      s->set_file(RankFileName(rank, world));
      *s->mutable_offsets() = b.offsets();
      *s->mutable_extents() = b.shape();
      int64_t n = 1;
      for (int64_t d : b.shape()) n *= d;
      total += n * graph::DTypeBytes(dtype);
    }
  }
  for (auto& [name, t] : tensors) {
    // Every element once: the pieces within the tensor, disjoint, complete.
    if (const std::string why = TilingError(t); !why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("the plan's pieces of '", name, "' ", why));
    }
    *index.add_tensors() = std::move(t);
  }
  for (int rank = 0; rank < world; ++rank) index.add_files(RankFileName(rank, world));
  index.set_total_bytes(total);
  return index;
}

std::vector<std::string> OwnedTensors(const v1::CheckpointIndex& index, int rank,
                                      int world_size) {
  const std::string file = RankFileName(rank, world_size);
  std::vector<std::string> out;
  for (const auto& t : index.tensors()) {
    for (const auto& s : t.slices()) {
      if (s.file() == file) {
        out.push_back(t.name());
        break;
      }
    }
  }
  return out;
}

namespace {

// The save's temporary directory: .tmp-step-N, then the run's RunSuffix.
std::string TmpDirPath(const SaveRequest& r) {
  return (fs::path(r.dir) / absl::StrCat(absl::StrFormat("%s%08d", kTmpPrefix, r.trainer.step()),
                                         RunSuffix(r.run_id)))
      .string();
}

}  // namespace

absl::StatusOr<std::string> SaveCheckpoint(const SaveRequest& r,
                                           const std::vector<ParameterShard>& state,
                                           Communicator& comm) {
  if (r.programs == nullptr || static_cast<int>(r.programs->size()) != comm.size() ||
      r.rank != comm.rank() || r.dir.empty() || r.trainer.step() < 0) {
    return absl::InvalidArgumentError(
        "SaveCheckpoint needs a directory, every rank's program and this rank's communicator");
  }
  const int world = comm.size();
  const std::string final_dir = (fs::path(r.dir) / StepDirName(r.trainer.step())).string();
  const std::string tmp = TmpDirPath(r);
  // Every rank computes the same index from the plan: no messages needed.
  HAP_ASSIGN_OR_RETURN(v1::CheckpointIndex index, BuildIndex(*r.programs, r.trainer.step()));

  // Every rank's result is the committed directory or an error. The ranks
  // agree through the shared directory, without data collectives (an NCCL
  // communicator's buffers must be device memory), and every rank passes
  // the same three barriers whatever happens: a rank that returned early
  // left the others waiting out the communicator's timeout.
  // 1. Rank 0 makes a fresh temporary directory, unless the step is
  // committed already: a committed checkpoint is never overwritten.
  const std::string committed_file = (fs::path(final_dir) / kCommittedFile).string();
  const absl::Status already = absl::AlreadyExistsError(
      absl::StrCat("a complete checkpoint ", final_dir, " exists already"));
  absl::Status prepared = absl::OkStatus();
  if (r.rank == 0) {
    prepared = CreateDirectoriesSynced(r.dir);
    // The first save of a run resumed from an earlier step: the steps the
    // replaced run committed after it are not this run's (one of them may
    // be the step saved now).
    if (prepared.ok() && r.replaces_after >= 0) SetAsideAfter(r.dir, r.replaces_after);
    if (prepared.ok()) prepared = RemoveAll(tmp);
    if (prepared.ok() && Exists(committed_file)) prepared = already;
    if (prepared.ok()) {
      std::error_code ec;
      fs::create_directory(tmp, ec);
      if (ec) prepared = absl::InternalError(absl::StrCat("cannot create ", tmp, ": ", ec.message()));
    }
  }
  HAP_RETURN_IF_ERROR(comm.Barrier());

  // 2. Every rank writes the slices it owns. A rank that fails leaves its
  // error in `tmp` for rank 0 instead of a partial file. Each notes which
  // directory `tmp` is: the step directory is this save's only if it is
  // that one, renamed (another run may commit the step meanwhile).
  const std::string file = (fs::path(tmp) / RankFileName(r.rank, world)).string();
  absl::Status wrote = absl::OkStatus();
  struct stat ours {};
  const bool have_tmp = ::stat(tmp.c_str(), &ours) == 0;
  if (have_tmp) {
    const std::vector<std::string> owned = OwnedTensors(index, r.rank, world);
    const std::set<std::string> own(owned.begin(), owned.end());
    std::vector<SafetensorsEntry> entries;
    for (const ParameterShard& s : state) {
      if (own.count(s.name)) entries.push_back({s.name, s.value.view()});
    }
    if (entries.size() != owned.size()) {
      wrote = absl::InternalError(absl::StrCat("rank ", r.rank, " holds ", entries.size(), " of the ",
                                               owned.size(), " tensors the index gives it"));
    } else {
      std::map<std::string, std::string> metadata = {{"format", "hap-checkpoint"},
                                                     {"step", std::to_string(r.trainer.step())},
                                                     {"rank", std::to_string(r.rank)},
                                                     {"world_size", std::to_string(world)}};
      AddChecksums(entries, &metadata);
      wrote = WriteSafetensors(file, entries, metadata);
    }
    if (!wrote.ok()) {
      std::error_code ec;
      fs::remove(file, ec);
      (void)WriteFileSynced(absl::StrCat(file, kFailedSuffix), wrote.ToString());
    }
  } else if (r.rank != 0) {
    wrote = Exists(committed_file)
                ? already
                : absl::FailedPreconditionError(absl::StrCat(
                      "rank ", r.rank, " does not see ", tmp,
                      " (rank 0 could not create it, or the checkpoint directory is not shared)"));
  }
  HAP_RETURN_IF_ERROR(comm.Barrier());

  // 3. Rank 0 commits.
  absl::StatusOr<std::string> committed = final_dir;
  if (r.rank == 0) {
    if (!prepared.ok()) {
      committed = prepared;
    } else if (!wrote.ok()) {
      committed = wrote;
    } else {
      committed = Commit(r, index, tmp, final_dir);
    }
    if (!committed.ok()) (void)RemoveAll(tmp);  // best effort; the next save retries
  }
  HAP_RETURN_IF_ERROR(comm.Barrier());
  if (!wrote.ok()) return wrote;
  if (!committed.ok()) return committed.status();
  // Rank 0's answer, read from the directory: committed, and committed by
  // this save (the temporary directory renamed), not by another run that
  // committed the step meanwhile (rank 0 then failed AlreadyExists).
  struct stat now {};
  const bool renamed = ::stat(final_dir.c_str(), &now) == 0 && now.st_dev == ours.st_dev &&
                       now.st_ino == ours.st_ino;
  if (!Exists(committed_file)) {
    return absl::AbortedError(
        absl::StrCat("the checkpoint ", final_dir, " did not commit (see rank 0's error)"));
  }
  if (!renamed) return already;
  return final_dir;
}

absl::StatusOr<std::string> FindCheckpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    // Said as it is: a file, a name too long, a directory not searchable.
    if (fs::exists(path, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " is not a checkpoint directory: it is a file"));
    }
    if (ec && ec != std::errc::no_such_file_or_directory) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot read the checkpoint directory ", path, ": ", ec.message()));
    }
    return absl::NotFoundError(absl::StrCat("no checkpoint directory ", path));
  }
  // A committed checkpoint itself, else the newest committed one in it
  // (whatever the directory's own name).
  if (Exists((fs::path(path) / kCommittedFile).string())) return path;
  std::map<int64_t, std::string> committed = CommittedSteps(path, &ec);
  if (ec) {
    // Not "no checkpoint": the newest may be among the names not read.
    return absl::UnavailableError(
        absl::StrCat("cannot list the checkpoint directory ", path, ": ", ec.message()));
  }
  if (!committed.empty()) return committed.rbegin()->second;
  // A step directory (through a link such as latest -> step-00000005 too)
  // that did not commit.
  fs::path resolved = fs::canonical(path, ec);
  if (ec) resolved = fs::path(path).lexically_normal();
  std::string name = resolved.filename().string();
  if (name.empty()) name = resolved.parent_path().filename().string();
  if (StepOf(name) >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint ", path, " is incomplete (no ", kCommittedFile, "; a write was cut)"));
  }
  return absl::NotFoundError(
      absl::StrCat("no complete checkpoint (step-*/", kCommittedFile, ") in ", path));
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    const std::string& path) {
  HAP_ASSIGN_OR_RETURN(std::string dir, FindCheckpoint(path));
  std::unique_ptr<CheckpointReader> r(new CheckpointReader);
  r->dir_ = dir;
  HAP_ASSIGN_OR_RETURN(const Manifest manifest, ReadManifest(dir));
  HAP_RETURN_IF_ERROR(FromJsonFile((fs::path(dir) / kIndexFile).string(), &r->index_, manifest));
  HAP_RETURN_IF_ERROR(
      FromJsonFile((fs::path(dir) / kTrainerFile).string(), &r->trainer_, manifest));
  for (const int version : {r->index_.format_version(), r->trainer_.format_version()}) {
    if (version > kCheckpointFormatVersion) {
      // Intact, of a newer build: not damage (a job would set it aside and
      // resume from an older one, DataLoss's meaning to the planner).
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint ", dir, " has format version ", version,
          ", written by a newer build; this build reads version ", kCheckpointFormatVersion));
    }
    if (version != kCheckpointFormatVersion) {
      return absl::DataLossError(absl::StrCat("the checkpoint ", dir, " has format version ", version,
                                              "; this build reads version ",
                                              kCheckpointFormatVersion));
    }
  }
  const std::string index_file = (fs::path(dir) / kIndexFile).string();
  HAP_RETURN_IF_ERROR(CheckStep(dir, r->index_, r->trainer_));
  const int world = r->trainer_.world_size();
  if (world < 0 || world > (1 << 20)) {
    return absl::DataLossError(
        absl::StrCat("the checkpoint ", dir, " says it was written by ", world, " ranks"));
  }
  // A slice's file is one of the shards: never a path (outside the
  // directory or not) nor another file of the checkpoint. Told by its name,
  // not from a list of every shard's (a damaged world size may be 2^20).
  auto is_shard = [world](const std::string& file) {
    constexpr absl::string_view kPrefix = "rank-";
    const size_t of = file.find("-of-");
    int rank = -1;
    return absl::StartsWith(file, kPrefix) && of != std::string::npos &&
           absl::SimpleAtoi(absl::string_view(file).substr(kPrefix.size(), of - kPrefix.size()),
                            &rank) &&
           rank >= 0 && rank < world && RankFileName(rank, world) == file;
  };
  const std::string shards =
      world == 0   ? std::string("it records no ranks")
      : world == 1 ? RankFileName(0, 1)
                   : absl::StrCat(RankFileName(0, world), " to ", RankFileName(world - 1, world));
  for (const auto& t : r->index_.tensors()) {
    auto dtype = FromSafetensorsDType(t.dtype());
    if (!dtype.ok() || t.name().empty()) {
      return absl::DataLossError(absl::StrCat("the checkpoint index of ", dir,
                                              " is corrupted at tensor '", t.name(), "'"));
    }
    for (const auto& s : t.slices()) {
      if (!is_shard(s.file())) {
        return absl::DataLossError(
            absl::StrCat(index_file, " places a slice of '", t.name(), "' in '", s.file(),
                         "', which is not one of its shards (", shards, ")"));
      }
      if (s.offsets_size() != t.shape_size() || s.extents_size() != t.shape_size()) {
        return absl::DataLossError(absl::StrCat("the checkpoint index of ", dir,
                                                " has a malformed slice of '", t.name(), "'"));
      }
    }
    if (const std::string why = TilingError(t); !why.empty()) {
      return absl::DataLossError(absl::StrCat(
          "the checkpoint index of ", dir, " is corrupted: the slices of '", t.name(), "' ", why));
    }
    if (!r->by_name_.emplace(t.name(), &t).second) {
      return absl::DataLossError(
          absl::StrCat("the checkpoint index of ", dir, " lists '", t.name(), "' twice"));
    }
  }
  // The checkpoint is refused as a whole when any of its shards is damaged
  // or missing, also one this rank (or this plan) would not read: damage
  // is the storage's, and the next resume on another plan would meet it.
  // Opening maps a file and checks its header and size; no data is read.
  for (int rank = 0; rank < world; ++rank) {
    HAP_ASSIGN_OR_RETURN(const SafetensorsFile* f, r->File(RankFileName(rank, world)));
    HAP_RETURN_IF_ERROR(CheckShardOrigin(*f, r->trainer_.step(), rank, world));
  }
  // Every slice is in its shard as the index says: what readers allocate
  // from the index's shapes is then bounded by the data on disk.
  for (const auto& [file, f] : r->files_) {
    HAP_RETURN_IF_ERROR(CheckSlicesInShard(r->index_, file, *f, dir));
  }
  return r;
}

absl::Status CheckpointReader::CheckGraph(const graph::Graph& g) const {
  std::map<std::string, const graph::Tensor*> model;
  for (graph::TensorId id : g.Parameters()) model[g.tensor(id).name] = &g.tensor(id);
  std::map<std::string, const v1::CheckpointIndex::Tensor*> saved;
  for (const auto& [name, t] : by_name_) {
    if (!t->optimizer_state()) saved[name] = t;
  }
  auto m = model.begin();
  auto s = saved.begin();
  while (m != model.end() || s != saved.end()) {
    if (s == saved.end() || (m != model.end() && m->first < s->first)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint ", dir_, " is of another graph: the model's parameter '", m->first,
          "' is not in it"));
    }
    if (m == model.end() || s->first < m->first) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint ", dir_, " is of another graph: its parameter '", s->first,
          "' is not in the model"));
    }
    const graph::TensorType& type = m->second->type;
    const Shape saved_shape(s->second->shape().begin(), s->second->shape().end());
    if (saved_shape != type.shape || s->second->dtype() != SafetensorsDType(type.dtype)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint ", dir_, " is of another graph: parameter '", m->first, "' is ",
          s->second->dtype(), graph::ShapeString(saved_shape), " there and ",
          SafetensorsDType(type.dtype), graph::ShapeString(type.shape), " in the model"));
    }
    ++m;
    ++s;
  }
  return absl::OkStatus();
}

bool CheckpointReader::Has(const std::string& name) const { return by_name_.count(name) > 0; }

absl::StatusOr<const SafetensorsFile*> CheckpointReader::File(const std::string& name) {
  auto it = files_.find(name);
  if (it == files_.end()) {
    auto f = SafetensorsFile::Open((fs::path(dir_) / name).string());
    // A shard the index names must be there: its absence is a damaged
    // checkpoint; an open or a map that fails (EMFILE, EIO) is not.
    if (!f.ok()) return ReadFailure(f.status(), std::string(f.status().message()));
    it = files_.emplace(name, *std::move(f)).first;
  }
  return it->second.get();
}

void AddChecksums(const std::vector<SafetensorsEntry>& entries,
                  std::map<std::string, std::string>* metadata) {
  for (const SafetensorsEntry& e : entries) {
    const int64_t width = e.other_dtype.empty() ? graph::DTypeBytes(e.data.dtype)
                                                : SafetensorsDTypeWidth(e.other_dtype);
    (*metadata)[absl::StrCat(kCrcPrefix, e.name)] =
        Crc32cHex(Crc32c(0, e.data.data, static_cast<size_t>(e.data.num_elements() * width)));
  }
}

absl::Status VerifyChecksum(const SafetensorsFile& f, const std::string& name,
                            std::set<std::pair<std::string, std::string>>* verified) {
  auto recorded = f.metadata().find(absl::StrCat(kCrcPrefix, name));
  if (recorded == f.metadata().end()) {
    // Written before checksums: none. One with checksums for other tensors
    // and not this one has a damaged header (its key bent), and the
    // tensor's bytes were read unchecked.
    auto any = f.metadata().lower_bound(kCrcPrefix);
    if (any != f.metadata().end() && absl::StartsWith(any->first, kCrcPrefix)) {
      return absl::DataLossError(absl::StrCat(f.path(),
                                              " is damaged: its header records the "
                                              "CRC-32C of other tensors but not of '",
                                              name, "'"));
    }
    return absl::OkStatus();
  }
  if (verified->count({f.path(), name})) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(uint32_t crc, f.Crc32cOf(name));
  if (Crc32cHex(crc) != recorded->second) {
    return absl::DataLossError(absl::StrCat(f.path(), " is damaged: the bytes of tensor '", name,
                                            "' have CRC-32C ", Crc32cHex(crc),
                                            ", its header records ", recorded->second));
  }
  verified->insert({f.path(), name});
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CopyOverlap(TensorView src, absl::Span<const int64_t> src_offsets,
                                    TensorView dst, absl::Span<const int64_t> dst_offsets) {
  const size_t rank = dst.shape.size();
  std::vector<int64_t> src_start(rank), dst_start(rank), extent(rank);
  int64_t n = 1;
  for (size_t d = 0; d < rank; ++d) {
    const int64_t lo = std::max(src_offsets[d], dst_offsets[d]);
    const int64_t hi = std::min(src_offsets[d] + src.shape[d], dst_offsets[d] + dst.shape[d]);
    if (hi <= lo) return 0;
    src_start[d] = lo - src_offsets[d];
    dst_start[d] = lo - dst_offsets[d];
    extent[d] = hi - lo;
    n *= extent[d];
  }
  HAP_RETURN_IF_ERROR(HostCopyBox(src, src_start, dst, dst_start, extent));
  return n;
}

namespace {

// The overlap of a stored slice (`src`: its shape, at `src_offsets` of the
// global tensor) with the piece `dst` (at `dst_offsets`), read from the file
// `f`. A region that is one contiguous run of bytes in both (row ranges of
// a ZeRO or row-sharded tensor, a whole tensor) is one pread; others copy
// from the mapping row by row. Returns the elements copied.
absl::StatusOr<int64_t> ReadOverlap(const SafetensorsFile& f, const std::string& name,
                                    TensorView src, absl::Span<const int64_t> src_offsets,
                                    TensorView dst, absl::Span<const int64_t> dst_offsets) {
  const size_t rank = dst.shape.size();
  std::vector<int64_t> lo(rank), extent(rank);
  int64_t n = 1;
  for (size_t d = 0; d < rank; ++d) {
    lo[d] = std::max(src_offsets[d], dst_offsets[d]);
    const int64_t hi = std::min(src_offsets[d] + src.shape[d], dst_offsets[d] + dst.shape[d]);
    if (hi <= lo[d]) return 0;
    extent[d] = hi - lo[d];
    n *= extent[d];
  }
  // Contiguous in a tensor of `shape`: after the first dimension with an
  // extent above 1, every dimension is whole.
  auto contiguous = [&](const Shape& shape) {
    size_t d = 0;
    while (d < rank && extent[d] == 1) ++d;
    for (++d; d < rank; ++d) {
      if (extent[d] != shape[d]) return false;
    }
    return true;
  };
  if (rank > 0 && contiguous(src.shape) && contiguous(dst.shape)) {
    int64_t src_at = 0, dst_at = 0;
    for (size_t d = 0; d < rank; ++d) {
      src_at = src_at * src.shape[d] + (lo[d] - src_offsets[d]);
      dst_at = dst_at * dst.shape[d] + (lo[d] - dst_offsets[d]);
    }
    const int64_t size = graph::DTypeBytes(dst.dtype);
    HAP_RETURN_IF_ERROR(f.ReadBytes(name, src_at * size, n * size,
                                    static_cast<char*>(dst.data) + dst_at * size));
    return n;
  }
  return CopyOverlap(src, src_offsets, dst, dst_offsets);
}

}  // namespace

absl::Status CheckRequest(const std::string& name, DType saved_dtype, const Shape& saved_shape,
                          const Shape& global, absl::Span<const int64_t> offsets,
                          const TensorView& dst, const std::string& where) {
  if (saved_shape != global || saved_dtype != dst.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "' is ", SafetensorsDType(saved_dtype), graph::ShapeString(saved_shape),
        " in ", where, " but ", SafetensorsDType(dst.dtype), graph::ShapeString(global),
        " in the plan"));
  }
  if (offsets.size() != global.size() || dst.shape.size() != global.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a malformed piece of '", name, "'"));
  }
  for (size_t d = 0; d < global.size(); ++d) {
    if (offsets[d] < 0 || offsets[d] + dst.shape[d] > global[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat("a piece of '", name, "' lies outside ", graph::ShapeString(global)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorView> CheckpointReader::SliceView(const SafetensorsFile& f,
                                                       const v1::CheckpointIndex::Tensor& t,
                                                       const v1::CheckpointIndex::Slice& s) {
  HAP_RETURN_IF_ERROR(VerifyChecksum(f, t.name(), &verified_));
  auto view = f.View(t.name());
  if (!view.ok()) return absl::DataLossError(std::string(view.status().message()));
  HAP_RETURN_IF_ERROR(CheckSliceShape(f.path(), t, s, SafetensorsDType(view->dtype), view->shape));
  return *view;
}

CheckpointReader::VerifyReport CheckpointReader::Verify() {
  VerifyReport report;
  std::set<std::string> unreadable;  // files already reported
  for (const auto& t : index_.tensors()) {
    for (const auto& s : t.slices()) {
      ++report.slices;
      if (unreadable.count(s.file())) continue;
      absl::StatusOr<const SafetensorsFile*> f = File(s.file());
      if (!f.ok()) {
        unreadable.insert(s.file());
        report.problems.push_back(f.status());
        continue;
      }
      absl::StatusOr<TensorView> view = SliceView(**f, t, s);
      if (!view.ok()) {
        report.problems.push_back(view.status());
        continue;
      }
      report.bytes += view->bytes();
      const bool recorded = (*f)->metadata().count(absl::StrCat(kCrcPrefix, t.name())) > 0;
      ++(recorded ? report.checked : report.unchecked);
    }
  }
  return report;
}

absl::Status CheckpointReader::Read(const std::string& name, const Shape& global,
                                    absl::Span<const int64_t> offsets, TensorView dst) {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' is not in the checkpoint ", dir_));
  }
  const v1::CheckpointIndex::Tensor& t = *it->second;
  HAP_ASSIGN_OR_RETURN(DType dtype, FromSafetensorsDType(t.dtype()));
  HAP_RETURN_IF_ERROR(CheckRequest(name, dtype, Shape(t.shape().begin(), t.shape().end()), global,
                                   offsets, dst, absl::StrCat("the checkpoint ", dir_)));
  int64_t copied = 0;
  for (const auto& s : t.slices()) {
    // Slices that miss the box are skipped before their file is opened.
    bool overlaps = true;
    for (int d = 0; d < s.offsets_size(); ++d) {
      overlaps = overlaps && s.offsets(d) < offsets[d] + dst.shape[d] &&
                 offsets[d] < s.offsets(d) + s.extents(d);
    }
    if (!overlaps) continue;
    HAP_ASSIGN_OR_RETURN(const SafetensorsFile* f, File(s.file()));
    HAP_ASSIGN_OR_RETURN(TensorView view, SliceView(*f, t, s));
    HAP_ASSIGN_OR_RETURN(int64_t n, ReadOverlap(*f, name, view, s.offsets(), dst, offsets));
    copied += n;
  }
  if (copied < dst.num_elements()) {
    return absl::DataLossError(absl::StrCat("the slices of '", name, "' in ", dir_,
                                            " do not cover the piece this rank needs"));
  }
  return absl::OkStatus();
}

absl::Status Restore(TensorSource& source, ProgramRunner& runner,
                     bool zero_missing_optimizer_state) {
  return runner.SetPersistentState([&](const v1::Buffer& b, HostTensor& host) -> absl::Status {
    if (b.role() == v1::Buffer::OPTIMIZER_STATE && zero_missing_optimizer_state &&
        !source.Has(b.tensor())) {
      std::memset(host.data(), 0, static_cast<size_t>(host.view().bytes()));
      return absl::OkStatus();
    }
    if (!source.Has(b.tensor())) {
      return absl::FailedPreconditionError(absl::StrCat(
          b.role() == v1::Buffer::OPTIMIZER_STATE ? "optimizer state '" : "parameter '",
          b.tensor(), "' is not in the checkpoint",
          b.role() == v1::Buffer::OPTIMIZER_STATE
              ? " (was it saved with another optimizer?)"
              : ""));
    }
    const Shape global(b.global_shape().begin(), b.global_shape().end());
    return source.Read(b.tensor(), global, b.offsets(), host.view());
  });
}

std::function<absl::Status(ProgramRunner&, int64_t)> SaveHook(
    CheckpointPolicy policy, const std::vector<v1::RankProgram>* programs,
    v1::TrainerState trainer, std::function<void(const std::string&, int64_t)> on_saved,
    Communicator* world) {
  // Atomic: the ranks of one process may share the hook (RunLocalRanks),
  // and each sets it after the (collective) save.
  auto saved_once = std::make_shared<std::atomic<bool>>(false);
  // The counters' forwards per step, parsed once (the metadata may hold
  // megabytes of folded buffers).
  using Counters = std::map<std::string, int64_t>;
  auto extras = ParseStateDictExtras(trainer.state_dict_extras());
  auto counters = std::make_shared<const absl::StatusOr<Counters>>(
      extras.ok() ? absl::StatusOr<Counters>(std::move(extras->counters)) : extras.status());
  return [policy, programs, trainer, on_saved, world, saved_once, counters](
             ProgramRunner& runner, int64_t done) -> absl::Status {
    if (policy.dir.empty()) return absl::OkStatus();
    const bool due = (policy.every > 0 && done % policy.every == 0) || done == policy.last_step;
    if (!due) return absl::OkStatus();
    SaveRequest r;
    r.dir = policy.dir;
    r.keep = policy.keep;
    if (!*saved_once) r.replaces_after = policy.resumed_from;
    r.run_id = policy.run_id;
    Communicator& comm = world != nullptr ? *world : runner.comm();
    r.rank = comm.rank();
    r.programs = programs;
    r.trainer = trainer;
    HAP_RETURN_IF_ERROR(counters->status());
    for (const auto& [name, per_step] : **counters) {
      auto start = trainer.num_batches_tracked().find(name);
      (*r.trainer.mutable_num_batches_tracked())[name] =
          (start == trainer.num_batches_tracked().end() ? 0 : start->second) +
          (done - trainer.step()) * per_step;
    }
    r.trainer.set_step(done);
    r.trainer.set_samples_seen(done * trainer.global_batch());
    HAP_ASSIGN_OR_RETURN(std::vector<ParameterShard> state, runner.PersistentState());
    auto saved = SaveCheckpoint(r, state, comm);
    if (!saved.ok()) return Annotate(saved.status(), absl::StrCat("checkpoint at step ", done));
    *saved_once = true;
    if (on_saved) on_saved(*saved, done);
    return absl::OkStatus();
  };
}

namespace {

// "#momentum" of "layer/weight#momentum".
std::string StateKind(const std::string& name) {
  const size_t at = name.rfind('#');
  return at == std::string::npos ? name : name.substr(at);
}

// The data source as both writers record it: the CLI's "synthetic" and
// "wikitext", the service's enum names ("SYNTHETIC", "WIKITEXT2").
std::string CanonicalData(const std::string& data) {
  if (data.find(':') != std::string::npos) return data;  // npy:DIR, tokens:FILE
  std::string d = absl::AsciiStrToLower(data);
  if (d == "data_source_unspecified") return "synthetic";
  if (d == "wikitext2") return "wikitext";
  return d;
}

}  // namespace

absl::Status CheckOptimizerState(const CheckpointReader& reader, const v1::RankProgram& program) {
  // The plan's optimizer: its update kernels, and the state they keep.
  bool updates = false;
  std::set<std::string> used;
  for (const v1::Step& s : program.steps()) {
    if (s.has_kernel() &&
        (s.kernel().kernel() == "sgd_update" || s.kernel().kernel() == "adam_update")) {
      updates = true;
    }
  }
  for (const v1::Buffer& b : program.buffers()) {
    if (b.role() == v1::Buffer::OPTIMIZER_STATE) used.insert(StateKind(b.tensor()));
  }
  if (!updates) return absl::OkStatus();  // this rank trains nothing: the others check
  for (const auto& t : reader.index().tensors()) {
    if (!t.optimizer_state() || used.count(StateKind(t.name()))) continue;
    const std::string kind = StateKind(t.name());
    return absl::FailedPreconditionError(
        absl::StrCat("the checkpoint ", reader.step_dir(), " holds optimizer state ", kind,
                     " of parameter '", t.name().substr(0, t.name().size() - kind.size()), "' ('",
                     t.name(), "'), which this plan's optimizer does not use (it keeps ",
                     used.empty() ? "none" : absl::StrJoin(used, ", "),
                     "): was it saved with another optimizer?"));
  }
  return absl::OkStatus();
}

absl::Status CheckDataSettings(const v1::TrainerState& saved, const v1::TrainerState& run) {
  auto differs = [](absl::string_view setting, const auto& then, const auto& now) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint was written by a run with ", setting, " ", then, ", this run has ", now,
        ": a resumed run reads the batches of the uninterrupted one only with the same data "
        "settings"));
  };
  if (saved.global_batch() > 0 && run.global_batch() > 0 &&
      saved.global_batch() != run.global_batch()) {
    return differs("global batch", saved.global_batch(), run.global_batch());
  }
  if (saved.data().empty() || run.data().empty()) return absl::OkStatus();  // not recorded
  if (CanonicalData(saved.data()) != CanonicalData(run.data())) {
    return differs("data", absl::StrCat("'", saved.data(), "'"),
                   absl::StrCat("'", run.data(), "'"));
  }
  auto shuffle = [](const v1::TrainerState& t) {
    return t.shuffle() ? absl::StrCat("shuffle seed ", t.shuffle_seed())
                       : std::string("no shuffle");
  };
  if (saved.shuffle() != run.shuffle() ||
      (saved.shuffle() && saved.shuffle_seed() != run.shuffle_seed())) {
    return differs("shuffle", shuffle(saved), shuffle(run));
  }
  // The same spec over data regenerated with another sample count (or a
  // corpus edited) maps each step to other samples: some skipped, some
  // read twice, silently.
  if (saved.data_size() > 0 && run.data_size() > 0 && saved.data_size() != run.data_size()) {
    return differs(absl::StrCat("data '", saved.data(), "' holding"), saved.data_size(),
                   absl::StrCat(run.data_size(), " (the data changed since)"));
  }
  return absl::OkStatus();
}

std::function<absl::Status(ProgramRunner&)> ResumeHook(std::shared_ptr<CheckpointReader> reader,
                                                       const graph::Graph* g) {
  auto mu = std::make_shared<std::mutex>();
  return [reader, g, mu](ProgramRunner& runner) -> absl::Status {
    std::lock_guard<std::mutex> lock(*mu);
    HAP_RETURN_IF_ERROR(reader->CheckGraph(*g));
    HAP_RETURN_IF_ERROR(CheckOptimizerState(*reader, runner.program()));
    HAP_RETURN_IF_ERROR(Restore(*reader, runner, /*zero_missing_optimizer_state=*/false));
    runner.OverrideSeed(reader->trainer().seed());
    return absl::OkStatus();
  };
}

std::function<absl::Status(ProgramRunner&)> InitWeightsHook(std::shared_ptr<WeightsReader> w,
                                                            const graph::Graph* g) {
  auto mu = std::make_shared<std::mutex>();
  return [w, g, mu](ProgramRunner& runner) -> absl::Status {
    std::lock_guard<std::mutex> lock(*mu);  // as ResumeHook's: the reader's checksum record
    HAP_RETURN_IF_ERROR(w->CheckGraph(*g));
    // Initialisers first (the exporter's constants, zero optimizer state),
    // then every parameter the file holds.
    HAP_RETURN_IF_ERROR(runner.InitializeParameters());
    return runner.SetPersistentState(
        [&](const v1::Buffer& b, HostTensor& host) {
          const Shape global(b.global_shape().begin(), b.global_shape().end());
          return w->Read(b.tensor(), global, b.offsets(), host.view());
        },
        [&](const v1::Buffer& b) {
          return b.role() == v1::Buffer::PARAMETER && w->Has(b.tensor());
        });
  };
}

absl::StatusOr<std::string> WeightsFileIdentity(const std::string& path) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path, ": ", ec.message()));
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  std::string head(std::min<uintmax_t>(size, 1 << 20), '\0');
  const size_t got = std::fread(head.data(), 1, head.size(), f);
  std::fclose(f);
  if (got != head.size()) {
    return absl::DataLossError(
        absl::StrCat(path, ": read ", got, " of its first ", head.size(), " bytes"));
  }
  return absl::StrCat("weights of ", size, " bytes, CRC-32C of the first MiB ",
                      Crc32cHex(Crc32c(0, head.data(), head.size())));
}

}  // namespace hap::executor::checkpoint
