"""Why memory peaks where it does: what is alive at the peak in groups (by kind, by layer, by the user's
line; :mod:`memplan.analysis.groups`) with a one-line diagnosis, then the tensors alive there, largest
first, each with the op that made it, the user's source line, and why it is still alive.

It reads a graph's analyses (tensors, liveness, saved-for-backward and the simulated timeline), so
:func:`memplan.analyze` explains a model as written, the pipeline names what holds a budget it cannot
meet, and the report lists the tensors at the peak before and after a plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from memplan.analysis.autograd import SavedForBackward
from memplan.analysis.explain_text import render_lines
from memplan.analysis.groups import (
    KindShare, LineShare, ModuleShare, PeakGroups, StorageOrigin, group_peak, storage_origins,
)
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase, SourceLine
from memplan.graphutil import packet_name
from memplan.measure import format_bytes

__all__ = ["explain_peak", "PeakTensor", "Explanation"]

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
    module: str | None = None  # the module path of the op that made it (see memplan.analysis.groups)
    kind: str | None = None  # one of memplan.analysis.groups.KINDS
    library_source: SourceLine | None = None  # torch's line beneath ``source``


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What is alive at the peak: in groups (by kind, by layer, by line) with a diagnosis, then the
    largest tensors one by one. Render with rich (it fits the console's width) or ``str`` (80 columns);
    :meth:`render` takes a width."""

    peak: int
    peak_node: str | None
    peak_op: str | None
    peak_phase: str | None
    tensors: tuple[PeakTensor, ...]
    rest_bytes: int  # bytes alive at the peak in tensors not listed
    kinds: tuple[KindShare, ...] = ()
    modules: tuple[ModuleShare, ...] = ()
    lines: tuple[LineShare, ...] = ()
    diagnosis: str | None = None

    def __str__(self) -> str:
        return self.render()

    def render(self, width: int = 80, rows: int = 10) -> str:
        """The explanation as text no wider than ``width`` columns (at least 60), at most ``rows`` layers
        and ``rows`` lines (the tensors are those ``explain(top=...)`` kept)."""
        return "\n".join(text for text, _ in render_lines(self, max(width, 60), rows))

    def _headline(self) -> str:
        if self.peak_node is None:
            return "no memory is allocated"
        return f"peak {format_bytes(self.peak)} during {self.peak_phase}, at {self.peak_op} ({self.peak_node})"

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        for text, style in render_lines(self, max(min(options.max_width, 160), 60), 10):
            yield Text(text, style=style or "", no_wrap=True, overflow="ellipsis")


def explain_peak(graph: CapturedGraph, am: AnalysisManager | None = None, top: int = 10, *,
                 groups: bool = True) -> Explanation:
    """What is alive at the peak of ``graph``: the groups of :func:`memplan.analysis.groups.group_peak`
    (unless ``groups`` is False: a caller that reads only the tensors) and the ``top`` largest tensors,
    with why each is alive. ``am``: the analyses of ``graph`` the caller already has."""
    am = am or AnalysisManager(graph)
    sim = am.get(PeakSimulation)
    if sim.peak_index < 0:
        return Explanation(0, None, None, None, (), 0)
    peak_node = am.get(Liveness).order[sim.peak_index]
    listed = sim.live_at_peak[:top]
    origins = storage_origins(graph, am, listed)
    rows = [_describe(graph, am, sid, sim.peak_index, origins[sid]) for sid in listed]
    rest = sum(am.get(Tensors).storages[sid].nbytes for sid in sim.live_at_peak[top:])
    grouped = group_peak(graph, am) if groups else PeakGroups()
    return Explanation(
        peak=sim.peak,
        peak_node=peak_node,
        peak_op=graph.describe(peak_node),
        peak_phase=graph.phases[peak_node].value,
        tensors=tuple(rows),
        rest_bytes=rest,
        kinds=grouped.kinds,
        modules=grouped.modules,
        lines=grouped.lines,
        diagnosis=grouped.diagnosis,
    )


def _describe(graph: CapturedGraph, am: AnalysisManager, sid: int, at: int, origin: StorageOrigin) -> PeakTensor:
    tensors = am.get(Tensors)
    storage = tensors.storages[sid]
    creator = graph.node(storage.creator)
    info = tensors.tensors[storage.creator]
    first = next((i for i in info if i.storage == sid), info[0])
    return PeakTensor(
        storage=sid,
        nbytes=storage.nbytes,
        shape=first.shape,
        dtype=first.dtype,
        node=storage.creator,
        op=packet_name(creator) or (f"chunked loop {creator.target}" if creator.op == "call_module" else str(creator.target)),
        phase=graph.phases[storage.creator].value,
        source=graph.sources.get(storage.creator),
        reason=_reason(graph, am, sid, at),
        provenance=_provenance(graph, tensors, creator),
        module=origin.module,
        kind=origin.kind,
        library_source=origin.library_source,
    )


def _reason(graph: CapturedGraph, am: AnalysisManager, sid: int, at: int) -> str:
    liveness = am.get(Liveness)
    storage = am.get(Tensors).storages[sid]
    for spec in graph.outputs:
        if spec.node is not None and spec.node in storage.members:
            return "output of the model" if spec.kind == "output" else f"gradient of {spec.path}"
    if liveness.position[storage.creator] == at:
        return "being computed at the peak"
    saved = am.get(SavedForBackward).saved.get(sid)
    peak_phase = graph.phases[liveness.order[at]]
    if saved is not None and (peak_phase is Phase.BACKWARD or not _read_later_in_forward(graph, am, sid, at)):
        needed = graph.describe(saved.needed_by) if saved.needed_by else graph.describe(saved.readers[0])
        return f"saved for backward by {needed}"
    if _read_at(graph, am, sid, at):
        return "an input of the op at the peak"
    reader = _next_reader(graph, am, sid, at)
    if reader is not None:
        return f"waiting to be read by {graph.describe(reader)}"
    if graph.lifetimes == "eager":
        return (
            "no op reads it any more, but a Python reference (a local variable, a list) "
            "still holds it; `del` it or reuse the name after its last use"
        )
    return "kept to the end of the call"


def _read_at(graph: CapturedGraph, am: AnalysisManager, sid: int, at: int) -> bool:
    node = am.get(Liveness).order[at]
    members = set(am.get(Tensors).storages[sid].members)
    return any(arg.name in members for arg in graph.node(node).all_input_nodes)


def _read_later_in_forward(graph: CapturedGraph, am: AnalysisManager, sid: int, at: int) -> bool:
    reader = _next_reader(graph, am, sid, at)
    return reader is not None and graph.phases[reader] is Phase.FORWARD


def _next_reader(graph: CapturedGraph, am: AnalysisManager, sid: int, at: int) -> str | None:
    storage = am.get(Tensors).storages[sid]
    position = am.get(Liveness).position
    best: tuple[int, str] | None = None
    for member in storage.members:
        for user in graph.node(member).users:
            pos = position.get(user.name)
            if pos is not None and pos > at and (best is None or pos < best[0]):
                best = (pos, user.name)
    return best[1] if best else None


def _provenance(graph: CapturedGraph, tensors: Tensors, node: torch.fx.Node) -> str | None:
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
    spec = graph.input_spec(source.name)
    what = f"{spec.kind} '{spec.path}'" if spec else f"input '{source.name}'"
    original = tensors.info(source.name)
    copy = tensors.info(node.name)
    if expanded and original is not None and copy is not None and original.nbytes:
        ratio = copy.nbytes / original.nbytes
        return (
            f"expanded copy of {what}: {list(original.shape)} broadcast to {list(copy.shape)}, "
            f"{ratio:.0f}x its size"
        )
    return f"copy of {what}"
