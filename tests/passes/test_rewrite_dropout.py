"""The rewrite pass's dropout peephole: ``native_dropout``'s output made again in the backward from its mask."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memplan
from memplan.analysis.peak import step_margin
from memplan.capture import capture
from memplan.measure import measure
from memplan.passes._rewrite.dropout_mask import find_dropout_from_mask
from memplan.steps import step_fn
from memplan.testing import assert_equivalent

_DROPOUT = torch.ops.aten.native_dropout


class Attention(nn.Module):
    """Layers of attention whose probabilities go through ``native_dropout`` (CUDA's dropout) before the
    product with the values, which saves them."""

    def __init__(self, layers=3, p=0.1, dtype=torch.float32):
        super().__init__()
        self.p = p
        self.qkv = nn.ModuleList(nn.Linear(16, 48, dtype=dtype) for _ in range(layers))

    def forward(self, x):
        for qkv in self.qkv:
            q, k, v = qkv(x).view(*x.shape[:-1], 3, 16).unbind(-2)
            probs = torch.softmax(q @ k.transpose(-1, -2), -1)
            dropped, _ = _DROPOUT(probs, self.p, True)
            x = x + dropped @ v
        return x


def _found(fn, *inputs, **kwargs):
    return find_dropout_from_mask(capture(fn, *inputs, seed="tangents", **kwargs))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_plan_is_eagers_bits_at_its_predicted_lower_peak(seed):
    torch.manual_seed(seed)
    model, x = Attention(), torch.randn(4, 128, 16, requires_grad=True)
    opt = memplan.optimize(model, passes="rewrite")
    assert_equivalent(model, opt, x, exact=True, seed=seed)
    plan = opt.plan_for(x)
    assert sum("made again in the backward from its mask" in note for r in plan.records for note in r.notes) == 3
    measured = measure(step_fn(opt, (x,), train=True)).peak
    assert measured == plan.planned_peak + step_margin(plan.graph)
    assert measured < measure(step_fn(model, (x,), train=True)).peak


def test_draws_stay_eagers_over_steps():
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 64, 16, requires_grad=True)
    opt = memplan.optimize(model, passes="rewrite")
    for seed in (3, 4):
        torch.manual_seed(seed)
        expected = model(x)
        torch.manual_seed(seed)
        got = opt(x)
        assert torch.equal(got, expected)


def test_what_is_not_rewritten():
    x = torch.randn(2, 32, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    # its input is not kept by the backward: keeping it instead of the output saves nothing
    assert not _found(lambda x, w: _DROPOUT(x * 2, 0.1, True)[0] @ w, x, w)
    # half precision: the kernels may round in another order
    h = torch.randn(2, 32, 32, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    assert not _found(lambda h: _DROPOUT(h.softmax(-1), 0.1, True)[0] @ h, h)
    # no output the backward reads: the product with a constant saves nothing of it
    assert not _found(lambda x: (_DROPOUT(x.softmax(-1), 0.1, True)[0] * 3).sum(), x)
    # found where it applies
    assert len(_found(lambda x, w: _DROPOUT(x.softmax(-1), 0.1, True)[0] @ w, x, w)) == 1


def test_a_plan_for_cuda_makes_dropouts_output_again_from_its_mask():
    # F.dropout traces as CUDA's native_dropout for a CUDA target (memplan._capture.target)
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.1)

        def forward(self, q, v):
            return self.drop(torch.softmax(q @ q.transpose(-1, -2), -1)) @ v

    q, v = torch.randn(4, 64, 16, requires_grad=True), torch.randn(4, 64, 16, requires_grad=True)
    assert len(_found(Layer(), q, v, target_device="cuda")) == 1
    plain = memplan.optimize(Layer(), device="cuda", passes="").plan_for(q, v)
    rewritten = memplan.optimize(Layer(), device="cuda", passes="rewrite").plan_for(q, v)
    # the dropout's output no longer crosses from the forward to the backward: 64 KiB of float32
    assert plain.saved_bytes - rewritten.saved_bytes == 4 * 64 * 64 * 4
    assert rewritten.planned_peak <= plain.planned_peak
    assert not _found(lambda q: F.dropout((q @ q.transpose(-1, -2)).softmax(-1), 0.1) @ q, q)  # on this CPU: no native_dropout
