"""memplan across processes: a check that every rank runs the same plans.

Under DDP and FSDP2 every rank plans its own copy of a module on its first call of each input signature.
Plans are deterministic (the same graph, options and rates give the same plan), but ranks can still differ:
another budget or option on one rank, another batch shape (a last batch that does not divide evenly), other
calibrated rates (``rates="calibrated"`` measured on machines that differ), another version of memplan or
torch. Different plans compute the same values, but not with the same memory or time, and a rank that runs
out of memory stalls every other one in its next collective. :func:`check_plans` compares the plans of every
rank and fails loudly on every rank when they differ.

    model = DDP(memplan.optimize(model))
    model(batch).sum().backward()            # the first step plans
    memplan.distributed.check_plans(model)   # collective: every rank calls it

The check is a collective (``all_gather_object`` over ``group``): every rank must call it, at the same point.
Nothing in memplan calls it by itself, so planning never waits on another rank.

Examples
--------
>>> import torch, memplan
>>> opt = memplan.optimize(torch.nn.Linear(4, 2))
>>> _ = opt(torch.randn(3, 4))
>>> [path for path, _ in plan_digests(torch.nn.Sequential(opt)).items()]
['0']
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from memplan.errors import MemplanError

__all__ = ["PlanMismatchError", "plan_digests", "check_plans"]


class PlanMismatchError(MemplanError, RuntimeError):
    """Ranks of a process group hold different memplan plans (see :func:`check_plans`)."""


def _digest(plan: Any) -> str:
    """A short digest of what a plan runs: its pipeline, predicted peak, pass notes and generated code."""
    parts = [plan.pipeline, str(plan.planned_peak), repr([(r.name, r.notes) for r in plan.records]), plan.code]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def plan_digests(module: torch.nn.Module) -> dict[str, list[tuple[str, str]]]:
    """Per memplan-optimized module in ``module`` (its path; ``""`` for ``module`` itself), the plans it holds
    as ``(signature, digest)`` pairs, in the order they were made (modules not called yet hold none)."""
    from memplan.api import OptimizedModule

    found = {}
    for path, sub in module.named_modules(remove_duplicate=True):
        if isinstance(sub, OptimizedModule):
            found[path] = [(repr(signature), _digest(plan)) for signature, plan in sub._plans.items()
                           if plan is not None]
    return found


def check_plans(module: torch.nn.Module, group: Any = None) -> None:
    """Raise :class:`PlanMismatchError` on every rank of ``group`` (the default group when None) when its ranks
    hold different plans for any memplan-optimized module in ``module``; a collective, as
    ``torch.distributed.all_gather_object``. Without an initialised process group there is nothing to compare.

    Raises
    ------
    PlanMismatchError
        Naming the module, the ranks that differ and how (which signatures each planned, or which plans
        differ), and the fix.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = plan_digests(module)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    problems = []
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for path in sorted(set(reference) | set(theirs)):
            name = path or "the module"
            ours, other = dict(reference.get(path, [])), dict(theirs.get(path, []))
            if path not in reference or path not in theirs:
                problems.append(f"{name} is memplan-optimized on rank {0 if path in reference else rank} only")
            elif set(ours) != set(other):
                problems.append(f"{name}: rank 0 planned {len(ours)} input signature(s), rank {rank} {len(other)}, "
                                f"not the same ones (rank 0 only: {sorted(set(ours) - set(other))[:2]}; rank {rank} "
                                f"only: {sorted(set(other) - set(ours))[:2]})")
            else:
                differ = [s for s in ours if ours[s] != other[s]]
                if differ:
                    problems.append(f"{name}: rank 0 and rank {rank} made different plans for {differ[0]}")
    if problems:
        raise PlanMismatchError(
            "memplan's plans differ between ranks: " + "; ".join(problems[:4])
            + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
            + ". Fix: give every rank the same memplan.optimize arguments (budget, max_overhead, passes, options) "
            "and rates (the reference rates, not rates='calibrated' on machines that differ), and inputs of the same "
            "shapes (drop or pad a last batch that does not divide evenly).")
