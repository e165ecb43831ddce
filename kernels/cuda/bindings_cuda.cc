// CUDA half of nmcli._kernels: launches on caller-owned device buffers (e.g. torch or cupy
// tensors' data pointers), so tests and benchmarks choose their own allocation and timing.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "nm_matmul_cuda.h"

namespace py = pybind11;

namespace nmcli {

void register_cuda_bindings(py::module_& mod) {
  mod.attr("HAS_CUDA") = true;
  mod.def(
      "nm_matmul_cuda",
      [](uintptr_t x, uintptr_t values, uintptr_t indices, uintptr_t bias, uintptr_t y, int64_t rows, int n, int m,
         int64_t k, int64_t nout, const std::string& dtype, float alpha, uintptr_t stream, const std::string& path) {
        if (!valid_pattern(n, m)) throw std::invalid_argument("invalid n:m");
        CudaMatMul call;
        call.dtype = dtype == "float32" ? DType::f32 : dtype == "float16" ? DType::f16 : dtype == "bfloat16" ? DType::bf16
                     : throw std::invalid_argument("dtype must be float32, float16 or bfloat16");
        call.x = reinterpret_cast<const void*>(x);
        call.values = reinterpret_cast<const void*>(values);
        call.indices = reinterpret_cast<const uint32_t*>(indices);
        call.bias = reinterpret_cast<const void*>(bias);
        call.y = reinterpret_cast<void*>(y);
        call.rows = rows;
        call.alpha = alpha;
        call.shape = NMShape::make(k, nout, n, m);
        const CudaPath chosen = path == "auto" ? CudaPath::automatic : path == "decode" ? CudaPath::decode
                                : path == "tiled" ? CudaPath::tiled : throw std::invalid_argument("path: auto, decode or tiled");
        const int err = nm_matmul_cuda(call, reinterpret_cast<void*>(stream), chosen);
        if (err != 0) throw std::runtime_error("nm_matmul_cuda failed with CUDA error " + std::to_string(err));
      },
      py::arg("x"), py::arg("values"), py::arg("indices"), py::arg("bias"), py::arg("y"), py::arg("rows"), py::arg("n"),
      py::arg("m"), py::arg("k"), py::arg("nout"), py::arg("dtype"), py::arg("alpha") = 1.0f, py::arg("stream") = 0,
      py::arg("path") = "auto",
      "Launch on device pointers (bias may be 0). Asynchronous on `stream`; no allocation.");
  mod.def(
      "cuda_path",
      [](int64_t rows, int n, int m, int64_t k, int64_t nout) {
        CudaMatMul call;
        call.rows = rows;
        call.shape = NMShape::make(k, nout, n, m);
        return std::string(path_name(choose_path(call)));
      },
      "The path the automatic dispatch takes for this shape.");
}

}  // namespace nmcli
