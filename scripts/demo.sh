#!/usr/bin/env bash
# The main job, with embedded defaults. On this machine it builds a
# heterogeneous CPU cluster and trains on it through the services:
#
#   1. set-up and build (scripts/setup.sh, bazel);
#   2. a planner on 127.0.0.1 (free ports), and per rank a cgroup
#      (/sys/fs/cgroup/cpu/hap-demo-PID-rI, cpu.cfs_quota_us = share x period)
#      holding that rank's profiler agent and executor daemon, pinned to one
#      core: the agents measure the devices as they really are (the throttled
#      one measures slower);
#   3. a plan synthesized by the planner for the GPT-style LM from those
#      measurements (ratios, predicted step time), deployed to the executors
#      and trained on WikiText-2: the loss going down, predicted vs. measured
#      step time, the /metrics and /status addresses;
#   4. a checkpoint every third of the run and at the end, in a fresh
#      directory under --checkpoint-dir that the demo leaves behind, and
#      `hapctl checkpoint inspect` of the last one (resume it with
#      hap-launch --resume, or export it with hapctl checkpoint export);
#   5. the same model at paper scale planned offline against the baselines.
#
# Everything it starts is stopped by pid, and its cgroups removed, on exit
# and on Ctrl-C. Without writable cgroups (not root, no cgroup v1 cpu
# controller) it says so and falls back to unthrottled ranks pinned to cores:
# a homogeneous cluster, so the plan is (close to) an even split.
#
# Options (defaults in brackets):
#   --shares F,F[,F,F]  CPU share of each rank, 2-4 values in (0,1] [1,0.4]
#   --steps N           training steps [150]
#   --model NAME        zoo model [gpt]; --layers/--hidden/--heads/--ffn/--seq/--batch
#                       size it [2/64/4/256/32/16]
#   --data wikitext|synthetic [wikitext, from $HAP_DATA_DIR or ../shared/data]
#   --checkpoint-dir DIR  checkpoints go to DIR/run-DATE-TIME-PID [demo-checkpoints]
#   --network SPEC      each rank a node of the network testbed (README "The network
#                       testbed"; root): a network namespace whose links are shaped,
#                       e.g. "between=1gbit pair=0-1:300mbit"; the planner and hapctl
#                       run in its switch namespace. Where namespaces cannot be made
#                       it says why and the ranks talk over loopback.
#   --with-prometheus   also run Debian's Prometheus (127.0.0.1:9090) scraping the
#                       planner's metrics on 127.0.0.1:9464; implies --keep-running
#   --keep-running      leave the cluster up until Enter or Ctrl-C
#   --no-paper-scale    skip step 5
#   --no-setup --bin-dir DIR   use already built binaries (tests)
#
# --elastic: an elastic job instead of steps 3-5 (README "Elastic jobs").
# Three ranks [shares 0.7,1,0.3; 900 steps, a checkpoint every
# --checkpoint-every 50 steps] train as the job `demo`; a third of the way
# in, rank --kill-rank's [1] agent and executor are SIGKILLed: the job
# re-plans onto the other two and resumes from its latest checkpoint. Once
# it trains again the rank is started again (same cgroup, same executor
# port), rejoins, and after --join-stable [5] s the job re-plans onto all
# three at its next checkpoint. It prints the job's timeline, and ends with
# `elastic: job SUCCEEDED; replans N; recovery S s (max); steps lost K`.
# With --throttle SHARE, rank --kill-rank is not killed but throttled: its
# cgroup's quota lowered to SHARE of its core a third of the way in; the job
# sees the slowdown, recalibrates and re-plans when that pays.
set -euo pipefail
cd "$(dirname "$0")/.."

SHARES=1,0.4
STEPS=150
MODEL=gpt
LAYERS=2 HIDDEN=64 HEADS=4 FFN=256 SEQ=32 BATCH=16
DATA=wikitext
NETWORK=""
CHECKPOINTS=demo-checkpoints
WITH_PROMETHEUS=0
KEEP_RUNNING=0
PAPER_SCALE=1
SETUP=1
BIN=""
ELASTIC=0
KILL_RANK=1
THROTTLE=""
JOIN_STABLE=5
EVERY=""
SHARES_SET=0 STEPS_SET=0
PERIOD_US=20000  # cgroup CPU period: 20 ms keeps throttling fine-grained
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in  # the options that take a value: one must follow
    --shares|--steps|--kill-rank|--throttle|--join-stable|--checkpoint-every|--model|--layers|\
    --hidden|--heads|--ffn|--seq|--batch|--data|--network|--checkpoint-dir|--bin-dir)
      [ $# -ge 2 ] || { echo "demo: $1 needs a value (see --help)" >&2; exit 2; } ;;
  esac
  case "$1" in
    --shares) SHARES=$2; SHARES_SET=1; shift 2 ;;
    --steps) STEPS=$2; STEPS_SET=1; shift 2 ;;
    --elastic) ELASTIC=1; shift ;;
    --kill-rank) KILL_RANK=$2; shift 2 ;;
    --throttle) THROTTLE=$2; shift 2 ;;
    --join-stable) JOIN_STABLE=$2; shift 2 ;;
    --checkpoint-every) EVERY=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --layers) LAYERS=$2; shift 2 ;;
    --hidden) HIDDEN=$2; shift 2 ;;
    --heads) HEADS=$2; shift 2 ;;
    --ffn) FFN=$2; shift 2 ;;
    --seq) SEQ=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --network) NETWORK=$2; shift 2 ;;
    --checkpoint-dir) CHECKPOINTS=$2; shift 2 ;;
    --with-prometheus) WITH_PROMETHEUS=1; shift ;;
    --keep-running) KEEP_RUNNING=1; shift ;;
    --no-paper-scale) PAPER_SCALE=0; shift ;;
    --no-setup) SETUP=0; shift ;;
    --bin-dir) BIN=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "demo: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$SETUP" = 1 ] && [ -n "$BIN" ]; then
  # Set-up builds the binaries and runs bazel-bin's: DIR would be ignored.
  echo "demo: --bin-dir needs --no-setup (with set-up it runs what bazel builds)" >&2; exit 2
fi
if [ "$ELASTIC" = 1 ]; then
  [ "$SHARES_SET" = 1 ] || SHARES=0.7,1,0.3
  [ "$STEPS_SET" = 1 ] || STEPS=900
  [ -n "$EVERY" ] || EVERY=50
fi
IFS=, read -r -a SHARE_LIST <<<"$SHARES"
RANKS=${#SHARE_LIST[@]}
if [ "$RANKS" -lt 2 ] || [ "$RANKS" -gt 4 ]; then
  echo "demo: --shares needs 2 to 4 values, got '$SHARES'" >&2; exit 2
fi
for s in "${SHARE_LIST[@]}"; do
  if ! awk -v s="$s" 'BEGIN { exit !(s + 0 > 0 && s + 0 <= 1) }'; then
    echo "demo: every --shares value must be in (0, 1], got '$s'" >&2; exit 2
  fi
done
if [[ " $NETWORK" =~ [[:space:]]nodes= ]]; then
  echo "demo: --network: nodes= is the demo's own (one node per rank, from --shares); give links only" >&2
  exit 2
fi
if ! [[ "$STEPS" =~ ^[0-9]+$ ]] || [ "$((10#$STEPS))" -eq 0 ]; then
  echo "demo: --steps must be a positive integer, got '$STEPS'" >&2; exit 2
fi
if [ "$ELASTIC" = 1 ]; then
  if [ "$RANKS" -lt 3 ]; then
    echo "demo: --elastic needs at least 3 ranks (--shares), got $RANKS" >&2; exit 2
  fi
  case "$KILL_RANK" in ''|*[!0-9]*) echo "demo: --kill-rank must be a rank number" >&2; exit 2 ;; esac
  if [ "$KILL_RANK" -ge "$RANKS" ]; then
    echo "demo: --kill-rank $KILL_RANK: there are ranks 0-$((RANKS - 1))" >&2; exit 2
  fi
  case "$EVERY" in ''|*[!0-9]*|0) echo "demo: --checkpoint-every must be a positive integer" >&2; exit 2 ;; esac
  if [ -n "$THROTTLE" ] && ! awk -v s="$THROTTLE" 'BEGIN { exit !(s + 0 > 0 && s + 0 <= 1) }'; then
    echo "demo: --throttle must be a share in (0, 1], got '$THROTTLE'" >&2; exit 2
  fi
  if ! awk -v s="$JOIN_STABLE" 'BEGIN { exit !(s ~ /^[0-9.]+$/ && s + 0 > 0) }'; then
    echo "demo: --join-stable must be a number of seconds above 0 (the job's 0 means its 30 s default), got '$JOIN_STABLE'" >&2; exit 2
  fi
fi
case "$DATA" in wikitext|synthetic) ;; *) echo "demo: --data must be wikitext or synthetic" >&2; exit 2 ;; esac
# Made now, not once the cluster runs (where a bad one stopped it all).
if ! err=$(mkdir -p -- "$CHECKPOINTS" 2>&1) || ! [ -w "$CHECKPOINTS" ]; then
  echo "demo: --checkpoint-dir $CHECKPOINTS: cannot make it or write in it${err:+ ($err)}" >&2; exit 2
fi

if [ "$SETUP" = 1 ]; then
  bash scripts/setup.sh
  TARGETS=(//tools:hapctl //planner/service:hap-planner //profiler_agent:hap-agent
           //executor/cli:hap-executor //executor/cli:hap-netns)
  bazel build "${TARGETS[@]}" >/dev/null 2>&1 || bazel build "${TARGETS[@]}"
  BIN="$(bazel info bazel-bin 2>/dev/null)"
fi
[ -n "$BIN" ] || { echo "demo: --no-setup needs --bin-dir" >&2; exit 2; }
HAPCTL="$BIN/tools/hapctl"
for b in "$HAPCTL" "$BIN/planner/service/hap-planner" "$BIN/profiler_agent/hap-agent" \
         "$BIN/executor/cli/hap-executor"; do
  [ -x "$b" ] || { echo "demo: missing binary $b" >&2; exit 2; }
done
# The model and its sizes, checked before anything starts (hapctl refused
# them only once the whole cluster was up).
if ! err=$("$HAPCTL" zoo "$MODEL" --layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS" \
             --ffn "$FFN" --seq "$SEQ" --batch "$BATCH" 2>&1 >/dev/null); then
  echo "demo: --model $MODEL --layers $LAYERS --hidden $HIDDEN --heads $HEADS --ffn $FFN" \
       "--seq $SEQ --batch $BATCH: ${err#error: }" >&2
  exit 2
fi

# --- state, processes, clean-up -------------------------------------------
STATE=$(mktemp -d /tmp/hap-demo.XXXXXX)
CGROUP_ROOT=/sys/fs/cgroup/cpu
GROUP_PREFIX="hap-demo-$$"
PIDS=()
GROUPS_MADE=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  # The network testbed: its namespaces, and anything still inside.
  [ -n "${NETNS:-}" ] && "$NETNS" down --owner $$ || true
  for g in "${GROUPS_MADE[@]}"; do
    # A group can only go once its last task is gone.
    for _ in $(seq 50); do rmdir "$g" 2>/dev/null && break; sleep 0.1; done
  done
  rm -rf "$STATE"
}
on_signal() { echo; echo "demo: interrupted, stopping everything it started"; cleanup; exit 130; }
trap cleanup EXIT
trap on_signal INT TERM
echo "$$" >"$STATE/demo.pid"
echo "demo: state in $STATE (removed on exit)"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
json() { python3 -c "import json, sys; d = json.load(sys.stdin); $1"; }

# Starts "$@" in the background, inside cgroup $1 (or none when "-") and
# pinned to core $2 (or none when "-"); output to $3. Appends its pid to PIDS.
start_in() {
  local group=$1 core=$2 log=$3; shift 3
  (
    [ "$group" != - ] && echo "$BASHPID" >"$group/cgroup.procs"
    if [ "$core" != - ] && command -v taskset >/dev/null; then exec taskset -c "$core" "$@"; fi
    exec "$@"
  ) >"$log" 2>&1 &
  PIDS+=($!)
}
wait_line() {  # wait_line LOG PATTERN SECONDS: prints the first matching line
  local i
  for i in $(seq $(($3 * 10))); do
    if grep -m1 -E "$2" "$1" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "demo: timed out waiting for '$2' in $1:" >&2; tail -5 "$1" >&2; return 1
}

# --- the cluster -------------------------------------------------------------
CGROUPS=1
probe="$CGROUP_ROOT/$GROUP_PREFIX-probe"
if ! { mkdir "$probe" && echo "$PERIOD_US" >"$probe/cpu.cfs_period_us"; } 2>"$STATE/cgroup.err"; then
  CGROUPS=0
  echo "demo: cgroups unavailable ($(tr -d '\n' <"$STATE/cgroup.err"));"
  echo "      fallback: ranks run unthrottled, each pinned to a core (a homogeneous cluster)."
fi
rmdir "$probe" 2>/dev/null || true
# Groups left by a demo or hap-launch that was killed outright (SIGKILL
# leaves no chance to clean up): removed when their process is gone and
# they hold no task.
if [ "$CGROUPS" = 1 ]; then
  for g in "$CGROUP_ROOT"/hap-demo-*-* "$CGROUP_ROOT"/hap-launch-*-*; do
    [ -d "$g" ] || continue
    owner=$(basename "$g" | sed -n 's/^hap-[a-z]*-\([0-9]*\)-.*/\1/p')
    [ -n "$owner" ] && ! kill -0 "$owner" 2>/dev/null && [ -z "$(cat "$g/tasks" 2>/dev/null)" ] &&
      rmdir "$g" 2>/dev/null && echo "demo: removed $(basename "$g"), left by process $owner that is gone"
  done
fi
CORES=$(nproc)

# --network: node r = rank r's namespace; the planner and hapctl in the
# switch's. hap-netns removes a set left by a demo killed outright.
NETNS="" SW=()
rank_host() { if [ -n "$NETNS" ]; then echo "10.213.0.$(($1 + 1))"; else echo 127.0.0.1; fi; }
in_rank() { NS=(); [ -z "$NETNS" ] || NS=("$NETNS" exec "$1" --owner $$ --); }
if [ -n "$NETWORK" ]; then
  [ -x "$BIN/executor/cli/hap-netns" ] || { echo "demo: missing binary $BIN/executor/cli/hap-netns" >&2; exit 2; }
  if out=$("$BIN/executor/cli/hap-netns" up --owner $$ --network "nodes=$RANKS $NETWORK" 2>&1); then
    NETNS="$BIN/executor/cli/hap-netns"
    SW=("$NETNS" exec sw --owner $$ --)
    echo "demo: network testbed nodes=$RANKS $NETWORK:"
    echo "$out" | sed 's/^/      /'
    # %q: --bin-dir may hold spaces (bash reads %q's quoting back).
    printf '#!/bin/bash\nexec %q exec sw --owner %s -- %q "$@"\n' "$NETNS" $$ "$BIN/tools/hapctl" >"$STATE/hapctl"
    chmod +x "$STATE/hapctl"
    HAPCTL="$STATE/hapctl"
  else
    rc=$?
    [ "$rc" = 2 ] && { echo "demo: --network: ${out#hap-netns: }" >&2; exit 2; }
    echo "demo: network testbed unavailable (${out#hap-netns: });"
    echo "      fallback: the ranks talk over loopback."
  fi
fi

# Private (0600): the planner, agents and hapctl warn about a token file every
# user can read.
(umask 077 && echo "x" >"$STATE/token")
if [ -n "$NETNS" ]; then
  PLANNER="10.213.0.254:7070" METRICS="10.213.0.254:9464"  # a fresh namespace: both free
else
  PLANNER="127.0.0.1:$(free_port)"
  if [ "$WITH_PROMETHEUS" = 1 ]; then METRICS="127.0.0.1:9464"; else METRICS="127.0.0.1:$(free_port)"; fi
fi
start_in - - "$STATE/planner.log" "${SW[@]}" "$BIN/planner/service/hap-planner" --listen "$PLANNER" \
  --metrics-listen "$METRICS" --database "$STATE/planner.db" --token-file "$STATE/token" \
  --heartbeat-seconds 2
wait_line "$STATE/planner.log" "listening on" 30 >/dev/null
CTL=(--server "$PLANNER" --token-file "$STATE/token")

DATA_DIR="${HAP_DATA_DIR:-$(cd .. && pwd)/shared/data}"
if [ "$DATA" = wikitext ] && [ ! -d "$DATA_DIR/wikitext-2" ]; then
  echo "demo: WikiText-2 not found under $DATA_DIR: synthetic data"
  DATA=synthetic
fi

echo
echo "== A heterogeneous CPU cluster on this machine: $RANKS ranks =="
declare -A EXECUTOR_ADDR
RANK_GROUP=() AGENT_PID=() EXECUTOR_PID=()
# start_rank R [LOG-SUFFIX]: rank R's agent and executor daemon, in its
# cgroup and on its core; an executor started again listens where it did.
start_rank() {
  local r=$1 suffix=${2:-} listen=127.0.0.1:0 links=0
  # Started again: its executor listens where it did, and its agent does
  # not measure links while the others train (a probe would measure their
  # load: the links measured at start stay in use).
  [ -z "$NETNS" ] || listen="$(rank_host "$r"):0"  # --network: the node's address
  if [ -n "${EXECUTOR_ADDR[node$r/cpu0]:-}" ]; then listen=${EXECUTOR_ADDR[node$r/cpu0]} links=3600; fi
  in_rank "$r"
  start_in "${RANK_GROUP[$r]}" "$((r % CORES))" "$STATE/executor$r$suffix.log" \
    "${NS[@]}" "$BIN/executor/cli/hap-executor" --serve --listen "$listen" \
    --gloo-host "$(rank_host "$r")" \
    --planner "$PLANNER" --device-id "node$r/cpu0" --token-file "$STATE/token" --threads 1 \
    --data-dir "$DATA_DIR" --timeout 120
  EXECUTOR_PID[$r]=${PIDS[-1]}
  EXECUTOR_ADDR[node$r/cpu0]=$(wait_line "$STATE/executor$r$suffix.log" "listening on" 30 |
                               sed 's/.*listening on //')
  # The agent shares its rank's cgroup and core, so it measures what the
  # rank gets. No drift checks or link re-probes while training. It labels
  # its node with the executor's address (hap.executor/node$r/cpu0), where
  # the job finds it.
  start_in "${RANK_GROUP[$r]}" "$((r % CORES))" "$STATE/agent$r$suffix.log" \
    "${NS[@]}" "$BIN/profiler_agent/hap-agent" --listen "$(rank_host "$r"):0" \
    --planner "$PLANNER" --name "node$r" --token-file "$STATE/token" --threads 1 \
    --probe-seconds 3 --drift 0 --link-probe-seconds 3600 --link-probe-delay "$links" --devices cpu \
    --executor "${EXECUTOR_ADDR[node$r/cpu0]}"
  AGENT_PID[$r]=${PIDS[-1]}
}
for r in $(seq 0 $((RANKS - 1))); do
  share=${SHARE_LIST[$r]}
  core=$((r % CORES))
  group=-
  if [ "$CGROUPS" = 1 ]; then
    group="$CGROUP_ROOT/$GROUP_PREFIX-r$r"
    mkdir "$group"
    GROUPS_MADE+=("$group")
    echo "$PERIOD_US" >"$group/cpu.cfs_period_us"
    awk -v s="$share" -v p="$PERIOD_US" 'BEGIN { printf "%d\n", s * p }' >"$group/cpu.cfs_quota_us"
    # The largest weight: other work on the machine takes little of the share.
    echo 262144 >"$group/cpu.shares" 2>/dev/null || true
  fi
  RANK_GROUP[$r]=$group
  start_rank "$r"
  addr=${EXECUTOR_ADDR[node$r/cpu0]}
  if [ "$CGROUPS" = 1 ]; then
    echo "   rank $r: core $core, cgroup $(basename "$group") at $(awk -v s="$share" 'BEGIN { print s * 100 }')% of the core, executor $addr"
  else
    echo "   rank $r: core $core (unthrottled), executor $addr"
  fi
done

echo "   waiting for the agents to measure their devices ..."
for _ in $(seq 300); do
  ready=$("$HAPCTL" get nodes -o json "${CTL[@]}" 2>/dev/null |
          json 'print(sum(1 for n in d.get("nodes", []) if n.get("state") == "READY"))' 2>/dev/null || echo 0)
  [ "$ready" = "$RANKS" ] && break
  sleep 0.2
done
[ "$ready" = "$RANKS" ] || { echo "demo: only $ready of $RANKS agents registered; logs in $STATE" >&2; exit 1; }
"$HAPCTL" get nodes -o json "${CTL[@]}" | json '
for n in sorted(d["nodes"], key=lambda n: n["name"]):
    dev = n["devices"][0]
    f = [x["flops"] for x in dev["flops"] if x["dtype"] == "FLOAT32"][0]
    print("   %-8s measured %6.1f GFLOP/s   (%s)" % (n["name"], f / 1e9, dev["model"]))'

mkdir -p "$CHECKPOINTS"
CKPT="$(cd "$CHECKPOINTS" && pwd)/run-$(date +%Y%m%d-%H%M%S)-$$"

# --- --elastic: a job that loses a node and gets it back ---------------------
job_json() { "$HAPCTL" describe job demo -o json "${CTL[@]}"; }
run_elastic() {
  local victim=$KILL_RANK
  echo
  echo "== Elastic job: $MODEL (layers $LAYERS, hidden $HIDDEN, seq $SEQ, batch $BATCH), $STEPS steps on $DATA, a checkpoint every $EVERY =="
  local job=(create job --id demo --model "$MODEL" --layers "$LAYERS" --hidden "$HIDDEN"
             --heads "$HEADS" --ffn "$FFN" --seq "$SEQ" --batch "$BATCH" --optimizer adam
             --lr 3e-3 --clip-norm 1 --steps "$STEPS" --data "$DATA" --checkpoint-dir "$CKPT"
             --checkpoint-every "$EVERY" --join-stable "$JOIN_STABLE")
  # No --executor: each device's executor is in its node's labels.
  "$HAPCTL" "${job[@]}" "${CTL[@]}" >/dev/null
  echo "   jobs/demo: checkpoints in $CKPT (kept); status page http://hap:$(cat "$STATE/token")@$METRICS/status/jobs/demo"
  local phase=0 stay="" last_key="" last_tenth=-1 killed_at=0 restarted_at=0 base_gen=0 j state done_steps gen ndev pred meas msg now
  while :; do
    j=$(job_json)
    read -r state done_steps gen ndev pred meas <<<"$(echo "$j" | json '
s = d.get("status", {})
print(s.get("state", "?"), int(s.get("stepsDone", 0)), int(s.get("generation", 0)), len(s.get("devices", [])),
      s.get("predictedStepSeconds", 0), s.get("measuredStepSeconds", 0))')"
    now=$(date +%s.%N)
    msg=$(echo "$j" | json 'print(d.get("status", {}).get("message", ""))')
    case "$msg" in staying:*" devices is "*) stay=$msg ;; esac  # a join judged
    if [ "$state:$gen:$ndev" != "$last_key" ] || [ $((done_steps * 10 / STEPS)) != "$last_tenth" ]; then
      printf "   %6.1f s  step %4d/%d  %-10s generation %d on %d devices  predicted step %.4f s, measured %.4f s  %s\n" \
        "$(awk -v a="$now" -v b="$START" 'BEGIN { print a - b }')" "$done_steps" "$STEPS" "$state" "$gen" "$ndev" \
        "$pred" "$meas" "${msg:0:90}"
      last_key="$state:$gen:$ndev"; last_tenth=$((done_steps * 10 / STEPS))
    fi
    case "$state" in SUCCEEDED|FAILED|STOPPED) break ;; esac
    if [ $phase = 0 ] && [ -n "$THROTTLE" ] && [ "$state" = RUNNING ] && [ "$done_steps" -ge $((STEPS / 3)) ]; then
      if [ "${RANK_GROUP[$victim]}" = - ]; then
        echo "   --- no cgroups: node$victim cannot be throttled ---"
      else
        awk -v s="$THROTTLE" -v p="$PERIOD_US" 'BEGIN { printf "%d\n", s * p }' >"${RANK_GROUP[$victim]}/cpu.cfs_quota_us"
        echo "   --- node$victim throttled to $THROTTLE of its core (its cgroup's quota lowered) ---"
      fi
      phase=10
    elif [ $phase = 0 ] && [ "$state" = RUNNING ] && [ "$done_steps" -ge $((STEPS / 3)) ]; then
      echo "   --- SIGKILL node$victim's agent (pid ${AGENT_PID[$victim]}) and executor (pid ${EXECUTOR_PID[$victim]}) ---"
      kill -KILL "${AGENT_PID[$victim]}" "${EXECUTOR_PID[$victim]}" 2>/dev/null || true
      wait "${AGENT_PID[$victim]}" "${EXECUTOR_PID[$victim]}" 2>/dev/null || true
      # Generations counted from the one running at the kill: a slowdown
      # re-plan before it (an agent re-probing under load) moves them on.
      killed_at=$now base_gen=$gen phase=1
    elif [ $phase = 1 ] && [ "$state" = RUNNING ] && [ "$gen" -gt "$base_gen" ]; then
      printf "   --- training again on %d devices, %.1f s after the SIGKILL; node%d started again ---\n" \
        "$ndev" "$(awk -v a="$now" -v b="$killed_at" 'BEGIN { print a - b }')" "$victim"
      start_rank "$victim" "-again"
      restarted_at=$(date +%s.%N) base_gen=$gen phase=2
    elif [ $phase = 2 ] && [ "$state" = RUNNING ] && [ "$gen" -gt "$base_gen" ] && [ "$ndev" = "$RANKS" ]; then
      printf "   --- node%d rejoined: training on %d devices, %.1f s after it was started again ---\n" \
        "$victim" "$ndev" "$(awk -v a="$now" -v b="$restarted_at" 'BEGIN { print a - b }')"
      phase=3
    fi
    sleep 0.5
  done
  echo
  echo "== The job's timeline (hapctl describe job demo) =="
  "$HAPCTL" describe job demo "${CTL[@]}" | sed 's/^/   /'
  if [ $phase != 3 ] && [ $phase != 10 ]; then
    echo "   node$victim did not rejoin before the job ended; the job's last judgement of a join:"
    echo "   ${stay:-(none: give it more --steps)}"
  fi
  echo
  # Each plan the job ran: its share of the batch per device.
  local plan
  for plan in $(job_json | json 'print(" ".join(e.get("plan", "") for e in d.get("status", {}).get("events", [])))'); do
    "$HAPCTL" describe plan "$plan" -o json "${CTL[@]}" | json '
r = (d.get("ratios") or [{}])[0].get("ratios", [])
print("   %s ratios: %s" % (d.get("name"), ", ".join("%s %.3f" % (x, float(r[i]) if i < len(r) else 0) for i, x in enumerate(d.get("devices", [])))))' || true
  done
  job_json | json '
s = d.get("status", {})
ev = [e for e in s.get("events", []) if e.get("reason") != "STARTED"]
rec = max([float(e.get("downtimeSeconds", 0)) for e in ev] or [0])
lost = sum(int(e.get("stepsLost", 0)) for e in ev)
for e in s.get("events", []):
    p, m = float(e.get("predictedStepAfter", 0)), float(e.get("measuredStepSeconds", 0))
    if m > 0 and p > 0:
        print("   %s on %d devices: %s prediction %.4f s, measured median %.4f s (%+.0f%%)" % (
            e.get("plan", "?"), len(e.get("devicesAfter", [])),
            "calibrated" if e.get("calibrated") else "uncalibrated", p, m, 100 * (p - m) / m))
print("elastic: job %s; replans %d; recovery %.1f s (max); steps lost %d" % (s.get("state", "?"), int(s.get("replans", 0)), rec, lost))'
  [ "$state" = SUCCEEDED ]
}
START=$(date +%s.%N)
if [ "$ELASTIC" = 1 ]; then
  run_elastic
  exit $?
fi

echo
echo "== Plan: $MODEL (layers $LAYERS, hidden $HIDDEN, seq $SEQ, batch $BATCH), synthesized by the planner =="
"$HAPCTL" create plan "${CTL[@]}" --id demo --wait --timeout 300 --model "$MODEL" \
  --layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS" --ffn "$FFN" --seq "$SEQ" \
  --batch "$BATCH" --optimizer adam --lr 3e-3 --clip-norm 1 >/dev/null
"$HAPCTL" describe plan demo "${CTL[@]}" | sed 's/^/   /'
PREDICTED=$("$HAPCTL" describe plan demo -o json "${CTL[@]}" | json 'print(d["prediction"]["stepSeconds"])')

echo
echo "== Training: deployed to the $RANKS executors, $STEPS steps on $DATA =="
[ -n "$EVERY" ] || EVERY=$(( STEPS >= 3 ? STEPS / 3 : 1 ))
DEPLOY=(deploy plan demo --steps "$STEPS" --data "$DATA"
        --checkpoint-dir "$CKPT" --checkpoint-every "$EVERY")
for dev in "${!EXECUTOR_ADDR[@]}"; do DEPLOY+=(--executor "$dev=${EXECUTOR_ADDR[$dev]}"); done
DEPLOYMENT=$("$HAPCTL" "${DEPLOY[@]}" -o json "${CTL[@]}" | json 'print(d["name"])')
echo "   $DEPLOYMENT; metrics http://$METRICS/metrics, status page http://hap:$(cat "$STATE/token")@$METRICS/status (the token is the password)"
last=-1
state=RUNNING
while :; do
  dep=$("$HAPCTL" describe deployment "$DEPLOYMENT" -o json "${CTL[@]}")
  read -r state done_steps loss median <<<"$(echo "$dep" | json '
print(d.get("state", "?"), d.get("stepsCompleted", 0), d.get("lastLoss", 0), d.get("medianStepSeconds", 0))')"
  if [ "$done_steps" != "$last" ] && [ "$done_steps" -gt 0 ] &&
     { [ $((done_steps / 10)) != $((last / 10)) ] || [ "$state" != RUNNING ]; }; then
    printf "   step %4d/%d  loss %7.4f  median step %.3f s\n" "$done_steps" "$STEPS" "$loss" "$median"
    last=$done_steps
  fi
  case "$state" in SUCCEEDED|FAILED|STOPPED) break ;; esac
  sleep 1
done
if [ "$state" != SUCCEEDED ]; then
  echo "demo: deployment ended $state: $(echo "$dep" | json 'print(d.get("error", ""))')" >&2
  exit 1
fi
echo "$dep" | json "
pred = $PREDICTED
meas = d.get('medianStepSeconds', 0)
print('   predicted step %.3f s, measured median %.3f s (prediction off by %+.0f%%)' % (pred, meas, 100 * (pred - meas) / meas))"

echo
echo "== node0's executor daemon: its log (standard error; kubectl logs in a cluster), the last lines =="
grep "^hap-executor: " "$STATE/executor0.log" | tail -4 | cut -c1-160 | sed 's/^/   /'

echo
echo "== Checkpoints in $CKPT (kept): the last one =="
"$HAPCTL" checkpoint inspect "$CKPT" |
  awk -v dir="$CKPT" 'NR <= 20 { print "   " $0 } END { if (NR > 20) printf "   ... %d more tensors (%s checkpoint inspect %s)\n", NR - 20, "hapctl", dir }'

if [ "$PAPER_SCALE" = 1 ]; then
  echo
  echo "== At paper scale: $MODEL on planner/examples/mixed-2node.json, offline, against the baselines =="
  hap=$("$HAPCTL" plan --model "$MODEL" --cluster planner/examples/mixed-2node.json -o json |
        json 'print(d["predicted_step_seconds"])')
  printf "   %-10s %10.4f s (predicted)\n" hap "$hap"
  for b in dp-even dp-prop zero3 megatron; do
    if out=$("$HAPCTL" plan --model "$MODEL" --cluster planner/examples/mixed-2node.json --baseline "$b" -o json 2>&1); then
      t=$(echo "$out" | json 'print(d["predicted_step_seconds"])')
      printf "   %-10s %10.4f s   (hap is %.2fx faster)\n" "$b" "$t" "$(awk -v a="$t" -v b="$hap" 'BEGIN {print a / b}')"
    else  # e.g. megatron on the 16 GiB GPUs: "does not fit: device ..."
      msg=$(echo "$out" | head -1)
      msg=${msg#error: }
      printf "   %-10s %s\n" "$b" "${msg#baseline "$b" }"
    fi
  done
fi

if [ "$WITH_PROMETHEUS" = 1 ]; then
  start_in - - "$STATE/prometheus.log" /usr/bin/prometheus \
    --config.file=deploy/prometheus/prometheus.yml --storage.tsdb.path="$STATE/prometheus" \
    --web.listen-address=127.0.0.1:9090
  echo
  echo "== Prometheus http://127.0.0.1:9090 scrapes http://$METRICS/metrics (deploy/prometheus/) =="
fi
if [ "$KEEP_RUNNING" = 1 ] || [ "$WITH_PROMETHEUS" = 1 ]; then
  echo
  echo "The cluster keeps running: planner $PLANNER (try: $HAPCTL get nodes --server $PLANNER --token-file $STATE/token),"
  echo "status http://hap:$(cat "$STATE/token")@$METRICS/status. Press Enter or Ctrl-C to stop everything."
  read -r _ || true
fi
