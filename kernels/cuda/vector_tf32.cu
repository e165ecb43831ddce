// Vector-wise path: fp32 weights whose columns share their offsets in blocks of 32 (the op's
// `vector` attribute, docs/FORMAT.md), on the tensor cores with three TF32 products per fp32 one.
//
// When 32 output columns keep the same K positions, their product is a dense one over the kept
// positions only: gather those activation columns, multiply by the 32 columns' stored values.
// A block covers kRows activation rows and 256 weight columns; each warp owns one 32-column block
// and all kRows rows. Per stage (kPositions K positions, kEntries stored entries per column) the
// block copies
//  * the activation tile [kRows x kPositions] (padded rows),
//  * the packed values of its 256 columns [256 x kEntries], as they are stored,
//  * each warp's leader column's offset words for the stage,
// with cp.async into a ring of stages. A warp decodes its kEntries offsets once per stage (lane
// e holds entry e's position in the tile) and hands them around with shuffles; the A fragments
// of mma.m16n8k8 are then gathered straight from the activation tile (row, position) and the
// B fragments are two consecutive stored values per lane: the MMA's k index t maps to stored
// entry 2t and k index t + 4 to entry 2t + 1, so a lane's two B values are one 8-byte load.
// Tiles (launch_rows): from 65 rows 128 x 256 with 16 entries per stage. The activation tile is
// copied whole though each warp reads N/M of it, so at high sparsity the kernel is bound by L2 ->
// shared-memory bytes per MMA; 64-row tiles ran 104 / 175 / 285 effective TFLOP/s against
// 111 / 188 / 283 for these at 16:32 / 8:32 / 4:32 on 4096^3 (BENCHMARKS.md, session 21).
// Up to 64 rows, 32- or 64-row tiles with 32 entries per stage (a whole 128-byte line of each
// column's values), K split over a cluster (k_split) so that the few tiles fill the GPU: the
// weight stream is the work there, and 32 entries ran 1.05-1.23x faster than 16 (session 22).
//
// fp32 accuracy from TF32 units (the 3xTF32 split): v = big + small with big = v rounded to TF32
// and small = v - big (exact), which the MMA truncates to TF32; a*b ~= a_small*b_big +
// a_big*b_small + a_big*b_big, accumulated in fp32, small terms first. The dropped small*small
// term is below 2^-22 of the product and small's truncation below 2^-21.
#include <algorithm>

#include "async_copy.cuh"
#include "common.cuh"
#include "kernels.cuh"
#include "split_k.cuh"

namespace nmcli {
namespace {

constexpr int kWarps = 8;                 // one per 32-column block of the weight
constexpr int kThreads = 32 * kWarps;
constexpr int kCols = 32 * kWarps;        // weight columns per block
constexpr int kOffsetWords = 8;           // a stage's offset fields (<= 32 x 5 bits) span at most 5 words
constexpr int kSmemBudget = 220 * 1024;

// kRows activation rows x kCols weight columns per block; per stage kEntries stored entries per
// column (kEntries / 8 mma k-steps), which span kPositions = kEntries * M/N positions of K.
template <int kRatio, int kRowsArg, int kEntriesArg>
struct VectorTile {
  static constexpr int kRows = kRowsArg, kEntries = kEntriesArg, kPositions = kEntries * kRatio;
  static constexpr int kRowTiles = kRows / 16;  // m16 tiles per warp
  static constexpr int kRowTilesAtOnce = kRowTiles < 4 ? kRowTiles : 4;  // A fragments held at a time

  // Rows of the activation tile are kPositions + 4 floats (4 mod 32 banks apart): the eight rows
  // a gather reads fall in different banks for any one position, so a gather conflicts only
  // where two of the four positions it reads are equal mod 4.
  static constexpr int kXStride = kPositions + 4;
  // Column stride 24 mod 32: the 8-byte B loads of a half-warp (4 columns x 4 pairs) hit 16
  // different bank pairs.
  static constexpr int kWStride = kEntries + 8;
  static constexpr int kXFloats = kRows * kXStride;
  static constexpr int kWFloats = kCols * kWStride;
  static constexpr int kStageFloats = kXFloats + kWFloats + kWarps * kOffsetWords;
  static constexpr int kStages = std::min(4, kSmemBudget / (kStageFloats * 4));
  static constexpr int kSmemBytes = kStages * kStageFloats * 4;
  static_assert(kStages >= 2, "a ring needs two stages");
  static_assert(kRows * kCols <= kStages * kStageFloats, "a split's partial tile fits in the ring");
};

// v rounded to TF32 (nearest, ties away), by integer arithmetic: cvt.rna.tf32.f32 costs four
// instructions on sm_90, this two. Infinities stay; a NaN still yields NaN through `small`.
__device__ __forceinline__ uint32_t round_tf32(float v) { return (__float_as_uint(v) + 0x1000u) & 0xffffe000u; }

// The MMA reads `small` truncated to TF32 (it ignores the low 13 bits): measured as accurate as
// rounding it here (error ratio <= 0.15 of the fp32 bound either way), for one instruction less.
__device__ __forceinline__ void split_tf32(float v, uint32_t& big, uint32_t& small) {
  big = round_tf32(v);
  small = __float_as_uint(v - __uint_as_float(big));
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A thread's share of each stage's copies (cp.async, 16 bytes each): the same tile rows,
// columns and chunks every stage, so the sources are set up once and advance by the stage.
template <typename Tile>
struct StageCopies {
  static constexpr int kRows = Tile::kRows, kEntries = Tile::kEntries, kPositions = Tile::kPositions;
  static constexpr int kXChunks = kPositions / 4, kXRowsPerPass = kThreads / kXChunks, kXPasses = kRows / kXRowsPerPass;
  static constexpr int kWChunks = kEntries / 4, kWColsPerPass = kThreads / kWChunks, kWPasses = kCols / kWColsPerPass;
  const float* x;       // this thread's first activation chunk at stage 0
  const float* values;  // ... and first packed-value chunk
  const uint32_t* words;  // lanes < kOffsetWords: the warp's leader column's offset words
  int64_t x_pass, w_pass;  // source distance between passes
  int64_t k_chunk;         // K position of the chunk at stage 0
  int x_rows_left, w_cols_left;  // rows (columns) of the tile that exist, from this thread's first
  uint32_t x_dst, w_dst, words_dst;  // shared-memory offsets within a stage
  bool leader;  // the warp's 32-column block exists

  __device__ __forceinline__ StageCopies(const PathParams<float>& p, int64_t row0, int64_t col0, int warp, int lane) {
    const int xr = threadIdx.x / kXChunks, xc = threadIdx.x % kXChunks;
    const int wc = threadIdx.x / kWChunks, wq = threadIdx.x % kWChunks;
    x = p.x + (row0 + xr) * p.k + 4 * xc;
    values = p.values + (col0 + wc) * p.row_len + 4 * wq;
    words = p.indices + (col0 + 32 * warp) * p.index_words + lane;
    x_pass = kXRowsPerPass * p.k;
    w_pass = kWColsPerPass * p.row_len;
    k_chunk = 4 * xc;
    x_rows_left = static_cast<int>(min(p.rows - row0 - xr, static_cast<int64_t>(kRows)));
    w_cols_left = static_cast<int>(min(p.nout - col0 - wc, static_cast<int64_t>(kCols)));
    x_dst = (xr * Tile::kXStride + 4 * xc) * 4;
    w_dst = (Tile::kXFloats + wc * Tile::kWStride + 4 * wq) * 4;
    words_dst = (Tile::kXFloats + Tile::kWFloats + warp * kOffsetWords + lane) * 4;
    leader = col0 + 32 * warp < p.nout;
  }

  // Copies stage `step` (K positions [step * kPositions, +kPositions), stored entries
  // [step * kEntries, +kEntries), which lie within the row as kEntries divides 32) to the stage
  // at `stage`; rows, columns and positions past the ends land as zeros.
  __device__ __forceinline__ void load(const PathParams<float>& p, uint32_t stage, int64_t step, int lane) const {
    const int64_t k0 = step * kPositions;
    const bool k_ok = k_chunk + k0 < p.k;  // K % 4 == 0: a chunk is all in K or all past it
#pragma unroll
    for (int i = 0; i < kXPasses; ++i) {
      const bool ok = k_ok && i * kXRowsPerPass < x_rows_left;
      sm90::cp_async16(stage + x_dst + i * kXRowsPerPass * Tile::kXStride * 4, ok ? x + i * x_pass + k0 : p.x, ok);
    }
    const int64_t j0 = step * kEntries;
#pragma unroll
    for (int i = 0; i < kWPasses; ++i) {
      const bool ok = i * kWColsPerPass < w_cols_left;
      sm90::cp_async16(stage + w_dst + i * kWColsPerPass * Tile::kWStride * 4, ok ? values + i * w_pass + j0 : p.values,
                       ok);
    }
    if (lane < kOffsetWords) {
      const int64_t word = (j0 * p.bits >> 5) + lane;
      const bool ok = leader && word < p.index_words;
      sm90::cp_async4(stage + words_dst, ok ? words + (j0 * p.bits >> 5) : p.indices, ok);
    }
  }
};

template <typename Tile>
__global__ void __launch_bounds__(kThreads, 1) vector_tf32_kernel(PathParams<float> p, int log2n, int log2m) {
  constexpr int kRows = Tile::kRows, kEntries = Tile::kEntries, kPositions = Tile::kPositions;
  constexpr int kRowTiles = Tile::kRowTiles, kRowTilesAtOnce = Tile::kRowTilesAtOnce;
  extern __shared__ __align__(16) float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows, col0 = static_cast<int64_t>(blockIdx.x) * kCols;
  // This block's stages [first, last): all of them unless a cluster of gridDim.z blocks splits K.
  const int64_t steps = (p.groups * p.m + kPositions - 1) / kPositions, per_block = (steps + gridDim.z - 1) / gridDim.z;
  const int64_t first = min(steps, blockIdx.z * per_block), last = min(steps, first + per_block);
  const StageCopies<Tile> copies(p, row0, col0, warp, lane);
  const uint32_t ring = sm90::smem_addr(smem);
  float acc[kRowTiles][4][4] = {};

  for (int64_t s = first; s < first + Tile::kStages - 1; ++s) {
    if (s < last) copies.load(p, ring + (s % Tile::kStages) * Tile::kStageFloats * 4, s, lane);
    sm90::cp_async_commit();
  }
  for (int64_t step = first; step < last; ++step) {
    sm90::cp_async_wait<Tile::kStages - 2>();
    __syncthreads();  // stage `step` is in, and every warp is done with the slot refilled next
    const int64_t next = step + Tile::kStages - 1;
    if (next < last) copies.load(p, ring + (next % Tile::kStages) * Tile::kStageFloats * 4, next, lane);
    sm90::cp_async_commit();

    const float* xs = smem + (step % Tile::kStages) * Tile::kStageFloats;
    const float* ws = xs + Tile::kXFloats + warp * 32 * Tile::kWStride;
    const uint32_t* words =
        reinterpret_cast<const uint32_t*>(xs + Tile::kXFloats + Tile::kWFloats) + warp * kOffsetWords;
    // Lane e: the tile position of this stage's entry e (group e / N, offset from the leader's row).
    const int64_t j0 = step * kEntries;
    int position = 0;
    if (lane < kEntries) {
      const int bit = static_cast<int>((j0 + lane) * p.bits - ((j0 * p.bits >> 5) << 5));
      position = ((lane >> log2n) << log2m) + static_cast<int>(read_bits(words, bit, p.bits) & ((1u << p.bits) - 1u));
    }
#pragma unroll
    for (int s = 0; s < kEntries / 8; ++s) {
      const int k_lo = __shfl_sync(0xffffffffu, position, 8 * s + 2 * q);
      const int k_hi = __shfl_sync(0xffffffffu, position, 8 * s + 2 * q + 1);
      uint32_t b_big[4][2], b_small[4][2];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float2 v = *reinterpret_cast<const float2*>(ws + (8 * nt + g) * Tile::kWStride + 8 * s + 2 * q);
        split_tf32(v.x, b_big[nt][0], b_small[nt][0]);
        split_tf32(v.y, b_big[nt][1], b_small[nt][1]);
      }
#pragma unroll
      for (int m0 = 0; m0 < kRowTiles; m0 += kRowTilesAtOnce) {
        uint32_t a_big[kRowTilesAtOnce][4], a_small[kRowTilesAtOnce][4];
#pragma unroll
        for (int i = 0; i < kRowTilesAtOnce; ++i) {
          const float* row = xs + (16 * (m0 + i) + g) * Tile::kXStride;
          split_tf32(row[k_lo], a_big[i][0], a_small[i][0]);
          split_tf32(row[8 * Tile::kXStride + k_lo], a_big[i][1], a_small[i][1]);
          split_tf32(row[k_hi], a_big[i][2], a_small[i][2]);
          split_tf32(row[8 * Tile::kXStride + k_hi], a_big[i][3], a_small[i][3]);
        }
        // Three sweeps, small terms first: 16 independent MMAs between two on one accumulator.
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int i = 0; i < kRowTilesAtOnce; ++i) mma_tf32(acc[m0 + i][nt], a_small[i], b_big[nt]);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int i = 0; i < kRowTilesAtOnce; ++i) mma_tf32(acc[m0 + i][nt], a_big[i], b_small[nt]);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int i = 0; i < kRowTilesAtOnce; ++i) mma_tf32(acc[m0 + i][nt], a_big[i], b_big[nt]);
      }
    }
  }

  if (gridDim.z > 1) {  // the ring is free once every warp is past its last stage
    sm90::cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          smem[(16 * mt + g + 8 * (e >> 1)) * kCols + 32 * warp + 8 * nt + 2 * q + (e & 1)] = acc[mt][nt][e];
    reduce_cluster<float, kRows, kCols, kThreads>(p, smem, row0, col0);
    return;
  }
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int64_t col = col0 + 32 * warp + 8 * nt + 2 * q + c;
      if (col >= p.nout) continue;
      const float bias = p.bias ? p.bias[col] : 0.f;
      const OutputColumn<float> y = p.y.column(col);
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t row = row0 + 16 * mt + g + 8 * h;
          if (row < p.rows) y[row] = p.alpha * acc[mt][nt][2 * h + c] + bias + residual_at(p, row, col);
        }
      }
    }
  }
}

// Clusters of `split` blocks of kKernel that the device runs at once, one block per SM (cached
// per device and split). Clusters must fit in one GPC, so this is less than SMs / split: 15
// clusters of 8 on the H100 (132 SMs).
template <auto kKernel>
int64_t active_clusters(int split, int smem_bytes) {
  static int known[64][9] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return multiprocessor_count() / split;
  int& count = known[device][split];
  if (count == 0) {
    cudaLaunchAttribute cluster = {};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 1, cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = static_cast<unsigned>(split);
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1, 1, static_cast<unsigned>(split));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    config.attrs = &cluster;
    config.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&count, kKernel, &config) != cudaSuccess || count <= 0) {
      (void)cudaGetLastError();  // not the launch's error
      count = std::max(1, multiprocessor_count() / split);
    }
  }
  return count;
}

// Blocks of a cluster that split each tile's K (1 = no split), only where the tiles alone leave
// SMs idle: splitting grids of several waves (4096 x 4096 x 11008) ran 1.08-1.29x slower. Of 1,
// 2, 4 and 8 it takes the least waves x stages per block, a wave being as many clusters as run at
// once, with at least 4 stages per block; ties go to the smaller split. On the H100, with 16 tiles
// (N = 4096, up to 64 rows), 8-way splits take two waves (15 clusters at once) and ran
// 1.03-1.22x slower than 4-way ones (BENCHMARKS.md, session 22).
template <auto kKernel>
int k_split(int64_t tiles, int64_t steps, int smem_bytes) {
  if (compute_capability() < 90 || tiles >= multiprocessor_count()) return 1;  // clusters; a full grid
  int best = 1;
  int64_t best_cost = steps;  // one wave of whole-K blocks
  for (const int split : {2, 4, 8}) {
    if (steps < 4 * split) break;
    const int64_t clusters = active_clusters<kKernel>(split, smem_bytes);
    const int64_t cost = (tiles + clusters - 1) / clusters * ((steps + split - 1) / split);
    if (cost < best_cost) best = split, best_cost = cost;
  }
  return best;
}

template <typename Tile>
cudaError_t launch(const PathParams<float>& p, cudaStream_t stream) {
  constexpr auto kernel = vector_tf32_kernel<Tile>;
  constexpr int kBytes = Tile::kSmemBytes, kPositions = Tile::kPositions, kRows = Tile::kRows;
  if (const cudaError_t e = allow_dynamic_smem<kernel>(kBytes); e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((p.nout + kCols - 1) / kCols),
                  static_cast<unsigned>((p.rows + kRows - 1) / kRows));
  const int log2n = __builtin_ctz(p.n), log2m = __builtin_ctz(p.m);
  const int splits =
      k_split<kernel>(static_cast<int64_t>(grid.x) * grid.y, (p.groups * p.m + kPositions - 1) / kPositions, kBytes);
  if (splits == 1) {
    kernel<<<grid, kThreads, kBytes, stream>>>(p, log2n, log2m);
    return cudaGetLastError();
  }
  return launch_split_k(kernel, grid, kThreads, kBytes, stream, splits, false, p, log2n, log2m);
}

// The activation tile: the smallest of 32, 64 and 128 rows that holds the call's rows (128 past
// that); with few rows the grid is small and k_split fills the GPU.
template <int kRatio>
cudaError_t launch_rows(const PathParams<float>& p, cudaStream_t stream) {
  if (p.rows <= 32) return launch<VectorTile<kRatio, 32, 32>>(p, stream);
  if (p.rows <= 64) return launch<VectorTile<kRatio, 64, 32>>(p, stream);
  return launch<VectorTile<kRatio, 128, 16>>(p, stream);
}

bool power_of_two(int v) { return v > 0 && (v & (v - 1)) == 0; }

}  // namespace

bool vector_tf32_family(int n, int m) {
  return power_of_two(n) && power_of_two(m) && (m == 2 * n || m == 4 * n || m == 8 * n);
}

// Stages span kEntries x 2, 4 or 8 K positions at N/M = 1/2, 1/4, 1/8.
cudaError_t run_vector_tf32(PathParams<float> p, cudaStream_t stream) {
  if (p.m == 2 * p.n) return launch_rows<2>(p, stream);
  if (p.m == 4 * p.n) return launch_rows<4>(p, stream);
  return launch_rows<8>(p, stream);
}

}  // namespace nmcli
