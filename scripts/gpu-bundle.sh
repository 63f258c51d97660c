#!/usr/bin/env bash
# Packs this machine's CUDA build for a GPU machine that has no Bazel and none
# of our system libraries (gRPC, Abseil, GLPK, Gloo, OpenBLAS), only CUDA and
# NCCL: the CUDA tests, gpu_bench and hapctl, with the shared libraries they
# load (ours and the system's), stripped, packed as FOLDER/bundle.tar.xz
# (about 16 MB; the device tool carries at most 64 MiB). hap-executor and
# hap-launch (38 MB each, every kernel linked in) stay out: their check needs
# two GPUs, and gpu_training_test runs the same backend on one.
#
#   bash scripts/gpu-bundle.sh [FOLDER]      (default .gpu in the repo root)
#
# Then, on the GPU machine, `scripts/gpu-check.sh` finds FOLDER (or
# $HAP_GPU_BUNDLE) and runs the same checks from it instead of building. The
# C library, the C++ runtime and CUDA's own libraries (cudart, cuBLAS,
# cuBLASLt, NCCL: 800 MB) are not packed: the GPU machine's are used, found
# in /usr/local/cuda or in Python's nvidia-* packages (gpu-check.sh looks).
#
# The CUDA code is built for every architecture in .bazelrc's
# hap_cuda_archs (sm_90 for an H100/H200 among them).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu}

# The CUDA tests, and the tests elsewhere that skip without a GPU.
QUERY_LOG=$(mktemp)
if ! CUDA_TESTS=$(bazel query 'tests(//executor/cuda:all)' 2>"$QUERY_LOG"); then
  echo "gpu-bundle: bazel query 'tests(//executor/cuda:all)' failed:" >&2
  tail -5 "$QUERY_LOG" >&2
  rm -f "$QUERY_LOG"
  exit 1
fi
rm -f "$QUERY_LOG"
TESTS="$CUDA_TESTS
//executor/train:backend_test
//profiler_agent:gpu_probe_test
//profiler_agent:devices_test
//profiler_agent:agent_test
//profiler_agent:agent_links_test"
TOOLS="//bench:gpu_bench //tools:hapctl"
# shellcheck disable=SC2086
bazel build --config=cuda $TESTS $TOOLS

rm -rf "$DEST"
mkdir -p "$DEST/bin" "$DEST/lib"
ORIGINALS=()
for t in $TESTS $TOOLS; do
  path=${t#//}
  path=${path/://}
  cp -L "bazel-bin/$path" "$DEST/bin/"
  ORIGINALS+=("bazel-bin/$path")
done
printf '%s\n' $TESTS | sed 's|^//.*:||' > "$DEST/tests.txt"

# Every library the binaries load, except the ones the GPU machine must
# provide itself (its C library and C++ runtime, which are newer than ours,
# and CUDA's, which must match its driver).
KEEP_OUT='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread|libdl\.|librt\.|libstdc\+\+|libgcc_s|libcuda\.|libcudart|libcublas|libnccl)'
# (ldd on the originals: their run path finds our libraries in bazel-bin.)
for b in "${ORIGINALS[@]}"; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name file; do
  if ! grep -qE "$KEEP_OUT" <<< "$name"; then
    cp -L "$file" "$DEST/lib/$name"
  fi
done
chmod u+w "$DEST"/bin/* "$DEST"/lib/*
strip --strip-unneeded "$DEST"/bin/* "$DEST"/lib/* 2>/dev/null || true
git rev-parse --short HEAD > "$DEST/commit.txt"
git diff --quiet HEAD || echo "+ uncommitted changes" >> "$DEST/commit.txt"
n_bin=$(ls "$DEST/bin" | wc -l)
n_lib=$(ls "$DEST/lib" | wc -l)
tar -C "$DEST" -cf - bin lib tests.txt commit.txt | xz -T0 -6 > "$DEST/bundle.tar.xz.tmp"
rm -rf "$DEST/bin" "$DEST/lib" "$DEST/tests.txt" "$DEST/commit.txt"
mv "$DEST/bundle.tar.xz.tmp" "$DEST/bundle.tar.xz"
echo "gpu-bundle: $n_bin programs, $n_lib libraries, $(du -h "$DEST/bundle.tar.xz" | cut -f1) in $DEST/bundle.tar.xz"
