// Warpgroup tensor-core path (Hopper, sm_90a) for fp16/bf16: prompt processing and large batches
// for the families the sparse tensor cores cannot take (4:8, 4:16, 8:16, 2:16; dispatch.cu).
//
// Y^T = W^T X^T, computed as D[weight rows x activation rows] with wgmma.mma_async, both operands
// K-major [rows x 64] tiles in shared memory with the 128-byte swizzle:
//  * A = the weight tile, rebuilt dense for each step by scattering the stored entries: the tile is
//    zeroed, then each stored value is written to its dense position (one shift, one LOP3 and one
//    16-bit store per entry);
//  * B = the activations;
//  * fp32 accumulators in registers; alpha and bias applied on the way out.
// A block computes 128 weight rows x 64, 128, 160, 192 or 256 activation rows with three roles,
// each waiting only on shared-memory barriers (wgmma_sp.cu's regrouping kernel has the same structure):
//  * the last warp copies each step into a ring of stages (wgmma_feed.cuh): the activation tile,
//    the packed values and (where their rows are 16-byte aligned) the offset words by tensor copy
//    (TMA, zero-filled past every edge), else the offset words with cp.async; "full" barrier;
//  * the expanding warps before it zero a dense tile of a ring of three once the MMAs are done with
//    it ("freed"), then scatter the step's entries into it ("ready");
//  * warps 0-7, two warpgroups of 64 weight rows, issue the MMAs of a step, keep them in flight
//    while the next step's go out, then hand back the older step's stage ("empty") and dense tile.
// Calls with few tiles split K over a cluster (sm90::launch_split, finish_tile).
// Until session 29 each thread gathered its A fragments in registers: ~40 instructions per pair of
// dense positions (ncu at 4096^3 4:16: 169M warp instructions). The scatter (session 29) touches
// each stored entry once, but every thread still copied, expanded and multiplied in turn with a
// block barrier per step (tensor pipe active 41%). With the three roles (session 30): 1.26-1.46x
// that kernel on 4:16, 1.11-1.35x on 4:8, 1.24-1.59x on 8:16, 1.30-1.72x on 2:16 (LLaMA shapes,
// 17-4096 rows), 0.48-1.48x cuBLAS fp16 (BENCHMARKS.md). Two things mattered besides the roles:
// the scatter issues all its shared-memory loads before its first store (the stores are ordered
// after earlier memory accesses, so interleaved loads waited out their latency pair by pair:
// 1.20-1.40x at 4096^3), and the offset words by tensor copy instead of 4-byte cp.async (about 300
// shared-memory wavefronts a step at 8:16 by ncu; 1.21-1.44x on 8:16 at 17 rows). The block's
// shared memory is the likely limit now: before the tensor-copied offset words, ncu counted the
// LSU's shared wavefronts 66% busy at 8:16 4096^3 (zeros, scatter, its loads, copies) on top of
// the MMAs' operand reads, with the tensor pipe active 46%.
// 4:16 on 192- and 256-row tiles takes wgmma_gather_kernel instead: the consumers build A in
// registers (Gather, below).
// Used for N in {1, 2, 4, 8}, M in {4, 8, 16}, M <= 8N (a step holds whole 16-byte runs of
// values), K % 8 == 0 (16-byte activation rows for the tensor copies). Other calls take the mma
// path.
#include <algorithm>
#include <type_traits>

#include "wgmma_feed.cuh"

namespace nmcli {
namespace {

using sm90::kBK;
using sm90::kProducerThreads;
using sm90::kThreads;
using sm90::kTileW;

// Threads that expand the weight tiles: a warpgroup, or two warps with the 192- and 256-row tiles,
// whose MMAs need 168 registers a thread at 256 rows (256 + 64 + 32 threads leave them 184, 416
// only 152; at 192 rows ptxas gives the kernel 123-128 with two warps, and a warpgroup was not tried).
// The 160-row tile keeps a warpgroup: ptxas gives it 107-124 registers, no spills.
template <int kRows>
constexpr int kExpandThreads = kRows >= 192 ? 64 : 128;

// Offset words copied per weight row and step: those holding the step's offsets, from the
// 16-byte boundary at or before the first (a tensor copy's box starts on one); a multiple of 4.
template <typename F>
constexpr int box_words() {
  int most = 0;
  for (int t = 0; t < 128; ++t) {  // the words' pattern repeats within 128 steps
    const int bit = t * F::kEntries * F::kBits;
    const int span = (bit >> 5) % 4 + ((bit & 31) + F::kEntries * F::kBits + 31) / 32;
    most = std::max(most, span);
  }
  return (most + 3) / 4 * 4;
}

// Shared memory: a ring of kStages steps, each the activation tile [kRows x 64] (128-byte swizzle),
// the packed values (kTileW rows of F::kValueBytes) and the offset words (kTileW rows of
// kBoxWords); then the ring of kDense dense weight tiles [128 x 64] (128-byte swizzle); then the
// barriers: "full" and "empty" per stage, "ready" and "freed" per dense tile.
template <int kN, int kM, int kRows>
struct Layout {
  using F = sm90::Family<kN, kM>;
  static constexpr int kBoxWords = box_words<F>();
  static constexpr size_t kX = static_cast<size_t>(kRows) * 128;
  static constexpr size_t kWords = kX + F::kValues;  // the offset words in a stage
  static constexpr uint32_t kWordBytes = kTileW * kBoxWords * 4;
  static constexpr size_t kStage = (kWords + kWordBytes + 1023) / 1024 * 1024;  // swizzle atoms stay 1024-aligned
  static constexpr size_t kA = static_cast<size_t>(kTileW) * 128;
  static constexpr int kDense = 3;  // one in the MMAs, one retiring, one being written
  static constexpr int kStages = std::min<int>(8, static_cast<int>((220 * 1024 - kDense * kA) / kStage));
  static constexpr size_t kDenseAt = kStages * kStage;
  static constexpr size_t kBarriers = kDenseAt + kDense * kA;
  static constexpr size_t kBytes = kBarriers + 2 * (kStages + kDense) * 8 + 1024;  // + slack to align the ring
  static constexpr uint32_t kTensorBytes = static_cast<uint32_t>(kX + F::kValues);  // + kWordBytes by tensor copy
  static_assert(kStages >= 3, "the copies run at least one step ahead of the two steps in the MMAs");
  static_assert(sm90::kFinishBytes<kRows> <= kBarriers, "finish_tile's scratch fits before the barriers");
  static_assert(kBytes >= sm90::kWholeSmBytes, "one block per SM, as launch_split's waves count them");
};

__device__ __forceinline__ void st_shared_zero(uint32_t addr, std::integral_constant<int, 8>) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %1};" ::"r"(addr), "r"(0u) : "memory");
}
__device__ __forceinline__ void st_shared_zero(uint32_t addr, std::integral_constant<int, 16>) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0u) : "memory");
}
// The low 16 bits of `value`.
__device__ __forceinline__ void st_shared_u16(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(static_cast<uint16_t>(value)) : "memory");
}

// Expanding thread `worker`'s share (of kWorkers) of rebuilding a step's dense weight tile: pairs
// of consecutive stored entries (one 32-bit word of values), the same pair in rows first_row,
// first_row + kRowStep, ... A warp's lanes cover kWarpRows whole consecutive rows at a time, so a
// load of values is one contiguous run, and a warp zeroes exactly the rows it then writes: only
// __syncwarp between the zeros and the values.
template <int kN, int kM, int kWorkers>
struct Scatter {
  using F = sm90::Family<kN, kM>;
  static constexpr int kBoxWords = box_words<F>();
  static constexpr int kPairs = F::kEntries / 2;  // pairs per row per step: 4, 8 or 16
  static constexpr int kRowStep = kWorkers / kPairs;
  static constexpr int kCount = kTileW / kRowStep;  // pairs per thread per step
  static constexpr int kWarpRows = 32 / kPairs;
  static constexpr int kZeroBytes = kWarpRows * 128 / 32;  // per lane and row block
  static constexpr int kZeroSlice = kZeroBytes < 16 ? kZeroBytes : 16;  // per store
  static_assert(kWorkers % 32 == 0 && 32 % kPairs == 0 && kTileW % kRowStep == 0, "whole rows per warp and thread");
  // first_row < kRowStep, a power of 2: row first_row + j * kRowStep's swizzle phase (row % 8) is
  // first_row's XOR (j * kRowStep) % 8, known at compile time.
  static_assert((kRowStep & (kRowStep - 1)) == 0, "rows a power of 2 apart");

  int first_row;     // in the block's tile
  int pair;          // in the row
  uint32_t key[2];   // per entry of the pair: first_row's byte offset in a dense tile, XOR the
                     // swizzled offset of its group's first position
  uint32_t zero_at;  // this lane's first bytes to zero

  __device__ __forceinline__ explicit Scatter(int worker) {
    first_row = worker / kPairs;
    pair = worker % kPairs;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int group = (2 * pair + e) / kN;
      // Byte of dense position p in row r: r * 128 + (2p ^ (r % 8) * 16) (128-byte swizzle), and
      // 2p = 2 * group * M | 2 * offset, the two parts in disjoint bits.
      const uint32_t swizzled = static_cast<uint32_t>((first_row & 7) * 16) ^ (2u * group * kM);
      key[e] = static_cast<uint32_t>(first_row * 128) | swizzled;
    }
    zero_at = static_cast<uint32_t>((worker / 32) * kWarpRows * 128 + (worker % 32) * kZeroSlice);
  }

  // Zeroes the rows this thread's warp writes in the dense tile at `tile`: per row block, 16 bytes
  // a lane in runs of 512 (no bank conflicts), 8 where a block is 256 bytes.
  __device__ __forceinline__ void zero(uint32_t tile) const {
#pragma unroll
    for (int j = 0; j < kCount; ++j)
#pragma unroll
      for (int c = 0; c < kZeroBytes / kZeroSlice; ++c)
        st_shared_zero(tile + zero_at + j * kRowStep * 128 + c * 32 * kZeroSlice,
                       std::integral_constant<int, kZeroSlice>{});
  }

  // Writes this thread's stored entries of step t (the step's packed tile at `packed`) to their
  // dense positions in the zeroed tile at `tile`. A group's offsets are distinct (docs/FORMAT.md),
  // so its entries never meet; padding entries (value 0, offset 0) meet only each other. Every
  // load is issued before the first store: the stores are ordered after earlier memory accesses,
  // so a load per pair between them would wait out the shared-memory latency pair by pair.
  __device__ __forceinline__ void write(const uint8_t* packed, int64_t t, uint32_t tile) const {
    const int bit = F::first_bit(t) + pair * 2 * F::kBits;
    const int word = static_cast<int>(F::first_word(t) & 3) + (bit >> 5), shift = bit & 31;
    const int next = min(word + 1, kBoxWords - 1);
    uint32_t offsets[kCount], values[kCount];
#pragma unroll
    for (int j = 0; j < kCount; ++j) {
      const int r = first_row + j * kRowStep;
      const uint32_t* words = reinterpret_cast<const uint32_t*>(packed + F::kValues) + r * kBoxWords;
      offsets[j] = __funnelshift_r(words[word], words[next], shift);  // the pair's from bit 0
      values[j] = *reinterpret_cast<const uint32_t*>(packed + r * F::kValueBytes + pair * 4);
    }
    const uint32_t key0 = tile + key[0], key1 = tile + key[1];
    constexpr uint32_t kMask = 2 * kM - 2;
#pragma unroll
    for (int j = 0; j < kCount; ++j) {
      const uint32_t phase = static_cast<uint32_t>((j * kRowStep) % 8 * 16);  // a constant once unrolled
      const uint32_t rows = j * kRowStep * 128;  // the row's bytes past first_row's
      st_shared_u16((key0 ^ phase ^ ((offsets[j] << 1) & kMask)) + rows, values[j]);
      st_shared_u16((key1 ^ phase ^ ((offsets[j] >> (F::kBits - 1)) & kMask)) + rows, values[j] >> 16);
    }
  }
};

// The producer warp of both kernels below: each step's activation tile and packed weight tile
// into stage s of a ring laid out as L (Layout) says. The offset words by tensor copy where
// their rows allow it (sm90::offset_rows_aligned), else by the lanes with cp.async; either way
// kBoxWords a row from the 16-byte boundary at or before the step's first word (box_start), zeros
// past the row and past Nout.
template <typename L, int kRows, int S, bool kEarly, typename T, typename StageAt, typename Full, typename Empty>
__device__ __forceinline__ void produce_packed(const PathParams<T>& p, const sm90::TileMaps& maps, bool tensor_offsets,
                                               int64_t w0, sm90::RowTile rows, int begin, int end, int lane,
                                               StageAt&& stage_at, Full&& full, Empty&& empty) {
  using F = typename L::F;
  if (lane == 0) maps.prefetch(tensor_offsets);
  auto activations = [&](int s, int t) {
    sm90::tma_load_2d(stage_at(s), &maps.x, t * kBK, static_cast<int>(rows.from), full(s));
  };
  auto box_start = [](int t) { return F::first_word(t) & ~int64_t{3}; };
  auto values = [&](int s, int t) {
    sm90::tma_load_2d(stage_at(s) + static_cast<uint32_t>(L::kX), &maps.values, t * F::kEntries,
                      static_cast<int>(w0), full(s));
    if (tensor_offsets)
      sm90::tma_load_2d(stage_at(s) + static_cast<uint32_t>(L::kWords), &maps.offsets,
                        static_cast<int>(box_start(t)) * 2, static_cast<int>(w0), full(s));
  };
  auto offsets = [&](int s, int t) {
    if (tensor_offsets) return;
    sm90::copy_offset_words<L::kBoxWords>(p, stage_at(s) + static_cast<uint32_t>(L::kWords), box_start(t), w0, lane,
                                          full(s));
  };
  const uint32_t tensor_bytes = L::kTensorBytes - sm90::activation_shortfall<kRows>(p);
  auto bytes = [&](int) { return tensor_bytes + (tensor_offsets ? L::kWordBytes : 0u); };
  sm90::produce<S, kEarly>(begin, end, lane, bytes, full, empty, activations, values, offsets);
}

// Issues a consumer warpgroup's MMAs of one step (its 64 rows of the dense tile at `dense`, the
// activation tile at `x`) as one commit group.
template <int kRows, bool kBf16>
__device__ __forceinline__ void issue_step(float (&acc)[kRows / 2], uint32_t dense, uint32_t x) {
  sm90::fence_operands(acc);
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kBK / 16; ++k)
    sm90::wgmma_ss<kRows, kBf16>(acc, sm90::sw128_desc(dense + k * 32), sm90::sw128_desc(x + k * 32));
  sm90::wgmma_commit();
  sm90::fence_operands(acc);
}

// The weight from registers instead (wgmma_gather_kernel, 4:16: 4 stored entries of a row per k16
// MMA, on 192- and 256-row activation tiles): each consumer thread builds
// its own A fragments of a step, rows g and g + 8 of its warp's 16, columns 2q, 2q + 1, 2q + 8
// and 2q + 9 of each k16 MMA (q = lane % 4), from the step's packed tile, while the tensor cores
// work on the step before. No dense tile is zeroed, scattered into or read by the MMAs: at 4096 x
// 4096 x 4096 4:16, ncu counted those 128 + 195 + 128 of the expanding kernel's 1091 shared-memory
// wavefronts a step, where cuBLAS's tensor pipe ran 90% busy and this kernel's 64% (BENCHMARKS.md,
// session 56). The positions a row's 4 entries fill of an MMA's 16 make a 16-bit mask; entries come
// in order, so those at positions 2q and 2q + 1 are the (n - 1)-th and n-th, n = popc(mask &
// ((2 << 2q) - 1)) (padding groups put all their entries, zeros, at position 0, which changes no
// value taken). Session 56 (H100, against the expanding kernel): 1.02-1.05x at 1024 rows and
// 1.06-1.10x at 4096 on the LLaMA shapes; on the H200 1.04-1.12x on 192-row tiles at 330-700
// rows. Not taken: 160-row tiles (0.97-1.01x), 2:16 (2 entries an MMA, where the scatter is
// half the work: 0.84-0.93x at 512 rows).
template <int kN, int kM>
struct Gather {
  using F = sm90::Family<kN, kM>;
  static constexpr int kBoxWords = box_words<F>();
  static constexpr int kE = 16 * kN / kM;  // stored entries of a row per k16 MMA
  static_assert(kE == 4, "a k16 MMA's entries of a row are two value words");

  // A quad's word of masks holds row g's in bits 0-15 and row g + 8's in 16-31. Per row h:
  uint32_t upto[2][2];                // [h][half]: its positions 0 .. 2q + 8 * half
  uint32_t to_bit7[2], to_bit15[2];  // shifts (row g left, g + 8 right) putting 2q, 2q + 1 on bits 7, 15

  __device__ __forceinline__ explicit Gather(int lane) {
    const int q = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      upto[h][0] = ((2u << (2 * q)) - 1) << (16 * h);
      upto[h][1] = (((2u << (2 * q)) << 8) - 1) << (16 * h);
      to_bit7[h] = h ? 9 + 2 * q : 7 - 2 * q;
      to_bit15[h] = h ? 2 + 2 * q : 14 - 2 * q;
    }
  }

  // The A registers of row h for positions 2q, 2q + 1 (a[0]) and 2q + 8, 2q + 9 (a[1]) of an
  // MMA's 16, from the quad's word of masks and the row's entries there (v01, v23: 0-3 in order).
  __device__ __forceinline__ void pairs(uint32_t masks, int h, uint32_t v01, uint32_t v23, uint32_t& lo,
                                        uint32_t& hi) const {
    // Each half kept where its position holds an entry: the mask's bits on byte sign bits, replicated.
    const uint32_t at7 = h ? masks >> to_bit7[1] : masks << to_bit7[0];
    const uint32_t at15 = h ? masks >> to_bit15[1] : masks << to_bit15[0];
    uint32_t regs[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t n = __popc(masks & upto[h][half]);
      // Halves: entries n - 1 and n (mod 4; byte selectors 2n - 2, 2n - 1, 2n, 2n + 1 mod 8).
      const uint32_t picked = prmt(v01, v23, (n * 0x2222u + 0x1076u) & 0x7777u);
      regs[half] = picked & prmt(at7, at15, half ? 0xEE99u : 0xDD88u);
    }
    lo = regs[0], hi = regs[1];
  }

  // This thread's A fragments of step t, whose packed tile is at `packed`, for rows r0, r0 + 8.
  // The four lanes of a quad share their rows: lane q marks the positions of MMA q for both, and
  // the quad passes the masks round.
  __device__ __forceinline__ void build(const uint8_t* packed, int64_t t, int r0, uint32_t (&a)[kBK / 16][4]) const {
    const int q = threadIdx.x & 3;
    const int bit = static_cast<int>(F::first_word(t) & 3) * 32 + F::first_bit(t) + q * kE * F::kBits;
    const int word = bit >> 5, shift = bit & 31;
    uint32_t both = 0;  // MMA q's masks: row r0 in bits 0-15, r0 + 8 in 16-31
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t* box = reinterpret_cast<const uint32_t*>(packed + F::kValues) + (r0 + 8 * h) * kBoxWords + word;
      const uint32_t fields = __funnelshift_r(box[0], box[1], shift);  // MMA q's kE * kBits <= 16 offset bits
      uint32_t occupied = 0;
#pragma unroll
      for (int e = 0; e < kE; ++e) occupied |= 1u << ((e / kN) * kM + ((fields >> (e * F::kBits)) & (kM - 1)));
      both |= occupied << (16 * h);
    }
#pragma unroll
    for (int k = 0; k < kBK / 16; ++k) {
      const uint32_t masks = __shfl_sync(0xFFFFFFFFu, both, (threadIdx.x & 28) | k);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 v = *reinterpret_cast<const uint2*>(packed + (r0 + 8 * h) * F::kValueBytes + k * 8);
        pairs(masks, h, v.x, v.y, a[k][h], a[k][2 + h]);
      }
    }
  }
};

template <int kN, int kM>
constexpr bool kGathers = kN == 4 && kM == 16;  // measured (1:4 and 2:8 fit Gather too but take wgmma_sp)
constexpr int kGatherFromRows = 192;  // activation-tile rows from which the consumers gather

// kEarly: launched as a programmatic dependent (grids of one wave, sm90::launch_early_or_not), as
// the sparse kernels are: the producer copies its first weight tiles before it waits for the
// previous kernel.
template <typename T, int kN, int kM, int kRows, bool kEarly>
__global__ void __launch_bounds__(kThreads + kExpandThreads<kRows> + kProducerThreads, 1)
    wgmma_kernel(PathParams<T> p, const __grid_constant__ sm90::TileMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Layout<kN, kM, kRows>;
  using F = typename L::F;
  constexpr int S = L::kStages, D = L::kDense, kExpanders = kExpandThreads<kRows>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms: 1024-aligned
  const uint32_t ring = sm90::smem_addr(smem);
  auto stage_at = [&](int s) { return ring + static_cast<uint32_t>(s * L::kStage); };
  auto dense_at = [&](int d) { return ring + static_cast<uint32_t>(L::kDenseAt + d * L::kA); };
  auto full = [&](int s) { return ring + static_cast<uint32_t>(L::kBarriers) + s * 8; };  // copies landed
  auto empty = [&](int s) { return full(S) + s * 8; };                                     // multiplied
  auto ready = [&](int d) { return empty(S) + d * 8; };                                    // expanded
  auto freed = [&](int d) { return ready(D) + d * 8; };                                    // multiplied
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  const bool consumer = warp < kThreads / 32;
  const bool producer = warp == (kThreads + kExpanders) / 32;
  const sm90::BlockTile tile = sm90::block_tile<kRows>(p);
  const int64_t w0 = tile.w0;
  const sm90::RowTile rows = tile.rows;
  int begin, end;  // this block's steps
  sm90::split_steps<1>(p.groups * kM, begin, end);
  const bool tensor_offsets = sm90::offset_rows_aligned(p);

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      // The expected bytes, then each lane's offset words where they go by cp.async.
      sm90::mbarrier_init(full(s), 1 + (tensor_offsets ? 0 : kProducerThreads));
      sm90::mbarrier_init(empty(s), kThreads / 32);        // every consumer warp
    }
    for (int d = 0; d < D; ++d) {
      sm90::mbarrier_init(ready(d), kExpanders / 32);  // every expanding warp
      sm90::mbarrier_init(freed(d), kThreads / 32);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if constexpr (kEarly) allow_next_kernel();  // the next kernel's blocks may take idle SMs and copy their weights

  float acc[kRows / 2];  // set and used by the consumers only: the other roles keep no registers for it

  if (producer) {
    produce_packed<L, kRows, S, kEarly>(p, maps, tensor_offsets, w0, rows, begin, end, lane, stage_at, full, empty);
  } else if (!consumer) {
    const Scatter<kN, kM, kExpanders> scatter(threadIdx.x - kThreads);
    sm90::RingSlot<S> stage;
    sm90::RingSlot<D> dense;
    for (int t = begin; t < end; ++t) {
      sm90::mbarrier_wait(freed(dense.slot), dense.phase ^ 1);  // passes at once on a tile's first use
      scatter.zero(dense_at(dense.slot));
      sm90::mbarrier_wait(full(stage.slot), stage.phase);
      __syncwarp();  // the warp's zeros before its values
      scatter.write(smem + stage.slot * L::kStage + L::kX, t, dense_at(dense.slot));
      sm90::fence_async_proxy();  // the MMAs read the dense tile through the async proxy
      __syncwarp();
      if (lane == 0) sm90::mbarrier_arrive(ready(dense.slot));
      stage.advance();
      dense.advance();
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
    sm90::fence_operands(acc);
    sm90::RingSlot<S> stage;
    sm90::RingSlot<D> dense;
    auto issue = [&] {
      sm90::mbarrier_wait(full(stage.slot), stage.phase);  // the activation tile
      sm90::mbarrier_wait(ready(dense.slot), dense.phase);
      issue_step<kRows, kBf16>(acc, dense_at(dense.slot) + wg * 64 * 128, stage_at(stage.slot));
    };
    int last_stage = 0, last_dense = 0;  // of the step before, whose MMAs may still be in flight
    auto release = [&] {
      __syncwarp();
      if (lane == 0) {
        sm90::mbarrier_arrive(empty(last_stage));
        sm90::mbarrier_arrive(freed(last_dense));
      }
    };
    // ptxas serializes the MMAs (C7518) when wgmma's wait sits under a branch: the first step is
    // issued before the loop, and every step in it waits for the one before.
    if (begin < end) {
      issue();
      last_stage = stage.slot, last_dense = dense.slot;
      stage.advance();
      dense.advance();
    }
    for (int t = begin + 1; t < end; ++t) {
      issue();
      sm90::wgmma_wait<1>();  // the step before has retired: its stage and dense tile go back
      sm90::fence_operands(acc);
      release();
      last_stage = stage.slot, last_dense = dense.slot;
      stage.advance();
      dense.advance();
    }
    sm90::wgmma_wait<0>();
    sm90::fence_operands(acc);
  }
  if constexpr (kEarly) wait_for_previous_kernel();  // before any write (and the residual's read); long passed
  sm90::finish_tile<T, kRows>(p, acc, smem, consumer, w0, rows, sm90::consumer_row(warp, lane), lane & 3);
#else
  __trap();  // built for sm_90a only; the dispatch never launches it elsewhere
#endif
}

// The gathering kernel's block: the two consumer warpgroups and a producer warpgroup, of whose
// warps the first copies and the others wait; the producers hand registers to the consumers,
// whose accumulators and two steps' fragments (32 registers) did not fit the 168 a thread of
// 288 gets (ptxas serialized the MMAs; session 56).
constexpr int kGatherThreads = kThreads + 128;
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232, kLaunchRegisters = 168;
static_assert(128 * kProducerRegisters + kThreads * kConsumerRegisters <= kGatherThreads * kLaunchRegisters,
              "the consumers take what the producers hand back");

// Shared memory of the gathering kernel: the expanding kernel's ring of stages, no dense tiles.
template <int kN, int kM, int kRows>
struct GatherLayout {
  using Ring = Layout<kN, kM, kRows>;
  static constexpr size_t kStage = Ring::kStage;
  static constexpr int kStages = std::min<int>(8, static_cast<int>((220 * 1024) / kStage));
  static constexpr size_t kBarriers = kStages * kStage;
  static constexpr size_t kBytes = kBarriers + 2 * kStages * 8 + 1024;
  static_assert(kStages >= 3, "the copies run at least one step ahead of the two steps in the MMAs");
  static_assert(sm90::kFinishBytes<kRows> <= kBarriers, "finish_tile's scratch fits before the barriers");
  static_assert(kBytes >= sm90::kWholeSmBytes, "one block per SM, as launch_split's waves count them");
};

// The expanding kernel's producer, tiles and epilogue, with the consumers building A in registers.
template <typename T, int kN, int kM, int kRows, bool kEarly>
__global__ void __launch_bounds__(kGatherThreads, 1)
    wgmma_gather_kernel(PathParams<T> p, const __grid_constant__ sm90::TileMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = GatherLayout<kN, kM, kRows>;
  using Ring = typename L::Ring;
  using F = typename Ring::F;
  constexpr int S = L::kStages;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms: 1024-aligned
  const uint32_t ring = sm90::smem_addr(smem);
  auto stage_at = [&](int s) { return ring + static_cast<uint32_t>(s * L::kStage); };
  auto full = [&](int s) { return ring + static_cast<uint32_t>(L::kBarriers) + s * 8; };  // copies landed
  auto empty = [&](int s) { return full(S) + s * 8; };                                     // multiplied
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  const bool consumer = warp < kThreads / 32;
  const sm90::BlockTile tile = sm90::block_tile<kRows>(p);
  const int64_t w0 = tile.w0;
  const sm90::RowTile rows = tile.rows;
  int begin, end;  // this block's steps
  sm90::split_steps<1>(p.groups * kM, begin, end);
  const bool tensor_offsets = sm90::offset_rows_aligned(p);

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      sm90::mbarrier_init(full(s), 1 + (tensor_offsets ? 0 : kProducerThreads));
      sm90::mbarrier_init(empty(s), kThreads / 32);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if constexpr (kEarly) allow_next_kernel();

  float acc[kRows / 2];
  // Each warpgroup's warps meet before it moves its register limit again (named barriers 2-4).
  auto warpgroup_barrier = [&] { sm90::named_barrier_sync<128>(2 + wg); };

  if (!consumer) {
    sm90::setmaxnreg_dec<kProducerRegisters>();
    if (warp == kThreads / 32)
      produce_packed<Ring, kRows, S, kEarly>(p, maps, tensor_offsets, w0, rows, begin, end, lane, stage_at, full, empty);
    warpgroup_barrier();
    sm90::setmaxnreg_inc<kLaunchRegisters>();
  } else {
    sm90::setmaxnreg_inc<kConsumerRegisters>();
#pragma unroll
    for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
    sm90::fence_operands(acc);
    const Gather<kN, kM> gather(lane);
    const int r0 = sm90::consumer_row(warp, lane);
    uint32_t a0[kBK / 16][4], a1[kBK / 16][4];  // two steps' fragments: the MMAs read one while the next is built
    sm90::RingSlot<S> stage;
    int last = 0;
    auto build = [&](uint32_t(&a)[kBK / 16][4], int t) {
      sm90::mbarrier_wait(full(stage.slot), stage.phase);
      gather.build(smem + stage.slot * L::kStage + Ring::kX, t, r0, a);
      sm90::fence_operands(a);
    };
    // Step t's MMAs (fragments a), one commit group; then, the step before retired, its stage goes
    // back and step t + 1's fragments are built into the other set.
    auto step = [&](int t, uint32_t(&a)[kBK / 16][4], uint32_t(&next)[kBK / 16][4]) {
      const uint32_t x = stage_at(stage.slot);
      sm90::fence_operands(acc);
      sm90::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBK / 16; ++k) sm90::wgmma_rs<kRows, kBf16>(acc, a[k], sm90::sw128_desc(x + k * 32));
      sm90::wgmma_commit();
      sm90::fence_operands(acc);
      sm90::wgmma_wait<1>();
      if (t > begin) {
        __syncwarp();
        if (lane == 0) sm90::mbarrier_arrive(empty(last));
      }
      last = stage.slot;
      stage.advance();
      if (t + 1 < end) build(next, t + 1);
    };
    if (begin < end) build(a0, begin);
    for (int t = begin; t < end; t += 2) {  // two at a time, so that each set stays in fixed registers
      step(t, a0, a1);
      if (t + 1 < end) step(t + 1, a1, a0);
    }
    sm90::wgmma_wait<0>();
    sm90::fence_operands(acc);
    warpgroup_barrier();
    sm90::setmaxnreg_dec<kLaunchRegisters>();
  }
  if constexpr (kEarly) wait_for_previous_kernel();
  sm90::finish_tile<T, kRows>(p, acc, smem, consumer, w0, rows, sm90::consumer_row(warp, lane), lane & 3);
#else
  __trap();
#endif
}

// The consumers' setmaxnreg.inc waits for registers the producers hand back, out of what the
// block was launched with: a build whose kernel starts with fewer than kLaunchRegisters a thread
// would wait forever, so it takes the expanding kernel instead (ptxas gives 168 to every one).
template <auto kKernel>
bool gather_registers_fit() {
  static const bool fit = [] {
    cudaFuncAttributes a{};
    return cudaFuncGetAttributes(&a, kKernel) == cudaSuccess && a.numRegs >= kLaunchRegisters;
  }();
  return fit;
}

template <typename T, int kN, int kM, int kRows>
cudaError_t launch_expanded(const PathParams<T>& p, cudaStream_t stream, int splits) {
  using L = Layout<kN, kM, kRows>;
  sm90::TileMaps maps{};
  if (!sm90::packed_maps<typename L::F, kRows>(&maps, p) || !sm90::offsets_map(&maps.offsets, p, L::kBoxWords))
    return cudaErrorInvalidValue;
  if constexpr (kGathers<kN, kM> && kRows >= kGatherFromRows) {
    using G = GatherLayout<kN, kM, kRows>;
    if (gather_registers_fit<wgmma_gather_kernel<T, kN, kM, kRows, false>>() &&
        gather_registers_fit<wgmma_gather_kernel<T, kN, kM, kRows, true>>())
      return sm90::launch_early_or_not<kRows>(p, splits, [&](auto early) {
        return sm90::launch_tiles<wgmma_gather_kernel<T, kN, kM, kRows, early()>, kRows, G::kBytes, kGatherThreads>(
            p, stream, splits, early(), maps);
      });
  }
  constexpr unsigned kBlock = kThreads + kExpandThreads<kRows> + kProducerThreads;
  return sm90::launch_early_or_not<kRows>(p, splits, [&](auto early) {
    return sm90::launch_tiles<wgmma_kernel<T, kN, kM, kRows, early()>, kRows, L::kBytes, kBlock>(p, stream, splits,
                                                                                                early(), maps);
  });
}

// The families wgmma.cu compiles (sm90::with_family_of).
constexpr auto with_family = [](int n, int m, auto&& fn) {
  using sm90::family_code;
  return sm90::with_family_of<family_code(1, 4), family_code(2, 4), family_code(1, 8), family_code(2, 8), family_code(4, 8),
                              family_code(4, 16), family_code(8, 16), family_code(2, 16)>(n, m, fn);
};

}  // namespace

bool wgmma_family(int n, int m) {
  return with_family(n, m, [](auto kN, auto) { return kN() != 0; });
}

bool wgmma_device() { return compute_capability() == 90; }

template <typename T>
cudaError_t run_wgmma(PathParams<T> p, cudaStream_t stream) {
  return sm90::run_family(p, with_family, [&](auto kN, auto kM) {
    const int64_t steps = sm90::k_steps(p.groups, kM());
    const auto launch = [&](auto rows, int splits, const PathParams<T>& tiles) {
      return launch_expanded<T, kN(), kM(), rows()>(tiles, stream, splits);
    };
    return sm90::launch_split<256, 192, 160, 128, 64>(p, steps, sm90::kSparseTiles, sm90::kSparseSplits, launch);
  });
}

template cudaError_t run_wgmma<float>(PathParams<float>, cudaStream_t);
template cudaError_t run_wgmma<__half>(PathParams<__half>, cudaStream_t);
template cudaError_t run_wgmma<__nv_bfloat16>(PathParams<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
