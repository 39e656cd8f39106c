"""Nothing lost under faults: an exception or a KeyboardInterrupt in the middle of a planned forward or
backward, or of planning itself, leaves the optimized module usable.

After each fault: the next call gives eager's outputs and gradients, the parameters are unchanged, ``.grad``
is what an eager copy leaves after the same fault, and no plan is left half-built (a signature whose planning
was interrupted plans again; a new signature plans as usual).
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memplan
import memplan.api
from memplan.testing import assert_equivalent


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        return self.c(h)


class Fault(TorchDispatchMode):
    """Raises ``error`` at the ``nth`` call of ``op`` (an aten overload packet) inside the block: an
    out-of-memory error, or a KeyboardInterrupt, in the middle of whatever runs there."""

    def __init__(self, op, nth: int, error: type[BaseException]):
        super().__init__()
        self.op, self.nth, self.error, self.seen = op, nth, error, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is self.op:
            self.seen += 1
            if self.seen == self.nth:
                raise self.error("simulated fault")
        return func(*args, **(kwargs or {}))


aten = torch.ops.aten
ERRORS = [torch.OutOfMemoryError, KeyboardInterrupt]


def pair(seed: int = 0):
    """An optimized model, already planned for ``X``, and an eager copy with the same parameters."""
    torch.manual_seed(seed)
    model = Net()
    reference = copy.deepcopy(model)
    opt = memplan.optimize(model)
    opt(X).sum().backward()
    reference(X).sum().backward()
    return model, reference, opt


X = torch.randn(5, 4)


def snapshot(module: nn.Module):
    return [p.detach().clone() for p in module.parameters()], [None if p.grad is None else p.grad.clone()
                                                               for p in module.parameters()]


def assert_same_grads(model: nn.Module, reference: nn.Module):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=f".grad of {name} differs")


def assert_usable(model: nn.Module, reference: nn.Module, opt, plans_built: int):
    """The next step is eager's, from the plan already made."""
    for module in (model, reference):
        module.zero_grad(set_to_none=True)
    opt(X).sum().backward()
    reference(X).sum().backward()
    assert_same_grads(model, reference)
    assert_equivalent(reference, opt, X)
    assert opt.plans_built == plans_built


def step_under(fault: Fault, module: nn.Module, error: type[BaseException]):
    with pytest.raises(error, match="simulated fault"):
        with fault:
            module(X).sum().backward()


# ----------------------------------------------------------------------------------------------
# faults while a plan runs


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("accumulating", [False, True], ids=["grad_none", "grad_present"])
def test_a_fault_in_the_planned_forward_changes_nothing(error, nth, accumulating):
    model, reference, opt = pair()
    if not accumulating:
        for module in (model, reference):
            module.zero_grad(set_to_none=True)
    before, grads_before = snapshot(model)
    step_under(Fault(aten.addmm, nth, error), opt, error)  # each linear layer's forward is an addmm
    step_under(Fault(aten.addmm, nth, error), reference, error)
    params, grads = snapshot(model)
    for p, q in zip(params, before):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert_same_grads(model, reference)
    for g, h in zip(grads, grads_before):
        assert (g is None and h is None) or torch.equal(g, h)  # no backward ran: .grad untouched
    assert_usable(model, reference, opt, plans_built=1)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("nth", [1, 2, 3, 4, 5])
def test_a_fault_in_the_planned_backward_leaves_grad_as_eager_does(error, nth):
    # With .grad already there (gradient accumulation), the plan adds each gradient as it is made, as
    # autograd does in eager: after a fault, the gradients finished before it are added, the others not.
    model, reference, opt = pair()
    before, _ = snapshot(model)
    step_under(Fault(aten.mm, nth, error), opt, error)  # the backward's matmuls
    step_under(Fault(aten.mm, nth, error), reference, error)
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    assert_same_grads(model, reference)
    assert_usable(model, reference, opt, plans_built=1)


@pytest.mark.parametrize("nth", [1, 2, 3, 4, 5])
def test_a_fault_in_the_planned_backward_from_no_grad_adds_no_gradient(nth):
    # From .grad None a plan hands all its gradients to autograd when its backward returns, so a fault
    # inside it leaves every .grad None; eager may have set some already. Each .grad is then either
    # eager's after the same fault or None: never part of a gradient.
    model, reference, opt = pair()
    full = [p.grad.clone() for p in reference.parameters()]  # one step's gradients (pair ran one step)
    for module in (model, reference):
        module.zero_grad(set_to_none=True)
    step_under(Fault(aten.mm, nth, torch.OutOfMemoryError), opt, torch.OutOfMemoryError)
    step_under(Fault(aten.mm, nth, torch.OutOfMemoryError), reference, torch.OutOfMemoryError)
    assert all(p.grad is None for p in model.parameters())
    for q, whole in zip(reference.parameters(), full):
        assert q.grad is None or torch.equal(q.grad, whole)  # eager: whole gradients only, too
    assert_usable(model, reference, opt, plans_built=1)


def _raises(error: type[BaseException]):
    def hook(*args):
        raise error("simulated fault")
    return hook


HOOKS = {
    # where a hook of the user's runs while a plan runs, and raises
    "parameter_tensor_hook": lambda m, owner, e: owner.a.weight.register_hook(_raises(e)),
    "post_accumulate_grad_hook": lambda m, owner, e: owner.b.weight.register_post_accumulate_grad_hook(_raises(e)),
    "forward_pre_hook": lambda m, owner, e: m.register_forward_pre_hook(_raises(e)),
    "forward_hook": lambda m, owner, e: m.register_forward_hook(_raises(e)),
    "full_backward_hook": lambda m, owner, e: m.register_full_backward_hook(_raises(e)),
    "full_backward_pre_hook": lambda m, owner, e: m.register_full_backward_pre_hook(_raises(e)),
}


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # torch's, in eager as in the plan
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt], ids=lambda e: e.__name__)
@pytest.mark.parametrize("where", list(HOOKS))
@pytest.mark.parametrize("accumulating", [False, True], ids=["grad_none", "grad_present"])
def test_a_hook_that_raises_while_a_plan_runs_leaves_the_module_usable(where, error, accumulating):
    model, reference, opt = pair()
    full = [p.grad.clone() for p in reference.parameters()]  # one step's gradients (pair ran one step)
    if not accumulating:
        for module in (model, reference):
            module.zero_grad(set_to_none=True)
    before, grads_before = snapshot(model)
    handles = [HOOKS[where](opt, model, error), HOOKS[where](reference, reference, error)]
    for m in (opt, reference):
        with pytest.raises(error, match="simulated fault"):
            m(X).sum().backward()
    for handle in handles:
        handle.remove()
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    watched = where in ("parameter_tensor_hook", "post_accumulate_grad_hook")
    if not watched or (accumulating and where == "parameter_tensor_hook"):
        assert_same_grads(model, reference)
    else:
        # A hook on a parameter's gradient runs in autograd after the plan's backward returns. From .grad
        # None, autograd then takes the plan's gradients in its own order; with .grad there, the plan has
        # added the gradients of the parameters nothing watches as it made them, where eager had stopped
        # at the hook. Either way every .grad holds whole gradients: as before the step, or after it.
        for p, whole, old in zip(model.parameters(), full, grads_before):
            if old is None:
                assert p.grad is None or torch.equal(p.grad, whole)
            else:
                assert torch.equal(p.grad, old) or torch.equal(p.grad, old + whole)
    assert_usable(model, reference, opt, plans_built=opt.plans_built)


def test_a_hook_on_an_output_that_raises_leaves_the_module_usable():
    model, reference, opt = pair()
    for m in (opt, reference):
        out = m(X)
        out.register_hook(_raises(ValueError))
        with pytest.raises(ValueError, match="simulated fault"):
            out.sum().backward()
    assert_same_grads(model, reference)
    assert_usable(model, reference, opt, plans_built=1)


# ----------------------------------------------------------------------------------------------
# faults while planning


class RaisingHook:
    """A forward hook (changing the output, so planned) that raises at its first ``times`` calls."""

    def __init__(self, error: type[BaseException], times: int = 1):
        self.error, self.times = error, times

    def __call__(self, module, args, out):
        if self.times > 0:
            self.times -= 1
            raise self.error("simulated fault")
        return out * 2


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt], ids=lambda e: e.__name__)
def test_a_hook_that_raises_while_planning_plans_again_at_the_next_call(error):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    model.b.register_forward_hook(RaisingHook(error))
    reference.b.register_forward_hook(RaisingHook(error, times=0))
    opt = memplan.optimize(model)
    with pytest.raises(error, match="simulated fault") as info:  # the user's own exception, as eager raises it
        opt(X)
    if error is ValueError:
        assert any("memplan: raised by the model's code" in note for note in info.value.__notes__)
    assert opt.plans_built == 0 and opt.plan is None
    assert all(type(p) is nn.Parameter for p in model.parameters())  # the trace's fake tensors were put back
    assert_equivalent(reference, opt, X)  # planned again, then run
    assert opt.plans_built == 1


class KeepsItsLast(nn.Module):
    """Stores a tensor of the forward on the module, then fails: the trace's fake tensor must not stay."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fail = True

    def forward(self, x):
        self.last = self.fc(x)
        if self.fail:
            raise KeyboardInterrupt("simulated fault")
        return self.last


def test_an_interrupted_trace_leaves_no_fake_tensor_on_the_model():
    model = KeepsItsLast()
    with pytest.raises(KeyboardInterrupt):
        memplan.optimize(model)(X)
    assert not hasattr(model, "last")


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, KeyboardInterrupt], ids=lambda e: e.__name__)
@pytest.mark.parametrize("stage", ["passes", "emit"])
def test_planning_interrupted_after_capture_keeps_no_half_built_plan(monkeypatch, error, stage):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    opt = memplan.optimize(model)
    calls = []

    def once(original):
        def interrupted(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise error("simulated fault")
            return original(*args, **kwargs)
        return interrupted

    if stage == "emit":
        monkeypatch.setattr(memplan.api, "emit", once(memplan.api.emit))
    else:
        monkeypatch.setattr(memplan.api.PassManager, "run", once(memplan.api.PassManager.run))
    with pytest.raises(error, match="simulated fault"):
        opt(X)
    assert opt.plans_built == 0 and opt.plan is None and len(opt._plans) == 0
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert_equivalent(reference, opt, X)  # the same signature plans again
    assert_equivalent(reference, opt, torch.randn(7, 4))  # and a new one plans as usual
    assert opt.plans_built == 2


def _plans_whose_backward_raises(monkeypatch) -> None:
    """Every plan built from now on fails in its backward, as a plan with a fault of memplan's would."""
    import dataclasses

    build = memplan.api.OptimizedModule._build_plan

    def broken(self, *args, **kwargs):
        plan = build(self, *args, **kwargs)

        def raising(arguments):  # fails inside torch, as a wrong plan's op would (not a raise of the user's)
            grad, saved = torch.ones(3), torch.ones(3, dtype=torch.bfloat16)
            return torch.ops.aten._softmax_backward_data(grad, saved, 0, torch.float32)

        return dataclasses.replace(plan, emitted=dataclasses.replace(plan.emitted, run_backward=raising))

    monkeypatch.setattr(memplan.api.OptimizedModule, "_build_plan", broken)


def test_under_fallback_eager_a_plan_that_fails_its_first_run_runs_eagerly(monkeypatch):
    # fallback="eager" covered capture only: a plan that raised in its first backward (autocast's
    # mixed dtypes, once) reached the user's training run, after the forward had already returned
    torch.manual_seed(0)
    model, x = Net(), torch.randn(6, 4)
    _plans_whose_backward_raises(monkeypatch)
    with pytest.raises(RuntimeError, match="BFloat16|Float"):
        memplan.optimize(model)(x.requires_grad_()).sum().backward()
    opt = memplan.optimize(model, fallback="eager")
    with pytest.warns(UserWarning, match=r"runs this input signature eagerly .*raised RuntimeError on a trial run"):
        assert_equivalent(model, opt, x)
    assert opt.plans_built == 1
    assert_equivalent(model, opt, x)  # the signature stays eager, without another warning or plan
    assert opt.plans_built == 1


def test_the_trial_run_of_fallback_eager_draws_and_updates_as_eager_does():
    # the trial runs the plan once on copies before the call: dropout's draws and the batch norm's
    # running statistics must still be those of one eager call
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 2))
    reference = copy.deepcopy(model)
    opt = memplan.optimize(model, fallback="eager")
    x = torch.randn(6, 8)
    torch.manual_seed(3)
    planned = opt(x)
    torch.manual_seed(3)
    eager = reference(x)
    torch.testing.assert_close(planned, eager)
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    assert model[1].num_batches_tracked == reference[1].num_batches_tracked == 1
