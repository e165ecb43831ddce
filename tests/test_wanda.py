"""Activation-aware pruning (wanda): exact choice on data with known channel norms, calibration
files checked with one clear line per mistake."""
import numpy as np
import onnx
import pytest
from models import matmul_model
from test_cli import assert_one_line_error, run

from nmcli import NMPattern, Selection, prune_model, unpack
from nmcli.calibrate import load_calibration
from nmcli.errors import NmcliError
from nmcli.inputs import input_specs
from nmcli.prune import get_criterion


def packed_weight(model):
    """The dense [K, Nout] weight stored by the single NMMatMul of a pruned model."""
    from nmcli.format import PackedShape, PackedWeight
    node = next(n for n in model.graph.node if n.op_type == "NMMatMul")
    attrs = {a.name: a.i for a in node.attribute}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    shape = PackedShape(attrs["k"], inits[node.input[1]].shape[0], NMPattern(attrs["n"], attrs["m"]))
    return unpack(PackedWeight(inits[node.input[1]], inits[node.input[2]], shape))


def expected_wanda(w, samples, pattern):
    """Top-N of |W| * ||X_k|| per group, written out independently of nmcli.masks."""
    norms = np.sqrt(sum((x.astype(np.float64) ** 2).reshape(-1, w.shape[0]).sum(0) for x in samples))
    score = np.abs(w.astype(np.float64)) * norms[:, None]
    keep = np.zeros_like(w, dtype=bool)
    for g0 in range(0, w.shape[0], pattern.m):
        block = score[g0:g0 + pattern.m]
        top = np.argsort(-block, axis=0, kind="stable")[:pattern.n]
        np.put_along_axis(keep[g0:g0 + pattern.m], top, True, axis=0)
    return np.where(keep, w, 0)


@pytest.mark.parametrize("n,m,k", [(2, 4, 64), (2, 8, 70), (1, 4, 33)])
def test_wanda_keeps_exactly_the_expected_weights(rng, n, m, k):
    pattern = NMPattern(n, m)
    w = rng.standard_normal((k, 24)).astype(np.float32)
    scale = np.exp(rng.uniform(-2, 2, size=k)).astype(np.float32)  # very unequal channel norms
    samples = [{"x": (rng.standard_normal((3, 5, k)) * scale).astype(np.float32)} for _ in range(4)]
    model = matmul_model(w, ["b", "s", k], name="W")
    pruned, report = prune_model(model, Selection(pattern), criterion=get_criterion("wanda"), calibration=samples)
    assert report.method == "wanda"
    expected = expected_wanda(w, [s["x"] for s in samples], pattern)
    np.testing.assert_array_equal(packed_weight(pruned), expected)
    magnitude, _ = prune_model(model, Selection(pattern))
    assert not np.array_equal(packed_weight(magnitude), expected)  # the data changed the choice


def test_wanda_without_calibration_is_refused(rng):
    model = matmul_model(rng.standard_normal((16, 8)).astype(np.float32), ["s", 16])
    with pytest.raises(NmcliError, match="calibration"):
        prune_model(model, Selection(NMPattern(2, 4)), criterion=get_criterion("wanda"))


@pytest.fixture
def small_model(tmp_path, rng):
    path = tmp_path / "mm.onnx"
    onnx.save_model(matmul_model(rng.standard_normal((32, 16)).astype(np.float32), ["b", 32]), str(path))
    return path


def test_prune_cli_with_calibration_file(small_model, tmp_path, rng):
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((6, 4, 32)).astype(np.float32))
    result = run("prune", small_model, "--nm", "2:4", "--method", "wanda", "--calib", tmp_path / "calib.npz",
                 "-o", tmp_path / "out.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "wanda" in result.stdout and (tmp_path / "out.onnx").is_file()
    result = run("prune", small_model, "--nm", "2:4", "--method", "wanda", "-o", tmp_path / "gen.onnx", cwd=tmp_path)
    assert result.returncode == 0 and "real data prunes better" in result.stderr


@pytest.mark.parametrize("arrays,fragment", [
    ({"y": np.zeros((2, 4, 32), np.float32)}, "missing: x"),
    ({"x": np.ones((2, 4, 31), np.float32)}, "the model wants ?x32"),
    ({"x": np.ones((2, 4, 32), np.int64)}, "the model wants float32"),
    ({"x": np.ones((0, 4, 32), np.float32)}, "same number (>= 1) of samples"),
])
def test_bad_calibration_files_are_one_line(small_model, tmp_path, arrays, fragment):
    np.savez(tmp_path / "bad.npz", **arrays)
    result = run("prune", small_model, "--nm", "2:4", "--method", "wanda", "--calib", tmp_path / "bad.npz",
                 "-o", tmp_path / "o.onnx", cwd=tmp_path)
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "o.onnx").exists()


def test_calibration_file_errors(small_model, tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    specs = input_specs(onnx.load(str(small_model)))
    with pytest.raises(NmcliError, match="not a readable .npz"):
        load_calibration(tmp_path / "junk.npz", specs)
    with pytest.raises(NmcliError, match="no such file"):
        load_calibration(tmp_path / "none.npz", specs)
    result = run("prune", small_model, "--nm", "2:4", "--calib", tmp_path / "junk.npz", cwd=tmp_path)
    assert_one_line_error(result, "only used by activation-aware methods")
