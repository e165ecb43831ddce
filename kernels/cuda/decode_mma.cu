// Decode-sized calls (1..16 activation rows) on the tensor cores, fp16/bf16, for the families with
// one or two entries in groups of 4 or 8 (1:4, 2:4, 1:8, 2:8).
//
// Why: the SIMT decode kernel multiplies every stored entry by every row in fp32, after one
// 16-to-32-bit conversion per entry and row; from 4 rows on that, not the bytes, sets its time
// (4096 x 4096 2:8: 5.9 us at 1 row, 13 us at 8, 25 at 16, for 10 MB). Here mma.sync m16n8k16
// does the products with the activation rows as its M = 16 side, so rows cost little up to 16
// (10.1 us at 8 rows, 12.5 at 16), and its work per stored entry is building the dense weight
// fragment. At 1 row it is slower than decode (9.2 us), bound by that work and by latency: 8 warps
// per SM (BENCHMARKS.md session 35).
//  * The weight fragment is built in registers, never in shared memory: lane (g, q) of a warp
//    holds, per 16-position slab, positions 2q, 2q+1 and 2q+8, 2q+9 of weight column g. Those two
//    positions lie in one group; a PRMT picks each half from the group's value word (or zero) with
//    a selector looked up by the group's offset field in a per-lane table (one shared-memory word
//    per lane and field, lane-strided, so the 32 lookups of a warp never share a bank).
//  * Each warp owns 16 output columns (two n8 tiles) and a share of K: a block's 8 warps split a
//    column tile's K steps and sum their partial tiles through shared memory. The block walks
//    column tiles blockIdx.x, + gridDim.x, ... (one block per SM) and stages the activations once.
//  * A step is 32 stored entries of each of the warp's 16 columns (the row padding unit of the
//    format, so no step runs past a row). Its values and offset words go global -> shared with
//    cp.async into a ring of kDepth steps per warp; the first steps are issued before the kernel
//    waits on the previous one (the weights are constants), like the decode kernel.
//  * The activations are staged as T, rows of the 16 (or 8) MMA rows, zeros past K and past the
//    call's rows; the gated and normalised prologues (kernels/fusion.h) are applied while staging,
//    and a normalised row's 1 / rms scales its sums at the end, as in the decode kernel.
#include <algorithm>
#include <type_traits>

#include "async_copy.cuh"
#include "common.cuh"
#include "kernels.cuh"
#include "mma_sync.cuh"

namespace nmcli {
namespace decode_mma {

using sm90::cp_async16;
using sm90::cp_async4;
using sm90::cp_async_commit;
using sm90::cp_async_wait;
using sm90::smem_addr;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kColumns = 16;       // output columns per warp: two n8 MMA tiles
constexpr int kStepEntries = 32;   // stored entries of a column per step
constexpr int kDepth = 4;          // steps per warp in flight (the cp.async ring)
// A stage: each column's 64 bytes of values in a 80-byte row (so the 8 columns one LDS.128 reads
// fall in different banks), then each column's offset words in a 16-byte row.
constexpr int kValueRowWords = 20;
constexpr int kValueBytes = kColumns * kValueRowWords * 4;
constexpr int kStageBytes = kValueBytes + kColumns * 16;
constexpr int kSmemLimit = 226 * 1024;  // of 227 KB per block, leaving the static norm sums room

template <int kN, int kM>
struct Family {
  static constexpr int kBits = index_bits(kM);
  static constexpr int kFieldBits = kN * kBits;          // offset bits of one group
  static constexpr int kFields = 1 << kFieldBits;
  static constexpr int kPositions = kStepEntries * kM / kN;  // K positions a step covers
  static constexpr int kSlabs = kPositions / 16;             // MMAs of 16 positions per step
  static_assert((kN == 1 || kN == 2) && (kM == 4 || kM == 8), "groups of 4 or 8 with one or two entries");
};

// The selectors of lane `lane` for a group whose offset field is `field`: bits 0-15 build the
// lane's word at slab positions 2q, 2q+1 (first B register), bits 16-31 the one at 2q+8, 2q+9.
// PRMT(0, V, selector) with V the 32-bit word holding the group's values: nibbles 4/5 take V's low
// half, 6/7 its high half, 0 a zero byte.
template <int kN, int kM>
__host__ __device__ constexpr uint32_t selectors(int field, int lane) {
  constexpr int kBits = index_bits(kM);
  const int q = lane & 3;
  uint32_t both = 0;
  for (int w = 0; w < 2; ++w) {
    const int position = 2 * q + 8 * w, group = position / kM, t = position % kM;
    uint32_t selector = 0;
    for (int e = 0; e < kN; ++e) {
      const int offset = (field >> (e * kBits)) & ((1 << kBits) - 1);
      const int half = kN == 2 ? e : (group & 1);  // which half of V holds entry e
      const uint32_t code = static_cast<uint32_t>((4 + 2 * half) | (5 + 2 * half) << 4);
      if (offset == t) selector |= code;
      if (offset == t + 1) selector |= code << 8;
    }
    both |= selector << (16 * w);
  }
  return both;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// `width` bits at compile-time bit `bit` of the little-endian string in w[].
template <int bit, int width>
__device__ __forceinline__ uint32_t bits_at(const uint32_t (&w)[4]) {
  static_assert(bit + width <= 128, "the string has 4 words");
  constexpr int word = bit / 32, shift = bit % 32;
  constexpr uint32_t mask = (1u << width) - 1u;
  if constexpr (shift + width <= 32) return (w[word] >> shift) & mask;
  else return __funnelshift_r(w[word], w[word + 1], shift) & mask;
}

template <int V>
using Int = std::integral_constant<int, V>;

// f(Int<0>{}), ..., f(Int<kCount - 1>{}): a loop whose index is a constant in its body.
template <int kCount, int I = 0, typename F>
__device__ __forceinline__ void unrolled(F&& f) {
  if constexpr (I < kCount) {
    f(Int<I>{});
    unrolled<kCount, I + 1>(f);
  }
}

// Shared memory: the selector table, the warps' rings, two sets of partial tiles, the activations.
template <int R, int kN, int kM>
struct Layout {
  static constexpr int kTableBytes = Family<kN, kM>::kFields * 32 * 4;
  static constexpr int kRingBytes = kWarps * kDepth * kStageBytes;
  static constexpr int kPartialBytes = 2 * kWarps * R * kColumns * 4;
  static constexpr int kRingOffset = kTableBytes;
  static constexpr int kPartialOffset = kRingOffset + kRingBytes;
  static constexpr int kXOffset = kPartialOffset + kPartialBytes;
  // Staged positions per row: every position a stored entry can name, plus 8 so that rows start
  // 16 bytes apart modulo 128 and ldmatrix's 8 row addresses hit different banks.
  static int64_t staged(int64_t row_len) { return row_len / kStepEntries * Family<kN, kM>::kPositions; }
  static int64_t bytes(int64_t row_len) { return kXOffset + static_cast<int64_t>(R) * (staged(row_len) + 8) * 2; }
};

// Stages A (X, gated, or X * norm_weight) for rows [0, R) and positions [0, staged) as T: zeros
// past K and past the call's rows. With `sumsq`, adds each row's sum of squares of X into it.
// Needs K % 8 == 0 and 16-byte aligned X, x_up and norm_weight (decode_mma_supported). X as it is
// goes over with cp.async, every copy in flight at once; a prologue's loads go 4 rows at a time
// (one row at a time, each thread's loads waited for one after another: 1 row 10.2 us, 8 rows
// 15.1 us on 4096 x 4096 in run A).
template <typename T, int R>
__device__ __forceinline__ void stage_activations(const PathParams<T>& p, T* xs, int stride, int staged, float* sumsq) {
  const bool gate = p.glu != Glu::none;
  const T* gamma = p.norm_weight;
  const int chunks = staged / 8;  // 16-byte chunks per row
  if (!gate && !gamma) {
    for (int idx = threadIdx.x; idx < R * chunks; idx += kThreads) {
      const int r = idx / chunks;
      const int64_t k = static_cast<int64_t>(idx - r * chunks) * 8;
      const bool real = r < p.rows && k < p.k;
      sm90::cp_async16(sm90::smem_addr(xs + r * stride + k), real ? p.x + r * p.k + k : p.x, real);
    }
    sm90::cp_async_commit();
    sm90::cp_async_wait<0>();
    return;
  }
  constexpr int kBatch = 4;
  for (int r0 = 0; r0 < R; r0 += kBatch) {
    float squares[kBatch] = {};
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      const int64_t k = static_cast<int64_t>(c) * 8;
      uint4 v[kBatch], u[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int r = r0 + b;
        v[b] = u[b] = make_uint4(0, 0, 0, 0);
        if (r < p.rows && k < p.k) {
          v[b] = __ldg(reinterpret_cast<const uint4*>(p.x + r * p.k + k));
          u[b] = __ldg(reinterpret_cast<const uint4*>((gate ? p.x_up + r * p.k : gamma) + k));
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        uint32_t out[4];
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
          float a[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float x = vec_entry<T>(v[b], i + j), w = vec_entry<T>(u[b], i + j);
            squares[b] = fmaf(x, x, squares[b]);
            a[j] = gate ? gated_activation(p.glu, x, w) : x * w;
          }
          const T lo = from_f32<T>(a[0]), hi = from_f32<T>(a[1]);
          out[i / 2] = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&lo)) |
                       static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hi)) << 16;
        }
        *reinterpret_cast<uint4*>(xs + (r0 + b) * stride + k) = make_uint4(out[0], out[1], out[2], out[3]);
      }
    }
    if (sumsq) {
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        float sq = squares[b];
        for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        if ((threadIdx.x & 31) == 0) atomicAdd(&sumsq[r0 + b], sq);
      }
    }
  }
}

template <typename T, int R, int kN, int kM>
__global__ void __launch_bounds__(kThreads, 1) decode_mma_kernel(PathParams<T> p) {
  using F = Family<kN, kM>;
  using L = Layout<R, kN, kM>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float norm_sumsq[R];
  uint32_t* table = reinterpret_cast<uint32_t*>(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  unsigned char* ring = smem + L::kRingOffset + warp * kDepth * kStageBytes;
  float* partials = reinterpret_cast<float*>(smem + L::kPartialOffset);
  T* xs = reinterpret_cast<T*>(smem + L::kXOffset);
  const int steps = static_cast<int>(p.row_len / kStepEntries);
  const int staged = steps * F::kPositions, stride = staged + 8;
  const int tiles = static_cast<int>((p.nout + kColumns - 1) / kColumns);
  // This warp's share of every tile's steps.
  const int first = warp * steps / kWarps, last = (warp + 1) * steps / kWarps;

  struct Step {
    int tile, step;
  };
  auto advance = [&](Step s) {
    if (++s.step >= last) {
      s.step = first;
      s.tile += gridDim.x;
    }
    return s;
  };
  // Copies step s's values and offset words into ring slot `slot` (zeros past Nout); always
  // commits a group, so every warp counts its groups alike.
  auto issue = [&](Step s, int slot) {
    if (first < last && s.tile < tiles) {
      unsigned char* stage = ring + slot * kStageBytes;
      const int64_t col0 = static_cast<int64_t>(s.tile) * kColumns;
#pragma unroll
      for (int i = lane; i < kColumns * 4; i += 32) {
        const int col = i >> 2, part = i & 3;
        const bool valid = col0 + col < p.nout;
        const T* src = p.values + (valid ? (col0 + col) * p.row_len + s.step * kStepEntries + part * 8 : 0);
        cp_async16(smem_addr(stage + col * kValueRowWords * 4 + part * 16), src, valid);
      }
      for (int i = lane; i < kColumns * F::kBits; i += 32) {
        const int col = i / F::kBits, word = i % F::kBits;
        const bool valid = col0 + col < p.nout;
        const uint32_t* src = p.indices + (valid ? (col0 + col) * p.index_words + s.step * F::kBits + word : 0);
        cp_async4(smem_addr(stage + kValueBytes + col * 16 + word * 4), src, valid);
      }
    }
    cp_async_commit();
  };

  // The weights are constants: the table and the first steps' copies go out before the wait.
  for (int i = threadIdx.x; i < F::kFields * 32; i += kThreads) table[i] = selectors<kN, kM>(i >> 5, i & 31);
  Step next{static_cast<int>(blockIdx.x), first};
#pragma unroll
  for (int d = 0; d < kDepth - 1; ++d) {
    issue(next, d);
    next = advance(next);
  }
  wait_for_previous_kernel();
  allow_next_kernel();
  if (p.norm_weight) {
    if (threadIdx.x < R) norm_sumsq[threadIdx.x] = 0.f;
    __syncthreads();
  }
  stage_activations<T, R>(p, xs, stride, staged, p.norm_weight ? norm_sumsq : nullptr);
  __syncthreads();

  // The lane's weight columns are g and 8 + g of the stage. Its group in a slab is `lane_group`
  // groups past the slab's first (q / 2 for groups of 4, 0 for groups of 8): its offset fields sit
  // that many fields further along the step's offset string than the compile-time positions below.
  const int lane_group = kM == 4 ? q >> 1 : 0;
  const uint32_t* lane_table = table + lane;
  // ldmatrix row addresses of the activation fragment: rows 0-15 (or 0-7), positions +0 / +8.
  const T* x_lane = R == 16 ? xs + (lane & 15) * stride + (lane >> 4) * 8
                            : xs + (lane & 7) * stride + ((lane >> 3) & 1) * 8;

  // acc[slab % 2][h]: two chains of dependent MMAs per n8 tile instead of one.
  auto multiply = [&](const unsigned char* stage, int step, float (&acc)[2][2][4]) {
    // The step's values and offset words of the lane's two columns, in registers.
    uint32_t values[2][16], offsets[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4* column = reinterpret_cast<const uint4*>(stage + (8 * h + g) * kValueRowWords * 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 v = column[i];
        values[h][4 * i] = v.x, values[h][4 * i + 1] = v.y, values[h][4 * i + 2] = v.z, values[h][4 * i + 3] = v.w;
      }
      const uint4 w = *reinterpret_cast<const uint4*>(stage + kValueBytes + (8 * h + g) * 16);
      offsets[h][0] = w.x, offsets[h][1] = w.y, offsets[h][2] = w.z, offsets[h][3] = w.w;
      if constexpr (kM == 4) {  // a 64-bit string: move the lane's first field to bit 0
        const uint64_t s = (static_cast<uint64_t>(w.y) << 32 | w.x) >> (lane_group * F::kFieldBits);
        offsets[h][0] = static_cast<uint32_t>(s), offsets[h][1] = static_cast<uint32_t>(s >> 32);
      }
    }
    const T* x_step = x_lane + step * F::kPositions;
    unrolled<F::kSlabs>([&](auto slab_constant) {
      constexpr int slab = decltype(slab_constant)::value;
      uint32_t a[4];
      if constexpr (R == 16) {
        ldmatrix_x4(a, x_step + slab * 16);
      } else {
        ldmatrix_x2(a[0], a[2], x_step + slab * 16);
        a[1] = a[3] = 0u;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t b[2];
        unrolled<2>([&](auto w_constant) {
          constexpr int w = decltype(w_constant)::value;
          // The word's group within the step: this constant, plus lane_group.
          constexpr int kGroup = slab * (16 / kM) + 8 * w / kM;
          const uint32_t field = bits_at<kGroup * F::kFieldBits, F::kFieldBits>(offsets[h]);
          uint32_t selector = lane_table[field << 5];
          if constexpr (kN == 1 && kM == 8) selector >>= 16 * w;  // the only family whose two words differ
          // The 32-bit word holding the group's values: entries 2G, 2G + 1 (N = 2) or G (N = 1).
          uint32_t word;
          if constexpr (kN == 1) word = values[h][kGroup >> 1];  // kGroup even where lane_group may be 1
          else if constexpr (kM == 8) word = values[h][kGroup];
          else word = lane_group ? values[h][kGroup + 1] : values[h][kGroup];
          b[w] = prmt(0u, word, selector);
        });
        mma_16816<T>(acc[slab & 1][h], a, b);
      }
    });
  };

  int walked = 0;  // steps this warp has multiplied: its ring position
  int parity = 0;  // which set of partial tiles this tile uses
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, parity ^= 1) {
    float acc[2][2][4] = {};
    for (int step = first; step < last; ++step, ++walked) {
      issue(next, (walked + kDepth - 1) % kDepth);  // the slot multiplied one step ago
      next = advance(next);
      cp_async_wait<kDepth - 1>();
      __syncwarp();
      multiply(ring + (walked % kDepth) * kStageBytes, step, acc);
      __syncwarp();
    }
    // Accumulator (row g + 8 * (j / 2), column 8h + 2q + j % 2) of this warp's partial tile.
    float* mine = partials + (parity * kWarps + warp) * R * kColumns;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = g + 8 * (j >> 1);
        if (row < R) mine[row * kColumns + 8 * h + 2 * q + (j & 1)] = acc[0][h][j] + acc[1][h][j];
      }
    __syncthreads();
    // One output per thread: row t / 16, column t % 16 of the tile.
    const int row = threadIdx.x / kColumns, col = threadIdx.x % kColumns;
    const int64_t out_col = static_cast<int64_t>(tile) * kColumns + col;
    if (row < R && row < p.rows && out_col < p.nout) {
      const float* set = partials + parity * kWarps * R * kColumns + row * kColumns + col;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += set[w * R * kColumns];
      const float scale = p.norm_weight ? rsqrtf(norm_sumsq[row] / static_cast<float>(p.k) + p.norm_epsilon) : 1.f;
      const float b = p.bias ? to_f32(p.bias[out_col]) : 0.f;
      p.y.column(out_col)[row] = from_f32<T>(p.alpha * scale * sum + b + residual_at(p, row, out_col));
    }
  }
  cp_async_wait<0>();
}

template <typename T, int R, int kN, int kM>
cudaError_t launch(const PathParams<T>& p, cudaStream_t stream) {
  const int64_t smem = Layout<R, kN, kM>::bytes(p.row_len);
  if (smem > kSmemLimit) return cudaErrorInvalidValue;
  if (cudaError_t e = allow_dynamic_smem<decode_mma_kernel<T, R, kN, kM>>(kSmemLimit); e != cudaSuccess) return e;
  // One block per SM, walking column tiles (persistent_blocks); programmatic dependent launch.
  const int64_t tiles = (p.nout + kColumns - 1) / kColumns;
  return launch_split_k(decode_mma_kernel<T, R, kN, kM>, dim3(persistent_blocks(tiles, multiprocessor_count())),
                        kThreads, static_cast<size_t>(smem), stream, 1, true, p);
}

// Calls f(Int<R>, Int<kN>, Int<kM>) for the kernel of `rows` activation rows (R = 8 up to 8, else
// 16) and pattern n:m; returns `otherwise` for a family this path does not compile.
template <typename F, typename Otherwise>
auto with_kernel(int64_t rows, int n, int m, F&& f, Otherwise otherwise) {
  auto by_pattern = [&](auto r) {
    switch (n * 64 + m) {
      case 1 * 64 + 4: return f(r, Int<1>{}, Int<4>{});
      case 2 * 64 + 4: return f(r, Int<2>{}, Int<4>{});
      case 1 * 64 + 8: return f(r, Int<1>{}, Int<8>{});
      case 2 * 64 + 8: return f(r, Int<2>{}, Int<8>{});
      default: return otherwise;
    }
  };
  return rows <= 8 ? by_pattern(Int<8>{}) : by_pattern(Int<16>{});
}

}  // namespace decode_mma

bool decode_mma_supported(int64_t rows, int n, int m, int64_t k) {
  if (rows < 1 || rows > kDecodeMaxRows || k % 8 != 0 || compute_capability() < 80) return false;
  const int64_t row_len = NMShape::make(k, 1, n, m).row_len;
  return decode_mma::with_kernel(
      rows, n, m,
      [&](auto r, auto kn, auto km) {
        return decode_mma::Layout<decltype(r)::value, decltype(kn)::value, decltype(km)::value>::bytes(row_len) <=
               decode_mma::kSmemLimit;
      },
      false);
}

template <typename T>
cudaError_t run_decode_mma(PathParams<T> p, cudaStream_t stream) {
  if constexpr (sizeof(T) != 2) {
    return cudaErrorInvalidValue;
  } else {
    return decode_mma::with_kernel(
        p.rows, p.n, p.m,
        [&](auto r, auto kn, auto km) {
          return decode_mma::launch<T, decltype(r)::value, decltype(kn)::value, decltype(km)::value>(p, stream);
        },
        cudaErrorInvalidValue);
  }
}

template cudaError_t run_decode_mma<float>(PathParams<float>, cudaStream_t);
template cudaError_t run_decode_mma<__half>(PathParams<__half>, cudaStream_t);
template cudaError_t run_decode_mma<__nv_bfloat16>(PathParams<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
