"""A report's timelines as a Chrome trace: counter tracks for Perfetto (ui.perfetto.dev) and chrome://tracing.

One process per timeline (the model as written, then the plan), one counter event (``"ph": "C"``) per op
with the bytes live after it, by category (the bands of the HTML report's charts, parameters included).
Time is the op's position in the run: one microsecond per op, so the two tracks line up op by op, not in
seconds (nothing ran).
"""

from __future__ import annotations

import json
import os

__all__ = ["to_chrome_trace", "save_chrome_trace"]


def to_chrome_trace(report) -> dict:
    """The trace of a :class:`~memplan.report.data.MemoryReport` (the JSON object format).

    Examples
    --------
    >>> import torch, memplan
    >>> report = memplan.analyze(torch.nn.Linear(256, 256), torch.randn(64, 256), train=False).report()
    >>> trace = to_chrome_trace(report)
    >>> [(e["ts"], e["args"]["outputs"]) for e in trace["traceEvents"] if e["ph"] == "C"]  # a view, then addmm
    [(0, 0), (1, 65536)]
    """
    events = []
    timelines = [report.before] + ([report.after] if report.after is not None else [])
    for pid, timeline in enumerate(timelines):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": timeline.label}})
        for i, (node, phase) in enumerate(zip(timeline.steps, timeline.phases)):
            values = {category: series[i] for category, series in timeline.series.items()}
            events.append({"name": "memory (bytes)", "ph": "C", "ts": i, "pid": pid, "tid": 0, "args": values})
            events.append({"name": node, "cat": phase, "ph": "X", "ts": i, "dur": 1, "pid": pid, "tid": 0})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"title": report.title, "peak_as_written": report.before.peak,
                          "peak_of_plan": report.after.peak if report.after is not None else None}}


def save_chrome_trace(report, path: str | os.PathLike) -> str:
    """Write :func:`to_chrome_trace` as JSON to ``path``; returns the path."""
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_chrome_trace(report), f)
    return path
