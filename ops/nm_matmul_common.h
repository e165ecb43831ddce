// What the CPU and CUDA kernels of nmcli.NMMatMul share: the op's signature, its attributes,
// input validation (the only place that turns bad tensors into messages) and shape inference.
//
//   Y = NMMatMul(X, values, indices[, bias][, residual][, x_up][, norm_weight][, copy_values, copy_indices];
//                n, m, k, alpha[, glu][, norm, norm_epsilon])
//   X [..., K] T, values [Nout, S] T, indices [Nout, W] uint32 (W: docs/FORMAT.md), bias [Nout] T -> Y [..., Nout] T
//   Y = alpha * (A @ W) + bias + residual, A = X, or silu(X) * x_up (glu = "silu"), or
//   X / sqrt(mean(X^2) + norm_epsilon) * norm_weight (norm = "rms")
//   (residual: Y's shape; x_up: X's shape; norm_weight: [K]; docs/FORMAT.md "Fused neighbours").
//   copy_values, copy_indices: the same weight packed as 2:4, for the sparse tensor cores
//   (docs/FORMAT.md "A 2:4 copy"; the CPU kernel reads inputs 1 and 2).
// With the optional attribute splits = [w_0, ..., w_p-1] (sum Nout, at most kMaxOutputParts) the
// op has p outputs Y_i [..., w_i]: consecutive column ranges of Y (a fused sibling group, so no
// Split has to copy them apart).
#pragma once
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <string>
#include <vector>

#include "../kernels/fusion.h"
#include "../kernels/nm_format.h"
#include "../kernels/output_parts.h"

namespace nmcli {

constexpr const char* kOpDomain = "nmcli";
constexpr const char* kOpName = "NMMatMul";

struct NMMatMulAttrs {
  int n = 0, m = 0;
  int64_t k = 0;
  float alpha = 1.0f;
  std::vector<int64_t> splits;  // empty: one output
  Glu glu = Glu::none;
  bool rms_norm = false;
  float norm_epsilon = 0.0f;
  int64_t vector = 0;  // columns per aligned block sharing one offsets row (0: none promised)
  static NMMatMulAttrs read(const OrtKernelInfo* info);
};

// Shapes of one call, checked against the attributes and the format spec.
struct NMMatMulCall {
  NMShape shape;
  int64_t rows = 0;                 // product of X's leading dims
  std::vector<int64_t> leading;     // X's leading dims
  std::vector<int64_t> widths;      // columns of each output ({Nout}, or the splits)
  bool has_bias = false, has_residual = false, has_x_up = false, has_norm_weight = false, has_copy = false;
  int64_t copy_index_words = 0;  // the 2:4 copy's words per row of indices (S4/16, or padded: docs/FORMAT.md)
  static NMMatMulCall check(Ort::KernelContext& ctx, const NMMatMulAttrs& attrs);
  // Allocates the outputs through ORT: output i is [leading..., widths[i]].
  OutputParts<void> outputs(Ort::KernelContext& ctx) const;
};

// Shape inference shared by every kernel of the op: each output keeps X's leading dims
// (symbolic ones too) and element type, and gets values' first dim (or its split) as its last.
OrtStatusPtr infer_output_shape(OrtShapeInferContext* ctx);

// Run `body`, turning any exception into an ORT status (exceptions must not cross the C API).
template <typename F>
OrtStatusPtr guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
}

// The op schema common to all kernels; TOp supplies the kernel type, element type and EP.
template <typename TOp, typename TKernel>
struct NMMatMulOpBase : Ort::CustomOpBase<TOp, TKernel, true> {
  NMMatMulOpBase() { OrtCustomOp::InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* c) { return infer_output_shape(c); }; }
  const char* GetName() const { return kOpName; }
  // X, values, indices, bias, residual, x_up, norm_weight, copy_values, copy_indices
  size_t GetInputTypeCount() const { return 9; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 2 || index == 8 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32 : TOp::kElementType;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return TOp::kElementType; }
  // One output, or one per split (attribute splits); all of the input's type.
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  int GetVariadicOutputMinArity() const { return 1; }
  bool GetVariadicOutputHomogeneity() const { return true; }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return guarded([&] { *kernel = new TKernel(NMMatMulAttrs::read(info)); });
  }
};

}  // namespace nmcli
