// Tiled path: any row count, any N:M, any dtype. "Load sparse, compute dense": each K step
// expands a [BK x BN] weight tile from the packed format into shared memory (zero fill, then
// scatter the stored entries), stages a [BM x BK] activation tile, and runs a register-blocked
// fp32 FMA product (4x4 outputs per thread). K steps are whole groups, so any M works.
// This is the general path; tensor-core tiles for fp16/bf16 build on the same expansion.
#include "common.cuh"
#include "kernels.cuh"

namespace nmcli {
namespace {

constexpr int BM = 64, BN = 64, kMaxBK = 64, kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) tiled_kernel(PathParams<T> p, int groups_per_step) {
  __shared__ float xs[BM][kMaxBK + 1];  // +1: column reads by different rows avoid bank conflicts
  __shared__ float ws[kMaxBK][BN];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * BM, col0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int bk = groups_per_step * p.m;
  const int per_col = groups_per_step * p.n;
  const int64_t stored = p.groups * p.n;
  float acc[4][4] = {};

  for (int64_t g0 = 0; g0 < p.groups; g0 += groups_per_step) {
    const int64_t k0 = g0 * p.m;
    for (int idx = threadIdx.x; idx < BM * bk; idx += kThreads) {
      const int r = idx / bk, kk = idx - r * bk;
      const int64_t row = row0 + r, k = k0 + kk;
      xs[r][kk] = (row < p.rows && k < p.k) ? to_f32(p.x[row * p.k + k]) : 0.f;
    }
    for (int idx = threadIdx.x; idx < bk * BN; idx += kThreads) ws[idx / BN][idx % BN] = 0.f;
    __syncthreads();
    for (int idx = threadIdx.x; idx < BN * per_col; idx += kThreads) {
      const int c = idx / per_col, jj = idx - c * per_col;
      const int64_t col = col0 + c, j = g0 * p.n + jj;
      if (col < p.nout && j < stored) {
        const uint32_t off = read_offset(p.indices + col * p.index_words, j, p.bits);
        ws[(jj / p.n) * p.m + off][c] = to_f32(p.values[col * p.row_len + j]);
      }
    }
    __syncthreads();
    for (int kk = 0; kk < bk; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[ty * 4 + i][kk];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + ty * 4 + i;
    if (row >= p.rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = col0 + tx * 4 + j;
      if (col < p.nout)
        p.y.column(col)[row] = from_f32<T>(p.alpha * acc[i][j] + (p.bias ? to_f32(p.bias[col]) : 0.f) + residual_at(p, row, col));
    }
  }
}

}  // namespace

template <typename T>
cudaError_t run_tiled(PathParams<T> p, cudaStream_t stream) {
  const int groups_per_step = max(1, kMaxBK / p.m);
  const dim3 grid(static_cast<unsigned>((p.nout + BN - 1) / BN), static_cast<unsigned>((p.rows + BM - 1) / BM));
  tiled_kernel<T><<<grid, kThreads, 0, stream>>>(p, groups_per_step);
  return cudaGetLastError();
}

template cudaError_t run_tiled<float>(PathParams<float>, cudaStream_t);
template cudaError_t run_tiled<__half>(PathParams<__half>, cudaStream_t);
template cudaError_t run_tiled<__nv_bfloat16>(PathParams<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
