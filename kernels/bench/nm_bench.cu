// nmcli_bench: nmcli's CUDA kernels against cuBLAS dense, with no Python and no PyTorch.
//
// Method (the same as `nmcli bench kernels`, so the numbers compare):
//  * a magnitude-pruned N:M weight is built on the host from random data and packed per
//    docs/FORMAT.md; the same pruned weight, expanded to dense, is what cuBLAS multiplies;
//  * enough buffer sets to exceed 4x the L2 are rotated, so every call reads its weight from
//    HBM; one CUDA graph holds one launch per set and is replayed; each replay is timed with
//    CUDA events and the time per call is the median replay time divided by the sets;
//  * ceilings measured in the same run: device-to-device copy bandwidth (read + write; the fastest
//    of cudaMemcpyAsync in a graph and on its own, and nmcli's copy kernel, kernels/cuda/copy.cu) and
//    cuBLAS dense (cublasGemmEx, fp32 accumulation, no TF32) on the same shape;
//  * every measured call is checked: our output against cuBLAS's on the same inputs.
//
// Build: cmake -S kernels/bench -B build/bench [-DCUBLAS_ROOT=.../site-packages/nvidia/cu13]
//        cmake --build build/bench && build/bench/nmcli_bench --help
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/nm_matmul_cuda.h"

namespace {

using nmcli::CudaMatMul;
using nmcli::CudaPath;
using nmcli::DType;
using nmcli::NMShape;

#define CHECK_CUDA(expr)                                                                       \
  do {                                                                                         \
    cudaError_t err_ = (expr);                                                                 \
    if (err_ != cudaSuccess) throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(err_)); \
  } while (0)
#define CHECK_CUBLAS(expr)                                                                     \
  do {                                                                                         \
    cublasStatus_t st_ = (expr);                                                               \
    if (st_ != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(#expr) + ": cuBLAS status " + std::to_string(st_)); \
  } while (0)

struct Options {
  std::vector<std::pair<int, int>> patterns{{2, 4}, {2, 8}, {1, 4}, {4, 16}, {1, 8}};
  std::vector<int64_t> rows;  // empty: the shape set's own
  std::vector<std::array<int64_t, 3>> shapes;
  std::string set = "llama";
  DType dtype = DType::f16;
  CudaPath path = CudaPath::automatic;
  int replays = 20;
  bool json = false;
};

const char* dtype_name(DType d) { return d == DType::f16 ? "float16" : d == DType::bf16 ? "bfloat16" : "float32"; }
size_t dtype_bytes(DType d) { return d == DType::f32 ? 4 : 2; }

// Host float -> device element bits.
void store(DType d, float v, void* out, size_t i) {
  if (d == DType::f32) static_cast<float*>(out)[i] = v;
  else if (d == DType::f16) static_cast<__half*>(out)[i] = __float2half(v);
  else static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16(v);
}
float load(DType d, const void* in, size_t i) {
  if (d == DType::f32) return static_cast<const float*>(in)[i];
  if (d == DType::f16) return __half2float(static_cast<const __half*>(in)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(in)[i]);
}

// Packed weight per docs/FORMAT.md (values [Nout, S], B-bit offsets in uint32 words, little-
// endian bit strings), plus the dense pruned weight [K, Nout] it encodes, both on the host.
struct HostWeight {
  NMShape shape;
  std::vector<char> values;        // Nout * S elements of the dtype
  std::vector<uint32_t> indices;   // Nout * index_words
  std::vector<char> dense;         // K * Nout elements of the dtype (row-major [K, Nout])
};

void write_offset(uint32_t* row_words, int64_t j, int bits, uint32_t offset) {
  const int64_t bit = j * bits;
  const int64_t word = bit >> 5;
  const int shift = static_cast<int>(bit & 31);
  const uint64_t field = static_cast<uint64_t>(offset) << shift;
  row_words[word] |= static_cast<uint32_t>(field);
  if (shift + bits > 32) row_words[word + 1] |= static_cast<uint32_t>(field >> 32);
}

HostWeight magnitude_pruned(int64_t k, int64_t nout, int n, int m, DType dtype, std::mt19937& gen) {
  HostWeight w;
  w.shape = NMShape::make(k, nout, n, m);
  const NMShape& s = w.shape;
  const size_t eb = dtype_bytes(dtype);
  w.values.assign(static_cast<size_t>(nout * s.row_len) * eb, 0);
  w.indices.assign(static_cast<size_t>(nout * s.index_words), 0u);
  w.dense.assign(static_cast<size_t>(k * nout) * eb, 0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> column(static_cast<size_t>(k));
  std::vector<int> order(m);
  for (int64_t j = 0; j < nout; ++j) {
    for (auto& v : column) v = normal(gen);
    uint32_t* words = w.indices.data() + j * s.index_words;
    for (int64_t g = 0; g < s.groups; ++g) {
      const int real = static_cast<int>(std::min<int64_t>(m, k - g * m));
      for (int i = 0; i < m; ++i) order[i] = i;
      // Top-N |w| of the real positions (ties to the lower offset); padding only if needed.
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        const float fa = a < real ? std::fabs(column[g * m + a]) : -1.0f;
        const float fb = b < real ? std::fabs(column[g * m + b]) : -1.0f;
        return fa > fb;
      });
      std::sort(order.begin(), order.begin() + n);
      for (int t = 0; t < n; ++t) {
        const int64_t entry = g * n + t;
        const int off = order[t];
        const float v = off < real ? column[g * m + off] : 0.0f;
        store(dtype, v, w.values.data(), static_cast<size_t>(j * s.row_len + entry));
        write_offset(words, entry, s.bits, static_cast<uint32_t>(off));
        if (off < real) store(dtype, v, w.dense.data(), static_cast<size_t>((g * m + off) * nout + j));
      }
    }
    for (int64_t entry = 0; entry < s.stored(); ++entry) {  // the writer must round-trip
      const uint32_t off = nmcli::read_offset(words, entry, s.bits);
      if (off >= static_cast<uint32_t>(m)) throw std::logic_error("offset packing does not round-trip");
    }
  }
  return w;
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(bytes, 1))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Median milliseconds of run(), each timed with CUDA events on `stream`.
template <typename F>
float median_ms(cudaStream_t stream, F run, int replays) {
  cudaEvent_t start, end;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&end));
  std::vector<float> times;
  for (int i = 0; i < replays; ++i) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    run();
    CHECK_CUDA(cudaEventRecord(end, stream));
    CHECK_CUDA(cudaEventSynchronize(end));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, end));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// Median milliseconds of one replay of a graph capturing launch_all().
template <typename F>
float time_graph(cudaStream_t stream, F launch_all, int replays) {
  launch_all();  // warm-up outside capture (lazy module load, cuBLAS heuristics)
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch_all();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  const float ms = median_ms(stream, [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); }, replays);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return ms;
}

int sets_for(size_t l2_bytes, size_t bytes_per_set) {
  const size_t want = (4 * l2_bytes + bytes_per_set - 1) / std::max<size_t>(bytes_per_set, 1);
  return static_cast<int>(std::min<size_t>(64, std::max<size_t>(2, want)));
}

double copy_bandwidth_gbps(cudaStream_t stream) {
  const size_t bytes = size_t(1) << 30;
  DeviceBuffer src(bytes), dst(bytes);
  CHECK_CUDA(cudaMemsetAsync(src.ptr, 1, bytes, stream));
  // The fastest of cudaMemcpyAsync inside a graph and on its own (2.42 against 2.99 TB/s on the
  // H100), and nmcli's 16-byte-vector copy kernel (kernels/cuda/copy.cu).
  auto copy_call = [&] { CHECK_CUDA(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, stream)); };
  float best_ms = std::min(time_graph(stream, copy_call, 20),
                           time_graph(stream, [&] { CHECK_CUDA(static_cast<cudaError_t>(nmcli::device_copy(dst.ptr, src.ptr, bytes, stream))); }, 20));
  copy_call();  // warm-up
  CHECK_CUDA(cudaStreamSynchronize(stream));
  best_ms = std::min(best_ms, median_ms(stream, copy_call, 20));
  return 2.0 * bytes / (best_ms * 1e-3) / 1e9;
}

struct Row {
  int64_t m, k, n;
  int pn, pm;
  std::string path;
  double ours_ms, cublas_ms, gbps, pct_bw, tflops, cublas_tflops, check_rel_err;
};

Row bench_one(cublasHandle_t handle, cudaStream_t stream, const cudaDeviceProp& prop, double copy_gbps,
              int64_t rows, int64_t k, int64_t nout, int n, int m, const Options& opt, std::mt19937& gen) {
  const DType dt = opt.dtype;
  const size_t eb = dtype_bytes(dt);
  HostWeight w = magnitude_pruned(k, nout, n, m, dt, gen);
  const NMShape& s = w.shape;
  CudaMatMul call;
  call.dtype = dt;
  call.rows = rows;
  call.shape = s;
  CudaPath path = opt.path == CudaPath::automatic ? nmcli::choose_path(call) : opt.path;
  if (!nmcli::path_supported(call, path)) throw std::invalid_argument("path cannot run this call");

  const size_t x_bytes = rows * k * eb, y_bytes = rows * nout * eb;
  const size_t v_bytes = w.values.size(), i_bytes = w.indices.size() * 4, d_bytes = w.dense.size();
  std::vector<char> x_host(x_bytes);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < static_cast<size_t>(rows * k); ++i) store(dt, normal(gen), x_host.data(), i);

  const int sets = sets_for(prop.l2CacheSize, v_bytes + i_bytes + x_bytes + y_bytes);
  std::vector<std::unique_ptr<DeviceBuffer>> vs, is, xs, ys;
  for (int i = 0; i < sets; ++i) {
    vs.emplace_back(new DeviceBuffer(v_bytes));
    is.emplace_back(new DeviceBuffer(i_bytes));
    xs.emplace_back(new DeviceBuffer(x_bytes));
    ys.emplace_back(new DeviceBuffer(y_bytes));
    CHECK_CUDA(cudaMemcpy(vs[i]->ptr, w.values.data(), v_bytes, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(is[i]->ptr, w.indices.data(), i_bytes, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(xs[i]->ptr, x_host.data(), x_bytes, cudaMemcpyHostToDevice));
  }
  // One workspace for every set (a staged 2:4 copy, kernels/cuda/dispatch.cu), as ORT's arena
  // hands the same block to consecutive calls.
  const size_t workspace_bytes = nmcli::nm_matmul_cuda_workspace_bytes(call, path);
  DeviceBuffer workspace(workspace_bytes);
  auto ours = [&](int i) {
    CudaMatMul c = call;
    c.workspace = workspace_bytes ? workspace.ptr : nullptr;
    c.x = xs[i]->ptr;
    c.values = vs[i]->ptr;
    c.indices = static_cast<const uint32_t*>(is[i]->ptr);
    c.y = nmcli::OutputParts<void>::single(ys[i]->ptr, c.shape.nout);
    const int err = nmcli::nm_matmul_cuda(c, stream, path);
    if (err != 0) throw std::runtime_error(std::string("nm_matmul_cuda: ") + cudaGetErrorString(static_cast<cudaError_t>(err)));
  };
  const float ours_ms = time_graph(stream, [&] { for (int i = 0; i < sets; ++i) ours(i); }, opt.replays) / sets;
  std::vector<char> y_ours(y_bytes);
  CHECK_CUDA(cudaMemsetAsync(ys[0]->ptr, 0xFF, y_bytes, stream));  // poisoned (NaN) before the checked call
  ours(0);
  CHECK_CUDA(cudaMemcpyAsync(y_ours.data(), ys[0]->ptr, y_bytes, cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  vs.clear();
  is.clear();

  // cuBLAS, column-major: Y^T [Nout x rows] = W^T [Nout x K] * X^T [K x rows] on row-major buffers.
  const int dsets = sets_for(prop.l2CacheSize, d_bytes);
  std::vector<std::unique_ptr<DeviceBuffer>> ws, yd;
  for (int i = 0; i < dsets; ++i) {
    ws.emplace_back(new DeviceBuffer(d_bytes));
    yd.emplace_back(new DeviceBuffer(y_bytes));
    CHECK_CUDA(cudaMemcpy(ws[i]->ptr, w.dense.data(), d_bytes, cudaMemcpyHostToDevice));
  }
  const cudaDataType_t ct = dt == DType::f32 ? CUDA_R_32F : dt == DType::f16 ? CUDA_R_16F : CUDA_R_16BF;
  const float one = 1.0f, zero = 0.0f;
  auto dense = [&](int i) {
    CHECK_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(nout), static_cast<int>(rows),
                              static_cast<int>(k), &one, ws[i]->ptr, ct, static_cast<int>(nout), xs[i % sets]->ptr, ct,
                              static_cast<int>(k), &zero, yd[i]->ptr, ct, static_cast<int>(nout), CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  };
  const float cublas_ms = time_graph(stream, [&] { for (int i = 0; i < dsets; ++i) dense(i); }, opt.replays) / dsets;
  std::vector<char> y_ref(y_bytes);
  dense(0);
  CHECK_CUDA(cudaMemcpyAsync(y_ref.data(), yd[0]->ptr, y_bytes, cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));

  double diff = 0, norm = 0;
  for (size_t i = 0; i < static_cast<size_t>(rows * nout); ++i) {
    const double a = load(dt, y_ours.data(), i), b = load(dt, y_ref.data(), i);
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  const double rel = std::isfinite(diff) && norm > 0 ? std::sqrt(diff / norm) : INFINITY;

  Row r{rows, k, nout, n, m, nmcli::path_name(path), ours_ms, cublas_ms, 0, 0, 0, 0, rel};
  const double moved = static_cast<double>(s.nout * s.row_len * eb + s.nout * s.index_words * 4 + x_bytes + y_bytes);
  r.gbps = moved / (ours_ms * 1e-3) / 1e9;
  r.pct_bw = 100.0 * r.gbps / copy_gbps;
  const double flops = 2.0 * rows * k * nout;
  r.tflops = flops / (ours_ms * 1e-3) / 1e12;
  r.cublas_tflops = flops / (cublas_ms * 1e-3) / 1e12;
  return r;
}

std::vector<std::array<int64_t, 3>> shape_set(const Options& opt) {
  if (!opt.shapes.empty()) return opt.shapes;
  std::vector<std::pair<int64_t, int64_t>> kn;
  std::vector<int64_t> ms;
  if (opt.set == "nmsparse") {
    kn = {{1024, 1024}, {2048, 2048}, {4096, 4096}, {8192, 8192}, {1024, 4096}, {4096, 1024}, {5120, 20480}, {20480, 5120}};
    ms = {1, 256, 1024, 4096};
  } else {
    kn = {{4096, 4096}, {4096, 11008}, {11008, 4096}, {4096, 14336}, {14336, 4096}};
    ms = {1, 2, 4, 8, 16, 256, 4096};
  }
  if (!opt.rows.empty()) ms = opt.rows;
  std::vector<std::array<int64_t, 3>> out;
  for (auto [k, n] : kn)
    for (int64_t m : ms) out.push_back({m, k, n});
  return out;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

const char* kUsage =
    "usage: nmcli_bench [--shapes llama|nmsparse] [--rows 1,8,16] [--mkn 16x4096x4096,...]\n"
    "                   [--nm 2:4,2:8,...] [--dtype f16|bf16|f32] [--path auto|decode|mma|wgmma|wgmma_sp|tiled]\n"
    "                   [--replays 20] [--json]\n"
    "Times nmcli's CUDA kernels against cuBLAS dense on the same pruned weights (CUDA-graph\n"
    "replay, buffers rotated past 4x L2, median) and checks every result against cuBLAS.\n";

Options parse(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--shapes") {
      opt.set = value();
      if (opt.set != "llama" && opt.set != "nmsparse") throw std::invalid_argument("--shapes must be llama or nmsparse");
    } else if (a == "--rows") {
      for (auto& r : split(value(), ',')) opt.rows.push_back(std::stoll(r));
    } else if (a == "--mkn") {
      for (auto& t : split(value(), ',')) {
        auto d = split(t, 'x');
        if (d.size() != 3) throw std::invalid_argument("--mkn wants ROWSxKxN");
        opt.shapes.push_back({std::stoll(d[0]), std::stoll(d[1]), std::stoll(d[2])});
      }
    } else if (a == "--nm") {
      opt.patterns.clear();
      for (auto& p : split(value(), ',')) {
        auto d = split(p, ':');
        if (d.size() != 2) throw std::invalid_argument("--nm wants N:M");
        const int n = std::stoi(d[0]), m = std::stoi(d[1]);
        if (!nmcli::valid_pattern(n, m)) throw std::invalid_argument("invalid N:M " + p);
        opt.patterns.push_back({n, m});
      }
    } else if (a == "--dtype") {
      const std::string d = value();
      if (d == "f16" || d == "float16") opt.dtype = DType::f16;
      else if (d == "bf16" || d == "bfloat16") opt.dtype = DType::bf16;
      else if (d == "f32" || d == "float32") opt.dtype = DType::f32;
      else throw std::invalid_argument("--dtype must be f16, bf16 or f32");
    } else if (a == "--path") {
      if (!path_from_name(value().c_str(), &opt.path))
        throw std::invalid_argument("--path must be auto, decode, mma, wgmma, wgmma_sp or tiled");
    } else if (a == "--replays") {
      opt.replays = std::max(3, std::stoi(value()));
    } else if (a == "--json") {
      opt.json = true;
    } else {
      throw std::invalid_argument("unknown argument " + a);
    }
  }
  return opt;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options opt = parse(argc, argv);
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::fprintf(stderr, "error: no CUDA GPU available\n");
      return 2;
    }
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cublasHandle_t handle;
    CHECK_CUBLAS(cublasCreate(&handle));
    CHECK_CUBLAS(cublasSetStream(handle, stream));
    DeviceBuffer workspace(32u << 20);  // a fixed workspace so cuBLAS allocates nothing under capture
    CHECK_CUBLAS(cublasSetWorkspace(handle, workspace.ptr, 32u << 20));
    const double copy_gbps = copy_bandwidth_gbps(stream);
    std::mt19937 gen(12345);
    const double tolerance = opt.dtype == DType::f32 ? 1e-5 : opt.dtype == DType::f16 ? 2e-3 : 1.6e-2;
    if (!opt.json)
      std::printf("%s, %s, copy bandwidth %.0f GB/s\n%6s %6s %6s %5s %7s %10s %10s %8s %6s %6s %8s %8s %9s\n", prop.name,
                  dtype_name(opt.dtype), copy_gbps, "M", "K", "N", "N:M", "path", "ours ms", "cuBLAS ms", "speedup",
                  "GB/s", "%BW", "TFLOP/s", "cuBLAS", "check");
    else
      std::printf("{\"gpu\": \"%s\", \"dtype\": \"%s\", \"copy_gbps\": %.1f, \"rows\": [\n", prop.name,
                  dtype_name(opt.dtype), copy_gbps);
    int failures = 0;
    bool first = true;
    for (const auto& shape : shape_set(opt)) {
      for (auto [n, m] : opt.patterns) {
        CudaMatMul probe;
        probe.dtype = opt.dtype;
        probe.rows = shape[0];
        probe.shape = NMShape::make(shape[1], shape[2], n, m);
        if (opt.path != CudaPath::automatic && !nmcli::path_supported(probe, opt.path)) continue;
        const Row r = bench_one(handle, stream, prop, copy_gbps, shape[0], shape[1], shape[2], n, m, opt, gen);
        const bool ok = r.check_rel_err <= tolerance;
        failures += !ok;
        if (opt.json) {
          std::printf("%s  {\"m\": %lld, \"k\": %lld, \"n\": %lld, \"nm\": \"%d:%d\", \"path\": \"%s\", \"ours_ms\": %.5f, "
                      "\"cublas_ms\": %.5f, \"speedup\": %.3f, \"gbps\": %.1f, \"pct_copy_bw\": %.1f, \"tflops\": %.2f, "
                      "\"cublas_tflops\": %.2f, \"check_rel_err\": %.3g, \"check_ok\": %s}",
                      first ? "" : ",\n", (long long)r.m, (long long)r.k, (long long)r.n, r.pn, r.pm, r.path.c_str(),
                      r.ours_ms, r.cublas_ms, r.cublas_ms / r.ours_ms, r.gbps, r.pct_bw, r.tflops, r.cublas_tflops,
                      r.check_rel_err, ok ? "true" : "false");
        } else {
          std::printf("%6lld %6lld %6lld %2d:%-2d %7s %10.4f %10.4f %7.2fx %6.0f %5.0f%% %8.1f %8.1f %9s\n",
                      (long long)r.m, (long long)r.k, (long long)r.n, r.pn, r.pm, r.path.c_str(), r.ours_ms,
                      r.cublas_ms, r.cublas_ms / r.ours_ms, r.gbps, r.pct_bw, r.tflops, r.cublas_tflops,
                      ok ? "ok" : "FAIL");
        }
        std::fflush(stdout);
        first = false;
      }
    }
    if (opt.json) std::printf("\n]}\n");
    cublasDestroy(handle);
    cudaStreamDestroy(stream);
    if (failures) std::fprintf(stderr, "error: %d result(s) differ from cuBLAS beyond tolerance %.1g\n", failures, tolerance);
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
