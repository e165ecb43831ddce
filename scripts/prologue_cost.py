"""What each fused neighbour (kernels/fusion.h) adds to one decode call: 1 x 4096 x 12288 at
2:8, fp16 (a LLaMA-7B layer's fused Q/K/V at 1 token), through the pybind entry point.

Four weight sets (120 MB, past L2) rotate inside one CUDA graph of 20 calls; median of 40
replays. Needs torch and a GPU. NMCLI_NO_PDL=1 times calls that do not overlap each other, as in
a model where an ORT kernel precedes each call.

    python scripts/prologue_cost.py
"""
import statistics

import numpy as np
import torch

from nmcli import _kernels
from nmcli.format import NMPattern, pack
from nmcli.masks import choose_offsets

K, NOUT, ROWS, SETS, REPEATS = 4096, 12288, 1, 4, 5


def main() -> None:
    pattern = NMPattern(2, 8)
    w = np.random.default_rng(0).standard_normal((K, NOUT)).astype(np.float16)
    packed = pack(w, choose_offsets(np.abs(w), pattern), pattern)
    values = [torch.from_numpy(packed.values).cuda() for _ in range(SETS)]
    indices = [torch.from_numpy(packed.indices.view(np.int32)).cuda() for _ in range(SETS)]
    x, up = (torch.randn(ROWS, K, device="cuda", dtype=torch.float16) for _ in range(2))
    residual = torch.randn(ROWS, NOUT, device="cuda", dtype=torch.float16)
    gamma = torch.rand(K, device="cuda", dtype=torch.float16) + 0.5
    y = torch.empty(ROWS, NOUT, device="cuda", dtype=torch.float16)
    stream = torch.cuda.Stream()
    extra = {"plain": {}, "norm": dict(norm_weight=gamma.data_ptr(), norm_epsilon=1e-5),
             "glu": dict(x_up=up.data_ptr(), glu="silu"), "residual": dict(residual=residual.data_ptr())}

    def call(i, variant):
        _kernels.nm_matmul_cuda(x.data_ptr(), values[i].data_ptr(), indices[i].data_ptr(), 0, y.data_ptr(), ROWS,
                                2, 8, K, NOUT, "float16", 1.0, stream.cuda_stream, "decode",
                                index_words=packed.indices.shape[1], **extra[variant])

    for variant in ["plain", "norm", "glu", "residual", "plain", "norm"]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            for i in range(SETS):
                call(i, variant)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(REPEATS):
                    for i in range(SETS):
                        call(i, variant)
        times = []
        for _ in range(40):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                graph.replay()
                end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / (REPEATS * SETS))
        print(f"{variant:9s} {statistics.median(times):6.2f} us per call")


if __name__ == "__main__":
    main()
