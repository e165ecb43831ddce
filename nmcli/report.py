"""Per-layer pruning reports: data classes, a Rich table for people, a dict for --json."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rich.table import Table


@dataclass
class LayerReport:
    node: str
    op_type: str
    weight: str
    k: int
    nout: int
    dtype: str
    rel_error: float          # ||W - W'|| / ||W||
    bytes_before: int
    bytes_after: int
    shared_by: int = 1        # nodes using this weight (it is stored, and counted, once)
    permuted: bool = False    # input channels reordered before grouping (--permute)
    perm_gain: float = 0.0    # relative gain in kept criterion score from that order


@dataclass
class SkipReport:
    node: str
    weight: str
    reason: str


@dataclass
class PruneReport:
    pattern: str
    method: str
    layers: list[LayerReport] = field(default_factory=list)
    skipped: list[SkipReport] = field(default_factory=list)
    fused: dict[str, int] = field(default_factory=dict)  # neighbours moved into ops, by kind (fusion.py)
    bias_corrected: int = 0  # nodes whose bias got prune._bias_correction
    vector: int = 0  # columns per block sharing positions (0: element-wise)
    prefill_copy_bytes: int = 0  # 2:4 copies of the weights added for the sparse tensor cores (prefill_copy.py)

    def _unique_layers(self) -> list[LayerReport]:
        seen, out = set(), []
        for layer in self.layers:
            if layer.weight not in seen:
                seen.add(layer.weight)
                out.append(layer)
        return out

    @property
    def bytes_before(self) -> int:
        return sum(layer.bytes_before for layer in self._unique_layers())

    @property
    def bytes_after(self) -> int:
        return sum(layer.bytes_after for layer in self._unique_layers())

    def to_dict(self) -> dict:
        return {
            "pattern": self.pattern, "method": self.method,
            "layers": [asdict(layer) for layer in self.layers],
            "skipped": [asdict(s) for s in self.skipped],
            "fused": dict(self.fused),
            "bias_corrected": self.bias_corrected,
            "vector": self.vector,
            "prefill_copy_bytes": self.prefill_copy_bytes,
            "totals": {"layers": len(self.layers), "weights": len(self._unique_layers()),
                       "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                       "compression": self.bytes_before / self.bytes_after if self.bytes_after else None},
        }

    def table(self, title: str) -> Table:
        table = Table(title=title, show_footer=True, header_style="bold")
        table.add_column("layer", footer="total")
        table.add_column("op")
        table.add_column("K x Nout", justify="right")
        table.add_column("N:M", justify="center")
        table.add_column("rel. error", justify="right")
        table.add_column("before", justify="right", footer=human_bytes(self.bytes_before))
        table.add_column("after", justify="right", footer=human_bytes(self.bytes_after))
        ratio = self.bytes_before / self.bytes_after if self.bytes_after else 0.0
        table.add_column("ratio", justify="right", footer=f"{ratio:.2f}x")
        permuted = any(layer.permuted for layer in self.layers)
        if permuted:
            table.add_column("channel order", justify="right")
        for layer in self.layers:
            shared = f" (shared x{layer.shared_by})" if layer.shared_by > 1 else ""
            row = [layer.node + shared, layer.op_type, f"{layer.k} x {layer.nout}", self.pattern,
                   f"{layer.rel_error:.4f}", human_bytes(layer.bytes_before), human_bytes(layer.bytes_after),
                   f"{layer.bytes_before / layer.bytes_after:.2f}x"]
            if permuted:
                row.append(f"+{layer.perm_gain * 100:.2f}% score" if layer.permuted else "identity")
            table.add_row(*row)
        return table

    def skipped_table(self) -> Table | None:
        if not self.skipped:
            return None
        table = Table(title="skipped", header_style="bold")
        table.add_column("layer")
        table.add_column("weight")
        table.add_column("why")
        for s in self.skipped:
            table.add_row(s.node, s.weight, s.reason)
        return table


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
