// Warpgroup tensor-core path for fp32 (Hopper, sm_90a): element-wise N:M weights from 17 rows
// (from 9 where N/M > 1/4; dispatch.cu), where the only other fp32 kernel for them was the SIMT
// tiled path (tiled.cu). Measured (BENCHMARKS.md, session 27): 1.42-1.91x cuBLAS fp32 from 256
// rows on the LLaMA shapes, 80-90 effective TFLOP/s at 4096 rows; 0.50-0.98x at 17-64 rows where
// Nout = 4096 (few weight tiles; a step's shared-memory traffic bounds it there).
//
// The structure of wgmma.cu (Y^T = W^T X^T; two warpgroups of 64 weight rows each; the weight
// expanded one step ahead into dense shared-memory tiles while the tensor cores work on the
// current step; activations by cp.async into a ring of stages), on TF32 MMAs with fp32 accuracy
// by the 3xTF32 split of tf32.cuh (as vector.cu does with mma.sync): W x ~= W_small X_big +
// W_big X_small + W_big X_big in fp32 accumulators.
// A step is 32 K positions, one 128-byte swizzle row of fp32, so k8 TF32 MMAs address a tile as
// k16 16-bit ones do.
//  * The weight: each thread owns 16 positions of one row of the block's tile (row tid / 2, half
//    tid % 2); it builds them in registers from the stored entries that land there and writes
//    them split into two dense tiles (W_big, W_small). Any N:M with M a power of two up to 32
//    (groups never cross a step).
//  * The activations: once a step has landed, each thread rounds its own chunks to big in place
//    and writes small to a second tile.
// MMAs per step: 3 x 4 k8 per warpgroup. Calls with few tiles split K over a cluster
// (sm90::launch_split, reduce_split).
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

// Shared memory: a ring of kStages steps (the activation tile [kRows x 32] with the 128-byte
// swizzle, then the packed weight tile: values, then offset words), then two sets of operand
// tiles written per step (the dense W_big and W_small [128 x 32], X_small [kRows x 32]).
template <int kN, int kM, int kRows>
struct Tf32Layout {
  using F = Tf32Family<kN, kM>;
  static constexpr size_t kX = static_cast<size_t>(kRows) * 128;
  static constexpr size_t kW = static_cast<size_t>(kTileW) * 128;
  static constexpr size_t kStage = (kX + F::kTileBytes + 1023) / 1024 * 1024;  // swizzle atoms stay 1024-aligned
  static constexpr size_t kOperands = 2 * kW + kX;                           // W_big, W_small, X_small
  static constexpr int kStages = std::min<int>(6, static_cast<int>((226 * 1024 - 2 * kOperands) / kStage));
  static constexpr size_t kOperandsOffset = kStages * kStage;
  static constexpr size_t kBytes = kOperandsOffset + 2 * kOperands + 1024;  // + slack to align the ring
  static_assert(kStages >= 4, "the ring runs kStages - 2 steps ahead, at least 2");
  static_assert(kThreads * kRows / 2 * 4 <= kOperandsOffset + 2 * kOperands, "reduce_split's scratch fits");
};

// Byte offset of position `pos` (0..31) of row `r` in a [rows x 32] fp32 tile with the 128-byte
// swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)).
__device__ __forceinline__ uint32_t swizzled(int r, int pos) {
  return static_cast<uint32_t>(r * 128 + (((pos >> 2) ^ (r & 7)) << 4) + (pos & 3) * 4);
}

// Loads kCount consecutive floats from `src` (kCount * 4 bytes apart from 16-byte aligned rows)
// with the widest loads their alignment allows.
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

// Writes this thread's 16 positions of step t (row r of the block's tile, half h) into W_big and
// W_small, built in registers and stored as four 16-byte chunks per tile: with M <= 16 a half
// holds whole groups, the step's entries [h E/2, (h+1) E/2), and an entry can only land inside
// its own group (compile-time candidates); with M = 32 the step's one group spans both halves,
// so every entry is a candidate for each of the 16 positions. Positions no entry takes stay
// zero, as do positions past K (their stored values are zero by the format). Scattering single
// values into zeroed tiles instead made shared memory the bound: conflicting 4-byte accesses.
template <int kN, int kM>
__device__ __forceinline__ void expand_weight(const uint8_t* packed, int64_t t, int r, int h, uint8_t* w_big,
                                              uint8_t* w_small) {
  using F = Tf32Family<kN, kM>;
  constexpr bool kWhole = kM == 32;
  constexpr int kCount = kWhole ? F::kEntries : F::kEntries / 2;  // entries this thread reads
  constexpr int kWords = F::kIndexWords;
  float v[kCount];
  // Rows of values lie kValueBytes apart; this half's entries start kCount * 4 bytes in.
  constexpr int kFrom = F::kValueBytes | (kWhole ? 16 : kCount * 4);
  constexpr int kAlign = kFrom & -kFrom;  // the largest power of two dividing both
  load_floats<kCount, kAlign>(reinterpret_cast<const float*>(packed + r * F::kValueBytes) + (kWhole ? 0 : h * kCount), v);
  // The step's offset bits, from bit 0 of norm: then (M <= 16) this half's, from bit 0 of bits.
  const uint32_t* words = reinterpret_cast<const uint32_t*>(packed + F::kValues) + r * kWords;
  uint32_t raw[kWords], norm[kWords - 1], bits[kWords - 1];
#pragma unroll
  for (int i = 0; i < kWords; ++i) raw[i] = words[i];
  const int first = F::first_bit(t);
#pragma unroll
  for (int i = 0; i < kWords - 1; ++i) norm[i] = __funnelshift_r(raw[i], raw[i + 1], first);
  constexpr int kSkip = kWhole ? 0 : kCount * F::kBits;  // the bits of half 0's entries
#pragma unroll
  for (int i = 0; i < kWords - 1; ++i) {
    constexpr int kW = kSkip / 32;
    const uint32_t lo = i + kW < kWords - 1 ? norm[i + kW] : 0u, hi = i + kW + 1 < kWords - 1 ? norm[i + kW + 1] : 0u;
    bits[i] = h ? __funnelshift_r(lo, hi, kSkip % 32) : norm[i];
  }
  float d[16];
#pragma unroll
  for (int p = 0; p < 16; ++p) d[p] = 0.f;
#pragma unroll
  for (int e = 0; e < kCount; ++e) {
    const int bit = e * F::kBits, word = bit / 32, shift = bit % 32;
    uint32_t offset = bits[word] >> shift;
    if (shift + F::kBits > 32 && word + 1 < kWords - 1) offset |= bits[word + 1] << (32 - shift);
    offset &= (1u << F::kBits) - 1u;
    if constexpr (kWhole) {
      const int at = static_cast<int>(offset) - 16 * h;  // this half's position, if it is one
#pragma unroll
      for (int p = 0; p < 16; ++p) d[p] = at == p ? v[e] : d[p];
    } else {
      const int group = e / kN;
#pragma unroll
      for (int o = 0; o < kM; ++o) d[group * kM + o] = static_cast<int>(offset) == o ? v[e] : d[group * kM + o];
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint4 big, small;
    split_tf32(d[4 * c], big.x, small.x);
    split_tf32(d[4 * c + 1], big.y, small.y);
    split_tf32(d[4 * c + 2], big.z, small.z);
    split_tf32(d[4 * c + 3], big.w, small.w);
    const uint32_t at = swizzled(r, 16 * h + 4 * c);
    *reinterpret_cast<uint4*>(w_big + at) = big;
    *reinterpret_cast<uint4*>(w_small + at) = small;
  }
}

// Rounds this thread's chunks of a landed activation tile to big in place and writes small at
// the same places of x_small: the chunks it copied (sm90::ActivationLoader's assignment).
template <int kRows>
__device__ __forceinline__ void split_activations(uint8_t* x, uint8_t* x_small) {
  constexpr int kChunks = kRows * 8 / kThreads;
  const int r = threadIdx.x >> 3;
  const uint32_t dst = r * 128 + (((threadIdx.x & 7) ^ (r & 7)) << 4);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    uint4* big = reinterpret_cast<uint4*>(x + dst + j * 32 * 128);
    const float4 v = *reinterpret_cast<const float4*>(big);
    uint4 b, s;
    split_tf32(v.x, b.x, s.x);
    split_tf32(v.y, b.y, s.y);
    split_tf32(v.z, b.z, s.z);
    split_tf32(v.w, b.w, s.w);
    *big = b;
    *reinterpret_cast<uint4*>(x_small + dst + j * 32 * 128) = s;
  }
}

template <int kN, int kM, int kRows>
__global__ void __launch_bounds__(kThreads, 1) wgmma_tf32_kernel(PathParams<float> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Tf32Layout<kN, kM, kRows>;
  constexpr int S = L::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms: 1024-aligned
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kTileW, r0 = static_cast<int64_t>(blockIdx.y) * kRows;
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
  // Step i's operands: its activation tile split in place and into X_small, its weight expanded.
  auto prepare = [&](int i) {
    uint8_t* ops = operands(i);
    split_activations<kRows>(stage(i), ops + 2 * L::kW);
    expand_weight<kN, kM>(stage(i) + L::kX, begin + i, threadIdx.x >> 1, threadIdx.x & 1, ops, ops + L::kW);
  };

  float acc[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
  sm90::fence_operands(acc);

#pragma unroll
  for (int i = 0; i < S - 2; ++i) {
    if (i < steps) load(i);
    sm90::cp_async_commit();
  }
  sm90::cp_async_wait<S - 3>();  // step 0 has landed (this thread's copies) ...
  __syncthreads();               // ... everyone's
  if (steps > 0) prepare(0);

  for (int i = 0; i < steps; ++i) {
    // Steps i and i + 1 have landed and step i's operands are written; step i - 2's MMAs retired
    // in the previous iteration, so its stage can be refilled.
    sm90::cp_async_wait<S - 4>();
    sm90::fence_async_proxy();
    __syncthreads();
    if (i + S - 2 < steps) load(i + S - 2);
    sm90::cp_async_commit();

    const uint32_t x_big = sm90::smem_addr(stage(i)), ops = sm90::smem_addr(operands(i));
    const uint32_t w_big = ops + wg * 64 * 128, w_small = w_big + static_cast<uint32_t>(L::kW);
    const uint32_t x_small = ops + static_cast<uint32_t>(2 * L::kW);
    sm90::fence_operands(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kStep / 8; ++k) {  // small terms first
      sm90::wgmma_tf32<kRows>(acc, sm90::sw128_desc(w_small + k * 32), sm90::sw128_desc(x_big + k * 32));
      sm90::wgmma_tf32<kRows>(acc, sm90::sw128_desc(w_big + k * 32), sm90::sw128_desc(x_small + k * 32));
      sm90::wgmma_tf32<kRows>(acc, sm90::sw128_desc(w_big + k * 32), sm90::sw128_desc(x_big + k * 32));
    }
    sm90::wgmma_commit();
    sm90::fence_operands(acc);
    sm90::wgmma_wait<1>();  // step i - 1's MMAs have retired: its operand set is free for step i + 1
    if (i + 1 < steps) prepare(i + 1);
  }
  sm90::wgmma_wait<0>();
  sm90::fence_operands(acc);
  if (sm90::reduce_split(acc, smem))
    sm90::store_tile<float, kRows>(p, acc, w0, r0, wg * 64 + (warp & 3) * 16 + (lane >> 2), lane & 3);
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

// Step cost of each width relative to a 64-row step, and splits for any grid: measured in session
// 27 (every width x split 1, 2, 4 forced at 17-512 rows on 4096 x 4096, 11008 x 4096 and
// 4096 x 14336, 2:4 and 2:8; BENCHMARKS.md), a 128-row step costs about 1.4 and a 32-row one 0.85,
// and at 512 rows on 4096 x 14336 a 2-way split of 128-row tiles ran 1.08-1.11x unsplit ones
// (3.4 waves of them).
constexpr sm90::TileCost kTf32Tiles[] = {{128, 1.4}, {64, 1.0}, {32, 0.85}};

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
      return sm90::launch_split<128, 64, 32>(p, steps, kTf32Tiles, true, [&](auto rows, int splits) {
        using L = Tf32Layout<kN(), kM(), rows()>;
        return sm90::launch_tiles<wgmma_tf32_kernel<kN(), kM(), rows()>, rows(), L::kBytes>(p, stream, splits, false);
      });
    }
  });
}

}  // namespace nmcli
