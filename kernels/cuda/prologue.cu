// The activation A of a gated or normalised call (kernels/fusion.h) written out once, for the
// paths that copy X into shared memory as it is (mma, wgmma, wgmma_sp, tiled); the decode path
// forms A while it stages X.
#include "kernels.cuh"

namespace nmcli {
namespace {

template <typename T>
__global__ void glu_kernel(const T* x, const T* up, Glu glu, T* out, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_f32<T>(gated_activation(glu, to_f32(x[i]), to_f32(up[i])));
}

constexpr int kNormThreads = 256;

__device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// One block per row: the row's mean square, then A = x * rsqrt(mean + eps) * weight. 16-byte
// vectors where K and the pointers allow, and several loads in flight per thread: a loop of
// one dependent 2-byte load at a time made a 64 x 4096 call take ~8 us (session 12).
template <typename T>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const T* x, const T* weight, float epsilon, T* out,
                                                                int64_t k) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float warp_sums[kNormThreads / 32];
  const T* row = x + blockIdx.x * k;
  T* dst = out + blockIdx.x * k;
  const bool vectors = k % VEC == 0 && aligned16(row) && aligned16(weight) && aligned16(dst);
  const int64_t units = vectors ? k / VEC : k;
  float sum = 0.f;
#pragma unroll 4
  for (int64_t u = threadIdx.x; u < units; u += kNormThreads) {
    if (vectors) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(row) + u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) sum = fmaf(vec_entry<T>(v, i), vec_entry<T>(v, i), sum);
    } else {
      const float e = to_f32(row[u]);
      sum = fmaf(e, e, sum);
    }
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total += warp_sums[w];
  const float scale = rsqrtf(total / static_cast<float>(k) + epsilon);
#pragma unroll 4
  for (int64_t u = threadIdx.x; u < units; u += kNormThreads) {
    if (vectors) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(row) + u), w = __ldg(reinterpret_cast<const uint4*>(weight) + u);
      alignas(16) T a[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) a[i] = from_f32<T>(vec_entry<T>(v, i) * scale * vec_entry<T>(w, i));
      reinterpret_cast<uint4*>(dst)[u] = *reinterpret_cast<const uint4*>(a);
    } else {
      dst[u] = from_f32<T>(to_f32(row[u]) * scale * to_f32(weight[u]));
    }
  }
}

}  // namespace

template <typename T>
cudaError_t run_rms_norm(const T* x, const T* weight, float epsilon, T* out, int64_t rows, int64_t k,
                         cudaStream_t stream) {
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  rms_norm_kernel<T><<<static_cast<unsigned>(rows), kNormThreads, 0, stream>>>(x, weight, epsilon, out, k);
  return cudaGetLastError();
}

template <typename T>
cudaError_t run_glu(const T* x, const T* up, Glu glu, T* out, int64_t count, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t wanted = (count + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(wanted, 8LL * multiprocessor_count()));
  glu_kernel<T><<<std::max(blocks, 1u), kThreads, 0, stream>>>(x, up, glu, out, count);
  return cudaGetLastError();
}

template cudaError_t run_rms_norm<float>(const float*, const float*, float, float*, int64_t, int64_t, cudaStream_t);
template cudaError_t run_rms_norm<__half>(const __half*, const __half*, float, __half*, int64_t, int64_t, cudaStream_t);
template cudaError_t run_rms_norm<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, float, __nv_bfloat16*,
                                                 int64_t, int64_t, cudaStream_t);
template cudaError_t run_glu<float>(const float*, const float*, Glu, float*, int64_t, cudaStream_t);
template cudaError_t run_glu<__half>(const __half*, const __half*, Glu, __half*, int64_t, cudaStream_t);
template cudaError_t run_glu<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, Glu, __nv_bfloat16*, int64_t,
                                            cudaStream_t);

}  // namespace nmcli
