"""Small ONNX models built in code, for the tests."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from nmcli.masks import choose_offsets, prune_mask
from nmcli.toymodels import make_model, transformer_block, vinfo  # noqa: F401


def magnitude_pruned(weight: np.ndarray, pattern) -> np.ndarray:
    """The dense weight [K, Nout] that magnitude N:M pruning leaves."""
    mask = prune_mask(weight, choose_offsets(np.abs(weight.astype(np.float64)), pattern), pattern)
    return np.where(mask, weight, np.zeros_like(weight))


def matmul_model(weight: np.ndarray, x_shape, name="W") -> onnx.ModelProto:
    k, nout = weight.shape
    out_shape = list(x_shape[:-1]) + [nout]
    return make_model([helper.make_node("MatMul", ["x", name], ["y"], name="mm")],
                      [vinfo("x", weight.dtype, list(x_shape))], [vinfo("y", weight.dtype, out_shape)],
                      [numpy_helper.from_array(weight, name)])


def gemm_model(a_shape, b: np.ndarray, c: np.ndarray | None, c_is_input=False, **attrs) -> onnx.ModelProto:
    dtype = b.dtype
    trans_a, trans_b = attrs.get("transA", 0), attrs.get("transB", 0)
    rows = a_shape[1] if trans_a else a_shape[0]
    nout = b.shape[0] if trans_b else b.shape[1]
    inputs = [vinfo("a", dtype, list(a_shape))]
    inits = [numpy_helper.from_array(b, "B")]
    names = ["a", "B"]
    if c is not None:
        names.append("C")
        if c_is_input:
            inputs.append(vinfo("C", dtype, list(c.shape)))
        else:
            inits.append(numpy_helper.from_array(c, "C"))
    node = helper.make_node("Gemm", names, ["y"], name="gemm", **attrs)
    return make_model([node], inputs, [vinfo("y", dtype, [rows, nout])], inits)




def assert_matches_reference(y: np.ndarray, x: np.ndarray, w: np.ndarray, dtype) -> None:
    """The op's output y against the float64 x @ w, within the dtype's rounding bound."""
    from nmcli.reference import dense_reference, error_ratio

    ref, magnitude = dense_reference(x, w)
    assert error_ratio(y, ref, magnitude, dtype, x.shape[-1]) < 1
