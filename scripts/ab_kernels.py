"""Two or more builds of nmcli's kernels timed in one process: the installed `nmcli._kernels`
("new") against other builds' `_kernels*.so` files, on the same packed weights and buffers,
alternating builds per point (BENCHMARKS.md, session 16). The same build differed by up to 10%
between leases of the same GPU model (session 17, at 4096 rows), so a change is measured against
its base here, not against an older table.

Each point is bench_kernels' method: several weight sets past L2 rotated in one CUDA graph,
median of 15 replays, three rounds per build (all printed, the median reported). fp16 unless
`--dtype` says otherwise, weights magnitude-pruned from normal data. Needs torch and a GPU.

Archive the base on the machine that has the commits, into a folder that travels with the tree
(untracked and not ignored, or named in the device call's carry): on the lent GPU machine the
working tree travels but its git repository stays as it was when the session started, so
`git archive HEAD` there gives the session's first commit (BENCHMARKS.md, session 17).

    mkdir -p scratch/base && git archive <base> | tar -x -C scratch/base    # here; carry scratch
    (cd scratch/base && pip install --no-deps --target /tmp/old .)          # on the GPU machine
    python scripts/ab_kernels.py --path decode --rows 1 --rows 4 old=$(ls /tmp/old/nmcli/_kernels*.so)

With several `--path`, every build runs every path on each point (`-` where a path does not take
the call), so forced paths are compared in the same process as the builds' dispatch. Likewise
`--index-rows unpadded --index-rows padded` times each build on the weight's rows of indices
unpadded, as format version 1 wrote them, and padded to 16-byte units, as nmcli packs them now
(docs/FORMAT.md version 2). Builds before version 2 read only unpadded rows: time them with
`--index-rows unpadded` (with the default, padded, they print `-`).
"""
import argparse
import importlib.util

import numpy as np
import torch

from nmcli import _kernels as installed
from nmcli import bench_kernels
from nmcli.format import NMPattern, PackedShape

# (K, Nout): LLaMA-7B/8B projections, with the fused Q/K/V (12288) and gate/up (28672) widths.
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 12288), (4096, 28672)]
ROUNDS = 3


def load_build(name: str, so_path: str):
    spec = importlib.util.spec_from_file_location(f"{name}._kernels", so_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Point:
    """One call's buffers: the packed weight replicated over sets past L2, activations, outputs;
    shared by every build, so all of them run on the same bytes."""

    def __init__(self, m, k, n, pattern, values, indices, l2_bytes, resident=False, layouts=("padded",)):
        self.m, self.k, self.n, self.pattern = m, k, n, pattern
        self.dtype, size = values.dtype, values.element_size()
        self.moved = values.numel() * size + indices.numel() * 4 + (m * k + m * n) * size  # bytes a call moves
        self.sets = bench_kernels._sets_for(l2_bytes, self.moved)
        # resident: one set launched as often, so that a weight smaller than L2 stays there (a
        # diagnostic: what the kernel does without HBM's latency and bandwidth)
        distinct = 1 if resident else self.sets

        def buffers(make):  # self.sets buffers, `distinct` of them different
            return [make() for _ in range(distinct)] * (self.sets // distinct)

        self.values = buffers(values.clone)
        # rows of indices as packed (padded to 16-byte units, docs/FORMAT.md version 2) and as
        # version 1 wrote them, each only where asked
        words = {"padded": indices.shape[1], "unpadded": PackedShape(k, n, pattern).index_words}
        self.indices = {layout: buffers(lambda: indices[:, : words[layout]].contiguous()) for layout in layouts}
        self.x = buffers(lambda: torch.randn(m, k, device="cuda", dtype=self.dtype))
        self.y = buffers(lambda: torch.empty(m, n, device="cuda", dtype=self.dtype))

    def time_us(self, module, path: str, index_rows: str = "padded") -> float:
        """Median microseconds per call of `module`'s kernel, with the workspace that build asks for
        (builds stage a 2:4 copy in it on different calls), on rows of indices padded as packed or
        unpadded (ValueError where the build reads no padded rows)."""
        indices = self.indices[index_rows]
        if "index_words" not in (module.nm_matmul_cuda.__doc__ or ""):  # builds before version 2
            if index_rows != "unpadded":
                raise ValueError("this build reads unpadded rows of indices only")
            pitch = {}
        else:
            pitch = {"index_words": indices[0].shape[1]}
        dtype = str(self.dtype).removeprefix("torch.")
        workspace = bench_kernels.workspace_for(torch, self.m, self.k, self.n, self.pattern, dtype, path,
                                                kernels=module)
        workspace_ptr = workspace.data_ptr() if workspace is not None else 0

        def launch():
            stream = torch.cuda.current_stream().cuda_stream
            for i in range(self.sets):
                module.nm_matmul_cuda(self.x[i].data_ptr(), self.values[i].data_ptr(), indices[i].data_ptr(), 0,
                                      self.y[i].data_ptr(), self.m, self.pattern.n, self.pattern.m, self.k, self.n,
                                      dtype, 1.0, stream, path, workspace=workspace_ptr, **pitch)

        return bench_kernels._time_graph(torch, launch, 15) / self.sets * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="*",
                        help="name=path/to/_kernels.so of each other build (none: the installed one alone)")
    parser.add_argument("--path", action="append",
                        help="kernel path, as in nmcli bench kernels --path (repeatable; default decode)")
    parser.add_argument("--rows", type=int, action="append", help="activation rows (repeatable; default 1)")
    parser.add_argument("--nm", action="append", help="N:M patterns (repeatable; default 2:8 and 2:4)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--shape", action="append", metavar="KxN",
                        help="weight shape K x Nout (repeatable; default the LLaMA projections)")
    parser.add_argument("--index-rows", action="append", choices=["unpadded", "padded"],
                        help="rows of indices padded to 16-byte units as packed (docs/FORMAT.md version 2), "
                             "or unpadded as version 1 wrote them, which builds before version 2 read "
                             "(repeatable, each build on each; default padded)")
    parser.add_argument("--resident", action="store_true",
                        help="launch one buffer set over and over (weights smaller than L2 stay there): a "
                             "diagnostic, not a measurement of a call")
    args = parser.parse_args()
    shapes = [bench_kernels.parse_weight_shape(s) for s in args.shape] if args.shape else SHAPES
    paths = args.path or ["decode"]
    builds = {"new": installed}
    for spec in args.builds:
        name, so_path = spec.split("=", 1)
        builds[name] = load_build(name, so_path)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    rng = np.random.default_rng(0)
    layouts = args.index_rows or ["padded"]
    print(torch.cuda.get_device_name(0))
    for k, n in shapes:
        for nm in args.nm or ["2:8", "2:4"]:
            pattern = NMPattern.parse(nm)
            packed, _ = bench_kernels._random_packed(k, n, pattern, 0, False, rng)
            values = torch.from_numpy(packed.values).to("cuda", getattr(torch, args.dtype))
            indices = torch.from_numpy(packed.indices.view(np.int32)).cuda()
            for m in args.rows or [1]:
                point = Point(m, k, n, pattern, values, indices, l2_bytes, args.resident, layouts)
                runs = {(name, path, layout): [] for name in builds for path in paths for layout in layouts}
                plans = {}  # the tile plan each build ran, where it reports one (from session 51)
                for _ in range(ROUNDS):
                    for (name, path, layout), times in runs.items():
                        try:
                            times.append(point.time_us(builds[name], path, layout))
                        except ValueError:  # the path does not take this call (or the build these rows)
                            continue
                        if hasattr(builds[name], "last_tile_plan"):
                            plans[(name, path, layout)] = bench_kernels.tile_text(builds[name].last_tile_plan())
                moved = point.moved
                del point
                cells = []
                for (name, path, layout), times in runs.items():
                    label = "/".join([name] + ([path] if len(paths) > 1 else []) + ([layout] if len(layouts) > 1 else [])) + \
                        (f" ({plans[(name, path, layout)]})" if plans.get((name, path, layout)) else "")
                    if not times:
                        cells.append(f"{label} -")
                        continue
                    us = float(np.median(times))
                    cells.append(f"{label} {us:6.2f} us ({moved / us / 1e3:4.0f} GB/s; "
                                 f"{'/'.join(f'{t:.2f}' for t in times)})")
                chosen = installed.cuda_path(m, pattern.n, pattern.m, k, n, args.dtype)
                print(f"{m:3d} {k:5d}x{n:<5d} {nm} [{chosen}] " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
