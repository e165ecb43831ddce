// CUDA entry point for Y = alpha * (A @ W) + bias + residual with W packed per docs/FORMAT.md
// and A = X or silu(X) * X_up (kernels/fusion.h). Type-erased so the ORT op and the pybind
// module share one dispatch; all pointers are device pointers, the call is asynchronous on
// `stream` and allocates nothing (a gated call on a path other than decode gates X into the
// caller's `workspace` first, large calls on the sparse tensor cores write a 2:4 copy of the
// weight there, and calls of the regrouping kernel with fewer tiles than SMs keep stream-K's flags
// and partial sums there: nm_matmul_cuda_workspace_bytes).
#pragma once
#include <cstddef>
#include <cstdint>

#include "../fusion.h"
#include "../nm_format.h"
#include "../output_parts.h"

namespace nmcli {

enum class DType { f32 = 0, f16 = 1, bf16 = 2 };
enum class CudaPath { automatic = 0, decode = 1, tiled = 2, mma = 3, wgmma = 4, wgmma_sp = 5, vector = 6, decode_mma = 7 };

struct CudaMatMul {
  DType dtype = DType::f16;
  const void* x = nullptr;            // [rows, K]
  const void* values = nullptr;       // [Nout, S]
  const uint32_t* indices = nullptr;  // [Nout, shape.index_words] (S*B/32, or padded: docs/FORMAT.md)
  const void* bias = nullptr;         // [Nout] or null
  const void* residual = nullptr;     // [rows, Nout] added to the output (single output only), or null
  const void* x_up = nullptr;         // [rows, K], read when glu != none
  Glu glu = Glu::none;
  const void* norm_weight = nullptr;  // [K]: A = X / sqrt(mean(X^2) + eps) * norm_weight, or null
  float norm_epsilon = 0.0f;
  void* workspace = nullptr;          // nm_matmul_cuda_workspace_bytes(call, path) bytes, 16-byte aligned
  OutputParts<void> y;                // [rows, Nout], or column ranges into several tensors
  int64_t rows = 0;
  float alpha = 1.0f;
  NMShape shape;
  // Columns per aligned block that share one row of offsets (the op's `vector` attribute,
  // docs/FORMAT.md); 0 when nothing is promised. Paths that know it read one row per block.
  int64_t vector = 0;
  // The same weight packed as 2:4 (docs/FORMAT.md "A 2:4 copy"), or null: where given, the sparse
  // tensor-core path reads it instead of `values` and `indices`.
  const void* copy_values = nullptr;        // [Nout, S4]
  const uint32_t* copy_indices = nullptr;   // [Nout, copy_index_words]
  int64_t copy_index_words = 0;             // the copy's words per row: 0 for S4 / 16, or padded (FORMAT.md)
};

// From how many rows, and from kStagedCopyMinOutputs outputs (rows x Nout), the sparse tensor cores
// read 1:4, 2:8 and 1:8 weights that carry no 2:4 copy as one staged in the call's workspace
// (kernels/cuda/dispatch.cu, stages_copy): where 4096 <= K <= 14336, 1:8 from 640 rows, 1:4 from
// 640 (K <= 5120) or 768, and 2:8 from 640 (896 on weights of kStagedTwoOfEightLargeWeights or
// more, K x Nout); other K from 2048.
constexpr int64_t kStagedCopyMinOutputs = int64_t{1} << 19;
constexpr int64_t kStagedCopyEarlyMinK = 4096, kStagedCopyEarlyMaxK = 14336;
constexpr int64_t kStagedTwoOfEightLargeWeights = int64_t{1} << 26;
inline int64_t staged_copy_from_rows(int n, int m, int64_t k, int64_t nout) {
  if (k < kStagedCopyEarlyMinK || k > kStagedCopyEarlyMaxK) return 2048;
  if (n == 2) return k * nout >= kStagedTwoOfEightLargeWeights ? 896 : 640;
  return m == 8 || k <= 5120 ? 640 : 768;
}

// Which path `automatic` takes for this call (see kernels/cuda/dispatch.cu for the rule).
CudaPath choose_path(const CudaMatMul& call);
// Whether `path` can run this call (decode: rows <= 16; decode_mma: fp16/bf16, 1:4, 2:4, 1:8, 2:8,
// 4:8 or 4:16, rows <= 16, K % 8 == 0, the activations of all of K in shared memory, 16-byte
// aligned X; mma: fp16/bf16 with M in {2,4,8,16};
// wgmma: fp16/bf16 on compute capability 9.0, K % 8 == 0, the families wgmma.cu compiles;
// wgmma_sp: the same for 2:4, 1:4, 2:8 and 1:8, or any pattern with a 2:4 copy; vector: `vector`
// a multiple of 32, N and M powers of two with N/M in {1/2, 1/4, 1/8}, K a multiple of 4 (fp32)
// or 8 (fp16/bf16)).
bool path_supported(const CudaMatMul& call, CudaPath path);
const char* path_name(CudaPath path);
// The path `path_name` spells as `name`; false when there is none.
bool path_from_name(const char* name, CudaPath* path);

// Device memory the call needs in `workspace` on `path` (0 for most calls: gated or normalised
// calls on paths other than decode write A there first, calls that stage a 2:4 copy of their
// weight for the sparse tensor cores write it there, after A, and unstaged 1:4, 2:8 and 1:8 calls
// on the sparse tensor cores with fewer 256-row tiles than SMs, but more than half as many, keep a
// flag and a 128 KB slot of partial sums per SM there for stream-K, after A: 17.3 MB on 132 SMs).
size_t nm_matmul_cuda_workspace_bytes(const CudaMatMul& call, CudaPath path = CudaPath::automatic);

// Returns a cudaError_t as int (0 = success) so callers need no CUDA headers.
int nm_matmul_cuda(const CudaMatMul& call, void* stream, CudaPath path = CudaPath::automatic);

// The tile plan of the calling thread's last nm_matmul_cuda call where it ran a warpgroup kernel
// (sm90::launch_split in kernels/cuda/wgmma_tile.cuh): its activation-tile rows (0 where the call
// ran another path), K split, whether its whole waves ran unsplit before the last wave's tiles
// split, whether it ran stream-K; or the regrouping kernel's grid of two 64-row blocks an SM and its
// K split (wgmma_sp.cu, two_per_sm_split), which launch_split does not weigh. For tests and
// measurements, which otherwise would have to work launch_split's model by hand.
struct CudaTilePlan {
  int rows = 0;
  int split = 1;
  bool last_wave_split = false;
  bool stream_k = false;
  bool persistent = false;  // the persistent 2:4 kernel (wgmma_sp.cu)
  bool two_per_sm = false;  // the regrouping kernel's grid of two 64-row blocks an SM (wgmma_sp.cu)
};
CudaTilePlan& last_tile_plan();

// A 2:4 copy of a packed weight (docs/FORMAT.md "A 2:4 copy") in device memory: values [Nout, S4]
// (16-bit), offset words [Nout, S4 / 16].
struct TwoOfFourCopy {
  void* values = nullptr;
  uint32_t* indices = nullptr;
};
// Bytes of one such copy laid out in a single buffer (two_of_four_copy_parts), and its parts there.
size_t two_of_four_copy_bytes(const NMShape& shape);
TwoOfFourCopy two_of_four_copy_parts(void* buffer, const NMShape& shape);
// Whether the copy of an n:m weight is written a word (32 positions) per thread, at about the copy
// bandwidth (M in {2, 4, 8, 16, 32}); other patterns that fit 2:4 go a block of 4 positions per thread.
bool two_of_four_copy_by_words(int n, int m);
// Writes the 2:4 copy of a 16-bit weight whose pattern fits 2:4 (fits_two_of_four) on `stream`: the
// bytes nmcli.format.two_of_four_copy writes (kernels/cuda/two_of_four_copy.cu). cudaError_t as int.
int two_of_four_copy_cuda(const void* values, const uint32_t* indices, const NMShape& shape, TwoOfFourCopy copy,
                          void* stream);

// Copies `bytes` (a multiple of 16, both pointers 16-byte aligned) on `stream` with nmcli's
// 16-byte-vector copy kernel: the benchmarks' copy-bandwidth ceiling (kernels/cuda/copy.cu).
int device_copy(void* dst, const void* src, size_t bytes, void* stream);

}  // namespace nmcli
