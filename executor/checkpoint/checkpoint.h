// Checkpoints of a training run: saved by every rank in parallel, each
// writing only the slices it owns, and restored onto any plan of the same
// graph (another world size, other ratios, other forms), each rank reading
// only the bytes it needs.
//
// Layout of a checkpoint directory DIR (format version 1):
//   DIR/step-00000012/                 one complete checkpoint, after 12 steps
//       rank-00000-of-00003.safetensors  the slices rank 0 owns (header
//                      metadata: step, rank, world_size, and crc32c:NAME,
//                      the CRC-32C of each tensor's bytes, checked on read)
//       ...
//       index.json     hap.v1.CheckpointIndex: tensor -> global shape, dtype,
//                      and every slice's file, offsets and extents
//       trainer.json   hap.v1.TrainerState: global step, data cursor, seed,
//                      optimizer, graph and plan hashes
//       COMMITTED      written last; without it the directory does not count:
//                      the step, then "FILE BYTES CRC32C" of index.json and
//                      trainer.json, checked on open (older ones: the step)
//   DIR/.tmp-step-00000012/            a checkpoint being written
//   DIR/superseded-step-00000020/      a committed checkpoint of a run that a
//                                      run resumed from an earlier step
//                                      replaced: kept, never resumed or counted
//
// A tensor's slices are the persistent buffers of the plan's rank programs
// (parameters and optimizer state: #momentum, #adam_m, #adam_v); a slice
// held identically by several ranks (a replicated tensor) is written once,
// by the lowest of them. The checkpoint directory must be one file system
// that every rank sees (a local disk for one machine, a shared one across
// machines), as for PyTorch's distributed checkpoints.
//
// Saving is collective: every rank calls SaveCheckpoint at the same step.
// Rank 0 prepares the temporary directory, every rank writes and fsyncs its
// file (or, failing, leaves "<its file>.failed" holding its error), rank 0
// checks every file, writes the index and trainer state, renames the
// directory into place, fsyncs, writes COMMITTED, sets aside committed
// checkpoints of later steps (superseded-*: a run resumed from an earlier
// step replaced theirs; said on stderr) and removes all but the newest
// `keep` of the rest, never the one just committed. The ranks agree through
// the shared directory, without data collectives (three barriers, passed by
// every rank whatever happens): a rank takes the step directory for its
// save's only if it is the temporary directory renamed, so another run
// committing the same step meanwhile fails every rank alike. A rank killed
// at any point leaves the previous checkpoints as they were.
#ifndef HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_H_
#define HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "executor/checkpoint/layout.h"
#include "executor/checkpoint/safetensors.h"
#include "executor/comm/communicator.h"
#include "executor/runtime/program_runner.h"
#include "hap/v1/checkpoint.pb.h"
#include "hap/v1/plan.pb.h"
#include "planner/graph/graph.h"

namespace hap::executor::checkpoint {

inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr int kDefaultKeep = 3;

// "rank-00000-of-00003.safetensors".
std::string RankFileName(int rank, int world_size);

// The index of a checkpoint of `programs` (every rank's program of one
// plan): which rank writes which slice. InvalidArgument when a tensor's
// pieces disagree in global shape or dtype, or leave elements uncovered.
absl::StatusOr<hap::v1::CheckpointIndex> BuildIndex(
    const std::vector<hap::v1::RankProgram>& programs, int64_t step);

// The slices `rank` writes (names of its persistent buffers it owns).
std::vector<std::string> OwnedTensors(const hap::v1::CheckpointIndex& index, int rank,
                                      int world_size);

struct SaveRequest {
  std::string dir;         // DIR (created when missing)
  int keep = kDefaultKeep;  // complete checkpoints kept, newest first; >= 1
  int rank = 0;
  const std::vector<hap::v1::RankProgram>* programs = nullptr;  // every rank's
  hap::v1::TrainerState trainer;  // step and the rest; format_version and time are set here
  // >= 0: the first save of a run that started at this step (resumed from
  // it; 0: a fresh run). The committed checkpoints in `dir` past it belong
  // to the run this one replaces: they are set aside (superseded-step-N)
  // before writing, so that saving a step that run also reached is not
  // AlreadyExists.
  int64_t replaces_after = -1;
  // The same on every rank of this run and different from any other run
  // saving into `dir` (the daemon: the deployment and its generation). It
  // names the temporary directory (.tmp-step-N-RUN), so that a rank of a
  // replaced run still writing (a thread a Stop gave up on) cannot put its
  // file into this run's checkpoint of the same step. Empty: .tmp-step-N,
  // for runs that are one process group at a time (hap-launch).
  std::string run_id;
};

// Collective: every rank of `comm` calls it with the same dir, programs and
// trainer.step. `state` is this rank's persistent buffers
// (ProgramRunner::PersistentState()). Returns the committed step directory.
// Every rank returns an error when the checkpoint did not commit: every
// rank AlreadyExists when the step is committed already; a rank's own
// write error on that rank, Aborted naming the failed rank and its error on
// rank 0, Aborted "did not commit" on the others. Earlier checkpoints are
// untouched then.
absl::StatusOr<std::string> SaveCheckpoint(const SaveRequest& request,
                                           const std::vector<ParameterShard>& state,
                                           Communicator& comm);

// The step directory to resume from: `path` itself when it holds COMMITTED,
// else the committed step-* directory in `path` with the highest step
// (whatever `path` is named; superseded-* directories do not count).
// Without either: FailedPrecondition ("incomplete") when `path`'s name,
// after resolving a symbolic link, is a step directory's; else NotFound.
absl::StatusOr<std::string> FindCheckpoint(const std::string& path);

// Graph parameters that are slices of one PyTorch parameter: the exporter
// splits nn.MultiheadAttention's in_proj_weight into q, k and v and records
// that in the graph's metadata under kStateDictSlicesKey as JSON:
//   {"<graph parameter>": {"source": "<state_dict name>", "axis": 0,
//                          "offset": 768, "source_shape": [2304, 768]}, ...}
// Weights files and exports carry the source tensor whole.
inline constexpr char kStateDictSlicesKey[] = "hap.state_dict_slices";
struct StateDictSlice {
  std::string source;
  int axis = 0;
  int64_t offset = 0;
  Shape source_shape;
};
using StateDictSlices = std::map<std::string, StateDictSlice>;
// The graph's slices (empty without the key). InvalidArgument naming the
// entry that is malformed or does not fit its graph parameter's shape.
absl::StatusOr<StateDictSlices> GraphStateDictSlices(const graph::Graph& g);
absl::StatusOr<StateDictSlices> ParseStateDictSlices(const std::string& json);

// How the model's state_dict differs from the graph's parameters beyond
// slices, recorded by the exporter under kStateDictExtrasKey as JSON:
//   {"aliases": {"head.weight": "emb.weight"}, "constants": ["const.mul"],
//    "counters": {"bn.num_batches_tracked": {"per_step": 1, "value": 0}},
//    "folded": {"mask": {"dtype": "F32", "shape": [4],
//                        "runs": [[3, "0000803f"], [1, "00000000"]]},
//               "spare.bias": {"dtype": "F32", "shape": [1],
//                              "runs": [[1, "0000803f"]], "parameter": true}},
//    "unheld": ["big.weight"]}
// `aliases`: further names of a tensor PyTorch holds under several (tied
// weights) -> the name the graph holds it under (a parameter or a slice
// source); exports write a copy under each, weights files may carry them
// (equal to the tensor they name) or carry only them. `constants`: graph
// parameters that are the exporter's constants, not state_dict entries
// (left out of exports). `counters`: BatchNorm's num_batches_tracked ->
// forwards of its module per step (`value`, the module's at export, is what
// the exporter's --weights writes); TrainerState.num_batches_tracked counts
// them, exports write them as I64 scalars, weights files may carry the
// start value. `folded`: buffers the exporter folded into the graph's
// constants (through a slice, a comparison...) or that forward leaves
// unused, and (`"parameter": true`) parameters forward does not use, which
// PyTorch's training leaves as they are, with their values at export:
// row-major runs of equal elements, [count, the element's little-endian
// bytes in hex], of any safetensors dtype (BOOL and U8 too); exports write
// them, weights files may carry them with these values (other values are
// refused: the graph was built from these buffers, and exports give back
// these parameters). `unheld`: state_dict entries the graph does not hold
// and the exporter could not record (unused parameters or buffers of too
// many runs, buffers of a dtype safetensors has no name for): weights files
// may carry them; they are not read, and exports cannot write them.
inline constexpr char kStateDictExtrasKey[] = "hap.state_dict_extras";
struct FoldedBuffer {
  std::string dtype;  // safetensors: F32, BOOL, U8, ... (SafetensorsDTypeWidth)
  Shape shape;
  std::string bytes;       // row-major, little-endian
  bool parameter = false;  // a parameter forward does not use, not a buffer
};
struct StateDictExtras {
  std::map<std::string, std::string> aliases;
  std::set<std::string> constants;
  std::map<std::string, int64_t> counters;  // per step
  std::map<std::string, FoldedBuffer> folded;
  std::vector<std::string> unheld;
};
// The parsed JSON (empty parts for an empty string or missing keys);
// InvalidArgument naming what is malformed.
absl::StatusOr<StateDictExtras> ParseStateDictExtras(const std::string& json);
// The graph's (empty parts without the key).
absl::StatusOr<StateDictExtras> GraphStateDictExtras(const graph::Graph& g);

// Where tensors come from: a checkpoint, or a weights file.
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual bool Has(const std::string& name) const = 0;
  // Copies the box [offsets, offsets + dst.shape) of the global tensor
  // `name` into `dst`. InvalidArgument naming the tensor when its global
  // shape or dtype differs from `global`/`dst.dtype`; DataLoss naming the
  // file when the stored data does not cover the box, is malformed, or (a
  // checkpoint) fails its checksum.
  virtual absl::Status Read(const std::string& name, const Shape& global,
                            absl::Span<const int64_t> offsets, TensorView dst) = 0;
};

// A committed checkpoint, opened for reading (files mapped on first use).
class CheckpointReader : public TensorSource {
 public:
  // `path`: as FindCheckpoint. DataLoss naming the file for a missing or
  // malformed index.json or trainer.json, or one whose size or CRC-32C is
  // not what COMMITTED records, an unknown format version, a step
  // that is negative, differs between trainer.json, index.json and a
  // step-N directory name, or overflows in step * global batch; a slice
  // placed in a file that is not one of the shards (a path, another file of
  // the checkpoint); a shard that is missing, malformed, not a regular file,
  // recorded as written for another step, rank or world size, or that does
  // not hold a slice as the index says.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& path);

  const std::string& step_dir() const { return dir_; }
  const hap::v1::CheckpointIndex& index() const { return index_; }
  const hap::v1::TrainerState& trainer() const { return trainer_; }

  // OK when the checkpoint's parameters are the graph's: FailedPrecondition
  // naming the first parameter (by name) whose name, shape or dtype differs.
  absl::Status CheckGraph(const graph::Graph& g) const;

  bool Has(const std::string& name) const override;
  absl::Status Read(const std::string& name, const Shape& global,
                    absl::Span<const int64_t> offsets, TensorView dst) override;

  // What Verify read and found.
  struct VerifyReport {
    int64_t slices = 0;     // tensor slices the index places in the shards
    int64_t checked = 0;    // of them, read whole and matching their CRC-32C
    int64_t unchecked = 0;  // in shards written before checksums: readable, unchecked
    int64_t bytes = 0;      // tensor bytes read
    // DataLoss naming the file (and tensor) of each problem: a shard that is
    // missing or malformed, a slice it does not hold as the index says, bytes
    // whose CRC-32C is not the recorded one. Empty when the checkpoint is
    // sound.
    std::vector<absl::Status> problems;
  };
  // Reads every slice of every tensor (parameters and optimizer state)
  // whole and checks it, going on past problems: whether the checkpoint
  // can be resumed from, before a resume finds out (`hapctl checkpoint
  // verify`).
  VerifyReport Verify();

 private:
  CheckpointReader() = default;
  absl::StatusOr<const SafetensorsFile*> File(const std::string& name);
  // Slice `s` of tensor `t` in shard `f`, checked against its CRC-32C and
  // the index (shape, dtype): DataLoss naming the file otherwise.
  absl::StatusOr<TensorView> SliceView(const SafetensorsFile& f,
                                       const hap::v1::CheckpointIndex::Tensor& t,
                                       const hap::v1::CheckpointIndex::Slice& s);
  std::string dir_;
  hap::v1::CheckpointIndex index_;
  hap::v1::TrainerState trainer_;
  std::map<std::string, const hap::v1::CheckpointIndex::Tensor*> by_name_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::set<std::pair<std::string, std::string>> verified_;  // (file, tensor): CRC-32C checked
};

// What ranks that start from an --init-weights file must agree on
// (CheckStartsAgree): its size and the CRC-32C of its first MiB (the
// header, which names every tensor and where it lies, and the start of the
// data), not its path. IO errors naming the file.
absl::StatusOr<std::string> WeightsFileIdentity(const std::string& path);

// A safetensors file of whole tensors by name (--init-weights, the
// exporter's --weights, `hapctl checkpoint export`).
class WeightsReader : public TensorSource {
 public:
  // `slices`: graph parameters read from a slice of a tensor of the file;
  // `extras.aliases`: a tensor the file holds only under a further name of
  // it (GPT-2's lm_head.weight without transformer.wte.weight) is read from
  // that name.
  static absl::StatusOr<std::unique_ptr<WeightsReader>> Open(const std::string& path,
                                                             StateDictSlices slices = {},
                                                             StateDictExtras extras = {});
  // --init-weights FILE for `g`: Open with the graph's slices and extras,
  // then CheckGraph.
  static absl::StatusOr<std::unique_ptr<WeightsReader>> OpenFor(const std::string& path,
                                                                const graph::Graph& g);
  const SafetensorsFile& file() const { return *file_; }
  // OK when the file holds exactly the graph's parameters with their shapes
  // and dtypes (besides the graph's kStateDictExtrasKey aliases, each equal
  // to the tensor it names or standing in for it, counters as I64 scalars,
  // folded buffers with the recorded values, and unheld entries, ignored);
  // else FailedPrecondition listing the missing, the extra and the
  // mismatched names.
  absl::Status CheckGraph(const graph::Graph& g) const;
  bool Has(const std::string& name) const override;
  absl::Status Read(const std::string& name, const Shape& global,
                    absl::Span<const int64_t> offsets, TensorView dst) override;

 private:
  WeightsReader() = default;
  // The name the file holds `name` (a graph parameter or a slice source)
  // under: itself, else a further name of it (an alias) the file holds.
  std::string FileName(const std::string& name) const;
  std::unique_ptr<SafetensorsFile> file_;
  StateDictSlices slices_;
  StateDictExtras extras_;
  std::set<std::pair<std::string, std::string>> verified_;  // (file, tensor): CRC-32C checked
};

// Sets `trainer`'s num_batches_tracked to the values the counters of its
// state_dict_extras (set before) start from at step trainer.step() (set to
// the run's first step): the resumed checkpoint's (`resumed`: its trainer
// state; a checkpoint written without them counts from 0 at step 0), else
// the --init-weights file's (`weights`; 0 where it lacks one), else 0.
// SaveHook advances them by the counters' per-step forwards.
absl::Status SetStartCounters(const hap::v1::TrainerState* resumed, const WeightsReader* weights,
                              hap::v1::TrainerState* trainer);

// Restores the runner's parameters and optimizer state from `source`.
// Optimizer state missing from the source starts at zero when
// `zero_missing_optimizer_state` (weights files carry none); otherwise it is
// an error naming the tensor.
absl::Status Restore(TensorSource& source, ProgramRunner& runner,
                     bool zero_missing_optimizer_state);

// When and where a training run saves.
struct CheckpointPolicy {
  std::string dir;          // empty: no checkpoints
  int64_t every = 0;        // steps between checkpoints; 0: only the last step
  int keep = kDefaultKeep;
  int64_t last_step = 0;    // the run's final global step: always saved
  // The step the run started from (resumed from, or 0 for a fresh run):
  // SaveRequest::replaces_after of its first save. -1: none.
  int64_t resumed_from = -1;
  std::string run_id = "";  // SaveRequest::run_id
};

// TrainOptions::after_step for `policy`: after step counts that are
// multiples of `every`, and after `last_step`, saves through
// SaveCheckpoint. `trainer` is the run's state; its step and samples_seen
// (step * global_batch) are set per save, and its num_batches_tracked,
// given at trainer.step() (SetStartCounters), advanced to that step.
// `programs` must outlive the hook.
// `on_saved` (optional) is told each committed directory. `world`
// (optional) is the communicator of every rank of `programs` when the
// runner's own is narrower (a pipeline stage's group): the save is
// collective over it and this rank is its rank there.
std::function<absl::Status(ProgramRunner&, int64_t)> SaveHook(
    CheckpointPolicy policy, const std::vector<hap::v1::RankProgram>* programs,
    hap::v1::TrainerState trainer,
    std::function<void(const std::string& dir, int64_t step)> on_saved = nullptr,
    Communicator* world = nullptr);

// OK when every optimizer state the checkpoint holds is of a kind that the
// optimizer of `program` (a rank's program of the resuming plan) keeps:
// FailedPrecondition naming the parameter and the state otherwise (SGD
// momentum resumed by plain SGD, Adam moments by SGD). State the plan keeps
// and the checkpoint lacks is Restore's error.
absl::Status CheckOptimizerState(const CheckpointReader& reader,
                                 const hap::v1::RankProgram& program);

// OK when a run with the data settings of `run` (global_batch, data,
// shuffle, shuffle_seed, data_size) may resume from a checkpoint whose trainer state is
// `saved`: a resumed run must read the batches the uninterrupted run would.
// FailedPrecondition naming the setting and both values otherwise. A
// setting either side does not record (0 or empty: older writers, callers
// that do not know it) is not compared; the data source's CLI and service
// spellings ("synthetic", "SYNTHETIC") are the same source.
absl::Status CheckDataSettings(const hap::v1::TrainerState& saved,
                               const hap::v1::TrainerState& run);

// TrainOptions::initialize resuming from `reader` (shared by the ranks of a
// process; thread-safe through a mutex): checks the graph and the optimizer
// state (CheckOptimizerState), restores the parameters and optimizer state,
// and keeps the checkpoint's seed. The data settings are the caller's to
// check (CheckDataSettings), before the ranks connect.
std::function<absl::Status(ProgramRunner&)> ResumeHook(std::shared_ptr<CheckpointReader> reader,
                                                       const graph::Graph* g);

// TrainOptions::initialize from a weights file (shared by the ranks of a
// process; thread-safe through a mutex): checks that it holds the graph's
// parameters exactly, sets them, zeroes the optimizer state.
std::function<absl::Status(ProgramRunner&)> InitWeightsHook(std::shared_ptr<WeightsReader> w,
                                                            const graph::Graph* g);

// Writes every tensor of a checkpoint whole into one safetensors file
// (parameters only unless `with_optimizer_state`), the slices of the
// trainer state's state_dict_slices joined into their source tensors, so
// that PyTorch's load_state_dict takes the file, with each tensor's CRC-32C
// in its metadata (which WeightsReader checks). Returns the bytes written.
absl::StatusOr<int64_t> ExportCheckpoint(CheckpointReader& reader, const std::string& out,
                                         bool with_optimizer_state);

}  // namespace hap::executor::checkpoint

#endif  // HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_H_
