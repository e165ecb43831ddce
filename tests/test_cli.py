"""The command line, run as a user runs it: a separate process, one clear line on bad input."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from models import matmul_model, transformer_block

import nmcli


def run(*args, cwd):
    # cwd is a temp folder so that `-m nmcli` imports the installed package, not the source tree
    return subprocess.run([sys.executable, "-m", "nmcli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"}, timeout=120)


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def model_file(tmp_path, rng):
    model, _ = transformer_block(rng)
    path = tmp_path / "block.onnx"
    onnx.save_model(model, str(path))
    return path


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_version(tmp_path):
    result = run("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"nmcli {nmcli.__version__}"


def test_help_lists_commands(tmp_path):
    result = run("--help", cwd=tmp_path)
    assert result.returncode == 0
    for command in ("prune", "info", "ops-path"):
        assert command in result.stdout


def test_prune_writes_model_and_report(tmp_path, model_file):
    before = digest(model_file)
    result = run("prune", model_file, "--nm", "2:8", "-o", tmp_path / "out.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "q_proj" in result.stdout and "wrote" in result.stdout
    assert digest(model_file) == before
    pruned = onnx.load(str(tmp_path / "out.onnx"))
    assert sum(n.op_type == "NMMatMul" for n in pruned.graph.node) == 4  # q/k/v fused into one op
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block.onnx", "out.onnx"]  # no temp files left


def test_prune_default_output_name_and_json(tmp_path, model_file):
    result = run("prune", model_file, "--nm", "1:4", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["output"].endswith("block.nm.onnx") and (tmp_path / "block.nm.onnx").exists()
    assert report["pattern"] == "1:4" and report["totals"]["layers"] == 6
    assert report["totals"]["bytes_after"] < report["totals"]["bytes_before"]
    assert {s["node"] for s in report["skipped"]} == {"qk", "pv"}
    assert all(0 < layer["rel_error"] < 1 for layer in report["layers"])


def test_prune_prefill_copy(tmp_path, rng):
    model, _ = transformer_block(rng, dtype=np.float16)
    path = tmp_path / "block16.onnx"
    onnx.save_model(model, str(path))
    result = run("prune", path, "--nm", "2:8", "--prefill-copy", "-o", tmp_path / "out.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "2:4 copies for the sparse tensor cores: +" in result.stdout and "of dense)" in result.stdout
    pruned = onnx.load(str(tmp_path / "out.onnx"))
    assert all(len(n.input) == 9 for n in pruned.graph.node if n.op_type == "NMMatMul")
    before = digest(path)
    for nm, why in (("2:4", "it is 2:4 already"), ("4:16", "more than 2 of 4")):
        refused = run("prune", path, "--nm", nm, "--prefill-copy", "-o", tmp_path / "no.onnx", cwd=tmp_path)
        assert_one_line_error(refused, "--prefill-copy does not apply to " + nm, why)
    assert digest(path) == before and not (tmp_path / "no.onnx").exists()
    fp32_demo = run("demo", "--device", "cpu", "--prefill-copy", "--output-dir", tmp_path / "demo", cwd=tmp_path)
    assert_one_line_error(fp32_demo, "--prefill-copy needs --dtype float16")


def test_info(tmp_path, model_file):
    result = run("info", model_file, "--nm", "2:8", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    actions = {row["layer"]: row["action"] for row in info["layers"]}
    assert actions["q_proj"] == "prune" and actions["qk"] == "skip"
    assert info["prunable_bytes_after"] < info["prunable_bytes_before"]
    table = run("info", model_file, cwd=tmp_path)
    assert table.returncode == 0 and "fc1" in table.stdout and "not a constant" in table.stdout


def test_ops_path(tmp_path):
    result = run("ops-path", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == nmcli.ops_library_path()


@pytest.mark.parametrize("nm", ["5:4", "0:4", "abc", "4:4", "2:64"])
def test_invalid_nm(tmp_path, model_file, nm):
    result = run("prune", model_file, "--nm", nm, cwd=tmp_path)
    assert_one_line_error(result, "invalid N:M")
    assert not (tmp_path / "block.nm.onnx").exists()


def test_missing_file(tmp_path):
    assert_one_line_error(run("prune", tmp_path / "nope.onnx", cwd=tmp_path), "no such file")
    assert_one_line_error(run("info", tmp_path / "nope.onnx", cwd=tmp_path), "no such file")


@pytest.mark.parametrize("content", [b"this is not a model", b"", bytes(range(256)) * 10])
def test_not_onnx(tmp_path, content):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    assert_one_line_error(run("prune", bad, cwd=tmp_path), "bad.onnx")
    assert bad.read_bytes() == content and not (tmp_path / "bad.nm.onnx").exists()


def test_nothing_to_prune(tmp_path, rng):
    path = tmp_path / "small.onnx"
    onnx.save_model(matmul_model(rng.standard_normal((4, 8)).astype(np.float32), (2, 4)), str(path))
    assert_one_line_error(run("prune", path, "--nm", "2:8", cwd=tmp_path), "nothing to prune")
    assert not (tmp_path / "small.nm.onnx").exists()


def test_output_equal_to_input(tmp_path, model_file):
    before = digest(model_file)
    assert_one_line_error(run("prune", model_file, "-o", model_file, cwd=tmp_path), "--force")
    assert digest(model_file) == before
    forced = run("prune", model_file, "-o", model_file, "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert any(n.op_type == "NMMatMul" for n in onnx.load(str(model_file)).graph.node)


def test_unwritable_output_directory(tmp_path, model_file):
    before = digest(model_file)
    assert_one_line_error(run("prune", model_file, "-o", tmp_path / "missing" / "out.onnx", cwd=tmp_path),
                          "does not exist")
    # /proc refuses new files even to root
    assert_one_line_error(run("prune", model_file, "-o", "/proc/nmcli-out.onnx", cwd=tmp_path), "/proc")
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        assert_one_line_error(run("prune", model_file, "-o", locked / "out.onnx", cwd=tmp_path), "not writable")
    assert digest(model_file) == before


def test_bad_regex(tmp_path, model_file):
    assert_one_line_error(run("prune", model_file, "--include", "(", cwd=tmp_path), "regular expression")


def test_bench_kernels_without_gpu_says_so(tmp_path):
    from conftest import has_cuda_gpu
    if has_cuda_gpu():
        pytest.skip("this machine has a GPU")
    assert_one_line_error(run("bench", "kernels", "--nm", "2:8", cwd=tmp_path), "bench kernels")


def test_bench_kernels_rows_replace_the_table_rows():
    from nmcli.bench_kernels import LLAMA_KN, NMSPARSE_KN, default_shapes

    llama = default_shapes(include_nmsparse=False, rows=[17, 64])
    assert llama == [(m, k, n) for (k, n) in LLAMA_KN for m in (17, 64)]
    both = default_shapes(rows=[1])
    assert len(both) == len(set(both)) == len(set(LLAMA_KN) | set(NMSPARSE_KN))
    assert {m for m, _, _ in default_shapes(include_llama=False)} == {1, 256, 1024, 4096}


def test_bench_kernels_shape_replaces_the_sets(tmp_path):
    from nmcli.bench_kernels import default_shapes, parse_weight_shape

    assert parse_weight_shape("8192x3072") == (8192, 3072)
    assert parse_weight_shape("2048X512") == (2048, 512)
    weights = [(8192, 3072), (3072, 1024), (8192, 3072)]
    assert default_shapes(rows=[1, 17], weights=weights) == [(1, 8192, 3072), (17, 8192, 3072), (1, 3072, 1024),
                                                             (17, 3072, 1024)]
    assert {m for m, _, _ in default_shapes(weights=weights)} == {1, 2, 4, 8, 16, 256, 4096}
    # A bad shape is refused before the GPU is looked for, on any machine.
    for bad in ("8192", "8192x", "0x512", "ax3", "4x4x4"):
        assert_one_line_error(run("bench", "kernels", "--shape", bad, cwd=tmp_path), "--shape must be KxN")
