#!/usr/bin/env bash
# On the GPU machine: build nmcli against ORT headers in $ORT_INCLUDE_DIR, run the GPU tests,
# then the kernel benchmark arguments given (if any). Logs go to ${OUT:-.}.
set -uo pipefail
OUT="${OUT:-.}"
export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
ORT_INCLUDE_DIR="${ORT_INCLUDE_DIR:-/tmp/ort-include}" python3 -m pip install -q --no-build-isolation --no-deps . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
REPO="$(pwd)"
cd /tmp  # run the installed package, not the source tree
python3 -c 'import nmcli; print("nmcli", nmcli.__version__, nmcli.build_info())'
python3 -m pytest -q -x -p no:cacheprovider "$REPO/tests/test_gpu.py" "$REPO/tests/test_kernel_cpu.py" > "$OUT/gpu-tests.log" 2>&1
echo "pytest exit $?"; tail -25 "$OUT/gpu-tests.log"
if [ $# -gt 0 ]; then
  python3 -m nmcli bench kernels "$@" > "$OUT/bench.txt" 2> "$OUT/bench.err"; echo "bench exit $?"
  cat "$OUT/bench.txt"; tail -5 "$OUT/bench.err"
fi
