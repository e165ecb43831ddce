// fp16 / bf16 <-> fp32 conversions for the CPU kernel (no dependency on ORT or CUDA headers).
#pragma once
#include <cstdint>
#include <cstring>

namespace nmcli {

struct half_t { uint16_t bits; };
struct bfloat16_t { uint16_t bits; };

inline float to_float(float v) { return v; }

inline float to_float(half_t h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  uint32_t out;
  if (exp == 0x1f) {
    out = sign | 0x7f800000u | (man << 13);              // inf / nan
  } else if (exp != 0) {
    out = sign | ((exp + 112) << 23) | (man << 13);      // normal
  } else if (man == 0) {
    out = sign;                                          // zero
  } else {                                               // subnormal: renormalize
    int e = -1;
    do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
    out = sign | static_cast<uint32_t>(112 - e) << 23 | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}

inline float to_float(bfloat16_t b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> T from_float(float v);

template <> inline float from_float<float>(float v) { return v; }

// Round to nearest even, with overflow to inf and gradual underflow, as IEEE requires.
template <> inline half_t from_float<half_t>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u))};
  if (abs >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // rounds past 65504
  if (abs < 0x38800000u) {                                                 // fp16 subnormal or zero
    if (abs < 0x33000000u) return {sign};
    // v = man * 2^(e - 150) with e its biased exponent; in units of 2^-24 that is man >> (126 - e)
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    uint32_t q = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return {static_cast<uint16_t>(sign | q)};
  }
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return {static_cast<uint16_t>(sign | h)};
}

template <> inline bfloat16_t from_float<bfloat16_t>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}

}  // namespace nmcli
