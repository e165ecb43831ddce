"""`nmcli eval`: how far a converted model is from the dense one.

Two views. Outputs: both models run on the same inputs (calibration file or generated), per
output the relative error, the cosine similarity of each output row (the last axis: a token's
hidden state, a sentence embedding, a row of logits) and, for outputs that look like logits,
how often the arg-max agrees. Weights: per pruned node, the dense weight against the pruned
weight it now stores (unpacked and put back in the original channel order).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper
from rich.table import Table

from .errors import ModelError, NmcliError, first_line
from .format import NMPattern, from_arrays, unpack
from .graph import Selection, _attr, find_candidates

LOGIT_NAME = re.compile(r"logit|class|score|prob", re.IGNORECASE)
LOGIT_PRODUCERS = {"Softmax", "LogSoftmax", "MatMul", "Gemm", "NMMatMul"}


@dataclass
class OutputAgreement:
    name: str
    rel_error: float            # ||dense - sparse|| / ||dense|| over all samples
    cosine_mean: float          # cosine similarity of each row (last axis), mean ...
    cosine_min: float           # ... and worst row
    max_abs_diff: float
    rows: int
    top1: float | None = None   # arg-max agreement per row, for logit-like outputs


@dataclass
class LayerError:
    node: str
    k: int
    nout: int
    nm: str
    rel_error: float            # ||W - W'|| / ||W||
    kept_energy: float          # ||W'||^2 / ||W||^2
    permuted: bool


@dataclass
class EvalReport:
    dense: str
    sparse: str
    samples: int
    inputs: str                 # where the inputs came from
    outputs: list[OutputAgreement] = field(default_factory=list)
    layers: list[LayerError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"dense_model": self.dense, "sparse_model": self.sparse, "samples": self.samples,
                "inputs": self.inputs, "outputs": [asdict(o) for o in self.outputs],
                "layers": [asdict(layer) for layer in self.layers], "notes": self.notes}

    def tables(self) -> list[Table]:
        outputs = Table(title=f"output agreement over {self.samples} sample(s) ({self.inputs})", header_style="bold")
        for col in ("output", "rows", "rel. error", "cosine mean", "cosine min", "max |diff|", "top-1 agree"):
            outputs.add_column(col, justify="left" if col == "output" else "right")
        for o in self.outputs:
            outputs.add_row(o.name, str(o.rows), f"{o.rel_error:.4f}", f"{o.cosine_mean:.5f}", f"{o.cosine_min:.5f}",
                            f"{o.max_abs_diff:.4g}", "-" if o.top1 is None else f"{o.top1 * 100:.1f}%")
        layers = Table(title="per-layer weight error", header_style="bold")
        for col in ("layer", "K x Nout", "N:M", "rel. error", "kept energy", "channel order"):
            layers.add_column(col, justify="left" if col == "layer" else "right")
        for layer in self.layers:
            layers.add_row(layer.node, f"{layer.k} x {layer.nout}", layer.nm, f"{layer.rel_error:.4f}",
                           f"{layer.kept_energy * 100:.1f}%", "permuted" if layer.permuted else "identity")
        return [outputs, layers]


def stored_weights(model: onnx.ModelProto):
    """(node name, dense pruned weight [K, Nout] in the original channel order, pattern,
    permuted) for every nmcli op node of a converted model, one node at a time."""
    from .prune import OP_DOMAIN, OP_TYPE

    inits = {t.name: t for t in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    for node in model.graph.node:
        if node.domain != OP_DOMAIN or node.op_type != OP_TYPE:
            continue
        if node.input[1] not in inits or node.input[2] not in inits:
            raise ModelError(f"{node.name}: packed weights are not initializers")
        values, indices = (numpy_helper.to_array(inits[name]) for name in node.input[1:3])
        try:
            packed = from_arrays(values, indices, _attr(node, "n", 0), _attr(node, "m", 0), _attr(node, "k", 0))
        except (ValueError, NmcliError) as exc:
            raise ModelError(f"{node.name}: stored weights do not fit the N:M format ({first_line(exc)})") from None
        weight, pattern = unpack(packed), packed.shape.pattern
        perm = _channel_order(producers.get(node.input[0]), inits)
        if perm is not None:
            original = np.zeros_like(weight)
            original[perm] = weight  # packed row r is original channel perm[r]
            weight = original
        sizes = list(_attr(node, "splits", []))
        if len(sizes) < 2:
            yield node.name or node.output[0], weight, pattern, perm is not None
            continue
        if len(sizes) != len(node.output) or sum(sizes) != weight.shape[1]:
            raise ModelError(f"{node.name}: splits {sizes} do not match its {len(node.output)} outputs "
                             f"and {weight.shape[1]} columns")
        start = 0
        for output, size in zip(node.output, sizes):  # fused siblings: one entry per original output
            yield output, weight[:, start:start + size], pattern, perm is not None
            start += size


def _channel_order(producer, inits) -> np.ndarray | None:
    """The permutation of a Gather(x, perm, axis=-1) feeding the op, as prune --permute writes."""
    if producer is None or producer.op_type != "Gather" or _attr(producer, "axis", 0) != -1:
        return None
    if producer.input[1] not in inits:
        return None
    return numpy_helper.to_array(inits[producer.input[1]]).astype(np.int64)


def layer_errors(dense: onnx.ModelProto, sparse: onnx.ModelProto) -> tuple[list[LayerError], list[str]]:
    from .prune import OP_DOMAIN, OP_TYPE

    if not any(n.domain == OP_DOMAIN and n.op_type == OP_TYPE for n in sparse.graph.node):
        raise ModelError("the sparse model has no nmcli.NMMatMul nodes: nothing to compare (run nmcli prune first)")
    originals, node_of_output = {}, {}  # fused ops report each original node by its output
    for cand in find_candidates(dense, Selection(NMPattern(1, 2))):
        if cand.weight is not None:
            originals[cand.name] = cand.weight
            node_of_output[cand.node.output[0]] = cand.name
    layers, notes = [], []
    for name, pruned, pattern, permuted in stored_weights(sparse):
        if name not in originals:
            name = node_of_output.get(name, name)
        weight = originals.get(name)
        if weight is None or weight.shape != pruned.shape:
            notes.append(f"{name}: no dense node of that name and shape; its weight error is not shown")
            continue
        w64, p64 = weight.astype(np.float64), pruned.astype(np.float64)
        norm2 = float(np.sum(w64 * w64))
        layers.append(LayerError(name, *weight.shape, str(pattern),
                                 float(np.sqrt(np.sum((w64 - p64) ** 2) / norm2)) if norm2 else 0.0,
                                 float(np.sum(p64 * p64) / norm2) if norm2 else 1.0, permuted))
    return layers, notes


def looks_like_logits(model: onnx.ModelProto, name: str, value: np.ndarray) -> bool:
    """Named like logits/scores/probabilities, or produced by a softmax or a final projection."""
    if value.ndim < 1 or value.shape[-1] < 2 or value.dtype.kind != "f":
        return False
    producers = {o: n for n in model.graph.node for o in n.output}
    producer = producers.get(name)
    constants = {t.name for t in model.graph.initializer}
    if producer is not None and producer.op_type == "Add" and any(i in constants for i in producer.input):
        # a projection plus its bias (not a residual Add, whose inputs are both computed)
        producer = next((producers[i] for i in producer.input if i in producers), producer)
    return bool(LOGIT_NAME.search(name)) or (producer is not None and producer.op_type in LOGIT_PRODUCERS)


def output_agreement(dense: onnx.ModelProto, sparse: onnx.ModelProto, feeds: list[dict]) -> list[OutputAgreement]:
    from .runtime import session

    sessions = []
    for which, model in (("dense", dense), ("sparse", sparse)):
        try:
            sessions.append(session(model))
        except Exception as exc:
            raise NmcliError(f"onnxruntime cannot load the {which} model: {first_line(exc)}") from None
    names = [o.name for o in dense.graph.output]
    sparse_names = [o.name for o in sparse.graph.output]
    if names != sparse_names:
        raise NmcliError(f"the models have different outputs: {', '.join(names)} vs {', '.join(sparse_names)}")
    collected: dict[str, tuple[list, list]] = {n: ([], []) for n in names}
    for feed in feeds:
        try:
            ys = [s.run(names, feed) for s in sessions]
        except Exception as exc:
            raise NmcliError(f"running the models failed: {first_line(exc)}") from None
        for name, a, b in zip(names, *ys):
            if np.shape(a) != np.shape(b):
                raise NmcliError(f"output '{name}' has shape {np.shape(a)} dense but {np.shape(b)} sparse")
            collected[name][0].append(np.asarray(a))
            collected[name][1].append(np.asarray(b))
    return [_agreement(name, a, b, looks_like_logits(dense, name, a[0])) for name, (a, b) in collected.items()]


def _agreement(name: str, dense: list[np.ndarray], sparse: list[np.ndarray], logits: bool) -> OutputAgreement:
    width = dense[0].shape[-1] if dense[0].ndim else 1
    a = np.concatenate([x.astype(np.float64).reshape(-1, width) for x in dense])
    b = np.concatenate([x.astype(np.float64).reshape(-1, width) for x in sparse])
    norm = np.linalg.norm(a)
    rel = float(np.linalg.norm(a - b) / norm) if norm else float(np.linalg.norm(b))
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (na == 0) & (nb == 0)
    cos = np.where(both_zero, 1.0, np.einsum("ij,ij->i", a, b) / np.maximum(na * nb, 1e-300))
    top1 = float(np.mean(a.argmax(1) == b.argmax(1))) if logits else None
    return OutputAgreement(name, rel, float(cos.mean()), float(cos.min()),
                           float(np.max(np.abs(a - b))) if a.size else 0.0, len(a), top1)


def evaluate(dense: onnx.ModelProto, sparse: onnx.ModelProto, feeds: list[dict], inputs: str,
             dense_name: str = "dense", sparse_name: str = "sparse") -> EvalReport:
    layers, notes = layer_errors(dense, sparse)
    report = EvalReport(dense_name, sparse_name, len(feeds), inputs, notes=notes, layers=layers)
    report.outputs = output_agreement(dense, sparse, feeds)
    return report
