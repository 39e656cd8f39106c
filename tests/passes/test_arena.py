"""The arena planner: static offsets, no two live storages share a byte, close to the lower bound."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memplan.examples as examples
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.api import optimize
from memplan.capture import capture
from memplan.measure import measure
from memplan.passes.arena import ORDERS, ArenaBuffer, ArenaOptions, ArenaPlan, place, plan_arena
from memplan.pipeline import PassManager
from memplan.steps import step_fn
from memplan.testing import assert_equivalent, random_model, zoo

EXAMPLES = [examples.make(name) for name in examples.WORKLOADS]
ZOO = list(zoo())


def with_graph_lifetimes(graph):
    return dataclasses.replace(graph, lifetimes="graph")


def arena_plan(graph, **options):
    graph = with_graph_lifetimes(graph)
    return plan_arena(graph, AnalysisManager(graph), ArenaOptions(**options))


def conflicts(plan: ArenaPlan):
    """Pairs of storages live at the same time whose byte ranges overlap (the oracle: all pairs)."""
    found = []
    buffers = sorted(plan.buffers, key=lambda b: b.storage)
    for i, a in enumerate(buffers):
        for b in buffers[i + 1 :]:
            in_time = a.start <= b.end and b.start <= a.end
            oa, ob = plan.offsets[a.storage], plan.offsets[b.storage]
            in_space = oa < ob + b.nbytes and ob < oa + a.nbytes
            if in_time and in_space:
                found.append((a.storage, b.storage))
    return found


# ----------------------------------------------------------------------------------------------
# (a) outputs and gradients equal to the untouched model (the pass annotates, it never rewrites)


TRAINING_EXAMPLES = ("chain_product", "broadcast_matmul", "maxsim")  # the others are covered in inference (c)


@pytest.mark.parametrize("name", TRAINING_EXAMPLES)
def test_examples_are_unchanged_and_equivalent(name):
    workload = next(w for w in EXAMPLES if w.name == name)
    opt = optimize(workload.model, passes="arena")
    assert_equivalent(workload.model, opt, *workload.inputs, exact=True)
    (record,) = opt.plan.records
    assert not record.changed and isinstance(record.plan, ArenaPlan)


@pytest.mark.parametrize("item", ZOO, ids=[z.name for z in ZOO])
def test_zoo_is_unchanged_and_equivalent(item):
    opt = optimize(item.model, passes="arena")
    assert_equivalent(item.model, opt, *item.inputs, exact=True)
    empty = optimize(item.model, passes="")
    empty(*item.inputs)
    assert opt.code == empty.code and not opt.plan.records[0].changed


def test_preallocate_is_declined_with_a_note():
    graph = capture(lambda x: x.exp().sin(), torch.randn(64), train=False)
    code = graph.gm.code
    result = PassManager("arena", options={"arena.preallocate": True}).run(graph)
    (record,) = result.records
    assert not record.changed and result.graph.gm.code == code
    assert any("arena.preallocate is not implemented" in note for note in record.notes)


# ----------------------------------------------------------------------------------------------
# (b) golden offsets on a small hand model


def ladder(x):
    a = x.exp()  # 1 KiB
    b = a.sin()
    c = b.cos()
    d = x.sum()  # 4 bytes, rounded to 64
    return c * d


def test_golden_offsets():
    graph = with_graph_lifetimes(capture(ladder, torch.randn(256), train=False))
    plan = plan_arena(graph, AnalysisManager(graph))
    tensors = AnalysisManager(graph).get(Tensors)
    by_creator = {tensors.storages[sid].creator: offset for sid, offset in plan.offsets.items()}
    assert by_creator == {"exp": 0, "sin": 1024, "cos": 0, "sum_1": 2048, "mul": 1024}
    assert (plan.size, plan.lower_bound, plan.order) == (2112, 2052, "size")
    assert str(plan) == (
        "ArenaPlan: 5 storages in 2.06 KiB (lower bound 2.00 KiB, fragmentation 2.9%, order 'size')"
    )


# ----------------------------------------------------------------------------------------------
# (c) behaviour: within 5% of the lower bound on every example's inference plan, and it shares


@pytest.mark.parametrize("workload", EXAMPLES, ids=[w.name for w in EXAMPLES])
@pytest.mark.parametrize("passes", ["arena", "inplace,schedule,arena"])
def test_inference_arena_is_within_five_percent_of_the_lower_bound(workload, passes):
    opt = optimize(workload.model, passes=passes)
    with torch.no_grad():
        assert_equivalent(workload.model, opt, *workload.inputs, grad=False)
    step = step_fn(opt, workload.inputs, train=False)
    plan = opt.plan.records[-1].plan
    assert not opt.plan.training and plan.lower_bound == opt.plan.planned_peak
    assert plan.lower_bound <= plan.size <= 1.05 * plan.lower_bound
    assert plan.size <= sum(b.nbytes for b in plan.buffers)
    if workload.name == "chain_product":
        assert plan.size < 0.5 * sum(b.nbytes for b in plan.buffers)  # storages do share bytes
    assert measure(step).peak <= plan.size  # the ruler never sees more than the arena holds


def test_training_plans_are_placed_too():
    for item in ZOO:
        plan = arena_plan(capture(item.model, *item.inputs, train=True, seed="tangents"))
        assert plan.lower_bound <= plan.size <= 1.15 * plan.lower_bound, item.name
        assert not conflicts(plan)


# ----------------------------------------------------------------------------------------------
# (d) invariant oracles: random graphs and random buffers


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), train=st.booleans(), alignment=st.sampled_from([8, 64, 512]))
def test_random_graphs_no_two_live_storages_share_a_byte(seed, train, alignment):
    model, inputs = random_model(seed, requires_grad_input=train)
    graph = with_graph_lifetimes(capture(model, *inputs, train=train, seed="tangents"))
    am = AnalysisManager(graph)
    plan = plan_arena(graph, am, ArenaOptions(alignment=alignment))
    tensors = am.get(Tensors)
    assert set(plan.offsets) == {sid for sid, s in tensors.storages.items() if not s.external}
    assert not conflicts(plan)
    assert all(offset % alignment == 0 and b.nbytes % alignment == 0 for b in plan.buffers for offset in [plan.offsets[b.storage]])
    assert plan.lower_bound == am.get(PeakSimulation).peak
    assert plan.lower_bound <= plan.size == max(plan.offsets[b.storage] + b.nbytes for b in plan.buffers)


buffers = st.lists(
    st.tuples(st.integers(1, 64), st.integers(0, 30), st.integers(0, 10)), min_size=1, max_size=40
).map(lambda rows: tuple(ArenaBuffer(i, 64 * n, s, s + d) for i, (n, s, d) in enumerate(rows)))


@settings(max_examples=100, deadline=None)
@given(buffers=buffers, order=st.sampled_from(sorted(ORDERS)))
def test_best_fit_never_overlaps_and_respects_the_bound(buffers, order):
    offsets, size = place(buffers, ORDERS[order])
    plan = ArenaPlan(offsets, buffers, size, 0, order, (), 64)
    assert not conflicts(plan)
    live = max(sum(b.nbytes for b in buffers if b.start <= t <= b.end) for t in range(0, 41))
    assert live <= size <= sum(b.nbytes for b in buffers)
