// sp_metadata_probe: measures which metadata bits of which lane steer which (row, group of 4) of
// the A operand in wgmma.mma_async.sp.m64n8k32 (fp16, sparsity selector 0), and checks the
// shared-memory layouts the wgmma_sp kernel uses (A: stored values, 64-byte swizzle, the second
// MMA of a 64-position step 32 bytes further; B: 128-byte swizzle) against a float64 product.
//   cmake --build build/bench --target sp_metadata_probe && build/bench/sp_metadata_probe
// Method: A holds ones, B column n holds the offsets 0,1,2,3 of group n (zeros elsewhere), and
// every group's metadata says (0, 1), so each output is 0 + 1 = 1. One block per (lane, nibble)
// turns that nibble to (2, 3): the output of the group it steers becomes 2 + 3 = 5.
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace {

__device__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ uint64_t descriptor(uint32_t addr, int swizzle_mode, int stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(stride_bytes >> 4) << 32) |
         (static_cast<uint64_t>(swizzle_mode) << 62);
}

__device__ void mma_sp(float (&d)[4], uint64_t a, uint64_t b, uint32_t meta) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.mma_async.sp.sync.aligned.m64n8k32.f32.f16.f16 {%0,%1,%2,%3}, %4, %5, %6, 0, 1, 1, 1, 0, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(a), "l"(b), "r"(meta));
#endif
}

// A: [64 x 32] stored values (two MMAs of 16); B: [8 x 64] activations (K-major); meta: two
// words per thread per block; D: [64 x 8] per block.
__global__ void probe(const __half* a, const __half* b, const uint32_t* meta, float* d_out, bool two_mmas) {
  __shared__ __align__(1024) uint8_t smem[64 * 64 + 8 * 128];
  uint8_t* as = smem;
  uint8_t* bs = smem + 64 * 64;
  for (int i = threadIdx.x; i < 64 * 32; i += 128) {
    const int r = i / 32, s = i % 32;
    *reinterpret_cast<__half*>(as + r * 64 + (((s / 8) ^ ((r >> 1) & 3)) << 4) + (s % 8) * 2) = a[i];
  }
  for (int i = threadIdx.x; i < 8 * 64; i += 128) {
    const int n = i / 64, k = i % 64;
    *reinterpret_cast<__half*>(bs + n * 128 + (((k / 8) ^ (n & 7)) << 4) + (k % 8) * 2) = b[i];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  float d[4] = {0, 0, 0, 0};
  const uint32_t* m = meta + static_cast<size_t>(blockIdx.x) * 256 + threadIdx.x * 2;
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  mma_sp(d, descriptor(smem_addr(as), 2, 512), descriptor(smem_addr(bs), 1, 1024), m[0]);
  if (two_mmas) mma_sp(d, descriptor(smem_addr(as) + 32, 2, 512), descriptor(smem_addr(bs) + 64, 1, 1024), m[1]);
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  const int w = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  float* out = d_out + static_cast<size_t>(blockIdx.x) * 512;
  out[(16 * w + g) * 8 + 2 * q] = d[0];
  out[(16 * w + g) * 8 + 2 * q + 1] = d[1];
  out[(16 * w + g + 8) * 8 + 2 * q] = d[2];
  out[(16 * w + g + 8) * 8 + 2 * q + 1] = d[3];
}

}  // namespace

int main() {
  constexpr int kLanes = 64, kBlocks = 1 + kLanes * 8;  // baseline + warps 0 and 1, every nibble
  std::vector<__half> a(64 * 32, __float2half(1.f)), b(8 * 64);
  for (int n = 0; n < 8; ++n)
    for (int k = 0; k < 64; ++k) b[n * 64 + k] = __float2half(k / 4 == n ? static_cast<float>(k % 4) : 0.f);
  std::vector<uint32_t> meta(static_cast<size_t>(kBlocks) * 256, 0x44444444u);
  for (int lane = 0; lane < kLanes; ++lane)
    for (int f = 0; f < 8; ++f)
      meta[static_cast<size_t>(1 + lane * 8 + f) * 256 + lane * 2] = (0x44444444u & ~(0xFu << (4 * f))) | (0xEu << (4 * f));
  __half *da, *db;
  uint32_t* dm;
  float* dd;
  cudaMalloc(&da, a.size() * 2);
  cudaMalloc(&db, b.size() * 2);
  cudaMalloc(&dm, meta.size() * 4);
  cudaMalloc(&dd, static_cast<size_t>(kBlocks) * 512 * 4);
  cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dm, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice);
  probe<<<kBlocks, 128>>>(da, db, dm, dd, false);
  std::vector<float> d(static_cast<size_t>(kBlocks) * 512);
  if (cudaError_t e = cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost); e != cudaSuccess) {
    std::printf("CUDA error: %s (needs an sm_90a GPU)\n", cudaGetErrorString(e));
    return 1;
  }
  int off_baseline = 0;
  for (int i = 0; i < 512; ++i) off_baseline += d[i] != 1.f;
  std::printf("baseline outputs != 1: %d\n", off_baseline);
  for (int lane = 0; lane < kLanes; ++lane)
    for (int f = 0; f < 8; ++f) {
      std::printf("lane %2d bits %2d-%2d steer:", lane, 4 * f, 4 * f + 3);
      for (int i = 0; i < 512; ++i)
        if (d[static_cast<size_t>(1 + lane * 8 + f) * 512 + i] != 1.f) std::printf(" row %d group %d", i / 8, i % 8);
      std::printf("\n");
    }
  // Layouts: random A and B, metadata (0, 1) everywhere, two MMAs (64 positions).
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (auto& v : a) v = __float2half(uniform(rng));
  for (auto& v : b) v = __float2half(uniform(rng));
  cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  probe<<<1, 128>>>(da, db, dm, dd, true);
  cudaMemcpy(d.data(), dd, 512 * 4, cudaMemcpyDeviceToHost);
  double max_err = 0;
  for (int r = 0; r < 64; ++r)
    for (int n = 0; n < 8; ++n) {
      double ref = 0;
      for (int s = 0; s < 32; ++s)  // stored value s sits at K position 4 * (s / 2) + s % 2
        ref += static_cast<double>(__half2float(a[r * 32 + s])) * __half2float(b[n * 64 + 4 * (s / 2) + s % 2]);
      max_err = std::fmax(max_err, std::fabs(ref - d[r * 8 + n]));
    }
  std::printf("layouts: max abs error against float64 %.3g\n", max_err);
  return off_baseline == 0 && max_err < 1e-3 ? 0 : 1;
}
