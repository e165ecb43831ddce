// A step's packed weight tile (docs/FORMAT.md) for the warpgroup kernels that rebuild the weight
// in shared memory (wgmma.cu: dense tiles; wgmma_sp.cu: 2:4 tiles regrouped from sparser
// patterns; wgmma_tf32.cu): the family's per-step geometry, and the copy of a step's stored values
// and offset words by cp.async from every thread (PackedLoader, the fp32 kernel's; the others'
// producer warp copies them, wgmma_feed.cuh). sm_90a only.
#pragma once
#include "wgmma_tile.cuh"

namespace nmcli {
namespace sm90 {

// Geometry of one step (kBK K positions) of an N:M family.
template <int kN, int kM>
struct Family {
  static constexpr int kBits = index_bits(kM);
  static constexpr int kEntries = kBK / kM * kN;              // stored entries per weight row per step
  static constexpr int kValueBytes = kEntries * 2;             // >= 16 because M <= 8N
  static constexpr int kChunk = 16;                            // bytes per value copy
  static constexpr int kValueChunks = kValueBytes / kChunk;
  static constexpr int kOffsetWords = (kEntries * kBits + 31) / 32;  // a step's offset bits
  static constexpr int kIndexWords = kOffsetWords + 1;               // ... copied from any start bit
  static constexpr int kGroupBits = kN * kBits;                      // offset bits of one group
  static_assert(kValueBytes % 16 == 0, "a step must hold whole 16-byte runs of values");
  static_assert(kM == 4 || kM == 8 || kM == 16, "groups must not straddle 8-position halves");
  // Shared-memory bytes of a step's kTileW rows of values (its offset words follow them).
  static constexpr size_t kValues = static_cast<size_t>(kTileW) * kValueBytes;
  // The word holding step t's first offset bit, and that bit inside it.
  static __device__ __forceinline__ int64_t first_word(int64_t t) { return (t * kEntries * kBits) >> 5; }
  static __device__ __forceinline__ int first_bit(int64_t t) { return static_cast<int>((t * kEntries * kBits) & 31); }
};

// Copies a step's packed weight tile to a shared-memory address: row r's values at
// r * kValueBytes, its offset words (from the word holding the step's first offset bit) at
// kValues + r * kIndexWords * 4. Every thread copies the same chunks of every step, so the
// addresses are computed once; per step only K moves. Rows past the end and steps past the
// stored entries are zero-filled. F is the step's geometry (Family here, or the fp32 path's):
// kEntries, kBits, kValueBytes, kChunk (bytes per value copy: 16, 8 or 4), kValueChunks,
// kIndexWords, kValues.
template <typename T, typename F>
struct PackedLoader {
  // A step's entries divide or fill the rows' 32-entry multiples, so a step that starts inside a
  // row ends inside it.
  static_assert(32 % F::kEntries == 0 || F::kEntries % 32 == 0, "steps never straddle a row's end");
  static constexpr int kV = (kTileW * F::kValueChunks + kThreads - 1) / kThreads;   // 16-byte chunks
  static constexpr int kI = (kTileW * F::kIndexWords + kThreads - 1) / kThreads;    // 4-byte words

  const T* v[kV];
  uint32_t v_dst[kV];
  bool v_ok[kV];
  const uint32_t* w[kI];    // index words of the row, at word 0
  uint32_t w_dst[kI];
  int w_col[kI];
  bool w_ok[kI];

  __device__ __forceinline__ PackedLoader(const PathParams<T>& p, int64_t w0) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const int i = tid + j * kThreads, row = i / F::kValueChunks, c = i % F::kValueChunks;
      v_ok[j] = i < kTileW * F::kValueChunks && w0 + row < p.nout;
      v[j] = p.values + (v_ok[j] ? (w0 + row) * p.row_len + c * (F::kChunk / static_cast<int>(sizeof(T))) : 0);
      v_dst[j] = row * F::kValueBytes + c * F::kChunk;
    }
#pragma unroll
    for (int j = 0; j < kI; ++j) {
      const int i = tid + j * kThreads, row = i / F::kIndexWords, c = i % F::kIndexWords;
      w_ok[j] = i < kTileW * F::kIndexWords && w0 + row < p.nout;
      w[j] = p.indices + (w_ok[j] ? (w0 + row) * p.index_words : 0);
      w_col[j] = c;
      w_dst[j] = static_cast<uint32_t>(F::kValues) + (row * F::kIndexWords + c) * 4;
    }
  }

  __device__ __forceinline__ void load(const PathParams<T>& p, uint32_t dst, int64_t t) const {
    const int64_t j0 = t * F::kEntries;  // the step's first stored entry
    const bool in_row = j0 < p.row_len;
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      if (kTileW * F::kValueChunks % kThreads != 0 && threadIdx.x + j * kThreads >= kTileW * F::kValueChunks) break;
      const bool ok = v_ok[j] && in_row;
      const T* src = ok ? v[j] + j0 : p.values;
      if constexpr (F::kChunk == 16) cp_async16(dst + v_dst[j], src, ok);
      else if constexpr (F::kChunk == 8) cp_async8(dst + v_dst[j], src, ok);
      else cp_async4(dst + v_dst[j], src, ok);
    }
    const int64_t word0 = (j0 * F::kBits) >> 5;
#pragma unroll
    for (int j = 0; j < kI; ++j) {
      if (kTileW * F::kIndexWords % kThreads != 0 && threadIdx.x + j * kThreads >= kTileW * F::kIndexWords) break;
      const int64_t word = word0 + w_col[j];
      const bool ok = w_ok[j] && word < p.index_words;
      cp_async4(dst + w_dst[j], ok ? w[j] + word : p.indices, ok);
    }
  }
};

}  // namespace sm90
}  // namespace nmcli
