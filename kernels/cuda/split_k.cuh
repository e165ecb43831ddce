// Split-K over a thread-block cluster (sm_90), shared by the mma path (mma.cu) and the vector-wise
// path (vector.cu): the blocks of a cluster walk slices of one tile's K, write their
// partial tiles to their own shared memory, and sum them through distributed shared memory, so
// there is no workspace and no second kernel. The warpgroup kernels (wgmma_tile.cuh) share the
// stores and the count of clusters that run at once.
#pragma once
#include <cooperative_groups.h>

#include <algorithm>

#include "common.cuh"
#include "kernels.cuh"

namespace nmcli {

// Clusters of `split` blocks of kKernel that the device runs at once, one block per SM (cached
// per device and split). Clusters must fit in one GPC, so this is less than SMs / split: 15
// clusters of 8 on the H100 (132 SMs).
template <auto kKernel>
int64_t active_clusters(int split, int threads, int smem_bytes) {
  static int known[64][9] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return multiprocessor_count() / split;
  int& count = known[device][split];
  if (count == 0) {
    cudaLaunchAttribute cluster = {};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 1, cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = static_cast<unsigned>(split);
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1, 1, static_cast<unsigned>(split));
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    config.attrs = &cluster;
    config.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&count, kKernel, &config) != cudaSuccess || count <= 0) {
      (void)cudaGetLastError();  // not the launch's error
      count = std::max(1, multiprocessor_count() / split);
    }
  }
  return count;
}

// Writes output (row, col) = alpha * v + bias + residual, skipping positions past the ends.
template <typename T>
__device__ __forceinline__ void store_output(const PathParams<T>& p, int64_t row, int64_t col, float v) {
  if (row < p.rows && col < p.nout)
    p.y.column(col)[row] = from_f32<T>(p.alpha * v + (p.bias ? to_f32(p.bias[col]) : 0.f) + residual_at(p, row, col));
}

// Sums the cluster's partial [BM x BN] tiles (each block's `partial`, row-major, in its own shared
// memory); block r of the cluster reduces and stores rows [r*BM/S, (r+1)*BM/S) of the tile.
template <typename T, int BM, int BN, int kBlockThreads>
__device__ __forceinline__ void reduce_cluster(const PathParams<T>& p, float* partial, int64_t row0, int64_t col0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every partial tile is written
  const int splits = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int rows_per = (BM + splits - 1) / splits, r0 = rank * rows_per, r1 = min(BM, r0 + rows_per);
  for (int idx = threadIdx.x; idx < (r1 - r0) * BN; idx += kBlockThreads) {
    const int r = r0 + idx / BN, c = idx % BN;
    float sum = 0.f;
    for (int q = 0; q < splits; ++q) sum += cluster.map_shared_rank(partial, q)[r * BN + c];
    store_output<T>(p, row0 + r, col0 + c, sum);
  }
  cluster.sync();  // peers' shared memory must outlive the reads above
#else
  __trap();  // the launchers split only where clusters exist
#endif
}

}  // namespace nmcli
