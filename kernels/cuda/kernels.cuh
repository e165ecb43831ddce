// Parameters and launchers of the CUDA paths (internal to kernels/cuda).
#pragma once
#include "common.cuh"
#include "../fusion.h"
#include "../output_parts.h"

namespace nmcli {

// Fields shared by every path: the call, typed.
template <typename T>
struct PathParams {
  const T* x;
  const T* values;
  const uint32_t* indices;
  const T* bias;
  const T* residual;  // [rows, Nout] added to the output (a single one), or null
  const T* x_up;      // [rows, K]: with glu, the product reads gated_activation(glu, x, x_up)
  Glu glu;            // only the decode path gates; dispatch gates X first for the others
  const T* norm_weight;  // [K]: A = RMSNorm(X) * norm_weight (decode only, like glu), or null
  float norm_epsilon;
  OutputParts<T> y;
  int64_t rows, k, nout, groups, row_len, index_words;
  int n, m, bits;
  float alpha;
  // The weight was written by the kernel before this one on the stream (a 2:4 copy the dispatch
  // staged): no programmatic-dependent start, whose blocks read their first weights before waiting.
  bool weight_from_stream = false;
  // Warpgroup kernels: the grid runs tiles [first_tile, first_tile + tile_count), weight tile
  // fastest (tile_count 0: all of them). sm90::launch_split launches the tiles of a last partial
  // wave apart, split over clusters.
  int64_t first_tile = 0, tile_count = 0;
  // Stream-K (sm90::stream_k): where stream_k_blocks > 0, the grid's blocks take equal runs of the
  // call's steps across its tiles, hand the partial sums of a tile they do not finish to the block
  // that does through `partials` (kStreamKSlotFloats per block) and mark them ready in `flags`
  // (one word per block, zeroed before the launch). Both in the call's workspace, null elsewhere.
  float* partials = nullptr;
  uint32_t* flags = nullptr;
  int64_t stream_k_blocks = 0;
};

// The activation tile stream-K runs on (256 rows: narrower ones never came out ahead in its cost
// model, against 256-row tiles split over clusters) and a block's slot of partial sums, that
// tile's fp32 accumulators.
constexpr int kStreamKRows = 256;
constexpr int64_t kStreamKSlotFloats = int64_t{kStreamKRows} * 128;

template <typename T>
struct DecodeParamsT : PathParams<T> {
  int64_t chunk_groups;   // groups staged per shared-memory chunk
  int staged_positions;   // positions staged per chunk (chunk + slack)
};

constexpr int64_t kDecodeMaxRows = 16;  // the decode path handles 1..16 activation rows
constexpr int64_t kDecodeMmaCrossover = 8;  // ... and is faster than the mma path up to 8
constexpr int64_t kDecodeMmaFromRows = 5;   // decode_mma.cu from here at the latest (2:4 on wgmma_sp too),
constexpr int64_t kDecodeMmaNarrowestNout = 1024;  // from 1 row (groups of 4) or 2 up to this Nout,
constexpr int64_t kDecodeMmaMidNout = 16384;       // from 3 up to this one (groups of 4: at every Nout;
constexpr int64_t kDecodeMmaFourMidNout = 4096;    // four entries a group, 4:8 and 4:16: up to this one)
constexpr int64_t kTwoOfFourSpFromRows = 3;        // 2:4 on wgmma_sp from here where decode_mma splits K
constexpr int64_t kTwoOfFourSpWideNout = 4096;     // or the output is wider than this
constexpr int64_t kTwoOfFourMmaWideNout = 6144;    // 2:4 on decode_mma at 1-4 rows up to this Nout,
constexpr int64_t kTwoOfFourMmaOneRowK = 2048;     // at 1 row from this K (or up to 1024 wide)
constexpr int64_t kDecodeMmaOneRowK = 8192;        // groups of 8 up to 1024 wide from 1 row from this K
constexpr int64_t kDecodeFullGridNout = 4096;      // decode's row tiles fill the GPU from this Nout
constexpr int64_t kDecodeMmaLongKNout = 2048;      // from kDecodeMmaOneRowK: 1:4 from 1 row, 2:8, 1:8 from 2 to here
constexpr int64_t kWgmmaCrossover = 128;    // the wgmma path from this many rows (sm_90) ...
constexpr int64_t kWgmmaMinBlocks = 16;     // ... when its grid of smallest tiles has this many blocks,
constexpr int64_t kWgmmaWideTiles = 8;      // and from 17 rows (the sparse one 9) with this many weight tiles
constexpr int64_t kWgmmaSpMinBlocks = 16;   // the sparse one also from 9 rows with this many blocks
constexpr int64_t kWgmmaWeightTile = 128;   // weight rows per wgmma block
constexpr int64_t kWgmmaMinRowTile = 64;    // its smallest activation tile
constexpr int64_t kVector16MaxRows = 64;    // fp16/bf16 vector-wise calls take the vector path up to here
constexpr int64_t kVector16CopyMaxRows = 32;  // ... and up to here when they carry a 2:4 copy (N/M <= 1/8 only)

// The residual added to output (row, col).
template <typename T>
__device__ __forceinline__ float residual_at(const PathParams<T>& p, int64_t row, int64_t col) {
  return p.residual ? to_f32(p.residual[row * p.nout + col]) : 0.f;
}

// The activation A written out once for the paths that copy X as it is (prologue.cu): the gated
// one, out[i] = gated_activation(glu, x[i], up[i]), or the RMS-normalised one, row by row.
template <typename T> cudaError_t run_glu(const T* x, const T* up, Glu glu, T* out, int64_t count, cudaStream_t stream);
template <typename T>
cudaError_t run_rms_norm(const T* x, const T* weight, float epsilon, T* out, int64_t rows, int64_t k, cudaStream_t stream);

template <typename T> cudaError_t run_decode(DecodeParamsT<T> p, cudaStream_t stream);
// Whether the decode kernel for `rows` stages the activations of the whole K at once (one chunk).
template <typename T> bool decode_stages_once(int64_t rows, int n, int m, int64_t groups);
// Decode-sized calls on the tensor cores (decode_mma.cu): fp16/bf16, 1:4, 2:4, 1:8 and 2:8, 1..16
// rows, K % 8 == 0 where the activations of the whole K fit in the shared memory of one block or,
// K split over a cluster (compute capability 9.0), of up to 8; gates or normalises while it
// stages X, like run_decode. X, x_up and norm_weight 16-byte aligned.
template <typename T> cudaError_t run_decode_mma(PathParams<T> p, cudaStream_t stream);
bool decode_mma_supported(int64_t rows, int n, int m, int64_t k);
// The blocks decode_mma splits K over for such a call (1: none), 0 where it does not take it.
int decode_mma_split(int64_t rows, int n, int m, int64_t k);
template <typename T> cudaError_t run_tiled(PathParams<T> p, cudaStream_t stream);
template <typename T> cudaError_t run_mma(PathParams<T> p, cudaStream_t stream);
bool mma_supported(int dtype_bytes, int m);
// Warpgroup (wgmma) path, sm_90a only: built when NMCLI_WITH_SM90A is defined.
template <typename T> cudaError_t run_wgmma(PathParams<T> p, cudaStream_t stream);
bool wgmma_family(int n, int m);  // N:M families the wgmma kernels are compiled for
bool wgmma_device();              // the current device runs sm_90a code (compute capability 9.0)
// Its fp32 twin (wgmma_tf32.cu, 3xTF32) for the families wgmma_tf32_family lists; runs where
// wgmma_tf32_runs (a family it compiles, K % 4 == 0, the values 16-byte aligned, sm_90a) and X
// is 16-byte aligned.
cudaError_t run_wgmma_tf32(PathParams<float> p, cudaStream_t stream);
bool wgmma_tf32_family(int n, int m);
bool wgmma_tf32_runs(int n, int m, int64_t k, const void* values);
// Sparse warpgroup (wgmma.mma_async.sp) path for 2:4, sm_90a only, built with run_wgmma.
template <typename T> cudaError_t run_wgmma_sp(PathParams<T> p, cudaStream_t stream);
bool wgmma_sp_family(int n, int m);
// Vector-wise path (vector.cu): the caller promises that columns share their offsets in aligned
// blocks of 32; N and M powers of two with N/M in {1/2, 1/4, 1/8}, K a multiple of 16 bytes' elements.
template <typename T> cudaError_t run_vector(PathParams<T> p, cudaStream_t stream);
bool vector_family(int n, int m);

// SMs of the current device (cached per device).
int multiprocessor_count();

// Compute capability of the current device as major * 10 + minor (cached per device; 0 if unknown).
int compute_capability();

// Whether to launch with programmatic dependent launch: the current device supports it
// (compute capability 9.0+) and NMCLI_NO_PDL is unset (for A/B measurements).
bool use_pdl();

// Launches `kernel` with grid.z = `split` blocks of one cluster along z, which split each tile's
// K steps between them (the mma and warpgroup paths' split-K; sm_90; split 1 launches no
// cluster, as the decode kernels do). With `pdl` (and use_pdl()), as a programmatic dependent
// launch: only for kernels that call wait_for_previous_kernel() before they read what earlier
// kernels wrote or write anything themselves.
template <typename... Params, typename... Args>
cudaError_t launch_split_k(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem, cudaStream_t stream,
                           int split, bool pdl, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid.x, grid.y, static_cast<unsigned>(split));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned count = 0;
  if (split > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = 1;
    attrs[count].val.clusterDim.y = 1;
    attrs[count++].val.clusterDim.z = static_cast<unsigned>(split);
  }
  if (pdl && use_pdl()) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  config.attrs = attrs;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Blocks of a persistent grid over `tiles` tiles with `slots` blocks resident at once: at most
// `slots`, and just enough that every block walks the same number of tiles (896 tiles on 264
// slots: 224 blocks x 4 tiles, not 264 blocks of which 104 walk a 4th tile alone).
inline unsigned persistent_blocks(int64_t tiles, int64_t slots) {
  const int64_t per_block = (tiles + slots - 1) / slots;
  return static_cast<unsigned>((tiles + per_block - 1) / per_block);
}

// Raises kKernel's dynamic shared-memory cap to `bytes` on the current device, once per device
// (every launch of a kernel asks for the same cap).
template <auto kKernel>
cudaError_t allow_dynamic_smem(int bytes) {
  static bool configured[64] = {};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device < 64 && !configured[device]) {
    if (cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); e != cudaSuccess)
      return e;
    configured[device] = true;
  }
  return cudaSuccess;
}

}  // namespace nmcli
