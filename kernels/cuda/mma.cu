// Tensor-core path for fp16/bf16 with M in {2, 4, 8, 16} (any N): "load sparse, compute dense".
// Per K step of 64 positions (64/M whole groups) a block
//  * stages a [BM x 64] activation tile in shared memory;
//  * expands the [BN x 64] weight tile from the packed format straight into dense rows (zeros
//    between the stored entries), written with 16-byte stores, so the expansion costs no extra
//    shared-memory pass;
//  * runs mma.sync m16n8k16 (fp32 accumulate) on ldmatrix fragments; each warp owns a
//    (BM/2) x (BN/4) tile of the output.
// For K % 8 == 0 and N a power of two with M <= 8N, the next step's activations and packed
// weights are loaded into registers while the current step's MMAs run (one step of prefetch).
// Rows are padded by 8 elements so ldmatrix's eight row addresses fall in different banks.
// Other patterns and fp32 run on the tiled SIMT path (tiled.cu).
//
// Split-K over a thread-block cluster (sm_90): when the output has too few tiles to fill the
// GPU (few rows, or a narrow output), each tile is computed by a cluster of up to 8 blocks,
// each walking a slice of K; the partial tiles are summed through distributed shared memory
// (split_k.cuh). A block's K walk is a chain of dependent
// load -> expand -> MMA steps, so walking a slice instead of all of K is what makes small-row
// calls fast.
#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "kernels.cuh"
#include "mma_sync.cuh"
#include "split_k.cuh"

namespace nmcli {
namespace {

constexpr int kThreads = 256;
// Warp layout of a block tile: 2 x 4 warps for 64- and 128-row tiles, 1 x 8 for the 16-row
// tile used for 1..16 activation rows (each warp then owns 16 rows x BN/8 columns).
template <int BM> __host__ __device__ constexpr int warps_m() { return BM >= 64 ? 2 : 1; }
template <int BM> __host__ __device__ constexpr int warps_n() { return 8 / warps_m<BM>(); }
constexpr int BK = 64, LDS = BK + 8;

// Scalar staging for activations that cannot be read as 16-byte vectors (K % 8 != 0).
template <typename T, int BM>
__device__ __forceinline__ void stage_activations(const PathParams<T>& p, T (*xs)[LDS], int64_t row0, int64_t k0) {
  for (int idx = threadIdx.x; idx < BM * BK; idx += kThreads) {
    const int r = idx / BK, c = idx % BK;
    const int64_t row = row0 + r, k = k0 + c;
    xs[r][c] = (row < p.rows && k < p.k) ? p.x[row * p.k + k] : from_f32<T>(0.f);
  }
}

// Writes kValues expanded 16-bit values (kValues / 2 packed words) to a weight-tile row with the
// widest stores their alignment allows (dense runs start on a multiple of their own length).
template <int kValues, typename T>
__device__ __forceinline__ void store_dense(T* dst, const uint32_t* dense) {
  if constexpr (kValues % 8 == 0) {
#pragma unroll
    for (int q = 0; q < kValues / 8; ++q)
      reinterpret_cast<uint4*>(dst)[q] = make_uint4(dense[4 * q], dense[4 * q + 1], dense[4 * q + 2], dense[4 * q + 3]);
  } else if constexpr (kValues == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(dense[0], dense[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = dense[0];
  }
}

// Global data of one K step, held in registers so the next step's loads overlap this step's
// MMAs: the activation tile as 16-byte vectors and, for power-of-two N dividing 8, the packed
// weight tile as 16-byte vectors of 8 stored entries plus their 8*B offset bits.
template <int BM, int BN>
struct StepRegs {
  static constexpr int kXVectors = BM * BK / 8;                 // 16-byte vectors of the x tile
  static constexpr int kX = (kXVectors + kThreads - 1) / kThreads;
  static constexpr int kW = BN * BK / 8 / kThreads;  // enough for N/M <= 1 (we need <= 1/2)
  uint4 x[kX];
  uint4 w[kW];
  uint32_t off[kW];
};

template <typename T, int BM, int BN>
__device__ __forceinline__ void load_x_regs(const PathParams<T>& p, StepRegs<BM, BN>& r, int64_t row0, int64_t k0) {
#pragma unroll
  for (int i = 0; i < StepRegs<BM, BN>::kX; ++i) {
    const int idx = threadIdx.x + i * kThreads, rr = idx / (BK / 8), c = idx % (BK / 8) * 8;
    if (idx >= StepRegs<BM, BN>::kXVectors) break;
    const int64_t row = row0 + rr, k = k0 + c;
    r.x[i] = (row < p.rows && k < p.k) ? __ldg(reinterpret_cast<const uint4*>(p.x + row * p.k + k)) : make_uint4(0, 0, 0, 0);
  }
}

template <int BM, int BN, typename T>
__device__ __forceinline__ void store_x_regs(const StepRegs<BM, BN>& r, T (*xs)[LDS]) {
#pragma unroll
  for (int i = 0; i < StepRegs<BM, BN>::kX; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx >= StepRegs<BM, BN>::kXVectors) break;
    *reinterpret_cast<uint4*>(&xs[idx / (BK / 8)][idx % (BK / 8) * 8]) = r.x[i];
  }
}

// Vector slot i of this thread: column c and vector vi within the column's entries of the step.
template <int kN, int kM>
struct WeightVectors {
  static constexpr int kPerColumn = 8 * kN / kM;  // 16-byte vectors per column per step
  __device__ static int column(int v) { return v / kPerColumn; }
  __device__ static int within(int v) { return v % kPerColumn; }
};

template <typename T, int kN, int kM, int BM, int BN>
__device__ __forceinline__ void load_w_regs(const PathParams<T>& p, StepRegs<BM, BN>& r, int64_t col0, int64_t step) {
  using V = WeightVectors<kN, kM>;
  constexpr int kBits = index_bits(kM);
#pragma unroll
  for (int i = 0; i < StepRegs<BM, BN>::kW; ++i) {
    const int v = threadIdx.x + i * kThreads;
    r.w[i] = make_uint4(0, 0, 0, 0);
    r.off[i] = 0;
    if (v >= BN * V::kPerColumn) continue;
    const int64_t col = col0 + V::column(v);
    const int64_t j0 = step * (BK / kM) * kN + V::within(v) * 8;  // first stored entry of the vector
    if (col >= p.nout || j0 >= p.row_len) continue;
    r.w[i] = load_stream16(p.values + col * p.row_len + j0);
    const int64_t bit = j0 * kBits;  // 8 entries: 8*B <= 32 bits, starting on a byte
    const uint32_t* wp = p.indices + col * p.index_words + (bit >> 5);
    const int shift = static_cast<int>(bit & 31);
    uint64_t window = __ldg(wp);
    if (shift + 8 * kBits > 32) window |= static_cast<uint64_t>(__ldg(wp + 1)) << 32;
    r.off[i] = static_cast<uint32_t>(window >> shift);
  }
}

// Writes the 8/N groups (8M/N dense positions) of each held vector into the [BN x 64] tile.
template <typename T, int kN, int kM, int BM, int BN>
__device__ __forceinline__ void expand_w_regs(const StepRegs<BM, BN>& r, T (*ws)[LDS]) {
  using V = WeightVectors<kN, kM>;
  constexpr int kBits = index_bits(kM), kPositions = 8 / kN * kM;
#pragma unroll
  for (int i = 0; i < StepRegs<BM, BN>::kW; ++i) {
    const int v = threadIdx.x + i * kThreads;
    if (v >= BN * V::kPerColumn) continue;
    uint32_t dense[kPositions / 2];
#pragma unroll
    for (int q = 0; q < kPositions / 2; ++q) dense[q] = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t value = (&r.w[i].x)[e / 2] >> (16 * (e & 1)) & 0xffffu;
      const uint32_t off = (r.off[i] >> (e * kBits)) & ((1u << kBits) - 1u);
      const int base = e / kN * kM;  // first dense position of the entry's group
#pragma unroll
      for (int o = 0; o < kM; ++o)
        if (off == static_cast<uint32_t>(o)) dense[(base + o) / 2] |= value << (16 * ((base + o) & 1));
    }
    store_dense<kPositions>(&ws[V::column(v)][V::within(v) * kPositions], dense);
  }
}

// Any N (runtime): one thread per (column, group) reads the group's entries and writes its M
// dense values. Slower (one dependent load per entry); used where N does not divide 8.
template <typename T, int kM, int BN>
__device__ __forceinline__ void expand_w_direct(const PathParams<T>& p, T (*ws)[LDS], int64_t col0, int64_t step) {
  constexpr int kGroups = BK / kM;
  for (int idx = threadIdx.x; idx < BN * kGroups; idx += kThreads) {
    const int c = idx / kGroups, gl = idx % kGroups;
    const int64_t col = col0 + c, g = step * kGroups + gl;
    uint32_t dense[kM / 2] = {};  // pairs of 16-bit values
    if (col < p.nout && g < p.groups) {
      const uint16_t* vrow = reinterpret_cast<const uint16_t*>(p.values + col * p.row_len);
      const uint32_t* irow = p.indices + col * p.index_words;
      for (int e = 0; e < p.n; ++e) {
        const int64_t j = g * p.n + e;
        const uint32_t off = read_offset(irow, j, p.bits);
        const uint32_t v = __ldg(vrow + j);
#pragma unroll
        for (int i = 0; i < kM; ++i)
          if (off == static_cast<uint32_t>(i)) dense[i / 2] |= v << (16 * (i & 1));
      }
    }
    store_dense<kM>(&ws[c][gl * kM], dense);
  }
}

// kN == 0: runtime N, direct expansion; else N is a power of two dividing 8 with 8N/M >= 1.
// kSplit: the tile may be split over K across a cluster of gridDim.z blocks (64x64 tiles only).
template <typename T, int BM, int BN, bool kSplit>
struct TileSmem {
  static constexpr size_t kOperands = static_cast<size_t>(BM + BN) * LDS * sizeof(T);
  static constexpr size_t kPartial = kSplit ? static_cast<size_t>(BM) * BN * sizeof(float) : 0;
  static constexpr size_t kBytes = kOperands > kPartial ? kOperands : kPartial;
};

template <typename T, int kN, int kM, int BM, int BN, bool kSplit>
__global__ void __launch_bounds__(kThreads) mma_kernel(PathParams<T> p, bool vector_loads) {
  constexpr int kWarpsM = warps_m<BM>(), kWarpsN = warps_n<BM>();
  constexpr int TM = BM / kWarpsM, TN = BN / kWarpsN;  // warp tile
  constexpr int MT = TM / 16, NT = TN / 8;              // mma tiles per warp
  constexpr bool kPipelined = kN > 0;
  static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
  __shared__ __align__(16) unsigned char smem[TileSmem<T, BM, BN, kSplit>::kBytes];
  T (*xs)[LDS] = reinterpret_cast<T (*)[LDS]>(smem);
  T (*ws)[LDS] = reinterpret_cast<T (*)[LDS]>(smem + static_cast<size_t>(BM) * LDS * sizeof(T));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * BM, col0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int64_t all_steps = (p.groups + BK / kM - 1) / (BK / kM);
  // This block's slice of K steps (all of them without a split).
  const int64_t per_split = (all_steps + gridDim.z - 1) / gridDim.z;
  const int64_t first = kSplit ? min(all_steps, blockIdx.z * per_split) : 0;
  const int64_t steps = kSplit ? min(all_steps, first + per_split) : all_steps;

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  StepRegs<BM, BN> regs;
  if (first < steps) {
    if (vector_loads) load_x_regs<T, BM, BN>(p, regs, row0, first * BK);
    if constexpr (kPipelined) load_w_regs<T, kN, kM, BM, BN>(p, regs, col0, first);
  }

  for (int64_t s = first; s < steps; ++s) {
    if (vector_loads) store_x_regs<BM, BN>(regs, xs);
    else stage_activations<T, BM>(p, xs, row0, s * BK);
    if constexpr (kPipelined) expand_w_regs<T, kN, kM, BM, BN>(regs, ws);
    else expand_w_direct<T, kM, BN>(p, ws, col0, s);
    __syncthreads();
    if (s + 1 < steps) {  // next step's global loads fly while the tensor cores work
      if (vector_loads) load_x_regs<T, BM, BN>(p, regs, row0, (s + 1) * BK);
      if constexpr (kPipelined) load_w_regs<T, kN, kM, BM, BN>(p, regs, col0, s + 1);
    }
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t a[MT][4], b[NT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i) ldmatrix_x4(a[i], &xs[wm * TM + i * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, &ws[wn * TN + j * 8 + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
        b[j][0] = r[0]; b[j][1] = r[1]; b[j + 1][0] = r[2]; b[j + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) mma_16816<T>(acc[i][j], a[i], b[j]);
    }
    __syncthreads();
  }

  // The loop ends on a barrier, so the operand tiles are free to hold the partial sums.
  float* partial = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wm * TM + i * 16 + (lane >> 2) + (e >> 1) * 8;
        const int c = wn * TN + j * 8 + (lane & 3) * 2 + (e & 1);
        if constexpr (kSplit) partial[r * BN + c] = acc[i][j][e];
        else store_output<T>(p, row0 + r, col0 + c, acc[i][j][e]);
      }
  if constexpr (kSplit) reduce_cluster<T, BM, BN, kThreads>(p, partial, row0, col0);
}

// Blocks of a cluster that split one tile over K (1 = no split): enough blocks for `waves`
// per SM, at most 8 (the portable cluster size), each block keeping at least 2 K steps.
int split_for(int64_t tiles, int64_t steps, int waves) {
  static int cluster_ok = -1;
  if (cluster_ok < 0) {
    int device = 0, value = 0;
    cluster_ok = cudaGetDevice(&device) == cudaSuccess &&
                 cudaDeviceGetAttribute(&value, cudaDevAttrClusterLaunch, device) == cudaSuccess && value;
  }
  const int64_t target = waves * static_cast<int64_t>(multiprocessor_count());
  if (!cluster_ok || tiles >= target) return 1;
  const int64_t split = std::min<int64_t>({8, (target + tiles - 1) / tiles, steps / 2});
  return static_cast<int>(std::max<int64_t>(1, split));
}

// BM x BN tiles, split over K across a cluster when there are too few tiles to fill the GPU.
// The 16-row tile uses few registers (several blocks fit per SM), so it splits for 4 waves.
template <typename T, int kN, int kM, int BM, int BN>
cudaError_t launch_tile(const PathParams<T>& p, cudaStream_t stream, bool vector_loads, int64_t steps) {
  const dim3 grid(static_cast<unsigned>((p.nout + BN - 1) / BN), static_cast<unsigned>((p.rows + BM - 1) / BM));
  const int split = split_for(static_cast<int64_t>(grid.x) * grid.y, steps, BM <= 16 ? 4 : 2);
  if (split == 1) {
    mma_kernel<T, kN, kM, BM, BN, false><<<grid, kThreads, 0, stream>>>(p, vector_loads);
    return cudaGetLastError();
  }
  return launch_split_k(mma_kernel<T, kN, kM, BM, BN, true>, grid, kThreads, 0, stream, split, false, p, vector_loads);
}

template <typename T, int kN, int kM>
cudaError_t launch(const PathParams<T>& p, cudaStream_t stream) {
  const bool vector_loads = p.k % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  const int64_t steps = (p.groups + BK / kM - 1) / (BK / kM);
  if (p.rows <= 16) return launch_tile<T, kN, kM, 16, 128>(p, stream, vector_loads, steps);
  const int64_t big_tiles = (p.nout + 127) / 128 * ((p.rows + 127) / 128);
  if (big_tiles >= 2 * multiprocessor_count()) {  // enough 128x128 tiles to fill the GPU twice over
    const dim3 grid(static_cast<unsigned>((p.nout + 127) / 128), static_cast<unsigned>((p.rows + 127) / 128));
    mma_kernel<T, kN, kM, 128, 128, false><<<grid, kThreads, 0, stream>>>(p, vector_loads);
    return cudaGetLastError();
  }
  return launch_tile<T, kN, kM, 64, 64>(p, stream, vector_loads, steps);
}


// Families with N a power of two dividing 8 and at least one 8-entry vector per column per step
// take the pipelined kernel; other N with the same M the direct expansion.
template <typename T, int kM>
cudaError_t launch_m(const PathParams<T>& p, cudaStream_t stream) {
  switch (p.n) {  // pipelined when M <= 8N (a whole 8-entry vector per column per step)
    case 1: if constexpr (kM <= 8) return launch<T, 1, kM>(p, stream); break;
    case 2: if constexpr (kM > 2) return launch<T, 2, kM>(p, stream); break;
    case 4: if constexpr (kM > 4) return launch<T, 4, kM>(p, stream); break;
    case 8: if constexpr (kM > 8) return launch<T, 8, kM>(p, stream); break;
    default: break;
  }
  return launch<T, 0, kM>(p, stream);
}

}  // namespace

bool mma_supported(int dtype_bytes, int m) { return dtype_bytes == 2 && (m == 2 || m == 4 || m == 8 || m == 16); }

template <typename T>
cudaError_t run_mma(PathParams<T> p, cudaStream_t stream) {
  if constexpr (sizeof(T) != 2) {
    return cudaErrorInvalidValue;
  } else {
    switch (p.m) {
      case 2: return launch_m<T, 2>(p, stream);
      case 4: return launch_m<T, 4>(p, stream);
      case 8: return launch_m<T, 8>(p, stream);
      case 16: return launch_m<T, 16>(p, stream);
      default: return cudaErrorInvalidValue;
    }
  }
}

template cudaError_t run_mma<float>(PathParams<float>, cudaStream_t);
template cudaError_t run_mma<__half>(PathParams<__half>, cudaStream_t);
template cudaError_t run_mma<__nv_bfloat16>(PathParams<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
