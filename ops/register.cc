// Entry point of libnmcli_ops.so: SessionOptions.register_custom_ops_library calls
// RegisterCustomOps, which adds the nmcli domain with one kernel per (element type, EP).
#include <mutex>

#include "nm_matmul_cpu_op.h"
#ifdef NMCLI_WITH_CUDA
#include "nm_matmul_cuda_op.h"
#endif

#ifndef NMCLI_CUDA_ARCHS
#define NMCLI_CUDA_ARCHS ""
#endif

namespace {
std::once_flag g_once;
Ort::CustomOpDomain* g_domain = nullptr;  // lives as long as the process: sessions keep pointers to it
}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                  const OrtApiBase* api_base) {
  // Built against C API 21; newer runtimes still serve that version of the table.
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  return nmcli::guarded([&] {
    std::call_once(g_once, [] {
      g_domain = new Ort::CustomOpDomain(nmcli::kOpDomain);
      nmcli::add_cpu_ops(*g_domain);
#ifdef NMCLI_WITH_CUDA
      nmcli::add_cuda_ops(*g_domain);
#endif
    });
    Ort::UnownedSessionOptions(options).Add(*g_domain);
  });
}

// "key=value;..." describing the build, read by nmcli.build_info().
__attribute__((visibility("default"))) const char* nmcli_ops_build_info() {
#ifdef NMCLI_WITH_CUDA
  return "format=1;cpu=1;cuda=1;cuda_archs=" NMCLI_CUDA_ARCHS;
#else
  return "format=1;cpu=1;cuda=0;cuda_archs=";
#endif
}

}  // extern "C"
