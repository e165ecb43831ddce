// Decode-sized calls (1..16 activation rows) on the tensor cores, fp16/bf16, for the families with
// one or two entries in groups of 4 or 8 (1:4, 2:4, 1:8, 2:8) and four in groups of 8 or 16 (4:8,
// 4:16).
//
// Why: the SIMT decode kernel multiplies every stored entry by every row in fp32, after one
// 16-to-32-bit conversion per entry and row; from 3-5 rows on that, not the bytes, sets its time
// (4096 x 4096 2:8 on the H200: 6.9 us at 2 rows, 12.8 at 8, 26.0 at 16, for 10 MB). Here
// mma.sync m16n8k16 does the products, so rows cost little up to 16 (7.7 us at 2 rows, 8.9 at 8,
// 12.2 at 16), and its work per stored entry is building the dense weight fragment. At 1-2 rows
// decode stays faster on most shapes. Every block needs the activations of its whole K slice, so
// rows still cost bytes out of L2 (BENCHMARKS.md sessions 35, 36 and 38).
//  * The weights are the MMA's M = 16 side (A, 16 columns x 16 positions) and the activation rows
//    its N side in n8 tiles (B, from shared memory by ldmatrix), so 1-8 rows take one MMA per 16
//    positions and 9-16 two, with no zero rows multiplied.
//  * The weight fragment is built in registers, never in shared memory: lane (g, q) of a warp
//    holds, per 16-position slab, positions 2q, 2q+1 and 2q+8, 2q+9 of columns g and g + 8. Each
//    pair lies in one group; a PRMT picks each half from the group's value word (or zero) with a
//    selector looked up in a per-lane table (one shared-memory word per lane and key,
//    lane-strided, so the 32 lookups of a warp never share a bank; see table_lanes for the one
//    exception). With one entry a group one key covers both pairs of a column. The key's byte
//    offset into the table comes from the offset string in one shift and one LOP3. With four
//    entries a group the values fill two words: a word's two entries key its selector (for groups
//    of 16 a 32 KB table, which at 9-16 rows, where the activations need the room, holds 16 lanes a
//    key), and the two words' PRMTs are ORed (a position holds at most one entry; a 16-bit field as
//    one key would need a table of 65536 keys). Session 48: against each entry keying its own selector (its offset and its half of the
//    word, a word's two ORed), with the leaner loop, 1.16-1.59x at 2-16 rows (4:8), 1.23-1.43x at
//    2-8 rows (4:16; 1.10-1.15x of it from the leaner loop), and 1.10-1.18x at 9-16 rows (4:16,
//    the 16-lane table).
//  * 2:4 builds nothing: its stored values and offset words are the operands of the 2:4 sparse
//    mma.sync (m16n8k32) as they are. A step is two such MMAs; ldmatrix.x4 reads an MMA's values
//    from the stage, and each metadata word is one PRMT of two columns' offset words (session 62,
//    H200: 1.06-1.47x the fragment-building kernel at 1-8 rows, with the two changes below). Its
//    warps take interleaved steps (below: 0.99-1.16x), and at 1-8 rows its ring is 8 steps deep
//    (1.06-1.23x the 4-step ring on 4096 x 1024 and 4096 x 4096, level on wider and longer
//    weights; 0.84-1.00x at 16 rows, which keep 4).
//  * Each warp owns 16 output columns and a share of K: a block's 8 warps split a column tile's
//    K steps (each a run of consecutive steps; for 2:4, every 8th step, so that the block reads
//    neighbouring steps of a column together) and sum their partial tiles through shared memory.
//    The block walks column tiles blockIdx.x, + gridDim.x, ... (one block per SM) and stages the
//    activations once: each warp copies those of its own steps with the first tile's weight
//    steps, so its first step waits for one step of activations, not for all of them (session
//    38: 1.05-1.55x on 1-16 rows).
//  * Where the activations of all of K do not fit one block's shared memory (K past 4480-4928 at
//    9-16 rows, 8576-10560 at 1-8, by family, 7616 for 2:4), K is split over a cluster of 2-8
//    blocks (the fewest that fit): each stages and walks its slice of the steps for the same
//    column tiles, and the blocks' sums meet through distributed shared memory in batches of up
//    to 8 tiles, with no workspace and no second kernel. That lifts the limit to K = 34816-38912
//    at 9-16 rows, 68608-83968 at 1-8 (2:4's deeper ring: one block to K = 7616, 8 blocks to
//    60416).
//  * A step is 32 stored entries of each of the warp's 16 columns (the row padding unit of the
//    format, so no step runs past a row). Its values and offset words go global -> shared with
//    cp.async into a ring of kDepth steps per warp, from per-lane sources moved along each step; the
//    first steps and the selector table (built by the compiler) are copied before the kernel
//    waits on the previous one (the weights are constants), like the decode kernel.
//  * The activations are staged as T, rows of the 16 (or 8) MMA rows, zeros past K and past the
//    call's rows; the gated and normalised prologues (kernels/fusion.h) are applied while staging
//    (by the whole block, before the first step), and a normalised row's 1 / rms scales its sums
//    at the end, as in the decode kernel.
#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "async_copy.cuh"
#include "common.cuh"
#include "kernels.cuh"
#include "mma_sync.cuh"
#include "split_k.cuh"

namespace nmcli {
namespace decode_mma {

using sm90::cp_async16;
using sm90::cp_async4;
using sm90::cp_async_commit;
using sm90::cp_async_wait;
using sm90::smem_addr;

constexpr int kWarps = 8;  // one block per SM
constexpr int kThreads = kWarps * 32;
constexpr int kColumns = 16;       // output columns per warp: the MMA's M side
constexpr int kStepEntries = 32;   // stored entries of a column per step
// A stage: each column's 64 bytes of values in a 80-byte row (so the 8 columns one LDS.128 reads
// fall in different banks), then each column's offset words in a 16-byte row.
constexpr int kValueRowWords = 20;
constexpr int kValueBytes = kColumns * kValueRowWords * 4;
constexpr int kStageBytes = kValueBytes + kColumns * 16;
// Floats per activation row of a partial tile: 16 columns and 4 of padding, so that the 32 lanes'
// stores of one accumulator register (rows 2q, columns g) fall in 32 banks.
constexpr int kPartialStride = 20;
constexpr int kSmemLimit = 226 * 1024;  // of 227 KB per block, leaving the static norm sums room
constexpr int kMaxSplit = 8;            // blocks of a cluster splitting K: the portable cluster size

// Lanes of the selector table a key: 32, so that a warp's lookups never share a bank, but 16 for
// groups of 16 at 9-16 rows, whose 32 KB table (256 pair keys) would leave the activations of K =
// 4096 no room (16 KB; lanes l and l + 16 share a word, a 2-way bank conflict where their keys
// differ in parity).
constexpr int table_lanes(int rows, int n, int m) { return n == 4 && m == 16 && rows > 8 ? 16 : 32; }

template <int kN, int kM>
struct Family {
  static constexpr int kBits = index_bits(kM);
  static constexpr int kFieldBits = kN * kBits;          // offset bits of one group
  static constexpr int kPositions = kStepEntries * kM / kN;  // K positions a step covers
  static constexpr int kSlabs = kPositions / 16;             // MMAs of 16 positions per step
  // A lane's two words of a column and slab (positions 2q, 2q+1 and 2q+8, 2q+9) lie kApart
  // groups apart (none with groups of 16). With one entry a group the fields of both groups and
  // any between them, 6 bits, key one table lookup that gives both words' selectors; with two,
  // each group's 4- or 6-bit field keys its own; with four, each value word's two entries (until
  // session 48 each entry, its offset and its half of the word, keyed its own, and a word's two
  // selectors were ORed: BENCHMARKS.md has what the pairs gained).
  static constexpr int kApart = 8 / kM;
  static constexpr int kKeyBits = kN == 1 ? (kApart + 1) * kFieldBits : kN == 2 ? kFieldBits : 2 * kBits;
  static constexpr int kKeys = 1 << kKeyBits;
  // 2:4 itself: the stored values and offset words are the operands of the sparse mma.sync as they
  // are (ldmatrix, one PRMT a word), with no table and no fragment to build.
  static constexpr bool kSparseCores = kN == 2 && kM == 4;
  static_assert(((kN == 1 || kN == 2) && (kM == 4 || kM == 8)) || (kN == 4 && (kM == 8 || kM == 16)),
                "groups of 4 or 8 with one or two entries, or of 8 or 16 with four");
};

// The selectors of lane `lane` for table key `key`: bits 0-15 build the lane's word at slab
// positions 2q, 2q+1, bits 16-31 the one at 2q+8, 2q+9 (for two entries a group, or four in
// groups of 8, both halves are the same, as both words sit at the same place in their groups).
// PRMT(0, V, selector), which reads the selector's low 16 bits, with V the 32-bit word holding the
// group's values (with four entries, the key's entries'): nibbles 4/5 take V's low half, 6/7 its high
// half, 0 a zero byte.
template <int kN, int kM>
__host__ __device__ constexpr uint32_t selectors(int key, int lane) {
  using F = Family<kN, kM>;
  const int q = lane & 3;
  constexpr int kKeyed = kN == 1 ? 1 : 2;  // entries a key names
  uint32_t both = 0;
  for (int w = 0; w < 2; ++w) {
    const int field = kN == 1 ? (key >> (w * F::kApart * F::kFieldBits)) & ((1 << F::kFieldBits) - 1) : key;
    const int position = 2 * q + 8 * w, group = position / kM, t = position % kM;
    uint32_t selector = 0;
    for (int e = 0; e < kKeyed; ++e) {
      const int offset = (field >> (e * F::kBits)) & ((1 << F::kBits) - 1);
      const int half = kN == 1 ? (group & 1) : e;  // which half of V holds entry e
      const uint32_t code = static_cast<uint32_t>((4 + 2 * half) | (5 + 2 * half) << 4);
      if (offset == t) selector |= code;
      if (offset == t + 1) selector |= code << 8;
    }
    both |= selector << (16 * w);
  }
  return both;
}

// The selector table, [key][lane], built by the compiler: blocks copy it into shared memory with
// the first weight steps, before the programmatic-dependent wait. (Session 35's kernel built it in
// every block on every launch, work the previous kernel's tail hides only in part: a block of this
// kernel starts once the SM's shared memory is free.)
template <int kN, int kM, int kLanes>
struct SelectorTable {
  alignas(16) uint32_t entry[Family<kN, kM>::kKeys * kLanes];
  constexpr SelectorTable() : entry() {
    for (int i = 0; i < Family<kN, kM>::kKeys * kLanes; ++i)
      entry[i] = selectors<kN, kM>(i / kLanes, i % kLanes);  // (a selector depends on lane % 4)
  }
};
template <int kN, int kM, int kLanes>
__device__ SelectorTable<kN, kM, kLanes> kSelectorTable;

// The `width` bits at compile-time bit `bit` of the little-endian string w[], times 2^kKeyShift (a
// table key's byte offset: 32 or 16 lanes of 4 bytes), in one shift and, with the lane's byte
// offset, one LOP3.
template <int bit, int width, int kKeyShift>
__device__ __forceinline__ uint32_t key_offset(const uint32_t (&w)[4], uint32_t lane_bytes) {
  static_assert(bit + width <= 128, "the string has 4 words");
  constexpr int word = bit / 32, shift = bit % 32;
  constexpr uint32_t mask = ((1u << width) - 1u) << kKeyShift;
  uint32_t moved;
  if constexpr (shift + width > 32) moved = __funnelshift_r(w[word], w[word + 1], shift - kKeyShift);
  else if constexpr (shift >= kKeyShift) moved = w[word] >> (shift - kKeyShift);
  else moved = w[word] << (kKeyShift - shift);
  // (moved & mask) | lane_bytes in one LOP3: left to itself, the compiler folds the lane's `& 31` into
  // every key and splits the merge in two (16-row kernels).
  return and_or<mask>(moved, lane_bytes);
}

template <int V>
using Int = std::integral_constant<int, V>;

// f(Int<0>{}), ..., f(Int<kCount - 1>{}): a loop whose index is a constant in its body.
template <int kCount, int I = 0, typename F>
__device__ __forceinline__ void unrolled(F&& f) {
  if constexpr (I < kCount) {
    f(Int<I>{});
    unrolled<kCount, I + 1>(f);
  }
}

// Shared memory: the selector table, the warps' rings, two sets of partial tiles, the activations
// of the block's K slice (all of K, or with K split over a cluster of `split` blocks, one split's
// steps).
template <int R, int kN, int kM>
struct Layout {
  static constexpr int kTableLanes = table_lanes(R, kN, kM), kKeyShift = kTableLanes == 32 ? 7 : 6;
  using F = Family<kN, kM>;
  static constexpr int kTableBytes =
      F::kSparseCores ? 0 : static_cast<int>(sizeof(SelectorTable<kN, kM, kTableLanes>));
  // Steps per warp in flight (the cp.async ring).
  static constexpr int kDepth = F::kSparseCores && R == 8 ? 8 : 4;
  static constexpr int kRingBytes = kWarps * kDepth * kStageBytes;
  static constexpr int kPartialBytes = 2 * kWarps * R * kPartialStride * 4;
  static constexpr int kRingOffset = kTableBytes;
  static constexpr int kPartialOffset = kRingOffset + kRingBytes;
  static constexpr int kXOffset = kPartialOffset + kPartialBytes;
  // Steps of the longest slice, and its staged positions per row: every position a stored entry
  // can name, plus 8 so that rows start 16 bytes apart modulo 128 and ldmatrix's 8 row addresses
  // hit different banks.
  __host__ __device__ static int64_t slice_steps(int64_t row_len, int split) {
    return (row_len / kStepEntries + split - 1) / split;
  }
  // With K split, three buffers of the block's tile sums follow (at the same offset in every block
  // of the cluster, which reads them in its peers), each for a batch of 1 to kMaxBatch tiles: as
  // many as the shared memory left holds.
  static constexpr int kTileSumsBytes = R * kColumns * 4;
  static constexpr int kMaxBatch = 8;
  __host__ __device__ static int64_t sums_offset(int64_t row_len, int split) {
    return kXOffset + static_cast<int64_t>(R) * (slice_steps(row_len, split) * F::kPositions + 8) * 2;
  }
  __host__ __device__ static int batch_tiles(int64_t row_len, int split) {
    const int64_t room = (kSmemLimit - sums_offset(row_len, split)) / (3 * kTileSumsBytes);
    return room < 1 ? 1 : room > kMaxBatch ? kMaxBatch : static_cast<int>(room);
  }
  static int64_t bytes(int64_t row_len, int split) {
    return sums_offset(row_len, split) + (split > 1 ? 3 * batch_tiles(row_len, split) * kTileSumsBytes : 0);
  }
  // The fewest blocks a cluster needs for the activations of their slices to fit; 0 past kMaxSplit.
  static int least_split(int64_t row_len) {
    for (int split = 1; split <= kMaxSplit; ++split)
      if (bytes(row_len, split) <= kSmemLimit) return split;
    return 0;
  }
};

// Stages A with a prologue (gated, or X * norm_weight; X as it is goes over with the weight steps,
// in the kernel) for rows [0, R) and positions [k0, k0 + staged) as T: zeros past K and past the
// call's rows. With `sumsq`, adds each row's sum of squares of X over those positions into it.
// Needs K % 8 == 0 and 16-byte aligned X, x_up and norm_weight (decode_mma_supported). The loads go
// 4 rows at a time (one row at a time, each thread's loads waited for one after another: 1 row
// 10.2 us, 8 rows 15.1 us on 4096 x 4096 in run A).
template <typename T, int R>
__device__ __forceinline__ void stage_activations(const PathParams<T>& p, T* xs, int stride, int64_t k0, int staged,
                                                  float* sumsq) {
  const bool gate = p.glu != Glu::none;
  const T* gamma = p.norm_weight;
  const int chunks = staged / 8;  // 16-byte chunks per row
  constexpr int kBatch = 4;
  for (int r0 = 0; r0 < R; r0 += kBatch) {
    float squares[kBatch] = {};
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      const int64_t staged_k = static_cast<int64_t>(c) * 8, k = k0 + staged_k;
      uint4 v[kBatch], u[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int r = r0 + b;
        v[b] = u[b] = make_uint4(0, 0, 0, 0);
        if (r < p.rows && k < p.k) {
          v[b] = __ldg(reinterpret_cast<const uint4*>(p.x + r * p.k + k));
          u[b] = __ldg(reinterpret_cast<const uint4*>((gate ? p.x_up + r * p.k : gamma) + k));
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        uint32_t out[4];
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
          float a[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float x = vec_entry<T>(v[b], i + j), w = vec_entry<T>(u[b], i + j);
            squares[b] = fmaf(x, x, squares[b]);
            a[j] = gate ? gated_activation(p.glu, x, w) : x * w;
          }
          const T lo = from_f32<T>(a[0]), hi = from_f32<T>(a[1]);
          out[i / 2] = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&lo)) |
                       static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hi)) << 16;
        }
        *reinterpret_cast<uint4*>(xs + (r0 + b) * stride + staged_k) = make_uint4(out[0], out[1], out[2], out[3]);
      }
    }
    if (sumsq) {
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        float sq = squares[b];
        for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        if ((threadIdx.x & 31) == 0) atomicAdd(&sumsq[r0 + b], sq);
      }
    }
  }
}

// The two halves of a barrier over the block's cluster (every thread arrives, then waits; the
// arrive releases this thread's shared-memory writes to the cluster, the wait acquires the
// others'), and the address of a shared variable in block `rank` of the cluster (sm_90; launch()
// splits K over a cluster only there).
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

template <typename V>
__device__ __forceinline__ V* peer_address(V* mine, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(mine, rank);
#else
  __trap();
  return mine;
#endif
}

// kSplit: K is split over a cluster of gridDim.z blocks. A separate kernel: with the cluster code
// in the one-block kernel too, one-block calls ran 1-9% slower (session 37); without it, that
// kernel's PTX is the same as before K could be split.
template <typename T, int R, int kN, int kM, bool kSplit>
__global__ void __launch_bounds__(kThreads, 1) decode_mma_kernel(PathParams<T> p) {
  using L = Layout<R, kN, kM>;
  using F = typename L::F;
  constexpr int kDepth = L::kDepth;
  constexpr int kRowTiles = R / 8;  // n8 MMA tiles of activation rows
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float norm_sumsq[R];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  unsigned char* ring = smem + L::kRingOffset + warp * kDepth * kStageBytes;
  float* partials = reinterpret_cast<float*>(smem + L::kPartialOffset);
  T* xs = reinterpret_cast<T*>(smem + L::kXOffset);
  // The block's slice of every tile's K steps: all of them, or with K split over a cluster of
  // gridDim.z blocks (rank blockIdx.z), the rank's share; and this warp's share of the slice.
  const int steps = static_cast<int>(p.row_len / kStepEntries);
  const int splits = kSplit ? static_cast<int>(gridDim.z) : 1, rank = kSplit ? static_cast<int>(blockIdx.z) : 0;
  const int slice_first = rank * steps / splits, slice_steps = (rank + 1) * steps / splits - slice_first;
  const int staged = slice_steps * F::kPositions, stride = staged + 8;
  const int tiles = static_cast<int>((p.nout + kColumns - 1) / kColumns);
  // Warp w takes a run of consecutive steps, or for 2:4 the slice's steps w, w + 8, ..., so that
  // the block's warps read neighbouring steps of the same columns at once (session 62: 0.99-1.16x
  // at 1-8 rows, 1.13-1.16x on 4096 x 1024; for the families that build fragments 0.98-1.06x,
  // left as they were).
  constexpr bool kInterleave = F::kSparseCores;
  constexpr int kStepStride = kInterleave ? kWarps : 1;
  const int first = kInterleave ? slice_first + warp : slice_first + warp * slice_steps / kWarps;
  const int last = kInterleave ? slice_first + slice_steps : slice_first + (warp + 1) * slice_steps / kWarps;

  // The lane's copies of a step: value chunk c (16 bytes) of column lane / 4 + 8c, part lane % 4,
  // and offset word i = lane + 32c of the tile's 16 x kBits (16 x 2 fit one per lane; 16 x 3 take
  // lanes 0-15 twice). Sources are at step `step` (moved along with it: recomputing them from the
  // tile's step 0 cost 10-15 instructions a step), zero-filled past Nout.
  constexpr int kIndexCopies = kColumns * F::kBits > 32 ? 2 : 1;
  struct Step {
    int tile, step;
    bool first_tile;  // the block's first: its steps carry X
    const T* value[2];
    const uint32_t* index[kIndexCopies];
    bool value_ok[2], index_ok[kIndexCopies];
  };
  auto at_tile = [&](Step& s, int tile) {
    s.tile = tile;
    s.step = first;
    s.first_tile = tile == static_cast<int>(blockIdx.x);
    const int64_t col0 = static_cast<int64_t>(tile) * kColumns;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int64_t col = col0 + (lane >> 2) + 8 * c;
      s.value_ok[c] = col < p.nout;
      s.value[c] = p.values + (s.value_ok[c] ? col * p.row_len + (lane & 3) * 8 : 0) + first * kStepEntries;
    }
#pragma unroll
    for (int c = 0; c < kIndexCopies; ++c) {
      const int i = lane + 32 * c;
      const int64_t col = col0 + i / F::kBits;
      s.index_ok[c] = col < p.nout;
      s.index[c] = p.indices + (s.index_ok[c] ? col * p.index_words + i % F::kBits : 0) + first * F::kBits;
    }
  };
  auto advance = [&](Step& s) {
    if ((s.step += kStepStride) >= last) {
      at_tile(s, s.tile + gridDim.x);
    } else {
#pragma unroll
      for (int c = 0; c < 2; ++c) s.value[c] += kStepStride * kStepEntries;
#pragma unroll
      for (int c = 0; c < kIndexCopies; ++c) s.index[c] += kStepStride * F::kBits;
    }
  };
  const uint32_t value_dst0 = smem_addr(ring + (lane >> 2) * kValueRowWords * 4 + (lane & 3) * 16);
  const uint32_t index_dst0 = smem_addr(ring + kValueBytes) + (lane / F::kBits) * 16 + (lane % F::kBits) * 4;
  const uint32_t index_dst1 =
      smem_addr(ring + kValueBytes) + ((lane + 32) / F::kBits) * 16 + ((lane + 32) % F::kBits) * 4;
  // X as it is (no prologue) goes over with the weights, each warp copying the activations of its
  // own steps with the steps of the block's first tile (later tiles reuse them): its first step
  // waits for its own first step of X, not for the whole block's (session 38, Nsight Compute on
  // 16 x 4096 x 4096: staging all of X, then waiting for it, held 42% of the warps' samples).
  // Chunk i = lane + 32 j of the step's R x kPositions / 8 16-byte chunks is row i / kRowChunks,
  // chunk i % kRowChunks.
  const bool plain_x = p.glu == Glu::none && !p.norm_weight;
  constexpr int kRowChunks = F::kPositions / 8, kRowsPerCopy = 32 / kRowChunks, kXCopies = R / kRowsPerCopy;
  static_assert(32 % kRowChunks == 0 && R % kRowsPerCopy == 0, "a step's chunks cover whole rows, 32 at a time");
  const int x_row = lane / kRowChunks, x_chunk = lane % kRowChunks;
  const T* x_src = p.x + x_row * p.k + x_chunk * 8;  // the lane's first copy at step 0
  const int64_t x_src_apart = kRowsPerCopy * p.k;   // between its copies
  const uint32_t x_dst = smem_addr(xs + x_row * stride + x_chunk * 8), x_dst_apart = kRowsPerCopy * stride * sizeof(T);
  auto stage_x = [&](int step) {
    const int64_t k = static_cast<int64_t>(step) * F::kPositions;
    const T* src = x_src + k;
    const uint32_t dst = x_dst + (step - slice_first) * F::kPositions * static_cast<uint32_t>(sizeof(T));
    const bool inside = k + x_chunk * 8 < p.k;
#pragma unroll
    for (int j = 0; j < kXCopies; ++j) {
      const bool real = inside && x_row + j * kRowsPerCopy < p.rows;
      cp_async16(dst + j * x_dst_apart, real ? src + j * x_src_apart : p.x, real);
    }
  };
  bool x_readable = false;  // past the wait for the previous kernel
  // Copies step s into ring slot `slot` (and in the first tile its X); always commits a group, so
  // every warp counts its groups alike.
  auto issue = [&](const Step& s, unsigned slot) {
    if (first < last && s.tile < tiles) {
      const uint32_t stage = slot * kStageBytes;
#pragma unroll
      for (int c = 0; c < 2; ++c)
        cp_async16(value_dst0 + stage + c * 8 * kValueRowWords * 4, s.value[c], s.value_ok[c]);
      cp_async4(index_dst0 + stage, s.index[0], s.index_ok[0]);
      if constexpr (kIndexCopies == 2)
        if (lane < kColumns * F::kBits - 32) cp_async4(index_dst1 + stage, s.index[1], s.index_ok[1]);
      if (plain_x && x_readable && s.first_tile) stage_x(s.step);
    }
    cp_async_commit();
  };

  // The weights are constants: the table and the first steps' copies go out before the wait.
  if constexpr (!F::kSparseCores) {
    constexpr int kTableChunks = L::kTableBytes / 16;
    for (int i = threadIdx.x; i < kTableChunks; i += kThreads)
      cp_async16(smem_addr(smem + 16 * i),
                 reinterpret_cast<const unsigned char*>(&kSelectorTable<kN, kM, L::kTableLanes>) + 16 * i, true);
  }
  Step next{};
  at_tile(next, blockIdx.x);
  int early[kDepth - 1];  // the steps issued before the wait, while they are the first tile's
#pragma unroll
  for (int d = 0; d < kDepth - 1; ++d) {
    early[d] = next.first_tile ? next.step : -1;
    issue(next, d);
    advance(next);
  }
  wait_for_previous_kernel();
  allow_next_kernel();
  if (plain_x) {
    // X of the steps issued above, a group each, so that the loop's wait finds a step's X and
    // weights landed together: groups W0..W(d-1), X0..X(d-1), then W(d) with X(d), ... (d =
    // kDepth - 1); the first waits for W0 and X0 alone.
    x_readable = true;
#pragma unroll
    for (int d = 0; d < kDepth - 1; ++d) {
      if (first < last && early[d] >= 0) stage_x(early[d]);
      cp_async_commit();
    }
    cp_async_wait<2 * (kDepth - 1) - 1>();  // the table, copied with W0
  } else {
    if (p.norm_weight) {
      if (threadIdx.x < R) norm_sumsq[threadIdx.x] = 0.f;
      __syncthreads();
    }
    stage_activations<T, R>(p, xs, stride, static_cast<int64_t>(slice_first) * F::kPositions, staged,
                            p.norm_weight ? norm_sumsq : nullptr);
    cp_async_wait<0>();  // the table too
  }
  __syncthreads();

  // The lane's weight columns are g and 8 + g of the stage (MMA rows g and g + 8). Its group in a
  // slab is `lane_group` groups past the slab's first (q / 2 for groups of 4, 0 for groups of 8):
  // its offset fields sit that many fields further along the step's offset string than the
  // compile-time positions below.
  const int lane_group = kM == 4 ? q >> 1 : 0;
  const uint32_t lane_bytes = static_cast<uint32_t>(lane % L::kTableLanes) * 4;
  constexpr int kShift = L::kKeyShift;
  const unsigned char* table = smem;
  auto lookup = [&](uint32_t offset) { return *reinterpret_cast<const uint32_t*>(table + offset); };
  // ldmatrix row addresses of the activations (the MMA's B, K x rows): lanes 0-7 rows 0-7 at +0,
  // 8-15 the same rows at +8, 16-31 rows 8-15 likewise.
  const T* x_lane = xs + ((lane & 7) + (R == 8 ? 0 : (lane >> 4) * 8)) * stride + ((lane >> 3) & 1) * 8;

  // 2:4 on the sparse tensor cores: a step is two m16n8k32 MMAs, each reading 32 of the stage's 64
  // value bytes a column. ldmatrix row addresses: the values (A) of lanes 0-7 columns 0-7, 8-15
  // columns 8-15, at the MMA's first 16 bytes, lanes 16-31 likewise at its last 16; the activations
  // (B) of lane l row l % 8 of the n8 tile at positions 8 (l / 8) of the MMA's 32.
  const uint32_t a_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * kValueRowWords * 4 + (lane >> 4) * 16;
  const T* x_lane_sp = xs + (lane & 7) * stride + (lane >> 3) * 8;
  // Lanes 4g and 4g + 1 give the offsets of an MMA's positions 0-15 and 16-31 (sparsity selector 0):
  // the low or high halves of columns g's and g + 8's offset words.
  const uint32_t halves = q & 1 ? 0x7632u : 0x5410u;
  auto multiply_sparse = [&](const unsigned char* stage, int step, float (&acc)[2][kRowTiles][4]) {
    const uint2 low = *reinterpret_cast<const uint2*>(stage + kValueBytes + g * 16);
    const uint2 high = *reinterpret_cast<const uint2*>(stage + kValueBytes + (g + 8) * 16);
    const T* x_step = x_lane_sp + (step - slice_first) * F::kPositions;
    unrolled<2>([&](auto mma_constant) {
      constexpr int s = decltype(mma_constant)::value;
      uint32_t a[4];
      ldmatrix_x4(a, stage + a_lane + 32 * s);
      const uint32_t meta = valid_metadata(prmt(s ? low.y : low.x, s ? high.y : high.x, halves));
#pragma unroll
      for (int t = 0; t < kRowTiles; ++t) {
        uint32_t b[4];
        ldmatrix_x4(b, x_step + t * 8 * stride + 32 * s);
        mma_sp_16832<T>(acc[s][t], a, b, meta);
      }
    });
  };

  // acc[slab % 2][n8 tile]: two chains of dependent MMAs per tile instead of one. Generic, so that it
  // is compiled only for the families that build fragments (not 2:4).
  auto multiply_dense = [&](const unsigned char* stage, int step, auto& acc) {
    // The step's values and offset words of the lane's two columns, in registers.
    uint32_t values[2][16], offsets[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4* column = reinterpret_cast<const uint4*>(stage + (8 * h + g) * kValueRowWords * 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 v = column[i];
        values[h][4 * i] = v.x, values[h][4 * i + 1] = v.y, values[h][4 * i + 2] = v.z, values[h][4 * i + 3] = v.w;
      }
      const uint4 w = *reinterpret_cast<const uint4*>(stage + kValueBytes + (8 * h + g) * 16);
      offsets[h][0] = w.x, offsets[h][1] = w.y, offsets[h][2] = w.z, offsets[h][3] = w.w;
      if constexpr (kM == 4) {  // a 64-bit string: move the lane's first field to bit 0
        const uint64_t s = (static_cast<uint64_t>(w.y) << 32 | w.x) >> (lane_group * F::kFieldBits);
        offsets[h][0] = static_cast<uint32_t>(s), offsets[h][1] = static_cast<uint32_t>(s >> 32);
      }
    }
    const T* x_step = x_lane + (step - slice_first) * F::kPositions;
    unrolled<F::kSlabs>([&](auto slab_constant) {
      constexpr int slab = decltype(slab_constant)::value;
      uint32_t b[kRowTiles][2];
      if constexpr (R == 8) {
        ldmatrix_x2(b[0][0], b[0][1], x_step + slab * 16);
      } else {  // both n8 tiles at once: x_lane already puts lanes 16-31 on rows 8-15
        uint32_t r[4];
        ldmatrix_x4(r, x_step + slab * 16);
        b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
      }
      // The weight fragment (MMA rows = columns g, g + 8; K = the slab's positions): a[2w + h] is
      // column 8h + g at positions 2q + 8w, 2q + 8w + 1.
      uint32_t a[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kN == 4) {
          // Entries 4G .. 4G + 3 of the step are group G's: word 2G holds the first two, 2G + 1
          // the last two, and each word's two entries key its selector. The two words' PRMTs are
          // ORed (a position holds at most one entry). Groups of 16: the slab's one group gives
          // both of the lane's words (the selectors' halves); groups of 8: word w is group
          // 2 * slab + w's.
          auto group_selectors = [&](auto group_constant, uint32_t& low, uint32_t& high) {
            constexpr int kGroup = decltype(group_constant)::value;
            low = lookup(key_offset<4 * kGroup * F::kBits, 2 * F::kBits, kShift>(offsets[h], lane_bytes));
            high = lookup(key_offset<(4 * kGroup + 2) * F::kBits, 2 * F::kBits, kShift>(offsets[h], lane_bytes));
          };
          if constexpr (kM == 16) {
            uint32_t low, high;
            group_selectors(Int<slab>{}, low, high);
            a[h] = prmt(0u, values[h][2 * slab], low) | prmt(0u, values[h][2 * slab + 1], high);
            a[2 + h] = prmt(0u, values[h][2 * slab], low >> 16) | prmt(0u, values[h][2 * slab + 1], high >> 16);
          } else {
            unrolled<2>([&](auto w_constant) {
              constexpr int kGroup = 2 * slab + decltype(w_constant)::value;
              uint32_t low, high;
              group_selectors(Int<kGroup>{}, low, high);
              a[2 * decltype(w_constant)::value + h] =
                  prmt(0u, values[h][2 * kGroup], low) | prmt(0u, values[h][2 * kGroup + 1], high);
            });
          }
        } else if constexpr (kN == 1) {
          // Entry G of the step is group G's; word G / 2 holds it, in the half the selector picks.
          constexpr int kGroup = slab * (16 / kM);  // the first word's group, less lane_group
          const uint32_t selector =
              lookup(key_offset<kGroup * F::kFieldBits, F::kKeyBits, kShift>(offsets[h], lane_bytes));
          a[h] = prmt(0u, values[h][kGroup >> 1], selector);
          a[2 + h] = prmt(0u, values[h][(kGroup + F::kApart) >> 1], selector >> 16);
        } else {
          unrolled<2>([&](auto w_constant) {
            constexpr int w = decltype(w_constant)::value;
            constexpr int kGroup = slab * 2 + w * F::kApart;  // 2:8 (2:4 takes the sparse MMA)
            const uint32_t selector =
                lookup(key_offset<kGroup * F::kFieldBits, F::kFieldBits, kShift>(offsets[h], lane_bytes));
            // Entries 2G, 2G + 1 of the step are group G's: word G.
            a[2 * w + h] = prmt(0u, values[h][kGroup], selector);
          });
        }
      }
#pragma unroll
      for (int t = 0; t < kRowTiles; ++t) mma_16816<T>(acc[slab & 1][t], a, b[t]);
    });
  };

  auto multiply = [&](const unsigned char* stage, int step, float (&acc)[2][kRowTiles][4]) {
    if constexpr (F::kSparseCores) multiply_sparse(stage, step, acc);
    else multiply_dense(stage, step, acc);
  };

  // Writes output (row, out_col), inside the output, from its sum over K (and with a normalised
  // prologue, its row's sum of squares, read only then).
  auto write = [&](int row, int64_t out_col, float sum, auto sumsq) {
    const float scale = p.norm_weight ? rsqrtf(sumsq() / static_cast<float>(p.k) + p.norm_epsilon) : 1.f;
    const float b = p.bias ? to_f32(p.bias[out_col]) : 0.f;
    p.y.column(out_col)[row] = from_f32<T>(p.alpha * scale * sum + b + residual_at(p, row, out_col));
  };
  // With K split: the cluster's blocks store every splits-th output of a tile, summing the blocks'
  // sums (and a normalised row's sums of squares) through distributed shared memory.
  float* sums = reinterpret_cast<float*>(smem + L::sums_offset(p.row_len, splits));
  const int batch = kSplit ? L::batch_tiles(p.row_len, splits) : 1;
  // The outputs of the block's walked tiles [b * batch, b * batch + count), from buffer b % 3.
  auto store_cluster_totals = [&](int b, int count) {
    const int row = threadIdx.x / kColumns, col = threadIdx.x % kColumns;
    if (row >= R || threadIdx.x % splits != rank) return;
    float sumsq = 0.f;
    if (p.norm_weight)
      for (int r = 0; r < splits; ++r) sumsq += *peer_address(&norm_sumsq[row], r);
    for (int i = 0; i < count; ++i) {
      const float* slot = sums + ((b % 3) * batch + i) * R * kColumns + threadIdx.x;
      float sum = 0.f;
      for (int r = 0; r < splits; ++r) sum += *peer_address(slot, r);
      const int64_t tile = blockIdx.x + static_cast<int64_t>(b * batch + i) * gridDim.x;
      const int64_t out_col = tile * kColumns + col;
      if (row < p.rows && out_col < p.nout) write(row, out_col, sum, [&] { return sumsq; });
    }
  };

  unsigned walked = 0;  // steps this warp has multiplied: its ring position
  int parity = 0;  // which set of partial tiles this tile uses
  int walked_tiles = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, parity ^= 1, ++walked_tiles) {
    float acc[2][kRowTiles][4] = {};
    for (int step = first; step < last; step += kStepStride, ++walked) {
      issue(next, (walked + kDepth - 1) % kDepth);  // the slot multiplied one step ago
      advance(next);
      cp_async_wait<kDepth - 1>();
      __syncwarp();
      multiply(ring + (walked % kDepth) * kStageBytes, step, acc);
      __syncwarp();
    }
    // Accumulator j of n8 tile t: column g + 8 (j / 2), activation row 8t + 2q + j % 2. Two sets
    // of partial tiles: a set is written again only after the next tile's __syncthreads, which
    // every thread passes after reading it.
    float* mine = partials + (parity * kWarps + warp) * R * kPartialStride;
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        mine[(8 * t + 2 * q + (j & 1)) * kPartialStride + g + 8 * (j >> 1)] = acc[0][t][j] + acc[1][t][j];
    __syncthreads();
    // Output t of the tile, one per thread: activation row t / 16, column t % 16, summed over the
    // warps.
    const int row = threadIdx.x / kColumns, col = threadIdx.x % kColumns;
    auto warp_sum = [&] {
      const float* set = partials + parity * kWarps * R * kPartialStride + row * kPartialStride + col;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += set[w * R * kPartialStride];
      return sum;
    };
    if constexpr (!kSplit) {
      const int64_t out_col = static_cast<int64_t>(tile) * kColumns + col;
      if (row < R && row < p.rows && out_col < p.nout) write(row, out_col, warp_sum(), [&] { return norm_sumsq[row]; });
    } else {
      // The cluster sums the tiles in batches, one batch late, so that no block waits on its
      // peers between tiles and the barrier comes once a batch (its release arrive compiles to a
      // MEMBAR.ALL.GPU, on which Nsight Compute found 7% of the samples at 16 x 14336 x 4096 with
      // a barrier every tile; session 38 on the down projections at 9-16 rows: 1.02-1.05x the
      // kernel before without batches, 1.13-1.24x with them). The block's sums of batch i go to
      // buffer i % 3 and the cluster barrier's arrive; after batch i + 1, its wait (long since
      // complete, as a rule) and the reads of batch i. Buffer i % 3 is written again in batch
      // i + 3, past this block's wait after batch i + 1, which every peer arrives at only after
      // its reads of batch i.
      const int b = walked_tiles / batch, i = walked_tiles % batch;
      if (row < R) sums[((b % 3) * batch + i) * R * kColumns + threadIdx.x] = warp_sum();
      if (i == batch - 1) {
        if (b > 0) {
          cluster_wait();
          store_cluster_totals(b - 1, batch);
        }
        cluster_arrive();
      }
    }
  }
  cp_async_wait<0>();
  if (kSplit && walked_tiles > 0) {
    // The last full batch, a partial one after it, and before leaving, the peers' reads of this
    // block's sums (barrier arrives and waits alternate).
    const int full = walked_tiles / batch, rest = walked_tiles % batch;
    if (full > 0) {
      cluster_wait();
      store_cluster_totals(full - 1, batch);
    }
    if (rest > 0) {
      cluster_arrive();
      cluster_wait();
      store_cluster_totals(full, rest);
    }
    cluster_arrive();
    cluster_wait();
  }
}

// The least number of blocks a cluster splits K over, from NMCLI_DECODE_MMA_SPLIT (1 if unset):
// a knob for A/B measurements, like NMCLI_NO_PDL.
int least_split_asked() {
  static const int asked = [] {
    const char* text = std::getenv("NMCLI_DECODE_MMA_SPLIT");
    return text ? std::clamp(std::atoi(text), 1, kMaxSplit) : 1;
  }();
  return asked;
}

template <typename T, int R, int kN, int kM>
cudaError_t launch(const PathParams<T>& p, cudaStream_t stream) {
  using L = Layout<R, kN, kM>;
  const int64_t steps = p.row_len / kStepEntries;
  const int least = L::least_split(p.row_len);
  if (least == 0) return cudaErrorInvalidValue;
  const int64_t asked = std::max(least, least_split_asked());
  const int split = static_cast<int>(std::min<int64_t>(asked, std::max<int64_t>(steps, 1)));  // a step per block
  if (split > 1 && compute_capability() < 90) return cudaErrorInvalidValue;  // clusters
  // One block per SM, or one cluster per `split` SMs, walking column tiles (persistent_blocks);
  // programmatic dependent launch.
  const int64_t tiles = (p.nout + kColumns - 1) / kColumns;
  if (split == 1) {
    constexpr auto kernel = decode_mma_kernel<T, R, kN, kM, false>;
    if (cudaError_t e = allow_dynamic_smem<kernel>(kSmemLimit); e != cudaSuccess) return e;
    return launch_split_k(kernel, dim3(persistent_blocks(tiles, multiprocessor_count())), kThreads,
                          static_cast<size_t>(L::bytes(p.row_len, 1)), stream, 1, true, p);
  }
  // A split block asks for over half an SM's shared memory, so that clusters spread over the SMs
  // (the least split needs that much anyway; a larger one asked for through
  // NMCLI_DECODE_MMA_SPLIT might otherwise put two blocks on one SM).
  constexpr auto kernel = decode_mma_kernel<T, R, kN, kM, true>;
  if (cudaError_t e = allow_dynamic_smem<kernel>(kSmemLimit); e != cudaSuccess) return e;
  const int64_t slots = active_clusters<kernel>(split, kThreads, kSmemLimit);
  const int64_t smem = std::max<int64_t>(L::bytes(p.row_len, split), kSmemLimit / 2 + 1024);
  return launch_split_k(kernel, dim3(persistent_blocks(tiles, slots)), kThreads, static_cast<size_t>(smem), stream,
                        split, true, p);
}

// Calls f(Int<R>, Int<kN>, Int<kM>) for the kernel of `rows` activation rows (R = 8 up to 8, else
// 16) and pattern n:m; returns `otherwise` for a family this path does not compile.
template <typename F, typename Otherwise>
auto with_kernel(int64_t rows, int n, int m, F&& f, Otherwise otherwise) {
  auto by_pattern = [&](auto r) {
    switch (n * 64 + m) {
      case 1 * 64 + 4: return f(r, Int<1>{}, Int<4>{});
      case 2 * 64 + 4: return f(r, Int<2>{}, Int<4>{});
      case 1 * 64 + 8: return f(r, Int<1>{}, Int<8>{});
      case 2 * 64 + 8: return f(r, Int<2>{}, Int<8>{});
      case 4 * 64 + 8: return f(r, Int<4>{}, Int<8>{});
      case 4 * 64 + 16: return f(r, Int<4>{}, Int<16>{});
      default: return otherwise;
    }
  };
  return rows <= 8 ? by_pattern(Int<8>{}) : by_pattern(Int<16>{});
}

}  // namespace decode_mma

int decode_mma_split(int64_t rows, int n, int m, int64_t k) {
  if (rows < 1 || rows > kDecodeMaxRows || k % 8 != 0) return 0;
  const int64_t row_len = NMShape::make(k, 1, n, m).row_len;
  return decode_mma::with_kernel(
      rows, n, m,
      [&](auto r, auto kn, auto km) {
        return decode_mma::Layout<decltype(r)::value, decltype(kn)::value, decltype(km)::value>::least_split(row_len);
      },
      0);
}

bool decode_mma_supported(int64_t rows, int n, int m, int64_t k) {
  const int split = decode_mma_split(rows, n, m, k);
  return split > 0 && compute_capability() >= (split > 1 ? 90 : 80);  // clusters from 9.0
}

template <typename T>
cudaError_t run_decode_mma(PathParams<T> p, cudaStream_t stream) {
  if constexpr (sizeof(T) != 2) {
    return cudaErrorInvalidValue;
  } else {
    return decode_mma::with_kernel(
        p.rows, p.n, p.m,
        [&](auto r, auto kn, auto km) {
          return decode_mma::launch<T, decltype(r)::value, decltype(kn)::value, decltype(km)::value>(p, stream);
        },
        cudaErrorInvalidValue);
  }
}

template cudaError_t run_decode_mma<float>(PathParams<float>, cudaStream_t);
template cudaError_t run_decode_mma<__half>(PathParams<__half>, cudaStream_t);
template cudaError_t run_decode_mma<__nv_bfloat16>(PathParams<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
