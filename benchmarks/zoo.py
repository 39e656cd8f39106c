"""The library zoo's figures: each model of ``tests/zoo`` trained for one step eagerly and planned.

Run ``python benchmarks/zoo.py`` (transformers installed: ``pip install -e ".[zoo]"``; without it the
torch.nn models only). For every model, in float32, training mode (dropout on): outputs and gradients
compared with :func:`memplan.testing.assert_equivalent`, eager's and the plan's measured peaks
(:func:`memplan.measure` on :func:`memplan.steps.step_fn`), the plan's prediction against its measured
peak; then a markdown table and the summary (models, equal, peak ratio median and worst, prediction
worst) that ``docs/benchmarks.md`` quotes. Then the zoo's autocast models again under bfloat16 autocast: the
same, with ``analyze()``'s prediction against eager's measured peak.
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


def _zoo() -> tuple[list, list, type]:
    """The zoo's factories, those it also runs under autocast, and its autocast wrapper module."""
    spec = importlib.util.spec_from_file_location("memplan_zoo_models", ZOO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        import transformers  # noqa: F401
    except ImportError:
        factories = list(module.TORCH_NN)
    else:
        factories = list(module.ALL)
    autocast = [f for f in module.AUTOCAST if f in factories]
    return factories, autocast, module._UnderAutocast


def _measured(factory, wrap=lambda module: module) -> tuple:
    """``factory``'s model planned and stepped once, ``wrap`` around both (the autocast block): the model and
    its inputs, whether the plan trains as eager does, eager's and the plan's measured peaks, the plan's
    predicted peak."""
    torch.manual_seed(0)
    model, inputs = factory()
    model.train()
    opt = memplan.optimize(model)
    try:
        assert_equivalent(wrap(model), wrap(opt), *inputs)
        equal = True
    except AssertionError:
        equal = False
    eager = memplan.measure(step_fn(wrap(model), inputs, train=True)).peak
    step = step_fn(wrap(opt), inputs, train=True)
    step()
    planned = memplan.measure(step).peak
    return model, inputs, equal, eager, planned, opt.plan.planned_peak + step_margin(opt.plan.graph)


def _autocast_rows(factories: list, wrapper: type) -> list[tuple]:
    """Each model's step under bfloat16 autocast (forward in the block, backward after it): equal to eager,
    the plan's peak over eager's, ``analyze()`` (called in the block) and the plan's prediction against the
    measures."""
    rows = []
    for factory in factories:
        model, inputs, equal, eager, planned, predicted = _measured(factory, wrapper)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            analyzed = memplan.analyze(model, *inputs).peak
        rows.append((factory.__name__, equal, eager, planned, analyzed / eager, predicted / planned))
        print(f"{factory.__name__} (autocast): {'equal' if equal else 'DIFFERS'}, peak {planned / eager:.3f}x "
              f"eager's", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows = []
    factories, autocast, wrapper = _zoo()
    for factory in factories:
        _, _, equal, eager, planned, predicted = _measured(factory)
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
    mixed = _autocast_rows(autocast, wrapper)
    print("\nUnder bfloat16 autocast:\n")
    print("| model | outputs and gradients | eager peak | memplan peak | memplan / eager | analyze() / eager's "
          "measure | plan's prediction / measured |")
    print("|---|---|---|---|---|---|---|")
    for name, equal, eager, planned, analyzed, prediction in mixed:
        print(f"| {name} | {'equal' if equal else 'differ'} | {memplan.format_bytes(eager)} | "
              f"{memplan.format_bytes(planned)} | {planned / eager:.3f} | {analyzed:.3f} | {prediction:.3f} |")
    if mixed:
        worst_analyzed = max(mixed, key=lambda r: abs(r[4] - 1))
        worst_plan = max(mixed, key=lambda r: abs(r[5] - 1))
        print(f"\n{len(mixed)} models, {sum(r[1] for r in mixed)} equal; memplan / eager peak worst "
              f"{max(r[3] / r[2] for r in mixed):.3f}; analyze() worst {worst_analyzed[4]:.3f} ({worst_analyzed[0]}); "
              f"plans' prediction worst {worst_plan[5]:.3f} ({worst_plan[0]})")
    return 0 if all(r[1] for r in rows + mixed) else 1


if __name__ == "__main__":
    sys.exit(main())
