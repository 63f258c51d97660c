#!/bin/bash
# hapctl's output files (plan --save-plan, zoo --export): written whole and
# readable back, and a write that fails (a full device) is an error naming
# the file, with a non-zero exit, never reported as written.
set -u
HAPCTL="$1"
CLUSTER="$2"
fail() { echo "FAIL: $*"; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
model=(--model mlp --layers 2 --hidden 64 --batch 16)

"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --save-plan "$tmp/p.pb" > "$tmp/out" 2>&1 \
  || fail "save: $(cat "$tmp/out")"
[ -s "$tmp/p.pb" ] || fail "--save-plan wrote nothing"
grep -q "wrote plan for" "$tmp/out" || fail "no 'wrote plan' line: $(cat "$tmp/out")"
"$HAPCTL" zoo mlp --export "$tmp/g.json" > "$tmp/out" 2>&1 || fail "export: $(cat "$tmp/out")"
python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["ops"]' "$tmp/g.json" \
  || fail "exported graph is not JSON with ops"

# plan -o json of a graph whose names hold control characters (a tab, a
# newline) is JSON: they were written as they were.
python3 - "$tmp/g.json" "$tmp/ctl.json" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))
g["name"] = "my\tmodel\nv2"
g["ops"][0]["name"] = "first\nop"
json.dump(g, open(sys.argv[2], "w"))
PY
"$HAPCTL" plan --cluster "$CLUSTER" --graph "$tmp/ctl.json" -o json > "$tmp/ctl.out" 2> "$tmp/ctl.err" \
  || fail "plan of names with control characters: $(cat "$tmp/ctl.err")"
python3 - "$tmp/ctl.out" <<'PY' || fail "plan -o json of names with control characters: $(cat "$tmp/ctl.out")"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["model"] == "my\tmodel\nv2", d["model"]
assert any(o["op"] == "first\nop" for o in d["ops"]), [o["op"] for o in d["ops"]]
PY

if [ -w /dev/full ]; then
  out="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --save-plan /dev/full 2>&1)" \
    && fail "--save-plan to a full device exited 0: $out"
  echo "$out" | grep -q "cannot write --save-plan file '/dev/full': No space left on device" \
    || fail "--save-plan error: $out"
  echo "$out" | grep -q "wrote plan for" && fail "reported written: $out"
  out="$("$HAPCTL" zoo mlp --export /dev/full 2>&1)" \
    && fail "--export to a full device exited 0: $out"
  echo "$out" | grep -q "cannot write --export file '/dev/full': No space left on device" \
    || fail "--export error: $out"
  # Standard output as the files: a write that fails there is an error
  # naming it (every command exited 0 with its output lost).
  for cmd in "zoo" "ops -o json" "--help" "plan --cluster $CLUSTER ${model[*]} -o json"; do
    # shellcheck disable=SC2086
    out="$("$HAPCTL" $cmd 2>&1 >/dev/full)" && fail "$cmd > /dev/full exited 0: $out"
    echo "$out" | grep -q "cannot write to standard output: No space left on device" \
      || fail "$cmd > /dev/full: $out"
  done
fi
# A closed standard output is refused before the command runs: the
# --export file took descriptor 1 and the table went into it.
out="$("$HAPCTL" zoo mlp --export "$tmp/closed.json" 2>&1 >&-)" \
  && fail "zoo with standard output closed exited 0: $out"
echo "$out" | grep -q "standard output is closed" || fail "closed stdout: $out"
[ -e "$tmp/closed.json" ] && fail "zoo ran with standard output closed: $(cat "$tmp/closed.json")"
echo PASS
