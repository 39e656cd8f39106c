"""A plan's backward in stages, where a hook waits for each gradient as it is made.

DDP's reducer starts each bucket's all-reduce from hooks on the parameters' gradient accumulators, and an
optimizer step in the backward (``register_post_accumulate_grad_hook``) frees each gradient as soon as it
is applied. A plan's backward is one autograd node, so those hooks fired together after it; now it pauses
after each run of finished gradients (``memplan.emit``'s staged backward), autograd accumulates them and
runs their hooks, and the backward goes on. These tests check the hooks fire while the backward runs, the
gradients and the parameters stay eager's, and the optimizer-in-backward step peaks lower for it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memplan
from memplan.errors import HigherOrderGradientError
from memplan.testing import assert_equivalent, random_model, zoo


class _Looped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(10, 48), nn.Linear(48, 48), nn.Linear(48, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        for _ in range(3):  # b's gradient is finished only after the loop's first step
            h = torch.tanh(self.b(h)) + h
        return self.c(h).logsumexp(-1)


class _Tied(nn.Module):
    """An embedding whose weight is also the output layer's: one leaf, two uses."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, tokens):
        h = torch.relu(self.mid(self.embed(tokens)))
        return h @ self.embed.weight.t()


def _models():
    torch.manual_seed(0)
    found = [(z.name, z.model, z.inputs) for z in zoo()]
    found.append(("looped", _Looped(), (torch.randn(12, 10),)))
    found.append(("tied", _Tied(), (torch.randint(0, 20, (6, 5)),)))
    for seed in (0, 2):  # programs whose outputs read their parameters
        found.append((f"random{seed}", *random_model(seed, requires_grad_input=True)))
    return found


MODELS = _models()
IDS = [m[0] for m in MODELS]


# what autograd's accumulation into an existing .grad dispatches (after the hooks of the leaves before)
_ACCUMULATING = {"aten.add_.Tensor", "aten.add.Tensor", "aten.clone.default", "aten.detach.default",
                 "aten.copy_.default", "aten.empty_strided.default", "aten.empty.memory_format", "aten.alias.default"}


class _Log(TorchDispatchMode):
    """Every op dispatched while it is on, beside the hooks' marks, in order."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.events.append(func)
        return func(*args, **(kwargs or {}))


def _hooked(model, events):
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(name))


def _loss(out):
    outs = out if isinstance(out, tuple) else (out,)
    return sum(o.float().square().mean() for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point())


def _clone(model):
    import copy

    return copy.deepcopy(model)


@pytest.mark.parametrize("name,model,inputs", MODELS, ids=IDS)
def test_hooks_fire_while_the_planned_backward_runs(name, model, inputs):
    eager = _clone(model)
    opt = memplan.optimize(model)
    events: list = []
    _hooked(model, events)
    _hooked(eager, [])
    for _ in range(2):  # the second backward adds to existing .grad
        loss = _loss(opt(*inputs))
        events.clear()
        with _Log(events):
            loss.backward()
        _loss(eager(*inputs)).backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=n: f"{n}: {m}")
    assert {e for e in events if isinstance(e, str)} == {n for n, p in model.named_parameters()}
    stages = opt.plan.emitted.stages
    if name in ("mlp", "convnet", "attention", "looped", "tied"):
        assert stages, "every layer's gradient is finished at the end of the backward"
    if stages:
        hooks = [i for i, e in enumerate(events) if isinstance(e, str)]
        computed = [i for i, e in enumerate(events) if not isinstance(e, str) and str(e) not in _ACCUMULATING]
        assert hooks[0] < computed[-1], f"{name}: every hook fired after the plan's backward"


@pytest.mark.parametrize("name,model,inputs", MODELS, ids=IDS)
def test_staged_gradients_are_eagers(name, model, inputs):
    # autograd.grad (assert_equivalent's way) through the stages: no accumulation, the same gradients
    opt = memplan.optimize(model)
    _hooked(model, [])
    assert_equivalent(model, opt, *inputs)


def test_retained_graphs_partial_backwards_and_second_order_under_stages():
    model, x = _Looped(), torch.randn(12, 10)
    eager = _clone(model)
    opt = memplan.optimize(model)
    _hooked(model, [])
    out = opt(x).sum()
    out.backward(retain_graph=True)
    out.backward()  # the same graph again: the stages start over
    (eager(x).sum() * 2).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    model.zero_grad(set_to_none=True)
    opt(x).sum().backward(inputs=[model.a.weight])  # only the last stage's leaf
    assert model.c.weight.grad is None and model.a.weight.grad is not None
    x.requires_grad_()  # the backward reads x: the gradients hang on it under create_graph
    grads = torch.autograd.grad(opt(x).sum(), [model.c.weight, x], create_graph=True)
    expected = torch.autograd.grad(eager(x).sum(), [eager.c.weight, x])
    torch.testing.assert_close(grads, expected)
    with pytest.raises(HigherOrderGradientError):
        grads[0].pow(2).sum().backward()  # a gradient penalty on a stage's gradient


def _optimizer_in_backward(model, lr=0.1):
    """The optimizer step in the backward, as torch's tutorial has it: one SGD per parameter, stepped
    and its gradient dropped as soon as the gradient is accumulated."""
    optimizers = {p: torch.optim.SGD([p], lr=lr, momentum=0.9) for p in model.parameters()}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)


def _deep(width=256, depth=6):
    torch.manual_seed(1)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def test_an_optimizer_step_in_the_backward_trains_as_eager_and_frees_each_gradient():
    x = torch.randn(16, 256)
    eager, planned = _deep(), _deep()
    plain = _deep()  # the same model, the optimizer stepped after the backward
    opt, opt_plain = memplan.optimize(planned), memplan.optimize(plain)
    _optimizer_in_backward(eager)
    _optimizer_in_backward(planned)
    plain_sgd = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)

    def steps(module, after=None):
        def run():
            module(x).square().mean().backward()
            if after is not None:
                after.step()
                after.zero_grad(set_to_none=True)
        return run

    for _ in range(3):
        steps(eager)()
        steps(opt)()
        steps(opt_plain, plain_sgd)()
    for p, q, r in zip(planned.parameters(), eager.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(p, r)
        assert p.grad is None
    peaks = {name: memplan.measure(run).peak for name, run in
             [("eager", steps(eager)), ("planned", steps(opt)), ("plain", steps(opt_plain, plain_sgd))]}
    # each gradient is applied and freed as its stage ends, not held to the end of the backward
    assert peaks["planned"] < peaks["plain"]
    assert peaks["planned"] <= peaks["eager"]
