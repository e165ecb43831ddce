#include "nm_matmul_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
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
      if (args.rows >= 2) build_tiles();
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
  if (args.rows >= 2) build_tiles();
}

template <typename T>
NMMatMulCpu<T>::~NMMatMulCpu() {
  delete[] x32_storage_;
  delete[] tiles_;
}

// From 2 rows on, A is also laid out as tiles of R rows, [tile][K][R] (zeros past the last row),
// so one decoded entry (k, v) updates R sums from R contiguous floats: a loop the compiler
// vectorizes, instead of R scalar gathers from R rows K apart.
template <typename T>
void NMMatMulCpu<T>::build_tiles() {
  const int64_t rows = args_.rows, K = args_.shape.k;
  tile_rows_ = rows <= 4 ? 4 : rows <= 8 ? 8 : rows <= 16 ? 16 : 32;
  const int64_t tiles = (rows + tile_rows_ - 1) / tile_rows_;
  tiles_ = new float[static_cast<size_t>(tiles * K * tile_rows_)]();
  for (int64_t r = 0; r < rows; ++r) {
    float* tile = tiles_ + (r / tile_rows_) * K * tile_rows_ + r % tile_rows_;
    const float* row = x32_ + r * K;
    for (int64_t k = 0; k < K; ++k) tile[k * tile_rows_] = row[k];
  }
}

namespace {

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

// sums[r] = sum over the column's entries of v * tile[k][r], r < R: R contiguous floats per entry,
// as R / V vectors of V lanes (GCC/Clang vector extensions; left to itself the compiler kept the
// sums in memory and multiplied one lane at a time).
template <int R, int V>
inline __attribute__((always_inline)) void tile_sums_body(const int32_t* pos, const float* val, int64_t live,
                                                          const float* tile, float* sums) {
  typedef float Vec __attribute__((vector_size(V * sizeof(float))));
  // Two sets of sums, for even and odd entries: twice the independent FMA chains in flight.
  Vec a[R / V] = {}, b[R / V] = {};
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

// 4-lane vectors (SSE2, every x86-64; NEON elsewhere) unless the CPU has AVX2 and FMA, checked
// once at run time: then 8 lanes with fused multiply-adds, from code compiled for that target
// alone, so the library itself stays portable. (GCC's target_clones("arch=haswell") was tried:
// its resolver tests the CPU model, not features, and picked the slow clone on newer CPUs.)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
template <int R>
__attribute__((target("avx2,fma"))) void tile_sums_avx2(const int32_t* pos, const float* val, int64_t live,
                                                         const float* tile, float* sums) {
  tile_sums_body<R, R >= 8 ? 8 : 4>(pos, val, live, tile, sums);
}
// NMCLI_CPU_BASELINE=1 keeps the 4-lane code on any CPU (tests run both).
bool has_avx2_fma() {
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && std::getenv("NMCLI_CPU_BASELINE") == nullptr;
  return yes;
}
#endif

template <int R>
void tile_sums_for(const int32_t* pos, const float* val, int64_t live, const float* tile, float* sums) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
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

}  // namespace

template <typename T>
void NMMatMulCpu<T>::compute_block(int64_t block) const {
  const NMShape& s = args_.shape;
  const int64_t col_begin = block * kColumnsPerBlock;
  const int64_t col_end = std::min(s.nout, col_begin + kColumnsPerBlock);
  const int64_t rows = args_.rows, K = s.k;
  std::vector<int32_t> pos(static_cast<size_t>(s.stored()));
  std::vector<float> val(static_cast<size_t>(s.stored()));
  float sums[32];

  for (int64_t col = col_begin; col < col_end; ++col) {
    // Decode the column once; every activation row reuses it.
    const int64_t live = decode_column(s, args_.values + col * s.row_len, args_.indices + col * s.index_words,
                                       pos.data(), val.data());
    const float bias = args_.bias ? to_float(args_.bias[col]) : 0.0f;
    const OutputColumn<T> y = args_.y.column(col);
    // The residual of output (r, col), read where the row is written.
    auto residual = [&](int64_t r) { return args_.residual ? to_float(args_.residual[r * s.nout + col]) : 0.0f; };
    if (rows == 1) {
      float a = 0;
      for (int64_t j = 0; j < live; ++j) a += val[j] * x32_[pos[j]];
      y[0] = from_float<T>(args_.alpha * a + bias + residual(0));
      continue;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += tile_rows_) {
      tile_sums(tile_rows_, pos.data(), val.data(), live, tiles_ + r0 * K, sums);
      for (int64_t r = r0; r < std::min(rows, r0 + tile_rows_); ++r)
        y[r] = from_float<T>(args_.alpha * sums[r - r0] + bias + residual(r));
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
