"""Simulated memory timeline: the peak a graph reaches when run eagerly in its current order.

The numbers are the base timeline of :class:`~memplan.analysis.memory_model.MemoryModel` (the one
memory model, which also prices what-ifs for the passes); this analysis adds the per-node events and
the storages alive at the peak, for reports.

Stages
------
(1) Walk nodes in ``Liveness.order``. At a node, every storage it creates is allocated (bytes of the
    whole storage); the live total after that is the node's event and a candidate for the peak.
(2) Then every storage whose interval ends at this node is freed.
(3) External storages (inputs, parameters, constants) were there before and are never counted;
    storages aliased by outputs stay until the end.

This is the model the ruler measures on CPU (bytes of storages allocated by dispatched ops), so the
simulated peak of an eagerly-run graph should agree with :func:`memplan.measure` on it. On CUDA each
storage is charged as the caching allocator charges it (:mod:`memplan.analysis.allocator`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np
import torch

from memplan.analysis.allocator import allocator_for
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import Analysis, AnalysisManager
from memplan.analysis.memory_model import MemoryModel
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph

__all__ = ["SimEvent", "PeakSimulation", "step_margin"]


class SimEvent(NamedTuple):
    """One node of the simulated run: bytes it allocated, bytes freed after it, bytes live with its outputs.

    A named tuple: one per node, made at every change of the graph (cheaper to build than a dataclass).
    """

    index: int
    node: str
    op: str
    allocated: int
    freed: int
    live: int


@dataclasses.dataclass(frozen=True)
class PeakSimulation(Analysis):
    """The simulated timeline and its peak.

    ``peak``, ``peak_index``, ``after``, ``born`` and ``dies`` are the base timeline of the graph's
    :class:`~memplan.analysis.memory_model.MemoryModel` (the pipeline asks for them after every pass);
    the per-node ``timeline`` and ``live_at_peak`` are built when first read.
    """

    name = "peak"
    peak: int
    peak_index: int  # -1 when nothing is allocated
    after: int  # bytes still live at the end (outputs, gradients)
    graph: CapturedGraph = dataclasses.field(repr=False, compare=False)
    tensors: Tensors = dataclasses.field(repr=False, compare=False)
    liveness: Liveness = dataclasses.field(repr=False, compare=False)
    born: np.ndarray = dataclasses.field(repr=False, compare=False)  # bytes allocated at each position
    dies: np.ndarray = dataclasses.field(repr=False, compare=False)  # bytes freed after each position

    @classmethod
    def compute(cls, graph: CapturedGraph, am: AnalysisManager) -> "PeakSimulation":
        model = am.get(MemoryModel)
        return cls(peak=model.peak, peak_index=model.peak_index, after=model.after, graph=graph,
                   tensors=model.tensors, liveness=model.liveness, born=model.born, dies=model.dies)

    @functools.cached_property
    def timeline(self) -> tuple[SimEvent, ...]:
        """One event per node of ``Liveness.order``."""
        by_name = {n.name: n for n in self.graph.gm.graph.nodes}
        op_names: dict[int, str] = {}  # id of a target -> its name (an operator's str() costs microseconds)
        events = []
        live_bytes = 0
        steps = zip(self.liveness.order, self.born.tolist(), self.dies.tolist())
        for index, (name, allocated, freed) in enumerate(steps):
            live_bytes += allocated
            target = by_name[name].target
            op = op_names.get(id(target))
            if op is None:
                op = op_names[id(target)] = str(target)
            events.append(SimEvent(index, name, op, allocated, freed, live_bytes))
            live_bytes -= freed
        return tuple(events)

    @functools.cached_property
    def live_at_peak(self) -> tuple[int, ...]:
        """Storage ids live at the peak (born at or before it, dying at or after it), largest first then by id."""
        if self.peak_index < 0:
            return ()
        storages, intervals, at = self.tensors.storages, self.liveness.intervals, self.peak_index
        return tuple(sorted(
            (sid for sid, storage in storages.items()
             if not storage.external and intervals[sid].start <= at <= intervals[sid].end),
            key=lambda s: (-storages[s].nbytes, s),
        ))


def step_margin(graph: CapturedGraph) -> int:
    """Bytes a training step allocates outside the captured graph: its loss and the loss's gradient.

    The graph takes the gradients of its outputs as inputs (tangents). A step such as
    ``memplan.steps.step_fn`` (``sum(out.sum()).backward()``) also allocates, during the call, each
    output's ``sum`` and the seed gradient that ``backward`` expands to the output's shape (one element
    each). Budgets are bytes allocated during a step as ``memplan.measure`` reports them, so candidates
    are compared with the budget including these. A user whose loss allocates more (a cross-entropy
    over the outputs outside the model) should leave that much room in the budget: its gradients of the
    outputs are dense, and where the backward reshapes one, a dense gradient is copied where a sum's
    broadcast one is viewed (each such copy is at most an output's size). Each scalar is charged as its
    device's allocator charges it (:mod:`memplan.analysis.allocator`: 512 bytes on CUDA).

    Examples
    --------
    >>> import torch, dataclasses
    >>> from memplan.capture import capture
    >>> step_margin(capture(torch.nn.Linear(4, 4), torch.randn(2, 4), seed="tangents"))
    8
    """
    margin = 0
    for spec in graph.inputs:
        if spec.kind == "tangent":
            value = graph.node(spec.node).meta.get("val")
            if isinstance(value, torch.Tensor):
                margin += 2 * allocator_for(value.device, graph.target_device).charge(value.element_size())
    return margin
