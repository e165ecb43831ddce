"""Vector-wise N:M (prune --vector, docs/FORMAT.md): blocks of columns keep the same positions,
the op node says so, and the pruned model still matches the float64 reference on the CPU EP."""
import itertools

import numpy as np
import onnx
import pytest
from models import matmul_model
from test_cli import assert_one_line_error, digest, run

import nmcli
from nmcli import NMPattern, Selection, prune_model
from nmcli.errors import NmcliError
from nmcli.format import pack, shares_offsets, unpack
from nmcli.masks import choose_offsets
from nmcli.reference import dense_reference, error_ratio


def op_nodes(model):
    return [n for n in model.graph.node if n.op_type == "NMMatMul"]


def attribute(node, name):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


@pytest.mark.parametrize("nm,k,nout,vector", [("2:4", 12, 70, 32), ("1:4", 10, 64, 32), ("2:8", 19, 5, 4),
                                              ("3:5", 11, 40, 16)])
def test_blocks_keep_the_positions_with_the_highest_summed_score(rng, nm, k, nout, vector):
    pattern = NMPattern.parse(nm)
    scores = rng.random((k, nout))
    offsets = choose_offsets(scores, pattern, vector)
    padded = np.full((-(-k // pattern.m) * pattern.m, nout), -np.inf)
    padded[:k] = scores
    for b0 in range(0, nout, vector):
        block = offsets[b0:b0 + vector]
        assert (block == block[0]).all()
        summed = padded[:, b0:b0 + vector].sum(axis=1)
        for g in range(padded.shape[0] // pattern.m):
            group = summed[g * pattern.m:(g + 1) * pattern.m]
            best = max(itertools.combinations(range(pattern.m), pattern.n), key=lambda c: group[list(c)].sum())
            assert group[list(block[0, g])].sum() == pytest.approx(group[list(best)].sum())
    packed = pack(scores.astype(np.float32), offsets, pattern)
    assert shares_offsets(packed.indices, vector)
    assert not shares_offsets(pack(scores.astype(np.float32), choose_offsets(scores, pattern), pattern).indices, vector)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("nout", [64, 70])
def test_pruned_model_carries_the_attribute_and_matches_reference(rng, dtype, nout):
    w = rng.standard_normal((96, nout)).astype(dtype)
    pruned, report = prune_model(matmul_model(w, (3, 96)), Selection(NMPattern(2, 8)), vector=32)
    [node] = op_nodes(pruned)
    assert attribute(node, "vector") == 32 and report.vector == 32
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in pruned.graph.initializer}
    packed = nmcli.format.from_arrays(inits["W.nm_values"], inits["W.nm_indices"], 2, 8, 96)
    assert shares_offsets(packed.indices, 32)
    x = rng.standard_normal((3, 96)).astype(dtype)
    (y,) = nmcli.session(pruned).run(None, {"x": x})
    ref, magnitude = dense_reference(x, unpack(packed))
    assert error_ratio(y, ref, magnitude, dtype, 96) < 1


def _siblings(rng, widths):
    """x @ W_i for each width: MatMuls reading one activation, which prune fuses into one op."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 64])
    nodes, inits, outs = [], [], []
    for i, width in enumerate(widths):
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal((64, width)).astype(np.float32), f"W{i}"))
        nodes.append(onnx.helper.make_node("MatMul", ["x", f"W{i}"], [f"y{i}"], name=f"mm{i}"))
        outs.append(onnx.helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, [4, width]))
    graph = onnx.helper.make_graph(nodes, "siblings", [x], outs, inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


@pytest.mark.parametrize("widths,promised", [([64, 96, 40], True), ([40, 64], False)])
def test_fused_op_promises_blocks_only_when_parts_are_whole_blocks(rng, widths, promised):
    model = _siblings(rng, widths)
    pruned, _ = prune_model(model, Selection(NMPattern(2, 4)), vector=32)
    [node] = op_nodes(pruned)
    assert list(attribute(node, "splits")) == widths
    assert (attribute(node, "vector") == 32) == promised
    x = rng.standard_normal((4, 64)).astype(np.float32)
    ys = nmcli.session(pruned).run(None, {"x": x})
    for y, width, init in zip(ys, widths, model.graph.initializer):
        w = onnx.numpy_helper.to_array(init)
        kept = pack(w, choose_offsets(np.abs(w), NMPattern(2, 4), 32), NMPattern(2, 4))
        ref, magnitude = dense_reference(x, unpack(kept))
        assert y.shape == (4, width) and error_ratio(y, ref, magnitude, np.float32, 64) < 1


def test_refuses_vector_one_and_sparsegpt(rng):
    model = matmul_model(rng.standard_normal((32, 32)).astype(np.float32), (2, 32))
    with pytest.raises(NmcliError, match="--vector"):
        prune_model(model, Selection(NMPattern(2, 4)), vector=1)
    with pytest.raises(NmcliError, match="sparsegpt"):
        prune_model(model, Selection(NMPattern(2, 4)), method="sparsegpt", vector=32, calibration=[{}])


def test_cli_prune_vector(tmp_path, rng):
    path = tmp_path / "m.onnx"
    onnx.save_model(matmul_model(rng.standard_normal((64, 64)).astype(np.float32), (2, 64)), str(path))
    before = digest(path)
    result = run("prune", path, "--nm", "2:8", "--vector", "32", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert '"vector": 32' in result.stdout
    [node] = op_nodes(onnx.load(str(tmp_path / "m.nm.onnx")))
    assert attribute(node, "vector") == 32
    assert_one_line_error(run("prune", path, "--vector", "1", "-o", tmp_path / "o.onnx", cwd=tmp_path), "--vector")
    assert_one_line_error(run("prune", path, "--vector", "32", "--method", "sparsegpt", "-o", tmp_path / "o.onnx",
                              cwd=tmp_path), "sparsegpt")
    assert digest(path) == before
