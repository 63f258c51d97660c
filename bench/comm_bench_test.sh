#!/usr/bin/env bash
# bench/comm_bench.sh against a fake comm_bench (COMM_BENCH_BIN) and no
# cgroup (COMM_BENCH_CGROUP_ROOT names no folder): its scratch folders are
# removed, the two sides alternate in order between rounds, the ratio is
# default / idle, bad arguments and a failed rank are refused, and SIGTERM
# stops the ranks it started.
#   comm_bench_test.sh PATH/TO/comm_bench.sh
set -uo pipefail
SCRIPT=$(realpath "$1")
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/comm-bench-test.XXXXXX")
FAILS=0
fail() { echo "FAIL: $*"; FAILS=$((FAILS + 1)); }
cleanup() {
  # Ranks a broken script left running (the fake's sleep), by pid.
  if [ -f "$T/pids" ]; then
    while read -r p; do kill -KILL "$p" 2>/dev/null || true; done <"$T/pids"
  fi
  rm -rf "$T"
}
trap cleanup EXIT
if [ "$(nproc)" -lt 2 ]; then
  echo "comm_bench.sh needs 2 cores; this machine has $(nproc): skipped"
  exit 0
fi

# The fake: RANK SIZE DIR OP BYTES WORK_MS SCALE ITERS, as comm_bench.
cat >"$T/fake" <<'EOF'
#!/usr/bin/env bash
echo "$1 ${COMM_BENCH_DEFAULT_LOOP:-} $4 $5 ${COMM_BENCH_NO_CALL_CHECK:-} $6" >>"$FAKE_DIR/calls"
if [ -n "${FAKE_FAIL:-}" ] && [ "$1" = 1 ] && [ "$4" = allgather ]; then
  echo "gloo: connection reset" >&2; exit 3
fi
if [ -n "${FAKE_HANG:-}" ]; then echo $$ >>"$FAKE_DIR/pids"; exec sleep 300; fi
if [ "$1" = 0 ] && [ -n "${COMM_BENCH_NO_CALL_CHECK:-}" ]; then
  if [ "$COMM_BENCH_NO_CALL_CHECK" = 0 ]; then ms=2.5000; else ms=2.0000; fi
  echo "$4 $5 bytes, work 0.0 ms: 2.50 ms/iter, beyond work $ms ms"
elif [ "$1" = 0 ]; then
  if [ "$COMM_BENCH_DEFAULT_LOOP" = 0 ]; then ms=2.00; else ms=3.00; fi
  echo "$4 $5 bytes, work 20.0 ms: 22.00 ms/iter, beyond work $ms ms"
fi
EOF
chmod +x "$T/fake"
mkdir "$T/tmp"
run() {  # run ARGS...: the script with the fake, output in $T/out
  COMM_BENCH_BIN="$T/fake" COMM_BENCH_CGROUP_ROOT="$T/no-cgroups" FAKE_DIR="$T" \
    TMPDIR="$T/tmp" bash "$SCRIPT" "$@" >"$T/out" 2>&1
}

# 1. Two rounds: the table, the order, nothing left in TMPDIR.
run 2 0.5
rc=$?
[ $rc = 0 ] || fail "2 rounds: exit $rc: $(cat "$T/out")"
grep -qF "| allreduce | 4096 | 2.00 | 3.00 | 1.50x |" "$T/out" ||
  fail "no allreduce 4096 row with idle 2.00, default 3.00, ratio 1.50x: $(cat "$T/out")"
grep -qF "| barrier | 0 | 2.00 | 3.00 | 1.50x |" "$T/out" || fail "no barrier row: $(cat "$T/out")"
order=$(awk '$1 == 0 && $3 == "allreduce" && $4 == 4096 { printf "%s", $2 }' "$T/calls")
[ "$order" = 0110 ] || fail "order of the loops over 2 rounds: got '$order', want 0110 (alternating)"
left=$(ls -A "$T/tmp")
[ -z "$left" ] || fail "left in TMPDIR: $(echo "$left" | head -3 | tr '\n' ' ')($(echo "$left" | wc -l) entries)"

# 1b. --call-check: the agreement on the call against none (the fake: 2.5
# against 2.0 ms), no compute between collectives, alternating in order.
rm -f "$T/calls"
run --call-check 2
rc=$?
[ $rc = 0 ] || fail "--call-check: exit $rc: $(cat "$T/out")"
grep -qF "| allreduce | 4096 | 2.500 | 2.000 | 1.25x |" "$T/out" ||
  fail "--call-check: no allreduce 4096 row with 2.500, 2.000, 1.25x: $(cat "$T/out")"
order=$(awk '$1 == 0 && $2 == "allreduce" && $3 == 4096 { printf "%s", $4 }' "$T/calls")
[ "$order" = 0110 ] || fail "--call-check: order over 2 rounds: got '$order', want 0110"
awk '$5 != 0 { exit 1 }' "$T/calls" || fail "--call-check: compute between collectives: $(head -2 "$T/calls")"

# 2. Bad arguments: refused, with a message, before any rank starts.
rm -f "$T/calls"
for args in "x 0.4" "0 0.4" "2 abc" "2 0" "2 1.5"; do
  # shellcheck disable=SC2086
  run $args
  rc=$?
  [ $rc = 2 ] || fail "args '$args': exit $rc, want 2: $(cat "$T/out")"
  grep -qE "ROUNDS must be|SHARE must be" "$T/out" || fail "args '$args': no clear message: $(cat "$T/out")"
done
[ ! -e "$T/calls" ] || fail "a rank ran with bad arguments"

# 3. A rank that fails stops the run with exit 1 and says which.
FAKE_FAIL=1 run 1 0.5
rc=$?
[ $rc = 1 ] || fail "a failed rank: exit $rc, want 1: $(cat "$T/out")"
grep -q "rank 1 exit 3" "$T/out" || fail "a failed rank: not said: $(cat "$T/out")"
grep -q "^| allgather" "$T/out" && fail "a row for the failed collective"
left=$(ls -A "$T/tmp")
[ -z "$left" ] || fail "left in TMPDIR after a failure: $(echo "$left" | head -3 | tr '\n' ' ')"

# 4. SIGTERM while the ranks run: both stopped, by the script.
rm -f "$T/pids"
COMM_BENCH_BIN="$T/fake" COMM_BENCH_CGROUP_ROOT="$T/no-cgroups" FAKE_DIR="$T" FAKE_HANG=1 \
  TMPDIR="$T/tmp" bash "$SCRIPT" 1 0.5 >"$T/out" 2>&1 &
script=$!
started() { [ -f "$T/pids" ] && [ "$(wc -l <"$T/pids")" -ge 2 ]; }
for _ in $(seq 300); do started && break; sleep 0.1; done
started || fail "the two fake ranks never started"
kill -TERM "$script"
wait "$script"
rc=$?
[ $rc = 130 ] || fail "SIGTERM: exit $rc, want 130"
while read -r p; do
  # A stopped rank may linger as a zombie for a moment: gone or a zombie.
  state=$(ps -o stat= -p "$p" 2>/dev/null | cut -c1)
  [ -z "$state" ] || [ "$state" = Z ] || fail "rank pid $p still running after SIGTERM"
done <"$T/pids"
left=$(ls -A "$T/tmp")
[ -z "$left" ] || fail "left in TMPDIR after SIGTERM: $(echo "$left" | head -3 | tr '\n' ' ')"

if [ "$FAILS" = 0 ]; then echo "comm_bench_test: all passed"; else echo "comm_bench_test: $FAILS failed"; fi
[ "$FAILS" = 0 ]
