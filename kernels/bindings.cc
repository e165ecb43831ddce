// nmcli._kernels: the kernels without ONNX Runtime, on NumPy arrays (CPU) and, when built
// with CUDA, on device pointers (see kernels/cuda/). Shapes are checked here, at the boundary.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <thread>

#include "cpu/nm_matmul_cpu.h"
#include "nm_format.h"

namespace py = pybind11;
using namespace nmcli;

namespace nmcli {
// The glu argument of both entry points (the CUDA one in kernels/cuda/bindings_cuda.cc).
Glu parse_glu_arg(const std::string& name) {
  Glu glu;
  if (!parse_glu(name.c_str(), &glu)) throw std::invalid_argument("glu must be 'none' or 'silu', got '" + name + "'");
  return glu;
}
}  // namespace nmcli

namespace {

// A C-contiguous view of `obj` in `dtype` (copies only when needed).
py::array as_contiguous(const py::object& obj, const py::dtype& dtype) {
  return py::array::ensure(py::module_::import("numpy").attr("ascontiguousarray")(obj, dtype));
}

template <typename T>
py::array run_cpu(const py::array& x, const py::array& values, const py::array& indices, const py::object& bias,
                  int n, int m, int64_t k, float alpha, int threads, const py::object& residual, const py::object& x_up,
                  Glu glu, const py::object& norm_weight, float norm_epsilon) {
  const py::dtype dtype = values.dtype();
  const py::array xa = as_contiguous(x, dtype), va = as_contiguous(values, dtype);
  const py::array ia = as_contiguous(indices, py::dtype("uint32"));
  if (xa.ndim() < 1 || xa.shape(xa.ndim() - 1) != k) throw std::invalid_argument("x's last dim must be k");
  if (va.ndim() != 2) throw std::invalid_argument("values must be rank 2 [Nout, S]");
  const NMShape made = NMShape::make(k, va.shape(0), n, m);
  if (va.shape(1) != made.row_len)
    throw std::invalid_argument("values have row length " + std::to_string(va.shape(1)) + ", expected " +
                                std::to_string(made.row_len));
  if (ia.ndim() != 2 || ia.shape(0) != made.nout || !made.accepts_index_words(ia.shape(1)))
    throw std::invalid_argument("indices must be uint32 [Nout, " + std::to_string(made.index_words) + "] (or, rows padded, [Nout, " +
                                std::to_string(made.padded_index_words()) + "])");
  const NMShape shape = made.with_index_words(ia.shape(1));
  py::array ba;  // note: a default py::array is an empty array, not null; test has_bias instead
  const bool has_bias = !bias.is_none();
  if (has_bias) {
    ba = as_contiguous(bias, dtype);
    if (ba.ndim() != 1 || ba.shape(0) != shape.nout) throw std::invalid_argument("bias must be [Nout]");
  }
  std::vector<py::ssize_t> out_dims(xa.shape(), xa.shape() + xa.ndim());
  out_dims.back() = shape.nout;
  py::array y(dtype, out_dims);
  // Optional tensors of an exact shape: the residual the output's, x_up X's.
  auto optional_like = [&](const py::object& obj, const std::vector<py::ssize_t>& dims, const char* error) {
    py::array a;
    if (obj.is_none()) return a;
    a = as_contiguous(obj, dtype);
    if (std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()) != dims) throw std::invalid_argument(error);
    return a;
  };
  const py::array ra = optional_like(residual, out_dims, "residual must have the output's shape");
  const py::array ua = optional_like(x_up, std::vector<py::ssize_t>(xa.shape(), xa.shape() + xa.ndim()),
                                     "x_up must have x's shape");
  if ((glu != Glu::none) != !x_up.is_none()) throw std::invalid_argument("x_up goes with glu='silu' and only with it");
  const py::array na = optional_like(norm_weight, {static_cast<py::ssize_t>(k)}, "norm_weight must be [K]");
  if (glu != Glu::none && !norm_weight.is_none()) throw std::invalid_argument("glu and norm_weight exclude each other");
  NMMatMulArgs<T> args;
  args.x = static_cast<const T*>(xa.data());
  args.values = static_cast<const T*>(va.data());
  args.indices = static_cast<const uint32_t*>(ia.data());
  args.bias = has_bias ? static_cast<const T*>(ba.data()) : nullptr;
  args.residual = residual.is_none() ? nullptr : static_cast<const T*>(ra.data());
  args.x_up = x_up.is_none() ? nullptr : static_cast<const T*>(ua.data());
  args.glu = glu;
  args.norm_weight = norm_weight.is_none() ? nullptr : static_cast<const T*>(na.data());
  args.norm_epsilon = norm_epsilon;
  args.y = OutputParts<T>::single(static_cast<T*>(y.mutable_data()), shape.nout);
  args.rows = k ? xa.size() / k : 0;
  args.alpha = alpha;
  args.shape = shape;
  py::gil_scoped_release release;
  nm_matmul_cpu<T>(args, threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency()));
  return y;
}

py::array nm_matmul_cpu_py(const py::array& x, const py::array& values, const py::array& indices,
                           const py::object& bias, int n, int m, int64_t k, float alpha, int threads,
                           const py::object& residual, const py::object& x_up, const std::string& glu,
                           const py::object& norm_weight, float norm_epsilon) {
  if (!valid_pattern(n, m)) throw std::invalid_argument("invalid n:m " + std::to_string(n) + ":" + std::to_string(m));
  const Glu gate = parse_glu_arg(glu);
  const std::string kind = py::str(values.dtype());
  if (kind == "float32")
    return run_cpu<float>(x, values, indices, bias, n, m, k, alpha, threads, residual, x_up, gate, norm_weight, norm_epsilon);
  if (kind == "float16")
    return run_cpu<half_t>(x, values, indices, bias, n, m, k, alpha, threads, residual, x_up, gate, norm_weight, norm_epsilon);
  throw std::invalid_argument("values must be float32 or float16, got " + kind);
}

}  // namespace

#ifdef NMCLI_WITH_CUDA
namespace nmcli {
void register_cuda_bindings(py::module_& m);  // kernels/cuda/bindings_cuda.cc
}
#endif

PYBIND11_MODULE(_kernels, mod) {
  mod.doc() = "nmcli kernels without ONNX Runtime";
  mod.attr("FORMAT_VERSION") = kFormatVersion;
  mod.def("nm_matmul_cpu", &nm_matmul_cpu_py, py::arg("x"), py::arg("values"), py::arg("indices"),
          py::arg("bias") = py::none(), py::arg("n"), py::arg("m"), py::arg("k"), py::arg("alpha") = 1.0f,
          py::arg("threads") = 0, py::arg("residual") = py::none(), py::arg("x_up") = py::none(),
          py::arg("glu") = "none", py::arg("norm_weight") = py::none(), py::arg("norm_epsilon") = 0.0f,
          "Y = alpha * A @ W + bias + residual on the CPU, A = x, (glu='silu') silu(x) * x_up, or (norm_weight) "
          "x / sqrt(mean(x^2) + norm_epsilon) * norm_weight; W packed per docs/FORMAT.md, dtype from values.");
#ifdef NMCLI_WITH_CUDA
  nmcli::register_cuda_bindings(mod);
#else
  mod.attr("HAS_CUDA") = false;
#endif
}
