#!/usr/bin/env bash
# The main job, with embedded defaults: set-up, build, the model zoo, a
# synthesized plan for the GPT-style LM on a heterogeneous 2-node cluster
# against the baselines, and real training: a small GPT planned for this
# machine as 2 CPU ranks, run by hap-launch on WikiText-2 over Gloo.
# Options: --model NAME, --cluster FILE, --steps N (training steps), --with-prometheus
# (also a planner and Debian's Prometheus on 127.0.0.1 with deploy/prometheus/).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=gpt
CLUSTER=planner/examples/mixed-2node.json
STEPS=60
WITH_PROMETHEUS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --cluster) CLUSTER=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --with-prometheus) WITH_PROMETHEUS=1; shift ;;
    -h|--help) echo "usage: scripts/demo.sh [--model NAME] [--cluster FILE.json] [--steps N] [--with-prometheus]"; exit 0 ;;
    *) echo "demo: unknown option $1" >&2; exit 1 ;;
  esac
done

bash scripts/setup.sh
TARGETS=(//tools:hapctl //executor/cli:hap-executor //executor/cli:hap-launch)
bazel build "${TARGETS[@]}" >/dev/null 2>&1 || bazel build "${TARGETS[@]}"
BIN="$(bazel info bazel-bin 2>/dev/null)"
HAPCTL="$BIN/tools/hapctl"

if [ "$WITH_PROMETHEUS" = 1 ]; then
  # A planner exporting /metrics on 127.0.0.1:9464 (the address deploy/prometheus/prometheus.yml
  # scrapes) and Prometheus on 127.0.0.1:9090 with that configuration and its alerting rules;
  # both get temporary state and are stopped by pid when the demo exits.
  bazel build //planner/service:hap-planner >/dev/null 2>&1 || bazel build //planner/service:hap-planner
  OBS_DIR=$(mktemp -d /tmp/hap-demo-prometheus.XXXXXX)
  OBS_PIDS=()
  stop_observability() {
    for pid in "${OBS_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${OBS_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$OBS_DIR"
  }
  trap stop_observability EXIT
  "$BIN/planner/service/hap-planner" --listen 127.0.0.1:7070 --metrics-listen 127.0.0.1:9464 \
    --database "$OBS_DIR/planner.db" >"$OBS_DIR/planner.log" 2>&1 &
  OBS_PIDS+=($!)
  /usr/bin/prometheus --config.file=deploy/prometheus/prometheus.yml \
    --storage.tsdb.path="$OBS_DIR/prometheus" --web.listen-address=127.0.0.1:9090 \
    >"$OBS_DIR/prometheus.log" 2>&1 &
  OBS_PIDS+=($!)
  ready=0
  for _ in $(seq 50); do
    curl -sf http://127.0.0.1:9090/-/ready >/dev/null 2>&1 && { ready=1; break; }
    sleep 0.2
  done
  echo "== Observability =="
  [ "$ready" = 1 ] || echo "   WARNING: Prometheus is not ready yet; see $OBS_DIR/prometheus.log"
  echo "   planner gRPC 127.0.0.1:7070, metrics http://127.0.0.1:9464/metrics (log $OBS_DIR/planner.log)"
  echo "   Prometheus http://127.0.0.1:9090 (targets: /targets, alerts: /alerts; log $OBS_DIR/prometheus.log)"
  echo "   try: $HAPCTL get nodes; Grafana: deploy/grafana/ (deploy/README.md)"
  echo
fi

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

if [ "$WITH_PROMETHEUS" = 1 ] && [ -t 0 ]; then
  read -r -p "Prometheus and the planner keep running; press Enter to stop them. " _
fi
