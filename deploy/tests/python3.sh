#!/usr/bin/env bash
# Runs a deploy/ test with Debian's Python (python3-yaml); paths come in the environment.
exec /usr/bin/python3 "$@"
