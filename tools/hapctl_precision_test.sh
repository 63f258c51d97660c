#!/bin/bash
# hapctl plan --gradient-precision: bf16 gradients halve the data-parallel
# baseline's communication (compute unchanged), the JSON and table say so,
# a saved plan carries the bf16 wire on its gradient sums, bad values named.
set -u
HAPCTL="$1"
CLUSTER="$2"
PLAN_PROTO="$3"  # proto/hap/v1/plan.proto (its imports beside it)
PROTO_DIR="$(dirname "$(dirname "$(dirname "$PLAN_PROTO")")")"
fail() { echo "FAIL: $*"; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
model=(--model gpt --layers 2 --hidden 512 --heads 4 --ffn 1024 --seq 32 --vocab 4000 --batch 32)

for gp in fp32 bf16; do
  "$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --baseline dp-prop --gradient-precision "$gp" \
    -o json > "$tmp/$gp.json" 2>&1 || fail "$gp: $(cat "$tmp/$gp.json")"
done
python3 - "$tmp/fp32.json" "$tmp/bf16.json" <<'PY' || fail "json: $(cat "$tmp"/*.json)"
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
assert a["gradient_precision"] == "fp32" and b["gradient_precision"] == "bf16", (a, b)
assert abs(a["compute_seconds"] - b["compute_seconds"]) <= 1e-9 * a["compute_seconds"]
r = b["communication_seconds"] / a["communication_seconds"]
assert 0.45 < r < 0.6, r
PY

"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --gradient-precision bf16 \
  --save-plan "$tmp/p.pb" > "$tmp/table" 2>&1 || fail "save: $(cat "$tmp/table")"
grep -q "bf16 gradients" "$tmp/table" || fail "table header: $(head -3 "$tmp/table")"
# The saved plan: some gradient sum with wire_dtype BFLOAT16 (field 20 of
# CollectiveCall), found by protoc's text decoding of the rank programs.
protoc -I"$PROTO_DIR" --decode=hap.v1.Plan hap/v1/plan.proto < "$tmp/p.pb" > "$tmp/p.txt" \
  || fail "protoc decode"
grep -q "wire_dtype: BFLOAT16" "$tmp/p.txt" || fail "no bf16 wire in the saved plan"
grep -q "gradient_precision: PRECISION_BF16" "$tmp/p.txt" || fail "options not recorded"

out="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --gradient-precision fp16 2>&1)" \
  && fail "--gradient-precision fp16 accepted"
echo "$out" | grep -q "must be fp32 or bf16, got 'fp16'" || fail "bad value: $out"
echo PASS
