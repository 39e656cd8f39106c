"""Recurrent loops written by hand (``benchmarks/recurrent_loops.py``): memplan's default plan against eager
and against ``torch.utils.checkpoint`` every sqrt(T) steps, on the ruler's deterministic peaks. Times are
the benchmark's business (docs/benchmarks.md), never a test's."""

import importlib.util
import math
import pathlib
import sys

import pytest
import torch

import memplan
from memplan.steps import step_fn
from memplan.testing import assert_equivalent

REPO = pathlib.Path(__file__).resolve().parents[1]


def _loops():
    spec = importlib.util.spec_from_file_location("memplan_benchmark_recurrent_loops",
                                                  REPO / "benchmarks" / "recurrent_loops.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


LOOPS = _loops()


def _peaks(name):
    model, inputs = LOOPS.build(name, "test")
    opt = memplan.optimize(model)
    assert_equivalent(model, opt, *inputs)
    segment = round(math.sqrt(inputs[0].shape[0]))
    checkpointed = LOOPS.Checkpointed(model, segment)
    torch.testing.assert_close(checkpointed(*inputs), model(*inputs))
    planned = step_fn(opt, inputs, train=True)
    planned()
    return (memplan.measure(step_fn(model, inputs, train=True)).peak, memplan.measure(planned).peak,
            memplan.measure(step_fn(checkpointed, inputs, train=True)).peak, opt.plan)


@pytest.mark.parametrize("name", ["lstm", "gru", "attention_rnn"])
def test_the_default_plan_is_3x_below_eager_and_below_sqrt_checkpointing(name):
    eager, planned, checkpointed, plan = _peaks(name)
    assert planned * 3 <= eager
    assert planned < checkpointed
    assert plan.overhead <= 0.3 + 0.03  # predicted, the whole plan (see tests/analysis/test_cost.py)
