// Picks the path for a call and launches it.
//
// Rule (measured crossovers in BENCHMARKS.md, session 3: nmcli_bench --path decode|mma on
// LLaMA shapes at 1..32 rows; session 5: --path mma|wgmma at 64..4096 rows; session 11:
// --path mma|wgmma_sp at 8..256 rows on the LLaMA and nmSPARSE shapes; session 34: decode, mma
// and wgmma_sp at 1..16 rows and the warpgroup paths on N = 1024 and 2048; session 35: decode,
// decode_mma and wgmma_sp at 1..16 rows, scratch/small35.py, then ab_kernels --path auto; session
// 36, on an H200: decode_mma reworked, ab_kernels --path auto --path decode_mma (both builds) and
// --path decode --path wgmma_sp at 2-16 rows on six K = 4096 shapes, run A; the rule, run B;
// session 37: decode_mma with K split over a cluster, ab_kernels --path auto|decode|decode_mma|
// wgmma_sp at 2-16 rows on 11008 and 14336 x 4096, then the rule against HEAD; session 38:
// decode_mma faster (each warp copies its own steps' activations), ab_kernels --path
// auto|decode|decode_mma|wgmma_sp at 1-8 rows on nine shapes, 2048 x 2048 to 4096 x 28672):
//  * 2:4, 1:4, 2:8 and 1:8 from a few rows (fp16/bf16, K % 8 == 0, the activations of the whole K
//    in the shared memory of one block or, K split over a cluster on compute capability 9.0, of up
//    to 8: K up to 34816-38912 at 9..16 rows, 60416-83968 at 1..8, by family): the decode-sized
//    tensor-core kernel (decode_mma.cu), to 16 rows (2:4 to 8). Where Nout <= 1024 it starts at 1
//    row for groups of 4 (1:4, 2:4) and 2 for groups of 8 (session 38: 1.08x and 1.26x decode at 1
//    row on 4096 x 1024 for 1:4 and 2:4, level for 1:8 and 2:8; session 36: 1.14-1.34x decode at 2
//    rows, every family), else at 3 for groups of 4 (1.04-1.76x decode at 3 rows, 2048 x 2048 to
//    4096 x 28672) and for groups of 8 at 3 where Nout <= 16384, else 5 (session 38: 1.02-1.08x
//    decode at 3 rows on 4096 x 11008 and 14336; decode 1.07-1.09x at 3-4 rows on 4096 x 28672;
//    session 36: at 2 rows decode won on 2048 x 2048 and wider). Since session 62, 2:4 (the sparse
//    mma.sync, no fragment to build) starts at 1 row up to 6144 wide where one block holds K (at 2
//    below K = 2048; decode_mma_from_rows has the measurements) and keeps 3-4 rows there
//    (choose_path has those). 2:4 takes it to 8 rows up to 4096 wide (session 38: 1.08-1.15x the
//    sparse tensor cores at 5-8 rows on 4096 x 1024, which session 36 gave to them); wider, the
//    sparse tensor cores take 2:4 from 3 rows (session 59, H200, ab_kernels --path
//    auto|decode_mma|wgmma_sp|decode at 3, 4 and 8 rows: wgmma_sp 1.10-1.21x decode_mma on 4096 x
//    6144, 1.22-1.36x on 4096 x 11008 and 14336, 1.19-1.26x on 4096 x 28672; on 4096 x 4096 0.98x
//    at 3 rows, 1.02x at 4, 1.10x at 8; session 38 had found them ahead only at 7-8 rows on 4096 x
//    14336, before sessions 39-58 made them faster). Session 36 against the rule before it (run B,
//    100 points at 2-8 rows on 4096 x 1024, 6144, 14336, 22016, 28672): 68 points 1.02-1.76x, 31
//    within 2%. Session 35 (the first version): 1.34-1.73x the rule before it at 9-16 rows on the
//    K = 4096 LLaMA projections (wgmma_sp before). Calls that read a 2:4 copy keep it from 9 rows,
//    as does 2:4. Where it splits K (the down projections), groups of 8 start at 5 rows while
//    decode stages K once (session 37: decode 1.04-1.18x at 4 rows on 11008 x 4096; session 38:
//    for 1:4 decode_mma 1.03-1.05x at 3-4 rows there), and 2:4 takes the sparse tensor cores from
//    3 rows (session 37: against the rule before, 1.07-1.97x at 3-16 rows on 11008 and 14336 x
//    4096 where the choice changed); since session 68 only on outputs at least kDecodeFullGridNout
//    wide: narrower, where decode's grid leaves SMs idle, decode_mma_from_rows has the rule.
//  * 4:8 and 4:16 (fp16/bf16, the same K limits but 4:16's, 34816 and 68608) on decode_mma
//    (session 46, H100, ab_kernels --path decode|decode_mma|mma at 1-16 rows on eight shapes, 4096
//    x 1024 to 4096 x 28672: at 12-16 rows 1.55-2.96x the faster of decode and mma everywhere).
//    Session 48 (pair keys; H100, ab_kernels --path decode_mma --path decode at 2-16 rows on seven
//    shapes, 4096 x 1024 to 4096 x 28672) refit the first rows: at 5-8 rows decode_mma 1.15-2.70x
//    decode everywhere, the down projections too; at 3-4 rows 1.04-1.88x up to 4096 wide (but 0.89x
//    and 0.99x on 11008 x 4096, where decode stages K once), 0.83-1.06x wider; at 2 rows only on
//    4096 x 1024 (1.18x and 1.45x; 0.70-0.91x elsewhere). So the rule of groups of 8 with 4096
//    for 16384.
//  * 2:4 at 5..8 rows where decode_mma does not take it: the sparse tensor cores where their grid
//    is as wide as from 9 rows (session 35: 1.25-2.46x decode at 5-8 rows, ab_kernels run D).
//  * Otherwise 1..8 rows: the decode path.
//  * 2:4, 1:4, 2:8 and 1:8 (fp16/bf16, K % 8 == 0, compute capability 9.0): the sparse tensor
//    cores (wgmma_sp.cu) from 9 rows where the output has at least 8 weight tiles (Nout > 896)
//    or the grid of smallest tiles (64 activation rows x 128 weight rows) at least 16 blocks.
//    Session 34, with K split up to 8 ways (sm90::launch_split): against the rule before
//    (scripts/ab_kernels.py --path auto, both builds in one process), 1.02-1.88x at 9 and 16 rows
//    for 2:8, 1:8 and 1:4 on the five LLaMA shapes (decode or mma before; scratch/small34.py
//    found wgmma_sp ahead of both at 9-16 rows at every point it timed); on N = 1024 (4096 and
//    8192 x 1024) 1.90-2.99x at 9-16 rows, 2:4 2.43-3.22x, and 1.89-3.01x at 17-64 rows, where
//    the mma path ran before. Until session 34 the rule was session 11's: from 17 rows, 2:4 from
//    9, with 16 blocks; at 9..16 rows decode or mma were then ahead of or level with wgmma_sp on
//    3 of 5 LLaMA shapes for 2:8 and 4 of 5 for 1:8, and 8 blocks kept the mma path (0.66-0.91x).
//    At 8 rows decode stays: wgmma_sp was 1.24-1.76x faster on N = 1024 but slower on 4096 x 4096.
//  * The families the expanding warpgroup kernel (wgmma.cu) compiles: from 17 rows where Nout
//    gives at least 8 weight tiles (Nout > 896), else from 128 rows when its grid of 64-row
//    tiles has at least 16 blocks. Session 34 (splits up to 8 ways; ab_kernels --path auto on
//    4096 and 8192 x 1024, 4:8, 4:16 and 2:16): 1.91-2.76x the mma path at 17-64 rows. Session 30
//    (`nmcli bench kernels --shapes nmsparse --path mma|wgmma` at 17-512 rows, splits up to 2):
//    with 16 weight tiles wgmma ran 1.11-1.46x the mma path at 17-64 rows, with 32 or more
//    1.65-8.01x at every row count. Grids under 8 weight tiles and 16 blocks were not measured and
//    keep the mma path.
//  * From 9 rows otherwise the mma path where it applies (fp16/bf16, M in {2,4,8,16}; split-K
//    over a cluster keeps small row counts fast), except at 9..16 rows for N/M <= 1/4 when the
//    decode kernel stages the whole K at once (session 8, --path decode|mma at 12 and 16 rows:
//    decode 1.06-1.33x the mma path for 2:8 and 1:8 with K = 4096; mma ahead at 2:4 and at
//    K = 11008 or 14336, where decode stages K in two chunks); else decode up to 16 rows and the
//    tiled SIMT path above.
//  * A call that carries a 2:4 copy of its weight (docs/FORMAT.md) takes the sparse tensor cores
//    on the copy wherever 2:4 would (from 9 rows), unless the vector path takes it first. Session
//    26 (scratch/copy_ab.py: the same calls with and without the copy, in one process, at 9, 12,
//    16, 17, 64, 512 and 4096 rows on the five LLaMA shapes, 2:8, 1:4 and 1:8): the copy was
//    faster at all 105 points, 1.38-2.28x against decode or mma at 9-16 rows, 1.14-1.81x against
//    the regrouping kernel at 17-64, 1.03-1.45x at 512 and 4096. Vector-wise fp16 weights with a
//    copy (`nmcli bench kernels --vector 32 --prefill-copy [--path wgmma_sp]`, 9-64 rows, same
//    shapes): the vector path kept 1:8 up to 32 rows (copy 0.59-0.87x of it) and lost it from 48
//    (1.01-1.27x); for 2:8 and 1:4 the copy ran 0.86-1.19x of the vector path at 9-32 rows (below
//    1 mostly on 4096x14336) and 1.37-1.70x from 48, so those take the copy from 9 rows. Session
//    34 (scratch/copy34.py, 9-16 rows on 4096 and 8192 x 1024, 2:8, 1:8, 1:4): the copy on the
//    sparse tensor cores ran 1.77-3.00x the faster of decode and mma on the weight.
//  * From staged_copy_from_rows rows (nm_matmul_cuda.h: 640-896 by family and weight size where K
//    is 4096-14336, else 2048), fp16/bf16 1:4, 2:8 and 1:8 weights that carry no 2:4 copy have the
//    sparse tensor cores read one staged in the call's workspace: one kernel writes it
//    (two_of_four_copy.cu, at 79-99% of the copy bandwidth on the LLaMA projections on the H100,
//    86-99% on the H200 since session 65 but on 4096 x 1024), the 2:4 kernel reads it, where the
//    regrouping kernel rebuilt the same 2:4 tiles in every block that read them (a weight tile once
//    per activation tile). Session 40 (H100, ab_kernels --path wgmma_sp against HEAD with the
//    staging forced from 256 rows, 2:8, 1:8 and 1:4 on 4096 x 4096, 11008 x 4096, 4096 x 14336 and
//    14336 x 4096): 0.72-0.95x at 512 rows, 0.96-1.15x at 1024 (below 1 only on 11008 x 4096),
//    1.00-1.26x at 2048 and 1.04-1.28x at 4096. On narrow outputs it lost or tied (session 41:
//    0.85-0.96x at 2.1M output entries, 0.95-1.04x at 1M), so it also needs rows x Nout of
//    kStagedCopyMinOutputs (3 x 2^20 then, 2^19 since session 63). Session 55 moved it from 1024
//    rows, where the regrouping kernel (faster since session 40) had come to beat the staged copy (H100, ab_kernels
//    --path auto against a build that never stages, on 4096 x 4096, 11008 x 4096, 4096 x 11008,
//    4096 x 14336 and 14336 x 4096): at 1024 rows the regrouping kernel ran 1.06-1.16x the staged
//    copy for 2:8, 0.99-1.11x for 1:4 and 0.95-1.09x for 1:8; at 2048 rows 0.93-1.01x, 0.88-0.97x
//    and 0.88-0.98x. Session 63 (H200) launched the copy's kernel and the 2:4 kernel behind it as
//    programmatic dependents, which took 1-3 us off every staged call, and refit the rows: see
//    stages_copy. Other patterns that fit 2:4 (2:16, 1:16, 1:3, 2:32, ...) reach the sparse
//    tensor cores only that way: see staging_pays for where.
//  * fp32, element-wise: the 3xTF32 warpgroup kernel (wgmma_tf32.cu) from 9 rows, for the families
//    it compiles; else decode up to 16 rows and the tiled SIMT path above. Session 27
//    (scratch/tf32.py: decode, tiled and wgmma timed in one process at 9-4096 rows on 4096x4096,
//    11008x4096 and 4096x14336, 2:4, 2:8, 1:8): against the tiled path it replaces, 5.3-8.6x at 17
//    rows. Session 28, with the weight fed from registers (scratch/tf32.py paths: decode and wgmma
//    at 9, 12 and 16 rows on the five LLaMA shapes, 2:4, 2:8, 1:4, 1:8, 2:16 and 4:32): wgmma
//    1.56-2.51x decode for 2:8, 1.04-1.75x for 1:8, 1.69-2.69x for 1:4, 1.13-1.78x for 2:16,
//    2.50-3.87x for 2:4, and 0.99-1.53x for 4:32 (below 1 at 2 of 15 points, by 1%).
//  * Weights whose columns share offsets in blocks of 32 (`vector`): the vector-wise tensor-core
//    path (vector.cu) where it applies, from 9 rows for fp32, and for fp16/bf16 at 9..64 rows
//    where N/M <= 1/4.
//    - fp32, session 21 (scratch timing of both paths at 17, 64, 128, 256 rows on 4096x4096,
//      11008x4096, 4096x14336; 2:4, 2:8, 1:8): 1.86-11.7x the tiled path it replaces at every
//      point. Session 22 (small row tiles, K split over a cluster): 1.04-6.9x cuBLAS fp32 from
//      17 rows on LLaMA shapes (17-512 rows swept on 4096x4096 and 11008x4096); against decode
//      on those three shapes and families, 2.7-6.2x at 9, 12 and 16 rows, 0.93-1.45x at 8 and
//      0.55-0.84x at 4, so 1..8 rows stay on decode.
//    - fp16, session 23 (`nmcli bench kernels --dtype float16 [--vector 32] --shapes llama`, and
//      scratch/vec16.py forcing each path): against the element-wise choice (decode, mma or
//      wgmma_sp) for 2:8, 1:8 and 1:4, 1.57-2.52x at 9 rows, 1.23-2.58x at 17, 0.90-1.56x at 64
//      (below 1 only on the wide outputs 4096x11008 and 4096x14336 for 2:8 and 1:4); at 256 and
//      4096 rows 0.41-0.94x of wgmma_sp; 2:4 loses to wgmma_sp at every row count. At 8 rows
//      each won some (vector 4 of 7 points, by 1.05-1.27x; decode 3, by 1.04-1.14x) and at 2-4
//      rows decode was 1.1-2.0x faster, so 1..8 rows stay on decode here too.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include "kernels.cuh"
#include "nm_matmul_cuda.h"

namespace nmcli {
namespace {

// Whether the product reads a transformed activation A (gated or normalised), not X itself.
bool forms_activation(const CudaMatMul& c) { return c.glu != Glu::none || c.norm_weight != nullptr; }

// Whether the rows of the product's activation start 16-byte aligned: a gated or normalised call
// reads A from the (aligned) workspace, others X itself.
bool activation_aligned(const CudaMatMul& call) {
  return forms_activation(call) || reinterpret_cast<uintptr_t>(call.x) % 16 == 0;
}

template <typename T>
PathParams<T> typed(const CudaMatMul& c) {
  PathParams<T> p;
  p.x = static_cast<const T*>(c.x);
  p.values = static_cast<const T*>(c.values);
  p.indices = c.indices;
  p.bias = static_cast<const T*>(c.bias);
  p.residual = static_cast<const T*>(c.residual);
  p.x_up = static_cast<const T*>(c.x_up);
  p.glu = c.glu;
  p.norm_weight = static_cast<const T*>(c.norm_weight);
  p.norm_epsilon = c.norm_epsilon;
  p.y = c.y.as<T>();
  p.rows = c.rows;
  p.k = c.shape.k;
  p.nout = c.shape.nout;
  p.groups = c.shape.groups;
  p.row_len = c.shape.row_len;
  p.index_words = c.shape.index_words;
  p.n = c.shape.n;
  p.m = c.shape.m;
  p.bits = c.shape.bits;
  p.alpha = c.alpha;
  return p;
}

// Where a stream-K launch of the sparse tensor cores keeps its flags and partial sums (null where
// the call has no room for them).
struct StreamKSpace {
  uint32_t* flags = nullptr;
  float* partials = nullptr;
};

// `staged`: the weight `c` reads is the 2:4 copy the call just wrote into its workspace.
template <typename T>
cudaError_t run(const CudaMatMul& c, cudaStream_t stream, CudaPath path, bool staged, StreamKSpace stream_k) {
  if (path == CudaPath::decode) {
    DecodeParamsT<T> p;
    static_cast<PathParams<T>&>(p) = typed<T>(c);
    return run_decode<T>(p, stream);  // gates or normalises while it stages X
  }
  PathParams<T> p = typed<T>(c);
  p.weight_from_stream = staged;
  p.flags = stream_k.flags;
  p.partials = stream_k.partials;
  if (path == CudaPath::decode_mma) return run_decode_mma<T>(p, stream);  // so does this one
  if (forms_activation(c)) {  // the other paths copy X as it is: write A out first
    T* a = static_cast<T*>(c.workspace);
    const cudaError_t e = p.norm_weight ? run_rms_norm<T>(p.x, p.norm_weight, p.norm_epsilon, a, p.rows, p.k, stream)
                                        : run_glu<T>(p.x, p.x_up, p.glu, a, p.rows * p.k, stream);
    if (e != cudaSuccess) return e;
    p.x = a;
    p.x_up = nullptr;
    p.glu = Glu::none;
    p.norm_weight = nullptr;
  }
  if (path == CudaPath::mma) return run_mma<T>(p, stream);
  if (path == CudaPath::vector) return run_vector<T>(p, stream);
#if defined(NMCLI_WITH_SM90A)
  if constexpr (std::is_same_v<T, float>) {
    if (path == CudaPath::wgmma) return run_wgmma_tf32(p, stream);
  } else {
    if (path == CudaPath::wgmma) return run_wgmma<T>(p, stream);
  }
  if (path == CudaPath::wgmma_sp) return run_wgmma_sp<T>(p, stream);
#endif
  return run_tiled<T>(p, stream);
}

size_t dtype_bytes(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

bool has_copy(const CudaMatMul& c) { return c.copy_values != nullptr && c.copy_indices != nullptr; }

// Whether the sparse tensor cores' kernels regroup this pattern into 2:4 themselves (1:4, 2:8, 1:8).
bool regrouped_in_kernel(int n, int m) {
#if defined(NMCLI_WITH_SM90A)
  return wgmma_sp_family(n, m) && !(n == 2 && m == 4);
#else
  (void)n;
  (void)m;
  return false;
#endif
}

// Whether a call on the sparse tensor cores first writes its weight's 2:4 copy into its workspace
// and reads that (the weight regrouped once per call, not once per block that reads it): fp16/bf16
// weights whose pattern fits 2:4 and that carry no copy, at any row count for the patterns the
// kernels do not regroup themselves (the only way they reach the sparse tensor cores); for those
// they do (1:4, 2:8, 1:8), from staged_copy_from_rows rows where the output has at least
// kStagedCopyMinOutputs entries. Session 63 (H200, the launches as programmatic dependents;
// ab_kernels --path auto, the regrouping kernel against the staged copy forced from 17 rows, 2:8,
// 1:4 and 1:8 on the six LLaMA projections with 4096 x 1024 and on six nmSPARSE shapes at 300-2048
// rows; BENCHMARKS.md): at 300 rows the copy ran 0.76-0.98x, at 640 1:8 1.04-1.21x, 1:4 1.00-1.08x
// (0.94x and 0.96x on 8192 x 8192 and 20480 x 5120), 2:8 0.98-1.05x; at 768 1:4 1.05-1.15x; at
// 1024 1:8 1.13-1.16x, 1:4 1.05-1.17x, 2:8 0.98-1.13x. It lost at K = 1024 and 2048 below 2048 rows
// (1024 x 4096: 0.81-0.87x at 640-1024; 2048 x 2048: 0.89x at 640) and at K = 20480 (0.92-0.98x at
// 1024), so those keep 2048 rows, where it won 1.03-1.12x; on 4096 x 1024 (2.1M outputs) at 2048 rows
// 1.01-1.07x, so the outputs go down to 2^19 (4096 x 1024 at 640 rows: 1.04x for 1:8). Session 41
// (H100, before these launches) had found staging losing on narrow outputs (0.85-0.96x at 2.1M
// outputs), hence 3 x 2^20 until session 63. Session 64 (H200, the 2:4 kernel 1.02-1.12x faster at
// 640-4096 rows with its offset words swizzled and the persistent kernel's early weight copies; the
// rule then against session 63's, same kernels): 2:8 from 896 rows, not 1024: 1.02-1.17x at 896 on
// 9 of 10 shapes with K = 4096-8192, 0.97x on 5120 x 5120 (from 640 or 768 it still lost up to 0.94x
// on 4096 x 11008); 1:4 from 640 where K <= 5120: 1.01-1.13x at 640 on six such shapes (0.99x on
// 4096 x 11008), but 0.91x on 8192 x 8192 and 0.99-1.01x at K = 11008-14336, which kept 768.
// Session 65 (H200, the copy's kernel 1.21-1.55x faster for 2:8; ab_kernels --path auto, a build
// staging from 256 rows against session 64's build and rule, on the six LLaMA projections with 4096
// x 1024): at 640-768 rows 2:8 1.03-1.25x, 1:4 0.98-1.15x (1.11x and 1.15x at 640 on 11008 x 4096
// and 14336 x 4096), 1:8 1.00-1.05x; at 512 rows 0.81-0.98x but on 4096 x 1024 (1.07-1.17x), at 256
// 0.67-1.04x. So 2:8 stages from 640, but on weights of 2^26 entries or more (K x Nout), which keep
// 896: against the regrouping kernel at 640-768 rows 0.94x on 8192 x 8192 and 0.92-0.98x on 5120 x
// 13824, where the weights up to 4096 x 14336 (58.7M) and 14336 x 4096 took 1.03-1.25x. 1:4 at 640
// past K = 5120 measured 1.11-1.15x on 11008 x 4096 and 14336 x 4096 in that run but 1.00x and
// 0.95x in two others (the regrouping kernel's time moved by up to 20% between runs), so it keeps
// 768 there.
bool stages_copy(const CudaMatMul& c) {
  if (has_copy(c) || c.dtype == DType::f32 || !fits_two_of_four(c.shape.n, c.shape.m)) return false;
  if (!regrouped_in_kernel(c.shape.n, c.shape.m)) return true;
  return c.rows >= staged_copy_from_rows(c.shape.n, c.shape.m, c.shape.k, c.shape.nout) &&
         c.rows * c.shape.nout >= kStagedCopyMinOutputs;
}

// Workspace bytes of a call's activation A (gated or normalised calls off the decode paths).
size_t activation_bytes(const CudaMatMul& c, CudaPath path) {
  if (!forms_activation(c) || path == CudaPath::decode || path == CudaPath::decode_mma) return 0;  // they stage A themselves
  return static_cast<size_t>(c.rows * c.shape.k) * dtype_bytes(c.dtype);
}
// Where a staged 2:4 copy or stream-K's flags and partial sums start in the workspace (a call has
// at most one of them): after A, on a 256-byte boundary.
size_t after_activation(const CudaMatMul& c) { return (activation_bytes(c, CudaPath::wgmma_sp) + 255) / 256 * 256; }

// Workspace bytes for stream-K (wgmma_feed.cuh, stream_k: a flag and a slot of partial sums per
// SM) in the regrouping kernel, where the call's 256-row activation tiles are fewer than the SMs
// and more than half as many (launch_split weighs it only where they are more than the clusters of
// 2 that run at once, at most half the SMs: without the room it weighs the rest), and where they
// start: after A (after_activation). The flags, one word per SM, fill whole 256 bytes before the
// partial sums.
size_t stream_k_flag_bytes() { return (static_cast<size_t>(multiprocessor_count()) * 4 + 255) / 256 * 256; }
size_t stream_k_bytes(const CudaMatMul& c, CudaPath path) {
  if (path != CudaPath::wgmma_sp || c.dtype == DType::f32 || c.rows <= kWgmmaMinRowTile) return 0;
  if (!regrouped_in_kernel(c.shape.n, c.shape.m) || has_copy(c) || stages_copy(c)) return 0;
  const int64_t sms = multiprocessor_count();
  const int64_t weight_tiles = (c.shape.nout + kWgmmaWeightTile - 1) / kWgmmaWeightTile;
  const int64_t tiles = weight_tiles * ((c.rows + kStreamKRows - 1) / kStreamKRows);
  if (tiles >= sms || 2 * tiles <= sms) return 0;
  return stream_k_flag_bytes() + static_cast<size_t>(sms * kStreamKSlotFloats * 4);
}
StreamKSpace stream_k_space(const CudaMatMul& c, CudaPath path) {
  if (c.workspace == nullptr || stream_k_bytes(c, path) == 0) return {};
  uint8_t* at = static_cast<uint8_t*>(c.workspace) + after_activation(c);
  return {reinterpret_cast<uint32_t*>(at), reinterpret_cast<float*>(at + stream_k_flag_bytes())};
}

// Where a call that stages its 2:4 copy keeps it in its workspace (nowhere yet where there is no
// workspace, as when only the path is being chosen).
TwoOfFourCopy staged_copy(const CudaMatMul& c) {
  if (c.workspace == nullptr) return {};
  return two_of_four_copy_parts(static_cast<uint8_t*>(c.workspace) + after_activation(c), c.shape);
}

// The call as the sparse tensor cores read it: its 2:4 copy in place of the weight, where it
// carries one or stages one (`staged`: stages_copy(c)) in its workspace.
CudaMatMul sparse_tensor_core_view(const CudaMatMul& c, bool staged) {
  if (!has_copy(c) && !staged) return c;
  CudaMatMul view = c;
  if (staged) {
    const TwoOfFourCopy copy = staged_copy(c);
    view.values = copy.values;
    view.indices = copy.indices;
  } else {
    view.values = c.copy_values;
    view.indices = c.copy_indices;
  }
  view.shape = NMShape::make(c.shape.k, c.shape.nout, 2, 4);
  if (!staged && c.copy_index_words > 0) view.shape = view.shape.with_index_words(c.copy_index_words);
  view.vector = 0;
  return view;
}
CudaMatMul sparse_tensor_core_view(const CudaMatMul& c) { return sparse_tensor_core_view(c, stages_copy(c)); }

// fp16/bf16 vector-wise weights: the vector path at 9..64 rows where N/M <= 1/4; with a 2:4 copy,
// which runs the 2:4 kernel instead, only at 9..32 rows where N/M <= 1/8 (see the rule above).
bool vector16_takes(const CudaMatMul& call) {
  const int n = call.shape.n, m = call.shape.m;
  if (has_copy(call)) return 8 * n <= m && call.rows <= kVector16CopyMaxRows;
  return 4 * n <= m && call.rows <= kVector16MaxRows;
}

}  // namespace

int multiprocessor_count() {
  static int counts[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return 132;
  if (counts[device] == 0 && cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 132;
  return counts[device];
}

int compute_capability() {
  static int known[64] = {};  // major * 10 + minor; 0 = not read yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  if (known[device] == 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
      return 0;
    known[device] = major * 10 + minor;
  }
  return known[device];
}

bool use_pdl() {
  static const bool disabled = std::getenv("NMCLI_NO_PDL") != nullptr;
  return !disabled && compute_capability() >= 90;
}

// Both warpgroup paths: fp16/bf16, K % 8 == 0 (16-byte activation copies), compute capability
// 9.0, and a family the path's kernels are compiled for; the dense one also fp32 (3xTF32,
// wgmma_tf32.cu) where that kernel runs.
bool wgmma_supported(const CudaMatMul& call, bool sparse_tensor_cores) {
#if defined(NMCLI_WITH_SM90A)
  const int n = call.shape.n, m = call.shape.m;
  if (call.dtype == DType::f32)
    return !sparse_tensor_cores && activation_aligned(call) && wgmma_tf32_runs(n, m, call.shape.k, call.values);
  return call.shape.k % 8 == 0 && activation_aligned(call) &&
         (sparse_tensor_cores ? wgmma_sp_family(n, m) : wgmma_family(n, m)) && wgmma_device();
#else
  (void)call;
  (void)sparse_tensor_cores;
  return false;
#endif
}

namespace {
// The vector-wise path: columns promised to share offsets in blocks of 32 (or a multiple), rows
// of X a whole number of 16-byte copies and 16-byte aligned like the values, compute capability
// 8.0+ (mma.sync on TF32, fp16 and bf16).
bool vector_supported(const CudaMatMul& call) {
  const bool aligned = activation_aligned(call) && reinterpret_cast<uintptr_t>(call.values) % 16 == 0;
  return call.vector > 0 && call.vector % 32 == 0 && call.shape.k % (16 / dtype_bytes(call.dtype)) == 0 && aligned &&
         vector_family(call.shape.n, call.shape.m) && compute_capability() >= 80;
}

// The decode-sized tensor-core path: fp16/bf16 with the rows of X, x_up and norm_weight read as
// 16-byte vectors (it stages A itself, like decode).
bool decode_mma_runs(const CudaMatMul& call) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return call.dtype != DType::f32 && aligned(call.x) && aligned(call.x_up) && aligned(call.norm_weight) &&
         decode_mma_supported(call.rows, call.shape.n, call.shape.m, call.shape.k);
}

// Whether the decode kernel would stage this call's activations once (one K chunk).
bool decode_single_chunk(const CudaMatMul& call) {
  const NMShape& s = call.shape;
  switch (call.dtype) {
    case DType::f32: return decode_stages_once<float>(call.rows, s.n, s.m, s.groups);
    case DType::f16: return decode_stages_once<__half>(call.rows, s.n, s.m, s.groups);
    case DType::bf16: return decode_stages_once<__nv_bfloat16>(call.rows, s.n, s.m, s.groups);
  }
  return false;
}
}  // namespace

bool path_supported(const CudaMatMul& call, CudaPath path) {
  switch (path) {
    case CudaPath::automatic: return true;
    case CudaPath::decode: return call.rows <= kDecodeMaxRows;
    case CudaPath::tiled: return true;
    case CudaPath::mma: return mma_supported(call.dtype == DType::f32 ? 4 : 2, call.shape.m);
    case CudaPath::wgmma: return wgmma_supported(call, false);
    case CudaPath::wgmma_sp: return wgmma_supported(sparse_tensor_core_view(call), true);
    case CudaPath::vector: return vector_supported(call);
    case CudaPath::decode_mma: return decode_mma_runs(call);
  }
  return false;
}

namespace {
// Where the sparse tensor cores on a staged 2:4 copy beat the path the call would take otherwise
// (session 40, H100, forced paths on 4096 x 4096): from kStagingPaysFromRows rows against the
// kernels that regroup or expand the weight on the tensor cores themselves (2:16 on wgmma:
// 0.57-0.81x at 17-512 rows, 1.01x at 1024, 1.11x at 4096), from 17 rows against the mma path where
// the copy goes a word per thread (1:16: 1.42x at 17 rows, 1.60x at 64, 3.75-7.2x from 256; 1:2
// since session 41, H100, ab_kernels --path auto against HEAD on 4096 x 4096 and 4096 x 14336:
// 1.44x and 1.10x at 17 rows, 1.66x and 1.19x at 64, 2.94x and 3.62x at 256) and against the
// tiled SIMT path (2:32 12.8x, 1:3 7.1x at 17 rows). At 1..16 rows the decode kernels keep what
// they take.
constexpr int64_t kStagingPaysFromRows = 1024;
bool staging_pays(const CudaMatMul& call) {
  // 1:4, 2:8 and 1:8: stages_copy weighed the copy against the regrouping kernel.
  if (call.rows >= kStagingPaysFromRows || regrouped_in_kernel(call.shape.n, call.shape.m)) return true;
  if (call.rows <= kDecodeMaxRows || path_supported(call, CudaPath::wgmma)) return false;
  return !path_supported(call, CudaPath::mma) || two_of_four_copy_by_words(call.shape.n, call.shape.m);
}

// 2:4 calls decode_mma takes at its first rows, on the sparse MMA: up to kTwoOfFourMmaWideNout
// wide where one block holds K, and where it splits K over a cluster (`splits`) on outputs too
// narrow for decode's grid to fill the GPU (session 68, H200, ab_kernels --path decode --path
// decode_mma: 1.11-1.58x decode at 1-2 rows on 8192 x 2048, 14336 x 2048, 11008 x 3072 and 14336 x
// 3072; past 2048 wide, 2 rows went back to decode in session 69: choose_path).
bool two_of_four_mma_wide(const CudaMatMul& call, bool splits) {
  return call.shape.n == 2 && call.shape.m == 4 && call.shape.nout <= kTwoOfFourMmaWideNout &&
         (!splits || call.shape.nout < kDecodeFullGridNout);
}

// The fewest rows decode_mma takes a call from (choose_path's rule, below). `splits`: it splits K
// over a cluster; where decode then stages K in one chunk and its grid fills the GPU, decode keeps
// the first rows (groups of 4 aside). Narrower, decode leaves SMs idle (a block per 32 outputs):
// session 68 (H200, ab_kernels --path decode --path decode_mma at 1-4 rows) found decode_mma
// 1.87-2.17x decode at 3-4 rows on 11008 x 1024 (2:8, 1:8, 4:16), and 1.10-1.18x on 11008 x 3072
// for 2:8 and 1:8 (4:16 0.97x). Up to 1024 wide, groups of 8 start at 1 row from K =
// kDecodeMmaOneRowK (there 1.04-1.38x decode at 1 row, 1.15-1.68x at 2, on 8192, 11008 and 14336 x
// 1024 for 2:8, 1:8 and 4:16; level with decode at K = 1024-4096). Four entries a group (4:8,
// 4:16), which cost more to build into fragments, start at 3 rows on narrower outputs than groups
// of 8 (session 48). 2:4, whose weight goes to the sparse MMA as it is, where two_of_four_mma_wide
// takes it: from 1 row, or from 2 below K = kTwoOfFourMmaOneRowK (session 62, H200, ab_kernels
// --path decode_mma --path auto at 1-2 rows: 1.03-1.23x decode on 2048 x 2048, 4096 x 4096, 4096 x
// 5120, 4096 x 6144 and 5120 x 5120, 0.95x on 1024 x 4096 at 1 row; 0.88-0.93x at 1 row from 4096 x
// 8192 to 4096 x 28672).
// From 3 rows, wider than kTwoOfFourSpWideNout, the sparse tensor cores take it.
int64_t decode_mma_from_rows(const CudaMatMul& call, bool splits) {
  const int64_t nout = call.shape.nout;
  const bool groups_of_4 = call.shape.m == 4;
  if (two_of_four_mma_wide(call, splits))
    return call.shape.k >= kTwoOfFourMmaOneRowK || nout <= kDecodeMmaNarrowestNout ? 1 : 2;
  const bool decode_stages_k_once =
      splits && !groups_of_4 && nout >= kDecodeFullGridNout && decode_single_chunk(call);
  const int64_t mid_nout = call.shape.n == 4 ? kDecodeMmaFourMidNout : kDecodeMmaMidNout;
  const int64_t narrowest_from = groups_of_4 || call.shape.k >= kDecodeMmaOneRowK ? 1 : 2;
  // 1:4, 2:8 and 1:8 1025-2048 wide from K = kDecodeMmaOneRowK, where decode's grid fills at most
  // 64 SMs (session 69, H200, ab_kernels --path auto against session 68's kernels on 8192, 11008 and
  // 14336 x 2048 and 8192 x 1536): 1:4 from 1 row (1.01-1.27x at 1-2 rows); 2:8 and 1:8 from 2
  // rows where decode_mma holds K in one block (8192: 1.08-1.16x), but not where it splits K
  // (11008, 14336: 0.87-0.94x against decode's X in halves with 4 loads). 4:16 stays at 3 rows
  // (session 68: decode_mma 0.89-0.93x at 1-2 rows on 8192 x 2048).
  const bool long_k_mid = nout <= kDecodeMmaLongKNout && call.shape.k >= kDecodeMmaOneRowK &&
                          ((call.shape.n == 1 && groups_of_4) || (call.shape.n <= 2 && !splits));
  const int64_t from = nout <= kDecodeMmaNarrowestNout ? narrowest_from
                       : long_k_mid                    ? (groups_of_4 ? 1 : 2)
                       : groups_of_4 || nout <= mid_nout ? 3
                                                         : kDecodeMmaFromRows;
  return decode_stages_k_once ? std::max(from, kDecodeMmaFromRows) : from;
}
}  // namespace

CudaPath choose_path(const CudaMatMul& call) {
  // The decode-sized tensor-core kernel for 2:4, 1:4, 2:8 and 1:8 on outputs up to 1024 wide from
  // 1 row (groups of 4) or 2 (groups of 8; 2:4 from 1 row up to 6144 wide where one block holds K
  // and K >= 2048, from 2 below, past 4096 wide to 4 rows), else from 3 for groups of 4 and, for
  // groups of 8, from 3 up to 16384 wide, else 5; to 8 rows for 2:4 and to 16 for the others,
  // except calls that read a 2:4 copy on the sparse tensor cores from 9 rows. 4:8 and 4:16 like
  // groups of 8, from 3 rows up to 4096 wide. Where its K does not fit (K past 34816-38912 at
  // 9..16 rows, 60416-83968 at 1..8), 2:4 at 5-8 rows takes the sparse tensor cores and the rest
  // decode. Where it splits K over a cluster (K past one block's shared memory, as in the down
  // projections), groups of 8 (and 4:8, 4:16) start at 5 rows while decode stages K in one chunk
  // (session 37: decode 1.04-1.18x at 4 rows on 11008 x 4096, decode_mma 1.14-1.24x on 14336 x
  // 4096 in two chunks), and 2:4 takes the sparse tensor cores from 3 rows (1.02-1.16x decode_mma
  // at 3-8 rows there), as it does on outputs wider than 4096 (session 59: 1.10-1.36x).
  const bool sparse = 4 * call.shape.n <= call.shape.m;
  const bool two_of_four = call.shape.n == 2 && call.shape.m == 4;
  const int64_t nout = call.shape.nout;
  const bool decode_mma_splits = decode_mma_split(call.rows, call.shape.n, call.shape.m, call.shape.k) > 1;
  const int64_t decode_mma_from = decode_mma_from_rows(call, decode_mma_splits);
  // 2:4 at 2 rows where decode_mma splits K on outputs 2049-4095 wide: decode, whose X goes in
  // halves with 4 loads a thread there since session 68, ran 1.02-1.09x decode_mma on 8192, 11008
  // and 14336 x 3072 (session 69, H200, ab_kernels --path decode --path decode_mma; decode_mma kept
  // 1 row, 1.05-1.12x, and 2048 wide both rows, 1.16-1.46x).
  const bool decode_keeps_2_rows_of_2_4 =
      two_of_four && call.rows == 2 && decode_mma_splits && nout > kDecodeMmaLongKNout;
  // (path_supported limits it to the six families decode_mma.cu compiles.)
  const bool decode_mma_takes = call.rows >= decode_mma_from && !decode_keeps_2_rows_of_2_4 &&
                                !(call.rows > kDecodeMmaCrossover && (two_of_four || has_copy(call))) &&
                                path_supported(call, CudaPath::decode_mma);
  const int64_t weight_tiles = (nout + kWgmmaWeightTile - 1) / kWgmmaWeightTile;
  const int64_t wgmma_blocks = (call.rows + kWgmmaMinRowTile - 1) / kWgmmaMinRowTile * weight_tiles;
  const bool enough_tiles = weight_tiles >= kWgmmaWideTiles;
  // The sparse tensor cores from 9 rows where the output has kWgmmaWideTiles weight tiles (their K
  // splits, up to 8 blocks a tile, keep such grids busy) or the grid kWgmmaSpMinBlocks blocks, and
  // 2:4 on such grids from 5 rows where decode_mma does not take it; the expanding kernel from 17
  // rows with those weight tiles, else from kWgmmaCrossover rows on kWgmmaMinBlocks blocks.
  const bool sparse_grid = enough_tiles || wgmma_blocks >= kWgmmaSpMinBlocks;
  if (call.rows <= kDecodeMmaCrossover) {
    // Up to kTwoOfFourMmaWideNout wide, where one block holds K, decode_mma keeps 2:4 to 4 rows
    // (session 62, H200, ab_kernels --path decode_mma --path wgmma_sp on 4096 x 5120, 4096 x 6144,
    // 5120 x 5120 and 6144 x 6144: 1.02-1.13x at 3-4 rows, 0.95-1.06x at 6-8; on 4096 x 8192
    // 0.92-0.98x). Where it splits K, it keeps them only up to 1024 wide (session 68, same command:
    // 1.04-1.09x on 8192 and 14336 x 1024; 0.90-1.01x on 8192 and 14336 x 2048, 11008 and 14336 x
    // 3072).
    const bool two_of_four_sp_early = decode_mma_splits || nout > kTwoOfFourSpWideNout;
    const bool mma_keeps_4_rows = two_of_four_mma_wide(call, decode_mma_splits) &&
                                  (!decode_mma_splits || nout <= kDecodeMmaNarrowestNout);
    const int64_t two_of_four_sp_from =
        two_of_four_sp_early && !mma_keeps_4_rows ? kTwoOfFourSpFromRows : kDecodeMmaFromRows;
    const bool two_of_four_sp = two_of_four && call.rows >= two_of_four_sp_from && sparse_grid &&
                                path_supported(call, CudaPath::wgmma_sp);
    if (decode_mma_takes && !(two_of_four_sp && two_of_four_sp_early)) return CudaPath::decode_mma;
    return two_of_four_sp ? CudaPath::wgmma_sp : CudaPath::decode;
  }
  if (path_supported(call, CudaPath::vector) && (call.dtype == DType::f32 || vector16_takes(call)))
    return CudaPath::vector;
  if (decode_mma_takes) return CudaPath::decode_mma;
  // fp32 element-wise: the 3xTF32 warpgroup kernel from 9 rows.
  if (call.dtype == DType::f32 && path_supported(call, CudaPath::wgmma)) return CudaPath::wgmma;
  if (sparse_grid && (!stages_copy(call) || staging_pays(call)) && path_supported(call, CudaPath::wgmma_sp))
    return CudaPath::wgmma_sp;
  const bool wgmma_grid =
      (call.rows > kDecodeMaxRows && enough_tiles) || (call.rows >= kWgmmaCrossover && wgmma_blocks >= kWgmmaMinBlocks);
  if (wgmma_grid && path_supported(call, CudaPath::wgmma)) return CudaPath::wgmma;
  if (path_supported(call, CudaPath::mma)) {
    // 9..16 rows: the decode kernel still wins for the sparser patterns when it stages the
    // activations once; with several K chunks, or at N/M = 1/2, the mma path does.
    if (call.rows <= kDecodeMaxRows && sparse && decode_single_chunk(call)) return CudaPath::decode;
    return CudaPath::mma;
  }
  return call.rows <= kDecodeMaxRows ? CudaPath::decode : CudaPath::tiled;
}

CudaTilePlan& last_tile_plan() {
  static thread_local CudaTilePlan plan;
  return plan;
}

const char* path_name(CudaPath path) {
  switch (path) {
    case CudaPath::decode: return "decode";
    case CudaPath::tiled: return "tiled";
    case CudaPath::mma: return "mma";
    case CudaPath::wgmma: return "wgmma";
    case CudaPath::wgmma_sp: return "wgmma_sp";
    case CudaPath::vector: return "vector";
    case CudaPath::decode_mma: return "decode_mma";
    default: return "auto";
  }
}

bool path_from_name(const char* name, CudaPath* path) {
  for (CudaPath p : {CudaPath::automatic, CudaPath::decode, CudaPath::tiled, CudaPath::mma, CudaPath::wgmma,
                     CudaPath::wgmma_sp, CudaPath::vector, CudaPath::decode_mma}) {
    if (std::strcmp(name, path_name(p)) == 0) {
      *path = p;
      return true;
    }
  }
  return false;
}

size_t nm_matmul_cuda_workspace_bytes(const CudaMatMul& call, CudaPath path) {
  if (call.rows == 0 || call.shape.nout == 0) return 0;
  if (path == CudaPath::automatic) path = choose_path(call);
  if (path == CudaPath::wgmma_sp && stages_copy(call)) return after_activation(call) + two_of_four_copy_bytes(call.shape);
  if (const size_t stream_k = stream_k_bytes(call, path); stream_k > 0) return after_activation(call) + stream_k;
  return activation_bytes(call, path);
}

int nm_matmul_cuda(const CudaMatMul& call, void* stream_ptr, CudaPath path) {
  last_tile_plan() = {};  // a warpgroup kernel's launch_split records its plan
  if (call.rows == 0 || call.shape.nout == 0) return cudaSuccess;
  if (path == CudaPath::automatic) path = choose_path(call);
  if (!path_supported(call, path)) return cudaErrorInvalidValue;
  if (call.glu != Glu::none && (call.x_up == nullptr || call.norm_weight != nullptr)) return cudaErrorInvalidValue;
  if (nm_matmul_cuda_workspace_bytes(call, path) > 0 &&
      (call.workspace == nullptr || reinterpret_cast<uintptr_t>(call.workspace) % 16 != 0))
    return cudaErrorInvalidValue;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const bool staged = path == CudaPath::wgmma_sp && stages_copy(call);
  const CudaMatMul used = path == CudaPath::wgmma_sp ? sparse_tensor_core_view(call, staged) : call;
  if (staged) {
    const int e = two_of_four_copy_cuda(call.values, call.indices, call.shape, staged_copy(call), stream_ptr);
    if (e != 0) return e;
  }
  const StreamKSpace stream_k = stream_k_space(call, path);
  switch (call.dtype) {
    case DType::f32: return run<float>(used, stream, path, staged, stream_k);
    case DType::f16: return run<__half>(used, stream, path, staged, stream_k);
    case DType::bf16: return run<__nv_bfloat16>(used, stream, path, staged, stream_k);
  }
  return cudaErrorInvalidValue;
}

}  // namespace nmcli
