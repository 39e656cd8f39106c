"""``optimize(..., verify=True)``: the first call of a signature checked against eager, and a pass that
changes the results found, rolled back, and the call answered correctly."""

import copy
import pathlib
import warnings

import pytest
import torch
from torch import nn

import memplan
import memplan.verify
from memplan.errors import PassError, PassRolledBackWarning, VerificationWarning
from memplan.graphutil import GraphEditor
from memplan.pipeline import PassResult, pass_failures, register_pass


@register_pass("_test_wrong_forward")
def wrong_forward(graph, ctx):
    """A wrong pass that keeps every invariant: the forward's tanh becomes a sigmoid."""
    node = next(n for n in graph.gm.graph.nodes if n.target == torch.ops.aten.tanh.default)
    node.target = torch.ops.aten.sigmoid.default
    graph.gm.recompile()
    return PassResult(graph, changed=True)


@register_pass("_test_wrong_gradient")
def wrong_gradient(graph, ctx):
    """A wrong pass that keeps every invariant and the outputs: tanh's gradient doubled."""
    editor = GraphEditor(graph)
    node = next(n for n in graph.gm.graph.nodes if n.target == torch.ops.aten.tanh_backward.default)
    doubled = editor.call(torch.ops.aten.mul.Tensor, (node, 2.0), like=node, after=node)
    for user in [u for u in node.users if u is not doubled]:
        user.replace_input_with(node, doubled)
    return PassResult(editor.finish(), changed=True)


def model_and_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 4), nn.BatchNorm1d(4))
    return model, torch.randn(6, 8, requires_grad=True)


def one_step(model, x, seed):
    """A training step's results: output, the input's and parameters' .grad, buffers, the RNG after."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    y = model(x)
    (y.square().sum()).backward()
    after = torch.rand(4)  # the RNG state the call left
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return y.detach(), x.grad, grads, [b.clone() for b in model.buffers()], after


def assert_same_step(a, b):
    for left, right in zip(a, b):
        torch.testing.assert_close(left, right)


@pytest.fixture
def temporary_dir(tmp_path, monkeypatch):
    """The temporary directory, where reproducers are saved by default, made the test's own."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_correct_plan_passes_silently_and_the_step_is_eagers():
    # dropout draws from the user's RNG state as eager does; the user's .grad and the batch-norm
    # statistics come from one step, not from the check's runs too
    model, x = model_and_input()
    eager = copy.deepcopy(model)
    opt = memplan.optimize(model, verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planned = one_step(opt, x, seed=3)
    assert_same_step(planned, one_step(eager, x, seed=3))
    assert not any(r.rolled_back for r in opt.plan.records) and opt.plans_built == 1
    assert_same_step(one_step(opt, x, seed=4), one_step(eager, x, seed=4))  # later calls: no check


def test_inference_is_checked_too():
    model, x = model_and_input()
    model.eval()
    opt = memplan.optimize(model, verify=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        torch.testing.assert_close(opt(x), model(x))
    assert not opt.plan.training


@pytest.mark.parametrize("bad, what", [
    ("_test_wrong_forward", "output 0 differs"),
    ("_test_wrong_gradient", "gradient of args[0] differs: "),
])
def test_a_pass_that_changes_the_results_is_rolled_back_and_the_call_is_right(bad, what, temporary_dir):
    model, x = model_and_input()
    eager = copy.deepcopy(model)
    opt = memplan.optimize(model, passes=f"{bad},inplace,schedule", verify=True)
    with pass_failures("rollback"), pytest.warns(PassRolledBackWarning) as caught:
        planned = one_step(opt, x, seed=3)
    (warning,) = [w.message for w in caught]
    assert warning.pass_name == bad and what in str(warning) and caught[0].filename == __file__
    assert (pathlib.Path(warning.reproducer) / "graph.pt").exists()
    assert pathlib.Path(warning.reproducer).parent == temporary_dir
    assert_same_step(planned, one_step(eager, x, seed=3))
    assert [r.name for r in opt.plan.records] == [bad, "inplace", "schedule"]
    assert [r.name for r in opt.plan.records if r.rolled_back] == [bad] and opt.plan.pipeline == "inplace,schedule"
    with warnings.catch_warnings():  # the signature's plan is the one without it: no second check
        warnings.simplefilter("error")
        assert_same_step(one_step(opt, x, seed=5), one_step(eager, x, seed=5))


def test_memplans_own_tests_raise_where_users_are_warned():
    model, x = model_and_input()
    opt = memplan.optimize(model, passes="_test_wrong_forward", verify=True)
    with pytest.raises(PassError, match=r"'_test_wrong_forward'.*output 0 differs"):
        opt(x)


def test_a_difference_no_pass_explains_runs_the_signature_eagerly(monkeypatch):
    model, x = model_and_input()
    eager = copy.deepcopy(model)
    opt = memplan.optimize(model, passes="", verify=True)
    monkeypatch.setattr(memplan.verify, "first_difference", lambda expected, actual, terms=None: "output 0 differs: (made up)")
    with pass_failures("rollback"), pytest.warns(VerificationWarning, match="runs eagerly"):
        planned = one_step(opt, x, seed=3)
    assert opt.plan is None
    assert_same_step(planned, one_step(eager, x, seed=3))


def test_the_check_is_skipped_where_the_eager_copy_would_not_fit(monkeypatch):
    model, x = model_and_input()
    eager = copy.deepcopy(model)
    opt = memplan.optimize(model, verify=True)
    monkeypatch.setattr(memplan.verify, "_short_of_memory", lambda plan, state, leaves: "it needs 9 GiB, 1 GiB is free")
    with pytest.warns(VerificationWarning, match=r"skipped verify=True for this call: it needs 9 GiB"):
        planned = one_step(opt, x, seed=3)
    assert_same_step(planned, one_step(eager, x, seed=3))


def test_first_difference_names_the_value_and_holds_each_family_to_its_own_scale():
    first_difference = memplan.verify.first_difference
    a = torch.ones(3)
    assert first_difference([("output 0", a)], [a + 1e-7]) is None
    message = first_difference([("output 0", a), ("gradient of w", a)], [a, a * 2])
    assert message.startswith("gradient of w differs: 3 of 3 elements differ by more than")
    # a gradient that cancelled to rounding noise is judged on its family's scale, as assert_equivalent does
    big, noise = torch.full((3,), 100.0), torch.full((3,), 1e-7)
    assert first_difference([("gradient of w", big), ("gradient of b", noise)], [big, -noise], terms=64) is None
    assert first_difference([("gradient of b", noise)], [-noise], terms=64) is not None
    assert "eager gives 1 values where the plan gives 2" in first_difference([("x", a)], [a, a])
    assert first_difference([("output 1", 3)], [4]) == "output 1 differs: eager gives 3, the plan 4"
