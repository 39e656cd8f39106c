"""Plans run on a GPU: the ruler, one plan per pass, a plan on another stream than the default, the caching
allocator across steps, and the host tier (offload). Skipped without a CUDA device; ``benchmarks/cuda_check.py``
runs them (``pytest -m cuda``) when a GPU is lent."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memplan
import memplan.examples as examples
from memplan.analysis.peak import step_margin
from memplan.measure import allocator_peak, measure
from memplan.ops import _PENDING, offload
from memplan.steps import clear_grads, step_fn
from memplan.testing import assert_equivalent

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

#: A measured peak may exceed its prediction by this share (the CUDA check's tolerance); kernels' own
#: temporaries (embedding_dense_backward's) are outside the graph.
TOLERANCE = 0.05

#: One workload per pass of the default pipeline where the pass acts at the small sizes.
PASS_WORKLOADS = [("rewrite", "broadcast_matmul"), ("chunk", "chain_product"), ("timesteps", "latent_gru"),
                  ("remat", "seq2seq"), ("inplace", "chain_product"), ("concat", "seq2seq"), ("schedule", "maxsim")]


def deep_mlp(width=1024, depth=6, batch=4096):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*layers).cuda(), (torch.randn(batch, width, device="cuda"),)


def warmed_peak(step):
    """The measured peak of one step after a warm-up step (cuBLAS's workspace and handles made outside it)."""
    step()
    torch.cuda.synchronize()
    return measure(step, device="cuda").peak


def test_the_ruler_agrees_with_the_allocators_peak():
    model, inputs = deep_mlp(512, 4, 2048)
    step = step_fn(model, inputs, train=True)
    step()
    ruler = measure(step, device="cuda").peak
    clear_grads(model, inputs)
    allocator = allocator_peak(step, device=torch.device("cuda"))
    assert ruler > 0 and abs(ruler - allocator) <= TOLERANCE * allocator
    predicted = memplan.analyze(model, *inputs).peak
    assert abs(ruler - predicted) <= TOLERANCE * predicted


@pytest.mark.parametrize("name,workload", PASS_WORKLOADS, ids=[f"{p}-{w}" for p, w in PASS_WORKLOADS])
def test_one_plan_per_pass_gives_eager_values_at_its_predicted_peak(name, workload):
    w = examples.make(workload, size="small", device="cuda")
    optimized = memplan.optimize(w.model, passes=name)
    assert_equivalent(w.model, optimized, *w.inputs)
    plan = optimized.plan_for(*w.inputs)
    predicted = plan.planned_peak + step_margin(plan.graph)
    measured = warmed_peak(step_fn(optimized, w.inputs, train=True))
    assert measured <= predicted * (1 + TOLERANCE), (measured, predicted)


def test_offload_on_a_gpu_gives_eager_values_at_its_predicted_peak_and_leaves_no_copy_pending():
    model, inputs = deep_mlp()
    optimized = memplan.optimize(model, passes="offload", max_overhead=1.0,
                                 options={"offload.when": "always", "offload.min_bytes": 1})
    assert_equivalent(model, optimized, *inputs)
    plan = optimized.plan_for(*inputs)
    assert any(n.target is offload for n in plan.graph.gm.graph.nodes)
    predicted = plan.planned_peak + step_margin(plan.graph)
    measured = warmed_peak(step_fn(optimized, inputs, train=True))
    eager = warmed_peak(step_fn(model, inputs, train=True))
    assert measured <= predicted * (1 + TOLERANCE) and measured < eager
    torch.cuda.synchronize()
    assert not _PENDING  # every copy's event was waited for


@pytest.mark.parametrize("options", [{}, {"offload.when": "always", "offload.min_bytes": 1}], ids=["default", "offload"])
def test_a_plan_runs_on_the_current_stream_when_it_is_not_the_default(options):
    model, inputs = deep_mlp(512, 4, 2048)
    optimized = memplan.optimize(model, options=options)
    torch.manual_seed(0)
    expected = model(*inputs)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    clear_grads(model, inputs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # the first call plans
            clear_grads(optimized, inputs)
            got = optimized(*inputs)
            got.sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, expected)
    for p, g in zip(optimized.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


def test_the_caching_allocator_reuses_a_plans_memory_across_steps():
    w = examples.make("chain_product", size="small", device="cuda")
    step = step_fn(memplan.optimize(w.model), w.inputs, train=True)
    step()
    step()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    peaks = []
    for _ in range(3):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
    assert torch.cuda.memory_reserved() == reserved  # no new segments once warm
    assert max(peaks) == min(peaks)


def test_dropouts_output_made_again_from_its_mask_is_the_forwards_bits():
    """What the rewrite's dropout peephole relies on (memplan.passes._rewrite.dropout_mask), on CUDA's kernels."""
    x = torch.randn(1024, 1024, device="cuda")
    for p in (0.1, 0.3, 0.5):
        out, mask = torch.ops.aten.native_dropout(x, p, True)
        again = torch.ops.aten.native_dropout_backward(x, mask, 1.0 / (1.0 - p))
        assert torch.equal(out.view(torch.int32), again.view(torch.int32))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.drop = nn.Linear(16, 48), nn.Dropout(0.1)

        def forward(self, x):
            q, k, v = self.qkv(x).view(*x.shape[:-1], 3, 16).unbind(-2)
            return self.drop(torch.softmax(q @ k.transpose(-1, -2), -1)) @ v

    model, x = Layer().cuda(), torch.randn(4, 128, 16, device="cuda", requires_grad=True)
    optimized = memplan.optimize(model, passes="rewrite")
    assert_equivalent(model, optimized, x, exact=True)
    assert "native_dropout_backward" in optimized.code


def test_a_staged_backward_hands_gradients_to_their_hooks_as_they_are_made_on_a_gpu():
    # An optimizer step in the backward (post-accumulate-grad hooks): the plan's backward runs in stages on
    # the GPU's autograd thread; each hook fires before the backward ends and frees its gradient.
    model, inputs = deep_mlp(512, 6, 256)
    twin, _ = deep_mlp(512, 6, 256)
    opt = memplan.optimize(model)
    fired: list[int] = []
    progress = [0]

    def hook(p):
        fired.append(progress[0])
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    step_fn(opt, inputs, train=True)()  # plans

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            progress[0] += 1
            return func(*args, **(kwargs or {}))

    fired.clear()
    loss = opt(*inputs).square().mean()
    progress[0] = 0
    with Count():
        loss.backward()
    torch.cuda.synchronize()
    assert len(fired) == len(list(model.parameters())) and min(fired) < progress[0]
    assert all(p.grad is None for p in model.parameters())
    grads = torch.autograd.grad(twin(*inputs).square().mean(), list(twin.parameters()))
    found = torch.autograd.grad(opt(*inputs).square().mean(), list(model.parameters()))
    for got, expected in zip(found, grads):
        torch.testing.assert_close(got, expected)
