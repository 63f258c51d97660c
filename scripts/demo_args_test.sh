#!/usr/bin/env bash
# scripts/demo.sh refuses --bin-dir without --no-setup (set-up would build
# and run bazel-bin's binaries, ignoring DIR) before set-up or a build starts.
# setup.sh's dpkg-query and bazel are fakes that note they were called.
#   demo_args_test.sh PATH/TO/demo.sh PATH/TO/setup.sh
set -uo pipefail
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/demo-args-test.XXXXXX")
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/repo/scripts" "$T/path" "$T/bin"
cp "$1" "$T/repo/scripts/demo.sh"
cp "$2" "$T/repo/scripts/setup.sh"
printf '#!/bin/sh\necho "dpkg-query $*" >>"%s/calls"\nprintf "install ok installed"\n' "$T" >"$T/path/dpkg-query"
printf '#!/bin/sh\necho "bazel $*" >>"%s/calls"\nexit 1\n' "$T" >"$T/path/bazel"
chmod +x "$T/path/"*
PATH="$T/path:$PATH" bash "$T/repo/scripts/demo.sh" --bin-dir "$T/bin" >"$T/out" 2>&1
rc=$?
FAILS=0
[ $rc = 2 ] || { echo "FAIL: exit $rc, want 2: $(head -3 "$T/out")"; FAILS=1; }
grep -qF -- "demo: --bin-dir needs --no-setup" "$T/out" ||
  { echo "FAIL: no message: $(head -3 "$T/out")"; FAILS=1; }
[ ! -e "$T/calls" ] || { echo "FAIL: set-up or a build ran: $(sort -u "$T/calls" | head -3)"; FAILS=1; }
[ "$FAILS" = 0 ] && echo "demo_args_test: passed"
[ "$FAILS" = 0 ]
