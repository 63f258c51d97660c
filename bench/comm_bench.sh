#!/bin/bash
# Collective cost between two ranks pinned to one core each, rank 1 throttled
# to a CPU share through a cgroup (v1 cpu controller), with Gloo's event-loop
# thread at SCHED_IDLE (ours) against Gloo's default (the baseline),
# interleaved round by round, the order alternating between rounds. Prints the
# time per collective beyond the ranks' compute, medians over the rounds, and
# the ratio.
#   bazel build -c opt //bench:comm_bench && bench/comm_bench.sh [ROUNDS] [SHARE]
#   bench/comm_bench.sh --call-check [ROUNDS]
# --call-check: instead, the collectives' agreement on the call
# (GlooOptions::check_calls) against none, no compute between collectives,
# both ranks at a full core.
# ROUNDS: a positive integer [5]; SHARE: rank 1's share of its core, in (0, 1]
# [0.4]. COMM_BENCH_BIN: the binary [bazel-bin/bench/comm_bench];
# COMM_BENCH_CGROUP_ROOT: the cgroup v1 cpu controller [/sys/fs/cgroup/cpu].
# The ranks are stopped by pid, and the cgroup and scratch folders removed, on
# exit, Ctrl-C and SIGTERM; a rank that fails stops the run (exit 1).
set -euo pipefail
CALL_CHECK=0
if [ "${1:-}" = --call-check ]; then CALL_CHECK=1; shift; fi
ROUNDS=${1:-5}
SHARE=${2:-0.4}
case "$ROUNDS" in ''|*[!0-9]*|0) echo "comm_bench: ROUNDS must be a positive integer, got '$ROUNDS'" >&2; exit 2 ;; esac
if ! awk -v s="$SHARE" 'BEGIN { exit !(s ~ /^[0-9]*\.?[0-9]+$/ && s + 0 > 0 && s + 0 <= 1) }'; then
  echo "comm_bench: SHARE must be a number in (0, 1], got '$SHARE'" >&2; exit 2
fi
BIN=${COMM_BENCH_BIN:-bazel-bin/bench/comm_bench}
[ -x "$BIN" ] || { echo "comm_bench: $BIN not built (bazel build -c opt //bench:comm_bench)" >&2; exit 2; }
[ "$(nproc)" -ge 2 ] || { echo "comm_bench: needs 2 cores" >&2; exit 2; }
WORK_MS=20 ITERS=30
# The variable that picks the baseline in a pair: Gloo's default loop
# thread, or no agreement on the call.
BASELINE_ENV=COMM_BENCH_DEFAULT_LOOP
if [ "$CALL_CHECK" = 1 ]; then WORK_MS=0 ITERS=2000 SHARE=1 BASELINE_ENV=COMM_BENCH_NO_CALL_CHECK; fi
CG=${COMM_BENCH_CGROUP_ROOT:-/sys/fs/cgroup/cpu}/hap-comm-bench.$$
MADE_CG=0
PIDS=()
SCRATCH=""
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
  [ -z "$SCRATCH" ] || rm -rf "$SCRATCH"
  if [ "$MADE_CG" = 1 ]; then rmdir "$CG" 2>/dev/null || true; fi
}
trap cleanup EXIT
trap 'echo "comm_bench: interrupted, stopping the ranks" >&2; exit 130' INT TERM
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/hap-comm-bench.XXXXXX")
if [ "$CALL_CHECK" = 0 ] && mkdir "$CG" 2>/dev/null; then
  MADE_CG=1
  PERIOD=20000
  echo $PERIOD > "$CG/cpu.cfs_period_us"
  awk -v s="$SHARE" -v p="$PERIOD" 'BEGIN { printf "%d\n", s * p }' > "$CG/cpu.cfs_quota_us"
  WHERE="rank 1 at $SHARE of a core (CFS quota, period ${PERIOD} us)"
elif [ "$CALL_CHECK" = 1 ]; then
  CG=""
  WHERE="the agreement on the call against none; both ranks at a full core"
else
  CG=""; SHARE=1
  WHERE="no writable cgroup v1 cpu controller: both ranks at a full core"
fi
# One pinned pair, its rendezvous in a fresh folder; sets MS to rank 0's
# milliseconds beyond its compute. Run in this shell (not in $(...)), so that
# PIDS names the ranks that a Ctrl-C stops.
pair() {  # baseline(0|1) op bytes
  local d r0 r1 rc0=0 rc1=0
  d=$(mktemp -d "$SCRATCH/pair.XXXXXX")
  env "$BASELINE_ENV=$1" taskset -c 0 "$BIN" 0 2 "$d" "$2" "$3" $WORK_MS 1 $ITERS > "$d/out" 2> "$d/err0" &
  r0=$!
  PIDS=("$r0")
  ( [ -n "$CG" ] && echo $BASHPID > "$CG/cgroup.procs"
    exec env "$BASELINE_ENV=$1" taskset -c 1 "$BIN" 1 2 "$d" "$2" "$3" $WORK_MS "$SHARE" $ITERS ) 2> "$d/err1" &
  r1=$!
  PIDS+=("$r1")
  wait "$r0" || rc0=$?
  wait "$r1" || rc1=$?
  PIDS=()
  if [ "$rc0" != 0 ] || [ "$rc1" != 0 ]; then
    echo "comm_bench: $2 $3 bytes ($BASELINE_ENV=$1): rank 0 exit $rc0, rank 1 exit $rc1" >&2
    tail -3 "$d/err0" "$d/err1" >&2
    exit 1
  fi
  MS=$(sed -n 's/.*beyond work \([0-9.]*\) ms/\1/p' "$d/out")
  if [ -z "$MS" ]; then
    echo "comm_bench: $2 $3 bytes ($BASELINE_ENV=$1): rank 0 printed no time:" >&2
    tail -3 "$d/out" >&2
    exit 1
  fi
  rm -rf "$d"
}
echo "$WHERE; ${WORK_MS} ms of compute between collectives, $ITERS per round, $ROUNDS rounds"
if [ "$CALL_CHECK" = 1 ]; then
  echo "| collective | bytes | with the check ms | without ms | ratio (with / without) |"
else
  echo "| collective | bytes | idle loop thread ms | default loop thread ms | ratio (default / idle) |"
fi
echo "|---|---|---|---|---|"
for spec in "allreduce 4096" "allreduce 131072" "allreduce 5242880" "allgather 131072" "none 0"; do
  read -r op bytes <<<"$spec"
  a=(); b=()
  for ((r = 0; r < ROUNDS; r++)); do
    # Idle loop first in even rounds, the default first in odd ones: the
    # machine's drift within a round falls on both alike.
    if [ $((r % 2)) = 0 ]; then
      pair 0 "$op" "$bytes"; a+=("$MS"); pair 1 "$op" "$bytes"; b+=("$MS")
    else
      pair 1 "$op" "$bytes"; b+=("$MS"); pair 0 "$op" "$bytes"; a+=("$MS")
    fi
  done
  python3 - "$op" "$bytes" "${a[*]}" "${b[*]}" "$CALL_CHECK" <<'PY'
import statistics, sys
op, n, a, b, call_check = sys.argv[1:]
ma = statistics.median(map(float, a.split())); mb = statistics.median(map(float, b.split()))
name = {"none": "barrier"}.get(op, op)
if call_check == "1":  # a: with the check, b: without; the ratio of the round pairs' medians
    r = statistics.median(x / max(y, 1e-6) for x, y in zip(map(float, a.split()), map(float, b.split())))
    print(f"| {name} | {n} | {ma:.3f} | {mb:.3f} | {r:.2f}x |")
else:
    print(f"| {name} | {n} | {ma:.2f} | {mb:.2f} | {mb / max(ma, 1e-3):.2f}x |")
PY
done
