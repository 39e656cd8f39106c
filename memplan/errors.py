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
    "TargetDeviceError",
    "PassRolledBackWarning",
    "VerificationWarning",
    "CompileFallbackWarning",
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
    """A pass failed or broke an invariant; names the pass and the pipeline before it.

    Raised only where failures are asked to raise (``PassManager(on_failure="raise")``, or inside
    :func:`memplan.pipeline.pass_failures` ``("raise")``); elsewhere the pass is rolled back with a
    :class:`PassRolledBackWarning`.
    """


class PassRolledBackWarning(UserWarning):
    """A pass failed, broke an invariant or changed the results, and the plan was made without it.

    The plan is correct (the pass's change is not in it) but may use more memory than it would with
    the pass. ``pass_name``: the pass; ``reason``: what it did wrong; ``source``: the user's line of
    the node involved (None when there is none); ``reproducer``: where its reproducer was saved (None
    when none was), which :func:`memplan.pipeline.replay` runs.
    """

    def __init__(self, message: str, *, pass_name: str = "", reason: str = "", source: str | None = None,
                 reproducer: str | None = None):
        super().__init__(message)
        self.pass_name = pass_name
        self.reason = reason
        self.source = source
        self.reproducer = reproducer


class VerificationWarning(UserWarning):
    """``optimize(..., verify=True)`` skipped its check (the eager copy would not fit in memory), or
    found the plan differing from eager with no pass to blame, and ran that signature eagerly."""


class CompileFallbackWarning(UserWarning):
    """``inductor=True``: Inductor could not compile one of a plan's modules (a functionalization torch
    refuses, an operator it cannot lower), which runs as memplan's own code instead, op by op: the plan's
    values and memory are the same, its kernels are not fused there. ``module``: which module
    (``"forward"``, ``"backward"``, ``"chunk body"``); ``reason``: the compiler's error."""

    def __init__(self, message: str, *, module: str = "", reason: str = ""):
        super().__init__(message)
        self.module = module
        self.reason = reason


class HigherOrderGradientError(MemplanError, RuntimeError):
    """A gradient of a plan's gradients was asked for (``create_graph=True``): a plan computes
    first-order gradients from values it saved without autograd, so their own gradients would miss
    every term through those values."""


class OutputGradientHookError(MemplanError, RuntimeError):
    """A hook or ``retain_grad()`` on an output the model also reads inside: the plan's backward adds
    the gradient of the inside path itself, so the hook would see, and change, only the outside part."""


class AutocastBackwardError(MemplanError, RuntimeError):
    """A plan's backward was called inside an autocast block, where autocast would cast some backward op
    that the plan, traced with the backward outside the block (as torch's mixed precision recipes run
    it), does not: the gradients would not be eager's."""


class TargetDeviceError(MemplanError, RuntimeError):
    """A module planned for another device (``memplan.optimize(model, device="cuda")``) was called with
    tensors elsewhere: its plan's code makes and reads tensors on the device it was planned for, so it
    does not run here (a plan for CUDA, made on a machine without a GPU, is read, not run)."""
