// Picks the path for a call and launches it.
//
// Rule (to be replaced by measured crossovers, see BENCHMARKS.md): the decode path for 1..8
// activation rows, where the product is memory-bound on the weight; the tiled path above.
#include "kernels.cuh"
#include "nm_matmul_cuda.h"

namespace nmcli {
namespace {

constexpr int64_t kDecodeMaxRows = 8;

template <typename T>
PathParams<T> typed(const CudaMatMul& c) {
  PathParams<T> p;
  p.x = static_cast<const T*>(c.x);
  p.values = static_cast<const T*>(c.values);
  p.indices = c.indices;
  p.bias = static_cast<const T*>(c.bias);
  p.y = static_cast<T*>(c.y);
  p.rows = c.rows;
  p.k = c.shape.k;
  p.nout = c.shape.nout;
  p.groups = c.shape.groups;
  p.row_len = c.shape.row_len;
  p.index_words = c.shape.index_words;
  p.n = c.shape.n;
  p.m = c.shape.m;
  p.bits = c.shape.bits;
  p.alpha = c.alpha;
  return p;
}

template <typename T>
cudaError_t run(const CudaMatMul& c, cudaStream_t stream, CudaPath path) {
  if (path == CudaPath::decode) {
    DecodeParamsT<T> p;
    static_cast<PathParams<T>&>(p) = typed<T>(c);
    return run_decode<T>(p, stream);
  }
  return run_tiled<T>(typed<T>(c), stream);
}

}  // namespace

CudaPath choose_path(const CudaMatMul& call) {
  return call.rows <= kDecodeMaxRows ? CudaPath::decode : CudaPath::tiled;
}

const char* path_name(CudaPath path) {
  switch (path) {
    case CudaPath::decode: return "decode";
    case CudaPath::tiled: return "tiled";
    default: return "auto";
  }
}

int nm_matmul_cuda(const CudaMatMul& call, void* stream_ptr, CudaPath path) {
  if (call.rows == 0 || call.shape.nout == 0) return cudaSuccess;
  if (path == CudaPath::automatic) path = choose_path(call);
  if (path == CudaPath::decode && call.rows > kDecodeMaxRows) return cudaErrorInvalidValue;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (call.dtype) {
    case DType::f32: return run<float>(call, stream, path);
    case DType::f16: return run<__half>(call, stream, path);
    case DType::bf16: return run<__nv_bfloat16>(call, stream, path);
  }
  return cudaErrorInvalidValue;
}

}  // namespace nmcli
