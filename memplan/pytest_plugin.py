"""pytest plugin: pin the peak memory of a call in a regression test.

Registered through the ``pytest11`` entry point, so installing memplan makes the fixture available::

    def test_my_model_peak(memplan_peak):
        memplan_peak(lambda: model(x).sum().backward(), max_bytes=64 * 2**20)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from memplan.measure import Measurement, format_bytes, measure

__all__ = ["assert_peak", "memplan_peak"]


def assert_peak(fn: Callable[..., Any], *args: Any, max_bytes: int, **kwargs: Any) -> Measurement:
    """Run ``fn(*args, **kwargs)`` under the ruler and fail if its peak exceeds ``max_bytes``.

    Examples
    --------
    >>> import torch
    >>> assert_peak(lambda x: x * 2, torch.ones(256), max_bytes=1024).peak
    1024
    """
    m = measure(fn, *args, **kwargs)
    if m.peak > max_bytes:
        at = m.peak_at
        where = f" at {at.op} (event {at.index})" if at is not None else ""
        raise AssertionError(
            f"peak {format_bytes(m.peak)} exceeds the limit {format_bytes(max_bytes)} "
            f"by {format_bytes(m.peak - max_bytes)}{where}"
        )
    return m


@pytest.fixture
def memplan_peak() -> Callable[..., Measurement]:
    """``memplan_peak(fn, *args, max_bytes=...)``: :func:`assert_peak` as a fixture."""
    return assert_peak
