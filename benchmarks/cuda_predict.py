"""What each example's training step needs on a CUDA GPU, predicted on a machine without one.

``python benchmarks/cuda_predict.py [--size full] [--capacity 80GiB] [--out DIR]`` builds each example workload
(:mod:`memplan.examples`) on the meta device (nothing big is allocated), captures its training step for
``cuda:0`` over fake tensors (:func:`memplan.fit.capture_step`; see :mod:`memplan._capture.target` for what a
CPU-only build plans as CUDA runs it), and prices it with the CUDA caching allocator's model
(:mod:`memplan.analysis.allocator`): the parameters, buffers and inputs resident before the step, the
step's peak as written (eager), with memplan's default plan and with the smallest plan memplan reaches
(the lowest rung of the budget ladder), each plus the cuBLAS workspace against the capacity. Nothing runs:
these are predictions, for ``benchmarks/cuda_check.py`` to measure on a GPU.

Each workload is planned in a process of its own with a time limit (``--limit``, 900 s by default): a
workload not planned in time is reported as such, with what was predicted before the limit (its eager peak
is a capture, seconds).

Files: ``DIR/cuda_predict.json`` (every figure in bytes and seconds, torch's version, the settings) and
``DIR/cuda_predict.md`` (the table ``docs/benchmarks.md`` quotes), rewritten after each workload.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the memplan of this tree, not another installed one
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import memplan.examples as examples  # noqa: E402
from memplan.measure import format_bytes  # noqa: E402
from memplan.policy import parse_bytes  # noqa: E402

PREFIX = "@cuda_predict "


def _one(name: str, size: str, device: str, stage: str) -> None:
    """Print (prefixed JSON lines) what one workload needs: the eager figures first, then the plans."""
    from memplan.fit import capture_step, needs_of

    torch.set_num_threads(1)
    start = time.perf_counter()
    workload = examples.make(name, size=size, device="meta")
    graph = capture_step(workload.model, workload.inputs, device, train=True)
    eager = needs_of(graph, plans=False)
    nodes = sum(1 for _ in graph.gm.graph.nodes)
    capture_seconds = time.perf_counter() - start
    # the same step predicted for the CPU (exact bytes, the CPU's kernels), for comparison
    cpu = needs_of(capture_step(workload.model, workload.inputs, "cpu", train=True), plans=False)
    print(PREFIX + json.dumps({"stage": "eager", "description": workload.description, "nodes": nodes,
                               "capture_seconds": capture_seconds, "cpu_eager": cpu.eager, **eager.__dict__}),
          flush=True)
    if stage == "eager":
        return
    start = time.perf_counter()
    planned = needs_of(graph, plans=True)
    print(PREFIX + json.dumps({"stage": "plans", "plan_seconds": time.perf_counter() - start,
                               **planned.__dict__}), flush=True)


def _run(name: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--one", name, "--size", args.size, "--device", args.device]
    row: dict = {"workload": name}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.limit)
        out, err, timed_out = done.stdout, done.stderr, False
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, timed_out = "", True
    for line in out.splitlines():
        if line.startswith(PREFIX):
            row.update(json.loads(line[len(PREFIX):]))
    row["seconds"] = time.perf_counter() - start
    if timed_out:
        row["note"] = f"not planned within {args.limit:.0f} s on this CPU"
    elif "smallest" not in row or row.get("smallest") is None:
        last = (err.strip().splitlines() or ["no output"])[-1]
        row["note"] = f"failed: {last}"
    return row


def _cell(row: dict, key: str, capacity: int) -> str:
    peak = row.get(key)
    if peak is None:
        return "—"
    total = row["resident"] + row["workspace"] + peak
    return f"{format_bytes(peak)} ({'fits' if total <= capacity else 'does not fit'})"


def render_markdown(rows: list[dict], args: argparse.Namespace, capacity: int) -> str:
    lines = [
        f"Predicted on a machine without a GPU (torch {torch.__version__}), for `{args.device}`, `--size {args.size}`, "
        f"training step; fits = resident + peak + cuBLAS workspaces within {format_bytes(capacity)}.",
        "",
        "| workload | resident (params, inputs) | eager peak | memplan default plan | memplan smallest plan | "
        "eager peak predicted for the CPU | nodes | planned in |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        resident = format_bytes(row["resident"]) if "resident" in row else "—"
        cpu = format_bytes(row["cpu_eager"]) if "cpu_eager" in row else "—"
        seconds = f"{row['plan_seconds']:.0f} s" if "plan_seconds" in row else row.get("note", "—")
        lines.append(f"| {row['workload']} | {resident} | {_cell(row, 'eager', capacity)} | "
                     f"{_cell(row, 'default', capacity)} | {_cell(row, 'smallest', capacity)} | {cpu} | "
                     f"{row.get('nodes', '—')} | {seconds} |")
    notes = [f"- {row['workload']}: {row['note']}" for row in rows if "note" in row]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=examples.SIZES, default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--capacity", default="80GiB")
    parser.add_argument("--workloads", nargs="*", default=list(examples.WORKLOADS))
    parser.add_argument("--limit", type=float, default=900.0, help="seconds to plan one workload")
    parser.add_argument("--out", default=".")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--stage", default="plans", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(args.one, args.size, args.device, args.stage)
        return 0
    capacity = parse_bytes(args.capacity)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.workloads:
        rows.append(_run(name, args))
        print(f"{name}: {rows[-1]}", file=sys.stderr)
        payload = {"prediction": True, "torch": torch.__version__, "device": args.device, "size": args.size,
                   "capacity": capacity, "rows": rows}
        (out / "cuda_predict.json").write_text(json.dumps(payload, indent=1))
        (out / "cuda_predict.md").write_text(render_markdown(rows, args, capacity))
    print(render_markdown(rows, args, capacity))
    return 0


if __name__ == "__main__":
    sys.exit(main())
