"""The measuring half of ``benchmarks/cuda_check.py``: a process that runs the tasks the check sends it.

The check (the parent) starts this script, reads one greeting and then sends one task per line on stdin, as
JSON. The worker answers on stdout with lines that start with :data:`PREFIX`, each holding one JSON object:
``{"hello": {...}}`` once it is ready (device, versions, free memory), then for every task
``{"id": n, "update": {...}}`` as each figure is known and ``{"id": n, "done": true}`` at its end. Anything
else that lands on stdout or stderr (library warnings, compiler logs) is the log's, not the protocol's.

Why a process of its own: (1) a task that overruns its limit and cannot be interrupted (a hang inside a CUDA
call) can be killed, and the figures it sent before are kept; (2) a CUDA error that poisons the context ends
one worker, not the check; (3) the parent holds no device memory, so the free memory a task sees is what the
device has.

Tasks
-----
``"memplan"``, the training step of one example workload (:func:`memplan.steps.step_fn`):

(1) build the workload on the device (:func:`memplan.examples.make`);
(2) predict eager's peak with :func:`memplan.analyze` and compare it with the device's free memory; a run
    that would not fit (see :data:`FIT_HEADROOM`) is not started, and the note says what was predicted;
(3) eager: one warm-up step, then the peak of one step (:func:`step_peak`);
(4) memplan: ``memplan.optimize(model, verify=True)``; its first call plans and checks its outputs and
    gradients against the model run eagerly (skipped, with a note, where eager would not fit), then the
    peak of one step, beside the plan's predicted peak;
(5) ``torch.compile(model, backend="memplan")``, where the captured graph is small (:data:`BACKEND_MAX_NODES`):
    its first call and the peak of one step;
(6) the step times of the variants that ran, as medians of blocks timed in turn
    (:func:`memplan.bench.interleaved_medians`; CUDA is synchronised around each step);
(7) on CUDA, where (5) ran: ``torch.compile`` with ``memplan.compile.backend(inductor=True)`` (memplan's plans
    compiled by Inductor), its first call, peak and step time beside eager's (:func:`_inductor_backend`).

``"offload"``: moving saved activations to host memory (the ``offload`` pass), on a deep MLP built here
(:func:`offload_workload`: its activations outweigh its weights, and its matmuls leave the copies time to
overlap): eager; memplan with offload off (``"kept"``); with offload on without a budget (``"offload"``: the
lowest peak within ``max_overhead``); and, where offload moved something, recomputation alone under a budget
of the offload plan's peak (``"recompute"``). Each plan is checked against eager (``verify=True``); peaks
beside predictions, then the step times of all, timed in turn. On a CPU (the dry run) the host tier is
emulated, which exercises the code, not the gain.

``"compile"``: the same step through ``torch.compile`` with
``torch._functorch.config.activation_memory_budget`` set (the knob users tune to make the compiler
recompute activations): first call (compilation), peak of one step, and its step time timed in turn
with eager's where eager fits.

Each variant that runs out of device memory (``torch.cuda.OutOfMemoryError``) is recorded as such, the cache is
emptied, and the task goes on. A task has a soft time limit: when it passes, the task is interrupted where it
stands (``SIGALRM``) and reports in which phase; the parent kills the worker if even that does not end it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memplan
import memplan.compile
import memplan.examples as examples
from memplan.analysis.cost import REFERENCE_CUDA_RATES, calibrate
from memplan.bench import device_name, interleaved_medians
from memplan.errors import PassRolledBackWarning, VerificationWarning
from memplan.measure import allocator_peak, format_bytes, measure
from memplan.steps import clear_grads, step_fn

__all__ = ["FIT_HEADROOM", "PREFIX", "free_bytes", "step_peak", "main"]

#: Marks the worker's protocol lines on stdout; every other line there is a library's and goes to the log.
PREFIX = "@cuda_check "

#: Eager runs only where its predicted peak, plus this share of it, fits in the free memory. The prediction
#: counts tensors' bytes; the caching allocator rounds each block up and splits segments, and kernels take
#: workspaces, so a run predicted to fill the device to the last byte would fail on it. One run that
#: does not start costs a figure; one that exhausts the device can cost the rest of the check.
FIT_HEADROOM = 0.10


class TaskTimeout(BaseException):
    """Raised by the alarm when a task passes its soft time limit.

    A ``BaseException``, as ``KeyboardInterrupt`` is: memplan's pipeline answers a pass that raises an
    ``Exception`` by rolling the pass back and going on, and the compiler wraps what it meets; neither
    may swallow the end of the task's time.
    """


# ----------------------------------------------------------------------------------------------
# Protocol
# ----------------------------------------------------------------------------------------------


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


class _Task:
    """One task's id and its channel back to the parent: ``update(**figures)``, ``phase(name)``."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.id = spec["id"]
        self.current = "starting"
        self.figures: dict[str, Any] = {}  # every figure sent so far

    def update(self, **fields: Any) -> None:
        self.figures.update(fields)
        _send({"id": self.id, "update": fields})

    def phase(self, name: str) -> None:
        self.current = name
        self.update(phase=name)


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TaskTimeout` in the main thread once ``seconds`` have passed (POSIX ``SIGALRM``).

    The exception arrives between two Python bytecodes, so planning and tracing (Python) stop at once and a
    long CUDA call stops when it returns; the parent's hard limit covers a call that never returns.
    """

    def on_alarm(signum: int, frame: Any) -> None:
        raise TaskTimeout(f"passed its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------


def free_bytes(device: torch.device, cap: int | None = None) -> int | None:
    """Bytes a new run can take on ``device``; None where nothing bounds it.

    CUDA: ``torch.cuda.mem_get_info``'s free bytes plus what the caching allocator holds unused (it
    hands those out first). CPU: ``MemAvailable`` of ``/proc/meminfo`` where there is one. ``cap``
    (``--free-memory``) lowers the answer, to see how the check behaves on a smaller device.
    """
    free: int | None = None
    if device.type == "cuda":
        device_free, _ = torch.cuda.mem_get_info(device)
        free = device_free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    else:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        free = int(line.split()[1]) * 1024
    if cap is not None:
        free = cap if free is None else min(free, cap)
    return free


def step_peak(step: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated during one call of ``step`` above what was allocated before it.

    CUDA: :func:`memplan.measure.allocator_peak` (``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``, less ``memory_allocated`` before the step, the device synchronised on both
    sides: the numbers :func:`memplan.measure` reports on CUDA, read without its dispatch mode, which
    compiled code would not pass through). CPU: :func:`memplan.measure`,
    the deterministic byte count.
    """
    if device.type != "cuda":
        return measure(step).peak
    return allocator_peak(step, device=device)


#: ``torch.compile(model, backend="memplan")`` runs beside eager and memplan.optimize on workloads whose captured
#: graph has at most this many nodes (Dynamo traces an unrolled loop of thousands of steps slowly).
BACKEND_MAX_NODES = 2000

#: A prediction further than this from the measured peak (either way) gets :func:`op_peaks` in the record.
DIAGNOSE_OFF_BY = 0.02


class _OpPeaks(TorchDispatchMode):
    """After each aten op: the allocator's live bytes and its peak during the op, then the peak reset."""

    def __init__(self, device: torch.device, before: int) -> None:
        super().__init__()
        self.device, self.before, self.ops = device, before, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        live = torch.cuda.memory_allocated(self.device) - self.before
        peak = torch.cuda.max_memory_allocated(self.device) - self.before
        self.ops.append((str(func), live, peak))
        torch.cuda.reset_peak_memory_stats(self.device)
        return out


def op_peaks(step: Callable[[], Any], device: torch.device, top: int = 8) -> dict[str, Any]:
    """Where one step's memory peaks, op by op, to tell a misprediction's cause from afar.

    One step under a dispatch mode that reads the caching allocator after every aten op: ``peak`` is the
    step's peak so measured, and ``ops`` the ``top`` ops whose own peak (the most allocated while the op
    ran) is highest, each with the op before it, its live bytes after it and its peak. An op whose peak
    is above both its neighbours' live bytes allocated memory that no tensor it returned holds: a kernel's
    workspace or temporaries. A mode also changes what eager runs: autograd's formulas take their
    out-of-place forms for tensor subclasses and under modes (``isTensorSubclassLike``), as a trace does,
    so a peak here above the one measured without it points at such a formula.
    """
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    mode = _OpPeaks(device, torch.cuda.memory_allocated(device))
    with mode:
        step()
    torch.cuda.synchronize(device)
    ops = mode.ops
    ranked = sorted(range(len(ops)), key=lambda i: -ops[i][2])[:top]
    return {
        "peak": max((peak for _, _, peak in ops), default=0),
        "ops": [{"index": i, "op": ops[i][0], "previous": ops[i - 1][0] if i else None,
                 "live_before": ops[i - 1][1] if i else 0, "live_after": ops[i][1], "peak": ops[i][2]}
                for i in sorted(ranked)],
    }


def _off(predicted: int | None, measured: int | None) -> bool:
    return bool(predicted and measured) and abs(predicted / measured - 1.0) > DIAGNOSE_OFF_BY


def _release(device: torch.device) -> None:
    """Give back what a finished or failed variant held: Python's garbage, then the allocator's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised from, ``torch.cuda.OutOfMemoryError`` (the compiler wraps what it meets)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 10:
        if isinstance(current, torch.cuda.OutOfMemoryError):
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _eager_fits(workload: examples.Workload, device: torch.device, cap: int | None, task: _Task) -> bool:
    """Stage (2): predict eager's peak, compare it with the free memory, and report both."""
    task.phase("predicting")
    start = time.perf_counter()
    analysis = memplan.analyze(workload.model, *workload.inputs, train=True)
    predicted = analysis.peak
    free = free_bytes(device, cap)
    fits = free is None or predicted * (1 + FIT_HEADROOM) <= free
    task.update(predicted=predicted, analyze_seconds=time.perf_counter() - start, free=free, eager_fits=fits,
                graph_nodes=len(analysis.graph.gm.graph.nodes))
    if not fits:
        task.update(eager_note=f"does not fit (predicted {format_bytes(predicted)}, {format_bytes(free)} free)")
    return fits


def _verify_outcome(caught: list[warnings.WarningMessage]) -> tuple[str, str | None]:
    """What ``verify=True`` said on the first call: ``("match" | "skipped" | "rolled back" | "differs", why)``."""
    for record in caught:
        if issubclass(record.category, PassRolledBackWarning):
            return "rolled back", str(record.message).splitlines()[0]
    for record in caught:
        if issubclass(record.category, VerificationWarning):
            message = str(record.message).splitlines()[0]
            return ("skipped" if "skipped verify=True" in message else "differs"), message
    return "match", None


# ----------------------------------------------------------------------------------------------
# Tasks
# ----------------------------------------------------------------------------------------------


def memplan_task(task: _Task) -> None:
    """Eager and memplan on one workload: stages (1)-(5) of the module docstring."""
    spec = task.spec
    device = torch.device(spec["device"])
    task.phase("building")
    workload = examples.make(spec["workload"], size=spec["size"], device=device)
    task.update(description=workload.description)
    fits = _eager_fits(workload, device, spec.get("free_memory"), task)

    timed: dict[str, Callable[[], Any]] = {}
    eager = step_fn(workload.model, workload.inputs, train=True)
    if fits:
        task.phase("eager")
        failure = None
        try:
            eager()  # warm-up: kernels, cuBLAS handles and the allocator's cache, outside the measurement
            clear_grads(workload.model, workload.inputs)
            task.update(eager_peak=step_peak(eager, device))
            timed["eager"] = eager
            if device.type == "cuda" and _off(task.figures.get("predicted"), task.figures["eager_peak"]):
                clear_grads(workload.model, workload.inputs)
                task.update(eager_op_peaks=op_peaks(eager, device))
        except torch.cuda.OutOfMemoryError as exc:
            failure = f"out of memory: {_first_line(exc, 160)}"
        if failure is not None:
            clear_grads(workload.model, workload.inputs)
            _release(device)
            task.update(eager_note=failure)

    task.phase("planning")
    optimized = memplan.optimize(workload.model, verify=True)
    planned_step = step_fn(optimized, workload.inputs, train=True)
    failure = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            planned_step()  # plans, checks the plan against eager on copies, and runs it
            first_call = time.perf_counter() - start
        verify, why = _verify_outcome(caught)
        plan = optimized.plan
        task.update(first_call_seconds=first_call, verify=verify, verify_note=why,
                    planned=plan.planned_peak if plan is not None else None,
                    plan_seconds=plan.plan_seconds if plan is not None else None,
                    pipeline=plan.pipeline if plan is not None else None)
        task.phase("memplan")
        clear_grads(workload.model, workload.inputs)
        task.update(memplan_peak=step_peak(planned_step, device))
        timed["memplan"] = planned_step
        if device.type == "cuda" and plan is not None and _off(plan.planned_peak, task.figures["memplan_peak"]):
            clear_grads(workload.model, workload.inputs)
            task.update(memplan_op_peaks=op_peaks(planned_step, device))
    except torch.cuda.OutOfMemoryError as exc:
        failure = f"out of memory: {_first_line(exc, 160)}"
    if failure is not None:
        clear_grads(workload.model, workload.inputs)
        _release(device)
        task.update(memplan_note=failure)

    nodes = task.figures.get("graph_nodes")
    if "memplan" in timed and nodes is not None and nodes <= BACKEND_MAX_NODES:
        task.phase("backend")
        torch._dynamo.reset()
        # the backend object, not its name: the name needs memplan installed (an entry point), and this
        # script runs from a checkout
        compiled = torch.compile(workload.model, backend=memplan.compile.backend())
        backend_step = step_fn(compiled, workload.inputs, train=True)
        try:
            start = time.perf_counter()
            backend_step()  # Dynamo traces, memplan plans each graph
            task.update(backend_first_call_seconds=time.perf_counter() - start)
            clear_grads(workload.model, workload.inputs)
            # (the allocator's peak on CPU too: under memplan.measure's dispatch mode Dynamo would run eagerly)
            task.update(backend_peak=allocator_peak(backend_step, device=device))
            timed["backend"] = backend_step
        except torch.cuda.OutOfMemoryError as exc:
            clear_grads(workload.model, workload.inputs)
            _release(device)
            task.update(backend_note=f"out of memory: {_first_line(exc, 160)}")

    if timed:
        task.phase("timing")
        medians = interleaved_medians(list(timed.values()), spec["repeats"], device)
        task.update(**{f"{name}_seconds": seconds for name, seconds in zip(timed, medians)})

    if device.type == "cuda" and "memplan" in timed and nodes is not None and nodes <= BACKEND_MAX_NODES:
        _inductor_backend(task, workload, device, timed.get("eager"), spec["repeats"])


def _inductor_backend(task: _Task, workload: examples.Workload, device: torch.device,
                      eager: Callable[[], Any] | None, repeats: int) -> None:
    """(7) ``torch.compile(model, backend=memplan.compile.backend(inductor=True))``: memplan's plan of each
    graph compiled by Inductor. Last, after every other figure of the task is sent, and timed with eager
    alone: its compilation may take what is left of the task's time. On CUDA only (on a CPU it compiles
    C++ for minutes)."""
    task.phase("inductor backend")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(workload.model, backend=memplan.compile.backend(inductor=True))
        step = step_fn(compiled, workload.inputs, train=True)
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()  # Dynamo traces, memplan plans each graph, Inductor compiles its forward and backward
        task.update(inductor_backend_first_call_seconds=time.perf_counter() - start)
        fallbacks = [str(w.message)[:200] for w in caught if issubclass(w.category, memplan.CompileFallbackWarning)]
        if fallbacks:
            task.update(inductor_backend_note="; ".join(fallbacks))
        clear_grads(workload.model, workload.inputs)
        task.update(inductor_backend_peak=allocator_peak(step, device=device))
        medians = interleaved_medians([step] + ([eager] if eager is not None else []), repeats, device)
        task.update(inductor_backend_seconds=medians[0],
                    inductor_backend_eager_seconds=medians[1] if eager is not None else None)
    except Exception as exc:  # noqa: BLE001 - a figure of the check, not the check's failure
        clear_grads(workload.model, workload.inputs)
        _release(device)
        kind = "out of memory" if _is_out_of_memory(exc) else "raised"
        task.update(inductor_backend_note=f"{kind}: {_first_line(exc, 200)}")
    finally:
        torch._dynamo.reset()


def compile_task(task: _Task) -> None:
    """``torch.compile`` under an activation memory budget on one workload, timed beside eager where eager fits."""
    spec = task.spec
    device = torch.device(spec["device"])
    task.phase("building")
    workload = examples.make(spec["workload"], size=spec["size"], device=device)
    fits = spec.get("eager_fits")
    if fits is None:  # the memplan task did not say (it was skipped or failed before deciding)
        fits = _eager_fits(workload, device, spec.get("free_memory"), task)
    torch._dynamo.reset()
    try:
        with torch._functorch.config.patch(activation_memory_budget=spec["activation_memory_budget"]):
            compiled = torch.compile(workload.model, backend=spec["compile_backend"])
            step = step_fn(compiled, workload.inputs, train=True)
            task.phase("compiling")
            start = time.perf_counter()
            step()  # dynamo traces the forward; AOTAutograd partitions under the budget; both halves compile
            task.update(compile_seconds=time.perf_counter() - start)
            task.phase("measuring")
            clear_grads(workload.model, workload.inputs)
            task.update(peak=step_peak(step, device))
            task.phase("timing")
            timed = [step]
            if fits:
                timed.append(step_fn(workload.model, workload.inputs, train=True))
            medians = interleaved_medians(timed, spec["repeats"], device)
            task.update(seconds=medians[0], eager_seconds=medians[1] if fits else None, status="ok")
    except Exception as exc:  # noqa: BLE001 - the compiler's failure is a figure of the check, not the check's
        if _is_out_of_memory(exc):
            task.update(status="out of memory", note=_first_line(exc, 160))
        elif task.current in ("building", "compiling"):
            task.update(status="skipped", note=f"torch.compile raised {_first_line(exc)}")
        else:
            raise
    finally:
        torch._dynamo.reset()


def offload_workload(size: str, device: torch.device) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A stack of ``Linear`` + GELU layers at a batch far above its width: at the ``full`` size, 12 layers of
    4096 features over 8192 rows, 3 GiB of saved activations against 0.8 GiB of weights, and about 5 ms of
    matmuls per layer on an H100 to hide each 128 MiB copy behind."""
    width, depth, batch = (4096, 12, 8192) if size == "full" else (128, 6, 512)
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(depth)]
    model = torch.nn.Sequential(*layers).to(device)
    return model, (torch.randn(batch, width, device=device),)


def offload_task(task: _Task) -> None:
    """Offload against keeping and recomputing on :func:`offload_workload` (see the module docstring)."""
    from memplan.analysis.peak import step_margin
    from memplan.errors import InfeasibleBudgetError
    from memplan.ops import offload

    spec = task.spec
    device = torch.device(spec["device"])
    task.phase("building")
    model, inputs = offload_workload(spec["size"], device)
    options = {"offload.emulate": True} if device.type == "cpu" else {}
    timed: dict[str, Callable[[], Any]] = {}
    eager = step_fn(model, inputs, train=True)
    task.phase("eager")
    eager()
    clear_grads(model, inputs)
    task.update(eager_peak=step_peak(eager, device))
    timed["eager"] = eager
    variants = [("kept", {"offload.when": "never"}, None), ("offload", {"offload.when": "always"}, None)]
    while variants:
        label, extra, budget = variants.pop(0)
        task.phase(f"planning {label}")
        optimized = memplan.optimize(model, verify=True, budget=budget, options={**options, **extra})
        step = step_fn(optimized, inputs, train=True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
        except InfeasibleBudgetError as exc:
            task.update(**{f"{label}_note": _first_line(exc, 200)})
            continue
        verify, why = _verify_outcome(caught)
        plan = optimized.plan
        moved = [n for n in plan.graph.gm.graph.nodes if n.target is offload]
        task.update(**{f"{label}_planned": plan.planned_peak + step_margin(plan.graph), f"{label}_verify": verify,
                       f"{label}_verify_note": why, f"{label}_moved": len(moved),
                       f"{label}_moved_bytes": sum(n.args[0].meta["val"].nbytes for n in moved),
                       f"{label}_predicted_time": plan.plan_time, "eager_predicted_time": plan.eager_time})
        task.phase(label)
        clear_grads(model, inputs)
        task.update(**{f"{label}_peak": step_peak(step, device)})
        timed[label] = step
        if label == "offload" and moved:  # recomputation alone, to the same peak
            variants.append(("recompute", {"offload.when": "never"}, plan.planned_peak + step_margin(plan.graph)))
    task.phase("timing")
    medians = interleaved_medians(list(timed.values()), spec["repeats"], device)
    task.update(**{f"{name}_seconds": seconds for name, seconds in zip(timed, medians)})


TASKS: dict[str, Callable[[_Task], None]] = {"memplan": memplan_task, "compile": compile_task, "offload": offload_task}


def _hello(device: torch.device) -> dict[str, Any]:
    """The greeting: what the figures were measured on and with."""
    hello: dict[str, Any] = {
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "memplan": os.path.dirname(memplan.__file__),
        "pid": os.getpid(),
    }
    if device.type == "cuda":
        torch.ones(1, device=device)  # makes the context, so a device that cannot run fails here, clearly
        props = torch.cuda.get_device_properties(device)
        hello.update(
            device_name=torch.cuda.get_device_name(device),
            capability=f"{props.major}.{props.minor}",
            total_memory=props.total_memory,
            cudnn=torch.backends.cudnn.version(),
            float32_matmul_precision=torch.get_float32_matmul_precision(),
        )
        # the time model's rates measured on this GPU (about a second), beside REFERENCE_CUDA_RATES
        rates = calibrate(device)
        hello["calibrated_rates"] = dataclasses.asdict(rates)
        hello["reference_cuda_rates"] = dataclasses.asdict(REFERENCE_CUDA_RATES)
    hello["free"] = free_bytes(device)
    return hello


def main() -> int:
    """Greet, then run tasks from stdin until it closes."""
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    if device.type == "cpu":
        # The dry run checks this script, not the CPU's speed. On a loaded machine the second intra-op thread
        # spins while the first waits for a core: the small matmuls of the unrolled workloads took 5 ms each.
        torch.set_num_threads(1)
    _send({"hello": _hello(device)})
    for line in sys.stdin:
        if not line.strip():
            continue
        task = _Task(json.loads(line))
        try:
            with _time_limit(task.spec["limit_s"]):
                TASKS[task.spec["kind"]](task)
        except TaskTimeout as exc:
            task.update(timed_out=str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which records it and goes on
            traceback.print_exc()
            task.update(error=_first_line(exc), error_phase=task.current)
            _send({"id": task.id, "done": True})
            return 1  # a fresh worker for the next task: this one's state (a CUDA context) may be broken
        _release(device)
        _send({"id": task.id, "done": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
