"""Does a step fit on a device? Predicted from a capture, never run: a GPU's question, asked from a laptop.

:func:`fit` captures one step of a model for a device (``"cuda"`` on a machine without a GPU: see
:mod:`memplan._capture.target`) and compares with the device's capacity what the step needs there:

    resident (parameters, buffers and inputs, as the allocator holds them)
    + the step's predicted peak (bytes allocated during the step, as the allocator charges them)
    + library workspaces the device keeps (on CUDA, a cuBLAS workspace per thread that multiplies matrices)

for three plans: the model as written (eager), memplan's default plan (``memplan.optimize(model)``), and
the smallest plan memplan reaches (the lowest rung of the budget ladder,
:meth:`memplan.pipeline.PassManager.ladder`). Peaks are step peaks as budgets count them: a training step
includes the loss scalars ``out.sum().backward()`` allocates (:func:`memplan.analysis.peak.step_margin`).

:func:`largest_batch` searches the batch size of a factory ``make(batch=b) -> (model, inputs)``: doubling
from 1, then bisecting, each probe a capture (and for memplan a budgeted pipeline run, which stops at the
first rung that fits), nothing run. It assumes a step's needs grow with the batch.

What is not counted (leave room for it in the capacity): the optimizer's state (Adam keeps two tensors
per parameter), gradients kept from an earlier step, the CUDA context and what else lives outside the
caching allocator, and fragmentation (see :mod:`memplan.analysis.allocator`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation, step_margin
from memplan.analysis.tensors import Tensors
from memplan.analyze import MemoryAnalysis
from memplan.capture import CapturedGraph, capture
from memplan.errors import InfeasibleBudgetError
from memplan.graphutil import copy_graph
from memplan.measure import format_bytes
from memplan.policy import Policy, parse_bytes

__all__ = ["FitReport", "Needs", "BatchSearch", "fit", "largest_batch", "capture_step", "needs_of"]

#: The largest batch :func:`largest_batch` tries: a step whose needs do not grow with the batch fits at any.
MAX_BATCH = 1 << 20


@dataclasses.dataclass(frozen=True)
class Needs:
    """What one captured step needs on its device, and the plans' step peaks (None: not planned)."""

    device: str
    allocator: str
    training: bool
    resident: int
    workspace: int
    eager: int
    default: int | None = None
    smallest: int | None = None


@dataclasses.dataclass(frozen=True)
class BatchSearch:
    """The largest batch that fits, for eager and for memplan's smallest plan (None: not even batch 1;
    ``at_least``: every batch up to :data:`MAX_BATCH` fits), and the batches probed."""

    eager: int | None
    memplan: int | None
    probes: int
    at_least: bool = False


@dataclasses.dataclass(frozen=True)
class FitReport:
    """The answer of :func:`fit`: the step's needs on the device against its capacity.

    ``total(peak)`` is what the device must hold at a plan's peak; ``fits(peak)`` compares it with the
    capacity. Rendered by :meth:`lines` (text) and :meth:`as_dict` (JSON).
    """

    needs: Needs
    capacity: int
    torch_version: str
    predicted_on: str
    batch: BatchSearch | None = None

    def total(self, peak: int | None) -> int | None:
        return None if peak is None else self.needs.resident + self.needs.workspace + peak

    def fits(self, peak: int | None) -> bool | None:
        total = self.total(peak)
        return None if total is None else total <= self.capacity

    def lines(self) -> list[str]:
        n = self.needs
        out = [
            f"prediction for {n.device} ({'training step' if n.training else 'inference'}), made {self.predicted_on} "
            f"with torch {self.torch_version}; allocator model: {n.allocator}",
            f"capacity {format_bytes(self.capacity)}; resident before the step (parameters, buffers, inputs) "
            f"{format_bytes(n.resident)}; cuBLAS workspace {format_bytes(n.workspace)}",
        ]
        for label, peak in (("eager (as written)", n.eager), ("memplan default plan", n.default),
                            ("memplan smallest plan", n.smallest)):
            if peak is None:
                continue
            verdict = "fits" if self.fits(peak) else "does not fit"
            total = format_bytes(self.total(peak))
            out.append(f"  {label:22s} peak {format_bytes(peak):>10s}  total {total:>10s}  {verdict}")
        if self.batch is not None:
            b = self.batch
            more = "+" if b.at_least else ""
            eager = f"{b.eager}{more}" if b.eager is not None else "none"
            planned = f"{b.memplan}{more}" if b.memplan is not None else "none"
            out.append(f"  largest batch that fits: eager {eager}, memplan {planned} "
                       f"({b.probes} captures, nothing run)")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def as_dict(self) -> dict[str, Any]:
        n = self.needs
        plans = {}
        for label, peak in (("eager", n.eager), ("default", n.default), ("smallest", n.smallest)):
            if peak is not None:
                plans[label] = {"peak": peak, "total": self.total(peak), "fits": self.fits(peak)}
        payload: dict[str, Any] = {
            "prediction": True, "device": n.device, "predicted_on": self.predicted_on,
            "torch": self.torch_version, "allocator": n.allocator, "training": n.training,
            "capacity": self.capacity, "resident": n.resident, "workspace": n.workspace, "plans": plans,
        }
        if self.batch is not None:
            payload["largest_batch"] = dataclasses.asdict(self.batch)
        return payload


def _predicted_on() -> str:
    """Where the prediction is made, for its label: ``"without a GPU (a CPU-only build of torch)"``..."""
    if torch.cuda.is_available():
        return f"on {torch.cuda.get_device_name()}"
    return "without a GPU (a CPU-only build of torch)" if not torch.backends.cuda.is_built() else "without a usable GPU"


def _step_peak(graph: CapturedGraph, am: AnalysisManager) -> int:
    return am.get(PeakSimulation).peak + (step_margin(graph) if graph.training else 0)


def capture_step(model: Any, inputs: Sequence[Any], device: torch.device | str | None, train: bool) -> CapturedGraph:
    """One step of ``model(*inputs)`` captured for ``device``, with the backward seeded by tangents (as
    ``memplan.optimize`` captures it) when training; values left on a stand-in for the passes."""
    return capture(model, *inputs, train=train, seed="tangents" if train else "sum", target_device=device)


def needs_of(graph: CapturedGraph, *, plans: bool = True, passes: Sequence[str] | None = None) -> Needs:
    """What the step ``graph`` needs, and (``plans``) the step peaks of memplan's default and smallest plans."""
    from memplan.api import DEFAULT_PIPELINE
    from memplan.pipeline import PassManager

    am = AnalysisManager(graph)
    eager = _step_peak(graph, am)
    default = smallest = None
    if plans:
        manager = PassManager(DEFAULT_PIPELINE if passes is None else passes, Policy())
        known = {Tensors: am.get(Tensors)}
        result = manager.run(copy_graph(graph), known=known, pristine=graph)
        default = _step_peak(result.graph, result.graph_analyses())
        smallest = min(peak for _, peak in manager.ladder(graph, known))
    analysis = MemoryAnalysis.from_graph(graph, am)
    return Needs(device=str(analysis.device), allocator=analysis.allocator.describe(), training=graph.training,
                 resident=analysis.resident, workspace=analysis.workspace, eager=eager, default=default,
                 smallest=smallest)


def fit(model: Any, *inputs: Any, device: torch.device | str | None = None, capacity: int | str,
        train: bool = True, plans: bool = True, passes: Sequence[str] | None = None) -> FitReport:
    """Whether one step of ``model(*inputs)`` fits in ``capacity`` bytes (``"80GiB"``) of ``device``.

    Examples
    --------
    >>> import torch
    >>> report = fit(torch.nn.Linear(256, 256), torch.randn(64, 256), device="cuda", capacity="1MiB", plans=False)
    >>> report.needs.resident  # weight, bias and input, each in 512-byte blocks
    328704
    >>> report.needs.workspace // 2**20  # a cuBLAS workspace for the forward's thread, one for the backward's
    64
    >>> report.fits(report.needs.eager)
    False
    """
    graph = capture_step(model, inputs, device, train)
    needs = needs_of(graph, plans=plans, passes=passes)
    return FitReport(needs=needs, capacity=parse_bytes(capacity), torch_version=torch.__version__,
                     predicted_on=_predicted_on())


def largest_batch(make: Callable[[int], tuple[Any, Sequence[Any]]], *, device: torch.device | str | None = None,
                  capacity: int | str, train: bool = True, passes: Sequence[str] | None = None,
                  memplan: bool = True) -> BatchSearch:
    """The largest batch ``b`` for which one step of ``make(b) -> (model, inputs)`` fits in ``capacity`` bytes
    of ``device``: as written, and (``memplan``) with memplan's smallest plan. Each probe captures; nothing runs.

    Examples
    --------
    >>> import torch
    >>> make = lambda b: (torch.nn.Linear(512, 512), (torch.randn(b, 512),))
    >>> # inference: 1 MiB + 2 KiB of parameters, 2 KiB of input and 2 KiB of output per row
    >>> largest_batch(make, capacity="2MiB", train=False, memplan=False).eager
    255
    """
    from memplan.api import DEFAULT_PIPELINE
    from memplan.pipeline import PassManager

    limit = parse_bytes(capacity)
    probes = 0

    def probe(batch: int):
        """The step at ``batch``, captured, and what it needs without a plan."""
        nonlocal probes
        probes += 1
        model, inputs = make(batch)
        graph = capture_step(model, inputs, device, train)
        return graph, needs_of(graph, plans=False)

    def eager_fits(batch: int) -> bool:
        _, needs = probe(batch)
        return needs.resident + needs.workspace + needs.eager <= limit

    def planned_fits(batch: int) -> bool:
        graph, needs = probe(batch)
        room = limit - needs.resident - needs.workspace
        if needs.eager <= room:
            return True
        if room <= 0:
            return False
        manager = PassManager(DEFAULT_PIPELINE if passes is None else passes, Policy(budget=room))
        am = AnalysisManager(graph)
        try:
            manager.run(copy_graph(graph), known={Tensors: am.get(Tensors)}, pristine=graph)
        except InfeasibleBudgetError:
            return False
        return True

    eager, at_least = _largest(eager_fits, 1)
    planned = None
    if memplan:
        if at_least:
            planned = eager
        else:
            planned, at_least = _largest(planned_fits, eager or 1, known_fit=eager is not None)
    return BatchSearch(eager=eager, memplan=planned, probes=probes, at_least=at_least)


def _largest(fits: Callable[[int], bool], start: int, known_fit: bool = False) -> tuple[int | None, bool]:
    """The largest ``b >= 1`` with ``fits(b)``, for a monotone ``fits``, searched from ``start`` (known to
    fit when ``known_fit``): doubling, then bisecting. ``(None, False)`` when 1 does not fit; ``(MAX_BATCH,
    True)`` when that fits."""
    low = start if known_fit else None
    if low is None:
        if fits(start):
            low = start
        elif start == 1:
            return None, False
        else:
            return _largest(fits, 1)
    high = None
    while high is None:
        candidate = min(low * 2, MAX_BATCH)
        if candidate == low:
            return low, True
        if fits(candidate):
            low = candidate
        else:
            high = candidate
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, False
