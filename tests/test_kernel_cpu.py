"""The C++ CPU kernel through nmcli._kernels, against the float64 reference."""
import functools
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import FAMILIES

from nmcli import _kernels
from nmcli.format import NMPattern, pack, unpack, with_index_words
from nmcli.masks import choose_offsets
from nmcli.reference import dense_reference, error_ratio, gated_activation, rms_normalised


def packed_random(rng, k, nout, pattern, dtype):
    w = rng.standard_normal((k, nout)).astype(dtype)
    return pack(w, choose_offsets(np.abs(w), pattern), pattern)


@pytest.mark.parametrize("n,m", FAMILIES + [(3, 7)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("x_shape,k,nout", [((1, 64), 64, 1), ((5, 100), 100, 33), ((2, 3, 71), 71, 17),
                                            ((2, 2, 3, 256), 256, 64), ((33,), 33, 9),
                                            # row tiles of 4, 16 and 32 (the last one partial)
                                            ((3, 40), 40, 7), ((2, 7, 48), 48, 20), ((70, 96), 96, 40),
                                            # 32-row tiles walking K in chunks of 256 positions or
                                            # less (a partial last chunk, a partial last group),
                                            # partial last tile and column block
                                            ((40, 1000), 1000, 37), ((3, 33, 600), 600, 20),
                                            # tiles past 1 MB: blocks of 64 columns on up to 2
                                            # hardware threads (of 32 up to 4), a partial last one
                                            ((40, 6600), 6600, 300),
                                            # a 16-row tile whose K passes L1 (a whole column
                                            # at a time)
                                            ((12, 700), 700, 21),
                                            # one row: chunks of 8 entries, a partial last group,
                                            # a last chunk read from its two index words
                                            ((1, 1000), 1000, 37), ((1, 4099), 4099, 20), ((1, 1, 512), 512, 12)])
def test_matches_reference(rng, n, m, dtype, x_shape, k, nout):
    if k < m:
        pytest.skip("K < M is never pruned")
    packed = packed_random(rng, k, nout, NMPattern(n, m), dtype)
    x = rng.standard_normal(x_shape).astype(dtype)
    bias = rng.standard_normal(nout).astype(dtype) if rng.random() < 0.5 else None
    alpha = float(rng.uniform(0.5, 2.0))
    y = _kernels.nm_matmul_cpu(x, packed.values, packed.indices, bias, n=n, m=m, k=k, alpha=alpha)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha)
    assert y.shape == ref.shape and y.dtype == dtype
    assert error_ratio(y, ref, magnitude, dtype, k) < 1


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (8, 16), (8, 12), (2, 6), (1, 2), (4, 12)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("k", [40, 1000, 1012, 1003])
def test_one_row_chunk_pairs_match_reference(rng, n, m, dtype, k):
    """One activation row where two chunks of 8 entries span at most 32 positions (2:4, 4:8, 8:16,
    8:12, ...; AVX-512 reads X's window for them and permutes): an even and an odd number of
    chunks, last pairs whose window would pass K, a partial last group."""
    packed = packed_random(rng, k, 19, NMPattern(n, m), dtype)
    x = rng.standard_normal((1, k)).astype(dtype)
    y = _kernels.nm_matmul_cpu(x, packed.values, packed.indices, n=n, m=m, k=k)
    ref, magnitude = dense_reference(x, unpack(packed), None, 1.0)
    assert error_ratio(y, ref, magnitude, dtype, k) < 1


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("x_shape,k,nout,nm", [((1, 64), 64, 5, (2, 8)), ((2, 3, 71), 71, 17, (2, 4)),
                                               ((9, 130), 130, 40, (1, 8)), ((50, 700), 700, 33, (2, 8))])
@pytest.mark.parametrize("residual,glu", [(True, False), (False, True), (True, True)])
def test_fused_neighbours_match_reference(rng, dtype, x_shape, k, nout, nm, residual, glu):
    """Y = alpha * (silu(x) * x_up) @ W + bias + residual, each part optional."""
    n, m = nm
    packed = packed_random(rng, k, nout, NMPattern(n, m), dtype)
    x, x_up = (rng.standard_normal(x_shape).astype(dtype) for _ in range(2))
    bias = rng.standard_normal(nout).astype(dtype)
    r = rng.standard_normal(x_shape[:-1] + (nout,)).astype(dtype) if residual else None
    y = _kernels.nm_matmul_cpu(x, packed.values, packed.indices, bias, n=n, m=m, k=k, alpha=0.5, residual=r,
                               x_up=x_up if glu else None, glu="silu" if glu else "none")
    a = gated_activation(x, x_up) if glu else x
    ref, magnitude = dense_reference(a, unpack(packed), bias, 0.5, residual=r)
    assert y.shape == ref.shape and error_ratio(y, ref, magnitude, dtype, k) < 1


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_no_rows_gives_an_empty_output(rng, dtype):
    """An activation with no rows ([0, K], as an empty batch) gives an empty [0, Nout] output."""
    packed = packed_random(rng, 64, 9, NMPattern(2, 8), dtype)
    y = _kernels.nm_matmul_cpu(np.zeros((0, 64), dtype), packed.values, packed.indices, n=2, m=8, k=64)
    assert y.shape == (0, 9) and y.dtype == dtype


def check_fp16_rounding_at_the_edges(rows):
    """fp16 in and out across the whole fp16 range: subnormal inputs, products that round to
    subnormals, to zero, to 65504 or past it to inf, with ties among them. Each output is a single
    exact product (fp16 x fp16 fits fp32; the other weights are zeros), so the output must be its
    float32 value rounded to nearest even, bit for bit."""
    rng = np.random.default_rng(rows)
    k, nout = 64, 300

    def every_exponent(size):
        signs, fractions = rng.choice([-1.0, 1.0], size), 1 + rng.integers(0, 1024, size) / 1024
        return (signs * fractions * 2.0 ** rng.integers(-24, 16, size)).astype(np.float16)

    w = np.zeros((k, nout), np.float16)
    w[0] = every_exponent(nout)
    w[0, :4] = [1.5, -1.0009765625, 2.0**-14, 32752.0]  # ties and the largest finite fp16 among the products
    packed = pack(w, np.zeros((nout, k // 2, 1), np.int64), NMPattern(1, 2))
    x = rng.standard_normal((rows, k)).astype(np.float16)
    x[:, 0] = every_exponent(rows)
    x[0, 0] = 1.5
    if rows > 1:
        x[-1, 0] = 2.0**-24 * 3  # a subnormal input
    y = _kernels.nm_matmul_cpu(x, packed.values, packed.indices, n=1, m=2, k=k)
    with np.errstate(over="ignore"):
        expected = (x[:, :1].astype(np.float32) * w[0].astype(np.float32)).astype(np.float16)
    assert np.isinf(expected).any() and (np.abs(expected) < 2.0**-14).any() and (rows == 1 or (expected == 0).any())
    assert np.array_equal(y.view(np.uint16), expected.view(np.uint16)), rows


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_fp16_rounding_at_the_edges(rows):
    check_fp16_rounding_at_the_edges(rows)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_silu_gate_over_the_whole_float_range(rng, dtype):
    """The GLU prologue, silu(x) * x_up, on activations from -120 to 120 (past where e^-x over- and
    underflows in fp32, and past fp16's range for x * x_up where the dtype is fp16: -20 to 20),
    shuffled, 8 lanes at a time and the tail one by one: within the dtype's bound of the float64
    reference."""
    k, nout, rows = 259, 24, 20
    limit = 120.0 if dtype == np.float32 else 20.0
    x = np.linspace(-limit, limit, rows * k).astype(dtype)
    rng.shuffle(x)
    x = x.reshape(rows, k)
    x_up = rng.standard_normal((rows, k)).astype(dtype)
    packed = packed_random(rng, k, nout, NMPattern(2, 8), dtype)
    y = _kernels.nm_matmul_cpu(x, packed.values, packed.indices, n=2, m=8, k=k, x_up=x_up, glu="silu")
    ref, magnitude = dense_reference(gated_activation(x, x_up), unpack(packed))
    assert error_ratio(y, ref, magnitude, dtype, k, rounded_input=dtype != np.float32) < 1


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("x_shape,k,nout", [((1, 64), 64, 5), ((2, 3, 71), 71, 17), ((9, 130), 130, 40),
                                            ((36, 520), 520, 20)])
def test_rms_norm_prologue_matches_reference(rng, dtype, x_shape, k, nout):
    packed = packed_random(rng, k, nout, NMPattern(2, 8), dtype)
    x = (4 * rng.standard_normal(x_shape)).astype(dtype)
    gamma = (1 + 0.3 * rng.standard_normal(k)).astype(dtype)
    r = rng.standard_normal(x_shape[:-1] + (nout,)).astype(dtype)
    y = _kernels.nm_matmul_cpu(x, packed.values, packed.indices, n=2, m=8, k=k, residual=r, norm_weight=gamma,
                               norm_epsilon=1e-5)
    ref, magnitude = dense_reference(rms_normalised(x, gamma, 1e-5), unpack(packed), residual=r)
    assert error_ratio(y, ref, magnitude, dtype, k, rounded_input=True) < 1


def test_fused_neighbours_reject_bad_inputs(rng):
    packed = packed_random(rng, 64, 8, NMPattern(2, 8), np.float32)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    call = dict(n=2, m=8, k=64)
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        _kernels.nm_matmul_cpu(x, packed.values, packed.indices, residual=np.ones((2, 7), np.float32), **call)
    with pytest.raises(ValueError, match="x_up must have x's shape"):
        _kernels.nm_matmul_cpu(x, packed.values, packed.indices, x_up=x[:1], glu="silu", **call)
    with pytest.raises(ValueError, match="x_up goes with glu"):
        _kernels.nm_matmul_cpu(x, packed.values, packed.indices, x_up=x, **call)
    with pytest.raises(ValueError, match="glu must be"):
        _kernels.nm_matmul_cpu(x, packed.values, packed.indices, x_up=x, glu="gelu", **call)
    with pytest.raises(ValueError, match="norm_weight must be"):
        _kernels.nm_matmul_cpu(x, packed.values, packed.indices, norm_weight=np.ones(63, np.float32), **call)
    with pytest.raises(ValueError, match="exclude each other"):
        _kernels.nm_matmul_cpu(x, packed.values, packed.indices, x_up=x, glu="silu", norm_weight=np.ones(64, np.float32),
                               **call)


@pytest.mark.parametrize("switch", ["NMCLI_CPU_BASELINE", "NMCLI_CPU_NO_AVX512"])
def test_narrower_vectors_match_reference(tmp_path, switch):
    """NMCLI_CPU_BASELINE=1 keeps the portable code (4-lane row tiles, the decoded 1-row dot) on
    CPUs with AVX2 too, NMCLI_CPU_NO_AVX512=1 the 8-lane code on CPUs with AVX-512; each must
    agree with the reference as the default path does (own process: the choice is made once)."""
    script = """
import numpy as np
from nmcli import _kernels
from nmcli.format import NMPattern, pack, unpack
from nmcli.masks import choose_offsets
from nmcli.reference import dense_reference, error_ratio
rng = np.random.default_rng(7)
for rows, k, nout, (n, m) in [(3, 40, 7, (2, 8)), (9, 130, 40, (1, 8)), (16, 64, 9, (2, 4)), (70, 96, 40, (4, 16)),
                              (1, 1000, 37, (2, 8)), (1, 4099, 20, (4, 16)), (40, 1000, 37, (2, 8)),
                              (66, 700, 20, (1, 4)), (16, 1100, 20, (2, 8)), (40, 6600, 300, (2, 8)),
                              (1, 1012, 20, (2, 4)), (1, 1003, 20, (8, 12))]:
    for dtype in (np.float32, np.float16):
        w = rng.standard_normal((k, nout)).astype(dtype)
        packed = pack(w, choose_offsets(np.abs(w), NMPattern(n, m)), NMPattern(n, m))
        x = rng.standard_normal((rows, k)).astype(dtype)
        y = _kernels.nm_matmul_cpu(x, packed.values, packed.indices, n=n, m=m, k=k, alpha=0.5)
        ref, magnitude = dense_reference(x, unpack(packed), None, 0.5)
        assert error_ratio(y, ref, magnitude, dtype, k) < 1, (rows, k, nout, n, m, dtype)
sys.path.insert(0, TESTS)
from test_kernel_cpu import check_fp16_rounding_at_the_edges
for rows in (1, 5, 40):
    check_fp16_rounding_at_the_edges(rows)
print("ok")
"""
    env = dict(os.environ, **{switch: "1"})
    script = f"import sys\nTESTS = {os.path.dirname(__file__)!r}\n" + script
    # Run outside the checkout, so the installed package (with its built module) is imported.
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("n,m,k", [(2, 8, 11008), (1, 8, 200), (2, 4, 4104), (3, 7, 100), (1, 4, 40)])
@pytest.mark.parametrize("rows", [1, 5])
def test_padded_rows_of_indices_give_the_same_products(rng, n, m, k, rows):
    """Rows of indices padded to 16-byte units, as pack writes them (docs/FORMAT.md version 2), give
    exactly the products of version 1's unpadded rows; both within fp16's bound of the float64
    reference."""
    padded = packed_random(rng, k, 9, NMPattern(n, m), np.float16)
    unpadded = with_index_words(padded, padded.shape.index_words)
    assert padded.indices.shape[1] > unpadded.indices.shape[1]
    x = rng.standard_normal((rows, k)).astype(np.float16)
    y = _kernels.nm_matmul_cpu(x, padded.values, padded.indices, n=n, m=m, k=k)
    assert np.array_equal(_kernels.nm_matmul_cpu(x, unpadded.values, unpadded.indices, n=n, m=m, k=k), y)
    ref, magnitude = dense_reference(x, unpack(padded), None, 1.0)
    assert error_ratio(y, ref, magnitude, np.float16, k) < 1


def test_cpp_follows_the_same_format_version():
    """kernels/nm_format.h mirrors nmcli/format.py: one version of docs/FORMAT.md for both."""
    import nmcli.format
    assert _kernels.FORMAT_VERSION == nmcli.format.FORMAT_VERSION == 2


def test_cuda_binding_checks_rows_of_indices():
    """The CUDA binding takes rows of indices of S*B/32 words or padded to 16-byte units, for the
    weight and for its 2:4 copy, and refuses any other width before it touches a device."""
    if not getattr(_kernels, "HAS_CUDA", False):
        pytest.skip("built without CUDA")
    call = dict(x=0, values=0, indices=0, bias=0, y=0, rows=1, n=2, m=8, k=104, nout=24, dtype="float16")
    with pytest.raises(ValueError, match="index_words must be 3 or, rows padded, 4"):
        _kernels.nm_matmul_cuda(**call, index_words=5)
    with pytest.raises(ValueError, match=r"copy_index_words must be 4 \(docs"):  # S4 / 16 = 4: already whole units
        _kernels.nm_matmul_cuda(**call, copy_index_words=3)
    with pytest.raises(ValueError, match="index_words must be 3 or, rows padded, 4"):
        _kernels.cuda_two_of_four_copy(0, 0, 2, 8, 104, 24, 0, 0, 0, index_words=2)


def test_threads_agree(rng):
    packed = packed_random(rng, 300, 200, NMPattern(2, 8), np.float32)
    x = rng.standard_normal((7, 300)).astype(np.float32)
    one = _kernels.nm_matmul_cpu(x, packed.values, packed.indices, n=2, m=8, k=300, threads=1)
    many = _kernels.nm_matmul_cpu(x, packed.values, packed.indices, n=2, m=8, k=300, threads=4)
    assert np.array_equal(one, many)


def test_rejects_bad_shapes(rng):
    packed = packed_random(rng, 64, 8, NMPattern(2, 8), np.float32)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="last dim"):
        _kernels.nm_matmul_cpu(x[:, :60], packed.values, packed.indices, n=2, m=8, k=64)
    with pytest.raises(ValueError, match="indices"):
        _kernels.nm_matmul_cpu(x, packed.values, packed.indices[:, :1], n=2, m=8, k=64)
    with pytest.raises(ValueError, match="n:m"):
        _kernels.nm_matmul_cpu(x, packed.values, packed.indices, n=8, m=8, k=64)


def test_cuda_workspace_holds_a_staged_two_of_four_copy():
    """The workspace a call needs on the sparse tensor cores (kernels/cuda/dispatch.cu): a 2:4
    copy of the weight (values, then offset words from a 256-byte boundary) for 1:4, 2:8 and 1:8
    from staged_copy_from_rows rows and STAGED_COPY_MIN_OUTPUTS outputs, for the other patterns
    that fit 2:4 at any row count; below those, room for stream-K (a flag and a 128 KB slot of
    partial sums per SM) where 1:4, 2:8 and 1:8 have more than 64 rows and fewer 256-row tiles than
    SMs but more than half as many; none for 2:4 itself, for fp32 or for a call that carries a copy; after a gated call's
    activation."""
    if not getattr(_kernels, "HAS_CUDA", False):
        pytest.skip("built without CUDA")
    from nmcli.format import NMPattern, PackedShape

    def copy_bytes(k, nout):
        shape = PackedShape(k, nout, NMPattern(2, 4))
        return -(-shape.nout * shape.row_len * 2 // 256) * 256 + shape.nout * shape.index_words * 4

    from_rows = {(n, m): _kernels.staged_copy_from_rows(n, m, 4096, 4096) for n, m in ((1, 4), (2, 8), (1, 8))}
    assert from_rows == {(1, 4): 640, (2, 8): 640, (1, 8): 640}
    assert {_kernels.staged_copy_from_rows(n, m, k, 4096) for n, m in from_rows for k in (4095, 14337)} == {2048}
    assert {(n, m): _kernels.staged_copy_from_rows(n, m, 5121, 4096) for n, m in from_rows} == {(1, 4): 768, (2, 8): 640,
                                                                                              (1, 8): 640}
    assert _kernels.staged_copy_from_rows(1, 4, 5120, 4096) == 640 and _kernels.staged_copy_from_rows(1, 4, 14336, 4096) == 768
    # 2:8 on weights of 2^26 entries or more (K x Nout: 8192 x 8192, 5120 x 13824) from 896
    large = {(n, m): _kernels.staged_copy_from_rows(n, m, 8192, 8192) for n, m in from_rows}
    assert large == {(1, 4): 768, (2, 8): 896, (1, 8): 640}
    assert _kernels.staged_copy_from_rows(2, 8, 4096, 16383) == 640 and _kernels.staged_copy_from_rows(2, 8, 4096, 16384) == 896
    with pytest.raises(ValueError):
        _kernels.staged_copy_from_rows(2, 16, 4096, 4096)  # stages at any row count
    space = functools.partial(_kernels.cuda_workspace_bytes, path="wgmma_sp")
    stream_k = space(639, 2, 8, 11008, 4096, "float16")  # 96 tiles of 256 rows, below the staged copy
    sms = stream_k // (256 * 128 * 4)  # the device's, or the 132 assumed without one
    assert sms > 96 and stream_k == -(-sms * 4 // 256) * 256 + sms * 256 * 128 * 4
    assert space(64, 2, 8, 11008, 4096, "float16") == 0  # 64 rows: no stream-K
    assert space(512, 2, 8, 11008, 4096, "float16") == 0  # 64 tiles: split over clusters
    assert space(640, 2, 4, 11008, 4096, "float16") == 0  # the 2:4 kernel does not take it
    for (n, m), rows in from_rows.items():
        assert space(rows, n, m, 4096, 4096, "float16") == copy_bytes(4096, 4096) == 4096 * (2048 * 2 + 128 * 4)
        assert space(rows - 1, n, m, 4096, 16384, "float16") == 0  # 512 tiles: more than SMs
        assert space(rows, n, m, 4096, 4096, "float16", copy=True) == 0
        assert space(rows, n, m, 4096, 4096, "float32") == 0
    assert space(4096, 2, 4, 4096, 4096, "bfloat16") == 0
    assert space(4096, 4, 16, 4096, 4096, "bfloat16") == 0  # does not fit 2:4
    assert space(17, 2, 16, 4104, 1000, "bfloat16") == copy_bytes(4104, 1000)
    assert space(9, 1, 3, 100, 33, "float16") == copy_bytes(100, 33)
    # ... and only from STAGED_COPY_MIN_OUTPUTS outputs (rows x Nout): not on narrow outputs.
    assert _kernels.STAGED_COPY_MIN_OUTPUTS == 1 << 19
    assert space(1024, 2, 8, 4096, 512, "float16") == copy_bytes(4096, 512)  # 2^19 outputs
    assert space(1024, 2, 8, 4096, 504, "float16") == 0  # fewer, and 16 tiles: no stream-K either
    assert space(639, 2, 8, 4096, 2048, "float16") == 0  # 48 tiles: split over clusters
    assert space(640, 2, 8, 4096, 2048, "float16") == copy_bytes(4096, 2048)
    assert space(640, 1, 8, 4096, 4096, "bfloat16") == copy_bytes(4096, 4096)
    assert space(639, 1, 8, 4096, 4096, "bfloat16") == stream_k  # 96 tiles, unstaged
    assert space(600, 1, 8, 4096, 6144, "bfloat16") == 0  # 144 tiles, unstaged
    assert space(2048, 1, 8, 4095, 4096, "bfloat16") == copy_bytes(4095, 4096)
    assert space(2047, 1, 8, 4095, 4096, "bfloat16") == 0  # 256 tiles, unstaged below K = 4096
    gated = 2100 * 100 * 2  # the activation A, then the copy from the next 256-byte boundary
    assert space(2100, 2, 8, 100, 1600, "float16", "silu") == -(-gated // 256) * 256 + copy_bytes(100, 1600)
    assert space(2100, 2, 8, 100, 1600, "float16", norm=True) == -(-gated // 256) * 256 + copy_bytes(100, 1600)
    assert _kernels.cuda_workspace_bytes(2100, 2, 8, 100, 1600, "float16", "silu", "mma") == gated
    gated_639 = 639 * 11008 * 2  # ... or the stream-K room
    assert space(639, 2, 8, 11008, 4096, "float16", "silu") == -(-gated_639 // 256) * 256 + stream_k


def test_library_reports_cuda_when_built_with_nvcc():
    """CI has nvcc: the CUDA kernels and the CUDA op must have been compiled in."""
    import os
    import shutil

    import nmcli
    if not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")):
        pytest.skip("no CUDA toolkit on this machine")
    info = nmcli.build_info()
    assert info["cuda"] is True and "90" in info["cuda_archs"]
    assert _kernels.HAS_CUDA
    # The dispatch rule (kernels/cuda/dispatch.cu): decode up to 8 rows, tensor cores for
    # fp16/bf16 with M in {2, 4, 8, 16} and (on sm_90) for most fp32 families, the SIMT tiled
    # path for everything else.
    assert _kernels.cuda_path(1, 2, 8, 4096, 4096, "float16") == "decode"
    assert _kernels.cuda_path(8, 2, 8, 4096, 4096, "float32") == "decode"
    sm90 = _kernels.cuda_path_supported("wgmma", 4096, 4, 16, "bfloat16", 4096)
    sp = "wgmma_sp" if sm90 else "mma"
    # 2:4, 1:4, 2:8 and 1:8 (fp16/bf16, K % 8 == 0, the activations of all of K in shared memory;
    # compute capability 8.0+): the decode-sized tensor-core kernel where Nout <= 1024 from 1 row for
    # groups of 4 and 2 for groups of 8, else from 3 for groups of 4 and, for groups of 8, from 3
    # where Nout <= 16384, else 5; to 8 rows for 2:4 and to 16 for the others, unless a call with a
    # 2:4 copy reads it on the sparse tensor cores from 9 rows.
    tc = _kernels.cuda_path_supported("decode_mma", 16, 2, 8, "float16", 4096)
    dm = "decode_mma" if tc else "decode"
    assert _kernels.cuda_path_supported("decode_mma", 8, 2, 8, "bfloat16", 8192) == tc  # 8 rows of K = 8192 fit
    # Past one block's shared memory (K = 4736 at 16 rows of 1:4), K split over a cluster of up to 8.
    assert _kernels.cuda_path_supported("decode_mma", 16, 1, 4, "float16", 4744) == tc
    assert _kernels.cuda_path_supported("decode_mma", 16, 2, 8, "float16", 8192) == tc
    assert _kernels.cuda_path_supported("decode_mma", 8, 2, 8, "float16", 11008) == tc
    assert _kernels.cuda_path_supported("decode_mma", 16, 1, 8, "float16", 36864) == tc  # the most 8 blocks fit
    assert not _kernels.cuda_path_supported("decode_mma", 16, 1, 8, "float16", 36872)
    assert _kernels.cuda_path_supported("decode_mma", 8, 2, 8, "bfloat16", 80896) == tc
    assert not _kernels.cuda_path_supported("decode_mma", 8, 2, 8, "bfloat16", 80904)
    assert not _kernels.cuda_path_supported("decode_mma", 8, 8, 16, "float16", 4096)  # 8 entries a group: not compiled
    # 4:8 and 4:16 (four entries a group): as groups of 8, from 2 rows up to 1024 wide, from 3 up
    # to 4096 wide, else from 5, and from 5 where decode_mma splits K and decode stages it once;
    # 4:16's pair-keyed tables leave 1-8 rows one block to K = 8576 and 8 blocks to 68608, 9-16 rows
    # (16 lanes a key) 4480 and 34816.
    assert _kernels.cuda_path_supported("decode_mma", 16, 4, 16, "bfloat16", 4744) == tc
    assert _kernels.cuda_path_supported("decode_mma", 8, 4, 16, "float16", 68608) == tc
    assert not _kernels.cuda_path_supported("decode_mma", 8, 4, 16, "float16", 68616)
    assert _kernels.cuda_path_supported("decode_mma", 16, 4, 16, "float16", 34816) == tc
    assert not _kernels.cuda_path_supported("decode_mma", 16, 4, 16, "float16", 34824)
    assert _kernels.cuda_path(2, 4, 8, 4096, 1024, "float16") == dm
    assert _kernels.cuda_path(1, 4, 8, 4096, 1024, "float16") == "decode"
    assert _kernels.cuda_path(2, 4, 16, 4096, 1024, "bfloat16") == dm
    assert _kernels.cuda_path(3, 4, 16, 4096, 4096, "float16") == dm
    assert _kernels.cuda_path(2, 4, 16, 4096, 4096, "float16") == "decode"
    assert _kernels.cuda_path(5, 4, 16, 4096, 11008, "float16") == dm
    assert _kernels.cuda_path(4, 4, 16, 4096, 11008, "float16") == "decode"
    assert _kernels.cuda_path(5, 4, 8, 4096, 28672, "float16") == dm
    assert _kernels.cuda_path(4, 4, 8, 4096, 28672, "float16") == "decode"
    assert _kernels.cuda_path(16, 4, 8, 14336, 4096, "float16") == ("decode_mma" if tc else "mma")
    assert _kernels.cuda_path(3, 4, 16, 14336, 4096, "float16") == dm  # decode: several K chunks
    assert _kernels.cuda_path(4, 4, 8, 11008, 4096, "float16") == "decode"  # one chunk, decode_mma splits K
    assert _kernels.cuda_path(5, 4, 8, 11008, 4096, "float16") == dm
    # Narrower than 4096, decode's grid leaves SMs idle: there decode_mma takes K splits at its usual
    # rows, groups of 8 from 1 row up to 1024 wide from K = 8192 (to 2048 wide 1:4 from 1 row, 2:8
    # and 1:8 from 2 where decode_mma holds K), and 2:4 from 1 row.
    # 2:4 keeps decode_mma to 4 rows there only up to 1024 wide (the sparse tensor cores from 3 rows wider).
    for rows, n, m, k, nout, dtype, path in [(3, 2, 8, 11008, 3072, "float16", dm),
                                             (2, 2, 8, 11008, 3072, "float16", "decode"),
                                             (1, 1, 8, 11008, 1024, "float16", dm),
                                             (1, 4, 16, 8192, 1024, "bfloat16", dm),
                                             (1, 2, 8, 7168, 1024, "float16", "decode"),
                                             (1, 2, 4, 14336, 2048, "float16", dm),
                                             (1, 2, 4, 14336, 4096, "float16", "decode"),
                                             (3, 2, 4, 14336, 1024, "float16", dm),
                                             # 1025-2048 wide from K = 8192: 1:4 from 1 row, 2:8 and 1:8
                                             # from 2 where decode_mma holds K (8192), else from 3
                                             (1, 1, 4, 8192, 2048, "float16", dm),
                                             (1, 1, 4, 14336, 2048, "float16", dm),
                                             (1, 1, 4, 4096, 2048, "float16", "decode"),
                                             (2, 2, 8, 8192, 2048, "bfloat16", dm),
                                             (2, 1, 8, 8192, 1536, "float16", dm),
                                             (2, 2, 8, 11008, 2048, "float16", "decode"),
                                             (2, 1, 8, 14336, 2048, "float16", "decode"),
                                             (1, 2, 8, 8192, 2048, "float16", "decode"),
                                             (2, 4, 16, 8192, 2048, "float16", "decode"),
                                             (2, 2, 8, 8192, 3072, "float16", "decode"),
                                             # 2:4 at 2 rows past 2048 wide: decode (decode_mma at 1)
                                             (2, 2, 4, 8192, 3072, "float16", "decode"),
                                             (1, 2, 4, 8192, 3072, "float16", dm),
                                             (2, 2, 4, 14336, 2048, "float16", dm)]:
        assert _kernels.cuda_path(rows, n, m, k, nout, dtype) == path, (rows, n, m, k, nout)
    assert _kernels.cuda_path(3, 2, 4, 14336, 2048, "float16") != "decode_mma"
    assert not _kernels.cuda_path_supported("decode_mma", 8, 2, 8, "float32", 4096)
    assert _kernels.cuda_path(1, 2, 8, 4096, 1024, "float16") == "decode"
    assert _kernels.cuda_path(2, 2, 8, 4096, 1024, "float16") == dm
    assert _kernels.cuda_path(1, 2, 4, 4096, 1024, "float16") == dm
    assert _kernels.cuda_path(1, 1, 4, 4096, 1024, "bfloat16") == dm
    assert _kernels.cuda_path(1, 1, 4, 4096, 1040, "float16") == "decode"
    assert _kernels.cuda_path(2, 2, 8, 4096, 1040, "float16") == "decode"
    assert _kernels.cuda_path(3, 1, 4, 4096, 4096, "float16") == dm
    assert _kernels.cuda_path(3, 1, 4, 4096, 28672, "float16") == dm  # groups of 4: from 3 rows at any width
    assert _kernels.cuda_path(2, 2, 8, 4096, 14336, "float16") == "decode"
    assert _kernels.cuda_path(3, 2, 8, 4096, 14336, "float16") == dm
    assert _kernels.cuda_path(3, 1, 8, 4096, 16384, "float16") == dm
    assert _kernels.cuda_path(4, 1, 8, 4096, 16400, "float16") == "decode"
    assert _kernels.cuda_path(4, 1, 8, 4096, 28672, "bfloat16") == "decode"
    assert _kernels.cuda_path(5, 1, 8, 4096, 28672, "bfloat16") == dm
    assert _kernels.cuda_path(5, 1, 4, 4096, 4096, "float16") == dm
    assert _kernels.cuda_path(8, 2, 8, 4096, 1024, "bfloat16") == dm
    # 2:4 at 3..8 rows: the sparse tensor cores where the output is wider than 4096 (up to 6144
    # wide from 5 rows) or decode_mma splits K (below); else decode_mma.
    assert _kernels.cuda_path(8, 2, 4, 4096, 4096, "float16") == dm
    assert _kernels.cuda_path(4, 2, 4, 4096, 4096, "float16") == dm
    assert _kernels.cuda_path(3, 2, 4, 4096, 4104, "float16") == dm  # to 6144 wide: decode_mma to 4 rows
    assert _kernels.cuda_path(5, 2, 4, 4096, 4104, "float16") == ("wgmma_sp" if sm90 else dm)
    assert _kernels.cuda_path(3, 2, 4, 4096, 14336, "bfloat16") == ("wgmma_sp" if sm90 else dm)
    assert _kernels.cuda_path(2, 2, 4, 4096, 14336, "float16") == "decode"
    assert _kernels.cuda_path(8, 2, 4, 4096, 896, "float16") == dm  # 7 weight tiles: not a sparse tensor-core grid
    assert _kernels.cuda_path(4, 2, 4, 4096, 1024, "float16") == dm
    assert _kernels.cuda_path(5, 2, 4, 4096, 1024, "float16") == dm
    assert _kernels.cuda_path(8, 2, 4, 4096, 28672, "float16") == ("wgmma_sp" if sm90 else dm)
    assert _kernels.cuda_path(5, 2, 4, 11008, 4096, "bfloat16") == ("wgmma_sp" if sm90 else "decode")
    assert _kernels.cuda_path(8, 2, 4, 11008, 896, "float16") == dm  # 7 weight tiles
    # 2:4 at 1-4 rows: decode_mma (the sparse MMA) up to 6144 wide where one block holds K (its ring
    # of 8 steps a warp leaves 1-8 rows room for K = 7616), at 1 row from K = 2048 (or up to 1024
    # wide), else decode; past 4096 wide the sparse tensor cores from 5 rows (wider: from 3).
    assert _kernels.cuda_path(1, 2, 4, 4096, 4096, "float16") == dm
    assert _kernels.cuda_path(1, 2, 4, 2048, 2048, "float16") == dm
    assert _kernels.cuda_path(1, 2, 4, 2040, 4096, "float16") == "decode"
    assert _kernels.cuda_path(2, 2, 4, 1024, 4096, "float16") == dm
    assert _kernels.cuda_path(1, 2, 4, 1024, 1024, "float16") == dm
    assert _kernels.cuda_path(2, 2, 4, 7616, 2048, "bfloat16") == dm
    assert _kernels.cuda_path(1, 2, 4, 7624, 4096, "float16") == "decode"  # K split: decode where 4096 wide,
    assert _kernels.cuda_path(1, 2, 4, 7624, 2048, "float16") == dm  # decode_mma narrower (session 68)
    assert _kernels.cuda_path(2, 2, 4, 4096, 6144, "float16") == dm
    assert _kernels.cuda_path(1, 2, 4, 4096, 6160, "float16") == "decode"
    assert _kernels.cuda_path(4, 2, 4, 4096, 6144, "float16") == dm  # past 4096 wide to 4 rows
    assert _kernels.cuda_path(5, 2, 4, 4096, 6144, "float16") == ("wgmma_sp" if sm90 else dm)
    assert _kernels.cuda_path(3, 2, 4, 4096, 6160, "float16") == ("wgmma_sp" if sm90 else dm)
    assert _kernels.cuda_path(3, 2, 4, 7624, 4096, "float16") == ("wgmma_sp" if sm90 else dm)
    assert _kernels.cuda_path_supported("decode_mma", 8, 2, 4, "float16", 60416) == tc  # the most 8 blocks fit
    assert not _kernels.cuda_path_supported("decode_mma", 8, 2, 4, "float16", 60424)
    # Where decode_mma splits K (the down projections): 2:4 on the sparse tensor cores from 3 rows,
    # groups of 8 from 5 rows while decode stages K in one chunk (11008 at 1-8 rows; not 14336).
    assert _kernels.cuda_path(3, 2, 4, 11008, 4096, "float16") == ("wgmma_sp" if sm90 else "decode")
    assert _kernels.cuda_path(2, 2, 4, 14336, 4096, "float16") == "decode"
    assert _kernels.cuda_path(8, 2, 4, 14336, 4096, "float16") == ("wgmma_sp" if sm90 else "decode")
    assert _kernels.cuda_path(4, 2, 8, 11008, 4096, "float16") == "decode"
    assert _kernels.cuda_path(5, 1, 8, 11008, 4096, "float16") == dm
    assert _kernels.cuda_path(3, 1, 4, 11008, 4096, "float16") == dm
    assert _kernels.cuda_path(3, 1, 4, 14336, 4096, "bfloat16") == dm
    assert _kernels.cuda_path(4, 2, 8, 14336, 4096, "float16") == dm
    assert _kernels.cuda_path(8, 1, 8, 4096, 4096, "float16") == dm
    assert _kernels.cuda_path(8, 1, 8, 4096, 12288, "float16") == dm
    assert _kernels.cuda_path(9, 1, 8, 4096, 12288, "float16") == dm
    assert _kernels.cuda_path(8, 2, 8, 4096, 4096, "float16", 0, True) == dm
    # 9..16 rows otherwise: 2:4, 1:4, 2:8 and 1:8 on the sparse tensor cores (wgmma.mma_async.sp)
    # with 8 weight tiles (Nout >= 897); else decode for N/M <= 1/4 while the activations are staged
    # in one K chunk, and mma.
    assert _kernels.cuda_path(9, 2, 8, 4096, 4096, "float16") == ("decode_mma" if tc else "decode")
    assert _kernels.cuda_path(12, 2, 8, 4096, 4096, "float16", 0, True) == ("wgmma_sp" if sm90 else "decode")
    assert _kernels.cuda_path(16, 1, 8, 4096, 22016, "bfloat16") == ("decode_mma" if tc else "decode")
    assert _kernels.cuda_path(9, 2, 8, 4096, 896, "float16") == ("decode_mma" if tc else "decode")  # 7 weight tiles
    assert _kernels.cuda_path(16, 2, 8, 8192, 4096, "float16") == ("decode_mma" if tc else sp)  # K split
    assert _kernels.cuda_path(9, 2, 4, 4096, 4096, "float16") == sp
    assert _kernels.cuda_path(16, 2, 4, 1024, 1024, "float16") == sp  # 8 weight tiles
    assert _kernels.cuda_path(16, 2, 4, 4096, 896, "float16") == "mma"  # 7: too few
    assert _kernels.cuda_path(16, 2, 8, 11008, 4096, "float16") == ("decode_mma" if tc else sp)
    assert _kernels.cuda_path(12, 1, 4, 14336, 4096, "float16") == ("decode_mma" if tc else sp)
    assert _kernels.cuda_path(16, 2, 4, 14336, 4096, "float16") == sp
    assert _kernels.cuda_path(16, 2, 8, 11008, 896, "float16") == ("decode_mma" if tc else "mma")  # 7 weight tiles
    # 4:16 to 16 rows on decode_mma (from 9 on 14336 x 4096, K split), the expanding kernel from 17
    assert _kernels.cuda_path(16, 4, 16, 14336, 4096, "float16") == ("decode_mma" if tc else "mma")
    # From 17 rows 2:4, 1:4, 2:8 and 1:8 take the sparse tensor cores with 8 weight tiles or 16 blocks.
    assert _kernels.cuda_path(17, 2, 8, 4096, 4096, "float16") == sp
    assert _kernels.cuda_path(127, 1, 8, 4096, 4096, "bfloat16") == sp
    assert _kernels.cuda_path(64, 1, 4, 4096, 1024, "float16") == sp  # 8 weight tiles
    assert _kernels.cuda_path(64, 1, 4, 4096, 896, "float16") == "mma"  # 7 weight tiles, 7 blocks
    assert _kernels.cuda_path(256, 2, 8, 1024, 512, "float16") == sp  # 16 blocks
    # The expanding warpgroup (wgmma) path for the other families on compute capability 9.0:
    # from 17 rows with 8 weight tiles (Nout >= 897), else from 128 rows with 16 blocks.
    assert _kernels.cuda_path(4096, 4, 16, 4096, 4096, "bfloat16") == ("wgmma" if sm90 else "mma")
    assert _kernels.cuda_path(17, 4, 8, 4096, 4096, "float16") == ("wgmma" if sm90 else "mma")
    assert _kernels.cuda_path(17, 4, 16, 4096, 1024, "float16") == ("wgmma" if sm90 else "mma")  # 8 weight tiles
    assert _kernels.cuda_path(17, 4, 16, 4096, 896, "float16") == "mma"  # 7 weight tiles
    assert _kernels.cuda_path(127, 4, 8, 4096, 896, "float16") == "mma"  # 7 x 2 blocks
    assert _kernels.cuda_path(129, 4, 8, 4096, 896, "float16") == ("wgmma" if sm90 else "mma")  # 7 x 3 blocks
    assert _kernels.cuda_path(128, 4, 16, 1024, 512, "float16") == "mma"  # 4 x 2 wgmma blocks: too few
    assert _kernels.cuda_path(4096, 2, 8, 4100, 4096, "float16") == "mma"  # K % 8 != 0: no 16-byte copies
    # fp32 element-wise: the 3xTF32 warpgroup kernel from 9 rows, for M a power of two up to 32
    # and N/M <= 1/2, K % 4 == 0.
    assert _kernels.cuda_path_supported("wgmma", 4096, 2, 8, "float32", 4096) == sm90
    assert _kernels.cuda_path(17, 8, 32, 4096, 4096, "float32") == ("wgmma" if sm90 else "tiled")
    assert _kernels.cuda_path(9, 2, 4, 4096, 4096, "float32") == ("wgmma" if sm90 else "decode")
    assert _kernels.cuda_path(9, 1, 8, 4096, 4096, "float32") == ("wgmma" if sm90 else "decode")
    assert _kernels.cuda_path(16, 4, 32, 14336, 4096, "float32") == ("wgmma" if sm90 else "decode")
    assert _kernels.cuda_path(16, 3, 7, 4096, 4096, "float32") == "decode"
    assert _kernels.cuda_path(17, 2, 8, 4098, 4096, "float32") == "tiled"  # K % 4 != 0
    assert _kernels.cuda_path(17, 3, 7, 4096, 4096, "float32") == "tiled"
    assert _kernels.cuda_path(17, 3, 4, 4096, 4096, "float32") == "tiled"  # N/M > 1/2
    assert not _kernels.cuda_path_supported("wgmma", 4096, 3, 8, "float16", 4096)
    assert _kernels.cuda_path(4096, 2, 4, 4096, 4096, "float16") == sp
    assert _kernels.cuda_path(512, 2, 4, 4096, 11008, "bfloat16") == sp
    # 1:4, 2:8 and 1:8 run on it regrouped into 2:4 form; 4:16 and 4:8 do not fit 2 of every 4.
    for n, m in ((1, 4), (2, 8), (1, 8)):
        assert _kernels.cuda_path_supported("wgmma_sp", 4096, n, m, "float16", 4096) == sm90
        assert _kernels.cuda_path(1024, n, m, 4096, 11008, "float16") == ("wgmma_sp" if sm90 else "mma")
    # Every other pattern that fits 2:4 reaches them through a 2:4 copy staged in the workspace:
    # from 17 rows against the mma path where the copy goes a word per thread (1:16) and against
    # the tiled path (1:3, 2:32), from 1024 rows against the expanding kernel (2:16).
    for n, m in ((2, 16), (1, 16), (1, 3), (2, 32), (1, 2), (2, 12)):
        assert _kernels.cuda_path_supported("wgmma_sp", 17, n, m, "bfloat16", 4096) == sm90
    assert _kernels.cuda_path(17, 1, 16, 4096, 4096, "float16") == sp
    assert _kernels.cuda_path(16, 1, 16, 4096, 4096, "float16") in ("decode", "mma")
    assert _kernels.cuda_path(17, 1, 3, 4096, 4096, "float16") == ("wgmma_sp" if sm90 else "tiled")
    assert _kernels.cuda_path(64, 2, 32, 4096, 4096, "bfloat16") == ("wgmma_sp" if sm90 else "tiled")
    assert _kernels.cuda_path(17, 1, 2, 4096, 4096, "float16") == sp  # its copy goes a word per thread too
    assert _kernels.cuda_path(1024, 1, 2, 4096, 4096, "float16") == sp
    assert _kernels.cuda_path(1023, 2, 16, 4096, 4096, "float16") == ("wgmma" if sm90 else "mma")
    assert _kernels.cuda_path(1024, 2, 16, 4096, 4096, "float16") == sp
    assert _kernels.cuda_path(1024, 2, 16, 4096, 4096, "float32") == ("wgmma" if sm90 else "tiled")  # no fp32 copy
    assert not _kernels.cuda_path_supported("wgmma_sp", 4096, 4, 16, "float16", 4096)
    assert not _kernels.cuda_path_supported("wgmma_sp", 4096, 4, 8, "bfloat16", 4096)
    assert not _kernels.cuda_path_supported("wgmma_sp", 4096, 2, 4, "float32", 4096)
    assert _kernels.cuda_path(17, 2, 8, 4096, 4096, "float32") == ("wgmma" if sm90 else "tiled")
    assert _kernels.cuda_path(17, 3, 7, 4096, 4096, "float16") == "tiled"
    assert _kernels.cuda_path(17, 16, 32, 4096, 4096, "float16") == "tiled"
    assert not _kernels.cuda_path_supported("decode", 17, 2, 8, "float16")
    assert not _kernels.cuda_path_supported("mma", 64, 2, 8, "float32")
