"""The nmcli command line: a thin shell over the library (prune_model, session, ...)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup
from rich.table import Table

from .errors import NmcliError
from .format import NMPattern, PackedShape
from .graph import Selection, find_candidates
from .report import human_bytes

app = typer.Typer(name="nmcli", help="Prune ONNX models to N:M sparsity and run them on nmcli's kernels.",
                  add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  pretty_exceptions_enable=False)


def _report_width() -> int | None:
    """Rich squeezes tables to 80 columns when stdout is not a terminal (a log, a pipe, a
    notebook), which cuts the numbers to '0.0…'; there, give them room unless COLUMNS says."""
    return None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160


out = Console(soft_wrap=True, width=_report_width())
err = Console(stderr=True, soft_wrap=True)


def handle_errors(command):
    """Every failure a user can cause becomes one line on stderr and a non-zero exit."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except NmcliError as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True)
            raise typer.Exit(exc.exit_code)
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]")
            raise typer.Exit(130)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # a bug of ours: still one line, with a way to see more
            if os.environ.get("NMCLI_DEBUG"):
                raise
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            err.print(f"[bold red]internal error:[/] {type(exc).__name__}: {message} "
                      "(set NMCLI_DEBUG=1 for a traceback)", highlight=False)
            raise typer.Exit(70)
    return wrapper


def _version(value: bool):
    if value:
        from . import __version__
        out.print(f"nmcli {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                              help="Print the version and exit.")):
    """nmcli: general N:M weight sparsity for ONNX models, with its own CPU and CUDA kernels."""


NM_HELP = "N:M pattern: keep N of every M consecutive weights along K (2:4, 2:8, 1:4, 4:16, ...)."
INCLUDE_HELP = "Only prune layers whose node or weight name matches this regex (repeatable)."
EXCLUDE_HELP = "Skip layers whose node or weight name matches this regex (repeatable)."
MIN_SIZE_HELP = "Skip weights with fewer elements than this."
PERMUTE_HELP = ("Reorder input channels before N:M grouping where it keeps more of the criterion score "
                "(one Gather of the activation per call; outputs equal the dense model with the same weights).")
VECTOR_HELP = ("Vector-wise N:M: aligned blocks of this many output columns keep the same positions (0: "
               "each column its own). A multiple of 32 runs on the GPU's vector-wise tensor-core path (fp32; "
               "fp16/bf16 up to 64 rows at N/M <= 1/4); magnitude and wanda only.")
PREFILL_COPY_HELP = ("Also store each fp16/bf16 weight packed as 2:4 (1:4, 2:8, 1:8 and other patterns with at "
                     "most 2 of 4 consecutive weights kept): on the GPU, 9 rows and more read it on the sparse "
                     "tensor cores without regrouping, decode keeps the sparser bytes. Costs model size: 2:8 "
                     "becomes 0.86x of dense instead of 0.30x.")
FUSE_HELP = ("Merge MatMuls that read the same activation (Q/K/V, gate/up) into one op that writes each "
             "original output, and move a residual Add after an op and a SiLU-gated product or an RMSNorm "
             "before it into the op: fewer, wider kernel calls.")


@app.command()
@handle_errors
def prune(
    model: Path = typer.Argument(..., help="Input ONNX model (never modified)."),
    nm: str = typer.Option("2:8", "--nm", help=NM_HELP),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output model [default: MODEL.nm.onnx]."),
    method: str = typer.Option("magnitude", "--method", help="How to choose the kept weights: magnitude (|W|), "
                                                           "wanda (|W| * ||X_k|| from calibration inputs) or sparsegpt "
                                                           "(also updates the kept weights to offset the dropped ones)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration inputs for wanda, sparsegpt and "
                                                               "--bias-correct: .npz with one array per model input, "
                                                               "samples on axis 0."),
    calib_samples: int = typer.Option(8, "--calib-samples", min=1, help="Generated calibration samples without --calib."),
    calib_tokens: int = typer.Option(64, "--calib-tokens", min=1, help="Sequence length of generated samples."),
    permute: bool = typer.Option(False, "--permute", help=PERMUTE_HELP),
    bias_correct: bool = typer.Option(False, "--bias-correct", help="Add to each pruned layer's bias the mean change "
                                                                   "of its output on the calibration inputs (any method)."),
    fuse: bool = typer.Option(True, "--fuse/--no-fuse", help=FUSE_HELP),
    vector: int = typer.Option(0, "--vector", help=VECTOR_HELP),
    prefill_copy: bool = typer.Option(False, "--prefill-copy", help=PREFILL_COPY_HELP),
    include: List[str] = typer.Option([], "--include", help=INCLUDE_HELP),
    exclude: List[str] = typer.Option([], "--exclude", help=EXCLUDE_HELP),
    min_size: int = typer.Option(0, "--min-size", min=0, help=MIN_SIZE_HELP),
    force: bool = typer.Option(False, "--force", help="Allow the output to replace the input file."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
):
    """Prune MatMul/Gemm weights to N:M and rewrite them to nmcli's op."""
    from .modelio import check_output_path, load_model, save_model
    from .prefill_copy import check_prefill_copy
    from .prune import check_vector, get_criterion, prune_model

    pattern = NMPattern.parse(nm)
    criterion = get_criterion(method)
    check_vector(vector, criterion)
    if prefill_copy:
        check_prefill_copy(pattern)
    output = output or model.with_name(model.name.removesuffix(".onnx") + ".nm.onnx")
    check_output_path(model, output, force)
    dense = load_model(model)
    selection = Selection(pattern, include=include, exclude=exclude, min_size=min_size)
    feeds = _calibration(dense, criterion, calib, calib_samples, calib_tokens, bias_correct)
    with err.status("searching channel orders (--permute)") if permute else contextlib.nullcontext():
        pruned, report = prune_model(dense, selection, criterion=criterion, calibration=feeds, permute=permute,
                                     fuse=fuse, bias_correct=bias_correct, vector=vector,
                                     prefill_copy=prefill_copy)
    _check(pruned)
    written = save_model(pruned, output)
    if as_json:
        print(json.dumps({"input": str(model), "output": str(output), "files": [str(p) for p in written],
                          **report.to_dict()}, indent=2))
        return
    how = f"{pattern}, {report.method}" + (f", vector {vector}" if vector else "")
    out.print(report.table(f"{model.name} -> {output.name}  ({how})"))
    skipped = report.skipped_table()
    if skipped is not None:
        out.print(skipped)
    fused = [f"{count} {FUSED_NAMES[kind]}" for kind, count in report.fused.items() if count]
    if fused:
        out.print(f"fused into the op: {', '.join(fused)}")
    if report.bias_corrected:
        out.print(f"bias corrected from the calibration means: {report.bias_corrected} layer(s)")
    if report.prefill_copy_bytes:
        with_copy = report.bytes_after + report.prefill_copy_bytes
        out.print(f"2:4 copies for the sparse tensor cores: +{human_bytes(report.prefill_copy_bytes)} (pruned weights "
                  f"{human_bytes(with_copy)} in all, {with_copy / report.bytes_before:.2f}x of dense)")
    out.print(f"[green]wrote[/] {', '.join(str(p) for p in written)}")


FUSED_NAMES = {"glu": "gated activation(s)", "norm": "RMSNorm(s)", "residual": "residual add(s)"}


@app.command()
@handle_errors
def info(
    model: Path = typer.Argument(..., help="ONNX model to inspect."),
    nm: str = typer.Option("2:8", "--nm", help=NM_HELP),
    include: List[str] = typer.Option([], "--include", help=INCLUDE_HELP),
    exclude: List[str] = typer.Option([], "--exclude", help=EXCLUDE_HELP),
    min_size: int = typer.Option(0, "--min-size", min=0, help=MIN_SIZE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the analysis as JSON on stdout."),
):
    """Show the prunable layers and what `prune` would do with them."""
    from .modelio import load_model, raw_initializer_bytes
    from .prune import OP_DOMAIN, OP_TYPE

    pattern = NMPattern.parse(nm)
    loaded = load_model(model)
    candidates = find_candidates(loaded, Selection(pattern, include=include, exclude=exclude, min_size=min_size))
    rows, seen = [], set()
    for cand in candidates:
        k, nout = cand.shape
        row = {"layer": cand.name, "op": cand.node.op_type, "weight": cand.weight_name, "k": k, "nout": nout,
               "action": "prune" if cand.weight is not None else "skip", "reason": cand.skip_reason}
        if cand.weight is not None:
            first = cand.weight_key not in seen
            seen.add(cand.weight_key)
            row["bytes_before"] = cand.weight.nbytes if first else 0
            row["bytes_after"] = PackedShape(k, nout, pattern).packed_bytes(cand.weight.itemsize) if first else 0
        rows.append(row)
    already = [n for n in loaded.graph.node if n.domain == OP_DOMAIN and n.op_type == OP_TYPE]
    before = sum(r.get("bytes_before", 0) for r in rows)
    after = sum(r.get("bytes_after", 0) for r in rows)
    file_bytes = raw_initializer_bytes(loaded)
    summary = {"model": str(model), "ir_version": loaded.ir_version,
               "opsets": {o.domain or "ai.onnx": o.version for o in loaded.opset_import},
               "nodes": len(loaded.graph.node), "pattern": str(pattern), "layers": rows,
               "already_sparse_nodes": len(already), "prunable_bytes_before": before, "prunable_bytes_after": after,
               "weights_bytes_before": file_bytes, "weights_bytes_after": file_bytes - before + after}
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"{model.name}: MatMul/Gemm layers under {pattern}", header_style="bold")
    for col, justify in [("layer", "left"), ("op", "left"), ("K x Nout", "right"), ("action", "left"),
                         ("dense", "right"), ("packed", "right")]:
        table.add_column(col, justify=justify)
    for r in rows:
        action = "[green]prune[/]" if r["action"] == "prune" else f"[yellow]skip[/]: {r['reason']}"
        table.add_row(r["layer"], r["op"], f"{r['k']} x {r['nout']}" if r["k"] else "-", action,
                      human_bytes(r.get("bytes_before", 0)) if "bytes_before" in r else "-",
                      human_bytes(r.get("bytes_after", 0)) if "bytes_after" in r else "-")
    out.print(table)
    out.print(f"IR {loaded.ir_version}, {len(loaded.graph.node)} nodes, opsets {summary['opsets']}")
    if already:
        out.print(f"{len(already)} node(s) already use {OP_DOMAIN}.{OP_TYPE}")
    if before:
        out.print(f"prunable weights: {human_bytes(before)} -> {human_bytes(after)} ({before / after:.2f}x); "
                  f"all weights: {human_bytes(file_bytes)} -> {human_bytes(file_bytes - before + after)}")
    else:
        out.print("[yellow]nothing to prune under these settings[/]")


class _BenchGroup(TyperGroup):
    """`nmcli bench MODEL ...` runs the `model` subcommand; `nmcli bench kernels` the kernel one."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["model", *args]
        return super().parse_args(ctx, args)


bench_app = typer.Typer(cls=_BenchGroup, no_args_is_help=True,
                        help="Measure speed: a model dense vs N:M (`nmcli bench MODEL --nm 2:8`), or the kernels.")
app.add_typer(bench_app, name="bench")

BENCH_SHAPE_HELP = "Input shape for every setting, NAME=DIMS like input_ids=1x128 (repeatable)."


CUDA_GRAPH_HELP = ("Time CUDA-graph replays (ORT enable_cuda_graph, fixed device buffers), as a decode server "
                   "runs; both models, GPU only.")


def _bench_and_print(dense, sparse, *, device_choice, tokens, batch, shape, warmup, runs, as_json, dense_path=None,
                     sparse_path=None, extra=None, cuda_graph=False):
    """device_choice: (device, notes) from benchmodel.pick_device, made once per command."""
    from rich.progress import Progress

    from . import benchmodel as bm
    from .inputs import parse_shape_overrides

    overrides = parse_shape_overrides(shape)
    chosen, notes = device_choice
    settings = bm.default_settings(chosen, tokens, batch)
    if overrides and not tokens and all(s.name in overrides for s in bm.input_specs(dense)):
        settings = [("custom", batch, 1)]  # every input fixed by --shape: one setting
    runs = runs or (100 if chosen == "cuda" else 20)
    warmup = warmup if warmup is not None else (10 if chosen == "cuda" else 3)
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("loading", total=None)
        report = bm.bench_pair(dense, sparse, settings, overrides, device=chosen, notes=notes, warmup=warmup, runs=runs,
                               dense_path=dense_path, sparse_path=sparse_path, cuda_graph=cuda_graph,
                               progress=lambda what: progress.update(task, description=what))
    for note in report.notes:
        err.print(f"[yellow]warning:[/] {note}", highlight=False)
    if as_json:
        print(json.dumps({**(extra or {}), **report.to_dict()}, indent=2))
        return report
    for table in bm.report_tables(report):
        out.print(table)
    return report


@bench_app.command("model")
@handle_errors
def bench_model(
    model: Path = typer.Argument(..., help="Dense ONNX model."),
    nm: Optional[str] = typer.Option(None, "--nm", help="Prune in memory to this N:M and compare. " + NM_HELP),
    sparse: Optional[Path] = typer.Option(None, "--sparse", help="Compare against this already converted model."),
    method: str = typer.Option("magnitude", "--method", help="Pruning criterion with --nm."),
    permute: bool = typer.Option(False, "--permute", help="With --nm: " + PERMUTE_HELP),
    fuse: bool = typer.Option(True, "--fuse/--no-fuse", help="With --nm: " + FUSE_HELP),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when there is a GPU), cuda or cpu."),
    tokens: List[int] = typer.Option([], "--tokens", min=1, help="Sequence lengths to sweep "
                                     "[default: 1 and 512 on a GPU, 1 and 64 on a CPU]."),
    batch: int = typer.Option(1, "--batch", min=1, help="Batch size (first free dim of each input)."),
    shape: List[str] = typer.Option([], "--shape", help=BENCH_SHAPE_HELP),
    warmup: Optional[int] = typer.Option(None, "--warmup", min=0, help="Warm-up runs [default: 10 GPU, 3 CPU]."),
    runs: Optional[int] = typer.Option(None, "--runs", min=3, help="Timed runs [default: 100 GPU, 20 CPU]."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help=CUDA_GRAPH_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
):
    """Dense vs N:M in ONNX Runtime: latency (p10/p50/p90), op time split, size, memory, agreement, energy."""
    from . import benchmodel as bm
    from .modelio import load_model
    from .prune import get_criterion, prune_model

    if (nm is None) == (sparse is None):
        raise NmcliError("give exactly one of --nm N:M (prune in memory) or --sparse MODEL (compare two files)")
    if permute and nm is None:
        raise NmcliError("--permute applies when pruning in memory (--nm); prune the --sparse model with it instead")
    dense = load_model(model)
    if sparse is not None:
        sparse_model = load_model(sparse)
        extra = {"dense_model": str(model), "sparse_model": str(sparse)}
    else:
        pattern = NMPattern.parse(nm)
        criterion = get_criterion(method)
        sparse_model, prune_report = prune_model(dense, Selection(pattern), criterion=criterion,
                                                 calibration=_calibration(dense, criterion, None, 8, 64),
                                                 permute=permute, fuse=fuse)
        extra = {"dense_model": str(model), "nm": str(pattern), "method": prune_report.method,
                 "permute": permute, "fuse": fuse, "pruned_layers": len(prune_report.layers)}
    _bench_and_print(dense, sparse_model, device_choice=bm.pick_device(device), tokens=tokens, batch=batch, shape=shape, warmup=warmup,
                     runs=runs, as_json=as_json, dense_path=str(model), sparse_path=str(sparse) if sparse else None,
                     extra=extra, cuda_graph=cuda_graph)


@app.command()
@handle_errors
def demo(
    nm: str = typer.Option("2:8", "--nm", help=NM_HELP),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when there is a GPU), cuda or cpu."),
    hidden: Optional[int] = typer.Option(None, "--hidden", min=8, help="Hidden size [default: 4096 GPU, 512 CPU]."),
    ffn: Optional[int] = typer.Option(None, "--ffn", min=8, help="MLP size [default: 11008 GPU, 1408 CPU]."),
    heads: Optional[int] = typer.Option(None, "--heads", min=1, help="Attention heads [default: 32 GPU, 8 CPU]."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Decoder layers [default: 1 GPU, 2 CPU]."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float16 or float32 [default: float16 GPU, float32 CPU]."),
    tokens: List[int] = typer.Option([], "--tokens", min=1, help="Sequence lengths to sweep."),
    runs: Optional[int] = typer.Option(None, "--runs", min=3, help="Timed runs per setting."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help=CUDA_GRAPH_HELP),
    output_dir: Path = typer.Option(Path("nmcli-demo"), "--output-dir", help="Where the two models are saved."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    fuse: bool = typer.Option(True, "--fuse/--no-fuse", help=FUSE_HELP),
    prefill_copy: bool = typer.Option(False, "--prefill-copy", help=PREFILL_COPY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
):
    """Build a LLaMA-style decoder block, save it, prune it to N:M and bench dense vs sparse."""
    import numpy as np

    from . import benchmodel as bm
    from .llama import CPU_DEFAULT, GPU_DEFAULT, LlamaConfig, llama_model
    from .modelio import save_model
    from .prefill_copy import check_prefill_copy
    from .prune import prune_model

    pattern = NMPattern.parse(nm)
    if prefill_copy:
        check_prefill_copy(pattern)
    chosen, notes = bm.pick_device(device)
    base = GPU_DEFAULT if chosen == "cuda" else CPU_DEFAULT
    config = LlamaConfig(hidden=hidden or base.hidden, ffn=ffn or base.ffn, heads=heads or base.heads,
                         layers=layers or base.layers, dtype=dtype or base.dtype).check()
    if prefill_copy and config.dtype == "float32":
        raise NmcliError("--prefill-copy needs --dtype float16: the sparse tensor cores take float16 and bfloat16 "
                         "weights, and the block would be float32")
    if output_dir.exists() and not output_dir.is_dir():
        raise NmcliError(f"--output-dir {output_dir}: exists and is not a directory")
    output_dir.mkdir(parents=True, exist_ok=True)
    copy_tag = ".2of4-copy" if prefill_copy else ""
    dense_path = output_dir / "llama-block.onnx"
    sparse_path = output_dir / f"llama-block.{pattern.n}-{pattern.m}{copy_tag}.onnx"
    with err.status(f"building a {config.layers}-layer LLaMA-style block (hidden {config.hidden}, MLP {config.ffn}, "
                    f"{config.dtype}, {config.params / 1e6:.0f}M parameters) and pruning it to {pattern}"):
        dense = llama_model(config, np.random.default_rng(seed))
        save_model(dense, dense_path)
        sparse, prune_report = prune_model(dense, Selection(pattern), fuse=fuse, prefill_copy=prefill_copy)
        save_model(sparse, sparse_path)
    if not as_json:
        out.print(f"[green]saved[/] {dense_path} and {sparse_path} ({len(prune_report.layers)} layers pruned to {pattern})")
    _bench_and_print(dense, sparse, device_choice=(chosen, notes), tokens=tokens, batch=1, shape=[], warmup=None, runs=runs,
                     as_json=as_json, dense_path=str(dense_path), sparse_path=str(sparse_path),
                     extra={"config": config.to_dict(), "nm": str(pattern), "fuse": fuse, "prefill_copy": prefill_copy,
                            "dense_model": str(dense_path),
                            "sparse_model": str(sparse_path)}, cuda_graph=cuda_graph)


@bench_app.command("kernels")
@handle_errors
def bench_kernels(
    nm: List[str] = typer.Option(["2:4", "2:8", "1:4", "4:16", "1:8"], "--nm", help="N:M patterns (repeatable)."),
    dtype: str = typer.Option("float16", "--dtype", help="float16, bfloat16 or float32."),
    shapes: str = typer.Option("all", "--shapes", help="all, llama (LLaMA-7B/8B layers, 1..16 rows + 256, 4096) "
                                                       "or nmsparse (the nmSPARSE operator table)."),
    rows: List[int] = typer.Option([], "--rows", min=1, help="Activation row counts to time on the shapes' K x N, "
                                                           "instead of their own (repeatable)."),
    shape: List[str] = typer.Option([], "--shape", help="Weight shape KxN to time instead of --shapes' sets, "
                                                        "e.g. 8192x3072 (repeatable); at --rows, else at 1, 2, "
                                                        "4, 8, 16, 256 and 4096 rows."),
    replays: int = typer.Option(20, "--replays", min=3, help="Timed graph replays per measurement (median)."),
    path: str = typer.Option("auto", "--path", help="auto (the dispatch's choice), decode, decode_mma, mma, wgmma, "
                                                   "wgmma_sp, vector or tiled; calls a forced path cannot run are "
                                                   "skipped."),
    vector: int = typer.Option(0, "--vector", min=0, help="Prune the timed weights vector-wise, blocks of this many "
                                                         "columns (as prune --vector; the op is told so)."),
    prefill_copy: bool = typer.Option(False, "--prefill-copy", help="Give the calls a 2:4 copy of the weight where "
                                                                  "the pattern fits (as prune --prefill-copy)."),
    cusparselt: bool = typer.Option(True, "--cusparselt/--no-cusparselt",
                                    help="Also time cuSPARSELt 2:4 (through torch, its searched algorithm) at "
                                         "each shape and row count."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout."),
):
    """Time nmcli's CUDA kernels against cuBLAS dense and cuSPARSELt 2:4 (CUDA-graph replay, weights
    rotated past L2; each pattern against the median of the cuBLAS runs at its shape and row count)."""
    from dataclasses import replace

    from rich.progress import Progress

    from . import bench_kernels as bk
    from .prune import check_vector

    patterns = [NMPattern.parse(p) for p in nm]
    if dtype not in ("float16", "bfloat16", "float32"):
        raise NmcliError(f"--dtype must be float16, bfloat16 or float32, not '{dtype}'")
    if shapes not in ("all", "llama", "nmsparse"):
        raise NmcliError(f"--shapes must be all, llama or nmsparse, not '{shapes}'")
    if path not in ("auto", "decode", "decode_mma", "mma", "wgmma", "wgmma_sp", "vector", "tiled"):
        raise NmcliError(f"--path must be auto, decode, decode_mma, mma, wgmma, wgmma_sp, vector or tiled, not '{path}'")
    weights = [bk.parse_weight_shape(s) for s in shape]
    check_vector(vector)
    torch = bk.require_gpu()
    todo = [(s, p) for s in bk.default_shapes(shapes != "llama", shapes != "nmsparse", rows, weights)
            for p in patterns if bk.path_for(*s, p, dtype, path, vector, prefill_copy)]
    if not todo:
        raise NmcliError(f"the {path} path runs none of the selected shapes")
    props = torch.cuda.get_device_properties(0)
    copy_gbps = bk.copy_bandwidth(torch)
    points = list(dict.fromkeys(s for s, _ in todo)) if cusparselt else []
    sparselt: dict[tuple, float | None] = {}
    timing: dict[str, list[str]] = {}  # how cuSPARSELt was timed (or why not): the points of each
    results = []
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(todo) + len(points))
        for point in points:
            progress.update(task, description="{}x{}x{} cuSPARSELt 2:4".format(*point))
            sparselt[point], note = bk.time_cusparselt(torch, *point, dtype, props.L2_cache_size, replays)
            timing.setdefault(note, []).append("{}x{}x{}".format(*point))
            progress.advance(task)
        for (m, k, n), pattern in todo:
            progress.update(task, description=f"{m}x{k}x{n} {pattern}")
            row = bk.bench_shape(torch, m, k, n, pattern, dtype, copy_gbps, props.L2_cache_size, replays,
                                 path=path, vector=vector, prefill_copy=prefill_copy)
            results.append(replace(row, cusparselt_ms=sparselt.get((m, k, n))))
            progress.advance(task)
    results = bk.shared_baseline(results)
    for note, where in timing.items():
        if note != "searched":
            err.print(f"[yellow]note:[/] cuSPARSELt 2:4 at {len(where)} point(s) ({where[0]}, ...): {note}",
                      highlight=False)
    if as_json:
        print(json.dumps({"gpu": props.name, "copy_gbps": copy_gbps, "dtype": dtype, "vector": vector,
                          "prefill_copy": prefill_copy, "cusparselt": bk.cusparselt_version(torch),
                          "cusparselt_timing": timing, "rows": bk.as_dicts(results)}, indent=2))
        return
    how = dtype + (f", vector {vector}" if vector else "") + (", 2:4 copies" if prefill_copy else "")
    table = Table(title=f"{props.name}: nmcli kernels vs cuBLAS dense and cuSPARSELt 2:4 ({how}; copy bandwidth "
                        f"{copy_gbps:.0f} GB/s)",
                  header_style="bold")
    for col in ("M", "K", "N", "N:M", "path", "ours ms", "cuBLAS ms", "speedup", "cuSPARSELt 2:4 ms",
                "vs cuSPARSELt", "GB/s", "% copy BW", "TFLOP/s", "cuBLAS TFLOP/s"):
        table.add_column(col, justify="right")
    for r in results:
        lt = r.cusparselt_ms
        table.add_row(str(r.m), str(r.k), str(r.n), r.nm, bk.path_text(r.path, r.tile, r.copy), f"{r.ours_ms:.4f}",
                      f"{r.cublas_ms:.4f}", f"{r.speedup:.2f}x", f"{lt:.4f}" if lt else "-",
                      f"{lt / r.ours_ms:.2f}x" if lt else "-", f"{r.gbps:.0f}", f"{r.pct_copy_bw:.0f}%",
                      f"{r.tflops:.1f}", f"{r.cublas_tflops:.1f}")
    out.print(table)


@app.command("eval")
@handle_errors
def eval_models(
    dense: Path = typer.Argument(..., help="The dense ONNX model."),
    sparse: Path = typer.Argument(..., help="The converted model (from nmcli prune)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Inputs to compare on: .npz with one array per model "
                                                               "input, samples on axis 0 [default: generated]."),
    samples: int = typer.Option(8, "--samples", min=1, help="Generated samples without --calib."),
    tokens: int = typer.Option(64, "--tokens", min=1, help="Sequence length of generated samples."),
    shape: List[str] = typer.Option([], "--shape", help=BENCH_SHAPE_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated inputs."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
):
    """Output agreement (relative error, cosine, top-1) and per-layer weight error, dense vs sparse."""
    import numpy as np

    from .calibrate import generated_calibration, load_calibration
    from .evaluate import evaluate
    from .inputs import input_specs, parse_shape_overrides
    from .modelio import load_model

    dense_model, sparse_model = load_model(dense), load_model(sparse)
    specs = input_specs(dense_model)
    if calib is not None:
        if shape:
            raise NmcliError("--shape applies to generated inputs; the --calib file fixes the shapes")
        feeds, source = load_calibration(calib, specs), str(calib)
    else:
        overrides = parse_shape_overrides(shape)
        feeds = generated_calibration(specs, samples, tokens, np.random.default_rng(seed), overrides)
        source = "generated random inputs"
    with err.status("running both models"):
        report = evaluate(dense_model, sparse_model, feeds, source, str(dense), str(sparse))
    for note in report.notes:
        err.print(f"[yellow]note:[/] {note}", highlight=False)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
        return
    for table in report.tables():
        out.print(table)


@app.command("ops-path")
@handle_errors
def ops_path():
    """Print the path of the op library (for register_custom_ops_library in any language)."""
    from .runtime import ops_library_path

    print(ops_library_path())


def _calibration(model, criterion, calib, samples: int, tokens: int, bias_correct: bool = False):
    """Calibration feeds for criteria (or a bias correction) that need them (None otherwise)."""
    if not getattr(criterion, "needs_calibration", False) and not bias_correct:
        if calib is not None:
            raise NmcliError(f"--calib is only used by activation-aware methods (wanda, sparsegpt) and --bias-correct, "
                             f"not by '{criterion.name}' alone")
        return None
    import numpy as np

    from .calibrate import generated_calibration, load_calibration
    from .inputs import input_specs

    specs = input_specs(model)
    if calib is not None:
        return load_calibration(calib, specs)
    purpose = criterion.name if getattr(criterion, "needs_calibration", False) else "the bias correction"
    err.print(f"[yellow]warning:[/] no --calib given: calibrating {purpose} on {samples} generated samples of "
              f"{tokens} tokens; real data prunes better", highlight=False)
    return generated_calibration(specs, samples, tokens, np.random.default_rng(0))


def _check(model) -> None:
    import onnx

    from .modelio import PROTOBUF_LIMIT, raw_initializer_bytes

    if raw_initializer_bytes(model) < PROTOBUF_LIMIT:
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as exc:
            raise NmcliError(f"the rewritten model fails onnx.checker: {str(exc).splitlines()[0]}") from None


def main():
    app(prog_name="nmcli")


if __name__ == "__main__":
    sys.exit(main())
