"""One command that proves memplan on one CUDA GPU in a few minutes, and leaves every figure it measured.

GPUs are lent to this project now and then, for minutes. ``python benchmarks/cuda_check.py --out DIR`` spends
them on what only a GPU can show: the ``cuda``-marked tests, and each example workload's training step
(:mod:`memplan.examples`) run eagerly, through ``memplan.optimize`` and through ``torch.compile`` with an
activation memory budget, with the caching allocator's peaks beside memplan's predictions.

Stages
------
(1) Device. ``torch.cuda.is_available()`` first; the device's name, torch's and CUDA's versions are printed.
    Anything wrong here ends the check at once, with one line and exit code 2.
(2) ``pytest -m cuda -q`` in a subprocess, with a time limit. It runs beside stage (3): collecting the suite
    is CPU work, and peaks are counted per process, so neither disturbs the other's figures.
(3) For each workload (``"memplan"`` tasks of ``cuda_check_worker.py``): eager's peak, unless memplan.analyze
    predicts it would not fit in the free memory; memplan's predicted and measured peak, its outputs and
    gradients checked against eager (``verify=True``); the step times of both, timed in turn; where the
    captured graph is small, ``torch.compile`` with memplan's backend, and on CUDA the same with
    ``inductor=True`` (memplan's plans compiled by Inductor), last in the task.
(4) Offload (an ``"offload"`` task), after every workload's stage (3): a deep MLP built by the worker, whose
    saved activations can wait in pinned host memory while its matmuls run; memplan with the ``offload``
    pass off, on, and recomputation alone under a budget of the offload plan's peak, each checked against
    eager, with peaks, predictions and step times (``--offload-limit 0`` skips it).
(5) For each workload, ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` (default
    0.5), within a time limit of its own ("compile" tasks). These come last, because memplan's figures are
    what the check is for, and smallest captured graph first, because compile time grows with the traced
    graph: a budget running out cuts the ones least likely to compile.

Stages (3) to (5) run in a worker process (``benchmarks/cuda_check_worker.py``), restarted when one dies
or has to be killed, so a hang, a crash or a poisoned CUDA context costs one figure, not the check.

Time
----
Every stage has its own limit, and all of them share ``--budget-seconds`` (default 330: an H100 is lent
for about 15 minutes, start-up included, and the check should take under 6, leaving time to run it again).
A stage is started only with at least :data:`MIN_STAGE_SECONDS` of the budget left, and is given no more
than what is left; the stages that cannot start are recorded as skipped, with the reason.

Files
-----
After every stage and every figure, ``DIR/cuda_check.json`` (all figures in bytes and seconds, the device,
versions, settings, timestamps) and ``DIR/cuda_check.md`` (a table to paste into docs/benchmarks.md, the
device in its heading) are written again, each replaced whole, so an interrupted run leaves every figure
measured so far. SIGTERM and SIGINT end the check that way. ``DIR/cuda_check.log`` keeps the worker's own
output (warnings, compiler logs, tracebacks) and ``DIR/pytest.log`` pytest's.

Exit codes: 0 when everything ran and every check held; 1 when a stage failed or a check did not hold
(see :func:`judge`); 2 when the check cannot run (no CUDA device, bad arguments, no worker); 3 when nothing
failed but stage (2) or (3) was skipped for lack of time; 128 + the signal's number when interrupted.

Dry run: ``python benchmarks/cuda_check.py --device cpu --size small --out DIR`` runs the same code on the
CPU (memplan.measure's byte count instead of the allocator's, and ``torch.compile`` with the
``aot_eager_decomp_partition`` backend, which runs AOTAutograd's budgeted partitioner without compiling
C++), in well under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the memplan of this tree, not another installed one
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import memplan.examples as examples  # noqa: E402
from memplan.measure import format_bytes  # noqa: E402
from memplan.policy import parse_bytes  # noqa: E402

__all__ = ["Limits", "DEFAULTS", "judge", "judge_offload", "render_markdown", "main"]

WORKER = pathlib.Path(__file__).resolve().with_name("cuda_check_worker.py")
PREFIX = "@cuda_check "  # the worker's protocol lines (cuda_check_worker.PREFIX)

#: A stage is not started with less of the budget left: even the smallest workload needs seconds to be built,
#: run and timed, and one started with less would end in a timeout that tells nothing.
MIN_STAGE_SECONDS = 10.0
#: Seconds past a task's own limit before its worker is killed. The worker stops itself at the limit (an
#: alarm, between two Python bytecodes); only a call stuck below Python (a CUDA call, a compiler subprocess)
#: needs the kill.
KILL_GRACE_SECONDS = 15.0
#: Importing torch and memplan and making a CUDA context: the first time on a fresh machine takes longest.
WORKER_START_SECONDS = 90.0
#: A measured peak more than this share above its prediction fails the check: memplan's fuzzer holds
#: predictions to the same 5%. An overestimate is reported, not failed (a budget planned on it still holds).
PREDICTION_TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-device defaults: time limits in seconds, timed steps per variant, and the compiler backend."""

    pytest: float
    workload: float
    compile: float
    repeats: int
    backend: str
    offload: float


#: ``cuda``: sized for an H100 at the ``full`` sizes (planning the 1000-step latent GRU takes half a minute of
#: CPU; a compile that takes over a minute is not going to finish in the budget). ``cpu``: the dry run, where
#: the compile limit only has to show that the limit works.
DEFAULTS: dict[str, Limits] = {
    "cuda": Limits(pytest=90, workload=150, compile=60, repeats=5, backend="inductor", offload=90),
    "cpu": Limits(pytest=60, workload=120, compile=5, repeats=3, backend="aot_eager_decomp_partition", offload=60),
}


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived: write what was measured and exit."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SetupError(Exception):
    """The check cannot run at all; the message is the one line to print."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Defaults by device: " + "; ".join(
            f"{kind}: pytest {d.pytest:.0f} s, workload {d.workload:.0f} s, compile {d.compile:.0f} s, "
            f"offload {d.offload:.0f} s, "
            f"{d.repeats} timed steps, backend {d.backend}" for kind, d in DEFAULTS.items()),
    )
    parser.add_argument("--out", required=True, help="folder for cuda_check.json, cuda_check.md and the logs")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for a dry run (default cuda)")
    parser.add_argument("--size", choices=examples.SIZES, default="full", help="workload size (default full)")
    parser.add_argument("--workloads", default=",".join(examples.WORKLOADS),
                        help="comma-separated workloads (default: all five)")
    parser.add_argument("--budget-seconds", type=float, default=330.0, help="for the whole check (default 330)")
    parser.add_argument("--pytest-limit", type=float, help="seconds for the pytest stage")
    parser.add_argument("--workload-limit", type=float, help="seconds for one workload's eager and memplan runs")
    parser.add_argument("--compile-limit", type=float, help="seconds for one workload's torch.compile (0: skip)")
    parser.add_argument("--offload-limit", type=float, help="seconds for the offload stage (0: skip)")
    parser.add_argument("--repeats", type=int, help="timed steps per variant")
    parser.add_argument("--compile-backend", help="torch.compile's backend")
    parser.add_argument("--activation-memory-budget", type=float, default=0.5,
                        help="torch._functorch.config.activation_memory_budget for torch.compile (default 0.5)")
    parser.add_argument("--pytest-args", default="-m cuda -q", help="what pytest is given (default '-m cuda -q')")
    parser.add_argument("--no-pytest", action="store_true", help="skip the pytest stage")
    parser.add_argument("--free-memory", type=parse_bytes, default=None,
                        help="decide whether eager fits as if at most this much were free (e.g. 8GiB)")
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in examples.WORKLOADS]
    if unknown or not names:
        parser.error(f"unknown workload(s) {unknown}; choose from {', '.join(examples.WORKLOADS)}")
    args.names = names
    kind = args.device.split(":")[0]
    if kind not in DEFAULTS:
        parser.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    for field in dataclasses.fields(Limits):
        option = {"pytest": "pytest_limit", "workload": "workload_limit", "compile": "compile_limit",
                  "backend": "compile_backend", "offload": "offload_limit"}.get(field.name, field.name)
        if getattr(args, option) is None:
            setattr(args, option, getattr(DEFAULTS[kind], field.name))
    return args


def _device(args: argparse.Namespace) -> dict[str, Any]:
    """Stage (1): the device and versions, or :class:`SetupError` with the one line that says what is wrong."""
    info: dict[str, Any] = {"type": args.device.split(":")[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if info["type"] == "cpu":
        info["name"] = f"CPU, {torch.get_num_threads()} threads"
        return info
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        raise SetupError(f"torch.cuda.is_available() is False (torch {torch.__version__}, {built}); "
                         f"for a dry run on the CPU pass --device cpu")
    index = torch.device(args.device).index or 0
    if index >= torch.cuda.device_count():
        raise SetupError(f"{args.device} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)")
    info["name"] = torch.cuda.get_device_name(index)
    return info


def _commit() -> dict[str, Any] | None:
    """The tree's commit and whether it has changes beyond it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "changed": bool(status.strip())}


# ----------------------------------------------------------------------------------------------
# Judging and rendering (pure functions of the record)
# ----------------------------------------------------------------------------------------------


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def derived(workload: dict[str, Any]) -> dict[str, Any]:
    """The ratios of one workload's figures (None where a figure is missing)."""
    compile_ = workload.get("compile", {})
    return {
        "eager_prediction_ratio": _ratio(workload.get("predicted"), workload.get("eager_peak")),
        "memplan_prediction_ratio": _ratio(workload.get("planned"), workload.get("memplan_peak")),
        "reduction": _ratio(workload.get("eager_peak"), workload.get("memplan_peak")),
        "time_ratio": _ratio(workload.get("memplan_seconds"), workload.get("eager_seconds")),
        "compile_reduction": _ratio(workload.get("eager_peak"), compile_.get("peak")),
        "compile_time_ratio": _ratio(compile_.get("seconds"), compile_.get("eager_seconds")),
    }


def _above(measured: int | None, predicted: int | None) -> bool:
    return measured is not None and predicted is not None and measured > predicted * (1 + PREDICTION_TOLERANCE)


def judge(workload: dict[str, Any]) -> list[str]:
    """The checks one finished workload failed, each a sentence with its figures (empty: all held).

    A workload fails when its task raised or timed out; when memplan did not run or ran out of memory; when
    ``verify=True`` found the plan's outputs or gradients differing from eager's; when memplan's measured peak
    is above eager's; when a measured peak is more than :data:`PREDICTION_TOLERANCE` above its prediction;
    and when eager ran out of memory although its prediction fitted. A skipped or failed ``torch.compile`` is
    a figure of the comparison, not a failure of memplan.
    """
    failures = []
    if workload.get("error"):
        failures.append(f"raised {workload['error']} (during {workload.get('error_phase', '?')})")
    eager, memplan_peak = workload.get("eager_peak"), workload.get("memplan_peak")
    predicted, planned = workload.get("predicted"), workload.get("planned")
    if memplan_peak is None and not workload.get("error"):
        failures.append(f"memplan did not run: {workload.get('memplan_note') or 'no figure came back'}")
    if workload.get("verify") in ("rolled back", "differs"):
        failures.append(f"verify=True {workload['verify']}: {workload.get('verify_note')}")
    if eager is not None and memplan_peak is not None and memplan_peak > eager:
        failures.append(f"memplan's peak {format_bytes(memplan_peak)} is above eager's {format_bytes(eager)}")
    if _above(eager, predicted):
        failures.append(f"eager's peak {format_bytes(eager)} is {eager / predicted - 1:.1%} above its prediction "
                        f"{format_bytes(predicted)}")
    if _above(memplan_peak, planned):
        failures.append(f"memplan's peak {format_bytes(memplan_peak)} is {memplan_peak / planned - 1:.1%} above "
                        f"the plan's prediction {format_bytes(planned)}")
    if str(workload.get("eager_note", "")).startswith("out of memory") and workload.get("eager_fits"):
        failures.append(f"eager ran out of memory although its predicted peak {format_bytes(predicted or 0)} "
                        f"fitted in {format_bytes(workload.get('free') or 0)}")
    return failures


#: The variants of the offload stage, in its table's order.
OFFLOAD_VARIANTS = ("kept", "offload", "recompute")


def judge_offload(record: dict[str, Any]) -> list[str]:
    """The checks the offload stage failed: the task raised or timed out; a plan's outputs or gradients
    differ from eager's; a plan's measured peak is above its prediction by more than the tolerance, or above
    eager's. That offload moved nothing, or that recomputation alone could not reach its peak, is a figure."""
    failures = []
    if record.get("error"):
        failures.append(f"raised {record['error']} (during {record.get('phase', '?')})")
    eager = record.get("eager_peak")
    for label in OFFLOAD_VARIANTS:
        if record.get(f"{label}_verify") in ("rolled back", "differs"):
            failures.append(f"{label}: verify=True {record[f'{label}_verify']}: {record.get(f'{label}_verify_note')}")
        peak, planned = record.get(f"{label}_peak"), record.get(f"{label}_planned")
        if _above(peak, planned):
            failures.append(f"{label}: peak {format_bytes(peak)} is {peak / planned - 1:.1%} above the plan's "
                            f"{format_bytes(planned)}")
        if eager is not None and peak is not None and peak > eager:
            failures.append(f"{label}: peak {format_bytes(peak)} is above eager's {format_bytes(eager)}")
    return failures


def _offload_lines(record: dict[str, Any]) -> list[str]:
    """The offload stage's table: one row per variant that ran."""
    if record.get("eager_peak") is None:
        note = record.get("note") or record.get("error")
        return [f"Offload stage ({record['name']}): {record['status']}" + (f", {note}" if note else "") + "."]
    eager_s = record.get("eager_seconds")
    lines = [f"Offload stage ({record['name']}, `{record['size']}` size): eager's peak {format_bytes(record['eager_peak'])}"
             + (f", step {eager_s * 1e3:.1f} ms" if eager_s else "") + ".", "",
             "| plan | moved to host | planned | measured peak | lower by | step time / eager | predicted time / eager | verify |",
             "|---|---|---|---|---|---|---|---|"]
    for label in OFFLOAD_VARIANTS:
        if record.get(f"{label}_planned") is None:
            if record.get(f"{label}_note"):
                lines.append(f"| {label} | - | - | - | - | - | - | {record[f'{label}_note']} |")
            continue
        peak, seconds = record.get(f"{label}_peak"), record.get(f"{label}_seconds")
        predicted = _ratio(record.get(f"{label}_predicted_time"), record.get("eager_predicted_time"))
        lines.append("| " + " | ".join([
            label, f"{record.get(f'{label}_moved', 0)} ({_bytes(record.get(f'{label}_moved_bytes'))})",
            _bytes(record.get(f"{label}_planned")), _bytes(peak),
            "-" if not peak else f"{record['eager_peak'] / peak:.2f}x",
            "-" if _ratio(seconds, eager_s) is None else f"{seconds / eager_s:.2f}x",
            "-" if predicted is None else f"{predicted:.2f}x", str(record.get(f"{label}_verify")),
        ]) + " |")
    lines += [f"- FAILED: {f}" for f in record.get("failures", [])]
    return lines


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _times(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}" if r < 10 else f"{r:.1f}"


def _eager_cell(workload: dict[str, Any]) -> str:
    if workload.get("eager_peak") is not None:
        return format_bytes(workload["eager_peak"])
    note = str(workload.get("eager_note") or "")
    if note.startswith("does not fit"):
        return f"does not fit (predicted {_bytes(workload.get('predicted'))})"
    return "out of memory" if note.startswith("out of memory") else "-"


def _compile_cell(compile_: dict[str, Any]) -> str:
    status = compile_.get("status", "pending")
    if status == "ok":
        return _bytes(compile_.get("peak"))
    return status


def render_markdown(record: dict[str, Any]) -> str:
    """``cuda_check.md``: a heading naming the device, one line of context, the table, then notes."""
    device = record["device"]
    where = device.get("name", device.get("type", "?"))
    versions = f"torch {device.get('torch')}" + (f", CUDA {device['cuda']}" if device.get("cuda") else "")
    kind = "CUDA check" if device.get("type") == "cuda" else "CUDA check, dry run"
    date = record["started"][:10]
    settings = record["settings"]
    lines = [f"### {kind} on {where} ({versions}), `{settings['size']}` sizes, {date}", ""]
    commit = record.get("commit")
    at = f" on `{commit['commit']}`{' with local changes' if commit['changed'] else ''}" if commit else ""
    pytest_ = record["pytest"]
    pytest_text = "; ".join(str(t) for t in (pytest_.get("note"), pytest_.get("summary")) if t)
    lines.append(
        f"`{record['command']}`{at}: {record['status']} after {record['elapsed_s']:.0f} s of the "
        f"{record['budget_s']:.0f} s budget. `pytest {settings['pytest_args']}`: {pytest_['status']}"
        f"{f' ({pytest_text})' if pytest_text else ''}. Peaks: "
        + ("the caching allocator's (`torch.cuda.max_memory_allocated` over one warmed-up training step)"
           if device.get("type") == "cuda" else "memplan.measure's byte count over one training step")
        + f"; times: medians of {settings['repeats']} steps, variants timed in turn; torch.compile: backend "
        f"`{settings['compile_backend']}`, `activation_memory_budget={settings['activation_memory_budget']}`."
    )
    lines += ["", "| workload | eager peak | predicted | pred/meas | memplan peak | planned | pred/meas | lower by "
              "| eager step | memplan time | compile peak | compile time | status |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for w in record["workloads"]:
        d = derived(w)
        compile_ = w.get("compile", {})
        eager_ms = w.get("eager_seconds")
        lines.append("| " + " | ".join([
            w["name"], _eager_cell(w), _bytes(w.get("predicted")), _times(d["eager_prediction_ratio"]),
            _bytes(w.get("memplan_peak")), _bytes(w.get("planned")), _times(d["memplan_prediction_ratio"]),
            "-" if d["reduction"] is None else f"{d['reduction']:.2f}x",
            "-" if eager_ms is None else f"{eager_ms * 1e3:.1f} ms",
            "-" if d["time_ratio"] is None else f"{d['time_ratio']:.2f}x",
            _compile_cell(compile_),
            "-" if d["compile_time_ratio"] is None else f"{d['compile_time_ratio']:.2f}x",
            w["status"],
        ]) + " |")
        said = []
        if w.get("plan_seconds") is not None:
            said.append(f"planned in {w['plan_seconds']:.1f} s")
        if w.get("verify"):
            said.append(f"verify: {w['verify']}" + (f" ({w['verify_note']})" if w.get("verify_note") else ""))
        for key in ("eager_note", "memplan_note", "note"):
            if w.get(key):
                said.append(f"eager {w[key]}" if key == "eager_note" else str(w[key]))
        if w.get("backend_peak") is not None:
            ratio = (f", step time {w['backend_seconds'] / w['eager_seconds']:.2f}x eager's"
                     if w.get("backend_seconds") and w.get("eager_seconds") else "")
            said.append(f"torch.compile(backend=\"memplan\"): peak {format_bytes(w['backend_peak'])}{ratio}")
        if w.get("inductor_backend_peak") is not None:
            ratio = (f", step time {w['inductor_backend_seconds'] / w['inductor_backend_eager_seconds']:.2f}x eager's"
                     if w.get("inductor_backend_seconds") and w.get("inductor_backend_eager_seconds") else "")
            said.append(f"memplan.compile.backend(inductor=True): peak {format_bytes(w['inductor_backend_peak'])}"
                        f"{ratio}, first call {w.get('inductor_backend_first_call_seconds') or 0:.1f} s")
        if w.get("inductor_backend_note"):
            said.append(f"memplan.compile.backend(inductor=True): {w['inductor_backend_note']}")
        if compile_.get("compile_seconds") is not None:
            said.append(f"torch.compile's first step took {compile_['compile_seconds']:.1f} s")
        if compile_.get("note"):
            said.append(f"torch.compile {compile_['status']}: {compile_['note']}")
        said += [f"FAILED: {f}" for f in w.get("failures", [])]
        if said:
            notes.append(f"- {w['name']}: " + "; ".join(said) + ".")
    if notes:
        lines += ["", *notes]
    if record.get("offload", {}).get("status", "pending") != "pending":
        lines += ["", *_offload_lines(record["offload"])]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# The record, written as it grows
# ----------------------------------------------------------------------------------------------


class Run:
    """The record of one check and the clock it runs against; :meth:`write` puts both files in ``out``."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str]):
        self.out = pathlib.Path(args.out)
        self.start = time.monotonic()
        self.budget = args.budget_seconds
        self.record: dict[str, Any] = {
            "schema": 1,
            "command": "python benchmarks/cuda_check.py " + shlex.join(argv),
            "status": "running",
            "started": _now(),
            "updated": _now(),
            "finished": None,
            "elapsed_s": 0.0,
            "budget_s": self.budget,
            "exit_code": None,
            "device": {"type": args.device.split(":")[0]},
            "commit": None,
            "settings": {
                "device": args.device, "size": args.size, "repeats": args.repeats,
                "pytest_args": args.pytest_args, "pytest_limit_s": args.pytest_limit,
                "workload_limit_s": args.workload_limit, "compile_limit_s": args.compile_limit,
                "offload_limit_s": args.offload_limit,
                "compile_backend": args.compile_backend, "activation_memory_budget": args.activation_memory_budget,
                "free_memory": args.free_memory, "prediction_tolerance": PREDICTION_TOLERANCE,
                "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            },
            "pytest": {"status": "pending"},
            "workloads": [{"name": name, "size": args.size, "status": "pending", "compile": {"status": "pending"}}
                          for name in args.names],
            "offload": {"name": "deep_mlp", "size": args.size, "status": "pending"},
            "failures": [],
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()

    def workload(self, name: str) -> dict[str, Any]:
        return next(w for w in self.record["workloads"] if w["name"] == name)

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():5.0f} s] {message}", flush=True)

    def write(self) -> None:
        """Replace both files whole (write beside, then rename), so no reader ever sees half of one."""
        self.record["updated"] = _now()
        self.record["elapsed_s"] = round(self.elapsed(), 2)
        for w in self.record["workloads"]:  # in place (the tasks hold these dicts): figures, compile's, ratios
            w.pop("derived", None)
            w["compile"] = w.pop("compile")
            w["derived"] = derived(w)
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (("cuda_check.json", json.dumps(self.record, indent=1) + "\n"),
                           ("cuda_check.md", render_markdown(self.record))):
            partial = self.out / f".{name}.partial"
            partial.write_text(text)
            os.replace(partial, self.out / name)


# ----------------------------------------------------------------------------------------------
# Subprocesses: the pytest stage and the worker
# ----------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _kill(process: subprocess.Popen) -> None:
    """End ``process`` and everything it started, which shares its process group (it leads a session of its
    own): the compiler's worker processes outlive a worker that ended. Linux keeps a group's id from being
    reused while the group has members, so the kill reaches no stranger after the leader was reaped."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


class PytestStage:
    """Stage (2): ``pytest ARGS`` in a subprocess, polled while the workloads run, killed at its deadline."""

    def __init__(self, run: Run, args: argparse.Namespace):
        self.run, self.args = run, args
        self.process: subprocess.Popen | None = None
        self.deadline = 0.0
        self.started = 0.0
        self.state = run.record["pytest"]

    def start(self) -> None:
        if self.args.no_pytest:
            self.state.update(status="skipped", note="--no-pytest")
            return
        limit = min(self.args.pytest_limit, self.run.left())
        if self.run.left() < MIN_STAGE_SECONDS:
            self.state.update(status="skipped", note=f"out of time ({self.run.left():.0f} s of the budget left)")
            return
        command = [sys.executable, "-m", "pytest", *shlex.split(self.args.pytest_args)]
        log = open(self.run.out / "pytest.log", "w")
        self.process = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.started = time.monotonic()
        self.deadline = self.started + limit
        self.state.update(status="running", command=shlex.join(["pytest", *command[3:]]), limit_s=limit,
                          started=_now())

    def poll(self) -> bool:
        """Record the result if pytest has ended (or kill it at its deadline); True once it is settled."""
        if self.process is None:
            return True
        if self.process.poll() is None and time.monotonic() < self.deadline:
            return False
        timed_out = self.process.poll() is None
        _kill(self.process)
        seconds = time.monotonic() - self.started
        summary = self._summary()
        code = self.process.returncode
        self.process = None
        if timed_out:
            status, note = "failed", f"timed out after {seconds:.0f} s"
        elif code == 0 and self.run.record["device"]["type"] == "cuda" and " passed" not in f" {summary}":
            status, note = "failed", "no test passed on a CUDA device (skipped where a GPU was expected?)"
        elif code == 0:
            status, note = "passed", None
        else:
            status, note = "failed", f"exit code {code}"
        self.state.update(status=status, note=note, summary=summary, seconds=round(seconds, 2), returncode=code)
        self.run.say(f"pytest {self.args.pytest_args}: {status}" + (f", {note}" if note else "")
                     + (f" ({summary})" if summary else ""))
        self.run.write()
        return True

    def wait(self) -> None:
        while not self.poll():
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            _kill(self.process)
            self.state.update(status="interrupted", note="the check ended first")
            self.process = None
        elif self.state["status"] == "pending":
            self.state.update(status="skipped", note="not run: the check ended first")

    def _summary(self) -> str:
        """pytest's last line (``2 passed, 1452 deselected in 4.38s``), without its decoration."""
        try:
            lines = (self.run.out / "pytest.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            if line.strip():
                return line.strip().strip("=").strip()
        return ""


class Worker:
    """A ``cuda_check_worker.py`` process: started on demand, given one task at a time, killed when stuck.

    ``command`` is the process to run (a test can give a stand-in); its stderr and every stdout line that is
    not the protocol's go to ``log``. ``grace``: seconds past a task's limit before the kill.
    """

    def __init__(self, command: list[str], log: pathlib.Path, grace: float = KILL_GRACE_SECONDS):
        self.command, self.log, self.grace = command, log, grace
        self.process: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.hello: dict[str, Any] | None = None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, limit: float, poll: Callable[[], Any]) -> dict[str, Any]:
        """Start a process and wait for its greeting; :class:`SetupError` with its last words if none comes."""
        self.stop()
        self.lines = queue.Queue()
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(self.command, cwd=REPO, env=_env(), stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                                            start_new_session=True)
        threading.Thread(target=self._read, args=(self.process, self.lines), daemon=True).start()
        deadline = time.monotonic() + limit
        while True:
            message = self._next(deadline, poll)
            if message is None or "eof" in message or "hello" in message:
                break
        if message is None or "eof" in message:
            code = self._exited() if message is not None else None
            self.stop(kill=True)
            why = f"exited with code {code}" if code is not None else f"did not answer within {limit:.0f} s"
            raise SetupError(f"the worker {why}: {self._last_words()} (see {self.log})")
        self.hello = message["hello"]
        return self.hello

    def run(self, spec: dict[str, Any], limit: float, poll: Callable[[], Any],
            on_update: Callable[[dict[str, Any]], None]) -> str:
        """Send one task and pass its updates on; ``"done"``, ``"died"`` (the process ended) or ``"killed"``."""
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps({**spec, "limit_s": limit}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return "died"
        deadline = time.monotonic() + limit + self.grace
        while True:
            message = self._next(deadline, poll)
            if message is None:
                self.stop(kill=True)
                return "killed"
            if "eof" in message:
                self._exited()
                return "died"
            if message.get("id") != spec["id"]:
                continue
            if message.get("done"):
                return "done"
            on_update(message.get("update", {}))

    def stop(self, kill: bool = False) -> None:
        """Close the worker's stdin (it ends when idle) and kill it if it does not end at once, or at once."""
        if self.process is None:
            return
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        if not kill:
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        _kill(self.process)
        self.process = None

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def _exited(self) -> int | None:
        """The exit code once the process has ended; None if it still runs a moment after its output ended."""
        assert self.process is not None
        try:
            return self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return None

    def _next(self, deadline: float, poll: Callable[[], Any]) -> dict[str, Any] | None:
        """The next protocol message; None at the deadline, ``{"eof": True}`` at the end of the worker's output."""
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.25)
            except queue.Empty:
                poll()
                continue
            return {"eof": True} if line is None else json.loads(line)
        return None

    def _read(self, process: subprocess.Popen, lines: queue.Queue) -> None:
        """Reader thread: protocol lines to the queue, everything else to the log, None at the end."""
        assert process.stdout is not None
        with open(self.log, "a") as log:
            for line in process.stdout:
                if line.startswith(PREFIX):
                    lines.put(line[len(PREFIX):])
                else:
                    log.write(line)
                    log.flush()
        lines.put(None)

    def _last_words(self) -> str:
        try:
            lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no output"
        return lines[-1] if lines else "no output"


# ----------------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------------


def _summary_line(w: dict[str, Any]) -> str:
    """One console line for a finished workload."""
    d = derived(w)
    parts = [f"eager {_eager_cell(w)}" + (f" (pred/meas {d['eager_prediction_ratio']:.3f})"
                                           if d["eager_prediction_ratio"] else "")]
    if w.get("memplan_peak") is not None:
        parts.append(f"memplan {format_bytes(w['memplan_peak'])}"
                     + (f" (pred/meas {d['memplan_prediction_ratio']:.3f})" if d["memplan_prediction_ratio"] else ""))
    if d["reduction"]:
        parts.append(f"{d['reduction']:.2f}x lower")
    if d["time_ratio"]:
        parts.append(f"step time {d['time_ratio']:.2f}x eager's")
    if w.get("verify"):
        parts.append(f"verify: {w['verify']}")
    text = f"{w['name']}: " + ", ".join(parts)
    return text + ("" if w["status"] == "ok" else f" -- {w['status'].upper()}: " + "; ".join(w.get("failures", [])))


def _compile_line(w: dict[str, Any]) -> str:
    c = w["compile"]
    if c["status"] != "ok":
        return f"{w['name']}, torch.compile: {c['status']}" + (f": {c['note']}" if c.get("note") else "")
    d = derived(w)
    text = f"{w['name']}, torch.compile: {_bytes(c.get('peak'))}, first step {c.get('compile_seconds', 0):.1f} s"
    return text + (f", step time {d['compile_time_ratio']:.2f}x eager's" if d["compile_time_ratio"] else "")


class Check:
    """Runs stages (2)-(5) against the clock of ``run``, writing the record after every figure."""

    def __init__(self, run: Run, args: argparse.Namespace, worker: Worker):
        self.run, self.args, self.worker = run, args, worker
        self.pytest = PytestStage(run, args)
        self.task_ids = 0

    def __call__(self) -> None:
        self.pytest.start()
        self.run.write()
        for name in self.args.names:
            self._memplan(name)
        self._offload()
        for name in self._compile_order():
            self._compile(name)
        self.pytest.wait()

    def stop(self, kill: bool = False) -> None:
        self.pytest.stop()
        self.worker.stop(kill=kill)

    # -- tasks -----------------------------------------------------------------------------------

    def _ready(self) -> None:
        """A live worker, started if needed (:class:`SetupError` when none will start)."""
        if self.worker.alive():
            return
        hello = self.worker.start(min(WORKER_START_SECONDS, max(self.run.left(), 1.0)), self.pytest.poll)
        device = self.run.record["device"]
        first = "free" not in device
        device.update({key: value for key, value in hello.items() if key != "device_name"}, name=hello["device_name"])
        if first:
            free = f", {format_bytes(hello['free'])} free" if hello.get("free") is not None else ""
            self.run.say(f"worker ready on {hello['device_name']}{free}")
        self.run.write()

    def _limit(self, stage_limit: float) -> float | None:
        """Seconds for the next task: its own limit within what is left of the budget; None when too little is."""
        left = self.run.left()
        return min(stage_limit, left) if left >= MIN_STAGE_SECONDS else None

    def _task(self, kind: str, name: str, stage_limit: float, on_update: Callable[[dict[str, Any]], None],
              extra: dict[str, Any]) -> tuple[str, float] | None:
        """Run one task; ``(outcome, limit)``, or None when it could not start for lack of time."""
        if self._limit(stage_limit) is None:
            return None
        self._ready()
        limit = self._limit(stage_limit)
        if limit is None:
            return None
        self.task_ids += 1
        spec = {"id": self.task_ids, "kind": kind, "workload": name, "size": self.args.size,
                "device": self.args.device, "repeats": self.args.repeats, "free_memory": self.args.free_memory,
                **extra}
        return self.worker.run(spec, limit, self.pytest.poll, on_update), limit

    def _memplan(self, name: str) -> None:
        w = self.run.workload(name)
        w.update(status="running", started=_now())
        start = time.monotonic()

        def on_update(fields: dict[str, Any]) -> None:
            w.update(fields)
            self.run.write()

        result = self._task("memplan", name, self.args.workload_limit, on_update, {})
        w["task_seconds"] = round(time.monotonic() - start, 2)
        if result is None:
            w.update(status="skipped", note=f"skipped: out of time ({self.run.left():.0f} s of the budget left)")
            self.run.say(f"{name}: skipped, out of time")
            self.run.write()
            return
        outcome, limit = result
        if w.get("timed_out"):
            w.setdefault("error", f"TaskTimeout: {w['timed_out']}")
            w.setdefault("error_phase", w.get("phase"))
        elif outcome != "done":
            w.setdefault("error", self._lost(outcome, limit, w.get("phase")))
            w.setdefault("error_phase", w.get("phase"))
        if w.get("error"):
            self.worker.stop()  # the worker exits after an error; a fresh one takes the next task
        w["failures"] = judge(w)
        w["status"] = "failed" if w["failures"] else "ok"
        self.run.say(_summary_line(w))
        self.run.write()

    def _compile_order(self) -> list[str]:
        """Smallest captured graph first (see the module docstring); workloads without a count last, in order."""
        nodes = {name: self.run.workload(name).get("graph_nodes") for name in self.args.names}
        return sorted(self.args.names, key=lambda n: (nodes[n] is None, nodes[n] or 0))

    def _begin(self, record: dict[str, Any], limit: float, option: str) -> Callable[[dict[str, Any]], None] | None:
        """Mark a stage's ``record`` running and return the callback that files its figures there; None (the
        stage marked skipped) when its ``option`` set its limit to 0."""
        if limit <= 0:
            record.update(status="skipped", note=f"{option} 0")
            self.run.write()
            return None
        record.update(status="running", started=_now())

        def on_update(fields: dict[str, Any]) -> None:
            record.update(fields)
            self.run.write()

        return on_update

    def _compile(self, name: str) -> None:
        w = self.run.workload(name)
        c = w["compile"]
        on_update = self._begin(c, self.args.compile_limit, "--compile-limit")
        if on_update is None:
            return
        start = time.monotonic()
        extra = {"eager_fits": w.get("eager_fits"), "compile_backend": self.args.compile_backend,
                 "activation_memory_budget": self.args.activation_memory_budget}
        result = self._task("compile", name, self.args.compile_limit, on_update, extra)
        c["task_seconds"] = round(time.monotonic() - start, 2)
        if result is None:
            c.update(status="skipped", note=f"out of time ({self.run.left():.0f} s of the budget left)")
        else:
            outcome, limit = result
            phase = c.get("phase")
            if c.get("timed_out") or outcome == "killed":
                compiling = phase in (None, "building", "predicting", "compiling")
                c.update(status="skipped", note=f"{'did not compile' if compiling else f'was still {phase}'} "
                                                f"within {limit:.0f} s")
            elif c.get("error"):
                c.update(status="failed", note=f"raised {c['error']} (during {c.get('error_phase')})")
                self.worker.stop()
            elif outcome == "died":
                c.update(status="skipped", note=self._lost(outcome, limit, phase))
            elif c["status"] == "running":
                c.update(status="failed", note="no figure came back")
        if c["status"] == "failed":
            w["failures"] = [*w.get("failures", []), f"torch.compile task: {c.get('note')}"]
            w["status"] = "failed"
        self.run.say(_compile_line(w))
        self.run.write()

    def _offload(self) -> None:
        o = self.run.record["offload"]
        on_update = self._begin(o, self.args.offload_limit, "--offload-limit")
        if on_update is None:
            return
        start = time.monotonic()
        result = self._task("offload", o["name"], self.args.offload_limit, on_update, {})
        o["task_seconds"] = round(time.monotonic() - start, 2)
        if result is None:
            o.update(status="skipped", note=f"out of time ({self.run.left():.0f} s of the budget left)")
        else:
            outcome, limit = result
            if o.get("timed_out"):
                o.setdefault("error", f"TaskTimeout: {o['timed_out']}")
            elif outcome != "done":
                o.setdefault("error", self._lost(outcome, limit, o.get("phase")))
            if o.get("error"):
                self.worker.stop()
            o["failures"] = judge_offload(o)
            o["status"] = "failed" if o["failures"] else "ok"
        self.run.say(f"offload ({o['name']}): {o['status']}" + "".join(f"; {f}" for f in o.get("failures", [])))
        self.run.write()

    def _lost(self, outcome: str, limit: float, phase: str | None) -> str:
        if outcome == "killed":
            return f"killed {self.worker.grace:.0f} s after its {limit:.0f} s limit, during {phase}"
        code = self.worker.exit_code()
        self.worker.stop()
        return f"the worker died (exit code {code}) during {phase}; see cuda_check.log"


def _exit_code(record: dict[str, Any]) -> int:
    """0, 1 or 3 as the module docstring says, from the finished record."""
    workloads = record["workloads"]
    failed = record["pytest"]["status"] == "failed" or any(w["status"] == "failed" for w in workloads) \
        or record.get("offload", {}).get("status") == "failed"
    if failed:
        return 1
    skipped = record["pytest"]["status"] == "skipped" and record["pytest"].get("note") != "--no-pytest"
    return 3 if skipped or any(w["status"] == "skipped" for w in workloads) else 0


def _write_or_say(run: Run) -> bool:
    """Write the record; False, after one line saying why, when the folder cannot be written."""
    try:
        run.write()
    except OSError as exc:
        print(f"cuda_check: cannot write to {run.out}: {exc}", file=sys.stderr, flush=True)
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    run = Run(args, argv)
    try:
        run.record["device"].update(_device(args))
    except SetupError as exc:
        print(f"cuda_check: {exc}", file=sys.stderr, flush=True)
        run.record.update(status=f"could not run: {exc}", finished=_now(), exit_code=2)
        _write_or_say(run)
        return 2
    if not _write_or_say(run):
        return 2
    device = run.record["device"]
    print(f"cuda_check: {device['name']}, torch {device['torch']}, CUDA {device['cuda'] or '-'}; "
          f"budget {args.budget_seconds:.0f} s; writing {run.out}/cuda_check.{{json,md}}", flush=True)
    run.record["commit"] = _commit()

    def on_signal(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    worker = Worker([sys.executable, str(WORKER), args.device], run.out / "cuda_check.log")
    check = Check(run, args, worker)
    code = 0
    try:
        check()
        run.record["status"] = "finished"
        code = _exit_code(run.record)
    except Interrupted as exc:
        run.record["status"] = f"interrupted by {exc}"
        code = 128 + exc.signum
    except SetupError as exc:
        run.record["status"] = f"could not run: {exc}"
        print(f"cuda_check: {exc}", file=sys.stderr, flush=True)
        code = 2
    finally:
        for s in previous:  # a second signal must not cut the last write short
            signal.signal(s, signal.SIG_IGN)
        check.stop(kill=run.record["status"] != "finished")
        for w in run.record["workloads"]:
            if w["status"] == "pending":
                w.update(status="skipped", note="not run: the check ended first")
            elif w["status"] == "running":
                w.update(status="interrupted", note="the check ended while it ran")
            if w["compile"]["status"] == "pending":
                w["compile"].update(status="skipped", note="not run: the check ended first")
            elif w["compile"]["status"] == "running":
                w["compile"].update(status="interrupted", note="the check ended while it ran")
        offload_ = run.record["offload"]
        if offload_["status"] == "pending":
            offload_.update(status="skipped", note="not run: the check ended first")
        elif offload_["status"] == "running":
            offload_.update(status="interrupted", note="the check ended while it ran")
        run.record["failures"] = [f"{w['name']}: {f}" for w in run.record["workloads"] for f in w.get("failures", [])]
        run.record["failures"] += [f"offload: {f}" for f in offload_.get("failures", [])]
        run.record.update(finished=_now(), exit_code=code)
        run.write()
        for s, handler in previous.items():
            signal.signal(s, handler)
    verdict = {0: "every check held", 1: "FAILED: " + "; ".join(run.record["failures"] or ["see the record"]),
               3: "incomplete: out of time before every stage ran"}.get(code, run.record["status"])
    print(f"cuda_check: {verdict} ({run.elapsed():.0f} s); {run.out}/cuda_check.md", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
