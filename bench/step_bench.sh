#!/usr/bin/env bash
# Runs bench/step_bench.py with Debian's /usr/bin/python3, the only
# interpreter with python3-torch (the `python3` first on PATH may lack it).
# Usage: step_bench.sh step_bench.py [ARGS ...]
set -euo pipefail
if ! /usr/bin/python3 -c "import torch" >/dev/null 2>&1; then
  echo "step_bench: /usr/bin/python3 cannot import torch (install python3-torch)" >&2
  exit 1
fi
exec /usr/bin/python3 "$@"
