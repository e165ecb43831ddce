"""The README's serve snippet and examples/serve.py run as written."""
import re
import os
import subprocess
import sys
from pathlib import Path

import onnx

import nmcli
from nmcli import NMPattern, Selection, prune_model
from nmcli.toymodels import transformer_block

ROOT = Path(__file__).resolve().parents[1]


def readme_snippet(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def write_pruned_block(folder: Path, rng) -> Path:
    model, _ = transformer_block(rng, hidden=256, ffn=1024)
    pruned, _ = prune_model(model, Selection(NMPattern(2, 8)))
    path = folder / "block.nm.onnx"
    onnx.save_model(pruned, str(path))
    return path


def test_serve_snippet_runs(tmp_path):
    demo = [sys.executable, "-m", "nmcli", "demo", "--device", "cpu", "--runs", "3", "--tokens", "1"]
    subprocess.run(demo, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    result = subprocess.run([sys.executable, "-c", readme_snippet("Serve in ONNX Runtime")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(1, 16, 512)"


def test_serve_example_runs(tmp_path, rng):
    path = write_pruned_block(tmp_path, rng)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "serve.py"), str(path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "y: shape (4, 4, 256)" in result.stdout


def test_main_job_commands(tmp_path):
    """The README's main job (`nmcli demo`) and the prune/bench commands work as written."""
    result = subprocess.run([sys.executable, "-m", "nmcli", "demo"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert "decode 1x1" in result.stdout and "speedup" in result.stdout
    dense = tmp_path / "nmcli-demo" / "llama-block.onnx"
    assert dense.is_file() and (tmp_path / "nmcli-demo" / "llama-block.2-8.onnx").is_file()
    result = subprocess.run([sys.executable, "-m", "nmcli", "prune", str(dense), "--nm", "2:8", "-o", "model.nm.onnx"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sum(n.op_type == nmcli.OP_TYPE for n in onnx.load(str(tmp_path / "model.nm.onnx")).graph.node) == 8  # 2 layers: q/k/v and gate/up fused
    result = subprocess.run([sys.executable, "-m", "nmcli", "bench", str(dense), "--sparse", "model.nm.onnx", "--runs", "3"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
