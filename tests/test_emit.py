"""emit: the code that runs is the code fx generates for the emitted modules, character for character.

emit writes the forward and backward code straight from the planned graph's nodes and builds the fx
modules only when they are read. These tests compare that code with fx's own (``python_code`` of the
modules), check what happens where the direct code generation steps aside, and that plans still run.
"""

import warnings

import pytest
import torch
from torch import nn

import memplan
import memplan.emit as emit_module
import memplan.examples as examples
from memplan.capture import capture
from memplan.testing import assert_equivalent, random_model, zoo


def _plans_and_sources(model, inputs, passes, train, monkeypatch):
    """Plan ``model`` and return its emitted plan with the sources emit generated, in module order."""
    sources = []
    generate = emit_module._boxed_source

    def recording(program):
        source = generate(program)
        sources.append(source)
        return source

    monkeypatch.setattr(emit_module, "_boxed_source", recording)
    opt = memplan.optimize(model, passes=passes)
    with torch.set_grad_enabled(train):
        opt(*inputs)
    return opt.plan.emitted, sources


def _assert_fx_writes_the_same(emitted, sources):
    modules = [emitted.forward] + ([emitted.backward] if emitted.backward is not None else [])
    assert len(sources) == len(modules)
    for module, (source, globals_) in zip(modules, sources):
        expected = module.graph.python_code(root_module="self")
        assert source == expected.src
        assert globals_ == expected.globals


ZOO = [(z.name, z.model, z.inputs) for z in zoo()]
RANDOM = [(f"random{seed}", *random_model(seed, requires_grad_input=seed % 2 == 0)) for seed in range(6)]
EXAMPLES = [(name, examples.make(name).model, examples.make(name).inputs) for name in ("chain_product", "maxsim")]
MODELS = ZOO + RANDOM + EXAMPLES


@pytest.mark.parametrize("train", [True, False], ids=["train", "inference"])
@pytest.mark.parametrize("passes", [None, ""], ids=["default", "empty"])
@pytest.mark.parametrize("name,model,inputs", MODELS, ids=[m[0] for m in MODELS])
def test_direct_code_is_fx_code(name, model, inputs, passes, train, monkeypatch):
    emitted, sources = _plans_and_sources(model, inputs, passes, train, monkeypatch)
    _assert_fx_writes_the_same(emitted, sources)


class _CollidingNames(nn.Module):
    """Saved parameters whose placeholder names, snake-cased, are taken by saved ops (``Mul`` -> ``mul``)."""

    def __init__(self):
        super().__init__()
        self.Mul = nn.Parameter(torch.randn(4, 4))
        self.Mul_1 = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        y = x * self.Mul  # "mul", saved: reads Mul
        z = y * self.Mul_1  # "mul_1"
        return (z * y).sin() * z


def test_direct_code_names_colliding_placeholders_as_fx(monkeypatch):
    model, x = _CollidingNames(), torch.randn(3, 4, 4, requires_grad=True)
    emitted, sources = _plans_and_sources(model, (x,), "", True, monkeypatch)
    placeholders = [n for n in emitted.backward.graph.nodes if n.op == "placeholder"]
    assert all(n.target == n.name for n in placeholders)  # read straight into their names: nothing renamed
    assert len({n.name for n in placeholders}) == len(placeholders)
    _assert_fx_writes_the_same(emitted, sources)


def test_colliding_placeholder_names_give_eager_gradients():
    # fx's own code would read ``Mul`` and ``mul`` and then rename them, ``mul = Mul`` overwriting the
    # saved ``mul`` before ``mul_1 = mul`` reads it: wrong gradients
    model, x = _CollidingNames(), torch.randn(3, 4, 4, requires_grad=True)
    assert_equivalent(model, memplan.optimize(model, passes=""), x, exact=True)
    assert_equivalent(model, memplan.optimize(model), x)


def test_unsupported_graphs_run_fx_code(monkeypatch):
    def unsupported(program):
        raise emit_module._Unsupported("for the test")

    monkeypatch.setattr(emit_module, "_boxed_source", unsupported)
    model, inputs = random_model(3, requires_grad_input=True)
    opt = memplan.optimize(model)
    assert_equivalent(model, opt, *inputs, exact=True)
    assert "# backward" in opt.code


def test_modules_are_built_when_read():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    opt = memplan.optimize(model, passes="")
    opt(torch.randn(3, 4)).sum().backward()
    emitted = opt.plan.emitted
    assert "_modules" not in emitted.__dict__  # not built by planning nor by running
    forward = emitted.forward
    assert emitted.forward is forward and emitted.backward is not None
    assert "tanh" in opt.code


# -- torch's Python bindings ------------------------------------------------------------------------


def _captured_nodes(fn, *inputs):
    return [n for n in capture(fn, *inputs).gm.graph.nodes if n.op == "call_function"]


def _ops(nodes):
    return {n.target for n in nodes if isinstance(n.target, torch._ops.OpOverload)}


def test_bindings_are_taken_only_where_they_make_the_operators_own_call(monkeypatch):
    """A candidate binding is taken when it reaches the operator with the same tensors and values, and
    refused when it swaps its arguments, reaches another operator first, or warns."""
    monkeypatch.setattr(emit_module, "_BINDING_CACHE", {})
    nodes = _captured_nodes(lambda x, y: (x + y) * y, torch.randn(3), torch.randn(3))
    add, mul = torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor
    assert {add, mul} <= _ops(nodes)

    class Homes:
        @staticmethod
        def add(a, b, **kwargs):  # swaps its tensors: another call
            return add(b, a, **kwargs)

        @staticmethod
        def mul(a, b):  # reaches another operator first
            return torch.ops.aten.mul.Tensor(torch.ops.aten.neg.default(a), b)

    monkeypatch.setattr(emit_module, "_BINDING_HOMES", (Homes,))
    assert emit_module.python_bindings(nodes) == {}

    class Warns:
        @staticmethod
        def add(a, b, **kwargs):
            warnings.warn("deprecated", UserWarning)
            return add(a, b, **kwargs)

        mul = staticmethod(torch.mul)

    monkeypatch.setattr(emit_module, "_BINDING_CACHE", {})
    monkeypatch.setattr(emit_module, "_BINDING_HOMES", (Warns,))
    assert emit_module.python_bindings(nodes) == {mul: torch.mul}


def test_an_operator_called_with_arguments_its_binding_refuses_keeps_its_own_call(monkeypatch):
    """Every kind of call an operator receives must pass: one that does not refuses the operator."""
    monkeypatch.setattr(emit_module, "_BINDING_CACHE", {})
    nodes = _captured_nodes(lambda x, y: x + y + 2.0, torch.randn(3), torch.randn(3))
    add = torch.ops.aten.add.Tensor
    assert sum(n.target is add for n in nodes) == 2

    class TensorsOnly:
        @staticmethod
        def add(a, b):
            if not isinstance(b, torch.Tensor):
                raise TypeError("add takes tensors")
            return add(a, b)

    monkeypatch.setattr(emit_module, "_BINDING_HOMES", (TensorsOnly,))
    assert add not in emit_module.python_bindings(nodes)
    assert add in emit_module.python_bindings([n for n in nodes if all(isinstance(a, torch.fx.Node) for a in n.args)])


def test_nodes_without_fake_values_keep_the_operators_own_call(monkeypatch):
    monkeypatch.setattr(emit_module, "_BINDING_CACHE", {})
    nodes = _captured_nodes(lambda x: x.exp(), torch.randn(3))
    assert torch.ops.aten.exp.default in emit_module.python_bindings(nodes)
    monkeypatch.setattr(emit_module, "_BINDING_CACHE", {})
    for n in nodes:
        for a in n.all_input_nodes:
            a.meta.pop("val", None)
    assert emit_module.python_bindings(nodes) == {}


def _outputs_and_grads(opt, model, inputs):
    torch.manual_seed(1)
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
    flat = [o for o in torch.utils._pytree.tree_leaves(opt(*leaves)) if isinstance(o, torch.Tensor)]
    loss = sum(o.float().sum() for o in flat if o.requires_grad)
    wrt = [p for p in model.parameters() if p.requires_grad] + [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True) if isinstance(loss, torch.Tensor) else ()
    return flat + list(grads)


@pytest.mark.parametrize("name,model,inputs", MODELS, ids=[m[0] for m in MODELS])
def test_code_with_bindings_computes_what_the_operators_compute(name, model, inputs, monkeypatch):
    """The same plan run with torch's bindings and with every operator's own call: equal bit for bit."""
    found = []
    bindings = emit_module.python_bindings
    monkeypatch.setattr(emit_module, "python_bindings", lambda nodes: found.append(bindings(nodes)) or found[-1])
    with_bindings = memplan.optimize(model)
    _outputs_and_grads(with_bindings, model, inputs)  # plans, and builds every runner (loops build theirs when they first run)
    assert any(found), "no operator of the plan was bound"
    monkeypatch.setattr(emit_module, "python_bindings", lambda nodes: {})
    without = memplan.optimize(model)
    for a, b in zip(_outputs_and_grads(with_bindings, model, inputs), _outputs_and_grads(without, model, inputs), strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_a_context_that_reaches_another_operator_first_is_not_remembered(monkeypatch):
    """Under autocast an operator's own call first casts its inputs: no binding then, and the answer
    is not cached, so the same call outside autocast still gets its binding."""
    monkeypatch.setattr(emit_module, "_BINDING_CACHE", {})
    nodes = _captured_nodes(lambda a, b: a @ b, torch.randn(4, 4), torch.randn(4, 4))
    mm = torch.ops.aten.mm.default
    assert mm in _ops(nodes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mm not in emit_module.python_bindings(nodes)
    assert mm in emit_module.python_bindings(nodes)


# ----------------------------------------------------------------------------------------------
# gradients of outputs the loss does not reach


class _LossAndPredictions(nn.Module):
    """A loss, the predictions (an argmax, not differentiable) and the logits (differentiable)."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(16, 64)

    def forward(self, x):
        logits = self.f(x)
        return logits.logsumexp(-1).mean(), logits.argmax(-1), logits


def test_outputs_the_loss_does_not_reach_get_no_allocated_gradient():
    # Autograd gave every output of the plan's function a zero gradient, the argmax's too (a copy of the
    # predictions eager never makes): the measured peak was above the planned one by that much.
    torch.manual_seed(0)
    model, x = _LossAndPredictions(), torch.randn(512, 16)
    opt = memplan.optimize(model)

    def step():
        model.zero_grad(set_to_none=True)
        loss, predictions, logits = opt(x)
        loss.backward()

    step()
    measured = memplan.measure(step).peak
    argmax_bytes = 512 * 8
    assert measured < opt.plan.planned_peak + argmax_bytes // 2
    expected = torch.autograd.grad(model(x)[0], model.f.weight)[0]
    got = torch.autograd.grad(opt(x)[0], model.f.weight)[0]
    torch.testing.assert_close(got, expected)
    # a differentiable output the loss does not reach still differentiates when asked alone
    expected = torch.autograd.grad(model(x)[2].square().sum(), model.f.weight)[0]
    got = torch.autograd.grad(opt(x)[2].square().sum(), model.f.weight)[0]
    torch.testing.assert_close(got, expected)


class _DetachedTwin(nn.Module):
    """Returns a value beside its detached self, and an input beside its detached self."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(8, 8)

    def forward(self, x):
        y = self.f(x).tanh()
        return y.detach(), y, x.detach(), x, y.detach() * 2


def test_a_detached_output_leaves_its_twin_differentiable():
    # The plan drops detaches, so y.detach() came out as the very tensor y: marking it
    # non-differentiable took y's gradient away (backward raised "does not require grad").
    torch.manual_seed(0)
    model, x = _DetachedTwin(), torch.randn(4, 8, requires_grad=True)
    opt = memplan.optimize(model)
    got, expected = opt(x), model(x)
    assert [o.requires_grad for o in got] == [o.requires_grad for o in expected] == [False, True, False, True, False]
    assert got[0].data_ptr() == got[1].data_ptr()  # still one storage: the alias costs no memory
    assert_equivalent(model, opt, x)


class _WideHead(nn.Module):
    """A trunk under a wide frozen output layer (a tied or pretrained head): the output's gradient is
    read only by the head's input gradient, at the start of the backward; the trunk's backward after
    it holds the most."""

    def __init__(self, hidden: int = 1024):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 4096).requires_grad_(False)

    def forward(self, x):
        return self.head(self.trunk(x))


def test_the_output_gradient_is_freed_when_the_backward_last_reads_it():
    # With the loss outside the model, autograd handed the plan's backward a full gradient of the
    # output and held it until that whole backward returned; eager frees it after the head's backward.
    # The step peaked one output gradient (1 MiB here) above eager: 5.57 MiB against 4.75 MiB.
    torch.manual_seed(0)
    model, x, y = _WideHead(), torch.randn(64, 16), torch.randint(0, 4096, (64,))
    opt = memplan.optimize(model)

    def step(m):
        def run():
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(m(x), y).backward()
        return run

    step(opt)()
    eager, planned = memplan.measure(step(model)).peak, memplan.measure(step(opt)).peak
    assert planned <= eager
    loss = lambda m: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    trained = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad(loss(model), trained)
    got = torch.autograd.grad(loss(opt), trained)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_output_hooks_and_retained_gradients_see_the_real_gradient():
    # The plan's backward takes the outputs' gradients through a node of its own: a hook on an output
    # and retain_grad() must still see the gradient autograd computed, and a second backward with
    # retain_graph must compute the same gradients again.
    torch.manual_seed(0)
    model, x = _WideHead(hidden=32).requires_grad_(True), torch.randn(8, 16)
    opt = memplan.optimize(model)
    seen = []
    out = opt(x)
    out.retain_grad()
    out.register_hook(lambda g: seen.append(g.clone()))
    weight = torch.randn(8, 4096)
    (out * weight).sum().backward(retain_graph=True)
    torch.testing.assert_close(out.grad, weight)
    torch.testing.assert_close(seen[0], weight)
    first = model.head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    (out * weight).sum().backward()
    torch.testing.assert_close(model.head.weight.grad, first)


def _accumulating_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)], nn.Linear(256, 10))


def test_gradients_added_to_existing_grads_are_freed_as_they_are_made():
    # With .grad already there (the second micro-batch of gradient accumulation), autograd adds the
    # plan's gradients only after its whole backward returned: all of them were alive at once, a step
    # 1.67x eager's peak (5x after zero_grad(set_to_none=False)). Now each is added as it is made.
    model = _accumulating_model()
    xs, ys = [torch.randn(8, 256) for _ in range(2)], [torch.randint(0, 10, (8,)) for _ in range(2)]
    opt = memplan.optimize(model)

    def accumulate(m):
        def run():
            model.zero_grad(set_to_none=True)
            for x, y in zip(xs, ys):
                torch.nn.functional.cross_entropy(m(x), y).backward()
        return run

    accumulate(opt)()
    planned = [p.grad.clone() for p in model.parameters()]
    accumulate(model)()
    for got, expected in zip(planned, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    eager, measured = memplan.measure(accumulate(model)).peak, memplan.measure(accumulate(opt)).peak
    assert measured <= eager


def test_gradients_go_through_autograd_where_something_watches_them():
    # A hook on a parameter, autograd.grad, and backward(inputs=...) leaving a parameter out: autograd's
    # own accumulation (or none) must happen, never the plan's.
    model, x = _accumulating_model(), torch.randn(4, 256)
    opt = memplan.optimize(model)
    first, last = model[0][0].weight, model[-1].weight
    opt(x).sum().backward()
    before = {p: p.grad.clone() for p in model.parameters()}
    seen = []
    handle = first.register_hook(lambda g: seen.append(g.clone()))
    opt(x).sum().backward()
    handle.remove()
    torch.testing.assert_close(seen[0], before[first], rtol=0, atol=0)  # the same batch: the same gradient
    for p in model.parameters():
        torch.testing.assert_close(p.grad, 2 * before[p])
    grads = torch.autograd.grad(opt(x).sum(), [first])  # .grad untouched
    torch.testing.assert_close(grads[0], before[first], rtol=0, atol=0)
    for p in model.parameters():
        torch.testing.assert_close(p.grad, 2 * before[p])
    opt(x).sum().backward(inputs=[last])  # only last accumulates
    torch.testing.assert_close(last.grad, 3 * before[last])
    torch.testing.assert_close(first.grad, 2 * before[first])


class _ReturnsItsHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(12, 12), nn.Linear(12, 6)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        return self.l2(h), h


def test_a_hook_on_an_output_the_model_also_reads_is_refused():
    # The plan's backward adds the inside path's gradient itself: h.retain_grad() saw only the outside
    # part, and a hook returning 3 * g changed only that part (l1's weight gradient off by 4.8).
    torch.manual_seed(0)
    model, x = _ReturnsItsHidden(), torch.randn(5, 12)
    opt = memplan.optimize(model)
    a, h = opt(x)
    h.register_hook(lambda g: g * 3)
    with pytest.raises(memplan.OutputGradientHookError, match="also reads it inside"):
        (a.square().sum() + h.sum()).backward()
    a, h = opt(x)  # without a hook, the same step is the model's
    (a.square().sum() + h.sum()).backward()
    assert_equivalent(model, opt, x)


class _ReturnsAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(12, 12)

    def forward(self, x):
        return (self.l1(x) * 2).t()


def test_an_output_that_is_a_view_can_be_written_in_place():
    # autograd refused in-place writes into a view a custom function returns; eager allows them.
    torch.manual_seed(0)
    model, x = _ReturnsAView(), torch.randn(5, 12)
    opt = memplan.optimize(model)
    grads = []
    for m in (model, opt):
        model.zero_grad(set_to_none=True)
        out = m(x)
        out.mul_(3)
        out.square().sum().backward()
        grads.append(model.l1.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])


class _FillsItsOutput(nn.Module):
    """A recurrence that writes each state into a slice of the output it returns, and reads a slice
    it wrote before writing the next ones: the backward saves views of the output that were made
    before later writes to it."""

    def __init__(self, steps: int = 3):
        super().__init__()
        self.steps = steps
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.v = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        h = x.new_zeros(4, 8)
        out = x.new_zeros(4, self.steps, 8)
        first = None
        for t in range(self.steps):
            h = torch.tanh(x[:, t] @ self.w + h)
            out[:, t] = h
            if first is None:
                first = out[:, 0]  # a view of the output, written after it is made
        return out, first * self.v


@pytest.mark.parametrize("passes", ["", None])
def test_a_saved_view_of_an_output_written_after_it_is_made_unpacks(passes):
    # The forward runs under no_grad: a saved view of a storage written afterwards, whose base then
    # became an output requiring grad, made autograd refuse to unpack the saved tensors ("A view was
    # created in no_grad mode and its base ... has been modified inplace").
    torch.manual_seed(0)
    model, x = _FillsItsOutput(), torch.randn(4, 3, 8, requires_grad=True)
    opt = memplan.optimize(model, passes=passes)
    assert_equivalent(model, opt, x)
    saved = opt.plan.emitted.saved
    assert any(name.startswith(("select", "copy_")) for name in saved), saved  # the case under test
    for m in (model, opt):  # memory the backward saved, written before it runs: refused as in eager
        out, y = m(x)
        out.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (out.sum() + y.sum()).backward()


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(12, 12), nn.Linear(12, 6)

    def forward(self, x):
        return self.l1(x), self.l2(x)


def test_parameters_the_loss_does_not_reach_get_no_gradient():
    # The plan gave l2 a gradient of zeros where eager gives None: optimizers then step it (Adam's
    # momentum, AdamW's decay).
    model, x = _TwoHeads(), torch.randn(5, 12)
    opt = memplan.optimize(model)
    first, _ = opt(x)
    first.sum().backward()
    assert model.l2.weight.grad is None and model.l2.bias.grad is None
    assert model.l1.weight.grad is not None


def test_the_autocast_cache_setting_is_part_of_the_signature():
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    opt = memplan.optimize(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            opt(x)
    assert opt.plans_built == 2
