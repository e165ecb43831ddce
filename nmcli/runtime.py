"""Finding the compiled op library and opening ONNX Runtime sessions with it registered."""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import onnx

from .errors import ModelError, OpsLibraryError

LIBRARY_NAME = "libnmcli_ops.so"


def ops_library_path() -> str:
    """Absolute path of the op library, for SessionOptions.register_custom_ops_library."""
    override = os.environ.get("NMCLI_OPS_LIBRARY")
    path = Path(override) if override else Path(__file__).parent / "_lib" / LIBRARY_NAME
    if not path.is_file():
        raise OpsLibraryError(f"op library not found at {path}: reinstall nmcli with 'pip install .' "
                              "(it is built from ops/ and kernels/ at install time)")
    return str(path)


@functools.lru_cache(maxsize=1)
def build_info() -> dict:
    """What the op library was compiled with, e.g. {'cpu': True, 'cuda': True, 'cuda_archs': '90'}."""
    lib = _library()
    lib.nmcli_ops_build_info.restype = ctypes.c_char_p
    info = {}
    for item in lib.nmcli_ops_build_info().decode().split(";"):
        key, _, value = item.partition("=")
        info[key] = value == "1" if key in ("cpu", "cuda") else value
    return info


@functools.lru_cache(maxsize=1)
def _library():
    lib = ctypes.CDLL(ops_library_path())  # the same handle ONNX Runtime loads, so the same timer
    lib.nmcli_op_timing_enable.argtypes = [ctypes.c_int]
    lib.nmcli_op_timing_read.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_longlong)]
    return lib


def set_op_timing(on: bool) -> None:
    """Switch the op library's own kernel timer (host clock on CPU, CUDA events on GPU)."""
    _library().nmcli_op_timing_enable(int(on))


def read_op_timing() -> tuple[float, int]:
    """Milliseconds spent in nmcli.NMMatMul kernels and the number of calls since the last read."""
    total, calls = ctypes.c_double(), ctypes.c_longlong()
    _library().nmcli_op_timing_read(ctypes.byref(total), ctypes.byref(calls))
    return total.value, calls.value


def cuda_device_count() -> int:
    """GPUs the CUDA kernels can use (0 without a CUDA build, driver or GPU)."""
    from . import _kernels
    return _kernels.cuda_device_count() if getattr(_kernels, "HAS_CUDA", False) else 0


def session_options(options=None):
    import onnxruntime as ort

    options = options or ort.SessionOptions()
    options.register_custom_ops_library(ops_library_path())
    return options


def session(model, providers=None, sess_options=None, **kwargs):
    """An onnxruntime.InferenceSession with the nmcli op library registered.

    `model` is a path or an onnx.ModelProto; `providers` defaults to CPU only.
    """
    import onnxruntime as ort

    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    elif not isinstance(model, (bytes, bytearray)):
        model = os.fspath(model)
        if not Path(model).is_file():
            raise ModelError(f"{model}: no such file")
    providers = providers or ["CPUExecutionProvider"]
    names = [p[0] if isinstance(p, tuple) else p for p in providers]
    if "CUDAExecutionProvider" in names and hasattr(ort, "preload_dlls"):
        # CUDA libraries may come from pip wheels (nvidia-*), which the EP does not search itself.
        ort.preload_dlls(directory="")
    return ort.InferenceSession(model, sess_options=session_options(sess_options), providers=providers, **kwargs)
