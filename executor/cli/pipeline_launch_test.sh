#!/bin/bash
# hap-launch runs a pipeline plan (issue 17 item 3): hapctl plan --pipeline 2
# --save-plan on 4 CPU ranks, then the losses of 4 steps against the SPMD
# plan of the same model and seed (both equal the single-device losses);
# flags it cannot honour with pipelines are refused by name.
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

out="$(timeout 60 "$LAUNCH" --plan "$tmp/pipe.pb" --steps 4 --checkpoint-dir "$tmp/ck" 2>&1)" \
  && fail "--checkpoint-dir accepted with a pipeline plan"
echo "$out" | grep -q "checkpoint-dir is not supported with pipeline plans" || fail "refusal: $out"
echo PASS
