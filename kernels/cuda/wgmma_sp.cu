// Sparse warpgroup path (Hopper, sm_90a) for 2:4 weights in fp16/bf16: the sparse tensor cores
// (wgmma.mma_async.sp) do half the multiplies of a dense tile, and the weight is never expanded.
//
// Y^T = W^T X^T as in wgmma.cu, but A = the weight stays packed: a 2:4 row of the packed format
// (docs/FORMAT.md) is exactly the instruction's A operand, 2 stored values per group of 4 in
// order, and one 32-bit word of its offsets is exactly the metadata of one row for 32 K
// positions (two 2-bit offsets per group, the first in the low bits). So a step copies the
// packed values straight into a 64-byte-swizzled shared-memory tile and the offset words next to
// them; each thread then picks the halves of two offset words that the instruction wants from
// it (lanes 4g and 4g + 1 of a warp, rows g and g + 8; wgmma_ops.cuh) -- no expansion at all.
// The activation tile, block shape and epilogue are the ones of wgmma.cu (wgmma_tile.cuh); the
// steps run in groups so that metadata registers are only written with no MMA in flight (see
// the kernel). Measured (BENCHMARKS.md, session 9): 1.68-1.85x the expanding kernel at 4096
// rows on the LLaMA shapes, 0.71-0.82x cuBLAS dense there. Writing a step's metadata while the
// previous step's MMAs ran gave wrong results with the 256-row tile, two alternating sets made
// ptxas serialize the MMAs, and draining after every step cost 8-13% against the groups.
// Padding groups past the stored length carry offsets (0, 0), a value the hardware leaves
// undefined; their values and activations are zero, so any valid pair gives the same result,
// and valid_metadata() rewrites them to (0, 1).
#include <algorithm>
#include <type_traits>

#include "wgmma_tile.cuh"

namespace nmcli {
namespace {

using sm90::kBK;
using sm90::kThreads;
using sm90::kTileW;

constexpr int kStored = kBK / 2;        // stored values per weight row per step
constexpr int kMetaWords = kBK / 32;    // offset words per weight row per step (one per MMA)

template <int kRows>
struct SpLayout {
  static constexpr size_t kX = static_cast<size_t>(kRows) * 128;    // activation tile, 128-byte swizzle
  static constexpr size_t kA = static_cast<size_t>(kTileW) * kStored * 2;  // stored values, 64-byte swizzle
  static constexpr size_t kMeta = static_cast<size_t>(kTileW) * kMetaWords * 4;
  static constexpr size_t kStage = (kX + kA + kMeta + 1023) / 1024 * 1024;
  // Steps per group (see the kernel): half the ring, as many as fit in 216 KB, at most 4.
  static constexpr int kGroup = std::min<int>(4, static_cast<int>(216 * 1024 / kStage) / 2);
  static constexpr int kStages = 2 * kGroup;
  static constexpr size_t kBytes = kStages * kStage + 1024;  // + slack to align the ring
  static_assert(kGroup >= 2, "a group of steps in the MMAs while the next group's copies fly");
};

// Copies a step's activation tile, stored-value tile and offset words into its stage.
template <typename T, int kRows>
struct SpStepLoader {
  using L = SpLayout<kRows>;
  static constexpr int kChunksPerRow = kStored * 2 / 16;                 // 16-byte chunks of values
  static constexpr int kV = kTileW * kChunksPerRow / kThreads;
  static_assert(kTileW * kChunksPerRow % kThreads == 0 && kTileW <= kThreads, "whole chunks per thread");

  sm90::ActivationLoader<T, kRows> x;
  const T* v[kV];
  uint32_t v_dst[kV];
  bool v_ok[kV];
  const uint32_t* meta;    // the offset words of this thread's row (threads < kTileW)
  uint32_t meta_dst;
  bool meta_ok;

  __device__ __forceinline__ SpStepLoader(const PathParams<T>& p, int64_t w0, int64_t r0) : x(p, r0) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const int i = tid + j * kThreads, row = i / kChunksPerRow, c = i % kChunksPerRow;
      v_ok[j] = w0 + row < p.nout;
      v[j] = p.values + (v_ok[j] ? (w0 + row) * p.row_len + c * 8 : 0);
      v_dst[j] = static_cast<uint32_t>(L::kX) + row * kStored * 2 + ((c ^ ((row >> 1) & 3)) << 4);
    }
    meta_ok = tid < kTileW && w0 + tid < p.nout;
    meta = p.indices + (meta_ok ? (w0 + tid) * p.index_words : 0);
    meta_dst = static_cast<uint32_t>(L::kX + L::kA) + tid * kMetaWords * 4;
  }

  // Step t's entries [t * kStored, (t + 1) * kStored) lie either inside every row or, for the
  // steps that round the last group up, past its end (the row length is a multiple of 32):
  // those steps are zeros.
  __device__ __forceinline__ void load(const PathParams<T>& p, uint8_t* stage, int64_t t) const {
    const uint32_t base = sm90::smem_addr(stage);
    const bool in_row = t * kStored < p.row_len;
    x.load(p, base, t);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const bool ok = v_ok[j] && in_row;
      sm90::cp_async16(base + v_dst[j], ok ? v[j] + t * kStored : p.values, ok);
    }
    const bool ok = meta_ok && in_row;
    if (threadIdx.x < kTileW) sm90::cp_async8(base + meta_dst, ok ? meta + t * kMetaWords : p.indices, ok);
  }
};

// Groups whose offsets read (0, 0) -- padding past the stored entries, rows past the end --
// become (0, 1); every group of the format proper has a second offset >= 1 and stays as it is.
__device__ __forceinline__ uint32_t valid_metadata(uint32_t meta) {
  uint32_t any = meta | (meta >> 1);
  any |= any >> 2;                                   // bit 0 of each nibble: the nibble is nonzero
  return meta | ((~any & 0x11111111u) << 2);
}

template <typename T, int kRows>
__global__ void __launch_bounds__(kThreads, 1) wgmma_sp_kernel(PathParams<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = SpLayout<kRows>;
  constexpr int S = L::kStages;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms: 1024-aligned
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3, wg = warp >> 2;
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kTileW, r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  constexpr int G = L::kGroup;
  // Steps of kBK positions, rounded up to whole groups (the extra steps load zeros).
  const int64_t steps = ((p.groups * 4 + kBK - 1) / kBK + G - 1) / G * G;
  // This thread's rows: g and g + 8 of its warp's 16, in the block's tile.
  const int row = wg * 64 + (warp & 3) * 16 + (lane >> 2);
  // Lane 4g supplies the offsets of K positions 0..15 of an MMA (the low halves of the two rows'
  // words), lane 4g + 1 those of 16..31 (the high halves); lanes 4g + 2, 4g + 3 are not read.
  const uint32_t halves = (lane & 1) ? 0x7632u : 0x5410u;
  auto stage_of = [&](int64_t t) { return smem + (t % S) * L::kStage; };

  const SpStepLoader<T, kRows> loader(p, w0, r0);

  float acc[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
  sm90::fence_operands(acc);

  // Steps run in groups of G = S / 2. wgmma reads its metadata register operand asynchronously
  // and ptxas serializes the MMAs (C7513) when a metadata register is written while any MMA is
  // in flight, so a group starts with no MMA in flight: it reads the metadata of all its G
  // steps, then issues their MMAs back to back and waits for them at the end. Its stages were
  // copied during the previous group, which left the stages of that group free for the next one.
#pragma unroll
  for (int t = 0; t < S - G; ++t)
    if (t < steps) loader.load(p, stage_of(t), t);
  sm90::cp_async_commit();
  for (int64_t t = 0; t < steps; t += G) {
    sm90::cp_async_wait<0>();
    sm90::fence_async_proxy();
    __syncthreads();  // every thread's copies of steps t .. t + G - 1 landed; no MMA reads steps < t
#pragma unroll
    for (int g = 0; g < G; ++g)
      if (t + S - G + g < steps) loader.load(p, stage_of(t + S - G + g), t + S - G + g);
    sm90::cp_async_commit();

    uint32_t meta[G][kMetaWords];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const uint32_t* words = reinterpret_cast<const uint32_t*>(stage_of(t + g) + L::kX + L::kA);
#pragma unroll
      for (int s = 0; s < kMetaWords; ++s)
        meta[g][s] = valid_metadata(__byte_perm(words[row * kMetaWords + s], words[(row + 8) * kMetaWords + s], halves));
    }
    sm90::fence_operands(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const uint32_t xs = sm90::smem_addr(stage_of(t + g));
      const uint32_t as = xs + static_cast<uint32_t>(L::kX) + wg * 64 * kStored * 2;
#pragma unroll
      for (int s = 0; s < kMetaWords; ++s)
        sm90::wgmma_sp<kRows, kBf16>(acc, sm90::sw64_desc(as + s * 32), sm90::sw128_desc(xs + s * 64), meta[g][s]);
    }
    sm90::wgmma_commit();
    sm90::fence_operands(acc);
    sm90::wgmma_wait<0>();
  }
  sm90::store_tile<T, kRows>(p, acc, w0, r0, row, q);
#else
  __trap();  // built for sm_90a only; the dispatch never launches it elsewhere
#endif
}

}  // namespace

bool wgmma_sp_family(int n, int m) { return n == 2 && m == 4; }

template <typename T>
cudaError_t run_wgmma_sp(PathParams<T> p, cudaStream_t stream) {
  if constexpr (sizeof(T) != 2) {
    return cudaErrorInvalidValue;
  } else {
    if (!wgmma_sp_family(p.n, p.m) || !sm90::runs_here(p)) return cudaErrorInvalidValue;
    return sm90::launch_widest(p, [&](auto rows) {
      return sm90::launch_tiles<wgmma_sp_kernel<T, rows()>, rows(), SpLayout<rows()>::kBytes>(p, stream);
    });
  }
}

template cudaError_t run_wgmma_sp<float>(PathParams<float>, cudaStream_t);
template cudaError_t run_wgmma_sp<__half>(PathParams<__half>, cudaStream_t);
template cudaError_t run_wgmma_sp<__nv_bfloat16>(PathParams<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
