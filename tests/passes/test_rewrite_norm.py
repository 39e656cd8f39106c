"""The rewrite pass's batch-norm peephole: its output (or its ReLU) made again in the backward by the same kernel
on its input, without running statistics: eager's bits."""

import pytest
import torch
from torch import nn

import memplan
from memplan.analysis.peak import step_margin
from memplan.capture import capture
from memplan.measure import measure
from memplan.passes._rewrite.norm_output import find_norm_outputs
from memplan.steps import step_fn
from memplan.testing import assert_equivalent


def conv_net(relu_inplace=True, affine=True, blocks=3, width=16):
    def block():
        return [nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width, affine=affine),
                nn.ReLU(inplace=relu_inplace)]

    layers = [nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
    for _ in range(blocks):
        layers += block()
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


class NoActivation(nn.Module):
    """Batch norm straight into the next convolution (a bottleneck's last layer before the sum)."""

    def __init__(self, width=16):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, width, 3, padding=1), nn.Conv2d(width, width, 3, padding=1)
        self.na, self.nb = nn.BatchNorm2d(width), nn.BatchNorm2d(width)

    def forward(self, x):
        return self.nb(self.b(self.na(self.a(x)))).square().mean((1, 2, 3))


def sequence_net(width=32):
    """``BatchNorm1d`` over (batch, channels, length), between 1-d convolutions."""
    return nn.Sequential(nn.Conv1d(8, width, 5, padding=2), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Conv1d(width, width, 5, padding=2), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Conv1d(width, 4, 1))


MODELS = [
    ("relu_inplace", lambda: conv_net(), lambda: torch.randn(8, 3, 24, 24)),
    ("relu", lambda: conv_net(relu_inplace=False), lambda: torch.randn(8, 3, 24, 24)),
    ("not_affine", lambda: conv_net(affine=False), lambda: torch.randn(8, 3, 24, 24)),
    ("channels_last", lambda: conv_net().to(memory_format=torch.channels_last),
     lambda: torch.randn(8, 3, 24, 24).to(memory_format=torch.channels_last)),
    ("no_activation", lambda: NoActivation(), lambda: torch.randn(8, 3, 24, 24)),
    ("batchnorm1d", lambda: sequence_net(), lambda: torch.randn(16, 8, 64)),
]


@pytest.mark.parametrize("name,make,inputs", MODELS, ids=[m[0] for m in MODELS])
def test_the_plan_keeps_eagers_values_and_predicts_its_lower_peak(name, make, inputs):
    torch.manual_seed(0)
    model, x = make(), inputs()
    assert find_norm_outputs(capture(model, x, seed="tangents"))
    opt = memplan.optimize(model, passes="rewrite")
    assert_equivalent(model, opt, x, exact=True)  # the running statistics compared too
    plan = opt.plan_for(x)
    assert any("made again in the backward from its input" in n for r in plan.records for n in r.notes)
    assert measure(step_fn(opt, (x,), train=True)).peak == plan.planned_peak + step_margin(plan.graph)
    assert plan.planned_peak < memplan.optimize(model, passes="").plan_for(x).planned_peak


def test_training_steps_under_the_default_pipeline_follow_eagers():
    torch.manual_seed(0)
    eager, planned = conv_net(), conv_net()
    planned.load_state_dict(eager.state_dict())
    opt = memplan.optimize(planned)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, planned)]
    for step in range(3):
        x, y = torch.randn(8, 3, 24, 24), torch.randint(0, 10, (8,))
        for module, optimizer in zip((eager, opt), optimizers):
            torch.nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(planned.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert any("made again in the backward from its input" in n for r in opt.plan.records for n in r.notes)


class Returned(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.next = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3)

    def forward(self, x):
        y = torch.relu(self.norm(self.conv(x)))
        return y, self.next(y).sum()  # the backward reads y, and the caller gets it


def test_an_output_and_eval_mode_are_left_alone():
    x = torch.randn(4, 3, 12, 12)
    assert find_norm_outputs(capture(Returned(), x, seed="tangents")) == []
    model = conv_net().eval()
    assert find_norm_outputs(capture(model, x, seed="tangents")) == []
