// The measurement behind the sparse kernels' copy schedule (BENCHMARKS.md, session 19): how fast
// blocks of one producer warp pull a 2:4 or 2:8 kernel's per-step copies into a shared-memory
// ring, with nothing multiplied. A consumer thread waits on each stage's "full" barrier and
// releases it at once. Per step: a stored-value box of 128 weight rows (TMA), optionally the
// activation box (TMA, 17 valid rows of a 64-row box) and the offset words (cp.async by the
// warp's lanes: each row's words per step, as wgmma_sp.cu copies them, or a whole group of four
// steps' words in two 16-byte copies per row). The first table varies the value box alone.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 copy_probe.cu -o copy_probe && ./copy_probe
// (or the copy_probe target of this folder's CMakeLists.txt). Each launch's blocks read rows no
// other launch of its point read, from a 270 MB matrix, so the copies come from HBM; median of 9.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint32_t b, uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(b), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint32_t b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory"); }
__device__ __forceinline__ void bar_expect(uint32_t b, uint32_t n) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t b, uint32_t parity) {
  asm volatile("{\n .reg .pred done;\n W: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra W;\n}" ::"r"(b),
               "r"(parity)
               : "memory");
}
__device__ __forceinline__ void tma2d(uint32_t dst, const CUtensorMap* m, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(m), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void cp4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_arrive(uint32_t b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(b) : "memory");
}

struct Maps {
  CUtensorMap values, x;
};
enum Copies { kValues = 0, kPlusX = 1, kOffsetsPerStep = 2, kOffsetsPerGroup = 4 };
constexpr uint32_t kOffsetsAt = 16384;  // offset words' place in a stage (value box <= 8 KB, x box 8 KB)

// Block b reads weight rows [base + 128 b, +128) (box_rows for the value box alone).
__global__ void __launch_bounds__(64, 1) probe(const __grid_constant__ Maps maps, const uint32_t* offsets, int row_words,
                                              int step_words, int box_cols, int box_rows, int steps, int stages,
                                              uint32_t stage_bytes, uint32_t tx_bytes, int base, int copies) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t ring = (smem_addr(smem) + 1023) & ~1023u, bars = ring + stages * stage_bytes;
  auto full = [&](int s) { return bars + s * 8; };
  auto empty = [&](int s) { return bars + (stages + s) * 8; };
  const bool lanes_copy = copies & (kOffsetsPerStep | kOffsetsPerGroup);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) bar_init(full(s), lanes_copy ? 33 : 1), bar_init(empty(s), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int row0 = base + blockIdx.x * box_rows, lane = threadIdx.x & 31;
  int s = 0;
  uint32_t phase = 0;
  if (threadIdx.x >= 32) {
    for (int t = 0; t < steps; ++t) {
      bar_wait(empty(s), phase ^ 1);
      const uint32_t stage = ring + s * stage_bytes;
      if (lane == 0) {
        bar_expect(full(s), tx_bytes);
        tma2d(stage, &maps.values, t * box_cols, row0, full(s));
        if (copies & kPlusX) tma2d(stage + 8192, &maps.x, t * 64, 0, full(s));
      }
      if (copies & kOffsetsPerStep) {  // lane l: rows l, l + 32, ...; step_words words each
        for (int r = lane; r < 128; r += 32) {
          const uint32_t* src = offsets + int64_t(row0 + r) * row_words + t * step_words;
          if (step_words == 2) {
            cp8(stage + kOffsetsAt + r * 8, src);
          } else {
            for (int w = 0; w < step_words; ++w) cp4(stage + kOffsetsAt + (r * step_words + w) * 4, src + w);
          }
        }
      }
      if ((copies & kOffsetsPerGroup) && t % 4 == 0) {  // 32 bytes per row: 4 steps of 2 words
        for (int i = lane; i < 256; i += 32)
          cp16(stage + kOffsetsAt + i * 16, offsets + int64_t(row0 + i / 2) * row_words + t * 2 + (i % 2) * 4);
      }
      if (lanes_copy) cp_arrive(full(s));
      if (++s == stages) s = 0, phase ^= 1;
    }
  } else if (threadIdx.x == 0) {
    for (int t = 0; t < steps; ++t) {
      bar_wait(full(s), phase);
      bar_arrive(empty(s));
      if (++s == stages) s = 0, phase ^= 1;
    }
  }
}

using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                            const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

bool map2d(Encode encode, CUtensorMap* m, void* base, int64_t cols, int64_t rows, int box_cols, int box_rows,
           CUtensorMapSwizzle swizzle) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)}, unit[2] = {1, 1};
  return encode(m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, base, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Median microseconds of one launch over `blocks` blocks, each launch on rows no other one read.
float time_us(const Maps& maps, const uint32_t* offsets, int row_words, int step_words, int box_cols, int box_rows,
              int steps, int stages, uint32_t stage_bytes, uint32_t tx, int blocks, int copies, int64_t rows) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int rep = 0; rep < 9; ++rep) {
    const int base = static_cast<int>((int64_t(rep) * blocks * box_rows) % (rows - blocks * box_rows + 1));
    cudaEventRecord(e0);
    probe<<<blocks, 64, 220 * 1024>>>(maps, offsets, row_words, step_words, box_cols, box_rows, steps, stages,
                                      stage_bytes, tx, base, copies);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms[ms.size() / 2] * 1e3f;
}

}  // namespace

int main() {
  const int64_t k = 4096, rows = 33792;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
  if (fn == nullptr) return std::printf("no cuTensorMapEncodeTiled\n"), 1;
  const Encode encode = reinterpret_cast<Encode>(fn);
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024);
  void *values, *offsets, *x;
  cudaMalloc(&values, k * rows * 2);  // 16-bit [rows x K]: the value boxes' matrix
  cudaMalloc(&offsets, k * rows);     // 256 words per row
  cudaMalloc(&x, 17 * k * 2);
  cudaMemset(values, 1, k * rows * 2);
  cudaMemset(offsets, 1, k * rows);
  cudaMemset(x, 1, 17 * k * 2);

  std::printf("value box alone (bytes x rows), 1 TMA per stage\n");
  struct Box { int cols, rows; CUtensorMapSwizzle swizzle; };
  for (const Box b : {Box{16, 128, CU_TENSOR_MAP_SWIZZLE_NONE}, Box{32, 128, CU_TENSOR_MAP_SWIZZLE_64B},
                      Box{64, 128, CU_TENSOR_MAP_SWIZZLE_128B}, Box{128, 128, CU_TENSOR_MAP_SWIZZLE_NONE},
                      Box{32, 64, CU_TENSOR_MAP_SWIZZLE_64B}, Box{64, 64, CU_TENSOR_MAP_SWIZZLE_128B},
                      Box{64, 256, CU_TENSOR_MAP_SWIZZLE_128B}}) {
    Maps maps;
    if (!map2d(encode, &maps.values, values, k, rows, b.cols, b.rows, b.swizzle)) return std::printf("map refused\n"), 1;
    const uint32_t stage_bytes = b.cols * 2 * b.rows;
    const int stages = std::min<int>(16, 200 * 1024 / stage_bytes), steps = static_cast<int>(k / b.cols);
    for (int blocks : {16, 64, 128, 132}) {
      const float us = time_us(maps, nullptr, 0, 0, b.cols, b.rows, steps, stages, stage_bytes, stage_bytes, blocks,
                               kValues, rows);
      const double bytes = double(blocks) * steps * stage_bytes;
      std::printf("  %3d B x %3d, %2d stages, %3d blocks: %7.1f us %6.0f GB/s (%5.1f per block)\n", b.cols * 2, b.rows,
                  stages, blocks, us, bytes / us / 1e3, bytes / us / 1e3 / blocks);
    }
  }

  std::printf("a step's copies (64 steps of 64 K positions, 10 stages of 20 KB)\n");
  struct Family { const char* name; int entries, step_words, row_words; };
  for (const Family f : {Family{"2:4", 32, 2, 256}, Family{"2:8", 16, 3, 192}}) {
    Maps maps;
    if (!map2d(encode, &maps.values, values, k * f.entries / 64, rows, f.entries, 128,
               f.entries == 32 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_NONE) ||
        !map2d(encode, &maps.x, x, k, 17, 64, 64, CU_TENSOR_MAP_SWIZZLE_128B))
      return std::printf("map refused\n"), 1;
    struct Case { int copies; const char* name; };
    for (const Case c : {Case{kValues, "values"}, Case{kPlusX, "values + x"},
                         Case{kPlusX | kOffsetsPerStep, "values + x + offsets per step"},
                         Case{kPlusX | kOffsetsPerGroup, "values + x + offsets per group"}}) {
      if ((c.copies & kOffsetsPerGroup) && f.step_words != 2) continue;  // 16-byte group copies: 2 words per step
      const uint32_t tx = 128 * f.entries * 2 + ((c.copies & kPlusX) ? 64 * 128 : 0);
      for (int blocks : {16, 64, 128}) {
        const int steps = static_cast<int>(k / 64);
        const float us = time_us(maps, static_cast<const uint32_t*>(offsets), f.row_words, f.step_words, f.entries, 128,
                                 steps, 10, 20480, tx, blocks, c.copies, rows);
        std::printf("  %s %-31s %3d blocks: %6.1f us, %4.0f ns per step\n", f.name, c.name, blocks, us, us * 1e3 / steps);
      }
    }
  }
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return std::printf("error: %s\n", cudaGetErrorString(e)), 1;
  return 0;
}
