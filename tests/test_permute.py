"""Channel permutation (--permute): the search keeps more score, and a permuted model computes
exactly the dense model with the same pruned weights (checked against float64)."""
import numpy as np
import onnx
import pytest
from models import assert_matches_reference, gemm_model, make_model, matmul_model, vinfo
from onnx import helper, numpy_helper
from test_cli import run

import nmcli
from nmcli import NMPattern, Selection, prune_model
from nmcli.errors import ModelError
from nmcli.format import PackedShape, PackedWeight, unpack
from nmcli.permute import _without_each_row, find_permutation


def brute_kept(scores, pattern):
    k = scores.shape[0]
    total = 0.0
    for g0 in range(0, k, pattern.m):
        block = scores[g0:g0 + pattern.m]
        total += np.sort(block, axis=0)[::-1][:pattern.n].sum()
    return total


def stored_in_original_order(model, node_name):
    """Written out independently of nmcli.evaluate: unpack, then undo the Gather's order."""
    node = next(n for n in model.graph.node if n.name == node_name)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    attrs = {a.name: a.i for a in node.attribute}
    values, indices = inits[node.input[1]], inits[node.input[2]]
    dense = unpack(PackedWeight(values, indices, PackedShape(attrs["k"], values.shape[0],
                                                             NMPattern(attrs["n"], attrs["m"]))))
    gather = next((n for n in model.graph.node if node.input[0] in n.output and n.op_type == "Gather"), None)
    if gather is None:
        return dense, None
    perm = inits[gather.input[1]]
    assert sorted(perm.tolist()) == list(range(attrs["k"]))
    original = np.zeros_like(dense)
    original[perm] = dense
    return original, perm


@pytest.mark.parametrize("n,m,k", [(2, 4, 64), (2, 8, 70), (1, 4, 33), (4, 16, 100)])
def test_search_never_loses_and_scores_match(rng, n, m, k):
    pattern = NMPattern(n, m)
    scores = np.abs(rng.standard_normal((k, 12))) * np.exp(rng.uniform(-1, 1, size=(k, 1)))
    result = find_permutation(scores, pattern, max_rounds=40)
    assert sorted(result.perm.tolist()) == list(range(k))
    assert result.kept_identity == pytest.approx(brute_kept(scores, pattern))
    assert result.kept == pytest.approx(brute_kept(scores[result.perm], pattern))
    assert result.kept >= result.kept_identity


def test_search_finds_the_perfect_order_when_one_exists():
    # 2:4 over 8 channels: the 4 large channels all sit in group 0, so identity keeps 2 of
    # them; an order with two large channels per group keeps all four.
    scores = np.array([[9.0], [8.0], [7.0], [6.0], [0.1], [0.2], [0.3], [0.4]]) * np.ones((1, 5))
    result = find_permutation(scores, NMPattern(2, 4))
    assert result.kept == pytest.approx(30.0 * 5)
    assert result.kept_identity == pytest.approx((9 + 8 + 0.4 + 0.3) * 5)


def test_closed_form_for_a_group_without_one_row(rng):
    block = rng.standard_normal((3, 8, 7))
    block[0, 2] = block[0, 5]  # a tie
    rest, nth = _without_each_row(block, 3)
    for p in range(3):
        for i in range(8):
            others = np.delete(block[p], i, axis=0)
            desc = -np.sort(-others, axis=0)
            np.testing.assert_allclose(rest[p, i], desc[:3].sum(0))
            np.testing.assert_allclose(nth[p, i], desc[2])


def clustered_weight(rng, k, nout, dtype):
    """Large input channels bunched together, where grouping without a new order loses most."""
    w = rng.standard_normal((k, nout))
    w[: k // 4] *= 8.0
    return w.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n,m,k", [(2, 4, 64), (2, 8, 70), (1, 4, 37)])
def test_permuted_model_equals_dense_with_same_weights(rng, dtype, n, m, k):
    pattern = NMPattern(n, m)
    w = clustered_weight(rng, k, 24, dtype)
    model = matmul_model(w, ["b", "s", k])
    plain, plain_report = prune_model(model, Selection(pattern))
    pruned, report = prune_model(model, Selection(pattern), permute=True)
    onnx.checker.check_model(pruned)
    assert report.layers[0].permuted and report.layers[0].perm_gain > 0
    assert report.layers[0].rel_error < plain_report.layers[0].rel_error
    w_pruned, perm = stored_in_original_order(pruned, "mm")
    assert perm is not None
    # What it keeps is N:M in the new order and only ever weights of W.
    kept = (w_pruned != 0)[perm]
    padded = np.zeros((-(-k // m) * m, 24), bool)
    padded[:k] = kept
    assert padded.reshape(-1, m, 24).sum(1).max() <= n
    assert np.all((w_pruned == 0) | (w_pruned == w))
    x = rng.standard_normal((2, 5, k)).astype(dtype)
    (y,) = nmcli.session(pruned).run(None, {"x": x})
    assert_matches_reference(y, x, w_pruned, dtype)


def test_shared_activation_gets_one_gather(rng):
    k = 32
    wq, wk = clustered_weight(rng, k, 16, np.float32), clustered_weight(rng, k, 8, np.float32)
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "Wk"], ["kk"], name="k")]
    model = make_model(nodes, [vinfo("x", np.float32, ["s", k])],
                       [vinfo("q", np.float32, ["s", 16]), vinfo("kk", np.float32, ["s", 8])],
                       [numpy_helper.from_array(wq, "Wq"), numpy_helper.from_array(wk, "Wk")])
    pruned, report = prune_model(model, Selection(NMPattern(2, 4)), permute=True, fuse=False)
    gathers = [n for n in pruned.graph.node if n.op_type == "Gather"]
    assert len(gathers) == 1 and all(layer.permuted for layer in report.layers)
    x = rng.standard_normal((3, k)).astype(np.float32)
    q, kk = nmcli.session(pruned).run(None, {"x": x})
    for name, y in (("q", q), ("k", kk)):
        w_pruned, _ = stored_in_original_order(pruned, name)
        assert_matches_reference(y, x, w_pruned, np.float32)


def test_gemm_trans_a_permuted(rng):
    b = clustered_weight(rng, 24, 10, np.float32)
    model = gemm_model((24, 3), b, None, transA=1)
    pruned, report = prune_model(model, Selection(NMPattern(2, 4)), permute=True)
    assert report.layers[0].permuted
    a = rng.standard_normal((24, 3)).astype(np.float32)
    (y,) = nmcli.session(pruned).run(None, {"a": a})
    w_pruned, _ = stored_in_original_order(pruned, "gemm")
    assert_matches_reference(y, a.T, w_pruned, np.float32)


def test_no_gather_when_the_order_does_not_help():
    # Every channel alike: no order keeps more, so the model stays Gather-free.
    w = np.ones((16, 4), np.float32)
    pruned, report = prune_model(matmul_model(w, ["s", 16]), Selection(NMPattern(2, 4)), permute=True)
    assert not report.layers[0].permuted
    assert not any(n.op_type == "Gather" for n in pruned.graph.node)


def test_old_opset_refused(rng):
    model = matmul_model(rng.standard_normal((16, 4)).astype(np.float32), ["s", 16])
    model.opset_import[0].version = 10
    with pytest.raises(ModelError, match="opset 11"):
        prune_model(model, Selection(NMPattern(2, 4)), permute=True)


def test_cli_permute(tmp_path, rng):
    w = clustered_weight(rng, 64, 32, np.float32)
    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(w, ["s", 64]), str(src))
    result = run("prune", src, "--nm", "2:4", "--permute", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    import json
    layer = json.loads(result.stdout)["layers"][0]
    assert layer["permuted"] is True and layer["perm_gain"] > 0
    table = run("prune", src, "--nm", "2:4", "--permute", "-o", tmp_path / "t.onnx", cwd=tmp_path)
    assert table.returncode == 0 and "score" in table.stdout
