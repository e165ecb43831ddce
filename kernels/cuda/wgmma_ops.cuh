// Hopper (sm_90a) PTX wrappers for the warpgroup tensor-core paths (wgmma.cu, wgmma_sp.cu), besides
// the cp.async ones (async_copy.cuh): the async-proxy fence, barriers and tensor copies, wgmma's
// fence/commit/wait, shared-memory descriptors, and wgmma.mma_async with both operands in shared
// memory for the activation-tile widths we launch.
// Only compiled for sm_90a (cmake/KernelSources.cmake builds those files with their own -gencode).
#pragma once
#include <cstdint>

#include "async_copy.cuh"

namespace nmcli {
namespace sm90 {

// Shared memory written through the generic proxy (cp.async included) and read next by wgmma
// (the async proxy) needs this fence in each writing thread before the barrier.
__device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Shared-memory barriers (mbarrier) and tensor copies (TMA), for kernels whose copies are issued
// by one producer warp: a stage's "full" barrier completes when its bytes have landed, its
// "empty" barrier when every consumer warp is done with it.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes initialised barriers visible to the asynchronous proxy (TMA) and the cluster.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrives and announces `bytes` more of asynchronous copies that complete on the barrier.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Expects `bytes` more on the barrier's current phase, without an arrival.
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrives once this thread's earlier cp.async copies have landed (counted among the arrivals).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase of parity `parity` has completed (parity 1 passes at once on
// a fresh barrier: "the phase before the first" counts as complete).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Copies the box at (c0, c1) of a 2-D tensor map (a __grid_constant__ kernel parameter) to
// shared memory, completing `bytes` of the barrier's transaction count; out-of-bounds
// elements land as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      :
      : "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// The other way: shared memory at `src` to the box at (c0, c1) of a 2-D tensor map, as a bulk
// group of this thread (commit, then wait for the groups); elements out of bounds are not written.
__device__ __forceinline__ void tma_store_2d(const void* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               :
               : "l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until this thread's bulk groups have read their shared memory (may be written again) ...
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// ... or have written global memory too.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Named barrier `id` (1-15; 0 is __syncthreads') for kCount threads, whole warps.
template <int kCount>
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kCount) : "memory");
}
// Four 8x8 matrices of 16-bit elements from an MMA accumulator's fragment layout (lane l holds row
// l / 4, columns 2 (l % 4) and + 1 of each, in r0..r3), stored transposed: row j of matrix m (its
// fragment's column j) at the address lane 8 m + j gives.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t at, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Pins accumulator registers in program order around the asynchronous MMAs (the compiler
// cannot see that wgmma writes them after the instruction issues).
template <int kCount>
__device__ __forceinline__ void fence_operands(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A fragments built in registers (kCount MMAs' 4 registers each): their values are
// fixed here, before the wgmma_fence that must follow their writes (the compiler would otherwise
// compute some of them past it, next to the MMA that reads them).
template <int kCount>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[kCount][4]) {
#pragma unroll
  for (int k = 0; k < kCount; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[k][i])::"memory");
}


// Descriptor of a K-major tile of 16-bit values in shared memory with the 128-byte swizzle:
// rows of 64 values (128 B), 8-row atoms of 1024 B (stride-dimension offset), atoms 1024-byte
// aligned; the 16-byte chunk c of row r sits at chunk c ^ (r % 8). Bits: start address >> 4
// [0,14), leading offset >> 4 [16,30) (unused with this swizzle, 1 by convention), stride
// offset >> 4 [32,46), swizzle mode [62,64) = 1 (128 B).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

// The same for rows of 32 values (64 B) with the 64-byte swizzle: 8-row atoms of 512 B, chunk c
// of row r at chunk c ^ ((r / 2) % 4), atoms 512-byte aligned; swizzle mode 2 (64 B).
__device__ __forceinline__ uint64_t sw64_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(512 >> 4) << 32) |
         (2ull << 62);
}

// The descriptor of the tile `bytes` further on: the start address sits in the low bits, and a
// tile in shared memory (< 228 KB) never carries out of its 14-bit field.
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// The MMAs below: D[64 x N] += A[64 x K] * B[K x N], B a K-major tile in shared memory
// (descriptors above), fp32 accumulators (N/2 per thread; the mma.m16n8 C layout per warp, warp w
// owning rows 16w..16w+15). PTX takes the accumulators as a brace list of registers, so the
// operand lists are built from fixed chunks by the preprocessor.

// The placeholders of the accumulator brace list, in chunks of 16 and 32 (string literals concatenate).
#define NMCLI_WGMMA_REGS_0_15 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define NMCLI_WGMMA_REGS_0_31 \
  NMCLI_WGMMA_REGS_0_15 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define NMCLI_WGMMA_REGS_32_63 \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define NMCLI_WGMMA_REGS_64_79 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define NMCLI_WGMMA_REGS_80_95 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define NMCLI_WGMMA_REGS_96_127 \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// 8, 16 and 32 accumulator operands starting at d[i].
#define NMCLI_WGMMA_ACC8(i) \
  "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), \
  "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define NMCLI_WGMMA_ACC16(i) NMCLI_WGMMA_ACC8(i), NMCLI_WGMMA_ACC8((i) + 8)
#define NMCLI_WGMMA_ACC32(i) NMCLI_WGMMA_ACC16(i), NMCLI_WGMMA_ACC16((i) + 16)

// An N-wide MMA's accumulators: placeholders %0..%(N/2 - 1) and their operands d[0..N/2).
#define NMCLI_WGMMA_D64_REGS NMCLI_WGMMA_REGS_0_31
#define NMCLI_WGMMA_D64 NMCLI_WGMMA_ACC32(0)
#define NMCLI_WGMMA_D128_REGS NMCLI_WGMMA_REGS_0_31 ", " NMCLI_WGMMA_REGS_32_63
#define NMCLI_WGMMA_D128 NMCLI_WGMMA_ACC32(0), NMCLI_WGMMA_ACC32(32)
#define NMCLI_WGMMA_D160_REGS NMCLI_WGMMA_D128_REGS ", " NMCLI_WGMMA_REGS_64_79
#define NMCLI_WGMMA_D160 NMCLI_WGMMA_D128, NMCLI_WGMMA_ACC16(64)
#define NMCLI_WGMMA_D192_REGS NMCLI_WGMMA_D160_REGS ", " NMCLI_WGMMA_REGS_80_95
#define NMCLI_WGMMA_D192 NMCLI_WGMMA_D160, NMCLI_WGMMA_ACC16(80)
#define NMCLI_WGMMA_D256_REGS NMCLI_WGMMA_D192_REGS ", " NMCLI_WGMMA_REGS_96_127
#define NMCLI_WGMMA_D256 NMCLI_WGMMA_D192, NMCLI_WGMMA_ACC32(96)

// The body of a wrapper templated on <kWidth, kBf16>: the instruction macro (taking the type
// name) for the activation-tile width, with the type the template asks for.
#define NMCLI_WGMMA_FOR_WIDTH(N64, N128, N160, N192, N256) \
  static_assert(kWidth == 64 || kWidth == 128 || kWidth == 160 || kWidth == 192 || kWidth == 256, \
                "activation tile widths we launch"); \
  if constexpr (kWidth == 64) { \
    if constexpr (kBf16) N64("bf16"); else N64("f16"); \
  } else if constexpr (kWidth == 128) { \
    if constexpr (kBf16) N128("bf16"); else N128("f16"); \
  } else if constexpr (kWidth == 160) { \
    if constexpr (kBf16) N160("bf16"); else N160("f16"); \
  } else if constexpr (kWidth == 192) { \
    if constexpr (kBf16) N192("bf16"); else N192("f16"); \
  } else { \
    if constexpr (kBf16) N256("bf16"); else N256("f16"); \
  }

// One wgmma.mma_async with both operands in shared memory (descriptors above): A a K-major
// [64 x 16] tile, B the activations.
#define NMCLI_WGMMA_SS(SHAPE, TYPE, REGS, DESCS, ...) \
  asm volatile("wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" REGS "}, " DESCS ", 1, 1, 1, 0, 0;" \
               : __VA_ARGS__ : "l"(a_desc), "l"(b_desc))
#define NMCLI_WGMMA_SS_M64N64K16(TYPE) \
  NMCLI_WGMMA_SS("m64n64k16", TYPE, NMCLI_WGMMA_D64_REGS, "%32, %33", NMCLI_WGMMA_D64)
#define NMCLI_WGMMA_SS_M64N128K16(TYPE) \
  NMCLI_WGMMA_SS("m64n128k16", TYPE, NMCLI_WGMMA_D128_REGS, "%64, %65", NMCLI_WGMMA_D128)
#define NMCLI_WGMMA_SS_M64N160K16(TYPE) \
  NMCLI_WGMMA_SS("m64n160k16", TYPE, NMCLI_WGMMA_D160_REGS, "%80, %81", NMCLI_WGMMA_D160)
#define NMCLI_WGMMA_SS_M64N192K16(TYPE) \
  NMCLI_WGMMA_SS("m64n192k16", TYPE, NMCLI_WGMMA_D192_REGS, "%96, %97", NMCLI_WGMMA_D192)
#define NMCLI_WGMMA_SS_M64N256K16(TYPE) \
  NMCLI_WGMMA_SS("m64n256k16", TYPE, NMCLI_WGMMA_D256_REGS, "%128, %129", NMCLI_WGMMA_D256)

template <int kWidth, bool kBf16>
__device__ __forceinline__ void wgmma_ss(float (&d)[kWidth / 2], uint64_t a_desc, uint64_t b_desc) {
  NMCLI_WGMMA_FOR_WIDTH(NMCLI_WGMMA_SS_M64N64K16, NMCLI_WGMMA_SS_M64N128K16, NMCLI_WGMMA_SS_M64N160K16,
                        NMCLI_WGMMA_SS_M64N192K16, NMCLI_WGMMA_SS_M64N256K16)
}

// One wgmma.mma_async with A from registers (the TF32 wrapper below): TYPES the A.B type pair, REGS the
// accumulator placeholder list, OPERANDS A's four register placeholders and B's descriptor
// placeholder, IMMEDIATES what follows them (TF32 MMAs take no transpose operand). `a` holds per
// warp the mma.m16n8 A fragment of its 16 rows (a[0] row g, a[1] row g + 8, a[2] and a[3] the same
// rows half the MMA's K further on; g = lane / 4). The MMA reads them asynchronously: they must
// stay unchanged until wgmma_wait retires it.
#define NMCLI_WGMMA_RS(SHAPE, TYPES, IMMEDIATES, REGS, OPERANDS, ...) \
  asm volatile("wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPES " {" REGS "}, " OPERANDS ", " IMMEDIATES ";" \
               : __VA_ARGS__ : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc))

// D[64 x N] += A[64 x 8] * B[8 x N] on TF32 (fp32 values; the instruction reads their upper 19
// bits). B: a K-major tile of 32 fp32 (128 B) per row in shared memory with the 128-byte swizzle
// (each k8 MMA reads 32 bytes of each row, like a k16 one of 16-bit values). A: registers
// (NMCLI_WGMMA_RS), one fp32 each, column lane % 4 (+ 4).
#define NMCLI_WGMMA_TF32_RS(SHAPE, ...) NMCLI_WGMMA_RS(SHAPE, "tf32.tf32", "1, 1, 1", __VA_ARGS__)

template <int kWidth>
__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[kWidth / 2], const uint32_t (&a)[4], uint64_t b_desc) {
  static_assert(kWidth == 32 || kWidth == 64 || kWidth == 128, "activation tile widths of the fp32 path");
  if constexpr (kWidth == 32) {
    NMCLI_WGMMA_TF32_RS("m64n32k8", NMCLI_WGMMA_REGS_0_15, "{%16, %17, %18, %19}, %20", NMCLI_WGMMA_ACC8(0),
                        NMCLI_WGMMA_ACC8(8));
  } else if constexpr (kWidth == 64) {
    NMCLI_WGMMA_TF32_RS("m64n64k8", NMCLI_WGMMA_D64_REGS, "{%32, %33, %34, %35}, %36", NMCLI_WGMMA_D64);
  } else {
    NMCLI_WGMMA_TF32_RS("m64n128k8", NMCLI_WGMMA_D128_REGS, "{%64, %65, %66, %67}, %68", NMCLI_WGMMA_D128);
  }
}

// D[64 x N] += A[64 x 16] * B[16 x N] on fp16/bf16 with A from registers (NMCLI_WGMMA_RS: the
// mma.m16n8k16 A fragment, a[0] row g columns 2q, 2q + 1, a[1] row g + 8, a[2] and a[3] the same
// rows 8 columns on; q = lane % 4), B the activations as for wgmma_ss.
#define NMCLI_WGMMA_HALF_RS(SHAPE, TYPE, ...) NMCLI_WGMMA_RS(SHAPE, TYPE "." TYPE, "1, 1, 1, 0", __VA_ARGS__)
#define NMCLI_WGMMA_RS_M64N64K16(TYPE) \
  NMCLI_WGMMA_HALF_RS("m64n64k16", TYPE, NMCLI_WGMMA_D64_REGS, "{%32, %33, %34, %35}, %36", NMCLI_WGMMA_D64)
#define NMCLI_WGMMA_RS_M64N128K16(TYPE) \
  NMCLI_WGMMA_HALF_RS("m64n128k16", TYPE, NMCLI_WGMMA_D128_REGS, "{%64, %65, %66, %67}, %68", NMCLI_WGMMA_D128)
#define NMCLI_WGMMA_RS_M64N160K16(TYPE) \
  NMCLI_WGMMA_HALF_RS("m64n160k16", TYPE, NMCLI_WGMMA_D160_REGS, "{%80, %81, %82, %83}, %84", NMCLI_WGMMA_D160)
#define NMCLI_WGMMA_RS_M64N192K16(TYPE) \
  NMCLI_WGMMA_HALF_RS("m64n192k16", TYPE, NMCLI_WGMMA_D192_REGS, "{%96, %97, %98, %99}, %100", NMCLI_WGMMA_D192)
#define NMCLI_WGMMA_RS_M64N256K16(TYPE) \
  NMCLI_WGMMA_HALF_RS("m64n256k16", TYPE, NMCLI_WGMMA_D256_REGS, "{%128, %129, %130, %131}, %132", NMCLI_WGMMA_D256)

template <int kWidth, bool kBf16>
__device__ __forceinline__ void wgmma_rs(float (&d)[kWidth / 2], const uint32_t (&a)[4], uint64_t b_desc) {
  NMCLI_WGMMA_FOR_WIDTH(NMCLI_WGMMA_RS_M64N64K16, NMCLI_WGMMA_RS_M64N128K16, NMCLI_WGMMA_RS_M64N160K16,
                        NMCLI_WGMMA_RS_M64N192K16, NMCLI_WGMMA_RS_M64N256K16)
}

// Moves a warpgroup's per-thread register limit (every warp of it executes this; sm_90a): `dec`
// hands registers back to the block's pool, `inc` waits until the pool has them.
template <int kCount>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kCount));
}
template <int kCount>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kCount));
}

// D[64 x N] += A[64 x 32] * B[32 x N] with A 2:4-sparse: the descriptor's tile holds A's 16 stored
// values per row (K-major, like a dense 64 x 16 tile) and `meta` their offsets. Lanes 4g and
// 4g + 1 of each warp supply the metadata (sparsity selector 0): bits [0, 16) for row g and
// [16, 32) for row g + 8 of the warp's 16, lane 4g for K positions 0..15 and lane 4g + 1 for
// 16..31, each 4-position group in 4 bits (two 2-bit offsets, the first in the low bits).
// Measured on the H100: kernels/bench/sp_metadata_probe.cu.
#define NMCLI_WGMMA_SP(SHAPE, TYPE, REGS, OPERANDS, ...) \
  asm volatile("wgmma.mma_async.sp.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" REGS "}, " OPERANDS ", 0, 1, 1, 1, 0, 0;" \
               : __VA_ARGS__ : "l"(a_desc), "l"(b_desc), "r"(meta))

#define NMCLI_WGMMA_SP_M64N64K32(TYPE) \
  NMCLI_WGMMA_SP("m64n64k32", TYPE, NMCLI_WGMMA_D64_REGS, "%32, %33, %34", NMCLI_WGMMA_D64)
#define NMCLI_WGMMA_SP_M64N128K32(TYPE) \
  NMCLI_WGMMA_SP("m64n128k32", TYPE, NMCLI_WGMMA_D128_REGS, "%64, %65, %66", NMCLI_WGMMA_D128)
#define NMCLI_WGMMA_SP_M64N160K32(TYPE) \
  NMCLI_WGMMA_SP("m64n160k32", TYPE, NMCLI_WGMMA_D160_REGS, "%80, %81, %82", NMCLI_WGMMA_D160)
#define NMCLI_WGMMA_SP_M64N192K32(TYPE) \
  NMCLI_WGMMA_SP("m64n192k32", TYPE, NMCLI_WGMMA_D192_REGS, "%96, %97, %98", NMCLI_WGMMA_D192)
#define NMCLI_WGMMA_SP_M64N256K32(TYPE) \
  NMCLI_WGMMA_SP("m64n256k32", TYPE, NMCLI_WGMMA_D256_REGS, "%128, %129, %130", NMCLI_WGMMA_D256)

template <int kWidth, bool kBf16>
__device__ __forceinline__ void wgmma_sp(float (&d)[kWidth / 2], uint64_t a_desc, uint64_t b_desc, uint32_t meta) {
  NMCLI_WGMMA_FOR_WIDTH(NMCLI_WGMMA_SP_M64N64K32, NMCLI_WGMMA_SP_M64N128K32, NMCLI_WGMMA_SP_M64N160K32,
                        NMCLI_WGMMA_SP_M64N192K32, NMCLI_WGMMA_SP_M64N256K32)
}

}  // namespace sm90
}  // namespace nmcli
