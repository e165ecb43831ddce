// The producer side of the TMA-fed warpgroup kernels (wgmma_sp.cu: the sparse tensor cores; wgmma.cu:
// the weight expanded to dense tiles): one warp issues every copy of a block, tensor copies (TMA)
// for the activation tiles and the stored values, and completes each stage on a "full" barrier;
// the consumers hand stages back on an "empty" barrier. Also the tensor maps those copies read,
// built on the host for each call. sm_90a only.
#pragma once
#include <cuda.h>  // CUtensorMap; the encoder comes from the driver at run time (no libcuda link)

#include "wgmma_packed.cuh"

namespace nmcli {
namespace sm90 {

constexpr int kProducerThreads = 32;  // one warp issues every copy

// A kernel's tensor maps (TMA descriptors): activation tiles, stored-value tiles and (the 2:4 and
// expanding kernels, where offset_rows_aligned) offset-word tiles, in the layouts the kernel reads.
struct TileMaps {
  CUtensorMap x;
  CUtensorMap values;
  CUtensorMap offsets;

  // For the producer's lane 0, before its first copies: fetches the descriptors it will read,
  // the offset-word map's too where `offsets_too`.
  __device__ __forceinline__ void prefetch(bool offsets_too) const {
    tma_prefetch_map(&x);
    tma_prefetch_map(&values);
    if (offsets_too) tma_prefetch_map(&offsets);
  }
};

// A position in a ring of kSize stages and the parity of its current pass, the phase its barrier
// waits expect. advance<kBy>() moves on by kBy stages, a divisor of kSize, so a move lands on the
// ring's end exactly and wraps to the next pass.
template <int kSize>
struct RingSlot {
  int slot = 0;
  uint32_t phase = 0;
  template <int kBy = 1>
  __device__ __forceinline__ void advance() {
    static_assert(kSize % kBy == 0, "moves land on the ring's end");
    slot += kBy;
    if (slot == kSize) slot = 0, phase ^= 1;
  }
};

// The producer warp's schedule. Step t's copies go to stage t % S once the consumers released it
// (`empty(s)`, phase parity): lane 0 tells the stage's `full` barrier the bytes(s) its tensor
// copies bring and issues them, activations(s, t) and values(s, t) (the weight tiles: values and,
// where they go by tensor copy, offset words); then every lane copies its share of any offset
// words that go by cp.async, offsets(s, t). kEarly, for a grid launched as a programmatic
// dependent (it may start while the previous kernel in the stream still runs): the weights are
// constants, so the first S steps' weight copies go out at once, and their activation tiles
// (which that kernel may write) once it has finished. Step `begin` goes to stage `stage` (the
// ring's start unless a block's earlier steps left it elsewhere: stream_k); returns where the next
// step would go.
template <int S, bool kEarly, typename Bytes, typename Full, typename Empty, typename Activations, typename Values,
          typename Offsets>
__device__ __forceinline__ RingSlot<S> produce(int begin, int end, int lane, Bytes&& bytes, Full&& full, Empty&& empty,
                                               Activations&& activations, Values&& values, Offsets&& offsets,
                                               RingSlot<S> stage = {}) {
  int t = begin;
  if constexpr (kEarly) {
    const int ahead = min(end - begin, S);
    for (int i = 0; i < ahead; ++i) {
      if (lane == 0) {
        mbarrier_arrive_expect_tx(full(i), bytes(i));
        values(i, begin + i);
      }
      offsets(i, begin + i);
    }
    wait_for_previous_kernel();
    if (lane == 0)
      for (int i = 0; i < ahead; ++i) activations(i, begin + i);
    t = begin + ahead;
    stage.slot = ahead % S, stage.phase = ahead == S;  // the stages filled ahead wrapped the ring once
  }
  for (; t < end; ++t) {
    const int s = stage.slot;
    mbarrier_wait(empty(s), stage.phase ^ 1);  // passes at once on a stage's first use
    if (lane == 0) {
      mbarrier_arrive_expect_tx(full(s), bytes(s));
      activations(s, t);
      values(s, t);
    }
    offsets(s, t);
    stage.advance();
  }
  return stage;
}

// Stream-K (after Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense Matrix
// Multiplication on the GPU", 2023) for grids of fewer tiles than SMs (launch_split): one block
// per SM, every block an equal run of the call's groups of kGroup steps, tile after tile. A run is
// shorter than a tile, so it holds the end of one tile (which the block finishes) and the start of
// the next (whose partial sums it hands over), or a piece of one. A block does the piece it hands
// over first and the one it finishes last, so the partial sums it adds were made first thing by
// the blocks before it. Both pieces run through one ring without a stop: the producer goes on to
// the second piece's copies while the consumers finish the first and store its sums.
// * Handover: the consumers store their fp32 accumulators in the block's slot of p.partials
//   (consumer thread i's float4 j at (j * kThreads + i) * 4: a warp's stores are 512 contiguous
//   bytes) and arrive on named barrier 1; the producer warp, once it has issued the first ring's
//   worth of the next piece, waits there and marks the slot ready in p.flags[block] (a release
//   store: the waiting is its, not the consumers').
// * Finish: thread 0 waits for the flags of the blocks holding the tile's earlier steps (acquire
//   loads), the consumers add their sums, and finish_tile writes the tile. A block waits only for
//   blocks before it, which never wait for it and which the GPU starts first (in index order), so
//   the grid finishes even where not all of it is resident (it is: one block per SM).
// Each role's work comes as a callable: produce_steps(tile, begin, end, from), consume_steps(begin,
// end, from) (into acc from zero) and other_steps(begin, end, from) for any third role; `from` is
// the ring slot of step `begin`, and each returns the slot after its last step.
struct StreamKRun {
  int per_tile, total, lo, hi;  // groups a tile, of all tiles; this block's run [lo, hi)
  template <int kRows, int kGroup, typename T>
  __device__ __forceinline__ static StreamKRun of(const PathParams<T>& p, int64_t positions) {
    const int per_tile = static_cast<int>(((positions + kBK - 1) / kBK + kGroup - 1) / kGroup);
    const int tiles = static_cast<int>((p.nout + kTileW - 1) / kTileW * ((p.rows + kRows - 1) / kRows));
    const int total = tiles * per_tile;
    return {per_tile, total, run_end(total, static_cast<int>(blockIdx.x) - 1), run_end(total, blockIdx.x)};
  }
  // Where block c's run ends (c = -1: where the first one starts).
  __device__ __forceinline__ static int run_end(int total, int c) {
    return static_cast<int>((static_cast<int64_t>(c) + 1) * total / gridDim.x);
  }
};
// A piece of a block's run: its tile (-1: none) and steps [begin, end) of that tile, and whether
// the piece ends the tile (the block finishes it) and starts it (no other block holds part of it).
struct StreamKPiece {
  int tile, begin, end;
  bool ends, starts;
};
// The block's piece `which` (0: of its last tile, 1: of the tile before), computed again wherever it
// is needed (from the launch: nothing of it stays in registers across a piece's main loop).
template <int kRows, int kGroup, typename T>
__device__ __forceinline__ StreamKPiece stream_k_piece(const PathParams<T>& p, int64_t positions, int which) {
  asm volatile("" : "+r"(which));  // unknown to the compiler: recomputed, not kept
  const StreamKRun r = StreamKRun::of<kRows, kGroup>(p, positions);
  const int tile = (r.hi - 1) / r.per_tile - which, tile_begin = tile * r.per_tile;
  const int first = max(r.lo, tile_begin), last = min(r.hi, tile_begin + r.per_tile);
  return {r.hi > r.lo && tile >= r.lo / r.per_tile ? tile : -1, (first - tile_begin) * kGroup,
          (last - tile_begin) * kGroup, last == tile_begin + r.per_tile, first == tile_begin};
}

__device__ __forceinline__ void release_flag(uint32_t* flag) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(1u) : "memory");
}
__device__ __forceinline__ void acquire_flag(const uint32_t* flag) {
  uint32_t ready = 0;
  do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
  while (ready == 0);
}
constexpr int kHandoverBarrier = 1;  // named barrier: the consumers arrive, the producer warp waits
constexpr int kHandoverThreads = kThreads + kProducerThreads;

template <typename T, int kRows, int kGroup, int S, typename Produce, typename Consume, typename Other>
__device__ __forceinline__ void stream_k(const PathParams<T>& p, int64_t positions, float (&acc)[kRows / 2],
                                         uint8_t* scratch, bool consumer, bool producer, int row, int q,
                                         Produce&& produce_steps, Consume&& consume_steps, Other&& other_steps) {
  static_assert(kRows == kStreamKRows && kStreamKSlotFloats == int64_t{kRows} * kTileW, "a slot: a tile's sums");
  const int tid = static_cast<int>(threadIdx.x), b = static_cast<int>(blockIdx.x);
  const auto piece = [&](int which) { return stream_k_piece<kRows, kGroup>(p, positions, which); };
  // The piece handed over (which 0, unless the run ends its last tile) and the one finished.
  const auto hands_over = [&] { return !piece(0).ends; };
  const auto finished = [&] { return piece(hands_over() ? 1 : 0); };
  RingSlot<S> slot{};
  if (producer) {
    int mid = 0;  // the finished piece's steps before it are issued before the handover's flag
    if (hands_over()) {
      const StreamKPiece h = piece(0);
      slot = produce_steps(tile_at<kRows>(p, h.tile), h.begin, h.end, slot);
    }
    if (const StreamKPiece f = finished(); f.tile >= 0) {
      mid = min(f.end, f.begin + S);
      slot = produce_steps(tile_at<kRows>(p, f.tile), f.begin, mid, slot);
    }
    if (hands_over()) {
      asm volatile("bar.sync %0, %1;" ::"r"(kHandoverBarrier), "r"(kHandoverThreads) : "memory");
      if ((tid & 31) == 0) release_flag(p.flags + b);
    }
    if (const StreamKPiece f = finished(); f.tile >= 0 && mid < f.end)
      produce_steps(tile_at<kRows>(p, f.tile), mid, f.end, slot);
  } else if (consumer) {
    if (hands_over()) {
      const StreamKPiece h = piece(0);
      slot = consume_steps(h.begin, h.end, slot);
      float4* out = reinterpret_cast<float4*>(p.partials + b * kStreamKSlotFloats);
#pragma unroll
      for (int i = 0; i < kRows / 8; ++i)
        __stcg(out + i * kThreads + tid, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
      asm volatile("bar.arrive %0, %1;" ::"r"(kHandoverBarrier), "r"(kHandoverThreads) : "memory");
    }
    if (const StreamKPiece f = finished(); f.tile >= 0) consume_steps(f.begin, f.end, slot);
  } else {
    if (hands_over()) {
      const StreamKPiece h = piece(0);
      slot = other_steps(h.begin, h.end, slot);
    }
    if (const StreamKPiece f = finished(); f.tile >= 0) other_steps(f.begin, f.end, slot);
  }
  const StreamKPiece f = finished();
  if (f.tile < 0) return;
  if (!f.starts) {  // the blocks from the one holding the tile's first group on hold its earlier steps
    const StreamKRun r = StreamKRun::of<kRows, kGroup>(p, positions);
    const int tile_begin = f.tile * r.per_tile;
    int c = static_cast<int>(static_cast<int64_t>(tile_begin) * gridDim.x / r.total);
    while (StreamKRun::run_end(r.total, c) <= tile_begin) ++c;
    if (tid == 0)
      for (int d = c; d < b; ++d) acquire_flag(p.flags + d);
    __syncthreads();
    if (consumer)
      for (; c < b; ++c) {
        const float4* in = reinterpret_cast<const float4*>(p.partials + c * kStreamKSlotFloats);
#pragma unroll
        for (int i0 = 0; i0 < kRows / 8; i0 += 8) {  // 8 loads in flight, then their adds
          float4 v[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = __ldcg(in + (i0 + i) * kThreads + tid);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            float* a = acc + 4 * (i0 + i);
            a[0] += v[i].x, a[1] += v[i].y, a[2] += v[i].z, a[3] += v[i].w;
          }
        }
      }
  }
  const BlockTile tile = tile_at<kRows>(p, f.tile);
  finish_tile<T, kRows>(p, acc, scratch, consumer, tile.w0, tile.rows, row, q);
}

// The producer warp's copy of kWords offset words from word `first` of each of a tile's kTileW rows
// (from row w0) to `words`, row after row, 4 bytes a lane at a time (rows of words are rarely
// 16-byte aligned, as a tensor copy needs); then each lane arrives on `full` once its copies have
// landed. Zeros past the row and past Nout.
template <int kWords, typename T>
__device__ __forceinline__ void copy_offset_words(const PathParams<T>& p, uint32_t words, int64_t first, int64_t w0,
                                                  int lane, uint32_t full) {
#pragma unroll
  for (int i = lane; i < kTileW * kWords; i += 32) {
    const int row = i / kWords;
    const int64_t word = first + i % kWords;
    const bool ok = w0 + row < p.nout && word < p.index_words;
    cp_async4(words + i * 4, ok ? p.indices + (w0 + row) * p.index_words + word : p.indices, ok);
  }
  cp_async_arrive(full);
}

// cuTensorMapEncodeTiled from the driver, looked up once (the op library links only the static
// CUDA runtime); null when the driver lacks it.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiled encode_tiled() {
  static const EncodeTiled encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess)
      return static_cast<EncodeTiled>(nullptr);
    return reinterpret_cast<EncodeTiled>(fn);
  }();
  return encode;
}

// A tensor map over `rows` rows of `cols` 16-bit elements (`stride` elements apart) whose boxes
// of [box_rows x box_cols] land in shared memory with `swizzle`; out-of-bounds elements read as
// zeros. False where the driver refuses it (e.g. a base address not 16-byte aligned).
inline bool tile_map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows, int64_t stride, int box_cols,
                     int box_rows, CUtensorMapSwizzle swizzle) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(base), dims, strides, box, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Whether rows of offset words may be copied as tensor tiles: a tensor map's row stride must be a
// multiple of 16 bytes and its base 16-byte aligned, and a box's first element must lie on a
// 16-byte boundary (else the copy stops the kernel with "illegal instruction"). Other rows (K = 4104
// at 2:4, for one: 130 words a row) are copied by the producer warp's lanes with cp.async into the
// same layout (copy_offset_words in the expanding kernel).
template <typename T>
__host__ __device__ bool offset_rows_aligned(const PathParams<T>& p) {
  return p.index_words % 4 == 0 && reinterpret_cast<uintptr_t>(p.indices) % 16 == 0;
}

// A tensor map over the offset words (as 16-bit halves) whose boxes bring `words` words of kTileW
// rows with `swizzle`, where offset_rows_aligned(p) (the kernels copy them with cp.async
// otherwise); false where the driver refuses it.
template <typename T>
bool offsets_map(CUtensorMap* map, const PathParams<T>& p, int words,
                 CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE) {
  return !offset_rows_aligned(p) || tile_map(map, p.indices, p.index_words * 2, p.nout, p.index_words * 2, words * 2,
                                             kTileW, swizzle);
}

// The maps of a kernel that copies a step's [kRows x kBK] activation tile (128-byte swizzle) and
// its packed values as laid out in the format (no swizzle, F::kEntries a row; PackedLoader's
// layout); false where the driver refuses. The offset words have their own map where they go by
// tensor copy (offsets_map), else copy_offset_words.
template <typename F, int kRows, typename T>
bool packed_maps(TileMaps* maps, const PathParams<T>& p) {
  return tile_map(&maps->x, p.x, p.k, p.rows, p.k, kBK, activation_box_rows<kRows>(p.rows),
                  CU_TENSOR_MAP_SWIZZLE_128B) &&
         tile_map(&maps->values, p.values, p.row_len, p.nout, p.row_len, F::kEntries, kTileW,
                  CU_TENSOR_MAP_SWIZZLE_NONE);
}

}  // namespace sm90
}  // namespace nmcli
