"""Loading and saving models safely: clear errors, atomic writes, readable IR version."""
from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import onnx
from onnx import helper

from .errors import ModelError, OutputError, first_line

PROTOBUF_LIMIT = 2**31 - 1
EXTERNAL_THRESHOLD = 1_800_000_000  # save tensors externally well before protobuf's 2 GB cap


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    p = Path(path)
    if not p.exists():
        raise ModelError(f"{p}: no such file")
    if p.is_dir():
        raise ModelError(f"{p}: is a directory, expected an .onnx file")
    try:
        model = onnx.load(str(p), load_external_data=True)
    except Exception as exc:  # protobuf raises several unrelated types for garbage input
        raise ModelError(f"{p}: not a readable ONNX model ({first_line(exc, limit=200)})") from None
    if not model.graph.node and not model.graph.initializer:
        raise ModelError(f"{p}: not an ONNX model (no graph found)")
    return model


@functools.lru_cache(maxsize=1)
def max_ir_version_supported() -> int:
    """Highest IR version the installed onnxruntime loads, found by asking it."""
    import onnxruntime as ort

    for ir in range(onnx.IR_VERSION, 6, -1):
        probe = helper.make_model(
            helper.make_graph(
                [helper.make_node("Identity", ["x"], ["y"])], "probe",
                [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])]),
            opset_imports=[helper.make_opsetid("", 13)], ir_version=ir)
        try:
            ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
            return ir
        except Exception:
            continue
    return 7


def clamp_ir_version(model: onnx.ModelProto) -> None:
    """Lower the IR version to what onnxruntime reads, but not below what the opsets need."""
    needed = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    model.ir_version = max(min(model.ir_version, max_ir_version_supported()), needed)


def check_output_path(input_path: Path, output_path: Path, force: bool) -> None:
    if output_path.exists() and output_path.resolve() == input_path.resolve() and not force:
        raise OutputError(f"{output_path}: output would overwrite the input model (pass --force to allow)")
    if output_path.is_dir():
        raise OutputError(f"{output_path}: is a directory, give a file name")
    parent = output_path.parent if str(output_path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{parent}: output directory does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{parent}: output directory is not writable")


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> list[Path]:
    """Write atomically: everything goes to a temp folder beside the target, then is renamed.

    Models near protobuf's 2 GB limit store their tensors in `<name>.data` beside the model.
    Returns the files written.
    """
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    external = model.ByteSize() > EXTERNAL_THRESHOLD if _small_enough_to_measure(model) else True
    data_name = target.name + ".data"
    try:
        tmpdir = Path(tempfile.mkdtemp(prefix=".nmcli-", dir=parent))
    except OSError as exc:
        raise OutputError(f"{parent}: cannot write here ({exc.strerror})") from None
    try:
        tmp_model = tmpdir / target.name
        if external:
            onnx.save_model(model, str(tmp_model), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        else:
            onnx.save_model(model, str(tmp_model))
        written = []
        if external:  # data first: the model file is the one that points at it
            os.replace(tmpdir / data_name, parent / data_name)
            written.append(parent / data_name)
        os.replace(tmp_model, target)
        written.append(target)
        return written
    except OSError as exc:
        raise OutputError(f"{target}: cannot write ({exc.strerror or exc})") from None
    finally:
        for leftover in tmpdir.glob("*"):
            leftover.unlink(missing_ok=True)
        tmpdir.rmdir()


def raw_initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers stored as raw data (what dominates a model's size)."""
    total = 0
    for tensor in model.graph.initializer:
        if tensor.HasField("raw_data"):
            total += len(tensor.raw_data)
    return max(total, 0)


def _small_enough_to_measure(model: onnx.ModelProto) -> bool:
    # ByteSize() overflows past 2 GB in some protobuf builds; count raw tensor bytes first.
    return raw_initializer_bytes(model) < PROTOBUF_LIMIT
