"""Median milliseconds of the CPU kernel (`nmcli._kernels.nm_matmul_cpu`, one thread) against
NumPy's dense fp32 matmul on the same shapes (BENCHMARKS.md, session 16). fp32, weights
magnitude-pruned from normal data, fresh activations; 30 timed calls after one warm-up. Run it
with PYTHONPATH pointing at another build to compare two builds on this machine.

    python scripts/cpu_kernel_time.py
    python scripts/cpu_kernel_time.py --nm 2:4 --shape 4096x4096 --rows 1 --rows 4
    python scripts/cpu_kernel_time.py --glu --shape 1408x512 --rows 64    # the gated prologue too
"""
import argparse
import statistics
import time

import numpy as np

from nmcli import _kernels
from nmcli.format import NMPattern, pack
from nmcli.masks import choose_offsets

# K x N: the CPU demo block's projections (hidden 512, MLP 1408 padded to the fused gate/up) and a
# LLaMA-7B one.
SHAPES = ["512x1536", "1376x512", "4096x4096"]
CALLS = 30


def median_ms(call) -> float:
    call()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", help="KxN (repeatable)")
    parser.add_argument("--rows", type=int, action="append", help="activation rows (repeatable; default 1, 4, 64)")
    parser.add_argument("--nm", default="2:8")
    parser.add_argument("--glu", action="store_true",
                        help="the op's GLU prologue (glu=silu, a second activation x_up); NumPy computes it too")
    args = parser.parse_args()
    pattern = NMPattern.parse(args.nm)
    rng = np.random.default_rng(0)
    for shape in args.shape or SHAPES:
        k, n = (int(v) for v in shape.split("x"))
        w = rng.standard_normal((k, n)).astype(np.float32)
        packed = pack(w, choose_offsets(np.abs(w), pattern), pattern)
        for rows in args.rows or [1, 4, 64]:
            x, up = (rng.standard_normal((rows, k)).astype(np.float32) for _ in range(2))
            gated = dict(x_up=up, glu="silu") if args.glu else {}
            ours = median_ms(lambda: _kernels.nm_matmul_cpu(x, packed.values, packed.indices, None, pattern.n,
                                                            pattern.m, k, 1.0, threads=1, **gated))
            dense = median_ms(lambda: (x / (1 + np.exp(-x)) * up if args.glu else x) @ w)
            print(f"{rows:3d} x {k} x {n} {pattern}{' glu' if args.glu else ''}: nmcli {ours:.3f} ms, "
                  f"numpy dense fp32 {dense:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
