#!/bin/bash
# hapctl watch against a hap-planner on 127.0.0.1 (port 0) and a job that
# waits for devices (there are none), so its watch never ends by itself:
# a standard output that fails ends the watch, exit 1 naming it (it watched
# on, writing into nothing, until the job ended); --timeout ends it.
set -u
HAPCTL="$1"
PLANNER="$2"
fail() { echo "FAIL: $*"; exit 1; }
tmp="$(mktemp -d)"
planner_pid=""
cleanup() {
  if [ -n "$planner_pid" ]; then
    kill "$planner_pid" 2>/dev/null
    wait "$planner_pid" 2>/dev/null
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

"$PLANNER" --listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0 --database "$tmp/db" \
  > "$tmp/planner.log" 2>&1 &
planner_pid=$!
# Its address, once it listens (it prints it then).
addr=""
while [ -z "$addr" ]; do
  kill -0 "$planner_pid" 2>/dev/null || fail "hap-planner exited: $(cat "$tmp/planner.log")"
  addr="$(sed -n 's/^listening on \(127\.0\.0\.1:[0-9]*\)$/\1/p' "$tmp/planner.log")"
  [ -n "$addr" ] || sleep 0.1
done
server=(--server "$addr")

out="$("$HAPCTL" create job --id waits --model mlp --checkpoint-dir "$tmp/ckpt" "${server[@]}" 2>&1)" \
  || fail "create job: $out"

if [ -w /dev/full ]; then
  for fmt in table json; do
    out="$("$HAPCTL" watch job waits -o "$fmt" "${server[@]}" 2>&1 >/dev/full)" \
      && fail "watch -o $fmt > /dev/full exited 0: $out"
    echo "$out" | grep -q "cannot write to standard output: No space left on device" \
      || fail "watch -o $fmt > /dev/full: $out"
  done
else
  echo "SKIPPED: the standard-output failure case (no writable /dev/full here)"
fi

out="$("$HAPCTL" watch job waits --timeout 1 "${server[@]}" 2>&1)" \
  && fail "watch --timeout 1 exited 0: $out"
echo "$out" | grep -q "DEADLINE_EXCEEDED: still watching at --timeout 1 s" \
  || fail "watch --timeout 1: $out"
# A planner that stops answering mid-watch (its host hung: SIGSTOP keeps
# the connection open, so no reset comes): the watch waited for ever; with
# a ping unanswered it ends, exit 1, within --keepalive and as long again.
"$HAPCTL" watch job waits --keepalive 1 "${server[@]}" > "$tmp/hung.out" 2> "$tmp/hung.err" &
watch_pid=$!
sleep 1
kill -STOP "$planner_pid"
ended=""
for _ in $(seq 1 600); do
  if ! kill -0 "$watch_pid" 2>/dev/null; then ended=1; break; fi
  sleep 0.1
done
kill -CONT "$planner_pid"
if [ -z "$ended" ]; then
  kill "$watch_pid" 2>/dev/null
  wait "$watch_pid" 2>/dev/null
  fail "watch went on for 60 s after the planner stopped answering"
fi
wait "$watch_pid"
rc=$?
[ "$rc" = 1 ] || fail "watch of a hung planner: exit $rc: $(cat "$tmp/hung.err")"
grep -q "UNAVAILABLE" "$tmp/hung.err" || fail "watch of a hung planner: $(cat "$tmp/hung.err")"
out="$("$HAPCTL" get jobs --keepalive 0.5 "${server[@]}" 2>&1)" && fail "--keepalive 0.5 exited 0"
echo "$out" | grep -q "keepalive must be seconds from 1 to 86400, got '0.5'" \
  || fail "--keepalive 0.5: $out"
echo PASS
