#!/usr/bin/env bash
# scripts/fuzz.sh's command line: a missing value, a bad --seconds, an
# unknown option or target are refused (exit 2, a message) before anything is
# built; --help prints the whole header. bazel and clang++-14 are fakes that
# note they were called.
#   fuzz_args_test.sh PATH/TO/fuzz.sh
set -uo pipefail
SCRIPT=$(realpath "$1")
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/fuzz-args-test.XXXXXX")
trap 'rm -rf "$T"' EXIT
FAILS=0
fail() { echo "FAIL: $*"; FAILS=$((FAILS + 1)); }
mkdir -p "$T/repo/scripts" "$T/path"
cp "$SCRIPT" "$T/repo/scripts/fuzz.sh"
for tool in bazel clang++-14; do
  printf '#!/bin/sh\necho "%s $*" >>"%s/calls"\nexit 1\n' "$tool" "$T" >"$T/path/$tool"
  chmod +x "$T/path/$tool"
done
run() { PATH="$T/path:$PATH" bash "$T/repo/scripts/fuzz.sh" "$@" >"$T/out" 2>&1; }

while IFS='|' read -r args message; do
  # shellcheck disable=SC2086
  run $args
  rc=$?
  [ $rc = 2 ] || fail "'$args': exit $rc, want 2: $(head -3 "$T/out")"
  grep -qF -- "$message" "$T/out" || fail "'$args': no '$message' in: $(head -3 "$T/out")"
done <<'CASES'
--seconds|fuzz: --seconds needs a value
--smoke --junit|fuzz: --junit needs a value
--seconds abc graph|fuzz: --seconds must be a positive whole number, got 'abc'
--seconds 0|fuzz: --seconds must be a positive whole number, got '0'
--bogus|fuzz: unknown option --bogus
graph nosuch|fuzz: unknown target nosuch
CASES
[ ! -e "$T/calls" ] || fail "a build started: $(cat "$T/calls")"

run --help
rc=$?
[ $rc = 0 ] || fail "--help: exit $rc"
grep -qF "reproduce with out/fuzz/bin/TARGET FILE." "$T/out" ||
  fail "--help stops short of the header's end: $(tail -1 "$T/out")"
grep -q "pipefail" "$T/out" && fail "--help prints the code after the header"

if [ "$FAILS" = 0 ]; then echo "fuzz_args_test: all passed"; else echo "fuzz_args_test: $FAILS failed"; fi
[ "$FAILS" = 0 ]
