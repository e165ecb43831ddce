"""Which N of every M weights to keep.

A criterion scores every weight (higher = keep); `choose_offsets` turns scores into the kept
offsets of each group. Later criteria (activation-aware, permutation-aware) plug in by
implementing `MaskCriterion.scores`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .format import NMPattern


@dataclass
class LayerContext:
    """What a criterion may know about a layer besides its weight."""

    node_name: str
    weight_name: str
    input_channel_norms: np.ndarray | None = None  # ||X_k|| over calibration data, [K]
    extra: dict = field(default_factory=dict)


class MaskCriterion(Protocol):
    name: str

    def scores(self, weight: np.ndarray, layer: LayerContext) -> np.ndarray:
        """Importance of each entry of weight [K, Nout], same shape, higher = keep."""
        ...


class Magnitude:
    """|W|: the ASP / nmSPARSE baseline."""

    name = "magnitude"

    def scores(self, weight: np.ndarray, layer: LayerContext) -> np.ndarray:
        return np.abs(weight.astype(np.float64))


class Wanda:
    """|W_kj| * ||X_k|| (Sun et al., 2023): a weight matters as much as the input it multiplies.

    Within one group of M input channels of one output column the norms differ per row, so
    activation-aware choices differ from magnitude exactly where channels are unevenly scaled.
    """

    name = "wanda"
    needs_calibration = True

    def scores(self, weight: np.ndarray, layer: LayerContext) -> np.ndarray:
        if layer.input_channel_norms is None:
            raise ValueError(f"wanda needs input channel norms for {layer.node_name}")
        return np.abs(weight.astype(np.float64)) * layer.input_channel_norms.astype(np.float64)[:, None]


class SparseGPT(Wanda):
    """Wanda's choice refined with error compensation (obs.py): the kept weights are updated
    so the layer's output on the calibration data changes least. The prune step calls
    `obs.sparsegpt` with each activation's gram X^T X; `scores` (Wanda's) only rank channel
    orders for --permute."""

    name = "sparsegpt"
    needs_gram = True


CRITERIA: dict[str, type] = {"magnitude": Magnitude, "wanda": Wanda, "sparsegpt": SparseGPT}


def choose_offsets(scores: np.ndarray, pattern: NMPattern, vector: int = 0) -> np.ndarray:
    """Top-N offsets per group of M along K: scores [K, Nout] -> int64 [Nout, G, N], sorted.

    Ties go to the lower offset, so the choice is deterministic. Positions past K (the
    partial last group) score -inf and are kept only when the group has fewer than N real
    positions; the format stores zeros there.

    With `vector` > 1 the choice is vector-wise (nmSPARSE, NM-SpMM): the columns of each aligned
    block of `vector` (the last one may be narrower) keep the same positions, those with the
    highest score summed over the block.
    """
    k, nout = scores.shape
    if vector > 1:
        blocks = -(-nout // vector)
        summed = np.zeros((k, blocks * vector))
        summed[:, :nout] = scores
        offsets = choose_offsets(summed.reshape(k, blocks, vector).sum(axis=-1), pattern)
        return np.repeat(offsets, vector, axis=0)[:nout]
    groups = -(-k // pattern.m)
    padded = np.full((groups * pattern.m, nout), -np.inf)
    padded[:k] = np.nan_to_num(scores.astype(np.float64), nan=-np.inf)
    by_group = padded.T.reshape(nout, groups, pattern.m)
    order = np.argsort(-by_group, axis=-1, kind="stable")[..., : pattern.n]
    return np.sort(order, axis=-1)


def prune_mask(weight: np.ndarray, offsets: np.ndarray, pattern: NMPattern) -> np.ndarray:
    """Boolean mask [K, Nout] with True where a weight is kept."""
    k, nout = weight.shape
    groups = offsets.shape[1]
    mask = np.zeros((nout, groups, pattern.m), dtype=bool)
    np.put_along_axis(mask, offsets, True, axis=-1)
    return mask.reshape(nout, groups * pattern.m)[:, :k].T
