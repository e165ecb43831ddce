"""Whole-model benchmark: a dense and a sparse ONNX model in ONNX Runtime, same inputs.

Method: one session per model on the CUDA execution provider (CPU when no GPU, with a
warning), IO binding with inputs and outputs resident on the device, warm-up runs, then the
wall time of each `run_with_iobinding` (ORT synchronizes its stream at the end of a run, so this
is the latency a caller sees); median, p10 and p90. Separately, with nmcli's kernel timer on
(CUDA events on the GPU, host clock on the CPU), the time inside nmcli.NMMatMul per run, and with
NVML (optional) the energy per run over a loop of at least a second.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx

from .errors import NmcliError, first_line
from .inputs import input_specs, random_feeds, resolve_shapes
from .runtime import cuda_device_count, read_op_timing, session, set_op_timing


@dataclass
class Latency:
    p10_ms: float
    p50_ms: float
    p90_ms: float

    @staticmethod
    def of(samples_ms: list[float]) -> "Latency":
        p10, p50, p90 = np.percentile(samples_ms, [10, 50, 90])
        return Latency(float(p10), float(p50), float(p90))


@dataclass
class Agreement:
    output: str
    max_abs_diff: float
    cosine: float


@dataclass
class SettingResult:
    name: str
    shapes: dict
    dense: Latency
    sparse: Latency
    speedup: float                  # dense p50 / sparse p50
    nm_op_ms: float | None          # per run, inside nmcli.NMMatMul (sparse model)
    other_ms: float | None          # sparse p50 minus that
    agreement: list[Agreement]
    dense_mj: float | None = None   # energy per run (NVML), millijoules
    sparse_mj: float | None = None


@dataclass
class ModelSide:
    label: str
    file_bytes: int
    gpu_bytes: int | None           # device memory the session holds after a run


@dataclass
class BenchReport:
    device: str
    provider: str
    runs: int
    dense: ModelSide
    sparse: ModelSide
    cuda_graph: bool = False        # timed runs were CUDA-graph replays (ORT enable_cuda_graph)
    settings: list[SettingResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def model_bytes(model: onnx.ModelProto, path: str | None = None) -> int:
    """Bytes on disk for a file (its external data included), else the serialized size."""
    if not path:
        return model.ByteSize()
    folder = os.path.dirname(os.path.abspath(path))
    files = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    return os.path.getsize(path) + sum(os.path.getsize(os.path.join(folder, f)) for f in files
                                       if os.path.isfile(os.path.join(folder, f)))


def pick_device(requested: str) -> tuple[str, list[str]]:
    """("cuda" | "cpu", warnings)."""
    notes = []
    if requested not in ("auto", "cuda", "cpu"):
        raise NmcliError(f"--device must be auto, cuda or cpu, not '{requested}'")
    if requested == "cpu":
        return "cpu", notes
    gpus = cuda_device_count()
    if gpus == 0:
        if requested == "cuda":
            raise NmcliError("--device cuda: no CUDA GPU visible (or nmcli was built without CUDA)")
        notes.append("no CUDA GPU visible: timing on the CPU execution provider; GPU numbers need a GPU")
        return "cpu", notes
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        if requested == "cuda":
            raise NmcliError("--device cuda: this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
        notes.append("onnxruntime has no CUDAExecutionProvider: timing on the CPU (install onnxruntime-gpu)")
        return "cpu", notes
    return "cuda", notes


def _open(model: onnx.ModelProto, device: str, cuda_graph: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if device == "cuda":
        cuda = {"arena_extend_strategy": "kSameAsRequested"}
        if cuda_graph:
            cuda["enable_cuda_graph"] = "1"
        providers = [("CUDAExecutionProvider", cuda)]
    else:
        providers = ["CPUExecutionProvider"]
    try:
        return session(model, providers=providers, sess_options=options)
    except NmcliError:
        raise
    except Exception as exc:
        with_graphs = " with CUDA graphs" if cuda_graph else ""
        raise NmcliError(f"onnxruntime cannot load the model{with_graphs}: {first_line(exc)}") from None


class BoundModel:
    """A session with IO binding: inputs copied to the device once, outputs left there.

    After `enable_cuda_graphs()`, timed runs replay a CUDA graph that ORT captured (enable_cuda_graph):
    a second session per input shape, every input and output bound to a fixed device buffer,
    as a decode server would run. The plain session still serves the op-time split (our op's
    timer runs on the host side of each launch, which a graph replay skips) and the outputs."""

    def __init__(self, model: onnx.ModelProto, device: str):
        self.device = device
        self.model = model
        self.cuda_graph = False
        self.session = _open(model, device)
        self.provider = self.session.get_providers()[0]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.graph_session = self.graph_binding = None

    def enable_cuda_graphs(self) -> None:
        """From the next bind() on, time graph replays (CUDA only; a no-op on the CPU)."""
        self.cuda_graph = self.device == "cuda"

    def bind(self, feeds: dict) -> None:
        import onnxruntime as ort

        self.binding = self.session.io_binding()
        self._device_inputs = {}  # name -> OrtValue, kept alive and shared with the graph session
        for name, array in feeds.items():
            if self.device == "cuda":
                value = ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0)
                self._device_inputs[name] = value
                self.binding.bind_ortvalue_input(name, value)
            else:
                self.binding.bind_cpu_input(name, array)
        for name in self.outputs:
            self.binding.bind_output(name, "cuda" if self.device == "cuda" else "cpu")
        if self.cuda_graph:
            self._bind_graph()

    def _bind_graph(self) -> None:
        import onnxruntime as ort

        self.run_plain()  # learns the output shapes and types
        outputs = self.binding.get_outputs()
        self.graph_session = None  # the previous shape's graph and buffers go first
        self.graph_session = _open(self.model, self.device, cuda_graph=True)
        self.graph_binding = self.graph_session.io_binding()
        for name, value in self._device_inputs.items():
            self.graph_binding.bind_ortvalue_input(name, value)
        self._graph_outputs = [ort.OrtValue.ortvalue_from_shape_and_type(v.shape(), _numpy_type(v), "cuda", 0)
                               for v in outputs]
        for name, value in zip(self.outputs, self._graph_outputs):
            self.graph_binding.bind_ortvalue_output(name, value)
        for _ in range(3):  # ORT captures the graph on an early run, later runs replay it
            self._run(self.graph_session, self.graph_binding)

    def run(self) -> None:
        if self.cuda_graph:
            self._run(self.graph_session, self.graph_binding)
        else:
            self.run_plain()

    def run_plain(self) -> None:
        self._run(self.session, self.binding)

    @staticmethod
    def _run(sess, binding) -> None:
        try:
            sess.run_with_iobinding(binding)
        except Exception as exc:
            raise NmcliError(f"onnxruntime failed to run the model: {first_line(exc)}") from None

    def time(self, warmup: int, runs: int) -> list[float]:
        for _ in range(warmup):
            self.run()
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            self.run()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples

    def outputs_numpy(self) -> list[np.ndarray]:
        self.run_plain()
        return self.binding.copy_outputs_to_cpu()


def _numpy_type(value) -> type:
    """NumPy type of an OrtValue, for allocating a buffer like it."""
    name = value.data_type()  # e.g. "tensor(float16)"
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
            "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
            "tensor(bfloat16)": np.uint16}.get(name, np.float32)


def _gpu_used() -> int:
    from . import _kernels
    free, total = _kernels.cuda_mem_info(0)
    return total - free


def agreement(names: list[str], dense: list[np.ndarray], sparse: list[np.ndarray]) -> list[Agreement]:
    out = []
    for name, a, b in zip(names, dense, sparse):
        a64, b64 = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
        denom = np.linalg.norm(a64) * np.linalg.norm(b64)
        cosine = float(a64 @ b64 / denom) if denom > 0 else float(np.array_equal(a64, b64))
        out.append(Agreement(name, float(np.max(np.abs(a64 - b64))) if a64.size else 0.0, cosine))
    return out


class EnergyMeter:
    """Total-energy counter of GPU 0 through NVML (nvidia-ml-py); reads only, changes nothing."""

    def __init__(self):
        self.handle = None
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)  # nmcli runs on CUDA device 0
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            self.pynvml, self.handle = pynvml, handle
        except Exception:
            self.handle = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def per_run_mj(self, bound: BoundModel, min_seconds: float = 1.0) -> float:
        start_mj = self.pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        start, runs = time.perf_counter(), 0
        while time.perf_counter() - start < min_seconds:
            bound.run()
            runs += 1
        return (self.pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) - start_mj) / runs


def op_time_per_run(bound: BoundModel, runs: int) -> float | None:
    """Milliseconds per run inside nmcli.NMMatMul kernels (None when the model has none)."""
    for _ in range(3):  # the other model just ran: let caches and clocks settle first
        bound.run_plain()
    read_op_timing()  # reset
    set_op_timing(True)
    try:
        for _ in range(runs):
            bound.run_plain()
    finally:
        set_op_timing(False)
    total_ms, calls = read_op_timing()
    return total_ms / runs if calls else None


def bench_pair(dense: onnx.ModelProto, sparse: onnx.ModelProto, settings: list[tuple[str, int, int]],
               overrides: dict, device: str, notes: list[str] = (), warmup: int = 10, runs: int = 100,
               dense_path: str | None = None, sparse_path: str | None = None, energy: bool = True,
               progress=None, seed: int | None = None, cuda_graph: bool = False) -> BenchReport:
    """settings: (name, batch, tokens) triples; overrides: input name -> shape for every setting;
    device and notes: what pick_device chose and why (the notes end up in the report)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"bench_pair runs on 'cuda' or 'cpu' (see pick_device), not '{device}'")
    notes = list(notes)
    specs = input_specs(dense)
    sparse_names = {s.name for s in input_specs(sparse)}
    if sparse_names != {s.name for s in specs}:
        raise NmcliError("the dense and sparse models have different inputs: "
                         f"{sorted(s.name for s in specs)} vs {sorted(sparse_names)}")
    if not specs:
        raise NmcliError("the model has no inputs to feed")
    rng = np.random.default_rng(seed)
    first = random_feeds(specs, resolve_shapes(specs, settings[0][1], settings[0][2], overrides), rng)
    runners, gpu_bytes = [], []
    for model in (dense, sparse):  # one at a time, so each memory reading holds one model
        before = _gpu_used() if device == "cuda" else 0
        runner = BoundModel(model, device)
        runner.bind(first)
        runner.run()
        runners.append(runner)
        gpu_bytes.append(max(0, _gpu_used() - before) if device == "cuda" else None)
        if cuda_graph:  # after the memory reading: graph sessions from the first setting on
            runner.enable_cuda_graphs()
    dense_run, sparse_run = runners
    if device == "cuda" and (dense_run.provider != "CUDAExecutionProvider" or sparse_run.provider != "CUDAExecutionProvider"):
        raise NmcliError("onnxruntime did not place the models on the CUDA execution provider")
    meter = EnergyMeter() if energy and device == "cuda" else None
    if cuda_graph and device != "cuda":
        notes.append("--cuda-graph applies to the CUDA EP only: ignored on the CPU")
    if cuda_graph and device == "cuda":
        notes.append("CUDA graphs: latency and energy are graph replays; the op/other split is measured on "
                     "plain runs, so 'other' is the graph replay time minus the op's kernel time")
    if device == "cuda" and energy and not meter.available:
        notes.append("energy not measured: install the optional extra (pip install 'nmcli[energy]') for NVML")
    report = BenchReport(
        device=_device_name(device), provider=dense_run.provider, runs=runs, cuda_graph=cuda_graph and device == "cuda",
        dense=ModelSide("dense", model_bytes(dense, dense_path), gpu_bytes[0]),
        sparse=ModelSide("sparse", model_bytes(sparse, sparse_path), gpu_bytes[1]), notes=notes)
    for name, batch, tokens in settings:
        shapes = resolve_shapes(specs, batch, tokens, overrides)
        feeds = random_feeds(specs, shapes, rng)
        results = {}
        for label, bound in (("dense", dense_run), ("sparse", sparse_run)):
            if progress:
                progress(f"{name}: {label}")
            bound.bind(feeds)
            results[label] = Latency.of(bound.time(warmup, runs))
        op_ms = op_time_per_run(sparse_run, max(10, runs // 4))
        dense_mj = sparse_mj = None
        if meter and meter.available:
            dense_mj, sparse_mj = meter.per_run_mj(dense_run), meter.per_run_mj(sparse_run)
        report.settings.append(SettingResult(
            name=name, shapes={k: list(v) for k, v in shapes.items()}, dense=results["dense"], sparse=results["sparse"],
            speedup=results["dense"].p50_ms / results["sparse"].p50_ms, nm_op_ms=op_ms,
            other_ms=None if op_ms is None else max(0.0, results["sparse"].p50_ms - op_ms),
            agreement=agreement(dense_run.outputs, dense_run.outputs_numpy(), sparse_run.outputs_numpy()),
            dense_mj=dense_mj, sparse_mj=sparse_mj))
    return report


def _device_name(device: str) -> str:
    if device == "cuda":
        try:
            import pynvml
            pynvml.nvmlInit()
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            return name.decode() if isinstance(name, bytes) else name
        except Exception:
            return "CUDA GPU 0"
    import platform
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)"


def default_settings(device: str, tokens: list[int], batch: int) -> list[tuple[str, int, int]]:
    tokens = tokens or ([1, 512] if device == "cuda" else [1, 64])
    return [(("decode" if t == 1 else "prefill") + f" {batch}x{t}", batch, t) for t in tokens]



def report_tables(report: BenchReport) -> list:
    """Rich tables: latency per setting, then size and memory."""
    from rich.table import Table

    from .report import human_bytes

    graphs = ", CUDA graphs" if report.cuda_graph else ""
    timing = Table(title=f"dense vs sparse on {report.device} ({report.provider}{graphs}, median of {report.runs} runs)",
                   caption="ms: median, p10-p90 below; op ms: inside nmcli.NMMatMul per run; other: the rest; "
                           "mJ/run: dense above sparse (NVML); cosine, max|diff|: sparse vs dense outputs",
                   header_style="bold")
    for col in ("setting", "dense ms", "sparse ms", "speedup", "op ms", "other ms", "mJ/run", "cosine", "max|diff|"):
        timing.add_column(col, justify="left" if col == "setting" else "right", no_wrap=True)
    fmt = lambda lat: f"{lat.p50_ms:.3f}\n[dim]{lat.p10_ms:.3f}-{lat.p90_ms:.3f}[/]"
    for s in report.settings:
        energy = f"{s.dense_mj:.1f}\n{s.sparse_mj:.1f}" if s.dense_mj is not None else "n/a"
        timing.add_row(s.name, fmt(s.dense), fmt(s.sparse), f"[bold]{s.speedup:.2f}x[/]",
                       "-" if s.nm_op_ms is None else f"{s.nm_op_ms:.3f}",
                       "-" if s.other_ms is None else f"{s.other_ms:.3f}", energy,
                       f"{min(a.cosine for a in s.agreement):.5f}", f"{max(a.max_abs_diff for a in s.agreement):.3g}")
    size = Table(title="model size", header_style="bold")
    for col in ("", "file", "GPU memory"):
        size.add_column(col, justify="right")
    for side in (report.dense, report.sparse):
        size.add_row(side.label, human_bytes(side.file_bytes),
                     "n/a" if side.gpu_bytes is None else human_bytes(side.gpu_bytes))
    return [timing, size]
