#!/usr/bin/env bash
# The main job, with embedded defaults: set-up, build, the model zoo, and a
# synthesized plan for the GPT-style LM on a heterogeneous 2-node cluster
# against the baselines. Options: --model NAME, --cluster FILE.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=gpt
CLUSTER=planner/examples/mixed-2node.json
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --cluster) CLUSTER=$2; shift 2 ;;
    -h|--help) echo "usage: scripts/demo.sh [--model NAME] [--cluster FILE.json]"; exit 0 ;;
    *) echo "demo: unknown option $1" >&2; exit 1 ;;
  esac
done

bash scripts/setup.sh
bazel build //tools:hapctl >/dev/null 2>&1 || bazel build //tools:hapctl
HAPCTL="$(bazel info bazel-bin 2>/dev/null)/tools/hapctl"

echo "== The model zoo (paper defaults: 12 layers, hidden 768, batch 32 x 8 devices) =="
"$HAPCTL" zoo
echo
echo "== Synthesized plan: $MODEL on $CLUSTER =="
plan=$("$HAPCTL" plan --model "$MODEL" --cluster "$CLUSTER")
echo "$plan" | sed -n '1,20p'
echo "   (full per-op table: $HAPCTL plan --model $MODEL --cluster $CLUSTER)"
echo
echo "== Predicted step time against the baselines (same cost model) =="
hap=$("$HAPCTL" plan --model "$MODEL" --cluster "$CLUSTER" -o json | awk -F': ' '/"predicted_step_seconds"/ {gsub(",","",$2); print $2}')
printf "%-10s %10.4f s\n" hap "$hap"
for b in dp-even dp-prop zero3 megatron; do
  if out=$("$HAPCTL" plan --model "$MODEL" --cluster "$CLUSTER" --baseline "$b" -o json 2>&1); then
    t=$(echo "$out" | awk -F': ' '/"predicted_step_seconds"/ {gsub(",","",$2); print $2}')
    printf "%-10s %10.4f s   (hap is %.2fx faster)\n" "$b" "$t" "$(awk -v a="$t" -v b="$hap" 'BEGIN {print a / b}')"
  else
    printf "%-10s %s\n" "$b" "$(echo "$out" | head -1)"
  fi
done
