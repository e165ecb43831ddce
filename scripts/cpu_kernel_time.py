"""Median milliseconds of the CPU kernel (`nmcli._kernels.nm_matmul_cpu`, one thread) against
NumPy's dense fp32 matmul on the same shapes (BENCHMARKS.md, session 16). fp32 (or --dtype),
weights magnitude-pruned from normal data, fresh activations; 30 timed calls after one warm-up.
bfloat16, which NumPy lacks, runs the op alone in onnxruntime (CPU EP, one thread). Run it with
PYTHONPATH (or, for bfloat16, NMCLI_OPS_LIBRARY) pointing at another build to compare two builds
on this machine.

    python scripts/cpu_kernel_time.py
    python scripts/cpu_kernel_time.py --nm 2:4 --shape 4096x4096 --rows 1 --rows 4
    python scripts/cpu_kernel_time.py --glu --shape 1408x512 --rows 64    # the gated prologue too
    python scripts/cpu_kernel_time.py --dtype bfloat16 --shape 4096x4096 --rows 16
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


def bfloat16_op(w: np.ndarray, rows: int, pattern: NMPattern):
    """A call of the op alone, pruned from `w` rounded to bfloat16, in an onnxruntime session on
    one thread: returns (run, x) with run() computing y for the bfloat16 activation x."""
    import ml_dtypes  # an onnx dependency
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    import nmcli
    from nmcli.toymodels import make_model, vinfo

    bf16 = onnx.TensorProto.BFLOAT16
    k, n = w.shape
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["y"])], [vinfo("x", ml_dtypes.bfloat16, [rows, k])],
                       [vinfo("y", ml_dtypes.bfloat16, [rows, n])],
                       [numpy_helper.from_array(w.astype(ml_dtypes.bfloat16), "W")])
    pruned, _ = nmcli.prune_model(model, nmcli.Selection(pattern))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = nmcli.session(pruned, sess_options=options)
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(ml_dtypes.bfloat16)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(np.uint16), bf16))
    binding.bind_output("y")
    return lambda: session.run_with_iobinding(binding), x.astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", help="KxN (repeatable)")
    parser.add_argument("--rows", type=int, action="append", help="activation rows (repeatable; default 1, 4, 64)")
    parser.add_argument("--nm", default="2:8")
    parser.add_argument("--glu", action="store_true",
                        help="the op's GLU prologue (glu=silu, a second activation x_up); NumPy computes it too")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="of the weights and activations (NumPy's dense product stays fp32)")
    args = parser.parse_args()
    if args.dtype == "bfloat16" and args.glu:
        parser.error("--glu takes float32 or float16")
    pattern = NMPattern.parse(args.nm)
    rng = np.random.default_rng(0)
    for shape in args.shape or SHAPES:
        k, n = (int(v) for v in shape.split("x"))
        w = rng.standard_normal((k, n)).astype(np.float32)
        packed = pack(w, choose_offsets(np.abs(w), pattern), pattern)
        if args.dtype == "float16":
            packed = pack(w.astype(np.float16), choose_offsets(np.abs(w), pattern), pattern)
        for rows in args.rows or [1, 4, 64]:
            x, up = (rng.standard_normal((rows, k)).astype(np.float32) for _ in range(2))
            if args.dtype == "bfloat16":
                run, x = bfloat16_op(w, rows, pattern)
            else:
                xs, ups = (a.astype(args.dtype) for a in (x, up))
                gated = dict(x_up=ups, glu="silu") if args.glu else {}
                run = lambda: _kernels.nm_matmul_cpu(xs, packed.values, packed.indices, None,  # noqa: E731
                                                     pattern.n, pattern.m, k, 1.0, threads=1, **gated)
            ours = median_ms(run)
            dense = median_ms(lambda: (x / (1 + np.exp(-x)) * up if args.glu else x) @ w)
            print(f"{rows:3d} x {k} x {n} {pattern} {args.dtype}{' glu' if args.glu else ''}: nmcli {ours:.3f} ms, "
                  f"numpy dense fp32 {dense:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
