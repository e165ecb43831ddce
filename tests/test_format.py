import numpy as np
import pytest
from conftest import FAMILIES

from nmcli.errors import InvalidPatternError
from nmcli.format import NMPattern, PackedShape, from_arrays, index_bits, pack, unpack, with_index_words
from nmcli.masks import choose_offsets, prune_mask


@pytest.mark.parametrize("text,n,m", [("2:4", 2, 4), (" 1 : 8 ", 1, 8), ("8:32", 8, 32), ("3:7", 3, 7)])
def test_parse(text, n, m):
    assert NMPattern.parse(text) == NMPattern(n, m)


@pytest.mark.parametrize("text", ["5:4", "0:4", "4:4", "abc", "2:", "2:64", "-1:4", "2/4", ""])
def test_parse_rejects(text):
    with pytest.raises(InvalidPatternError):
        NMPattern.parse(text)


def test_index_bits():
    assert [index_bits(m) for m in (2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 2, 3, 3, 4, 4, 5, 5]


@pytest.mark.parametrize("n,m", FAMILIES + [(3, 7), (5, 6)])
@pytest.mark.parametrize("k", [1, 7, 33, 100, 256])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pack_unpack_roundtrip(rng, n, m, k, dtype):
    nout = int(rng.integers(1, 40))
    pattern = NMPattern(n, m)
    w = rng.standard_normal((k, nout)).astype(dtype)
    offsets = choose_offsets(np.abs(w), pattern)
    packed = pack(w, offsets, pattern)
    shape = packed.shape
    assert packed.values.shape == (nout, shape.row_len) and shape.row_len % 32 == 0
    words = -(-shape.row_len * pattern.index_bits // 128) * 4  # S*B/32, padded to 16-byte units
    assert packed.indices.dtype == np.uint32 and packed.indices.shape == (nout, words)
    dense = unpack(packed)
    assert dense.dtype == w.dtype and dense.shape == w.shape
    assert np.array_equal(dense, np.where(prune_mask(w, offsets, pattern), w, 0))
    # at most N nonzeros in every group of M along K, per column
    padded = np.zeros((shape.groups * m, nout)); padded[:k] = dense != 0
    assert padded.reshape(shape.groups, m, nout).sum(axis=1).max() <= n
    # padding entries are zero and point at offset 0
    assert not packed.values[:, shape.stored:].any() and not packed.offsets()[:, shape.stored:].any()
    assert np.all(packed.values[packed.positions() >= k] == 0)


def test_bit_layout_matches_spec():
    """A hand-checked example of docs/FORMAT.md: 2:8, B=3, little-endian bit strings per row."""
    pattern = NMPattern(2, 8)
    w = np.zeros((16, 1), np.float32)
    w[[1, 6, 8 + 0, 8 + 7], 0] = [1, 2, 3, 4]
    packed = pack(w, choose_offsets(np.abs(w), pattern), pattern)
    # offsets 1, 6, 0, 7 -> bits 001 110 000 111 from bit 0 upwards
    expected = 1 | (6 << 3) | (0 << 6) | (7 << 9)
    assert packed.indices[0, 0] == expected
    assert list(packed.values[0, :4]) == [1, 2, 3, 4]
    assert packed.indices.shape == (1, 4)  # S = 32 entries * 3 bits = 3 words, padded to 16 bytes
    assert packed.indices[0, 3] == 0


@pytest.mark.parametrize("n,m,fp16_bytes_per_group", [(2, 4, 4.5), (2, 8, 4.75), (1, 8, 2.375), (4, 16, 10.0)])
def test_byte_cost_in_spec(n, m, fp16_bytes_per_group):
    shape = PackedShape(k=4096 * m, nout=4, pattern=NMPattern(n, m))
    assert shape.packed_bytes(2) / (4 * shape.groups) == fp16_bytes_per_group


def test_choose_offsets_top_n_and_ties():
    pattern = NMPattern(2, 4)
    scores = np.array([[1.0], [3.0], [3.0], [2.0], [5.0], [5.0], [5.0], [0.0]])
    assert choose_offsets(scores, pattern)[0].tolist() == [[1, 2], [0, 1]]


def test_partial_last_group_keeps_zeros_past_k(rng):
    pattern = NMPattern(4, 8)
    w = rng.standard_normal((10, 3)).astype(np.float32)  # last group has 2 real positions, N=4
    packed = pack(w, choose_offsets(np.abs(w), pattern), pattern)
    assert np.array_equal(unpack(packed)[8:], w[8:])
    assert np.all(packed.values[packed.positions() >= 10] == 0)


def test_from_arrays_checks_shapes(rng):
    pattern = NMPattern(2, 8)
    w = rng.standard_normal((64, 5)).astype(np.float32)
    packed = pack(w, choose_offsets(np.abs(w), pattern), pattern)
    assert np.array_equal(unpack(from_arrays(packed.values, packed.indices, 2, 8, 64)), unpack(packed))
    with pytest.raises(ValueError):
        from_arrays(packed.values[:, :-1], packed.indices, 2, 8, 64)
    with pytest.raises(ValueError):
        from_arrays(packed.values, packed.indices.astype(np.int32), 2, 8, 64)


@pytest.mark.parametrize("n,m,k", [(2, 8, 11008), (1, 8, 11008), (1, 8, 13824), (2, 4, 4104), (3, 7, 100)])
def test_pack_pads_rows_of_indices_and_unpadded_ones_read_back_the_same(rng, n, m, k):
    """FORMAT.md version 2: pack writes rows of indices padded to whole 16-byte units (zeros past
    S*B/32); version 1's unpadded rows stand for the same weight; no other width is taken."""
    pattern = NMPattern(n, m)
    w = rng.standard_normal((k, 3)).astype(np.float16)
    packed = pack(w, choose_offsets(np.abs(w), pattern), pattern)
    shape = packed.shape
    assert shape.index_words % 4 != 0
    assert packed.indices.shape == (3, shape.padded_index_words) and shape.padded_index_words % 4 == 0
    assert not packed.indices[:, shape.index_words:].any()
    assert shape.packed_bytes(2) == packed.nbytes
    unpadded = with_index_words(packed, shape.index_words)
    assert np.array_equal(unpadded.indices, packed.indices[:, : shape.index_words])
    assert np.array_equal(unpack(from_arrays(unpadded.values, unpadded.indices, n, m, k)), unpack(packed))
    assert np.array_equal(unpack(packed), np.where(unpack(packed) != 0, w, 0))
    for words in {shape.index_words - 1, shape.index_words + 1, shape.padded_index_words + 4}:
        with pytest.raises(ValueError, match="rows padded"):
            from_arrays(packed.values, np.zeros((3, words), np.uint32), n, m, k)
        with pytest.raises(ValueError, match="rows padded"):
            with_index_words(packed, words)
