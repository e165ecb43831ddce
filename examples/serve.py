"""Serve an nmcli-pruned model with plain ONNX Runtime.

    python examples/serve.py block.nm.onnx [--cuda]

Only the op library path comes from nmcli; code that does not import nmcli can take it from
`nmcli ops-path` instead.
"""
import sys

import numpy as np
import onnxruntime as ort

import nmcli


def main(model_path: str, use_cuda: bool) -> np.ndarray:
    options = ort.SessionOptions()
    options.register_custom_ops_library(nmcli.ops_library_path())
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if use_cuda else ["CPUExecutionProvider"]
    session = ort.InferenceSession(model_path, options, providers=providers)
    feeds = {}
    for inp in session.get_inputs():
        shape = [d if isinstance(d, int) else 4 for d in inp.shape]  # 4 for every symbolic dim
        dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
        feeds[inp.name] = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    outputs = session.run(None, feeds)
    print(f"provider: {session.get_providers()[0]}")
    for meta, value in zip(session.get_outputs(), outputs):
        print(f"{meta.name}: shape {value.shape}, dtype {value.dtype}, mean {float(np.mean(value)):+.5f}")
    return outputs[0]


if __name__ == "__main__":
    main(sys.argv[1], "--cuda" in sys.argv[2:])
