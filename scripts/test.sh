#!/usr/bin/env bash
# Runs every test suite: set-up, then `bazel test //...`, then a plain
# "N passed, N failed" line counted over the test cases of every suite.
set -uo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh || { echo "setup failed"; echo "0 passed, 1 failed"; exit 1; }

# CI has 2 cores; keep Bazel's footprint modest.
# Tests that read ../shared/data find it through HAP_DATA_DIR.
# CUDA targets build (and their tests run, skipping without a GPU) where
# nvcc is present; elsewhere they are skipped as incompatible.
CUDA_FLAGS=()
if [ -x "${HAP_CUDA_PATH:-/usr/local/cuda}/bin/nvcc" ]; then
  # Device code for the GPUs this machine has (their tests run), else for
  # sm_75 alone, the oldest .bazelrc lists: a compile check where the CUDA
  # tests skip, at a quarter of nvcc's time for all five (37 s -> 10 s for
  # kernels_elementwise.cu). HAP_CUDA_ARCHS=75,80,... chooses; `bazel build
  # --config=cuda //...` builds .bazelrc's five.
  ARCHS=${HAP_CUDA_ARCHS:-}
  if [ -z "$ARCHS" ] && command -v nvidia-smi > /dev/null; then
    ARCHS=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
      tr -d ' .' | grep -E '^[0-9]+$' | sort -u | paste -sd, -)
  fi
  ARCHS=${ARCHS:-75}
  CUDA_FLAGS=(--config=cuda "--define=hap_cuda_archs=$ARCHS")
  echo "test.sh: nvcc found, building the CUDA targets too (--config=cuda, sm_$ARCHS)"
else
  echo "test.sh: no nvcc at ${HAP_CUDA_PATH:-/usr/local/cuda}; CUDA targets skipped"
fi
# The build event file names this run's test results (cached ones too):
# count_tests.py counts those and not the XML that bazel-testlogs keeps of
# targets since deleted or of shards of an earlier shard_count.
mkdir -p out
rm -f out/bep.json
bazel test //... "${CUDA_FLAGS[@]}" --test_env=HAP_DATA_DIR="$(cd .. && pwd)/shared/data" \
  --build_event_json_file=out/bep.json "$@"
rc=$?

# A short libFuzzer run of each parser target (scripts/fuzz.sh; long runs:
# scripts/fuzz.sh --seconds N). Its cases join the count below.
rm -rf out/fuzz-results
bash scripts/fuzz.sh --smoke --junit out/fuzz-results/test.xml || rc=1

/usr/bin/python3 scripts/count_tests.py --bep out/bep.json out/fuzz-results
count_rc=$?
if [ $rc -ne 0 ] || [ $count_rc -ne 0 ]; then
  exit 1
fi
exit 0
