"""SparseGPT (--method sparsegpt): valid N:M masks, exactly Wanda's choice when the channels
are uncorrelated, lower layer-output error than Wanda when they are correlated, and a pruned
model that computes the float64 reference of the weights it stores."""
import numpy as np
import pytest
from models import assert_matches_reference, make_model, matmul_model, vinfo
from onnx import helper, numpy_helper
from test_cli import run
from test_wanda import expected_wanda, packed_weight

import nmcli
from nmcli import NMPattern, Selection, prune_model
from nmcli.calibrate import gram_passes
from nmcli.obs import sparsegpt
from nmcli.prune import get_criterion


def check_nm(keep, w_new, pattern):
    k = keep.shape[0]
    for g0 in range(0, k, pattern.m):
        size = min(pattern.m, k - g0)
        assert np.all(keep[g0:g0 + size].sum(0) == min(pattern.n, size))
    assert np.all(w_new[~keep] == 0)


def mixing(rng, k):
    """Channels that mostly live in a k/4-dimensional subspace, unevenly scaled (as real
    activations are: strongly correlated, a few large channels)."""
    return rng.standard_normal((max(1, k // 4), k)) * np.exp(rng.uniform(-1, 1, size=k))


def correlated_rows(rng, rows, k, mix=None):
    mix = mixing(rng, k) if mix is None else mix
    return rng.standard_normal((rows, mix.shape[0])) @ mix + 0.1 * rng.standard_normal((rows, k))


@pytest.mark.parametrize("n,m,k", [(2, 4, 64), (2, 8, 70), (1, 4, 33), (3, 5, 41), (4, 16, 300)])
def test_uncorrelated_channels_give_wandas_choice(rng, n, m, k):
    pattern = NMPattern(n, m)
    w = rng.standard_normal((k, 12))
    sq = np.exp(rng.uniform(-2, 2, size=k))             # diagonal gram: no correlation to exploit
    keep, w_new = sparsegpt(w, np.diag(sq), pattern, damp=0.0)
    check_nm(keep, w_new, pattern)
    wanda = expected_wanda(w, [np.sqrt(sq)[None, :]], pattern)
    np.testing.assert_allclose(w_new, wanda, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n,m,k", [(2, 4, 96), (2, 8, 130), (1, 4, 64)])
def test_compensation_lowers_output_error(rng, n, m, k):
    pattern = NMPattern(n, m)
    mix = mixing(rng, k)
    x, held_out = correlated_rows(rng, 4 * k, k, mix), correlated_rows(rng, 4 * k, k, mix)
    w = rng.standard_normal((k, 20))
    keep, w_new = sparsegpt(w, x.T @ x, pattern)
    check_nm(keep, w_new, pattern)
    wanda = expected_wanda(w, [x], pattern)
    for rows in (x, held_out):  # held-out rows: the gain is not an overfit to the calibration rows
        err_sgpt, err_wanda = (np.linalg.norm(rows @ (w - v)) for v in (w_new, wanda))
        assert err_sgpt < 0.97 * err_wanda  # typically 0.45-0.7


def test_gram_passes_are_independent_of_the_budget(rng):
    k = 24
    model = make_model([helper.make_node("MatMul", ["x", "A"], ["h"], name="a"),
                        helper.make_node("Relu", ["h"], ["r"]),
                        helper.make_node("MatMul", ["r", "B"], ["y"], name="b")],
                       [vinfo("x", np.float32, ["s", k])], [vinfo("y", np.float32, ["s", 8])],
                       [numpy_helper.from_array(rng.standard_normal((k, 16)).astype(np.float32), "A"),
                        numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "B")])
    feeds = [{"x": rng.standard_normal((5, k)).astype(np.float32)} for _ in range(3)]
    axes, channels = {"x": -1, "r": -1}, {"x": k, "r": 16}
    one = list(gram_passes(model, axes, channels, feeds))
    many = list(gram_passes(model, axes, channels, feeds, budget_bytes=1))
    assert len(one) == 1 and len(many) == 2
    merged = {name: g for batch in many for name, g in batch.items()}
    rows = np.concatenate([f["x"] for f in feeds]).astype(np.float64)
    # Relative to the sum of |products| per entry: entries that cancel to near zero differ in the
    # last bits with the summation order (CI once saw 1.2e-12 relative on one of them).
    bound = 1e-12 * (np.abs(rows).T @ np.abs(rows))
    assert np.all(np.abs(one[0]["x"] - rows.T @ rows) <= bound)
    for name in axes:
        np.testing.assert_array_equal(one[0][name], merged[name])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("nm,k", [("2:4", 64), ("2:8", 70)])
def test_pruned_model_computes_its_stored_weights(rng, dtype, nm, k):
    pattern = NMPattern.parse(nm)
    w = rng.standard_normal((k, 24)).astype(dtype)
    samples = [{"x": correlated_rows(rng, 15, k).reshape(3, 5, k).astype(dtype)} for _ in range(6)]
    model = matmul_model(w, ["b", "s", k])
    pruned, report = prune_model(model, Selection(pattern), criterion=get_criterion("sparsegpt"), calibration=samples)
    assert report.method == "sparsegpt"
    stored = packed_weight(pruned)
    rows = np.concatenate([s["x"].reshape(-1, k) for s in samples]).astype(np.float64)
    keep, expected = sparsegpt(w, rows.T @ rows, pattern)
    np.testing.assert_array_equal(stored, expected.astype(dtype))
    assert report.layers[0].rel_error == pytest.approx(np.linalg.norm(w.astype(np.float64) - stored)
                                                       / np.linalg.norm(w.astype(np.float64)), rel=1e-6)
    x = rng.standard_normal((2, 7, k)).astype(dtype)
    (y,) = nmcli.session(pruned).run(None, {"x": x})
    assert_matches_reference(y, x, stored, dtype)


def test_weight_shared_by_two_activations_sees_both(rng):
    k = 32
    w = rng.standard_normal((k, 8)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x1", "W"], ["y1"], name="a"),
                        helper.make_node("MatMul", ["x2", "W"], ["y2"], name="b")],
                       [vinfo("x1", np.float32, ["s", k]), vinfo("x2", np.float32, ["s", k])],
                       [vinfo("y1", np.float32, ["s", 8]), vinfo("y2", np.float32, ["s", 8])],
                       [numpy_helper.from_array(w, "W")])
    samples = [{"x1": correlated_rows(rng, 6, k).astype(np.float32),
                "x2": correlated_rows(rng, 6, k).astype(np.float32)} for _ in range(4)]
    pruned, report = prune_model(model, Selection(NMPattern(2, 4)), criterion=get_criterion("sparsegpt"),
                                 calibration=samples)
    rows = np.concatenate([s[name] for s in samples for name in ("x1", "x2")]).astype(np.float64)
    _, expected = sparsegpt(w, rows.T @ rows, NMPattern(2, 4))
    np.testing.assert_array_equal(packed_weight(pruned), expected.astype(np.float32))


def test_cli_sparsegpt(tmp_path, rng):
    k = 32
    model = matmul_model(rng.standard_normal((k, 16)).astype(np.float32), ["b", "s", k])
    import onnx
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((4, 2, 3, k)).astype(np.float32))
    result = run("prune", tmp_path / "m.onnx", "--nm", "2:4", "--method", "sparsegpt", "--calib",
                 tmp_path / "calib.npz", "-o", tmp_path / "s.onnx", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert '"method": "sparsegpt"' in result.stdout
    bad = run("prune", tmp_path / "m.onnx", "--nm", "2:4", "--method", "obs", "-o", tmp_path / "t.onnx", cwd=tmp_path)
    assert bad.returncode != 0 and "sparsegpt" in bad.stderr and "Traceback" not in bad.stderr
