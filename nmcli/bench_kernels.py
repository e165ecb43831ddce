"""Kernel micro-benchmark: our CUDA paths against cuBLAS dense on the same GPU, same method.

Method (the same for every number we publish):
  * several buffer sets, together larger than twice the L2, are rotated so each call reads its
    weight from HBM, not from the cache;
  * one CUDA graph holds one launch per set; graphs are replayed and timed with CUDA events;
    the time per call is the median over replays divided by the launches per graph;
  * the ceilings are measured in the same process: device-to-device copy bandwidth (bytes read
    plus written) and, per shape, cuBLAS dense through torch.matmul;
  * cuBLAS runs once per timed pattern, and every pattern of a shape and row count is compared
    with the median of those runs (dense work does not depend on the pattern; one run in 30 came
    out 1.7-1.8x slower than the others in session 47, which made our speedup look that much
    better);
  * cuSPARSELt 2:4, the library users hold 2:4 sparsity to, runs once per shape and row count
    where this torch has it, with the algorithm its search picks (time_cusparselt).
It needs PyTorch for device buffers, cuBLAS and cuSPARSELt; nmcli's kernels are called directly.
"""
from __future__ import annotations

import functools
import statistics
import warnings
from dataclasses import asdict, dataclass, replace

import numpy as np

from .errors import NmcliError
from .format import NMPattern, PackedShape, fits_two_of_four, pack, two_of_four_copy
from .masks import choose_offsets

NMSPARSE_MS = [1, 256, 1024, 4096]
NMSPARSE_KN = [(1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192), (1024, 4096), (4096, 1024),
               (5120, 20480), (20480, 5120)]
# LLaMA-7B/8B projections (K, Nout); 4096 x 1024 is LLaMA-3-8B's K and V (8 key-value heads of 128).
LLAMA_KN = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (14336, 4096), (4096, 1024)]
DECODE_MS = [1, 2, 4, 8, 16]
LLAMA_MS = DECODE_MS + [256, 4096]  # the LLaMA set's rows, and --shape's without --rows


@dataclass
class KernelRow:
    m: int
    k: int
    n: int
    nm: str
    dtype: str
    path: str
    ours_ms: float
    cublas_ms: float
    speedup: float
    bytes_moved: int
    gbps: float
    pct_copy_bw: float
    tflops: float          # effective: 2*m*k*n / time
    cublas_tflops: float
    copy: bool = False     # the call read a 2:4 copy of the weight (prune --prefill-copy)
    cublas_run_ms: float | None = None  # this pattern's own cuBLAS run, where cublas_ms is the point's median
    tile: str = ""         # the warpgroup kernels' tile plan (tile_text), else empty
    cusparselt_ms: float | None = None  # cuSPARSELt 2:4 at this shape and row count (time_cusparselt)


def tile_text(plan: tuple) -> str:
    """_kernels.last_tile_plan() in short: activation-tile rows, "/S" for a K split S ways over a
    cluster, " last" where only the last wave's tiles split, " sk" for stream-K, " pers" for the
    persistent 2:4 kernel (a fifth field, which builds before session 61 lack), " x2" for the
    regrouping kernel's grid of two blocks an SM (a sixth, from session 72); empty off the
    warpgroup kernels."""
    rows, split, last_wave, stream_k = plan[:4]
    persistent = len(plan) > 4 and plan[4]
    two_per_sm = len(plan) > 5 and plan[5]
    if rows == 0:
        return ""
    if stream_k:
        return f"{rows} sk"
    return (f"{rows}" + (f"/{split}" if split > 1 else "") + (" pers" if persistent else "")
            + (" x2" if two_per_sm else "") + (" last" if last_wave else ""))


def path_text(path: str, tile: str = "", copy: bool = False) -> str:
    """The path column of `nmcli bench kernels` and of its markdown tables: the path taken, the
    tile plan (tile_text) and whether the call read a 2:4 copy of its weight."""
    return path + (f" {tile}" if tile else "") + (" (2:4 copy)" if copy else "")


def require_gpu():
    try:
        import torch
    except ImportError:
        raise NmcliError("nmcli bench kernels needs PyTorch for device buffers and cuBLAS (pip install torch)") from None
    if not torch.cuda.is_available():
        raise NmcliError("no CUDA GPU available: nmcli bench kernels measures GPU kernels")
    from . import _kernels
    if not getattr(_kernels, "HAS_CUDA", False):
        raise NmcliError("this nmcli was built without CUDA (no nvcc at install time)")
    return torch


def _time_graph(torch, launch_all, replays: int) -> float:
    """Median milliseconds of one replay of a graph that runs launch_all()."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch_all()  # warm-up outside capture (module load, lazy init)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            launch_all()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return _median_ms(torch, graph.replay, replays)


def _median_ms(torch, run, replays: int) -> float:
    """Median milliseconds of run(), each timed with CUDA events on the current stream."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(torch, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of 1 GiB, bytes read plus written per second (GB/s): the fastest of
    torch's copy launched on its own and inside a CUDA graph, and nmcli's 16-byte copy kernel. On
    the H100 the copy reaches 2.90 TB/s on its own but 2.42 TB/s as a graph node, and the kernel
    2.81 TB/s (BENCHMARKS.md, session 14): the ceiling is the best of them."""
    from . import _kernels

    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    stream = torch.cuda.current_stream
    kernel = lambda: _kernels.cuda_copy(dst.data_ptr(), src.data_ptr(), nbytes, stream().cuda_stream)  # noqa: E731
    torch_copy = lambda: dst.copy_(src)  # noqa: E731
    ms = min(_time_graph(torch, torch_copy, replays=20), _time_graph(torch, kernel, replays=20),
             _time_launches(torch, torch_copy, replays=20))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _time_launches(torch, launch, replays: int) -> float:
    """Median milliseconds of launch() on its own, outside any graph."""
    launch()  # warm-up
    torch.cuda.synchronize()
    return _median_ms(torch, launch, replays)


def _sets_for(l2_bytes: int, bytes_per_set: int) -> int:
    return int(min(64, max(2, -(-4 * l2_bytes // max(bytes_per_set, 1)))))


def path_for(m: int, k: int, n: int, pattern: NMPattern, dtype: str, path: str, vector: int = 0,
             copy: bool = False) -> str | None:
    """The path a call runs on: the dispatch's choice for "auto", else `path` if it can run it
    (`copy`: the call carries a 2:4 copy of its weight where the pattern fits that form)."""
    from . import _kernels

    copy = copy and fits_two_of_four(pattern)
    if path == "auto":
        return _kernels.cuda_path(m, pattern.n, pattern.m, k, n, dtype, vector, copy)
    return path if _kernels.cuda_path_supported(path, m, pattern.n, pattern.m, dtype, k, vector, copy) else None


def workspace_for(torch, m: int, k: int, n: int, pattern: NMPattern, dtype: str, path: str, copy: bool = False,
                  kernels=None):
    """Device memory a call needs beside its tensors (a 2:4 copy the sparse tensor cores stage, from
    `cuda_workspace_bytes` of `kernels`, the installed build unless another is given), or None: one
    buffer every call may reuse, as ORT's arena hands the same block to consecutive calls."""
    if kernels is None:
        from . import _kernels as kernels

    need = kernels.cuda_workspace_bytes(m, pattern.n, pattern.m, k, n, dtype, path=path, copy=copy)
    return torch.empty(need, dtype=torch.uint8, device="cuda") if need else None


def _random_packed(k: int, n: int, pattern: NMPattern, vector: int, with_copy: bool, rng):
    """A magnitude-pruned random weight [K, N] packed (and its 2:4 copy, or None)."""
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = pack(w, choose_offsets(np.abs(w), pattern, vector), pattern)
    return packed, two_of_four_copy(packed) if with_copy else None


@functools.lru_cache(maxsize=6)
def packed_weight(k: int, n: int, pattern: NMPattern, vector: int, with_copy: bool):
    """_random_packed with fresh random data, kept for the next calls on the same weight shape:
    packing tens of millions of weights on the host takes seconds, more than timing a call, so
    a sweep over row counts packs each weight once (the weight's values do not change its time)."""
    return _random_packed(k, n, pattern, vector, with_copy, np.random.default_rng())


def bench_shape(torch, m, k, n, pattern: NMPattern, dtype: str, copy_gbps: float, l2_bytes: int,
                replays: int = 20, rng=None, path: str = "auto", vector: int = 0, prefill_copy: bool = False
                ) -> KernelRow:
    """One call timed against cuBLAS. `prefill_copy`: the call also carries the weight packed as
    2:4 (prune --prefill-copy) where its pattern fits that form."""
    from . import _kernels

    tdtype = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    itemsize = torch.tensor([], dtype=tdtype).element_size()
    shape = PackedShape(k, n, pattern)
    # One packed weight from real random data, replicated on the device per set (same bytes).
    with_copy = prefill_copy and fits_two_of_four(pattern)
    packed, copy = packed_weight(k, n, pattern, vector, with_copy) if rng is None else \
        _random_packed(k, n, pattern, vector, with_copy, rng)
    values = torch.from_numpy(packed.values).to("cuda", tdtype)
    indices = torch.from_numpy(packed.indices.view(np.int32)).cuda()
    chosen = path_for(m, k, n, pattern, dtype, path, vector, with_copy)
    if chosen is None:
        raise NmcliError(f"the {path} path cannot run {m}x{k}x{n} {pattern} {dtype}")
    reads_copy = with_copy and chosen == "wgmma_sp"
    read_shape = copy.shape if reads_copy else shape
    per_set = read_shape.packed_bytes(itemsize) + (m * k + m * n) * itemsize
    sets = _sets_for(l2_bytes, per_set)
    vs = [values.clone() for _ in range(sets)]
    ids = [indices.clone() for _ in range(sets)]
    cvs = [torch.from_numpy(copy.values).to("cuda", tdtype) for _ in range(sets)] if copy else []
    cids = [torch.from_numpy(copy.indices.view(np.int32)).cuda() for _ in range(sets)] if copy else []
    xs = [torch.randn(m, k, device="cuda", dtype=tdtype) for _ in range(sets)]
    ys = [torch.empty(m, n, device="cuda", dtype=tdtype) for _ in range(sets)]
    workspace = workspace_for(torch, m, k, n, pattern, dtype, chosen, with_copy)

    def ours():
        stream = torch.cuda.current_stream().cuda_stream
        for i in range(sets):
            copy_ptrs = dict(copy_values=cvs[i].data_ptr(), copy_indices=cids[i].data_ptr(),
                             copy_index_words=copy.indices.shape[1]) if copy else {}
            _kernels.nm_matmul_cuda(xs[i].data_ptr(), vs[i].data_ptr(), ids[i].data_ptr(), 0, ys[i].data_ptr(), m,
                                    pattern.n, pattern.m, k, n, dtype, 1.0, stream, chosen, vector=vector,
                                    workspace=workspace.data_ptr() if workspace is not None else 0,
                                    index_words=packed.indices.shape[1], **copy_ptrs)

    ours_ms = _time_graph(torch, ours, replays) / sets
    tile = tile_text(_kernels.last_tile_plan())
    del vs, ids, cvs, cids, workspace
    dense_sets = _sets_for(l2_bytes, k * n * itemsize)
    ws = [torch.randn(k, n, device="cuda", dtype=tdtype) for _ in range(dense_sets)]
    xd = [xs[i % sets] for i in range(dense_sets)]
    yd = [torch.empty(m, n, device="cuda", dtype=tdtype) for _ in range(dense_sets)]

    def dense():
        for i in range(dense_sets):
            torch.matmul(xd[i], ws[i], out=yd[i])

    cublas_ms = _time_graph(torch, dense, replays) / dense_sets
    moved = read_shape.packed_bytes(itemsize) + (m * k + m * n) * itemsize
    gbps = moved / (ours_ms * 1e-3) / 1e9
    flops = 2.0 * m * k * n
    return KernelRow(m, k, n, str(pattern), dtype, chosen, ours_ms, cublas_ms, cublas_ms / ours_ms, moved, gbps,
                     100.0 * gbps / copy_gbps, flops / (ours_ms * 1e-3) / 1e12, flops / (cublas_ms * 1e-3) / 1e12,
                     reads_copy, tile=tile)


def has_cusparselt(torch) -> bool:
    """Whether this torch runs cuSPARSELt: built with it, and with the ops time_cusparselt calls."""
    backend = getattr(torch.backends, "cusparselt", None)
    return (backend is not None and backend.is_available() and hasattr(torch, "_cslt_compress")
            and hasattr(torch, "_cslt_sparse_mm"))


def cusparselt_version(torch) -> int | None:
    """The cuSPARSELt version torch runs (as torch.backends.cusparselt.version() gives it), or None."""
    return torch.backends.cusparselt.version() if has_cusparselt(torch) else None


def two_of_four_pruned(torch, w):
    """w [N, K] with the 2 largest magnitudes of every 4 consecutive weights along K kept."""
    n, k = w.shape
    groups = w.reshape(n, k // 4, 4)
    keep = groups.abs().topk(2, dim=-1).indices
    return (groups * torch.zeros_like(groups).scatter_(-1, keep, 1)).reshape(n, k)


CUSPARSELT_ROWS = 8  # cuSPARSELt's dense operand takes whole multiples of 8 columns (fp16, bf16)


def time_cusparselt(torch, m: int, k: int, n: int, dtype: str, l2_bytes: int, replays: int = 20
                    ) -> tuple[float | None, str]:
    """cuSPARSELt's time (ms) for Y^T = W X^T with W [N, K] 2:4-pruned from random data, timed as
    bench_shape times ours (buffer sets rotated past L2, one graph, median replay), and how it went:
    (ms, how) or (None, why not). cuSPARSELt at its best, the fairest rival: torch's
    `_cslt_sparse_mm` with the algorithm `_cslt_sparse_mm_search` picks for the shape ("searched";
    "default algorithm" where this torch cannot search; torch's own F.linear path keeps algorithm 0,
    which session 66 measured up to 2.6x slower at 1-256 rows), the activation rows padded to a
    multiple of CUSPARSELT_ROWS before timing. Where the graph cannot capture it, single launches
    are timed instead (", launches": that adds launch overhead). The output is checked against the
    dense product of the same pruned weight first: a mismatch is an NmcliError, not a time."""
    if not has_cusparselt(torch):
        return None, "this torch has no cuSPARSELt"
    if dtype not in ("float16", "bfloat16"):
        return None, f"not timed for {dtype} (fp16 and bf16 only)"
    if k % 4:
        return None, f"K = {k} is not a whole number of groups of 4"
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    itemsize = torch.tensor([], dtype=tdtype).element_size()
    dense_w = two_of_four_pruned(torch, torch.randn(n, k, device="cuda", dtype=tdtype))
    try:
        first = torch._cslt_compress(dense_w)
    except RuntimeError as e:  # shapes cuSPARSELt does not take (its alignment rules)
        return None, f"cuSPARSELt refused {n}x{k}: {str(e).splitlines()[0]}"
    padded = -(-m // CUSPARSELT_ROWS) * CUSPARSELT_ROWS
    # Stored values (half of W) and metadata (a 16th more), activations and output per set.
    sets = _sets_for(l2_bytes, n * k * itemsize * 9 // 16 + (padded * k + padded * n) * itemsize)
    ws = [first] + [torch._cslt_compress(dense_w) for _ in range(sets - 1)]
    xs = [torch.zeros(padded, k, device="cuda", dtype=tdtype) for _ in range(sets)]
    for x in xs:
        x[:m].normal_()
    how, alg = "default algorithm", 0
    if hasattr(torch, "_cslt_sparse_mm_search"):
        with warnings.catch_warnings():  # torch 2.11 calls it deprecated, with no public successor
            warnings.simplefilter("ignore", UserWarning)
            found = torch._cslt_sparse_mm_search(ws[0], xs[0].t())
        how, alg = "searched", int(found[0] if isinstance(found, (tuple, list)) else found)
    expected = dense_w.double() @ xs[0][:m].double().t()
    got = torch._cslt_sparse_mm(ws[0], xs[0].t(), alg_id=alg)[:, :m].double()
    error = float((got - expected).norm() / expected.norm())
    if not error < 2e-2:
        raise NmcliError(f"cuSPARSELt's {m}x{k}x{n} {dtype} product is off the dense one by {error:.2g}")

    def run():
        for i in range(sets):
            torch._cslt_sparse_mm(ws[i], xs[i].t(), alg_id=alg)

    try:
        return _time_graph(torch, run, replays) / sets, how
    except RuntimeError:  # not capturable by this torch: time launches, and say so
        torch.cuda.synchronize()
        return _time_launches(torch, run, replays) / sets, how + ", launches"


def shared_baseline(rows: list[KernelRow]) -> list[KernelRow]:
    """The rows with one cuBLAS time per shape, row count and dtype: the median of the runs timed
    with its patterns, each row's own run kept in cublas_run_ms, speedups against the median."""
    def own(r: KernelRow) -> float:
        return r.cublas_ms if r.cublas_run_ms is None else r.cublas_run_ms

    runs: dict[tuple, list[float]] = {}
    for r in rows:
        runs.setdefault((r.m, r.k, r.n, r.dtype), []).append(own(r))
    shared = []
    for r in rows:
        median = statistics.median(runs[(r.m, r.k, r.n, r.dtype)])
        flops = 2.0 * r.m * r.k * r.n
        shared.append(replace(r, cublas_ms=median, speedup=median / r.ours_ms,
                              cublas_tflops=flops / (median * 1e-3) / 1e12, cublas_run_ms=own(r)))
    return shared


def parse_weight_shape(text: str) -> tuple[int, int]:
    """'KxN' (as `--shape 8192x3072`) -> (K, N); NmcliError unless both are positive integers."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise NmcliError(f"--shape must be KxN with positive integers (e.g. 8192x3072), not '{text}'")
    return int(parts[0]), int(parts[1])


def default_shapes(include_nmsparse=True, include_llama=True, rows=None, weights=None) -> list[tuple[int, int, int]]:
    """(m, k, n) to time: each set's K x N at its row counts, or at `rows` when given; with
    `weights` ((K, N) pairs), those alone, at `rows` or the LLaMA set's row counts."""
    if weights:
        return list(dict.fromkeys((m, k, n) for (k, n) in weights for m in rows or LLAMA_MS))
    shapes = []
    if include_llama:
        shapes += [(m, k, n) for (k, n) in LLAMA_KN for m in rows or LLAMA_MS]
    if include_nmsparse:
        shapes += [(m, k, n) for (k, n) in NMSPARSE_KN for m in rows or NMSPARSE_MS if (m, k, n) not in shapes]
    return shapes


def as_dicts(rows: list[KernelRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def _cells_by_point(rows: list[dict]) -> tuple[list[str], dict[tuple[int, int, int], dict[str, dict]]]:
    """The N:M patterns in the order they first appear, and each (k, n, m) point's rows by pattern,
    each compared with the point's median cuBLAS run (shared_baseline: JSON written before it
    carries each pattern's own run)."""
    patterns, points = [], {}
    for row in as_dicts(shared_baseline([KernelRow(**row) for row in rows])):
        if row["nm"] not in patterns:
            patterns.append(row["nm"])
        points.setdefault((row["k"], row["n"], row["m"]), {})[row["nm"]] = row
    return patterns, points


def _cusparselt_ms(by_pattern: dict[str, dict]) -> float | None:
    """The point's cuSPARSELt 2:4 time (every pattern's row carries the same), or None."""
    return next((r["cusparselt_ms"] for r in by_pattern.values() if r.get("cusparselt_ms")), None)


def markdown_table(rows: list[dict]) -> str:
    """`nmcli bench kernels --json` rows as one markdown table (BENCHMARKS.md's): a line per shape
    and row count, cuBLAS's time (the median of the patterns' cuBLAS runs), cuSPARSELt 2:4's time
    and speedup over cuBLAS where the run timed it, and per pattern our time, the speedup over
    cuBLAS, at 1..16 rows the share of the copy bandwidth and the path (path_text: with the tile
    plan on the warpgroup kernels, "(2:4 copy)" where the call read one)."""
    patterns, points = _cells_by_point(rows)
    sparselt = any(_cusparselt_ms(p) for p in points.values())
    lines = ["| K x N | rows | cuBLAS us | " + ("cuSPARSELt 2:4 us | " if sparselt else "") + " | ".join(patterns)
             + " |", "|:--|--:|--:|" + "--:|" * (len(patterns) + sparselt)]
    for (k, n, m), by_pattern in points.items():
        cublas_ms = next(iter(by_pattern.values()))["cublas_ms"]
        cells = []
        if sparselt:
            ms = _cusparselt_ms(by_pattern)
            cells.append(f"{ms * 1e3:.1f} us {cublas_ms / ms:.2f}x" if ms else "")
        for nm in patterns:
            r = by_pattern.get(nm)
            if r is None:
                cells.append("")
                continue
            bandwidth = f" {r['pct_copy_bw']:.0f}%" if m <= DECODE_MS[-1] else ""
            path = path_text(r["path"], r.get("tile", ""), r.get("copy", False))
            cells.append(f"{r['ours_ms'] * 1e3:.1f} us {r['speedup']:.2f}x{bandwidth} {path}")
        lines.append(f"| {k} x {n} | {m} | {cublas_ms * 1e3:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def speedup_ranges(rows: list[dict]) -> str:
    """The speedup over cuBLAS (the median of the point's runs) per row count and pattern as the
    range over the shapes (README's table), one markdown line per row count; first cuSPARSELt
    2:4's where the run timed it."""
    patterns, points = _cells_by_point(rows)
    sparselt = "cuSPARSELt 2:4"
    columns = ([sparselt] if any(_cusparselt_ms(p) for p in points.values()) else []) + patterns
    ranges: dict[tuple[int, str], list[float]] = {}
    for (_, _, m), by_pattern in points.items():
        if ms := _cusparselt_ms(by_pattern):
            ranges.setdefault((m, sparselt), []).append(next(iter(by_pattern.values()))["cublas_ms"] / ms)
        for nm, r in by_pattern.items():
            ranges.setdefault((m, nm), []).append(r["speedup"])
    lines = ["| rows | " + " | ".join(columns) + " |", "|--:|" + "--:|" * len(columns)]
    for m in sorted({m for (m, _) in ranges}):
        cells = [f"{min(v):.2f}-{max(v):.2f}x" if (v := ranges.get((m, nm))) else "" for nm in columns]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
