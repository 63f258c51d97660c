// libFuzzer target: checkpoint directories (hap-executor / hap-launch
// --resume, hapctl checkpoint verify) through CheckpointReader::Open, then
// what a resume reads: CheckGraph against the MLP the seeds were trained
// on, the data settings, the start counters, the optimizer state, and every
// tensor, whole and in the pieces of another plan, besides Verify; then
// `hapctl checkpoint export` of it, read back as --init-weights reads it.
//
// An input is the directory's files, one after another:
//   [flags byte] then per file [name length byte][name][4-byte LE size][bytes]
// A name is one file or "DIR/FILE" (the seeds: step-00000001/index.json ...)
// of [A-Za-z0-9._-], neither "." nor ".."; others, and a size past the
// input's end, are cut to what is there. Flags bit 0: COMMITTED's records of
// index.json and trainer.json are rewritten to match their bytes, so that a
// mutated index reaches the checks past the manifest. Bit 1: the export
// carries the optimizer state.
//
// Findings: crashes, sanitizer reports, allocations past libFuzzer's
// -malloc_limit_mb, hangs (-timeout), and broken promises, which trap:
// Open's errors are the ones its contract names, DataLoss among them naming
// the directory; a tensor read of a checkpoint that Verify found sound
// succeeds, a failed one is DataLoss, and Verify reports only DataLoss;
// an export fails only with DataLoss (naming the checkpoint) and leaves no
// file, and the file of one that succeeds opens with every tensor's
// checksum right.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/checkpoint/crc32c.h"
#include "executor/checkpoint/safetensors.h"
#include "executor/runtime/tensor.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

namespace ckpt = ::hap::executor::checkpoint;
namespace fs = std::filesystem;
namespace v1 = ::hap::v1;

bool SafeComponent(const std::string& c) {
  if (c.empty() || c == "." || c == "..") return false;
  for (char ch : c) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                    (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    if (!ok) return false;
  }
  return true;
}

// The files of an input, by name (a later one of a name replaces it).
std::map<std::string, std::string> Files(const uint8_t* data, size_t size) {
  std::map<std::string, std::string> files;
  size_t at = 0;
  while (at < size) {
    const size_t name_size = data[at++];
    const size_t n = std::min(name_size, size - at);
    std::string name(reinterpret_cast<const char*>(data + at), n);
    at += n;
    uint32_t bytes = 0;
    for (int i = 0; i < 4 && at < size; ++i) bytes |= uint32_t{data[at++]} << (8 * i);
    const size_t b = std::min<size_t>(bytes, size - at);
    std::string contents(reinterpret_cast<const char*>(data + at), b);
    at += b;
    std::vector<std::string> parts = absl::StrSplit(name, '/');
    bool safe = parts.size() <= 2;
    for (const std::string& p : parts) safe = safe && SafeComponent(p);
    if (safe) files[name] = std::move(contents);
  }
  return files;
}

// COMMITTED's "FILE BYTES CRC32C" records of index.json and trainer.json
// made true of the files beside it.
void FixManifests(std::map<std::string, std::string>* files) {
  for (auto& [name, contents] : *files) {
    const fs::path p(name);
    if (p.filename() != ckpt::kCommittedFile) continue;
    std::vector<std::string> lines = absl::StrSplit(contents, '\n');
    for (size_t i = 1; i < lines.size(); ++i) {
      std::vector<std::string> fields = absl::StrSplit(lines[i], ' ');
      if (fields.size() != 3) continue;
      auto file = files->find((p.parent_path() / fields[0]).string());
      if (file == files->end()) continue;
      const std::string& f = file->second;
      lines[i] = absl::StrCat(fields[0], " ", f.size(), " ",
                              ckpt::Crc32cHex(ckpt::Crc32c(0, f.data(), f.size())));
    }
    contents = absl::StrJoin(lines, "\n");
  }
}

bool Expected(const absl::Status& s, std::initializer_list<absl::StatusCode> codes) {
  for (absl::StatusCode c : codes) {
    if (s.code() == c) return true;
  }
  return false;
}

void Check(bool promise, const char* what, const absl::Status& s = absl::OkStatus()) {
  if (promise) return;
  std::fprintf(stderr, "checkpoint_fuzzer: %s: %s\n", what, s.ToString().c_str());
  __builtin_trap();
}

// A rank program whose optimizer is Adam (CheckOptimizerState's view of it).
v1::RankProgram AdamProgram() {
  v1::RankProgram p;
  p.add_steps()->mutable_kernel()->set_kernel("adam_update");
  for (const char* state : {"x#adam_m", "x#adam_v"}) {
    v1::Buffer* b = p.add_buffers();
    b->set_tensor(state);
    b->set_role(v1::Buffer::OPTIMIZER_STATE);
  }
  return p;
}

// Reads the box [offsets, offsets + shape) of tensor `t`; a failure must be
// DataLoss, and none is allowed when Verify found the checkpoint sound.
void ReadPiece(ckpt::CheckpointReader& r, const v1::CheckpointIndex::Tensor& t,
               hap::graph::DType dtype, const std::vector<int64_t>& offsets,
               const hap::executor::Shape& shape, bool sound) {
  const hap::executor::Shape global(t.shape().begin(), t.shape().end());
  hap::executor::HostTensor piece(dtype, shape);
  const absl::Status s = r.Read(t.name(), global, offsets, piece.view());
  Check(s.ok() || s.code() == absl::StatusCode::kDataLoss, "Read's error is not DataLoss", s);
  Check(s.ok() || !sound, "Verify found the checkpoint sound, a read failed", s);
}

// `hapctl checkpoint export` (with the optimizer state or without) to
// `out`: fails only with DataLoss naming the checkpoint's step directory
// and writes nothing then; what it writes opens as a weights file whose
// every tensor reads back whole with its recorded checksum.
void Export(ckpt::CheckpointReader& r, const std::string& out, bool with_optimizer_state) {
  std::error_code ec;
  fs::remove(out, ec);
  auto bytes = ckpt::ExportCheckpoint(r, out, with_optimizer_state);
  if (!bytes.ok()) {
    Check(bytes.status().code() == absl::StatusCode::kDataLoss, "export's error is not DataLoss",
          bytes.status());
    Check(bytes.status().message().find(r.step_dir()) != std::string::npos,
          "export's DataLoss does not name the checkpoint", bytes.status());
    Check(!fs::exists(out, ec), "a failed export left its file");
    return;
  }
  auto w = ckpt::WeightsReader::Open(out);
  Check(w.ok(), "an export does not open as a weights file", w.status());
  for (const auto& [name, info] : (*w)->file().tensors()) {
    auto view = (*w)->file().View(name);
    Check(view.ok(), "an exported tensor cannot be viewed", view.status());
    hap::executor::HostTensor back(view->dtype, view->shape);
    const std::vector<int64_t> zero(view->shape.size(), 0);
    const absl::Status s = (*w)->Read(name, view->shape, zero, back.view());
    Check(s.ok(), "an exported tensor does not read back", s);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The seeds' model (scripts/fuzz.sh trains it one step); the checkpoint
  // directory, written afresh for each input, and the export beside it.
  const hap::graph::Graph& g = hap::fuzz::SeedMlp();
  static const std::string root = hap::fuzz::ScratchDir("checkpoint") + "/checkpoint";
  static const std::string exported = hap::fuzz::ScratchDir("checkpoint") + "/model.safetensors";
  static const v1::RankProgram adam = AdamProgram();
  if (size < 1) return 0;
  std::error_code ec;
  fs::remove_all(root, ec);
  if (!fs::create_directory(root, ec)) return 0;
  std::map<std::string, std::string> files = Files(data + 1, size - 1);
  if (data[0] & 1) FixManifests(&files);
  for (const auto& [name, contents] : files) {
    const fs::path path = fs::path(root) / name;
    fs::create_directories(path.parent_path(), ec);  // a file of that name: the write fails
    (void)hap::fuzz::WriteFile(path.string(), contents.data(), contents.size());
  }

  auto opened = ckpt::CheckpointReader::Open(root);
  if (!opened.ok()) {
    const absl::Status& s = opened.status();
    Check(Expected(s, {absl::StatusCode::kDataLoss, absl::StatusCode::kNotFound,
                       absl::StatusCode::kFailedPrecondition}),
          "Open's error is not one it names", s);
    Check(s.code() != absl::StatusCode::kDataLoss || s.message().find(root) != std::string::npos,
          "Open's DataLoss does not name the checkpoint", s);
    return 0;
  }
  ckpt::CheckpointReader& r = **opened;

  // What a resume checks before reading (executor_core, run_plan).
  (void)r.CheckGraph(g);
  v1::TrainerState run;
  run.set_global_batch(4);
  run.set_data("synthetic");
  (void)ckpt::CheckDataSettings(r.trainer(), run);
  run.set_state_dict_extras(R"({"counters": {"bn.num_batches_tracked": {"per_step": 2}}})");
  (void)ckpt::SetStartCounters(&r.trainer(), nullptr, &run);
  (void)ckpt::CheckOptimizerState(r, adam);

  const ckpt::CheckpointReader::VerifyReport report = r.Verify();
  for (const absl::Status& p : report.problems) {
    Check(p.code() == absl::StatusCode::kDataLoss, "Verify's problem is not DataLoss", p);
  }
  const bool sound = report.problems.empty();

  // Every tensor as this plan holds it (whole), as a plan sharding its last
  // dimension in two does, and as each slice was saved.
  for (const auto& t : r.index().tensors()) {
    Check(r.Has(t.name()), "a tensor of the index is not Has()");
    auto dtype = ckpt::FromSafetensorsDType(t.dtype());
    Check(dtype.ok(), "Open let through a tensor of an unknown dtype", dtype.status());
    const hap::executor::Shape global(t.shape().begin(), t.shape().end());
    const std::vector<int64_t> zero(global.size(), 0);
    ReadPiece(r, t, *dtype, zero, global, sound);
    if (!global.empty() && global.back() >= 2) {
      hap::executor::Shape half = global;
      half.back() = global.back() / 2;
      std::vector<int64_t> at = zero;
      ReadPiece(r, t, *dtype, at, half, sound);
      at.back() = half.back();
      half.back() = global.back() - half.back();
      ReadPiece(r, t, *dtype, at, half, sound);
    }
    for (const auto& s : t.slices()) {
      ReadPiece(r, t, *dtype, std::vector<int64_t>(s.offsets().begin(), s.offsets().end()),
                hap::executor::Shape(s.extents().begin(), s.extents().end()), sound);
    }
  }
  Export(r, exported, (data[0] & 2) != 0);
  return 0;
}
