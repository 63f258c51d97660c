#!/usr/bin/env bash
# libFuzzer targets (tests/fuzz/*_fuzzer.cc) built with Debian's clang 14,
# AddressSanitizer and UndefinedBehaviorSanitizer, seeded from real inputs
# (zoo graphs and a graph with a VALUES initializer, the example clusters, a plan file,
# a checkpoint shard, checkpoints).
#
#   scripts/fuzz.sh [--seconds S] [TARGET ...]   long runs (default 300 s each)
#   scripts/fuzz.sh --smoke [--junit FILE]       a short run of each (scripts/test.sh)
#
# Targets: graph cluster plan safetensors rpc npy checkpoint (default: all). npy:
# training data files (hap-executor --data npy:DIR) opened and read batch by batch.
# checkpoint: checkpoint directories (--resume DIR) opened and read as a resume and
# hapctl checkpoint verify read them, then exported (hapctl checkpoint export) and the file
# read back, seeded with checkpoints hap-launch wrote. rpc: sequences of
# planner requests (nodes, plans, deployments, step metrics, rendezvous) given
# to the core and the deployment manager as the gRPC service gives them. Objects, binaries,
# corpora and crash files go to out/fuzz/ (git ignores out/). A crash leaves
# out/fuzz/crash-* and exits 1; reproduce with out/fuzz/bin/TARGET FILE.
set -uo pipefail
cd "$(dirname "$0")/.."

SECONDS_EACH=300
SMOKE=0
JUNIT=""
TARGETS=()
ALL_TARGETS=(graph cluster plan safetensors rpc npy checkpoint)
while [ $# -gt 0 ]; do
  case "$1" in  # the options that take a value: one must follow
    --seconds|--junit) [ $# -ge 2 ] || { echo "fuzz: $1 needs a value (see --help)" >&2; exit 2; } ;;
  esac
  case "$1" in
    --seconds) SECONDS_EACH=$2; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --junit) JUNIT=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) TARGETS+=("$1"); shift ;;
  esac
done
case "$SECONDS_EACH" in
  ''|*[!0-9]*|0) echo "fuzz: --seconds must be a positive whole number, got '$SECONDS_EACH'" >&2; exit 2 ;;
esac
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${ALL_TARGETS[@]}")
# Every target known before anything is built (a typo after a long run of
# the others was only found then).
for t in "${TARGETS[@]}"; do
  case " ${ALL_TARGETS[*]} " in
    *" $t "*) ;;
    *) echo "fuzz: unknown target $t (targets: ${ALL_TARGETS[*]})" >&2; exit 2 ;;
  esac
done

# Ctrl-C stops the run. libFuzzer catches SIGINT and exits 72, so without
# this trap bash saw its child end normally and went on with the next target.
SEED_TMP=""
trap '[ -z "$SEED_TMP" ] || rm -rf "$SEED_TMP"' EXIT
trap 'echo "fuzz: interrupted" >&2; exit 130' INT TERM

CXX=clang++-14
if ! command -v "$CXX" >/dev/null || [ ! -e /usr/lib/llvm-14/lib/clang/14.0.6/lib/linux/libclang_rt.fuzzer-x86_64.a ]; then
  echo "fuzz: needs clang-14 and libfuzzer-14-dev (scripts/setup.sh installs them)" >&2
  exit 2
fi
# Generated protobuf code and the seed tools come from the Bazel build.
# With nvcc, the same configuration as scripts/test.sh (one analysis cache).
CONFIG=()
if [ -x "${HAP_CUDA_PATH:-/usr/local/cuda}/bin/nvcc" ]; then CONFIG=(--config=cuda); fi
# hap-launch writes the checkpoint target's seeds.
BUILD_TARGETS=(//proto:hap_v1 //tools:hapctl)
case " ${TARGETS[*]} " in *" checkpoint "*) BUILD_TARGETS+=(//executor/cli:hap-launch) ;; esac
bazel build "${BUILD_TARGETS[@]}" "${CONFIG[@]}" >/dev/null 2>&1 ||
  { echo "fuzz: bazel build ${BUILD_TARGETS[*]} failed" >&2; exit 2; }
GEN=bazel-bin/proto
OUT=out/fuzz
mkdir -p "$OUT/obj" "$OUT/bin" "$OUT/corpus"

ABSL=$(grep -o '"-labsl_[a-z0-9_]*"' third_party/BUILD.bazel | tr -d '"' | sort -u | tr '\n' ' ')
FLAGS=(-std=c++17 -O1 -g -fno-omit-frame-pointer -I. -I"$GEN" -Wno-unused-command-line-argument)
SAN=-fsanitize=address,undefined

GRAPH_SRCS=(planner/graph/graph.cc planner/graph/op_registry.cc planner/graph/types.cc
            planner/graph/graph_proto.cc $(ls planner/graph/ops_*.cc))
PROTO_SRCS=($(ls "$GEN"/hap/v1/*.pb.cc | grep -v grpc))
# The planner's library sources (no tests, no mains) for the rpc target.
planner_srcs() {
  # Every source of the core (a file split off a library joins by itself).
  ls planner/graph/*.cc planner/synth/*.cc planner/cost/*.cc planner/ratios/*.cc \
    planner/lower/*.cc planner/pipeline/*.cc planner/calibrate/*.cc planner/service/core/*.cc \
    common/training_checks.cc common/json_struct.cc common/host_port.cc executor/checkpoint/layout.cc |
    grep -v -e '_test\.cc$' -e '_main\.cc$' -e '/test_util\.cc$'
}
declare -A SRCS=(
  [graph]="${GRAPH_SRCS[*]}"
  [cluster]="planner/cost/cluster_model.cc planner/cost/collectives.cc planner/ratios/ratio_lp.cc"
  [plan]="planner/lower/plan_file.cc ${GRAPH_SRCS[*]}"
  [safetensors]="executor/checkpoint/safetensors.cc executor/checkpoint/crc32c.cc executor/checkpoint/file_util.cc planner/graph/types.cc common/json_struct.cc"
  [npy]="executor/data/user_data.cc executor/data/batches.cc planner/graph/zoo.cc ${GRAPH_SRCS[*]}"
  [rpc]="$(planner_srcs | tr '\n' ' ')"
  [checkpoint]="$(ls executor/checkpoint/*.cc | grep -v -e '_test\.cc$' -e '_test_util\.cc$' | tr '\n' ' ')
    executor/runtime/device.cc executor/runtime/program_runner.cc
    executor/runtime/async_collectives.cc executor/runtime/collective_call.cc
    common/json_struct.cc planner/graph/zoo.cc ${GRAPH_SRCS[*]}"
)

# One object per source, rebuilt when the source or any generated protobuf
# header is newer (other headers: rm -r out/fuzz/obj). A message that grew
# fields must not meet objects compiled against its old layout.
NEWEST_PB_H=$(ls -t "$GEN"/hap/v1/*.pb.h | head -1)
object() {
  local src=$1 obj="$OUT/obj/$(echo "$1" | tr '/' '_').o"
  if [ ! -e "$obj" ] || [ "$src" -nt "$obj" ] || [ "$NEWEST_PB_H" -nt "$obj" ]; then
    "$CXX" "${FLAGS[@]}" $SAN -fsanitize=fuzzer-no-link -c "$src" -o "$obj" || return 1
  fi
  echo "$obj"
}

build() {
  local t=$1 objs=() o
  for s in ${SRCS[$t]} "${PROTO_SRCS[@]}"; do
    o=$(object "$s") || { echo "fuzz: compiling $s failed" >&2; return 1; }
    objs+=("$o")
  done
  "$CXX" "${FLAGS[@]}" $SAN -fsanitize=fuzzer "tests/fuzz/${t}_fuzzer.cc" "${objs[@]}" \
    -o "$OUT/bin/$t" -lprotobuf -lglpk -lcrypto -lopenblas $ABSL -lpthread
}

# A graph with a VALUES initializer (runs of listed values: the exporter's
# masks and one-hot constants), which no zoo graph has; added to a corpus
# made before it too.
values_seed() {
  [ -e "$1/values.textpb" ] && return 0
  cat >"$1/values.textpb" <<'PB'
name: "values"
inputs { tensor { name: "x" shape: [ 4, 8 ] dtype: FLOAT32 } role: FEATURES }
inputs { tensor { name: "labels" shape: [ 4 ] dtype: INT64 } role: LABELS }
parameters {
  tensor { name: "const.mask" shape: [ 4, 8 ] dtype: FLOAT32 }
  init { kind: VALUES values: [ 0, -100, 0.5, 0 ] counts: [ 9, 7, 1, 15 ] }
  frozen: true
}
parameters { tensor { name: "w" shape: [ 3, 8 ] dtype: FLOAT32 } init { kind: NORMAL stddev: 0.02 } }
parameters { tensor { name: "b" shape: [ 3 ] dtype: FLOAT32 } }
ops { name: "masked" type: "add" inputs: [ "x", "const.mask" ] outputs: [ "xm" ] }
ops { name: "fc" type: "linear" inputs: [ "xm", "w", "b" ] outputs: [ "logits" ] }
ops { name: "loss" type: "cross_entropy" inputs: [ "logits", "labels" ] outputs: [ "loss" ] }
loss: "loss"
PB
}

seed() {
  local t=$1 dir="$OUT/corpus/$1"
  mkdir -p "$dir"
  [ "$t" = graph ] && values_seed "$dir"
  [ -n "$(ls -A "$dir" 2>/dev/null | grep -v '^values\.textpb$')" ] && return 0
  case "$t" in
    graph)
      for m in mlp gpt vit moe; do
        bazel-bin/tools/hapctl zoo "$m" --layers 1 --export "$dir/$m.json" >/dev/null 2>&1
      done ;;
    cluster) cp planner/examples/*.json "$dir/" ;;
    plan)
      bazel-bin/tools/hapctl plan --cluster planner/examples/cpu-2rank.json --model mlp \
        --save-plan "$dir/mlp.pb" >/dev/null 2>&1 ;;
    rpc)
      # Register a node, plan an MLP on it, list, deploy (to no executor),
      # use the rendezvous store: each call [method][length, 2 bytes][request].
      local tmp; tmp=$(mktemp -d); SEED_TMP=$tmp
      enc() { protoc -Iproto --encode="hap.v1.$1" proto/hap/v1/planner_service.proto >"$tmp/$2"; }
      enc RegisterNodeRequest 0 <<'PB'
node { name: "n" address: "127.0.0.1:1"
  devices { id: "n/cpu0" kind: CPU flops { dtype: FLOAT32 flops: 1e12 } memory_bytes: 8000000000 }
  devices { id: "n/cpu1" kind: CPU flops { dtype: FLOAT32 flops: 2e12 } memory_bytes: 8000000000 } }
PB
      enc CreatePlanRequest 6 <<'PB'
model { zoo { name: "mlp" params { key: "layers" value: 2 } params { key: "hidden" value: 16 } } }
plan_id: "p" wait: true
PB
      enc ListPlansRequest 8 <<<'page_size: 5'
      enc DeployPlanRequest 11 <<<'plan: "plans/p" executors { key: "n/cpu0" value: "127.0.0.1:1" } executors { key: "n/cpu1" value: "127.0.0.1:1" }'
      enc StoreSetRequest 17 <<<'deployment: "deployments/p-g1" generation: 1 key: "k" value: "v"'
      enc StoreAddRequest 19 <<<'deployment: "deployments/p-g1" generation: 1 key: "c" delta: 3'
      python3 - "$tmp" "$dir/sequence" <<'PY'
import os, struct, sys
tmp, out = sys.argv[1], sys.argv[2]
with open(out, "wb") as f:
    for m in (0, 6, 8, 11, 17, 19, 8):
        b = open(os.path.join(tmp, str(m)), "rb").read()
        f.write(struct.pack("<BH", m, len(b)) + b)
PY
      rm -r "$tmp"; SEED_TMP="" ;;
    npy)
      # The fuzzer's own valid files, each behind the byte that picks it.
      python3 - "$dir" <<'PY'
import struct, sys
def npy(descr, shape, data):
    h = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)
    h += " " * ((64 - (10 + len(h) + 1) % 64) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + data
x = npy("<f4", "(8, 3)", struct.pack("<24f", *[0.25 * i for i in range(24)]))
y = npy("<i8", "(8,)", struct.pack("<8q", *[i % 5 for i in range(8)]))
open(sys.argv[1] + "/x", "wb").write(b"\x00" + x)
open(sys.argv[1] + "/labels", "wb").write(b"\x01" + y)
PY
      ;;
    checkpoint)
      # Checkpoints hap-launch wrote after one step of the fuzzer's MLP
      # (ZeRO-3 with Adam: slices in both shards; data parallel with
      # momentum: replicated tensors), each directory's files framed as the
      # fuzzer reads them: [flags][name length][name][4-byte size][bytes]...
      local tmp; tmp=$(mktemp -d); SEED_TMP=$tmp
      local mlp=(--model mlp --layers 1 --hidden 4 --input 3 --classes 5 --batch 4)
      local plan base
      for plan in zero3:adam dp-even:momentum; do
        base=${plan%:*}
        bazel-bin/tools/hapctl plan --cluster planner/examples/cpu-2rank.json "${mlp[@]}" \
          --baseline "$base" --optimizer "${plan#*:}" --save-plan "$tmp/$base.pb" >/dev/null 2>&1 &&
          bazel-bin/executor/cli/hap-launch --plan "$tmp/$base.pb" --steps 1 \
            --checkpoint-dir "$tmp/$base" >/dev/null 2>&1 ||
          echo "fuzz: cannot write the checkpoint seed $base (hapctl plan, hap-launch)" >&2
      done
      python3 - "$tmp" "$dir" <<'PY'
import os, struct, sys
tmp, out = sys.argv[1], sys.argv[2]
for run in sorted(os.listdir(tmp)):
    if not os.path.isdir(os.path.join(tmp, run)):
        continue
    framed = b"\x00"
    for step in sorted(os.listdir(os.path.join(tmp, run))):
        for name in sorted(os.listdir(os.path.join(tmp, run, step))):
            path = "%s/%s" % (step, name)
            data = open(os.path.join(tmp, run, path), "rb").read()
            framed += struct.pack("<B", len(path)) + path.encode() + struct.pack("<I", len(data)) + data
    open(os.path.join(out, run), "wb").write(framed)
PY
      rm -r "$tmp"; SEED_TMP="" ;;
    safetensors)
      # A small hand-made file: one F32 [2] tensor.
      printf '\x38\x00\x00\x00\x00\x00\x00\x00{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}\x00\x00\x80\x3f\x00\x00\x00\x40' \
        >"$dir/one.safetensors" ;;
  esac
}

failed=0
cases=""
for t in "${TARGETS[@]}"; do
  [ -n "${SRCS[$t]:-}" ] || { echo "fuzz: unknown target $t" >&2; exit 2; }
  start=$(date +%s)
  if ! build "$t"; then
    failed=$((failed + 1)); cases+="<testcase classname=\"fuzz\" name=\"$t\"><failure message=\"build failed\"/></testcase>"
    continue
  fi
  seed "$t"
  if [ "$SMOKE" = 1 ]; then budget=(-runs=20000 -max_total_time=30); else budget=(-max_total_time="$SECONDS_EACH"); fi
  # An UndefinedBehaviorSanitizer report is a finding, as ASan's are: by
  # default UBSan prints it and goes on, and libFuzzer saw a clean run.
  if UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1} "$OUT/bin/$t" "${budget[@]}" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$OUT/crash-$t-" "$OUT/corpus/$t" >"$OUT/$t.log" 2>&1; then
    echo "fuzz: $t ok ($(grep -o 'Done [0-9]* runs' "$OUT/$t.log" | tail -1), $(( $(date +%s) - start )) s)"
    cases+="<testcase classname=\"fuzz\" name=\"$t\"/>"
  else
    failed=$((failed + 1))
    echo "fuzz: $t FAILED; see $OUT/$t.log and $OUT/crash-$t-*" >&2
    tail -30 "$OUT/$t.log" >&2
    cases+="<testcase classname=\"fuzz\" name=\"$t\"><failure message=\"crash\"/></testcase>"
  fi
done
if [ -n "$JUNIT" ]; then
  mkdir -p "$(dirname "$JUNIT")"
  echo "<?xml version=\"1.0\"?><testsuites><testsuite name=\"fuzz\">$cases</testsuite></testsuites>" >"$JUNIT"
fi
[ "$failed" = 0 ]
