#include "tools/hapctl_checkpoint.h"

#include <filesystem>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/cli_args.h"
#include "executor/checkpoint/checkpoint.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace hap::tools {
namespace {

namespace ckpt = ::hap::executor::checkpoint;
namespace fs = std::filesystem;

constexpr char kUsage[] =
    R"(usage: hapctl checkpoint inspect DIR [-o table|json]
       hapctl checkpoint export DIR -o FILE.safetensors [--with-optimizer-state]
       hapctl checkpoint verify DIR

DIR is a checkpoint directory (its latest complete checkpoint is used) or one
step-NNNNNNNN directory in it (or one set aside: damaged-step-N,
superseded-step-N).
inspect  lists the step, the plan and graph it was written by, the files and
         every tensor with its shape, dtype and slices.
export   writes every parameter whole into one safetensors file under the
         model's names (PyTorch state_dict names for exported modules:
         `model.load_state_dict(safetensors_io.read(FILE))`), for
         --init-weights or PyTorch.
verify   reads every tensor of every shard whole and checks it against the
         CRC-32C its shard records (and the records against COMMITTED):
         exit 0 when the checkpoint can be resumed from, 1 naming each
         problem. A job sets a checkpoint it found damaged aside as
         damaged-step-N; verify says whether it is.
)";

int Fail(const absl::Status& s) {
  std::cerr << "error: " << s.message() << "\n";
  return 1;
}

std::string Shape(const google::protobuf::RepeatedField<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

int64_t Elements(const google::protobuf::RepeatedField<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

int Inspect(const Args& a) {
  // Checked before reading the checkpoint, naming the value.
  const std::string fmt = a.Get("o", a.Get("output", "table"));
  if (fmt != "table" && fmt != "json") {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat("-o must be table or json, got '", fmt, "'")));
  }
  auto reader = ckpt::CheckpointReader::Open(a.positional()[1]);
  if (!reader.ok()) return Fail(reader.status());
  const auto& index = (*reader)->index();
  const auto& trainer = (*reader)->trainer();
  int64_t file_bytes = 0;
  for (const auto& f : index.files()) {
    std::error_code ec;
    auto n = fs::file_size(fs::path((*reader)->step_dir()) / f, ec);
    if (!ec) file_bytes += static_cast<int64_t>(n);
  }
  if (fmt == "json") {
    // The path as a JSON string too: written between quotes as it was, a
    // directory with a quote or a backslash in its name made the output no JSON.
    google::protobuf::Value path;
    path.set_string_value((*reader)->step_dir());
    google::protobuf::util::JsonPrintOptions o;
    o.preserve_proto_field_names = true;
    std::string path_json, idx, tr;
    for (const auto& [message, json] :
         {std::pair<const google::protobuf::Message*, std::string*>{&path, &path_json},
          {&index, &idx},
          {&trainer, &tr}}) {
      if (auto st = google::protobuf::util::MessageToJsonString(*message, json, o); !st.ok()) {
        return Fail(absl::InternalError(absl::StrCat("cannot print the checkpoint's ",
                                                     message->GetDescriptor()->name(),
                                                     " as json: ", st.message().as_string())));
      }
    }
    std::cout << "{\"path\": " << path_json << ", \"bytes\": " << file_bytes
              << ", \"trainer\": " << tr << ", \"index\": " << idx << "}\n";
    return 0;
  }
  int64_t params = 0, states = 0;
  for (const auto& t : index.tensors()) (t.optimizer_state() ? states : params) += Elements(t.shape());
  std::cout << absl::StrFormat("checkpoint  %s\n", (*reader)->step_dir());
  std::cout << absl::StrFormat("step        %d (%d samples seen, global batch %d)\n", trainer.step(),
                               trainer.samples_seen(), trainer.global_batch());
  std::cout << absl::StrFormat("graph       %s (hash %s)\n", trainer.graph_name(),
                               trainer.graph_hash().substr(0, 12));
  std::cout << absl::StrFormat("plan        %s (hash %s) on %d ranks\n",
                               trainer.plan_name().empty() ? "-" : trainer.plan_name(),
                               trainer.plan_hash().substr(0, 12), trainer.world_size());
  std::cout << absl::StrFormat("written     %s, format version %d\n", trainer.time(),
                               trainer.format_version());
  // The size a resume checks (samples of user data, tokens of a corpus).
  const bool user_data =
      absl::StartsWith(trainer.data(), "npy:") || absl::StartsWith(trainer.data(), "tokens:");
  const std::string data_size =
      trainer.data_size() <= 0
          ? ""
          : absl::StrCat(" (", trainer.data_size(), user_data ? " samples)" : " tokens)");
  std::cout << absl::StrFormat(
      "data        %s%s%s, seed %d\n", trainer.data().empty() ? "-" : trainer.data(), data_size,
      trainer.shuffle() ? absl::StrCat(", shuffled (seed ", trainer.shuffle_seed(), ")") : "",
      trainer.seed());
  std::cout << absl::StrFormat(
      "size        %.2f MB in %d files: %d parameters, %d optimizer state values\n",
      file_bytes / 1e6, index.files_size(), params, states);
  std::cout << absl::StrFormat("\n%-44s %-6s %-16s %s\n", "TENSOR", "DTYPE", "SHAPE", "SLICES");
  for (const auto& t : index.tensors()) {
    std::vector<std::string> slices;
    for (const auto& s : t.slices()) {
      std::string file = s.file();
      if (auto dash = file.find("-of-"); dash != std::string::npos) file = file.substr(0, dash);
      slices.push_back(absl::StrCat(file, "@", Shape(s.offsets()), "+", Shape(s.extents())));
    }
    std::cout << absl::StrFormat("%-44s %-6s %-16s %s\n", t.name(), t.dtype(), Shape(t.shape()),
                                 absl::StrJoin(slices, " "));
  }
  return 0;
}

int Export(const Args& a) {
  const std::string out = a.Get("o", a.Get("output"));
  if (out.empty()) return Fail(absl::InvalidArgumentError("export needs -o FILE.safetensors"));
  // The export is written into a temporary file renamed over the output:
  // '-o /dev/stdout' or a named pipe was replaced by a regular file (as
  // root '-o /dev/null' or '/dev/full' replaced the device), and 'wrote'
  // said it went there. Checked before the checkpoint is read.
  std::error_code ec;
  const fs::file_status st = fs::status(out, ec);
  if (!ec && fs::exists(st) && !fs::is_regular_file(st)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "-o ", out, " is ", fs::is_directory(st) ? "a directory" : "not a regular file",
        ": export writes a safetensors file whole, into a temporary file renamed over the "
        "output, which would replace it; name a file")));
  }
  auto reader = ckpt::CheckpointReader::Open(a.positional()[1]);
  if (!reader.ok()) return Fail(reader.status());
  auto bytes = ckpt::ExportCheckpoint(**reader, out, a.Bool("with-optimizer-state"));
  if (!bytes.ok()) return Fail(bytes.status());
  std::cout << absl::StrFormat("wrote %s: %.2f MB of tensors from %s (step %d)\n", out,
                               *bytes / 1e6, (*reader)->step_dir(), (*reader)->trainer().step());
  // ExportCheckpoint has parsed them already.
  auto extras = ckpt::ParseStateDictExtras((*reader)->trainer().state_dict_extras());
  if (extras.ok() && !extras->unheld.empty()) {
    std::cerr << absl::StrFormat(
        "note: the model's state_dict also holds %s, which the graph does not hold and the "
        "exporter could not record (parameters forward does not use or buffers folded into "
        "constants, of too many runs of equal values; buffers of a dtype safetensors has no name "
        "for (complex), as tools/export_fx.py said at export): not in %s; take them from the "
        "module (load_state_dict(..., strict=False))\n",
        absl::StrJoin(extras->unheld, ", "), out);
  }
  return 0;
}

int Verify(const Args& a) {
  auto reader = ckpt::CheckpointReader::Open(a.positional()[1]);
  if (!reader.ok()) return Fail(reader.status());
  const ckpt::CheckpointReader::VerifyReport r = (*reader)->Verify();
  for (const absl::Status& p : r.problems) std::cout << "damaged: " << p.message() << "\n";
  std::cout << absl::StrFormat(
      "%s (step %d): %d of %d tensor slices read whole, %.2f MB, %d checked against their "
      "CRC-32C%s: %s\n",
      (*reader)->step_dir(), (*reader)->trainer().step(), r.checked + r.unchecked, r.slices,
      r.bytes / 1e6, r.checked,
      r.unchecked > 0 ? absl::StrCat(", ", r.unchecked, " written before checksums (unchecked)")
                      : std::string(),
      r.problems.empty() ? "sound" : absl::StrCat(r.problems.size(), " damaged"));
  return r.problems.empty() ? 0 : 1;
}

}  // namespace

int RunCheckpoint(const std::vector<std::string>& argv) {
  auto a = Args::Parse(argv, {"o", "output"}, {"help", "with-optimizer-state"});
  if (!a.ok()) {
    std::cerr << "error: " << a.status().message() << "\n" << kUsage;
    return 2;
  }
  if (a->Bool("help")) {
    std::cout << kUsage;
    return 0;
  }
  if (a->positional().size() != 2) {
    // Which: the usage alone left the reader to find it.
    std::cerr << "error: hapctl checkpoint: "
              << (a->positional().empty() ? std::string("no command (inspect, export, verify)")
                  : a->positional().size() == 1
                      ? std::string("no checkpoint DIR")
                      : absl::StrCat("unexpected argument '", a->positional()[2], "'"))
              << "\n"
              << kUsage;
    return 2;
  }
  const std::string& verb = a->positional()[0];
  // A flag another command takes was dropped ('verify DIR -o json' printed
  // the table, 'inspect --with-optimizer-state' ignored it).
  if (verb == "verify" && (a->Has("o") || a->Has("output"))) {
    return Fail(absl::InvalidArgumentError("checkpoint verify has no -o: it prints its report"));
  }
  if (verb != "export" && a->Has("with-optimizer-state")) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--with-optimizer-state is export's; checkpoint ", verb, " reads every tensor")));
  }
  if (verb == "inspect") return Inspect(*a);
  if (verb == "export") return Export(*a);
  if (verb == "verify") return Verify(*a);
  std::cerr << "error: unknown checkpoint command '" << verb << "'\n" << kUsage;
  return 2;
}

}  // namespace hap::tools
