"""NumPy float64 reference for the op, built from the packed tensors (via format.unpack)."""
from __future__ import annotations

import numpy as np

from .format import PackedWeight, unpack


def dense_reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, alpha: float = 1.0,
                    residual: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(alpha * x @ w + bias + residual, |alpha| * |x| @ |w| + |bias| + |residual|) in float64.

    The second is the scale of fp32 accumulation error: cancellation can make the product
    itself tiny, but the rounding errors of its terms stay proportional to this.
    """
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    y, magnitude = alpha * (x64 @ w64), abs(alpha) * (np.abs(x64) @ np.abs(w64))
    for addend in (bias, residual):
        if addend is not None:
            y, magnitude = y + addend.astype(np.float64), magnitude + np.abs(addend.astype(np.float64))
    return y, magnitude


def gated_activation(x: np.ndarray, x_up: np.ndarray) -> np.ndarray:
    """silu(x) * x_up in float64: the activation the op reads with glu="silu" (kernels/fusion.h)."""
    x64 = x.astype(np.float64)
    return x64 / (1.0 + np.exp(-x64)) * x_up.astype(np.float64)


def nm_matmul_reference(x: np.ndarray, packed: PackedWeight, bias: np.ndarray | None = None,
                        alpha: float = 1.0) -> np.ndarray:
    """alpha * x @ W' + bias in float64, W' the dense pruned weight the packed tensors encode."""
    return dense_reference(x, unpack(packed), bias, alpha)[0]


def unit_roundoff(dtype) -> float:
    """dtype: a NumPy dtype or a name ("bfloat16" has no NumPy dtype without ml_dtypes)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}[name]


def rms_normalised(x: np.ndarray, weight: np.ndarray, epsilon: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + epsilon) * weight over the last axis, in float64: the activation the
    op reads with norm="rms" (kernels/fusion.h)."""
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + epsilon) * weight.astype(np.float64)


def error_ratio(y: np.ndarray, ref: np.ndarray, magnitude: np.ndarray, dtype, k: int,
                rounded_input: bool = False) -> float:
    """||y - ref|| over its bound, the output's rounding (2u ||ref||) plus fp32 accumulation over
    K terms (2 sqrt(K) 2^-24 ||magnitude||); below 1 passes. Non-finite output gives inf.
    `rounded_input`: the activation was computed by the op and rounded to the dtype before the
    product (a gated activation), which adds u ||magnitude||."""
    y = y.astype(np.float64)
    if not np.all(np.isfinite(y)):
        return float("inf")
    bound = 2.0 * unit_roundoff(dtype) * np.linalg.norm(ref) + 2.0 * np.sqrt(k) * 2.0**-24 * np.linalg.norm(magnitude)
    if rounded_input:
        bound += unit_roundoff(dtype) * np.linalg.norm(magnitude)
    error = np.linalg.norm(y - ref)
    return float(error / bound) if bound else (0.0 if error == 0 else float("inf"))


def relative_error(y: np.ndarray, ref: np.ndarray) -> float:
    y = y.astype(np.float64)
    if not np.all(np.isfinite(y)):
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(y - ref) / denom) if denom else float(np.linalg.norm(y))
