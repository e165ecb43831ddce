"""Neighbour fusion (nmcli/fusion.py): residual adds, SiLU-gated products and RMSNorms move into
the op only when the op then computes exactly what the removed nodes did."""
import numpy as np
import onnx
import pytest
from models import make_model, vinfo
from onnx import helper, numpy_helper

import nmcli
from nmcli import NMPattern, Selection, prune_model
from nmcli.llama import LlamaConfig, llama_model
from nmcli.reference import relative_error


def op_types(model):
    return [n.op_type for n in model.graph.node]


def test_llama_layers_fuse_norms_residuals_and_gates(rng):
    config = LlamaConfig(hidden=64, ffn=96, heads=4, layers=2, dtype="float32")
    dense = llama_model(config, rng)
    fused, report = prune_model(dense, Selection(NMPattern(2, 8)))
    plain, plain_report = prune_model(dense, Selection(NMPattern(2, 8)), fuse=False)
    assert report.fused == {"glu": 2, "norm": 4, "residual": 4} and plain_report.fused == {}
    ops = op_types(fused)
    assert not {"Sigmoid", "Pow", "ReduceMean", "Sqrt", "Div", "Add"} & set(ops), ops
    assert ops.count("NMMatMul") == 8
    gated = [n for n in fused.graph.node if any(a.name == "glu" for a in n.attribute)]
    assert len(gated) == 2 and all(len(n.input) == 6 for n in gated)
    normed = [n for n in fused.graph.node if any(a.name == "norm" for a in n.attribute)]
    assert len(normed) == 4 and all(len(n.input) == 7 for n in normed)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    (y_fused,) = nmcli.session(fused).run(None, {"x": x})
    (y_plain,) = nmcli.session(plain).run(None, {"x": x})
    assert relative_error(y_fused, y_plain.astype(np.float64)) < 1e-5  # same weights, same math


def _matmul_then(rng, k, nout, tail, extra_inputs=(), outputs=("y",), dtype=np.float32):
    """x [b, s, k] -> MatMul -> p [b, s, nout] -> `tail` nodes; initializer W."""
    w = rng.standard_normal((k, nout)).astype(dtype)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["p"], name="mm")] + tail
    inputs = [vinfo("x", dtype, ["b", "s", k])] + [vinfo(name, dtype, shape) for name, shape in extra_inputs]
    outs = [vinfo(name, dtype, None) for name in outputs]
    return make_model(nodes, inputs, outs, [numpy_helper.from_array(w, "W")])


@pytest.mark.parametrize("case", ["broadcast", "other_dims", "product_is_output"])
def test_residual_fuses_only_exact_adds(rng, case):
    add = helper.make_node("Add", ["p", "r"], ["y"], name="add")
    shape = {"broadcast": [24], "other_dims": ["b", "t", 24], "product_is_output": ["b", "s", 24]}[case]
    outputs = ("y", "p") if case == "product_is_output" else ("y",)
    dense = _matmul_then(rng, 32, 24, [add], [("r", shape)], outputs)
    pruned, report = prune_model(dense, Selection(NMPattern(2, 4)))
    assert report.fused["residual"] == 0 and "Add" in op_types(pruned)


def test_residual_fused_op_checks_its_shape(rng):
    dense = _matmul_then(rng, 32, 24, [helper.make_node("Add", ["r", "p"], ["y"], name="add")],
                         [("r", ["b", "s", 24])])
    pruned, report = prune_model(dense, Selection(NMPattern(2, 4)))
    assert report.fused["residual"] == 1 and op_types(pruned) == ["NMMatMul"]
    x, r = rng.standard_normal((2, 3, 32)).astype(np.float32), rng.standard_normal((2, 3, 24)).astype(np.float32)
    sess = nmcli.session(pruned)
    (y,) = sess.run(None, {"x": x, "r": r})
    (y_plain,) = nmcli.session(prune_model(dense, Selection(NMPattern(2, 4)), fuse=False)[0]).run(None, {"x": x, "r": r})
    assert relative_error(y, y_plain.astype(np.float64)) < 1e-6
    with pytest.raises(Exception, match="residual has shape"):
        sess.run(None, {"x": x, "r": r[:, :2]})


def _gated_model(rng, extra_reader=False, up_shape=("b", "s", 32)):
    """x -> Sigmoid/Mul/Mul gate with input u -> MatMul; optionally the SiLU output is also read."""
    n = helper.make_node
    nodes = [n("Sigmoid", ["g"], ["sg"], name="sig"), n("Mul", ["sg", "g"], ["act"], name="silu"),
             n("Mul", ["u", "act"], ["gated"], name="gate"), n("MatMul", ["gated", "W"], ["y"], name="mm")]
    outputs = [vinfo("y", np.float32, None)]
    if extra_reader:
        nodes.append(n("Identity", ["act"], ["act_copy"], name="peek"))
        outputs.append(vinfo("act_copy", np.float32, None))
    w = rng.standard_normal((32, 16)).astype(np.float32)
    return make_model(nodes, [vinfo("g", np.float32, ["b", "s", 32]), vinfo("u", np.float32, list(up_shape))],
                      outputs, [numpy_helper.from_array(w, "W")])


def test_gated_product_fuses_in_either_operand_order(rng):
    dense = _gated_model(rng)
    pruned, report = prune_model(dense, Selection(NMPattern(2, 8)))
    assert report.fused["glu"] == 1 and op_types(pruned) == ["NMMatMul"]
    feeds = {"g": rng.standard_normal((2, 5, 32)).astype(np.float32), "u": rng.standard_normal((2, 5, 32)).astype(np.float32)}
    (y,) = nmcli.session(pruned).run(None, feeds)
    (y_plain,) = nmcli.session(prune_model(dense, Selection(NMPattern(2, 8)), fuse=False)[0]).run(None, feeds)
    assert relative_error(y, y_plain.astype(np.float64)) < 1e-6


@pytest.mark.parametrize("extra_reader,up_shape", [(True, ("b", "s", 32)), (False, (32,))])
def test_gated_product_stays_when_not_exact(rng, extra_reader, up_shape):
    pruned, report = prune_model(_gated_model(rng, extra_reader, up_shape), Selection(NMPattern(2, 8)))
    assert report.fused["glu"] == 0 and "Sigmoid" in op_types(pruned)


def _rms_model(rng, axis=-1, extra_reader=False, weight_shape=(32,), square="Pow", axes_attribute=False):
    """x -> RMSNorm (PyTorch's export, or Mul(x, x) for the square) -> MatMul; the mean's axes an
    input (opset 18) or an attribute (opset 17)."""
    n = helper.make_node
    sq = n("Pow", ["x", "two"], ["sq"], name="sq") if square == "Pow" else n("Mul", ["x", "x"], ["sq"], name="sq")
    mean = (n("ReduceMean", ["sq"], ["ms"], keepdims=1, axes=[axis], name="mean") if axes_attribute
            else n("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1, name="mean"))
    nodes = [sq, mean,
             n("Add", ["eps", "ms"], ["ms_eps"], name="eps_add"), n("Sqrt", ["ms_eps"], ["rms"], name="sqrt"),
             n("Div", ["x", "rms"], ["normed"], name="div"), n("Mul", ["gamma", "normed"], ["h"], name="scale"),
             n("MatMul", ["h", "W"], ["y"], name="mm")]
    outputs = [vinfo("y", np.float32, None)]
    if extra_reader:
        outputs.append(vinfo("h", np.float32, None))
    inits = [numpy_helper.from_array(a, name) for name, a in (
        ("two", np.array(2.0, np.float32)), ("axes", np.array([axis], np.int64)), ("eps", np.array(1e-3, np.float32)),
        ("gamma", (1 + 0.2 * rng.standard_normal(weight_shape)).astype(np.float32)),
        ("W", rng.standard_normal((32, 24)).astype(np.float32)))]
    if axes_attribute:
        inits = [t for t in inits if t.name != "axes"]
    return make_model(nodes, [vinfo("x", np.float32, ["b", "s", 32])], outputs, inits, opset=17 if axes_attribute else 18)


@pytest.mark.parametrize("weight_shape,square,axes_attribute", [((32,), "Pow", False), ((1, 1, 32), "Mul", False),
                                                                ((32,), "Pow", True)])
def test_rms_norm_fuses_into_the_op(rng, weight_shape, square, axes_attribute):
    dense = _rms_model(rng, weight_shape=weight_shape, square=square, axes_attribute=axes_attribute)
    pruned, report = prune_model(dense, Selection(NMPattern(2, 8)))
    assert report.fused["norm"] == 1 and op_types(pruned) == ["NMMatMul"]
    x = (3 * rng.standard_normal((2, 5, 32))).astype(np.float32)
    (y,) = nmcli.session(pruned).run(None, {"x": x})
    (y_plain,) = nmcli.session(prune_model(dense, Selection(NMPattern(2, 8)), fuse=False)[0]).run(None, {"x": x})
    assert relative_error(y, y_plain.astype(np.float64)) < 1e-5


@pytest.mark.parametrize("axis,extra_reader,axes_attribute", [(1, False, False), (-1, True, False), (1, False, True)])
def test_rms_norm_stays_when_not_exact(rng, axis, extra_reader, axes_attribute):
    pruned, report = prune_model(_rms_model(rng, axis, extra_reader, axes_attribute=axes_attribute),
                                 Selection(NMPattern(2, 8)))
    assert report.fused["norm"] == 0 and "ReduceMean" in op_types(pruned)


def test_tensors_read_inside_subgraphs_are_not_fused_away(rng):
    """The SiLU output is also read by an If branch (outer-scope): the gate must stay."""
    model = _gated_model(rng)
    branch = helper.make_graph([helper.make_node("Identity", ["act"], ["peek"])], "branch", [],
                               [vinfo("peek", np.float32, None)])
    model.graph.input.append(vinfo("flag", np.float32, []))
    model.graph.node.extend([
        helper.make_node("Cast", ["flag"], ["cond"], to=onnx.TensorProto.BOOL, name="cond"),
        helper.make_node("If", ["cond"], ["branch_out"], then_branch=branch, else_branch=branch, name="if")])
    model.graph.output.append(vinfo("branch_out", np.float32, None))
    pruned, report = prune_model(model, Selection(NMPattern(2, 8)))
    assert report.fused["glu"] == 0 and "Sigmoid" in op_types(pruned)


@pytest.mark.parametrize("tamper,message", [
    (lambda op: op.attribute.append(helper.make_attribute("glu", "gelu")), 'glu must be "silu"'),
    (lambda op: [a for a in op.attribute if a.name == "norm"][0].__setattr__("s", b"layer"), 'norm must be "rms"'),
    (lambda op: op.input.__delitem__(6), "norm_weight goes with attribute norm"),
])
def test_op_refuses_inconsistent_fusion_attributes(rng, tamper, message):
    """A hand-edited fused node fails with one clear message, at session creation or first run."""
    pruned, _ = prune_model(_rms_model(rng), Selection(NMPattern(2, 8)))
    tamper(pruned.graph.node[0])
    with pytest.raises(Exception, match=message):
        nmcli.session(pruned).run(None, {"x": rng.standard_normal((1, 2, 32)).astype(np.float32)})
