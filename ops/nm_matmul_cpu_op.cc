// nmcli.NMMatMul on ONNX Runtime's CPU execution provider.
#include "nm_matmul_cpu_op.h"

#include "../kernels/cpu/nm_matmul_cpu.h"
#include "op_timer.h"

namespace nmcli {
namespace {

template <typename T>
void run_blocks(void* op, size_t block) { static_cast<NMMatMulCpu<T>*>(op)->compute_block(static_cast<int64_t>(block)); }

template <typename T, typename OrtT>
struct CpuKernel {
  explicit CpuKernel(NMMatMulAttrs attrs) : attrs_(attrs) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded([&] {
      Ort::KernelContext ctx(context);
      const NMMatMulCall call = NMMatMulCall::check(ctx, attrs_);
      const OutputParts<void> y = call.outputs(ctx);
      if (call.rows == 0 || call.shape.nout == 0) return;
      NMMatMulArgs<T> args;
      args.x = reinterpret_cast<const T*>(ctx.GetInput(0).GetTensorData<OrtT>());
      args.values = reinterpret_cast<const T*>(ctx.GetInput(1).GetTensorData<OrtT>());
      args.indices = ctx.GetInput(2).GetTensorData<uint32_t>();
      args.bias = call.has_bias ? reinterpret_cast<const T*>(ctx.GetInput(3).GetTensorData<OrtT>()) : nullptr;
      args.residual = call.has_residual ? reinterpret_cast<const T*>(ctx.GetInput(4).GetTensorData<OrtT>()) : nullptr;
      args.x_up = call.has_x_up ? reinterpret_cast<const T*>(ctx.GetInput(5).GetTensorData<OrtT>()) : nullptr;
      args.glu = attrs_.glu;
      args.norm_weight = call.has_norm_weight ? reinterpret_cast<const T*>(ctx.GetInput(6).GetTensorData<OrtT>()) : nullptr;
      args.norm_epsilon = attrs_.norm_epsilon;
      args.y = y.as<T>();
      args.rows = call.rows;
      args.alpha = attrs_.alpha;
      args.shape = call.shape;
      HostTimer timer;
      NMMatMulCpu<T> op(args);
      // ORT's intra-op thread pool runs the column blocks.
      ctx.ParallelFor(&run_blocks<T>, static_cast<size_t>(op.num_blocks()), 0, &op);
    });
  }

  NMMatMulAttrs attrs_;
};

template <typename T, typename OrtT, ONNXTensorElementDataType ET>
struct CpuOp : NMMatMulOpBase<CpuOp<T, OrtT, ET>, CpuKernel<T, OrtT>> {
  static constexpr ONNXTensorElementDataType kElementType = ET;
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
};

}  // namespace

void add_cpu_ops(Ort::CustomOpDomain& domain) {
  static CpuOp<float, float, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> op_f32;
  static CpuOp<half_t, Ort::Float16_t, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> op_f16;
  static CpuOp<bfloat16_t, Ort::BFloat16_t, ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16> op_bf16;
  domain.Add(&op_f32);
  domain.Add(&op_f16);
  domain.Add(&op_bf16);
}

}  // namespace nmcli
