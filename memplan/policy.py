"""The budget/overhead policy: which candidate plan to run.

A pass may produce several candidate plans (e.g. save more, recompute less). The policy picks:

- with a ``budget`` (bytes, or a fraction of the model's own predicted peak: see :func:`parse_budget`):
  the candidate with the least extra compute whose predicted peak fits the budget,
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

__all__ = ["Policy", "Candidate", "pareto_front", "parse_bytes", "parse_budget"]

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


def parse_budget(value: int | float | str) -> int | float:
    """A budget as memplan reads it: bytes (an int), or a fraction of the eager peak (a float in (0, 1]).

    An int, a float that is a whole number above 1, or a string with a byte unit (``"64MiB"``,
    ``"1.5GB"``, ``"4096"``) is bytes; a float in (0, 1] or a percentage (``"30%"``) is a fraction of the
    predicted peak of the model as written, the convention of
    ``torch._functorch.config.activation_memory_budget``. Anything else is an error that says so: zero
    or a negative budget, a bool, a float above 1 that is not a whole number of bytes, a percentage
    outside (0, 100], an unknown unit.

    Examples
    --------
    >>> parse_budget("64MiB"), parse_budget(4096), parse_budget(0.3), parse_budget("30%"), parse_budget(2e9)
    (67108864, 4096, 0.3, 0.3, 2000000000)
    """
    if isinstance(value, bool):
        raise TypeError("a budget cannot be a bool: give bytes (e.g. '2GiB', 2**31) or a fraction of eager's peak (0.5, '50%')")
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"cannot read {value!r} as a percentage of eager's peak; write e.g. '30%'") from None
        if not 0 < percent <= 100:
            raise ValueError(f"a budget of {value!r} is not a share of eager's peak: give a percentage in (0, 100]")
        return percent / 100
    if isinstance(value, float):
        if not value > 0:  # NaN too
            raise ValueError(f"a budget must be positive, not {value}")
        if value <= 1:
            return value
        if value != int(value):
            raise ValueError(f"a budget of {value} is neither a fraction of eager's peak (in (0, 1]) nor a whole "
                             "number of bytes; write e.g. 0.5, '50%', '1.5GiB' or 1610612736")
        return int(value)
    if isinstance(value, int) and value <= 0:
        raise ValueError(f"a budget must be positive, not {value} bytes")
    budget = parse_bytes(value)
    if budget <= 0:
        raise ValueError(f"a budget must be positive, not {value!r}")
    return budget


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
    # a budget given as a fraction of the eager peak (see parse_budget), until the pipeline, which knows
    # that peak, makes it bytes (``budget`` is None meanwhile)
    fraction: float | None = None

    def __post_init__(self) -> None:
        if self.when_over not in ("raise", "overhead", "lowest"):
            raise ValueError(f"when_over must be 'raise', 'overhead' or 'lowest', not {self.when_over!r}")
        if self.budget is not None:
            budget = parse_budget(self.budget)
            if isinstance(budget, float):
                object.__setattr__(self, "budget", None)
                object.__setattr__(self, "fraction", budget)
            else:
                object.__setattr__(self, "budget", budget)
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

    def in_bytes(self, eager_peak: int) -> "Policy":
        """This policy with a fractional budget made bytes of ``eager_peak`` (itself when it has none)."""
        if self.fraction is None:
            return self
        return dataclasses.replace(self, budget=max(1, int(self.fraction * eager_peak)), fraction=None)

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


def pareto_front(candidates: Sequence[Candidate[T]]) -> list[Candidate[T]]:
    """Drop candidates that another beats on both peak and overhead (ties kept: the policy breaks them)."""
    kept = []
    for c in candidates:
        dominated = any(
            (o.peak <= c.peak and o.overhead <= c.overhead) and (o.peak < c.peak or o.overhead < c.overhead)
            for o in candidates
        )
        if not dominated:
            kept.append(c)
    return kept
