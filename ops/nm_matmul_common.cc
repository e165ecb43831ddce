#include "nm_matmul_common.h"

#include <atomic>
#include <sstream>
#include <string>
#include <vector>

namespace nmcli {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw Ort::Exception(std::string("nmcli.NMMatMul: ") + what, ORT_INVALID_ARGUMENT);
}

// A string attribute's value, or "" when the node does not have it.
std::string string_attribute(const OrtKernelInfo* info, const char* name) {
  const OrtApi& api = Ort::GetApi();
  size_t bytes = 0;
  if (OrtStatus* absent = api.KernelInfoGetAttribute_string(info, name, nullptr, &bytes)) {
    api.ReleaseStatus(absent);
    return "";
  }
  std::string value(bytes, '\0');
  Ort::ThrowOnError(api.KernelInfoGetAttribute_string(info, name, value.data(), &bytes));
  value.resize(bytes > 0 ? bytes - 1 : 0);  // the size counts the terminating null
  return value;
}

std::string dims_str(const std::vector<int64_t>& dims) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

}  // namespace

NMMatMulAttrs NMMatMulAttrs::read(const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  NMMatMulAttrs a;
  a.n = static_cast<int>(ki.GetAttribute<int64_t>("n"));
  a.m = static_cast<int>(ki.GetAttribute<int64_t>("m"));
  a.k = ki.GetAttribute<int64_t>("k");
  const OrtApi& api = Ort::GetApi();
  float alpha = 1.0f;
  if (OrtStatus* absent = api.KernelInfoGetAttribute_float(info, "alpha", &alpha)) api.ReleaseStatus(absent);
  else a.alpha = alpha;
  size_t count = 0;  // splits: absent for a single output
  if (OrtStatus* absent = api.KernelInfoGetAttributeArray_int64(info, "splits", nullptr, &count)) {
    api.ReleaseStatus(absent);
  } else if (count > 0) {
    a.splits.resize(count);
    Ort::ThrowOnError(api.KernelInfoGetAttributeArray_int64(info, "splits", a.splits.data(), &count));
  }
  const std::string glu = string_attribute(info, "glu");  // absent for an ungated activation
  if (!parse_glu(glu.c_str(), &a.glu)) fail("glu must be \"silu\" (or absent), got \"" + glu + "\"");
  const std::string norm = string_attribute(info, "norm");
  if (!norm.empty() && norm != "rms") fail("norm must be \"rms\" (or absent), got \"" + norm + "\"");
  a.rms_norm = norm == "rms";
  float epsilon = 0.0f;
  if (OrtStatus* absent = api.KernelInfoGetAttribute_float(info, "norm_epsilon", &epsilon)) api.ReleaseStatus(absent);
  else a.norm_epsilon = epsilon;
  int64_t vector = 0;  // absent for element-wise offsets
  if (OrtStatus* absent = api.KernelInfoGetAttribute_int64(info, "vector", &vector)) api.ReleaseStatus(absent);
  else a.vector = vector;
  if (a.vector < 0) fail("attribute vector must be >= 0, got " + std::to_string(a.vector));
  if (a.rms_norm && a.glu != Glu::none) fail("glu and norm exclude each other");
  if (a.splits.size() > static_cast<size_t>(kMaxOutputParts))
    fail("at most " + std::to_string(kMaxOutputParts) + " splits, got " + std::to_string(a.splits.size()));
  for (int64_t w : a.splits)
    if (w < 1) fail("splits must be positive, got " + dims_str(a.splits));
  if (!valid_pattern(a.n, a.m)) fail("invalid n:m attributes " + std::to_string(a.n) + ":" + std::to_string(a.m));
  if (a.k < 1) fail("attribute k must be positive");
  return a;
}

NMMatMulCall NMMatMulCall::check(Ort::KernelContext& ctx, const NMMatMulAttrs& attrs) {
  NMMatMulCall call;
  const auto x_dims = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape();
  const auto v_dims = ctx.GetInput(1).GetTensorTypeAndShapeInfo().GetShape();
  const auto i_dims = ctx.GetInput(2).GetTensorTypeAndShapeInfo().GetShape();
  if (x_dims.empty() || x_dims.back() != attrs.k)
    fail("X has shape " + dims_str(x_dims) + ", its last dim must be K=" + std::to_string(attrs.k));
  if (v_dims.size() != 2) fail("values must be rank 2, got " + dims_str(v_dims));
  call.shape = NMShape::make(attrs.k, v_dims[0], attrs.n, attrs.m);
  if (v_dims[1] != call.shape.row_len)
    fail("values have shape " + dims_str(v_dims) + ", expected [Nout, " + std::to_string(call.shape.row_len) + "]");
  // Rows of S*B/32 index words, or padded to 16-byte units (docs/FORMAT.md).
  if (i_dims.size() != 2 || i_dims[0] != v_dims[0] || !call.shape.accepts_index_words(i_dims[1]))
    fail("indices have shape " + dims_str(i_dims) + ", expected " + dims_str({v_dims[0], call.shape.index_words}) +
         " (or, rows padded, " + dims_str({v_dims[0], call.shape.padded_index_words()}) + ")");
  call.shape = call.shape.with_index_words(i_dims[1]);
  // An absent optional input is either missing from the node or present as a null value.
  auto present = [&](size_t i) { return ctx.GetInputCount() > i && static_cast<const OrtValue*>(ctx.GetInput(i)) != nullptr; };
  call.has_bias = present(3);
  call.has_residual = present(4);
  call.has_x_up = present(5);
  call.has_norm_weight = present(6);
  if (call.has_bias) {
    const auto b_dims = ctx.GetInput(3).GetTensorTypeAndShapeInfo().GetShape();
    if (b_dims.size() != 1 || b_dims[0] != v_dims[0]) fail("bias has shape " + dims_str(b_dims) + ", expected [Nout]");
  }
  if (call.has_x_up != (attrs.glu != Glu::none)) fail("input x_up goes with attribute glu, and only with it");
  if (call.has_x_up && ctx.GetInput(5).GetTensorTypeAndShapeInfo().GetShape() != x_dims)
    fail("x_up has shape " + dims_str(ctx.GetInput(5).GetTensorTypeAndShapeInfo().GetShape()) + ", expected X's " +
         dims_str(x_dims));
  if (call.has_norm_weight != attrs.rms_norm) fail("input norm_weight goes with attribute norm, and only with it");
  if (call.has_norm_weight && ctx.GetInput(6).GetTensorTypeAndShapeInfo().GetShape() != std::vector<int64_t>{attrs.k})
    fail("norm_weight has shape " + dims_str(ctx.GetInput(6).GetTensorTypeAndShapeInfo().GetShape()) + ", expected [K]");
  if (present(7) != present(8)) fail("inputs copy_values and copy_indices go together");
  call.has_copy = present(7);
  if (call.has_copy) {
    if (!fits_two_of_four(attrs.n, attrs.m))
      fail("a 2:4 copy needs a pattern that fits 2:4 (N = 1, or N = 2 with M a multiple of 4 above 4), not " +
           std::to_string(attrs.n) + ":" + std::to_string(attrs.m));
    const NMShape copy = NMShape::make(attrs.k, v_dims[0], 2, 4);
    const auto cv_dims = ctx.GetInput(7).GetTensorTypeAndShapeInfo().GetShape();
    const auto ci_dims = ctx.GetInput(8).GetTensorTypeAndShapeInfo().GetShape();
    if (cv_dims != std::vector<int64_t>{v_dims[0], copy.row_len})
      fail("copy_values have shape " + dims_str(cv_dims) + ", expected " + dims_str({v_dims[0], copy.row_len}));
    if (ci_dims.size() != 2 || ci_dims[0] != v_dims[0] || !copy.accepts_index_words(ci_dims[1]))
      fail("copy_indices have shape " + dims_str(ci_dims) + ", expected " + dims_str({v_dims[0], copy.index_words}) +
           " (or, rows padded, " + dims_str({v_dims[0], copy.padded_index_words()}) + ")");
    call.copy_index_words = ci_dims[1];
  }
  if (call.has_residual) {
    std::vector<int64_t> y_dims = x_dims;
    y_dims.back() = v_dims[0];
    const auto r_dims = ctx.GetInput(4).GetTensorTypeAndShapeInfo().GetShape();
    if (!attrs.splits.empty()) fail("a residual needs a single output (no splits)");
    if (r_dims != y_dims) fail("residual has shape " + dims_str(r_dims) + ", expected the output's " + dims_str(y_dims));
  }
  call.rows = 1;
  for (size_t i = 0; i + 1 < x_dims.size(); ++i) call.rows *= x_dims[i];
  call.leading.assign(x_dims.begin(), x_dims.end() - 1);
  call.widths = attrs.splits.empty() ? std::vector<int64_t>{v_dims[0]} : attrs.splits;
  int64_t total = 0;
  for (int64_t w : call.widths) total += w;
  if (total != v_dims[0]) fail("splits " + dims_str(attrs.splits) + " must add up to Nout=" + std::to_string(v_dims[0]));
  if (ctx.GetOutputCount() != call.widths.size())
    fail("the node has " + std::to_string(ctx.GetOutputCount()) + " outputs, expected " + std::to_string(call.widths.size()));
  return call;
}

OutputParts<void> NMMatMulCall::outputs(Ort::KernelContext& ctx) const {
  std::vector<void*> bases;
  for (size_t i = 0; i < widths.size(); ++i) {
    std::vector<int64_t> dims = leading;
    dims.push_back(widths[i]);
    bases.push_back(ctx.GetOutput(i, dims).GetTensorMutableRawData());
  }
  return OutputParts<void>::split(bases.data(), widths.data(), static_cast<int>(widths.size()));
}

namespace {
std::atomic<unsigned long long> g_unknown_dims{0};

// The node's splits attribute at shape inference (empty when it has none).
std::vector<int64_t> splits_at_inference(OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  const OrtOpAttr* attr = nullptr;
  if (OrtStatus* absent = api.ShapeInferContext_GetAttribute(ctx, "splits", &attr)) {
    api.ReleaseStatus(absent);
    return {};
  }
  if (attr == nullptr) return {};
  size_t bytes = 0;
  if (OrtStatus* sized = api.ReadOpAttr(attr, ORT_OP_ATTR_INTS, nullptr, 0, &bytes)) api.ReleaseStatus(sized);
  std::vector<int64_t> splits(bytes / sizeof(int64_t));
  if (!splits.empty()) Ort::ThrowOnError(api.ReadOpAttr(attr, ORT_OP_ATTR_INTS, splits.data(), bytes, &bytes));
  return splits;
}
}  // namespace

OrtStatusPtr infer_output_shape(OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* x_info = nullptr;
  OrtTensorTypeAndShapeInfo* v_info = nullptr;
  OrtTensorTypeAndShapeInfo* out = nullptr;
  OrtStatusPtr status = nullptr;
  auto step = [&](OrtStatusPtr s) { if (!status) status = s; else if (s) api.ReleaseStatus(s); return status == nullptr; };
  // Input infos belong to the context (ORT's own wrapper does not free them); `out` is ours.
  if (step(api.ShapeInferContext_GetInputTypeShape(ctx, 0, &x_info)) &&
      step(api.ShapeInferContext_GetInputTypeShape(ctx, 1, &v_info))) {
    ONNXTensorElementDataType type;
    size_t x_rank = 0, v_rank = 0;
    step(api.GetTensorElementType(x_info, &type));
    step(api.GetDimensionsCount(x_info, &x_rank));
    step(api.GetDimensionsCount(v_info, &v_rank));
    if (!status && x_rank >= 1 && v_rank == 2) {
      std::vector<int64_t> dims(x_rank), vdims(2);
      std::vector<const char*> syms(x_rank), vsyms(2);
      step(api.GetDimensions(x_info, dims.data(), x_rank));
      step(api.GetSymbolicDimensions(x_info, syms.data(), x_rank));
      step(api.GetDimensions(v_info, vdims.data(), 2));
      step(api.GetSymbolicDimensions(v_info, vsyms.data(), 2));
      dims.back() = vdims[0];
      syms.back() = vsyms[0];
      // ORT writes a dim without a symbol as dim_value, so an unknown (-1) dim would become
      // the value -1 and shape arithmetic downstream (Shape -> Concat -> Reshape) would see
      // it as a literal -1. A fresh symbol keeps it unknown and equal to no other dim.
      std::vector<std::string> fresh(x_rank);
      for (size_t i = 0; i < x_rank; ++i) {
        if (dims[i] < 0 && (syms[i] == nullptr || syms[i][0] == '\0')) {
          fresh[i] = "nmcli_unk_" + std::to_string(g_unknown_dims.fetch_add(1));
          syms[i] = fresh[i].c_str();
        }
      }
      // One output of values' first dim, or one per split (whose widths are known).
      std::vector<int64_t> widths;
      try {
        widths = splits_at_inference(ctx);
      } catch (const Ort::Exception& e) {
        step(api.CreateStatus(e.GetOrtErrorCode(), e.what()));
      }
      if (widths.empty()) widths.push_back(vdims[0]);
      if (!status && step(api.CreateTensorTypeAndShapeInfo(&out))) step(api.SetTensorElementType(out, type));
      for (size_t i = 0; i < widths.size() && !status; ++i) {
        dims.back() = widths[i];
        if (widths.size() > 1) syms.back() = "";
        if (step(api.SetDimensions(out, dims.data(), x_rank)) && step(api.SetSymbolicDimensions(out, syms.data(), x_rank)))
          step(api.ShapeInferContext_SetOutputTypeShape(ctx, i, out));
      }
    }
  }
  if (out) api.ReleaseTensorTypeAndShapeInfo(out);
  return status;
}

}  // namespace nmcli
