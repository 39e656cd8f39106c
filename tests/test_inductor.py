"""Plans compiled by Inductor (memplan/inductor.py): ``optimize(model, inductor=True)`` and
``memplan.compile.backend(inductor=True)`` train as eager does (outputs, gradients, random draws, running
statistics), keep memplan's saved set, and hold no more than the op-by-op plan predicts."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

import memplan
import memplan.compile
from memplan.equivalence import assert_equivalent
from memplan.examples import make
from memplan.inductor import PIPELINE
from memplan.measure import allocator_peak
from memplan.steps import step_fn

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="Inductor compiles C++ on a CPU: no C++ compiler here"),
              pytest.mark.usefixtures("fresh_dynamo")]


class TwoDropouts(nn.Module):
    """Two draws on two branches that nothing orders but the program: a compiler free to reorder them
    would swap their noise."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(24, 48)
        self.b = nn.Linear(24, 48)
        self.c = nn.Linear(48, 5)
        self.norm = nn.BatchNorm1d(48)

    def forward(self, x):
        left = nn.functional.dropout(torch.tanh(self.a(x)), 0.3)
        right = nn.functional.dropout(nn.functional.gelu(self.b(x)), 0.2)
        return self.c(torch.relu(self.norm(left * right)))


def test_a_plan_compiled_by_inductor_trains_as_eager_draws_included():
    torch.manual_seed(0)
    model = TwoDropouts().train()
    opt = memplan.optimize(copy.deepcopy(model), inductor=True)
    x = torch.randn(16, 24, requires_grad=True)
    assert_equivalent(model, opt, x)  # same seed: the same noise, outputs and gradients
    assert opt.plan.pipeline == ",".join(PIPELINE)
    # the dropout noise is kept, not drawn again from the generator's state (see memplan.inductor)
    assert not any("rng_state" in str(n.target) for n in opt.plan.graph.gm.graph.nodes)
    # three optimizer steps from the same seed: parameters, running statistics and the stream alike
    reference, planned = copy.deepcopy(model), memplan.optimize(copy.deepcopy(model), inductor=True)
    sgd = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, planned)]
    draws = []
    for module, optimizer in zip((reference, planned), sgd):
        torch.manual_seed(1)
        for _ in range(3):
            optimizer.zero_grad()
            module(x.detach()).square().mean().backward()
            optimizer.step()
        draws.append(torch.rand(3))
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)
    for (name, p), q in zip(reference.state_dict().items(), planned.state_dict().values()):
        torch.testing.assert_close(q, p, msg=name)


class Encoder(nn.Module):
    """torch's transformer layers, batch first, dropout on: a dropout draws for the attention's output, a
    transposed view, whose noise fills memory in the view's order (Inductor, laying its copy out
    contiguously, gave every element another number than eager's)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x, mask):
        return self.encoder(x, src_key_padding_mask=mask)


def test_a_draw_for_a_transposed_view_gets_eagers_numbers():
    torch.manual_seed(0)
    model = Encoder().train()
    x, mask = torch.randn(2, 12, 32, requires_grad=True), torch.zeros(2, 12, dtype=torch.bool)
    mask[1, 6:] = True
    assert_equivalent(model, memplan.optimize(copy.deepcopy(model), inductor=True), x, mask)


def test_the_compiled_plan_keeps_memplans_saved_set_and_its_peak():
    """The broadcast matmul's plan (its expanded weight never made, the product chunked by a loop)
    compiled: the forward hands the backward exactly the plan's saved values, and the step holds what the
    op-by-op plan predicts, by the allocator (the chunk loop runs as one opaque operator: Inductor would
    unroll it and sum the chunks' partial gradients in one kernel that holds them all), whether the
    loss's gradient comes dense or as a broadcast scalar."""
    workload = make("broadcast_matmul", size="small")
    opt = memplan.optimize(copy.deepcopy(workload.model), inductor=True)
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in workload.inputs]
    assert_equivalent(workload.model, opt, *inputs)  # dense tangents
    plan = opt.plan
    assert any(n.op == "call_module" for n in plan.graph.gm.graph.nodes)  # a chunk loop
    flat = [*(p for p in workload.model.parameters()), *inputs]
    own = memplan.optimize(copy.deepcopy(workload.model)).plan_for(*inputs)  # memplan's own code
    assert own.emitted.saved == plan.emitted.saved
    with torch.no_grad():
        compiled = plan.emitted.run_forward([t.detach() for t in flat])
        reference = own.emitted.run_forward([t.detach() for t in flat])
    assert len(compiled) == len(reference) == plan.emitted.n_outputs + len(plan.emitted.saved)
    for got, expected in zip(compiled, reference):
        torch.testing.assert_close(got, expected)
    step = step_fn(opt, inputs, train=True)  # the loss's sum: a broadcast scalar tangent
    step()
    measured = allocator_peak(step)
    assert measured <= 1.01 * plan.planned_peak, (measured, plan.planned_peak)
    assert 10 * plan.planned_peak < plan.eager_peak


def test_the_backend_compiles_each_planned_graph_with_inductor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 3))
    planner = memplan.compile.backend(inductor=True)
    compiled = torch.compile(copy.deepcopy(model), backend=planner)
    x = torch.randn(9, 12, requires_grad=True)
    assert_equivalent(model, compiled, x)
    (module,) = planner.modules
    assert module.inductor and module.plan.emitted.run_forward.compile_seconds > 0  # compiled
    assert "inductor=True" in repr(planner)


def test_a_plan_compiled_by_inductor_refuses_offload_up_front():
    with pytest.raises(ValueError, match="offload.*Fix: drop"):
        memplan.optimize(nn.Linear(2, 2), inductor=True, passes="remat,offload")
    with pytest.raises(ValueError, match="offload.*Fix: drop"):
        memplan.compile.backend(inductor=True, passes="offload")


def test_a_plan_inductor_cannot_compile_is_planned_again_as_memplans_code_with_a_warning():
    """The seq2seq example's plan remakes an in-place unit in its backward through ``as_strided`` views,
    whose writes torch's functionalization refuses: that signature is planned again without
    ``inductor=True`` (memplan's own backward reads the storages its own forward saved, so the two run
    together), with the default pipeline, and runs as memplan's code, its peak the plan's."""
    workload = make("seq2seq", size="small")
    opt = memplan.optimize(copy.deepcopy(workload.model), inductor=True)
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
              for x in workload.inputs]
    with pytest.warns(memplan.CompileFallbackWarning, match="could not compile the plan's backward") as caught:
        assert_equivalent(workload.model, opt, *inputs)
    assert [w.message.module for w in caught if issubclass(w.category, memplan.CompileFallbackWarning)] == ["backward"]
    assert opt.plan.pipeline == ",".join(memplan.api.DEFAULT_PIPELINE)
    step = step_fn(opt, inputs, train=True)
    step()
    assert allocator_peak(step) <= 1.01 * opt.plan.planned_peak
