"""N:M pruning with error compensation (SparseGPT; Frantar & Alistarh, 2023).

Wanda and magnitude only choose which weights to drop. SparseGPT also updates the weights it
keeps so that the layer's output on the calibration activations moves as little as possible:
for X the calibration rows feeding the layer, it minimises ||X W - X W'||^2 with W' N:M sparse.
It walks K in order; dropping weight w_k of a column costs w_k^2 / [H^-1]_kk (H = X^T X) and
is compensated by moving the column's not-yet-visited weights along row k of the Cholesky
factor of H^-1 (optimal brain surgeon, one column at a time, batched in blocks of K).

Layout here is nmcli's: W [K, Nout], groups of M along K, every output column independent.
"""
from __future__ import annotations

import numpy as np

from .format import NMPattern

BLOCK = 128  # K positions updated lazily together (a multiple of M is used; see _block)


def sparsegpt(weight: np.ndarray, gram: np.ndarray, pattern: NMPattern, damp: float = 0.01
              ) -> tuple[np.ndarray, np.ndarray]:
    """Keep-mask [K, Nout] (exactly N per full group, min(N, size) per partial one) and the
    compensated weight [K, Nout] float64 (zero where dropped).

    `gram`: X^T X [K, K] over the calibration rows. `damp` * mean(diag) is added to its diagonal
    so that it is invertible when there are fewer calibration rows than channels; channels that
    were never active get a unit diagonal (their weights are judged by magnitude alone)."""
    k, nout = weight.shape
    if gram.shape != (k, k):
        raise ValueError(f"gram is {gram.shape}, weight K is {k}")
    h = np.array(gram, dtype=np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    # Upper Cholesky factor of H^-1: row i holds the compensation direction for position i
    # given that positions < i are already fixed.
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T
    w = weight.astype(np.float64).T.copy()          # [Nout, K]: one row per output column
    keep = np.zeros_like(w, dtype=bool)
    block = _block(pattern.m)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, hb = w[:, b0:b1].copy(), hinv[b0:b1, b0:b1]
        errors = np.zeros_like(wb)
        for i in range(b1 - b0):
            if (b0 + i) % pattern.m == 0:        # a group starts: choose its kept offsets now
                size = min(pattern.m, b1 - b0 - i)
                cost = wb[:, i:i + size] ** 2 / np.diag(hb)[i:i + size] ** 2
                top = np.argsort(-cost, axis=1, kind="stable")[:, :pattern.n]
                np.put_along_axis(keep[:, b0 + i:b0 + i + size], top, True, axis=1)
            column = wb[:, i]
            kept = np.where(keep[:, b0 + i], column, 0.0)
            err = (column - kept) / hb[i, i]
            wb[:, i:] -= np.outer(err, hb[i, i:])
            wb[:, i] = kept
            errors[:, i] = err
        w[:, b0:b1] = wb
        w[:, b1:] -= errors @ hinv[b0:b1, b1:]
    return keep.T, w.T


def _block(m: int) -> int:
    """A block length that holds whole groups, so every group is chosen within one block."""
    return max(1, BLOCK // m) * m
