"""Fusing an op's neighbours into it (docs/FORMAT.md, "Fused neighbours").

At decode sizes a sparse decoder layer spent about a quarter of its time in small kernels
between the projections (BENCHMARKS.md, session 12). Three kinds sit right next to our op and read or write
only what it reads or writes, so the op takes them over:
* a residual `Add` right after it: `Y = A @ W + residual` (input 4), after o_proj and down_proj;
* a gated activation right before it: `silu(g) * u`, written `Mul(Mul(g, Sigmoid(g)), u)` by
  exporters, becomes `A = silu(X) * x_up` with X = g (input 5, attribute glu="silu");
* an RMSNorm right before it, as PyTorch exports it (`Pow(x, 2)` or `Mul(x, x)`, `ReduceMean`
  over the last axis, `Add(eps)`, `Sqrt`, `Div(x, .)`, `Mul(., weight)`), becomes
  `A = x / sqrt(mean(x^2) + eps) * weight` (input 6, attributes norm="rms", norm_epsilon).
Only exact matches fuse: every intermediate tensor has the fused node as its only reader and is
no graph output, and the tensors combined element-wise have the same shape as far as ONNX shape
inference can prove (no broadcasting), so the op computes exactly what the nodes did."""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .format import OP_DOMAIN, OP_TYPE
from .graph import ConstantResolver, _attr, subgraph_inputs, unique_name

SMALL_INITIALIZER = 4096  # elements: shape tensors and scalars keep their values for inference
BIAS, RESIDUAL, X_UP, NORM_WEIGHT = 3, 4, 5, 6  # the op's optional inputs


def inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """Dims (int, symbol or None) of the tensors ONNX shape inference can type. Large
    initializers go in as typed inputs without their data, so no copy of the weights is made."""
    graph = model.graph
    inputs = list(graph.input)
    names = {i.name for i in inputs}
    small = []
    for t in graph.initializer:
        if t.name in names:
            continue
        if math.prod(t.dims) <= SMALL_INITIALIZER and t.data_location != onnx.TensorProto.EXTERNAL:
            small.append(t)
        else:
            inputs.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    light = helper.make_model(helper.make_graph(list(graph.node), "shapes", inputs, list(graph.output), small,
                                                value_info=list(graph.value_info)),
                              opset_imports=list(model.opset_import))
    light.ir_version = model.ir_version
    try:
        light = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    except Exception:  # inference is an aid: without it nothing is fused
        return {}
    shapes = {}
    for info in list(light.graph.input) + list(light.graph.value_info) + list(light.graph.output):
        t = info.type.tensor_type
        if t.HasField("shape"):
            shapes[info.name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                      for d in t.shape.dim)
    return shapes


def same_shape(shapes: dict, a: str, b: str) -> bool:
    """Whether a and b provably have one shape: equal rank, every dim the same number or symbol."""
    sa, sb = shapes.get(a), shapes.get(b)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(
        x is not None and x == y for x, y in zip(sa, sb))


def fuse_neighbours(graph: onnx.GraphProto, shapes: dict) -> dict[str, int]:
    """Fuse gated activations, RMSNorms and residual adds into the graph's ops in place; returns
    the count of each kind fused."""
    counts = {"glu": 0, "norm": 0, "residual": 0}
    for kind, fuse_one in (("glu", _fuse_glu), ("norm", _fuse_rms_norm), ("residual", _fuse_residual)):
        fused = True
        while fused:  # one fusion per sweep: it edits the graph the index was built from
            uses = _Uses(graph)
            fused = any(fuse_one(graph, node, shapes, uses) for node in graph.node
                        if node.op_type == OP_TYPE and node.domain == OP_DOMAIN)
            counts[kind] += fused
    return counts


class _Uses:
    """Producers and readers of every tensor of the graph as it is now."""

    def __init__(self, graph: onnx.GraphProto):
        self.nodes = list(graph.node)  # keeps the wrappers alive, so id() stays theirs
        self.position = {id(n): i for i, n in enumerate(self.nodes)}
        self._resolver = ConstantResolver(graph)
        self.producer = self._resolver.producers  # the same index: output name -> node
        self.readers = defaultdict(list)
        for n in graph.node:
            for name in set(n.input) | subgraph_inputs(n):  # a subgraph's outer-scope reads count
                self.readers[name].append(n)
        self.outputs = {o.name for o in graph.output}
        self.names = {t.name for t in graph.initializer} | {i.name for i in graph.input} | set(self.producer)

    def only_reader(self, name: str, node: onnx.NodeProto) -> bool:
        return name not in self.outputs and len(self.readers[name]) == 1 and self.readers[name][0] is node

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a constant tensor (graph.ConstantResolver), or None."""
        resolved = self._resolver.resolve(name)
        return resolved[0] if resolved is not None else None

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _set_input(node: onnx.NodeProto, index: int, name: str) -> None:
    while len(node.input) <= index:
        node.input.append("")
    node.input[index] = name


def _remove(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], uses: _Uses) -> None:
    for index in sorted((uses.position[id(n)] for n in nodes), reverse=True):  # in place: no copies
        del graph.node[index]


def _fuse_glu(graph: onnx.GraphProto, op: onnx.NodeProto, shapes: dict, uses: _Uses) -> bool:
    """X = Mul(Mul(g, Sigmoid(g)), u) (operands in either order) -> X = g, x_up = u, glu="silu"."""
    gated = op.input[0]
    product = uses.made_by(gated, "Mul")
    if product is None or not uses.only_reader(gated, op) or len(op.input) > X_UP or product.input[0] == product.input[1]:
        return False
    for act, up in ((product.input[0], product.input[1]), (product.input[1], product.input[0])):
        silu = uses.made_by(act, "Mul")
        if silu is None or not uses.only_reader(act, product):
            continue
        for g, sig in ((silu.input[0], silu.input[1]), (silu.input[1], silu.input[0])):
            sigmoid = uses.made_by(sig, "Sigmoid")
            if (sigmoid is not None and sigmoid.input[0] == g and uses.only_reader(sig, silu)
                    and same_shape(shapes, g, up) and same_shape(shapes, g, gated)):
                op.input[0] = g
                _set_input(op, X_UP, up)
                op.attribute.append(helper.make_attribute("glu", "silu"))
                _remove(graph, [product, silu, sigmoid], uses)
                return True
    return False


def _fuse_rms_norm(graph: onnx.GraphProto, op: onnx.NodeProto, shapes: dict, uses: _Uses) -> bool:
    """X = Mul(Div(x, Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps))), w) -> X = x, norm_weight = w."""
    if len(op.input) > NORM_WEIGHT or any(a.name in ("glu", "norm") for a in op.attribute):
        return False
    normed = op.input[0]
    scale = uses.made_by(normed, "Mul")
    if scale is None or not uses.only_reader(normed, op):
        return False
    k = _attr(op, "k", 0)
    for divided, weight_name in ((scale.input[0], scale.input[1]), (scale.input[1], scale.input[0])):
        weight = uses.constant(weight_name)
        div = uses.made_by(divided, "Div")
        if weight is None or weight.size != k or weight.shape[-1] != k or div is None or not uses.only_reader(divided, scale):
            continue
        x, rms = div.input
        chain = _rms_of(uses, x, rms, div, shapes)
        if chain is None or not same_shape(shapes, x, normed):
            continue
        nodes, epsilon = chain
        if weight.ndim != 1:  # [1, ..., K]: the op takes [K]
            weight_name = unique_name(weight_name + ".nm_norm_weight", uses.names)
            graph.initializer.append(numpy_helper.from_array(weight.reshape(k), weight_name))
        op.input[0] = x
        _set_input(op, NORM_WEIGHT, weight_name)
        op.attribute.extend([helper.make_attribute("norm", "rms"), helper.make_attribute("norm_epsilon", epsilon)])
        _remove(graph, [scale, div] + nodes, uses)
        return True
    return False


def _rms_of(uses: _Uses, x: str, rms: str, div: onnx.NodeProto, shapes: dict):
    """If rms = Sqrt(Add(ReduceMean(x^2, last axis, keepdims), eps)) with every intermediate read
    once: (its nodes, eps), else None."""
    sqrt = uses.made_by(rms, "Sqrt")
    add = uses.made_by(sqrt.input[0], "Add") if sqrt is not None and uses.only_reader(rms, div) else None
    if add is None or not uses.only_reader(sqrt.input[0], sqrt):
        return None
    rank = len(shapes.get(x) or ())
    for mean_name, eps_name in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
        eps, mean = uses.constant(eps_name), uses.made_by(mean_name, "ReduceMean")
        if eps is None or eps.size != 1 or mean is None or not uses.only_reader(mean_name, add) or rank == 0:
            continue
        if len(mean.input) > 1 and mean.input[1]:  # opset 18: axes as an input, else an attribute
            axes = uses.constant(mean.input[1])
        else:
            axes = _attr(mean, "axes", None)
            axes = None if axes is None else np.array(axes)
        keepdims = _attr(mean, "keepdims", 1)
        if axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) % rank != rank - 1 or not keepdims:
            continue
        squared = mean.input[0]
        square = uses.made_by(squared, "Pow") or uses.made_by(squared, "Mul")
        if square is None or not uses.only_reader(squared, mean):
            continue
        if square.op_type == "Pow":
            exponent = uses.constant(square.input[1])
            ok = square.input[0] == x and exponent is not None and exponent.size == 1 and float(exponent.reshape(-1)[0]) == 2.0
        else:
            ok = list(square.input) == [x, x]
        if ok:
            return [sqrt, add, mean, square], float(eps.reshape(-1)[0])
    return None


def _fuse_residual(graph: onnx.GraphProto, op: onnx.NodeProto, shapes: dict, uses: _Uses) -> bool:
    """Y = Add(op(...), r) (either order) with r of Y's shape -> op(..., residual=r) writes Y."""
    if len(op.output) != 1 or (len(op.input) > RESIDUAL and op.input[RESIDUAL]):
        return False
    out = op.output[0]
    readers = uses.readers[out]
    if len(readers) != 1 or out in uses.outputs or readers[0].op_type != "Add" or readers[0].domain not in ("", "ai.onnx"):
        return False
    add = readers[0]
    if list(add.input).count(out) != 1:
        return False
    residual = add.input[1] if add.input[0] == out else add.input[0]
    producer = uses.producer.get(residual)
    # The op runs where it is, so the residual must exist by then; shapes must match exactly.
    if producer is not None and uses.position[id(producer)] > uses.position[id(op)]:
        return False
    if not same_shape(shapes, residual, out) or not same_shape(shapes, add.output[0], out):
        return False
    _set_input(op, RESIDUAL, residual)
    op.output[0] = add.output[0]
    _remove(graph, [add], uses)
    return True
