// nmcli.NMMatMul on ONNX Runtime's CUDA execution provider: inputs and outputs stay on the
// device, the kernels run on ORT's compute stream, nothing synchronizes the host and nothing
// is allocated per call outside ORT's own allocator, so IO binding and ORT's CUDA graph capture work.
#include "nm_matmul_cuda_op.h"

#include <string>

#include "../kernels/cuda/nm_matmul_cuda.h"
#include "op_timer.h"

namespace nmcli {
namespace {

// Device memory from ORT's allocator for the input's device, returned when it goes out of scope.
struct Workspace {
  Workspace(Ort::KernelContext& ctx, size_t bytes) {
    if (bytes == 0) return;
    const int device = ctx.GetInput(0).GetTensorMemoryInfo().GetDeviceId();
    const Ort::MemoryInfo info("Cuda", OrtArenaAllocator, device, OrtMemTypeDefault);
    const OrtMemoryInfo* raw_info = info;
    allocator = ctx.GetAllocator(*raw_info);
    data = allocator->Alloc(allocator, bytes);
    if (data == nullptr) {
      Ort::GetApi().ReleaseAllocator(allocator);
      throw Ort::Exception("nmcli.NMMatMul: no device memory for the workspace", ORT_FAIL);
    }
  }
  ~Workspace() {
    if (data) allocator->Free(allocator, data);
    if (allocator) Ort::GetApi().ReleaseAllocator(allocator);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  OrtAllocator* allocator = nullptr;
  void* data = nullptr;
};

struct CudaKernel {
  CudaKernel(NMMatMulAttrs attrs, DType dtype) : attrs_(attrs), dtype_(dtype) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded([&] {
      Ort::KernelContext ctx(context);
      const NMMatMulCall call = NMMatMulCall::check(ctx, attrs_);
      CudaMatMul m;
      m.dtype = dtype_;
      m.x = ctx.GetInput(0).GetTensorRawData();
      m.values = ctx.GetInput(1).GetTensorRawData();
      m.indices = ctx.GetInput(2).GetTensorData<uint32_t>();
      m.bias = call.has_bias ? ctx.GetInput(3).GetTensorRawData() : nullptr;
      m.residual = call.has_residual ? ctx.GetInput(4).GetTensorRawData() : nullptr;
      m.x_up = call.has_x_up ? ctx.GetInput(5).GetTensorRawData() : nullptr;
      m.glu = attrs_.glu;
      m.norm_weight = call.has_norm_weight ? ctx.GetInput(6).GetTensorRawData() : nullptr;
      m.norm_epsilon = attrs_.norm_epsilon;
      m.copy_values = call.has_copy ? ctx.GetInput(7).GetTensorRawData() : nullptr;
      m.copy_indices = call.has_copy ? ctx.GetInput(8).GetTensorData<uint32_t>() : nullptr;
      m.copy_index_words = call.copy_index_words;
      m.y = call.outputs(ctx);
      m.rows = call.rows;
      m.alpha = attrs_.alpha;
      m.vector = attrs_.vector;
      m.shape = call.shape;
      void* stream = ctx.GetGPUComputeStream();
      // A gated or normalised call off the decode path writes A into a workspace first, and a
      // large call on the sparse tensor cores a 2:4 copy of its weight: from ORT's device arena,
      // stream-ordered like ORT's own temporaries (freed after the launch, reused by later kernels
      // of the same stream only).
      Workspace workspace(ctx, nm_matmul_cuda_workspace_bytes(m));
      m.workspace = workspace.data;
      StreamTimer timer(stream);
      const int err = nm_matmul_cuda(m, stream);
      if (err != 0) throw Ort::Exception("nmcli.NMMatMul: CUDA error " + std::to_string(err), ORT_EP_FAIL);
    });
  }

  NMMatMulAttrs attrs_;
  DType dtype_;
};

template <ONNXTensorElementDataType ET, DType D>
struct TypedCudaKernel : CudaKernel {
  explicit TypedCudaKernel(NMMatMulAttrs attrs) : CudaKernel(attrs, D) {}
};

template <ONNXTensorElementDataType ET, DType D>
struct CudaOp : NMMatMulOpBase<CudaOp<ET, D>, TypedCudaKernel<ET, D>> {
  static constexpr ONNXTensorElementDataType kElementType = ET;
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
};

}  // namespace

void add_cuda_ops(Ort::CustomOpDomain& domain) {
  static CudaOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, DType::f32> op_f32;
  static CudaOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, DType::f16> op_f16;
  static CudaOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16, DType::bf16> op_bf16;
  domain.Add(&op_f32);
  domain.Add(&op_f16);
  domain.Add(&op_bf16);
}

}  // namespace nmcli
