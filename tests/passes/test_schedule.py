"""The schedule pass: a valid order with a lower simulated peak, never a higher one, same results."""

import copy
import dataclasses
import heapq

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import memplan.examples as examples
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.api import optimize
from memplan.capture import Phase, capture
from memplan.graphutil import copy_graph, is_random
from memplan.measure import measure
from memplan.passes.schedule import STRATEGIES, SchedulePlan, ScheduleProblem, apply_schedule, plan_schedule
from memplan.graphutil import mutated_args
from memplan.pipeline import PassManager
from memplan.steps import step_fn
from memplan.testing import assert_equivalent, is_well_conditioned, random_model, zoo

EXAMPLES = [examples.make(name) for name in examples.WORKLOADS]
ZOO = list(zoo())
# capture leaves ``getitem`` of a None gradient without meta["val"]; pipeline.verify rejects every changed
# graph holding one (a capture bug, reported).


def with_graph_lifetimes(graph):
    return dataclasses.replace(graph, lifetimes="graph")


def peak(graph):
    return AnalysisManager(with_graph_lifetimes(graph)).get(PeakSimulation).peak


def order(graph):
    return [n.name for n in graph.gm.graph.nodes if n.op == "call_function"]


def run(graph, pipeline="schedule"):
    return PassManager(pipeline).run(graph)


# ----------------------------------------------------------------------------------------------
# (a) outputs and gradients equal to the untouched model


@pytest.mark.parametrize("workload", EXAMPLES, ids=[w.name for w in EXAMPLES])
def test_examples_outputs_and_gradients_match_and_the_peak_never_rises(workload):
    opt = optimize(workload.model, passes="inplace,schedule")
    assert_equivalent(workload.model, opt, *workload.inputs)
    plans = [opt.plan]
    with torch.no_grad():
        assert_equivalent(workload.model, opt, *workload.inputs, grad=False)
    plans.append(opt.plan)
    assert [plan.training for plan in plans] == [True, False]
    for plan in plans:
        for record in plan.records:
            assert record.peak_after <= record.peak_before, (plan.training, record.name)


@pytest.mark.parametrize("item", ZOO, ids=[z.name for z in ZOO])
def test_zoo_outputs_and_gradients_match(item):
    with torch.no_grad():
        assert_equivalent(item.model, optimize(item.model, passes="schedule"), *item.inputs, grad=False)
    assert_equivalent(item.model, optimize(item.model, passes="schedule"), *item.inputs)


class NoisyNorm(nn.Module):
    """Random ops and buffer updates (BatchNorm) that must keep their order."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        a = torch.nn.functional.dropout(self.fc(x), 0.5)
        b = torch.randn_like(x).exp().sum(0)
        return self.bn(a).tanh().sum(1) + b.sum(), torch.rand_like(x) * x


def test_random_ops_and_buffer_updates_behave_like_eager():
    torch.manual_seed(0)
    model = NoisyNorm()
    reference = copy.deepcopy(model)
    opt = optimize(model, passes="schedule")
    x = torch.randn(8, 16)
    assert_equivalent(reference, opt, x, exact=True)
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# (b) golden order on a small hand model


def two_branches(x):
    a = x.exp()
    b = x.sin()  # eager holds a and b together
    ra = a.sum(0)
    rb = b.sum(0)
    return ra * rb


def test_golden_order_finishes_one_branch_before_the_next():
    graph = capture(two_branches, torch.randn(64, 64), train=False)
    assert order(graph) == ["exp", "sin", "sum_1", "sum_2", "mul"]
    result = run(graph)
    assert order(result.graph) == ["exp", "sum_1", "sin", "sum_2", "mul"]
    assert result.records[0].plan.strategy == "lpmf"
    assert "forward(self, args_0)" in result.graph.gm.code


# ----------------------------------------------------------------------------------------------
# (c) behaviour: strictly lower peaks where the order matters, untouched where it does not


class Branches(nn.Module):
    """Four branches that each blow up to (n, 4d) and reduce back: eager interleaves them."""

    def __init__(self, d=64):
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(4))

    def forward(self, x):
        wide = [up(x) for up in self.ups]
        acts = [w.relu() for w in wide]
        return sum(a.sum(1) for a in acts)


def test_branching_model_has_a_strictly_lower_peak_simulated_and_measured():
    torch.manual_seed(0)
    model, x = Branches(), torch.randn(128, 64)
    graph = capture(model, x, train=False)
    before = peak(graph)
    result = run(graph)
    record = result.records[0]
    assert record.changed and peak(result.graph) <= 0.5 * before
    assert record.peak_after == peak(result.graph) == record.plan.peak
    assert record.stats.bytes_saved == before - peak(result.graph)
    with torch.no_grad():
        empty = measure(step_fn(optimize(model, passes=""), (x,), train=False)).peak
        scheduled = measure(step_fn(optimize(model, passes="schedule"), (x,), train=False)).peak
    assert scheduled <= 0.5 * empty


class Spread(nn.Module):
    """Training: branches whose wide temporaries autograd does not save (mul by a scalar, add, sum)."""

    def __init__(self, k=4):
        super().__init__()
        self.scales = nn.Parameter(torch.linspace(0.5, 2.0, k))

    def forward(self, x):
        wide = [x * scale for scale in self.scales]
        shifted = [w + 1.0 for w in wide]
        return sum(s.sum() for s in shifted)


def test_branching_training_step_has_a_strictly_lower_peak_simulated_and_measured():
    model, x = Spread(), torch.randn(256, 256)
    graph = capture(model, x, train=True, seed="tangents")
    before = peak(graph)
    result = run(graph)
    assert peak(result.graph) < before
    steps = {}
    for passes in ("", "schedule"):
        steps[passes] = step_fn(optimize(model, passes=passes), (x,), train=True)
        steps[passes]()
    assert measure(steps["schedule"]).peak < measure(steps[""]).peak
    assert_equivalent(model, optimize(model, passes="schedule"), x)


def test_broadcast_matmul_training_peak_halves():
    workload = examples.make("broadcast_matmul")
    graph = capture(workload.model, *workload.inputs, train=True, seed="tangents")
    before = peak(graph)
    result = run(graph)
    assert peak(result.graph) < 0.6 * before
    steps = {}
    for passes in ("", "schedule"):
        steps[passes] = step_fn(optimize(workload.model, passes=passes), workload.inputs, train=True)
        steps[passes]()
    assert measure(steps["schedule"]).peak < 0.6 * measure(steps[""]).peak


def test_a_straight_chain_is_left_untouched():
    graph = capture(lambda x: x.exp().sin().cos(), torch.randn(32), train=False)
    code = graph.gm.code
    result = run(graph)
    assert not result.records[0].changed and result.graph.gm.code == code
    assert result.records[0].plan.strategy == "original"


@pytest.mark.parametrize("item", ZOO, ids=[z.name for z in ZOO])
def test_never_a_higher_peak_than_the_input_order(item):
    for train in (False, True):
        graph = with_graph_lifetimes(capture(item.model, *item.inputs, train=train, seed="tangents"))
        plan = plan_schedule(graph, AnalysisManager(graph))
        assert plan.peak <= plan.peak_before == peak(graph)


# ----------------------------------------------------------------------------------------------
# (d) invariant oracles on random graphs


def check_order(original, scheduled):
    """Dependencies, phases, random ops, writers: an oracle that does not use the pass's own edges."""
    position = {name: i for i, name in enumerate(order(scheduled))}
    old_position = {name: i for i, name in enumerate(order(original))}
    nodes = [n for n in scheduled.gm.graph.nodes if n.op == "call_function"]
    assert sorted(position) == sorted(old_position)
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.name in position:
                assert position[arg.name] < position[node.name], f"{node.name} runs before its input {arg.name}"
    phases = [scheduled.phases[n.name] for n in nodes]
    assert phases == sorted(phases, key=lambda p: p is Phase.BACKWARD), "a node crossed the phase boundary"
    ordered = [n.name for n in nodes if is_random(n) or mutated_args(n)]
    assert ordered == sorted(ordered, key=old_position.__getitem__), "random or mutating ops were reordered"
    # every reader of a written storage stays on its side of the write
    storage = {}
    for node in nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            storage[node.name] = value.untyped_storage()._cdata
    for writer in nodes:
        for target in mutated_args(writer):
            written = target.meta["val"].untyped_storage()._cdata
            for reader in nodes:
                if reader is writer or not any(storage.get(a.name) == written for a in reader.all_input_nodes):
                    continue
                before_now = position[reader.name] < position[writer.name]
                before_then = old_position[reader.name] < old_position[writer.name]
                assert before_now == before_then, f"{reader.name} moved across the write by {writer.name}"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), train=st.booleans(), steps=st.integers(6, 24))
def test_random_programs_keep_every_constraint_and_never_rise(seed, train, steps):
    model, inputs = random_model(seed, steps=steps, requires_grad_input=train)
    graph = capture(model, *inputs, train=train, seed="tangents")
    # inplace may add and remove nodes (fused accumulations, concatenations): schedule's reference is its output
    reference = run(capture(model, *inputs, train=train, seed="tangents"), "inplace").graph
    before = peak(graph)
    result = run(graph, "inplace,schedule")
    check_order(reference, result.graph)
    assert peak(result.graph) <= before
    if not is_well_conditioned(model, *inputs):
        return  # its rounding error, or an overflow to NaN, is past any tolerance
    if train:
        assert_equivalent(model, optimize(model, passes="inplace,schedule"), *inputs)
    else:
        with torch.no_grad():
            assert_equivalent(model, optimize(model, passes="inplace,schedule"), *inputs, grad=False)


def random_problem(seed, steps, train):
    """A seeded random model's captured graph (graph lifetimes) and its schedule problem."""
    model, inputs = random_model(seed, steps=steps, requires_grad_input=train)
    graph = with_graph_lifetimes(capture(model, *inputs, train=train, seed="tangents"))
    return graph, ScheduleProblem(graph, AnalysisManager(graph))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_every_strategy_gives_a_valid_order_and_the_simulation_matches_the_analysis(seed):
    graph, problem = random_problem(seed, 16, True)
    assert problem.simulate(range(problem.n)) == peak(graph)
    for name, strategy in STRATEGIES.items():
        assert problem.is_valid(strategy(problem)), name


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), train=st.booleans())
def test_the_simulated_peak_of_every_candidate_is_the_analysis_of_the_reordered_graph(seed, train):
    """``simulate`` (vectorised) against PeakSimulation of the graph actually put in each order."""
    graph, problem = random_problem(seed, 16, train)
    for name, strategy in STRATEGIES.items():
        candidate = strategy(problem)
        names = tuple(problem.names[i] for i in candidate)
        reordered = apply_schedule(copy_graph(graph), SchedulePlan(names, name, ((name, 0),)))
        assert order(reordered) == list(names)
        assert problem.simulate(candidate) == peak(reordered), name


def kahn_by_depth(problem):
    """The reference for ``bfs``: Kahn's algorithm taking the ready node of lowest (depth, position),
    backward nodes released only once every forward node is placed."""
    depth = [0] * problem.n
    for i in range(problem.n):
        for j in problem.preds[i]:
            depth[i] = max(depth[i], depth[j] + 1)
    indegree = [len(ps) for ps in problem.preds]
    forward_left, waiting, ready, result = problem.n_forward, [], [], []

    def release(i):
        if problem.backward[i] and forward_left > 0:
            waiting.append(i)
        else:
            heapq.heappush(ready, (depth[i], i))

    for i in range(problem.n):
        if indegree[i] == 0:
            release(i)
    while ready:
        _, pick = heapq.heappop(ready)
        result.append(pick)
        if not problem.backward[pick]:
            forward_left -= 1
            if forward_left == 0:
                for i in waiting:
                    release(i)
        for j in problem.succs[pick]:
            indegree[j] -= 1
            if indegree[j] == 0:
                release(j)
    assert len(result) == problem.n
    return result


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), train=st.booleans())
def test_bfs_is_kahns_algorithm_by_depth(seed, train):
    """``bfs`` sorts instead of running the greedy: the same order."""
    _, problem = random_problem(seed, 20, train)
    assert STRATEGIES["bfs"](problem) == kahn_by_depth(problem)


class _CheckpointedLM(nn.Module):
    """A tiny language model whose residual block is checkpointed: the order best for a .sum() seed
    keeps the logits' gradient alive through the recomputed block."""

    def __init__(self, vocab=256, width=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        return self.head(h)


def test_an_order_is_not_taken_when_a_loss_outside_the_model_would_pay_for_it():
    # The pass chose the order with the lowest peak for a .sum() seed, a broadcast scalar; with a
    # cross-entropy over the logits the gradient is as large as the logits, and that order held it
    # longer: the step peaked 16.7% above eager's (590,088 B -> 688,392 B).
    torch.manual_seed(0)
    model = _CheckpointedLM()
    tokens, targets = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    opt = optimize(model, passes="schedule")

    def step(m):
        def run():
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), targets.flatten()).backward()
        return run

    step(opt)()
    assert measure(step(opt)).peak <= measure(step(model)).peak
    assert_equivalent(model, opt, tokens)


class _SortThenMore(nn.Module):
    """A sort whose values die early and whose indices are read last, and a max beside it."""

    def forward(self, x):
        values, indices = x.exp().sort(dim=1)
        total = values.sum(1)
        more = (x * 3).exp()
        top, where = more.max(dim=1)
        return total + top, indices.float().sum(1) + where


def test_getitems_follow_their_node_in_every_candidate_and_never_raise_the_peak():
    # A tuple holds all its items until its last getitem runs: a getitem placed late keeps them (and a
    # chunk loop's scratch) alive for nothing. A candidate that delayed one predicted 6% above what
    # the plan measured (found by the structural fuzzer, seed 414: chunk, then schedule).
    graph = with_graph_lifetimes(capture(_SortThenMore(), torch.randn(64, 32), train=False))
    problem = ScheduleProblem(graph, AnalysisManager(graph))
    sources = [i for i, items in enumerate(problem.items) if items]
    assert len(sources) >= 2
    # delay every getitem to just before its first reader
    late = [i for i in range(problem.n) if not any(i in items for items in problem.items)]
    for items in problem.items:
        for item in items:
            first = min((late.index(j) for j in problem.succs[item] if j in late), default=len(late))
            late.insert(first, item)
    assert problem.is_valid(late)
    fixed = problem.items_first(late)
    assert problem.is_valid(fixed)
    for source in sources:
        at = fixed.index(source)
        assert fixed[at + 1: at + 1 + len(problem.items[source])] == problem.items[source]
    assert problem.simulate(fixed) < problem.simulate(late)  # the sorted values die before `more` is made
    plan = plan_schedule(graph, AnalysisManager(graph))
    for source in sources:
        name = problem.names[source]
        at = plan.order.index(name)
        assert {problem.index[n] for n in plan.order[at + 1: at + 1 + len(problem.items[source])]} == set(problem.items[source])
