import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

FAMILIES = [(1, 2), (2, 4), (1, 4), (2, 8), (1, 8), (4, 16), (8, 32)]


@pytest.fixture
def rng():
    """Fresh random data every run; the seed is printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"rng seed = {seed}")
    return np.random.default_rng(seed)


def has_cuda_gpu() -> bool:
    try:
        import ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    except OSError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_cuda_gpu():
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
