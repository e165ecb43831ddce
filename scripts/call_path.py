"""One call of nmcli's CUDA kernels, made a few times on fresh random data, for a profiler to
catch (BENCHMARKS.md, session 38). Prints the path the dispatch would choose. Needs torch and a GPU.

    ncu --clock-control none --set full -k regex:decode_mma_kernel --launch-skip 1 --launch-count 1 \\
        -o 16x4096x4096 python scripts/call_path.py 16 4096 4096 2:8 --path decode_mma
"""
import argparse

import numpy as np
import torch

from nmcli import _kernels, bench_kernels
from nmcli.format import NMPattern


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=int, help="activation rows")
    parser.add_argument("k", type=int, help="reduction length K")
    parser.add_argument("nout", type=int, help="output columns")
    parser.add_argument("nm", help="N:M pattern, e.g. 2:8")
    parser.add_argument("--path", default="auto", help="kernel path, as in nmcli bench kernels --path")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    pattern = NMPattern.parse(args.nm)
    dtype = getattr(torch, args.dtype)
    packed, _ = bench_kernels._random_packed(args.k, args.nout, pattern, 0, False, np.random.default_rng())
    values = torch.from_numpy(packed.values).to("cuda", dtype)
    indices = torch.from_numpy(packed.indices.view(np.int32)).cuda()
    x = torch.randn(args.rows, args.k, device="cuda", dtype=dtype)
    y = torch.full((args.rows, args.nout), float("nan"), device="cuda", dtype=dtype)
    workspace = bench_kernels.workspace_for(torch, args.rows, args.k, args.nout, pattern, args.dtype, args.path)
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(args.calls):
        _kernels.nm_matmul_cuda(x.data_ptr(), values.data_ptr(), indices.data_ptr(), 0, y.data_ptr(), args.rows,
                                pattern.n, pattern.m, args.k, args.nout, args.dtype, 1.0, stream, args.path,
                                workspace=workspace.data_ptr() if workspace is not None else 0,
                                index_words=packed.indices.shape[1])
    torch.cuda.synchronize()
    chosen = _kernels.cuda_path(args.rows, pattern.n, pattern.m, args.k, args.nout, args.dtype)
    print(f"{args.rows} x {args.k} x {args.nout} {args.nm} {args.dtype}: ran {args.path}, the dispatch chooses {chosen}")


if __name__ == "__main__":
    main()
