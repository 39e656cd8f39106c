import torch
from torch import nn

from memplan.testing import is_well_conditioned, random_model


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
