// Optional timing of nmcli.NMMatMul's own kernels, for `nmcli bench`'s split between our op and
// the rest of the model. Off by default (no cost beyond one relaxed atomic load per call);
// switched on and read through the C functions nmcli_op_timing_enable / nmcli_op_timing_read.
// CPU kernels are timed on the host clock; CUDA kernels with CUDA events on the compute stream
// (recorded asynchronously, resolved when read), since ORT's own profiler sees only launches.
#pragma once
#include <chrono>

namespace nmcli {

bool op_timing_enabled();
void add_host_time(double ms);

// Times the enclosing scope on the host clock when timing is on.
class HostTimer {
 public:
  HostTimer() : on_(op_timing_enabled()), start_(std::chrono::steady_clock::now()) {}
  ~HostTimer() {
    if (on_) add_host_time(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count());
  }

 private:
  bool on_;
  std::chrono::steady_clock::time_point start_;
};

#ifdef NMCLI_WITH_CUDA
// Brackets a launch on `stream` with CUDA events when timing is on.
class StreamTimer {
 public:
  explicit StreamTimer(void* stream);
  ~StreamTimer();

 private:
  void* stream_;
  void* start_ = nullptr;
};
#endif

}  // namespace nmcli
