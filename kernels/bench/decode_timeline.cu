// decode_timeline: where the time of a decode call (kernels/cuda/decode.cuh, 1-16 activation rows)
// goes, warp by warp, when calls run back to back as they do in a model and in `nmcli bench
// kernels`: one CUDA graph of one call per buffer set, the sets rotated past L2, replayed.
//
// Every warp records the global timer (ns, one clock for all SMs) when it starts, when it has
// waited for the previous kernel, when the block has staged the activations, and when it leaves
// (the NMCLI_DECODE_STAMP hooks in decode.cuh, compiled to nothing elsewhere). Per call the probe
// prints medians over the middle calls of the graph:
//   gap     first warp start minus the previous call's last warp end (negative: they overlapped);
//   span    last warp end minus the previous call's last warp end (the time a call adds);
//   waited  block start to the end of its wait for the previous kernel;
//   staged  end of the wait to the activations staged (block barrier passed);
//   stream  staged to the warp's end; and when the first, median and last warps end.
// The stamps cost a call 0.1-1.5 us (BENCHMARKS.md, session 67): -DNMCLI_NO_STAMPS builds the
// kernel as shipped, which prints the time a call only. Random packed weights (every offset field
// in range), random activations: the kernel's time does not depend on the values. The product is
// not checked here (tests/test_gpu.py does that).
//
// Build (nvcc, no cuBLAS):
//   nvcc -std=c++17 -O3 -arch=sm_90a -Ikernels -Ikernels/cuda kernels/bench/decode_timeline.cu \
//        -o decode_timeline
//   ./decode_timeline K NOUT N M [ROWS] [SETS] [REPLAYS]   (NMCLI_NO_PDL=1: launches without PDL)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace probe {
constexpr int kEvents = 4;
constexpr int kMostBlocks = 1024;  // per call; the decode grid is at most one block per SM
// In the constant bank, not global memory: a stamp must not make a warp wait on a load before it
// issues its first weight loads (global variables did, and added 1-4 us to a call).
__constant__ unsigned long long* g_stamps;  // [set][block][warp][event]
__constant__ unsigned* g_smid;              // [set][block]: the SM the block ran on
__constant__ const char* g_values_base;     // every set's values in one allocation, 2^g_set_shift
__constant__ int g_set_shift;               // bytes apart: a call's set from its values pointer

// A warp's first three events wait in shared memory; when it leaves, it writes all four out.
__device__ __forceinline__ void stamp(const void* values, int event) {
  __shared__ unsigned long long held[32][kEvents];
  if ((threadIdx.x & 31) != 0) return;
  const int warp = threadIdx.x >> 5;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  held[warp][event] = now;
  if (event != kEvents - 1) return;
  const long long set = (static_cast<const char*>(values) - g_values_base) >> g_set_shift;
  unsigned long long* out = g_stamps + ((set * kMostBlocks + blockIdx.x) * 32 + warp) * kEvents;
  for (int e = 0; e < kEvents; ++e) out[e] = held[warp][e];
  unsigned sm;
  asm("mov.u32 %0, %%smid;" : "=r"(sm));
  g_smid[set * kMostBlocks + blockIdx.x] = sm;
}
}  // namespace probe

#ifndef NMCLI_NO_STAMPS  // -DNMCLI_NO_STAMPS: the kernel as shipped, for its time alone
#define NMCLI_DECODE_STAMP(p, event) ::probe::stamp((p).values, (event))
#endif
#include "decode.cuh"

namespace nmcli {
NMCLI_INSTANTIATE_DECODE(__half)

int multiprocessor_count() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count;
}
int compute_capability() { return 90; }
bool use_pdl() { return std::getenv("NMCLI_NO_PDL") == nullptr; }
}  // namespace nmcli

namespace {

#define CHECK(expr)                                                                   \
  do {                                                                                \
    cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_));                \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

__global__ void fill_random(uint32_t* words, size_t count, uint32_t seed, bool as_halves) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    if (as_halves) {  // two fp16 values in [-1, 1)
      const __half lo = __float2half(static_cast<float>(h & 0xffff) / 32768.f - 1.f);
      const __half hi = __float2half(static_cast<float>(h >> 16) / 32768.f - 1.f);
      h = static_cast<uint32_t>(__half_as_ushort(lo)) | static_cast<uint32_t>(__half_as_ushort(hi)) << 16;
    }
    words[i] = h;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The buffer sets of one shape on the device: every set's values in one allocation, 2^set_shift
// bytes apart (the stamps find a call's set from its values pointer).
struct Sets {
  nmcli::NMShape shape;
  int64_t rows = 1;
  int count = 0, set_shift = 8;
  char* values = nullptr;
  uint32_t* indices = nullptr;
  __half *x = nullptr, *y = nullptr;
  unsigned long long* stamps = nullptr;
  unsigned* smids = nullptr;
  size_t stamp_count = 0;

  Sets(const nmcli::NMShape& s, int64_t r, int sets) : shape(s), rows(r), count(sets) {
    while ((1ll << set_shift) < shape.row_len * shape.nout * 2) ++set_shift;
    const size_t words = index_words();
    stamp_count = static_cast<size_t>(count) * probe::kMostBlocks * 32 * probe::kEvents;
    CHECK(cudaMalloc(&values, value_stride() * count));
    CHECK(cudaMalloc(&indices, words * 4 * count));
    CHECK(cudaMalloc(&x, rows * shape.k * 2 * count));
    CHECK(cudaMalloc(&y, rows * shape.nout * 2 * count));
    CHECK(cudaMalloc(&stamps, stamp_count * 8));
    CHECK(cudaMalloc(&smids, static_cast<size_t>(count) * probe::kMostBlocks * 4));
    fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(values), value_stride() * count / 4, 1, true);
    fill_random<<<1024, 256>>>(indices, words * count, 2, false);
    fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(x), rows * shape.k * count / 2, 3, true);
    const char* base = values;
    CHECK(cudaMemcpyToSymbol(probe::g_stamps, &stamps, sizeof(stamps)));
    CHECK(cudaMemcpyToSymbol(probe::g_smid, &smids, sizeof(smids)));
    CHECK(cudaMemcpyToSymbol(probe::g_values_base, &base, sizeof(base)));
    CHECK(cudaMemcpyToSymbol(probe::g_set_shift, &set_shift, sizeof(set_shift)));
  }
  long long value_stride() const { return 1ll << set_shift; }
  size_t index_words() const { return static_cast<size_t>(shape.index_words * shape.nout); }
  double bytes() const {  // what one call must move: values, offset words, X and Y
    return static_cast<double>(shape.row_len * shape.nout * 2 + index_words() * 4 + rows * shape.k * 2 +
                               rows * shape.nout * 2);
  }
  void call(int set, cudaStream_t stream) const {
    nmcli::DecodeParamsT<__half> p{};
    p.x = x + set * rows * shape.k;
    p.values = reinterpret_cast<const __half*>(values + set * value_stride());
    p.indices = indices + set * index_words();
    p.glu = nmcli::Glu::none;
    p.y.base[0] = y + set * rows * shape.nout;
    p.y.end[0] = shape.nout;
    p.y.count = 1;
    p.rows = rows, p.k = shape.k, p.nout = shape.nout, p.groups = shape.groups, p.row_len = shape.row_len;
    p.index_words = shape.index_words, p.n = shape.n, p.m = shape.m, p.bits = shape.bits, p.alpha = 1.f;
    CHECK(nmcli::run_decode<__half>(p, stream));
  }
};

// One call's stamps: each block's start (its first warp's), wait and staging ends, SM and end, and
// every warp's end and streaming time (staged to end).
struct Call {
  double first_start = 1e300, last_end = 0;
  std::vector<double> block_start, waited, staged, block_end, warp_end, stream;
  std::vector<unsigned> block_sm;
};

std::vector<Call> read_calls(const Sets& sets, int* blocks) {
  std::vector<unsigned long long> h(sets.stamp_count);
  std::vector<unsigned> sm_of(static_cast<size_t>(sets.count) * probe::kMostBlocks);
  CHECK(cudaMemcpy(h.data(), sets.stamps, h.size() * 8, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(sm_of.data(), sets.smids, sm_of.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<Call> calls(sets.count);
  *blocks = 0;
  for (int s = 0; s < sets.count; ++s) {
    Call& c = calls[s];
    for (int b = 0; b < probe::kMostBlocks; ++b) {
      const size_t block = static_cast<size_t>(s) * probe::kMostBlocks + b;
      const unsigned long long* rec = &h[block * 32 * probe::kEvents];
      if (rec[0] == 0) continue;
      *blocks = std::max(*blocks, b + 1);
      double start = 1e300, waited = 0, staged = 0, end = 0;
      for (int w = 0; w < 32; ++w) {
        const unsigned long long* e = rec + w * probe::kEvents;
        if (e[0] == 0) continue;
        start = std::min(start, static_cast<double>(e[0]));
        waited = std::max(waited, static_cast<double>(e[1]));
        staged = std::max(staged, static_cast<double>(e[2]));
        end = std::max(end, static_cast<double>(e[3]));
        c.warp_end.push_back(static_cast<double>(e[3]));
        c.stream.push_back(static_cast<double>(e[3] - e[2]));
      }
      c.first_start = std::min(c.first_start, start);
      c.last_end = std::max(c.last_end, end);
      c.block_start.push_back(start);
      c.waited.push_back(waited - start);
      c.staged.push_back(staged - waited);
      c.block_end.push_back(end);
      c.block_sm.push_back(sm_of[block]);
    }
  }
  return calls;
}

// Medians over the calls that have a call before them, in us.
void print_timeline(const std::vector<Call>& calls) {
  std::vector<double> gap, span, mid_start, last_start, waited, staged, stream, first_end, mid_end, last_end;
  for (size_t s = 2; s < calls.size(); ++s) {
    const Call& c = calls[s];
    const double t0 = c.first_start;
    std::vector<double> ends = c.warp_end;
    std::sort(ends.begin(), ends.end());
    gap.push_back((t0 - calls[s - 1].last_end) / 1e3);
    span.push_back((c.last_end - calls[s - 1].last_end) / 1e3);
    mid_start.push_back((median(c.block_start) - t0) / 1e3);
    last_start.push_back((*std::max_element(c.block_start.begin(), c.block_start.end()) - t0) / 1e3);
    waited.push_back(median(c.waited) / 1e3);
    staged.push_back(median(c.staged) / 1e3);
    stream.push_back(median(c.stream) / 1e3);
    first_end.push_back((ends.front() - t0) / 1e3);
    mid_end.push_back((ends[ends.size() / 2] - t0) / 1e3);
    last_end.push_back((ends.back() - t0) / 1e3);
  }
  std::printf("  span %.2f us, gap %.2f; from the first warp's start (us): median block start %.2f, last %.2f;\n",
              median(span), median(gap), median(mid_start), median(last_start));
  std::printf("  a block waits %.2f, stages %.2f; a warp streams %.2f; warps end at %.2f first, %.2f median,"
              " %.2f last\n", median(waited), median(staged), median(stream), median(first_end), median(mid_end),
              median(last_end));
}

// Whether the spread of block ends belongs to the SMs: each SM's block end after the call's median
// block end, averaged over the calls, against how much it varies from call to call.
void print_sm_spread(const std::vector<Call>& calls) {
  std::vector<std::vector<double>> by_sm(1024);
  for (size_t s = 2; s < calls.size(); ++s) {
    const double mid = median(calls[s].block_end);
    for (size_t i = 0; i < calls[s].block_end.size(); ++i)
      by_sm[calls[s].block_sm[i] % 1024].push_back((calls[s].block_end[i] - mid) / 1e3);
  }
  std::vector<double> means, spreads;
  for (const auto& v : by_sm) {
    if (v.size() < 4) continue;
    double mean = 0, var = 0;
    for (double d : v) mean += d;
    mean /= v.size();
    for (double d : v) var += (d - mean) * (d - mean);
    means.push_back(mean), spreads.push_back(std::sqrt(var / (v.size() - 1)));
  }
  if (means.empty()) return;
  std::sort(means.begin(), means.end());
  std::printf("  block end after the median, per SM over the calls (us): means %.2f min, %.2f p10, %.2f p90,"
              " %.2f max; call-to-call std %.2f (median over SMs)\n", means.front(), means[means.size() / 10],
              means[means.size() * 9 / 10], means.back(), median(spreads));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s K NOUT N M [ROWS=1] [SETS=16] [REPLAYS=20]\n", argv[0]);
    return 2;
  }
  const int64_t k = std::atoll(argv[1]), nout = std::atoll(argv[2]);
  const int n = std::atoi(argv[3]), m = std::atoi(argv[4]);
  const int64_t rows = argc > 5 ? std::atoll(argv[5]) : 1;
  const int count = argc > 6 ? std::atoi(argv[6]) : 16, replays = argc > 7 ? std::atoi(argv[7]) : 20;
  const Sets sets(nmcli::NMShape::make(k, nout, n, m), rows, count);

  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int s = 0; s < count; ++s) sets.call(s, stream);  // first launches configure the kernel outside the graph
  CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int s = 0; s < count; ++s) sets.call(s, stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<double> per_call;
  for (int r = 0; r < replays + 3; ++r) {  // 3 warm-up replays
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (r >= 3) per_call.push_back(1e3 * ms / count);
  }
  CHECK(cudaMemset(sets.stamps, 0, sets.stamp_count * 8));
  CHECK(cudaGraphLaunch(exec, stream));  // the replay whose stamps are read
  CHECK(cudaStreamSynchronize(stream));
  int blocks = 0;
  const std::vector<Call> calls = read_calls(sets, &blocks);

  const double t = median(per_call);
  std::printf("decode %lld x %lld x %lld %d:%d, %d blocks, PDL %s: %.2f us a call (event-timed, %d sets), %.1f MB,"
              " %.0f GB/s\n", static_cast<long long>(rows), static_cast<long long>(k), static_cast<long long>(nout),
              n, m, blocks, nmcli::use_pdl() ? "on" : "off", t, count, sets.bytes() / 1e6, sets.bytes() / t / 1e3);
  if (blocks == 0) return 0;  // built without the stamps
  print_timeline(calls);
  print_sm_spread(calls);
  return 0;
}
