// CPU implementation of Y = alpha * (A @ W) + bias + residual with W in the packed N:M format
// (A = X, silu(X) * X_up, or RMSNorm(X) * norm_weight: kernels/fusion.h).
#pragma once
#include <cstdint>

#include "../fusion.h"
#include "../nm_format.h"
#include "../output_parts.h"
#include "half.h"

namespace nmcli {

template <typename T>
struct NMMatMulArgs {
  const T* x = nullptr;           // [rows, K]
  const T* values = nullptr;      // [Nout, S]
  const uint32_t* indices = nullptr;  // [Nout, shape.index_words] (docs/FORMAT.md)
  const T* bias = nullptr;        // [Nout] or null
  const T* residual = nullptr;    // [rows, Nout] added to the output, or null (single output only)
  const T* x_up = nullptr;        // [rows, K], read when glu != none
  Glu glu = Glu::none;
  const T* norm_weight = nullptr; // [K]: A = X / sqrt(mean(X^2) + eps) * norm_weight, or null
  float norm_epsilon = 0.0f;
  OutputParts<T> y;               // [rows, Nout], or column ranges into several tensors
  int64_t rows = 0;
  float alpha = 1.0f;
  NMShape shape;
};

// Construct once; then, on any thread pool, prologue_part(t) for every t in [0, num_prologue_parts)
// (from 2 rows: activation tile t), and after all of them compute_block(b) for every b in
// [0, num_blocks) (output columns in blocks of 16-64, chosen per call). Parts of a phase are
// independent.
template <typename T>
class NMMatMulCpu {
 public:
  static constexpr int64_t kMaxColumnsPerBlock = 64;

  // Bytes of the activation tiles a call makes (0 below 2 rows). A caller that keeps memory between
  // calls (ORT's arena) passes `tiles`, 64-byte aligned and that large; else they are allocated
  // here, and with threads each call's fresh pages faulting in, serialised in the kernel, made a
  // 256 x 11008 prologue 1.7x slower on two threads than on one (BENCHMARKS.md session 73).
  static size_t tile_bytes(const NMMatMulArgs<T>& args);
  explicit NMMatMulCpu(const NMMatMulArgs<T>& args, float* tiles = nullptr);
  ~NMMatMulCpu();
  NMMatMulCpu(const NMMatMulCpu&) = delete;
  NMMatMulCpu& operator=(const NMMatMulCpu&) = delete;

  int64_t num_prologue_parts() const { return num_tiles_; }
  void prologue_part(int64_t tile) const;
  int64_t num_blocks() const { return (args_.shape.nout + block_cols_ - 1) / block_cols_; }
  void compute_block(int64_t block) const;

 private:
  void choose_block_columns();
  float row_scale(int64_t row) const;
  const float* activation_span(int64_t row, int64_t k0, int64_t n, float scale, float* scratch) const;

  NMMatMulArgs<T> args_;
  const float* x32_ = nullptr;    // at 1 row: activations A as fp32 [K]
  float* x32_storage_ = nullptr;  // x32_'s memory where T is not float or A is not X
  int tile_rows_ = 0;             // from 2 rows: A in tiles of 4, 8, 16 or 32 rows, [tile][K][rows]
  int64_t num_tiles_ = 0;
  float* tiles_ = nullptr;        // 64-byte aligned: a 16- or 32-row tile's row is whole cache lines
  bool owns_tiles_ = false;
  int64_t block_cols_ = 16;       // output columns a block
};

// Convenience: the whole product on std::threads (used by the pybind module and tests).
template <typename T>
void nm_matmul_cpu(const NMMatMulArgs<T>& args, int num_threads);

}  // namespace nmcli
