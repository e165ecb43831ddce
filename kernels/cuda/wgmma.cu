// Warpgroup tensor-core path (Hopper, sm_90a) for fp16/bf16: prompt processing and large batches
// for the families the sparse tensor cores cannot take (4:8, 4:16, 8:16, 2:16; dispatch.cu).
//
// Y^T = W^T X^T, computed as D[weight rows x activation rows] with wgmma.mma_async:
//  * A = the weight, from registers: each thread builds its A fragments (two rows, 16 pairs of
//    dense positions) of step t + 1 from the packed format while the tensor cores work on step
//    t, into the other of two fixed register sets (sm90::fence_operands keeps their writes first);
//  * B = the activations, a [rows x 64] K-major tile per step with the 128-byte swizzle, copied
//    with cp.async, zero-filled past the last row and past K;
//  * fp32 accumulators in registers; alpha and bias applied on the way out.
// A block has two warpgroups (128 weight rows, 64 each) and one activation tile of 64, 128 or
// 256 rows. The packed weight tile (values and offset words) and the activation tile of each
// step land in a ring of shared-memory stages, kStages - 2 steps ahead of the MMAs; a stage is
// refilled only after the MMAs that read it have retired. Calls with few tiles split K over a
// cluster (sm90::launch_split, reduce_split).
// Until session 28 A was a dense [128 x 64] shared-memory tile that each thread wrote and the
// MMAs read, with a ring of 4-5 stages and no K split: the register build, 8 stages where they
// fit and the split ran 2.0-2.5x faster at 128 rows, 1.06-3.55x at 512 and 1.02-1.22x at 4096 on
// 4:16 and 4:8, and mask_pair another 1.15-1.45x (BENCHMARKS.md); they still run 0.29-0.61x
// cuBLAS fp16, bound by the expansion. An earlier try at register operands had given wrong
// results (A rebuilt while the MMAs that read it ran) or serialized MMAs (ptxas keeping one set
// alive).
// Expansion: a thread owns 16 pairs of dense positions per step (its two A-fragment rows, the
// pair 2q of each 8-position half). For N <= 2 a pair is one byte permute of the group's stored
// values, with the selector looked up in a small shared-memory table indexed by the group's
// offset bits and the pair's place in the group (7-8 instructions a pair; comparing each
// entry's offset against the pair took about twice that); for N = 4 a pair is one byte permute
// selected by counting the group's offset-mask bits below it (mask_pair), for N = 8 the
// comparison remains.
// Each thread copies the same chunks every step, so the copy addresses are computed once
// (StepLoader): computing them per step made the copies the largest part of the instruction
// stream (199M -> 140M warp instructions at 4096^3 2:8).
// Used for N in {1, 2, 4, 8}, M in {4, 8, 16}, M <= 8N (a step holds whole 16-byte runs of
// values), K % 8 == 0 (16-byte activation copies). Other calls take the mma path.
#include <algorithm>
#include <type_traits>

#include "wgmma_packed.cuh"

namespace nmcli {
namespace {

using sm90::kBK;
using sm90::kThreads;
using sm90::kTileW;

// Expansion by selector table (N <= 2) or by comparing offsets (N >= 4).
template <int kN, int kM>
struct Family : sm90::Family<kN, kM> {
  static constexpr bool kTable = kN <= 2;
  static constexpr int kTableEntries = kTable ? (1 << (kN * index_bits(kM))) * (kM / 2) : 0;
};

template <int kN, int kM, int kRows>
struct Layout {
  using F = Family<kN, kM>;
  static constexpr size_t kX = static_cast<size_t>(kRows) * 128;  // activation tile per stage
  static constexpr size_t kValues = F::kValues;                   // then the packed tile
  static constexpr size_t kStage = (kX + F::kTileBytes + 1023) / 1024 * 1024;
  // As many stages as fit, up to 8: the ring runs kStages - 2 steps ahead of the MMAs.
  static constexpr int kStages =
      std::min<int>(8, static_cast<int>((225 * 1024 - F::kTableEntries * 2) / kStage));
  static constexpr size_t kTableOffset = kStages * kStage;        // then the selector table
  static_assert(kStages >= 4, "the ring runs kStages - 2 steps ahead, at least 2");
  static_assert(kThreads * kRows / 2 * 4 <= kTableOffset, "reduce_split's scratch fits in the ring");
  static constexpr size_t kBytes = kTableOffset + F::kTableEntries * 2 + 1024;  // + slack to align
};

// Copies a step's activation tile and packed weight tile into its stage.
template <typename T, int kN, int kM, int kRows>
struct StepLoader {
  using L = Layout<kN, kM, kRows>;
  sm90::ActivationLoader<T, kRows> x;
  sm90::PackedLoader<T, sm90::Family<kN, kM>> w;

  __device__ __forceinline__ StepLoader(const PathParams<T>& p, int64_t w0, int64_t r0) : x(p, r0), w(p, w0) {}

  __device__ __forceinline__ void load(const PathParams<T>& p, uint8_t* stage, int64_t t) const {
    const uint32_t base = sm90::smem_addr(stage);
    x.load(p, base, t);
    w.load(p, base + static_cast<uint32_t>(L::kX), t);
  }
};

// Selector table for N <= 2: entry code * (M/2) + p is the byte-permute selector that turns the
// group's stored values (entry e in bytes 2e, 2e+1 of a 32-bit word) into the dense pair of
// positions 2p, 2p+1, for a group whose offset bits are `code`; 0x44 picks zero bytes.
template <int kN, int kM>
__device__ __forceinline__ void fill_selectors(uint16_t* table) {
  using F = Family<kN, kM>;
  for (int i = threadIdx.x; i < F::kTableEntries; i += kThreads) {
    const int code = i / (kM / 2), pair = i % (kM / 2);
    uint32_t lo = 0x44, hi = 0x44;
    for (int e = 0; e < kN; ++e) {
      const int off = (code >> (e * F::kBits)) & ((1 << F::kBits) - 1);
      const uint32_t bytes = static_cast<uint32_t>(2 * e) | static_cast<uint32_t>(2 * e + 1) << 4;
      if (off == 2 * pair) lo = bytes;
      if (off == 2 * pair + 1) hi = bytes;
    }
    table[i] = static_cast<uint16_t>(lo | hi << 8);
  }
}

// Bits [bit, bit + width) of a step's offsets (width <= 32), shifted down to bit 0. `bit` is a
// compile-time constant once the callers' loops are unrolled; `extra` is a per-thread shift that
// never crosses a word.
__device__ __forceinline__ uint32_t offset_bits(const uint32_t* norm, int bit, int width, int extra) {
  const int word = bit >> 5, shift = bit & 31;
  uint32_t v = norm[word] >> (shift + extra);
  if (shift + width > 32) v |= norm[word + 1] << (32 - shift);
  return width >= 32 ? v : v & ((1u << width) - 1u);
}

// The stored values of a group (entry e in bits 16e..16e+15), up to two entries.
template <int kN>
__device__ __forceinline__ uint32_t group_values(const uint8_t* p) {
  if constexpr (kN == 1) return *reinterpret_cast<const uint16_t*>(p);
  else return *reinterpret_cast<const uint32_t*>(p);
}

// N = 8: the dense pair at positions o, o + 1 of a group, by comparing each entry's offset.
template <int kN, int kM>
__device__ __forceinline__ uint32_t compare_pair(const uint8_t* group, uint32_t code, int o) {
  using F = Family<kN, kM>;
  static_assert(kN == 8, "N <= 2 take the selector table, N = 4 mask_pair");
  const uint4 u = *reinterpret_cast<const uint4*>(group);
  const uint32_t v[4] = {u.x, u.y, u.z, u.w};
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int e = 0; e < kN; ++e) {
    const uint32_t off = (code >> (e * F::kBits)) & ((1u << F::kBits) - 1u);
    const uint32_t value = (v[e / 2] >> (16 * (e & 1))) & 0xffffu;
    lo |= off == static_cast<uint32_t>(o) ? value : 0u;
    hi |= off == static_cast<uint32_t>(o + 1) ? value : 0u;
  }
  return lo | (hi << 16);
}

// A thread's A fragments for one step: a[s][i] for k16 MMA s, register i (row + 8 for odd i,
// positions 2q, 2q + 1 for i < 2 and 2q + 8, 2q + 9 for i >= 2 of the MMA's 16).
struct WeightFragments {
  uint32_t a[kBK / 16][4];
};

// N = 4: the dense pair at positions o, o + 1 of a group from the group's offset mask (bit p set
// where an entry sits). Offsets strictly increase within a group (docs/FORMAT.md), so the entry at
// p is the count of mask bits below p, and one byte permute of the group's 8 value bytes picks
// both halves (about half the instructions of comparing every entry's offset with both).
template <int kM>
__device__ __forceinline__ uint32_t mask_pair(const uint8_t* group, uint32_t code, int o) {
  constexpr int kBits = index_bits(kM);
  uint32_t mask = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) mask |= 1u << ((code >> (e * kBits)) & (kM - 1));
  const uint2 v = *reinterpret_cast<const uint2*>(group);
  const uint32_t lo = __popc(mask & ((1u << o) - 1u)), has_lo = (mask >> o) & 1u, has_hi = (mask >> (o + 1)) & 1u;
  const uint32_t hi = lo + has_lo;  // entry indices, meaningful where has_lo / has_hi
  // Selector nibbles 2i, 2i + 1 pick entry i's bytes out of (v.x, v.y).
  const uint32_t dense = __byte_perm(v.x, v.y, (lo * 0x22u + 0x10u) | (hi * 0x22u + 0x10u) << 8);
  return dense & ((has_lo ? 0xffffu : 0u) | (has_hi ? 0xffff0000u : 0u));
}

// Builds the 16 dense pairs a thread owns for one step, its A fragments: rows `row` and row + 8 of
// the stage's packed tile, K positions 16s + 8h + 2q and + 1 for s < 4, h < 2.
template <int kN, int kM, int kRows>
__device__ __forceinline__ void expand_step(const uint8_t* stage, int64_t t, int row, const uint16_t* table, int q,
                                            WeightFragments& f) {
  using F = Family<kN, kM>;
  using L = Layout<kN, kM, kRows>;
  const int first_bit = F::first_bit(t);
  // M = 4 has two groups per 8-position half: the thread's one depends on q.
  const int qgroup = kM == 4 ? q >> 1 : 0;
  const int pair_in_group = kM == 4 ? (q & 1) : q;  // + 4h for M = 16
#pragma unroll
  for (int half_row = 0; half_row < 2; ++half_row) {
    const int r = row + 8 * half_row;
    const uint8_t* values = stage + L::kX + r * F::kValueBytes + qgroup * kN * 2;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(stage + L::kX + L::kValues) + r * F::kIndexWords;
    uint32_t raw[F::kIndexWords], norm[F::kOffsetWords];
#pragma unroll
    for (int i = 0; i < F::kIndexWords; ++i) raw[i] = words[i];
#pragma unroll
    for (int i = 0; i < F::kOffsetWords; ++i) norm[i] = __funnelshift_r(raw[i], raw[i + 1], first_bit);
#pragma unroll
    for (int s = 0; s < kBK / 16; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int g = (16 * s + 8 * h) / kM;  // the half's first group (+ qgroup for M = 4)
        const int pair = pair_in_group + (kM == 16 ? 4 * h : 0);
        const uint32_t code = offset_bits(norm, g * F::kGroupBits, F::kGroupBits, qgroup * F::kGroupBits);
        uint32_t dense;
        if constexpr (F::kTable) {
          dense = __byte_perm(group_values<kN>(values + g * kN * 2), 0u, table[code * (kM / 2) + pair]);
        } else if constexpr (kN == 4) {
          dense = mask_pair<kM>(values + g * kN * 2, code, 2 * pair);
        } else {
          dense = compare_pair<kN, kM>(values + g * kN * 2, code, 2 * pair);
        }
        f.a[s][half_row + 2 * h] = dense;
      }
  }
  sm90::fence_operands(f.a);
}

template <typename T, int kN, int kM, int kRows>
__global__ void __launch_bounds__(kThreads, 1) wgmma_kernel(PathParams<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using F = Family<kN, kM>;
  using L = Layout<kN, kM, kRows>;
  constexpr int S = L::kStages;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms: 1024-aligned
  uint16_t* table = reinterpret_cast<uint16_t*>(smem + L::kTableOffset);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3, wg = warp >> 2;
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kTileW, r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  int begin, end;  // this block's steps
  sm90::split_steps<1>(p.groups * kM, begin, end);
  const int steps = end - begin;
  // This thread's rows: A-fragment rows g and g + 8 of its warp's 16.
  const int row = wg * 64 + (warp & 3) * 16 + (lane >> 2);
  auto stage_of = [&](int i) { return smem + (i % S) * L::kStage; };  // step begin + i

  const StepLoader<T, kN, kM, kRows> loader(p, w0, r0);

  float acc[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
  sm90::fence_operands(acc);
  if constexpr (F::kTable) fill_selectors<kN, kM>(table);

#pragma unroll
  for (int i = 0; i < S - 2; ++i) {
    if (i < steps) loader.load(p, stage_of(i), begin + i);
    sm90::cp_async_commit();
  }
  sm90::cp_async_wait<S - 3>();  // step 0 has landed (this thread's copies) ...
  __syncthreads();               // ... everyone's, and the selector table is written
  WeightFragments f0, f1;        // two sets: step i's MMAs read one while step i + 1's is built
  if (steps > 0) expand_step<kN, kM, kRows>(stage_of(0), begin, row, table, q, f0);

  auto step = [&](int i, const WeightFragments& f, WeightFragments& next) {
    // Steps i (for the MMAs) and i + 1 (for the expansion) have landed; step i - 2's MMAs retired
    // in the previous iteration, so its stage can be refilled.
    sm90::cp_async_wait<S - 4>();
    sm90::fence_async_proxy();
    __syncthreads();
    if (i + S - 2 < steps) loader.load(p, stage_of(i + S - 2), begin + i + S - 2);
    sm90::cp_async_commit();

    const uint32_t xs = sm90::smem_addr(stage_of(i));
    sm90::fence_operands(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int s = 0; s < kBK / 16; ++s) sm90::wgmma_rs<kRows, kBf16>(acc, f.a[s], sm90::sw128_desc(xs + s * 32));
    sm90::wgmma_commit();
    sm90::fence_operands(acc);
    sm90::wgmma_wait<1>();  // step i - 1's MMAs have retired: its fragments are free for step i + 1
    if (i + 1 < steps) expand_step<kN, kM, kRows>(stage_of(i + 1), begin + i + 1, row, table, q, next);
  };
  for (int i = 0; i < steps; i += 2) {  // two at a time, so that each set stays in fixed registers
    step(i, f0, f1);
    if (i + 1 < steps) step(i + 1, f1, f0);
  }
  sm90::wgmma_wait<0>();
  sm90::fence_operands(acc);
  if (sm90::reduce_split(acc, smem)) sm90::store_tile<T, kRows>(p, acc, w0, r0, row, q);
#else
  __trap();  // built for sm_90a only; the dispatch never launches it elsewhere
#endif
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
    const int64_t steps = (p.groups * kM() + kBK - 1) / kBK;
    return sm90::launch_split<256, 128, 64>(p, steps, sm90::kSparseTiles, {}, [&](auto rows, int splits) {
      return sm90::launch_tiles<wgmma_kernel<T, kN(), kM(), rows()>, rows(), Layout<kN(), kM(), rows()>::kBytes>(
          p, stream, splits, false);
    });
  });
}

template cudaError_t run_wgmma<float>(PathParams<float>, cudaStream_t);
template cudaError_t run_wgmma<__half>(PathParams<__half>, cudaStream_t);
template cudaError_t run_wgmma<__nv_bfloat16>(PathParams<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
