"""Autograd's write-into-zeros formulas, as eager runs them (memplan/_capture/formulas.py).

Eager writes the gradients of max, gather, indexing, topk, sort... into zeros in place; under a dispatch mode
or over fake tensors autograd takes the out-of-place form. memplan's trace and its ruler put the in-place form
back; the allocator, read with no mode at all (allocator_peak), is the judge.
"""

from __future__ import annotations

import pytest
import torch

import memplan
from memplan.capture import Phase, capture
from memplan.examples import make
from memplan.measure import allocator_peak, measure
from memplan.steps import step_fn

torch.manual_seed(0)
X_SHAPE = (96, 160)
INDEX = torch.randint(0, X_SHAPE[1], (X_SHAPE[0], 3))
ROWS = torch.randint(0, X_SHAPE[0], (40,))

CASES = {
    "max_dim": lambda t: t.max(-1).values,
    "min_dim_keepdim": lambda t: t.min(0, keepdim=True).values * 2,
    "gather": lambda t: t.gather(1, INDEX),
    "index_select": lambda t: t.index_select(0, ROWS),
    "indexing": lambda t: t[ROWS].tanh(),
    "topk": lambda t: t.topk(4, -1).values,
    "sort": lambda t: t.sort(-1).values[:, :5],
    "cummax": lambda t: t.cummax(-1).values,
    "median_dim": lambda t: t.median(-1).values,
}


def _x():
    return torch.randn(X_SHAPE, requires_grad=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_predicted_measured_and_allocated_agree_where_eager_writes_a_gradient_in_place(name):
    fn, x = CASES[name], _x()
    step = step_fn(fn, (x,), train=True)
    step()
    predicted = memplan.analyze(fn, x).peak
    assert predicted == measure(step).peak
    assert predicted <= allocator_peak(step) <= 1.01 * predicted  # (the allocator: no mode, no trace)
    if name not in ("sort", "cummax"):  # (those save indices as large as x, in int64)
        assert predicted < 2 * x.numel() * x.element_size()  # the gradient's zeros are written, not copied


def test_the_captured_backward_writes_in_place_and_the_forward_is_left_as_written():
    def user(t):  # the user's own out-of-place scatter into zeros stays out of place
        return torch.zeros_like(t).scatter(1, INDEX, t[:, :3]).mul(t).max(-1).values

    graph = capture(user, _x())
    forward = [str(n.target) for n in graph.gm.graph.nodes if graph.phases.get(n.name) is Phase.FORWARD]
    backward = [str(n.target) for n in graph.gm.graph.nodes if graph.phases.get(n.name) is Phase.BACKWARD]
    assert "aten.scatter.src" in forward and "aten.scatter_.src" not in forward
    assert "aten.scatter_.src" in backward


class _ZerosThenScatter(torch.autograd.Function):
    """A backward of the user's own that scatters into zeros out of place and reads the zeros again."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        zeros = torch.zeros_like(grad)
        written = zeros.scatter(1, INDEX, grad[:, :3])
        return written + zeros + grad


def test_a_custom_backward_runs_as_written():
    x = _x()
    out = _ZerosThenScatter.apply(x)
    (expected,) = torch.autograd.grad(out.sum(), x)
    step = step_fn(lambda t: _ZerosThenScatter.apply(t), (x,), train=True)
    measured = measure(step)
    assert measured.peak <= allocator_peak(step) <= 1.01 * measured.peak
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plans_give_eagers_gradients(name):
    fn = CASES[name]

    class Model(torch.nn.Module):
        def forward(self, t):
            return fn(t)

    model, x = Model(), _x()
    from memplan.equivalence import assert_equivalent

    assert_equivalent(model, memplan.optimize(model), x)


def test_maxsims_eager_is_predicted_as_the_allocator_counts_it():
    workload = make("maxsim", size="small")
    step = step_fn(workload.model, workload.inputs, train=True)
    step()
    predicted = memplan.analyze(workload.model, *workload.inputs).peak
    assert predicted == measure(step).peak
    assert predicted <= allocator_peak(step) <= 1.01 * predicted
