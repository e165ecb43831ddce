"""The nmcli command line: a thin shell over the library (prune_model, session, ...)."""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import NmcliError
from .format import NMPattern, PackedShape
from .graph import Selection, find_candidates
from .report import human_bytes

app = typer.Typer(name="nmcli", help="Prune ONNX models to N:M sparsity and run them on nmcli's kernels.",
                  add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  pretty_exceptions_enable=False)
out = Console(soft_wrap=True)
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


@app.command()
@handle_errors
def prune(
    model: Path = typer.Argument(..., help="Input ONNX model (never modified)."),
    nm: str = typer.Option("2:8", "--nm", help=NM_HELP),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output model [default: MODEL.nm.onnx]."),
    method: str = typer.Option("magnitude", "--method", help="How to choose the kept weights: magnitude."),
    include: List[str] = typer.Option([], "--include", help=INCLUDE_HELP),
    exclude: List[str] = typer.Option([], "--exclude", help=EXCLUDE_HELP),
    min_size: int = typer.Option(0, "--min-size", min=0, help=MIN_SIZE_HELP),
    force: bool = typer.Option(False, "--force", help="Allow the output to replace the input file."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
):
    """Prune MatMul/Gemm weights to N:M and rewrite them to nmcli's op."""
    from .modelio import check_output_path, load_model, save_model
    from .prune import get_criterion, prune_model

    pattern = NMPattern.parse(nm)
    criterion = get_criterion(method)
    output = output or model.with_name(model.name.removesuffix(".onnx") + ".nm.onnx")
    check_output_path(model, output, force)
    dense = load_model(model)
    selection = Selection(pattern, include=include, exclude=exclude, min_size=min_size)
    pruned, report = prune_model(dense, selection, criterion=criterion)
    _check(pruned)
    written = save_model(pruned, output)
    if as_json:
        print(json.dumps({"input": str(model), "output": str(output), "files": [str(p) for p in written],
                          **report.to_dict()}, indent=2))
        return
    out.print(report.table(f"{model.name} -> {output.name}  ({pattern}, {report.method})"))
    skipped = report.skipped_table()
    if skipped is not None:
        out.print(skipped)
    out.print(f"[green]wrote[/] {', '.join(str(p) for p in written)}")


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


bench_app = typer.Typer(help="Measure speed: kernels against cuBLAS dense.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("kernels")
@handle_errors
def bench_kernels(
    nm: List[str] = typer.Option(["2:4", "2:8", "1:4", "4:16", "1:8"], "--nm", help="N:M patterns (repeatable)."),
    dtype: str = typer.Option("float16", "--dtype", help="float16, bfloat16 or float32."),
    shapes: str = typer.Option("all", "--shapes", help="all, llama (LLaMA-7B/8B layers, 1..16 rows + 256, 4096) "
                                                       "or nmsparse (the nmSPARSE operator table)."),
    rows: List[int] = typer.Option([], "--rows", help="Only these activation row counts (repeatable)."),
    replays: int = typer.Option(20, "--replays", min=3, help="Timed graph replays per measurement (median)."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout."),
):
    """Time nmcli's CUDA kernels against cuBLAS dense (CUDA-graph replay, weights rotated past L2)."""
    from rich.progress import Progress

    from . import bench_kernels as bk

    patterns = [NMPattern.parse(p) for p in nm]
    if dtype not in ("float16", "bfloat16", "float32"):
        raise NmcliError(f"--dtype must be float16, bfloat16 or float32, not '{dtype}'")
    if shapes not in ("all", "llama", "nmsparse"):
        raise NmcliError(f"--shapes must be all, llama or nmsparse, not '{shapes}'")
    torch = bk.require_gpu()
    todo = [s for s in bk.default_shapes(shapes != "llama", shapes != "nmsparse") if not rows or s[0] in rows]
    props = torch.cuda.get_device_properties(0)
    copy_gbps = bk.copy_bandwidth(torch)
    results = []
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(todo) * len(patterns))
        for (m, k, n) in todo:
            for pattern in patterns:
                progress.update(task, description=f"{m}x{k}x{n} {pattern}")
                results.append(bk.bench_shape(torch, m, k, n, pattern, dtype, copy_gbps, props.L2_cache_size, replays))
                progress.advance(task)
    if as_json:
        print(json.dumps({"gpu": props.name, "copy_gbps": copy_gbps, "dtype": dtype, "rows": bk.as_dicts(results)},
                         indent=2))
        return
    table = Table(title=f"{props.name}: nmcli kernels vs cuBLAS dense ({dtype}; copy bandwidth {copy_gbps:.0f} GB/s)",
                  header_style="bold")
    for col in ("M", "K", "N", "N:M", "path", "ours ms", "cuBLAS ms", "speedup", "GB/s", "% copy BW", "TFLOP/s",
                "cuBLAS TFLOP/s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r.m), str(r.k), str(r.n), r.nm, r.path, f"{r.ours_ms:.4f}", f"{r.cublas_ms:.4f}",
                      f"{r.speedup:.2f}x", f"{r.gbps:.0f}", f"{r.pct_copy_bw:.0f}%", f"{r.tflops:.1f}",
                      f"{r.cublas_tflops:.1f}")
    out.print(table)


@app.command("ops-path")
@handle_errors
def ops_path():
    """Print the path of the op library (for register_custom_ops_library in any language)."""
    from .runtime import ops_library_path

    print(ops_library_path())


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
