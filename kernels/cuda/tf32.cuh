// fp32 accuracy from TF32 tensor cores (the 3xTF32 split), shared by the vector-wise path
// (vector.cu, mma.sync) and the fp32 warpgroup path (wgmma_tf32.cu): v = big + small with big = v
// rounded to TF32 and small = v - big (exact), which the MMA truncates to TF32; a*b ~= a_small*b_big
// + a_big*b_small + a_big*b_big, accumulated in fp32, small terms first. The dropped small*small
// term is below 2^-22 of the product and small's truncation below 2^-21.
#pragma once
#include <cstdint>

namespace nmcli {

// v rounded to TF32 (nearest, ties away), by integer arithmetic: cvt.rna.tf32.f32 costs four
// instructions on sm_90, this two. Infinities stay; a NaN still yields NaN through `small`.
__device__ __forceinline__ uint32_t round_tf32(float v) { return (__float_as_uint(v) + 0x1000u) & 0xffffe000u; }

// The MMA reads `small` truncated to TF32 (it ignores the low 13 bits): measured as accurate as
// rounding it here (error ratio <= 0.15 of the fp32 bound either way), for one instruction less.
__device__ __forceinline__ void split_tf32(float v, uint32_t& big, uint32_t& small) {
  big = round_tf32(v);
  small = __float_as_uint(v - __uint_as_float(big));
}

}  // namespace nmcli
