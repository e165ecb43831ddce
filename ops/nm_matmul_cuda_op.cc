// nmcli.NMMatMul on ONNX Runtime's CUDA execution provider: inputs and outputs stay on the
// device, the kernels run on ORT's compute stream, nothing synchronizes the host and nothing
// is allocated per call, so IO binding and ORT's CUDA graph capture work.
#include "nm_matmul_cuda_op.h"

#include <string>

#include "../kernels/cuda/nm_matmul_cuda.h"
#include "op_timer.h"

namespace nmcli {
namespace {

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
      m.y = call.outputs(ctx);
      m.rows = call.rows;
      m.alpha = attrs_.alpha;
      m.shape = call.shape;
      void* stream = ctx.GetGPUComputeStream();
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
