#!/usr/bin/env bash
# Builds nmcli's extension here for the GPU machine's Python and packs the `nmcli` package (without
# the ORT op library unless NMCLI_PACK_OPS=1) into one xz archive to carry there, so a kernel
# change costs no build time on the lent GPU (BENCHMARKS.md, session 42: 15 MB, where a build
# there took 100-165 s of device time). PYTHON must be that Python's version (3.12 on the GPU
# image) with scikit-build-core, pybind11, cmake and ninja installed; the tree's build/<tag>
# folder keeps rebuilds incremental.
#
#   ~/.pyenv/versions/3.12.1/bin/python -m venv /tmp/py312
#   /tmp/py312/bin/pip install scikit-build-core pybind11 cmake ninja
#   scripts/pack-for-gpu.sh /tmp/py312/bin/python .device-carry/new.tar.xz
#   # there:  mkdir -p /tmp/new && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
#   #         .device-carry/new.tar.xz /tmp/new && PYTHONPATH=/tmp/new python3 scripts/ab_kernels.py ...
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 PYTHON ARCHIVE.tar.xz" >&2; exit 2; }
PYTHON="$1"
ARCHIVE="$(realpath -m "$2")"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PATH="$(dirname "$PYTHON"):$PATH" "$PYTHON" -m pip wheel -q --no-build-isolation --no-deps . -w "$WORK/wheel"
mkdir -p "$WORK/tree" "$(dirname "$ARCHIVE")"
"$PYTHON" -m zipfile -e "$WORK"/wheel/nmcli-*.whl "$WORK/tree"
# the ORT op library: kernel measurements do not load it, the ORT tests do (about 2x the archive)
[ "${NMCLI_PACK_OPS:-0}" = 1 ] || rm -rf "$WORK/tree/nmcli/_lib"
tar -C "$WORK/tree" -cf - nmcli | xz -3 -T0 > "$ARCHIVE"
ls -l "$ARCHIVE"
