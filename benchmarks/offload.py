"""Offload predicted for a GPU, from any machine: what moving saved activations to host memory would give.

For each model, three plans for CUDA are made here (no GPU needed; see ``memplan.optimize(device=...)``):
memplan with the ``offload`` pass off (``kept``), on without a budget (``offload``: the lowest peak within
``max_overhead``), and recomputation alone under a budget of the offload plan's peak (``recompute``). Each
row is the plan's predicted peak and its predicted step time over eager's, priced with the reference CUDA
rates (``REFERENCE_CUDA_RATES``: an H100, its host link assumed at 20 GB/s). These are predictions, not
measurements: ``benchmarks/cuda_check.py`` measures the same three plans on a GPU (its offload stage).

    python benchmarks/offload.py                 # the deep MLP of the CUDA check and three examples, full size
    python benchmarks/offload.py --size small    # smaller
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import memplan  # noqa: E402
import memplan.examples as examples  # noqa: E402
from memplan.analysis.peak import step_margin  # noqa: E402
from memplan.errors import InfeasibleBudgetError  # noqa: E402
from memplan.measure import format_bytes  # noqa: E402
from memplan.ops import offload  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from cuda_check_worker import offload_workload  # noqa: E402


def plans(model: torch.nn.Module, inputs: tuple) -> list[tuple[str, str]]:
    """``(label, row text)`` of the three plans (see the module docstring)."""
    rows = []
    variants = [("kept", {"offload.when": "never"}, None), ("offload", {"offload.when": "always"}, None)]
    while variants:
        label, options, budget = variants.pop(0)
        start = time.perf_counter()
        try:
            plan = memplan.optimize(model, device="cuda", budget=budget, options=options).plan_for(*inputs)
        except InfeasibleBudgetError as exc:
            rows.append((label, f"not reached: {str(exc).split(':')[1].split('(')[0].strip()}"))
            continue
        peak = plan.planned_peak + step_margin(plan.graph)
        moved = [n for n in plan.graph.gm.graph.nodes if n.target is offload]
        moved_bytes = sum(n.args[0].meta["val"].nbytes for n in moved)
        rows.append((label, f"{format_bytes(plan.eager_peak)} | {format_bytes(peak)} | {plan.plan_time / plan.eager_time:.2f}x | "
                            f"{len(moved)} ({format_bytes(moved_bytes)}) | {time.perf_counter() - start:.1f} s"))
        if label == "offload" and moved:
            variants.append(("recompute", {"offload.when": "never"}, peak))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=examples.SIZES, default="full")
    parser.add_argument("--workloads", default="deep_mlp,chain_product,broadcast_matmul,seq2seq")
    args = parser.parse_args()
    print(f"Predicted for CUDA (reference CUDA rates), `{args.size}` sizes, planned on this machine's CPU:\n")
    print("| model | plan | eager peak (predicted) | planned peak | predicted step time / eager | moved to host | planning |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        if name == "deep_mlp":
            model, inputs = offload_workload(args.size, torch.device("meta"))
        else:
            workload = examples.make(name, size=args.size, device="meta")
            model, inputs = workload.model, workload.inputs
        for label, row in plans(model, inputs):
            print(f"| {name} | {label} | {row} |", flush=True)


if __name__ == "__main__":
    main()
