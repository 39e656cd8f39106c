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

        result = run_bench(names, size=args.size, device=args.device, modes=modes, repeats=args.repeats, progress=advance)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        Console().print(result)
    if args.check:
        bad = [r for r in result.rows if abs(r.prediction_ratio - 1) > 0.05]
        for row in bad:
            print(f"prediction off by more than 5%: {row.workload} ({row.mode}) ratio {row.prediction_ratio:.3f}", file=sys.stderr)
        return 1 if bad else 0
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from rich.console import Console

    import memplan.examples as examples
    from memplan.analysis.memory import analyze

    if args.workload not in examples.WORKLOADS:
        print(f"memplan analyze: unknown workload {args.workload!r}; choose from {list(examples.WORKLOADS)}", file=sys.stderr)
        return 2
    w = examples.make(args.workload, size=args.size, device=args.device)
    result = analyze(w.model, *w.inputs, train=args.mode == "train")
    explanation = result.explain(top=args.top)
    if args.json:
        payload = {
            "workload": w.name,
            "mode": args.mode,
            "peak": result.peak,
            "saved_for_backward": result.saved.nbytes,
            "peak_node": explanation.peak_node,
            "tensors": [
                {
                    "bytes": t.nbytes, "shape": list(t.shape), "dtype": str(t.dtype), "op": t.op, "node": t.node,
                    "source": str(t.source) if t.source else None, "reason": t.reason, "provenance": t.provenance,
                }
                for t in explanation.tensors
            ],
        }
        print(json.dumps(payload, indent=2))
    else:
        console = Console()
        console.print(repr(result))
        console.print(explanation)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memplan", description="Memory planning for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure and predict the peak of each example workload")
    bench.add_argument("workloads", nargs="*", help="workload names (default: all)")
    bench.add_argument("--size", choices=("small", "full"), default="small", help="CPU defaults or the reports' full sizes")
    bench.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    bench.add_argument("--mode", choices=("train", "infer", "both"), default="both")
    bench.add_argument("--repeats", type=int, default=3, help="timed repetitions per row (median)")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.add_argument("--check", action="store_true", help="exit 1 if a prediction is off by more than 5%%")
    bench.set_defaults(func=_bench)

    an = sub.add_parser("analyze", help="explain where an example workload's memory goes")
    an.add_argument("workload")
    an.add_argument("--size", choices=("small", "full"), default="small")
    an.add_argument("--device", default="cpu")
    an.add_argument("--mode", choices=("train", "infer"), default="train")
    an.add_argument("--top", type=int, default=10)
    an.add_argument("--json", action="store_true")
    an.set_defaults(func=_analyze)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
