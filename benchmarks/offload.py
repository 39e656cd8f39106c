"""Offload predicted for a GPU, from any machine: what moving saved activations to host memory would give.

For each model, memplan's budget ladder (the plans a budget chooses among, from the least extra time to the
lowest peak: :meth:`memplan.pipeline.PassManager.ladder`) is built for CUDA here, no GPU needed, with the
``offload`` pass on and off. Each row is a rung that moves saved activations to host memory: its predicted
peak and step time over eager's, and, without offload, the fastest rung at or below that peak. Times are
priced with the reference CUDA rates (``REFERENCE_CUDA_RATES``: an H100, its host link assumed at 20 GB/s).
These are predictions, not measurements: ``benchmarks/cuda_check.py`` measures offload on a GPU (its
offload stage).

    python benchmarks/offload.py                 # the deep MLP of the CUDA check and three examples, full size
    python benchmarks/offload.py --size small    # smaller
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import memplan  # noqa: E402
import memplan.examples as examples  # noqa: E402
from memplan.api import DEFAULT_PIPELINE  # noqa: E402
from memplan.capture import capture  # noqa: E402
from memplan.measure import format_bytes  # noqa: E402
from memplan.ops import offload  # noqa: E402
from memplan.pipeline import PassManager  # noqa: E402
from memplan.policy import Policy  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from cuda_check_worker import offload_workload  # noqa: E402


def ladders(model: torch.nn.Module, inputs: tuple) -> list[str]:
    """Rows for the rungs of the budget ladder where offload moves tensors (see the module docstring)."""
    graph = capture(model, *inputs, seed="tangents", target_device="cuda")
    rungs = {}
    for when in ("never", "budget"):
        manager = PassManager(DEFAULT_PIPELINE, Policy(budget=1), options={"offload.when": when})
        rungs[when] = [(peak, result.plan_time / result.eager_time, result)
                       for result, peak in manager.ladder(graph)]
    rows = []
    for peak, ratio, result in rungs["budget"]:
        moved = [n for n in result.graph.gm.graph.nodes if n.target is offload]
        if not moved:
            continue
        moved_bytes = sum(n.args[0].meta["val"].nbytes for n in moved)
        fitting = min(((p, r) for p, r, _ in rungs["never"] if p <= peak), key=lambda pr: pr[1], default=None)
        without = "no plan fits" if fitting is None else f"{format_bytes(fitting[0])} at {fitting[1]:.2f}x"
        rows.append(f"{format_bytes(peak)} at {ratio:.2f}x | {len(moved)} ({format_bytes(moved_bytes)}) | {without}")
    if not rows:
        lowest = rungs["budget"][-1]
        rows.append(f"no rung moves a tensor (lowest rung {format_bytes(lowest[0])} at {lowest[1]:.2f}x) | - | -")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=examples.SIZES, default="full")
    parser.add_argument("--workloads", default="deep_mlp,chain_product,broadcast_matmul")
    args = parser.parse_args()
    print(f"Predicted for CUDA (reference CUDA rates), `{args.size}` sizes, planned on this machine's CPU:\n")
    print("| model | eager peak (predicted) | a rung with offload: peak, step time / eager | moved to host "
          "| without offload, the fastest rung at or below that peak |")
    print("|---|---|---|---|---|")
    for name in args.workloads.split(","):
        if name == "deep_mlp":
            model, inputs = offload_workload(args.size, torch.device("meta"))
        else:
            workload = examples.make(name, size=args.size, device="meta")
            model, inputs = workload.model, workload.inputs
        eager = memplan.analyze(model, *inputs, device="cuda").peak
        for row in ladders(model, inputs):
            print(f"| {name} | {format_bytes(eager)} | {row} |", flush=True)


if __name__ == "__main__":
    main()
