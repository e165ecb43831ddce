// The measurement behind wgmma.cu's scatter (BENCHMARKS.md, session 30): what a warp's 16-bit
// shared-memory stores cost by where its 32 lanes write. Every SM runs one block of 8 warps; each
// warp repeats 8 stores per lane (from a table of 8 address patterns) 4096 times; printed: cycles
// per warp store instruction, SM-wide. The random patterns mimic the scatter's lane maps: lanes
// cover `rows` consecutive 128-byte rows of a 128-byte-swizzled tile, each lane one entry of a
// group of 16 positions at a random offset.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 smem_store_probe.cu -o smem_store_probe
// (or the smem_store_probe target of this folder's CMakeLists.txt).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

constexpr int kRepeats = 4096;
constexpr int kWarps = 8;
constexpr int kPatterns = 8;  // address patterns per lane, cycled

__global__ void store_probe(const uint32_t* offsets, long long* cycles) {
  extern __shared__ uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * 2048;
  uint32_t addr[kPatterns];
  for (int j = 0; j < kPatterns; ++j) addr[j] = base + offsets[j * 32 + lane];
  __syncthreads();
  const long long start = clock64();
  for (int i = 0; i < kRepeats; ++i) {
#pragma unroll
    for (int j = 0; j < kPatterns; ++j)
      asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr[j]), "h"(static_cast<uint16_t>(i + j)) : "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - start;
}

int main() {
  std::mt19937 rng(30);
  struct Pattern {
    const char* name;
    std::vector<uint32_t> offsets;  // kPatterns x 32 byte offsets
  };
  std::vector<Pattern> patterns;
  auto fixed = [&](const char* name, auto offset) {
    Pattern p{name, {}};
    for (int j = 0; j < kPatterns; ++j)
      for (int lane = 0; lane < 32; ++lane) p.offsets.push_back(offset(lane));
    patterns.push_back(p);
  };
  // Lanes over `rows` rows, 32 / rows lanes a row, spread evenly over a row's 4 groups of 16
  // positions (32 bytes each), one random position each, swizzled by the row's phase.
  auto scatter = [&](const char* name, int rows) {
    Pattern p{name, {}};
    const int per_row = 32 / rows, per_group = per_row / 4 > 0 ? per_row / 4 : 1;
    for (int j = 0; j < kPatterns; ++j)
      for (int lane = 0; lane < 32; ++lane) {
        const int row = lane / per_row, group = (lane % per_row) / per_group % 4;
        const uint32_t position = rng() % 16;
        p.offsets.push_back(row * 128u + ((group * 32u + 2 * position) ^ ((row & 7) * 16u)));
      }
    patterns.push_back(p);
  };
  fixed("one row, a word per lane", [](int lane) { return 4u * lane; });
  fixed("one row, two lanes per word", [](int lane) { return 2u * lane; });
  fixed("two rows, same banks", [](int lane) { return 4u * (lane >> 1) + 128u * (lane & 1); });
  fixed("four rows, same banks", [](int lane) { return 16u * (lane >> 2) % 128 + 128u * (lane & 3); });
  scatter("random, one row (32 entries a row)", 1);
  scatter("random, two rows (8:16 lane map)", 2);
  scatter("random, four rows (4:16 lane map)", 4);
  scatter("random, eight rows (2:16 lane map)", 8);

  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  uint32_t* offsets = nullptr;
  long long* cycles = nullptr;
  cudaMalloc(&offsets, kPatterns * 32 * sizeof(uint32_t));
  cudaMalloc(&cycles, sms * sizeof(long long));
  constexpr int kSmem = kWarps * 2048;
  for (const Pattern& p : patterns) {
    cudaMemcpy(offsets, p.offsets.data(), p.offsets.size() * sizeof(uint32_t), cudaMemcpyHostToDevice);
    for (int warm = 0; warm < 2; ++warm) store_probe<<<sms, kWarps * 32, kSmem>>>(offsets, cycles);
    std::vector<long long> c(sms);
    if (cudaMemcpy(c.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost) != cudaSuccess) {
      std::printf("CUDA error: %s\n", cudaGetErrorString(cudaGetLastError()));
      return 1;
    }
    std::printf("%-40s %.2f cycles per warp store\n", p.name,
                static_cast<double>(c[0]) / (static_cast<double>(kRepeats) * kPatterns * kWarps));
  }
  return 0;
}
