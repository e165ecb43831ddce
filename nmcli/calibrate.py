"""Calibration for activation-aware pruning: per input channel, ||X_k|| (wanda) and the mean
(bias correction) over calibration data for the activation that feeds each prunable node, or
its whole gram X^T X (sparsegpt).

The activations are read by running a temporary copy of the model in onnxruntime (CPU) with
those tensors added as graph outputs; the user's model is never changed. Only running sums are
kept, so memory does not grow with the number of samples.
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass

import numpy as np
import onnx

from .errors import NmcliError, first_line
from .graph import Candidate, _attr
from .inputs import InputSpec, random_feeds, resolve_shapes


def activation_of(cand: Candidate) -> tuple[str, int]:
    """(tensor, channel axis) of the activation that meets the weight's K dimension."""
    if cand.node.op_type == "Gemm" and _attr(cand.node, "transA", 0) == 1:
        return cand.node.input[0], 0
    return cand.node.input[0], -1


def load_calibration(path, specs: list[InputSpec]) -> list[dict]:
    """`inputs.npz`: one array per model input, samples stacked on a leading axis."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise NmcliError(f"--calib {path}: no such file") from None
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise NmcliError(f"--calib {path}: not a readable .npz file ({exc})") from None
    names = {s.name for s in specs}
    if set(arrays) != names:
        missing, extra = sorted(names - set(arrays)), sorted(set(arrays) - names)
        raise NmcliError(f"--calib {path}: arrays must be named after the model inputs "
                         f"(missing: {', '.join(missing) or '-'}; unknown: {', '.join(extra) or '-'})")
    counts = {len(a) if a.ndim else 0 for a in arrays.values()}
    if len(counts) != 1 or 0 in counts:
        raise NmcliError(f"--calib {path}: every array needs the same number (>= 1) of samples on axis 0")
    for s in specs:
        a = arrays[s.name]
        sample = a.shape[1:]
        fixed_ok = len(sample) == len(s.dims) and all(not isinstance(d, int) or d == v for d, v in zip(s.dims, sample))
        if not fixed_ok:
            want = "x".join(str(d) if isinstance(d, int) else "?" for d in s.dims)
            raise NmcliError(f"--calib {path}: '{s.name}' samples have shape {'x'.join(map(str, sample)) or 'scalar'}, "
                             f"the model wants {want}")
        if (a.dtype.kind == "f") != (s.dtype.kind == "f"):
            raise NmcliError(f"--calib {path}: '{s.name}' is {a.dtype}, the model wants {s.dtype}")
    return [{s.name: arrays[s.name][i].astype(s.dtype, copy=False) for s in specs} for i in range(counts.pop())]


def generated_calibration(specs: list[InputSpec], samples: int, tokens: int, rng,
                          overrides: dict | None = None) -> list[dict]:
    """Random samples of batch 1 and `tokens` tokens (or the `--shape` overrides)."""
    shapes = resolve_shapes(specs, 1, tokens, overrides or {})
    return [random_feeds(specs, shapes, rng) for _ in range(samples)]


@dataclass
class Moments:
    """Per input channel k, over all calibration rows: the row count, sum of X_k and of X_k^2."""

    rows: int
    sums: np.ndarray
    sq_sums: np.ndarray

    def __add__(self, other: "Moments") -> "Moments":
        return Moments(self.rows + other.rows, self.sums + other.sums, self.sq_sums + other.sq_sums)

    @property
    def means(self) -> np.ndarray:
        return self.sums / max(self.rows, 1)


def channel_moments(model: onnx.ModelProto, activations: dict[str, int], feeds: list[dict]) -> dict[str, Moments]:
    """Moments of each activation tensor (name -> channel axis): wanda's norms, the means of
    bias correction."""
    return _accumulate(model, activations, feeds, lambda x: Moments(len(x), x.sum(0), np.einsum("rk,rk->k", x, x)))


def gram_passes(model: onnx.ModelProto, activations: dict[str, int], channels: dict[str, int],
                feeds: list[dict], budget_bytes: int = 2 << 30):
    """Yield {name: sum over calibration rows of X^T X ([K, K], float64)} for groups of the
    activations (name -> channel axis; `channels`: name -> K).

    A gram costs 8 K^2 bytes (970 MB at K = 11008): each group's grams stay under
    `budget_bytes` (one gram at least) and the caller drops a group before the next one is
    computed. More calibration runs, bounded memory."""
    batch: dict[str, int] = {}
    used = 0
    for name, axis in activations.items():
        size = 8 * channels[name] ** 2
        if batch and used + size > budget_bytes:
            yield _accumulate(model, batch, feeds, lambda x: x.T @ x)
            batch, used = {}, 0
        batch[name], used = axis, used + size
    if batch:
        yield _accumulate(model, batch, feeds, lambda x: x.T @ x)


def _accumulate(model: onnx.ModelProto, activations: dict[str, int], feeds: list[dict], statistic) -> dict:
    """Sum of statistic(X [rows, channels] float64) over the calibration feeds, per activation.

    The activations are read as extra outputs of a temporary copy of the model; only the running
    sums are kept, so memory does not grow with the number of samples."""
    from .runtime import session

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    outputs = {o.name for o in probe.graph.output}
    for name in activations:
        if name not in outputs:
            probe.graph.output.append(onnx.ValueInfoProto(name=name))
    try:
        sess = session(probe)
    except Exception as exc:
        raise NmcliError(f"onnxruntime cannot run the model for calibration: {first_line(exc)}") from None
    names = list(activations)
    sums: dict[str, np.ndarray] = {}
    for feed in feeds:
        try:
            values = sess.run(names, feed)
        except Exception as exc:
            raise NmcliError(f"calibration run failed: {first_line(exc)}") from None
        for name, value in zip(names, values):
            x = np.moveaxis(np.asarray(value, np.float64), activations[name], -1)
            stat = statistic(x.reshape(-1, x.shape[-1]))
            sums[name] = sums[name] + stat if name in sums else stat
    return sums
