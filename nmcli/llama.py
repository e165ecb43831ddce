"""A LLaMA-style decoder stack as ONNX, built in code: `nmcli demo`'s model.

Each layer: RMSNorm -> q/k/v projections -> multi-head causal-free attention -> o projection ->
residual; RMSNorm -> gated MLP (SiLU(x Wg) * (x Wu)) Wd -> residual. Weights are random
(N(0, 1/fan_in)), the seven projections per layer are plain MatMuls on [hidden, out] weights,
as exporters emit for nn.Linear after folding the transpose. Rotary embeddings and the KV
cache are left out: they do not touch the weights nmcli prunes, and a 1-token decode step
with a cache costs the same projections as the 1-token forward pass built here.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import NmcliError
from .toymodels import make_model, vinfo


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int = 4096
    ffn: int = 11008
    heads: int = 32
    layers: int = 1
    dtype: str = "float16"

    def check(self) -> "LlamaConfig":
        if min(self.hidden, self.ffn, self.heads, self.layers) < 1:
            raise NmcliError("hidden size, MLP size, heads and layers must be positive")
        if self.hidden % self.heads:
            raise NmcliError(f"hidden size {self.hidden} is not a multiple of {self.heads} heads")
        if self.dtype not in ("float16", "float32"):
            raise NmcliError(f"dtype must be float16 or float32, not '{self.dtype}'")
        return self

    @property
    def params(self) -> int:
        return self.layers * (4 * self.hidden * self.hidden + 3 * self.hidden * self.ffn + 2 * self.hidden)

    def to_dict(self) -> dict:
        return asdict(self)


GPU_DEFAULT = LlamaConfig()  # LLaMA-7B layer shapes
CPU_DEFAULT = LlamaConfig(hidden=512, ffn=1408, heads=8, layers=2, dtype="float32")


def llama_model(config: LlamaConfig, rng: np.random.Generator) -> onnx.ModelProto:
    """Input x [batch, tokens, hidden], output y of the same shape."""
    c = config.check()
    dtype = np.dtype(c.dtype)
    head_dim = c.hidden // c.heads
    n = helper.make_node
    inits = [
        numpy_helper.from_array(np.array(1e-5, dtype), "eps"),
        numpy_helper.from_array(np.array(2.0, dtype), "two"),
        numpy_helper.from_array(np.array(1.0 / np.sqrt(head_dim), dtype), "attn_scale"),
        numpy_helper.from_array(np.array([-1], np.int64), "last_axis"),
        numpy_helper.from_array(np.array([0, 0, c.heads, head_dim], np.int64), "split_heads"),
        numpy_helper.from_array(np.array([0, 0, c.hidden], np.int64), "merge_heads"),
    ]
    nodes = []

    def weight(name, rows, cols):
        w = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(rows))
        inits.append(numpy_helper.from_array(w.astype(dtype, copy=False), name))
        return name

    def rms_norm(x, prefix):
        # The form PyTorch exports (pow, mean, add, sqrt, div, mul), which ONNX Runtime fuses into
        # one SimplifiedLayerNormalization kernel, as it does for exported LLaMA models.
        gamma = (1 + 0.1 * rng.standard_normal(c.hidden)).astype(dtype)
        inits.append(numpy_helper.from_array(gamma, f"{prefix}.weight"))
        nodes.extend([
            n("Pow", [x, "two"], [f"{prefix}.sq"], name=f"{prefix}.sq"),
            n("ReduceMean", [f"{prefix}.sq", "last_axis"], [f"{prefix}.ms"], keepdims=1, name=f"{prefix}.mean"),
            n("Add", [f"{prefix}.ms", "eps"], [f"{prefix}.ms_eps"], name=f"{prefix}.eps"),
            n("Sqrt", [f"{prefix}.ms_eps"], [f"{prefix}.rms"], name=f"{prefix}.sqrt"),
            n("Div", [x, f"{prefix}.rms"], [f"{prefix}.normed"], name=f"{prefix}.div"),
            n("Mul", [f"{prefix}.normed", f"{prefix}.weight"], [f"{prefix}.out"], name=f"{prefix}.scale"),
        ])
        return f"{prefix}.out"

    def linear(x, prefix, rows, cols):
        nodes.append(n("MatMul", [x, weight(f"{prefix}.weight", rows, cols)], [f"{prefix}.out"], name=prefix))
        return f"{prefix}.out"

    x = "x"
    for layer in range(c.layers):
        p = f"layers.{layer}"
        h = rms_norm(x, f"{p}.input_norm")
        q, k, v = (linear(h, f"{p}.attn.{name}_proj", c.hidden, c.hidden) for name in "qkv")
        nodes.extend([
            n("Reshape", [q, "split_heads"], [f"{p}.q4"], name=f"{p}.q_split"),
            n("Transpose", [f"{p}.q4"], [f"{p}.qh"], perm=[0, 2, 1, 3], name=f"{p}.q_heads"),
            n("Reshape", [k, "split_heads"], [f"{p}.k4"], name=f"{p}.k_split"),
            n("Transpose", [f"{p}.k4"], [f"{p}.kt"], perm=[0, 2, 3, 1], name=f"{p}.k_heads"),
            n("Reshape", [v, "split_heads"], [f"{p}.v4"], name=f"{p}.v_split"),
            n("Transpose", [f"{p}.v4"], [f"{p}.vh"], perm=[0, 2, 1, 3], name=f"{p}.v_heads"),
            n("MatMul", [f"{p}.qh", f"{p}.kt"], [f"{p}.scores_raw"], name=f"{p}.qk"),
            n("Mul", [f"{p}.scores_raw", "attn_scale"], [f"{p}.scores"], name=f"{p}.scale"),
            n("Softmax", [f"{p}.scores"], [f"{p}.probs"], axis=-1, name=f"{p}.softmax"),
            n("MatMul", [f"{p}.probs", f"{p}.vh"], [f"{p}.ctx_h"], name=f"{p}.pv"),
            n("Transpose", [f"{p}.ctx_h"], [f"{p}.ctx4"], perm=[0, 2, 1, 3], name=f"{p}.ctx_heads"),
            n("Reshape", [f"{p}.ctx4", "merge_heads"], [f"{p}.ctx"], name=f"{p}.ctx_merge"),
        ])
        attn = linear(f"{p}.ctx", f"{p}.attn.o_proj", c.hidden, c.hidden)
        nodes.append(n("Add", [x, attn], [f"{p}.h1"], name=f"{p}.residual1"))
        h2 = rms_norm(f"{p}.h1", f"{p}.post_norm")
        gate = linear(h2, f"{p}.mlp.gate_proj", c.hidden, c.ffn)
        up = linear(h2, f"{p}.mlp.up_proj", c.hidden, c.ffn)
        nodes.extend([
            n("Sigmoid", [gate], [f"{p}.gate_sig"], name=f"{p}.sigmoid"),
            n("Mul", [gate, f"{p}.gate_sig"], [f"{p}.gate_act"], name=f"{p}.silu"),
            n("Mul", [f"{p}.gate_act", up], [f"{p}.gated"], name=f"{p}.gated"),
        ])
        down = linear(f"{p}.gated", f"{p}.mlp.down_proj", c.ffn, c.hidden)
        out = "y" if layer == c.layers - 1 else f"{p}.out"
        nodes.append(n("Add", [f"{p}.h1", down], [out], name=f"{p}.residual2"))
        x = out
    return make_model(nodes, [vinfo("x", dtype, ["batch", "tokens", c.hidden])],
                      [vinfo("y", dtype, ["batch", "tokens", c.hidden])], inits, opset=18)
