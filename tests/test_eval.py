"""nmcli eval: output agreement and per-layer weight error, checked against NumPy."""
import json

import numpy as np
import onnx
import pytest
from models import make_model, matmul_model, transformer_block, vinfo
from onnx import helper, numpy_helper
from test_cli import assert_one_line_error, run
from test_permute import clustered_weight, stored_in_original_order

from nmcli import NMPattern, Selection, prune_model


def save(model, path):
    onnx.save(model, str(path))
    return path


def classifier(rng, k=48, classes=10):
    w = clustered_weight(rng, k, classes, np.float32)
    node = helper.make_node("MatMul", ["features", "W"], ["logits"], name="head")
    return make_model([node], [vinfo("features", np.float32, ["b", k])], [vinfo("logits", np.float32, ["b", classes])],
                      [numpy_helper.from_array(w, "W")]), w


def test_eval_numbers_match_numpy(tmp_path, rng):
    dense, w = classifier(rng)
    sparse, _ = prune_model(dense, Selection(NMPattern(2, 4)), permute=True)
    feats = rng.standard_normal((5, 3, 48)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", features=feats)
    result = run("eval", save(dense, tmp_path / "d.onnx"), save(sparse, tmp_path / "s.onnx"),
                 "--calib", tmp_path / "calib.npz", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["samples"] == 5
    w_pruned, perm = stored_in_original_order(sparse, "head")
    a = feats.reshape(-1, 48).astype(np.float64) @ w.astype(np.float64)
    b = feats.reshape(-1, 48).astype(np.float64) @ w_pruned.astype(np.float64)
    (out,) = report["outputs"]
    assert out["name"] == "logits" and out["rows"] == 15
    assert out["rel_error"] == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(a), rel=1e-4)
    cos = np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert out["cosine_mean"] == pytest.approx(cos.mean(), rel=1e-4)
    assert out["cosine_min"] == pytest.approx(cos.min(), rel=1e-4)
    assert out["top1"] == pytest.approx(np.mean(a.argmax(1) == b.argmax(1)))
    (layer,) = report["layers"]
    w64 = w.astype(np.float64)
    assert layer["permuted"] is True and layer["nm"] == "2:4"
    assert layer["rel_error"] == pytest.approx(np.linalg.norm(w64 - w_pruned) / np.linalg.norm(w64), rel=1e-6)
    assert layer["kept_energy"] == pytest.approx(np.sum(w_pruned.astype(np.float64) ** 2) / np.sum(w64 ** 2), rel=1e-6)


def test_eval_block_table_and_no_top1_for_hidden_states(tmp_path, rng):
    dense, _ = transformer_block(rng)
    sparse, report = prune_model(dense, Selection(NMPattern(2, 8)))
    result = run("eval", save(dense, tmp_path / "d.onnx"), save(sparse, tmp_path / "s.onnx"), "--samples", "2",
                 "--tokens", "7", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "output agreement over 2 sample(s)" in result.stdout and "per-layer weight error" in result.stdout
    for layer in report.layers:
        assert layer.node in result.stdout
    as_json = json.loads(run("eval", tmp_path / "d.onnx", tmp_path / "s.onnx", "--samples", "2", "--json",
                             cwd=tmp_path).stdout)
    assert as_json["outputs"][0]["top1"] is None  # a residual stream, not logits
    assert len(as_json["layers"]) == len(report.layers)
    assert 0 < as_json["outputs"][0]["cosine_mean"] < 1


def test_eval_bad_input(tmp_path, rng):
    dense, _ = classifier(rng)
    d = save(dense, tmp_path / "d.onnx")
    assert_one_line_error(run("eval", d, d, cwd=tmp_path), "no nmcli.NMMatMul nodes")
    assert_one_line_error(run("eval", d, tmp_path / "missing.onnx", cwd=tmp_path), "missing.onnx")
    sparse, _ = prune_model(dense, Selection(NMPattern(2, 4)))
    s = save(sparse, tmp_path / "s.onnx")
    np.savez(tmp_path / "bad.npz", other=np.zeros((2, 3, 48), np.float32))
    assert_one_line_error(run("eval", d, s, "--calib", tmp_path / "bad.npz", cwd=tmp_path), "missing: features")
    corrupt = onnx.ModelProto()
    corrupt.CopyFrom(sparse)
    node = next(n for n in corrupt.graph.node if n.op_type == "NMMatMul")
    for attr in node.attribute:
        if attr.name == "k":
            attr.i = 4 * 48  # stored rows no longer fit the declared K
    c = save(corrupt, tmp_path / "c.onnx")
    assert_one_line_error(run("eval", d, c, cwd=tmp_path), "do not fit the N:M format")
    other = matmul_model(rng.standard_normal((48, 10)).astype(np.float32), ["b", 48])
    other_sparse, _ = prune_model(other, Selection(NMPattern(2, 4)))
    o = save(other_sparse, tmp_path / "o.onnx")
    assert_one_line_error(run("eval", d, o, cwd=tmp_path), "different")
