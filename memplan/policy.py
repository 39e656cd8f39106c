"""The budget/overhead policy: which candidate plan to run.

A pass may produce several candidate plans (e.g. save more, recompute less). The policy picks:

- with a ``budget``: the candidate with the least extra compute whose predicted peak fits the budget,
  ties broken by lower peak; if none fits, what ``when_over`` says: ``"raise"``
  :class:`~memplan.errors.InfeasibleBudgetError` naming the smallest reachable peak, ``"overhead"`` choose
  as without a budget, ``"lowest"`` the lowest peak whatever it costs. A pipeline given a budget runs
  the first plan of a budget-independent ladder that fits it (see
  :meth:`~memplan.pipeline.PassManager.ladder`), and raises only when no rung does;
- without one: the lowest predicted peak whose extra compute is at most ``max_overhead`` (a fraction of
  the original compute), ties broken by less overhead.

Policies are frozen and hashable, so they can key caches.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Generic, TypeVar

from memplan.errors import InfeasibleBudgetError
from memplan.measure import format_bytes

__all__ = ["Policy", "Candidate", "parse_bytes"]

T = TypeVar("T")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """``"2GiB"`` -> 2147483648; ints pass through.

    Examples
    --------
    >>> parse_bytes("64MiB"), parse_bytes("1.5 kB"), parse_bytes(4096)
    (67108864, 1500, 4096)
    """
    if isinstance(value, bool):
        raise TypeError("a byte count cannot be a bool")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a byte count cannot be negative: {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as bytes; write e.g. 512MiB, 2GiB, 1.5GB or an int")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclasses.dataclass(frozen=True)
class Candidate(Generic[T]):
    """A plan with its predicted peak (bytes) and extra compute (fraction of the original)."""

    plan: T
    peak: int
    overhead: float
    label: str = ""


@dataclasses.dataclass(frozen=True)
class Policy:
    """How memplan trades memory for compute.

    Examples
    --------
    >>> p = Policy(max_overhead=0.2)
    >>> p.choose([Candidate("a", 100, 0.0), Candidate("b", 40, 0.1), Candidate("c", 10, 0.5)]).plan
    'b'
    >>> Policy(budget=50).choose([Candidate("a", 100, 0.0), Candidate("b", 40, 0.1), Candidate("c", 10, 0.5)]).plan
    'b'
    """

    budget: int | None = None
    max_overhead: float = 0.3
    when_over: str = "raise"

    def __post_init__(self) -> None:
        if self.when_over not in ("raise", "overhead", "lowest"):
            raise ValueError(f"when_over must be 'raise', 'overhead' or 'lowest', not {self.when_over!r}")
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_bytes(self.budget))
        if isinstance(self.max_overhead, bool) or not isinstance(self.max_overhead, (int, float)):
            raise TypeError(f"max_overhead must be a number (0.3: up to 30% more compute), not "
                            f"{type(self.max_overhead).__name__} {self.max_overhead!r}")
        if not self.max_overhead >= 0:
            raise ValueError(f"max_overhead must be >= 0, not {self.max_overhead}")

    def may_take(self, overhead: float) -> bool:
        """False when :meth:`choose` can never take a candidate of this extra compute, whatever its peak,
        from candidates that include one with no extra compute: without a budget it keeps to
        ``max_overhead``. Such a candidate need not be simulated; nor can it hide one that may be taken
        from a Pareto front, since it costs more than any of those.

        >>> Policy(max_overhead=0.2).may_take(0.3), Policy(budget=50, max_overhead=0.2).may_take(0.3)
        (False, True)
        """
        return self.budget is not None or overhead <= self.max_overhead

    def choose(self, candidates: Sequence[Candidate[T]]) -> Candidate[T]:
        if not candidates:
            raise ValueError("no candidate plans to choose from")
        if self.budget is not None:
            fitting = [c for c in candidates if c.peak <= self.budget]
            if fitting:
                return min(fitting, key=lambda c: (c.overhead, c.peak, c.label))
            if self.when_over == "lowest":
                return min(candidates, key=lambda c: (c.peak, c.overhead, c.label))
            if self.when_over == "raise":
                best = min(candidates, key=lambda c: (c.peak, c.overhead))
                raise InfeasibleBudgetError(
                    f"no plan fits the budget of {format_bytes(self.budget)}: the smallest reachable peak is "
                    f"{format_bytes(best.peak)} ({best.label or 'best plan'}). Fix: raise the budget, lower the "
                    "batch size, or enable more passes.",
                    smallest=best.peak,
                    holders=(best.label,) if best.label else (),
                )
        allowed = [c for c in candidates if c.overhead <= self.max_overhead] or [min(candidates, key=lambda c: c.overhead)]
        return min(allowed, key=lambda c: (c.peak, c.overhead, c.label))
