#!/usr/bin/env bash
# On the GPU machine: build nmcli against ORT headers in $ORT_INCLUDE_DIR, run the GPU tests,
# then the kernel benchmark arguments given (if any). Logs go to ${OUT:-.}.
set -uo pipefail
OUT="${OUT:-.}"
export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
ORT_INCLUDE_DIR="${ORT_INCLUDE_DIR:-/tmp/ort-include}" python3 -m pip install -q --no-build-isolation --no-deps . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c 'import nmcli; print("nmcli", nmcli.__version__, nmcli.build_info())'
cd /tmp && python3 -m pytest -q -x "$OLDPWD/tests/test_gpu.py" "$OLDPWD/tests/test_kernel_cpu.py" 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
cd "$OLDPWD"
if [ $# -gt 0 ]; then
  (cd /tmp && python3 -m nmcli bench kernels "$@") | tee "$OUT/bench.txt"
fi
