"""Model inputs for benchmarks and calibration: shapes from the graph plus user overrides, and
random data of the right dtype in valid ranges (token ids below the vocabulary size when an
input feeds a Gather's indices, ones for masks, N(0, 1) for floats)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from .errors import NmcliError


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    dims: tuple            # ints for fixed dims, str (symbolic name) or None for free ones
    kind: str              # "float", "ids" (token ids), "mask" or "int"
    vocab: int = 0         # for "ids": exclusive upper bound

    def shape(self, batch: int, tokens: int) -> tuple[int, ...]:
        """Free dims: the first is the batch, every later one the sequence length."""
        return tuple(d if isinstance(d, int) else (batch if axis == 0 else tokens) for axis, d in enumerate(self.dims))


def parse_shape_overrides(items: list[str]) -> dict[str, tuple[int, ...]]:
    """`name=1x128` (repeatable) -> {"name": (1, 128)}."""
    out = {}
    for item in items:
        m = re.fullmatch(r"([^=]+)=(\d+(?:x\d+)*)", item.strip())
        if not m:
            raise NmcliError(f"--shape '{item}': expected NAME=DIMS like input_ids=1x128")
        out[m.group(1)] = tuple(int(d) for d in m.group(2).split("x"))
    return out


def _gather_vocab(model: onnx.ModelProto) -> dict[str, int]:
    """Inputs used as Gather indices -> rows of the gathered constant (the vocabulary)."""
    consts = {t.name: tuple(t.dims) for t in model.graph.initializer}
    vocab = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[0] in consts:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = consts[node.input[0]]
            if dims:
                vocab[node.input[1]] = dims[axis]
    return vocab


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    initializers = {t.name for t in model.graph.initializer}
    vocab = _gather_vocab(model)
    specs = []
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise NmcliError(f"input '{vi.name}' is not a tensor; nmcli can only generate tensor inputs")
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        if dtype.kind == "f":
            kind = "float"
        elif vi.name in vocab:
            kind = "ids"
        elif "mask" in vi.name.lower():
            kind = "mask"
        elif dtype.kind in "iub":
            kind = "int"
        else:
            raise NmcliError(f"input '{vi.name}' has type {dtype}, which nmcli cannot generate")
        specs.append(InputSpec(vi.name, dtype, dims, kind, vocab.get(vi.name, 0)))
    return specs


def resolve_shapes(specs: list[InputSpec], batch: int, tokens: int,
                   overrides: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    unknown = set(overrides) - {s.name for s in specs}
    if unknown:
        raise NmcliError(f"--shape names no model input: {', '.join(sorted(unknown))} "
                         f"(inputs: {', '.join(s.name for s in specs)})")
    shapes = {}
    for s in specs:
        shape = overrides.get(s.name) or s.shape(batch, tokens)
        if len(shape) != len(s.dims) or any(isinstance(d, int) and d != v for d, v in zip(s.dims, shape)):
            want = "x".join(str(d) if isinstance(d, int) else "?" for d in s.dims)
            raise NmcliError(f"--shape {s.name}={'x'.join(map(str, shape))} does not fit the model's {want}")
        shapes[s.name] = shape
    return shapes


def random_feeds(specs: list[InputSpec], shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> dict:
    feeds = {}
    for s in specs:
        shape = shapes[s.name]
        if s.kind == "float":
            feeds[s.name] = rng.standard_normal(shape, dtype=np.float32).astype(s.dtype)
        elif s.kind == "ids":
            feeds[s.name] = rng.integers(0, s.vocab, size=shape).astype(s.dtype)
        elif s.kind == "mask":
            feeds[s.name] = np.ones(shape, dtype=s.dtype)
        else:
            feeds[s.name] = rng.integers(0, 2, size=shape).astype(s.dtype)
    return feeds
