// Decode path: 1..16 activation rows (autoregressive generation, small batches). The product is
// memory-bound on the packed weight, so everything serves one goal: stream values and offsets
// at full HBM bandwidth.
//  * A warp owns one weight row (= output column) at a time. Per step each lane loads 2
//    16-byte vectors of stored entries, lane-interleaved so every load instruction of the warp
//    is one contiguous 512-byte run, plus the offset bits of those vectors.
//  * Persistent grid, software-pipelined: each block stays resident and walks several row tiles,
//    and each warp issues the loads of its next step (the next row's first step at a row's end)
//    before it multiplies the current one, from two register buffers. Rows on LLaMA shapes are
//    one to four steps long, so without this every row paid a full memory latency with nothing
//    in flight (session 3: 49-68% of copy bandwidth; now 55-77%).
//  * One block of 32 warps per SM, held to 64 registers per thread; it stages the activations
//    once for 32 rows at a time (measured against 2 blocks of 16: equal at 1 row, 5-35% faster at
//    4-8 rows, where the staged activations are larger). The grid is sized so every block walks
//    the same number of tiles (no last partial wave).
//  * Measured and not kept (BENCHMARKS.md, sessions 4 and 16): 4 vectors per step, cp.async
//    landing rings in shared memory 2-4 steps deep, and 3 register buffers of 1 vector (more or
//    finer bytes in flight, same or slower). Session 58, at 1-2 rows: each warp's steps brought
//    into a ring of its own in shared memory by bulk copies one lane issues (2-5 steps deep; at
//    best level with this walk for 2:8 and 4:16, 0.85-0.98x for 2:4 and 1:4, and slower the
//    deeper the ring), and each warp asking L2 for its next row at a row's end (0.81-0.95x):
//    more bytes in flight made these calls slower, not faster.
//  * What bounds a 1-row call is instruction issue (session 16, Nsight Compute: the schedulers
//    issue on 80% of cycles; session 59, H200: its warps ready or issuing on 25% of their cycles,
//    a flat read's on 2%, which waits on memory), so the inner loop is written for few
//    instructions per entry: one shift and one LOP3 place an entry's offset field in its
//    shared-memory address.
//  * Where K is staged once, at 1-2 rows, a leaner walk of whole rows (kWalkRows; launch says
//    where): each warp's loads move along the row from pointers, and what depends only on the
//    lane is computed once (0.98-1.06x on the wide LLaMA projections, session 49).
//    It loads X between its first and second step's weights (StagingInHalves, session 67): X's
//    loads had waited behind both steps', and a timing-only build that skipped the staging ran
//    1-row calls 1.1-2.8 us faster (kernels/bench/decode_timeline.cu).
//  * Common N:M families are compiled with N, M and B as constants (group index by shift,
//    offset extraction by constant shifts); any other pattern takes the runtime-N:M variant.
//  * Activations are staged once per block in shared memory, the R rows of a position side by
//    side so one load gathers all of them: as fp32 up to 4 rows, and as the 16-bit input type
//    from 8 rows on, so a position stays 16-32 bytes. For the compile-time families positions
//    are run-transposed (RunLayout): the 32 lanes' gathers never share a bank whatever their
//    offsets (session 8: 1.14-1.82x faster at 4 rows and up to 1.38x at 8, where these gathers
//    bound the kernel; 0.96-1.07x at 1 row and for 1:8 on 14336 x 4096). Generic patterns keep
//    a skewed layout (SkewLayout).
// Instantiated per dtype in decode_{f32,f16,bf16}.cu to keep compile units small.
#pragma once
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "common.cuh"
#include "kernels.cuh"

// Timeline hooks: kernels/bench/decode_timeline.cu defines NMCLI_DECODE_STAMP(p, event) to record
// when each warp starts (0), has waited for the previous kernel (1), has the activations staged
// (2) and leaves (3); everywhere else they compile to nothing.
#ifndef NMCLI_DECODE_STAMP
#define NMCLI_DECODE_STAMP(p, event)
#endif

namespace nmcli {
namespace decode {

// Block shape; NMCLI_DECODE_WARPS / NMCLI_DECODE_MIN_BLOCKS override it for tuning runs
// (warps x min blocks = 32 resident warps per SM, i.e. at most 64 registers per thread).
#ifndef NMCLI_DECODE_WARPS
#define NMCLI_DECODE_WARPS 32
#endif
#ifndef NMCLI_DECODE_MIN_BLOCKS
#define NMCLI_DECODE_MIN_BLOCKS 1
#endif
constexpr int kWarps = NMCLI_DECODE_WARPS;
constexpr int kThreads = kWarps * 32;
constexpr int kMinBlocksPerSM = NMCLI_DECODE_MIN_BLOCKS;
constexpr int kRowsPerBlock = kWarps;  // one weight row per warp at a time
#ifndef NMCLI_DECODE_VECTORS
#define NMCLI_DECODE_VECTORS 2
#endif
constexpr int kVectorsPerLane = NMCLI_DECODE_VECTORS;  // 16-byte vectors per lane per step
#ifndef NMCLI_DECODE_DEPTH
#define NMCLI_DECODE_DEPTH 2
#endif
constexpr int kDepth = NMCLI_DECODE_DEPTH;  // steps whose loads are issued ahead, plus the current one
constexpr int kStageBytes = 200 * 1024;    // shared-memory budget for staged activations (of 227 KB per block)

__host__ __device__ constexpr int ilog2(int v) { return v > 1 ? 1 + ilog2(v / 2) : 0; }

// Staged element type for R padded rows of T.
template <typename T, int R>
using StageT = std::conditional_t<(sizeof(T) == 2 && R >= 8), T, float>;

// Where a staged position lives. Slots are in units of one position (R staged values).
// Skewed: slot(q) = q plus one slot every 32 and every 1024 positions, for the runtime-N:M kernels
// (their vectors do not cover aligned runs of positions).
struct SkewLayout {
  __host__ __device__ static int slot(int q) { return q + (q >> 5) + (q >> 10); }
  static int capacity(int staged) { return slot(staged - 1) + 1; }
  static int64_t positions_within(int64_t slots) { return slots * 32 / 34; }
  static constexpr int kRun = 0;
};

// Run-transposed, for the compile-time families, where one 16-byte vector of stored entries
// covers exactly one aligned run of P positions: run v (positions [v*P, v*P + P)) goes to column
// v % 32 of a [P][32] tile of slots, one tile per 32 runs. The lanes of a warp read consecutive
// vectors, i.e. consecutive runs, so whatever offsets they hold they hit 32 different columns:
// by construction a gather is one shared-memory wavefront per 128 bytes (Nsight measured 3.2 per
// gather for the skewed layout, whose lanes collide when their random offsets do). Entry
// addresses become base + offset << 5.
template <int P>
struct RunLayout {
  __host__ __device__ static int run_slot(unsigned v) {  // slot of the run's first position
    return static_cast<int>((v & 31u) + (v >> 5) * (32u * P));
  }
  __host__ __device__ static int slot(int q) {
    return run_slot(static_cast<unsigned>(q) / P) + ((static_cast<unsigned>(q) % P) << 5);
  }
  static int capacity(int staged) { return (staged + 32 * P - 1) / (32 * P) * (32 * P); }
  static int64_t positions_within(int64_t slots) { return slots / (32 * P) * (32 * P); }
  static constexpr int kRun = P;
};

// Positions covered by one 16-byte vector when a compile-time N:M family covers aligned runs
// (N divides the vector and M is a power of two), else 0.
template <typename T, int kN, int kM>
__host__ __device__ constexpr int run_positions() {
  constexpr int VEC = 16 / sizeof(T);
  if constexpr (kN > 0 && VEC % (kN > 0 ? kN : 1) == 0 && (kM & (kM - 1)) == 0) return VEC / kN * kM;
  return 0;
}

template <typename T, int kN, int kM>
using LayoutFor = std::conditional_t<(run_positions<T, kN, kM>() > 0),
                                     RunLayout<std::max(run_positions<T, kN, kM>(), 1)>, SkewLayout>;

// The R staged values of one position (stride R elements of S), as fp32.
template <typename S, int R>
__device__ __forceinline__ void load_position(const S* src, float (&x)[R]) {
  constexpr int kWords = R * static_cast<int>(sizeof(S)) / 4;
  uint32_t w[kWords];
  if constexpr (kWords >= 4) {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(src)[i];
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else if constexpr (kWords == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) x[r] = packed_entry<S>(w, r);
}

// The first position of the t-th 16-byte vector of X a staging loads (per row), where runs of kRun
// positions share a column of the layout: consecutive t walk the same place of consecutive runs, so
// under the run layout their stores land in consecutive slots.
template <int VEC, int kRun>
__device__ __forceinline__ int staged_vector_position(int t, int runs) {
  constexpr int kPieces = kRun / VEC;  // vectors of X per run
  return kPieces == 1 ? t * VEC : t % runs * kRun + t / runs * VEC;
}

// Stages positions [p0, p0 + staged) of every row, position q at slot Layout::slot(q) with its R
// values side by side. X reads as zero past K and past the real rows (the format's padding
// entries point there with zero values, and zero times garbage can be NaN). With 16-byte loads
// (K a multiple of the vector, X aligned), consecutive threads take consecutive rows, then
// consecutive runs at the same place within the run, so under the run layout their stores land
// in consecutive slots.
// Fused prologues (kernels/fusion.h): a gated call stages silu(x) * x_up; a normalised call
// stages x * norm_weight and, with `sumsq` (on the block's first pass over K), adds each row's
// sum of squares of x into sumsq[r]: the row's 1 / rms scales its outputs in finish_row.
template <typename T, typename S, int R, typename Layout>
__device__ __forceinline__ void stage_activations(const DecodeParamsT<T>& p, S* xs, int64_t p0, float* sumsq) {
  constexpr int VEC = 16 / sizeof(T);
  const int staged = p.staged_positions;  // a multiple of the run length, as is p0
  const bool gate = p.glu != Glu::none;
  const T* gamma = p.norm_weight;
  float squares = 0.f;  // this thread's row: kThreads is a multiple of R
  if (p.k % VEC == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
      (!gate || reinterpret_cast<uintptr_t>(p.x_up) % 16 == 0) && reinterpret_cast<uintptr_t>(gamma) % 16 == 0) {
    constexpr int kRun = Layout::kRun > 0 ? Layout::kRun : VEC;  // positions that share a column
    constexpr int kPieces = kRun / VEC;                           // vectors of X per run
    const int runs = staged / kRun;
#pragma unroll 2
    for (int idx = threadIdx.x; idx < runs * kPieces * R; idx += kThreads) {
      const int r = idx % R, t = idx / R;
      const int q = staged_vector_position<VEC, kRun>(t, runs);
      const int64_t k = p0 + q;
      uint4 v = make_uint4(0, 0, 0, 0), u = v;  // zeros past K: gated, still zero
      if (k < p.k && r < p.rows) {
        v = __ldg(reinterpret_cast<const uint4*>(p.x + r * p.k + k));
        if (gate) u = __ldg(reinterpret_cast<const uint4*>(p.x_up + r * p.k + k));
      }
      if (gamma && k < p.k) u = __ldg(reinterpret_cast<const uint4*>(gamma + k));
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float x = vec_entry<T>(v, i);
        squares = fmaf(x, x, squares);
        const float a = gate ? gated_activation(p.glu, x, vec_entry<T>(u, i)) : gamma ? x * vec_entry<T>(u, i) : x;
        xs[Layout::slot(q + i) * R + r] = from_f32<S>(a);
      }
    }
    if (sumsq) {  // lanes l, l + R, ... hold row l % R (a warp starts at a multiple of R)
      for (int o = 16; o >= R; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
      if ((threadIdx.x & 31) < R) atomicAdd(&sumsq[threadIdx.x & 31], squares);
    }
  } else {
#pragma unroll 4
    for (int idx = threadIdx.x; idx < staged * R; idx += kThreads) {
      const int r = idx / staged, q = idx - r * staged;
      const int64_t k = p0 + q;
      const int64_t i = r * p.k + k;
      const bool real = k < p.k && r < p.rows;
      const float x = real ? to_f32(p.x[i]) : 0.f;
      float a = real ? gated_activation(p.glu, x, gate ? to_f32(p.x_up[i]) : 0.f) : 0.f;
      if (gamma && real) {
        a *= to_f32(gamma[k]);
        if (sumsq) atomicAdd(&sumsq[r], x * x);
      }
      xs[Layout::slot(q) * R + r] = from_f32<S>(a);
    }
  }
}

// The staging of a plain call (no gate, no norm, 16-byte aligned rows, K in one chunk, at most
// kMostLoads vectors of X a thread) in two halves: load() brings this thread's vectors of X into
// registers, store() writes them where stage_activations would. The whole-row walk issues its
// second step's weight loads between the two, so X's loads are not queued behind both steps'
// (BENCHMARKS.md, session 67: 1.02-1.05x at 1 row and 1.07-1.12x at 2 on 4096 x 11008, 14336 and
// 28672). The general walk keeps stage_activations: the halves around its loop's first loads
// compiled its register buffers to local memory, and written before the loop, spilled.
// kMostLoads: 2 vectors a thread, and 4 in a second kernel for 1-2 rows of 16-bit types where X
// needs more (K up to 16384 at 2 rows, 32768 at 1; launch). Session 68: that kernel made 2 rows on
// 11008 and 14336 x 4096 1.12-1.18x (2:8, 2:4, 1:4, 4:16); 4 loads in the one kernel of every call
// had made 4096 x 4096 0.97-0.99x at 1-2 rows. Session 69, at 1 row: 1.08-1.18x with a tile a block
// (28672 x 4096, 18944 x 3584), 1.01-1.03x where blocks walk several (but 1:8, 0.95-1.00x).
template <typename T, typename S, int R, typename Layout, int kMostLoads = 2>
struct StagingInHalves {
  static constexpr int VEC = 16 / sizeof(T);
  static constexpr int kRun = Layout::kRun > 0 ? Layout::kRun : VEC;
  uint4 held[kMostLoads];
  __host__ __device__ static int vectors(const DecodeParamsT<T>& p) {
    return p.staged_positions / kRun * (kRun / VEC) * R;
  }
  __host__ __device__ static bool applies(const DecodeParamsT<T>& p) {
    return p.glu == Glu::none && p.norm_weight == nullptr && p.k % VEC == 0 &&
           reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && p.chunk_groups >= p.groups &&
           vectors(p) <= kMostLoads * kThreads;
  }
  __device__ void load(const DecodeParamsT<T>& p) {
    const int runs = p.staged_positions / kRun;
#pragma unroll
    for (int j = 0; j < kMostLoads; ++j) {
      const int idx = threadIdx.x + j * kThreads;
      const int r = idx % R, q = staged_vector_position<VEC, kRun>(idx / R, runs);
      held[j] = make_uint4(0, 0, 0, 0);  // zeros past K and past the real rows
      if (idx < vectors(p) && q < p.k && r < p.rows)
        held[j] = __ldg(reinterpret_cast<const uint4*>(p.x + r * p.k + q));
    }
  }
  __device__ void store(const DecodeParamsT<T>& p, S* xs) const {
    const int runs = p.staged_positions / kRun;
#pragma unroll
    for (int j = 0; j < kMostLoads; ++j) {
      const int idx = threadIdx.x + j * kThreads;
      if (idx >= vectors(p)) continue;
      const int r = idx % R, q = staged_vector_position<VEC, kRun>(idx / R, runs);
#pragma unroll
      for (int i = 0; i < VEC; ++i) xs[Layout::slot(q + i) * R + r] = from_f32<S>(vec_entry<T>(held[j], i));
    }
  }
};

// One step of a warp: the 32 * U vectors starting at vb of row tile `tile`, in the K chunk that
// starts at group g0.
struct Step {
  int tile, g0, vb;
};

// Whether decode_kernel<T, R, kN, kM> has the whole-row walk (kWalkRows; launch says where it is
// taken): compile-time families whose vectors cover aligned runs, at 1-2 rows. 1:8 has it since X
// is staged in halves (session 68: 1.03-1.21x at 2 rows, 1.05-1.14x at 1 row where K > 4096; session
// 49, without the halves, had found it 0.96-1.00x as fast).
template <typename T, int R, int kN, int kM>
constexpr bool kHasRowWalk = run_positions<T, kN, kM>() > 0 && R <= 2;

// kN == 0: the pattern is read from the parameters (any valid N:M). kWalkRows: K fits one staged
// chunk, and the warps walk whole rows (below), staging X in halves of up to kXLoads vectors a
// thread (StagingInHalves).
template <typename T, int R, int kN, int kM, bool kWalkRows = false, int kXLoads = 2>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) decode_kernel(DecodeParamsT<T> p) {
  NMCLI_DECODE_STAMP(p, 0);
  using S = StageT<T, R>;
  constexpr int VEC = 16 / sizeof(T);             // entries per 16-byte vector
  constexpr int U = kVectorsPerLane;              // vectors per lane per step
  constexpr bool kStatic = kN > 0;
  // Compile-time families (N divides the vector, M a power of two): a vector's positions form
  // one aligned run, staged run-transposed, so its base slot is computed once and every entry
  // adds a constant plus its offset times 32 (compute_step).
  using Layout = LayoutFor<T, kN, kM>;
  constexpr bool kVectorBase = Layout::kRun > 0;
  const int n = kStatic ? kN : p.n;
  const int m = kStatic ? kM : p.m;
  const int bits = kStatic ? index_bits(kM) : p.bits;
  const int vec_bits = VEC * bits;                // offset bits of one vector (<= 40, byte-aligned for 16-bit T)
  const uint32_t mask = (1u << bits) - 1u;

  extern __shared__ __align__(16) unsigned char smem[];
  S* xs = reinterpret_cast<S*>(smem);
  // Row sums of squares of a normalised call, complete once the block's first tile has staged all of K.
  __shared__ float norm_sumsq[kDecodeMaxRows];
  // A normalised call clears them before its first staging. At 1-2 rows that happens before any
  // weight load is issued: a barrier there costs nothing, while one after the loads waits for the
  // slowest warp's offset words (0.3-0.5 us of the 1 x 4096 x 12288 call, BENCHMARKS.md session
  // 13). The kernels for more rows clear them at the first staging: clearing early compiled them
  // to 1.5-3x the register spills.
  constexpr bool kEarlyClear = R <= 2;
  if (kEarlyClear && p.norm_weight) {
    if (threadIdx.x < kDecodeMaxRows) norm_sumsq[threadIdx.x] = 0.f;
    __syncthreads();
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tiles = static_cast<int>((p.nout + kRowsPerBlock - 1) / kRowsPerBlock);
  const int groups = static_cast<int>(p.groups);
  const int chunk_groups = static_cast<int>(p.chunk_groups);
  const bool single_chunk = chunk_groups >= groups;  // activations staged once per block
  const int nvec = (groups * n + VEC - 1) / VEC;
  auto v_begin = [&](int g0) { return g0 * n / VEC; };  // chunks hold whole vectors
  auto v_end = [&](int g0) { return min((g0 + chunk_groups) * n / VEC, nvec); };
  auto row_of = [&](int tile) { return static_cast<int64_t>(tile) * kRowsPerBlock + warp; };

  // The warp's steps in order: along the chunk, then the next chunk, then the block's next tile.
  auto advance = [&](Step s) {
    s.vb += 32 * U;
    if (s.vb >= v_end(s.g0)) {
      s.g0 += chunk_groups;
      if (s.g0 >= groups) {
        s.g0 = 0;
        s.tile += gridDim.x;
      }
      s.vb = v_begin(s.g0);
    }
    return s;
  };

  // Offset bits of one vector: 32-bit when the compile-time pattern fits (every static family).
  using Off = std::conditional_t<(kStatic && VEC * index_bits(kStatic ? kM : 2) <= 32), uint32_t, uint64_t>;
  // A vector's offset bits arrive as the two index words they lie in (x, y), and compute_step
  // shifts them into place: shifting at the load made the warp wait for the next step's words
  // before it multiplied the current step (BENCHMARKS.md, session 16). Kernels with more rows
  // shift at the load (as a 64-bit value in x, y), because the deferred shift's live words
  // compiled them to register spills (-Xptxas=-v: 16-row fp16 38 -> 96 bytes, 4-8-row fp32
  // 0 -> 8-20 bytes).
  constexpr bool kDeferShift = R <= (sizeof(T) == 2 ? 8 : 2);
  auto vector_shift = [&](int v) { return static_cast<int>((static_cast<int64_t>(v) * vec_bits) & 31); };
  auto aligned = [](uint2 w, int shift) { return (static_cast<uint64_t>(w.y) << 32 | w.x) >> shift; };
  // Issues the loads of step s (zeros past the chunk and past Nout).
  auto load_step = [&](uint4 (&vals)[U], uint2 (&offs)[U], Step s) {
    const int64_t row = row_of(s.tile);
    const int end = v_end(s.g0);
    const T* vrow = p.values + row * p.row_len;
    const uint32_t* irow = p.indices + row * p.index_words;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = s.vb + lane + 32 * u;
      vals[u] = make_uint4(0, 0, 0, 0);
      offs[u] = make_uint2(0, 0);
      if (v < end && row < p.nout) {
        vals[u] = load_stream16(vrow + static_cast<int64_t>(v) * VEC);
        const int64_t bit = static_cast<int64_t>(v) * vec_bits;
        const uint32_t* wp = irow + (bit >> 5);
        offs[u].x = __ldg(wp);  // neighbouring lanes share index words: let L1 keep them
        if (static_cast<int>(bit & 31) + vec_bits > 32) offs[u].y = __ldg(wp + 1);
        if constexpr (!kDeferShift) {
          const uint64_t a = aligned(offs[u], vector_shift(v));
          offs[u] = make_uint2(static_cast<uint32_t>(a), static_cast<uint32_t>(a >> 32));
        }
      }
    }
  };

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;

  // Compile-time families: multiplies the vector `vals` of run `run` into acc, `offs` holding its
  // entries' offset fields from bit 0. Position d + off of the run sits d + off rows of 32 slots
  // below its first. Run slots use bits below 5 and from 5 + log2(run) up, and d + off < run, so in
  // bytes the entry's address is base | off << kRowShift, plus the constant d << kRowShift: one
  // shift and one LOP3 per entry move its offset field into place (the sum as written took five
  // integer instructions per entry, BENCHMARKS.md session 16).
  auto multiply_run = [&](const uint4& vals, Off offs, unsigned run) {
    if constexpr (kVectorBase) {
      static_assert((Layout::kRun & (Layout::kRun - 1)) == 0, "the OR needs a power-of-two run");
      constexpr int kRowShift = 5 + ilog2(R * static_cast<int>(sizeof(S)));
      const uint32_t base = static_cast<uint32_t>(Layout::run_slot(run)) << (kRowShift - 5);
      const unsigned char* xs_bytes = reinterpret_cast<const unsigned char*>(xs);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int d = (i / kN) * kM;
        const int up = kRowShift - i * bits;  // moves field i to bit kRowShift
        const Off field = up >= 0 ? offs << up : offs >> -up;
        const uint32_t at = (static_cast<uint32_t>(field) & (mask << kRowShift)) | base;
        float x[R];
        load_position<S, R>(reinterpret_cast<const S*>(xs_bytes + at + (d << kRowShift)), x);
        const float w = vec_entry<T>(vals, i);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = fmaf(w, x[r], acc[r]);
      }
    }
  };

  // Multiplies the step's entries into acc.
  auto compute_step = [&](const uint4 (&vals)[U], const uint2 (&words)[U], Step s) {
    const int end = v_end(s.g0);
    const int e_begin = s.g0 * n;  // first stored entry of the chunk; a multiple of VEC
    Off offs[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      offs[u] = static_cast<Off>(aligned(words[u], kDeferShift ? vector_shift(s.vb + lane + 32 * u) : 0));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = s.vb + lane + 32 * u;
      if (v >= end) continue;
      const int e0 = v * VEC - e_begin;  // entry index within the chunk
      if constexpr (kVectorBase) {
        multiply_run(vals[u], offs[u], static_cast<unsigned>(e0) / VEC);  // the vector covers run e0 / VEC
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const int pos = (e0 + i) / n * m + static_cast<int>((offs[u] >> (i * bits)) & mask);
          float x[R];
          load_position<S, R>(xs + Layout::slot(pos) * R, x);
          const float w = vec_entry<T>(vals[u], i);
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r] = fmaf(w, x[r], acc[r]);
        }
      }
    }
  };

  // Sums the row over the warp, writes it, and clears acc for the next row.
  auto finish_row = [&](int tile) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = acc[r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      acc[r] = s;
    }
    const int64_t row = row_of(tile);
    if (lane == 0 && row < p.nout) {
      const float b = p.bias ? to_f32(p.bias[row]) : 0.f;
      const OutputColumn<T> y = p.y.column(row);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        // A normalised row's 1 / rms, from the sum of squares of the block's first pass.
        const float scale = p.norm_weight ? rsqrtf(norm_sumsq[r] / static_cast<float>(p.k) + p.norm_epsilon) : 1.f;
        if (r < p.rows) y[r] = from_f32<T>(p.alpha * scale * acc[r] + b + residual_at(p, r, row));
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
  };

  // Before the first staging. The weights are constants, so the first steps' loads were issued
  // before this point; the activations (and every write) wait for the kernel that produced them.
  auto before_first_staging = [&]() {
    wait_for_previous_kernel();
    NMCLI_DECODE_STAMP(p, 1);
    allow_next_kernel();
    if (!kEarlyClear && p.norm_weight) {
      if (threadIdx.x < kDecodeMaxRows) norm_sumsq[threadIdx.x] = 0.f;
      __syncthreads();
    }
  };

  // Rows walked whole, K staged once (compile-time families, 1-2 rows): the general walk below
  // recomputes every step's row, chunk and 64-bit addresses (about 245 instructions a step of
  // 512 entries at 1 row, 2:8, against 80 for the multiplies: Nsight Compute, BENCHMARKS.md
  // session 49). Here a warp's cursor moves its lane's pointers along the row, and what depends
  // only on the lane -- each vector's offset word and shift, its run's slot -- is computed once.
  if constexpr (kWalkRows) {  // the general walk below is then unreachable
    static_assert(kHasRowWalk<T, R, kN, kM>, "the families and row counts that have it");
    static_assert(VEC * index_bits(kM) <= 32, "a vector's offset bits lie in two words, shifted into one");
    constexpr int kStepWords = U * VEC * index_bits(kM);  // offset words a step moves on (32 * U vectors)
    const int row_steps = (nvec + 32 * U - 1) / (32 * U);
    int lane_word[U], lane_shift[U];
    bool two_words[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int bit = (lane + 32 * u) * vec_bits;
      lane_word[u] = bit >> 5, lane_shift[u] = bit & 31, two_words[u] = (bit & 31) + vec_bits > 32;
    }
    struct Cursor {
      int tile, step;
      bool live;  // the warp's row exists
      const uint4* values;     // the lane's first vector of the step
      const uint32_t* words;   // the step's first offset word
    };
    auto row_start = [&](int tile) {
      const int64_t row = row_of(tile);
      const bool live = row < p.nout;
      const int64_t r = live ? row : 0;
      return Cursor{tile, 0, live, reinterpret_cast<const uint4*>(p.values + r * p.row_len) + lane,
                    p.indices + r * p.index_words};
    };
    auto next = [&](Cursor c) {
      if (++c.step == row_steps) return row_start(c.tile + gridDim.x);
      c.values += 32 * U, c.words += kStepWords;
      return c;
    };
    auto load = [&](uint4 (&v)[U], uint2 (&w)[U], const Cursor& c) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        v[u] = make_uint4(0, 0, 0, 0), w[u] = make_uint2(0, 0);
        if (c.live && c.step * 32 * U + lane + 32 * u < nvec) {
          v[u] = load_stream16(c.values + 32 * u);
          w[u].x = __ldg(c.words + lane_word[u]);
          if (two_words[u]) w[u].y = __ldg(c.words + lane_word[u] + 1);
        }
      }
    };
    auto multiply = [&](const uint4 (&v)[U], const uint2 (&w)[U], const Cursor& c) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int vec = c.step * 32 * U + lane + 32 * u;  // K staged from 0: vector vec covers run vec
        if (vec < nvec) multiply_run(v[u], static_cast<Off>(aligned(w[u], lane_shift[u])), static_cast<unsigned>(vec));
      }
    };
    // Two register buffers, as below: a step's buffer is refilled with the step after next as soon
    // as it has been multiplied; the first two steps' loads go out before the staging.
    static_assert(kDepth == 2, "two register buffers");
    uint4 v[2][U];
    uint2 w[2][U];
    Cursor current = row_start(static_cast<int>(blockIdx.x)), ahead = current;
    using Halves = StagingInHalves<T, S, R, Layout, kXLoads>;
    const bool in_halves = Halves::applies(p);
    Halves staging;
    load(v[0], w[0], current);
    if (in_halves) {  // X's loads go out between the two steps' (StagingInHalves)
      before_first_staging();
      staging.load(p);
    }
    ahead = next(ahead);
    if (ahead.tile < tiles) load(v[1], w[1], ahead);
    if (in_halves) {
      staging.store(p, xs);
    } else {
      before_first_staging();
      stage_activations<T, S, R, Layout>(p, xs, 0, p.norm_weight ? norm_sumsq : nullptr);
    }
    __syncthreads();
    NMCLI_DECODE_STAMP(p, 2);
    // One step from buffer b (a constant, so the buffers stay in registers); true when the walk ends.
    auto step = [&](auto b) {
      constexpr int kB = decltype(b)::value;
      multiply(v[kB], w[kB], current);
      if (current.step + 1 == row_steps) finish_row(current.tile);
      current = next(current);
      ahead = next(ahead);
      if (ahead.tile < tiles) load(v[kB], w[kB], ahead);
      return current.tile >= tiles;
    };
    while (!step(std::integral_constant<int, 0>{}) && !step(std::integral_constant<int, 1>{})) {
    }
    NMCLI_DECODE_STAMP(p, 3);
    return;
  }

  bool staged = false;
  // Stages the chunk's activations when the step opens it (block-uniform: every warp of the block
  // walks the same steps), multiplies, and finishes the row after its last step.
  auto process = [&](const uint4 (&vals)[U], const uint2 (&offs)[U], Step s, Step next) {
    if (s.vb == v_begin(s.g0) && (!staged || !single_chunk)) {
      if (staged)
        __syncthreads();  // every warp is done with the previous chunk
      else
        before_first_staging();
      const bool first_pass = s.tile == static_cast<int>(blockIdx.x);
      stage_activations<T, S, R, Layout>(p, xs, static_cast<int64_t>(s.g0) * m,
                                         p.norm_weight && first_pass ? norm_sumsq : nullptr);
      __syncthreads();
      if (!staged) {
        NMCLI_DECODE_STAMP(p, 2);
      }
      staged = true;
    }
    compute_step(vals, offs, s);
    if (next.tile != s.tile) finish_row(s.tile);
  };

  // Software pipeline, kDepth register buffers: the next steps' loads (possibly the next rows')
  // are in flight while the current one is multiplied, so a warp never waits a full memory
  // latency between rows. The block walks tiles blockIdx.x, + gridDim.x, ... (a persistent grid).
  uint4 vals[kDepth][U];
  uint2 offs[kDepth][U];
  Step current{static_cast<int>(blockIdx.x), 0, 0}, ahead = current;
  load_step(vals[0], offs[0], current);
#pragma unroll
  for (int d = 1; d < kDepth - 1; ++d) {
    ahead = advance(ahead);
    if (ahead.tile < tiles) load_step(vals[d], offs[d], ahead);
  }
  for (;;) {
#pragma unroll
    for (int b = 0; b < kDepth; ++b) {
      ahead = advance(ahead);
      if (ahead.tile < tiles) load_step(vals[(b + kDepth - 1) % kDepth], offs[(b + kDepth - 1) % kDepth], ahead);
      const Step next = advance(current);
      process(vals[b], offs[b], current, next);
      if (next.tile >= tiles) {
        NMCLI_DECODE_STAMP(p, 3);
        return;
      }
      current = next;
    }
  }
}

// Blocks of decode_kernel<T, R, kN, kM> resident per SM with `smem` bytes of dynamic shared
// memory (at least 1); remembered per kernel for the last size asked, nearly always the next one.
template <typename T, int R, int kN, int kM, bool kWalkRows, int kXLoads>
int resident_blocks(size_t smem) {
  static std::atomic<uint64_t> last{0};  // smem << 8 | blocks
  const uint64_t seen = last.load(std::memory_order_relaxed);
  if (seen != 0 && (seen >> 8) == smem) return static_cast<int>(seen & 0xff);
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, decode_kernel<T, R, kN, kM, kWalkRows, kXLoads>, kThreads,
                                                    smem) != cudaSuccess ||
      blocks < 1)
    blocks = 1;
  blocks = std::min(blocks, 255);
  last.store((static_cast<uint64_t>(smem) << 8) | static_cast<uint64_t>(blocks), std::memory_order_relaxed);
  return blocks;
}

// Groups of K staged per shared-memory chunk: whole vectors (a multiple of VEC, so no vector
// straddles two chunks), leaving VEC groups of slack for the zero padding entries of a row's last
// vector. One chunk when the whole K fits: the activations are then staged once per block, not
// once per tile.
template <typename T, int R, int kN, int kM>
int64_t chunk_groups(int64_t groups, int m) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kPositionBytes = R * static_cast<int>(sizeof(StageT<T, R>));
  const int64_t budget_positions = LayoutFor<T, kN, kM>::positions_within(kStageBytes / kPositionBytes);
  const int64_t chunk = std::max<int64_t>(VEC, (budget_positions / m - VEC) / VEC * VEC);
  return std::min(chunk, (groups + VEC - 1) / VEC * VEC);
}

template <int V>
using Int = std::integral_constant<int, V>;

template <typename T, int R, int kN, int kM>
cudaError_t launch(DecodeParamsT<T> p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  p.chunk_groups = chunk_groups<T, R, kN, kM>(p.groups, p.m);
  p.staged_positions = static_cast<int>((p.chunk_groups + VEC) * p.m);
  const size_t smem =
      static_cast<size_t>(LayoutFor<T, kN, kM>::capacity(p.staged_positions)) * R * sizeof(StageT<T, R>);

  // Persistent grid (persistent_blocks): the activations are staged once per block and no wave of
  // blocks drains the memory pipe. Programmatic dependent launch: the grid may start while the
  // previous kernel drains, so its launch and first weight loads overlap that kernel's tail
  // (decode calls are a few us long).
  const int64_t tiles = (p.nout + kRowsPerBlock - 1) / kRowsPerBlock;
  // Raises the kernel's shared-memory cap, then counts the blocks the GPU holds at once.
  // walk_rows, x_loads: decode_kernel's kWalkRows and kXLoads, as integral constants.
  auto slots_of = [&](auto walk_rows, auto x_loads, int64_t& slots) {
    if (cudaError_t e = allow_dynamic_smem<decode_kernel<T, R, kN, kM, walk_rows(), x_loads()>>(kStageBytes + 4096);
        e != cudaSuccess)
      return e;
    slots = static_cast<int64_t>(resident_blocks<T, R, kN, kM, walk_rows(), x_loads()>(smem)) * multiprocessor_count();
    return cudaSuccess;
  };
  auto launch_kernel = [&](auto walk_rows, auto x_loads, int64_t slots) {
    return launch_split_k(decode_kernel<T, R, kN, kM, walk_rows(), x_loads()>, dim3(persistent_blocks(tiles, slots)),
                          kThreads, smem, stream, 1, true, p);
  };
  int64_t slots = 0;
  // The whole-row walk where K is staged once and blocks walk more than one tile; since it stages X
  // in halves (session 67), also calls it stages in halves where each block has one tile: at 2
  // rows, and at 1 row where the tiles fill at least three quarters of the slots (gated and
  // normalised calls, staged at once, keep the general walk there). Measured against the general
  // walk (BENCHMARKS.md), 2:8, 2:4, 1:4 and 4:16 at 1-2 rows:
  //  * session 49: 1.00-1.06x on 4096 x 11008, 14336 and 28672 (3-7 tiles a block), 0.98-1.03x on
  //    4096 x 12288; with a tile a block 0.98-1.01x on 14336 x 4096 and 0.93-1.00x on 4096 x 4096;
  //  * session 67, with the halves and a tile a block: at 1 row 1.10-1.15x on 11008 and 14336 x 4096
  //    and 1.01-1.02x on 4096 x 4096 (128 tiles on 132 slots), 0.99-1.01x at 112 tiles, but
  //    0.93-0.99x for 2:8, 1:4 and 4:16 at 32 and 64 tiles (4:16 0.94-0.97x at 80-96); at 2 rows
  //    1.00-1.24x on 4096 x 1024, 2048 and 4096 and 11008 and 14336 x 4096.
  // 1:8 at 1 row only where a row is more than one step (32 * kVectorsPerLane vectors): session 68,
  // at K = 4096 (one step a row) 0.97-0.99x on 4096 x 4096, 8192, 11008 and 14336, while 2:8, 1:4,
  // 4:16 and 2:4 on rows of one step (K = 1024-2048) gained up to 1.06x from the whole-row walk.
  if constexpr (kHasRowWalk<T, R, kN, kM>) {
    const int64_t row_vectors = (p.groups * p.n + VEC - 1) / VEC;
    const bool one_step_rows_of_1_8 = kN == 1 && kM == 8 && R == 1 && row_vectors <= 32 * kVectorsPerLane;
    if (p.chunk_groups >= p.groups && !one_step_rows_of_1_8) {
      using Layout = LayoutFor<T, kN, kM>;
      const bool halves = StagingInHalves<T, StageT<T, R>, R, Layout>::applies(p);
      // Where the halves take a call: at 2 rows every grid, at 1 row grids that fill at least three
      // quarters of the slots (so every grid whose blocks walk several tiles).
      auto halves_take = [&] { return R == 2 || 4 * tiles >= 3 * slots; };
      // 16-bit X past 2 vectors a thread (2 rows past K = 8192, 1 row past 16384): the kernel that
      // holds 4. At 1 row 1:8 takes it only with a tile a block: where blocks walk several tiles it
      // ran 0.95-1.00x the one-piece staging (session 69, 20480 x 5120, 27648 x 5120, 28672 x 8192).
      if constexpr (sizeof(T) == 2) {
        if (!halves && StagingInHalves<T, StageT<T, R>, R, Layout, 4>::applies(p)) {
          if (cudaError_t e = slots_of(std::true_type{}, Int<4>{}, slots); e != cudaSuccess) return e;
          const bool one_piece_1_8 = R == 1 && kN == 1 && kM == 8 && tiles > slots;
          if (halves_take() && !one_piece_1_8) return launch_kernel(std::true_type{}, Int<4>{}, slots);
        }
      }
      if (cudaError_t e = slots_of(std::true_type{}, Int<2>{}, slots); e != cudaSuccess) return e;
      if (tiles > slots || (halves && halves_take())) return launch_kernel(std::true_type{}, Int<2>{}, slots);
    }
  }
  if (cudaError_t e = slots_of(std::false_type{}, Int<2>{}, slots); e != cudaSuccess) return e;
  return launch_kernel(std::false_type{}, Int<2>{}, slots);
}

// Calls f(Int<R>, Int<kN>, Int<kM>) for the kernel that serves `rows` (1..16) activation rows of
// pattern n:m: R = rows padded to 1, 2, 4, 8 or 16; the families users prune to are compiled with
// constant N:M, any other pattern runs the generic kernel (kN = kM = 0).
template <typename F>
auto with_kernel(int64_t rows, int n, int m, F&& f) {
  auto by_pattern = [&](auto r) {
    switch (n * 64 + m) {
      case 1 * 64 + 4: return f(r, Int<1>{}, Int<4>{});
      case 2 * 64 + 4: return f(r, Int<2>{}, Int<4>{});
      case 1 * 64 + 8: return f(r, Int<1>{}, Int<8>{});
      case 2 * 64 + 8: return f(r, Int<2>{}, Int<8>{});
      case 4 * 64 + 8: return f(r, Int<4>{}, Int<8>{});
      case 4 * 64 + 16: return f(r, Int<4>{}, Int<16>{});
      default: return f(r, Int<0>{}, Int<0>{});
    }
  };
  if (rows <= 1) return by_pattern(Int<1>{});
  if (rows <= 2) return by_pattern(Int<2>{});
  if (rows <= 4) return by_pattern(Int<4>{});
  if (rows <= 8) return by_pattern(Int<8>{});
  return by_pattern(Int<16>{});
}

template <typename T>
cudaError_t run(DecodeParamsT<T> p, cudaStream_t stream) {
  if (p.rows < 1 || p.rows > kDecodeMaxRows) return cudaErrorInvalidValue;
  return with_kernel(p.rows, p.n, p.m, [&](auto r, auto n, auto m) {
    return launch<T, decltype(r)::value, decltype(n)::value, decltype(m)::value>(p, stream);
  });
}

template <typename T>
bool stages_once(int64_t rows, int n, int m, int64_t groups) {
  if (rows < 1 || rows > kDecodeMaxRows) return false;
  return with_kernel(rows, n, m, [&](auto r, auto kn, auto km) {
    return chunk_groups<T, decltype(r)::value, decltype(kn)::value, decltype(km)::value>(groups, m) >= groups;
  });
}

}  // namespace decode

#define NMCLI_INSTANTIATE_DECODE(T)                                                              \
  template <> cudaError_t run_decode<T>(DecodeParamsT<T> p, cudaStream_t stream) { return decode::run<T>(p, stream); } \
  template <> bool decode_stages_once<T>(int64_t rows, int n, int m, int64_t groups) {            \
    return decode::stages_once<T>(rows, n, m, groups);                                            \
  }

}  // namespace nmcli
