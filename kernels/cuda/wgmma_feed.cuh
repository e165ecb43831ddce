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
// (which that kernel may write) once it has finished.
template <int S, bool kEarly, typename Bytes, typename Full, typename Empty, typename Activations, typename Values,
          typename Offsets>
__device__ __forceinline__ void produce(int begin, int end, int lane, Bytes&& bytes, Full&& full, Empty&& empty,
                                        Activations&& activations, Values&& values, Offsets&& offsets) {
  RingSlot<S> stage;
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
// rows, where offset_rows_aligned(p) (the kernels copy them with cp.async otherwise); false where
// the driver refuses it.
template <typename T>
bool offsets_map(CUtensorMap* map, const PathParams<T>& p, int words) {
  return !offset_rows_aligned(p) || tile_map(map, p.indices, p.index_words * 2, p.nout, p.index_words * 2, words * 2,
                                             kTileW, CU_TENSOR_MAP_SWIZZLE_NONE);
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
