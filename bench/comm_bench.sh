#!/bin/bash
# Collective cost between two ranks pinned to one core each, rank 1 throttled
# to a CPU share through a cgroup (v1 cpu controller), with Gloo's event-loop
# thread at SCHED_IDLE (ours) against Gloo's default (the baseline),
# interleaved round by round. Prints the time per collective beyond the
# ranks' compute, medians over the rounds, and the ratio.
#   bazel build -c opt //bench:comm_bench && bench/comm_bench.sh [ROUNDS] [SHARE]
set -euo pipefail
ROUNDS=${1:-5}
SHARE=${2:-0.4}
BIN=${COMM_BENCH_BIN:-bazel-bin/bench/comm_bench}
[ -x "$BIN" ] || { echo "comm_bench: $BIN not built (bazel build -c opt //bench:comm_bench)" >&2; exit 2; }
[ "$(nproc)" -ge 2 ] || { echo "comm_bench: needs 2 cores" >&2; exit 2; }
WORK_MS=20 ITERS=30
CG=/sys/fs/cgroup/cpu/hap-comm-bench.$$
DIRS=()
cleanup() { rmdir "$CG" 2>/dev/null || true; rm -rf "${DIRS[@]}" 2>/dev/null || true; }
trap cleanup EXIT
if mkdir "$CG" 2>/dev/null; then
  PERIOD=20000
  echo $PERIOD > "$CG/cpu.cfs_period_us"
  QUOTA=$(python3 -c "print(int($PERIOD*$SHARE))"); echo "$QUOTA" > "$CG/cpu.cfs_quota_us"
  WHERE="rank 1 at $SHARE of a core (CFS quota, period ${PERIOD} us)"
else
  CG=""; SHARE=1
  WHERE="no writable cgroup v1 cpu controller: both ranks at a full core"
fi
# One pinned pair; prints rank 0's milliseconds beyond its compute.
pair() {  # default_loop op bytes
  local d; d=$(mktemp -d); DIRS+=("$d")
  COMM_BENCH_DEFAULT_LOOP=$1 taskset -c 0 "$BIN" 0 2 "$d" "$2" "$3" $WORK_MS 1 $ITERS > "$d/out" &
  local r0=$!
  ( [ -n "$CG" ] && echo $BASHPID > "$CG/cgroup.procs"
    COMM_BENCH_DEFAULT_LOOP=$1 exec taskset -c 1 "$BIN" 1 2 "$d" "$2" "$3" $WORK_MS "$SHARE" $ITERS ) &
  local r1=$!
  wait $r0; wait $r1
  sed -n 's/.*beyond work \([0-9.]*\) ms/\1/p' "$d/out"
}
echo "$WHERE; ${WORK_MS} ms of compute between collectives, $ITERS per round, $ROUNDS rounds"
echo "| collective | bytes | idle loop thread ms | default loop thread ms | ratio (default / idle) |"
echo "|---|---|---|---|---|"
for spec in "allreduce 4096" "allreduce 131072" "allreduce 5242880" "allgather 131072" "none 0"; do
  set -- $spec
  a=(); b=()
  for ((r = 0; r < ROUNDS; r++)); do a+=("$(pair 0 "$1" "$2")"); b+=("$(pair 1 "$1" "$2")"); done
  python3 - "$1" "$2" "${a[*]}" "${b[*]}" <<'PY'
import statistics, sys
op, n, a, b = sys.argv[1:]
ma = statistics.median(map(float, a.split())); mb = statistics.median(map(float, b.split()))
name = {"none": "barrier"}.get(op, op)
print(f"| {name} | {n} | {ma:.2f} | {mb:.2f} | {mb / max(ma, 1e-3):.2f}x |")
PY
done
