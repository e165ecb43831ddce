"""`--bias-correct`: each pruned node's bias takes back the mean change of its output on the
calibration rows, for plain, fused-sibling, Gemm (alpha, bias, transA) and shared-weight nodes."""
import numpy as np
import pytest
from onnx import helper, numpy_helper
from test_cli import assert_one_line_error, run

import nmcli
from nmcli import NMPattern, Selection, prune_model
from nmcli.errors import NmcliError
from nmcli.toymodels import make_model, vinfo

K, WIDTHS = 45, (24, 13)  # K not a multiple of M; two sibling MatMuls of different widths


def model_with_every_node_kind(rng, dtype):
    """Every pruned node reads a graph input, so its dense input is known to the test:
    x -> MatMul W1, MatMul W2 (siblings, fused into one op); x2 -> MatMul W3 and x3 -> MatMul W3
    (one weight, two activations); a [K, rows] -> Gemm transA, alpha, bias."""
    w = lambda *shape: rng.standard_normal(shape).astype(dtype)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["y1"], name="q"),
             helper.make_node("MatMul", ["x", "W2"], ["y2"], name="k"),
             helper.make_node("MatMul", ["x2", "W3"], ["y3"], name="shared"),
             helper.make_node("MatMul", ["x3", "W3"], ["y4"], name="shared_again"),
             helper.make_node("Gemm", ["a", "B", "C"], ["y5"], name="gemm", transA=1, alpha=0.75)]
    inputs = [vinfo(name, dtype, [f"rows_{name}", K]) for name in ("x", "x2", "x3")] + [vinfo("a", dtype, [K, "rows_a"])]
    rows = ["rows_x", "rows_x", "rows_x2", "rows_x3", "rows_a"]
    widths = [*WIDTHS, 9, 9, 17]
    outputs = [vinfo(f"y{i + 1}", dtype, [r, width]) for i, (r, width) in enumerate(zip(rows, widths))]
    inits = [numpy_helper.from_array(w(K, WIDTHS[0]), "W1"), numpy_helper.from_array(w(K, WIDTHS[1]), "W2"),
             numpy_helper.from_array(w(K, 9), "W3"), numpy_helper.from_array(w(K, 17), "B"),
             numpy_helper.from_array(w(17), "C")]
    return make_model(nodes, inputs, outputs, inits)


def calibration(rng, dtype, samples=5):
    # Channel means far from zero, as after GELU or in BERT's outlier channels: pruning moves
    # every output's mean, which is what the correction has to take back.
    offset = rng.uniform(-2, 3, K)
    x = lambda rows: (rng.standard_normal((rows, K)) + offset).astype(dtype)
    return [{"x": x(6), "x2": x(4), "x3": x(5), "a": x(3).T.copy()} for _ in range(samples)]


def output_means(model, feeds):
    sess = nmcli.session(model)
    runs = [sess.run(None, feed) for feed in feeds]
    return [np.concatenate([r[i] for r in runs]).astype(np.float64).mean(0) for i in range(len(runs[0]))]


@pytest.mark.parametrize("method,permute", [("magnitude", False), ("wanda", True), ("sparsegpt", False)])
@pytest.mark.parametrize("dtype,tolerance", [(np.float32, 1e-5), (np.float16, 2e-3)])
def test_corrected_outputs_keep_the_dense_means(rng, method, permute, dtype, tolerance):
    model, feeds = model_with_every_node_kind(rng, dtype), calibration(rng, dtype)
    selection = Selection(NMPattern(2, 4))
    corrected, report = prune_model(model, selection, method=method, calibration=feeds, permute=permute,
                                    bias_correct=True)
    plain, _ = prune_model(model, selection, method=method, calibration=feeds, permute=permute)
    assert report.bias_corrected == 5
    assert sum(n.op_type == "NMMatMul" for n in corrected.graph.node) == 4  # q and k fused
    dense = output_means(model, feeds)
    for want, got, before in zip(dense, output_means(corrected, feeds), output_means(plain, feeds)):
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= tolerance * scale
        if method != "sparsegpt":  # which keeps the means close by itself (its gram holds them)
            # The test can fail: without the correction the means are far off.
            assert np.abs(before - want).max() > 10 * tolerance * scale


def test_bias_correction_needs_calibration(rng):
    model = model_with_every_node_kind(rng, np.float32)
    with pytest.raises(NmcliError, match="bias correction needs calibration"):
        prune_model(model, Selection(NMPattern(2, 4)), bias_correct=True)


def test_cli_bias_correct(tmp_path, rng):
    path = tmp_path / "m.onnx"
    path.write_bytes(model_with_every_node_kind(rng, np.float32).SerializeToString())
    result = run("prune", path, "--nm", "2:4", "--bias-correct", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "calibrating the bias correction on 8 generated samples" in result.stderr
    assert "bias corrected from the calibration means: 5 layer(s)" in result.stdout
    np.savez(tmp_path / "calib.npz", **{name: np.stack([f[name] for f in calibration(rng, np.float32)])
                                         for name in ("x", "x2", "x3", "a")})
    result = run("prune", path, "--nm", "2:4", "--calib", tmp_path / "calib.npz", "-o", tmp_path / "out.onnx", cwd=tmp_path)
    assert_one_line_error(result, "--calib is only used by", "--bias-correct")
