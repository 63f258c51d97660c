#!/bin/bash
# hap-launch and hap-executor given what a careless or hostile user gives
# them: stray words, no --plan, a closed or full standard output, a plan
# that is a pipe, paths the file system cannot take, a --profile or a
# --timeout that cannot work, leftovers that only look like a gone
# launcher's, and ranks that end together or in an unlucky order. Each case
# says what went wrong before; it is now refused before any rank starts,
# naming what is wrong, or named as it is. Real binaries (a fake executor
# where the order of ends must be made certain); every process started here
# is waited for (timeout(1) only guards against a hang).
set -u
HAPCTL="$1"
LAUNCH="$2"
EXECUTOR="$3"
CLUSTER="$4"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
tmp="$(mktemp -d)"
made=()
trap 'rm -rf "$tmp" "${made[@]}"' EXIT

"$HAPCTL" plan --cluster "$CLUSTER" --model mlp --save-plan "$tmp/mlp.pb" > "$tmp/plan" 2>&1 \
  || { echo "FAIL: plan: $(cat "$tmp/plan")"; exit 1; }

# "${closed_stdout[@]}" CMD...: CMD with its standard output closed.
closed_stdout=(bash -c '"$@" >&-' closed_stdout)

# expect_refused NAME CODE TEXT CMD...: CMD exits CODE, its stderr holds
# TEXT and no rank trained (rank 0 would print "training ...").
expect_refused() {
  local name="$1" code="$2" text="$3"
  shift 3
  timeout 120 "$@" > "$tmp/$name.out" 2> "$tmp/$name.err"
  local rc=$?
  [ "$rc" = "$code" ] || fail "$name: exit $rc, not $code: $(cat "$tmp/$name.err")"
  grep -qF -- "$text" "$tmp/$name.err" || fail "$name: no '$text' in: $(cat "$tmp/$name.err")"
  if grep -q "^training" "$tmp/$name.out"; then fail "$name: a rank trained"; fi
}

# Stray arguments: `--pin-cores 7` (a flag without a value) ran with the 7
# ignored, and so did any word left over from an edit of the command.
expect_refused stray_launch 2 "error: unexpected argument '7'" \
  "$LAUNCH" --plan "$tmp/mlp.pb" --steps 1 --pin-cores 7
expect_refused stray_executor 2 "error: unexpected argument 'extra'" \
  "$EXECUTOR" --plan "$tmp/mlp.pb" --rank 0 --world 2 --rendezvous "$tmp" extra
# No --plan: the usage alone, saying nothing of why.
expect_refused no_plan 2 "error: --plan is required" "$LAUNCH" --steps 1

# A closed standard output: the run trained to its end (with fd 1 free the
# first socket or file the rank opened took its number and the losses went
# there) and only then failed. Now refused at the start.
expect_refused closed_stdout_launch 2 "error: standard output is closed" \
  "${closed_stdout[@]}" "$LAUNCH" --plan "$tmp/mlp.pb" --steps 2
expect_refused closed_stdout_executor 2 "error: standard output is closed" \
  "${closed_stdout[@]}" "$EXECUTOR" --plan "$tmp/mlp.pb" --rank 0 --world 2 \
  --rendezvous "$tmp" --timeout 2

# Standard output that cannot be written (a full disk): the run trained on
# to its last step and failed only then; now it stops at the first line
# that did not go out.
timeout 120 "$LAUNCH" --plan "$tmp/mlp.pb" --steps 1000 > /dev/full 2> "$tmp/full.err"
rc=$?
[ "$rc" = 1 ] || fail "stdout on /dev/full: exit $rc, not 1: $(cat "$tmp/full.err")"
full_text="error: cannot write to standard output (the losses and the final line)"
grep -qF "$full_text; stopped after step 0" "$tmp/full.err" \
  || fail "stdout on /dev/full: $(cat "$tmp/full.err")"

# A plan that is not a regular file: a FIFO blocked hap-launch for good
# (open waits for a writer), and a pipe (--plan <(...)) was drained by
# hap-launch, leaving every rank "plan '/dev/fd/63' is empty".
mkfifo "$tmp/plan-fifo"
expect_refused fifo_plan 1 "plan '$tmp/plan-fifo' is not a regular file" \
  "$LAUNCH" --plan "$tmp/plan-fifo" --steps 1
expect_refused pipe_plan 1 "is not a regular file (a pipe or a device" \
  "$LAUNCH" --plan <(cat "$tmp/mlp.pb") --steps 1

# A rank's error names the rank (several ranks write to one stderr).
expect_refused rank_named 1 "(rank 1)" \
  "$EXECUTOR" --plan "$tmp/mlp.pb" --rank 1 --world 2 --rendezvous "$tmp" --data "npy:$tmp/plan"

# A checkpoint directory whose name the file system cannot hold passed the
# start check (the lookup failed, read as "does not exist yet") and failed
# at the first save.
long_name="$(printf 'c%.0s' $(seq 300))"
expect_refused long_component 2 "--checkpoint-dir $tmp/$long_name: File name too long" \
  "$LAUNCH" --plan "$tmp/mlp.pb" --steps 1 --checkpoint-dir "$tmp/$long_name"
# A path short enough for the lookup, too long for the step directory and
# shards inside it (4060 + "/.tmp-step-00000001/rank-00000-of-00002...").
deep="$tmp"
while [ ${#deep} -lt 3800 ]; do deep="$deep/$(printf 'd%.0s' $(seq 200))"; done
deep="$deep/$(printf 'e%.0s' $(seq $((4060 - ${#deep} - 1))))"
expect_refused long_path 2 "the files of a checkpoint in it would pass the system's limit" \
  "$LAUNCH" --plan "$tmp/mlp.pb" --steps 1 --checkpoint-dir "$deep"
# A directory whose file system refuses root what its permission bits
# allow (proc here; an NFS export that squashes root): it passed the start
# check, and the first save failed.
if [ "$(id -u)" = 0 ] && [ -d /proc/self ]; then
  in_proc="cannot make a directory in '/proc'"
  expect_refused refusing_fs 2 "--checkpoint-dir /proc/hap-ck: $in_proc" \
    "$LAUNCH" --plan "$tmp/mlp.pb" --steps 1 --checkpoint-dir /proc/hap-ck
  expect_refused refusing_fs_profile 2 "--profile /proc/hap-prof: $in_proc" \
    "$LAUNCH" --plan "$tmp/mlp.pb" --steps 3 --profile /proc/hap-prof
fi
# A --profile prefix too long for its files' names: they failed after the
# last step.
expect_refused long_profile 2 "--profile $tmp/${long_name:0:240}: " \
  "$LAUNCH" --plan "$tmp/mlp.pb" --steps 3 --profile "$tmp/${long_name:0:240}"
# Too few steps to profile: said by a rank once every rank had connected.
expect_refused profile_steps 2 "error: --profile needs more than 2 --steps" \
  "$LAUNCH" --plan "$tmp/mlp.pb" --steps 2 --profile "$tmp/prof"

# A --timeout that Gloo cannot hold: 1e300 s became 2^63 ms, which
# overflows where Gloo adds it to the clock, and every wait timed out at
# once ("Timed out waiting 9223372036854775807ms"); 1e-9 s became 0 ms.
timeout_range="error: --timeout must be seconds from 0.001 to 10000000"
expect_refused huge_timeout 2 "$timeout_range, got '1e300'" \
  "$LAUNCH" --plan "$tmp/mlp.pb" --steps 1 --timeout 1e300
expect_refused tiny_timeout 1 "$timeout_range, got '1e-9'" \
  "$EXECUTOR" --plan "$tmp/mlp.pb" --rank 0 --world 2 --rendezvous "$tmp" --timeout 1e-9

# Leftovers of a launcher that is gone are removed by name: only the names
# a launcher makes (/tmp/hap-rendezvous-PID-XXXXXX, cgroups
# hap-launch-PID-rR), not every name that starts the same way.
gone="$(sh -c 'echo $$')"  # a pid whose process has ended
ours="/tmp/hap-rendezvous-$gone-Ab12Cd"
theirs="/tmp/hap-rendezvous-$gone-keep-me"
mkdir "$ours" "$theirs"
made+=("$ours" "$theirs")
cgroups=()
if mkdir "/sys/fs/cgroup/cpu/hap-launch-$gone-r0" 2> /dev/null; then
  cgroups=("/sys/fs/cgroup/cpu/hap-launch-$gone-r0" "/sys/fs/cgroup/cpu/hap-launch-$gone-mine-r1")
  mkdir "${cgroups[1]}"
else
  echo "(no cgroup v1 cpu controller to write: the cgroup part is skipped)"
fi
timeout 120 "$LAUNCH" --plan "$tmp/mlp.pb" --steps 1 > "$tmp/leftovers.out" 2>&1 \
  || fail "leftovers run: $(cat "$tmp/leftovers.out")"
[ -d "$ours" ] && fail "the gone launcher's rendezvous directory $ours is still there"
[ -d "$theirs" ] || fail "$theirs, not a launcher's name, was removed"
if [ ${#cgroups[@]} -gt 0 ]; then
  [ -d "${cgroups[0]}" ] && fail "the gone launcher's cgroup ${cgroups[0]} is still there"
  [ -d "${cgroups[1]}" ] || fail "${cgroups[1]}, not a launcher's name, was removed"
  for g in "${cgroups[@]}"; do rmdir "$g" 2> /dev/null; done
fi

# Ranks that end before hap-launch looks, made certain by stopping it
# (SIGSTOP) while they end: they are reaped in fork order, and it named the
# first only. A crash and its peer failing on the lost connection: it named
# the peer ("rank 0 exited with code 3"), not the rank killed by a signal. A
# rank that failed on its own (exit 3) and its peer that lost its
# connection to it (exit 1, rankR.lost-peer in the rendezvous directory):
# it named the peer.
cat > "$tmp/fake-executor" << 'FAKE'
#!/bin/bash
# A rank that records its pid, then exits with the code in FAKE_DIR/go-RANK
# (LOST: exit 1 as a real rank does whose peer's connection failed).
[ -n "${FAKE_IGNORE_TERM:-}" ] && trap '' TERM
rank=""
rendezvous=""
while [ $# -gt 0 ]; do
  [ "$1" = --rank ] && rank="$2"
  [ "$1" = --rendezvous ] && rendezvous="$2"
  shift
done
echo $$ > "$FAKE_DIR/rank$rank.tmp" && mv "$FAKE_DIR/rank$rank.tmp" "$FAKE_DIR/rank$rank.pid"
while [ ! -e "$FAKE_DIR/go-$rank" ]; do sleep 0.05; done
code="$(cat "$FAKE_DIR/go-$rank")"
if [ "$code" = LOST ]; then
  echo "connection to a peer failed" > "$rendezvous/rank$rank.lost-peer"
  exit 1
fi
exit "$code"
FAKE
chmod +x "$tmp/fake-executor"
# wait_for CMD...: until CMD succeeds; fails after a minute without.
wait_for() {
  local i
  for i in $(seq 1200); do
    "$@" && return 0
    sleep 0.05
  done
  return 1
}
is_zombie() { [ "$(awk '{print $3}' "/proc/$1/stat" 2> /dev/null)" = Z ]; }
both_started() { [ -s "$1/rank0.pid" ] && [ -s "$1/rank1.pid" ]; }
# together NAME HOW0 HOW1 TEXT...: fake ranks 0 and 1 end while hap-launch
# is stopped, each by exiting with the code HOW or (KILL) by SIGKILL; then
# hap-launch exits 1 and says each TEXT.
together() {
  local name="$1" dir="$tmp/$1" launcher rc r text
  local how=("$2" "$3")
  shift 3
  mkdir "$dir"
  FAKE_DIR="$dir" "$LAUNCH" --plan "$tmp/mlp.pb" --executor "$tmp/fake-executor" \
    > "$dir/out" 2>&1 &
  launcher=$!
  if wait_for both_started "$dir"; then
    local pids=("$(cat "$dir/rank0.pid")" "$(cat "$dir/rank1.pid")")
    kill -STOP "$launcher"
    for r in 0 1; do
      if [ "${how[r]}" = KILL ]; then
        kill -KILL "${pids[r]}"
      else
        echo "${how[r]}" > "$dir/go.tmp" && mv "$dir/go.tmp" "$dir/go-$r"
      fi
    done
    if wait_for is_zombie "${pids[0]}" && wait_for is_zombie "${pids[1]}"; then
      kill -CONT "$launcher"
    else
      fail "$name: the ranks (${pids[*]}) did not end"
      kill -KILL "$launcher" "${pids[@]}"
    fi
  else
    fail "$name: the fake ranks did not start: $(cat "$dir/out")"
    kill -KILL "$launcher"
  fi
  wait "$launcher"
  rc=$?
  [ "$rc" = 1 ] || fail "$name: exit $rc, not 1: $(cat "$dir/out")"
  for text in "$@"; do
    grep -qF "$text" "$dir/out" || fail "$name: no '$text' in: $(cat "$dir/out")"
  done
}
together signal_first 3 KILL "hap-launch: rank 1 was killed by SIGKILL"
together lost_peer LOST 3 "rank 0 lost its connection to a peer" \
  "hap-launch: rank 1 exited with code 3"
# A rank killed (SIGKILL, by the kernel's OOM killer say) that ends after
# the peer that lost its connection to it: it was taken for hap-launch's
# own doing, as the SIGKILL after the grace period is, and not named.
mkdir "$tmp/killed_later"
FAKE_DIR="$tmp/killed_later" FAKE_IGNORE_TERM=1 "$LAUNCH" --plan "$tmp/mlp.pb" \
  --executor "$tmp/fake-executor" --grace-seconds 3600 > "$tmp/killed_later/out" 2>&1 &
launcher=$!
said_lost() { grep -q "rank 0 lost its connection to a peer" "$tmp/killed_later/out"; }
if wait_for both_started "$tmp/killed_later"; then
  rank1="$(cat "$tmp/killed_later/rank1.pid")"
  echo LOST > "$tmp/killed_later/go.tmp" && mv "$tmp/killed_later/go.tmp" "$tmp/killed_later/go-0"
  wait_for said_lost || fail "killed_later: rank 0's end not said: $(cat "$tmp/killed_later/out")"
  kill -KILL "$rank1"
else
  fail "killed_later: the fake ranks did not start: $(cat "$tmp/killed_later/out")"
  kill -KILL "$launcher"
fi
wait "$launcher"
rc=$?
[ "$rc" = 1 ] || fail "killed_later: exit $rc, not 1: $(cat "$tmp/killed_later/out")"
grep -q "hap-launch: rank 1 was killed by SIGKILL" "$tmp/killed_later/out" \
  || fail "killed_later: rank 1 not named: $(cat "$tmp/killed_later/out")"

# A real rank whose peer dies says so in the rendezvous directory, where
# hap-launch reads it (rank0.lost-peer); it exits 1 all the same.
mkdir "$tmp/rv-lost"
"$EXECUTOR" --plan "$tmp/mlp.pb" --rank 0 --world 2 --rendezvous "$tmp/rv-lost" --steps 1000000 \
  > "$tmp/lost0.out" 2> "$tmp/lost0.err" &
rank0=$!
"$EXECUTOR" --plan "$tmp/mlp.pb" --rank 1 --world 2 --rendezvous "$tmp/rv-lost" --steps 1000000 \
  > /dev/null 2>&1 &
rank1=$!
training() { grep -q "^step 1 loss" "$tmp/lost0.out"; }
if wait_for training; then
  kill -KILL "$rank1"
else
  fail "the ranks did not train: $(cat "$tmp/lost0.err")"
  kill -KILL "$rank0" "$rank1"
fi
# (bash says "Killed" of rank 1 at the next wait: not this test's output)
{
  wait "$rank0"
  rc=$?
  wait "$rank1"
} 2> /dev/null
[ "$rc" = 1 ] || fail "a rank whose peer was killed: exit $rc, not 1: $(cat "$tmp/lost0.err")"
[ -f "$tmp/rv-lost/rank0.lost-peer" ] || fail "a rank whose peer was killed did not say so"
grep -q "connection to a peer failed" "$tmp/lost0.err" || fail "lost peer: $(cat "$tmp/lost0.err")"

# hap-launch run through a symlink in another directory (an install's
# /usr/local/bin/hap-launch -> /opt/hap/bin/hap-launch) looked for
# hap-executor next to the link, and failed; it now finds the one next to
# the binary.
mkdir -p "$tmp/bin"
ln -s "$(readlink -f "$LAUNCH")" "$tmp/bin/hap-launch"
timeout 120 "$tmp/bin/hap-launch" --plan "$tmp/mlp.pb" --steps 1 > "$tmp/linked.out" \
  2> "$tmp/linked.err"
rc=$?
[ "$rc" = 0 ] || fail "hap-launch through a symlink: exit $rc: $(cat "$tmp/linked.err")"
grep -q "^final loss" "$tmp/linked.out" || fail "hap-launch through a symlink did not train"

[ "$failures" = 0 ] || exit 1
echo PASS
