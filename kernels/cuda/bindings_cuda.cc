// CUDA half of nmcli._kernels: launches on caller-owned device buffers (e.g. torch or cupy
// tensors' data pointers), so tests and benchmarks choose their own allocation and timing.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "nm_matmul_cuda.h"

namespace py = pybind11;

namespace nmcli {

Glu parse_glu_arg(const std::string& name);  // kernels/bindings.cc

namespace {

DType parse_dtype(const std::string& dtype) {
  if (dtype == "float32") return DType::f32;
  if (dtype == "float16") return DType::f16;
  if (dtype == "bfloat16") return DType::bf16;
  throw std::invalid_argument("dtype must be float32, float16 or bfloat16");
}

// y: one device pointer ([rows, Nout]), or a list of them with `splits` (columns of each part).
OutputParts<void> parse_outputs(const py::object& y, const std::vector<int64_t>& splits, int64_t nout) {
  if (py::isinstance<py::int_>(y)) {
    if (!splits.empty()) throw std::invalid_argument("splits needs a list of output pointers");
    return OutputParts<void>::single(reinterpret_cast<void*>(y.cast<uintptr_t>()), nout);
  }
  const auto pointers = y.cast<std::vector<uintptr_t>>();
  if (pointers.empty() || pointers.size() != splits.size() || pointers.size() > static_cast<size_t>(kMaxOutputParts))
    throw std::invalid_argument("y must be one pointer, or 1.." + std::to_string(kMaxOutputParts) +
                                " pointers with as many splits");
  std::vector<void*> bases;
  int64_t total = 0;
  for (size_t i = 0; i < pointers.size(); ++i) {
    if (splits[i] < 1) throw std::invalid_argument("splits must be positive");
    total += splits[i];
    bases.push_back(reinterpret_cast<void*>(pointers[i]));
  }
  if (total != nout) throw std::invalid_argument("splits must add up to nout");
  return OutputParts<void>::split(bases.data(), splits.data(), static_cast<int>(splits.size()));
}

// `shape` with rows of indices `words` apart: 0 keeps S*B/32, else it must be a pitch docs/FORMAT.md
// allows (S*B/32, or padded to 16-byte units).
NMShape with_row_pitch(const NMShape& shape, int64_t words, const char* name) {
  if (words == 0) return shape;
  if (!shape.accepts_index_words(words)) {
    const int64_t padded = shape.padded_index_words();
    throw std::invalid_argument(std::string(name) + " must be " + std::to_string(shape.index_words) +
                                (padded == shape.index_words ? "" : " or, rows padded, " + std::to_string(padded)) +
                                " (docs/FORMAT.md)");
  }
  return shape.with_index_words(words);
}

// Stands for a call's 2:4 copy where only whether there is one matters (choosing a path).
alignas(16) const uint32_t kAnyCopy[4] = {};

CudaPath parse_path(const std::string& name) {
  CudaPath path;
  if (!path_from_name(name.c_str(), &path))
    throw std::invalid_argument("path must be auto, decode, decode_mma, tiled, mma, wgmma, wgmma_sp or vector");
  return path;
}

}  // namespace

void register_cuda_bindings(py::module_& mod) {
  mod.attr("HAS_CUDA") = true;
  mod.def(
      "staged_copy_from_rows", [](int n, int m, int64_t k, int64_t nout) -> int64_t {
        if (!((n == 1 && (m == 4 || m == 8)) || (n == 2 && m == 8)))
          throw std::invalid_argument("the rule is for 1:4, 2:8 and 1:8 (other patterns that fit 2:4 stage at any row count)");
        return staged_copy_from_rows(n, m, k, nout);
      },
      py::arg("n"), py::arg("m"), py::arg("k"), py::arg("nout"),
      "Rows from which calls of 1:4, 2:8 and 1:8 without a 2:4 copy stage one on the sparse tensor cores.");
  mod.attr("STAGED_COPY_MIN_OUTPUTS") = kStagedCopyMinOutputs;
  mod.def(
      "nm_matmul_cuda",
      [](uintptr_t x, uintptr_t values, uintptr_t indices, uintptr_t bias, const py::object& y, int64_t rows, int n, int m,
         int64_t k, int64_t nout, const std::string& dtype, float alpha, uintptr_t stream, const std::string& path,
         const std::vector<int64_t>& splits, uintptr_t residual, uintptr_t x_up, const std::string& glu,
         uintptr_t workspace, uintptr_t norm_weight, float norm_epsilon, int64_t vector, uintptr_t copy_values,
         uintptr_t copy_indices, int64_t index_words, int64_t copy_index_words) {
        if (!valid_pattern(n, m)) throw std::invalid_argument("invalid n:m");
        if ((copy_values == 0) != (copy_indices == 0)) throw std::invalid_argument("copy_values and copy_indices go together");
        if (copy_values && !fits_two_of_four(n, m)) throw std::invalid_argument("this n:m takes no 2:4 copy");
        CudaMatMul call;
        call.copy_values = reinterpret_cast<const void*>(copy_values);
        call.copy_indices = reinterpret_cast<const uint32_t*>(copy_indices);
        call.dtype = parse_dtype(dtype);
        call.x = reinterpret_cast<const void*>(x);
        call.values = reinterpret_cast<const void*>(values);
        call.indices = reinterpret_cast<const uint32_t*>(indices);
        call.bias = reinterpret_cast<const void*>(bias);
        call.residual = reinterpret_cast<const void*>(residual);
        call.x_up = reinterpret_cast<const void*>(x_up);
        call.glu = parse_glu_arg(glu);
        call.workspace = reinterpret_cast<void*>(workspace);
        call.norm_weight = reinterpret_cast<const void*>(norm_weight);
        call.norm_epsilon = norm_epsilon;
        if (norm_weight && call.glu != Glu::none) throw std::invalid_argument("glu and norm_weight exclude each other");
        call.y = parse_outputs(y, splits, nout);
        if (residual && call.y.count > 1) throw std::invalid_argument("a residual needs a single output");
        if ((call.glu != Glu::none) != (x_up != 0)) throw std::invalid_argument("x_up goes with glu='silu' and only with it");
        call.rows = rows;
        call.alpha = alpha;
        call.shape = with_row_pitch(NMShape::make(k, nout, n, m), index_words, "index_words");
        if (copy_index_words != 0) {
          with_row_pitch(NMShape::make(k, nout, 2, 4), copy_index_words, "copy_index_words");  // checks it
          call.copy_index_words = copy_index_words;
        }
        if (vector < 0) throw std::invalid_argument("vector must be >= 0");
        call.vector = vector;
        const CudaPath chosen = parse_path(path);
        if (!path_supported(call, chosen)) throw std::invalid_argument("path " + path + " does not support this call");
        if (nm_matmul_cuda_workspace_bytes(call, chosen) > 0 && workspace == 0)
          throw std::invalid_argument("this call needs a workspace of cuda_workspace_bytes(...) bytes");
        const int err = nm_matmul_cuda(call, reinterpret_cast<void*>(stream), chosen);
        if (err != 0) throw std::runtime_error("nm_matmul_cuda failed with CUDA error " + std::to_string(err));
      },
      py::arg("x"), py::arg("values"), py::arg("indices"), py::arg("bias"), py::arg("y"), py::arg("rows"), py::arg("n"),
      py::arg("m"), py::arg("k"), py::arg("nout"), py::arg("dtype"), py::arg("alpha") = 1.0f, py::arg("stream") = 0,
      py::arg("path") = "auto", py::arg("splits") = std::vector<int64_t>{}, py::arg("residual") = 0,
      py::arg("x_up") = 0, py::arg("glu") = "none", py::arg("workspace") = 0, py::arg("norm_weight") = 0,
      py::arg("norm_epsilon") = 0.0f, py::arg("vector") = 0, py::arg("copy_values") = 0, py::arg("copy_indices") = 0,
      py::arg("index_words") = 0, py::arg("copy_index_words") = 0,
      "Launch on device pointers (bias, residual may be 0; y one pointer, or a list with `splits`, the columns "
      "each holds; glu='silu' multiplies silu(x) * x_up, norm_weight normalises x by its RMS; both need "
      "`workspace` on some paths; vector: columns promised to share offsets in blocks of this many; copy_values, "
      "copy_indices: the weight packed as 2:4, read by the sparse tensor-core path; index_words, copy_index_words: "
      "words per row of indices and copy_indices, 0 for S*B/32, or padded to 16-byte units: docs/FORMAT.md). "
      "Asynchronous on `stream`; no allocation.");
  mod.def(
      "cuda_workspace_bytes",
      [](int64_t rows, int n, int m, int64_t k, int64_t nout, const std::string& dtype, const std::string& glu,
         const std::string& path, bool norm, bool copy) {
        CudaMatMul call;
        call.dtype = parse_dtype(dtype);
        call.rows = rows;
        call.glu = parse_glu_arg(glu);
        static const char kAnyWeight = 0;  // only whether there is a norm weight matters here
        call.norm_weight = norm ? &kAnyWeight : nullptr;
        call.shape = NMShape::make(k, nout, n, m);
        if (copy) call.copy_values = call.copy_indices = kAnyCopy;
        return nm_matmul_cuda_workspace_bytes(call, parse_path(path));
      },
      py::arg("rows"), py::arg("n"), py::arg("m"), py::arg("k"), py::arg("nout"), py::arg("dtype"), py::arg("glu") = "none",
      py::arg("path") = "auto", py::arg("norm") = false, py::arg("copy") = false,
      "Workspace bytes nm_matmul_cuda needs for this call (copy: it carries a 2:4 copy of the weight): the activation "
      "of a gated or normalised call off the decode paths, a 2:4 copy the sparse tensor cores stage; 0 for most calls.");
  mod.def(
      "cuda_two_of_four_copy",
      [](uintptr_t values, uintptr_t indices, int n, int m, int64_t k, int64_t nout, uintptr_t copy_values,
         uintptr_t copy_indices, uintptr_t stream, int64_t index_words) {
        if (!valid_pattern(n, m) || !fits_two_of_four(n, m)) throw std::invalid_argument("this n:m takes no 2:4 copy");
        const TwoOfFourCopy copy{reinterpret_cast<void*>(copy_values), reinterpret_cast<uint32_t*>(copy_indices)};
        const NMShape shape = with_row_pitch(NMShape::make(k, nout, n, m), index_words, "index_words");
        if (const int err = two_of_four_copy_cuda(reinterpret_cast<const void*>(values),
                                                  reinterpret_cast<const uint32_t*>(indices), shape, copy,
                                                  reinterpret_cast<void*>(stream)))
          throw std::runtime_error("cuda_two_of_four_copy failed with CUDA error " + std::to_string(err));
      },
      py::arg("values"), py::arg("indices"), py::arg("n"), py::arg("m"), py::arg("k"), py::arg("nout"),
      py::arg("copy_values"), py::arg("copy_indices"), py::arg("stream") = 0, py::arg("index_words") = 0,
      "Writes the 2:4 copy (docs/FORMAT.md) of a 16-bit packed weight (index_words: its rows' words, 0 for S*B/32) "
      "into copy_values [nout, S4] and copy_indices [nout, S4/16], as nmcli.format.two_of_four_copy does on the "
      "host; asynchronous on `stream`.");
  mod.def(
      "cuda_copy",
      [](uintptr_t dst, uintptr_t src, size_t bytes, uintptr_t stream) {
        if (const int err = device_copy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                                        reinterpret_cast<void*>(stream)))
          throw std::runtime_error(std::string("cuda_copy failed: ") + cudaGetErrorString(static_cast<cudaError_t>(err)));
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream") = 0,
      "Copies `bytes` (a multiple of 16, 16-byte aligned pointers) with nmcli's copy-bandwidth kernel; asynchronous.");
  mod.def(
      "cuda_device_count",
      [] {
        int count = 0;
        return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
      },
      "Visible CUDA devices (0 when there is no driver or GPU).");
  mod.def(
      "cuda_mem_info",
      [](int device) {
        size_t free_bytes = 0, total_bytes = 0;
        if (cudaSetDevice(device) != cudaSuccess || cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess)
          throw std::runtime_error("cudaMemGetInfo failed");
        return py::make_tuple(free_bytes, total_bytes);
      },
      py::arg("device") = 0, "(free, total) bytes of device memory, all processes and contexts included.");
  mod.def(
      "cuda_path",
      [](int64_t rows, int n, int m, int64_t k, int64_t nout, const std::string& dtype, int64_t vector, bool copy) {
        CudaMatMul call;
        call.dtype = parse_dtype(dtype);
        call.rows = rows;
        call.shape = NMShape::make(k, nout, n, m);
        call.vector = vector;
        if (copy) call.copy_values = call.copy_indices = kAnyCopy;
        return std::string(path_name(choose_path(call)));
      },
      py::arg("rows"), py::arg("n"), py::arg("m"), py::arg("k"), py::arg("nout"), py::arg("dtype") = "float16",
      py::arg("vector") = 0, py::arg("copy") = false,
      "The path the automatic dispatch takes for this call (copy: with a 2:4 copy of the weight).");
  mod.def(
      "last_tile_plan",
      [] {
        const CudaTilePlan& plan = last_tile_plan();
        return py::make_tuple(plan.rows, plan.split, plan.last_wave_split, plan.stream_k, plan.persistent,
                              plan.two_per_sm);
      },
      "(tile rows, K split, last wave split, stream-K, persistent, two blocks an SM) of this thread's last "
      "nm_matmul_cuda call on a warpgroup kernel (wgmma, wgmma_sp, fp32 wgmma); tile rows 0 where the last call "
      "ran another path.");
  mod.def(
      "cuda_path_supported",
      [](const std::string& path, int64_t rows, int n, int m, const std::string& dtype, int64_t k, int64_t vector,
         bool copy) {
        CudaMatMul call;
        call.dtype = parse_dtype(dtype);
        call.rows = rows;
        call.shape = NMShape::make(k > 0 ? k : 8 * m, 1, n, m);
        call.vector = vector;
        if (copy) call.copy_values = call.copy_indices = kAnyCopy;
        return path_supported(call, parse_path(path));
      },
      py::arg("path"), py::arg("rows"), py::arg("n"), py::arg("m"), py::arg("dtype"), py::arg("k") = 0,
      py::arg("vector") = 0, py::arg("copy") = false,
      "Whether a path (decode, decode_mma, tiled, mma, wgmma, wgmma_sp, vector) can run calls of this kind (K = k, or a "
      "multiple of 8 when 0).");
}

}  // namespace nmcli
