"""``memplan.analyze``: where memory goes in a model, predicted before anything big runs.

The result bundles the captured graph with its analyses (tensors, liveness, saved-for-backward and the
simulated timeline) and explains the peak (:mod:`memplan.analysis.explain`): what is alive there by kind,
layer and line, what would lower it, and the tensors alive there, largest first, each with the op that
made it, the user's source line, and why it is still alive. It
sits above the analyses and the report, as :mod:`memplan.api` does, since it hands out both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memplan.analysis.allocator import AllocatorModel, allocator_for
from memplan.analysis.autograd import SavedForBackward
from memplan.analysis.explain import Explanation, explain_peak
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation, SimEvent
from memplan.analysis.tensors import Tensors, parameter_bytes
from memplan.capture import CapturedGraph, Phase, capture, is_compiled, on_target
from memplan.graphutil import run_device
from memplan.measure import format_bytes
from memplan.report.data import build_report

__all__ = ["analyze", "MemoryAnalysis"]


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """What :func:`analyze` found: the captured graph, its analyses and the predicted peak."""

    graph: CapturedGraph
    tensors: Tensors
    liveness: Liveness
    saved: SavedForBackward
    simulation: PeakSimulation
    #: Whether ``model`` was a module ``torch.compile`` wrapped (see :func:`analyze`).
    compiled: bool = False

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

    @property
    def device(self) -> torch.device:
        """The device the prediction is for (where the graph's tensors are, or will be: see
        :attr:`memplan.capture.CapturedGraph.target_device`)."""
        return run_device(self.graph)

    @property
    def allocator(self) -> AllocatorModel:
        """How the device's allocator charges each allocation (:mod:`memplan.analysis.allocator`)."""
        return allocator_for(self.device)

    @property
    def resident(self) -> int:
        """Bytes that exist before the call, as the device's allocator holds them: the parameters, buffers
        and tensor inputs the graph reads (not the gradients of the outputs a graph seeded with tangents
        takes: a step makes those)."""
        storages = {sid for spec in self.graph.inputs if spec.kind in ("parameter", "buffer", "input")
                    for sid in self.tensors.storages_of(spec.node)}
        return sum(self.tensors.storages[sid].nbytes for sid in storages)

    @property
    def workspace(self) -> int:
        """Bytes of library workspaces the device keeps once the call has run: on CUDA, a cuBLAS workspace
        for the forward's thread and one for the backward's (autograd's), each where it multiplies
        matrices (:mod:`memplan.analysis.allocator`); none on the CPU. A process's first call allocates
        them; they are not part of :attr:`peak`."""
        threads: dict[Phase, set[str]] = {Phase.FORWARD: set(), Phase.BACKWARD: set()}
        for node in self.graph.gm.graph.nodes:
            if node.op == "call_function" and hasattr(node.target, "overloadpacket"):
                threads[self.graph.phases.get(node.name, Phase.FORWARD)].add(node.target.overloadpacket.__name__)
        return self.allocator.workspace(*threads.values())

    @classmethod
    def from_graph(cls, graph: CapturedGraph, am: AnalysisManager | None = None) -> "MemoryAnalysis":
        """The analysis of ``graph`` (whose values should be where they run: see :func:`memplan.capture.on_target`)."""
        am = am or AnalysisManager(graph)
        return cls(graph, am.get(Tensors), am.get(Liveness), am.get(SavedForBackward), am.get(PeakSimulation))

    def __repr__(self) -> str:
        mode = "training" if self.graph.training else "inference"
        n = sum(1 for _ in self.graph.gm.graph.nodes)
        device = self.device
        on = "" if device.type == "cpu" else f" on {device}"
        compiled = ", the program torch.compile runs, op by op" if self.compiled else ""
        return (
            f"MemoryAnalysis({mode}, {n} nodes, predicted peak {format_bytes(self.peak)}{on}, "
            f"saved for backward {format_bytes(self.saved.nbytes)}{compiled})"
        )

    def report(self, title: str = "memplan analysis"):
        """The memory report of the model as written; ``.save_html(path)`` writes it."""
        return build_report(self.graph, title=title, parameter_bytes=parameter_bytes(self.graph))

    def to_snapshot(self) -> dict:
        """The predicted timeline as the dictionary ``torch.cuda.memory._snapshot()`` returns, for
        PyTorch's memory visualizer (see :mod:`memplan.report.snapshot`); no CUDA needed."""
        from memplan.report.snapshot import to_snapshot

        return to_snapshot(self.graph, self._analyses(), label="eager")

    def save_snapshot(self, path: str) -> str:
        """Pickle :meth:`to_snapshot` to ``path``; open it at https://pytorch.org/memory_viz. Returns the path."""
        from memplan.report.snapshot import save_snapshot

        return save_snapshot(self.to_snapshot(), path)

    def _analyses(self) -> AnalysisManager:
        known = {Tensors: self.tensors, Liveness: self.liveness, SavedForBackward: self.saved,
                 PeakSimulation: self.simulation}
        return AnalysisManager(self.graph, known)

    def explain(self, top: int = 10) -> Explanation:
        """What is alive at the peak: summed by kind, by layer (module path) and by source line, a one-line
        diagnosis of what would lower it, then the ``top`` largest tensors with why each is alive."""
        explanation = explain_peak(self.graph, self._analyses(), top)
        if not self.compiled:
            return explanation
        note = (_COMPILED_NOTE if explanation.diagnosis is None else f"{explanation.diagnosis} {_COMPILED_NOTE}")
        return dataclasses.replace(explanation, diagnosis=note)


# What an analysis of a compiled module says of itself (see analyze).
_COMPILED_NOTE = (
    "(torch.compile: this is the model's program run op by op; Dynamo's graphs run the same ops, and the "
    "compiler's fused kernels hold fewer temporaries inside each graph, while its partitioner may keep "
    "other tensors for the backward. Compiled with memplan.compile.backend(), each graph's plan predicts "
    "its own peak to the byte: backend.plans[i].report().)"
)


def analyze(
    model: nn.Module | Callable[..., Any], *inputs: Any, train: bool | None = None,
    device: torch.device | str | None = None, **kwargs: Any
) -> MemoryAnalysis:
    """Predict where memory goes in one call of ``model(*inputs)``, without running it for real.

    Training mode (the default when something requires grad) covers forward and the backward of
    ``sum(out.sum())``, exactly ``model(*inputs).sum().backward()``.

    ``device``: predict for this device (``"cuda"``) wherever the model and inputs are, on a machine without
    a GPU too: the graph's tensors are fake ones on that device, and on CUDA every allocation is charged
    as PyTorch's caching allocator charges it (:mod:`memplan.analysis.allocator`); see
    :mod:`memplan._capture.target` for what a CPU-only build plans as CUDA runs it and what it refuses.
    None: the device the tensors are on. (A model's own keyword argument named ``device`` cannot be passed
    through ``analyze``: bind it first, with ``functools.partial``.)

    Examples
    --------
    >>> import torch
    >>> a = analyze(torch.nn.Linear(256, 256), torch.randn(64, 256), train=False)
    >>> a.peak  # the (64, 256) float32 output
    65536
    >>> # for CUDA, on any machine: the 3000-byte output in 512-byte blocks
    >>> analyze(torch.nn.Linear(256, 250), torch.randn(3, 256), train=False, device="cuda").peak
    3072

    A module ``torch.compile`` wrapped is analysed through the module it wraps: the ops Dynamo's graphs run,
    op by op (``.compiled`` is True, and :meth:`MemoryAnalysis.explain` says what the compiler changes).
    """
    compiled = is_compiled(model)
    if compiled:  # the program torch.compile runs is the module's own: memplan traces that
        model = model._orig_mod
    analysis = MemoryAnalysis.from_graph(on_target(capture(model, *inputs, train=train, target_device=device, **kwargs)))
    return dataclasses.replace(analysis, compiled=True) if compiled else analysis
