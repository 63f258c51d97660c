#!/usr/bin/env bash
# Installs every Debian package the project needs. Idempotent; prints nothing
# when everything is already there. Run as root (or with sudo available).
set -euo pipefail

PACKAGES=(
  bazel-bootstrap
  g++
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev
  libglpk-dev glpk-utils
  libgtest-dev libgmock-dev libbenchmark-dev
  libgloo-dev
  libopenblas-dev
  libdnnl-dev
  libsqlite3-dev
  libssl-dev
  python3-torch python3-torchvision python3-torchaudio
  prometheus
  python3-yaml
  chromium
  clang-14 libfuzzer-14-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# deploy/ tests: kubernetes-models validates the rendered manifests offline. Installed with
# npm (when Node.js is there) into deploy/tools/node_modules, which git ignores. kubectl is
# not installed: Debian 12's kubernetes-client (1.20) is too old for the kustomizations, and
# the deploy tests skip without it.
TOOLS="$(cd "$(dirname "$0")/.." && pwd)/deploy/tools"
if command -v npm >/dev/null 2>&1 && [ -f "$TOOLS/package.json" ] &&
   { [ ! -f "$TOOLS/node_modules/kubernetes-models/package.json" ] ||
     [ ! -f "$TOOLS/node_modules/@kubernetes-models/prometheus-operator/package.json" ]; }; then
  echo "setup: installing kubernetes-models into deploy/tools/node_modules" >&2
  (cd "$TOOLS" && npm install --no-audit --no-fund --loglevel=error --package-lock=false \
    >/dev/null) ||
    echo "setup: npm install failed (no registry?); the manifest schema checks will skip" >&2
fi
