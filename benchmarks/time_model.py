"""The time model against the clock: predicted and measured step times of eager and of memplan's plan.

memplan prices every plan with one time model (:mod:`memplan.analysis.cost`) and holds the whole plan to
``max_overhead`` of eager's predicted step time. This script shows how far those predictions are from
the measured times, for the example workloads and (with the ``zoo`` extra) the library zoo:

* eager's measured step (:func:`memplan.steps.step_fn` on the model) against
  :func:`~memplan.analysis.cost.eager_seconds` of its capture;
* the default plan's measured step against :func:`~memplan.analysis.cost.graph_cost` of its graph;
* the plan's time over eager's, measured and predicted: what ``max_overhead`` bounds.

Each with the reference rates and with the rates :func:`~memplan.analysis.cost.calibrate` measures on
this machine (the plan itself is made with the reference rates, the default, so both columns price the
same plan). Times are medians of interleaved blocks (:func:`memplan.bench.interleaved_medians`), on one
thread by default.

Run ``python benchmarks/time_model.py [--repeats 12] [--threads 1] [--zoo] [--size small]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import warnings

import torch

import memplan
from memplan.analysis.cost import REFERENCE_RATES, calibrate, eager_seconds, graph_cost
from memplan.bench import interleaved_medians
from memplan.examples import WORKLOADS, make
from memplan.steps import step_fn

__all__ = ["main", "rows"]

ZOO = pathlib.Path(__file__).resolve().parent.parent / "tests" / "zoo" / "test_library_models.py"


def _models(size: str, zoo: bool) -> list[tuple[str, torch.nn.Module, tuple]]:
    models = []
    for name in WORKLOADS:
        workload = make(name, size=size)
        models.append((name, workload.model, tuple(workload.inputs)))
    if zoo and importlib.util.find_spec("transformers") is not None:
        spec = importlib.util.spec_from_file_location("memplan_zoo_models", ZOO)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for factory in module.ALL:
            torch.manual_seed(0)
            model, inputs = factory()
            models.append((factory.__name__, model.train(), tuple(inputs)))
    return models


def rows(size: str = "small", zoo: bool = False, repeats: int = 12) -> list[dict]:
    """One dict per model: measured and predicted seconds of eager and of the plan, by both rates."""
    rates = {"reference": REFERENCE_RATES, "calibrated": calibrate("cpu")}
    out = []
    for name, model, inputs in _models(size, zoo):
        opt = memplan.optimize(model, rates="reference")
        eager_step, plan_step = step_fn(model, inputs, train=True), step_fn(opt, inputs, train=True)
        plan_step()
        eager, plan = interleaved_medians([eager_step, plan_step], repeats, torch.device("cpu"))
        row = {"model": name, "eager": eager, "plan": plan}
        for label, r in rates.items():
            row[f"{label} eager"] = eager_seconds(opt.plan.original, r)
            row[f"{label} plan"] = graph_cost(opt.plan.graph, r)
        out.append(row)
        print(_line(row), flush=True)
    return out


def _line(row: dict) -> str:
    cells = [f"{row['model']:22s}", f"{row['eager'] * 1e3:8.2f}", f"{row['plan'] * 1e3:8.2f}",
             f"{row['plan'] / row['eager']:5.2f}"]
    for label in ("reference", "calibrated"):
        e, p = row[f"{label} eager"], row[f"{label} plan"]
        cells += [f"{e / row['eager']:5.2f}", f"{p / row['plan']:5.2f}", f"{p / e:5.2f}"]
    return " | ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("small", "full"), default="small")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--zoo", action="store_true", help="the library zoo too (needs the zoo extra)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    print(" | ".join(["model".ljust(22), "eager ms", " plan ms", "ratio", "ref e", "ref p", "ref r",
                      "cal e", "cal p", "cal r"]))
    found = rows(args.size, args.zoo, args.repeats)
    print("\nref/cal e, p: predicted / measured seconds of eager and of the plan; r: predicted plan / eager "
          "(measured: ratio)")
    for label in ("reference", "calibrated"):
        errors = {
            "eager": [row[f"{label} eager"] / row["eager"] for row in found],
            "plan": [row[f"{label} plan"] / row["plan"] for row in found],
            "ratio": [(row[f"{label} plan"] / row[f"{label} eager"]) / (row["plan"] / row["eager"]) for row in found],
        }
        summary = ", ".join(
            f"{what} median {statistics.median(v):.2f}, within 15%: {sum(abs(x - 1) <= 0.15 for x in v)}/{len(v)}"
            for what, v in errors.items())
        print(f"{label}: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
