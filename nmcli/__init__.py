"""nmcli: prune ONNX models to general N:M sparsity and run them with nmcli's own kernels."""
from importlib.metadata import PackageNotFoundError, version as _version

from .errors import NmcliError
from .format import NMPattern, PackedWeight, pack, unpack
from .graph import Selection
from .prune import OP_DOMAIN, OP_TYPE, prune_model
from .runtime import build_info, ops_library_path, session

try:
    __version__ = _version("nmcli")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = ["NmcliError", "NMPattern", "PackedWeight", "pack", "unpack", "Selection", "prune_model",
           "OP_DOMAIN", "OP_TYPE", "ops_library_path", "build_info", "session", "__version__"]
