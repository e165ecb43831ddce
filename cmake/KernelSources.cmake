# The CUDA kernel sources, relative to the repository root: one list for the op library
# (cmake/Targets.cmake) and the stand-alone micro-benchmark (kernels/bench/CMakeLists.txt).
set(NMCLI_KERNEL_CUDA_FILES kernels/cuda/decode_f32.cu kernels/cuda/decode_f16.cu kernels/cuda/decode_bf16.cu
    kernels/cuda/tiled.cu kernels/cuda/mma.cu kernels/cuda/dispatch.cu)
