// nmcli.NMMatMul on ONNX Runtime's CPU execution provider.
#include "nm_matmul_cpu_op.h"

#include <cstdint>

#include "../kernels/cpu/nm_matmul_cpu.h"
#include "op_timer.h"

namespace nmcli {
namespace {

// A call's activation tiles in memory from the CPU provider's allocator: its arena keeps the
// pages between runs, where memory of our own came fresh each call and faulted in page by page
// (BENCHMARKS.md session 73). Null where ORT lends no allocator: the kernel allocates its own.
class ArenaTiles {
 public:
  ArenaTiles(const Ort::KernelContext& ctx, size_t bytes) {
    if (bytes == 0) return;
    try {
      const Ort::MemoryInfo cpu = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
      allocator_ = ctx.GetAllocator(*static_cast<const OrtMemoryInfo*>(cpu));
    } catch (const Ort::Exception&) {
      allocator_ = nullptr;
    }
    if (allocator_) raw_ = allocator_->Alloc(allocator_, bytes + 64);  // + 64: room to align
  }
  ~ArenaTiles() {
    if (raw_) allocator_->Free(allocator_, raw_);
  }
  ArenaTiles(const ArenaTiles&) = delete;
  ArenaTiles& operator=(const ArenaTiles&) = delete;

  float* aligned() const {
    if (!raw_) return nullptr;
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(raw_) + 63) & ~uintptr_t{63});
  }

 private:
  OrtAllocator* allocator_ = nullptr;
  void* raw_ = nullptr;
};

template <typename T>
void run_prologue(void* op, size_t tile) { static_cast<NMMatMulCpu<T>*>(op)->prologue_part(static_cast<int64_t>(tile)); }

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
      const ArenaTiles tiles(ctx, NMMatMulCpu<T>::tile_bytes(args));
      NMMatMulCpu<T> op(args, tiles.aligned());
      // ORT's intra-op thread pool makes the activation tiles, then runs the column blocks.
      if (op.num_prologue_parts() > 0)
        ctx.ParallelFor(&run_prologue<T>, static_cast<size_t>(op.num_prologue_parts()), 0, &op);
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
