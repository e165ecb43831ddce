"""The packed N:M format: the one owner of the layout written down in docs/FORMAT.md.

Every other component (the C++ CPU kernel, the CUDA kernels, the tests) follows this module
and that document; kernels/nm_format.h mirrors the same constants for C++ and CUDA.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .errors import InvalidPatternError

FORMAT_VERSION = 2  # readers take padded rows of indices too (FORMAT.md)
OP_DOMAIN, OP_TYPE, OP_VERSION = "nmcli", "NMMatMul", 1  # the op that reads the format (FORMAT.md)
MAX_M = 32
ROW_ALIGN = 32  # stored entries per row are padded to a multiple of this (see FORMAT.md)
PADDED_INDEX_ROW_WORDS = 4  # padded rows of `indices` are whole 16-byte units (FORMAT.md, version 2)


@dataclass(frozen=True)
class NMPattern:
    """N kept of every M consecutive weights along the reduction dimension."""

    n: int
    m: int

    def __post_init__(self) -> None:
        if not (1 <= self.n < self.m <= MAX_M):
            raise InvalidPatternError(
                f"invalid N:M pattern {self.n}:{self.m}: need 1 <= N < M <= {MAX_M} (e.g. 2:4, 2:8, 1:4)")

    @classmethod
    def parse(cls, text: str) -> "NMPattern":
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
        if not match:
            raise InvalidPatternError(f"invalid N:M pattern '{text}': write it as N:M, e.g. 2:8")
        return cls(int(match.group(1)), int(match.group(2)))

    @property
    def index_bits(self) -> int:
        return index_bits(self.m)

    @property
    def density(self) -> float:
        return self.n / self.m

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


def index_bits(m: int) -> int:
    """B = ceil(log2 M): bits of one stored offset."""
    return max(1, (m - 1).bit_length())


@dataclass(frozen=True)
class PackedShape:
    k: int          # logical reduction length
    nout: int       # output columns
    pattern: NMPattern

    @property
    def groups(self) -> int:
        return -(-self.k // self.pattern.m)

    @property
    def stored(self) -> int:
        """Kc: entries per row that belong to groups."""
        return self.groups * self.pattern.n

    @property
    def row_len(self) -> int:
        """S: stored row length, padded to ROW_ALIGN."""
        return -(-self.stored // ROW_ALIGN) * ROW_ALIGN

    @property
    def index_words(self) -> int:
        """S*B/32: the words that hold a row's offsets (a row of `indices` as version 1 wrote it)."""
        return self.row_len * self.pattern.index_bits // 32

    @property
    def padded_index_words(self) -> int:
        """A row of `indices` padded to whole 16-byte units, as `pack` writes it (FORMAT.md, version 2)."""
        return -(-self.index_words // PADDED_INDEX_ROW_WORDS) * PADDED_INDEX_ROW_WORDS

    def accepts_index_words(self, words: int) -> bool:
        """Whether rows of `words` words are this weight's indices: unpadded or padded."""
        return words in (self.index_words, self.padded_index_words)

    def packed_bytes(self, itemsize: int) -> int:
        """Bytes of values and indices as `pack` writes them (rows of indices padded)."""
        return self.nout * (self.row_len * itemsize + self.padded_index_words * 4)


@dataclass
class PackedWeight:
    """values [Nout, S] in the weight dtype and indices uint32 [Nout, W]: W = S*B/32 rounded up to
    whole 16-byte units as `pack` writes them, or S*B/32 as version 1 did (FORMAT.md)."""

    values: np.ndarray
    indices: np.ndarray
    shape: PackedShape

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.indices.nbytes)

    def offsets(self) -> np.ndarray:
        """Decoded B-bit offsets, int64 [Nout, S]."""
        return _unpack_fields(self.indices, self.shape.row_len, self.shape.pattern.index_bits)

    def positions(self) -> np.ndarray:
        """k_j of every stored entry, int64 [Nout, S] (may be >= K for padding)."""
        n = self.shape.pattern.n
        group = np.arange(self.shape.row_len, dtype=np.int64) // n
        return group[None, :] * self.shape.pattern.m + self.offsets()


def check_offsets(keep_offsets: np.ndarray, shape: PackedShape) -> None:
    """Validate per-group offsets [Nout, G, N]: in range and strictly increasing."""
    want = (shape.nout, shape.groups, shape.pattern.n)
    if keep_offsets.shape != want:
        raise ValueError(f"offsets have shape {keep_offsets.shape}, expected {want}")
    if keep_offsets.min(initial=0) < 0 or keep_offsets.max(initial=0) >= shape.pattern.m:
        raise ValueError("offsets out of range [0, M)")
    if shape.pattern.n > 1 and not np.all(np.diff(keep_offsets, axis=-1) > 0):
        raise ValueError("offsets inside a group must be strictly increasing")


def pack(weight: np.ndarray, keep_offsets: np.ndarray, pattern: NMPattern) -> PackedWeight:
    """Pack the kept entries of a dense weight [K, Nout].

    keep_offsets [Nout, G, N]: for each output column and group, the N kept offsets in
    increasing order. Entries whose position k >= K are stored as zeros.
    """
    if weight.ndim != 2:
        raise ValueError(f"weight must be rank 2 [K, Nout], got shape {weight.shape}")
    k, nout = weight.shape
    shape = PackedShape(k, nout, pattern)
    keep_offsets = np.asarray(keep_offsets, dtype=np.int64)
    check_offsets(keep_offsets, shape)

    m, n, g = pattern.m, pattern.n, shape.groups
    padded = np.zeros((shape.groups * m, nout), dtype=weight.dtype)
    padded[:k] = weight
    by_group = padded.T.reshape(nout, g, m)
    kept = np.take_along_axis(by_group, keep_offsets, axis=-1).reshape(nout, g * n)

    values = np.zeros((nout, shape.row_len), dtype=weight.dtype)
    values[:, : g * n] = kept
    offsets = np.zeros((nout, shape.row_len), dtype=np.int64)
    offsets[:, : g * n] = keep_offsets.reshape(nout, g * n)
    indices = np.zeros((nout, shape.padded_index_words), dtype=np.uint32)
    indices[:, : shape.index_words] = _pack_fields(offsets, pattern.index_bits)
    return PackedWeight(values, indices, shape)


def with_index_words(packed: PackedWeight, words: int) -> PackedWeight:
    """The same weight with rows of indices `words` wide: `shape.index_words` (version 1's rows,
    which readers still take) or `shape.padded_index_words` (FORMAT.md, version 2)."""
    shape = packed.shape
    if not shape.accepts_index_words(words):
        raise ValueError(f"rows of indices must be {shape.index_words} or, rows padded, "
                         f"{shape.padded_index_words} words")
    indices = np.zeros((shape.nout, words), dtype=np.uint32)
    indices[:, : shape.index_words] = packed.indices[:, : shape.index_words]
    return PackedWeight(packed.values, indices, shape)


def unpack(packed: PackedWeight) -> np.ndarray:
    """The dense pruned weight [K, Nout] that the packed tensors stand for."""
    shape = packed.shape
    dense = np.zeros((shape.nout, shape.groups * shape.pattern.m + shape.pattern.m), packed.values.dtype)
    pos = packed.positions()
    rows = np.arange(shape.nout)[:, None]
    # Padding entries are zeros at k >= K; scatter them past the end and cut them off.
    pos = np.where(np.arange(shape.row_len)[None, :] < shape.stored, pos, dense.shape[1] - 1)
    dense[rows, pos] = packed.values
    return np.ascontiguousarray(dense[:, : shape.k].T)


def from_arrays(values: np.ndarray, indices: np.ndarray, n: int, m: int, k: int) -> PackedWeight:
    """Wrap stored tensors (e.g. read back from a model) after checking they fit the spec."""
    pattern = NMPattern(n, m)
    shape = PackedShape(k, values.shape[0], pattern)
    if values.shape != (shape.nout, shape.row_len):
        raise ValueError(f"values have shape {values.shape}, expected {(shape.nout, shape.row_len)}")
    if indices.ndim != 2 or indices.shape[0] != shape.nout or not shape.accepts_index_words(indices.shape[1]) \
            or indices.dtype != np.uint32:
        raise ValueError(f"indices must be uint32 {(shape.nout, shape.index_words)} (or, rows padded, "
                         f"{(shape.nout, shape.padded_index_words)}), got {indices.dtype} {indices.shape}")
    return PackedWeight(values, indices, shape)


TWO_OF_FOUR = NMPattern(2, 4)


def fits_two_of_four(pattern: NMPattern) -> bool:
    """Whether every weight of `pattern` holds at most 2 entries in each aligned block of 4
    positions, so it can be stored a second time as 2:4 (docs/FORMAT.md, "A 2:4 copy"): N = 1
    (4 consecutive positions meet at most 2 groups of M >= 2), or N = 2 with M a multiple of 4
    (each block lies in one group). 2:4 itself is excluded: its copy would be the weight again."""
    return pattern.n == 1 or (pattern.n == 2 and pattern.m % 4 == 0 and pattern.m > 4)


def two_of_four_copy(packed: PackedWeight) -> PackedWeight:
    """The same pruned weight packed as 2:4 (docs/FORMAT.md, "A 2:4 copy"): unpacks to exactly
    the dense weight `packed` does. Each block of 4 positions keeps the positions `packed` stores
    there, filled up to two with the lowest free positions (zeros)."""
    pattern = packed.shape.pattern
    if not fits_two_of_four(pattern):
        raise ValueError(f"{pattern} weights do not fit 2:4 (need N = 1, or N = 2 with M a multiple of 4 above 4)")
    k, nout = packed.shape.k, packed.shape.nout
    shape = PackedShape(k, nout, TWO_OF_FOUR)
    # The positions `packed` stores, per column: unpack's own padding rules, on a weight of ones.
    stored = np.zeros((nout, shape.groups * 4), dtype=bool)
    stored[:, :k] = unpack(PackedWeight(np.ones(packed.values.shape, bool), packed.indices, packed.shape)).T
    blocks = stored.reshape(nout, shape.groups, 4)
    if blocks.sum(axis=-1).max(initial=0) > 2:
        raise ValueError("the weight holds more than 2 entries in a block of 4")
    # Stored positions first, then the free ones, each in increasing order; keep two, sorted.
    order = np.argsort(np.where(blocks, 0, 4) + np.arange(4), axis=-1, kind="stable")[..., :2]
    return pack(unpack(packed), np.sort(order, axis=-1), TWO_OF_FOUR)


def shares_offsets(indices: np.ndarray, vector: int) -> bool:
    """Whether the rows of `indices` [Nout, words] are equal within every aligned block of
    `vector` rows: what the op's `vector` attribute promises (docs/FORMAT.md)."""
    leaders = (np.arange(indices.shape[0]) // vector) * vector
    return bool(np.array_equal(indices, indices[leaders]))


def _pack_fields(fields: np.ndarray, bits: int) -> np.ndarray:
    """[rows, S] small ints -> uint32 [rows, S*bits/32], little-endian bit strings."""
    rows, s = fields.shape
    bit_planes = (fields[:, :, None] >> np.arange(bits)) & 1            # [rows, S, bits]
    packed_bytes = np.packbits(bit_planes.reshape(rows, s * bits).astype(np.uint8), axis=1, bitorder="little")
    return np.ascontiguousarray(packed_bytes).view("<u4").astype(np.uint32, copy=False)


def _unpack_fields(words: np.ndarray, s: int, bits: int) -> np.ndarray:
    rows = words.shape[0]
    as_bytes = np.ascontiguousarray(words.astype("<u4", copy=False)).view(np.uint8)
    bit_planes = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, : s * bits].reshape(rows, s, bits)
    return (bit_planes.astype(np.int64) << np.arange(bits)).sum(axis=-1)
