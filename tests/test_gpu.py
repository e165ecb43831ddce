"""GPU checks (run on the lent H100; skipped without a GPU): every CUDA path and N:M family
against the float64 reference with fresh random data, odd shapes and poisoned outputs; the
pruned model on ORT's CUDA EP against the CPU EP, with IO binding and CUDA-graph replay."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FAMILIES

from nmcli.format import (NMPattern, PackedShape, PackedWeight, pack, shares_offsets, two_of_four_copy, unpack,
                          with_index_words)
from nmcli.masks import choose_offsets
from nmcli.reference import dense_reference, error_ratio, gated_activation, relative_error, rms_normalised

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
kernels = pytest.importorskip("nmcli._kernels")

TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _ort_has_cuda() -> bool:
    try:
        import onnxruntime
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


# The ONNX Runtime tests need onnxruntime-gpu: with the CPU package (or none) they skip, rather
# than fail on a session that fell back to the CPU EP or on a device buffer it cannot allocate.
needs_ort_cuda = pytest.mark.skipif(not _ort_has_cuda(),
                                    reason="onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")


def to_device(array, dtype_name):
    t = torch.from_numpy(np.ascontiguousarray(array.astype(np.float32) if dtype_name == "bfloat16" else array))
    return t.to("cuda", TORCH_DTYPE[dtype_name] if array.dtype.kind == "f" else None)


def run_cuda(x, packed, bias, alpha, dtype_name, path, widths=None, vector=0, copy=None):
    """The op's output as float64 parts: one [rows, Nout], or one per width (consecutive
    columns in separate tensors, as a fused sibling group writes them). Outputs start poisoned.
    `copy`: the weight packed as 2:4 as well (docs/FORMAT.md "A 2:4 copy")."""
    k, nout = packed.shape.k, packed.shape.nout
    xd, vd = to_device(x, dtype_name), to_device(packed.values, dtype_name)
    idx = torch.from_numpy(packed.indices.view(np.int32)).cuda()
    copy_ptrs = {}
    if copy is not None:
        copy_tensors = (to_device(copy.values, dtype_name), torch.from_numpy(copy.indices.view(np.int32)).cuda())
        copy_ptrs = dict(copy_values=copy_tensors[0].data_ptr(), copy_indices=copy_tensors[1].data_ptr(),
                         copy_index_words=copy.indices.shape[1])
    bd = to_device(bias, dtype_name) if bias is not None else None
    rows = int(np.prod(x.shape[:-1]))
    ys = [torch.full((rows, width), float("nan"), device="cuda", dtype=TORCH_DTYPE[dtype_name])
          for width in (widths or [nout])]
    y_arg = [y.data_ptr() for y in ys] if widths else ys[0].data_ptr()
    workspace = poisoned_workspace(rows, packed, dtype_name, path, copy=copy is not None)
    kernels.nm_matmul_cuda(xd.data_ptr(), vd.data_ptr(), idx.data_ptr(), bd.data_ptr() if bd is not None else 0,
                           y_arg, rows, packed.shape.pattern.n, packed.shape.pattern.m, k, nout, dtype_name,
                           alpha, torch.cuda.current_stream().cuda_stream, path, widths or [], vector=vector,
                           workspace=workspace.data_ptr() if workspace is not None else 0,
                           index_words=packed.indices.shape[1], **copy_ptrs)
    torch.cuda.synchronize()
    return [y.float().cpu().numpy().astype(np.float64) for y in ys]


def poisoned_workspace(rows, packed, dtype_name, path, glu="none", norm=False, copy=False):
    """The workspace the call asks for (cuda_workspace_bytes: a gated or normalised activation, a
    staged 2:4 copy), filled with 0xFF bytes (NaN in fp16 and bf16) so that a byte the call reads
    before writing it shows in the output; None where it needs none."""
    pattern, shape = packed.shape.pattern, packed.shape
    need = kernels.cuda_workspace_bytes(rows, pattern.n, pattern.m, shape.k, shape.nout, dtype_name, glu, path,
                                        norm=norm, copy=copy)
    return torch.full((need,), 0xFF, dtype=torch.uint8, device="cuda") if need else None


def random_array(rng, shape, dtype_name):
    """Fresh normal data of the dtype; bf16 values are rounded through bf16 first so the
    reference sees the same numbers."""
    a = rng.standard_normal(shape).astype(np.float16 if dtype_name == "float16" else np.float32)
    return torch.from_numpy(a).to(torch.bfloat16).float().numpy() if dtype_name == "bfloat16" else a


def random_case(rng, pattern, rows, k, nout, dtype_name, vector=0):
    """Fresh x [rows, K], packed W (magnitude-pruned; vector-wise in blocks of `vector` columns
    when > 1) and bias."""
    w, x, bias = (random_array(rng, shape, dtype_name) for shape in ((k, nout), (rows, k), nout))
    return x, pack(w, choose_offsets(np.abs(w), pattern, vector), pattern), bias


def paths_for(rows, pattern, dtype_name, k):
    return ["auto"] + [p for p in ("decode", "decode_mma", "mma", "wgmma", "wgmma_sp", "tiled")
                       if kernels.cuda_path_supported(p, rows, pattern.n, pattern.m, dtype_name, k)]


@pytest.mark.parametrize("n,m", FAMILIES + [(3, 7), (4, 8), (8, 16), (2, 16)])
@pytest.mark.parametrize("dtype_name", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout", [(1, 4096, 257), (2, 1000, 64), (3, 777, 33), (5, 300, 1), (8, 4099, 130),
                                         # decode's whole-row walk (135 tiles of 32 rows on 132 SMs,
                                         # the last partial; 2:8 rows of three steps, the last partial);
                                         # at 2 rows X staged in halves for 16-bit types, at once for fp32;
                                         # 129 tiles, one a block: the whole-row walk since session 67
                                         (1, 4104, 4300), (2, 4104, 4300), (1, 4104, 4100),
                                         # at 2 rows X of 8200: 16-bit types stage it in halves
                                         # with a third load for some threads, fp32 at once; at 1
                                         # row X of 20000 (past 16384), with a third load
                                         (2, 8200, 4300), (1, 20000, 4300),
                                         (9, 515, 200), (16, 2048, 77), (17, 130, 300), (64, 1024, 96),
                                         (100, 333, 65), (1100, 264, 3900), (1100, 200, 3900),
                                         # decode: activations staged in several K chunks; many row tiles per block
                                         (1, 60000, 40), (16, 9000, 70), (2, 512, 20001), (4, 4100, 9000),
                                         # wgmma: 64-, 128- and 256-row activation tiles, partial K steps
                                         (600, 4104, 130), (300, 136, 8000), (700, 264, 17000),
                                         # on 132 SMs, 144 tiles of 256 rows: 132 unsplit, then the
                                         # last wave's 12 split over clusters (launch_split), the last
                                         # activation tile overlapping the one before (K: partial step)
                                         (2300, 3000, 2000),
                                         # 32 weight tiles of 4 x 160 rows (2:8 and 1:8 stage a 2:4
                                         # copy from 640 rows here; until session 51, stream-K
                                         # over 3 x 256: test_regrouping_kernel_stream_k_when_forced)
                                         (640, 11000, 4000),
                                         # K split three ways over a cluster, the last block fewer steps
                                         (40, 1800, 520),
                                         # 5-8 ways (per family): 8 weight tiles, 7-way over 15 groups, 16 tiles
                                         (40, 4104, 1000), (40, 3600, 1000), (40, 4104, 2000)])
def test_cuda_paths_match_reference(rng, n, m, dtype_name, rows, k, nout):
    pattern = NMPattern(n, m)
    x, packed, bias = random_case(rng, pattern, rows, k, nout, dtype_name)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    for path in paths_for(rows, pattern, dtype_name, k):
        [y] = run_cuda(x, packed, bias, 0.75, dtype_name, path)
        assert error_ratio(y, ref, magnitude, dtype_name, k) < 1, path


@pytest.mark.parametrize("n,m", [(1, 4), (2, 4), (1, 8), (2, 8), (4, 8), (4, 16)])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout", [(1, 64, 16), (2, 1000, 1000), (4, 136, 4100), (7, 4104, 130), (8, 2048, 4097),
                                         (9, 1024, 33), (13, 4096, 1030), (16, 3000, 257), (16, 4096, 4096),
                                         # K split over a cluster: 2 blocks (2:4 1), 2, 4 (2:4 3), 6-8, 8
                                         (16, 4744, 77), (8, 11008, 300), (16, 14336, 130), (3, 60000, 50),
                                         (16, 34816, 40),
                                         # 4:16's 32 KB table at 1-8 rows: one block to K = 8576, then 2;
                                         # the most 8 blocks of 4:16 hold at 9-16 rows (34816) above, and
                                         # at 1-8 rows those of 2:4 (60416: its ring is 8 steps deep) and 4:16
                                         (6, 8584, 100), (2, 60416, 40), (2, 68608, 40),
                                         # clusters walking several tiles: a partial batch of tile
                                         # sums (2 blocks), two full batches and a partial one (4)
                                         (8, 11008, 4100), (16, 14336, 8200),
                                         # 1 row, K split (decode_mma takes these narrow outputs from 1 row)
                                         (1, 14336, 1000)])
def test_decode_mma_matches_reference(rng, n, m, dtype_name, rows, k, nout):
    """The decode-sized tensor-core path (decode_mma.cu), one or two entries in groups of 4 or 8 and
    four in groups of 8 or 16 (a value word's two entries keying its selector; at 9-16 rows of 4:16
    from a table of 16 lanes a key; 2:4 read as it is by the sparse MMA, its warps taking every 8th
    step, its padding offsets made valid where K is not a multiple of 64): 8- and 16-row kernels, fewer K
    steps than warps (K = 64), steps not a multiple of the block's 8 warps, Nout not a multiple of its 16-column
    tile, K split over clusters of 2-8 blocks where the activations of all of K do not fit one
    block's shared memory (the splits in the comment follow decode_mma.cu's Layout), clusters that
    sum their tiles in batches (on an H100 or H200, about 30 clusters of 4 walk 513 tiles: 8 + 8 +
    2), outputs poisoned."""
    pattern = NMPattern(n, m)
    two_of_four_past_its_most = (n, m) == (2, 4) and rows <= 8 and k > 60416
    assert kernels.cuda_path_supported("decode_mma", rows, n, m, dtype_name, k) != two_of_four_past_its_most
    if two_of_four_past_its_most:
        return
    x, packed, bias = random_case(rng, pattern, rows, k, nout, dtype_name)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    [y] = run_cuda(x, packed, bias, 0.75, dtype_name, "decode_mma")
    assert error_ratio(y, ref, magnitude, dtype_name, k) < 1


def with_index_rows(packed, index_rows):
    """`packed` with its rows of indices "padded" to 16-byte units as pack writes them (docs/FORMAT.md
    version 2) or "unpadded" as version 1 did."""
    shape = packed.shape
    return with_index_words(packed, shape.padded_index_words if index_rows == "padded" else shape.index_words)


def assert_forced_path_matches_reference(rng, n, m, dtype_name, rows, k, nout, path, index_rows="padded"):
    """A fresh case run on `path` against the float64 reference, outputs poisoned; skipped where the
    path cannot take it (no sm_90a device). `index_rows`: rows of indices "padded" as pack writes
    them or "unpadded" (with_index_rows). Returns the packed weight."""
    if not kernels.cuda_path_supported(path, rows, n, m, dtype_name, k):
        pytest.skip("no sm_90a device")
    x, packed, bias = random_case(rng, NMPattern(n, m), rows, k, nout, dtype_name)
    packed = with_index_rows(packed, index_rows)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    [y] = run_cuda(x, packed, bias, 0.75, dtype_name, path)
    assert error_ratio(y, ref, magnitude, dtype_name, k) < 1
    return packed


def skip_unless_padding_differs(index_rows, k, nout, n, m):
    """Skips an unpadded case whose rows of indices are whole 16-byte units anyway (the padded case
    runs the same bytes)."""
    shape = PackedShape(k, nout, NMPattern(n, m))
    if index_rows == "unpadded" and shape.padded_index_words == shape.index_words:
        pytest.skip("these rows of indices are whole 16-byte units already")


@pytest.mark.parametrize("n,m", [(1, 4), (1, 8), (2, 8)])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout", [(17, 4104, 4100), (64, 2048, 12300), (33, 11008, 11008), (5, 1032, 22000)])
@pytest.mark.parametrize("index_rows", ["unpadded", "padded"])
def test_regrouping_kernel_two_blocks_per_sm(rng, n, m, dtype_name, rows, k, nout, index_rows):
    """The sparse tensor cores' regrouping kernel with two blocks of 64-row tiles per SM
    (wgmma_sp.cu, two_per_sm_split), which takes calls of up to 64 rows whose grid reaches 5/4 of
    the SMs: on 132 SMs 33 weight tiles split 5 ways (the last tile 4 columns, K a step past a
    whole number of 64-position steps), 97 tiles split 2 ways, 86 split 2 ways with a row count
    off the 8-row MMA grain, and 172 tiles unsplit at 5 rows (K past 16 steps). K = 2048 brings the
    offset words by tensor copy (rows of whole 16-byte units), the other K by cp.async (but 1:4's
    at K = 11008) unless their rows of indices are padded to 16-byte units (docs/FORMAT.md version
    2); both into the area apart from the steps. Outputs poisoned."""
    skip_unless_padding_differs(index_rows, k, nout, n, m)
    assert_forced_path_matches_reference(rng, n, m, dtype_name, rows, k, nout, "wgmma_sp", index_rows)


@pytest.mark.parametrize("n,m", [(1, 4), (1, 8), (2, 8)])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout", [(639, 11264, 4000), (300, 4096, 1030), (100, 2048, 520), (40, 4096, 1000),
                                         (150, 5120, 6000), (150, 11264, 4104), (330, 5120, 3000)])
def test_regrouping_kernel_copies_offset_words_by_tensor_copy(rng, n, m, dtype_name, rows, k, nout):
    """The regrouping kernel where rows of offset words are 16-byte multiples (K a multiple of 1024
    here, for 1:4, 2:8 and 1:8): each group of steps' words come as one tensor copy of a window from
    the 16-byte boundary before the group's first bit (wgmma_sp.cu, OffsetWindow). On 132 SMs
    (session 53's plans): 160-row tiles unsplit (since session 51, not stream-K:
    test_regrouping_kernel_stream_k_when_forced) and split 5 ways, 64-row tiles split 4 and 8 ways
    over a cluster, Nout off the 128-column weight tile (the window past Nout reads zeros); the last
    three 160-row tiles split 2 and 3 ways and 192-row tiles split 2 ways, whose groups are of 2
    steps. Outputs poisoned."""
    packed = assert_forced_path_matches_reference(rng, n, m, dtype_name, rows, k, nout, "wgmma_sp")
    assert packed.indices.shape[1] % 4 == 0  # the rows the tensor copies take


# Run in a fresh process: NMCLI_TILE_PLAN is read once per process. argv: the tests' folder, then
# the folder of the nmcli this process imported (the child's working directory may hold another,
# the source tree without the built kernels).
STREAM_K_SCRIPT = """
import sys
import numpy as np
sys.path[:0] = [sys.argv[2], sys.argv[1]]
from test_gpu import assert_forced_path_matches_reference, kernels
rng = np.random.default_rng(53)
for rows, k, nout in [(639, 11000, 4000), (639, 11264, 4000)]:
    for n, m in [(1, 4), (2, 8), (1, 8)]:
        for dtype_name in ["float16", "bfloat16"]:
            assert_forced_path_matches_reference(rng, n, m, dtype_name, rows, k, nout, "wgmma_sp")
            assert kernels.last_tile_plan()[:4] == (256, 1, False, True), (rows, k, nout, n, m, kernels.last_tile_plan())
"""


def test_regrouping_kernel_stream_k_when_forced():
    """Stream-K in the regrouping kernel (sm90::stream_k: each SM an equal run of the steps of 96
    tiles of 256 rows, the last overlapping the one before), which launch_split still weighs but which
    no other case here takes on 132 SMs since the 160-row tiles (session 51; session 53 listed the
    plans): forced through NMCLI_TILE_PLAN, 1:4, 2:8 and 1:8 in fp16 and bf16, K a partial step past
    171 (offset words by cp.async) and a multiple of 1024 (by tensor copy), against the float64
    reference with poisoned outputs; the launch must have taken stream-K."""
    if not kernels.cuda_path_supported("wgmma_sp", 639, 2, 8, "float16", 11000):
        pytest.skip("no sm_90a device")
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the stream-K grid is sized for 132 SMs")
    nmcli_root = str(Path(kernels.__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", STREAM_K_SCRIPT, str(Path(__file__).parent), nmcli_root],
                            env=dict(os.environ, NMCLI_TILE_PLAN="256,sk"), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


TWO_PER_SM_SCRIPT = """
import sys
import numpy as np
sys.path[:0] = [sys.argv[2], sys.argv[1]]
from test_gpu import assert_forced_path_matches_reference, kernels
rng = np.random.default_rng(72)
for n, m in [(1, 4), (2, 8), (1, 8)]:
    for rows in (17, 64):
        assert_forced_path_matches_reference(rng, n, m, "float16", rows, 4096, 4096, "wgmma_sp")
        plan = kernels.last_tile_plan()
        assert (plan[5], plan[1]) == ((True, 8) if sys.argv[3] == "pair" else (False, plan[1])), (n, m, rows, plan)
        assert plan[0] != 0, plan
"""


def test_two_blocks_per_sm_grid_reported_and_forced(rng):
    """The regrouping kernel's grid of two 64-row blocks an SM (wgmma_sp.cu, two_per_sm_split) shows
    in last_tile_plan: on 132 SMs the fewest K splits that make 165 blocks, 6 ways for the 32 tiles
    of 4096 x 4096 at 17 rows and 5 for the 33 of 4096 x 4100 at 64; none at 40 rows on 4096 x 1024
    (8 tiles keep a block an SM). NMCLI_TILE_PLAN=64,8,pair forces 8-way splits, and any other plan
    asked for (64,4) keeps the grid off the call. Every call against the float64 reference with
    poisoned outputs, 1:4, 2:8 and 1:8."""
    if not kernels.cuda_path_supported("wgmma_sp", 64, 2, 8, "float16", 4096):
        pytest.skip("no sm_90a device")
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the grids are sized for 132 SMs")
    for n, m in [(1, 4), (2, 8), (1, 8)]:
        for rows, nout, split in [(17, 4096, 6), (64, 4100, 5)]:
            assert_forced_path_matches_reference(rng, n, m, "float16", rows, 4096, nout, "wgmma_sp")
            assert kernels.last_tile_plan() == (64, split, False, False, False, True), (n, m, rows)
        assert_forced_path_matches_reference(rng, n, m, "float16", 40, 4096, 1024, "wgmma_sp")
        assert not kernels.last_tile_plan()[5]
    nmcli_root = str(Path(kernels.__file__).resolve().parents[1])
    for asked, kind in (("64,8,pair", "pair"), ("64,4", "other")):
        result = subprocess.run([sys.executable, "-c", TWO_PER_SM_SCRIPT, str(Path(__file__).parent), nmcli_root,
                                 kind], env=dict(os.environ, NMCLI_TILE_PLAN=asked), capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, asked + ": " + result.stdout[-2000:] + result.stderr[-2000:]


# Calls whose tile plan (sm90::launch_split, on 132 SMs) is the same for the 2:4, regrouping and
# expanding kernels: (rows, K, Nout, (activation-tile rows, K split, whole waves first, then the last
# wave's tiles split)).
WIDE_TILE_CALLS = [
    (640, 1000, 4000, (160, 1, False)),  # 128 tiles, 4 x 160 rows; K a partial step past 15
    (150, 4104, 6000, (160, 2, False)),  # one partial row tile, 47 weight tiles (the last 112 columns)
    (300, 4104, 11000, (160, 2, True)),  # 172 tiles: a wave, then 40 split; the last row tile overlaps
    (150, 11008, 4104, (160, 3, False)),  # 33 weight tiles, the last 8 columns
    (330, 4104, 3000, (192, 2, False)),  # K a step and 8 positions past 64 steps
    (700, 4096, 4096, (192, 1, False)),  # 128 tiles, the last row tile over the one before
    (520, 4104, 8200, (192, 2, True)),  # 195 tiles: a wave, then 63 split
]


@pytest.mark.parametrize("n,m,path", [(2, 4, "wgmma_sp"), (1, 4, "wgmma_sp"), (2, 8, "wgmma_sp"), (1, 8, "wgmma_sp"),
                                      (4, 16, "wgmma"), (4, 8, "wgmma"), (2, 16, "wgmma")])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout,plan", WIDE_TILE_CALLS)
@pytest.mark.parametrize("index_rows", ["unpadded", "padded"])
def test_warpgroup_kernels_on_160_and_192_row_tiles(rng, n, m, path, dtype_name, rows, k, nout, plan, index_rows):
    """The warpgroup kernels on 160- and 192-row activation tiles (m64n160 and m64n192 MMAs), unsplit,
    with K split over a cluster and with the last wave split, against the float64 reference with
    poisoned outputs. On 132 SMs the launch must also have taken the plan named (last_tile_plan),
    so a change to launch_split's model cannot quietly move these calls to other widths. Rows of
    indices that are not whole 16-byte units go by the kernels' cp.async copies, the same rows padded
    (docs/FORMAT.md version 2) by tensor copy."""
    skip_unless_padding_differs(index_rows, k, nout, n, m)
    assert_forced_path_matches_reference(rng, n, m, dtype_name, rows, k, nout, path, index_rows)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert kernels.last_tile_plan()[:3] == plan


# Regrouping-kernel calls on the 160-row tile whose offset words go by tensor copy (a row's offset
# words a multiple of 4 for 2:8, 1:4 and 1:8 at K = 4096; the calls above have K = 4104, 11008 or
# 1000, whose 2:8 words go by cp.async unless padded): the ring in slots of a group, and for 2:8 a
# warpgroup of regrouping threads (wgmma_sp.cu, launch_regrouped). (rows, K, Nout, plan as above.)
ALIGNED_160_CALLS = [
    (300, 4096, 4096, (160, 2, False)),  # K split over clusters of 2, the last row tile overlapping
    (150, 4096, 14336, (160, 1, False)),  # one partial row tile, 112 weight tiles
    (150, 4096, 1024, (160, 8, False)),  # 8 steps a block: a step a slot (kSlotsFromSteps)
]


@pytest.mark.parametrize("n,m", [(2, 8), (1, 4), (1, 8)])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout,plan", ALIGNED_160_CALLS)
def test_regrouping_kernel_on_160_rows_with_offsets_by_tensor_copy(rng, n, m, dtype_name, rows, k, nout, plan):
    """The regrouping kernel's 160-row tile where its offset words go by tensor copy (the ring in
    slots of a group) against the float64 reference with poisoned outputs, on the plan named."""
    assert_forced_path_matches_reference(rng, n, m, dtype_name, rows, k, nout, "wgmma_sp")
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert kernels.last_tile_plan()[:3] == plan


# Calls of the persistent 2:4 kernel (wgmma_sp.cu, wgmma_sp_persistent_kernel: unsplit 256-row tiles,
# more of them than SMs, of at most 128 steps, one block per SM walking tile after tile through one
# ring and storing each tile by tensor copy), and one just past its bound. (rows, K, Nout, plan as
# above, whether the launch was persistent.)
PERSISTENT_CALLS = [
    (4096, 4096, 4096, (256, 1, False), True),  # 512 tiles, about 4 a block
    (3000, 2056, 4000, (256, 1, False), True),  # offset words by cp.async (unpadded); 34 steps (a half box a tile);
                                                # the last weight tile 32 columns, the last row tile overlapping
    (3000, 4224, 4000, (256, 1, False), True),  # offset words by tensor copy, 66 steps (a half box a tile)
    (2500, 4224, 4000, (256, 2, True), True),  # two waves' tiles persistent, then the last 56 split 2 ways
    (1500, 2056, 9000, (256, 1, False), True),  # 6 activation tiles: raster groups of 4 and 2 (raster_tile_at)
    (3000, 8192, 4000, (256, 1, False), True),  # 128 steps: kPersistentMostSteps
    (3000, 8256, 4000, (256, 1, False), False),  # 130 steps: a block a tile (wgmma_sp_kernel)
]


@pytest.mark.parametrize("rows,k,persistent", [(3000, 5120, True), (3000, 5184, False)])
def test_staged_copies_run_persistent_up_to_80_steps(rng, rows, k, persistent):
    """A 2:8 call that stages its 2:4 copy runs the persistent 2:4 kernel up to 80 steps
    (kPersistentMostStagedSteps, wgmma_sp.cu), a block a tile past them; right either way (float64
    reference, poisoned outputs)."""
    assert_forced_path_matches_reference(rng, 2, 8, "float16", rows, k, 4000, "wgmma_sp")
    assert kernels.cuda_workspace_bytes(rows, 2, 8, k, 4000, "float16", path="wgmma_sp") > 0  # the staged copy
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert kernels.last_tile_plan()[4] == persistent


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout,plan,persistent", PERSISTENT_CALLS)
@pytest.mark.parametrize("index_rows", ["unpadded", "padded"])
def test_persistent_two_of_four_kernel(rng, dtype_name, rows, k, nout, plan, persistent, index_rows):
    """The persistent 2:4 kernel against the float64 reference with poisoned outputs, alpha and bias:
    blocks of several tiles whose boxes of offset words go round the slots across tiles (a tile's
    last box half full), output tiles clipped at Nout, the last row tile overlapping the one before,
    tiles in raster groups and in the plain order of a grid over part of them. On 132 SMs the launch
    must have taken the plan named, persistent or not. Rows of indices also padded to 16-byte units
    where that changes them (K = 2056)."""
    skip_unless_padding_differs(index_rows, k, nout, 2, 4)
    assert_forced_path_matches_reference(rng, 2, 4, dtype_name, rows, k, nout, "wgmma_sp", index_rows)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert kernels.last_tile_plan() == (*plan, False, persistent, False)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (2, 8), (1, 8), (4, 8), (3, 7)])
@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
@pytest.mark.parametrize("rows,k,nout", [(1, 4104, 4300), (2, 4104, 300), (9, 11008, 300), (16, 2056, 130),
                                         (17, 4104, 4100), (64, 11008, 1000), (150, 4104, 1030), (700, 2056, 520)])
def test_padded_and_unpadded_rows_of_indices_on_every_path(rng, n, m, dtype_name, rows, k, nout):
    """Rows of indices padded to whole 16-byte units as pack writes them (docs/FORMAT.md version 2),
    where version 1's unpadded ones are not: every path that takes the call reads both (the
    warpgroup kernels copy padded rows' offset words by tensor copy, unpadded ones by cp.async) and
    matches the float64 reference within the dtype's bound; outputs poisoned."""
    pattern = NMPattern(n, m)
    skip_unless_padding_differs("unpadded", k, nout, n, m)
    x, packed, bias = random_case(rng, pattern, rows, k, nout, dtype_name)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    for path in paths_for(rows, pattern, dtype_name, k):
        for index_rows in ("padded", "unpadded"):
            [y] = run_cuda(x, with_index_rows(packed, index_rows), bias, 0.75, dtype_name, path)
            assert error_ratio(y, ref, magnitude, dtype_name, k) < 1, (path, index_rows)


TF32_FAMILIES = [(2, 4), (1, 4), (2, 8), (1, 8), (4, 8), (2, 16), (4, 16), (8, 16), (4, 32), (8, 32), (16, 32)]


@pytest.mark.parametrize("n,m", TF32_FAMILIES)
@pytest.mark.parametrize("rows,k,nout", [(9, 4100, 300), (17, 4100, 300), (40, 1028, 2000), (64, 2052, 129),
                                         (129, 516, 1000), (300, 4096, 4100), (1100, 132, 700)])
def test_fp32_element_wise_calls_take_the_tf32_warpgroup_kernel(rng, n, m, rows, k, nout):
    """Element-wise fp32 from 9 rows runs on the 3xTF32 warpgroup kernel (wgmma_tf32.cu) and
    keeps fp32's error bound: its 32-, 64- and 128-row activation tiles, K split over a cluster
    (2 and 3 ways), K not a multiple of its 32-position step, Nout not a multiple of its 128-row
    weight tile."""
    assert kernels.cuda_path(rows, n, m, k, nout, "float32") == "wgmma"
    pattern = NMPattern(n, m)
    x, packed, bias = random_case(rng, pattern, rows, k, nout, "float32")
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    for path in ("auto", "wgmma"):
        [y] = run_cuda(x, packed, bias, 0.75, "float32", path)
        assert error_ratio(y, ref, magnitude, "float32", k) < 1, path


def poisoned(packed):
    """The packed weight with every stored value NaN: a call that reads it writes NaN."""
    return PackedWeight(np.full_like(packed.values, np.nan), packed.indices, packed.shape)


@pytest.mark.parametrize("n,m", [(1, 4), (2, 8), (1, 8), (1, 2), (2, 16), (1, 3)])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout", [(1, 4096, 257), (9, 1024, 2048), (12, 4104, 1000), (16, 2048, 77),
                                         (17, 136, 3000), (64, 4104, 1030), (100, 333, 2000), (600, 4104, 130),
                                         (300, 136, 8000), (1100, 264, 3900)])
def test_cuda_reads_the_two_of_four_copy_on_the_sparse_tensor_cores(rng, n, m, dtype_name, rows, k, nout):
    """Calls that carry a 2:4 copy of their weight: the sparse tensor-core path reads the copy,
    every other path the weight. Each call gets the tensor it must not read poisoned with NaN and
    must still match the float64 reference; the dispatch sends the call to the sparse tensor cores
    exactly where it sends a 2:4 weight of the same shape. Weight and copy with their rows of
    indices padded to 16-byte units as pack writes them (docs/FORMAT.md version 2), and where K is
    4104 (which pads them) also unpadded, as version 1 wrote them."""
    pattern = NMPattern(n, m)
    x, packed, bias = random_case(rng, pattern, rows, k, nout, dtype_name)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    for index_rows in ("padded", "unpadded") if k == 4104 else ("padded",):
        weight, copy = with_index_rows(packed, index_rows), with_index_rows(two_of_four_copy(packed), index_rows)
        reads_the_right_tensor(x, weight, copy, bias, ref, magnitude, dtype_name)


def reads_the_right_tensor(x, packed, copy, bias, ref, magnitude, dtype_name):
    """test_cuda_reads_the_two_of_four_copy_on_the_sparse_tensor_cores on one pair of tensors."""
    rows, k, nout = x.shape[0], packed.shape.k, packed.shape.nout
    n, m = packed.shape.pattern.n, packed.shape.pattern.m
    auto = kernels.cuda_path(rows, n, m, k, nout, dtype_name, 0, True)
    assert (auto == "wgmma_sp") == (kernels.cuda_path(rows, 2, 4, k, nout, dtype_name) == "wgmma_sp")
    forced = [p for p in ("decode", "decode_mma", "mma", "wgmma_sp", "tiled")
              if kernels.cuda_path_supported(p, rows, n, m, dtype_name, k, 0, True)]
    for path in ["auto"] + forced:
        reads_copy = (auto if path == "auto" else path) == "wgmma_sp"
        weight, its_copy = (poisoned(packed), copy) if reads_copy else (packed, poisoned(copy))
        [y] = run_cuda(x, weight, bias, 0.75, dtype_name, path, copy=its_copy)
        assert error_ratio(y, ref, magnitude, dtype_name, k) < 1, path


TWO_OF_FOUR_FITS = [(1, 2), (1, 3), (1, 4), (1, 5), (1, 8), (2, 8), (2, 12), (1, 16), (2, 16), (1, 32), (2, 32)]


@pytest.mark.parametrize("n,m", TWO_OF_FOUR_FITS)
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("k,nout", [(1, 3), (7, 5), (64, 67), (100, 33), (4099, 40), (4104, 130)])
@pytest.mark.parametrize("index_rows", ["unpadded", "padded"])
def test_device_two_of_four_copy_matches_the_host_one(rng, n, m, dtype_name, k, nout, index_rows):
    """The 2:4 copy written on the GPU (what the sparse tensor cores stage) is bit for bit the one
    nmcli.format.two_of_four_copy writes: every pattern that fits 2:4, K off the group, off the
    block of 4 and off the 32-position word, partial last groups, the copy's row padding; from the
    weight's rows of indices as written and padded to 16-byte units (docs/FORMAT.md version 2); the
    output buffers start poisoned."""
    pattern = NMPattern(n, m)
    _, packed, _ = random_case(rng, pattern, 1, k, nout, dtype_name)
    want = with_index_rows(two_of_four_copy(packed), "unpadded")  # the staged copy's rows: S4/16 words
    source = with_index_rows(packed, index_rows)
    values = to_device(source.values, dtype_name)
    indices = torch.from_numpy(source.indices.view(np.int32)).cuda()
    copy_values = torch.full(want.values.shape, float("nan"), device="cuda", dtype=TORCH_DTYPE[dtype_name])
    copy_indices = torch.full(want.indices.shape, -1, device="cuda", dtype=torch.int32)
    kernels.cuda_two_of_four_copy(values.data_ptr(), indices.data_ptr(), n, m, k, nout, copy_values.data_ptr(),
                                  copy_indices.data_ptr(), torch.cuda.current_stream().cuda_stream,
                                  index_words=source.indices.shape[1])
    torch.cuda.synchronize()
    want_bits = to_device(want.values, dtype_name).view(torch.int16).cpu().numpy()
    np.testing.assert_array_equal(copy_values.view(torch.int16).cpu().numpy(), want_bits)
    np.testing.assert_array_equal(copy_indices.cpu().numpy().view(np.uint32), want.indices)


@pytest.mark.parametrize("n,m", [(1, 4), (2, 8), (1, 8), (2, 16), (1, 3), (1, 32), (2, 12), (1, 2)])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout", [(9, 1000, 1030), (40, 4104, 300), (600, 1000, 4100), (1000, 4104, 1030),
                                         (2100, 136, 240), (2100, 264, 1000), (4100, 136, 130), (3100, 520, 1030)])
def test_sparse_tensor_cores_stage_a_two_of_four_copy(rng, n, m, dtype_name, rows, k, nout):
    """Calls without a 2:4 copy on the sparse tensor cores: patterns their kernels regroup (1:4,
    2:8, 1:8) stage a copy in the workspace from staged_copy_from_rows rows (K of 4096-14336: 1:8
    640, 1:4 640 to K = 5120 and 768 past it, 2:8 640 below 2^26 weights and 896 from them; else
    2048) and kStagedCopyMinOutputs outputs
    (dispatch.cu; 600 x 4100 and 2100 x 240 do not, 1000 x 1030 at K = 4104, 2100 x 1000, 4100 x 130
    and 3100 x 1030 do), the other patterns that fit 2:4 at any row count. Poisoned workspace and
    outputs, the float64 reference; K off the 64-position step and Nout off the 128-column tile."""
    if not kernels.cuda_path_supported("wgmma_sp", rows, n, m, dtype_name, k):
        pytest.skip("no sm_90a device")
    pattern = NMPattern(n, m)
    x, packed, bias = random_case(rng, pattern, rows, k, nout, dtype_name)
    need = kernels.cuda_workspace_bytes(rows, n, m, k, nout, dtype_name, path="wgmma_sp")
    copy = PackedShape(k, nout, NMPattern(2, 4))
    copy_bytes = nout * (copy.row_len * 2 + copy.index_words * 4)  # fp16 values; the staged copy's rows are unpadded (dispatch.cu)
    regrouped = (n, m) in [(1, 4), (2, 8), (1, 8)]
    staged = regrouped and rows >= kernels.staged_copy_from_rows(n, m, k, nout) and rows * nout >= kernels.STAGED_COPY_MIN_OUTPUTS
    # Unstaged regrouped calls with fewer 256-row tiles than SMs (but more than half as many) keep
    # room for stream-K instead.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = -(-nout // 128) * -(-rows // 256)
    stream_k = regrouped and not staged and rows > 64 and sms < 2 * tiles and tiles < sms
    assert (need >= copy_bytes) == (staged or not regrouped or stream_k)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    [y] = run_cuda(x, packed, bias, 0.75, dtype_name, "wgmma_sp")
    assert error_ratio(y, ref, magnitude, dtype_name, k) < 1


@pytest.mark.parametrize("n,m", [(1, 8), (2, 8), (1, 4)])
@pytest.mark.parametrize("rows", [9, 32, 33, 64])
def test_vector_weights_with_a_copy_take_the_measured_path(rng, n, m, rows):
    """fp16 vector-wise weights that also carry a 2:4 copy: the vector path keeps 1:8 up to 32
    rows, everything else goes to the copy (dispatch.cu, session 26); either way the result is
    right, with the tensor the path must not read poisoned."""
    pattern, k, nout = NMPattern(n, m), 1024, 2048
    vector_path = 8 * n <= m and rows <= 32
    assert kernels.cuda_path(rows, n, m, k, nout, "float16", 32, True) == ("vector" if vector_path else "wgmma_sp")
    x, packed, bias = random_case(rng, pattern, rows, k, nout, "float16", 32)
    copy = two_of_four_copy(packed)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    weight, its_copy = (packed, poisoned(copy)) if vector_path else (poisoned(packed), copy)
    [y] = run_cuda(x, weight, bias, 0.75, "float16", "auto", vector=32, copy=its_copy)
    assert error_ratio(y, ref, magnitude, "float16", k) < 1


@pytest.mark.parametrize("dtype_name", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("rows,k,widths", [(1, 4096, [64, 200, 33]), (12, 1000, [128, 7]), (16, 2048, [77, 128, 1]),
                                           (300, 520, [130, 256, 5, 64]), (1100, 264, [1000, 2000, 900])])
def test_cuda_paths_write_split_outputs(rng, dtype_name, rows, k, widths):
    """A fused sibling group: every path writes consecutive column ranges into separate,
    poisoned tensors; each must equal its columns of the float64 reference."""
    pattern = NMPattern(2, 8)
    x, packed, bias = random_case(rng, pattern, rows, k, sum(widths), dtype_name)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    for path in paths_for(rows, pattern, dtype_name, k):
        start = 0
        for got, width in zip(run_cuda(x, packed, bias, 0.75, dtype_name, path, widths), widths):
            cols = slice(start, start + width)
            assert error_ratio(got, ref[:, cols], magnitude[:, cols], dtype_name, k) < 1, (path, width)
            start += width


@pytest.mark.parametrize("n,m", [(16, 32), (8, 32), (4, 32), (2, 4), (2, 8), (1, 8), (1, 4), (4, 16), (1, 2)])
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,nout,vector", [(17, 132, 100, 32), (200, 4100, 300, 64), (129, 64, 33, 32),
                                                (1100, 264, 3900, 32), (300, 8, 96, 96), (40, 2052, 257, 32),
                                                (20, 4100, 520, 32), (12, 2052, 257, 32)])
def test_vector_path_matches_reference(rng, n, m, dtype_name, rows, k, nout, vector):
    """Weights whose columns share offsets in blocks (prune --vector) on the vector-wise
    tensor-core path (fp32: 3xTF32; fp16, bf16: m16n8k16), forced and through the dispatch, into
    poisoned outputs: K not a multiple of the stage, rows and columns not multiples of the
    tile, partial last blocks; the 32-, 64- and 128-row tiles (fp32 at N/M = 1/8: 64 x 512 from
    65 rows; at 1/4 the swizzled value columns), with K split over a cluster (12, 20, 40 and 200
    rows). 16-bit rows of X are copied 8 elements at a time, so K rounds up to 8."""
    if dtype_name != "float32":
        k += -k % 8
    pattern = NMPattern(n, m)
    x, packed, bias = random_case(rng, pattern, rows, k, nout, dtype_name, vector)
    assert shares_offsets(packed.indices, vector)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    # the dispatch's rule: fp32 from 9 rows; fp16/bf16 at 9..64 rows where N/M <= 1/4
    chosen = dtype_name == "float32" or (4 * n <= m and rows <= 64)
    assert (kernels.cuda_path(rows, n, m, k, nout, dtype_name, vector) == "vector") == chosen
    assert kernels.cuda_path(rows, n, m, k, nout, dtype_name) != "vector"  # nothing promised
    for path in ("vector", "auto"):
        [y] = run_cuda(x, packed, bias, 0.75, dtype_name, path, vector=vector)
        assert error_ratio(y, ref, magnitude, dtype_name, k) < 1, path


@pytest.mark.parametrize("dtype_name,k", [("float16", 2052), ("bfloat16", 100), ("float32", 2050)])
def test_vector_path_refuses_rows_it_cannot_copy(rng, dtype_name, k):
    """The vector path copies rows of X in 16-byte pieces: K must be a multiple of 8 (16-bit) or
    4 (fp32). Otherwise the dispatch takes another path, which is still right."""
    pattern, rows, nout = NMPattern(2, 8), 40, 96
    assert not kernels.cuda_path_supported("vector", rows, 2, 8, dtype_name, k, 32)
    assert kernels.cuda_path(rows, 2, 8, k, nout, dtype_name, 32) != "vector"
    x, packed, bias = random_case(rng, pattern, rows, k, nout, dtype_name, 32)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    [y] = run_cuda(x, packed, bias, 0.75, dtype_name, "auto", vector=32)
    assert error_ratio(y, ref, magnitude, dtype_name, k) < 1


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_vector_path_split_outputs_residual_and_gate(rng, dtype_name):
    """The vector-wise path writes a fused group's column ranges, and adds a residual to a
    gated activation's product (written to the workspace first)."""
    pattern, rows, k = NMPattern(2, 8), 70, 520
    widths = [96, 32, 64]
    x, packed, bias = random_case(rng, pattern, rows, k, sum(widths), dtype_name, 32)
    ref, magnitude = dense_reference(x, unpack(packed), bias, alpha=0.75)
    start = 0
    for got, width in zip(run_cuda(x, packed, bias, 0.75, dtype_name, "vector", widths, vector=32), widths):
        cols = slice(start, start + width)
        assert error_ratio(got, ref[:, cols], magnitude[:, cols], dtype_name, k) < 1, width
        start += width
    nout = sum(widths)
    x_up, residual = random_array(rng, (rows, k), dtype_name), random_array(rng, (rows, nout), dtype_name)
    ref, magnitude = dense_reference(gated_activation(x, x_up), unpack(packed), bias, 0.75, residual=residual)
    xd, ud, rd = (to_device(a, dtype_name) for a in (x, x_up, residual))
    vd, bd = to_device(packed.values, dtype_name), to_device(bias, dtype_name)
    idx = torch.from_numpy(packed.indices.view(np.int32)).cuda()
    need = kernels.cuda_workspace_bytes(rows, 2, 8, k, nout, dtype_name, "silu", "vector")
    workspace = torch.empty(need, dtype=torch.uint8, device="cuda")
    y = torch.full((rows, nout), float("nan"), device="cuda", dtype=TORCH_DTYPE[dtype_name])
    kernels.nm_matmul_cuda(xd.data_ptr(), vd.data_ptr(), idx.data_ptr(), bd.data_ptr(), y.data_ptr(), rows, 2, 8, k,
                           nout, dtype_name, 0.75, torch.cuda.current_stream().cuda_stream, "vector",
                           residual=rd.data_ptr(), x_up=ud.data_ptr(), glu="silu", workspace=workspace.data_ptr(),
                           vector=32, index_words=packed.indices.shape[1])
    torch.cuda.synchronize()
    got = y.float().cpu().numpy().astype(np.float64)
    assert error_ratio(got, ref, magnitude, dtype_name, k, rounded_input=True) < 1


@pytest.mark.parametrize("prologue", ["glu", "norm"])
@pytest.mark.parametrize("dtype_name", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("n,m", [(2, 8), (2, 4), (4, 16)])
@pytest.mark.parametrize("rows,k,nout", [(1, 4096, 257), (1, 1000, 4500), (5, 300, 33), (12, 1000, 200),
                                         (17, 130, 300),
                                         (64, 1024, 2048), (300, 520, 130), (2, 60000, 40),
                                         # the sparse tensor cores stage a 2:4 copy of 2:8 after A
                                         (4100, 136, 1000)])
def test_cuda_paths_fuse_residual_and_prologue(rng, prologue, dtype_name, n, m, rows, k, nout):
    """Y = alpha * A @ W + bias + residual, A = silu(x) * x_up or RMSNorm(x) * weight, on every
    path (the ones off decode write A into a workspace first, before a staged 2:4 copy where there
    is one; K = 60000 stages X in several chunks), from fresh data into poisoned outputs and
    workspaces."""
    pattern = NMPattern(n, m)
    x, packed, bias = random_case(rng, pattern, rows, k, nout, dtype_name)
    x_up, residual = random_array(rng, (rows, k), dtype_name), random_array(rng, (rows, nout), dtype_name)
    gd = to_device(1 + 0.3 * random_array(rng, (k,), dtype_name).astype(np.float32), dtype_name)
    gamma = gd.float().cpu().numpy().astype(x.dtype)  # the stored numbers, rounded to the dtype
    a = gated_activation(x, x_up) if prologue == "glu" else rms_normalised(x, gamma, 1e-5)
    ref, magnitude = dense_reference(a, unpack(packed), bias, 0.75, residual=residual)
    xd, ud, rd = to_device(x, dtype_name), to_device(x_up, dtype_name), to_device(residual, dtype_name)
    vd, bd = to_device(packed.values, dtype_name), to_device(bias, dtype_name)
    idx = torch.from_numpy(packed.indices.view(np.int32)).cuda()
    glu = "silu" if prologue == "glu" else "none"
    for path in paths_for(rows, pattern, dtype_name, k):
        workspace = poisoned_workspace(rows, packed, dtype_name, path, glu, norm=prologue == "norm")
        y = torch.full((rows, nout), float("nan"), device="cuda", dtype=TORCH_DTYPE[dtype_name])
        kernels.nm_matmul_cuda(xd.data_ptr(), vd.data_ptr(), idx.data_ptr(), bd.data_ptr(), y.data_ptr(), rows, n, m,
                               k, nout, dtype_name, 0.75, torch.cuda.current_stream().cuda_stream, path,
                               residual=rd.data_ptr(), x_up=ud.data_ptr() if prologue == "glu" else 0, glu=glu,
                               workspace=workspace.data_ptr() if workspace is not None else 0,
                               norm_weight=gd.data_ptr() if prologue == "norm" else 0, norm_epsilon=1e-5,
                               index_words=packed.indices.shape[1])
        torch.cuda.synchronize()
        got = y.float().cpu().numpy().astype(np.float64)
        assert error_ratio(got, ref, magnitude, dtype_name, k, rounded_input=True) < 1, path


@pytest.mark.parametrize("nm", ["2:4", "2:8"])
@pytest.mark.parametrize("path,rows,wide", [("auto", 96, 2048), ("wgmma_sp", 40, 2048), ("decode", 1, 2048),
                                            ("decode_mma", 8, 2048), ("auto", 4100, 2048),
                                            # decode's whole-row walk for the first call (256 tiles)
                                            ("decode", 2, 8192)])
def test_back_to_back_calls_see_each_others_outputs(rng, nm, path, rows, wide):
    """Three calls on one stream with nothing between them: A reads b0 and writes b1, B reads b1
    and writes b2, C reads b2 and overwrites b0. Kernels launched as programmatic dependents start
    before the previous one ends, so they must wait before reading its output and before writing
    what it may still read; calls that stage a 2:4 copy (2:8 at 4100 rows) share one workspace,
    which each rewrites while the one before may still read it. Each call is checked against the
    float64 reference of its own input as read back afterwards; three rounds, each from fresh data."""
    pattern = NMPattern.parse(nm)
    widths = [1024, wide, 1024, 1024]  # b0 -> b1 -> b2 -> b0
    weights = [pack(w, choose_offsets(np.abs(w), pattern), pattern)
               for w in (random_array(rng, (k, n), "float16") for k, n in zip(widths, widths[1:]))]
    vds = [to_device(packed.values, "float16") for packed in weights]
    ids = [torch.from_numpy(packed.indices.view(np.int32)).cuda() for packed in weights]
    buffers = [torch.empty(rows, width, device="cuda", dtype=torch.float16) for width in widths[:3]]
    # Outputs of about unit scale (unscaled, the third would overflow fp16).
    alphas = [float(1 / np.sqrt(np.mean(unpack(packed) ** 2) * k)) for packed, k in zip(weights, widths)]
    needs = [kernels.cuda_workspace_bytes(rows, pattern.n, pattern.m, k, n, "float16", path=path)
             for k, n in zip(widths, widths[1:])]
    workspace = torch.empty(max(needs), dtype=torch.uint8, device="cuda") if max(needs) else None
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(3):
        buffers[0].copy_(to_device(random_array(rng, (rows, widths[0]), "float16"), "float16"))
        inputs = [buffers[0].clone()]
        for b in buffers[1:]:
            b.fill_(float("nan"))
        for i, packed in enumerate(weights):
            src, dst = buffers[i], buffers[(i + 1) % 3]
            kernels.nm_matmul_cuda(src.data_ptr(), vds[i].data_ptr(), ids[i].data_ptr(), 0, dst.data_ptr(), rows,
                                   pattern.n, pattern.m, widths[i], widths[i + 1], "float16", alphas[i], stream, path,
                                   workspace=workspace.data_ptr() if needs[i] else 0,
                                   index_words=packed.indices.shape[1])
        torch.cuda.synchronize()
        seen = [inputs[0]] + buffers[1:] + [buffers[0]]
        for i, packed in enumerate(weights):
            x = seen[i].float().cpu().numpy()
            ref, magnitude = dense_reference(x, unpack(packed), alpha=alphas[i])
            got = seen[i + 1].float().cpu().numpy().astype(np.float64)
            assert error_ratio(got, ref, magnitude, "float16", widths[i]) < 1, (path, i)


def test_cuda_copy_kernel_copies_and_refuses_misaligned():
    """The copy-bandwidth ceiling's kernel copies every byte (a size that leaves a partial pass),
    and refuses sizes or pointers that are not 16-byte multiples with an error."""
    nbytes = 16 * 1_000_003
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    kernels.cuda_copy(dst.data_ptr(), src.data_ptr(), nbytes, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    for args in [(dst.data_ptr(), src.data_ptr(), nbytes - 8), (dst.data_ptr() + 8, src.data_ptr(), 16)]:
        with pytest.raises(RuntimeError, match="cuda_copy failed"):
            kernels.cuda_copy(*args)


@needs_ort_cuda
@pytest.mark.parametrize("prefill_copy", [False, True])
def test_ort_cuda_llama_block_with_fused_neighbours(rng, prefill_copy):
    """A LLaMA-style block whose residual adds and SiLU gate moved into the op: CUDA EP (plain,
    and CUDA-graph replay at decode and prefill sizes, where the gate goes through ORT's arena)
    against the CPU EP; with 2:4 copies too (at 200 tokens Q/K/V and gate/up read them)."""
    import onnxruntime as ort

    import nmcli
    from nmcli.llama import LlamaConfig, llama_model
    dense = llama_model(LlamaConfig(hidden=256, ffn=688, heads=4, layers=2, dtype="float16"), rng)
    pruned, report = nmcli.prune_model(dense, nmcli.Selection(nmcli.NMPattern(2, 8)), prefill_copy=prefill_copy)
    assert report.fused == {"glu": 2, "norm": 4, "residual": 4}
    assert (report.prefill_copy_bytes > 0) == prefill_copy
    for tokens in (1, 40, 200):
        x = rng.standard_normal((1, tokens, 256)).astype(np.float16)
        (expected,) = nmcli.session(pruned).run(None, {"x": x})
        for graph in (False, True):
            sess = nmcli.session(pruned, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graph else "0"})])
            x_dev = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
            y_dev = ort.OrtValue.ortvalue_from_numpy(np.full(expected.shape, np.nan, np.float16), "cuda", 0)
            binding = sess.io_binding()
            binding.bind_ortvalue_input("x", x_dev)
            binding.bind_ortvalue_output("y", y_dev)
            for _ in range(3):
                sess.run_with_iobinding(binding)
                assert relative_error(y_dev.numpy(), expected.astype(np.float64)) < 3e-3, (tokens, graph)


@needs_ort_cuda
def test_ort_cuda_op_passes_the_copy_to_the_sparse_tensor_cores(rng):
    """A model whose weight values are NaN but whose 2:4 copy is right: on the CUDA EP, calls of
    300 rows (the sparse tensor cores) match the CPU EP on the intact model; calls of 4 rows (the
    decode path, which reads the weight) come out NaN. So the op passes the copy where it says."""
    import nmcli
    from models import matmul_model
    from onnx import numpy_helper
    w = rng.standard_normal((512, 2048)).astype(np.float16)
    pruned, _ = nmcli.prune_model(matmul_model(w, ["rows", 512]), nmcli.Selection(nmcli.NMPattern(2, 8)),
                                  prefill_copy=True)
    broken = type(pruned)()
    broken.CopyFrom(pruned)
    values_name = next(n.input[1] for n in broken.graph.node if n.op_type == "NMMatMul")
    for i, t in enumerate(broken.graph.initializer):
        if t.name == values_name:
            broken.graph.initializer[i].CopyFrom(
                numpy_helper.from_array(np.full_like(numpy_helper.to_array(t), np.nan), values_name))
    cuda = nmcli.session(broken, providers=["CUDAExecutionProvider"])
    assert cuda.get_providers()[0] == "CUDAExecutionProvider"  # not a silent fall-back to the CPU EP
    for rows in (300, 4):
        x = rng.standard_normal((rows, 512)).astype(np.float16)
        (expected,) = nmcli.session(pruned).run(None, {"x": x})
        (got,) = cuda.run(None, {"x": x})
        if rows == 300:
            assert relative_error(got, expected.astype(np.float64)) < 2e-3
        else:
            assert np.isnan(got).all()


@needs_ort_cuda
def test_ort_cuda_op_reads_padded_and_unpadded_rows_of_indices(rng):
    """A model whose rows of indices, in the weight and in its 2:4 copy, are padded to 16-byte units
    as nmcli writes them (docs/FORMAT.md version 2; K = 4104 leaves both short of whole units
    unpadded), and the same model with version 1's unpadded rows: on the CUDA EP, calls of 4 rows
    (the decode path, reading the weight) and 300 rows (the sparse tensor cores, reading the copy)
    match the CPU EP."""
    import nmcli
    from models import matmul_model
    from onnx import numpy_helper
    w = rng.standard_normal((4104, 1024)).astype(np.float16)
    pruned, _ = nmcli.prune_model(matmul_model(w, ["rows", 4104]), nmcli.Selection(nmcli.NMPattern(2, 8)),
                                  prefill_copy=True)
    node = next(n for n in pruned.graph.node if n.op_type == "NMMatMul")
    unpadded_model = type(pruned)()
    unpadded_model.CopyFrom(pruned)
    for name, pattern in ((node.input[2], NMPattern(2, 8)), (node.input[8], NMPattern(2, 4))):
        shape = PackedShape(4104, 1024, pattern)
        assert shape.padded_index_words > shape.index_words
        for i, t in enumerate(unpadded_model.graph.initializer):
            if t.name == name:
                words = numpy_helper.to_array(t)
                assert words.shape == (1024, shape.padded_index_words) and not words[:, shape.index_words:].any()
                unpadded = np.ascontiguousarray(words[:, : shape.index_words])
                unpadded_model.graph.initializer[i].CopyFrom(numpy_helper.from_array(unpadded, name))
    on_cpu = nmcli.session(pruned)
    for model in (pruned, unpadded_model):
        cuda = nmcli.session(model, providers=["CUDAExecutionProvider"])
        assert cuda.get_providers()[0] == "CUDAExecutionProvider"
        for rows in (4, 300):
            x = rng.standard_normal((rows, 4104)).astype(np.float16)
            (expected,) = on_cpu.run(None, {"x": x})
            (got,) = cuda.run(None, {"x": x})
            assert relative_error(got, expected.astype(np.float64)) < 2e-3, (rows, model is pruned)


def _pruned_block(rng, dtype, permute=False, fuse=True, vector=0):
    import nmcli
    from nmcli.toymodels import transformer_block
    model, _ = transformer_block(rng, hidden=256, ffn=688, dtype=dtype)
    pruned, _ = nmcli.prune_model(model, nmcli.Selection(nmcli.NMPattern(2, 8)), permute=permute, fuse=fuse,
                                  vector=vector)
    return pruned


@needs_ort_cuda
@pytest.mark.parametrize("dtype,permute,fuse,vector", [(np.float16, False, True, 0), (np.float32, False, True, 0),
                                                       (np.float16, True, True, 0), (np.float16, False, False, 0),
                                                       (np.float32, False, True, 32), (np.float16, False, True, 32)])
def test_ort_cuda_matches_cpu_without_memcpy(rng, tmp_path, dtype, permute, fuse, vector):
    import onnx
    import onnxruntime as ort

    import nmcli
    pruned = _pruned_block(rng, dtype, permute, fuse, vector)
    assert any(n.op_type == "Gather" for n in pruned.graph.node) == permute
    assert any(len(n.output) > 1 for n in pruned.graph.node if n.op_type == "NMMatMul") == fuse
    # vector: 40 rows, past the decode path, so the promised blocks reach the vector-wise path
    x = rng.standard_normal((2, 20 if vector else 5, 256)).astype(dtype)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    # ORT's own fp32 MatMuls (attention scores) run in TF32 unless told not to; we compare exact math.
    cuda = nmcli.session(pruned, providers=[("CUDAExecutionProvider", {"use_tf32": "0"})], sess_options=options)
    assert cuda.get_providers()[0] == "CUDAExecutionProvider"
    (y_cuda,) = cuda.run(None, {"x": x})
    (y_cpu,) = nmcli.session(pruned).run(None, {"x": x})
    assert relative_error(y_cuda, y_cpu.astype(np.float64)) < (2e-3 if dtype == np.float16 else 1e-5)
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    ops = [n.op_type for n in optimized.graph.node]
    assert ops.count("NMMatMul") == (4 if fuse else 6)  # fused: Q/K/V as one op
    assert not [o for o in ops if o.startswith("Memcpy")], ops


@needs_ort_cuda
@pytest.mark.parametrize("tokens", [4, 2400])
def test_ort_cuda_io_binding_and_cuda_graph(rng, tokens):
    """IO binding and ORT's CUDA-graph capture and replay, at 4 tokens and at 2400, where the fused
    2:8 gate/up projection (1376 wide) stages a 2:4 copy in a workspace from ORT's arena
    (kernels/cuda/dispatch.cu)."""
    import onnxruntime as ort

    import nmcli
    pruned = _pruned_block(rng, np.float16)
    x = rng.standard_normal((1, tokens, 256)).astype(np.float16)
    (expected,) = nmcli.session(pruned).run(None, {"x": x})
    for graph in (False, True):
        providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graph else "0"})]
        sess = nmcli.session(pruned, providers=providers)
        x_dev = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
        y_dev = ort.OrtValue.ortvalue_from_numpy(np.full(expected.shape, np.nan, np.float16), "cuda", 0)  # poisoned
        binding = sess.io_binding()
        binding.bind_ortvalue_input("x", x_dev)
        binding.bind_ortvalue_output("y", y_dev)
        for _ in range(3):  # with enable_cuda_graph the first run captures, later runs replay
            sess.run_with_iobinding(binding)
            assert relative_error(y_dev.numpy(), expected.astype(np.float64)) < 2e-3
        x_dev.update_inplace(rng.standard_normal(x.shape).astype(np.float16))  # replay must see new inputs
        sess.run_with_iobinding(binding)
        (fresh,) = nmcli.session(pruned).run(None, {"x": x_dev.numpy()})
        assert relative_error(y_dev.numpy(), fresh.astype(np.float64)) < 2e-3


@needs_ort_cuda
def test_serve_example_on_cuda(tmp_path, rng):
    """examples/serve.py --cuda runs the converted model on the CUDA EP and agrees with the CPU EP."""
    import importlib.util
    import pathlib
    import subprocess
    import sys

    import onnx
    root = pathlib.Path(__file__).resolve().parents[1]
    path = tmp_path / "block.nm.onnx"
    onnx.save_model(_pruned_block(rng, np.float16), str(path))
    result = subprocess.run([sys.executable, str(root / "examples" / "serve.py"), str(path), "--cuda"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "provider: CUDAExecutionProvider" in result.stdout
    spec = importlib.util.spec_from_file_location("serve", root / "examples" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    y_cuda, y_cpu = serve.main(str(path), True), serve.main(str(path), False)
    assert relative_error(y_cuda, y_cpu.astype(np.float64)) < 2e-3


def test_cusparselt_column_prunes_two_of_four_and_times_a_checked_product():
    """nmcli bench kernels' cuSPARSELt 2:4 column: the weight keeps the 2 largest magnitudes of
    every 4 along K; where this torch has cuSPARSELt, fp16 and bf16 calls (row counts it needs
    padded among them) get a positive time, with the algorithm its search picked, after their
    product matched the dense one; fp32 none."""
    from nmcli import bench_kernels as bk

    w = torch.randn(96, 256, device="cuda")
    groups = bk.two_of_four_pruned(torch, w).reshape(96, 64, 4)
    kept = groups != 0
    assert (kept.sum(-1) == 2).all()
    magnitudes = w.reshape(96, 64, 4).abs()
    smallest_kept = torch.where(kept, magnitudes, torch.inf).amin(-1)
    largest_dropped = torch.where(kept, -torch.inf, magnitudes).amax(-1)
    assert (smallest_kept >= largest_dropped).all()
    if not bk.has_cusparselt(torch):
        pytest.skip("this torch has no cuSPARSELt")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    searches = hasattr(torch, "_cslt_sparse_mm_search")
    for m, k, n, dtype in [(1, 4096, 4096, "float16"), (17, 4096, 1024, "bfloat16"), (300, 2048, 4096, "float16")]:
        ms, how = bk.time_cusparselt(torch, m, k, n, dtype, l2, replays=5)
        assert ms > 0 and how.startswith("searched" if searches else "default algorithm"), (m, k, n, dtype, how)
    assert bk.time_cusparselt(torch, 16, 4096, 4096, "float32", l2)[0] is None


def test_bench_kernels_reports_cusparselt_beside_cublas(tmp_path):
    """`nmcli bench kernels --json`: every row carries the point's cuSPARSELt 2:4 time where this
    torch has it, and the run says how each point was timed; --no-cusparselt leaves it out."""
    import json
    import subprocess
    import sys
    from nmcli import bench_kernels as bk

    def bench(*extra):
        result = subprocess.run([sys.executable, "-m", "nmcli", "bench", "kernels", "--shapes", "llama", "--rows", "17",
                                 "--nm", "2:4", "--replays", "5", "--json", *extra], cwd=tmp_path,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    report = bench("--nm", "2:8")
    assert len(report["rows"]) == 2 * len(bk.LLAMA_KN)
    if not bk.has_cusparselt(torch):
        assert all(r["cusparselt_ms"] is None for r in report["rows"])
    else:
        assert report["cusparselt"] and sum(len(p) for p in report["cusparselt_timing"].values()) == len(bk.LLAMA_KN)
        assert all(r["cusparselt_ms"] > 0 for r in report["rows"])
        by_point = {}
        for r in report["rows"]:
            by_point.setdefault((r["k"], r["n"]), set()).add(r["cusparselt_ms"])
        assert all(len(times) == 1 for times in by_point.values())  # one time per point, on every pattern
    report = bench("--no-cusparselt")
    assert report["cusparselt_timing"] == {} and all(r["cusparselt_ms"] is None for r in report["rows"])


@needs_ort_cuda
def test_bench_model_on_cuda(tmp_path):
    """nmcli bench on the CUDA EP: IO binding, the op timer's CUDA events, memory readings."""
    import json
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "nmcli", "demo", "--hidden", "512", "--ffn", "1024", "--heads", "8",
                             "--layers", "1", "--runs", "10", "--tokens", "1", "--tokens", "64", "--output-dir",
                             str(tmp_path / "demo"), "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["provider"] == "CUDAExecutionProvider"
    assert report["dense"]["gpu_bytes"] > report["sparse"]["gpu_bytes"] > 0
    for s in report["settings"]:
        assert 0 < s["nm_op_ms"] < s["sparse"]["p50_ms"]
        assert s["agreement"][0]["cosine"] > 0.3


@needs_ort_cuda
def test_bench_model_with_cuda_graphs(tmp_path):
    """--cuda-graph: both models replayed as ORT-captured CUDA graphs, one graph per shape."""
    import json
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "nmcli", "demo", "--hidden", "512", "--ffn", "1024", "--heads", "8",
                             "--layers", "1", "--runs", "10", "--tokens", "1", "--tokens", "16", "--cuda-graph",
                             "--output-dir", str(tmp_path / "demo"), "--json"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["cuda_graph"] is True and len(report["settings"]) == 2
    for s in report["settings"]:
        assert s["sparse"]["p50_ms"] > 0 and s["nm_op_ms"] > 0
        assert s["agreement"][0]["cosine"] > 0.3
