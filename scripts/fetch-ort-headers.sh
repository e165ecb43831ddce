#!/usr/bin/env bash
# Put ONNX Runtime's C/C++ API headers in .deps/onnxruntime/include.
# ORT's Python wheels ship none; Debian trixie's libonnxruntime-dev (1.21, C API 21) does. We
# download that one .deb with a private apt state and extract only its headers: nothing from
# trixie is installed on the system. The C API is backward compatible, so a library built on
# API 21 loads in newer onnxruntime releases.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.deps/onnxruntime/include"
if [ -f "$DEST/onnxruntime_cxx_api.h" ]; then echo "ORT headers already in $DEST"; exit 0; fi
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
  echo "error: need apt-get and dpkg-deb (Debian/Ubuntu) to fetch libonnxruntime-dev; or set ORT_INCLUDE_DIR" >&2; exit 1; }
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial"
echo "deb http://deb.debian.org/debian trixie main" > "$WORK/sources.list"
APT=(-o Dir::Etc::SourceList="$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o Dir::State::Lists="$WORK/lists" -o Dir::Cache="$WORK/cache" -o Debug::NoLocking=1
     -o APT::Sandbox::User="$(id -un)")
apt-get "${APT[@]}" -qq update
(cd "$WORK" && apt-get "${APT[@]}" -qq download libonnxruntime-dev)
dpkg-deb -x "$WORK"/libonnxruntime-dev_*.deb "$WORK/x"
mkdir -p "$DEST"
cp -r "$WORK/x/usr/include/onnxruntime/." "$DEST/"
echo "ORT headers ($(grep -m1 '#define ORT_API_VERSION' "$DEST/onnxruntime_c_api.h")) in $DEST"
