"""A small transformer block (LayerNorm, attention projections, GELU MLP through Gemm, a weight
behind a Transpose) round-trips: prune -> run -> compare with the dense model with pruned weights."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from models import magnitude_pruned, transformer_block
from onnx import numpy_helper

import nmcli
from nmcli import NMPattern, Selection, prune_model

# Weight name -> how the node sees it (stored transposed for Transpose / transB=1).
PRUNED = {"wq": False, "wk": False, "wv": False, "wo_t": True, "w1": False, "w2_t": True}


def dense_with_pruned_weights(model, weights, pattern):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in PRUNED:
            w = weights[init.name]
            pruned = magnitude_pruned(w.T, pattern).T if PRUNED[init.name] else magnitude_pruned(w, pattern)
            init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(pruned), init.name))
    return out


@pytest.mark.parametrize("nm,dtype", [("2:4", np.float32), ("2:8", np.float32), ("4:16", np.float16)])
def test_transformer_block_roundtrip(rng, nm, dtype):
    pattern = NMPattern.parse(nm)
    model, weights = transformer_block(rng, dtype=dtype)
    pruned, report = prune_model(model, Selection(pattern))
    onnx.checker.check_model(pruned)
    assert sorted(layer.node for layer in report.layers) == ["fc1", "fc2", "k_proj", "o_proj", "q_proj", "v_proj"]
    assert {s.node for s in report.skipped} == {"qk", "pv"}  # activation x activation products
    assert not any(n.op_type in ("Gemm",) for n in pruned.graph.node)
    assert "wo_transpose" not in {n.name for n in pruned.graph.node}
    x = rng.standard_normal((2, 7, 64)).astype(dtype)
    (y,) = nmcli.session(pruned).run(None, {"x": x})
    dense = dense_with_pruned_weights(model, weights, pattern)
    # The dense reference runs in float32 so the comparison measures our kernel, not fp16 rounding in ORT.
    (y_ref,) = ort.InferenceSession(dense.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    rel = np.linalg.norm(y.astype(np.float64) - y_ref) / np.linalg.norm(y_ref.astype(np.float64))
    assert y.shape == x.shape and rel < (1e-5 if dtype == np.float32 else 5e-3)
    # and pruning changed the function: the dense model with unpruned weights differs clearly
    (y_orig,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.linalg.norm(y_orig.astype(np.float64) - y_ref) / np.linalg.norm(y_orig.astype(np.float64)) > 1e-2
