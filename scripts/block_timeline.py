"""In-graph kernel timeline of ONNX models in ORT's CUDA EP under CUDA-graph replay.

torch.profiler (CUPTI) runs in the same process as ORT and records every kernel of 60
replays; this prints, per kernel position, the median duration and the gap before it
(negative: the kernel started before the previous one ended, e.g. with programmatic dependent
launch). Needs torch and onnxruntime-gpu; the models take one input x [1, tokens, hidden].

    python scripts/block_timeline.py dense.onnx sparse.onnx [--tokens 1]
"""
import argparse
import json
import statistics
import tempfile

import numpy as np
import onnxruntime as ort

import nmcli.runtime as rt

REPLAYS, SKIPPED = 60, 5


def bound_session(path: str, tokens: int):
    ort.preload_dlls(directory="")
    sess = ort.InferenceSession(path, sess_options=rt.session_options(),
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    shape = [d if isinstance(d, int) else 1 for d in sess.get_inputs()[0].shape]
    shape[-2] = tokens
    dtype = np.float16 if "float16" in sess.get_inputs()[0].type else np.float32
    x = ort.OrtValue.ortvalue_from_numpy(np.random.default_rng(0).standard_normal(shape).astype(dtype), "cuda", 0)
    y = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input(sess.get_inputs()[0].name, x)
    binding.bind_ortvalue_output(sess.get_outputs()[0].name, y)
    for _ in range(20):  # the first run captures the graph
        sess.run_with_iobinding(binding)
    return sess, binding, (x, y)


def timeline(sess, binding) -> list[list[dict]]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            sess.run_with_iobinding(binding)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = sorted((e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"),
                        key=lambda e: e["ts"])
    per = len(events) // REPLAYS
    return [events[i * per:(i + 1) * per] for i in range(REPLAYS)][SKIPPED:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--tokens", type=int, default=1)
    args = parser.parse_args()
    bound = [bound_session(m, args.tokens) for m in args.models]  # before torch touches CUDA
    for path, (sess, binding, _) in zip(args.models, bound):
        replays = timeline(sess, binding)
        span = statistics.median(r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in replays)
        print(f"\n{path}: {len(replays[0])} kernels per replay, first-to-last span {span:.2f} us (median)")
        for i, event in enumerate(replays[0]):
            dur = statistics.median(r[i]["dur"] for r in replays)
            gap = statistics.median(r[i]["ts"] - r[i - 1]["ts"] - r[i - 1]["dur"] for r in replays) if i else 0.0
            print(f"  {i:2d} {event['name'][:70]:70s} {dur:7.2f} us  gap before {gap:6.2f}")


if __name__ == "__main__":
    main()
