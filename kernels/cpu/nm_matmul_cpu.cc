#include "nm_matmul_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <type_traits>
#include <vector>

namespace nmcli {

template <typename T>
NMMatMulCpu<T>::NMMatMulCpu(const NMMatMulArgs<T>& args) : args_(args) {
  const int64_t count = args.rows * args.shape.k;
  if constexpr (std::is_same_v<T, float>) {
    if (args.glu == Glu::none && !args.norm_weight) {
      x32_ = args.x;
      return;
    }
  }
  // Convert (and gate) once, not once per output column.
  x32_storage_ = new float[static_cast<size_t>(std::max<int64_t>(count, 1))];
  for (int64_t i = 0; i < count; ++i)
    x32_storage_[i] = args.glu == Glu::none ? to_float(args.x[i])
                                            : gated_activation(args.glu, to_float(args.x[i]), to_float(args.x_up[i]));
  if (args.norm_weight) {
    const int64_t K = args.shape.k;
    for (int64_t r = 0; r < args.rows; ++r) {
      float* row = x32_storage_ + r * K;
      double squares = 0.0;
      for (int64_t k = 0; k < K; ++k) squares += static_cast<double>(row[k]) * row[k];
      const float scale = 1.0f / std::sqrt(static_cast<float>(squares / K) + args.norm_epsilon);
      for (int64_t k = 0; k < K; ++k) row[k] = row[k] * scale * to_float(args.norm_weight[k]);
    }
  }
  x32_ = x32_storage_;
}

template <typename T>
NMMatMulCpu<T>::~NMMatMulCpu() { delete[] x32_storage_; }

template <typename T>
void NMMatMulCpu<T>::compute_block(int64_t block) const {
  const NMShape& s = args_.shape;
  const int64_t col_begin = block * kColumnsPerBlock;
  const int64_t col_end = std::min(s.nout, col_begin + kColumnsPerBlock);
  const int64_t rows = args_.rows, K = s.k;
  std::vector<int32_t> pos(static_cast<size_t>(s.stored()));
  std::vector<float> val(static_cast<size_t>(s.stored()));

  for (int64_t col = col_begin; col < col_end; ++col) {
    // Decode the column once into (position, value) pairs, group by group (no division per
    // entry), dropping entries at k >= K: the spec guarantees they are zero and X has no such
    // columns.
    const T* vrow = args_.values + col * s.row_len;
    const uint32_t* irow = args_.indices + col * s.index_words;
    int64_t live = 0, j = 0;
    for (int64_t group_start = 0; group_start < K; group_start += s.m) {
      for (int t = 0; t < s.n; ++t, ++j) {
        const int64_t k = group_start + read_offset(irow, j, s.bits);
        if (k < K) { pos[live] = static_cast<int32_t>(k); val[live] = to_float(vrow[j]); ++live; }
      }
    }
    const float bias = args_.bias ? to_float(args_.bias[col]) : 0.0f;
    const OutputColumn<T> y = args_.y.column(col);
    // The residual of output (r, col), read where the row is written.
    auto residual = [&](int64_t r) { return args_.residual ? to_float(args_.residual[r * s.nout + col]) : 0.0f; };
    // Four activation rows at a time share each decoded entry.
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float* x0 = x32_ + r * K;
      const float* x1 = x0 + K;
      const float* x2 = x1 + K;
      const float* x3 = x2 + K;
      float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      for (int64_t j = 0; j < live; ++j) {
        const int32_t k = pos[j];
        const float v = val[j];
        a0 += v * x0[k]; a1 += v * x1[k]; a2 += v * x2[k]; a3 += v * x3[k];
      }
      y[r] = from_float<T>(args_.alpha * a0 + bias + residual(r));
      y[r + 1] = from_float<T>(args_.alpha * a1 + bias + residual(r + 1));
      y[r + 2] = from_float<T>(args_.alpha * a2 + bias + residual(r + 2));
      y[r + 3] = from_float<T>(args_.alpha * a3 + bias + residual(r + 3));
    }
    for (; r < rows; ++r) {
      const float* x0 = x32_ + r * K;
      float a0 = 0;
      for (int64_t j = 0; j < live; ++j) a0 += val[j] * x0[pos[j]];
      y[r] = from_float<T>(args_.alpha * a0 + bias + residual(r));
    }
  }
}

template <typename T>
void nm_matmul_cpu(const NMMatMulArgs<T>& args, int num_threads) {
  NMMatMulCpu<T> op(args);
  const int64_t blocks = op.num_blocks();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t b = next++; b < blocks; b = next++) op.compute_block(b);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

template class NMMatMulCpu<float>;
template class NMMatMulCpu<half_t>;
template class NMMatMulCpu<bfloat16_t>;
template void nm_matmul_cpu<float>(const NMMatMulArgs<float>&, int);
template void nm_matmul_cpu<half_t>(const NMMatMulArgs<half_t>&, int);
template void nm_matmul_cpu<bfloat16_t>(const NMMatMulArgs<bfloat16_t>&, int);

}  // namespace nmcli
