"""memplan's exceptions.

Every error memplan raises derives from :class:`MemplanError`. Messages name the graph node
(when there is one), the user's source line, what was expected and what was found, and a fix.
"""

from __future__ import annotations

__all__ = [
    "MemplanError",
    "CaptureError",
    "UnsupportedInputError",
    "UnsupportedNodeError",
    "InfeasibleBudgetError",
    "PassError",
    "HigherOrderGradientError",
]


class MemplanError(Exception):
    """Base class of all memplan errors."""


class CaptureError(MemplanError):
    """The model could not be captured as a static graph (for example, data-dependent control flow)."""


class UnsupportedInputError(MemplanError, TypeError):
    """An argument memplan cannot plan for (a non-tensor leaf, a sparse tensor, ...)."""


class UnsupportedNodeError(MemplanError):
    """A graph node that a pass or analysis cannot handle."""


class InfeasibleBudgetError(MemplanError):
    """No plan fits the requested memory budget.

    ``smallest`` holds the lowest peak (bytes) memplan can reach, ``holders`` what keeps it there.
    """

    def __init__(self, message: str, *, smallest: int | None = None, holders: tuple[str, ...] = ()):
        super().__init__(message)
        self.smallest = smallest
        self.holders = holders


class PassError(MemplanError):
    """A pass failed or broke an invariant; names the pass and the pipeline before it."""


class HigherOrderGradientError(MemplanError, RuntimeError):
    """A gradient of a plan's gradients was asked for (``create_graph=True``): a plan computes
    first-order gradients from values it saved without autograd, so their own gradients would miss
    every term through those values."""


class OutputGradientHookError(MemplanError, RuntimeError):
    """A hook or ``retain_grad()`` on an output the model also reads inside: the plan's backward adds
    the gradient of the inside path itself, so the hook would see, and change, only the outside part."""
