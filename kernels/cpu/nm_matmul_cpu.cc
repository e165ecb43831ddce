#include "nm_matmul_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define NMCLI_CPU_X86 1
#endif

namespace nmcli {
namespace {

#ifdef NMCLI_CPU_X86
bool has_avx2_fma();

// e^x, 8 lanes: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by its Taylor series to r^6
// (relative error under 3e-7), 2^n from the exponent bits. x is clamped to [-87, 88], where 2^n
// stays a normal float; silu only meets e^x past that range as 1 + e^x against 1 or as e^x >> 1.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 = 355/512 - 2.12194440e-4: n * 355/512 is exact for |n| <= 128
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// a[i] = silu(a[i]) * up[i] for fp32 `up`, 8 at a time, the rest one by one.
__attribute__((target("avx2,fma"))) void silu_gate_avx2(const float* up, float* a, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    const __m256 y = _mm256_div_ps(_mm256_mul_ps(x, _mm256_loadu_ps(up + i)), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(a + i, y);
  }
  for (; i < count; ++i) a[i] = gated_activation(Glu::silu, a[i], up[i]);
}
#endif

#ifdef NMCLI_CPU_X86
__attribute__((target("avx2,f16c"))) void widen_half_f16c(const half_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i].bits);
}

__attribute__((target("f16c"))) half_t narrow_half_f16c(float v) {
  return {static_cast<uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT))};
}
#endif

// dst[0, n) = src[0, n) as fp32. fp16 goes by F16C where the CPU has it: the portable conversion
// branches on the exponent, and with it (and narrow's) fp16 calls ran 1.2-1.25x bf16's
// time at 64-256 rows (BENCHMARKS.md session 74).
template <typename T>
void widen(const T* src, float* dst, int64_t n) {
#ifdef NMCLI_CPU_X86
  if constexpr (std::is_same_v<T, half_t>) {
    if (has_avx2_fma()) return widen_half_f16c(src, dst, n);
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// One value as fp32, the same way.
template <typename T>
float widen(T v) {
  float f;
  widen(&v, &f, 1);
  return f;
}

// v rounded to T (to nearest even), by F16C for fp16 where the CPU has it.
template <typename T>
T narrow(float v) {
#ifdef NMCLI_CPU_X86
  if constexpr (std::is_same_v<T, half_t>) {
    if (has_avx2_fma()) return narrow_half_f16c(v);
  }
#endif
  return from_float<T>(v);
}

// A = gate(A, up) in place (A already fp32): the GLU prologue, over a span of a row. With
// AVX2 and FMA, silu takes 8 lanes with exp8 (with a scalar expf a value, a gated 64 x 1408 x 512
// 2:8 call took 1.6x the ungated one's time, BENCHMARKS.md session 72); `up` in another dtype
// goes through fp32 in slices.
template <typename T>
void gate(Glu glu, const T* up, float* a, int64_t count) {
#ifdef NMCLI_CPU_X86
  if (glu == Glu::silu && has_avx2_fma()) {
    if constexpr (std::is_same_v<T, float>) {
      return silu_gate_avx2(up, a, count);
    } else {
      constexpr int64_t kSlice = 1024;
      float up32[kSlice];
      for (int64_t i0 = 0; i0 < count; i0 += kSlice) {
        const int64_t n = std::min(kSlice, count - i0);
        widen(up + i0, up32, n);
        silu_gate_avx2(up32, a + i0, n);
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < count; ++i) a[i] = gated_activation(glu, a[i], to_float(up[i]));
}

int tile_rows_for(int64_t rows) { return rows <= 4 ? 4 : rows <= 8 ? 8 : rows <= 16 ? 16 : 32; }

}  // namespace

template <typename T>
size_t NMMatMulCpu<T>::tile_bytes(const NMMatMulArgs<T>& args) {
  if (args.rows < 2) return 0;
  const int64_t R = tile_rows_for(args.rows);
  return static_cast<size_t>((args.rows + R - 1) / R * R * args.shape.k) * sizeof(float);
}

// At 1 row A is made here (X itself where it is fp32 and ungated); from 2 rows the tiles are
// filled by prologue_part, one tile a part, on the caller's threads (made in the constructor, a
// 256 x 11008 gated prologue took 3.7 ms on one thread while the product took 58 on two).
template <typename T>
NMMatMulCpu<T>::NMMatMulCpu(const NMMatMulArgs<T>& args, float* tiles) : args_(args) {
  const int64_t rows = args.rows, K = args.shape.k;
  if (rows == 1) {
    const bool x_as_is = std::is_same_v<T, float> && args.glu == Glu::none && !args.norm_weight;
    if (!x_as_is) x32_storage_ = new float[static_cast<size_t>(std::max<int64_t>(K, 1))];
    x32_ = activation_span(0, 0, K, row_scale(0), x32_storage_);
  } else if (rows >= 2) {
    tile_rows_ = tile_rows_for(rows);
    num_tiles_ = (rows + tile_rows_ - 1) / tile_rows_;
    tiles_ = tiles;
    if (!tiles_) {
      // 64-byte aligned (aligned_alloc wants a multiple of it): with new[]'s 16, every other 8-lane
      // load of a 32-row tile split two cache lines (7% of a 64 x 4096 x 4096 2:8 call, session 73).
      tiles_ = static_cast<float*>(std::aligned_alloc(64, (tile_bytes(args) + 63) / 64 * 64));
      if (!tiles_) throw std::bad_alloc();
      owns_tiles_ = true;
    }
    choose_block_columns();
  }
}

// RMSNorm's factor for an activation row, 1 without the norm.
template <typename T>
float NMMatMulCpu<T>::row_scale(int64_t row) const {
  if (!args_.norm_weight) return 1.0f;
  const int64_t K = args_.shape.k;
  const T* x = args_.x + row * K;
  double squares = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const double v = widen(x[k]);
    squares += v * v;
  }
  return 1.0f / std::sqrt(static_cast<float>(squares / K) + args_.norm_epsilon);
}

// A[row, k0 : k0 + n) as fp32: X itself where it is fp32 and nothing applies, else written to
// `scratch` converted, gated with X_up or normalised (scale: the row's row_scale).
template <typename T>
const float* NMMatMulCpu<T>::activation_span(int64_t row, int64_t k0, int64_t n, float scale, float* scratch) const {
  const int64_t at = row * args_.shape.k + k0;
  if constexpr (std::is_same_v<T, float>) {
    if (args_.glu == Glu::none && !args_.norm_weight) return args_.x + at;
  }
  widen(args_.x + at, scratch, n);
  if (args_.glu != Glu::none) gate(args_.glu, args_.x_up + at, scratch, n);
  if (args_.norm_weight) {
    for (int64_t i = 0; i < n; ++i) scratch[i] = scratch[i] * scale * widen(args_.norm_weight[k0 + i]);
  }
  return scratch;
}

// Every block reads all of the tiles (from L2 while they fit there, from L3 or memory past it),
// so from 1 MB of tiles blocks take 64 columns, or 32, reading the tiles a quarter or half as
// often (256 x 11008 x 4096 2:8: 163 -> 120 ms on one thread, BENCHMARKS.md session 73), where
// that still leaves two blocks a hardware thread for the pool to share out.
template <typename T>
void NMMatMulCpu<T>::choose_block_columns() {
  constexpr size_t kTilesInL2Bytes = 1 << 20;
  if (tile_rows_ < 32) return;  // one tile, each column's walk over it already the whole block's
  if (tile_bytes(args_) <= kTilesInL2Bytes) return;
  const int64_t threads = std::max(1u, std::thread::hardware_concurrency());
  for (const int64_t cols : {kMaxColumnsPerBlock, kMaxColumnsPerBlock / 2}) {
    if (args_.shape.nout / cols >= 2 * threads) {
      block_cols_ = cols;
      return;
    }
  }
}

template <typename T>
NMMatMulCpu<T>::~NMMatMulCpu() {
  delete[] x32_storage_;
  if (owns_tiles_) std::free(tiles_);
}

// From 2 rows on, A is laid out as tiles of R rows, [tile][K][R] (zeros past the last row), so
// one decoded entry (k, v) updates R sums from R contiguous floats: a loop the compiler
// vectorizes, instead of R scalar gathers from R rows K apart. Tile t is made a span of K
// positions at a time, whose R * kSpan floats stay in L1 while each row writes its column of them
// (row by row over all of K, the writes R floats apart missed L1: 13% of a 64 x 1408 x 512 2:8
// call, BENCHMARKS.md session 72).
template <typename T>
void NMMatMulCpu<T>::prologue_part(int64_t t) const {
  constexpr int64_t kSpan = 64;
  const int64_t K = args_.shape.k, R = tile_rows_, first = t * R;
  const int64_t live = std::min(R, args_.rows - first);  // rows of A in this tile
  float scales[32];
  for (int64_t r = 0; r < live; ++r) scales[r] = row_scale(first + r);
  alignas(64) float scratch[32][kSpan];
  const float* spans[32];
  float* tile = tiles_ + t * K * R;
  for (int64_t k0 = 0; k0 < K; k0 += kSpan) {
    const int64_t n = std::min(kSpan, K - k0);
    for (int64_t r = 0; r < live; ++r) spans[r] = activation_span(first + r, k0, n, scales[r], scratch[r]);
    for (int64_t k = 0; k < n; ++k) {
      float* out = tile + (k0 + k) * R;
      for (int64_t r = 0; r < live; ++r) out[r] = spans[r][k];
      for (int64_t r = live; r < R; ++r) out[r] = 0.0f;
    }
  }
}

namespace {

// The slice of a 32-row tile of A that a chunk of K covers (compute_block): within a core's L1
// data cache (32-48 KB on x86 cores since Skylake and Zen).
constexpr int64_t kTileChunkBytes = 32 * 1024;

// Decodes a column's stored entries into (position, value) pairs and returns how many, reading
// the offsets in order (OffsetStream) and dropping entries at k >= K (only in a partial last
// group), since the spec makes them zero and X has no such columns.
template <typename T>
int64_t decode_column(const NMShape& s, const T* vrow, const uint32_t* irow, int32_t* pos, float* val) {
  OffsetStream offsets(irow, s.bits);
  int64_t live = 0, j = 0;
  const int64_t full_groups = s.k / s.m;
  for (int64_t g = 0; g < full_groups; ++g) {
    const int32_t base = static_cast<int32_t>(g * s.m);
    for (int t = 0; t < s.n; ++t, ++j, ++live) {
      pos[live] = base + static_cast<int32_t>(offsets.next());
      val[live] = to_float(vrow[j]);
    }
  }
  if (full_groups < s.groups) {  // the partial last group
    const int64_t base = full_groups * s.m;
    for (int t = 0; t < s.n; ++t, ++j) {
      const int64_t k = base + offsets.next();
      if (k < s.k) pos[live] = static_cast<int32_t>(k), val[live] = to_float(vrow[j]), ++live;
    }
  }
  return live;
}

// sums[r] += sum over the entries of v * tile[k][r], r < R: R contiguous floats per entry, as
// R / V vectors of V lanes (GCC/Clang vector extensions; left to itself the compiler kept the sums
// in memory and multiplied one lane at a time).
template <int R, int V>
inline __attribute__((always_inline)) void tile_sums_body(const int32_t* pos, const float* val, int64_t live,
                                                          const float* tile, float* sums) {
  typedef float Vec __attribute__((vector_size(V * sizeof(float))));
  // Two sets of sums, for even and odd entries: twice the independent FMA chains in flight.
  Vec a[R / V], b[R / V] = {};
  std::memcpy(a, sums, sizeof(a));
  int64_t j = 0;
  for (; j + 2 <= live; j += 2) {
    const float* xa = tile + static_cast<int64_t>(pos[j]) * R;
    const float* xb = tile + static_cast<int64_t>(pos[j + 1]) * R;
    for (int i = 0; i < R / V; ++i) {
      Vec u, w;
      std::memcpy(&u, xa + i * V, sizeof(Vec));
      std::memcpy(&w, xb + i * V, sizeof(Vec));
      a[i] += val[j] * u;
      b[i] += val[j + 1] * w;
    }
  }
  if (j < live) {
    const float* xa = tile + static_cast<int64_t>(pos[j]) * R;
    for (int i = 0; i < R / V; ++i) {
      Vec u;
      std::memcpy(&u, xa + i * V, sizeof(Vec));
      a[i] += val[j] * u;
    }
  }
  for (int i = 0; i < R / V; ++i) a[i] += b[i];
  std::memcpy(sums, a, sizeof(a));
}

// 4-lane vectors (SSE2, every x86-64; NEON elsewhere) unless the CPU has AVX2, FMA and F16C,
// checked once at run time: then 8 lanes with fused multiply-adds, from code compiled for that
// target alone, so the library itself stays portable. (GCC's target_clones("arch=haswell") was
// tried: its resolver tests the CPU model, not features, and picked the slow clone on newer CPUs.)
#ifdef NMCLI_CPU_X86
template <int R>
__attribute__((target("avx2,fma"))) void tile_sums_avx2(const int32_t* pos, const float* val, int64_t live,
                                                         const float* tile, float* sums) {
  tile_sums_body<R, R >= 8 ? 8 : 4>(pos, val, live, tile, sums);
}
// NMCLI_CPU_BASELINE=1 keeps the portable code on any CPU, NMCLI_CPU_NO_AVX512=1 the AVX2 code
// on CPUs with AVX-512 (tests run all three).
bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c") && std::getenv("NMCLI_CPU_BASELINE") == nullptr;
  return yes;
}
bool has_avx512() {
  static const bool yes = has_avx2_fma() && __builtin_cpu_supports("avx512f") && std::getenv("NMCLI_CPU_NO_AVX512") == nullptr;
  return yes;
}

// Tiles of 16 or 32 rows with 16-lane AVX-512: a tile row is one or two aligned vectors, half the
// loads and FMAs of 8 lanes (1.15-1.3x on 16-256 rows, session 73); four sets of sums, each entry
// of four to its own, so that eight (or four) FMA chains are in flight.
template <int L>
__attribute__((target("avx512f"), always_inline)) inline void add_entry_avx512(__m512* sums, const float* x, float v) {
  const __m512 w = _mm512_set1_ps(v);
  for (int i = 0; i < L; ++i) sums[i] = _mm512_fmadd_ps(w, _mm512_load_ps(x + 16 * i), sums[i]);
}

template <int R>
__attribute__((target("avx512f"))) void tile_sums_avx512(const int32_t* pos, const float* val, int64_t live,
                                                         const float* tile, float* sums) {
  constexpr int L = R / 16;
  __m512 acc[4][L];
  for (int i = 0; i < L; ++i) {
    acc[0][i] = _mm512_loadu_ps(sums + 16 * i);
    acc[1][i] = acc[2][i] = acc[3][i] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 4 <= live; j += 4)
    for (int u = 0; u < 4; ++u) add_entry_avx512<L>(acc[u], tile + static_cast<int64_t>(pos[j + u]) * R, val[j + u]);
  for (; j < live; ++j) add_entry_avx512<L>(acc[0], tile + static_cast<int64_t>(pos[j]) * R, val[j]);
  for (int i = 0; i < L; ++i)
    _mm512_storeu_ps(sums + 16 * i, _mm512_add_ps(_mm512_add_ps(acc[0][i], acc[1][i]), _mm512_add_ps(acc[2][i], acc[3][i])));
}
#endif

// One activation row, portable: the column's decoded entries against x, four independent sums
// (one sum made every FMA wait for the previous one).
float dot_decoded(const int32_t* pos, const float* val, int64_t live, const float* x) {
  float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t j = 0;
  for (; j + 4 <= live; j += 4) {
    a0 += val[j] * x[pos[j]];
    a1 += val[j + 1] * x[pos[j + 1]];
    a2 += val[j + 2] * x[pos[j + 2]];
    a3 += val[j + 3] * x[pos[j + 3]];
  }
  for (; j < live; ++j) a0 += val[j] * x[pos[j]];
  return (a0 + a1) + (a2 + a3);
}

#ifdef NMCLI_CPU_X86
// AVX2 decoding, 8 entries ("a chunk") at a time, for patterns where N divides 8 or N is 8, and
// B <= 4 (every family users prune to but 8:32 and 16:32; a larger multiple of 8 needs M > 16):
//  * chunk c's 8 * B offset bits are the B bytes at byte c * B of the row's index words,
//    shifted apart per lane;
//  * lane i sits in group (8c + i) / N: position c * step + (i / N) * M + offset, where a
//    chunk spans step = (8 / N) * M positions (M when N is 8).
// Chunks cover the full groups only (positions below K by construction); the partial last group
// goes through read_offset one entry at a time.
struct Chunks {
  int64_t count = 0;      // chunks in the row's full groups
  int64_t unaligned = 0;  // chunks whose 4-byte offset read stays inside the row's index words
  int bits = 0, step = 0;   // step: positions a chunk spans

  static bool make(const NMShape& s, Chunks* g) {
    if (s.bits > 4 || 8 % s.n != 0) return false;
    g->count = s.k / s.m * s.n / 8;
    g->unaligned = std::min(g->count, (s.index_words * 4 - 4) / s.bits + 1);
    g->bits = s.bits;
    g->step = 8 / s.n * s.m;
    return true;
  }
};

// The per-lane constants of chunk decoding, made once a call.
struct ChunkLanes {
  __m256i group_base;  // lane i: (i / N) * M
  __m256i shifts;      // lane i: i * B
  __m256i mask;        // (1 << B) - 1

  __attribute__((target("avx2"), always_inline)) static ChunkLanes make(const Chunks& g, const NMShape& s) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return {_mm256_mullo_epi32(_mm256_srli_epi32(lane, __builtin_ctz(s.n)), _mm256_set1_epi32(s.m)),
            _mm256_mullo_epi32(lane, _mm256_set1_epi32(g.bits)), _mm256_set1_epi32((1 << g.bits) - 1)};
  }
};

// Chunk c's positions relative to its first position, c * step.
__attribute__((target("avx2"), always_inline)) inline __m256i chunk_positions(const ChunkLanes& lanes, const Chunks& g,
                                                                             const uint32_t* irow, int64_t c) {
  uint32_t word;
  if (c < g.unaligned) {
    std::memcpy(&word, reinterpret_cast<const unsigned char*>(irow) + c * g.bits, sizeof(word));
  } else {  // the row's last chunks: from the words their bits lie in
    word = read_bits(irow, c * 8 * g.bits, 8 * g.bits);
  }
  const __m256i offsets = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), lanes.shifts), lanes.mask);
  return _mm256_add_epi32(lanes.group_base, offsets);
}

// 8 stored values from v as fp32 (T: float, half_t or bfloat16_t; bf16 is the top half of an fp32).
template <typename T>
__attribute__((target("avx2,f16c"), always_inline)) inline __m256 values8(const T* v) {
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(v);
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  if constexpr (std::is_same_v<T, half_t>) return _mm256_cvtph_ps(bits);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The same, 16 values.
template <typename T>
__attribute__((target("avx512f"), always_inline)) inline __m512 values16(const T* v) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(v);
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  if constexpr (std::is_same_v<T, half_t>) return _mm512_cvtph_ps(bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Positions and fp32 values of chunk c.
template <typename T>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void chunk_entries(
    const ChunkLanes& lanes, const Chunks& g, const T* vrow, const uint32_t* irow, int64_t c, __m256i* positions,
    __m256* values) {
  *positions = _mm256_add_epi32(chunk_positions(lanes, g, irow, c), _mm256_set1_epi32(static_cast<int32_t>(c * g.step)));
  *values = values8(vrow + c * 8);
}

// The entries after the last whole chunk (the rest of the full groups, the partial last group),
// one at a time: f(k, value) for each at k < K.
template <typename T, typename F>
inline void for_each_tail_entry(const Chunks& g, const NMShape& s, const T* vrow, const uint32_t* irow, F&& f) {
  for (int64_t j = g.count * 8; j < s.stored(); ++j) {
    const int64_t k = j / s.n * s.m + read_offset(irow, j, s.bits);
    if (k < s.k) f(k, to_float(vrow[j]));
  }
}

// One activation row: decoded and multiplied in one pass, X gathered (2.4-3.3x the decode-then-
// multiply loop on a Zen 5 core, BENCHMARKS.md session 16); chunks from `first` on, then the
// entries after them.
template <typename T>
__attribute__((target("avx2,fma,f16c"))) float dot_avx2(const Chunks& g, const NMShape& s, const T* vrow,
                                                         const uint32_t* irow, const float* x, int64_t first = 0) {
  const ChunkLanes lanes = ChunkLanes::make(g, s);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t c = first; c < g.count; ++c) {
    __m256i positions;
    __m256 values;
    chunk_entries(lanes, g, vrow, irow, c, &positions, &values);
    const __m256 xs = _mm256_i32gather_ps(x, positions, 4);
    if (c & 1) acc1 = _mm256_fmadd_ps(values, xs, acc1);
    else acc0 = _mm256_fmadd_ps(values, xs, acc0);
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, _mm256_add_ps(acc0, acc1));
  float sum = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
  for_each_tail_entry(g, s, vrow, irow, [&](int64_t k, float v) { sum += v * x[k]; });
  return sum;
}

// Whether two chunks span at most 32 positions (2:4, 4:8, 8:16, 8:12, ...), the window of X that
// dot_avx512 reads for them. Wider pairs (1:4, 2:8, 4:16: 64 positions, two permutes and a blend)
// were no faster than the gathers of dot_avx2 (0.9-1.06x, session 73).
inline bool pairs_in_32(const Chunks& g) { return 2 * g.step <= 32; }

// One activation row, 16 entries (two chunks) at a time, for pairs_in_32 patterns: X's 32 floats
// for the pair loaded whole and the entries' values picked out with a two-source permute instead
// of gathered (1.16-1.2x on 2:4 and 4:8, session 73). The last pairs, whose window would pass K,
// and the rest go to dot_avx2.
template <typename T>
__attribute__((target("avx512f,avx2,fma,f16c"))) float dot_avx512(const Chunks& g, const NMShape& s, const T* vrow,
                                                                   const uint32_t* irow, const float* x) {
  const ChunkLanes lanes = ChunkLanes::make(g, s);
  // the pair's second chunk starts step positions after its first
  const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(g.step), 1);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= g.count && c * g.step + 32 <= s.k; c += 2) {
    const __m512i rel = _mm512_add_epi32(
        _mm512_inserti64x4(_mm512_zextsi256_si512(chunk_positions(lanes, g, irow, c)), chunk_positions(lanes, g, irow, c + 1), 1),
        second);
    const float* w = x + c * g.step;
    const __m512 xs = _mm512_permutex2var_ps(_mm512_loadu_ps(w), rel, _mm512_loadu_ps(w + 16));
    const __m512 values = values16(vrow + c * 8);
    if (c & 2) acc1 = _mm512_fmadd_ps(values, xs, acc1);
    else acc0 = _mm512_fmadd_ps(values, xs, acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + dot_avx2(g, s, vrow, irow, x, c);
}

// decode_column's result (positions and fp32 values of the live entries, their count), for the
// row tiles of 2 or more activation rows.
template <typename T>
__attribute__((target("avx2,fma,f16c"))) int64_t decode_avx2(const Chunks& g, const NMShape& s, const T* vrow,
                                                              const uint32_t* irow, int32_t* pos, float* val) {
  const ChunkLanes lanes = ChunkLanes::make(g, s);
  for (int64_t c = 0; c < g.count; ++c) {
    __m256i positions;
    __m256 values;
    chunk_entries(lanes, g, vrow, irow, c, &positions, &values);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pos + c * 8), positions);
    _mm256_storeu_ps(val + c * 8, values);
  }
  int64_t live = g.count * 8;
  for_each_tail_entry(g, s, vrow, irow, [&](int64_t k, float v) {
    pos[live] = static_cast<int32_t>(k);
    val[live++] = v;
  });
  return live;
}
#endif

template <int R>
void tile_sums_for(const int32_t* pos, const float* val, int64_t live, const float* tile, float* sums) {
#ifdef NMCLI_CPU_X86
  if constexpr (R >= 16) {
    if (has_avx512()) return tile_sums_avx512<R>(pos, val, live, tile, sums);
  }
  if (has_avx2_fma()) return tile_sums_avx2<R>(pos, val, live, tile, sums);
#endif
  tile_sums_body<R, 4>(pos, val, live, tile, sums);
}

void tile_sums(int rows_per_tile, const int32_t* pos, const float* val, int64_t live, const float* tile, float* sums) {
  switch (rows_per_tile) {
    case 4: return tile_sums_for<4>(pos, val, live, tile, sums);
    case 8: return tile_sums_for<8>(pos, val, live, tile, sums);
    case 16: return tile_sums_for<16>(pos, val, live, tile, sums);
    default: return tile_sums_for<32>(pos, val, live, tile, sums);
  }
}

// How a column's entries are read, chosen once per block of columns: 8 at a time (AVX2 chunks)
// where the CPU has AVX2, FMA and F16C and Chunks covers the pattern; one at a time otherwise.
template <typename T>
class ColumnDecoder {
 public:
  explicit ColumnDecoder(const NMShape& s) : s_(s) {
#ifdef NMCLI_CPU_X86
    if constexpr (kVectorTypes) chunked_ = has_avx2_fma() && Chunks::make(s, &chunks_);
#endif
  }

  // The column's (position, fp32 value) pairs at positions below K; returns their count.
  int64_t decode(const T* vrow, const uint32_t* irow, int32_t* pos, float* val) const {
#ifdef NMCLI_CPU_X86
    if constexpr (kVectorTypes) {
      if (chunked_) return decode_avx2(chunks_, s_, vrow, irow, pos, val);
    }
#endif
    return decode_column(s_, vrow, irow, pos, val);
  }

  // One activation row: the sum of value * x[position]; pos and val are scratch for the
  // one-at-a-time path.
  float dot(const T* vrow, const uint32_t* irow, const float* x, int32_t* pos, float* val) const {
#ifdef NMCLI_CPU_X86
    if constexpr (kVectorTypes) {
      if (chunked_ && has_avx512() && pairs_in_32(chunks_)) return dot_avx512(chunks_, s_, vrow, irow, x);
      if (chunked_) return dot_avx2(chunks_, s_, vrow, irow, x);
    }
#endif
    return dot_decoded(pos, val, decode_column(s_, vrow, irow, pos, val), x);
  }

 private:
  static constexpr bool kVectorTypes =
      std::is_same_v<T, float> || std::is_same_v<T, half_t> || std::is_same_v<T, bfloat16_t>;
  const NMShape& s_;
#ifdef NMCLI_CPU_X86
  bool chunked_ = false;
  Chunks chunks_;
#endif
};

}  // namespace

template <typename T>
void NMMatMulCpu<T>::compute_block(int64_t block) const {
  const NMShape& s = args_.shape;
  const int64_t col_begin = block * block_cols_;
  const int64_t cols = std::min(s.nout, col_begin + block_cols_) - col_begin;
  const int64_t rows = args_.rows, stored = s.stored();
  if (rows == 0) return;  // no outputs (and no tiles)
  const ColumnDecoder<T> decoder(s);
  auto values = [&](int64_t c) { return args_.values + (col_begin + c) * s.row_len; };
  auto indices = [&](int64_t c) { return args_.indices + (col_begin + c) * s.index_words; };
  OutputColumn<T> ys[kMaxColumnsPerBlock];
  float biases[kMaxColumnsPerBlock];
  for (int64_t c = 0; c < cols; ++c) {
    ys[c] = args_.y.column(col_begin + c);
    biases[c] = args_.bias ? to_float(args_.bias[col_begin + c]) : 0.0f;
  }
  // Output (r, col_begin + c) from its sum: scaled, biased, the residual added.
  auto output = [&](int64_t r, int64_t c, float sum) {
    const float residual = args_.residual ? widen(args_.residual[r * s.nout + col_begin + c]) : 0.0f;
    return narrow<T>(args_.alpha * sum + biases[c] + residual);
  };
  // Decoded (position, value) pairs: one column's, or every column's of the block where 32-row
  // tiles walk K in chunks (below).
  const bool chunked = tile_rows_ == 32;
  std::vector<int32_t> pos(static_cast<size_t>((chunked ? cols : 1) * stored));
  std::vector<float> val(pos.size());

  if (rows == 1) {
    for (int64_t c = 0; c < cols; ++c)
      ys[c][0] = output(0, c, decoder.dot(values(c), indices(c), x32_, pos.data(), val.data()));
    return;
  }
  // From 2 rows: each column decoded once, its sums for a tile of rows gathered in `sums`, written
  // row by row so that a row's outputs of the block lie side by side (written column by column, a
  // tile's rows Nout apart shared one L1 set: 1.15-1.25x slower at 32-64 rows, BENCHMARKS.md session 72).
  alignas(64) float sums[kMaxColumnsPerBlock][32];
  auto write_tile = [&](int64_t r0) {
    for (int64_t r = r0; r < std::min(rows, r0 + tile_rows_); ++r)
      for (int64_t c = 0; c < cols; ++c) ys[c][r] = output(r, c, sums[c][r - r0]);
  };
  if (!chunked) {  // one tile: each column summed as soon as it is decoded, its entries in L1
    std::memset(sums, 0, sizeof(sums));
    for (int64_t c = 0; c < cols; ++c)
      tile_sums(tile_rows_, pos.data(), val.data(), decoder.decode(values(c), indices(c), pos.data(), val.data()),
                tiles_, sums[c]);
    return write_tile(0);
  }
  // Tiles of 32 rows: the block's columns decoded first, then K walked in chunks whose slice of the
  // tile (chunk * 128 bytes) stays in L1 while every column of the block reads it; a whole column
  // at a time read the tile from L2 (1.15-1.25x slower at 64 rows, session 72). Smaller tiles read
  // their decoded entries back from L2 that way, and lost (up to 1.4x).
  int64_t live[kMaxColumnsPerBlock];
  for (int64_t c = 0; c < cols; ++c)
    live[c] = decoder.decode(values(c), indices(c), pos.data() + c * stored, val.data() + c * stored);
  const int64_t chunk = std::max<int64_t>(s.m, kTileChunkBytes / (tile_rows_ * 4) / s.m * s.m);
  for (int64_t r0 = 0; r0 < rows; r0 += tile_rows_) {
    std::memset(sums, 0, sizeof(sums));
    const float* tile = tiles_ + r0 * s.k;
    for (int64_t k0 = 0; k0 < s.k; k0 += chunk) {
      // The chunk's entries: those of its whole groups (chunks end on groups; the last takes the rest).
      const int64_t first = k0 / s.m * s.n, end = k0 + chunk >= s.k ? stored : (k0 + chunk) / s.m * s.n;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t last = std::min(end, live[c]);
        if (last > first)
          tile_sums(tile_rows_, pos.data() + c * stored + first, val.data() + c * stored + first, last - first, tile,
                    sums[c]);
      }
    }
    write_tile(r0);
  }
}

namespace {

// f(i) for every i in [0, count), on up to num_threads threads (the caller's among them).
template <typename F>
void run_parallel(int64_t count, int num_threads, const F& f) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, count)));
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next++; i < count; i = next++) f(i);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

}  // namespace

template <typename T>
void nm_matmul_cpu(const NMMatMulArgs<T>& args, int num_threads) {
  NMMatMulCpu<T> op(args);
  run_parallel(op.num_prologue_parts(), num_threads, [&](int64_t t) { op.prologue_part(t); });
  run_parallel(op.num_blocks(), num_threads, [&](int64_t b) { op.compute_block(b); });
}

template class NMMatMulCpu<float>;
template class NMMatMulCpu<half_t>;
template class NMMatMulCpu<bfloat16_t>;
template void nm_matmul_cpu<float>(const NMMatMulArgs<float>&, int);
template void nm_matmul_cpu<half_t>(const NMMatMulArgs<half_t>&, int);
template void nm_matmul_cpu<bfloat16_t>(const NMMatMulArgs<bfloat16_t>&, int);

}  // namespace nmcli
