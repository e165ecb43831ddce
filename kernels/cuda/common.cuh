// Small device helpers shared by the CUDA kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../nm_format.h"

namespace nmcli {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 16-byte streaming load of weight data: read once, so keep it out of L1.
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t load_stream4(const uint32_t* p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Bytes of {b, a} picked by the low 16 bits of `selector` (nibble n: result byte n, 0-3 from a,
// 4-7 from b). Unlike __byte_perm, which ignores each nibble's top bit and so masks the selector
// with 0x7777 first (one more instruction), the selector goes to PRMT as it is. A nibble with that
// bit set replicates the sign bit of the byte it names (PTX's sign-replicating mode): wgmma.cu's
// Gather turns mask bits into byte masks that way; the other callers never set it.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// (a & kB) | c in one LOP3. Left to itself the compiler splits it in two where it knows c to be a
// few bits wide (a lane's byte offset merged into a table key).
template <uint32_t kB>
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(kB), "r"(c));
  return d;
}

// 2:4 sparse tensor-core metadata (eight groups of two 2-bit offsets, the format's offset word as
// it is): groups whose offsets read (0, 0) -- padding past the stored entries, rows past the end --
// become (0, 1), which the hardware accepts; every group of the format proper has a second offset
// >= 1 and stays as it is.
__device__ __forceinline__ uint32_t valid_metadata(uint32_t meta) {
  uint32_t any = meta | (meta >> 1);
  any |= any >> 2;                                   // bit 0 of each nibble: the nibble is nonzero
  return meta | ((~any & 0x11111111u) << 2);
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and when launched without it):
// wait until the previous kernel in the stream has finished and its writes are visible ...
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ... and let the next kernel, when launched with it, start its own prologue while this one runs.
__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Entry i of consecutive packed T values held in 32-bit words, as fp32.
template <typename T>
__device__ __forceinline__ float packed_entry(const uint32_t* words, int i) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(words[i]);
  } else {
    const uint16_t h = static_cast<uint16_t>(words[i >> 1] >> (16 * (i & 1)));
    return to_f32(*reinterpret_cast<const T*>(&h));
  }
}

// Entry i of a 16-byte vector holding 16/sizeof(T) values, as fp32.
template <typename T>
__device__ __forceinline__ float vec_entry(const uint4& v, int i) {
  return packed_entry<T>(&v.x, i);
}

}  // namespace nmcli
