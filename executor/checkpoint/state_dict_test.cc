// State dicts and weights files: export of whole tensors that start another
// run, state_dict slices joined and split, the exporter's extras (tied
// names, constants, unheld entries), and BatchNorm counters, folded
// buffers and unused parameters carried through checkpoints and exports. Ranks are threads over
// the in-process communicator.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/checkpoint/checkpoint_test_util.h"
#include "executor/checkpoint/safetensors.h"
#include "executor/cpu/cpu_device.h"
#include "executor/data/batches.h"
#include "executor/train/in_process_comm.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace hap::executor::checkpoint {
namespace {

namespace v1 = ::hap::v1;
namespace fs = std::filesystem;
using ::hap::testing::StatusIs;
using test_util::Fresh;
using test_util::Mlp;
using test_util::Programs;
using test_util::Train;
using test_util::TrainAndSave;
using test_util::TrainAndSaveFrom;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(CheckpointTest, ExportWritesWholeTensorsThatStartAnotherRun) {
  graph::Graph g = Mlp();
  const std::string dir = Fresh("export");
  auto runs = TrainAndSave(g, Programs(g, 2, "tp"), dir, 2, 3);
  ASSERT_EQ(runs.size(), 2u);
  auto whole = AssembleParameters({runs[0].parameters, runs[1].parameters});
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const std::string out = dir + "/model.safetensors";
  auto bytes = ExportCheckpoint(**reader, out, false);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto file = SafetensorsFile::Open(out);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), whole->size());
  for (const auto& [name, t] : *whole) {
    auto v = (*file)->View(name);
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_EQ(v->shape, t.shape());
    EXPECT_EQ(std::memcmp(v->data, t.data(), t.view().bytes()), 0) << name;
  }
  // The file starts a 1-rank run with those parameters (momentum at zero).
  auto weights = WeightsReader::Open(out);
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto programs = Programs(g, 1, "single");
  auto comm = NewInProcessGroup(1);
  std::unique_ptr<Device> device = NewCpuDevice(1);
  auto runner = ProgramRunner::Create(programs[0], g, device.get(), comm[0].get());
  ASSERT_TRUE(runner.ok()) << runner.status();
  ASSERT_TRUE(
      InitWeightsHook(std::shared_ptr<WeightsReader>(std::move(*weights)), &g)(**runner).ok());
  auto params = (*runner)->Parameters();
  ASSERT_TRUE(params.ok());
  for (const auto& p : *params) {
    EXPECT_EQ(std::memcmp(p.value.data(), whole->at(p.name).data(), p.value.view().bytes()), 0);
  }
  // A file of another model: every missing, extra and mismatched name listed.
  graph::Graph wider = Mlp(20);
  auto w2 = WeightsReader::Open(out);
  ASSERT_TRUE(w2.ok());
  EXPECT_THAT((*w2)->CheckGraph(wider),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("other shape or dtype: layer0/fc/weight (F32[24,12] in the file, "
                                 "F32[20,12] in the model), layer0/fc/bias")));
}

// `g` trained `steps` steps on a 2-rank tensor-parallel plan, checkpointed
// at the last with `trainer`'s metadata into `dir` and exported there as
// model.safetensors (no optimizer state): the parameters as trained,
// assembled, and the export.
struct Exported {
  std::map<std::string, HostTensor> whole;
  std::unique_ptr<SafetensorsFile> file;
  std::string path;
};
void TrainCheckpointAndExport(const graph::Graph& g, const v1::TrainerState& trainer, int steps,
                              const std::string& dir, Exported* out) {
  auto programs = Programs(g, 2, "tp");
  TrainOptions to;
  to.steps = steps;
  to.after_step = SaveHook({dir, 0, 3, steps}, &programs, trainer);
  auto runs = Train(g, programs, to);
  ASSERT_TRUE(runs.ok()) << runs.status();
  auto whole = AssembleParameters({(*runs)[0].parameters, (*runs)[1].parameters});
  ASSERT_TRUE(whole.ok()) << whole.status();
  out->whole = *std::move(whole);
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  out->path = dir + "/model.safetensors";
  ASSERT_TRUE(ExportCheckpoint(**reader, out->path, false).ok());
  auto file = SafetensorsFile::Open(out->path);
  ASSERT_TRUE(file.ok()) << file.status();
  out->file = *std::move(file);
}

// Two graph parameters stored as one PyTorch parameter (as the exporter
// records nn.MultiheadAttention's q, k, v in in_proj_weight): the export
// joins them, --init-weights splits them again.
TEST(CheckpointTest, StateDictSlicesAreJoinedOnExportAndSplitOnInit) {
  auto base = graph::BuildZooModel(
      "mlp", {{"layers", 2}, {"hidden", 24}, {"input", 24}, {"classes", 5}, {"batch", 9}});
  ASSERT_TRUE(base.ok()) << base.status();
  const std::string json =
      R"({"layer0/fc/weight": {"source": "stacked", "axis": 0, "offset": 0, "source_shape": [48, 24]},)"
      R"( "layer1/fc/weight": {"source": "stacked", "axis": 0, "offset": 24, "source_shape": [48, 24]}})";
  v1::Graph proto = graph::ToProto(*base);
  (*proto.mutable_metadata())[kStateDictSlicesKey] = json;
  auto g = graph::FromProto(proto);
  ASSERT_TRUE(g.ok()) << g.status();
  auto slices = GraphStateDictSlices(*g);
  ASSERT_TRUE(slices.ok()) << slices.status();
  ASSERT_EQ(slices->size(), 2u);

  const std::string dir = Fresh("slices");
  v1::TrainerState trainer;
  trainer.set_state_dict_slices(json);
  Exported exported;
  ASSERT_NO_FATAL_FAILURE(TrainCheckpointAndExport(*g, trainer, 2, dir, &exported));
  const auto* whole = &exported.whole;
  const auto* file = &exported.file;
  const std::string& out = exported.path;
  EXPECT_FALSE((*file)->tensors().count("layer0/fc/weight"));
  auto stacked = (*file)->View("stacked");
  ASSERT_TRUE(stacked.ok()) << stacked.status();
  ASSERT_EQ(stacked->shape, (Shape{48, 24}));
  const int64_t half = 24 * 24 * 4;
  EXPECT_EQ(std::memcmp(stacked->data, whole->at("layer0/fc/weight").data(), half), 0);
  EXPECT_EQ(std::memcmp(static_cast<char*>(stacked->data) + half,
                        whole->at("layer1/fc/weight").data(), half),
            0);

  // Split again onto a 2-rank tensor-parallel plan.
  auto weights = WeightsReader::Open(out, *slices);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_TRUE((*weights)->CheckGraph(*g).ok()) << (*weights)->CheckGraph(*g);
  auto plain = WeightsReader::Open(out);  // without the mapping: named
  ASSERT_TRUE(plain.ok());
  EXPECT_THAT((*plain)->CheckGraph(*g), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                 HasSubstr("missing: layer0/fc/weight")));
  auto programs = Programs(*g, 2, "tp");  // the plan trained above
  TrainOptions init;
  init.steps = 1;
  init.initialize = InitWeightsHook(std::shared_ptr<WeightsReader>(std::move(*weights)), &*g);
  auto again = Train(*g, programs, init);
  ASSERT_TRUE(again.ok()) << again.status();
  // The weights arrived whole: the first loss equals that of a run that
  // resumes from the checkpoint itself (same plan, same batch).
  auto resumed_reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(resumed_reader.ok());
  TrainOptions resume;
  resume.steps = 1;
  resume.initialize =
      ResumeHook(std::shared_ptr<CheckpointReader>(std::move(*resumed_reader)), &*g);
  auto resumed = Train(*g, programs, resume);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ((*again)[0].losses[0], (*resumed)[0].losses[0]);

  // A mapping that does not fit the graph is named.
  (*proto.mutable_metadata())[kStateDictSlicesKey] =
      R"({"layer0/fc/weight": {"source": "s", "axis": 0, "offset": 30, "source_shape": [48, 24]}})";
  auto bad = graph::FromProto(proto);
  ASSERT_TRUE(bad.ok());
  EXPECT_THAT(
      GraphStateDictSlices(*bad).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("'layer0/fc/weight' [24,24] does not fit in s[48,24] at offset 30")));
}

// The exporter's hap.state_dict_extras: a tied name is written as a copy of
// the tensor it names and accepted back when equal (refused otherwise),
// exporter constants stay out of the export, unheld entries are ignored.
TEST(CheckpointTest, StateDictExtrasTiedNamesConstantsAndUnheld) {
  auto base = graph::BuildZooModel(
      "mlp", {{"layers", 2}, {"hidden", 24}, {"input", 24}, {"classes", 5}, {"batch", 9}});
  ASSERT_TRUE(base.ok()) << base.status();
  const std::string json =
      R"({"aliases": {"head.weight": "layer0/fc/weight"}, "constants": ["layer1/fc/bias"],)"
      R"( "unheld": ["spare"]})";
  auto extras = ParseStateDictExtras(json);
  ASSERT_TRUE(extras.ok()) << extras.status();
  EXPECT_EQ(extras->aliases.at("head.weight"), "layer0/fc/weight");
  EXPECT_THAT(ParseStateDictExtras(R"({"aliases": {"a": 3}})").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("alias 'a'")));
  v1::Graph proto = graph::ToProto(*base);
  (*proto.mutable_metadata())[kStateDictExtrasKey] = json;
  auto g = graph::FromProto(proto);
  ASSERT_TRUE(g.ok()) << g.status();

  const std::string dir = Fresh("extras");
  v1::TrainerState trainer;
  trainer.set_state_dict_extras(json);
  Exported exported;
  ASSERT_NO_FATAL_FAILURE(TrainCheckpointAndExport(*g, trainer, 1, dir, &exported));
  const auto* whole = &exported.whole;
  const auto* file = &exported.file;
  EXPECT_FALSE((*file)->tensors().count("layer1/fc/bias"));
  EXPECT_FALSE((*file)->tensors().count("spare"));
  auto tied = (*file)->View("head.weight");
  ASSERT_TRUE(tied.ok()) << tied.status();
  const HostTensor& held = whole->at("layer0/fc/weight");
  ASSERT_EQ(tied->shape, held.shape());
  EXPECT_EQ(std::memcmp(tied->data, held.data(), held.view().bytes()), 0);

  // Back in: every parameter, the tied name and an unheld entry.
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : *whole) entries.push_back({name, t.view()});
  entries.push_back({"head.weight", held.view()});
  HostTensor spare(DType::kFloat32, Shape{3});
  entries.push_back({"spare", spare.view()});
  const std::string in = dir + "/state_dict.safetensors";
  ASSERT_TRUE(WriteSafetensors(in, entries, {}).ok());
  auto weights = WeightsReader::Open(in);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_TRUE((*weights)->CheckGraph(*g).ok()) << (*weights)->CheckGraph(*g);
  // Without the metadata both are extra.
  EXPECT_THAT((*weights)->CheckGraph(*base),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("not in the model: head.weight, spare")));
  // A tied name with other values than the tensor it names.
  HostTensor other(DType::kFloat32, held.shape());
  entries[entries.size() - 2] = {"head.weight", other.view()};
  ASSERT_TRUE(WriteSafetensors(in, entries, {}).ok());
  auto differing = WeightsReader::Open(in);
  ASSERT_TRUE(differing.ok()) << differing.status();
  EXPECT_THAT((*differing)->CheckGraph(*g),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("head.weight (tied to layer0/fc/weight in the model, other "
                                 "values in the file)")));
}

// A weights file holding a tied tensor only under its further name (GPT-2's
// lm_head.weight without transformer.wte.weight) starts the run with it
// when the graph records the tie; without the record it is missing.
TEST(CheckpointTest, AWeightsFileHoldingOnlyTheTiedNameIsReadThroughIt) {
  auto base = graph::BuildZooModel(
      "mlp", {{"layers", 2}, {"hidden", 24}, {"input", 24}, {"classes", 5}, {"batch", 9}});
  ASSERT_TRUE(base.ok()) << base.status();
  v1::Graph proto = graph::ToProto(*base);
  (*proto.mutable_metadata())[kStateDictExtrasKey] =
      R"({"aliases": {"head.weight": "layer0/fc/weight"}})";
  auto g = graph::FromProto(proto);
  ASSERT_TRUE(g.ok()) << g.status();
  const std::string dir = Fresh("tied_only");
  fs::create_directories(dir);
  auto programs = Programs(*g, 2, "tp");
  TrainOptions one;
  one.steps = 1;
  auto trained = Train(*g, programs, one);
  ASSERT_TRUE(trained.ok()) << trained.status();
  auto whole = AssembleParameters({(*trained)[0].parameters, (*trained)[1].parameters});
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : *whole) {
    entries.push_back({name == "layer0/fc/weight" ? "head.weight" : name, t.view()});
  }
  const std::string in = dir + "/tied_only.safetensors";
  ASSERT_TRUE(WriteSafetensors(in, entries, {}).ok());
  EXPECT_THAT(WeightsReader::Open(in).value()->CheckGraph(*base),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("missing: layer0/fc/weight"),
                             HasSubstr("not in the model: head.weight"))));
  auto weights = WeightsReader::OpenFor(in, *g);
  ASSERT_TRUE(weights.ok()) << weights.status();
  TrainOptions init;
  init.steps = 1;
  init.initialize = InitWeightsHook(std::shared_ptr<WeightsReader>(std::move(*weights)), &*g);
  auto again = Train(*g, programs, init);
  ASSERT_TRUE(again.ok()) << again.status();
  auto started = AssembleParameters({(*again)[0].parameters, (*again)[1].parameters});
  ASSERT_TRUE(started.ok());
  // One SGD step from the file's values, not from the initialiser's: the
  // first loss is the one a run from the whole file has.
  auto named = WeightsReader::Open(
      in, {}, ParseStateDictExtras(R"({"aliases": {"head.weight": "layer0/fc/weight"}})").value());
  ASSERT_TRUE(named.ok());
  EXPECT_TRUE((*named)->Has("layer0/fc/weight"));
  std::vector<SafetensorsEntry> both = entries;
  both.push_back({"layer0/fc/weight", whole->at("layer0/fc/weight").view()});
  const std::string full = dir + "/full.safetensors";
  ASSERT_TRUE(WriteSafetensors(full, both, {}).ok());
  auto full_weights = WeightsReader::OpenFor(full, *g);
  ASSERT_TRUE(full_weights.ok()) << full_weights.status();
  init.initialize = InitWeightsHook(std::shared_ptr<WeightsReader>(std::move(*full_weights)), &*g);
  auto reference = Train(*g, programs, init);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ((*again)[0].losses[0], (*reference)[0].losses[0]);
  EXPECT_NE((*again)[0].losses[0], (*trained)[0].losses[0]);
}

// BatchNorm's num_batches_tracked (extras "counters": forwards per step)
// starts from the weights file's value, advances by its forwards per step,
// is kept in trainer.json, continues on resume and is written by the export
// as an I64 scalar; a buffer folded into constants (extras "folded") is
// written with its recorded values and refused from a weights file with
// other values.
TEST(CheckpointTest, CountersAndFoldedBuffersAreCarriedThroughCheckpointsAndExports) {
  auto base = graph::BuildZooModel(
      "mlp", {{"layers", 2}, {"hidden", 24}, {"input", 24}, {"classes", 5}, {"batch", 9}});
  ASSERT_TRUE(base.ok()) << base.status();
  // mask: F32[2, 3] = 1 1 1 1 0 0 (runs of 4 ones, 2 zeros).
  const std::string json =
      R"({"counters": {"bn.num_batches_tracked": {"per_step": 2, "value": 3},)"
      R"( "idle.num_batches_tracked": {"per_step": 0}},)"
      R"( "folded": {"mask": {"dtype": "F32", "shape": [2, 3],)"
      R"( "runs": [[4, "0000803f"], [2, "00000000"]]},)"
      R"( "flags": {"dtype": "BOOL", "shape": [3], "runs": [[2, "01"], [1, "00"]]}}})";
  auto extras = ParseStateDictExtras(json);
  ASSERT_TRUE(extras.ok()) << extras.status();
  EXPECT_EQ(extras->counters.at("bn.num_batches_tracked"), 2);
  ASSERT_EQ(extras->folded.at("mask").bytes.size(), 24u);
  for (const char* bad :
       {R"({"counters": {"c": {"per_step": -1}}})", R"({"counters": {"c": 1}})",
        R"({"folded": {"m": {"dtype": "F32", "shape": [2],)"
        R"( "runs": [[3, "0000803f"]]}}})",
        R"({"folded": {"m": {"dtype": "F32", "shape": [1], "runs": [[1, "00803f"]]}}})",
        R"({"folded": {"m": {"dtype": "Q7", "shape": [1], "runs": [[1, "01"]]}}})"}) {
    EXPECT_THAT(ParseStateDictExtras(bad).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(kStateDictExtrasKey)))
        << bad;
  }
  v1::Graph proto = graph::ToProto(*base);
  (*proto.mutable_metadata())[kStateDictExtrasKey] = json;
  auto g = graph::FromProto(proto);
  ASSERT_TRUE(g.ok()) << g.status();

  // A state_dict file: the parameters, bn.num_batches_tracked = 7 (idle's
  // left out: 0), the mask as recorded.
  const std::string dir = Fresh("counters");
  fs::create_directories(dir);
  std::map<std::string, HostTensor> params;
  for (graph::TensorId id : g->Parameters()) {
    const graph::Tensor& t = g->tensor(id);
    HostTensor h(t.type.dtype, t.type.shape);
    for (int64_t i = 0; i < h.view().num_elements(); ++i) h.as<float>()[i] = 0.01f * (i % 7);
    params.try_emplace(t.name, std::move(h));
  }
  HostTensor counter(DType::kInt64, Shape{});
  counter.as<int64_t>()[0] = 7;
  HostTensor mask(DType::kFloat32, Shape{2, 3});
  std::memcpy(mask.data(), extras->folded.at("mask").bytes.data(), 24);
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : params) entries.push_back({name, t.view()});
  entries.push_back({"bn.num_batches_tracked", counter.view()});
  entries.push_back({"mask", mask.view()});
  std::string flags("\1\1\0", 3);
  entries.push_back({"flags", TensorView{DType::kFloat32, Shape{3}, flags.data()}, "BOOL"});
  const std::string in = dir + "/state_dict.safetensors";
  ASSERT_TRUE(WriteSafetensors(in, entries, {}).ok());
  auto weights = WeightsReader::OpenFor(in, *g);
  ASSERT_TRUE(weights.ok()) << weights.status();
  std::shared_ptr<WeightsReader> w(std::move(*weights));

  auto programs = Programs(*g, 2, "tp");
  v1::TrainerState trainer;
  trainer.set_global_batch(9);
  trainer.set_state_dict_extras(json);
  ASSERT_TRUE(SetStartCounters(nullptr, w.get(), &trainer).ok());
  EXPECT_EQ(trainer.num_batches_tracked().at("bn.num_batches_tracked"), 7);
  const std::string ckpt = dir + "/ckpt";
  TrainOptions to;
  to.steps = 3;
  to.initialize = InitWeightsHook(w, &*g);
  to.after_step = SaveHook({ckpt, 0, 3, 3}, &programs, trainer);
  ASSERT_TRUE(Train(*g, programs, to).ok());
  auto reader = CheckpointReader::Open(ckpt);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->trainer().step(), 3);
  EXPECT_EQ((*reader)->trainer().num_batches_tracked().at("bn.num_batches_tracked"), 7 + 3 * 2);
  EXPECT_EQ((*reader)->trainer().num_batches_tracked().at("idle.num_batches_tracked"), 0);

  // Resumed to step 5: the counter continues.
  v1::TrainerState again = trainer;
  ASSERT_TRUE(SetStartCounters(&(*reader)->trainer(), nullptr, &again).ok());
  EXPECT_EQ(again.step(), 3);
  TrainOptions resume;
  resume.first_step = 3;
  resume.steps = 2;
  resume.initialize = ResumeHook(std::shared_ptr<CheckpointReader>(std::move(*reader)), &*g);
  resume.after_step = SaveHook({ckpt, 0, 3, 5, 3}, &programs, again);
  ASSERT_TRUE(Train(*g, programs, resume).ok());
  auto last = CheckpointReader::Open(ckpt);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ((*last)->trainer().step(), 5);
  EXPECT_EQ((*last)->trainer().num_batches_tracked().at("bn.num_batches_tracked"), 7 + 5 * 2);

  const std::string out = dir + "/model.safetensors";
  ASSERT_TRUE(ExportCheckpoint(**last, out, false).ok());
  auto file = SafetensorsFile::Open(out);
  ASSERT_TRUE(file.ok()) << file.status();
  auto exported_counter = (*file)->View("bn.num_batches_tracked");
  ASSERT_TRUE(exported_counter.ok()) << exported_counter.status();
  EXPECT_EQ(exported_counter->dtype, DType::kInt64);
  EXPECT_TRUE(exported_counter->shape.empty());
  EXPECT_EQ(*static_cast<const int64_t*>(exported_counter->data), 17);
  auto exported_mask = (*file)->View("mask");
  ASSERT_TRUE(exported_mask.ok()) << exported_mask.status();
  EXPECT_EQ(exported_mask->shape, (Shape{2, 3}));
  EXPECT_EQ(std::memcmp(exported_mask->data, mask.data(), 24), 0);
  ASSERT_TRUE((*file)->others().count("flags"));
  EXPECT_EQ((*file)->others().at("flags").dtype, "BOOL");
  EXPECT_EQ((*file)->others().at("flags").bytes, flags);
  // The export starts a run again, counter and mask included.
  EXPECT_TRUE(WeightsReader::OpenFor(out, *g).ok());

  // A counter below 0 (a damaged file): refused where the run would start
  // from it, named with its value.
  counter.as<int64_t>()[0] = -3;
  ASSERT_TRUE(WriteSafetensors(in, entries, {}).ok());
  auto negative = WeightsReader::OpenFor(in, *g);
  ASSERT_TRUE(negative.ok()) << negative.status();
  v1::TrainerState fresh;
  fresh.set_state_dict_extras(json);
  EXPECT_THAT(SetStartCounters(nullptr, negative->get(), &fresh),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(in), HasSubstr("counter 'bn.num_batches_tracked' is -3, "
                                                      "outside [0, 2^62]"))));
  counter.as<int64_t>()[0] = 7;

  // Other mask or flags values, or a counter of another dtype: refused, named.
  mask.as<float>()[5] = 1.0f;
  flags[2] = '\1';
  HostTensor float_counter(DType::kFloat32, Shape{});
  entries[entries.size() - 3] = {"bn.num_batches_tracked", float_counter.view()};
  // A parameter as BOOL (a dtype the file opens apart): named with it.
  std::string bias_bools(24, '\1');
  for (SafetensorsEntry& e : entries) {
    if (e.name == "layer0/fc/bias") {
      e = SafetensorsEntry(e.name, TensorView{DType::kFloat32, Shape{24}, bias_bools.data()},
                           "BOOL");
    }
  }
  ASSERT_TRUE(WriteSafetensors(in, entries, {}).ok());
  EXPECT_THAT(WeightsReader::OpenFor(in, *g).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("bn.num_batches_tracked (F32[] in the file, an I64 scalar "
                                       "counter in the model)"),
                             HasSubstr("layer0/fc/bias (BOOL[24] in the file, F32[24] in the "
                                       "model)"),
                             HasSubstr("mask (a buffer the graph's constants were built from at "
                                       "export, other values in the file"),
                             HasSubstr("flags (a buffer the graph's constants"))));
}

// A parameter forward does not use (extras "folded" marked "parameter"):
// the graph does not hold it, yet the export of a trained checkpoint writes
// it with its recorded values (PyTorch's training leaves it as it is); a
// weights file may carry it with those values, and other values are refused,
// named as such (the export would not give them back).
TEST(CheckpointTest, UnusedParametersAreExportedAsRecorded) {
  auto base = graph::BuildZooModel(
      "mlp", {{"layers", 2}, {"hidden", 24}, {"input", 24}, {"classes", 5}, {"batch", 9}});
  ASSERT_TRUE(base.ok()) << base.status();
  // spare.weight: F32[2, 2] = 1 2 2 0.5.
  const std::string json =
      R"({"folded": {"spare.weight": {"dtype": "F32", "shape": [2, 2], "parameter": true,)"
      R"( "runs": [[1, "0000803f"], [2, "00000040"], [1, "0000003f"]]}}})";
  auto extras = ParseStateDictExtras(json);
  ASSERT_TRUE(extras.ok()) << extras.status();
  EXPECT_TRUE(extras->folded.at("spare.weight").parameter);
  EXPECT_THAT(ParseStateDictExtras(R"({"folded": {"m": {"dtype": "F32", "shape": [1],)"
                                   R"( "runs": [[1, "0000803f"]], "parameter": 1}}})")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("folded buffer 'm': parameter is not true or false")));
  v1::Graph proto = graph::ToProto(*base);
  (*proto.mutable_metadata())[kStateDictExtrasKey] = json;
  auto g = graph::FromProto(proto);
  ASSERT_TRUE(g.ok()) << g.status();

  const std::string dir = Fresh("unused_parameters");
  v1::TrainerState trainer;
  trainer.set_state_dict_extras(json);
  Exported exported;
  ASSERT_NO_FATAL_FAILURE(TrainCheckpointAndExport(*g, trainer, 2, dir, &exported));
  const float recorded[] = {1.0f, 2.0f, 2.0f, 0.5f};
  auto spare = exported.file->View("spare.weight");
  ASSERT_TRUE(spare.ok()) << spare.status();
  EXPECT_EQ(spare->dtype, DType::kFloat32);
  EXPECT_EQ(spare->shape, (Shape{2, 2}));
  EXPECT_EQ(std::memcmp(spare->data, recorded, sizeof(recorded)), 0);
  EXPECT_EQ(exported.file->tensors().size(), exported.whole.size() + 1);
  // The export starts a run again, the parameter included.
  auto again = WeightsReader::OpenFor(exported.path, *g);
  EXPECT_TRUE(again.ok()) << again.status();

  // Other values for it: refused, named as a parameter forward does not use.
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : exported.whole) entries.push_back({name, t.view()});
  HostTensor other(DType::kFloat32, Shape{2, 2});
  std::memcpy(other.data(), recorded, sizeof(recorded));
  other.as<float>()[3] = 0.25f;
  entries.push_back({"spare.weight", other.view()});
  const std::string in = dir + "/state_dict.safetensors";
  ASSERT_TRUE(WriteSafetensors(in, entries, {}).ok());
  EXPECT_THAT(WeightsReader::OpenFor(in, *g).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("spare.weight (a parameter forward does not use, recorded at "
                                 "export so that exports give it back as PyTorch's training "
                                 "leaves it; other values in the file")));
}

// A checkpoint written without counters starts them at step * per_step; a
// step near 2^63 (trainer.json damaged, its global batch 1 or unrecorded, so
// Open's step * batch check passes) overflowed there: undefined behaviour,
// a negative counter in practice. Caught by tests/fuzz/checkpoint_fuzzer (UBSan).
TEST(CheckpointTest, AResumedStepWhoseCountersOverflowIsDataLoss) {
  v1::TrainerState resumed;
  resumed.set_step(std::numeric_limits<int64_t>::max() / 2 + 1);
  v1::TrainerState trainer;
  trainer.set_state_dict_extras(R"({"counters": {"bn.num_batches_tracked": {"per_step": 2}}})");
  EXPECT_THAT(SetStartCounters(&resumed, nullptr, &trainer),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("trainer.json is corrupted"),
                             HasSubstr("'bn.num_batches_tracked' overflows 64 bits"))));
  resumed.set_step(int64_t{1} << 61);  // 2^62 forwards: the most a counter may hold
  ASSERT_TRUE(SetStartCounters(&resumed, nullptr, &trainer).ok());
  EXPECT_EQ(trainer.num_batches_tracked().at("bn.num_batches_tracked"), int64_t{1} << 62);
}

// A counter read from a damaged trainer.json, below 0 or past 2^62, was
// taken as it was: negative, or added to at each save until it overflowed.
TEST(CheckpointTest, AResumedCounterOutOfRangeIsDataLoss) {
  v1::TrainerState trainer;
  trainer.set_state_dict_extras(R"({"counters": {"bn.num_batches_tracked": {"per_step": 2}}})");
  for (int64_t bad : {int64_t{-1}, (int64_t{1} << 62) + 1, std::numeric_limits<int64_t>::max()}) {
    v1::TrainerState resumed;
    resumed.set_step(10);
    (*resumed.mutable_num_batches_tracked())["bn.num_batches_tracked"] = bad;
    EXPECT_THAT(SetStartCounters(&resumed, nullptr, &trainer),
                StatusIs(absl::StatusCode::kDataLoss,
                         AllOf(HasSubstr("trainer.json is corrupted"),
                               HasSubstr(absl::StrCat("counter 'bn.num_batches_tracked' is ", bad,
                                                      ", outside [0, 2^62]")))))
        << bad;
  }
  v1::TrainerState resumed;
  resumed.set_step(10);
  (*resumed.mutable_num_batches_tracked())["bn.num_batches_tracked"] = int64_t{1} << 62;
  ASSERT_TRUE(SetStartCounters(&resumed, nullptr, &trainer).ok());
  EXPECT_EQ(trainer.num_batches_tracked().at("bn.num_batches_tracked"), int64_t{1} << 62);
}

// A flipped bit in an export (`hapctl checkpoint export`, then
// --init-weights) started a run from the damaged weights. Exports record
// each tensor's CRC-32C, which reading a weights file checks (a file
// without them, such as PyTorch's, is read as it is).
TEST(CheckpointTest, AFlippedBitInAnExportIsDataLossAtInitWeights) {
  graph::Graph g = Mlp();
  const std::string dir = Fresh("export_flipped");
  TrainAndSave(g, Programs(g, 1, "single"), dir, 1, 3);
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const std::string out = dir + "/model.safetensors";
  ASSERT_TRUE(ExportCheckpoint(**reader, out, false).ok());
  auto init = [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(std::unique_ptr<WeightsReader> w, WeightsReader::OpenFor(out, g));
    auto programs = Programs(g, 1, "single");
    auto comm = NewInProcessGroup(1);
    std::unique_ptr<Device> device = NewCpuDevice(1);
    HAP_ASSIGN_OR_RETURN(std::unique_ptr<ProgramRunner> runner,
                         ProgramRunner::Create(programs[0], g, device.get(), comm[0].get()));
    return InitWeightsHook(std::shared_ptr<WeightsReader>(std::move(w)), &g)(*runner);
  };
  ASSERT_TRUE(init().ok());
  const std::string last = test_util::FlipTheLastByte(out);
  EXPECT_THAT(init(), StatusIs(absl::StatusCode::kDataLoss,
                               AllOf(HasSubstr(out + " is damaged"), HasSubstr("'" + last + "'"),
                                     HasSubstr("CRC-32C"))));
}

// RunLocalRanks (tests, benchmarks) hands every rank thread the same
// TrainOptions::initialize: InitWeightsHook's reader was read by all at
// once, and its record of the tensors whose CRC-32C it had checked (a
// std::set) was inserted into concurrently: the heap was corrupted
// (malloc aborts, double frees, hangs in most runs), where ResumeHook takes
// a mutex. An export of a model of 400 parameters starts 8 ranks at once.
TEST(CheckpointTest, InitWeightsHookSharedByTheRanksOfAProcessStartsThemAll) {
  auto g = graph::BuildZooModel(
      "mlp", {{"layers", 200}, {"hidden", 4}, {"input", 4}, {"classes", 2}, {"batch", 2}});
  ASSERT_TRUE(g.ok()) << g.status();
  const std::string dir = Fresh("init_weights_shared");
  auto programs = Programs(*g, 1, "single");
  TrainAndSave(*g, programs, dir, 1, 3);
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const std::string file = dir + "/model.safetensors";  // with each tensor's CRC-32C
  ASSERT_TRUE(ExportCheckpoint(**reader, file, false).ok());
  constexpr int kRanks = 8;
  for (int round = 0; round < 10; ++round) {
    auto w = WeightsReader::OpenFor(file, *g);
    ASSERT_TRUE(w.ok()) << w.status();
    auto hook = InitWeightsHook(std::shared_ptr<WeightsReader>(std::move(*w)), &*g);
    std::vector<absl::Status> results(kRanks);
    std::vector<std::thread> ranks;
    std::atomic<int> ready{0};
    for (int r = 0; r < kRanks; ++r) {
      ranks.emplace_back([&, r] {
        auto comm = NewInProcessGroup(1);
        std::unique_ptr<Device> device = NewCpuDevice(1);
        auto runner = ProgramRunner::Create(programs[0], *g, device.get(), comm[0].get());
        // Every rank ready before any starts, as the ranks' first steps.
        ready.fetch_add(1);
        while (ready.load() < kRanks) std::this_thread::yield();
        results[r] = runner.ok() ? hook(**runner) : runner.status();
      });
    }
    for (std::thread& t : ranks) t.join();
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];
    }
  }
}

}  // namespace
}  // namespace hap::executor::checkpoint
