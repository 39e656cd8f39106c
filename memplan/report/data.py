"""The report's data: timelines by category, the graph in groups, passes, and the tensors at the peak.

Reports are objects first and rendered last (HTML in :mod:`memplan.report.html`, rich on the console).
Everything here is computed from a captured graph's analyses; nothing is measured.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence

import torch

from memplan.analysis.autograd import SavedForBackward
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.explain import Explanation, explain_peak
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import graph_device, packet_name

__all__ = ["CATEGORIES", "Timeline", "GraphGroup", "GraphView", "PassRow", "MemoryReport", "build_report", "graph_device"]

#: Memory categories, bottom to top of the stacked timeline.
CATEGORIES = ("parameters", "saved for backward", "temporaries", "gradients", "outputs")


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Bytes live per category after each node, plus the phase of each step."""

    label: str
    steps: tuple[str, ...]  # node names
    phases: tuple[str, ...]
    series: dict[str, tuple[int, ...]]  # category -> bytes per step, in the order of CATEGORIES
    peak: int
    peak_index: int


@dataclasses.dataclass(frozen=True)
class GraphGroup:
    """One box of the graph view: a node, or all nodes of one phase, op, module and source line (a collapsed
    loop)."""

    key: str
    label: str
    op: str
    source: str | None
    phase: str
    count: int  # nodes in the group (the timesteps of an unrolled loop collapse into one)
    nbytes: int  # bytes the group's nodes allocate
    storage: int | None  # storage id when the group is a single node; colours sharing
    shares_with: int  # other nodes sharing this node's storage
    module: str | None = None  # module path of the group's first node ("" the model's own), None outside


@dataclasses.dataclass(frozen=True)
class GraphView:
    groups: tuple[GraphGroup, ...]
    edges: tuple[tuple[int, int], ...]  # (from group index, to group index)
    collapsed: bool
    nodes: int


@dataclasses.dataclass(frozen=True)
class PassRow:
    name: str
    changed: bool
    peak_before: int
    peak_after: int
    bytes_saved: int
    recompute_added: float
    nodes_rewritten: int
    seconds: float
    notes: tuple[str, ...]
    rolled_back: str | None = None  # what the pass did wrong, when the pipeline left it out


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Everything the HTML report and the console show.

    ``before.peak`` counts the model as written with eager lifetimes (a tensor lives until the user's
    Python drops it); the passes' ``peak_before``/``peak_after`` count graph lifetimes (a tensor dies
    after its last use), the way a plan runs, so the first pass starts at or below ``before.peak``.
    """

    title: str
    training: bool
    parameter_bytes: int
    before: Timeline
    after: Timeline | None
    graph: GraphView
    passes: tuple[PassRow, ...]
    explain_before: Explanation
    explain_after: Explanation | None
    device: str = "cpu"  # the device the graph was captured for
    torch_version: str = torch.__version__
    memplan_version: str = ""
    created: str = ""  # local date and time the report was built

    def save_html(self, path: str) -> str:
        """Write one self-contained HTML file; returns the path."""
        from memplan.report.html import render_html

        with open(path, "w", encoding="utf-8") as f:
            f.write(render_html(self))
        return path

    def save_chrome_trace(self, path: str) -> str:
        """Write the timelines as counter tracks of a Chrome trace (JSON) for ui.perfetto.dev or
        chrome://tracing; returns the path (see :mod:`memplan.report.chrome_trace`)."""
        from memplan.report.chrome_trace import save_chrome_trace

        return save_chrome_trace(self, path)

    def __rich__(self):
        from rich.console import Group

        parts = [f"[bold]{self.title}[/bold]", self.explain_before]
        if self.explain_after is not None:
            parts.append(self.explain_after)
        return Group(*parts)


def _timeline(graph: CapturedGraph, label: str, parameter_bytes: int) -> Timeline:
    am = AnalysisManager(graph)
    tensors, liveness, saved, sim = am.get(Tensors), am.get(Liveness), am.get(SavedForBackward), am.get(PeakSimulation)
    output_storages: dict[int, str] = {}
    for spec in graph.outputs:
        if spec.node is not None:
            for sid in tensors.storages_of(spec.node):
                output_storages[sid] = "gradients" if spec.kind == "grad" else "outputs"
    category: dict[int, str] = {}
    for sid, storage in tensors.storages.items():
        if storage.external:
            continue
        if sid in output_storages:
            category[sid] = output_storages[sid]
        elif sid in saved.saved:
            category[sid] = "saved for backward"
        elif graph.phases.get(storage.creator) is Phase.BACKWARD:
            category[sid] = "gradients"
        else:
            category[sid] = "temporaries"
    n = len(liveness.order)
    # difference arrays: +bytes where a storage is born, -bytes after it dies; then running sums
    delta = {c: [0] * (n + 1) for c in CATEGORIES}
    for sid, cat in category.items():
        interval = liveness.intervals[sid]
        delta[cat][max(interval.start, 0)] += tensors.storages[sid].nbytes
        delta[cat][min(interval.end, n - 1) + 1] -= tensors.storages[sid].nbytes
    series: dict[str, tuple[int, ...]] = {"parameters": (parameter_bytes,) * n}
    for cat in CATEGORIES[1:]:
        running, values = 0, []
        for i in range(n):
            running += delta[cat][i]
            values.append(running)
        series[cat] = tuple(values)
    return Timeline(
        label=label,
        steps=liveness.order,
        phases=tuple(graph.phases[name].value for name in liveness.order),
        series=series,
        peak=sim.peak,
        peak_index=sim.peak_index,
    )


def _graph_view(graph: CapturedGraph, max_nodes: int) -> GraphView:
    am = AnalysisManager(graph)
    tensors = am.get(Tensors)
    nodes = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
    collapsed = len(nodes) > max_nodes
    keys: dict[str, str] = {}
    order: list[str] = []
    members: dict[str, list] = {}
    for node in nodes:
        source = graph.sources.get(node.name)
        if collapsed:  # one box per phase, op, module and line: a loop's timesteps, not two layers' ops
            line = f"{source.filename}:{source.lineno}" if source else "-"
            key = f"{graph.phases[node.name].value}|{packet_name(node)}|{graph.modules.get(node.name)}|{line}"
        else:
            key = node.name
        keys[node.name] = key
        if key not in members:
            members[key] = []
            order.append(key)
        members[key].append(node)
    index = {key: i for i, key in enumerate(order)}
    groups = []
    for key in order:
        group_nodes = members[key]
        first = group_nodes[0]
        allocated = 0
        for node in group_nodes:
            for sid in tensors.storages_of(node.name):
                if tensors.storages[sid].creator == node.name and not tensors.storages[sid].external:
                    allocated += tensors.storages[sid].nbytes
        source = graph.sources.get(first.name)
        storage = None
        shares = 0
        if not collapsed:
            sids = tensors.storages_of(first.name)
            if sids:
                storage = sids[0]
                shares = len(tensors.storages[storage].members) - 1
        groups.append(
            GraphGroup(
                key=key,
                label=first.name if not collapsed else packet_name(first) or first.name,
                op=packet_name(first) or str(first.target),
                source=str(source) if source else None,
                phase=graph.phases[first.name].value,
                count=len(group_nodes),
                nbytes=allocated,
                storage=storage,
                shares_with=shares,
                module=graph.modules.get(first.name),
            )
        )
    edges = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.name in keys and keys[arg.name] != keys[node.name]:
                edges.add((index[keys[arg.name]], index[keys[node.name]]))
    return GraphView(tuple(groups), tuple(sorted(edges)), collapsed, len(nodes))


def _pass_rows(records: Sequence) -> tuple[PassRow, ...]:
    return tuple(
        PassRow(
            name=r.name, changed=r.changed, peak_before=r.peak_before, peak_after=r.peak_after,
            bytes_saved=r.peak_before - r.peak_after, recompute_added=r.stats.recompute_added,
            nodes_rewritten=r.stats.nodes_rewritten, seconds=r.seconds, notes=r.notes, rolled_back=r.rolled_back,
        )
        for r in records
    )


def build_report(
    before: CapturedGraph,
    after: CapturedGraph | None = None,
    *,
    records: Sequence = (),
    title: str = "memplan report",
    parameter_bytes: int = 0,
    max_graph_nodes: int = 400,
) -> MemoryReport:
    """Build a report of ``before`` (the model as written) and, when given, ``after`` (the plan)."""
    from memplan import __version__

    return MemoryReport(
        title=title,
        training=before.training,
        parameter_bytes=parameter_bytes,
        before=_timeline(before, "as written (eager)", parameter_bytes),
        after=_timeline(after, "memplan plan", parameter_bytes) if after is not None else None,
        graph=_graph_view(after if after is not None else before, max_graph_nodes),
        passes=_pass_rows(records),
        explain_before=explain_peak(before),
        explain_after=explain_peak(after) if after is not None else None,
        device=str(graph_device(before)),
        torch_version=torch.__version__,
        memplan_version=__version__,
        created=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
    )


