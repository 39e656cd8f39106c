import pytest
import torch
from torch import nn

from memplan.testing import assert_equivalent, is_well_conditioned, random_model


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.fn(x * self.w)


def test_is_well_conditioned_tells_rounding_amplifiers_and_overflows_from_the_rest():
    x = torch.rand(8, 4) * 3
    assert is_well_conditioned(Fn(torch.tanh), x)
    assert is_well_conditioned(Fn(lambda v: v.max(1)), x)  # indices compared exactly
    assert not is_well_conditioned(Fn(lambda v: torch.sin(torch.exp(torch.exp(v + 2)))), x)  # sin of ~1e20
    assert not is_well_conditioned(Fn(lambda v: torch.exp(torch.exp(v * 3))), x)  # overflow: inf, NaN gradients
    # random programs: most are well-conditioned, and the seeds named in the pass tests are not
    assert not is_well_conditioned(*_flat(random_model(3122, requires_grad_input=True)))
    assert sum(is_well_conditioned(*_flat(random_model(s, requires_grad_input=True))) for s in range(20)) >= 18


def test_is_well_conditioned_leaves_the_rng_alone():
    x = torch.rand(8, 4)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    assert is_well_conditioned(Fn(lambda v: torch.nn.functional.dropout(v, 0.5)), x)  # same mask in both runs
    assert torch.equal(torch.rand(3), expected)


def _flat(pair):
    model, inputs = pair
    return (model, *inputs)


def test_assert_equivalent_passes_keyword_arguments_and_names_the_leaf_that_differs():
    def model(x, *, weight, scale=1.0):
        return (x * weight).sum() * scale

    def other_scale(x, *, weight, scale=1.0):
        return model(x, weight=weight, scale=scale + 1.0)

    def wrong_gradient(x, *, weight):  # the same value, but d/dweight is 2 instead of x
        return (x * weight.detach()).sum() + (weight - weight.detach()).sum() * 2.0

    x, weight = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    assert_equivalent(model, model, x, kwargs={"weight": weight, "scale": 2.0})
    with pytest.raises(AssertionError, match=r"output 0 differs"):
        assert_equivalent(model, other_scale, x, kwargs={"weight": weight})
    with pytest.raises(AssertionError, match=r"gradient of kwargs\['weight'\] differs"):
        assert_equivalent(model, wrong_gradient, x, kwargs={"weight": weight})
    assert x.grad is None and weight.grad is None  # the caller's tensors are copied, not used


def test_assert_equivalent_without_gradients_compares_what_inference_runs():
    # An optimized module plans a call under no_grad apart from one with gradients (the inference plan);
    # grad=False ran the models with gradients on, so it never compared the inference plan.
    class OffInInference(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inputs):
            return self.inner(inputs) + (0.0 if torch.is_grad_enabled() else 1.0)

    torch.manual_seed(0)
    model, x = nn.Linear(4, 3), torch.randn(5, 4)
    off_in_inference = OffInInference(model)
    assert_equivalent(model, off_in_inference, x)
    with pytest.raises(AssertionError, match="output 0 differs"):
        assert_equivalent(model, off_in_inference, x, grad=False)


def test_models_that_update_their_buffers_start_from_the_same_values():
    # The first run advanced spectral_norm's power-iteration vector before the second: a model
    # compared with itself failed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(16, 32)), nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(4, 16)
    assert_equivalent(model, model, x)
    assert_equivalent(model, model, x, grad=False)


class _Counter(nn.Module):
    def __init__(self, step):
        super().__init__()
        self.step = step
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(self.step)
        return x * 2


def test_buffers_that_end_apart_are_a_difference():
    with pytest.raises(AssertionError, match="buffer count differs"):
        assert_equivalent(_Counter(1.0), _Counter(2.0), torch.randn(3))
