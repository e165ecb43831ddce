"""`nmcli bench MODEL` and `nmcli demo` on the CPU: the report's structure and JSON (numbers are
not asserted), generated inputs in valid ranges, and one clear line for every bad input; the
markdown tables made from `nmcli bench kernels --json`."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import transformer_block
from onnx import TensorProto, helper, numpy_helper
from test_cli import assert_one_line_error, model_file, run  # noqa: F401  (fixture)

from nmcli.inputs import input_specs, parse_shape_overrides, random_feeds, resolve_shapes
from nmcli.errors import NmcliError
from nmcli.toymodels import make_model

LATENCY_KEYS = {"p10_ms", "p50_ms", "p90_ms"}


def check_report(report, settings):
    assert [s["name"] for s in report["settings"]] == settings
    assert report["provider"] == "CPUExecutionProvider"
    assert report["sparse"]["file_bytes"] < report["dense"]["file_bytes"]
    for s in report["settings"]:
        for side in ("dense", "sparse"):
            assert set(s[side]) == LATENCY_KEYS
            assert 0 < s[side]["p10_ms"] <= s[side]["p50_ms"] <= s[side]["p90_ms"]
        assert s["speedup"] == pytest.approx(s["dense"]["p50_ms"] / s["sparse"]["p50_ms"])
        assert s["nm_op_ms"] > 0 and s["other_ms"] >= 0
        (agreement,) = s["agreement"]
        assert agreement["output"] == "y" and -1 <= agreement["cosine"] <= 1 and agreement["max_abs_diff"] > 0


def test_bench_prunes_in_memory_and_reports(model_file, tmp_path):
    result = run("bench", model_file, "--nm", "2:8", "--runs", "3", "--warmup", "1", "--tokens", "1", "--tokens", "7",
                 "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["nm"] == "2:8" and report["pruned_layers"] == 6
    check_report(report, ["decode 1x1", "prefill 1x7"])
    assert report["settings"][1]["shapes"] == {"x": [1, 7, 64]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block.onnx"]  # nothing written


def test_bench_compares_two_files_and_prints_tables(model_file, tmp_path):
    sparse = tmp_path / "block.nm.onnx"
    assert run("prune", model_file, "--nm", "1:4", "-o", sparse, cwd=tmp_path).returncode == 0
    result = run("bench", model_file, "--sparse", sparse, "--runs", "3", "--batch", "2", "--shape", "x=2x5x64",
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "dense vs sparse" in result.stdout and "custom" in result.stdout and "model size" in result.stdout
    from nmcli.runtime import cuda_device_count
    if cuda_device_count() == 0:  # the fallback to the CPU is announced
        assert "warning: no CUDA GPU visible" in result.stderr


def test_demo_builds_saves_prunes_and_benches(tmp_path):
    out = tmp_path / "demo"
    result = run("demo", "--hidden", "64", "--ffn", "96", "--heads", "4", "--layers", "2", "--runs", "3",
                 "--tokens", "2", "--output-dir", out, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["config"] == {"hidden": 64, "ffn": 96, "heads": 4, "layers": 2, "dtype": "float32"}
    check_report(report, ["prefill 1x2"])
    dense = onnx.load(str(out / "llama-block.onnx"))
    sparse = onnx.load(str(out / "llama-block.2-8.onnx"))
    assert sum(n.op_type == "MatMul" for n in dense.graph.node) == 2 * (7 + 2)  # 7 projections + 2 attention
    # per layer: Q/K/V fused, O, gate/up fused, down; the fused ops write their parts themselves
    assert sum(n.op_type == "NMMatMul" for n in sparse.graph.node) == 2 * 4
    assert sorted(len(n.output) for n in sparse.graph.node if n.op_type == "NMMatMul") == [1, 1, 1, 1, 2, 2, 3, 3]


def test_demo_defaults_on_cpu(tmp_path):
    result = run("demo", "--runs", "3", "--tokens", "1", "--output-dir", tmp_path / "d", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "decode 1x1" in result.stdout and "saved" in result.stdout
    from nmcli.runtime import cuda_device_count
    if cuda_device_count() == 0:
        assert "warning: no CUDA GPU visible" in result.stderr


def ids_model(rng, vocab=50, hidden=16):
    """input_ids -> Gather(embedding) -> MatMul, plus an attention_mask that is multiplied in."""
    n = helper.make_node
    nodes = [n("Gather", ["emb", "input_ids"], ["h"], name="embed"),
             n("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT, name="cast"),
             n("Unsqueeze", ["maskf", "axes"], ["mask3"], name="unsq"),
             n("Mul", ["h", "mask3"], ["hm"], name="mask"),
             n("MatMul", ["hm", "w"], ["y"], name="proj")]
    inits = [numpy_helper.from_array(rng.standard_normal((vocab, hidden)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((hidden, 32)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "s"])]
    return make_model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 32])], inits)


def test_generated_inputs_respect_vocabulary_and_masks(rng):
    specs = input_specs(ids_model(rng, vocab=50))
    assert [(s.name, s.kind, s.vocab) for s in specs] == [("input_ids", "ids", 50), ("attention_mask", "mask", 0)]
    feeds = random_feeds(specs, resolve_shapes(specs, 3, 200, {}), rng)
    assert feeds["input_ids"].shape == (3, 200) and feeds["input_ids"].dtype == np.int64
    assert 0 <= feeds["input_ids"].min() and feeds["input_ids"].max() < 50 and len(np.unique(feeds["input_ids"])) > 10
    assert np.all(feeds["attention_mask"] == 1)


def test_bench_on_token_ids(rng, tmp_path):
    path = tmp_path / "ids.onnx"
    onnx.save_model(ids_model(rng), str(path))
    result = run("bench", path, "--nm", "2:4", "--runs", "3", "--tokens", "9", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["settings"][0]["shapes"] == {"input_ids": [1, 9], "attention_mask": [1, 9]}


def test_shape_overrides_parse_and_check(rng):
    assert parse_shape_overrides(["x=1x128", "ids=4"]) == {"x": (1, 128), "ids": (4,)}
    for bad in ("x", "x=", "x=1x", "=3", "x=a"):
        with pytest.raises(NmcliError, match="expected NAME=DIMS"):
            parse_shape_overrides([bad])
    specs = input_specs(transformer_block(rng)[0])
    with pytest.raises(NmcliError, match="does not fit"):
        resolve_shapes(specs, 1, 1, {"x": (1, 2, 63)})
    with pytest.raises(NmcliError, match="names no model input"):
        resolve_shapes(specs, 1, 1, {"nope": (1,)})


@pytest.mark.parametrize("args,fragments", [
    (["bench", "missing.onnx", "--nm", "2:8"], ["missing.onnx", "no such file"]),
    (["bench", "garbage.onnx", "--nm", "2:8"], ["not a readable ONNX model"]),
    (["bench", "{model}"], ["exactly one of --nm"]),
    (["bench", "{model}", "--nm", "2:8", "--sparse", "{model}"], ["exactly one of --nm"]),
    (["bench", "{model}", "--nm", "9:4"], ["N"]),
    (["bench", "{model}", "--nm", "2:8", "--shape", "x=1x3"], ["does not fit"]),
    (["bench", "{model}", "--nm", "2:8", "--shape", "x:1x3"], ["expected NAME=DIMS"]),
    (["bench", "{model}", "--nm", "2:8", "--device", "tpu"], ["--device"]),
    (["demo", "--hidden", "60", "--heads", "8", "--runs", "3"], ["not a multiple of 8 heads"]),
])
def test_bench_bad_input_is_one_line(model_file, tmp_path, args, fragments):
    (tmp_path / "garbage.onnx").write_bytes(b"\x00not onnx at all" * 10)
    result = run(*[a.format(model=model_file) for a in args], cwd=tmp_path)
    assert_one_line_error(result, *fragments)


def test_bench_without_op_library_is_one_line(model_file, tmp_path):
    import os
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "nmcli", "bench", str(model_file), "--nm", "2:8", "--runs", "3"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "NMCLI_OPS_LIBRARY": str(tmp_path / "libnope.so")})
    assert_one_line_error(result, "op library not found")


def test_bench_models_with_different_inputs(model_file, rng, tmp_path):
    other = tmp_path / "ids.onnx"
    onnx.save_model(ids_model(rng), str(other))
    sparse = tmp_path / "ids.nm.onnx"
    assert run("prune", other, "--nm", "2:4", "-o", sparse, cwd=tmp_path).returncode == 0
    assert_one_line_error(run("bench", model_file, "--sparse", sparse, cwd=tmp_path), "different inputs")


def test_cuda_graph_flag_on_cpu_warns_and_runs(model_file, tmp_path):
    result = run("bench", model_file, "--nm", "2:4", "--cuda-graph", "--runs", "3", "--tokens", "2", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--cuda-graph applies to the CUDA EP only" in result.stderr
    report = json.loads(result.stdout)
    assert report["cuda_graph"] is False and report["settings"][0]["sparse"]["p50_ms"] > 0


def _kernel_row(m, k, n, nm, ours_us, cublas_us, path="decode", tile=None, copy=False):
    row = {"m": m, "k": k, "n": n, "nm": nm, "dtype": "float16", "path": path, "ours_ms": ours_us / 1e3,
           "cublas_ms": cublas_us / 1e3, "speedup": cublas_us / ours_us, "bytes_moved": 1, "gbps": 1.0,
           "pct_copy_bw": 61.4, "tflops": 1.0, "cublas_tflops": 1.0, "copy": copy}
    return row if tile is None else {**row, "tile": tile}  # JSON from before session 51 has no tile


def test_tile_plan_text():
    """The tile plan `nmcli bench kernels` prints after the path (_kernels.last_tile_plan()), and
    the path column with it."""
    from nmcli.bench_kernels import path_text, tile_text

    assert tile_text((0, 1, False, False)) == ""  # the call ran no warpgroup kernel
    assert tile_text((160, 1, False, False)) == "160"
    assert tile_text((192, 2, False, False)) == "192/2"
    assert tile_text((160, 2, True, False)) == "160/2 last"
    assert tile_text((256, 1, False, True)) == "256 sk"
    assert tile_text((256, 1, False, False, True)) == "256 pers"  # the persistent 2:4 kernel
    assert tile_text((256, 2, True, False, True)) == "256/2 pers last"  # its whole waves, then the last split
    assert tile_text((256, 1, False, False, False)) == "256"
    assert tile_text((64, 6, False, False, False, True)) == "64/6 x2"  # two blocks an SM (regrouping kernel)
    assert tile_text((160, 1, False, False, False, False)) == "160"
    assert path_text("decode") == "decode"
    assert path_text("wgmma_sp", "256 sk", copy=True) == "wgmma_sp 256 sk (2:4 copy)"


def test_kernel_bench_tables_from_json_rows(tmp_path):
    """scripts/bench_table.py (BENCHMARKS.md's tables): a line per shape and row count, the patterns
    in the order they first appear, the copy-bandwidth share only up to 16 rows, cuBLAS's median
    and every pattern's speedup over it, the path as the console table shows it (tile plan, a 2:4
    copy read), a blank for a pattern a point lacks; ranges over the shapes; the later run wins a
    point."""
    from nmcli.bench_kernels import markdown_table, speedup_ranges

    rows = [_kernel_row(1, 4096, 4096, "2:8", 5.0, 15.0), _kernel_row(1, 4096, 4096, "2:4", 10.0, 14.0),
            _kernel_row(256, 4096, 4096, "2:8", 25.0, 20.0, "wgmma_sp", "192/2 last", copy=True),
            _kernel_row(1, 4096, 1024, "2:8", 4.0, 8.0)]
    table = markdown_table(rows).splitlines()
    assert table[0] == "| K x N | rows | cuBLAS us | 2:8 | 2:4 |"
    assert table[2] == "| 4096 x 4096 | 1 | 14.5 | 5.0 us 2.90x 61% decode | 10.0 us 1.45x 61% decode |"
    assert table[3] == "| 4096 x 4096 | 256 | 20.0 | 25.0 us 0.80x wgmma_sp 192/2 last (2:4 copy) |  |"
    assert table[4] == "| 4096 x 1024 | 1 | 8.0 | 4.0 us 2.00x 61% decode |  |"
    ranges = speedup_ranges(rows).splitlines()
    assert ranges[2:] == ["| 1 | 2.00-2.90x | 1.45-1.45x |", "| 256 | 0.80-0.80x |  |"]

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"rows": rows}))
    second.write_text(json.dumps({"rows": [_kernel_row(1, 4096, 1024, "2:8", 2.0, 8.0)]}))
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_table.py"
    out = subprocess.run([sys.executable, str(script), str(first), str(second), "--ranges"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[2] == "| 1 | 2.90-4.00x | 1.45-1.45x |"


def test_kernel_bench_tables_show_cusparselt_where_the_run_timed_it():
    """cuSPARSELt 2:4 (time_cusparselt, once per shape and row count, carried on each pattern's
    row) gets a column after cuBLAS: its time and speedup over the point's median cuBLAS run, and a
    range per row count; points the run could not time stay blank, and runs without it keep the
    old tables (test_kernel_bench_tables_from_json_rows)."""
    from nmcli.bench_kernels import markdown_table, speedup_ranges

    def row(m, k, nm, ours_us, cublas_us, sparselt_us):
        return {**_kernel_row(m, k, 4096, nm, ours_us, cublas_us),
                "cusparselt_ms": None if sparselt_us is None else sparselt_us / 1e3}

    rows = [row(1, 4096, "2:4", 10.0, 14.0, 20.0), row(1, 4096, "2:8", 5.0, 16.0, 20.0),
            row(4096, 4096, "2:4", 140.0, 200.0, 160.0), row(4096, 11008, "2:4", 390.0, 550.0, 500.0),
            row(1, 11008, "2:4", 20.0, 30.0, None)]
    table = markdown_table(rows).splitlines()
    assert table[0] == "| K x N | rows | cuBLAS us | cuSPARSELt 2:4 us | 2:4 | 2:8 |"
    assert table[1] == "|:--|--:|--:|--:|--:|--:|"
    assert table[2] == "| 4096 x 4096 | 1 | 15.0 | 20.0 us 0.75x | 10.0 us 1.50x 61% decode | 5.0 us 3.00x 61% decode |"
    assert table[3].startswith("| 4096 x 4096 | 4096 | 200.0 | 160.0 us 1.25x | 140.0 us 1.43x")
    assert table[5] == "| 11008 x 4096 | 1 | 30.0 |  | 20.0 us 1.50x 61% decode |  |"
    ranges = speedup_ranges(rows).splitlines()
    assert ranges[0] == "| rows | cuSPARSELt 2:4 | 2:4 | 2:8 |"
    assert ranges[2:] == ["| 1 | 0.75-0.75x | 1.50-1.50x | 3.00-3.00x |", "| 4096 | 1.10-1.25x | 1.41-1.43x |  |"]


def test_cusparselt_timing_says_why_it_did_not_time():
    """time_cusparselt returns no time, and the reason `nmcli bench kernels` prints, where the torch
    has no cuSPARSELt, for fp32, and where K is no whole number of groups of 4, before it touches a
    GPU (a stand-in torch: the calls past these checks would fail on it)."""
    from types import SimpleNamespace

    from nmcli.bench_kernels import has_cusparselt, time_cusparselt

    def fake_torch(available, ops=True):
        backend = SimpleNamespace(is_available=lambda: available, version=lambda: 800)
        extra = dict(_cslt_compress=None, _cslt_sparse_mm=None) if ops else {}
        return SimpleNamespace(backends=SimpleNamespace(cusparselt=backend), **extra)

    assert not has_cusparselt(fake_torch(False)) and not has_cusparselt(fake_torch(True, ops=False))
    assert not has_cusparselt(SimpleNamespace(backends=SimpleNamespace()))  # a torch from before the backend
    assert has_cusparselt(fake_torch(True))
    l2 = 50 << 20
    assert time_cusparselt(fake_torch(False), 16, 4096, 4096, "float16", l2) == (None, "this torch has no cuSPARSELt")
    assert time_cusparselt(fake_torch(True), 16, 4096, 4096, "float32", l2) == (
        None, "not timed for float32 (fp16 and bf16 only)")
    assert time_cusparselt(fake_torch(True), 16, 4098, 4096, "bfloat16", l2) == (
        None, "K = 4098 is not a whole number of groups of 4")


def test_kernel_bench_compares_every_pattern_with_the_points_median_cublas_run():
    """nmcli bench kernels times cuBLAS once per pattern; every pattern of a shape, row count and
    dtype is then compared with the median of those runs, so one slow cuBLAS run does not inflate
    one pattern's speedup. Each row keeps its own run; applying it again changes nothing."""
    from nmcli.bench_kernels import KernelRow, shared_baseline

    def row(m, nm, ours_ms, cublas_ms, dtype="float16"):
        flops = 2.0 * m * 4096 * 4096
        return KernelRow(m, 4096, 4096, nm, dtype, "wgmma", ours_ms, cublas_ms, cublas_ms / ours_ms, 1, 1.0, 1.0,
                         flops / ours_ms / 1e9, flops / cublas_ms / 1e9)

    rows = [row(32, "2:4", 0.010, 0.0150), row(32, "2:8", 0.012, 0.0152), row(32, "4:16", 0.016, 0.0280),
            row(32, "2:8", 0.020, 0.0300, "bfloat16"), row(1, "2:8", 0.004, 0.0090)]
    shared = shared_baseline(rows)
    assert [r.cublas_ms for r in shared] == [0.0152, 0.0152, 0.0152, 0.0300, 0.0090]
    assert [r.cublas_run_ms for r in shared] == [0.0150, 0.0152, 0.0280, 0.0300, 0.0090]
    assert shared[2].speedup == pytest.approx(0.95) and shared[0].speedup == pytest.approx(1.52)
    assert shared[2].cublas_tflops == pytest.approx(2.0 * 32 * 4096 * 4096 / 0.0152 / 1e9)
    assert shared_baseline(shared) == shared
    assert rows[2].cublas_ms == 0.0280  # the input rows are left as they were
