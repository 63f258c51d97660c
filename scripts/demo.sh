#!/usr/bin/env bash
# The main job, with embedded defaults: set-up, build, the model zoo, a
# synthesized plan for the GPT-style LM on a heterogeneous 2-node cluster
# against the baselines, and real training: a small GPT planned for this
# machine as 2 CPU ranks, run by hap-launch on WikiText-2 over Gloo.
# Options: --model NAME, --cluster FILE, --steps N (training steps).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=gpt
CLUSTER=planner/examples/mixed-2node.json
STEPS=60
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --cluster) CLUSTER=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    -h|--help) echo "usage: scripts/demo.sh [--model NAME] [--cluster FILE.json] [--steps N]"; exit 0 ;;
    *) echo "demo: unknown option $1" >&2; exit 1 ;;
  esac
done

bash scripts/setup.sh
TARGETS=(//tools:hapctl //executor/cli:hap-executor //executor/cli:hap-launch)
bazel build "${TARGETS[@]}" >/dev/null 2>&1 || bazel build "${TARGETS[@]}"
BIN="$(bazel info bazel-bin 2>/dev/null)"
HAPCTL="$BIN/tools/hapctl"

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

echo
echo "== Training: a 2-layer GPT on WikiText-2, this machine as 2 CPU ranks (Gloo on 127.0.0.1) =="
PLAN="$(mktemp -d)/gpt-cpu.pb"
"$HAPCTL" plan --cluster planner/examples/cpu-2rank.json --model gpt --layers 2 --hidden 64 \
  --heads 4 --ffn 128 --seq 32 --batch 16 --optimizer adam --lr 3e-3 --clip-norm 1 \
  --save-plan "$PLAN" | sed -n '1,6p'
DATA_DIR="${HAP_DATA_DIR:-$(cd .. && pwd)/shared/data}"
if [ -d "$DATA_DIR/wikitext-2" ]; then
  DATA=(--data wikitext --data-dir "$DATA_DIR")
else
  echo "(WikiText-2 not found in $DATA_DIR: synthetic data)"
  DATA=(--data synthetic)
fi
"$BIN/executor/cli/hap-launch" --plan "$PLAN" --steps "$STEPS" --log-every 10 "${DATA[@]}"
