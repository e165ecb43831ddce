"""NumPy float64 reference for the op, built from the packed tensors (via format.unpack)."""
from __future__ import annotations

import numpy as np

from .format import PackedWeight, unpack


def nm_matmul_reference(x: np.ndarray, packed: PackedWeight, bias: np.ndarray | None = None,
                        alpha: float = 1.0) -> np.ndarray:
    """alpha * x @ W' + bias in float64, W' the dense pruned weight the packed tensors encode."""
    y = alpha * (x.astype(np.float64) @ unpack(packed).astype(np.float64))
    if bias is not None:
        y = y + bias.astype(np.float64)
    return y


def unit_roundoff(dtype) -> float:
    """dtype: a NumPy dtype or a name ("bfloat16" has no NumPy dtype without ml_dtypes)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}[name]


def tolerance(dtype, k: int) -> float:
    """Bound for ||y - ref|| / ||ref||: the output's rounding plus fp32 accumulation over K terms."""
    return 2.0 * unit_roundoff(dtype) + 2.0 * np.sqrt(k) * 2.0**-24


def relative_error(y: np.ndarray, ref: np.ndarray) -> float:
    y = y.astype(np.float64)
    if not np.all(np.isfinite(y)):
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(y - ref) / denom) if denom else float(np.linalg.norm(y))
