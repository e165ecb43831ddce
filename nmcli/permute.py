"""Input-channel permutation before N:M grouping (Pool & Yu, NeurIPS 2021; Shfl-BW).

N:M keeps N of every M *consecutive* input channels. When two large weights of a column sit
in the same group one of them is lost; reordering the channels first can put them in
different groups. One order is shared by all output columns (it reorders whole rows of W),
so the search maximises the criterion score kept summed over every column.

The order `perm` means: packed row r holds original channel perm[r], i.e. the packed weight
is W[perm] and the activation is gathered as x[..., perm] before the op (an ONNX Gather,
see prune.py). Then x[..., perm] @ W[perm] == x @ W for any W, so the pruned model computes
exactly what the dense model with the same pruned weights computes.

Search: start from the better of identity and a striped order (channels ranked by total
score, dealt round-robin over the groups), then improve by channel swaps between groups. Each
round pairs the groups at random and, for every pair, evaluates all M*M swaps at once with a
closed form (below) and applies the best one if it gains. It stops when `patience` rounds in a
row gain nothing or after `max_rounds`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .format import NMPattern


@dataclass
class PermutationResult:
    perm: np.ndarray          # int64 [K]: packed row r is original channel perm[r]
    kept_identity: float      # criterion score kept without permutation
    kept: float               # ... with `perm`
    rounds: int

    @property
    def improves(self) -> bool:
        return self.kept > self.kept_identity * (1 + 1e-9)

    @property
    def gain(self) -> float:
        """Relative gain in kept score over the identity order."""
        return self.kept / self.kept_identity - 1 if self.kept_identity > 0 else 0.0


def kept_score(scores: np.ndarray, pattern: NMPattern) -> float:
    """Sum over columns and groups of the N largest scores: what N:M keeps of scores [K, Nout]."""
    return float(_top_n_sums(_grouped(scores, pattern), pattern.n).sum())


def find_permutation(scores: np.ndarray, pattern: NMPattern, max_rounds: int = 200, patience: int = 8,
                     max_columns: int = 512, seed: int = 0) -> PermutationResult:
    """A channel order that keeps more of `scores` [K, Nout] (>= 0) under N:M.

    The search sees at most `max_columns` output columns, drawn at random: the kept score is
    a sum over columns, so a sample ranks swaps almost as well at a fraction of the cost.
    The result is scored on all columns and never worse than the identity order."""
    full = np.asarray(scores, np.float64)
    rng = np.random.default_rng(seed)
    scores = full if full.shape[1] <= max_columns else full[:, np.sort(rng.choice(full.shape[1], max_columns, replace=False))]
    k = scores.shape[0]
    identity = np.arange(k, dtype=np.int64)
    kept_identity = kept_score(full, pattern)
    groups = -(-k // pattern.m)
    if groups < 2:
        return PermutationResult(identity, kept_identity, kept_identity, 0)
    perm = identity
    striped = _striped_order(scores, pattern)
    if kept_score(scores[striped], pattern) > kept_score(scores, pattern):
        perm = striped
    # slots[g, i]: the channel in position i of group g; -1 pads the partial last group.
    slots = np.full(groups * pattern.m, -1, dtype=np.int64)
    slots[:k] = perm
    slots = slots.reshape(groups, pattern.m)
    # The swap search runs in float32 (half the memory traffic); gains below its resolution
    # are ignored, and the result is re-scored in float64 on all columns.
    padded = np.vstack([scores / max(float(scores.max()), 1e-300), np.zeros((1, scores.shape[1]))]).astype(np.float32)
    idle, rounds = 0, 0
    while rounds < max_rounds and idle < patience:
        rounds += 1
        order = rng.permutation(groups)
        pairs = order[: groups // 2 * 2].reshape(-1, 2)
        if _swap_round(padded, slots, pairs, pattern) == 0:
            idle += 1
        else:
            idle = 0
    flat = slots.reshape(-1)
    perm = flat[flat >= 0]  # padding never moves (swaps with it are barred): it stays past K
    kept = kept_score(full[perm], pattern)
    if kept <= kept_identity:
        return PermutationResult(identity, kept_identity, kept_identity, rounds)
    return PermutationResult(perm.astype(np.int64), kept_identity, kept, rounds)


def _swap_round(padded: np.ndarray, slots: np.ndarray, pairs: np.ndarray, pattern: NMPattern,
                chunk_elems: int = 1 << 24) -> int:
    """Best swap per group pair, applied when it gains. Returns the number of swaps made."""
    n, m, nout = pattern.n, pattern.m, padded.shape[1]
    per_pair = m * m * nout
    step = max(1, chunk_elems // per_pair)
    swaps = 0
    for start in range(0, len(pairs), step):
        chunk = pairs[start:start + step]
        a, b = padded[slots[chunk[:, 0]]], padded[slots[chunk[:, 1]]]       # [P, M, Nout]
        top_a, top_b = _top_n_sums(a, n), _top_n_sums(b, n)                  # [P, Nout]
        rest_a, nth_a = _without_each_row(a, n)                              # [P, M, Nout]
        rest_b, nth_b = _without_each_row(b, n)
        # Group A with its row i swapped for B's row j keeps rest_a[i] + max(0, b[j] - nth_a[i]):
        # adding one value to a set changes its top-N sum only if it beats the N-th largest.
        new_a = rest_a[:, :, None] + np.maximum(0.0, b[:, None, :] - nth_a[:, :, None])    # [P, i, j, Nout]
        new_b = rest_b[:, None, :] + np.maximum(0.0, a[:, :, None] - nth_b[:, None, :])    # [P, i, j, Nout]
        gain = (new_a + new_b).sum(-1) - (top_a + top_b).sum(-1)[:, None, None]             # [P, i, j]
        # The format pads only the last group: a padding slot must not move.
        padding = (slots[chunk[:, 0]] < 0)[:, :, None] | (slots[chunk[:, 1]] < 0)[:, None, :]
        gain = np.where(padding, -np.inf, gain)
        best = gain.reshape(len(chunk), -1).argmax(-1)
        best_gain = gain.reshape(len(chunk), -1)[np.arange(len(chunk)), best]
        scale = (top_a + top_b).sum(-1)
        for (ga, gb), flat, g, s in zip(chunk, best, best_gain, scale):
            if g > 1e-5 * max(s, 1e-30):
                i, j = divmod(int(flat), m)
                slots[ga, i], slots[gb, j] = slots[gb, j], slots[ga, i]
                swaps += 1
    return swaps


def _without_each_row(block: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """For a group [..., M, Nout] with row i removed, for every i: its top-N sum and its N-th
    largest value, both [..., M, Nout]."""
    desc = -np.sort(-block, axis=-2)
    top = desc[..., :n, :].sum(-2, keepdims=True)
    nth, next_ = desc[..., n - 1:n, :], desc[..., n:n + 1, :]
    # A row tied with the N-th largest counts as in the top N: then next_ == nth, so both
    # branches give the same result and ties need no ranking.
    in_top = block >= nth
    rest = np.where(in_top, top - block + next_, top)
    nth_rest = np.where(in_top, next_, nth)
    return rest, nth_rest


def _top_n_sums(block: np.ndarray, n: int) -> np.ndarray:
    """Top-N sum along axis -2 of [..., M, Nout]."""
    m = block.shape[-2]
    return np.partition(block, m - n, axis=-2)[..., m - n:, :].sum(-2)


def _grouped(scores: np.ndarray, pattern: NMPattern) -> np.ndarray:
    k, nout = scores.shape
    groups = -(-k // pattern.m)
    padded = np.zeros((groups * pattern.m, nout))
    padded[:k] = scores
    return padded.reshape(groups, pattern.m, nout)


def _striped_order(scores: np.ndarray, pattern: NMPattern) -> np.ndarray:
    """Channels ranked by total score, dealt round-robin so each group gets one of each tier."""
    k = scores.shape[0]
    groups = -(-k // pattern.m)
    ranked = np.argsort(-scores.sum(axis=1), kind="stable")
    slot_of_rank = np.array([(r % groups) * pattern.m + r // groups for r in range(k)])
    # Fill slots in order; the partial last group (if any) takes what does not fit elsewhere.
    by_slot = np.full(groups * pattern.m, -1, dtype=np.int64)
    by_slot[slot_of_rank] = ranked
    return _with_padding_last(by_slot.reshape(groups, pattern.m), k)


def _with_padding_last(slots: np.ndarray, k: int) -> np.ndarray:
    """Flatten group slots to a permutation of K where padding (-1) only sits past K.

    The format pads the last group, so groups with a padding slot must come last; at most
    the padded count of slots are -1, and a group holding any is moved to the end. If the
    padding spans several groups, their real channels are packed together at the end."""
    full = [g for g in slots if (g >= 0).all()]
    partial = [g[g >= 0] for g in slots if not (g >= 0).all()]
    head = np.concatenate(full) if full else np.empty(0, np.int64)
    tail = np.concatenate(partial) if partial else np.empty(0, np.int64)
    perm = np.concatenate([head, tail]).astype(np.int64)
    assert perm.size == k
    return perm
