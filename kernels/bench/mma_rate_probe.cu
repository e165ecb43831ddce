// mma_rate_probe: the ceilings of the warpgroup kernels' main loops on a Hopper GPU -- the tensor-core
// rates an SM reaches with both operands in shared memory and nothing else to do, what copies into
// shared memory at the same time take from them, and how many bytes bulk copies from L2 can land
// in every SM (alone, in pairs of SMs, and multicast to both of a pair).
//   cmake --build build/bench --target mma_rate_probe && build/bench/mma_rate_probe
//   (or: nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Ikernels
//        kernels/bench/mma_rate_probe.cu -o /tmp/mma_rate_probe && /tmp/mma_rate_probe)
// Method: one block per SM; each of its 1 or 2 consumer warpgroups issues back-to-back batches of
// MMAs over one 64-position step ([64 x 64] weight tile, [N x 64] activation tile, the layouts the
// kernels use), keeping one batch in flight (wait_group 1), for `iters` batches; optionally a 9th
// warp copies 32 KB at a time from an L2-resident buffer into shared memory with bulk copies, as
// fast as it can, while they run. Dense: 4 x m64nNk16 per batch; sparse (2:4 A): 2 x m64nNk32,
// the same dense-equivalent work. Reported: dense-equivalent TFLOP/s (2*64*N*64 per batch) from
// CUDA events over the grid, and the copy warp's bytes per SM cycle. Operand values do not change
// the rate (zeros here); the metadata is a valid constant.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "cuda/wgmma_ops.cuh"

namespace {

using namespace nmcli::sm90;

constexpr int kCopyBytes = 32 * 1024;

// Shared memory: the activation tile [N x 64] (128-byte swizzle) at 0, the weight tile after it
// (dense: [64 x 64], 128-byte swizzle; sparse: [64 x 32] stored values, 64-byte swizzle), then two
// copy buffers and the copy warp's barrier.
template <int kN>
struct Probe {
  static constexpr int kB = kN * 128;
  static constexpr int kA = 64 * 128;
  static constexpr int kCopy = kB + kA;
  static constexpr int kBarrier = kCopy + 2 * kCopyBytes;
  static constexpr int kBytes = kBarrier + 8 + 1024;
};

template <int kN, bool kSparse, int kWarpgroups, bool kCopies>
__global__ void __launch_bounds__(128 * kWarpgroups + 32, 1)
    rate(float* out, int iters, const uint8_t* src, unsigned long long* copied, long long* cycles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using P = Probe<kN>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t base = smem_addr(smem);
  for (int i = threadIdx.x; i < P::kCopy / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __shared__ volatile int done;
  if (threadIdx.x == 0) {
    done = 0;
    mbarrier_init(base + P::kBarrier, 1);
    fence_barrier_init();
  }
  fence_async_proxy();
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  const long long start = clock64();
  if (warp == 4 * kWarpgroups) {
    // The copy warp: 32 KB bulk copies from the (L2-resident) source until the MMAs are done.
    if (kCopies && (threadIdx.x & 31) == 0) {
      unsigned long long bytes = 0;
      uint32_t phase = 0;
      for (int i = 0; !done; ++i) {
        mbarrier_arrive_expect_tx(base + P::kBarrier, kCopyBytes);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                base + P::kCopy + (i & 1) * kCopyBytes),
            "l"(src + (i & 7) * kCopyBytes), "r"(kCopyBytes), "r"(base + P::kBarrier)
            : "memory");
        mbarrier_wait(base + P::kBarrier, phase);
        phase ^= 1;
        bytes += kCopyBytes;
      }
      atomicAdd(copied, bytes);
    }
  } else {
    float acc[kN / 2];
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[i] = 0.f;
    const uint64_t b_desc = sw128_desc(base);
    const uint64_t a_desc = kSparse ? sw64_desc(base + P::kB) : sw128_desc(base + P::kB);
    const uint32_t meta = 0x44444444u;  // every group of 4: offsets (0, 1)
    fence_operands(acc);
    for (int it = 0; it < iters; ++it) {
      wgmma_fence();
      if constexpr (kSparse) {
#pragma unroll
        for (int k = 0; k < 2; ++k)
          wgmma_sp<kN, false>(acc, desc_plus(a_desc, k * 32), desc_plus(b_desc, k * 64), meta);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma<kN, false>(acc, desc_plus(a_desc, k * 32), desc_plus(b_desc, k * 32));
      }
      wgmma_commit();
      wgmma_wait<1>();
      fence_operands(acc);
    }
    wgmma_wait<0>();
    fence_operands(acc);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) sum += acc[i];
    if (sum != 0.f) out[blockIdx.x] = sum;  // keeps the MMAs; never true with zero operands
    asm volatile("bar.sync 1, %0;" ::"n"(128 * kWarpgroups));
    if (threadIdx.x == 0) {
      done = 1;
      cycles[blockIdx.x] = clock64() - start;
    }
  }
#endif
}

// The fastest of five launches of a grid of `blocks`: its milliseconds (CUDA events) and the SM
// cycles of its slowest block (each block writes its own to `cycles`); `best()` runs right after
// the fastest so far, to read back anything else it counted. ok is false on a launch error.
struct Timing {
  double ms = 1e30, cycles = 0;
  bool ok = true;
};

template <typename Launch, typename Best>
Timing best_of_five(int blocks, const long long* cycles, Launch&& launch, Best&& best) {
  Timing t;
  long long host_cycles[1024];
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    if (ms < t.ms) {
      t.ms = ms;
      cudaMemcpy(host_cycles, cycles, blocks * sizeof(long long), cudaMemcpyDeviceToHost);
      best();
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    std::printf("error: %s\n", cudaGetErrorString(e));
    t.ok = false;
  }
  for (int i = 0; i < blocks; ++i) t.cycles = std::max(t.cycles, static_cast<double>(host_cycles[i]));
  return t;
}

template <int kN, bool kSparse, int kWarpgroups, bool kCopies>
void run(int sms, float* out, const uint8_t* src, unsigned long long* copied, long long* cycles) {
  auto kernel = rate<kN, kSparse, kWarpgroups, kCopies>;
  const int smem = Probe<kN>::kBytes, iters = 20000;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  unsigned long long bytes = 0;
  const Timing t = best_of_five(
      sms, cycles,
      [&] {
        cudaMemset(copied, 0, sizeof(unsigned long long));
        kernel<<<sms, 128 * kWarpgroups + 32, smem>>>(out, iters, src, copied, cycles);
      },
      [&] { cudaMemcpy(&bytes, copied, sizeof(bytes), cudaMemcpyDeviceToHost); });
  if (!t.ok) return;
  const double per_sm = 2.0 * 64 * kN * 64 * iters * kWarpgroups;  // dense-equivalent FLOP
  std::printf("%-6s m64n%-3d %d warpgroup%s %-11s %7.1f TFLOP/s  %6.0f FLOP/cycle/SM  copies %5.1f B/cycle/SM\n",
              kSparse ? "sparse" : "dense", kN, kWarpgroups, kWarpgroups > 1 ? "s" : " ",
              kCopies ? "+ copies" : "", per_sm * sms / (t.ms * 1e-3) / 1e12, per_sm / t.cycles,
              static_cast<double>(bytes) / sms / t.cycles);
}

// Copies alone: every SM's one warp keeps `depth` bulk copies of 16 KB in flight from an
// L2-resident buffer (a different 128 KB slice per SM, 8 MB in all), `copies` of them; bytes per
// SM cycle and GB/s over the whole GPU. The rate a kernel's TMA ring can at best refill at.
__global__ void copy_only(const uint8_t* src, int copies, int depth, long long* cycles) {
  constexpr int kPiece = 16 * 1024;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t base = smem_addr(smem), bars = base + 8 * kPiece;
  if (threadIdx.x != 0) return;
  for (int d = 0; d < depth; ++d) mbarrier_init(bars + 8 * d, 1);
  fence_barrier_init();
  const uint8_t* slice = src + (blockIdx.x % 64) * 8 * kPiece;
  const long long start = clock64();
  uint32_t phases = 0;
  for (int i = 0; i < copies; ++i) {
    const int d = i % depth;
    if (i >= depth) {
      mbarrier_wait(bars + 8 * d, phases >> d & 1);
      phases ^= 1u << d;
    }
    mbarrier_arrive_expect_tx(bars + 8 * d, kPiece);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     base + d * kPiece),
                 "l"(slice + (i & 7) * kPiece), "r"(kPiece), "r"(bars + 8 * d)
                 : "memory");
  }
  for (int d = 0; d < depth && d < copies; ++d) {
    mbarrier_wait(bars + 8 * d, phases >> d & 1);
  }
  cycles[blockIdx.x] = clock64() - start;
}

void copies(int sms, const uint8_t* src, long long* cycles, int depth_only = 0) {
  const int smem = 8 * 16 * 1024 + 64 + 1024, copies = 4000;
  cudaFuncSetAttribute(copy_only, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int depth : {1, 2, 4, 8}) {
    if (depth_only && depth != depth_only) continue;
    const Timing t = best_of_five(
        sms, cycles, [&] { copy_only<<<sms, 32, smem>>>(src, copies, depth, cycles); }, [] {});
    const double bytes = 16.0 * 1024 * copies;
    std::printf("copies only, %d x 16 KB in flight per SM: %6.1f B/cycle/SM, %6.0f GB/s over %d SMs\n", depth,
                bytes / t.cycles, bytes * sms / (t.ms * 1e-3) / 1e9, sms);
  }
}

// Pairs of SMs (clusters of 2) that each bring half of every 16 KB piece and multicast it to
// both, against the same rounds without multicast: does a multicast copy save the L2's output?
// Per round, both blocks arm `depth` barriers for 16 KB each, meet at a cluster barrier, copy,
// wait for all of them and meet again (so no copy lands in a barrier's next phase early).
template <bool kMulticast>
__global__ void __cluster_dims__(2, 1, 1) paired(const uint8_t* src, int rounds, int depth, long long* cycles) {
  constexpr int kPiece = 16 * 1024, kHalf = kPiece / 2;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t base = smem_addr(smem), bars = base + 8 * kPiece;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const bool leader = threadIdx.x == 0;
  if (leader) {
    for (int d = 0; d < depth; ++d) mbarrier_init(bars + 8 * d, 1);
    fence_barrier_init();
  }
  asm volatile("barrier.cluster.arrive.aligned; barrier.cluster.wait.aligned;" ::: "memory");
  const uint8_t* slice = src + (blockIdx.x / 2 % 64) * 8 * kPiece;  // the pair reads the same bytes
  const long long start = clock64();
  for (int r = 0; r < rounds; ++r) {
    if (leader)
      for (int d = 0; d < depth; ++d) mbarrier_arrive_expect_tx(bars + 8 * d, kPiece);
    asm volatile("barrier.cluster.arrive.aligned; barrier.cluster.wait.aligned;" ::: "memory");
    if (leader) {
      for (int d = 0; d < depth; ++d) {
        const uint8_t* piece = slice + ((r * depth + d) & 7) * kPiece;
        if constexpr (kMulticast) {
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;" ::"r"(
                  base + d * kPiece + rank * kHalf),
              "l"(piece + rank * kHalf), "r"(kHalf), "r"(bars + 8 * d), "h"(static_cast<uint16_t>(3))
              : "memory");
        } else {
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                           base + d * kPiece),
                       "l"(piece), "r"(kPiece), "r"(bars + 8 * d)
                       : "memory");
        }
      }
      for (int d = 0; d < depth; ++d) mbarrier_wait(bars + 8 * d, r & 1);
    }
    asm volatile("barrier.cluster.arrive.aligned; barrier.cluster.wait.aligned;" ::: "memory");
  }
  if (leader) cycles[blockIdx.x] = clock64() - start;
}

template <bool kMulticast>
void pairs(int sms, const uint8_t* src, long long* cycles) {
  const int smem = 8 * 16 * 1024 + 64 + 1024, rounds = 1000, depth = 8;
  cudaFuncSetAttribute(paired<kMulticast>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int blocks = sms / 2 * 2;
  const Timing t = best_of_five(
      blocks, cycles, [&] { paired<kMulticast><<<blocks, 32, smem>>>(src, rounds, depth, cycles); }, [] {});
  const double bytes = 16.0 * 1024 * depth * rounds;  // landed in each block's shared memory
  std::printf("pairs of SMs, %-19s %6.1f B/cycle/SM landed, %6.0f GB/s landed over %d SMs\n",
              kMulticast ? "halves multicast:" : "each its own copy:", bytes / t.cycles,
              bytes * blocks / (t.ms * 1e-3) / 1e9, blocks);
}

template <int kN>
void widths(int sms, float* out, const uint8_t* src, unsigned long long* copied, long long* cycles) {
  run<kN, false, 2, false>(sms, out, src, copied, cycles);
  run<kN, true, 1, false>(sms, out, src, copied, cycles);
  run<kN, true, 2, false>(sms, out, src, copied, cycles);
  run<kN, false, 2, true>(sms, out, src, copied, cycles);
  run<kN, true, 2, true>(sms, out, src, copied, cycles);
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const int sms = prop.multiProcessorCount;
  float* out;
  uint8_t* src;
  unsigned long long* copied;
  long long* cycles;
  cudaMalloc(&out, sms * sizeof(float));
  cudaMalloc(&src, 64 * 8 * 16 * 1024);  // 8 MB: the copy probe's slices (L2-resident)
  cudaMemset(src, 0, 64 * 8 * 16 * 1024);
  cudaMalloc(&copied, sizeof(unsigned long long));
  cudaMalloc(&cycles, sms * sizeof(long long));
  copies(sms, src, cycles);
  copies(sms / 2, src, cycles, 4);  // is it each SM's intake or the L2's output?
  copies(sms / 4, src, cycles, 4);
  pairs<false>(sms, src, cycles);
  pairs<true>(sms, src, cycles);
  widths<256>(sms, out, src, copied, cycles);
  widths<128>(sms, out, src, copied, cycles);
  widths<64>(sms, out, src, copied, cycles);
  return 0;
}
