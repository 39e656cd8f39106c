"""The best hand-written versions of the workloads (``memplan.baselines``), side by side with eager and memplan.

Unlike ``memplan bench``, this script can time memplan with another pipeline, budget or overhead
allowance against the same baselines.

Run ``python benchmarks/hand_written.py [workload ...] [--size small|full] [--repeats N]`` to print
peak bytes (``memplan.measure`` on ``memplan.steps.step_fn(model, inputs, train=True)``) and step
times of eager, hand-written and ``memplan.optimize(model, passes=...)``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import memplan
import memplan.examples as examples
from memplan.baselines import BASELINES, hand_written
from memplan.measure import format_bytes, measure
from memplan.steps import step_fn
from memplan.testing import assert_equivalent

__all__ = ["compare", "main"]


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def compare(name: str, *, size: str = "small", passes: str = "rewrite,chunk", repeats: int = 5, check: bool = True,
            optimize_kwargs: dict | None = None) -> dict[str, Any]:
    """Peak bytes and best step time of eager, hand-written and memplan for workload ``name``."""
    w = examples.make(name, size=size)
    variants = {"eager": w.model, "hand": hand_written(name, w.model),
                "memplan": memplan.optimize(w.model, passes=passes, **(optimize_kwargs or {}))}
    if check:
        assert_equivalent(w.model, variants["hand"], *w.inputs, rtol=1e-4, atol=1e-4)
        assert_equivalent(w.model, variants["memplan"], *w.inputs, rtol=1e-4, atol=1e-4)
    steps = {k: step_fn(v, w.inputs, train=True) for k, v in variants.items()}
    for step in steps.values():
        step()  # warm up (memplan plans on its first call)
    peaks = {k: measure(step).peak for k, step in steps.items()}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):  # interleaved, so load on the machine affects all three alike
        for k, step in steps.items():
            times[k].append(_best_time(step, 1))
    plan = variants["memplan"].plan
    return {
        "workload": name,
        "size": size,
        "peak": peaks,
        "time": {k: min(v) for k, v in times.items()},
        "median_time": {k: statistics.median(v) for k, v in times.items()},
        "planned": plan.planned_peak,
        "plan": str(plan),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=[n for n in BASELINES if n != "latent_gru"])
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--passes", default="rewrite,chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-overhead", type=float, default=None)
    parser.add_argument("--budget", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable timings on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kwargs: dict[str, Any] = {}
    if args.max_overhead is not None:
        kwargs["max_overhead"] = args.max_overhead
    if args.budget is not None:
        kwargs["budget"] = args.budget
    for name in args.workloads:
        r = compare(name, size=args.size, passes=args.passes, repeats=args.repeats, optimize_kwargs=kwargs)
        eager = r["peak"]["eager"]
        print(f"{name} ({args.size}), pipeline {args.passes!r} {kwargs or ''}")
        for k in ("eager", "hand", "memplan"):
            peak, t = r["peak"][k], r["time"][k]
            print(f"  {k:8s} peak {format_bytes(peak):>11s} ({eager / peak:6.1f}x lower)  "
                  f"step {t * 1e3:8.1f} ms ({t / r['time']['eager']:.2f}x eager)")
        print(f"  planned peak {format_bytes(r['planned'])}")
        print("  " + r["plan"].replace("\n", "\n  "))


if __name__ == "__main__":
    main()
