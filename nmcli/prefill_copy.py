"""A 2:4 copy of each pruned weight for the GPU's sparse tensor cores (`nmcli prune --prefill-copy`).

1:4, 2:8 and 1:8 weights fit the 2:4 form the sparse tensor cores take, but the CUDA op then
regroups them on every call; from 9 rows on, reading a 2:4 copy instead is faster (BENCHMARKS.md),
while decode keeps reading the sparser weight. The copy is written into the op's inputs 7 and 8
(docs/FORMAT.md, "A 2:4 copy").
"""
from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from . import format as nmformat
from .errors import NmcliError
from .graph import unique_name

COPY_VALUES = 7  # the op's input copy_values; copy_indices follows it (docs/FORMAT.md)
TENSOR_CORE_TYPES = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def check_prefill_copy(pattern: nmformat.NMPattern) -> None:
    """Refuse a pattern whose weights cannot be stored as 2:4 (before any work is done)."""
    if not nmformat.fits_two_of_four(pattern):
        why = "it is 2:4 already" if (pattern.n, pattern.m) == (2, 4) else \
            "it may keep more than 2 of 4 consecutive weights (needs N = 1, or N = 2 with M a multiple of 4)"
        raise NmcliError(f"--prefill-copy does not apply to {pattern}: {why}")


def add_prefill_copies(graph: onnx.GraphProto, taken: set[str]) -> int:
    """Give every fp16/bf16 nmcli op of `graph` whose weight fits 2:4 its 2:4 copy; returns the
    bytes added. float32 weights get none: the sparse tensor cores do not take them."""
    initializers = {t.name: t for t in graph.initializer}
    made: dict[tuple[str, str], list[str]] = {}  # nodes that share a weight share its copy
    added = 0
    for node in graph.node:
        if node.domain != nmformat.OP_DOMAIN or node.op_type != nmformat.OP_TYPE or len(node.input) > COPY_VALUES:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        pattern = nmformat.NMPattern(attrs["n"], attrs["m"])
        weight = (node.input[1], node.input[2])
        values = initializers.get(weight[0])
        if not nmformat.fits_two_of_four(pattern) or values is None or values.data_type not in TENSOR_CORE_TYPES:
            continue
        if weight not in made:
            packed = nmformat.from_arrays(numpy_helper.to_array(values), numpy_helper.to_array(initializers[weight[1]]),
                                          pattern.n, pattern.m, attrs["k"])
            copy = nmformat.two_of_four_copy(packed)
            made[weight] = [unique_name(name + ".2of4", taken) for name in weight]
            graph.initializer.extend([numpy_helper.from_array(copy.values, made[weight][0]),
                                      numpy_helper.from_array(copy.indices, made[weight][1])])
            added += copy.nbytes
        # optional inputs 3..6 the op does not use stay empty names
        node.input.extend([""] * (COPY_VALUES - len(node.input)) + made[weight])
    return added
