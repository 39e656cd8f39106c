"""``memplan bench``: each example workload, measured and predicted side by side in one run.

For every workload and mode (training step, inference call) the bench runs the eager model under the
ruler, predicts its peak with :func:`memplan.analyze`, and, when memplan's optimizer is asked for,
runs the optimized module under the ruler too. Times are medians of repeated runs measured in the
same process, so ratios compare like with like.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

import memplan.examples as examples
from memplan.analysis.memory import analyze
from memplan.measure import format_bytes, measure
from memplan.steps import step_fn

__all__ = ["BenchRow", "BenchResult", "run_bench"]


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One workload in one mode."""

    workload: str
    mode: str  # "train" or "infer"
    size: str
    device: str
    measured: int  # eager peak, bytes (the ruler)
    predicted: int  # memplan.analyze's peak, bytes
    plan_seconds: float  # capture + analysis
    eager_seconds: float  # median step time

    @property
    def prediction_ratio(self) -> float:
        return self.predicted / self.measured if self.measured else float("nan")

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["prediction_ratio"] = self.prediction_ratio
        return out


@dataclasses.dataclass(frozen=True)
class BenchResult:
    rows: tuple[BenchRow, ...]
    torch_version: str
    device_name: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "torch": self.torch_version,
            "device": self.device_name,
            "rows": [row.as_dict() for row in self.rows],
        }

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title=f"memplan bench on {self.device_name} (torch {self.torch_version})", title_justify="left")
        for column in ("workload", "mode", "eager peak (measured)", "predicted peak", "predicted/measured", "plan s", "eager step ms"):
            table.add_column(column, justify="right" if column not in ("workload", "mode") else "left")
        for row in self.rows:
            ratio = row.prediction_ratio
            style = "green" if abs(ratio - 1) <= 0.05 else "red"
            table.add_row(
                row.workload, row.mode, format_bytes(row.measured), format_bytes(row.predicted),
                f"[{style}]{ratio:.3f}[/{style}]", f"{row.plan_seconds:.2f}", f"{row.eager_seconds * 1e3:.1f}",
            )
        return table


def _median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"CPU, {torch.get_num_threads()} threads"


def run_bench(
    names: Iterable[str] | None = None,
    *,
    size: str = "small",
    device: str = "cpu",
    modes: Iterable[str] = ("train", "infer"),
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Run the bench and return its rows (rendering is the caller's business)."""
    dev = torch.device(device)
    rows = []
    for name in names or examples.WORKLOADS:
        workload = examples.make(name, size=size, device=dev)
        for mode in modes:
            train = mode == "train"
            if progress is not None:
                progress(f"{name} ({mode})")
            start = time.perf_counter()
            predicted = analyze(workload.model, *workload.inputs, train=train).peak
            plan_seconds = time.perf_counter() - start
            step = step_fn(workload.model, workload.inputs, train=train)
            step()  # warm up kernels and the allocator outside the measurement
            measured = measure(step).peak
            rows.append(
                BenchRow(
                    workload=name, mode=mode, size=size, device=str(dev), measured=measured, predicted=predicted,
                    plan_seconds=plan_seconds, eager_seconds=_median_seconds(step, repeats, dev),
                )
            )
    return BenchResult(tuple(rows), torch.__version__, device_name(dev))
