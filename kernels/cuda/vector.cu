// Vector-wise path: weights whose columns share their offsets in blocks of 32 (the op's `vector`
// attribute, docs/FORMAT.md), on the tensor cores: fp16 and bf16 with mma.m16n8k16, fp32 with
// three TF32 products per fp32 one (mma.m16n8k8).
//
// When 32 output columns keep the same K positions, their product is a dense one over the kept
// positions only: gather those activation columns, multiply by the 32 columns' stored values.
// A block covers kRows activation rows and kCols weight columns (256, or 512 with 16 warps); each
// warp owns one 32-column block and all kRows rows. Per stage (kPositions K positions, kEntries
// stored entries per column) the block copies
//  * the activation tile [kRows x kPositions] (padded rows),
//  * the packed values of its columns [kCols x kEntries], as they are stored,
//  * each warp's leader column's offset words for the stage,
// with cp.async into a ring of stages. A warp decodes its kEntries offsets once per stage (lane
// e holds entry e's position in the tile) and hands them around with shuffles; the A fragments
// are then gathered straight from the activation tile (row, position). The MMA's k indices map
// to stored entries:
//  * fp32, m16n8k8: k index t -> entry 2t, t + 4 -> 2t + 1, so a lane's B values of a column are
//    one 8-byte load;
//  * fp16/bf16, m16n8k16: k indices 2t, 2t + 1, 2t + 8, 2t + 9 -> entries t, t + 4, t + 8, t + 12,
//    so each gather load spans 4 consecutive entries (multiply_stage_16bit).
// Tiles (launch_rows): from 65 rows 128 x 256 with 16 entries per stage; fp32 at N/M = 1/8 takes
// 64 x 512. The activation tile is copied whole though each warp reads N/M of it, so the bytes
// copied per MMA grow with sparsity; 512 columns share each copied activation between twice the
// warps (session 31). 64 x 256 tiles ran 104 / 175 / 285 effective TFLOP/s against 111 / 188 /
// 283 for 128 x 256 at 16:32 / 8:32 / 4:32 on 4096^3 (BENCHMARKS.md, session 21).
// Up to 64 rows, 32- or 64-row tiles with 32 entries per stage (for fp32 a whole 128-byte line of
// each column's values), K split over a cluster (k_split) so that the few tiles fill the GPU: the
// weight stream is the work there, and for fp32 32 entries ran 1.05-1.23x faster than 16
// (session 22). The 16-bit kernels are latency-bound per stage (one 8-warp block per SM, issue
// slots 13-29% busy, DRAM under 10%; session 23), so the dispatch uses them at 9-64 rows only.
//
// fp32 accuracy from TF32 units: the 3xTF32 split of tf32.cuh.
#include <algorithm>
#include <type_traits>

#include "async_copy.cuh"
#include "common.cuh"
#include "kernels.cuh"
#include "split_k.cuh"
#include "tf32.cuh"

namespace nmcli {
namespace {

constexpr int kOffsetWords = 8;           // a stage's offset fields (<= 32 x 5 bits) span at most 6 words
constexpr int kSmemBudget = 220 * 1024;

// Words per weight column in shared memory: at least `words`, padded so that a warp's B loads
// (multiply_stage_*) hit different banks: fp32 lanes read 8-byte pairs, a half-warp 4 columns x 8
// consecutive words (8 mod 16 apart); 16-bit lanes read single entries, a warp 8 columns x 2 words
// (4 mod 8 apart).
template <typename T>
constexpr int column_words(int words) {
  return sizeof(T) == 4 ? words + (24 - words % 16) % 16 : words + (12 - words % 8) % 8;
}

// kRows activation rows x kCols weight columns per block; per stage kEntries stored entries per
// column, which span kPositions = kEntries * M/N positions of K. Sizes in elements of T.
template <typename T, int kRatio, int kRowsArg, int kEntriesArg, int kWarpsArg = 8, bool kSwizzleArg = false>
struct VectorTile {
  // fp32 with 16 entries: columns of 16 words, unpadded, their two 8-word halves swapped where
  // bit 1 of the column is set, so a half-warp's B loads (4 columns x 8 words) still hit 32 banks.
  static constexpr bool kSwizzle = kSwizzleArg;
  static_assert(!kSwizzle || (sizeof(T) == 4 && kEntriesArg == 16), "the swizzle is for fp32 columns of 16 entries");
  static constexpr int kRows = kRowsArg, kEntries = kEntriesArg, kPositions = kEntries * kRatio;
  static constexpr int kWarps = kWarpsArg;  // one per 32-column block of the weight
  static constexpr int kThreads = 32 * kWarps, kCols = 32 * kWarps;
  static constexpr int kChunk = 16 / sizeof(T);  // elements per 16-byte copy
  static constexpr int kRowTiles = kRows / 16;   // m16 tiles per warp
  // Rows of the activation tile are kPositions + 16 bytes: an odd multiple of 4 words, so the
  // eight rows a gather reads start in eight different 16-byte bank groups (multiply_stage_*).
  static constexpr int kXStride = kPositions + kChunk;
  static constexpr int kWStride =
      kSwizzle ? kEntries : column_words<T>(kEntries * static_cast<int>(sizeof(T)) / 4) * 4 / sizeof(T);
  static constexpr int kXBytes = kRows * kXStride * sizeof(T);
  static constexpr int kWBytes = kCols * kWStride * sizeof(T);
  static constexpr int kStageBytes = kXBytes + kWBytes + kWarps * kOffsetWords * 4;
  static constexpr int kStages = std::min(4, kSmemBudget / kStageBytes);
  // The ring, or a split's partial tile (fp32) where that is larger: it is written over the ring.
  static constexpr int kSmemBytes = std::max(kStages * kStageBytes, kRows * kCols * 4);
  static_assert(kStages >= 2, "a ring needs two stages");
  static_assert(kEntries % (sizeof(T) == 4 ? 8 : 16) == 0 && kEntries <= 32, "whole MMA k-steps, one entry per lane");
};

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <typename T>
__device__ __forceinline__ void mma_16bit(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Two 16-bit values as one fragment register, the lower k index in the low half.
__device__ __forceinline__ uint32_t pair(uint16_t lo, uint16_t hi) { return lo | static_cast<uint32_t>(hi) << 16; }

// A thread's share of each stage's copies (cp.async, 16 bytes each): the same tile rows,
// columns and chunks every stage, so the sources are set up once and advance by the stage.
template <typename T, typename Tile>
struct StageCopies {
  static constexpr int kRows = Tile::kRows, kEntries = Tile::kEntries, kPositions = Tile::kPositions;
  static constexpr int kChunk = Tile::kChunk, kThreads = Tile::kThreads, kCols = Tile::kCols;
  static constexpr int kXChunks = kPositions / kChunk, kXRowsPerPass = kThreads / kXChunks, kXPasses = kRows / kXRowsPerPass;
  static constexpr int kWChunks = kEntries / kChunk, kWColsPerPass = kThreads / kWChunks, kWPasses = kCols / kWColsPerPass;
  static_assert(kThreads % kXChunks == 0 && kXPasses * kXRowsPerPass == kRows, "whole passes over the activation tile");
  static_assert(kThreads % kWChunks == 0 && kWPasses * kWColsPerPass == kCols, "whole passes over the values");
  static_assert(!Tile::kSwizzle || kWColsPerPass % 4 == 0, "a thread's columns share bit 1 (the swizzle)");
  const T* x;       // this thread's first activation chunk at stage 0
  const T* values;  // ... and first packed-value chunk
  const uint32_t* words;  // lanes < kOffsetWords: the warp's leader column's offset words
  int64_t x_pass, w_pass;  // source distance between passes
  int64_t k_chunk;         // K position of the chunk at stage 0
  int x_rows_left, w_cols_left;  // rows (columns) of the tile that exist, from this thread's first
  uint32_t x_dst, w_dst, words_dst;  // shared-memory byte offsets within a stage
  bool leader;  // the warp's 32-column block exists

  __device__ __forceinline__ StageCopies(const PathParams<T>& p, int64_t row0, int64_t col0, int warp, int lane) {
    const int xr = threadIdx.x / kXChunks, xc = threadIdx.x % kXChunks;
    const int wc = threadIdx.x / kWChunks, wq = threadIdx.x % kWChunks;
    x = p.x + (row0 + xr) * p.k + kChunk * xc;
    values = p.values + (col0 + wc) * p.row_len + kChunk * wq;
    words = p.indices + (col0 + 32 * warp) * p.index_words + lane;
    x_pass = kXRowsPerPass * p.k;
    w_pass = kWColsPerPass * p.row_len;
    k_chunk = kChunk * xc;
    x_rows_left = static_cast<int>(min(p.rows - row0 - xr, static_cast<int64_t>(kRows)));
    w_cols_left = static_cast<int>(min(p.nout - col0 - wc, static_cast<int64_t>(kCols)));
    x_dst = (xr * Tile::kXStride + kChunk * xc) * sizeof(T);
    const int w_chunk = Tile::kSwizzle ? wq ^ (2 * ((wc >> 1) & 1)) : wq;  // passes keep bit 1 of the column
    w_dst = Tile::kXBytes + (wc * Tile::kWStride + kChunk * w_chunk) * sizeof(T);
    words_dst = Tile::kXBytes + Tile::kWBytes + (warp * kOffsetWords + lane) * 4;
    leader = col0 + 32 * warp < p.nout;
  }

  // Copies stage `step` (K positions [step * kPositions, +kPositions), stored entries
  // [step * kEntries, +kEntries), which lie within the row as kEntries divides 32) to the stage
  // at `stage`; rows, columns and positions past the ends land as zeros.
  __device__ __forceinline__ void load(const PathParams<T>& p, uint32_t stage, int64_t step, int lane) const {
    const int64_t k0 = step * kPositions;
    const bool k_ok = k_chunk + k0 < p.k;  // K % kChunk == 0: a chunk is all in K or all past it
#pragma unroll
    for (int i = 0; i < kXPasses; ++i) {
      const bool ok = k_ok && i * kXRowsPerPass < x_rows_left;
      sm90::cp_async16(stage + x_dst + i * kXRowsPerPass * Tile::kXStride * sizeof(T), ok ? x + i * x_pass + k0 : p.x,
                       ok);
    }
    const int64_t j0 = step * kEntries;
#pragma unroll
    for (int i = 0; i < kWPasses; ++i) {
      const bool ok = i * kWColsPerPass < w_cols_left;
      sm90::cp_async16(stage + w_dst + i * kWColsPerPass * Tile::kWStride * sizeof(T),
                       ok ? values + i * w_pass + j0 : p.values, ok);
    }
    if (lane < kOffsetWords) {
      const int64_t word = (j0 * p.bits >> 5) + lane;
      const bool ok = leader && word < p.index_words;
      sm90::cp_async4(stage + words_dst, ok ? words + (j0 * p.bits >> 5) : p.indices, ok);
    }
  }
};

// One stage's products for fp32 (3xTF32, m16n8k8): kEntries / 8 k-steps.
template <typename Tile>
__device__ __forceinline__ void multiply_stage_tf32(float (&acc)[Tile::kRowTiles][4][4], const float* xs,
                                                    const float* ws, int position, int g, int q) {
  constexpr int kRowTiles = Tile::kRowTiles, kRowTilesAtOnce = kRowTiles < 4 ? kRowTiles : 4;  // A fragments held
#pragma unroll
  for (int s = 0; s < Tile::kEntries / 8; ++s) {
    const int k_lo = __shfl_sync(0xffffffffu, position, 8 * s + 2 * q);
    const int k_hi = __shfl_sync(0xffffffffu, position, 8 * s + 2 * q + 1);
    uint32_t b_big[4][2], b_small[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int half = Tile::kSwizzle ? s ^ ((g >> 1) & 1) : s;
      const float2 v = *reinterpret_cast<const float2*>(ws + (8 * nt + g) * Tile::kWStride + 8 * half + 2 * q);
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

// One stage's products for fp16 / bf16 (m16n8k16): kEntries / 16 k-steps. Lane (g, q)'s k
// indices 2q, 2q + 1, 2q + 8 and 2q + 9 stand for entries q, q + 4, q + 8 and q + 12 of the k-step,
// so each A gather (one load per lane: rows g or g + 8, one entry per q) reads 4 consecutive
// entries: at N/M = 1/2 their positions lie in one 16-byte group of each row, and the rows' groups
// in different banks (no conflict); at 1/4 and 1/8 in 2 and 4 groups, where rows share banks and
// conflict when their offsets meet. B is 4 loads per column. (Four consecutive entries per lane
// instead, one 8-byte B load, spread each gather over 16 entries: 1.13-1.51x slower at N/M = 1/2,
// within 5% at 1/4 and 1/8 up to 64 rows; BENCHMARKS.md, session 23.)
template <typename Tile, typename T>
__device__ __forceinline__ void multiply_stage_16bit(float (&acc)[Tile::kRowTiles][4][4], const T* xs, const T* ws,
                                                     int position, int g, int q) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xs);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(ws);
#pragma unroll
  for (int s = 0; s < Tile::kEntries / 16; ++s) {
    int k[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) k[j] = __shfl_sync(0xffffffffu, position, 16 * s + 4 * j + q);
    uint32_t b[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const uint16_t* column = w + (8 * nt + g) * Tile::kWStride + 16 * s + q;
      b[nt][0] = pair(column[0], column[4]), b[nt][1] = pair(column[8], column[12]);
    }
#pragma unroll
    for (int mt = 0; mt < Tile::kRowTiles; ++mt) {
      const uint16_t* lo = x + (16 * mt + g) * Tile::kXStride;
      const uint16_t* hi = lo + 8 * Tile::kXStride;
      const uint32_t a[4] = {pair(lo[k[0]], lo[k[1]]), pair(hi[k[0]], hi[k[1]]), pair(lo[k[2]], lo[k[3]]),
                             pair(hi[k[2]], hi[k[3]])};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mma_16bit<T>(acc[mt][nt], a, b[nt]);
    }
  }
}

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1) vector_kernel(PathParams<T> p, int log2n, int log2m) {
  constexpr int kRows = Tile::kRows, kEntries = Tile::kEntries, kPositions = Tile::kPositions;
  constexpr int kCols = Tile::kCols;
  constexpr int kRowTiles = Tile::kRowTiles;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows, col0 = static_cast<int64_t>(blockIdx.x) * kCols;
  // This block's stages [first, last): all of them unless a cluster of gridDim.z blocks splits K.
  const int64_t steps = (p.groups * p.m + kPositions - 1) / kPositions, per_block = (steps + gridDim.z - 1) / gridDim.z;
  const int64_t first = min(steps, blockIdx.z * per_block), last = min(steps, first + per_block);
  const StageCopies<T, Tile> copies(p, row0, col0, warp, lane);
  const uint32_t ring = sm90::smem_addr(smem);
  float acc[kRowTiles][4][4] = {};

  for (int64_t s = first; s < first + Tile::kStages - 1; ++s) {
    if (s < last) copies.load(p, ring + (s % Tile::kStages) * Tile::kStageBytes, s, lane);
    sm90::cp_async_commit();
  }
  for (int64_t step = first; step < last; ++step) {
    sm90::cp_async_wait<Tile::kStages - 2>();
    __syncthreads();  // stage `step` is in, and every warp is done with the slot refilled next
    const int64_t next = step + Tile::kStages - 1;
    if (next < last) copies.load(p, ring + (next % Tile::kStages) * Tile::kStageBytes, next, lane);
    sm90::cp_async_commit();

    const unsigned char* stage = smem + (step % Tile::kStages) * Tile::kStageBytes;
    const T* xs = reinterpret_cast<const T*>(stage);
    const T* ws = reinterpret_cast<const T*>(stage + Tile::kXBytes) + warp * 32 * Tile::kWStride;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(stage + Tile::kXBytes + Tile::kWBytes) + warp * kOffsetWords;
    // Lane e: the tile position of this stage's entry e (group e / N, offset from the leader's row).
    const int64_t j0 = step * kEntries;
    int position = 0;
    if (lane < kEntries) {
      const int bit = static_cast<int>((j0 + lane) * p.bits - ((j0 * p.bits >> 5) << 5));
      position = ((lane >> log2n) << log2m) + static_cast<int>(read_bits(words, bit, p.bits) & ((1u << p.bits) - 1u));
    }
    if constexpr (std::is_same_v<T, float>)
      multiply_stage_tf32<Tile>(acc, xs, ws, position, g, q);
    else
      multiply_stage_16bit<Tile, T>(acc, xs, ws, position, g, q);
  }

  // Outputs go straight out, or with K split over a cluster into this block's partial tile,
  // which reduce_cluster sums (the ring is free once every warp is past its last stage).
  const bool split = gridDim.z > 1;
  float* partial = reinterpret_cast<float*>(smem);
  if (split) {
    sm90::cp_async_wait<0>();
    __syncthreads();
  }
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * mt + g + 8 * (e >> 1), c = 32 * warp + 8 * nt + 2 * q + (e & 1);
        if (split) partial[r * kCols + c] = acc[mt][nt][e];
        else store_output<T>(p, row0 + r, col0 + c, acc[mt][nt][e]);
      }
  if (split) reduce_cluster<T, kRows, kCols, Tile::kThreads>(p, partial, row0, col0);
}

// Blocks of a cluster that split each tile's K (1 = no split), only where the tiles alone leave
// SMs idle: splitting grids of several waves (4096 x 4096 x 11008) ran 1.08-1.29x slower. Of 1,
// 2, 4 and 8 it takes the least waves x stages per block, a wave being as many clusters as run at
// once, with at least 4 stages per block; ties go to the smaller split. On the H100, with 16 tiles
// (N = 4096, up to 64 rows), 8-way splits take two waves (15 clusters at once) and ran
// 1.03-1.22x slower than 4-way ones (BENCHMARKS.md, session 22).
template <typename T, typename Tile>
int k_split(int64_t tiles, int64_t steps) {
  if (compute_capability() < 90 || tiles >= multiprocessor_count()) return 1;  // clusters; a full grid
  int best = 1;
  int64_t best_cost = steps;  // one wave of whole-K blocks
  for (const int split : {2, 4, 8}) {
    if (steps < 4 * split) break;
    const int64_t clusters = active_clusters<vector_kernel<T, Tile>>(split, Tile::kThreads, Tile::kSmemBytes);
    const int64_t cost = (tiles + clusters - 1) / clusters * ((steps + split - 1) / split);
    if (cost < best_cost) best = split, best_cost = cost;
  }
  return best;
}

template <typename T, typename Tile>
cudaError_t launch(const PathParams<T>& p, cudaStream_t stream) {
  constexpr auto kernel = vector_kernel<T, Tile>;
  constexpr int kBytes = Tile::kSmemBytes, kPositions = Tile::kPositions, kRows = Tile::kRows;
  constexpr int kThreads = Tile::kThreads, kCols = Tile::kCols;
  if (const cudaError_t e = allow_dynamic_smem<kernel>(kBytes); e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((p.nout + kCols - 1) / kCols),
                  static_cast<unsigned>((p.rows + kRows - 1) / kRows));
  const int log2n = __builtin_ctz(p.n), log2m = __builtin_ctz(p.m);
  const int64_t steps = (p.groups * p.m + kPositions - 1) / kPositions;
  const int splits = k_split<T, Tile>(static_cast<int64_t>(grid.x) * grid.y, steps);
  if (splits == 1) {
    kernel<<<grid, kThreads, kBytes, stream>>>(p, log2n, log2m);
    return cudaGetLastError();
  }
  return launch_split_k(kernel, grid, kThreads, kBytes, stream, splits, false, p, log2n, log2m);
}

// The activation tile: the smallest of 32 and 64 rows that holds the call's rows, where the grid
// is small and k_split fills the GPU. Past 64 rows 128 x 256 tiles, except for fp32 (session 31:
// against the padded 128 x 256 tile in one lease, nmSPARSE shapes at 4096 rows and LLaMA shapes
// at 256 and 4096):
//  * N/M = 1/8: 64 x 512 tiles (16 warps) copy fewer activation bytes per MMA: 0.97-1.13x, below
//    1 only at 4096 x 1024 x 1024;
//  * N/M = 1/4: unpadded, swizzled value columns, so 4 stages fit where 3 did: 1.00-1.08x;
//  * N/M = 1/2 keeps the padded columns (4 stages either way; the swizzle ran 0.98-1.02x).
template <typename T, int kRatio>
cudaError_t launch_rows(const PathParams<T>& p, cudaStream_t stream) {
  if (p.rows <= 32) return launch<T, VectorTile<T, kRatio, 32, 32>>(p, stream);
  if (p.rows <= 64) return launch<T, VectorTile<T, kRatio, 64, 32>>(p, stream);
  if constexpr (std::is_same_v<T, float> && kRatio == 8)
    return launch<T, VectorTile<T, kRatio, 64, 16, 16>>(p, stream);
  else if constexpr (std::is_same_v<T, float> && kRatio == 4)
    return launch<T, VectorTile<T, kRatio, 128, 16, 8, true>>(p, stream);
  else
    return launch<T, VectorTile<T, kRatio, 128, 16>>(p, stream);
}

bool power_of_two(int v) { return v > 0 && (v & (v - 1)) == 0; }

}  // namespace

bool vector_family(int n, int m) {
  return power_of_two(n) && power_of_two(m) && (m == 2 * n || m == 4 * n || m == 8 * n);
}

// Stages span kEntries x 2, 4 or 8 K positions at N/M = 1/2, 1/4, 1/8.
template <typename T>
cudaError_t run_vector(PathParams<T> p, cudaStream_t stream) {
  if (p.m == 2 * p.n) return launch_rows<T, 2>(p, stream);
  if (p.m == 4 * p.n) return launch_rows<T, 4>(p, stream);
  return launch_rows<T, 8>(p, stream);
}

template cudaError_t run_vector<float>(PathParams<float>, cudaStream_t);
template cudaError_t run_vector<__half>(PathParams<__half>, cudaStream_t);
template cudaError_t run_vector<__nv_bfloat16>(PathParams<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
