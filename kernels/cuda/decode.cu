// Decode path: 1..8 activation rows (autoregressive generation). Memory-bound on the packed
// weight, so the design goal is to stream values and offsets at full bandwidth:
//  * a warp walks one weight row (= one output column) along K with 16-byte coalesced loads of
//    values; the matching offset bits (VEC*B <= 40, starting on a multiple of 8 bits) always
//    lie in two consecutive 32-bit words (docs/FORMAT.md);
//  * each warp keeps two rows in flight, each lane two vectors per row, so enough bytes are
//    outstanding per SM to cover HBM latency;
//  * the activations are staged once per block in shared memory as fp32, laid out [k][R] so
//    one gather fetches all R rows, with one padding slot every 32 positions so that lanes
//    walking rows 16-64 positions apart hit different banks.
#include <algorithm>

#include "common.cuh"
#include "kernels.cuh"

namespace nmcli {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 2;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kSmemFloats = 16384 + 16384 / 32 + 64;  // ~66 KB of staged activations

__host__ __device__ __forceinline__ int skew(int k) { return k + (k >> 5); }

template <typename T, int R, bool kPow2N>
__global__ void __launch_bounds__(kWarps * 32) decode_kernel(DecodeParamsT<T> p) {
  constexpr int VEC = 16 / sizeof(T);
  extern __shared__ float xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp * kRowsPerWarp;
  const uint32_t mask = (1u << p.bits) - 1u;

  float acc[kRowsPerWarp][R];
#pragma unroll
  for (int q = 0; q < kRowsPerWarp; ++q)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[q][r] = 0.f;

  const int64_t stored = p.groups * p.n;
  for (int64_t g0 = 0; g0 < p.groups; g0 += p.chunk_groups) {
    const int64_t p0 = g0 * p.m;  // first staged position
    __syncthreads();
    // Stage positions [p0, p0 + staged) of every row, zero past K (the spec's promise that
    // entries at k >= K are zero needs X to read as zero there, never garbage).
    for (int idx = threadIdx.x; idx < p.staged_positions * R; idx += blockDim.x) {
      const int r = idx / p.staged_positions, kk = idx - r * p.staged_positions;
      const int64_t k = p0 + kk;
      float v = 0.f;
      if (k < p.k && r < p.rows) v = to_f32(p.x[r * p.k + k]);
      xs[skew(kk) * R + r] = v;
    }
    __syncthreads();

    const int64_t e0 = g0 * p.n;
    const int64_t e1 = min(stored, (g0 + p.chunk_groups) * p.n);
    const int64_t v_begin = e0 / VEC, v_end = (e1 + VEC - 1) / VEC;
#pragma unroll
    for (int q = 0; q < kRowsPerWarp; ++q) {
      const int64_t row = row0 + q;
      if (row >= p.nout) break;
      const T* vrow = p.values + row * p.row_len;
      const uint32_t* irow = p.indices + row * p.index_words;
      for (int64_t v = v_begin + lane; v < v_end; v += 32) {
        const uint4 vals = load_stream16(vrow + v * VEC);
        const int64_t bit = v * VEC * p.bits;
        const int shift = static_cast<int>(bit & 31);
        const uint32_t* wp = irow + (bit >> 5);
        uint64_t window = load_stream4(wp);
        if (shift + VEC * p.bits > 32) window |= static_cast<uint64_t>(load_stream4(wp + 1)) << 32;
        window >>= shift;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const int64_t j = v * VEC + i;
          const int64_t g = kPow2N ? (j >> p.log2n) : (j / p.n);
          const int kk = static_cast<int>(g * p.m - p0) + static_cast<int>((window >> (i * p.bits)) & mask);
          const float w = vec_entry<T>(vals, i);
          const float* xv = xs + skew(kk) * R;
#pragma unroll
          for (int r = 0; r < R; ++r) acc[q][r] = fmaf(w, xv[r], acc[q][r]);
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

template <typename T, int R, bool kPow2N>
cudaError_t launch(const DecodeParamsT<T>& p, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(skew(p.staged_positions) + 1) * R * sizeof(float);
  static bool configured = false;  // raising the dynamic shared-memory cap is a one-time call
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(decode_kernel<T, R, kPow2N>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kSmemFloats * static_cast<int>(sizeof(float)));
    if (e != cudaSuccess) return e;
    configured = true;
  }
  const unsigned blocks = static_cast<unsigned>((p.nout + kRowsPerBlock - 1) / kRowsPerBlock);
  decode_kernel<T, R, kPow2N><<<blocks, kWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int R>
cudaError_t launch_r(const DecodeParamsT<T>& p, cudaStream_t stream) {
  return (p.n & (p.n - 1)) == 0 ? launch<T, R, true>(p, stream) : launch<T, R, false>(p, stream);
}

}  // namespace

template <typename T>
cudaError_t run_decode(DecodeParamsT<T> p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const int r_pad = p.rows <= 1 ? 1 : p.rows <= 2 ? 2 : p.rows <= 4 ? 4 : 8;
  // Chunk: a whole number of VEC-entry vectors (so no vector straddles chunks), sized to the
  // shared-memory budget, with VEC groups of slack for the padding entries of the last vector.
  const int64_t budget = (16384 / r_pad) / p.m - VEC;
  p.chunk_groups = std::max<int64_t>(VEC, budget / VEC * VEC);
  p.staged_positions = static_cast<int>((p.chunk_groups + VEC) * p.m);
  p.log2n = 0;
  while ((1 << p.log2n) < p.n) ++p.log2n;
  switch (r_pad) {
    case 1: return launch_r<T, 1>(p, stream);
    case 2: return launch_r<T, 2>(p, stream);
    case 4: return launch_r<T, 4>(p, stream);
    default: return launch_r<T, 8>(p, stream);
  }
}

template cudaError_t run_decode<float>(DecodeParamsT<float>, cudaStream_t);
template cudaError_t run_decode<__half>(DecodeParamsT<__half>, cudaStream_t);
template cudaError_t run_decode<__nv_bfloat16>(DecodeParamsT<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
