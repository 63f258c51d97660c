#!/bin/bash
# hapctl's connection and output flags may come before the command, as
# with kubectl (`hapctl --server H:P get nodes` said "unknown command
# '--server'"); anything else before the command is an error naming it.
# Each verb takes only its kinds of resource (`hapctl delete job train`
# deleted the plan plans/train; `stop plan p` stopped deployments/p).
set -u
HAPCTL="$1"
CLUSTER="$2"
fail() { echo "FAIL: $*"; exit 1; }
model=(--model mlp --layers 2 --hidden 64 --batch 16)

# -o before `plan`: the same JSON as after it.
before="$("$HAPCTL" -o json plan --cluster "$CLUSTER" "${model[@]}" 2>&1)" \
  || fail "-o before plan: $before"
after="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" -o json 2>&1)" \
  || fail "-o after plan: $after"
# The same plan (the timings aside).
python3 - "$before" "$after" <<'PY' || fail "-o json before and after plan differ"
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:])
for d in (a, b):
    for k in [k for k in d if k.endswith("_seconds") and "synthesis" in k]:
        del d[k]
assert a == b, (a, b)
PY

# --server (both spellings) and --timeout before a client verb: used, so
# the error is the connection's to the port named, not "unknown command".
# Port 1 on 127.0.0.1: nothing listens there.
for flags in "--server 127.0.0.1:1 --timeout 3" "--server=127.0.0.1:1 --timeout=3"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $flags get nodes 2>&1)" && fail "$flags get nodes exited 0: $out"
  echo "$out" | grep -q "127.0.0.1:1" || fail "$flags: the server flag was not used: $out"
  echo "$out" | grep -q "unknown command" && fail "$flags: $out"
done

# Any other flag before the command is named; a flag without its value too.
out="$("$HAPCTL" --wait get plans 2>&1)" && fail "--wait before the command exited 0"
echo "$out" | grep -q "'--wait' before the command" || fail "--wait: $out"
out="$("$HAPCTL" --server 2>&1)" && fail "--server alone exited 0"
echo "$out" | grep -q "'--server' needs a value" || fail "--server alone: $out"
# A kind of resource the verb does not take is named, before any call (port
# 1: a call would fail to connect instead).
for cmd in "delete things d" "cancel job j" "stop plan p" "describe things n" \
           "watch deployment d" "deploy job j" "create node n" "get things"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd --server 127.0.0.1:1 --timeout 3 2>&1)" && fail "$cmd exited 0: $out"
  kind=$(echo "$cmd" | cut -d' ' -f2)
  echo "$out" | grep -q "hapctl $(echo "$cmd" | cut -d' ' -f1): '$kind' is not" \
    || fail "$cmd: $out"
  echo "$out" | grep -q "127.0.0.1:1" && fail "$cmd called the server: $out"
done
# create plan and create job take the optimizer as hapctl plan does:
# anything but sgd, momentum or adam is refused before any call (it was
# sent as plain SGD, a typo such as 'adamw' planning without Adam state).
for cmd in "create plan" "create job --id j --checkpoint-dir /tmp/x"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd --model mlp --optimizer adamw --server 127.0.0.1:1 --timeout 3 2>&1)" \
    && fail "$cmd --optimizer adamw exited 0: $out"
  echo "$out" | grep -q "optimizer must be sgd, momentum or adam, got 'adamw'" \
    || fail "$cmd --optimizer adamw: $out"
done
# A flag of another command is refused naming it, before any call (it was
# dropped: 'create plan --steps 5' planned, 'get plans --wait' listed).
for case in "create plan --model mlp --steps 5|create plan: --steps" \
            "create job --id j --wait|create job: --wait" \
            "create job --id j --resume /ck|create job: --resume" \
            "create job --id j --init-weights w.st|create job: --init-weights" \
            "get plans --wait|get plans: --wait" \
            "deploy plan p --model mlp|deploy plan: --model" \
            "describe plan p --executor d=127.0.0.1:2|describe plan: --executor" \
            "stop job j --no-join|stop job: --no-join" \
            "delete plan p --layers 4|delete plan: --layers"; do
  IFS='|' read -r cmd want <<< "$case"
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd --server 127.0.0.1:1 --timeout 3 2>&1)" && fail "$cmd exited 0: $out"
  echo "$out" | grep -qF "hapctl $want is not one of its flags" || fail "$cmd: $out"
  echo "$out" | grep -q "127.0.0.1:1" && fail "$cmd called the server: $out"
done

# -o before `checkpoint export` is refused: export's -o is its output file,
# and the leading '-o json' wrote the safetensors into a file named 'json'.
for o in "-o json" "--output=json"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $o checkpoint export /nonexistent/ckpt 2>&1)" && fail "$o checkpoint export exited 0"
  echo "$out" | grep -qF "before 'checkpoint export': its -o is the output file" \
    || fail "$o checkpoint export: $out"
done

# A word that is no flag's and no argument is named, before any call (it
# was dropped: 'plan vit' planned gpt, 'delete plan a b' deleted a only,
# 'create plan --no-sfb true' planned).
for cmd in "get nodes extra" "describe plan p extra" "create plan --model mlp extra" \
           "delete plan a b" "watch plan p q" "stop deployment d x" "cancel plan p q" \
           "deploy plan p extra" "create plan --no-sfb true"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd --server 127.0.0.1:1 --timeout 3 2>&1)" && fail "$cmd exited 0: $out"
  echo "$out" | grep -q "hapctl $(echo "$cmd" | cut -d' ' -f1): unexpected argument '$(echo "$cmd" | awk '{print $NF}')'" \
    || fail "$cmd: $out"
  echo "$out" | grep -q "127.0.0.1:1" && fail "$cmd called the server: $out"
done
# kubectl's 'get node NAME' is pointed to describe (it listed every node).
out="$("$HAPCTL" get nodes n1 --server 127.0.0.1:1 2>&1)" && fail "get nodes n1 exited 0: $out"
echo "$out" | grep -qF "unexpected argument 'n1' after 'nodes' (one resource: hapctl describe node n1)" \
  || fail "get nodes n1: $out"
out="$("$HAPCTL" plan vit --cluster "$CLUSTER" "${model[@]}" 2>&1)" && fail "plan vit exited 0: $out"
echo "$out" | grep -q "hapctl plan: unexpected argument 'vit'" || fail "plan vit: $out"
for cmd in "ops extra" "calibrate extra" "validate a b" "checkpoint inspect d extra"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd 2>&1)" && fail "$cmd exited 0: $out"
  echo "$out" | grep -q "error: hapctl $(echo "$cmd" | cut -d' ' -f1): unexpected argument '$(echo "$cmd" | awk '{print $NF}')'" \
    || fail "$cmd: $out"
done
# A server address gRPC would misread is refused naming where it came from
# (a port past 65535 was taken modulo 65536: 127.0.0.1:99999 called port
# 34463; none or a word was port 0; an empty --server fell back to
# HAPCTL_SERVER or 127.0.0.1:7070).
for server in "" "127.0.0.1" "127.0.0.1:99999" "127.0.0.1:abc" "127.0.0.1:0" "::1:7070" "a b:1"; do
  out="$(HAPCTL_SERVER=127.0.0.1:1 "$HAPCTL" get nodes --server "$server" --timeout 3 2>&1)" \
    && fail "--server '$server' exited 0: $out"
  echo "$out" | grep -qF -- "--server must be HOST:PORT with a port from 1 to 65535 (or a gRPC target such as unix:PATH), got '$server'" \
    || fail "--server '$server': $out"
done
out="$(HAPCTL_SERVER=127.0.0.1:70000 "$HAPCTL" get nodes --timeout 3 2>&1)" \
  && fail "HAPCTL_SERVER=127.0.0.1:70000 exited 0: $out"
echo "$out" | grep -qF "HAPCTL_SERVER must be HOST:PORT" || fail "HAPCTL_SERVER: $out"
# --timeout not positive: named with its value.
for t in 0 -5; do
  out="$("$HAPCTL" --timeout "$t" get nodes --server 127.0.0.1:1 2>&1)" && fail "--timeout $t exited 0"
  echo "$out" | grep -qF -- "--timeout must be a positive number of seconds, got '$t'" \
    || fail "--timeout $t: $out"
done
# An executor's address as the server's (the planner dials it).
for cmd in "deploy plan p" "create job --id j --checkpoint-dir /tmp/x --model mlp"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd --executor cpu0=127.0.0.1:99999 --server 127.0.0.1:1 --timeout 3 2>&1)" \
    && fail "$cmd --executor cpu0=127.0.0.1:99999 exited 0: $out"
  echo "$out" | grep -qF -- "--executor cpu0=HOST:PORT must be HOST:PORT with a port from 1 to 65535" \
    || fail "$cmd --executor cpu0=127.0.0.1:99999: $out"
done
# Well-formed addresses reach the connection (port 1: refused there).
for server in "127.0.0.1:1" "[::1]:1" "ipv4:127.0.0.1:1"; do
  out="$("$HAPCTL" get nodes --server "$server" --timeout 3 2>&1)" && fail "$server exited 0"
  echo "$out" | grep -q "must be HOST:PORT" && fail "--server '$server' refused: $out"
  echo "$out" | grep -q "UNAVAILABLE" || fail "--server '$server': $out"
done

# An empty --devices list is refused (it planned on every device).
for devices in "" ","; do
  out="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --devices "$devices" 2>&1)" \
    && fail "plan --devices '$devices' exited 0: $out"
  echo "$out" | grep -qF "devices names no device, got '$devices'" || fail "plan --devices '$devices': $out"
  out="$("$HAPCTL" create plan --model mlp --devices "$devices" --server 127.0.0.1:1 --timeout 3 2>&1)" \
    && fail "create plan --devices '$devices' exited 0: $out"
  echo "$out" | grep -qF "devices names no device, got '$devices'" \
    || fail "create plan --devices '$devices': $out"
done

# hapctl plan's optimizer flags are checked with or without --save-plan
# (they were read only to save the plan: '--lr -1' planned and exited 0),
# each named with its value.
for case in "--lr|-1|--lr must be positive, got '-1'" \
            "--lr|nan|flag --lr must be a number, got 'nan'" \
            "--momentum|1.5|--momentum must be from 0 to below 1, got '1.5'" \
            "--weight-decay|-0.1|--weight-decay must not be negative, got '-0.1'" \
            "--clip-norm|-2|--clip-norm must not be negative, got '-2'" \
            "--seed|-1|flag --seed must be an integer from 0"; do
  IFS='|' read -r flag value want <<< "$case"
  out="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" "$flag" "$value" 2>&1)" \
    && fail "plan $flag $value exited 0: $out"
  echo "$out" | grep -qF -- "$want" || fail "plan $flag $value: $out"
  # create plan and create job by the same rules, before any call (they
  # sent --momentum 1.5 and --lr -1 to the planner, which named the proto
  # fields instead of the flags).
  for cmd in "create plan" "create job --id j --checkpoint-dir /tmp/x"; do
    # shellcheck disable=SC2086
    out="$("$HAPCTL" $cmd --model mlp "$flag" "$value" --server 127.0.0.1:1 --timeout 3 2>&1)" \
      && fail "$cmd $flag $value exited 0: $out"
    echo "$out" | grep -qF -- "$want" || fail "$cmd $flag $value: $out"
  done
done
# deploy plan / create job: a data flag the executors would not use is
# refused before any call ('--data npy:D --data-path X' ran on D with X
# dropped; --shuffle with synthetic data failed every rank once deployed;
# --data '' ran on synthetic data; a misspelt spec reached every executor).
for cmd in "deploy plan p" "create job --id j --checkpoint-dir /tmp/x --model mlp"; do
  for case in "--data-path /d|--data-path is the WikiText-2 directory or split of --data wikitext; with --data synthetic it would be ignored" \
              "--data npy:/d --data-path /d|with --data npy:/d it would be ignored" \
              "--shuffle 3|--shuffle applies to --data npy:DIR and tokens:FILE only, not --data synthetic" \
              "--data wikitext --shuffle 3|not --data wikitext" \
              "--data npyy:/d|--data must be synthetic, wikitext, npy:DIR or tokens:FILE[:uint16|uint32], got 'npyy:/d'"; do
    IFS='|' read -r flags want <<< "$case"
    # shellcheck disable=SC2086
    out="$("$HAPCTL" $cmd $flags --server 127.0.0.1:1 --timeout 3 2>&1)" && fail "$cmd $flags exited 0: $out"
    echo "$out" | grep -qF -- "$want" || fail "$cmd $flags: $out"
    echo "$out" | grep -q "127.0.0.1:1" && fail "$cmd $flags called the server: $out"
  done
  out="$("$HAPCTL" $cmd --data "" --server 127.0.0.1:1 --timeout 3 2>&1)" && fail "$cmd --data '' exited 0: $out"
  echo "$out" | grep -qF -- "--data must be synthetic, wikitext, npy:DIR or tokens:FILE[:uint16|uint32], got ''" \
    || fail "$cmd --data '': $out"
  # The data flags each form takes still reach the call (port 1: refused there).
  for flags in "--data wikitext --data-path /d" "--data npy:/d --shuffle 3" "--data tokens:/t:uint32"; do
    # shellcheck disable=SC2086
    out="$("$HAPCTL" $cmd $flags --server 127.0.0.1:1 --timeout 3 2>&1)" && fail "$cmd $flags exited 0: $out"
    echo "$out" | grep -q "UNAVAILABLE" || fail "$cmd $flags: $out"
  done
done
# --momentum beside --optimizer adam is refused (Adam keeps its own moments:
# it was written into the plan and never used), in plan, create plan and
# create job alike, before any call.
out="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --optimizer adam --momentum 0.5 2>&1)" \
  && fail "plan --optimizer adam --momentum 0.5 exited 0: $out"
echo "$out" | grep -qF -- "--momentum is SGD's (--optimizer sgd or momentum); --optimizer adam would ignore it, got '0.5'" \
  || fail "plan --optimizer adam --momentum 0.5: $out"
for cmd in "create plan --model mlp" "create job --id j --checkpoint-dir /tmp/x --model mlp"; do
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd --optimizer adam --momentum 0.5 --server 127.0.0.1:1 --timeout 3 2>&1)" \
    && fail "$cmd --optimizer adam --momentum 0.5 exited 0: $out"
  echo "$out" | grep -qF -- "--optimizer adam would ignore it" || fail "$cmd adam momentum: $out"
  echo "$out" | grep -q "127.0.0.1:1" && fail "$cmd adam momentum called the server: $out"
done
"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --optimizer sgd --momentum 0.5 > /dev/null 2>&1 \
  || fail "plan --optimizer sgd --momentum 0.5 was refused"
# Adam's --beta1, --beta2 and --epsilon: refused beside SGD (never read)
# and outside their ranges, each naming its value; a beta of 0 is taken.
for case in "--optimizer sgd --beta1 0.5|--beta1 is Adam's (--optimizer adam); --optimizer sgd would ignore it, got '0.5'" \
            "--epsilon 1e-6|--epsilon is Adam's (--optimizer adam); --optimizer momentum would ignore it" \
            "--optimizer adam --beta2 1|--beta2 must be from 0 to below 1, got '1'" \
            "--optimizer adam --beta1 -0.1|--beta1 must be from 0 to below 1, got '-0.1'" \
            "--optimizer adam --epsilon 0|--epsilon must be positive, got '0'"; do
  IFS='|' read -r flags want <<< "$case"
  # shellcheck disable=SC2086
  out="$("$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" $flags 2>&1)" && fail "plan $flags exited 0: $out"
  echo "$out" | grep -qF -- "$want" || fail "plan $flags: $out"
done
"$HAPCTL" plan --cluster "$CLUSTER" "${model[@]}" --optimizer adam --beta1 0 --beta2 0.95 \
  --epsilon 1e-6 > /dev/null 2>&1 || fail "plan --optimizer adam --beta1 0 --beta2 0.95 was refused"
# create job: a value the job spec reads as the planner's default is
# refused naming what it would be ('--join-stable 0' waited 30 s), before
# any call. '--max-replans 0' (it allowed 20 re-plans, then was refused) and
# '--min-gain 0' (it needed 10%, then was refused) are sent: the fields are
# optional, 0 is none / any gain.
job=(create job --id j --checkpoint-dir /tmp/x --model mlp --server 127.0.0.1:1 --timeout 3)
for case in "--join-stable|0|--join-stable 0 would be 30 s" \
            "--join-stable|1e-10|--join-stable 1e-10 would be 30 s" \
            "--slowdown-threshold|0|--slowdown-threshold 0 would be 0.25" \
            "--min-devices|1|--min-devices 1 would be 2"; do
  IFS='|' read -r flag value want <<< "$case"
  out="$("$HAPCTL" "${job[@]}" "$flag" "$value" 2>&1)" && fail "create job $flag $value exited 0: $out"
  echo "$out" | grep -qF -- "$want" || fail "create job $flag $value: $out"
  echo "$out" | grep -q "127.0.0.1:1" && fail "create job $flag $value called the server: $out"
done
out="$("$HAPCTL" "${job[@]}" --max-replans 1 --min-gain 0.01 --join-stable 0.5 --slowdown-threshold 0.1 --min-devices 2 2>&1)" \
  && fail "create job with positive policy values exited 0: $out"
echo "$out" | grep -q "UNAVAILABLE" || fail "create job with positive policy values: $out"
for zero in --max-replans --min-gain; do
  out="$("$HAPCTL" "${job[@]}" "$zero" 0 2>&1)" && fail "create job $zero 0 exited 0: $out"
  echo "$out" | grep -q "UNAVAILABLE" || fail "create job $zero 0 was not sent: $out"
done
# create plan / create job take --microbatches and --max-seconds as hapctl
# plan does, before any call: microbatches without pipeline stages were
# sent and never read; 0 or a negative budget was the planner's default or
# its error naming a proto field.
for cmd in "create plan --model mlp" "create job --id j --checkpoint-dir /tmp/x --model mlp"; do
  for case in "--microbatches 4|--microbatches needs --pipeline auto or N" \
              "--pipeline auto --microbatches 0|--microbatches must be a positive integer, got '0'" \
              "--max-seconds 0|--max-seconds must be positive, got '0'" \
              "--max-seconds -5|--max-seconds must be positive, got '-5'"; do
    IFS='|' read -r flags want <<< "$case"
    # shellcheck disable=SC2086
    out="$("$HAPCTL" $cmd $flags --server 127.0.0.1:1 --timeout 3 2>&1)" && fail "$cmd $flags exited 0: $out"
    echo "$out" | grep -qF -- "$want" || fail "$cmd $flags: $out"
    echo "$out" | grep -q "127.0.0.1:1" && fail "$cmd $flags called the server: $out"
  done
  # shellcheck disable=SC2086
  out="$("$HAPCTL" $cmd --pipeline 2 --microbatches 4 --max-seconds 5 --server 127.0.0.1:1 --timeout 3 2>&1)" \
    && fail "$cmd --pipeline 2 --microbatches 4 exited 0: $out"
  echo "$out" | grep -q "UNAVAILABLE" || fail "$cmd --pipeline 2 --microbatches 4: $out"
done
# deploy plan: checkpoint flags the executors would drop are refused before
# any call (--checkpoint-every without --checkpoint-dir saved nothing;
# --checkpoint-keep 0 kept 3).
for case in "--checkpoint-every 5|--checkpoint-every needs --checkpoint-dir" \
            "--checkpoint-keep 2|--checkpoint-keep needs --checkpoint-dir" \
            "--checkpoint-dir /tmp/x --checkpoint-keep 0|--checkpoint-keep 0 would be 3"; do
  IFS='|' read -r flags want <<< "$case"
  # shellcheck disable=SC2086
  out="$("$HAPCTL" deploy plan p $flags --server 127.0.0.1:1 --timeout 3 2>&1)" && fail "deploy $flags exited 0: $out"
  echo "$out" | grep -qF -- "$want" || fail "deploy $flags: $out"
  echo "$out" | grep -q "127.0.0.1:1" && fail "deploy $flags called the server: $out"
done
out="$("$HAPCTL" deploy plan p --checkpoint-dir /tmp/x --checkpoint-every 0 --checkpoint-keep 1 --server 127.0.0.1:1 --timeout 3 2>&1)" \
  && fail "deploy with checkpoint flags exited 0: $out"
echo "$out" | grep -q "UNAVAILABLE" || fail "deploy with checkpoint flags: $out"
# --resume with --init-weights: an executor resumed and never read the
# weights; refused as hap-launch refuses it, before any call.
out="$("$HAPCTL" deploy plan p --checkpoint-dir /tmp/x --resume /tmp/x --init-weights /tmp/w.safetensors --server 127.0.0.1:1 --timeout 3 2>&1)" \
  && fail "deploy --resume --init-weights exited 0: $out"
echo "$out" | grep -qF -- "--resume and --init-weights exclude each other" || fail "deploy --resume --init-weights: $out"
# hapctl --help names every checkpoint command (verify was left out).
help="$("$HAPCTL" --help 2>&1)" || fail "--help: $help"
for sub in inspect export verify; do
  echo "$help" | grep -qE "^  checkpoint $sub DIR" || fail "--help has no 'checkpoint $sub': $help"
done
echo PASS
