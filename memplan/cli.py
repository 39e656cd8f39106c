"""memplan's command line: ``memplan bench`` and ``memplan analyze``.

Exit codes: 0 on success, 1 when a check fails (e.g. ``--check`` finds a prediction off by more than
5%), 2 for usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    import memplan.examples as examples
    from memplan.bench import run_bench

    names = args.workloads or list(examples.WORKLOADS)
    unknown = [n for n in names if n not in examples.WORKLOADS]
    if unknown:
        print(f"memplan bench: unknown workload(s) {unknown}; choose from {list(examples.WORKLOADS)}", file=sys.stderr)
        return 2
    modes = ("train", "infer") if args.mode == "both" else (args.mode,)
    err = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=err, transient=True, disable=args.json or not err.is_terminal,
    ) as progress:
        task = progress.add_task("bench", total=len(names) * len(modes))

        def advance(label: str) -> None:
            progress.update(task, description=label)
            progress.advance(task)

        passes = None if args.eager_only else args.passes
        result = run_bench(
            names, size=args.size, device=args.device, modes=modes, repeats=args.repeats, passes=passes,
            baselines=not (args.eager_only or args.no_baselines), progress=advance,
        )
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        out = Console()
        if not out.is_terminal:  # piped or redirected: rich would squeeze the table into 80 columns
            out = Console(width=max(out.width, 100))
        out.print(result)
    if args.check:
        bad = [r for r in result.rows if abs(r.prediction_ratio - 1) > 0.05]
        for row in bad:
            print(f"prediction off by more than 5%: {row.workload} ({row.mode}) ratio {row.prediction_ratio:.3f}", file=sys.stderr)
        return 1 if bad else 0
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from rich.console import Console

    from memplan.analysis.explain_text import torch_line
    from memplan.analyze import analyze
    from memplan.policy import parse_bytes

    if args.snapshot is not None:
        _check_directory("analyze", args.snapshot)
    try:
        capacity = parse_bytes(args.capacity) if args.capacity is not None else None
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"memplan analyze: --capacity {args.capacity!r}: {exc}") from None
    name, build, batched = _builder(args.workload, size=args.size, device=args.device)
    model, inputs = build()
    train = args.mode == "train"
    result = analyze(model, *inputs, train=train, device=args.device)
    explanation = result.explain(top=args.top)
    report = _fit_report(model, inputs, batched, args.device, capacity, train) if capacity is not None else None
    if args.snapshot is not None:
        path = result.save_snapshot(args.snapshot)
        print(f"memory snapshot written to {path} (open it at {MEMORY_VIZ})", file=sys.stderr)
    if args.json:
        payload = {
            "workload": name,
            "mode": args.mode,
            "device": str(result.device),
            "peak": result.peak,
            "saved_for_backward": result.saved.nbytes,
            "peak_node": explanation.peak_node,
            "diagnosis": explanation.diagnosis,
            "kinds": [{"kind": k.kind, "count": k.count, "bytes": k.nbytes, "in_peak": k.share is not None}
                      for k in explanation.kinds],
            "modules": [{"module": m.path, "depth": m.depth, "count": m.count, "bytes": m.nbytes}
                        for m in explanation.modules],
            "lines": [
                {"source": str(line.source) if line.source else None,
                 "library_source": torch_line(line.library_source) if line.library_source else None,
                 "count": line.count, "bytes": line.nbytes}
                for line in explanation.lines
            ],
            "tensors": [
                {
                    "bytes": t.nbytes, "shape": list(t.shape), "dtype": str(t.dtype), "op": t.op, "node": t.node,
                    "source": str(t.source) if t.source else None, "reason": t.reason, "provenance": t.provenance,
                    "module": t.module, "kind": t.kind,
                }
                for t in explanation.tensors
            ],
        }
        if report is not None:
            payload["fit"] = report.as_dict()
        print(json.dumps(payload, indent=2))
    else:
        console = Console()
        console.print(repr(result))
        console.print(explanation)
        if report is not None:
            print("\n".join(report.lines()))
    return 0


def _fit_report(model, inputs, batched, device: str, capacity: int, train: bool):
    """:func:`memplan.fit.fit` of the target, and its largest batch when its factory takes ``batch``."""
    import dataclasses

    from memplan.fit import fit, largest_batch

    report = fit(model, *inputs, device=device, capacity=capacity, train=train)
    if batched is not None:
        batch = largest_batch(batched, device=device, capacity=capacity, train=train)
        report = dataclasses.replace(report, batch=batch)
    return report


def load_target(spec: str, size: str = "small", device: str = "cpu"):
    """``(name, model, inputs)`` from an example name or ``path/to/file.py:factory``.

    The factory is called with no arguments and returns ``(model, inputs)``, inputs a tuple of tensors.
    For a CUDA device on a machine without one, the model and inputs are built on the meta device (they
    are planned for CUDA over fake tensors: see :func:`memplan.analyze`), so nothing big is allocated.
    """
    name, build, _ = _builder(spec, size=size, device=device)
    model, inputs = build()
    return name, model, inputs


def _build_device(device: str) -> str:
    """Where to build a target planned for ``device``: the meta device for CUDA without a usable GPU."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise SystemExit(f"memplan: unknown device {device!r}; give cpu, cuda or cuda:N") from None
    return "meta" if kind == "cuda" and not torch.cuda.is_available() else device


def _builder(spec: str, size: str = "small", device: str = "cpu"):
    """``(name, build, batched)``: ``build()`` gives ``(model, inputs)``; ``batched(b)`` gives them at batch
    size ``b`` when the factory takes a ``batch`` keyword (else None)."""
    import contextlib
    import importlib.util
    import inspect
    import pathlib

    import torch

    import memplan.examples as examples

    where = _build_device(device)
    if spec in examples.WORKLOADS:
        def build_example():
            w = examples.make(spec, size=size, device=where)
            return w.model, w.inputs

        return spec, build_example, None
    path, sep, attr = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise SystemExit(
            f"memplan: {spec!r} is neither an example ({', '.join(examples.WORKLOADS)}) nor FILE.py:FACTORY"
        )
    file = pathlib.Path(path)
    if not file.exists():
        raise SystemExit(f"memplan: no such file {path}")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    factory = getattr(module, attr, None)
    if factory is None:
        raise SystemExit(f"memplan: {path} has no {attr!r}; define def {attr}(): return model, (inputs, ...)")

    def build(**kwargs):
        # built on the meta device where it is planned for a device this machine lacks: nothing big is allocated
        with torch.device(where) if where == "meta" else contextlib.nullcontext():
            made = factory(**kwargs)
        if not (isinstance(made, tuple) and len(made) == 2):
            raise SystemExit(f"memplan: {attr}() must return (model, inputs), got {type(made).__name__}")
        model, inputs = made
        if not isinstance(inputs, (tuple, list)):
            inputs = (inputs,)
        return model, tuple(inputs)

    try:
        takes_batch = "batch" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_batch = False
    return f"{file.name}:{attr}", build, (lambda batch: build(batch=batch)) if takes_batch else None


#: PyTorch's memory visualizer, which opens the snapshots ``--snapshot`` writes.
MEMORY_VIZ = "https://pytorch.org/memory_viz"


def _check_directory(command: str, path: str) -> None:
    """Exit with a message when ``path``'s directory does not exist: said before planning, which can take
    a while."""
    import pathlib

    parent = pathlib.Path(path).parent
    if not parent.is_dir():
        raise SystemExit(f"memplan {command}: cannot write {path}: no such directory {parent}")


def _report(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from memplan.api import optimize
    from memplan.report.snapshot import snapshot_paths
    from memplan.steps import step_fn

    _check_directory("report", args.out)
    if args.snapshot is not None:
        _check_directory("report", args.snapshot)
    name, model, inputs = load_target(args.target, size=args.size, device=args.device)
    planned_only = _build_device(args.device) != args.device  # for a GPU this machine lacks: plan, do not run
    opt = optimize(model, passes=args.passes if args.passes != "default" else None,
                   device=args.device if planned_only else None)
    if planned_only:
        with torch.enable_grad() if args.mode == "train" else torch.no_grad():
            opt.plan_for(*inputs)
    else:
        step_fn(opt, inputs, train=args.mode == "train")()
    title = f"memplan report: {name} ({args.mode})" + (f", predicted for {opt.target_device}" if planned_only else "")
    report = opt.report(title=title)
    path = report.save_html(args.out)
    plan = opt.plan
    console = Console(stderr=True)
    console.print(plan.headline())
    console.print(f"report written to {path}")
    if args.snapshot is not None:
        eager_path, plan_path = snapshot_paths(args.snapshot)
        plan.save_snapshot(eager_path, which="eager")
        plan.save_snapshot(plan_path, which="plan")
        console.print(f"memory snapshots written to {eager_path} (as written) and {plan_path} (the plan); "
                      f"open them at {MEMORY_VIZ}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memplan", description="Memory planning for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure and predict the peak of each example workload")
    bench.add_argument("workloads", nargs="*", help="workload names (default: all)")
    bench.add_argument("--size", choices=("small", "full"), default="small", help="CPU defaults or the reports' full sizes")
    bench.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    bench.add_argument("--mode", choices=("train", "infer", "both"), default="both")
    bench.add_argument("--repeats", type=int, default=5,
                       help="timed repetitions per row (median of alternating blocks of consecutive steps)")
    bench.add_argument("--passes", default="default", help='memplan pipeline to compare with eager ("default", "" or e.g. "remat,inplace")')
    bench.add_argument("--eager-only", action="store_true", help="measure and predict eager only")
    bench.add_argument("--no-baselines", action="store_true",
                       help="skip the hand-written fixes (memplan.baselines) run beside eager and memplan in training")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.add_argument("--check", action="store_true", help="exit 1 if a prediction is off by more than 5%%")
    bench.set_defaults(func=_bench)

    an = sub.add_parser("analyze", help="explain where a model's memory goes; with --capacity, whether it fits")
    an.add_argument("workload", help="an example name, or FILE.py:FACTORY where FACTORY() returns (model, inputs)")
    an.add_argument("--size", choices=("small", "full"), default="small")
    an.add_argument("--device", default="cpu",
                    help="the device to predict for: cpu, cuda, cuda:N (on a machine without a GPU too: a prediction, "
                         "over fake tensors, with CUDA's caching allocator modelled)")
    an.add_argument("--capacity", metavar="BYTES", default=None,
                    help="the device's memory (80GiB, 24GB): say whether the step fits, as written, with memplan's "
                         "default plan and with its smallest, and the largest batch that fits when FACTORY takes batch=")
    an.add_argument("--mode", choices=("train", "infer"), default="train")
    an.add_argument("--top", type=int, default=10)
    an.add_argument("--json", action="store_true")
    an.add_argument("--snapshot", metavar="PATH", default=None,
                    help=f"also write the predicted timeline as a PyTorch memory snapshot (pickle) for {MEMORY_VIZ}")
    an.set_defaults(func=_analyze)

    rep = sub.add_parser("report", help="write an HTML memory report of an example or of your model")
    rep.add_argument("target", help="an example name, or FILE.py:FACTORY where FACTORY() returns (model, inputs)")
    rep.add_argument("--out", default="memplan-report.html")
    rep.add_argument("--size", choices=("small", "full"), default="small")
    rep.add_argument("--device", default="cpu",
                     help="cpu, cuda, cuda:N; cuda on a machine without a GPU plans for it over fake tensors, "
                          "runs nothing")
    rep.add_argument("--mode", choices=("train", "infer"), default="train")
    rep.add_argument("--passes", default="default", help='pipeline to plan with ("default", "" or e.g. "remat,inplace")')
    rep.add_argument("--snapshot", metavar="PATH", default=None,
                     help="also write PyTorch memory snapshots of both timelines: PATH with .eager and .plan put "
                          f"before its extension (out.pickle: out.eager.pickle, out.plan.pickle), for {MEMORY_VIZ}")
    rep.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from memplan.errors import MemplanError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MemplanError as exc:  # the model's or the budget's problem, said with its fix: no traceback
        print(f"memplan {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
