"""The analysis manager: computes analyses on demand and caches them per graph version.

Analyses are read-only results of a :class:`~memplan.capture.CapturedGraph`, keyed by node name.
A pass reports which analyses it preserved; the manager drops the rest and bumps the graph version
once per changed pass (never per mutation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from memplan.capture import CapturedGraph

__all__ = ["Analysis", "AnalysisManager"]

A = TypeVar("A", bound="Analysis")


class Analysis:
    """Base class of analyses: ``compute(graph, am)`` returns a frozen result.

    Subclasses are frozen dataclasses and implement :meth:`compute`.
    """

    name: ClassVar[str] = "analysis"

    @classmethod
    def compute(cls: type[A], graph: CapturedGraph, am: "AnalysisManager") -> A:  # pragma: no cover - abstract
        raise NotImplementedError(f"{cls.__name__}.compute is not implemented")


class AnalysisManager:
    """Cache of analyses over one captured graph.

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> from memplan.analysis.tensors import Tensors
    >>> am = AnalysisManager(capture(torch.nn.Linear(4, 2), torch.randn(3, 4)))
    >>> am.get(Tensors) is am.get(Tensors)
    True
    """

    def __init__(self, graph: CapturedGraph, known: "Mapping[type, Analysis] | None" = None):
        """``known``: analyses of ``graph`` the caller already has (those of a copy with the same nodes,
        order and fake values, which are equal), taken as computed."""
        self.graph = graph
        self.version = 0
        self._cache: dict[tuple[type, int], Any] = {(cls, 0): value for cls, value in (known or {}).items()}

    def get(self, analysis: type[A]) -> A:
        key = (analysis, self.version)
        if key not in self._cache:
            self._cache[key] = analysis.compute(self.graph, self)
        return self._cache[key]

    def update(self, graph: CapturedGraph, preserved: frozenset[type] = frozenset(),
               computed: "AnalysisManager | None" = None) -> None:
        """Point the manager at a changed graph, keeping only the ``preserved`` analyses.

        ``computed`` is a manager that already analysed ``graph`` itself (a pass that measured its own
        result): its analyses are taken over instead of being computed again.
        """
        kept = {cls: value for (cls, version), value in self._cache.items() if version == self.version and cls in preserved}
        if computed is not None and computed.graph is graph:
            kept.update((cls, value) for (cls, version), value in computed._cache.items() if version == computed.version)
        self.graph = graph
        self.version += 1
        self._cache = {(cls, self.version): value for cls, value in kept.items()}
