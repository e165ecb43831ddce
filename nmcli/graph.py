"""Finding the MatMul / Gemm nodes whose weight is a constant we can prune."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .format import NMPattern

SUPPORTED_DTYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
FOLDABLE_OPS = {"Transpose", "Cast", "Identity"}


@dataclass
class Candidate:
    """A MatMul or Gemm node and the effective weight W [K, Nout] it multiplies by."""

    node: onnx.NodeProto
    weight_name: str              # tensor feeding the node (after Transpose/Cast chains)
    weight: np.ndarray | None     # effective [K, Nout]; None when the node is skipped
    elem_type: int = onnx.TensorProto.UNDEFINED
    chain: list[onnx.NodeProto] = field(default_factory=list)
    skip_reason: str | None = None

    @property
    def name(self) -> str:
        return self.node.name or self.node.output[0]

    @property
    def weight_key(self) -> tuple[str, bool]:
        """Nodes with the same key share one pruned weight."""
        transposed = self.node.op_type == "Gemm" and _attr(self.node, "transB", 0) == 1
        return (self.weight_name, transposed)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape) if self.weight is not None else (0, 0)


@dataclass
class Selection:
    """What the user asked to prune."""

    pattern: NMPattern
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    min_size: int = 0

    def compiled(self) -> tuple[list[re.Pattern], list[re.Pattern]]:
        from .errors import NmcliError

        out = []
        for patterns in (self.include, self.exclude):
            try:
                out.append([re.compile(p) for p in patterns])
            except re.error as exc:
                raise NmcliError(f"invalid regular expression {exc.pattern!r}: {exc}") from None
        return out[0], out[1]


class ConstantResolver:
    """Evaluates a tensor name to a constant when it is an initializer, a Constant node, or
    a Transpose / Cast / Identity of one (what exporters emit for nn.Linear)."""

    def __init__(self, graph: onnx.GraphProto):
        graph_inputs = {i.name for i in graph.input}
        # An initializer that is also a graph input can be overridden at run time: not constant.
        self.initializers = {t.name: t for t in graph.initializer if t.name not in graph_inputs}
        self.producers = {out: node for node in graph.node for out in node.output}

    def resolve(self, name: str) -> tuple[np.ndarray, int, list[onnx.NodeProto]] | None:
        """(array, onnx element type, chain of folded nodes) or None if not constant."""
        if name in self.initializers:
            tensor = self.initializers[name]
            return numpy_helper.to_array(tensor), tensor.data_type, []
        node = self.producers.get(name)
        if node is None:
            return None
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is None:
                return None
            return numpy_helper.to_array(value), value.data_type, [node]
        if node.op_type not in FOLDABLE_OPS or not node.input:
            return None
        inner = self.resolve(node.input[0])
        if inner is None:
            return None
        array, elem_type, chain = inner
        if node.op_type == "Transpose":
            perm = _attr(node, "perm", None)
            array = np.transpose(array, perm)
        elif node.op_type == "Cast":
            elem_type = _attr(node, "to", elem_type)
            array = array.astype(helper.tensor_dtype_to_np_dtype(elem_type))
        return array, elem_type, chain + [node]


def find_candidates(model: onnx.ModelProto, selection: Selection) -> list[Candidate]:
    """Every MatMul / Gemm of the main graph, each with its weight or the reason it is skipped."""
    resolver = ConstantResolver(model.graph)
    include, exclude = selection.compiled()
    found = []
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
            continue
        found.append(_inspect(node, resolver, selection, include, exclude))
    return found


def _inspect(node, resolver, selection, include, exclude) -> Candidate:
    weight_name = node.input[1]
    cand = Candidate(node=node, weight_name=weight_name, weight=None)
    resolved = resolver.resolve(weight_name)
    if resolved is None:
        cand.skip_reason = "weight is not a constant"
        return cand
    array, elem_type, chain = resolved
    cand.elem_type, cand.chain = elem_type, chain
    if array.ndim != 2:
        cand.skip_reason = f"weight has rank {array.ndim}, need 2"
        return cand
    if node.op_type == "Gemm" and _attr(node, "transB", 0) == 1:
        array = array.T
    k, nout = array.shape
    names = [cand.name, weight_name]
    if elem_type not in SUPPORTED_DTYPES:
        cand.skip_reason = f"weight dtype {helper.tensor_dtype_to_string(elem_type)} is not float32/float16/bfloat16"
    elif include and not any(p.search(s) for p in include for s in names):
        cand.skip_reason = "not matched by --include"
    elif any(p.search(s) for p in exclude for s in names):
        cand.skip_reason = "matched by --exclude"
    elif k < selection.pattern.m:
        cand.skip_reason = f"K={k} is smaller than M={selection.pattern.m}"
    elif array.size < selection.min_size:
        cand.skip_reason = f"{array.size} weights < --min-size {selection.min_size}"
    else:
        cand.weight = np.ascontiguousarray(array)
    return cand


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names the node's subgraphs (If, Loop, Scan bodies) read, at any depth: outer-scope
    tensors they use count as read by the node."""
    names: set[str] = set()
    for attr in node.attribute:
        for sub in list(attr.g.node if attr.HasField("g") else []) + [n for g in attr.graphs for n in g.node]:
            names.update(sub.input)
            names.update(subgraph_inputs(sub))
    return names


def unique_name(name: str, taken: set[str]) -> str:
    """`name`, or `name.1`, `name.2`, ... : the first not in `taken`, which it is then added to."""
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}.{i}", i + 1
    taken.add(candidate)
    return candidate
