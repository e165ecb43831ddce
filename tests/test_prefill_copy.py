"""The 2:4 copy of a pruned weight (docs/FORMAT.md "A 2:4 copy", prune --prefill-copy): it stands
for exactly the same weight, the op checks its shapes, and the CPU op's results do not change."""
import numpy as np
import onnx
import pytest
from models import matmul_model
from onnx import numpy_helper

import nmcli
from nmcli.errors import NmcliError
from nmcli.format import NMPattern, fits_two_of_four, from_arrays, pack, two_of_four_copy, unpack
from nmcli.llama import LlamaConfig, llama_model
from nmcli.masks import choose_offsets

FITS = [(1, 2), (1, 3), (1, 4), (2, 8), (1, 8), (2, 12), (2, 16), (1, 32)]
DOES_NOT_FIT = [(2, 4), (3, 4), (2, 6), (3, 8), (4, 16), (8, 32), (2, 10)]


def packed_weight(rng, pattern, k, nout, dtype=np.float16):
    w = rng.standard_normal((k, nout)).astype(dtype)
    return pack(w, choose_offsets(np.abs(w.astype(np.float64)), pattern), pattern)


@pytest.mark.parametrize("n,m", FITS)
@pytest.mark.parametrize("k", [4, 37, 130, 4100])
def test_copy_unpacks_to_the_same_weight(rng, n, m, k):
    if k < m:
        k = m + 3
    packed = packed_weight(rng, NMPattern(n, m), k, 21)
    copy = two_of_four_copy(packed)
    assert (copy.shape.pattern.n, copy.shape.pattern.m, copy.shape.k) == (2, 4, k)
    # bit for bit: the copy moves the stored values, it computes nothing
    assert np.array_equal(unpack(copy).view(np.uint16), unpack(packed).view(np.uint16))


def test_copy_keeps_stored_zeros_and_fills_empty_blocks_with_the_lowest_positions():
    """A stored entry that happens to be 0 keeps its position; an empty block gets (0, 1)."""
    pattern = NMPattern(1, 8)
    w = np.zeros((8, 1), np.float16)
    w[6, 0] = 3.0                                # group 0 keeps k = 6: block 1 holds it, block 0 is empty
    packed = pack(w, np.array([[[6]]]), pattern)
    assert packed.offsets()[0, 0] == 6
    copy = two_of_four_copy(packed)
    assert copy.offsets()[0, :4].tolist() == [0, 1, 0, 2]
    assert copy.values[0, :4].tolist() == [0, 0, 0, 3]
    zero_kept = pack(np.zeros((8, 1), np.float16), np.array([[[5]]]), pattern)
    assert two_of_four_copy(zero_kept).offsets()[0, :4].tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("n,m", FITS + DOES_NOT_FIT)
def test_which_patterns_fit(n, m):
    assert fits_two_of_four(NMPattern(n, m)) == ((n, m) in FITS)


@pytest.mark.parametrize("n,m", DOES_NOT_FIT)
def test_copy_refuses_patterns_that_do_not_fit(rng, n, m):
    with pytest.raises(ValueError, match="do not fit 2:4"):
        two_of_four_copy(packed_weight(rng, NMPattern(n, m), 64, 3))


def nm_nodes(model):
    return [n for n in model.graph.node if n.op_type == "NMMatMul"]


def initializer(model, name):
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def test_llama_block_gets_copies_and_the_cpu_op_ignores_them(rng):
    """Every op of a fused LLaMA block (Q/K/V, gate/up with the gate, RMSNorm and residual in the
    op) carries a copy at inputs 7 and 8 that unpacks to its weight; the CPU op's output is bit for
    bit the one without copies."""
    dense = llama_model(LlamaConfig(hidden=64, ffn=176, heads=4, layers=1, dtype="float16"), rng)
    plain, plain_report = nmcli.prune_model(dense, nmcli.Selection(NMPattern(2, 8)))
    copied, report = nmcli.prune_model(dense, nmcli.Selection(NMPattern(2, 8)), prefill_copy=True)
    assert report.fused == plain_report.fused and report.fused["glu"] and report.fused["norm"]
    assert plain_report.prefill_copy_bytes == 0
    added = 0
    for node in nm_nodes(copied):
        assert len(node.input) == 9 and all(name for name in node.input[7:])
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        weight = from_arrays(initializer(copied, node.input[1]), initializer(copied, node.input[2]), 2, 8, attrs["k"])
        copy = from_arrays(initializer(copied, node.input[7]), initializer(copied, node.input[8]), 2, 4, attrs["k"])
        assert np.array_equal(unpack(copy), unpack(weight))
        added += copy.nbytes
    assert report.prefill_copy_bytes == added > 0
    assert report.to_dict()["prefill_copy_bytes"] == added
    x = rng.standard_normal((1, 5, 64)).astype(np.float16)
    (want,) = nmcli.session(plain).run(None, {"x": x})
    (got,) = nmcli.session(copied).run(None, {"x": x})
    assert np.array_equal(got, want)


def test_shared_weight_gets_one_copy(rng):
    from onnx import helper

    from nmcli.toymodels import make_model, vinfo
    w = rng.standard_normal((64, 32)).astype(np.float16)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="a"), helper.make_node("MatMul", ["x2", "W"], ["b"], name="b")]
    model = make_model(nodes, [vinfo("x", np.float16, [3, 64]), vinfo("x2", np.float16, [3, 64])],
                       [vinfo("a", np.float16, [3, 32]), vinfo("b", np.float16, [3, 32])], [numpy_helper.from_array(w, "W")])
    pruned, report = nmcli.prune_model(model, nmcli.Selection(NMPattern(1, 4)), fuse=False, prefill_copy=True)
    first, second = nm_nodes(pruned)
    assert first.input[7:] == second.input[7:]
    assert report.prefill_copy_bytes == from_arrays(initializer(pruned, first.input[7]),
                                                          initializer(pruned, first.input[8]), 2, 4, 64).nbytes


def test_prune_refuses_what_the_copy_cannot_serve(rng):
    fp16 = matmul_model(rng.standard_normal((64, 32)).astype(np.float16), [2, 64])
    for nm in ("2:4", "4:16", "2:6"):
        with pytest.raises(NmcliError, match="--prefill-copy does not apply to " + nm):
            nmcli.prune_model(fp16, nmcli.Selection(NMPattern.parse(nm)), prefill_copy=True)
    fp32 = matmul_model(rng.standard_normal((64, 32)).astype(np.float32), [2, 64])
    with pytest.raises(NmcliError, match="float16 and bfloat16"):
        nmcli.prune_model(fp32, nmcli.Selection(NMPattern(2, 8)), prefill_copy=True)


def with_copy_inputs(model, values, indices):
    """`model` (one op) with copy tensors of our choosing at inputs 7 and 8."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    [node] = nm_nodes(out)
    del node.input[7:]
    node.input.extend([""] * (7 - len(node.input)))
    for name, array in (("cv", values), ("ci", indices)):
        if array is not None:
            out.graph.initializer.append(numpy_helper.from_array(array, name))
        node.input.append(name if array is not None else "")
    return out


def test_cpu_op_checks_the_copy(rng):
    """Wrong shapes, half a copy, or a copy on a pattern that does not fit: one clear error."""
    w = rng.standard_normal((100, 48)).astype(np.float16)
    model = matmul_model(w, [3, 100])
    pruned, _ = nmcli.prune_model(model, nmcli.Selection(NMPattern(2, 8)), prefill_copy=True)
    [node] = nm_nodes(pruned)
    values, indices = initializer(pruned, node.input[7]), initializer(pruned, node.input[8])
    assert values.shape == (48, 64) and indices.shape == (48, 4)  # S4 = round_up(2 * 25, 32)
    x = rng.standard_normal((3, 100)).astype(np.float16)
    (want,) = nmcli.session(pruned).run(None, {"x": x})
    cases = [(values[:, :32], indices, "copy_values have shape [48, 32], expected [48, 64]"),
             (values, indices[:, :2], "copy_indices have shape [48, 2], expected [48, 4]"),
             (values, None, "copy_values and copy_indices go together")]
    for v, i, message in cases:
        with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
            nmcli.session(with_copy_inputs(pruned, v, i)).run(None, {"x": x})
    (again,) = nmcli.session(with_copy_inputs(pruned, values, indices)).run(None, {"x": x})
    assert np.array_equal(again, want)
    dense_fit, _ = nmcli.prune_model(model, nmcli.Selection(NMPattern(4, 16)))
    with pytest.raises(Exception, match="a 2:4 copy needs a pattern that fits 2:4"):
        nmcli.session(with_copy_inputs(dense_fit, values, indices)).run(None, {"x": x})
