#!/usr/bin/env bash
# One-time set-up on a fresh Debian 12 machine: build tools if missing, ONNX Runtime headers,
# and a virtual environment in .venv with nmcli (and its test extras) installed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

missing=()
command -v "$PY" >/dev/null || missing+=(python3)
command -v g++ >/dev/null || missing+=(g++)
command -v "$PY" >/dev/null && ! "$PY" -c 'import ensurepip, venv' 2>/dev/null && missing+=(python3-venv)
command -v "$PY" >/dev/null && ! "$PY" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' && missing+=(python3-dev)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then echo "error: install these Debian packages first: ${missing[*]}" >&2; exit 1; fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

bash scripts/fetch-ort-headers.sh
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install ".[test]"
.venv/bin/nmcli --version
