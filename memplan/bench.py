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
from memplan.analyze import analyze
from memplan.measure import format_bytes, measure
from memplan.steps import clear_grads, step_fn

__all__ = ["BenchRow", "BenchResult", "run_bench"]


def _ratio(num: float | None, den: float | None, zero: float = float("nan")) -> float | None:
    """``num / den``; None when either was not measured, ``zero`` when ``den`` is 0."""
    if num is None or den is None:
        return None
    return num / den if den else zero


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
    pipeline: str = ""
    optimized: int | None = None  # peak of memplan.optimize(model, passes=pipeline), bytes (the ruler)
    planned: int | None = None  # the plan's predicted peak
    optimized_seconds: float | None = None  # median step time, timed interleaved with eager
    baseline: str = ""  # the hand-written fix (memplan.baselines), training rows only
    baseline_peak: int | None = None  # its peak, bytes (the ruler)
    baseline_seconds: float | None = None  # its median step time, timed interleaved with eager

    @property
    def prediction_ratio(self) -> float:
        return self.predicted / self.measured if self.measured else float("nan")

    @property
    def reduction(self) -> float | None:
        """How many times lower the optimized peak is (eager / optimized)."""
        return _ratio(self.measured, self.optimized, zero=float("inf"))

    @property
    def time_ratio(self) -> float | None:
        """Optimized step time over eager's."""
        return _ratio(self.optimized_seconds, self.eager_seconds)

    @property
    def baseline_reduction(self) -> float | None:
        """How many times lower the hand-written fix's peak is (eager / hand-written)."""
        return _ratio(self.measured, self.baseline_peak, zero=float("inf"))

    @property
    def baseline_time_ratio(self) -> float | None:
        """Hand-written step time over eager's."""
        return _ratio(self.baseline_seconds, self.eager_seconds)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["prediction_ratio"] = self.prediction_ratio
        out["reduction"] = self.reduction
        out["time_ratio"] = self.time_ratio
        out["baseline_reduction"] = self.baseline_reduction
        out["baseline_time_ratio"] = self.baseline_time_ratio
        return out


def _measured(step: Callable[[], Any], workload: Any) -> int:
    """The peak of one ``step``, its model's and inputs' gradients dropped first. A step drops them at its
    start (``memplan.steps.clear_grads``): counted in the memory the step began with, on CUDA, where the ruler
    is the caching allocator's peak over that, their freeing would lower the figure by their bytes (the
    dispatch ruler of the CPU counts only what the step allocates, and is not moved)."""
    clear_grads(workload.model, workload.inputs)
    return measure(step).peak


def _times(ratio: float) -> str:
    """``"26.9x"``, ``"1234x"``: a ratio in at most six characters."""
    return f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def _compact(nbytes: int) -> str:
    """``"54.26MiB"``: :func:`format_bytes` without the space, for narrow tables."""
    return format_bytes(nbytes).replace(" ", "")


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
        """The table, one line per row within 100 columns: peaks without the space before the unit, a
        workload's name once for its rows, and what each column means in the caption."""
        from rich import box
        from rich.table import Table

        optimized = any(row.optimized is not None for row in self.rows)
        baselines = any(row.baseline_peak is not None for row in self.rows)
        pipeline = next((row.pipeline for row in self.rows if row.optimized is not None), "")
        title = f"memplan bench on {self.device_name} (torch {self.torch_version})"
        if optimized:
            title += f"; memplan pipeline: {pipeline or '(empty)'}"
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True)
        columns = ["workload", "mode", "eager", "pred"]
        if optimized:
            columns += ["memplan", "lower", "time"]
        if baselines:
            columns += ["by hand", "lower ", "time "]
        columns += ["plan"]
        for column in columns:
            table.add_column(column, justify="left" if column in ("workload", "mode") else "right", no_wrap=True)
        previous = None
        for row in self.rows:
            ratio = row.prediction_ratio
            style = "green" if abs(ratio - 1) <= 0.05 else "red"
            name = row.workload if row.workload != previous else ""
            previous = row.workload
            cells = [name, row.mode, _compact(row.measured), f"[{style}]{ratio:.3f}[/{style}]"]
            if optimized:
                if row.optimized is None:
                    cells += ["-", "-", "-"]
                else:
                    cells += [_compact(row.optimized), _times(row.reduction), f"{row.time_ratio:.2f}"]
            if baselines:
                if row.baseline_peak is None:
                    cells += ["-", "-", "-"]
                else:
                    cells += [_compact(row.baseline_peak), _times(row.baseline_reduction), f"{row.baseline_time_ratio:.2f}"]
            seconds = row.plan_seconds
            cells += [f"{seconds:.2f}" if seconds < 10 else f"{seconds:.1f}" if seconds < 100 else f"{seconds:.0f}"]
            table.add_row(*cells)
        notes = ["eager: eager's measured peak; pred: predicted / measured"]
        if optimized:
            notes.append("memplan: the plan's measured peak, lower: eager's / it, time: its step time / eager's")
        if baselines:
            notes.append("by hand: " + "; ".join(
                f"{row.workload}: {row.baseline}" for row in self.rows if row.baseline_peak is not None and row.mode == "train"))
        notes.append("plan: seconds to predict (eager) or plan (memplan); --json for every figure, step times too")
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
        return table


def _seconds(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved_medians(
    fns: list[Callable[[], Any]], repeats: int, device: torch.device, block: int = 4
) -> list[float]:
    """Median seconds of each function over ``repeats`` timed calls, taken in alternating blocks of up to
    ``block`` consecutive calls, each block after one untimed call.

    A training loop runs one model step after step, and a step's time depends on the state the step
    before left: the allocator's heap, the caches. Alternating the functions call by call measured each
    from the state another left. Eager's 8.8 MB blocks of the chain product then came as fresh,
    page-faulting memory after a chunked step instead of from the heap its own step had warmed: eager
    took 41-61 ms a step where it takes 28-39 ms step after step, and the plan looked 20-30% faster
    against it than it is. The untimed call puts each function back in the state its own calls leave;
    alternating the blocks still lets the machine's drift fall on all alike.
    """
    times: list[list[float]] = [[] for _ in fns]
    while len(times[0]) < repeats:
        count = min(block, repeats - len(times[0]))
        for i, fn in enumerate(fns):
            fn()  # untimed: back to the state this function's own calls leave
            for _ in range(count):
                times[i].append(_seconds(fn, device))
    return [statistics.median(t) for t in times]


def side_by_side(variants: dict[str, Callable[..., Any]], inputs: Any, repeats: int,
                 device: torch.device = torch.device("cpu")) -> tuple[dict[str, int], dict[str, float]]:
    """Each variant's training step (:func:`memplan.steps.step_fn` on ``inputs``): its peak by
    :func:`memplan.measure` and its median time (:func:`interleaved_medians`), keyed by label. Every step
    runs once first, so an optimized module has planned before it is measured."""
    steps = {label: step_fn(model, inputs, train=True) for label, model in variants.items()}
    for step in steps.values():
        step()
    peaks = {label: measure(step).peak for label, step in steps.items()}
    times = dict(zip(steps, interleaved_medians(list(steps.values()), repeats, device)))
    return peaks, times


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
    repeats: int = 5,
    passes: str | None = None,
    baselines: bool = False,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Run the bench and return its rows (rendering is the caller's business).

    ``passes``: None measures eager only; a pipeline string (``""`` for the empty one, ``"default"`` for
    memplan's default) also runs ``memplan.optimize(model, passes=...)`` side by side. ``baselines``:
    training rows also run the workload's hand-written fix (:mod:`memplan.baselines`), timed interleaved
    with the others.
    """
    from memplan.api import DEFAULT_PIPELINE, optimize
    from memplan.baselines import BASELINES, hand_written

    if passes == "default":
        passes = ",".join(DEFAULT_PIPELINE)
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
            measured = _measured(step, workload)
            row = BenchRow(
                workload=name, mode=mode, size=size, device=str(dev), measured=measured, predicted=predicted,
                plan_seconds=plan_seconds, eager_seconds=0.0,
            )
            timed = [step]
            if passes is not None:
                opt = optimize(workload.model, passes=passes)
                opt_step = step_fn(opt, workload.inputs, train=train)
                start = time.perf_counter()
                opt_step()  # plans on the first call
                plan_seconds = time.perf_counter() - start
                row = dataclasses.replace(
                    row, pipeline=passes, optimized=_measured(opt_step, workload),
                    planned=opt.plan.planned_peak if opt.plan is not None else None, plan_seconds=plan_seconds,
                )
                timed.append(opt_step)
            if baselines and train and name in BASELINES:
                base_step = step_fn(hand_written(name, workload.model), workload.inputs, train=train)
                base_step()
                row = dataclasses.replace(row, baseline=BASELINES[name][0], baseline_peak=_measured(base_step, workload))
                timed.append(base_step)
            seconds = iter(interleaved_medians(timed, repeats, dev))
            row = dataclasses.replace(row, eager_seconds=next(seconds))
            if passes is not None:
                row = dataclasses.replace(row, optimized_seconds=next(seconds))
            if row.baseline_peak is not None:
                row = dataclasses.replace(row, baseline_seconds=next(seconds))
            rows.append(row)
    return BenchResult(tuple(rows), torch.__version__, device_name(dev))
