#!/bin/bash
# hapctl plan --pipeline: a pipelined plan's table and JSON, --save-plan
# writing every device's stage program, bad values named, and off by
# default (issue 17 items 2 and 3).
set -u
HAPCTL="$1"
CLUSTER="$2"
fail() { echo "FAIL: $*"; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
model=(--model gpt --layers 2 --hidden 128 --heads 4 --ffn 256 --seq 32 --vocab 500 --batch 32)

"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --pipeline 2 --microbatches 4 > "$tmp/table" 2>&1 \
  || fail "pipeline 2: $(cat "$tmp/table")"
grep -q "^pipeline: 2 stages, 4 microbatches of 8 samples" "$tmp/table" || fail "table: $(cat "$tmp/table")"
grep -q "save-plan writes it for hap-launch" "$tmp/table" || fail "no save-plan note"

"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --pipeline 2 -o json > "$tmp/json" 2>&1 \
  || fail "json: $(cat "$tmp/json")"
python3 - "$tmp/json" <<'PY' || fail "json content: $(cat "$tmp/json")"
import json, sys
p = json.load(open(sys.argv[1]))["pipeline"]
assert len(p["stages"]) == 2, p
assert p["stages"][0]["end_op"] == p["stages"][1]["begin_op"]
assert abs(sum(p["stages"][1]["ratios"]) - 1) < 1e-6
assert p["stages"][0]["output_tensor"]
assert p["step_seconds"] > 0 and p["executable"] is True
PY

out="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --pipeline 2 --microbatches 4 \
  --save-plan "$tmp/pipe.pb" 2>&1)" || fail "--save-plan of a pipelined plan: $out"
echo "$out" | grep -q "wrote plan for 8 ranks" || fail "save-plan: $out"
[ -s "$tmp/pipe.pb" ] || fail "no pipeline plan file"

out="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --pipeline sideways 2>&1)" \
  && fail "--pipeline sideways accepted"
echo "$out" | grep -q "must be off, auto or a stage count" || fail "bad value: $out"

# Off by default: the SPMD plan, saved as before.
"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --save-plan "$tmp/p.pb" > "$tmp/off" 2>&1 \
  || fail "default: $(cat "$tmp/off")"
grep -q "^pipeline:" "$tmp/off" && fail "a pipeline without --pipeline"
[ -s "$tmp/p.pb" ] || fail "no plan file by default"
echo PASS
