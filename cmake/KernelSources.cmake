# The CUDA kernel sources, relative to the repository root: one list for the op library
# (cmake/Targets.cmake) and the stand-alone micro-benchmark (kernels/bench/CMakeLists.txt).
set(NMCLI_KERNEL_CUDA_FILES kernels/cuda/decode_f32.cu kernels/cuda/decode_f16.cu kernels/cuda/decode_bf16.cu
    kernels/cuda/tiled.cu kernels/cuda/mma.cu kernels/cuda/dispatch.cu)
# Built for sm_90a only (wgmma), as a separate object library with its own -gencode: the
# architecture-specific target cannot share a compile with the plain sm_90 one.
set(NMCLI_KERNEL_SM90A_FILES kernels/cuda/wgmma.cu)
