#include "op_timer.h"

#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

#ifdef NMCLI_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace nmcli {
namespace {

std::atomic<bool> g_enabled{false};
std::mutex g_mutex;
double g_total_ms = 0;
long long g_calls = 0;
#ifdef NMCLI_WITH_CUDA
std::vector<std::pair<cudaEvent_t, cudaEvent_t>> g_pending;  // resolved in nmcli_op_timing_read
#endif

}  // namespace

bool op_timing_enabled() { return g_enabled.load(std::memory_order_relaxed); }

void add_host_time(double ms) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_total_ms += ms;
  ++g_calls;
}

#ifdef NMCLI_WITH_CUDA
StreamTimer::StreamTimer(void* stream) : stream_(stream) {
  if (!op_timing_enabled()) return;
  cudaEvent_t start;
  if (cudaEventCreate(&start) != cudaSuccess) return;
  cudaEventRecord(start, static_cast<cudaStream_t>(stream_));
  start_ = start;
}

StreamTimer::~StreamTimer() {
  if (!start_) return;
  cudaEvent_t stop;
  if (cudaEventCreate(&stop) != cudaSuccess) return;
  cudaEventRecord(stop, static_cast<cudaStream_t>(stream_));
  std::lock_guard<std::mutex> lock(g_mutex);
  g_pending.emplace_back(static_cast<cudaEvent_t>(start_), stop);
}
#endif

}  // namespace nmcli

extern "C" {

__attribute__((visibility("default"))) void nmcli_op_timing_enable(int on) {
  nmcli::g_enabled.store(on != 0, std::memory_order_relaxed);
}

// Total milliseconds and number of calls since the last read; then resets. Waits for pending
// CUDA events, so call it after the runs being measured have finished.
__attribute__((visibility("default"))) void nmcli_op_timing_read(double* total_ms, long long* calls) {
  std::lock_guard<std::mutex> lock(nmcli::g_mutex);
#ifdef NMCLI_WITH_CUDA
  for (auto& [start, stop] : nmcli::g_pending) {
    float ms = 0;
    if (cudaEventSynchronize(stop) == cudaSuccess && cudaEventElapsedTime(&ms, start, stop) == cudaSuccess) {
      nmcli::g_total_ms += ms;
      ++nmcli::g_calls;
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  nmcli::g_pending.clear();
#endif
  *total_ms = nmcli::g_total_ms;
  *calls = nmcli::g_calls;
  nmcli::g_total_ms = 0;
  nmcli::g_calls = 0;
}

}  // extern "C"
