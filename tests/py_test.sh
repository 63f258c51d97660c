#!/usr/bin/env bash
# Runs a Python test that needs no PyTorch with Debian's /usr/bin/python3.
# Usage: py_test.sh TEST.py [NAME=RUNFILES_PATH ...] (exported as absolute paths).
set -euo pipefail
test_py="$1"
shift
for kv in "$@"; do
  export "${kv%%=*}=$PWD/${kv#*=}"
done
exec /usr/bin/python3 "$test_py"
