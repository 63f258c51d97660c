#!/usr/bin/env bash
# Runs a Python unittest file with Debian's /usr/bin/python3.
set -euo pipefail
exec /usr/bin/python3 "$1"
