// Decode path: 1..16 activation rows (autoregressive generation, small batches). The product is
// memory-bound on the packed weight, so everything serves one goal: stream values and offsets
// at full HBM bandwidth.
//  * A warp owns one weight row (= output column). Per step each lane loads 4 consecutive
//    16-byte vectors of stored entries, lane-interleaved so every load instruction of the warp
//    is one contiguous 512-byte run, plus the offset bits of those vectors. All loads of a step
//    are issued before any is used (4 or 8 independent 16-byte loads per lane).
//  * Blocks of 16 warps are held to 64 registers per thread so two fit per SM (32 warps): on
//    LLaMA shapes most rows are one or two steps long, so bytes in flight and latency hiding
//    come from many resident warps, not from deep per-warp pipelines. (Measured with Nsight
//    Compute: two rows per warp at 113 registers allowed 16 warps per SM, 3.4 waves, and
//    reached 1.0 TB/s.)
//  * Common N:M families are compiled with N, M and B as constants (group index by shift,
//    offset extraction by constant shifts); any other pattern takes the runtime-N:M variant.
//  * Activations are staged once per block in shared memory, laid out [k][R] so one load
//    gathers all R rows of a position: as fp32 up to 4 rows, and as the 16-bit input type from
//    8 rows on, so a position stays 16-32 bytes and shared-memory bandwidth keeps up. A skew
//    (one slot every 32 and every 1024 positions) spreads lanes whose vectors start 16-64
//    positions apart over different banks.
// Instantiated per dtype in decode_{f32,f16,bf16}.cu to keep compile units small.
#pragma once
#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "kernels.cuh"

namespace nmcli {
namespace decode {

// Block shape; NMCLI_DECODE_WARPS / NMCLI_DECODE_MIN_BLOCKS override it for tuning runs
// (warps x min blocks = 32 resident warps per SM, i.e. at most 64 registers per thread).
#ifndef NMCLI_DECODE_WARPS
#define NMCLI_DECODE_WARPS 16
#endif
#ifndef NMCLI_DECODE_MIN_BLOCKS
#define NMCLI_DECODE_MIN_BLOCKS 2
#endif
constexpr int kWarps = NMCLI_DECODE_WARPS;
constexpr int kThreads = kWarps * 32;
constexpr int kMinBlocksPerSM = NMCLI_DECODE_MIN_BLOCKS;
constexpr int kRowsPerWarp = 1;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kVectorsPerLane = 4;         // 16-byte vectors per lane per step (32 fp16 / 16 fp32 entries)
constexpr int kStageBytes = 64 * 1024;     // shared-memory budget for staged activations

// Staged element type for R padded rows of T.
template <typename T, int R>
using StageT = std::conditional_t<(sizeof(T) == 2 && R >= 8), T, float>;

__host__ __device__ __forceinline__ int skew(int pos) { return pos + (pos >> 5) + (pos >> 10); }

// The R staged values of one position (stride R elements of S), as fp32.
template <typename S, int R>
__device__ __forceinline__ void load_position(const S* src, float (&x)[R]) {
  constexpr int kWords = R * static_cast<int>(sizeof(S)) / 4;
  uint32_t w[kWords];
  if constexpr (kWords >= 4) {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(src)[i];
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else if constexpr (kWords == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) x[r] = packed_entry<S>(w, r);
}

// Stages positions [p0, p0 + staged) of every row as [skew(pos)][R]. X reads as zero past K and
// past the real rows (the format's padding entries point there with zero values, and zero times
// garbage can be NaN). 16-byte loads when K is a multiple of the vector and X is aligned.
template <typename T, typename S, int R>
__device__ __forceinline__ void stage_activations(const DecodeParamsT<T>& p, S* xs, int64_t p0) {
  constexpr int VEC = 16 / sizeof(T);
  const int staged = p.staged_positions;  // a multiple of VEC, as is p0
  if (p.k % VEC == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0) {
    const int vecs = staged / VEC;
#pragma unroll 2
    for (int idx = threadIdx.x; idx < vecs * R; idx += kThreads) {
      const int r = idx / vecs, pos = (idx - r * vecs) * VEC;
      const int64_t k = p0 + pos;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (k < p.k && r < p.rows) v = __ldg(reinterpret_cast<const uint4*>(p.x + r * p.k + k));
#pragma unroll
      for (int i = 0; i < VEC; ++i) xs[skew(pos + i) * R + r] = from_f32<S>(vec_entry<T>(v, i));
    }
  } else {
#pragma unroll 4
    for (int idx = threadIdx.x; idx < staged * R; idx += kThreads) {
      const int r = idx / staged, pos = idx - r * staged;
      const int64_t k = p0 + pos;
      xs[skew(pos) * R + r] = from_f32<S>(k < p.k && r < p.rows ? to_f32(p.x[r * p.k + k]) : 0.f);
    }
  }
}

// kN == 0: the pattern is read from the parameters (any valid N:M).
template <typename T, int R, int kN, int kM>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) decode_kernel(DecodeParamsT<T> p) {
  using S = StageT<T, R>;
  constexpr int VEC = 16 / sizeof(T);             // entries per 16-byte vector
  constexpr int U = kVectorsPerLane;              // vectors per lane per row per step
  constexpr bool kStatic = kN > 0;
  constexpr bool kGroupsWholeInVector = kStatic && VEC % (kStatic ? kN : 1) == 0;  // g = e/N splits per vector
  const int n = kStatic ? kN : p.n;
  const int m = kStatic ? kM : p.m;
  const int bits = kStatic ? index_bits(kM) : p.bits;
  const int vec_bits = VEC * bits;                // offset bits of one vector (<= 40, byte-aligned for 16-bit T)
  const uint32_t mask = (1u << bits) - 1u;

  extern __shared__ __align__(16) unsigned char smem[];
  S* xs = reinterpret_cast<S*>(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp * kRowsPerWarp;
  const int64_t nvec = (p.groups * n + VEC - 1) / VEC;

  float acc[kRowsPerWarp][R];
#pragma unroll
  for (int q = 0; q < kRowsPerWarp; ++q)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[q][r] = 0.f;

  // Offset bits of one vector: 32-bit when the compile-time pattern fits (every static family).
  using Off = std::conditional_t<(kStatic && VEC * index_bits(kStatic ? kM : 2) <= 32), uint32_t, uint64_t>;
  uint4 vals[kRowsPerWarp][U];
  Off offs[kRowsPerWarp][U];
  // Issues the loads of the step starting at vector vb (zeros outside [.., v_end) and Nout).
  auto load_step = [&](int64_t vb, int64_t v_end) {
#pragma unroll
    for (int q = 0; q < kRowsPerWarp; ++q) {
      const int64_t row = row0 + q;
      const T* vrow = p.values + row * p.row_len;
      const uint32_t* irow = p.indices + row * p.index_words;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = vb + lane + 32 * u;
        vals[q][u] = make_uint4(0, 0, 0, 0);
        offs[q][u] = 0;
        if (v < v_end && row < p.nout) {
          vals[q][u] = load_stream16(vrow + v * VEC);
          const int64_t bit = v * vec_bits;
          const int shift = static_cast<int>(bit & 31);
          const uint32_t* wp = irow + (bit >> 5);
          uint64_t window = __ldg(wp);  // neighbouring lanes share index words: let L1 keep them
          if (shift + vec_bits > 32) window |= static_cast<uint64_t>(__ldg(wp + 1)) << 32;
          offs[q][u] = static_cast<Off>(window >> shift);
        }
      }
    }
  };

  for (int64_t g0 = 0; g0 < p.groups; g0 += p.chunk_groups) {
    const int64_t p0 = g0 * m;
    const int64_t e_begin = g0 * n;  // first stored entry of the chunk; a multiple of VEC
    const int64_t v_begin = e_begin / VEC;
    const int64_t chunk_end = (g0 + p.chunk_groups) * n / VEC;
    const int64_t v_end = chunk_end < nvec ? chunk_end : nvec;
    load_step(v_begin, v_end);  // the first weights are in flight while the activations are staged
    __syncthreads();
    stage_activations<T, S, R>(p, xs, p0);
    __syncthreads();

    for (int64_t vb = v_begin; vb < v_end; vb += 32 * U) {
      if (vb != v_begin) load_step(vb, v_end);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = vb + lane + 32 * u;
        if (v >= v_end) continue;
        const int e0 = static_cast<int>(v * VEC - e_begin);  // entry index within the chunk
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          int g;  // group within the chunk
          if constexpr (kGroupsWholeInVector) g = e0 / kN + i / kN;
          else g = (e0 + i) / n;
#pragma unroll
          for (int q = 0; q < kRowsPerWarp; ++q) {
            const int pos = g * m + static_cast<int>((offs[q][u] >> (i * bits)) & mask);
            float x[R];
            load_position<S, R>(xs + skew(pos) * R, x);
            const float w = vec_entry<T>(vals[q][u], i);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[q][r] = fmaf(w, x[r], acc[q][r]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int q = 0; q < kRowsPerWarp; ++q) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = acc[q][r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      acc[q][r] = s;
    }
    const int64_t row = row0 + q;
    if (lane == 0 && row < p.nout) {
      const float b = p.bias ? to_f32(p.bias[row]) : 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r < p.rows) p.y[r * p.nout + row] = from_f32<T>(p.alpha * acc[q][r] + b);
    }
  }
}

template <typename T, int R, int kN, int kM>
cudaError_t launch(DecodeParamsT<T> p, cudaStream_t stream) {
  using S = StageT<T, R>;
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kPositionBytes = R * static_cast<int>(sizeof(S));
  // Chunk = whole vectors (chunk_groups a multiple of VEC, so no vector straddles two chunks),
  // with VEC groups of slack for the zero padding entries of the row's last vector. One chunk
  // when the whole K fits: less shared memory per block, more blocks per SM.
  const int64_t budget_positions = static_cast<int64_t>(kStageBytes / kPositionBytes) * 32 / 34;
  int64_t chunk = std::max<int64_t>(VEC, (budget_positions / p.m - VEC) / VEC * VEC);
  chunk = std::min(chunk, (p.groups + VEC - 1) / VEC * VEC);
  p.chunk_groups = chunk;
  p.staged_positions = static_cast<int>((chunk + VEC) * p.m);
  const size_t smem = static_cast<size_t>(skew(p.staged_positions - 1) + 1) * kPositionBytes;

  static bool configured[64] = {};  // raising the dynamic shared-memory cap: once per device
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device < 64 && !configured[device]) {
    if (cudaError_t e = cudaFuncSetAttribute(decode_kernel<T, R, kN, kM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             kStageBytes + 4096);
        e != cudaSuccess)
      return e;
    configured[device] = true;
  }
  const unsigned blocks = static_cast<unsigned>((p.nout + kRowsPerBlock - 1) / kRowsPerBlock);
  decode_kernel<T, R, kN, kM><<<blocks, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// The families compiled with constant N:M (the ones users prune to); others run generic.
template <typename T, int R>
cudaError_t launch_pattern(const DecodeParamsT<T>& p, cudaStream_t stream) {
  switch (p.n * 64 + p.m) {
    case 1 * 64 + 4: return launch<T, R, 1, 4>(p, stream);
    case 2 * 64 + 4: return launch<T, R, 2, 4>(p, stream);
    case 1 * 64 + 8: return launch<T, R, 1, 8>(p, stream);
    case 2 * 64 + 8: return launch<T, R, 2, 8>(p, stream);
    case 4 * 64 + 8: return launch<T, R, 4, 8>(p, stream);
    case 4 * 64 + 16: return launch<T, R, 4, 16>(p, stream);
    default: return launch<T, R, 0, 0>(p, stream);
  }
}

template <typename T>
cudaError_t run(DecodeParamsT<T> p, cudaStream_t stream) {
  if (p.rows <= 1) return launch_pattern<T, 1>(p, stream);
  if (p.rows <= 2) return launch_pattern<T, 2>(p, stream);
  if (p.rows <= 4) return launch_pattern<T, 4>(p, stream);
  if (p.rows <= 8) return launch_pattern<T, 8>(p, stream);
  if (p.rows <= kDecodeMaxRows) return launch_pattern<T, 16>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace decode

#define NMCLI_INSTANTIATE_DECODE(T) \
  template <> cudaError_t run_decode<T>(DecodeParamsT<T> p, cudaStream_t stream) { return decode::run<T>(p, stream); }

}  // namespace nmcli
