// Warpgroup tensor-core path for fp32 (Hopper, sm_90a): element-wise N:M weights from 9 rows
// (dispatch.cu), where the only other fp32 kernels for them were decode and the SIMT tiled path.
// Measured: BENCHMARKS.md, sessions 27 and 28.
//
// Y^T = W^T X^T on TF32 wgmma.mma_async, with fp32 accuracy by the 3xTF32 split of tf32.cuh (as
// vector.cu does with mma.sync): W x ~= W_small X_big + W_big X_small + W_big X_big in fp32
// accumulators. Two warpgroups of 64 weight rows each; activations by cp.async into a ring of
// stages. A step is 32 K positions, one 128-byte swizzle row of fp32, so k8 TF32 MMAs address a
// tile as k16 16-bit ones do.
//  * The weight, A, from registers: each thread builds its own A fragments of the next step (its
//    two rows, 8 positions each) from the packed tile while the tensor cores work on the current
//    step, into the other of two register sets. The first build expanded the weight into dense
//    shared-memory tiles (W_big, W_small) that every MMA then read: at small row counts those
//    reads and writes bounded a step (session 27); from registers the step traffic is less than
//    half.
//  * The activations, B: once a step has landed, each thread splits its rows' chunks into X_big
//    and X_small tiles, in the K order that makes each lane's A positions whole N:M groups
//    (split_activations).
// MMAs per step: 3 x 4 k8 per warpgroup. Calls with few tiles split K over a cluster
// (sm90::launch_split, finish_tile). Any N:M with M a power of two up to 32 (groups never cross
// a step).
#include <algorithm>

#include "tf32.cuh"
#include "wgmma_packed.cuh"

namespace nmcli {
namespace {

using sm90::kThreads;
using sm90::kTileW;

constexpr int kStep = sm90::kStepOf<float>;  // 32 K positions per step

// Geometry of one step of an N:M family with M | 32 (groups never cross steps).
template <int kN, int kM>
struct Tf32Family {
  static_assert(32 % kM == 0 && kN < kM, "M a power of two up to 32");
  static constexpr int kBits = index_bits(kM);
  static constexpr int kEntries = kStep / kM * kN;  // stored entries per weight row per step
  static constexpr int kValueBytes = kEntries * 4;
  static constexpr int kChunk = kValueBytes % 16 == 0 ? 16 : kValueBytes % 8 == 0 ? 8 : 4;  // copy width
  static constexpr int kValueChunks = kValueBytes / kChunk;
  static constexpr int kIndexWords = (kEntries * kBits + 31) / 32 + 1;  // a step's offset bits, from any start bit
  static constexpr size_t kValues = (static_cast<size_t>(kTileW) * kValueBytes + 15) / 16 * 16;
  static constexpr size_t kTileBytes = kValues + static_cast<size_t>(kTileW) * kIndexWords * 4;
  static __device__ __forceinline__ int first_bit(int64_t t) { return static_cast<int>((t * kEntries * kBits) & 31); }
};

// The K order of a step in the activation operand tiles: slot s = 8k + 4h + a holds K position
// 8a + 2k + h of the step (k the k8 MMA, a = 0..3, h = 0..1). The A fragment of lane q of a warp
// holds columns q and q + 4 of each k8 MMA, so with this order its eight weight positions per row
// are the step's 8q .. 8q + 7: whole groups for M <= 8, whose stored entries lie side by side. The
// MMA sums over K, so any order works that the two operands share.

// Shared memory: a ring of kStages steps (the activation tile [kRows x 32] with the 128-byte
// swizzle as copied, then the packed weight tile: values, then offset words), then two sets of
// activation operand tiles written per step in slot order (X_big, X_small). The weight goes to
// the MMAs from registers.
template <int kN, int kM, int kRows>
struct Tf32Layout {
  using F = Tf32Family<kN, kM>;
  static constexpr size_t kX = static_cast<size_t>(kRows) * 128;
  static constexpr size_t kStage = (kX + F::kTileBytes + 1023) / 1024 * 1024;  // swizzle atoms stay 1024-aligned
  static constexpr size_t kOperands = 2 * kX;                                // X_big, X_small
  static constexpr int kStages = std::min<int>(8, static_cast<int>((226 * 1024 - 2 * kOperands) / kStage));
  static constexpr size_t kOperandsOffset = kStages * kStage;
  static constexpr size_t kBytes = kOperandsOffset + 2 * kOperands + 1024;  // + slack to align the ring
  static_assert(kStages >= 3, "a step is prepared while the next kStages - 1 land");
  static_assert(sm90::kFinishBytes<kRows> <= kOperandsOffset + 2 * kOperands, "finish_tile's scratch fits");
};

// Byte offset of 16-byte chunk `c` (0..7) of row `r` in a [rows x 32] fp32 tile with the 128-byte
// swizzle (chunk c of row r at chunk c ^ (r % 8)).
__device__ __forceinline__ uint32_t swizzled_chunk(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4));
}

// Loads kCount consecutive floats from `src` (kAlign: the largest power of two dividing their
// byte offset from a 16-byte aligned base) with the widest loads that alignment allows.
template <int kCount, int kAlign>
__device__ __forceinline__ void load_floats(const float* src, float (&v)[kCount]) {
  if constexpr (kCount % 4 == 0 && kAlign % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kCount; i += 4) {
      const float4 u = *reinterpret_cast<const float4*>(src + i);
      v[i] = u.x, v[i + 1] = u.y, v[i + 2] = u.z, v[i + 3] = u.w;
    }
  } else if constexpr (kCount % 2 == 0 && kAlign % 8 == 0) {
#pragma unroll
    for (int i = 0; i < kCount; i += 2) {
      const float2 u = *reinterpret_cast<const float2*>(src + i);
      v[i] = u.x, v[i + 1] = u.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) v[i] = src[i];
  }
}

// A thread's A fragments for one step, both halves of the split: register i of k8 MMA k holds row
// `row` (+ 8 for odd i), slot 2k + (i >> 1) of the thread's eight (position 8q + 2k + (i >> 1)).
struct WeightFragments {
  uint32_t big[4][4], small[4][4];
};

// Builds this thread's fragments of step t from the packed tile: for each of its two rows, its
// eight positions 8q .. 8q + 7 in registers from the stored entries that can land there, then
// split. With M <= 8 those positions hold 8 / M whole groups (the entries [8qN / M, 8(q + 1)N / M)
// of the step, compile-time candidates); with M = 16 they are half of group q / 2 and with M = 32
// a quarter of the step's one group, so each of the group's entries is a candidate for each
// position. Positions no entry takes stay zero, as do positions past K (their stored values are
// zero by the format).
template <int kN, int kM>
__device__ __forceinline__ void expand_weight(const uint8_t* packed, int64_t t, int row, int q, WeightFragments& f) {
  using F = Tf32Family<kN, kM>;
  constexpr bool kWhole = kM <= 8;                     // the lane's positions are whole groups
  constexpr int kCount = kWhole ? 8 * kN / kM : kN;    // entries the lane reads per row
  const int first = kWhole ? q * kCount : kM == 16 ? (q >> 1) * kN : 0;
  const int base = kWhole ? 0 : kM == 16 ? 8 * (q & 1) : 8 * q;  // in-group offset of position 8q
  // The byte offset of a lane's first entry from a 16-byte aligned row start is a multiple of kFrom.
  constexpr int kFrom = F::kValueBytes | (kM == 32 ? 0 : kCount * 4);
  constexpr int kAlign = kFrom & -kFrom;
  constexpr int kWords = (kCount * F::kBits + 31) / 32;  // the lane's offset bits, normalized
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 8 * h;
    float v[kCount];
    load_floats<kCount, kAlign>(reinterpret_cast<const float*>(packed + r * F::kValueBytes) + first, v);
    // The lane's offset bits start `bit` bits into the row's copied words; the copy holds whole
    // words past the step's last bit, and the word read past those is never used.
    const uint32_t* words = reinterpret_cast<const uint32_t*>(packed + F::kValues) + r * F::kIndexWords;
    const int bit = F::first_bit(t) + first * F::kBits;
    uint32_t raw[kWords + 1], bits[kWords];
#pragma unroll
    for (int i = 0; i <= kWords; ++i) raw[i] = words[(bit >> 5) + i];
#pragma unroll
    for (int i = 0; i < kWords; ++i) bits[i] = __funnelshift_r(raw[i], raw[i + 1], bit & 31);
    float d[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) d[p] = 0.f;
#pragma unroll
    for (int e = 0; e < kCount; ++e) {
      const int b = e * F::kBits, word = b / 32, shift = b % 32;
      uint32_t offset = bits[word] >> shift;
      if (shift + F::kBits > 32 && word + 1 < kWords) offset |= bits[word + 1] << (32 - shift);
      offset &= (1u << F::kBits) - 1u;
      if constexpr (kWhole) {
        const int group = e / kN;
#pragma unroll
        for (int o = 0; o < kM; ++o) d[group * kM + o] = static_cast<int>(offset) == o ? v[e] : d[group * kM + o];
      } else {
        const int at = static_cast<int>(offset) - base;  // this lane's position, if it is one
#pragma unroll
        for (int p = 0; p < 8; ++p) d[p] = at == p ? v[e] : d[p];
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) split_tf32(d[j], f.big[j >> 1][h + 2 * (j & 1)], f.small[j >> 1][h + 2 * (j & 1)]);
  }
}

// Writes a landed activation tile (K order as copied) into x_big and x_small in slot order, split:
// a (row, u) item reads the row's chunks u, u + 2, u + 4, u + 6 (positions 8a + 4u .. 8a + 4u + 3)
// and writes chunks 4u .. 4u + 3 (chunk 4u + e holds position 8a + 4u + e in its lane a).
template <int kRows>
__device__ __forceinline__ void split_activations(const uint8_t* x, uint8_t* x_big, uint8_t* x_small) {
#pragma unroll
  for (int item = threadIdx.x; item < kRows * 2; item += kThreads) {
    const int r = item >> 1, u = item & 1;
    float in[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const float4 c = *reinterpret_cast<const float4*>(x + swizzled_chunk(r, 2 * a + u));
      in[a][0] = c.x, in[a][1] = c.y, in[a][2] = c.z, in[a][3] = c.w;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      uint4 b, s;
      split_tf32(in[0][e], b.x, s.x);
      split_tf32(in[1][e], b.y, s.y);
      split_tf32(in[2][e], b.z, s.z);
      split_tf32(in[3][e], b.w, s.w);
      const uint32_t at = swizzled_chunk(r, 4 * u + e);
      *reinterpret_cast<uint4*>(x_big + at) = b;
      *reinterpret_cast<uint4*>(x_small + at) = s;
    }
  }
}

template <int kN, int kM, int kRows>
__global__ void __launch_bounds__(kThreads, 1) wgmma_tf32_kernel(PathParams<float> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Tf32Layout<kN, kM, kRows>;
  constexpr int S = L::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms: 1024-aligned
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const sm90::BlockTile tile = sm90::block_tile<kRows, false>(p);  // ActivationLoader zero-fills past the rows
  const int64_t w0 = tile.w0, r0 = tile.rows.from;
  const int row = sm90::consumer_row(warp, lane), q = lane & 3;  // this thread's A rows: row, row + 8
  int begin, end;  // this block's steps
  sm90::split_steps<1, kStep>(p.groups * kM, begin, end);
  const int steps = end - begin;
  auto stage = [&](int i) { return smem + (i % S) * L::kStage; };  // step begin + i
  auto operands = [&](int i) { return smem + L::kOperandsOffset + (i & 1) * L::kOperands; };
  const sm90::ActivationLoader<float, kRows> x_loader(p, r0);
  const sm90::PackedLoader<float, Tf32Family<kN, kM>> w_loader(p, w0);
  auto load = [&](int i) {
    const uint32_t base = sm90::smem_addr(stage(i));
    x_loader.load(p, base, begin + i);
    w_loader.load(p, base + static_cast<uint32_t>(L::kX), begin + i);
  };
  // Step i's operands: its activation tiles in slot order, split; its weight fragments.
  auto prepare = [&](int i, WeightFragments& f) {
    uint8_t* ops = operands(i);
    split_activations<kRows>(stage(i), ops, ops + L::kX);
    expand_weight<kN, kM>(stage(i) + L::kX, begin + i, row, q, f);
    sm90::fence_operands(f.big);
    sm90::fence_operands(f.small);
  };

  float acc[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
  sm90::fence_operands(acc);

#pragma unroll
  for (int i = 0; i < S; ++i) {
    if (i < steps) load(i);
    sm90::cp_async_commit();
  }
  sm90::cp_async_wait<S - 1>();  // step 0 has landed (this thread's copies) ...
  __syncthreads();               // ... everyone's
  WeightFragments f0, f1;        // two sets: step i's MMAs read one while step i + 1's is built
  if (steps > 0) prepare(0, f0);

  auto step = [&](int i, const WeightFragments& f, WeightFragments& next) {
    // Step i + 1 has landed; step i's operands are written (the activation tiles by generic
    // stores, hence the proxy fence) and its stage has been read, so it takes step i + S.
    sm90::cp_async_wait<S - 2>();
    sm90::fence_async_proxy();
    __syncthreads();
    if (i + S < steps) load(i + S);
    sm90::cp_async_commit();

    const uint32_t x_big = sm90::smem_addr(operands(i)), x_small = x_big + static_cast<uint32_t>(L::kX);
    sm90::fence_operands(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kStep / 8; ++k) {  // small terms first
      sm90::wgmma_tf32_rs<kRows>(acc, f.small[k], sm90::sw128_desc(x_big + k * 32));
      sm90::wgmma_tf32_rs<kRows>(acc, f.big[k], sm90::sw128_desc(x_small + k * 32));
      sm90::wgmma_tf32_rs<kRows>(acc, f.big[k], sm90::sw128_desc(x_big + k * 32));
    }
    sm90::wgmma_commit();
    sm90::fence_operands(acc);
    sm90::wgmma_wait<1>();  // step i - 1's MMAs have retired: its fragments and tiles are free for step i + 1
    if (i + 1 < steps) prepare(i + 1, next);
  };
  for (int i = 0; i < steps; i += 2) {  // two at a time, so that each set stays in fixed registers
    step(i, f0, f1);
    if (i + 1 < steps) step(i + 1, f1, f0);
  }
  sm90::wgmma_wait<0>();
  sm90::fence_operands(acc);
  sm90::finish_tile<float, kRows>(p, acc, smem, true, w0, tile.rows, row, q);
#else
  __trap();  // built for sm_90a only; the dispatch never launches it elsewhere
#endif
}

// The families this path compiles: M a power of two up to 32, N/M <= 1/2 (sm90::with_family_of).
constexpr auto with_tf32_family = [](int n, int m, auto&& fn) {
  using sm90::family_code;
  return sm90::with_family_of<family_code(2, 4), family_code(1, 4), family_code(2, 8), family_code(1, 8),
                              family_code(4, 8), family_code(2, 16), family_code(4, 16), family_code(8, 16),
                              family_code(4, 32), family_code(8, 32), family_code(16, 32)>(n, m, fn);
};

// Step cost of each width relative to a 64-row step, and the K splits weighed: from session 28's
// sweeps (every width x split 1-3 forced at 17-512 rows on 4096 x 4096, 11008 x 4096, 4096 x 14336
// and 14336 x 4096, 2:4 and 2:8; BENCHMARKS.md), a 128-row step costs about 1.45 and a 32-row one
// 0.79 of a 64-row step, and an extra block of a split about 4 steps. With these the model's choice
// ran within 4% of the fastest forced one at 54 of 56 points (10-11% off at the other two). 3-way
// splits ran 1.36-1.46x 2-way ones at 17 rows with N = 4096 (96 blocks instead of 64); 4-way
// splits lost (only 30 clusters of 4 whole-SM blocks fit at once on the H100, against 32 tiles).
constexpr sm90::TileCost kTf32Tiles[] = {{128, 1.45}, {64, 1.0}, {32, 0.79}};
constexpr sm90::SplitRule kTf32Splits{3, 4.0, true, false, false};

}  // namespace

bool wgmma_tf32_family(int n, int m) {
  return with_tf32_family(n, m, [](auto kN, auto) { return kN() != 0; });
}

bool wgmma_tf32_runs(int n, int m, int64_t k, const void* values) {
  return wgmma_tf32_family(n, m) && k % 4 == 0 && reinterpret_cast<uintptr_t>(values) % 16 == 0 && wgmma_device();
}

cudaError_t run_wgmma_tf32(PathParams<float> p, cudaStream_t stream) {
  if (!wgmma_tf32_runs(p.n, p.m, p.k, p.values) || reinterpret_cast<uintptr_t>(p.x) % 16 != 0)
    return cudaErrorInvalidValue;
  return with_tf32_family(p.n, p.m, [&](auto kN, auto kM) -> cudaError_t {
    if constexpr (kN() == 0) {
      return cudaErrorInvalidValue;
    } else {
      const int64_t steps = (p.groups * kM() + kStep - 1) / kStep;
      auto launch = [&](auto rows, int splits, const PathParams<float>& tiles) {
        using L = Tf32Layout<kN(), kM(), rows()>;
        return sm90::launch_tiles<wgmma_tf32_kernel<kN(), kM(), rows()>, rows(), L::kBytes>(tiles, stream, splits,
                                                                                            false);
      };
      return sm90::launch_split<128, 64, 32>(p, steps, kTf32Tiles, kTf32Splits, launch);
    }
  });
}

}  // namespace nmcli
