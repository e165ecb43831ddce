"""The device 2:4 copy's kernel alone (`_kernels.cuda_two_of_four_copy`, what the sparse tensor
cores stage from 1024 rows; BENCHMARKS.md, session 40): microseconds per weight and the bytes it
moves (the packed weight read, the copy written) against the copy bandwidth measured in the same
process. bench_kernels' method: buffer sets past L2 rotated in one CUDA graph, median of replays.
Needs torch and a GPU.

    python scripts/two_of_four_copy_time.py [--nm 2:8 ...] [--shape 4096x4096 ...]
"""
import argparse

import numpy as np
import torch

from nmcli import _kernels, bench_kernels
from nmcli.format import NMPattern, PackedShape

SHAPES = [(4096, 4096), (11008, 4096), (4096, 14336), (14336, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nm", action="append", help="N:M patterns that fit 2:4 (repeatable; default 2:8 1:8 1:4 2:16)")
    parser.add_argument("--shape", action="append", metavar="KxN", help="weight shape K x Nout (repeatable)")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape] if args.shape else SHAPES
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copy_gbps = bench_kernels.copy_bandwidth(torch)
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {copy_gbps:.0f} GB/s")
    rng = np.random.default_rng(0)
    for k, n in shapes:
        for nm in args.nm or ["2:8", "1:8", "1:4", "2:16"]:
            pattern = NMPattern.parse(nm)
            packed, _ = bench_kernels._random_packed(k, n, pattern, 0, False, rng)
            copy = PackedShape(k, n, NMPattern(2, 4))
            moved = packed.nbytes + n * (copy.row_len * 2 + copy.index_words * 4)  # the copy's rows unpadded
            sets = bench_kernels._sets_for(l2_bytes, moved)
            values = [torch.from_numpy(packed.values).to("cuda", torch.float16) for _ in range(sets)]
            indices = [torch.from_numpy(packed.indices.view(np.int32)).cuda() for _ in range(sets)]
            copy_values = [torch.empty(n, copy.row_len, dtype=torch.float16, device="cuda") for _ in range(sets)]
            copy_indices = [torch.empty(n, copy.index_words, dtype=torch.int32, device="cuda") for _ in range(sets)]

            def launch():
                stream = torch.cuda.current_stream().cuda_stream
                for i in range(sets):
                    _kernels.cuda_two_of_four_copy(values[i].data_ptr(), indices[i].data_ptr(), pattern.n, pattern.m,
                                                   k, n, copy_values[i].data_ptr(), copy_indices[i].data_ptr(), stream,
                                                   index_words=packed.indices.shape[1])

            ms = bench_kernels._time_graph(torch, launch, 20) / sets
            gbps = moved / (ms * 1e-3) / 1e9
            print(f"{k:5d} x {n:<5d} {nm:>4}: {ms * 1e3:7.2f} us, {moved / 1e6:6.1f} MB, {gbps:5.0f} GB/s "
                  f"({100 * gbps / copy_gbps:.0f}% of copy)", flush=True)


if __name__ == "__main__":
    main()
