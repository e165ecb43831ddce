"""Prune constant MatMul / Gemm weights to N:M and rewrite the nodes to our custom op."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import format as nmformat
from .errors import ModelError, NmcliError
from .format import OP_DOMAIN, OP_TYPE, OP_VERSION  # noqa: F401 (re-exported)
from .fusion import fuse_neighbours, inferred_shapes
from .graph import Candidate, Selection, _attr, find_candidates, subgraph_inputs, unique_name
from .masks import CRITERIA, LayerContext, MaskCriterion, choose_offsets
from .modelio import clamp_ir_version
from .prefill_copy import add_prefill_copies, check_prefill_copy
from .report import LayerReport, PruneReport, SkipReport

MAX_OUTPUTS = 8  # outputs of one fused op: kMaxOutputParts in kernels/output_parts.h


@dataclass
class PrunedWeight:
    packed: nmformat.PackedWeight
    values_name: str
    indices_name: str
    rel_error: float
    dense_bytes: int
    perm_name: str | None = None   # int64 [K] channel order (see permute.py), None = identity
    perm: np.ndarray | None = None   # ... its values: packed row r is input channel perm[r]
    perm_gain: float = 0.0         # relative gain in kept criterion score from the order


def _moments(model, chosen, calibration) -> dict:
    """Activation name -> calibrate.Moments of the activation each pruned node multiplies."""
    from .calibrate import activation_of, channel_moments

    return channel_moments(model, dict(activation_of(c) for c in chosen), calibration)


def _channel_norms(chosen, moments) -> dict:
    """||X_k|| per pruned weight; a weight shared by several nodes sees all their inputs."""
    from .calibrate import activation_of

    norms = {}
    for cand in chosen:
        sq = moments[activation_of(cand)[0]].sq_sums
        if sq.shape[0] != cand.weight.shape[0]:
            raise NmcliError(f"{cand.name}: calibration activation has {sq.shape[0]} channels, weight K is "
                             f"{cand.weight.shape[0]}")
        norms[cand.weight_key] = norms.get(cand.weight_key, 0) + sq
    return {key: np.sqrt(value) for key, value in norms.items()}


def _compensated(model, chosen, first_node, calibration, pattern, orders) -> dict:
    """weight key -> (packed, rel. error) pruned by SparseGPT (obs.py) on the gram of the
    activations it multiplies, in the channel order chosen for the weight. Grams come a few at
    a time (calibrate.gram_passes) and each weight is solved as soon as its grams are in."""
    from .calibrate import activation_of, gram_passes

    keys_of: dict[str, list] = {}          # activation -> weights it feeds
    for cand in chosen:
        keys = keys_of.setdefault(activation_of(cand)[0], [])
        if cand.weight_key not in keys:
            keys.append(cand.weight_key)
    pending = {key: sum(key in keys for keys in keys_of.values()) for key in first_node}
    axes = {name: activation_of(first_node[keys[0]])[1] for name, keys in keys_of.items()}
    channels = {name: first_node[keys[0]].weight.shape[0] for name, keys in keys_of.items()}
    sums: dict = {}
    solved = {}
    for grams in gram_passes(model, axes, channels, calibration):
        for name, gram in grams.items():
            for key in keys_of[name]:       # a weight shared by several nodes sees all their inputs
                sums[key] = sums.get(key, 0) + gram
                pending[key] -= 1
                if pending[key] == 0:
                    solved[key] = _solve(first_node[key].weight, sums.pop(key), pattern, orders.get(key))
    return solved


def _solve(weight, gram, pattern, order) -> tuple[nmformat.PackedWeight, float]:
    from .obs import sparsegpt

    if gram.shape[0] != weight.shape[0]:
        raise NmcliError(f"calibration activation has {gram.shape[0]} channels, weight K is {weight.shape[0]}")
    if order is not None:
        perm = order[1]
        weight, gram = weight[perm], gram[np.ix_(perm, perm)]
    keep, compensated = sparsegpt(weight, gram, pattern)
    offsets = choose_offsets(keep.astype(np.float64), pattern)
    packed = nmformat.pack(compensated.astype(weight.dtype), offsets, pattern)
    return packed, _rel_error(weight, packed)


def get_criterion(method: str) -> MaskCriterion:
    try:
        return CRITERIA[method]()
    except KeyError:
        raise NmcliError(f"unknown pruning method '{method}' (choose from: {', '.join(CRITERIA)})") from None


def check_vector(vector: int, criterion: MaskCriterion | None = None) -> None:
    """Refuse a vector width masks.choose_offsets cannot honour, or that `criterion` cannot
    (checked before any calibration pass)."""
    if vector < 0 or vector == 1:
        raise NmcliError(f"--vector must be 0 (element-wise) or at least 2, got {vector}")
    if vector and getattr(criterion, "needs_gram", False):
        raise NmcliError(f"--vector is not supported with --method {criterion.name}: its error compensation "
                         "chooses positions column by column (use magnitude or wanda)")


def prune_weight(weight: np.ndarray, pattern: nmformat.NMPattern, scores: np.ndarray, vector: int = 0
                 ) -> tuple[nmformat.PackedWeight, float]:
    """Pack one weight [K, Nout] keeping the top scores (shared by blocks of `vector` columns
    when > 1); returns it and ||W - W'|| / ||W||."""
    offsets = choose_offsets(scores, pattern, vector)
    packed = nmformat.pack(weight, offsets, pattern)
    return packed, _rel_error(weight, packed)


def _bias_correction(cand: Candidate, entry: PrunedWeight, moments: dict) -> np.ndarray:
    """alpha * mean(X) @ (W - W'), float64 [Nout]: how much pruning moved the mean of the node's
    output over the calibration rows. Added to the op's bias, it puts that mean back (exactly,
    on the calibration data); the weights are left as pruned."""
    from .calibrate import activation_of

    mean = moments[activation_of(cand)[0]].means
    kept = nmformat.unpack(entry.packed)              # rows in packed order: channel perm[r]
    packed_mean = mean if entry.perm is None else mean[entry.perm]
    alpha = float(_attr(cand.node, "alpha", 1.0)) if cand.node.op_type == "Gemm" else 1.0
    return alpha * (mean @ cand.weight.astype(np.float64) - packed_mean @ kept.astype(np.float64))


def _rel_error(weight: np.ndarray, packed: nmformat.PackedWeight) -> float:
    dense = weight.astype(np.float64)
    norm = np.linalg.norm(dense)
    return float(np.linalg.norm(dense - nmformat.unpack(packed).astype(np.float64)) / norm) if norm else 0.0


def prune_model(model: onnx.ModelProto, selection: Selection, method: str = "magnitude",
                criterion: MaskCriterion | None = None, calibration: list[dict] | None = None,
                permute: bool = False, fuse: bool = True, bias_correct: bool = False, vector: int = 0,
                prefill_copy: bool = False) -> tuple[onnx.ModelProto, PruneReport]:
    """Return a pruned copy of `model` (the input is not modified) and the per-layer report.

    `calibration`: input feeds (one dict per sample) for activation-aware criteria.
    `permute`: reorder input channels before grouping where that keeps more of the criterion
    score (permute.py); the pruned node then reads its activation through a Gather.
    `fuse`: MatMuls that read the same activation become one op with one output each (_sibling_groups),
    and residual adds, gated activations and RMSNorms next to an op move into it (fusion.py).
    `bias_correct`: each op's bias also gets `_bias_correction`, from the calibration means
    (any method; needs `calibration`).
    `vector` > 1: vector-wise N:M (masks.choose_offsets): aligned blocks of that many output
    columns keep the same positions, and the op node says so (attribute `vector`,
    docs/FORMAT.md) where its blocks line up with the op's columns.
    `prefill_copy`: fp16/bf16 ops also get their weight packed as 2:4 (prefill_copy.py), which
    the GPU's sparse tensor cores read instead of regrouping 1:4, 2:8 or 1:8 on every call."""
    criterion = criterion or get_criterion(method)
    check_vector(vector, criterion)
    if prefill_copy:
        check_prefill_copy(selection.pattern)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    candidates = find_candidates(out, selection)
    chosen = [c for c in candidates if c.weight is not None]
    report = PruneReport(pattern=str(selection.pattern), method=criterion.name, vector=vector,
                         skipped=[SkipReport(c.name, c.weight_name, c.skip_reason) for c in candidates if c.weight is None])
    if not chosen:
        why = "no MatMul/Gemm nodes" if not candidates else "no MatMul/Gemm node with a prunable constant weight"
        raise ModelError(f"nothing to prune: {why}" + _skip_summary(report))

    if prefill_copy and all(c.weight.dtype == np.float32 for c in chosen):
        raise NmcliError("--prefill-copy: the sparse tensor cores take float16 and bfloat16 weights, and every "
                         "weight to prune here is float32")

    graph = out.graph
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}

    calibrated, needs_gram = getattr(criterion, "needs_calibration", False), getattr(criterion, "needs_gram", False)
    if calibrated and not calibration:
        raise NmcliError("this pruning method needs calibration inputs")
    if bias_correct and not calibration:
        raise NmcliError("bias correction needs calibration inputs")
    # SparseGPT reads the grams; it needs the norms only to rank channel orders.
    needs_norms = calibrated and (permute or not needs_gram)
    moments = _moments(model, chosen, calibration) if needs_norms or bias_correct else {}
    norms = _channel_norms(chosen, moments) if needs_norms else {}
    first_node = {c.weight_key: c for c in reversed(chosen)}  # first node of each weight wins

    def score_of(key) -> np.ndarray:
        """Criterion scores of one weight, computed when needed: float64 copies of every weight
        at once would not fit in memory for large models."""
        c = first_node[key]
        return criterion.scores(c.weight, LayerContext(node_name=c.name, weight_name=c.weight_name,
                                                       input_channel_norms=norms.get(key)))

    if permute and _default_opset(out) < 11:
        raise ModelError("--permute needs opset 11 or later (it adds Gather nodes with axis=-1); "
                         f"the model uses opset {_default_opset(out)}")
    orders = _channel_orders(chosen, score_of, selection.pattern, graph, taken) if permute else {}
    solved = _compensated(model, chosen, first_node, calibration, selection.pattern, orders) if needs_gram else {}
    pruned: dict[tuple[str, bool], PrunedWeight] = {}
    for cand in chosen:
        key = cand.weight_key
        if key in pruned:
            continue
        perm_name, perm, gain = orders.get(key, (None, None, 0.0))
        if key in solved:
            packed, rel_error = solved.pop(key)
        else:
            weight, score = cand.weight, score_of(key)
            if perm is not None:
                weight, score = weight[perm], score[perm]
            packed, rel_error = prune_weight(weight, selection.pattern, score, vector)
            del score
        base = cand.weight_name + (".T" if key[1] else "")
        entry = PrunedWeight(packed, unique_name(base + ".nm_values", taken), unique_name(base + ".nm_indices", taken),
                             rel_error, cand.weight.nbytes, perm_name, perm, gain)
        graph.initializer.extend([numpy_helper.from_array(packed.values, entry.values_name),
                                  numpy_helper.from_array(packed.indices, entry.indices_name)])
        pruned[key] = entry

    # Per node, not per weight: nodes that share a weight may multiply different activations.
    corrections = {id(c.node): _bias_correction(c, pruned[c.weight_key], moments) for c in chosen} if bias_correct else {}
    report.bias_corrected = len(corrections)
    sharing = {key: sum(c.weight_key == key for c in chosen) for key in pruned}
    gathers: dict[tuple[str, str], str] = {}
    group_of = {id(c.node): group for group in (_sibling_groups(chosen, pruned, sharing) if fuse else [])
                for c in group}
    replacements = {}
    for cand in chosen:  # in graph order, so a shared Gather is emitted before its first reader
        group = group_of.get(id(cand.node))
        if group is None:
            replacements[id(cand.node)] = _rewrite_node(cand, pruned[cand.weight_key], graph, taken, gathers,
                                                        corrections.get(id(cand.node)), vector)
        elif cand is group[0]:
            parts = [corrections[id(c.node)] for c in group] if corrections else None
            replacements.update(_fuse(group, [pruned[c.weight_key] for c in group], graph, taken, gathers,
                                      None if parts is None else np.concatenate(parts), vector))
    new_nodes = []
    for node in graph.node:
        new_nodes.extend(replacements.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(new_nodes)
    if fuse:
        report.fused = fuse_neighbours(graph, inferred_shapes(model))
    _remove_dead(graph, [n for c in chosen for n in c.chain])
    if prefill_copy:
        report.prefill_copy_bytes = add_prefill_copies(graph, taken)

    if not any(o.domain == OP_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(OP_DOMAIN, OP_VERSION))
    clamp_ir_version(out)

    for cand in chosen:
        entry = pruned[cand.weight_key]
        k, nout = cand.shape
        report.layers.append(LayerReport(
            node=cand.name, op_type=cand.node.op_type, weight=cand.weight_name, k=k, nout=nout,
            dtype=str(cand.weight.dtype), rel_error=entry.rel_error, bytes_before=entry.dense_bytes,
            bytes_after=entry.packed.nbytes, shared_by=sharing[cand.weight_key],
            permuted=entry.perm_name is not None, perm_gain=entry.perm_gain))
    return out, report


def _channel_orders(chosen: list[Candidate], score_of, pattern: nmformat.NMPattern, graph: onnx.GraphProto,
                    taken: set[str]) -> dict:
    """weight key -> (perm initializer name, perm, gain) for weights whose order is worth it.

    Weights that read the same activation must share one order (one Gather feeds them all),
    and so must nodes that share a weight: the groups are the connected components of the
    activation-weight graph. Each weight's scores are normalised so every weight counts
    alike in its group's search."""
    from .calibrate import activation_of
    from .permute import find_permutation

    parent: dict = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for cand in chosen:
        parent[root(("act", activation_of(cand)))] = root(("w", cand.weight_key))
    components: dict = {}
    for cand in chosen:
        keys = components.setdefault(root(("w", cand.weight_key)), [])
        if cand.weight_key not in keys:
            keys.append(cand.weight_key)
    orders = {}
    for keys in components.values():
        joint = np.concatenate([_normalised(score_of(k)) for k in keys], axis=1)
        result = find_permutation(joint, pattern)
        del joint
        if not result.improves:
            continue
        name = unique_name(keys[0][0] + ".nm_perm", taken)
        graph.initializer.append(numpy_helper.from_array(result.perm, name))
        for k in keys:
            orders[k] = (name, result.perm, result.gain)
    return orders


def _normalised(scores: np.ndarray) -> np.ndarray:
    return scores / max(float(scores.sum()), 1e-300)


def _rewrite_node(cand: Candidate, entry: PrunedWeight, graph: onnx.GraphProto, taken: set[str],
                  gathers: dict[tuple[str, str], str], correction: np.ndarray | None = None,
                  vector: int = 0) -> list[onnx.NodeProto]:
    """The op node (plus a Transpose for Gemm transA, a Gather for a channel order, bias nodes).

    `gathers` (activation, perm) -> gathered name lets nodes that read the same activation in
    the same order share one Gather. `correction` [Nout] is added to the op's bias."""
    node, shape = cand.node, entry.packed.shape
    attrs = dict(n=shape.pattern.n, m=shape.pattern.m, k=shape.k)
    if vector > 1:
        attrs["vector"] = vector
    inputs = [node.input[0], entry.values_name, entry.indices_name]
    pre, post = [], []
    output = node.output[0]
    bias = correction
    if node.op_type == "Gemm":
        if _attr(node, "transA", 0):
            transposed = unique_name(output + ".nm_At", taken)
            pre.append(helper.make_node("Transpose", [node.input[0]], [transposed], name=transposed))
            inputs[0] = transposed
        alpha = float(_attr(node, "alpha", 1.0))
        if alpha != 1.0:
            attrs["alpha"] = alpha
        gemm_bias, post, product = _gemm_bias(node, cand, graph, taken)
        if gemm_bias is not None:
            bias = gemm_bias if bias is None else gemm_bias + bias
        if product is not None:
            output = product
    if bias is not None:
        inputs.append(_bias_initializer(bias, cand.weight.dtype, cand.name + ".nm_bias", graph, taken))
    inputs[0] = _in_channel_order(inputs[0], entry.perm_name, taken, gathers, pre)
    core = helper.make_node(OP_TYPE, inputs, [output], name=node.name or output, domain=OP_DOMAIN, **attrs)
    return pre + [core] + post


def _sibling_groups(chosen: list[Candidate], pruned: dict, sharing: dict) -> list[list[Candidate]]:
    """MatMuls that read the same activation (Q, K and V; gate and up), in graph order.

    One op over the concatenated weight replaces them: at decode sizes each call pays a fixed
    start and drain cost, and a wider weight keeps more of the GPU busy. Only plain MatMuls
    whose weight no other node uses are fused (their packed rows are concatenated as is), at
    most MAX_OUTPUTS to an op."""
    groups: dict[tuple, list[Candidate]] = {}
    for cand in chosen:
        entry = pruned[cand.weight_key]
        if cand.node.op_type == "MatMul" and sharing[cand.weight_key] == 1:
            key = (cand.node.input[0], entry.perm_name, entry.packed.shape.k, entry.packed.values.dtype.str)
            groups.setdefault(key, []).append(cand)
    chunks = [group[i:i + MAX_OUTPUTS] for group in groups.values() for i in range(0, len(group), MAX_OUTPUTS)]
    return [chunk for chunk in chunks if len(chunk) > 1]


def _fuse(group: list[Candidate], entries: list[PrunedWeight], graph: onnx.GraphProto, taken: set[str],
          gathers: dict, correction: np.ndarray | None = None, vector: int = 0) -> dict[int, list[onnx.NodeProto]]:
    """Node replacements for one sibling group: the first node becomes one op on the
    concatenated weight that writes every original output itself (attribute `splits`: the
    columns of each), the others go. The packed format stores one row per output column, so
    concatenating rows is exact, and no Split has to copy the parts apart afterwards. Each
    part's vector blocks start at its first column: they stay aligned blocks of the op's
    columns when every part but the last is a whole number of blocks."""
    shape = entries[0].packed.shape
    sizes = [e.packed.shape.nout for e in entries]
    shared = {"vector": vector} if vector > 1 and all(size % vector == 0 for size in sizes[:-1]) else {}
    values = np.concatenate([e.packed.values for e in entries])
    indices = np.concatenate([e.packed.indices for e in entries])
    base = unique_name("+".join(c.weight_name for c in group)[:200] + ".nm_fused", taken)
    values_name, indices_name = unique_name(base + "_values", taken), unique_name(base + "_indices", taken)
    graph.initializer.extend([numpy_helper.from_array(values, values_name),
                              numpy_helper.from_array(indices, indices_name)])
    pre = []
    activation = _in_channel_order(group[0].node.input[0], entries[0].perm_name, taken, gathers, pre)
    inputs = [activation, values_name, indices_name]
    if correction is not None:  # the parts' corrections, concatenated as the columns are
        inputs.append(_bias_initializer(correction, values.dtype, base + "_bias", graph, taken))
    core = helper.make_node(OP_TYPE, inputs, [c.node.output[0] for c in group],
                            name="+".join(c.name for c in group), domain=OP_DOMAIN, n=shape.pattern.n,
                            m=shape.pattern.m, k=shape.k, splits=sizes, **shared)
    replaced = {id(c.node): [] for c in group[1:]}
    replaced[id(group[0].node)] = pre + [core]
    return replaced


def _in_channel_order(activation: str, perm_name: str | None, taken: set[str], gathers: dict,
                      pre: list[onnx.NodeProto]) -> str:
    """The activation as the op must read it: through a Gather when the weight's input
    channels were reordered (x[..., perm] @ W[perm] == x @ W). Nodes reading the same
    activation in the same order share one Gather (`gathers`)."""
    if perm_name is None:
        return activation
    key = (activation, perm_name)
    if key not in gathers:
        gathers[key] = unique_name(activation + ".nm_permuted", taken)
        pre.append(helper.make_node("Gather", [activation, perm_name], [gathers[key]], name=gathers[key], axis=-1))
    return gathers[key]


def _bias_initializer(bias: np.ndarray, dtype, base: str, graph: onnx.GraphProto, taken: set[str]) -> str:
    name = unique_name(base, taken)
    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(bias.astype(dtype)), name))
    return name


def _gemm_bias(node, cand: Candidate, graph, taken):
    """beta * C: a per-column bias when C is a constant vector, else nodes after the op.

    Returns (bias [Nout] float64 or None, nodes to append, name for the op's own output or None).
    """
    if len(node.input) < 3 or not node.input[2] or float(_attr(node, "beta", 1.0)) == 0.0:
        return None, [], None
    beta = float(_attr(node, "beta", 1.0))
    nout, dtype, c_name = cand.shape[1], cand.weight.dtype, node.input[2]
    init = {t.name: t for t in graph.initializer}.get(c_name)
    if init is not None and c_name not in {i.name for i in graph.input}:
        c = numpy_helper.to_array(init)
        if c.size in (1, nout) and all(d == 1 for d in c.shape[:-1]):
            return np.broadcast_to((beta * c.astype(np.float64)).reshape(-1), (nout,)), [], None
    # General C (a full matrix or a run-time tensor): Y = (A @ W) + beta * C, output name kept.
    product = unique_name(node.output[0] + ".nm_product", taken)
    nodes, addend = [], c_name
    if beta != 1.0:
        beta_name = unique_name(cand.name + ".nm_beta", taken)
        graph.initializer.append(numpy_helper.from_array(np.array(beta, dtype=dtype), beta_name))
        addend = unique_name(cand.name + ".nm_beta_c", taken)
        nodes.append(helper.make_node("Mul", [c_name, beta_name], [addend], name=addend))
    nodes.append(helper.make_node("Add", [product, addend], [node.output[0]], name=node.output[0] + ".nm_add"))
    return None, nodes, product


def _remove_dead(graph: onnx.GraphProto, chain_nodes: list[onnx.NodeProto]) -> None:
    """Drop folded Transpose/Cast/Constant nodes and initializers nothing reads any more."""
    removable = {tuple(n.output) for n in chain_nodes}  # by outputs: node protos are copied around
    while True:
        used = _used_names(graph)
        dead = [i for i, n in enumerate(graph.node) if tuple(n.output) in removable and not used & set(n.output)]
        if not dead:
            break
        for i in reversed(dead):
            del graph.node[i]
    used = _used_names(graph)
    live = [t for t in graph.initializer if t.name in used]
    if len(live) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(live)


def _used_names(graph: onnx.GraphProto) -> set[str]:
    names = {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
        names.update(subgraph_inputs(node))
    return names


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _skip_summary(report: PruneReport) -> str:
    if not report.skipped:
        return ""
    reasons = sorted({s.reason for s in report.skipped})
    return f" ({'; '.join(reasons[:3])})"
