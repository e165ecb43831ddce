#!/usr/bin/env bash
# On the GPU machine: build nmcli against ORT headers in $ORT_INCLUDE_DIR, run the GPU tests,
# then the kernel benchmark arguments given (if any). Logs go to ${OUT:-.}.
# NMCLI_TEST_WORKERS=N runs the tests in N processes sharing the GPU where pytest-xdist imports
# (BENCHMARKS.md, session 41: test_gpu.py in about 7 minutes with 14, where one process takes about
# 15); the one test that reads the device's memory in use runs alone after them.
set -uo pipefail
OUT="${OUT:-.}"
export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
ORT_INCLUDE_DIR="${ORT_INCLUDE_DIR:-/tmp/ort-include}" python3 -m pip install -q --no-build-isolation --no-deps . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
REPO="$(pwd)"
cd /tmp  # run the installed package, not the source tree
python3 -c 'import nmcli; print("nmcli", nmcli.__version__, nmcli.build_info())'
TESTS=("$REPO/tests/test_gpu.py" "$REPO/tests/test_kernel_cpu.py")
if [ "${NMCLI_TEST_WORKERS:-0}" -gt 0 ] && python3 -c 'import xdist' 2>/dev/null; then
  python3 -m pytest -q -x -p no:cacheprovider -n "$NMCLI_TEST_WORKERS" "${TESTS[@]}" \
    -k "not bench_model_on_cuda" > "$OUT/gpu-tests.log" 2>&1
  status=$?
  python3 -m pytest -q -x -p no:cacheprovider "${TESTS[@]}" -k "bench_model_on_cuda" >> "$OUT/gpu-tests.log" 2>&1
  [ $? -ne 0 ] && status=1
else
  python3 -m pytest -q -x -p no:cacheprovider "${TESTS[@]}" > "$OUT/gpu-tests.log" 2>&1
  status=$?
fi
echo "pytest exit $status"; tail -25 "$OUT/gpu-tests.log"
if [ $# -gt 0 ]; then
  python3 -m nmcli bench kernels "$@" > "$OUT/bench.txt" 2> "$OUT/bench.err"; echo "bench exit $?"
  cat "$OUT/bench.txt"; tail -5 "$OUT/bench.err"
fi
