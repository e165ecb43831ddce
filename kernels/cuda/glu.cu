// The gated activation silu(x) * x_up written out once, for the paths that copy X into shared
// memory as it is (mma, wgmma, wgmma_sp, tiled); the decode path gates while it stages X.
#include "kernels.cuh"

namespace nmcli {
namespace {

template <typename T>
__global__ void glu_kernel(const T* x, const T* up, Glu glu, T* out, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_f32<T>(gated_activation(glu, to_f32(x[i]), to_f32(up[i])));
}

}  // namespace

template <typename T>
cudaError_t run_glu(const T* x, const T* up, Glu glu, T* out, int64_t count, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t wanted = (count + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(wanted, 8LL * multiprocessor_count()));
  glu_kernel<T><<<std::max(blocks, 1u), kThreads, 0, stream>>>(x, up, glu, out, count);
  return cudaGetLastError();
}

template cudaError_t run_glu<float>(const float*, const float*, Glu, float*, int64_t, cudaStream_t);
template cudaError_t run_glu<__half>(const __half*, const __half*, Glu, __half*, int64_t, cudaStream_t);
template cudaError_t run_glu<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, Glu, __nv_bfloat16*, int64_t,
                                            cudaStream_t);

}  // namespace nmcli
