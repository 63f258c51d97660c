#!/usr/bin/env bash
# The CUDA backend on a real GPU, in one go (docs/design.md §10): at most about
# 8 minutes on one GPU, most of it the build when Bazel's cache is cold.
#
#   bash scripts/gpu-check.sh        (from anywhere; it works in the repo root)
#
# Needs: an NVIDIA GPU with its driver, CUDA + NCCL at ${HAP_CUDA_PATH:-/usr/local/cuda},
# Bazel and python3. No network: the build is offline (system libraries).
#
#   1. build   --config=cuda, nvcc narrowed to this machine's GPU architecture
#              (nvidia-smi compute_cap; --define=hap_cuda_archs=90 on an H100/H200)
#   2. tests   //executor/cuda: kernels_a_test and kernels_b_test (every CUDA
#              kernel against the CPU backend), cuda_device_test,
#              nccl_communicator_test (multi-rank cases need one GPU per rank;
#              on one GPU they skip and say why), gpu_training_test (training
#              steps of the GPT-style LM and an MLP on the GPU equal to the CPU
#              backend), bf16_test (bf16 mixed-precision linear/matmul/conv2d on
#              the GPU equal to the CPU's); tests not in this build yet are
#              reported as missing
#   3. GEMM    our `linear` kernel against cublasSgemm and cublasGemmEx (TF32,
#              and bf16 as the GPU's dense peak; our bf16 linear against that
#              peak), cudaEvents after warm-up (bench/gpu_bench.cc)
#   4. step    the GPT-style LM's training step on the GPU (median of 10
#              after 2 warm-up steps, SGD with momentum), ours against
#              PyTorch on the same GPU when python3 has torch with CUDA
#              ("PyTorch with CUDA not available: skipped" otherwise); also
#              in bf16 mixed precision (--precision bf16: ours against
#              PyTorch's bf16 autocast)
#
# Output: each step's log under $LOGS (default $OUT/gpu-check-logs when $OUT is
# set, else /tmp/hap-gpu-check-PID); a short Markdown table printed last and
# written to $OUT/gpu-check.md when $OUT is set.
#
# Exit status: 0 when every check passed; 1 when the build, a test or a
# benchmark failed (or no Bazel); 0 with the one line "no GPU: nothing run"
# when no GPU is visible (no nvidia-smi, or it lists none), so that machines
# without a GPU are not failures. On Ctrl-C or SIGTERM the tests it runs in
# the background (from a bundle) are stopped by pid, and the unpacked bundle
# removed, as at any exit.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "no GPU: nothing run"
  exit 0
fi

START=$SECONDS
BUDGET=${HAP_GPU_CHECK_BUDGET:-470}  # seconds; later steps are skipped past it
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  LOGS=${LOGS:-$OUT/gpu-check-logs}
else
  LOGS=${LOGS:-/tmp/hap-gpu-check-$$}
fi
mkdir -p "$LOGS"
ROWS="$LOGS/rows.tsv"  # check <TAB> result <TAB> detail
: > "$ROWS"
FAILED=0
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$ROWS"; }
left() { echo $((BUDGET - (SECONDS - START))); }
# A timeout for the next step: what is left, but never 0 (timeout 0 = none).
limit() { local l=$(( $(left) < $1 ? $(left) : $1 )); echo $(( l < 5 ? 5 : l )); }
say() { echo "gpu-check [$((SECONDS - START))s]: $*"; }

PY=$(command -v python3 || echo /usr/bin/python3)
# NCCL's bootstrap sockets on loopback (one machine; nothing else is needed).
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
BAZEL=$(command -v bazel || command -v bazelisk || true)
# Without Bazel (or with $HAP_GPU_BUNDLE set), a bundle made elsewhere by
# scripts/gpu-bundle.sh (the same programs, prebuilt, with the libraries they
# need; default .gpu) is run instead of building.
BUNDLE=${HAP_GPU_BUNDLE:-.gpu}
USE_BUNDLE=0
if { [ -z "$BAZEL" ] || [ -n "${HAP_GPU_BUNDLE:-}" ]; } && { [ -f "$BUNDLE/bundle.tar.xz" ] || [ -d "$BUNDLE/bin" ]; }; then
  USE_BUNDLE=1
fi
CUDA_PATH=${HAP_CUDA_PATH:-/usr/local/cuda}
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
GPUS=$(nvidia-smi -L | grep -c '^GPU')
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
ARCHS=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d ' .' | sort -u | paste -sd, -)
NVCC_VERSION=$("$CUDA_PATH/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
NCCL_VERSION=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' \
  "$CUDA_PATH/include/nccl.h" 2>/dev/null | paste -sd. -)
HEADER="GPU check: $GPUS x $GPU_NAME (sm_$ARCHS), driver $DRIVER, CUDA ${NVCC_VERSION:-?}, NCCL ${NCCL_VERSION:-?}, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "$HEADER"

finish() {
  local table="$LOGS/gpu-check.md"
  {
    echo "## $HEADER"
    echo
    echo "| check | result | detail |"
    echo "|---|---|---|"
    while IFS=$'\t' read -r check result detail; do
      echo "| $check | $result | $detail |"
    done < "$ROWS"
    echo
    echo "Total $((SECONDS - START)) s; logs in $LOGS."
  } > "$table"
  [ -n "${OUT:-}" ] && cp "$table" "$OUT/gpu-check.md"
  echo
  cat "$table"
  exit "$FAILED"
}

# Gathers a test's gtest counts into a row: $1 name, $2 status, $3.. logs
# (each one argument: $LOGS may hold spaces).
test_row() {
  local name=$1 status=$2
  shift 2
  local logs=("$@") ok=0 bad=0 skipped=0 why=""
  if [ ${#logs[@]} -gt 0 ]; then
    ok=$(cat -- "${logs[@]}" | grep -cE '^\[       OK \] .*\([0-9]+ ms\)')
    bad=$(cat -- "${logs[@]}" | grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)')
    skipped=$(cat -- "${logs[@]}" | grep -cE '^\[  SKIPPED \] .*\([0-9]+ ms\)')
    why=$(cat -- "${logs[@]}" | grep -A1 ': Skipped$' | grep -vE ': Skipped$|^--$' | sort | uniq -c | sort -rn | head -2 | sed 's/^ *//' | paste -sd';' - | cut -c1-200 | tr '|' '/')
  fi
  local detail="$ok passed, $bad failed, $skipped skipped"
  [ -n "$why" ] && detail="$detail (skips: $why)"
  if [ "$bad" -gt 0 ] && [ ${#logs[@]} -gt 0 ]; then
    detail="$detail; failed: $(cat -- "${logs[@]}" | grep -E '^\[  FAILED  \] .*\([0-9]+ ms\)' | sed 's/^\[  FAILED  \] //; s/ ([0-9]* ms)//' | head -6 | paste -sd' ' - | cut -c1-300 | tr '|' '/')"
  fi
  if [ "$name" = gpu_training_test ] && [ ${#logs[@]} -gt 0 ]; then
    local last
    last=$(cat -- "${logs[@]}" | grep -E '^gpt_adamw_dropout step [0-9]+ loss' | tail -1)
    [ -n "$last" ] && detail="$detail; $last"
  fi
  if [ "$status" = PASSED ]; then
    if [ "$ok" -eq 0 ]; then
      row "$name" "PASS (all skipped)" "$detail"
    else
      row "$name" "PASS" "$detail"
    fi
  else
    row "$name" "FAIL" "${status:-no result} - $detail; see $name.*.log"
    FAILED=1
  fi
}

# What runs in the background (a bundle's tests, each under `timeout`, which
# passes a signal on to its test) and the unpacked bundle: stopped and
# removed at any exit. `timeout` leads a process group of its own, so a
# terminal's Ctrl-C reaches it only through here.
BACKGROUND=()
UNPACKED=""
on_exit() {
  local p
  for p in "${BACKGROUND[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${BACKGROUND[@]}"; do wait "$p" 2>/dev/null || true; done
  [ -z "$UNPACKED" ] || rm -rf "$UNPACKED"
}
trap on_exit EXIT
trap 'echo "gpu-check: interrupted; stopping what it started" >&2; exit 130' INT TERM

if [ "$USE_BUNDLE" = 1 ]; then
  # --- 1+2 from a bundle: no build; every CUDA test binary, run directly ----
  B=$BUNDLE
  if [ -f "$BUNDLE/bundle.tar.xz" ]; then
    UNPACKED=$(mktemp -d "${TMPDIR:-/tmp}/hap-gpu-bundle.XXXXXX")
    B=$UNPACKED
    if ! err=$(tar -C "$B" -xJf "$BUNDLE/bundle.tar.xz" 2>&1); then
      row "bundle (scripts/gpu-bundle.sh)" "FAIL" "cannot unpack $BUNDLE/bundle.tar.xz: $(echo "$err" | head -1 | cut -c1-160 | tr '|' '/')"
      FAILED=1
      finish
    fi
  fi
  if [ ! -f "$B/tests.txt" ] || [ ! -d "$B/bin" ]; then
    row "bundle (scripts/gpu-bundle.sh)" "FAIL" "no tests.txt or bin/ in $B"
    FAILED=1
    finish
  fi
  # CUDA's libraries from this machine: the toolkit's, else Python's nvidia-* packages.
  CUDA_DIRS=""
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    f=$(find "$CUDA_PATH/lib64/" "$CUDA_PATH/targets/x86_64-linux/lib/" -maxdepth 1 -name "$lib" 2>/dev/null | head -1)
    [ -z "$f" ] && f=$("$PY" -c 'import site, sys; print("\n".join(site.getsitepackages()))' 2>/dev/null |
      while read -r d; do find "$d/nvidia" -name "$lib" 2>/dev/null; done | head -1)
    [ -n "$f" ] && ! grep -q ":$(dirname "$f")\(:\|$\)" <<< "$CUDA_DIRS" && CUDA_DIRS="$CUDA_DIRS:$(dirname "$f")"
  done
  export LD_LIBRARY_PATH="$B/lib$CUDA_DIRS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "bundle from commit $(paste -sd' ' "$B/commit.txt" 2>/dev/null); LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  missing=$(for b in "$B"/bin/*; do ldd "$b" | grep 'not found'; done | awk '{print $1}' | sort -u | paste -sd' ' -)
  if [ -n "$missing" ]; then
    row "bundle (scripts/gpu-bundle.sh)" "FAIL" "libraries not found: $missing"
    FAILED=1
    finish
  fi
  row "bundle (scripts/gpu-bundle.sh)" "PASS" "commit $(paste -sd' ' "$B/commit.txt" 2>/dev/null), built elsewhere for .bazelrc's archs"
  say "testing $(paste -sd' ' "$B/tests.txt")"
  t0=$SECONDS
  test_limit=$(( $(left) - 150 > 120 ? $(left) - 150 : 120 ))
  pids=()
  while read -r name; do
    timeout "$test_limit" "$B/bin/$name" > "$LOGS/$name.log" 2>&1 &
    pids+=("$!:$name")
    BACKGROUND+=("$!")
  done < "$B/tests.txt"
  for p in "${pids[@]}"; do
    wait "${p%%:*}"
    rc=$?
    name=${p#*:}
    status=PASSED
    [ $rc -eq 124 ] && status=TIMEOUT
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="FAILED (rc $rc)"
    test_row "$name" "$status" "$LOGS/$name.log"
  done
  BACKGROUND=()
  say "tests done in $((SECONDS - t0)) s"
  GPU_BENCH=$B/bin/gpu_bench
  HAPCTL=$B/bin/hapctl
  LAUNCH=$B/bin/hap-launch
  EXECUTOR=$B/bin/hap-executor
else
if [ -z "$BAZEL" ]; then
  row "build" "FAIL" "no bazel on PATH and no bundle at $BUNDLE (scripts/gpu-bundle.sh)"
  FAILED=1
  finish
fi

# --- 1. build ---------------------------------------------------------------
FLAGS=(--config=cuda "--define=hap_cuda_archs=$ARCHS" "--jobs=$(nproc)")
WANTED=(kernels_a_test kernels_b_test cuda_device_test nccl_communicator_test gpu_training_test
  bf16_test)
# Only the tests this tree has (another one may not be written yet).
EXISTING=$("$BAZEL" query 'tests(//executor/cuda:all)' 2>"$LOGS/query.log" | sed 's|^//executor/cuda:||')
TESTS=()
for t in "${WANTED[@]}"; do
  if grep -qx "$t" <<< "$EXISTING"; then
    TESTS+=("//executor/cuda:$t")
  else
    row "$t" "MISSING" "no such target in this tree"
    FAILED=1
  fi
done
say "building (${FLAGS[*]})"
b0=$SECONDS
timeout "$(limit 400)" "$BAZEL" build "${FLAGS[@]}" //bench:gpu_bench //executor/cli:hap-executor //executor/cli:hap-launch \
  //tools:hapctl "${TESTS[@]}" > "$LOGS/build.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  row "build (--config=cuda, sm_$ARCHS)" "FAIL" "rc $rc after $((SECONDS - b0)) s; see build.log: $(grep -m1 -E 'error|ERROR' "$LOGS/build.log" | cut -c1-160 | tr '|' '/')"
  FAILED=1
  finish
fi
row "build (--config=cuda, sm_$ARCHS)" "PASS" "$((SECONDS - b0)) s"

# --- 2. tests ---------------------------------------------------------------
if [ ${#TESTS[@]} -gt 0 ] && [ "$(left)" -gt 60 ]; then
  say "testing ${TESTS[*]}"
  t0=$SECONDS
  test_limit=$(( $(left) - 150 > 120 ? $(left) - 150 : 120 ))  # time left for the benchmarks
  timeout "$((test_limit + 30))" "$BAZEL" test "${FLAGS[@]}" --test_timeout="$test_limit" \
    --local_test_jobs=4 --test_output=errors --nocache_test_results "${TESTS[@]}" > "$LOGS/test.log" 2>&1
  say "tests done in $((SECONDS - t0)) s"
  for t in "${TESTS[@]}"; do
    name=${t#//executor/cuda:}
    status=$(grep -E "^$t +" "$LOGS/test.log" | grep -oE 'PASSED|FAILED TO BUILD|FAILED|TIMEOUT|NO STATUS|SKIPPED' | head -1)
    mapfile -t logs < <(find "bazel-testlogs/executor/cuda/$name" -name test.log 2>/dev/null)
    for l in "${logs[@]}"; do cp "$l" "$LOGS/$name.$(basename "$(dirname "$l")").log"; done
    test_row "$name" "$status" "${logs[@]}"
  done
else
  row "tests" "NOT RUN" "out of time ($(left) s left)"
  FAILED=1
fi

GPU_BENCH=bazel-bin/bench/gpu_bench
HAPCTL=bazel-bin/tools/hapctl
LAUNCH=bazel-bin/executor/cli/hap-launch
EXECUTOR=bazel-bin/executor/cli/hap-executor
fi

# --- 2b. the executor binaries end to end -----------------------------------
# A 2-GPU cluster profile, a plan of the GPT-style LM for it (hapctl), then
# hap-launch with no --device (each rank on the plan's GPU, NCCL) and with
# --device cpu (Gloo): the same losses within 1e-3. The planner plans for 2
# or more devices and NCCL needs a GPU per rank, so one GPU is not enough.
CLI_CHECK="hap-executor: the plan's GPUs vs --device cpu"
if [ "$GPUS" -lt 2 ]; then
  row "$CLI_CHECK" "SKIPPED" "needs 2 GPUs (plans have 2 or more ranks; NCCL needs one GPU per rank); gpu_training_test covers the same backend factory on one GPU"
elif [ "$(left)" -gt 60 ]; then
  say "hap-launch: the plan's GPUs against --device cpu"
  dev() {
    echo "{\"id\": \"gpu$1\", \"kind\": \"GPU\", \"model\": \"$GPU_NAME\", \"flops\": [{\"dtype\": \"FLOAT32\", \"flops\": 5e13}], \"memoryBytes\": \"100000000000\", \"launchOverheadSeconds\": 5e-06, \"node\": \"local\", \"localIndex\": $1}"
  }
  cat > "$LOGS/two-gpus.json" <<JSON
{"nodes": [{"name": "local", "devices": [$(dev 0), $(dev 1)]}],
 "defaults": {"intraNodeBandwidthBytesPerSecond": 1e11, "intraNodeLatencySeconds": 1e-05,
  "interNodeBandwidthBytesPerSecond": 1e10, "interNodeLatencySeconds": 5e-05}}
JSON
  cli="FAIL"$'\t'"hapctl plan failed (hapctl-plan.log)"
  if timeout "$(limit 60)" "$HAPCTL" plan --cluster "$LOGS/two-gpus.json" --model gpt \
      --layers 2 --hidden 64 --heads 4 --ffn 256 --seq 32 --vocab 211 --batch 8 \
      --save-plan "$LOGS/gpt-2gpus.pb" > "$LOGS/hapctl-plan.log" 2>&1; then
    for d in plan cpu; do
      extra=()
      [ "$d" = cpu ] && extra=(--device cpu)
      timeout "$(limit 60)" "$LAUNCH" --plan "$LOGS/gpt-2gpus.pb" \
        --executor "$EXECUTOR" --steps 5 "${extra[@]}" \
        > "$LOGS/cli-$d.log" 2>&1
      echo "rc=$?" >> "$LOGS/cli-$d.log"
    done
    cli=$("$PY" - "$LOGS/cli-plan.log" "$LOGS/cli-cpu.log" <<'EOF'
import re, sys
def read(path):
    text = open(path).read()
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)", text, re.M)]
    device = re.search(r"steps, rank 0 on (\S+)", text)
    return losses, device.group(1) if device else "?", "rc=0" in text
g, gdev, gok = read(sys.argv[1])
c, cdev, cok = read(sys.argv[2])
ok = (gok and cok and gdev.startswith("cuda") and cdev == "cpu" and len(g) == len(c) == 5 and
      all(abs(a - b) <= 1e-3 * abs(b) + 1e-5 for a, b in zip(g, c)))
worst = max((abs(a - b) / abs(b) for a, b in zip(g, c)), default=float("nan"))
print(("PASS" if ok else "FAIL") + "\t" +
      f"rank 0 by default on {gdev}: last loss {g[-1] if g else '?'}; on {cdev}: "
      f"{c[-1] if c else '?'} (worst relative difference {worst:.1e})")
EOF
)
  fi
  if [[ "$cli" == PASS* ]]; then
    row "$CLI_CHECK" "PASS" "${cli#*$'\t'}"
  else
    row "$CLI_CHECK" "FAIL" "${cli#*$'\t'}; see cli-*.log"
    FAILED=1
  fi
fi

# --- 3. GEMM ----------------------------------------------------------------
if [ "$(left)" -gt 40 ]; then
  say "GEMM: linear against cuBLAS"
  timeout "$(limit 90)" "$GPU_BENCH" gemm --iters 20 \
    > "$LOGS/gemm.jsonl" 2> "$LOGS/gemm.err"
  rc=$?
  if [ $rc -ne 0 ]; then
    row "GEMM" "FAIL" "rc $rc: $(head -c 200 "$LOGS/gemm.err" | tr '\n|' ' /')"
    FAILED=1
  fi
  "$PY" - "$LOGS/gemm.jsonl" >> "$ROWS" <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
        shape, kind, tflops = r["shape"], r["kind"], float(r["tflops"])
    except (ValueError, TypeError, KeyError):
        continue  # a line that is not one measurement: the row says nan
    rows.setdefault(str(shape), {})[str(kind)] = tflops
if not rows:
    print("GEMM\tFAIL\tno measurement in gpu_bench's output (see gemm.jsonl, gemm.err)")
for shape, k in rows.items():
    def get(name):
        v = k.get(name, float("nan"))
        return v if v > 0 else float("nan")  # 0 TFLOP/s: no ratio to take
    ours, sgemm = get("ours_fp32"), get("cublas_sgemm_fp32")
    ours32, tf32, bf16 = get("ours_tf32"), get("cublas_gemmex_tf32"), get("cublas_gemmex_bf16")
    ours16 = get("ours_bf16")
    print(f"GEMM {shape} (MxNxK) fp32\tours {ours:.1f} TFLOP/s = {ours / sgemm:.0%} of cublasSgemm"
          f"\tcublasSgemm {sgemm:.1f}; TF32: ours {ours32:.1f} vs cublasGemmEx {tf32:.1f}"
          f" ({ours32 / tf32:.0%}); bf16 GemmEx peak {bf16:.1f} TFLOP/s, our bf16 linear"
          f" {ours16:.1f} ({ours16 / bf16:.0%} of it)")
EOF
  tail -1 "$ROWS" | grep -q $'\tFAIL\t' && FAILED=1
else
  row "GEMM" "NOT RUN" "out of time"
fi

# --- 4. training step: ours against PyTorch on the same GPU ------------------
TORCH_PY=""
for p in "$PY" /usr/bin/python3; do
  if "$p" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    TORCH_PY=$p
    break
  fi
done
CONFIGS=(
  "GPT 4 layers, h 512, seq 128, batch 8|--layers 4 --hidden 512 --heads 8 --ffn 2048 --seq 128 --vocab 18328 --batch 8"
  "GPT 12 layers, h 768, seq 512, batch 8|--layers 12 --hidden 768 --heads 12 --ffn 3072 --seq 512 --vocab 18328 --batch 8"
  "GPT 12 layers, h 768, seq 512, batch 8, bf16 (PyTorch: autocast)|--layers 12 --hidden 768 --heads 12 --ffn 3072 --seq 512 --vocab 18328 --batch 8 --precision bf16"
)
i=0
for c in "${CONFIGS[@]}"; do
  i=$((i + 1))
  label=${c%%|*}
  read -r -a params <<< "${c#*|}"
  if [ "$(left)" -lt 30 ]; then
    row "step: $label" "NOT RUN" "out of time"
    continue
  fi
  say "step: $label (ours)"
  timeout "$(limit 90)" "$GPU_BENCH" step --model gpt --steps 10 \
    --warmup 2 "${params[@]}" > "$LOGS/step$i.ours.json" 2> "$LOGS/step$i.ours.err"
  rc=$?
  if [ $rc -ne 0 ]; then
    row "step: $label" "FAIL" "ours: rc $rc: $(head -c 200 "$LOGS/step$i.ours.err" | tr '\n|' ' /')"
    FAILED=1
    continue
  fi
  torch_note="PyTorch with CUDA not available: skipped"
  if [ -n "$TORCH_PY" ] && [ "$(left)" -gt 30 ]; then
    say "step: $label (PyTorch)"
    if timeout "$(limit 90)" "$TORCH_PY" bench/torch_step.py \
      --model gpt --device cuda --steps 10 --warmup 2 "${params[@]}" \
      > "$LOGS/step$i.torch.json" 2> "$LOGS/step$i.torch.err"; then
      torch_note=""
    else
      torch_note="PyTorch failed: $(tail -c 200 "$LOGS/step$i.torch.err" | tr '\n|' ' /')"
    fi
  elif [ -n "$TORCH_PY" ]; then
    torch_note="PyTorch: out of time"
  fi
  "$PY" - "$label" "$LOGS/step$i.ours.json" "$LOGS/step$i.torch.json" "$torch_note" >> "$ROWS" <<'EOF'
import json, os, statistics, sys
label, ours_path, torch_path, note = sys.argv[1:5]


def last_json(path):
    return json.loads(open(path).read().strip().splitlines()[-1])


try:
    ours = last_json(ours_path)
    o = statistics.median(ours["seconds"])
    detail = f"our losses {ours['losses'][0]:.3f} -> {ours['losses'][-1]:.3f}"
    result = f"ours {o * 1e3:.1f} ms"
    if not note and os.path.exists(torch_path):
        torch = last_json(torch_path)
        t = statistics.median(torch["seconds"])
        result += f", PyTorch {t * 1e3:.1f} ms: ours/torch {o / t:.2f}x"
        detail += f", torch {torch['losses'][0]:.3f} -> {torch['losses'][-1]:.3f}"
    else:
        detail += "; " + note
except (OSError, ValueError, KeyError, IndexError) as e:
    result, detail = "FAIL", f"unreadable result: {e}"
print(f"step: {label} (median of 10)\t{result}\t{detail}")
EOF
  tail -1 "$ROWS" | grep -q $'\tFAIL\t' && FAILED=1
done
[ -z "$TORCH_PY" ] && say "PyTorch with CUDA not available: skipped"

# --- 4b. where the last configuration's step goes: each kernel synchronized
# and timed (gpu_bench step --profile 1; slower than the step above).
if [ "$(left)" -gt 30 ]; then
  label=${CONFIGS[-1]%%|*}
  read -r -a params <<< "${CONFIGS[-1]#*|}"
  say "step profile: $label"
  if timeout "$(limit 90)" "$GPU_BENCH" step --model gpt --steps 3 --warmup 1 --profile 1 \
      "${params[@]}" > "$LOGS/step-profile.json" 2> "$LOGS/step-profile.md"; then
    top=$(grep -E '^\| [a-z(]' "$LOGS/step-profile.md" | grep -v '^| kernel' | head -6 |
      awk -F'|' '{gsub(/ /, "", $2); gsub(/ /, "", $4); gsub(/ /, "", $5); printf "%s %s ms (%s); ", $2, $4, $5}')
    total=$(grep -E '^\| total' "$LOGS/step-profile.md" | awk -F'|' '{gsub(/ /, "", $4); print $4}')
    row "step profile: $label" "INFO" "synchronized kernels ${total:-?} ms/step; top: ${top%; }"
  else
    row "step profile: $label" "FAIL" "$(head -c 200 "$LOGS/step-profile.md" | tr '\n|' ' /')"
    FAILED=1
  fi
fi

finish
