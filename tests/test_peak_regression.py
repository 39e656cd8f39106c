"""memplan's own peak regressions, pinned with its pytest plugin (baseline: tests/memplan-baseline.json).

Each example's training step and inference call, eager and through memplan's default pipeline, at
the CPU defaults: outputs and gradients equal to eager (float tolerance: chunking changes summation
order), the measured peak never above eager's, and both peaks pinned. Peaks come from the CPU ruler,
which is deterministic. Refresh with ``pytest tests/test_peak_regression.py --memplan-update`` when a
change is meant to move them.
"""

import pytest

import memplan.examples as examples
from memplan.api import optimize
from memplan.steps import step_fn
from memplan.testing import assert_equivalent


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("name", list(examples.WORKLOADS))
def test_example_peaks(memplan_baseline, name, mode):
    w = examples.make(name)
    train = mode == "train"
    eager = memplan_baseline.check("eager", step_fn(w.model, w.inputs, train=train))
    opt = optimize(w.model)
    step = step_fn(opt, w.inputs, train=train)
    step()  # plan outside the measurement
    planned = memplan_baseline.check("memplan", step)
    assert planned.peak <= eager.peak
    assert_equivalent(w.model, opt, *w.inputs, grad=train, rtol=1e-4, atol=1e-5)
