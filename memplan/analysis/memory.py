"""``memplan.analyze``: where memory goes in a model, predicted before anything big runs.

The result bundles the captured graph with its analyses (tensors, liveness, saved-for-backward and the
simulated timeline) and explains the peak: the tensors alive there, largest first, each with the op
that made it, the user's source line, and why it is still alive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memplan.analysis.autograd import SavedForBackward
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation, SimEvent
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase, SourceLine, capture
from memplan.graphutil import packet_name
from memplan.measure import format_bytes

__all__ = ["analyze", "MemoryAnalysis", "PeakTensor", "Explanation"]

# Ops that return a view of their first argument (no new storage).
VIEW_OPS = frozenset(
    {
        "alias", "as_strided", "detach", "diagonal", "expand", "narrow", "permute", "select", "slice",
        "squeeze", "t", "transpose", "unbind", "unflatten", "unfold", "unsqueeze", "view", "_unsafe_view",
        "_reshape_alias", "split", "split_with_sizes", "chunk", "view_as_real", "view_as_complex", "real", "imag",
    }
)
# Ops that copy their first argument into a new storage of (at most) the same layout.
COPY_OPS = frozenset({"clone", "contiguous", "_to_copy", "copy", "reshape", "_unsafe_view"})


@dataclasses.dataclass(frozen=True)
class PeakTensor:
    """One storage alive at the peak."""

    storage: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    node: str
    op: str
    phase: str
    source: SourceLine | None
    reason: str
    provenance: str | None


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The tensors alive at the peak, largest first. Render with rich or ``str``."""

    peak: int
    peak_node: str | None
    peak_op: str | None
    peak_phase: str | None
    tensors: tuple[PeakTensor, ...]
    rest_bytes: int  # bytes alive at the peak in tensors not listed

    def __str__(self) -> str:
        lines = [self._headline()]
        for t in self.tensors:
            share = t.nbytes / self.peak if self.peak else 0.0
            where = f" at {t.source}" if t.source else ""
            lines.append(f"  {format_bytes(t.nbytes):>11} {share:6.1%}  {t.op}{list(t.shape)} {t.dtype}{where}")
            if t.provenance:
                lines.append(f"{'':22}{t.provenance}")
            lines.append(f"{'':22}alive because: {t.reason}")
        if self.rest_bytes:
            lines.append(f"  {format_bytes(self.rest_bytes):>11} in smaller tensors")
        return "\n".join(lines)

    def _headline(self) -> str:
        if self.peak_node is None:
            return "no memory is allocated"
        return f"peak {format_bytes(self.peak)} during {self.peak_phase}, at {self.peak_op} ({self.peak_node})"

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title=self._headline(), title_justify="left")
        for column in ("bytes", "share", "tensor", "made by", "source line", "alive because"):
            table.add_column(column, overflow="fold")
        for t in self.tensors:
            share = f"{t.nbytes / self.peak:.1%}" if self.peak else "-"
            made_by = t.op if not t.provenance else f"{t.op}: {t.provenance}"
            table.add_row(
                format_bytes(t.nbytes), share, f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}",
                made_by, str(t.source or "-"), t.reason,
            )
        if self.rest_bytes:
            table.add_row(format_bytes(self.rest_bytes), f"{self.rest_bytes / self.peak:.1%}", "smaller tensors", "", "", "")
        return table


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """What :func:`analyze` found: the captured graph, its analyses and the predicted peak."""

    graph: CapturedGraph
    tensors: Tensors
    liveness: Liveness
    saved: SavedForBackward
    simulation: PeakSimulation

    @property
    def peak(self) -> int:
        """Predicted peak bytes allocated during one call (inputs and parameters excluded)."""
        return self.simulation.peak

    @property
    def timeline(self) -> tuple[SimEvent, ...]:
        return self.simulation.timeline

    @property
    def saved_for_backward(self) -> dict[str, int]:
        """Forward node name -> bytes it keeps for the backward."""
        return {s.node: s.nbytes for s in self.saved.saved.values()}

    @classmethod
    def from_graph(cls, graph: CapturedGraph, am: AnalysisManager | None = None) -> "MemoryAnalysis":
        am = am or AnalysisManager(graph)
        return cls(graph, am.get(Tensors), am.get(Liveness), am.get(SavedForBackward), am.get(PeakSimulation))

    def __repr__(self) -> str:
        mode = "training" if self.graph.training else "inference"
        n = sum(1 for _ in self.graph.gm.graph.nodes)
        return (
            f"MemoryAnalysis({mode}, {n} nodes, predicted peak {format_bytes(self.peak)}, "
            f"saved for backward {format_bytes(self.saved.nbytes)})"
        )

    def report(self, title: str = "memplan analysis"):
        """The memory report of the model as written; ``.save_html(path)`` writes it."""
        from memplan.api import _external_bytes
        from memplan.report.data import build_report

        return build_report(self.graph, title=title, parameter_bytes=_external_bytes(self.graph))

    def explain(self, top: int = 10) -> Explanation:
        """The tensors alive at the peak, largest first, with why each is alive."""
        sim = self.simulation
        if sim.peak_index < 0:
            return Explanation(0, None, None, None, (), 0)
        peak_node = self.liveness.order[sim.peak_index]
        rows = [self._describe(sid, sim.peak_index) for sid in sim.live_at_peak[:top]]
        rest = sum(self.tensors.storages[sid].nbytes for sid in sim.live_at_peak[top:])
        return Explanation(
            peak=sim.peak,
            peak_node=peak_node,
            peak_op=self.graph.describe(peak_node),
            peak_phase=self.graph.phases[peak_node].value,
            tensors=tuple(rows),
            rest_bytes=rest,
        )

    # -- explanation helpers -------------------------------------------------------------------

    def _describe(self, sid: int, at: int) -> PeakTensor:
        storage = self.tensors.storages[sid]
        creator = self.graph.node(storage.creator)
        info = self.tensors.tensors[storage.creator]
        first = next((i for i in info if i.storage == sid), info[0])
        return PeakTensor(
            storage=sid,
            nbytes=storage.nbytes,
            shape=first.shape,
            dtype=first.dtype,
            node=storage.creator,
            op=packet_name(creator) or (f"chunked loop {creator.target}" if creator.op == "call_module" else str(creator.target)),
            phase=self.graph.phases[storage.creator].value,
            source=self.graph.sources.get(storage.creator),
            reason=self._reason(sid, at),
            provenance=self._provenance(creator),
        )

    def _reason(self, sid: int, at: int) -> str:
        graph = self.graph
        storage = self.tensors.storages[sid]
        for spec in graph.outputs:
            if spec.node is not None and spec.node in storage.members:
                return "output of the model" if spec.kind == "output" else f"gradient of {spec.path}"
        if self.liveness.position[storage.creator] == at:
            return "being computed at the peak"
        saved = self.saved.saved.get(sid)
        peak_phase = graph.phases[self.liveness.order[at]]
        if saved is not None and (peak_phase is Phase.BACKWARD or not self._read_later_in_forward(sid, at)):
            needed = graph.describe(saved.needed_by) if saved.needed_by else graph.describe(saved.readers[0])
            return f"saved for backward by {needed}"
        if self._read_at(sid, at):
            return "an input of the op at the peak"
        reader = self._next_reader(sid, at)
        if reader is not None:
            return f"waiting to be read by {graph.describe(reader)}"
        if graph.lifetimes == "eager":
            return (
                "no op reads it any more, but a Python reference (a local variable, a list) "
                "still holds it; `del` it or reuse the name after its last use"
            )
        return "kept to the end of the call"

    def _read_at(self, sid: int, at: int) -> bool:
        node = self.liveness.order[at]
        members = set(self.tensors.storages[sid].members)
        return any(arg.name in members for arg in self.graph.node(node).all_input_nodes)

    def _read_later_in_forward(self, sid: int, at: int) -> bool:
        reader = self._next_reader(sid, at)
        return reader is not None and self.graph.phases[reader] is Phase.FORWARD

    def _next_reader(self, sid: int, at: int) -> str | None:
        storage = self.tensors.storages[sid]
        best: tuple[int, str] | None = None
        for member in storage.members:
            for user in self.graph.node(member).users:
                pos = self.liveness.position.get(user.name)
                if pos is not None and pos > at and (best is None or pos < best[0]):
                    best = (pos, user.name)
        return best[1] if best else None

    def _provenance(self, node: torch.fx.Node) -> str | None:
        """Say when a storage is a copy of an input or parameter, especially a broadcast (expanded) one."""
        if packet_name(node) not in COPY_OPS or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        source, expanded = node.args[0], False
        while source.op == "call_function" and packet_name(source) in VIEW_OPS and source.args:
            expanded = expanded or packet_name(source) == "expand"
            if not isinstance(source.args[0], torch.fx.Node):
                return None
            source = source.args[0]
        if source.op != "placeholder":
            return None
        spec = self.graph.input_spec(source.name)
        what = f"{spec.kind} '{spec.path}'" if spec else f"input '{source.name}'"
        original = self.tensors.info(source.name)
        copy = self.tensors.info(node.name)
        if expanded and original is not None and copy is not None and original.nbytes:
            ratio = copy.nbytes / original.nbytes
            return (
                f"expanded copy of {what}: {list(original.shape)} broadcast to {list(copy.shape)}, "
                f"{ratio:.0f}x its size"
            )
        return f"copy of {what}"


def analyze(
    model: nn.Module | Callable[..., Any], *inputs: Any, train: bool | None = None, **kwargs: Any
) -> MemoryAnalysis:
    """Predict where memory goes in one call of ``model(*inputs)``, without running it for real.

    Training mode (the default when something requires grad) covers forward and the backward of
    ``sum(out.sum())``, exactly ``model(*inputs).sum().backward()``.

    Examples
    --------
    >>> import torch
    >>> a = analyze(torch.nn.Linear(256, 256), torch.randn(64, 256), train=False)
    >>> a.peak  # the (64, 256) float32 output
    65536
    """
    return MemoryAnalysis.from_graph(capture(model, *inputs, train=train, **kwargs))
