"""emit: the code that runs is the code fx generates for the emitted modules, character for character.

emit writes the forward and backward code straight from the planned graph's nodes and builds the fx
modules only when they are read. These tests compare that code with fx's own (``python_code`` of the
modules), check what happens where the direct code generation steps aside, and that plans still run.
"""

import pytest
import torch
from torch import nn

import memplan
import memplan.emit as emit_module
import memplan.examples as examples
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
    assert_equivalent(model, memplan.optimize(model, passes=""), x, rtol=0, atol=0)
    assert_equivalent(model, memplan.optimize(model), x, rtol=1e-6, atol=1e-6)


def test_unsupported_graphs_run_fx_code(monkeypatch):
    def unsupported(program):
        raise emit_module._Unsupported("for the test")

    monkeypatch.setattr(emit_module, "_boxed_source", unsupported)
    model, inputs = random_model(3, requires_grad_input=True)
    opt = memplan.optimize(model)
    assert_equivalent(model, opt, *inputs, rtol=0, atol=0)
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
