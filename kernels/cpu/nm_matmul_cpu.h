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

// Output columns are processed in blocks of 16-64 (chosen per call); blocks are independent, so
// any thread pool can run them: construct once, then compute_block(b) for every b in [0, num_blocks).
template <typename T>
class NMMatMulCpu {
 public:
  static constexpr int64_t kMaxColumnsPerBlock = 64;

  explicit NMMatMulCpu(const NMMatMulArgs<T>& args);
  ~NMMatMulCpu();
  NMMatMulCpu(const NMMatMulCpu&) = delete;
  NMMatMulCpu& operator=(const NMMatMulCpu&) = delete;

  int64_t num_blocks() const { return (args_.shape.nout + block_cols_ - 1) / block_cols_; }
  void compute_block(int64_t block) const;

 private:
  void build_tiles();
  void choose_block_columns();

  NMMatMulArgs<T> args_;
  const float* x32_ = nullptr;    // activations A as fp32 [rows, K]
  float* x32_storage_ = nullptr;  // owned when T is not float or A is not X
  int tile_rows_ = 0;             // from 2 rows: A in tiles of 4, 8, 16 or 32 rows, [tile][K][rows]
  float* tiles_ = nullptr;         // 64-byte aligned: a 16- or 32-row tile's row is whole cache lines
  int64_t block_cols_ = 16;       // output columns a block
};

// Convenience: the whole product on std::threads (used by the pybind module and tests).
template <typename T>
void nm_matmul_cpu(const NMMatMulArgs<T>& args, int num_threads);

}  // namespace nmcli
