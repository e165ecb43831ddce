"""A kernel path's time at a few activation rows against the grid's size and each block's steps
(BENCHMARKS.md, session 19): N from 1024 to 16384 at K = 4096 (more weight tiles, so more blocks),
then K from 1024 to 16384 at N = 4096 (more steps per block), each point with cuBLAS dense in the
same process, by bench_kernels' method (weights rotated past L2, CUDA-graph replay, median). fp16.

    python scripts/grid_sweep.py --rows 17 --rows 64 --nm 2:4 --nm 2:8 [--path wgmma_sp]
"""
import argparse

import numpy as np
import torch

from nmcli import bench_kernels
from nmcli.format import NMPattern

SHAPES = [(4096, n) for n in (1024, 2048, 4096, 8192, 16384)] + [(k, 4096) for k in (1024, 2048, 8192, 16384)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, action="append", help="activation rows (repeatable; default 17)")
    parser.add_argument("--nm", action="append", help="N:M patterns (repeatable; default 2:4 and 2:8)")
    parser.add_argument("--path", default="wgmma_sp", help="kernel path, as in nmcli bench kernels --path")
    args = parser.parse_args()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copy_gbps = bench_kernels.copy_bandwidth(torch)
    print(torch.cuda.get_device_name(0))
    for m in args.rows or [17]:
        for nm in args.nm or ["2:4", "2:8"]:
            for k, n in SHAPES:
                r = bench_kernels.bench_shape(torch, m, k, n, NMPattern.parse(nm), "float16", copy_gbps, l2_bytes,
                                              replays=9, rng=np.random.default_rng(0), path=args.path)
                print(f"{m:3d} {k:5d}x{n:<5d} {nm} ours {r.ours_ms * 1e3:7.2f} us  cuBLAS {r.cublas_ms * 1e3:7.2f} us  "
                      f"x{r.speedup:4.2f}  {r.gbps:5.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
