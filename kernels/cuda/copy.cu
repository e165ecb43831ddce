// One of the copies behind the copy-bandwidth ceiling the benchmarks report against: 16-byte
// vectors, several in flight per thread, on a grid that fills every SM. On the H100 it reaches
// 2.81 TB/s, cudaMemcpyAsync 2.99 TB/s on its own but 2.42 TB/s as a CUDA-graph node
// (BENCHMARKS.md, session 14): the benchmarks take the fastest, this kernel being the floor
// where a driver's copy is slow.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "kernels.cuh"
#include "nm_matmul_cuda.h"

namespace nmcli {
namespace {

constexpr int kCopyThreads = 512;
constexpr int kCopyUnroll = 4;  // vectors per thread per pass, loaded before any is stored

__global__ void __launch_bounds__(kCopyThreads) copy_kernel(uint4* dst, const uint4* src, int64_t vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCopyThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  for (; i + (kCopyUnroll - 1) * stride < vectors; i += kCopyUnroll * stride) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) v[u] = load_stream16(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) __stcs(dst + i + u * stride, v[u]);
  }
  for (; i < vectors; i += stride) __stcs(dst + i, load_stream16(src + i));
}

}  // namespace

int device_copy(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    return static_cast<int>(cudaErrorInvalidValue);
  int blocks_per_sm = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, copy_kernel, kCopyThreads, 0);
      e != cudaSuccess)
    return static_cast<int>(e);
  const unsigned blocks = static_cast<unsigned>(std::max(1, blocks_per_sm) * multiprocessor_count());
  copy_kernel<<<blocks, kCopyThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint4*>(dst), static_cast<const uint4*>(src), static_cast<int64_t>(bytes / 16));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace nmcli
