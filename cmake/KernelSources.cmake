# The CUDA kernel sources, relative to the repository root: one list for the op library
# (cmake/Targets.cmake) and the stand-alone micro-benchmark (kernels/bench/CMakeLists.txt).
set(NMCLI_KERNEL_CUDA_FILES kernels/cuda/decode_f32.cu kernels/cuda/decode_f16.cu kernels/cuda/decode_bf16.cu
    kernels/cuda/decode_mma.cu kernels/cuda/tiled.cu kernels/cuda/mma.cu kernels/cuda/prologue.cu
    kernels/cuda/dispatch.cu kernels/cuda/copy.cu kernels/cuda/vector.cu kernels/cuda/two_of_four_copy.cu)
# Built for sm_90a only (wgmma), as a separate object library with its own -gencode: the
# architecture-specific target cannot share a compile with the plain sm_90 one.
set(NMCLI_KERNEL_SM90A_FILES kernels/cuda/wgmma.cu kernels/cuda/wgmma_sp.cu kernels/cuda/wgmma_tf32.cu)

# Object library `name` with the sm_90a sources of the repository at `root`; the consumer links
# $<TARGET_OBJECTS:name> and defines NMCLI_WITH_SM90A.
function(nmcli_add_sm90a_objects name root)
  list(TRANSFORM NMCLI_KERNEL_SM90A_FILES PREPEND ${root}/ OUTPUT_VARIABLE sources)
  add_library(${name} OBJECT ${sources})
  set_target_properties(${name} PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON)
  target_include_directories(${name} PRIVATE ${root}/kernels)
  target_compile_options(${name} PRIVATE -gencode=arch=compute_90a,code=sm_90a -O3 --use_fast_math -Xptxas=-v -lineinfo)
endfunction()
