#!/bin/bash
# hap-launch runs a pipeline plan (issue 17 item 3): hapctl plan --pipeline 2
# --save-plan on 4 CPU ranks, then the losses of 4 steps against the SPMD
# plan of the same model and seed (both equal the single-device losses);
# checkpoints saved and resumed across both plans; --profile writes every
# rank's kernel times and hapctl calibrate takes them.
set -u
HAPCTL="$1"
LAUNCH="$2"
CLUSTER="$3"
fail() { echo "FAIL: $*"; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
model=(--model gpt --layers 2 --hidden 32 --heads 4 --ffn 64 --seq 8 --vocab 50 --batch 16)

"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --pipeline 2 --microbatches 4 \
  --save-plan "$tmp/pipe.pb" > "$tmp/plan" 2>&1 || fail "pipeline plan: $(cat "$tmp/plan")"
grep -q "wrote plan for 4 ranks" "$tmp/plan" || fail "plan: $(cat "$tmp/plan")"
"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --save-plan "$tmp/spmd.pb" > "$tmp/plan2" 2>&1 \
  || fail "spmd plan: $(cat "$tmp/plan2")"

timeout 120 "$LAUNCH" --plan "$tmp/pipe.pb" --steps 4 > "$tmp/pipe.out" 2>&1 \
  || fail "pipeline run: $(cat "$tmp/pipe.out")"
grep -q "^pipeline: 2 stages, 4 microbatches of 4 samples (1F1B)" "$tmp/pipe.out" \
  || fail "no pipeline line: $(cat "$tmp/pipe.out")"
timeout 120 "$LAUNCH" --plan "$tmp/spmd.pb" --steps 4 > "$tmp/spmd.out" 2>&1 \
  || fail "spmd run: $(cat "$tmp/spmd.out")"
python3 - "$tmp/pipe.out" "$tmp/spmd.out" <<'PY' || fail "losses differ: $(cat "$tmp/pipe.out" "$tmp/spmd.out")"
import re, sys
def losses(path):
    return [float(m.group(1)) for m in re.finditer(r"^step \d+ loss ([0-9.]+)", open(path).read(), re.M)]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert len(a) == 4 and len(b) == 4, (a, b)
for x, y in zip(a, b):
    assert abs(x - y) <= 2e-5 * abs(y) + 2e-6, (a, b)
assert abs(a[0] - a[-1]) > 1e-4, a
PY

# --overlap on: the stages' gradient buckets start in the last microbatch's
# backward on a communication thread with the group's second Gloo context;
# run so, and with the same plan's collectives in line (--overlap off), the
# losses are the in-line pipeline's.
"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --pipeline 2 --microbatches 4 --overlap on \
  --save-plan "$tmp/pipe_ov.pb" > "$tmp/plan_ov" 2>&1 || fail "overlap plan: $(cat "$tmp/plan_ov")"
timeout 120 "$LAUNCH" --plan "$tmp/pipe_ov.pb" --steps 4 > "$tmp/pipe_ov.out" 2>&1 \
  || fail "overlapped pipeline run: $(cat "$tmp/pipe_ov.out")"
timeout 120 "$LAUNCH" --plan "$tmp/pipe_ov.pb" --steps 4 --overlap off > "$tmp/pipe_inline.out" \
  2>&1 || fail "in-line run: $(cat "$tmp/pipe_inline.out")"
python3 - "$tmp/pipe.out" "$tmp/pipe_ov.out" "$tmp/pipe_inline.out" <<'PY' \
  || fail "overlapped losses differ: $(cat "$tmp/pipe_ov.out" "$tmp/pipe_inline.out")"
import re, sys
def losses(path):
    return [float(m.group(1)) for m in re.finditer(r"^step \d+ loss ([0-9.]+)", open(path).read(), re.M)]
a = losses(sys.argv[1])
for other in sys.argv[2:]:
    b = losses(other)
    assert len(b) == 4, (other, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= 2e-5 * abs(x) + 2e-6, (other, a, b)
PY

# Checkpoints (every stage's ranks write their slices, committed over the
# world): 4 steps saved, resumed to 8 on the same pipeline plan, equal the
# uninterrupted 8 steps bit for bit; a pipeline checkpoint resumes on the
# SPMD plan and an SPMD checkpoint on the pipeline plan (resume onto any
# plan), both equal to the uninterrupted run within float summation order.
run() {  # run NAME ARGS...: hap-launch ARGS > $tmp/NAME.out
  local name="$1"; shift
  timeout 120 "$LAUNCH" "$@" > "$tmp/$name.out" 2>&1 || fail "$name: $(cat "$tmp/$name.out")"
}
run pipe8 --plan "$tmp/pipe.pb" --steps 8
run pipe4 --plan "$tmp/pipe.pb" --steps 4 --checkpoint-dir "$tmp/ck"
grep -q "^checkpoint: 4 steps done" "$tmp/pipe4.out" || fail "no checkpoint: $(cat "$tmp/pipe4.out")"
run pipe_resumed --plan "$tmp/pipe.pb" --steps 8 --resume "$tmp/ck"
run spmd_from_pipe --plan "$tmp/spmd.pb" --steps 8 --resume "$tmp/ck"
run spmd4 --plan "$tmp/spmd.pb" --steps 4 --checkpoint-dir "$tmp/sck"
run pipe_from_spmd --plan "$tmp/pipe.pb" --steps 8 --resume "$tmp/sck"
# --init-weights: the pipeline checkpoint exported whole starts both plans
# from the same parameters (fresh optimizer state): the same losses.
"$HAPCTL" checkpoint export "$tmp/ck" -o "$tmp/w.safetensors" > "$tmp/export" 2>&1 \
  || fail "export: $(cat "$tmp/export")"
run pipe_init --plan "$tmp/pipe.pb" --steps 2 --init-weights "$tmp/w.safetensors"
run spmd_init --plan "$tmp/spmd.pb" --steps 2 --init-weights "$tmp/w.safetensors"
python3 - "$tmp" <<'PY' || fail "resumed losses differ"
import re, sys
def losses(name):
    text = open(f"{sys.argv[1]}/{name}.out").read()
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^step (\d+) loss ([0-9.]+)", text, re.M)}
full = losses("pipe8")
assert sorted(full) == list(range(8)), full
resumed = losses("pipe_resumed")
assert sorted(resumed) == [4, 5, 6, 7], resumed
for s in resumed:
    assert resumed[s] == full[s], ("same plan, resumed", s, resumed[s], full[s])
for name in ("spmd_from_pipe", "pipe_from_spmd"):
    other = losses(name)
    assert sorted(other) == [4, 5, 6, 7], (name, other)
    for s in other:
        assert abs(other[s] - full[s]) <= 2e-5 * abs(full[s]) + 2e-6, (name, s, other[s], full[s])
a, b = losses("pipe_init"), losses("spmd_init")
assert sorted(a) == [0, 1] and sorted(b) == [0, 1], (a, b)
for s in a:
    assert abs(a[s] - b[s]) <= 2e-5 * abs(b[s]) + 2e-6, ("init-weights", s, a[s], b[s])
assert abs(a[0] - full[0]) > 1e-3, ("the weights were not loaded", a[0], full[0])
PY

# --profile on a pipeline plan: every rank's kernel times at the microbatch
# size; hapctl calibrate takes them (op-type scales and the optimizer) alone
# and beside an SPMD run's.
run pipe_prof --plan "$tmp/pipe.pb" --steps 5 --profile "$tmp/pprof"
run spmd_prof --plan "$tmp/spmd.pb" --steps 5 --profile "$tmp/sprof"
for r in 0 1 2 3; do
  [ -s "$tmp/pprof.rank$r.json" ] || fail "no profile of rank $r: $(cat "$tmp/pipe_prof.out")"
done
"$HAPCTL" calibrate --cluster "$CLUSTER" --plan "$tmp/pipe.pb" --profile "$tmp/pprof" \
  --out "$tmp/cal_pipe.json" > "$tmp/cal_pipe" 2>&1 || fail "calibrate (pipeline): $(cat "$tmp/cal_pipe")"
"$HAPCTL" calibrate --cluster "$CLUSTER" --plan "$tmp/pipe.pb" --profile "$tmp/pprof" \
  --plan "$tmp/spmd.pb" --profile "$tmp/sprof" --out "$tmp/cal_both.json" > "$tmp/cal_both" 2>&1 \
  || fail "calibrate (both): $(cat "$tmp/cal_both")"
python3 - "$tmp/cal_pipe.json" <<'PY' || fail "pipeline calibration: $(cat "$tmp/cal_pipe")"
import json, sys
c = json.load(open(sys.argv[1]))
devices = [d for n in c["nodes"] for d in n["devices"]]
assert len(devices) == 4, devices
for d in devices:
    scales = d.get("opTimeScale", {})
    assert "matmul" in scales and scales["matmul"] > 0, (d["id"], scales)
    assert d.get("optimizerSecondsPerElement", 0) > 0, d
PY
"$HAPCTL" plan --cluster "$tmp/cal_pipe.json" "${model[@]}" --pipeline 2 --microbatches 4 \
  > "$tmp/plan_cal" 2>&1 || fail "plan from the pipeline calibration: $(cat "$tmp/plan_cal")"
echo PASS
