#!/usr/bin/env bash
# Runs a PyTorch-based Python test with Debian's /usr/bin/python3 (the only
# interpreter with python3-torch; the `python3` first on PATH may lack it).
# Usage: torch_test.sh TEST.py [NAME=RUNFILES_PATH ...]
# Each NAME=path is exported as NAME=<absolute path> (e.g. HAPCTL, EXPORT_FX).
set -euo pipefail
test_py="$1"
shift
for kv in "$@"; do
  export "${kv%%=*}=$PWD/${kv#*=}"
done
# One core per test; Bazel may run two tests at once on a 2-core machine.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
if ! /usr/bin/python3 -c "import torch" >/dev/null 2>&1; then
  echo "SKIP: python3-torch not installed (/usr/bin/python3 cannot import torch)"
  if [ -n "${XML_OUTPUT_FILE:-}" ]; then
    name="$(basename "$test_py" .py)"
    cat >"$XML_OUTPUT_FILE" <<XML
<?xml version="1.0" encoding="UTF-8"?>
<testsuites><testsuite name="$name" tests="1" skipped="1"><testcase classname="$name" name="$name"><skipped message="python3-torch not installed"/></testcase></testsuite></testsuites>
XML
  fi
  exit 0
fi
exec /usr/bin/python3 "$test_py"
