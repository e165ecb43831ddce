"""Sibling fusion: MatMuls that read one activation become one op on the concatenated packed
weight that writes every original output itself (attribute splits); each output equals the
float64 reference of its own pruned weight, and nmcli eval still reports each original layer."""
import numpy as np
import onnx
import pytest
from models import assert_matches_reference, make_model, vinfo
from onnx import helper, numpy_helper
from test_cli import run

import nmcli
from nmcli import NMPattern, Selection, prune_model
from nmcli.evaluate import layer_errors


def siblings_model(rng, k, widths, dtype, opset=17):
    """x -> MatMul by W0, W1, ... (one output each) and one MatMul on another input."""
    nodes, inits, outputs = [], [], []
    for i, width in enumerate(widths):
        nodes.append(helper.make_node("MatMul", ["x", f"W{i}"], [f"y{i}"], name=f"p{i}"))
        inits.append(numpy_helper.from_array(rng.standard_normal((k, width)).astype(dtype), f"W{i}"))
        outputs.append(vinfo(f"y{i}", dtype, ["b", "s", width]))
    nodes.append(helper.make_node("MatMul", ["z", "Wz"], ["yz"], name="other"))
    inits.append(numpy_helper.from_array(rng.standard_normal((k, 24)).astype(dtype), "Wz"))
    outputs.append(vinfo("yz", dtype, ["b", "s", 24]))
    model = make_model(nodes, [vinfo("x", dtype, ["b", "s", k]), vinfo("z", dtype, ["b", "s", k])], outputs, inits)
    model.opset_import[0].version = opset
    return model


def pruned_weights(pruned, dense):
    """Original node name -> its pruned [K, Nout], read back through nmcli eval's reader."""
    from nmcli.evaluate import stored_weights

    by_output = {n.output[0]: n.name for n in dense.graph.node}
    return {by_output.get(name, name): w for name, w, _, _ in stored_weights(pruned)}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("nm,k,opset", [("2:4", 64, 17), ("2:8", 70, 17), ("1:4", 33, 11)])
def test_fused_outputs_match_each_pruned_weight(rng, dtype, nm, k, opset):
    dense = siblings_model(rng, k, [40, 8, 17], dtype, opset)
    pruned, report = prune_model(dense, Selection(NMPattern.parse(nm)))
    ops = [n for n in pruned.graph.node if n.op_type == "NMMatMul"]
    assert len(ops) == 2 and list(ops[0].output) == ["y0", "y1", "y2"] and not any(
        n.op_type == "Split" for n in pruned.graph.node)
    assert list(next(a for a in ops[0].attribute if a.name == "splits").ints) == [40, 8, 17]
    assert [layer.node for layer in report.layers] == ["p0", "p1", "p2", "other"]
    weights = pruned_weights(pruned, dense)
    feeds = {name: rng.standard_normal((2, 3, k)).astype(dtype) for name in ("x", "z")}
    got = dict(zip([o.name for o in pruned.graph.output], nmcli.session(pruned).run(None, feeds)))
    for i, (node, width) in enumerate(zip(["p0", "p1", "p2"], [40, 8, 17])):
        assert got[f"y{i}"].shape == (2, 3, width)
        assert_matches_reference(got[f"y{i}"], feeds["x"], weights[node], dtype)
    assert_matches_reference(got["yz"], feeds["z"], weights["other"], dtype)
    unfused, _ = prune_model(dense, Selection(NMPattern.parse(nm)), fuse=False)
    for node, w in pruned_weights(unfused, dense).items():
        np.testing.assert_array_equal(weights[node], w)  # fusion changes the graph, not the weights


def test_fusion_with_permute_and_eval(rng):
    k = 48
    dense = siblings_model(rng, k, [16, 16], np.float32)
    pruned, report = prune_model(dense, Selection(NMPattern(2, 4)), permute=True)
    assert sum(n.op_type == "Gather" for n in pruned.graph.node) <= 2
    layers, notes = layer_errors(dense, pruned)
    assert not notes and sorted(layer.node for layer in layers) == ["other", "p0", "p1"]
    by_node = {layer.node: layer for layer in report.layers}
    for layer in layers:
        assert layer.rel_error == pytest.approx(by_node[layer.node].rel_error, rel=1e-6)
    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    z = rng.standard_normal((1, 5, k)).astype(np.float32)
    y0, y1, _ = nmcli.session(pruned).run(None, {"x": x, "z": z})
    weights = pruned_weights(pruned, dense)
    for y, node in ((y0, "p0"), (y1, "p1")):
        assert_matches_reference(y, x, weights[node], np.float32)


def test_shared_weights_and_gemms_are_not_fused(rng):
    k = 16
    w = rng.standard_normal((k, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="a"),
             helper.make_node("MatMul", ["x", "W"], ["b"], name="b"),
             helper.make_node("Gemm", ["x2", "V"], ["c"], name="c"),
             helper.make_node("MatMul", ["x2", "U"], ["d"], name="d")]
    model = make_model(nodes, [vinfo("x", np.float32, ["s", k]), vinfo("x2", np.float32, [3, k])],
                       [vinfo(n, np.float32, None) for n in "abcd"],
                       [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w + 1, "V"),
                        numpy_helper.from_array(w - 1, "U")])
    pruned, _ = prune_model(model, Selection(NMPattern(2, 4)))
    ops = [n for n in pruned.graph.node if n.op_type == "NMMatMul"]
    assert len(ops) == 4 and all(len(n.output) == 1 for n in ops)


def test_more_siblings_than_one_op_writes(rng):
    """Ten siblings: one op writes at most MAX_OUTPUTS (the kernels' kMaxOutputParts) outputs."""
    import re
    from pathlib import Path

    from nmcli.prune import MAX_OUTPUTS
    header = (Path(__file__).parents[1] / "kernels" / "output_parts.h").read_text()
    assert int(re.search(r"kMaxOutputParts = (\d+);", header).group(1)) == MAX_OUTPUTS
    k, widths = 24, [3 + i for i in range(10)]
    dense = siblings_model(rng, k, widths, np.float32)
    pruned, _ = prune_model(dense, Selection(NMPattern(1, 4)))
    ops = [n for n in pruned.graph.node if n.op_type == "NMMatMul"]
    assert sorted(len(n.output) for n in ops) == [1, 2, MAX_OUTPUTS]
    feeds = {name: rng.standard_normal((1, 2, k)).astype(np.float32) for name in ("x", "z")}
    got = dict(zip([o.name for o in pruned.graph.output], nmcli.session(pruned).run(None, feeds)))
    weights = pruned_weights(pruned, dense)
    for i in range(10):
        assert_matches_reference(got[f"y{i}"], feeds["x"], weights[f"p{i}"], np.float32)


@pytest.mark.parametrize("splits,outputs,message", [([8, 9], 2, "must add up to Nout=16"),
                                                    ([8, 8], 3, "the node has 3 outputs, expected 2"),
                                                    ([16, 0], 2, "splits must be positive")])
def test_bad_splits_are_refused(rng, splits, outputs, message):
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException
    dense = siblings_model(rng, 16, [8, 8], np.float32)
    pruned, _ = prune_model(dense, Selection(NMPattern(2, 4)))
    node = next(n for n in pruned.graph.node if len(n.output) == 2)
    for attr in node.attribute:
        if attr.name == "splits":
            attr.ints[:] = splits
    if outputs == 3:
        node.output.append("extra")
    feeds = {name: rng.standard_normal((1, 2, 16)).astype(np.float32) for name in ("x", "z")}
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match=message):  # at load or at run
        nmcli.session(pruned).run(None, feeds)


def test_cli_no_fuse(tmp_path, rng):
    dense = siblings_model(rng, 32, [8, 8], np.float32)
    onnx.save(dense, tmp_path / "m.onnx")
    for flag, ops in (("--fuse", 2), ("--no-fuse", 3)):
        result = run("prune", tmp_path / "m.onnx", "--nm", "2:4", flag, "-o", tmp_path / f"{flag}.onnx",
                     cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        model = onnx.load(str(tmp_path / f"{flag}.onnx"))
        assert sum(n.op_type == "NMMatMul" for n in model.graph.node) == ops
