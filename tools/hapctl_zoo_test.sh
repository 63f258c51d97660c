#!/bin/bash
# Zoo parameters as flags: `hapctl zoo MODEL` lists them with their
# defaults; a parameter with '_' is taken as --moe-group-size like every
# other flag (only --moe_group_size was) and as its own name, with the same
# plan; both at once are refused.
set -u
HAPCTL="$1"
CLUSTER="$2"
fail() { echo "FAIL: $*"; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
model=(--model moe --layers 2 --experts 4 --batch 64)

"$HAPCTL" zoo moe > "$tmp/zoo" 2>&1 || fail "zoo moe: $(cat "$tmp/zoo")"
grep -q -- "--moe-group-size 0" "$tmp/zoo" || fail "zoo moe lists no --moe-group-size: $(cat "$tmp/zoo")"
grep -q -- "--layers 12" "$tmp/zoo" || fail "zoo moe lists no --layers: $(cat "$tmp/zoo")"

"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --moe-group-size 8 -o json > "$tmp/hyphen.json" 2>&1 \
  || fail "--moe-group-size: $(cat "$tmp/hyphen.json")"
"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --moe_group_size 8 -o json > "$tmp/under.json" 2>&1 \
  || fail "--moe_group_size: $(cat "$tmp/under.json")"
"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" -o json > "$tmp/default.json" 2>&1 \
  || fail "default: $(cat "$tmp/default.json")"
python3 - "$tmp/hyphen.json" "$tmp/under.json" "$tmp/default.json" <<'PY' || fail "json"
import json, sys
h, u, d = (json.load(open(f)) for f in sys.argv[1:])
assert h["predicted_step_seconds"] == u["predicted_step_seconds"], (h, u)
# The flag was taken: grouped routing changes the graph and its price.
assert h["predicted_step_seconds"] != d["predicted_step_seconds"], (h, d)
PY

out="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --moe-group-size 8 --moe_group_size 4 2>&1)" \
  && fail "both spellings accepted: $out"
echo "$out" | grep -q "are one zoo parameter; give it once" || fail "both: $out"

# zoo, ops and validate take -o table|json as plan does: another format is
# refused naming it (zoo printed a table without its header, ops and
# validate a table). `ops --help` is its usage, not the op list.
"$HAPCTL" zoo mlp --export "$tmp/g.json" > /dev/null 2>&1 || fail "zoo --export"
for cmd in "zoo" "zoo mlp" "ops" "validate $tmp/g.json"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd -o yaml 2>&1)" && fail "$cmd -o yaml exited 0: $out"
  echo "$out" | grep -q "\-o must be table or json, got 'yaml'" || fail "$cmd -o yaml: $out"
done
out="$("$HAPCTL" ops --help 2>&1)" || fail "ops --help: $out"
echo "$out" | grep -q "usage: hapctl ops" || fail "ops --help: $out"
echo "$out" | grep -q "^linear " && fail "ops --help listed the ops: $out"
# A graph file has its own model and shapes: --model or a zoo parameter
# beside --graph is refused naming it (it was dropped: '--graph g.json
# --layers 4' planned the file's layers), in plan and create plan alike.
for extra in "--model mlp" "--layers 4" "--set layers=4"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" plan --cluster "$CLUSTER" --graph "$tmp/g.json" $extra 2>&1)" \
    && fail "plan --graph $extra exited 0: $out"
  # shellcheck disable=SC2086
  out2="$("$HAPCTL" create plan --graph "$tmp/g.json" $extra --server 127.0.0.1:1 --timeout 3 2>&1)" \
    && fail "create plan --graph $extra exited 0: $out2"
  for o in "$out" "$out2"; do
    if [ "$extra" = "--model mlp" ]; then
      echo "$o" | grep -qF "and --model 'mlp' are two models: give one" || fail "$extra: $o"
    else
      echo "$o" | grep -qF "'layers' is a zoo model's parameter; the graph file" || fail "$extra: $o"
    fi
    echo "$o" | grep -q "127.0.0.1:1" && fail "create plan --graph $extra called the server: $o"
  done
done

# --export writes one model: with none or several named it is refused (the
# file held the last model of the list alone), and nothing is written.
for names in "" "mlp gpt"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" zoo $names --export "$tmp/several.json" 2>&1)" \
    && fail "zoo '$names' --export exited 0: $out"
  echo "$out" | grep -q "\-\-export writes one model's graph: name one model" \
    || fail "zoo '$names' --export: $out"
  [ -e "$tmp/several.json" ] && fail "zoo '$names' --export wrote a file"
done
# A model that fails prints nothing on stdout (there was a header, or half
# a JSON list), its error on stderr.
for fmt in table json; do
  out="$("$HAPCTL" zoo mlp nosuch -o "$fmt" 2>/dev/null)" && fail "zoo mlp nosuch exited 0"
  [ -z "$out" ] || fail "zoo mlp nosuch -o $fmt printed: $out"
done
# A zoo parameter none of the models listed takes is refused naming it (it
# was dropped: 'zoo --set foo=1' and 'zoo mlp gpt --experts 4' listed the
# defaults); one given twice, as a flag and by --set or by two --set, too
# (the last one given was built).
for args in "--set foo=1" "mlp gpt --experts 4"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" zoo $args 2>&1)" && fail "zoo $args exited 0: $out"
  echo "$out" | grep -qE "zoo parameter '(foo|experts)' is a parameter of none of the models listed" \
    || fail "zoo $args: $out"
done
"$HAPCTL" zoo mlp vit --heads 4 > /dev/null 2>&1 || fail "zoo mlp vit --heads 4 (vit takes it)"
for args in "--layers 3 --set layers=2" "--set layers=3 --set layers=2"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" zoo mlp $args 2>&1)" && fail "zoo mlp $args exited 0: $out"
  echo "$out" | grep -qF "zoo parameter 'layers' is given twice (--set layers=2 and" \
    || fail "zoo mlp $args: $out"
  # shellcheck disable=SC2086
  out="$("$HAPCTL" plan --cluster "$CLUSTER" --model mlp $args 2>&1)" && fail "plan $args exited 0: $out"
  echo "$out" | grep -qF "zoo parameter 'layers' is given twice" || fail "plan $args: $out"
done
# The same flag twice was taken, the last value built ('--layers 2 --layers
# 3' planned 3 layers).
for cmd in "zoo mlp" "plan --cluster $CLUSTER --model mlp"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd --layers 2 --layers 3 2>&1)" && fail "$cmd --layers 2 --layers 3 exited 0: $out"
  echo "$out" | grep -qF "zoo parameter 'layers' is given twice (--layers 2 and --layers 3)" \
    || fail "$cmd --layers 2 --layers 3: $out"
done
# --set batch=N is the batch, not hapctl plan's default beside it: planned
# as --batch N is, and not as the default batch (32 a device) is.
mlp=(plan --cluster "$CLUSTER" --model mlp --layers 2 -o json)
"$HAPCTL" "${mlp[@]}" --set batch=16 > "$tmp/set16.json" 2> "$tmp/set16.err" \
  || fail "plan --set batch=16: $(cat "$tmp/set16.err")"
"$HAPCTL" "${mlp[@]}" --batch 16 > "$tmp/flag16.json" 2>&1 || fail "plan --batch 16"
"$HAPCTL" "${mlp[@]}" > "$tmp/batch_default.json" 2>&1 || fail "plan, default batch"
python3 - "$tmp/set16.json" "$tmp/flag16.json" "$tmp/batch_default.json" <<'PY' \
  || fail "--set batch=16 is not the batch: $(cat "$tmp/set16.json")"
import json, sys
s, f, d = (json.load(open(p)) for p in sys.argv[1:])
for k in ("predicted_step_seconds", "compute_seconds", "memory_bytes_per_device"):
    assert s[k] == f[k], (k, s[k], f[k])
assert s["compute_seconds"] < d["compute_seconds"], (s["compute_seconds"], d["compute_seconds"])
PY
echo PASS
