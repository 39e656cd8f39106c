"""The library zoo's figures: each model of ``tests/zoo`` trained for one step eagerly and planned.

Run ``python benchmarks/zoo.py`` (transformers installed: ``pip install -e ".[zoo]"``; without it the
torch.nn models only). For every model, in float32, training mode (dropout on): outputs and gradients
compared with :func:`memplan.testing.assert_equivalent`, eager's and the plan's measured peaks
(:func:`memplan.measure` on :func:`memplan.steps.step_fn`), the plan's prediction against its measured
peak; then a markdown table and the summary (models, equal, peak ratio median and worst, prediction
worst) that ``docs/benchmarks.md`` quotes.
"""

from __future__ import annotations

import importlib.util
import pathlib
import statistics
import sys
import warnings

import torch

import memplan
from memplan.analysis.peak import step_margin
from memplan.steps import step_fn
from memplan.testing import assert_equivalent

ZOO = pathlib.Path(__file__).resolve().parent.parent / "tests" / "zoo" / "test_library_models.py"


def _factories() -> list:
    spec = importlib.util.spec_from_file_location("memplan_zoo_models", ZOO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return list(module.TORCH_NN)
    return list(module.ALL)


def main() -> int:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows = []
    for factory in _factories():
        torch.manual_seed(0)
        model, inputs = factory()
        model.train()
        opt = memplan.optimize(model)
        try:
            assert_equivalent(model, opt, *inputs)
            equal = True
        except AssertionError:
            equal = False
        eager = memplan.measure(step_fn(model, inputs, train=True)).peak
        step = step_fn(opt, inputs, train=True)
        step()
        planned = memplan.measure(step).peak
        predicted = opt.plan.planned_peak + step_margin(opt.plan.graph)
        rows.append((factory.__name__, equal, eager, planned, planned / eager, predicted / planned))
        print(f"{factory.__name__}: {'equal' if equal else 'DIFFERS'}, peak {planned / eager:.3f}x eager's, "
              f"prediction {predicted / planned:.3f}x", file=sys.stderr, flush=True)
    print("| model | outputs and gradients | eager peak | memplan peak | memplan / eager | predicted / measured |")
    print("|---|---|---|---|---|---|")
    for name, equal, eager, planned, ratio, prediction in rows:
        print(f"| {name} | {'equal' if equal else 'differ'} | {memplan.format_bytes(eager)} | "
              f"{memplan.format_bytes(planned)} | {ratio:.3f} | {prediction:.3f} |")
    ratios = [r[4] for r in rows]
    worst_prediction = max(rows, key=lambda r: abs(r[5] - 1))
    print(f"\n{len(rows)} models, {sum(r[1] for r in rows)} equal; memplan / eager peak: median "
          f"{statistics.median(ratios):.3f}, worst {max(ratios):.3f}; prediction worst {worst_prediction[5]:.3f} "
          f"({worst_prediction[0]})")
    return 0 if all(r[1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
