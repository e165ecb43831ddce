"""Small ONNX models built in code: a transformer block for the README's first run and the tests.

    python -m nmcli.toymodels block.onnx [--hidden 256 --ffn 1024 --fp16]
"""
from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .modelio import max_ir_version_supported


def make_model(nodes, inputs, outputs, initializers, opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "nmcli_toy", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, max_ir_version_supported())  # onnx writes IR 14 by default
    return model


def vinfo(name, dtype, shape):
    """A tensor's type and shape; dtype a NumPy dtype (ml_dtypes.bfloat16 for bfloat16)."""
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)


def transformer_block(rng, hidden=64, ffn=176, dtype=np.float32, seq="s") -> tuple[onnx.ModelProto, dict]:
    """A pre-LayerNorm transformer block: q/k/v/o projections as MatMul (one through the
    Transpose an exporter emits for nn.Linear), single-head attention, GELU MLP via Gemm on a
    flattened [B*S, H] view. Returns the model and its dense weights by initializer name."""
    f = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)
    w = {"wq": f(hidden, hidden), "wk": f(hidden, hidden), "wv": f(hidden, hidden),
         "wo_t": f(hidden, hidden), "w1": f(hidden, ffn), "b1": f(ffn), "w2_t": f(hidden, ffn).reshape(hidden, ffn),
         "b2": f(hidden), "ln_g": (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype),
         "ln_b": (0.1 * rng.standard_normal(hidden)).astype(dtype)}
    scale = np.array(1.0 / np.sqrt(hidden), dtype=dtype)
    shape_flat = np.array([-1, hidden], dtype=np.int64)
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln_g", "ln_b"], ["h"], axis=-1, epsilon=1e-5, name="ln"),
        n("MatMul", ["h", "wq"], ["q"], name="q_proj"),
        n("MatMul", ["h", "wk"], ["kk"], name="k_proj"),
        n("MatMul", ["h", "wv"], ["v"], name="v_proj"),
        n("Transpose", ["kk"], ["kt"], perm=[0, 2, 1], name="k_t"),
        n("MatMul", ["q", "kt"], ["scores_raw"], name="qk"),
        n("Mul", ["scores_raw", "scale"], ["scores"], name="scale"),
        n("Softmax", ["scores"], ["probs"], axis=-1, name="softmax"),
        n("MatMul", ["probs", "v"], ["ctx"], name="pv"),
        n("Transpose", ["wo_t"], ["wo"], perm=[1, 0], name="wo_transpose"),
        n("MatMul", ["ctx", "wo"], ["attn"], name="o_proj"),
        n("Add", ["x", "attn"], ["x1"], name="residual1"),
        n("Reshape", ["x1", "shape_flat"], ["x1_flat"], name="flatten"),
        n("Gemm", ["x1_flat", "w1", "b1"], ["ff1"], name="fc1"),
        n("Gelu", ["ff1"], ["ff1_act"], name="gelu"),
        n("Gemm", ["ff1_act", "w2_t", "b2"], ["ff2"], transB=1, name="fc2"),
        n("Shape", ["x1"], ["x1_shape"], name="shape"),
        n("Reshape", ["ff2", "x1_shape"], ["ff2_3d"], name="unflatten"),
        n("Add", ["x1", "ff2_3d"], ["y"], name="residual2"),
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in w.items()] + [
        numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(shape_flat, "shape_flat")]
    model = make_model(nodes, [vinfo("x", dtype, ["b", seq, hidden])], [vinfo("y", dtype, ["b", seq, hidden])], inits,
                       opset=20)  # Gelu is an operator from opset 20
    return model, w


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write a small transformer block as ONNX.")
    parser.add_argument("output")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--fp16", action="store_true")
    args = parser.parse_args(argv)
    model, _ = transformer_block(np.random.default_rng(0), hidden=args.hidden, ffn=args.ffn,
                                 dtype=np.float16 if args.fp16 else np.float32)
    onnx.save_model(model, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
