#!/usr/bin/env bash
# scripts/gpu-check.sh from a bundle, on no GPU: a fake nvidia-smi and a
# bundle of fake test programs (gtest-style output). Checks that the tests'
# counts reach the table when $OUT holds a space, that a packed bundle is
# unpacked into a folder of its own that is removed at the end, and that
# SIGTERM stops the bundle's tests running in the background, and that
# the GEMM table skips output lines that are not one measurement.
#   gpu_check_test.sh PATH/TO/gpu-check.sh
set -uo pipefail
SCRIPT=$(realpath "$1")
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/gpu-check-test.XXXXXX")
FAILS=0
fail() { echo "FAIL: $*"; FAILS=$((FAILS + 1)); }
cleanup() {
  # Fake tests a broken script left running, by pid.
  if [ -f "$T/pids" ]; then
    while read -r p; do kill -KILL "$p" 2>/dev/null || true; done <"$T/pids"
  fi
  rm -rf "$T"
}
trap cleanup EXIT

# The script from a copy of the repository's layout: it works in the folder
# above its own.
mkdir -p "$T/repo/scripts" "$T/path" "$T/tmp"
cp "$SCRIPT" "$T/repo/scripts/gpu-check.sh"
cat >"$T/path/nvidia-smi" <<'EOF'
#!/bin/sh
case "$*" in
  -L) echo "GPU 0: Fake GPU (UUID: GPU-0)" ;;
  *compute_cap*) echo "9.0" ;;
  *driver_version*) echo "555.55" ;;
  *name*) echo "Fake GPU" ;;
esac
EOF
chmod +x "$T/path/nvidia-smi"
mkdir -p "$T/bundle/bin"
printf 'kernels_a_test\nkernels_b_test\n' >"$T/bundle/tests.txt"
echo "abc1234" >"$T/bundle/commit.txt"
cat >"$T/bundle/bin/kernels_a_test" <<'EOF'
#!/bin/sh
if [ -n "${FAKE_HANG:-}" ]; then echo $$ >>"$FAKE_DIR/pids"; exec sleep 300; fi
echo "[       OK ] Kernels.Add (1 ms)"
echo "[       OK ] Kernels.Mul (2 ms)"
echo "[  SKIPPED ] Kernels.Big (0 ms)"
EOF
cat >"$T/bundle/bin/kernels_b_test" <<'EOF'
#!/bin/sh
if [ -n "${FAKE_HANG:-}" ]; then echo $$ >>"$FAKE_DIR/pids"; exec sleep 300; fi
echo "[       OK ] Kernels.Conv (1 ms)"
echo "[  FAILED  ] Kernels.Softmax (3 ms)"
exit 1
EOF
chmod +x "$T/bundle/bin/"*

# run OUT [ENV...]: the check, with a budget that stops before the benchmarks.
run() {
  local out=$1; shift
  env PATH="$T/path:$PATH" HAP_GPU_BUNDLE="$T/bundle" HAP_GPU_CHECK_BUDGET=20 \
    HAP_CUDA_PATH="$T/no-cuda" TMPDIR="$T/tmp" FAKE_DIR="$T" OUT="$out" "$@" \
    bash "$T/repo/scripts/gpu-check.sh" >"$T/stdout" 2>&1
}

# 1. $OUT with a space: each test's counts in the table; exit 1 (a test failed).
run "$T/out dir"
rc=$?
[ $rc = 1 ] || fail "exit $rc, want 1 (kernels_b_test failed): $(tail -5 "$T/stdout")"
table="$T/out dir/gpu-check.md"
if [ ! -f "$table" ]; then
  fail "no $table"
else
  grep -qF "| kernels_a_test | PASS | 2 passed, 0 failed, 1 skipped |" "$table" ||
    fail "kernels_a_test's row: $(grep kernels_a_test "$table")"
  grep -qF "| kernels_b_test | FAIL | FAILED (rc 1) - 1 passed, 1 failed, 0 skipped; failed: Kernels.Softmax;" "$table" ||
    fail "kernels_b_test's row: $(grep kernels_b_test "$table")"
fi

# 2. A packed bundle: unpacked into TMPDIR, removed at the end.
tar -C "$T/bundle" -cJf "$T/bundle.tar.xz" bin tests.txt commit.txt
mkdir "$T/packed"
mv "$T/bundle.tar.xz" "$T/packed/"
env PATH="$T/path:$PATH" HAP_GPU_BUNDLE="$T/packed" HAP_GPU_CHECK_BUDGET=20 \
  HAP_CUDA_PATH="$T/no-cuda" TMPDIR="$T/tmp" OUT="$T/out2" \
  bash "$T/repo/scripts/gpu-check.sh" >"$T/stdout" 2>&1
grep -qF "| kernels_a_test | PASS | 2 passed, 0 failed, 1 skipped |" "$T/out2/gpu-check.md" 2>/dev/null ||
  fail "packed bundle: kernels_a_test's row: $(tail -5 "$T/stdout")"
# Unpacked in a folder of its own under TMPDIR (not a fixed /tmp path that
# two runs share), and gone afterwards.
grep -qF "LD_LIBRARY_PATH=$T/tmp/hap-gpu-bundle." "$T/stdout" ||
  fail "packed bundle: not unpacked under TMPDIR: $(grep LD_LIBRARY_PATH "$T/stdout")"
left=$(ls -A "$T/tmp")
[ -z "$left" ] || fail "packed bundle: left in TMPDIR: $left"

# 3. SIGTERM while the bundle's tests run: both stopped.
rm -f "$T/pids"
env PATH="$T/path:$PATH" HAP_GPU_BUNDLE="$T/bundle" HAP_GPU_CHECK_BUDGET=20 \
  HAP_CUDA_PATH="$T/no-cuda" TMPDIR="$T/tmp" FAKE_DIR="$T" OUT="$T/out3" FAKE_HANG=1 \
  bash "$T/repo/scripts/gpu-check.sh" >"$T/stdout" 2>&1 &
check=$!  # env execs bash: the check's own pid
started() { [ -f "$T/pids" ] && [ "$(wc -l <"$T/pids")" -ge 2 ]; }
for _ in $(seq 300); do started && break; sleep 0.1; done
started || fail "the fake tests never started: $(tail -5 "$T/stdout")"
kill -TERM "$check"
wait "$check"
rc=$?
[ $rc = 130 ] || fail "SIGTERM: exit $rc, want 130"
# `timeout` passes the signal on; its test may take a moment to go.
gone() { local p; while read -r p; do kill -0 "$p" 2>/dev/null && return 1; done <"$T/pids"; return 0; }
for _ in $(seq 100); do gone && break; sleep 0.1; done
gone || fail "a fake test still runs after SIGTERM: $(cat "$T/pids" | tr '\n' ' ')"

# 4. The GEMM table from gpu_bench's output, lines that are not one
# measurement skipped: a JSON line without a shape or kind, or not an
# object, ended the parser with a traceback and no GEMM row; a 0 TFLOP/s
# baseline divided by zero.
cat >"$T/bundle/bin/gpu_bench" <<'EOF'
#!/bin/sh
[ "$1" = gemm ] || exit 1
echo "warming up"
echo '{"shape": "64x64x64"}'
echo '[1, 2]'
echo '{"shape": "64x64x64", "kind": "ours_fp32", "tflops": 50}'
echo '{"shape": "64x64x64", "kind": "cublas_sgemm_fp32", "tflops": 100}'
echo '{"shape": "64x64x64", "kind": "cublas_gemmex_tf32", "tflops": 0}'
EOF
chmod +x "$T/bundle/bin/gpu_bench"
env PATH="$T/path:$PATH" HAP_GPU_BUNDLE="$T/bundle" HAP_GPU_CHECK_BUDGET=90 \
  HAP_CUDA_PATH="$T/no-cuda" TMPDIR="$T/tmp" OUT="$T/out4" \
  bash "$T/repo/scripts/gpu-check.sh" >"$T/stdout" 2>&1
grep -qF "| GEMM 64x64x64 (MxNxK) fp32 | ours 50.0 TFLOP/s = 50% of cublasSgemm |" "$T/out4/gpu-check.md" 2>/dev/null ||
  fail "GEMM row: $(grep GEMM "$T/out4/gpu-check.md" 2>/dev/null) $(tail -5 "$T/stdout")"
grep -q "Traceback" "$T/stdout" && fail "GEMM parser: $(grep -A3 Traceback "$T/stdout")"

if [ "$FAILS" = 0 ]; then echo "gpu_check_test: all passed"; else echo "gpu_check_test: $FAILS failed"; fi
[ "$FAILS" = 0 ]
