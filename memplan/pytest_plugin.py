"""pytest plugin: pin the peak memory of a call in a regression test.

Registered through the ``pytest11`` entry point, so installing memplan makes these available:

- ``memplan_peak(fn, *args, max_bytes=...)``: fail if one call's peak exceeds a fixed limit.
- ``memplan_baseline.check(name, fn, *args)``: compare one call's peak with the value recorded in the
  baseline file; fail with a readable diff when it grew beyond the tolerance. Record or refresh the
  file with ``pytest --memplan-update`` (and commit it).

Settings (``pyproject.toml`` ``[tool.pytest.ini_options]``): ``memplan_baseline`` (file path relative to
the rootdir, default ``memplan-baseline.json``) and ``memplan_tolerance`` (default ``0.05``).

Example::

    def test_model_peak(memplan_baseline):
        memplan_baseline.check("train step", lambda: model(x).sum().backward())
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import pytest

from memplan.measure import Measurement, format_bytes, measure

__all__ = ["assert_peak", "PeakBaseline", "BaselineChecker"]

_BASELINE_KEY = pytest.StashKey["PeakBaseline"]()


def assert_peak(fn: Callable[..., Any], *args: Any, max_bytes: int, **kwargs: Any) -> Measurement:
    """Run ``fn(*args, **kwargs)`` under the ruler and fail if its peak exceeds ``max_bytes``.

    Examples
    --------
    >>> import torch
    >>> assert_peak(lambda x: x * 2, torch.ones(256), max_bytes=1024).peak
    1024
    """
    __tracebackhide__ = True  # a failure points at the test, not at the plugin
    m = measure(fn, *args, **kwargs)
    if m.peak > max_bytes:
        raise AssertionError(
            f"peak {format_bytes(m.peak)} exceeds the limit {format_bytes(max_bytes)} "
            f"by {format_bytes(m.peak - max_bytes)}{_where(m)}"
        )
    return m


def _where(m: Measurement) -> str:
    try:
        at = m.peak_at()
    except ValueError:
        return ""
    return f" (peak reached at {at.op}, event {at.index})"


class PeakBaseline:
    """The baseline file: ``{key: peak bytes}``, loaded once per session and written back on update."""

    def __init__(self, path: pathlib.Path, update: bool, tolerance: float):
        self.path = path
        self.update = update
        self.tolerance = tolerance
        self.values: dict[str, int] = json.loads(path.read_text()) if path.exists() else {}
        self.changes: list[tuple[str, int | None, int]] = []

    def check(self, key: str, m: Measurement, tolerance: float | None = None) -> None:
        tol = self.tolerance if tolerance is None else tolerance
        old = self.values.get(key)
        if self.update:
            if old != m.peak:
                self.changes.append((key, old, m.peak))
                self.values[key] = m.peak
            return
        if old is None:
            pytest.fail(
                f"no memplan baseline for {key!r} in {self.path.name} (measured {format_bytes(m.peak)}). "
                "Record it with: pytest --memplan-update, and commit the file.",
                pytrace=False,
            )
        if m.peak > old * (1 + tol):
            delta = m.peak - old
            pytest.fail(
                "\n".join(
                    [
                        f"memplan peak regression in {key}:",
                        f"  baseline  {format_bytes(old):>12}  ({old} bytes)",
                        f"  measured  {format_bytes(m.peak):>12}  ({m.peak} bytes)",
                        f"  change    +{format_bytes(delta)} (+{delta / old:.1%}; tolerance {tol:.0%}){_where(m)}",
                        f"If the increase is intended, run pytest --memplan-update and commit {self.path.name}.",
                    ]
                ),
                pytrace=False,
            )
        if m.peak < old * (1 - tol):
            self.changes.append((key, old, m.peak))

    def save(self) -> None:
        self.path.write_text(json.dumps(dict(sorted(self.values.items())), indent=2) + "\n")


class BaselineChecker:
    """What the ``memplan_baseline`` fixture gives a test: ``check(name, fn, *args, **kwargs)``."""

    def __init__(self, baseline: PeakBaseline, nodeid: str):
        self._baseline = baseline
        self._nodeid = nodeid

    def check(self, name: str, fn: Callable[..., Any], *args: Any, tolerance: float | None = None, **kwargs: Any) -> Measurement:
        m = measure(fn, *args, **kwargs)
        self._baseline.check(f"{self._nodeid}::{name}", m, tolerance)
        return m


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memplan")
    group.addoption("--memplan-update", action="store_true", default=False,
                    help="record the measured peaks as memplan's new baseline")
    parser.addini("memplan_baseline", "memplan peak baseline file, relative to the rootdir", default="memplan-baseline.json")
    parser.addini("memplan_tolerance", "allowed relative peak growth before a memplan baseline check fails", default="0.05")


def pytest_configure(config: pytest.Config) -> None:
    path = pathlib.Path(config.rootpath) / config.getini("memplan_baseline")
    config.stash[_BASELINE_KEY] = PeakBaseline(path, config.getoption("--memplan-update"), float(config.getini("memplan_tolerance")))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    baseline = session.config.stash.get(_BASELINE_KEY, None)
    if baseline is not None and baseline.update and baseline.changes:
        baseline.save()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    baseline = config.stash.get(_BASELINE_KEY, None)
    if baseline is None or not baseline.changes:
        return
    verb = "updated" if baseline.update else "improved beyond the tolerance (run --memplan-update to lock it in)"
    terminalreporter.section("memplan peak baseline")
    for key, old, new in baseline.changes:
        before = format_bytes(old) if old is not None else "(none)"
        terminalreporter.write_line(f"{verb}: {key}: {before} -> {format_bytes(new)}")


@pytest.fixture
def memplan_peak() -> Callable[..., Measurement]:
    """``memplan_peak(fn, *args, max_bytes=...)``: :func:`assert_peak` as a fixture."""
    return assert_peak


@pytest.fixture
def memplan_baseline(request: pytest.FixtureRequest) -> BaselineChecker:
    """``memplan_baseline.check(name, fn, *args)``: compare a call's peak with the recorded baseline."""
    return BaselineChecker(request.config.stash[_BASELINE_KEY], request.node.nodeid)
