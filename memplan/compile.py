"""memplan as a ``torch.compile`` backend: ``torch.compile(model, backend="memplan")``.

Dynamo turns the model's Python into FX graphs (one per stretch of code between graph breaks) and hands each
one to its backend with example inputs. memplan's backend plans each graph as :func:`memplan.optimize` plans a
model, with the same planner and the same policy (captured forward and backward, the pipeline, the budget
and the time allowance), and returns the planned module, which Dynamo calls in the graph's place; the
backward of each graph is the plan's own. Parameters reach a graph as its inputs (Dynamo lifts them) or as
its attributes; either way their gradients are the plan's.

Two spellings:

- ``torch.compile(model, backend="memplan")``: the default plan (``max_overhead=0.3``, no budget). The name
  is registered through the ``torch_dynamo_backends`` entry point of memplan's package metadata, so it
  needs memplan installed (``pip install``), not only on the path; :func:`backend` needs neither.
- ``torch.compile(model, backend=memplan.compile.backend(budget="2GiB", max_overhead=0.5))``: the
  arguments of :func:`memplan.optimize`. The object keeps the planned module of every graph it compiled
  (:attr:`MemplanBackend.modules`), whose ``.plan`` says what memplan did to that graph and predicts its
  peak (``plan.report()``, ``plan.planned_peak``).

- ``memplan.compile.backend(inductor=True)``: the same plans, whose forward and backward Inductor compiles
  (fused kernels; :mod:`memplan.inductor`). Without it they run as memplan's emitted code, op by op, as
  ``memplan.optimize`` runs them.

What it does not do (yet): share a plan between graphs; plan
for symbolic shapes: a graph Dynamo made dynamic is planned once per concrete shape it is called with
(up to :data:`memplan.api.MAX_PLANS` of them kept).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from memplan.analysis.cost import CostRates

__all__ = ["MemplanBackend", "backend", "memplan_backend"]


class MemplanBackend:
    """A ``torch.compile`` backend that plans each graph Dynamo hands it with :func:`memplan.optimize`.

    Made by :func:`backend`; its arguments are :func:`memplan.optimize`'s.

    Attributes
    ----------
    modules : list of memplan.OptimizedModule
        The planned module of each graph compiled so far, in the order Dynamo compiled them (a graph break
        makes two; a recompilation, for another shape or another guard, one more). Each module's ``plan``
        is the plan of its latest call.
    """

    def __init__(self, *, budget: int | str | None = None, max_overhead: float = 0.3, passes: str | Sequence[str] | None = None,
                 options: Mapping[str, Any] | None = None, verify: bool = False,
                 rates: CostRates | str | None = None, inductor: bool = False, keep: bool = True) -> None:
        from memplan.api import optimize
        from memplan.pipeline import check_options, parse_pipeline

        if passes is not None:  # a bad pipeline is refused here, not at the first compiled call
            names = parse_pipeline(passes)
            if inductor:
                from memplan.inductor import refuse_pipeline

                refuse_pipeline(names)
        check_options(dict(options or {}))
        self._optimize = optimize
        self.settings = {"budget": budget, "max_overhead": max_overhead, "passes": passes,
                         "options": dict(options or {}), "verify": verify, "rates": rates, "inductor": inductor}
        self.keep = keep
        self.modules: list[torch.nn.Module] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Plan ``gm`` (Dynamo's graph; ``example_inputs`` are not used: memplan plans each call's shapes on
        that call, as :func:`memplan.optimize` does) and return the planned module that runs in its place."""
        planned = self._optimize(gm, **self.settings)
        if self.keep:
            self.modules.append(planned)
        return planned

    @property
    def plans(self) -> list[Any]:
        """The latest plan of each compiled graph (None for a graph not yet called)."""
        return [module.plan for module in self.modules]

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.settings.items() if v not in (None, {}, False))
        return f"memplan.compile.backend({shown})"


def backend(*, budget: int | str | None = None, max_overhead: float = 0.3, passes: str | Sequence[str] | None = None,
            options: Mapping[str, Any] | None = None, verify: bool = False,
            rates: CostRates | str | None = None, inductor: bool = False) -> MemplanBackend:
    """A ``torch.compile`` backend planning with these arguments of :func:`memplan.optimize`.

    With ``inductor=True`` each graph's planned forward and backward are compiled by Inductor (fused
    kernels) instead of running as memplan's op-by-op code (see :mod:`memplan.inductor`).

    Examples
    --------
    >>> import torch, memplan.compile
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    >>> planner = memplan.compile.backend(max_overhead=0.5)
    >>> compiled = torch.compile(model, backend=planner)
    >>> x = torch.randn(4, 8)
    >>> torch.allclose(compiled(x), model(x))
    True
    >>> len(planner.modules), planner.plans[0].training
    (1, True)
    """
    return MemplanBackend(budget=budget, max_overhead=max_overhead, passes=passes, options=options,
                          verify=verify, rates=rates, inductor=inductor)


def memplan_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The backend named ``"memplan"`` (``torch.compile(model, backend="memplan")``): the default plan of
    each graph. It keeps nothing between compilations; :func:`backend` makes one that does."""
    return MemplanBackend(keep=False)(gm, example_inputs)
