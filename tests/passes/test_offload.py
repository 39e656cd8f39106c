"""The offload pass: saved activations wait in host memory between the forward and the backward.

On a CPU the host tier is emulated (``offload.emulate``): the same operators copy within memory, and the
ruler and the analyses count the copies as host memory, so every plan's outputs, gradients and peak are
checked here; plans for CUDA are built from this machine and their code read."""

import dataclasses

import pytest
import torch
from torch import nn

import memplan
from memplan.analysis.cost import STALL, REFERENCE_CUDA_RATES, REFERENCE_RATES, calibrate, graph_cost
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory_model import MemoryModel
from memplan.analysis.peak import step_margin
from memplan.analysis.tensors import Tensors
from memplan.capture import Phase, capture
from memplan.errors import InfeasibleBudgetError
from memplan.fuzz import check_program, structural_program
from memplan.measure import measure
from memplan.ops import TIER_OPS, offload, offload_wait_, prefetch, prefetch_wait_
from memplan.passes.offload import OffloadOptions, eligible, place, plan_offload
from memplan.steps import step_fn
from memplan.testing import assert_equivalent, zoo

EMULATE = {"offload.emulate": True, "offload.when": "always", "offload.min_bytes": 1}


def mlp(width=256, depth=6, batch=256):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
    return nn.Sequential(*layers), (torch.randn(batch, width),)


class GatedLoop(nn.Module):
    """A recurrent loop written by hand: each step's gates are saved for the backward."""

    def __init__(self, d=32, h=64):
        super().__init__()
        self.inp = nn.Linear(d, 2 * h)
        self.rec = nn.Linear(h, 2 * h, bias=False)

    def forward(self, xs, h):
        outs = []
        for x in xs.unbind(0):
            z, c = (self.inp(x) + self.rec(h)).chunk(2, -1)
            h = torch.sigmoid(z) * h + (1 - torch.sigmoid(z)) * torch.tanh(c)
            outs.append(h)
        return torch.stack(outs).pow(2).mean()


def gated_loop():
    torch.manual_seed(1)
    return GatedLoop(), (torch.randn(12, 16, 32), torch.zeros(16, 64))


def plan_of(model, inputs, passes="offload", options=EMULATE, **kwargs):
    opt = memplan.optimize(model, passes=passes, options=options, **kwargs)
    return opt, opt.plan_for(*inputs)


def moved(plan):
    return [n for n in plan.graph.gm.graph.nodes if n.target is offload]


def step_peak(module, inputs):
    return measure(step_fn(module, inputs, train=True)).peak


# ----------------------------------------------------------------------------------------------
# the operators


def test_the_operators_copy_through_host_memory_and_back():
    x = torch.randn(3, 5).t()  # strided: the copies keep the strides
    host = offload_wait_(offload(x), x)
    assert host.device.type == "cpu" and host.stride() == x.stride()
    back = prefetch_wait_(prefetch(host, x.device))
    assert torch.equal(back, x) and back.stride() == x.stride()
    assert back.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_the_ruler_counts_the_host_copy_as_host_memory():
    x = torch.randn(1024)

    def keep_host():
        host = offload_wait_(offload(x * 2), x)  # the product dies after the wait
        return prefetch_wait_(prefetch(host, x.device)) + 1

    result = measure(keep_host)
    # x * 2, then its copy back and the sum: never the host copy
    assert result.peak == 2 * 4096


def test_analyses_charge_the_host_copy_nothing():
    model, inputs = mlp(64, 4, 512)
    _, plan = plan_of(model, inputs)
    tensors = AnalysisManager(plan.graph).get(Tensors)
    hosts = [s for s in tensors.storages.values() if s.host]
    assert hosts and len(hosts) == len(moved(plan))
    assert all(s.nbytes == 0 for s in hosts)


# ----------------------------------------------------------------------------------------------
# plans: equal outputs and gradients, a lower peak, predicted exactly


@pytest.mark.parametrize("make", [mlp, gated_loop] + [lambda z=z: (z.model, z.inputs) for z in zoo()],
                         ids=["mlp", "gated_loop"] + [z.name for z in zoo()])
def test_an_emulated_plan_gives_eager_values_at_the_predicted_lower_peak(make):
    model, inputs = make()
    opt, plan = plan_of(model, inputs, max_overhead=1.0)
    assert_equivalent(model, opt, *inputs, exact=True)  # copies: the same bits
    measured = step_peak(opt, inputs)
    assert measured == plan.planned_peak + step_margin(plan.graph)
    if moved(plan):
        assert measured < step_peak(model, inputs)
        record = plan.records[-1]
        assert record.name == "offload" and record.peak_after < record.peak_before


def test_offload_after_the_default_passes_lowers_what_they_kept():
    model, inputs = mlp(256, 8, 512)
    options = dict(EMULATE)
    _, kept = plan_of(model, inputs, passes="remat,inplace,schedule", options=options, max_overhead=0.05)
    opt, plan = plan_of(model, inputs, passes="remat,inplace,schedule,offload", options=options, max_overhead=0.05)
    assert moved(plan) and plan.planned_peak < kept.planned_peak
    assert_equivalent(model, opt, *inputs)
    assert step_peak(opt, inputs) == plan.planned_peak + step_margin(plan.graph)


def test_every_backward_reader_reads_the_copy_back_and_the_tensor_dies_in_the_forward():
    model, inputs = gated_loop()
    _, plan = plan_of(model, inputs)
    graph = plan.graph
    assert moved(plan)
    for node in moved(plan):
        x = node.args[0]
        assert all(graph.phases[u.name] is Phase.FORWARD for u in x.users)
        wait = next(u for u in node.users if u.target is offload_wait_)
        fetch = next(u for u in wait.users if u.target is prefetch)
        assert graph.phases[wait.name] is Phase.FORWARD and graph.phases[fetch.name] is Phase.BACKWARD
        ready = next(iter(fetch.users))
        assert ready.target is prefetch_wait_
        assert ready.users and all(graph.phases[u.name] is Phase.BACKWARD for u in ready.users)


def test_random_values_stay_eager_across_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.3), nn.Tanh(), nn.Linear(256, 256), nn.Dropout(0.2),
                          nn.Tanh(), nn.Linear(256, 8))
    x = torch.randn(1024, 64)
    opt, plan = plan_of(model, (x,))
    assert moved(plan)
    assert all(not memplan.graphutil.is_random(n.args[0]) for n in moved(plan))
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        expected = model(x)
        expected.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch.manual_seed(seed)
        got = opt(x)
        got.sum().backward()
        torch.testing.assert_close(got, expected)
        for p, g in zip(opt.parameters(), grads):
            torch.testing.assert_close(p.grad, g)
        opt.zero_grad()


# ----------------------------------------------------------------------------------------------
# soundness: what may move


def _eligible_names(fn, *inputs):
    graph = dataclasses.replace(capture(fn, *inputs, seed="tangents"), lifetimes="graph")
    model = AnalysisManager(graph).get(MemoryModel)
    return {s.name for s in eligible(graph, model)}, graph


def test_only_the_last_write_of_a_storage_may_move():
    x = torch.randn(64, 64, requires_grad=True)

    def f(x):
        h = x + 1
        h.mul_(2)  # written after it is made, then saved by the product
        return (h * x).sin().sum()

    names, graph = _eligible_names(f, x)
    assert "add" not in names  # its storage is written after it
    assert "mul_" in names  # the value the backward reads, written last


def test_a_tensor_the_backward_reads_through_a_view_never_moves():
    x = torch.randn(64, 64, requires_grad=True)

    def f(x):
        h = x.exp()
        return (h.t() * x).sum()  # the backward reads h's transpose, a view

    names, graph = _eligible_names(f, x)
    assert "exp" not in names


def test_outputs_inputs_and_random_draws_never_move():
    x = torch.randn(64, 64, requires_grad=True)

    def f(x):
        h = x.tanh()
        d = torch.nn.functional.dropout(x, 0.5, training=True)
        return h, (h * d).sum()

    names, graph = _eligible_names(f, x)
    assert "tanh" not in names  # an output
    random = {n.name for n in graph.gm.graph.nodes if n.op == "call_function" and memplan.graphutil.is_random(n)}
    assert random and not names & random


def test_a_plain_saved_tensor_may_move():
    x = torch.randn(64, 64, requires_grad=True)
    names, _ = _eligible_names(lambda x: (x.exp() * x).sin().sum(), x)
    assert "exp" in names


# ----------------------------------------------------------------------------------------------
# the policy


def test_by_default_it_acts_only_for_a_budget():
    model, inputs = mlp(128, 6, 256)
    options = {"offload.emulate": True, "offload.min_bytes": 1}
    _, plan = plan_of(model, inputs, options=options)
    assert not moved(plan)
    eager = plan.eager_peak
    _, budgeted = plan_of(model, inputs, options=options, budget=int(0.8 * eager))
    assert moved(budgeted)
    assert budgeted.planned_peak + step_margin(budgeted.graph) <= int(0.8 * eager)


def test_no_host_tier_on_a_cpu_unless_emulated():
    model, inputs = mlp(128, 4, 128)
    _, plan = plan_of(model, inputs, options={"offload.when": "always", "offload.min_bytes": 1})
    assert not moved(plan)
    assert "no host tier" in plan.records[-1].notes[0]


def test_the_chosen_peak_never_rises_as_the_budget_falls():
    model, inputs = mlp(128, 6, 256)
    options = {"offload.emulate": True, "offload.min_bytes": 1}
    eager = plan_of(model, inputs, options=options)[1].eager_peak
    peaks = []
    for share in (0.95, 0.85, 0.75, 0.65):
        try:
            _, plan = plan_of(model, inputs, options=options, budget=int(share * eager))
        except InfeasibleBudgetError:
            break
        peaks.append(plan.planned_peak)
    assert len(peaks) >= 2 and peaks == sorted(peaks, reverse=True)


def test_candidates_price_the_transfers_and_waits():
    model, inputs = mlp(256, 6, 512)
    graph = dataclasses.replace(capture(model, *inputs, seed="tangents"), lifetimes="graph")
    memory = AnalysisManager(graph).get(MemoryModel)
    options = OffloadOptions(min_bytes=1)
    emulated = plan_offload(graph, memory, REFERENCE_RATES, options, overlap=False)
    assert len(emulated) > 1
    # emulated copies are synchronous: each candidate's overhead is its copies' whole time
    seconds = graph_cost(graph, REFERENCE_RATES)
    for candidate in emulated[1:]:
        copies = sum(2 * p.saved.nbytes for p in candidate.plan.placed) / REFERENCE_RATES.host_bandwidth
        dispatches = 4 * len(candidate.plan.placed) * REFERENCE_RATES.dispatch
        assert candidate.overhead == pytest.approx((copies + dispatches) / seconds, rel=1e-6)
        assert candidate.peak < emulated[0].peak
    # with streams, the copies overlap the ops between them: never more than synchronous copies
    overlapped = plan_offload(graph, memory, REFERENCE_RATES, options, overlap=True)
    for candidate in overlapped[1:]:
        for p in candidate.plan.placed:
            alone = 2 * p.saved.nbytes / REFERENCE_RATES.host_bandwidth
            assert p.stall_out + p.stall_in <= alone + 1e-12
            assert p.wait >= p.saved.last_forward and p.fetch <= p.saved.first_backward


def test_placement_waits_once_the_copy_is_covered():
    from memplan.passes.offload import Saved

    clock = [float(i) for i in range(21)]  # one second a position, 20 positions; the forward ends at 9
    rates = dataclasses.replace(REFERENCE_RATES, host_bandwidth=100.0)
    a = Saved("a", 0, 300, born=1, created=1, last_forward=2, first_backward=15, stop=18)  # 3 s a copy
    b = Saved("b", 1, 300, born=2, created=2, last_forward=3, first_backward=16, stop=19)
    pa, pb = place([a, b], clock, 9, rates, overlap=True)
    assert (pa.wait, pa.stall_out) == (4, 0.0)  # the copy runs from 2 to 5: the wait after position 4
    assert (pb.wait, pb.stall_out) == (7, 0.0)  # queued behind a's: 5 to 8
    # back: b from 13 to 16, before its reader at 16; a before b starts, from 10 to 13
    assert (pa.fetch, pa.stall_in) == (10, 0.0)
    assert (pb.fetch, pb.stall_in) == (13, 0.0)
    tight = dataclasses.replace(REFERENCE_RATES, host_bandwidth=30.0)  # 10 s a copy: the waits stall
    (pa,) = place([a], clock, 9, tight, overlap=True)
    assert (pa.wait, pa.stall_out) == (9, 2.0)  # 2 + 10 = 12, the forward ends at 10
    assert (pa.fetch, pa.stall_in) == (10, 5.0)  # 10 + 10 = 20, the reader at 15


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="offload.when"):
        OffloadOptions(when="sometimes")


# ----------------------------------------------------------------------------------------------
# plans for CUDA, made on this machine


def test_a_plan_for_cuda_moves_tensors_over_the_host_link_and_names_the_device():
    model, inputs = mlp(512, 6, 1024)
    opt = memplan.optimize(model, device="cuda", budget=0.9, passes="offload")
    plan = opt.plan_for(*inputs)
    assert moved(plan)
    for node in plan.graph.gm.graph.nodes:
        if node.target is prefetch:
            assert node.args[1] == torch.device("cuda", 0)
            assert node.meta["val"].device == torch.device("cuda", 0)
        if node.target is offload:
            assert node.meta["val"].device.type == "cpu"
    assert "torch.ops.memplan.prefetch.default" in opt.code and "device(type='cuda', index=0)" in opt.code
    # the waits carry their predicted stalls, which the plan's time includes
    stalls = [n.meta[STALL] for n in plan.graph.gm.graph.nodes if n.target in (offload_wait_, prefetch_wait_)]
    assert stalls and all(s >= 0 for s in stalls)
    assert plan.plan_time == pytest.approx(graph_cost(plan.graph, REFERENCE_CUDA_RATES))


def test_tier_ops_are_known_to_the_time_model():
    assert {offload, offload_wait_, prefetch, prefetch_wait_} == set(TIER_OPS)
    assert calibrate("cpu").host_bandwidth > 0
    assert REFERENCE_CUDA_RATES.host_bandwidth > 0


# ----------------------------------------------------------------------------------------------
# random programs


class RandomStack(nn.Module):
    """A seeded random stack of blocks whose activations outweigh their weights (where offload acts):
    linear layers, activations out of place and in place, layer norms, residuals, dropout, views of
    the batch, products with a parameter, halves joined again."""

    KINDS = ("linear", "tanh", "relu_", "gelu", "norm", "residual", "dropout", "transpose", "scale", "halves")

    def __init__(self, seed, width=32, depth=10):
        super().__init__()
        rng = torch.Generator().manual_seed(seed)
        pick = lambda n: int(torch.randint(n, (1,), generator=rng))  # noqa: E731
        self.kinds = [self.KINDS[pick(len(self.KINDS))] for _ in range(depth)]
        self.layers = nn.ModuleList(nn.Linear(width, width) if k == "linear" else nn.LayerNorm(width) if k == "norm"
                                    else nn.Identity() for k in self.kinds)
        self.scale = nn.Parameter(torch.rand(width, generator=rng) + 0.5)

    def forward(self, x):
        skip = x
        for kind, layer in zip(self.kinds, self.layers):
            if kind in ("linear", "norm"):
                x = layer(x)
            elif kind == "tanh":
                x = x.tanh()
            elif kind == "relu_":
                x = (x * 1.5).relu_()
            elif kind == "gelu":
                x = nn.functional.gelu(x)
            elif kind == "residual":
                x, skip = x + skip, x
            elif kind == "dropout":
                x = nn.functional.dropout(x, 0.25, training=self.training)
            elif kind == "transpose":
                x = x.t().contiguous().t().sin()
            elif kind == "scale":
                x = x * self.scale
            else:
                a, b = x.chunk(2, -1)
                x = torch.cat([a.sigmoid(), b * a], -1)
        return (x * x).mean()


@pytest.mark.parametrize("seed", range(12))
def test_random_stacks_stay_equal_and_exact_with_emulated_offload(seed):
    torch.manual_seed(seed)
    model, x = RandomStack(seed), torch.randn(512, 32, requires_grad=True)
    for passes in ("offload", "remat,inplace,schedule,offload"):
        findings = check_program(model, (x,), passes=passes, options=EMULATE, max_overhead=1.0,
                                 checks=("random", "equivalence", "peak", "prediction", "budget"))
        assert not [f for f in findings if f.failed], findings


def test_random_stacks_do_move_tensors():
    """The sweep above checks plans that move something: most stacks do."""
    movers = 0
    for seed in range(12):
        torch.manual_seed(seed)
        _, plan = plan_of(RandomStack(seed), (torch.randn(512, 32, requires_grad=True),), max_overhead=1.0)
        movers += bool(moved(plan))
    assert movers >= 8


@pytest.mark.parametrize("seed", range(300, 306))
def test_structural_programs_stay_equal_and_exact_with_emulated_offload(seed):
    model, inputs = structural_program(seed, size="default")
    findings = check_program(model, inputs, passes="remat,schedule,offload", options=EMULATE,
                             checks=("equivalence", "prediction"))
    assert not [f for f in findings if f.failed], findings


def _deep_mlp_on_meta(width=1024, depth=8, batch=8192):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*layers).to("meta"), (torch.randn(batch, width, device="meta"),)


def test_the_ladder_offers_offload_where_it_is_cheaper_than_recomputing_to_the_same_peak():
    from memplan.pipeline import PassManager
    from memplan.policy import Policy

    passes = ("remat", "inplace", "schedule", "offload")  # the default's recomputing passes, without chunk's cost
    model, inputs = _deep_mlp_on_meta()
    graph = capture(model, *inputs, seed="tangents", target_device="cuda")
    ladders = {}
    for when in ("never", "budget"):
        manager = PassManager(passes, Policy(budget=1), options={"offload.when": when})
        ladders[when] = [(result, peak, sum(n.target is offload for n in result.graph.gm.graph.nodes))
                         for result, peak in manager.ladder(graph)]
    peaks = [peak for _, peak, _ in ladders["budget"]]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert not any(moved for _, _, moved in ladders["never"])
    offloaded = [(result, peak) for result, peak, moved in ladders["budget"] if moved]
    assert offloaded
    compared = 0
    for result, peak in offloaded:
        # without offload, every plan at or below the same peak costs more predicted time (or none gets there)
        fitting = [r for r, p, _ in ladders["never"] if p <= peak]
        compared += bool(fitting)
        assert all(result.plan_time < r.plan_time for r in fitting)
    assert compared
    # and a user's budget at that peak gets the offload plan
    result, peak = offloaded[0]
    plan = memplan.optimize(model, device="cuda", budget=peak, passes=passes).plan_for(*inputs)
    assert moved(plan) and plan.planned_peak + step_margin(plan.graph) <= peak


def test_the_offload_benchmark_finds_rungs_no_plan_without_offload_beats():
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(repo / "benchmarks" / "offload.py"), "--size", "small",
                           "--workloads", "deep_mlp"], capture_output=True, text=True, timeout=300, cwd=repo)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| deep_mlp |")]
    assert rows and "no rung moves" not in rows[0]
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        peak, unit, time = re.fullmatch(r"([\d.]+) (\w+) at ([\d.]+)x", cells[2]).groups()
        assert int(cells[3].split()[0]) > 0
        without = re.fullmatch(r"([\d.]+) (\w+) at ([\d.]+)x", cells[4])
        if without:  # a plan without offload at or below the peak: never faster
            assert float(time) < float(without.group(3)), row
            assert float(without.group(1)) * units[without.group(2)] <= float(peak) * units[unit]
