"""memplan as a torch.compile backend (memplan/compile.py): the same plans as memplan.optimize, run where
Dynamo puts them, checked against eager by outputs and gradients, and by the allocator's peak (compiled
code runs no dispatch mode, so memplan.measure cannot see it: memplan.measure.allocator_peak reads the
allocator itself)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memplan
import memplan.compile
from memplan.examples import make
from memplan.measure import allocator_peak
from memplan.steps import step_fn


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Broken(nn.Module):
    """Two graphs: Dynamo breaks the graph between the blocks."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 32)
        self.b = nn.Linear(32, 5)

    def forward(self, x):
        h = torch.tanh(self.a(x)) * x.sum(-1, keepdim=True)
        torch._dynamo.graph_break()
        return self.b(h).softmax(-1)


def _grads(module, inputs):
    return [p.grad for p in module.parameters()] + [x.grad for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]


def _train_step_results(module, inputs):
    for p in module.parameters():
        p.grad = None
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.grad = None
    out = module(*inputs)
    out.sum().backward()
    return out.detach(), [g.clone() for g in _grads(module, inputs)]


def _assert_close(got, expected):
    out, grads = got
    ref_out, ref_grads = expected
    torch.testing.assert_close(out, ref_out)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_the_backend_by_name_plans_every_graph_and_trains_as_eager():
    torch.manual_seed(0)
    model = Broken()
    compiled = torch.compile(copy.deepcopy(model), backend="memplan")
    x = torch.randn(7, 12, requires_grad=True)
    expected = _train_step_results(model, (x,))
    _assert_close(_train_step_results(compiled, (x,)), expected)
    _assert_close(_train_step_results(compiled, (x,)), expected)  # a second step: the plans are kept


def test_a_backend_object_keeps_each_graphs_plan_and_honours_its_budget():
    workload = make("maxsim", size="small")
    planner = memplan.compile.backend(budget="1MiB")
    compiled = torch.compile(copy.deepcopy(workload.model), backend=planner)
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in workload.inputs]
    _assert_close(_train_step_results(compiled, inputs), _train_step_results(workload.model, workload.inputs))
    assert len(planner.modules) == 1 and planner.plans[0].training
    plan = planner.plans[0]
    assert plan.planned_peak <= 2**20 < plan.eager_peak
    # what the allocator held during a compiled step is what the plan predicts
    step = step_fn(compiled, inputs, train=True)
    step()
    measured = allocator_peak(step)
    assert abs(measured - plan.planned_peak) <= 0.01 * plan.planned_peak, (measured, plan.planned_peak)


@pytest.mark.parametrize("name", ["broadcast_matmul", "chain_product"])
def test_the_backend_is_below_the_budgeted_partitioner_of_torch_compile(name):
    """Against AOTAutograd's partitioner under an activation memory budget (the compiler's knob for
    memory), each by the allocator's peak of one training step, outputs and gradients equal to eager's."""
    workload = make(name, size="small")
    peaks = {}
    results = {}
    for label, backend in (("memplan", "memplan"), ("partitioner", "aot_eager_decomp_partition")):
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=0.5):
            compiled = torch.compile(copy.deepcopy(workload.model), backend=backend)
            inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in workload.inputs]
            results[label] = _train_step_results(compiled, inputs)
            step = step_fn(compiled, inputs, train=True)
            peaks[label] = allocator_peak(step)
    expected = _train_step_results(workload.model, workload.inputs)
    for label in results:
        _assert_close(results[label], expected)
    assert peaks["memplan"] < peaks["partitioner"] / 4, peaks


def test_shapes_dynamo_makes_dynamic_are_planned_per_shape():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 24), nn.GELU(), nn.Linear(24, 3))
    planner = memplan.compile.backend()
    compiled = torch.compile(copy.deepcopy(model), backend=planner)
    for batch in (4, 9, 13):  # the second shape makes Dynamo recompile with a symbolic batch
        x = torch.randn(batch, 6, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        _assert_close(_train_step_results(compiled, (x,)), _train_step_results(model, (x_ref,)))
    assert planner.modules


def test_inference_under_no_grad_is_planned_as_inference():
    model = nn.Sequential(nn.Linear(6, 24), nn.ReLU(), nn.Linear(24, 3))
    planner = memplan.compile.backend()
    compiled = torch.compile(copy.deepcopy(model), backend=planner)
    x = torch.randn(5, 6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert planner.plans[-1] is not None and not planner.plans[-1].training


def test_bad_arguments_are_refused_when_the_backend_is_made():
    with pytest.raises(ValueError, match="nope"):
        memplan.compile.backend(passes="nope")
    with pytest.raises(ValueError, match="chunk.nope"):
        memplan.compile.backend(options={"chunk.nope": 1})
    assert "budget='1MiB'" in repr(memplan.compile.backend(budget="1MiB"))


def test_the_allocator_ruler_reads_what_measure_counts_and_what_kernels_allocate_inside():
    """The ruler of compiled code, on eager code: memplan.measure's peak, and more where a kernel allocates
    temporaries no op returns (the CPU's kthvalue sorts a copy of each row)."""
    from memplan.measure import measure

    workload = make("broadcast_matmul", size="small")
    step = step_fn(workload.model, workload.inputs, train=True)
    step()
    counted, allocated = measure(step).peak, allocator_peak(step)
    assert counted <= allocated <= 1.01 * counted  # (a few bytes of scalars made below the dispatcher)
    x = torch.randn(64, 128, requires_grad=True)
    kth_step = step_fn(lambda t: t.kthvalue(3, -1).values, (x,), train=True)
    kth_step()
    assert allocator_peak(kth_step) > measure(kth_step).peak


def test_a_module_compiled_elsewhere_is_refused_by_optimize_with_both_fixes():
    compiled = torch.compile(nn.Linear(4, 4))
    with pytest.raises(memplan.CaptureError, match=r"\._orig_mod.*backend=\"memplan\""):
        memplan.optimize(compiled)


def test_analyze_explains_a_compiled_module_through_the_program_it_runs():
    torch.manual_seed(0)
    model = Broken()
    compiled = torch.compile(model)
    x = torch.randn(7, 12, requires_grad=True)
    analysis = memplan.analyze(compiled, x)
    own = memplan.analyze(model, x)
    assert analysis.compiled and not own.compiled
    assert analysis.peak == own.peak and analysis.saved.nbytes == own.saved.nbytes
    assert "torch.compile runs" in repr(analysis)
    assert "backend.plans[i].report()" in analysis.explain().diagnosis
    assert "torch.compile" not in (own.explain().diagnosis or "")
