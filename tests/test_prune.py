"""prune_model: which nodes are rewritten, and the rewritten model in onnxruntime (CPU EP)
against the same model with the pruned dense weights and against the float64 reference."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import FAMILIES
from models import gemm_model, magnitude_pruned, make_model, matmul_model, vinfo
from onnx import helper, numpy_helper

import nmcli
from nmcli import NMPattern, Selection, prune_model
from nmcli.errors import ModelError
from nmcli.format import PackedShape
from nmcli.modelio import load_model, max_ir_version_supported, save_model
from nmcli.reference import dense_reference, error_ratio, relative_error


def run_dense(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def run_sparse(model, feeds):
    return nmcli.session(model).run(None, feeds)


def op_nodes(model):
    return [n for n in model.graph.node if n.op_type == "NMMatMul"]


@pytest.mark.parametrize("n,m", FAMILIES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("x_shape", [(40,), (3, 40), (2, 5, 40), (2, 1, 3, 40)])
def test_matmul_matches_dense_pruned(rng, n, m, dtype, x_shape):
    nout = int(rng.choice([1, 33, 64]))
    w = rng.standard_normal((40, nout)).astype(dtype)
    model = matmul_model(w, x_shape)
    pruned, report = prune_model(model, Selection(NMPattern(n, m)))
    onnx.checker.check_model(pruned)
    assert len(op_nodes(pruned)) == 1 and not any(n.op_type == "MatMul" for n in pruned.graph.node)
    assert {t.name for t in pruned.graph.initializer} == {"W.nm_values", "W.nm_indices"}
    x = rng.standard_normal(x_shape).astype(dtype)
    w_pruned = magnitude_pruned(w, NMPattern(n, m))
    (y,) = run_sparse(pruned, {"x": x})
    (y_dense,) = run_dense(matmul_model(w_pruned, x_shape), {"x": x})
    ref, magnitude = dense_reference(x, w_pruned)
    assert y.shape == y_dense.shape and y.dtype == y_dense.dtype
    assert error_ratio(y, ref, magnitude, dtype, 40) < 1
    assert error_ratio(y_dense, ref, magnitude, dtype, 40) < 4
    layer = report.layers[0]
    assert (layer.k, layer.nout, layer.bytes_before) == (40, nout, w.nbytes)
    assert layer.bytes_after == PackedShape(40, nout, NMPattern(n, m)).packed_bytes(w.itemsize)


GEMM_CASES = [
    dict(),
    dict(transB=1),
    dict(transA=1),
    dict(transA=1, transB=1, alpha=0.5),
    dict(alpha=1.5, beta=0.25, c="vector"),
    dict(transB=1, c="row"),
    dict(beta=2.0, c="scalar"),
    dict(c="matrix", beta=0.5),
    dict(c="input", transB=1, alpha=2.0),
    dict(c="vector", beta=0.0),
]


@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gemm_attributes(rng, case, dtype):
    case = dict(case)
    rows, k, nout = 6, 48, 20
    kind = case.pop("c", None)
    a_shape = (k, rows) if case.get("transA") else (rows, k)
    b = rng.standard_normal((nout, k) if case.get("transB") else (k, nout)).astype(dtype)
    c = {"vector": rng.standard_normal(nout), "row": rng.standard_normal((1, nout)), "scalar": rng.standard_normal(1),
         "matrix": rng.standard_normal((rows, nout)), "input": rng.standard_normal((rows, nout)), None: None}[kind]
    c = None if c is None else c.astype(dtype)
    model = gemm_model(a_shape, b, c, c_is_input=kind == "input", **case)
    pruned, _ = prune_model(model, Selection(NMPattern(2, 8)))
    onnx.checker.check_model(pruned)
    assert len(op_nodes(pruned)) == 1 and not any(n.op_type == "Gemm" for n in pruned.graph.node)
    w = b.T if case.get("transB") else b
    w_pruned = magnitude_pruned(w, NMPattern(2, 8))
    b_pruned = w_pruned.T if case.get("transB") else w_pruned
    feeds = {"a": rng.standard_normal(a_shape).astype(dtype)}
    if kind == "input":
        feeds["C"] = c
    (y,) = run_sparse(pruned, feeds)
    (y_dense,) = run_dense(gemm_model(a_shape, np.ascontiguousarray(b_pruned), c, c_is_input=kind == "input", **case), feeds)
    a = feeds["a"].T if case.get("transA") else feeds["a"]
    ref, magnitude = dense_reference(a, w_pruned, alpha=case.get("alpha", 1.0))
    if c is not None:
        ref = ref + case.get("beta", 1.0) * c.astype(np.float64)
        magnitude = magnitude + abs(case.get("beta", 1.0) * c.astype(np.float64))
    assert y.shape == (rows, nout)
    assert error_ratio(y, ref, magnitude, dtype, k) < 2
    assert error_ratio(y_dense, ref, magnitude, dtype, k) < 4


def test_weight_through_transpose_and_cast(rng):
    """nn.Linear as exporters write it: W^T stored, Transpose (and a Cast to fp16) in front."""
    k, nout = 64, 24
    w_t = rng.standard_normal((nout, k)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w_t"], ["w_f32"], perm=[1, 0], name="t"),
             helper.make_node("Cast", ["w_f32"], ["w"], to=onnx.TensorProto.FLOAT16, name="cast"),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="linear")]
    model = make_model(nodes, [vinfo("x", np.float16, [2, k])], [vinfo("y", np.float16, [2, nout])],
                       [numpy_helper.from_array(w_t, "w_t")])
    pruned, report = prune_model(model, Selection(NMPattern(2, 4)))
    assert [n.op_type for n in pruned.graph.node] == ["NMMatMul"]     # Transpose/Cast folded away
    assert {t.name for t in pruned.graph.initializer} == {"w.nm_values", "w.nm_indices"}
    x = rng.standard_normal((2, k)).astype(np.float16)
    w_pruned = magnitude_pruned(w_t.T.astype(np.float16), NMPattern(2, 4))
    (y,) = run_sparse(pruned, {"x": x})
    assert error_ratio(y, *dense_reference(x, w_pruned), np.float16, k) < 1
    assert report.layers[0].dtype == "float16"


def test_shared_weight_pruned_once(rng):
    w = rng.standard_normal((32, 16)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y1"], name="a"),
             helper.make_node("MatMul", ["y1", "W2"], ["y2"], name="b"),
             helper.make_node("MatMul", ["x", "W"], ["y3"], name="c")]
    w2 = rng.standard_normal((16, 32)).astype(np.float32)
    model = make_model(nodes, [vinfo("x", np.float32, [3, 32])],
                       [vinfo("y2", np.float32, [3, 32]), vinfo("y3", np.float32, [3, 16])],
                       [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w2, "W2")])
    pruned, report = prune_model(model, Selection(NMPattern(2, 8)))
    names = sorted(t.name for t in pruned.graph.initializer)
    assert names == ["W.nm_indices", "W.nm_values", "W2.nm_indices", "W2.nm_values"]
    assert [layer.shared_by for layer in report.layers] == [2, 1, 2]
    assert report.bytes_before == w.nbytes + w2.nbytes
    x = rng.standard_normal((3, 32)).astype(np.float32)
    y2, y3 = run_sparse(pruned, {"x": x})
    wp, w2p = magnitude_pruned(w, NMPattern(2, 8)), magnitude_pruned(w2, NMPattern(2, 8))
    assert error_ratio(y3, *dense_reference(x, wp), np.float32, 32) < 1
    assert relative_error(y2, (x @ wp.astype(np.float64)).astype(np.float32) @ w2p.astype(np.float64)) < 1e-5


def test_selection_and_skip_reasons(rng):
    nodes = [helper.make_node("MatMul", ["x", "small"], ["h1"], name="tiny_layer"),
             helper.make_node("MatMul", ["h1", "big"], ["h2"], name="big_layer"),
             helper.make_node("MatMul", ["h2", "narrow_k"], ["h3"], name="narrow"),
             helper.make_node("MatMul", ["h3", "h3t"], ["y"], name="dynamic"),
             helper.make_node("Transpose", ["h3"], ["h3t"], name="tr")]
    inits = {"small": (64, 64), "big": (64, 128), "narrow_k": (128, 4)}
    model = make_model(nodes, [vinfo("x", np.float32, [4, 64])], [vinfo("y", np.float32, [4, 4])],
                       [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), k) for k, s in inits.items()])
    _, report = prune_model(model, Selection(NMPattern(2, 8), min_size=5000))
    reasons = {s.node: s.reason for s in report.skipped}
    assert [layer.node for layer in report.layers] == ["big_layer"]
    assert "min-size" in reasons["tiny_layer"] and "not a constant" in reasons["dynamic"]
    _, report = prune_model(model, Selection(NMPattern(2, 8), exclude=["big"]))
    assert [layer.node for layer in report.layers] == ["tiny_layer", "narrow"]
    _, report = prune_model(model, Selection(NMPattern(1, 8), include=["^narrow$"]))
    assert [layer.node for layer in report.layers] == ["narrow"]
    _, report = prune_model(model, Selection(NMPattern(8, 32), include=["small", "narrow"]))
    assert [layer.node for layer in report.layers] == ["tiny_layer", "narrow"]
    model_k_small = matmul_model(rng.standard_normal((4, 8)).astype(np.float32), (2, 4))
    with pytest.raises(ModelError, match="nothing to prune.*K=4 is smaller than M=8"):
        prune_model(model_k_small, Selection(NMPattern(2, 8)))


def test_input_model_untouched_and_ir_readable(rng):
    model = matmul_model(rng.standard_normal((64, 16)).astype(np.float32), (2, 64))
    model.ir_version = onnx.IR_VERSION  # what onnx writes by default, maybe past what ORT reads
    before = model.SerializeToString()
    pruned, _ = prune_model(model, Selection(NMPattern(2, 4)))
    assert model.SerializeToString() == before
    assert pruned.ir_version <= max_ir_version_supported()
    assert any(o.domain == "nmcli" and o.version == 1 for o in pruned.opset_import)
    nmcli.session(pruned)  # loads


def test_external_data_roundtrip(rng, tmp_path, monkeypatch):
    """Models past protobuf's 2 GB limit are saved with external data; force it on a small one."""
    import nmcli.modelio as modelio
    w = rng.standard_normal((256, 64)).astype(np.float32)
    model = matmul_model(w, (2, 256))
    src = tmp_path / "dense.onnx"
    onnx.save_model(model, str(src), save_as_external_data=True, location="dense.onnx.data", size_threshold=0)
    loaded = load_model(src)
    pruned, _ = prune_model(loaded, Selection(NMPattern(2, 8)))
    monkeypatch.setattr(modelio, "EXTERNAL_THRESHOLD", 0)
    out = tmp_path / "out" / "sparse.onnx"
    out.parent.mkdir()
    written = save_model(pruned, out)
    assert sorted(p.name for p in written) == ["sparse.onnx", "sparse.onnx.data"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["sparse.onnx", "sparse.onnx.data"]
    x = rng.standard_normal((2, 256)).astype(np.float32)
    (y,) = nmcli.session(str(out)).run(None, {"x": x})
    assert error_ratio(y, *dense_reference(x, magnitude_pruned(w, NMPattern(2, 8))), np.float32, 256) < 1


def test_op_rejects_mismatched_tensors(rng):
    """The op's own checks (ops/nm_matmul_common.cc) give a clear message, not a crash."""
    w = rng.standard_normal((64, 8)).astype(np.float32)
    pruned, _ = prune_model(matmul_model(w, (2, 64)), Selection(NMPattern(2, 8)))
    node = op_nodes(pruned)[0]
    for a in node.attribute:
        if a.name == "k":
            a.i = 300  # 38 groups need 96 stored entries per row, the tensors have 32
    pruned.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 300
    with pytest.raises(Exception, match="values have shape"):
        nmcli.session(pruned).run(None, {"x": rng.standard_normal((2, 300)).astype(np.float32)})


@pytest.mark.parametrize("n,m,k", [(2, 8, 104), (1, 8, 200), (2, 4, 40)])
def test_op_reads_padded_and_unpadded_rows_of_indices(rng, n, m, k):
    """docs/FORMAT.md version 2: prune writes rows of indices padded to 16-byte units; the op runs
    the same model with version 1's unpadded rows to the same result; rows of any other width get a
    clear message."""
    w = rng.standard_normal((k, 24)).astype(np.float32)
    pruned, _ = prune_model(matmul_model(w, (3, k)), Selection(NMPattern(n, m)))
    shape = PackedShape(k, 24, NMPattern(n, m))
    indices_name = op_nodes(pruned)[0].input[2]
    words = numpy_helper.to_array(next(i for i in pruned.graph.initializer if i.name == indices_name))
    assert words.shape == (24, shape.padded_index_words) and shape.padded_index_words > shape.index_words
    assert not words[:, shape.index_words:].any()
    x = {"x": rng.standard_normal((3, k)).astype(np.float32)}
    (expected,) = run_sparse(pruned, x)

    def with_indices(width):
        model = onnx.ModelProto()
        model.CopyFrom(pruned)
        rows = np.zeros((24, width), np.uint32)
        common = min(width, shape.index_words)
        rows[:, :common] = words[:, :common]
        for init in model.graph.initializer:
            if init.name == indices_name:
                init.CopyFrom(numpy_helper.from_array(rows, indices_name))
        return model

    (y,) = run_sparse(with_indices(shape.index_words), x)
    assert np.array_equal(y, expected)
    with pytest.raises(Exception, match="indices have shape.*rows padded"):
        run_sparse(with_indices(shape.padded_index_words + 4), x)


def test_unknown_dims_stay_unknown_for_shape_arithmetic(rng):
    """Exporters leave dims unnamed; the op's shape inference must not turn them into -1
    values, or a Reshape built from Shape(y) sees several -1s (as in HF BERT exports)."""
    w = rng.standard_normal((16, 8)).astype(np.float32)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, None, 16])  # unnamed dims
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
             helper.make_node("Shape", ["y"], ["shape"], end=2),
             helper.make_node("Concat", ["shape", "tail"], ["target"], axis=0),
             helper.make_node("Reshape", ["y", "target"], ["z"])]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([-1, 4], np.int64), "tail")]
    model = make_model(nodes, [x], [vinfo("z", np.float32, None)], inits)
    pruned, _ = prune_model(model, Selection(NMPattern(2, 4)))
    feed = {"x": rng.standard_normal((2, 3, 16)).astype(np.float32)}
    (z,) = run_sparse(pruned, feed)
    ref, _ = dense_reference(feed["x"], magnitude_pruned(w, NMPattern(2, 4)))
    assert z.shape == (2, 3, 2, 4)
    assert relative_error(z.reshape(2, 3, 8), ref) < 1e-5


@pytest.mark.parametrize("n,m", FAMILIES + [(3, 7)])
@pytest.mark.parametrize("rows,k", [(1, 1000), (1, 1024), (5, 1003), (37, 1000)])
def test_bfloat16_op_on_cpu(rng, n, m, rows, k):
    """A bfloat16 model's op on the CPU EP (its weights decoded 8 at a time where the CPU has
    AVX2, one at a time for 3:7 and 8:32) against the float64 product of the pruned model's
    own stored tensors; the output buffer starts as NaN."""
    import ml_dtypes  # an onnx dependency; NumPy has no bfloat16

    bf16 = onnx.TensorProto.BFLOAT16
    w = rng.standard_normal((k, 72)).astype(ml_dtypes.bfloat16)
    pruned, _ = prune_model(matmul_model(w, (rows, k)), Selection(NMPattern(n, m)))
    node = op_nodes(pruned)[0]
    stored = {i.name: numpy_helper.to_array(i) for i in pruned.graph.initializer}
    values = stored[node.input[1]].astype(np.float32)
    packed = nmcli.format.from_arrays(values, stored[node.input[2]], n, m, k)
    x = rng.standard_normal((rows, k)).astype(ml_dtypes.bfloat16)
    y = np.full((rows, 72), np.nan, ml_dtypes.bfloat16)
    session = nmcli.session(pruned)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(np.uint16), bf16))
    binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy_with_onnx_type(y.view(np.uint16), bf16))
    session.run_with_iobinding(binding)
    ref, magnitude = dense_reference(x.astype(np.float32), nmcli.format.unpack(packed))
    assert error_ratio(y.astype(np.float32), ref, magnitude, "bfloat16", k) < 1
