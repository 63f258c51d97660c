#!/usr/bin/env bash
# The main job: set-up, build, and show the model zoo (parameters and FLOPs)
# and planner output with embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
bazel build //tools:hapctl >/dev/null 2>&1 || bazel build //tools:hapctl

echo "== The model zoo (paper defaults: 12 layers, hidden 768, batch 32 x 8 devices) =="
./bazel-bin/tools/hapctl zoo
