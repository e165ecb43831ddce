// Warpgroup tensor-core path (Hopper, sm_90a) for fp16/bf16: prompt processing and large batches
// for the families the sparse tensor cores cannot take (4:8, 4:16, 8:16, 2:16; dispatch.cu).
//
// Y^T = W^T X^T, computed as D[weight rows x activation rows] with wgmma.mma_async, both operands
// K-major [rows x 64] tiles in shared memory with the 128-byte swizzle:
//  * A = the weight tile, rebuilt dense for each step by scattering the stored entries: the tile is
//    zeroed, then each stored value is written to its dense position (one shift, one LOP3 and one
//    16-bit store per entry);
//  * B = the activations, copied with cp.async, zero-filled past the last row and past K;
//  * fp32 accumulators in registers; alpha and bias applied on the way out.
// A block has two warpgroups (128 weight rows, 64 each) and one activation tile of 64, 128 or
// 256 rows. The packed weight tile (values and offset words) and the activation tile of each
// step land in a ring of shared-memory stages, kStages - 2 steps ahead of the MMAs; a stage is
// refilled only after the MMAs that read it have retired. The dense weight tiles rotate through
// three buffers: step i's MMAs read one, step i + 1 is scattered into the next (zeroed during step
// i - 1, so the block barrier at the top of step i orders the zeros before the values), and the
// one step i - 1's MMAs read is zeroed. Calls with few tiles split K over a cluster
// (sm90::launch_split, reduce_split).
// Until session 29 each thread gathered its A fragments in registers: for every pair of dense
// positions it looked up which stored entries land there (a selector table for N <= 2, a popcount
// over the group's offset mask for N = 4, comparisons for N = 8), ~40 instructions a pair
// (ncu at 4096^3 4:16: 169M warp instructions, issue slots busy 43% with 2 warps a scheduler).
// The scatter touches each stored entry once instead of each dense pair: 110M instructions, and
// 1.16-1.60x on 4:16 and 4:8 on the LLaMA shapes (BENCHMARKS.md, session 29). It still runs
// 0.40-0.92x cuBLAS fp16 there, with the tensor pipe active 41% of the time at 4096^3. The
// activation tile by cp.async is the likely limit left: issuing the copies later in the step ran
// 0.87-0.89x, 128-row tiles (more bytes per MMA) 0.61-0.62x, and by our count the sparse kernel's
// tensor copies from a producer warp (wgmma_sp.cu) move about 1.4x the bytes per second into each
// SM (2:8 at 4096^3).
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

template <int kN, int kM, int kRows>
struct Layout {
  using F = sm90::Family<kN, kM>;
  static constexpr size_t kX = static_cast<size_t>(kRows) * 128;  // activation tile per stage
  static constexpr size_t kStage = (kX + F::kTileBytes + 1023) / 1024 * 1024;  // + the packed tile
  static constexpr size_t kA = static_cast<size_t>(kTileW) * 128;  // a dense weight tile
  static constexpr int kBuffers = 3;
  // As many stages as fit, up to 8: the ring runs kStages - 2 steps ahead of the MMAs.
  static constexpr int kStages = std::min<int>(8, static_cast<int>((225 * 1024 - kBuffers * kA) / kStage));
  static constexpr size_t kAOffset = kStages * kStage;  // then the dense weight tiles
  static_assert(kStages >= 4, "the ring runs kStages - 2 steps ahead, at least 2");
  static_assert(kThreads * kRows / 2 * 4 <= kAOffset, "reduce_split's scratch fits in the ring");
  static constexpr size_t kBytes = kAOffset + kBuffers * kA + 1024;  // + slack to align
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

__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0u) : "memory");
}
// The low 16 bits of `value`.
__device__ __forceinline__ void st_shared_u16(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(static_cast<uint16_t>(value)) : "memory");
}

// A thread's share of rebuilding its warpgroup's 64 rows of a step's dense weight tile: pairs of
// consecutive stored entries (one 32-bit word of values), the same pair of rows first_row,
// first_row + kRowStep, ... (a warp's lanes cover whole rows, so a load of values is one
// contiguous run and the stores of a warp land in few rows).
template <int kN, int kM>
struct Scatter {
  using F = sm90::Family<kN, kM>;
  static constexpr int kPairs = F::kEntries / 2;  // pairs per row per step
  static constexpr int kRowStep = 128 / kPairs;   // rows between this thread's pairs
  static constexpr int kCount = 64 / kRowStep;    // pairs per thread per step
  static_assert(kRowStep % 8 == 0, "a thread's rows share their swizzle phase");

  int first_row;       // in the block's tile
  int pair;            // in the row
  uint32_t key[2];     // per entry of the pair: first_row's byte offset in a dense tile, XOR the
                       // swizzled offset of its group's first position

  __device__ __forceinline__ Scatter() {
    const int tid = threadIdx.x & 127;
    first_row = (threadIdx.x >> 7) * 64 + tid / kPairs;
    pair = tid % kPairs;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int group = (2 * pair + e) / kN;
      // Byte of dense position p in row r: r * 128 + (2p ^ (r % 8) * 16) (128-byte swizzle), and
      // 2p = 2 * group * M | 2 * offset, the two parts in disjoint bits.
      const uint32_t swizzled = static_cast<uint32_t>((first_row & 7) * 16) ^ (2u * group * kM);
      key[e] = static_cast<uint32_t>(first_row * 128) | swizzled;
    }
  }

  // Zeroes this thread's 64 bytes of its warpgroup's half of the dense tile at `tile` (consecutive
  // lanes, consecutive 16-byte chunks: no bank conflicts).
  __device__ __forceinline__ void zero(uint32_t tile) const {
    const uint32_t base = tile + (threadIdx.x >> 7) * 64 * 128 + (threadIdx.x & 127) * 16;
#pragma unroll
    for (int j = 0; j < 4; ++j) st_shared_zero16(base + j * 128 * 16);
  }

  // Writes this thread's stored entries of step t (the step's packed tile at `packed`) to their
  // dense positions in the zeroed tile at `tile`. A group's offsets are distinct (docs/FORMAT.md),
  // so its entries never meet; padding entries (value 0, offset 0) meet only each other.
  __device__ __forceinline__ void write(const uint8_t* packed, int64_t t, uint32_t tile) const {
    const int bit = F::first_bit(t) + pair * 2 * F::kBits;
    const int word = bit >> 5, shift = bit & 31, next = min(word + 1, F::kIndexWords - 1);
    const uint32_t key0 = tile + key[0], key1 = tile + key[1];
    constexpr uint32_t kMask = 2 * kM - 2;
#pragma unroll
    for (int j = 0; j < kCount; ++j) {
      const int r = first_row + j * kRowStep;
      const uint32_t* words = reinterpret_cast<const uint32_t*>(packed + F::kValues) + r * F::kIndexWords;
      const uint32_t offsets = __funnelshift_r(words[word], words[next], shift);  // the pair's from bit 0
      const uint32_t values = *reinterpret_cast<const uint32_t*>(packed + r * F::kValueBytes + pair * 4);
      const uint32_t rows = j * kRowStep * 128;  // the row's bytes past first_row's
      st_shared_u16((key0 ^ ((offsets << 1) & kMask)) + rows, values);
      st_shared_u16((key1 ^ ((offsets >> (F::kBits - 1)) & kMask)) + rows, values >> 16);
    }
  }
};

template <typename T, int kN, int kM, int kRows>
__global__ void __launch_bounds__(kThreads, 1) wgmma_kernel(PathParams<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Layout<kN, kM, kRows>;
  constexpr int S = L::kStages;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms: 1024-aligned
  const int lane = threadIdx.x & 31, q = lane & 3, wg = threadIdx.x >> 7;
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kTileW, r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  int begin, end;  // this block's steps
  sm90::split_steps<1>(p.groups * kM, begin, end);
  const int steps = end - begin;
  // This thread's accumulator rows: g and g + 8 of its warp's 16.
  const int row = wg * 64 + ((threadIdx.x >> 5) & 3) * 16 + (lane >> 2);
  auto stage_of = [&](int i) { return smem + (i % S) * L::kStage; };  // step begin + i
  const uint32_t tiles = sm90::smem_addr(smem + L::kAOffset);
  auto tile_of = [&](int i) { return tiles + static_cast<uint32_t>((i % L::kBuffers) * L::kA); };

  const StepLoader<T, kN, kM, kRows> loader(p, w0, r0);
  const Scatter<kN, kM> scatter;

  float acc[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
  sm90::fence_operands(acc);
  scatter.zero(tile_of(0));
  scatter.zero(tile_of(1));

#pragma unroll
  for (int i = 0; i < S - 2; ++i) {
    if (i < steps) loader.load(p, stage_of(i), begin + i);
    sm90::cp_async_commit();
  }
  sm90::cp_async_wait<S - 3>();  // step 0 has landed (this thread's copies) ...
  __syncthreads();               // ... everyone's, and the first two dense tiles are zero
  if (steps > 0) scatter.write(stage_of(0) + L::kX, begin, tile_of(0));

  for (int i = 0; i < steps; ++i) {
    // Steps i (for the MMAs) and i + 1 (for the scatter) have landed; step i - 2's MMAs retired in
    // the previous iteration, so its stage can be refilled; step i's dense tile is written.
    sm90::cp_async_wait<S - 4>();
    sm90::fence_async_proxy();
    __syncthreads();
    if (i + S - 2 < steps) loader.load(p, stage_of(i + S - 2), begin + i + S - 2);
    sm90::cp_async_commit();

    const uint32_t xs = sm90::smem_addr(stage_of(i)), as = tile_of(i) + wg * 64 * 128;
    sm90::fence_operands(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int s = 0; s < kBK / 16; ++s)
      sm90::wgmma_ss<kRows, kBf16>(acc, sm90::sw128_desc(as + s * 32), sm90::sw128_desc(xs + s * 32));
    sm90::wgmma_commit();
    sm90::fence_operands(acc);
    sm90::wgmma_wait<1>();  // step i - 1's MMAs have retired: their dense tile is free to zero
    if (i + 2 < steps) scatter.zero(tile_of(i + 2));
    if (i + 1 < steps) scatter.write(stage_of(i + 1) + L::kX, begin + i + 1, tile_of(i + 1));
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
