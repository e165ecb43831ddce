"""The README's serve snippet and examples/serve.py run as written."""
import re
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


def test_serve_snippet_runs(tmp_path, rng):
    write_pruned_block(tmp_path, rng)
    result = subprocess.run([sys.executable, "-c", readme_snippet("Serve in ONNX Runtime")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(1, 16, 256)"


def test_serve_example_runs(tmp_path, rng):
    path = write_pruned_block(tmp_path, rng)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "serve.py"), str(path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "y: shape (4, 4, 256)" in result.stdout


def test_main_job_commands(tmp_path):
    """The README's first-run commands (toy model, then prune) work as written."""
    subprocess.run([sys.executable, "-m", "nmcli.toymodels", "block.onnx"], cwd=tmp_path, check=True, timeout=120)
    result = subprocess.run([sys.executable, "-m", "nmcli", "prune", "block.onnx", "--nm", "2:8", "-o", "block.nm.onnx"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sum(n.op_type == nmcli.OP_TYPE for n in onnx.load(str(tmp_path / "block.nm.onnx")).graph.node) == 6
