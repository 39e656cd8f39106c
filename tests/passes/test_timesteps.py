"""The timesteps pass: find the steps of unrolled loops and checkpoint across them on an optimal schedule."""

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from memplan.analysis.cost import CostRates
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.api import optimize
from memplan.capture import Phase, capture
from memplan.errors import InfeasibleBudgetError, MemplanError
from memplan.examples.latent_gru import LatentGRU
from memplan.examples.seq2seq import Seq2Seq
from memplan.graphutil import is_random
from memplan.measure import measure
from memplan.analysis.peak import step_margin
from memplan.passes._remat.copies import apply_remat
from memplan.passes._remat.facts import RematFacts
from memplan.passes.timesteps import (
    Schedule,
    TimestepOptions,
    checkpoint_costs,
    find_loops,
    plan_timesteps,
    schedule_tree,
)
from memplan.pipeline import PassManager
from memplan.policy import Policy
from memplan.steps import step_fn
from memplan.testing import assert_equivalent, is_well_conditioned, random_model, zoo

RNN = next(z for z in zoo() if z.name == "rnn")

EVERY = Policy(max_overhead=math.inf)  # a policy that may take any plan: every candidate is simulated


def graph_of(model, inputs):
    return dataclasses.replace(capture(model, *inputs, seed="tangents"), lifetimes="graph")


class LSTMLoop(nn.Module):
    """An LSTM cell stepped in Python; only a head of each state is returned, so states cost memory."""

    def __init__(self, nx=8, nh=32, dropout=0.0):
        super().__init__()
        self.cell = nn.LSTMCell(nx, nh)
        self.head = nn.Linear(nh, 2)
        self.drop = nn.Dropout(dropout)

    def forward(self, seq):
        h = c = seq.new_zeros(seq.shape[1], self.cell.hidden_size)
        total = 0
        for x in seq.unbind(0):
            h, c = self.cell(self.drop(x), (h, c))
            total = total + self.head(h).square().sum()
        return total


def lstm(steps=12, dropout=0.0):
    torch.manual_seed(0)
    return LSTMLoop(dropout=dropout), (torch.randn(steps, 4, 8, requires_grad=True),)


def small_gru():
    torch.manual_seed(0)
    return LatentGRU(8, 16), (torch.randn(8, 4, 8, requires_grad=True), torch.zeros(4, 16))


def small_seq2seq():
    torch.manual_seed(0)
    return Seq2Seq(40, 40, 12, 16, 1), (torch.randint(0, 40, (6, 3)), torch.randint(0, 40, (7, 3)))


MODELS = {
    "latent_gru": small_gru,
    "seq2seq": small_seq2seq,
    "rnn": lambda: (RNN.model, RNN.inputs),
    "lstm": lstm,
    "lstm_dropout": lambda: lstm(dropout=0.3),
}


def measured(model, inputs):
    step = step_fn(model, inputs, train=True)
    step()
    return measure(step).peak


# ----------------------------------------------------------------------------------------------
# (a) outputs and gradients equal to the untouched model


@pytest.mark.parametrize("max_overhead", [0.3, 10.0])
@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_and_gradients_match(name, max_overhead):
    model, inputs = MODELS[name]()
    opt = optimize(model, passes="timesteps", max_overhead=max_overhead)
    assert_equivalent(model, opt, *inputs)


def test_dropout_inside_the_loop_is_saved_not_redrawn():
    model, inputs = lstm(dropout=0.3)
    opt = optimize(model, passes="timesteps", max_overhead=10.0)
    assert_equivalent(model, opt, *inputs)
    graph = opt.plan.graph
    assert opt.plan.records[0].changed
    assert not any(is_random(n) for n in graph.gm.graph.nodes if graph.phases.get(n.name) is Phase.BACKWARD)


# ----------------------------------------------------------------------------------------------
# (b) golden: loops found, the DP table, schedule trees


def test_loops_are_found_by_structure():
    loops = find_loops(capture(RNN.model, *RNN.inputs))
    assert [(loop.iterations, loop.period) for loop in loops] == [(11, 6)]
    model, inputs = small_seq2seq()
    graph = graph_of(model, inputs)
    am = AnalysisManager(graph)
    loops = [loop for loop in find_loops(graph, RematFacts.compute(graph, am)) if loop.period > 1]
    # the encoder steps (one LSTM cell) and the decoder steps (cell, attention, input feeding)
    assert [(loop.iterations, loop.period) for loop in loops] == [(5, 17), (5, 28)]


def test_the_boundary_goes_where_the_carried_state_is_smallest_and_splits_no_in_place_unit():
    graph = graph_of(RNN.model, RNN.inputs)
    facts = RematFacts.compute(graph, AnalysisManager(graph))
    (loop,) = find_loops(graph, facts)
    assert loop.state_bytes == 8 * 32 * 4  # the hidden state
    step = set(loop.steps[2])
    assert all(set(facts.units[n]) <= step for n in step if n in facts.units)


def test_bptt_dynamic_program():
    cost, split = checkpoint_costs(12, 4)
    one_slot = [int(cost[t, 1]) for t in range(1, 13)]
    assert one_slot == [t * (t + 1) // 2 for t in range(1, 13)]  # recompute from the start for every step
    assert [int(cost[10, m]) for m in (1, 2, 3, 4)] == [55, 30, 25, 24]
    assert np.isinf(cost[2, 0])

    @functools.lru_cache(maxsize=None)
    def reference(t, m):  # Gruslys et al.'s recurrence, written out
        if t <= 1:
            return t
        if m == 0:
            return float("inf")
        return min(y + reference(t - y, m - 1) + reference(y, m) for y in range(1, t))

    for t in range(1, 13):
        for m in range(0, 5):
            assert cost[t, m] == reference(t, m)
            if t > 1 and m > 0:
                y = int(split[t, m])
                assert y + reference(t - y, m - 1) + reference(y, m) == reference(t, m)


def test_golden_schedule_trees():
    assert schedule_tree(6, Schedule(segment=3, slots=0)) == [(0, 3, None), (3, 6, None)]
    # two slots over five steps: advance 2 and keep that state, do [2, 5) with one slot (advance 2, keep,
    # then [2, 4) from its start), then [0, 2) with both slots; parents come before their parts
    assert schedule_tree(5, Schedule(segment=5, slots=2)) == [
        (0, 5, None), (0, 2, 0), (2, 5, 0), (2, 4, 2), (4, 5, 2), (2, 3, 3), (3, 4, 3), (0, 1, 1), (1, 2, 1),
    ]


# ----------------------------------------------------------------------------------------------
# (c) counts and strictly lower peaks


def test_lstm_steps_are_checkpointed_with_a_strictly_lower_peak():
    model, inputs = lstm()
    graph = graph_of(model, inputs)
    result = PassManager("timesteps", Policy(max_overhead=10.0)).run(graph)
    record = result.records[0]
    assert record.changed and record.peak_after < record.peak_before
    plan = record.plan
    # every LSTM gate buffer (written in place) is recomputed whole: addmm, add_, split, sigmoid_, ...
    assert len(plan.units) >= 11
    assert record.stats.nodes_rewritten == len(plan.recomputed) + len(plan.stack_reads)
    assert_equivalent(model, optimize(model, passes="timesteps", max_overhead=10.0), *inputs)


def test_latent_gru_states_are_free_so_every_step_is_a_segment():
    model, inputs = small_gru()
    graph = graph_of(model, inputs)
    chosen, candidates, loops = plan_timesteps(graph, AnalysisManager(graph), Policy(max_overhead=10.0))
    (main,) = [loop for loop in loops if loop.period > 1]
    assert main.state_bytes == 0  # the hidden state is read back from the returned stack
    assert chosen.label == "segments of 1 steps, recomputed whole"
    assert chosen.peak < candidates[0].peak


def test_the_virtual_simulation_is_the_simulated_peak_of_the_applied_graph():
    for name in ("lstm", "seq2seq", "rnn"):
        model, inputs = MODELS[name]()
        graph = graph_of(model, inputs)
        _, candidates, _ = plan_timesteps(graph, AnalysisManager(graph), EVERY)
        assert len(candidates) > 3
        for candidate in candidates[1:: 2 if name == "seq2seq" else 1]:
            applied = apply_remat(graph_of(model, inputs), candidate.plan)
            peak = AnalysisManager(applied).get(PeakSimulation).peak + step_margin(graph)
            assert peak == candidate.peak, (name, candidate.label)


# ----------------------------------------------------------------------------------------------
# the budget


def test_budget_sweep_is_monotonic_and_holds_when_measured():
    model, inputs = lstm()
    graph = graph_of(model, inputs)
    _, candidates, _ = plan_timesteps(graph, AnalysisManager(graph), EVERY)
    peaks = sorted({c.peak for c in candidates}, reverse=True)
    assert len(peaks) >= 4
    last = None
    for budget in [peaks[0] + 100, peaks[len(peaks) // 3], peaks[2 * len(peaks) // 3], peaks[-1]]:
        opt = optimize(model, passes="timesteps", budget=budget)
        peak = measured(opt, inputs)
        assert peak <= budget
        assert last is None or peak <= last
        last = peak
    with pytest.raises(MemplanError) as caught:
        optimize(model, passes="timesteps", budget=peaks[-1] - 1)(*inputs)
    error = caught.value if isinstance(caught.value, InfeasibleBudgetError) else caught.value.__cause__
    assert isinstance(error, InfeasibleBudgetError) and error.smallest == peaks[-1]


def test_options():
    assert TimestepOptions.from_mapping({"timesteps.slots": [0, 2]}).slots == (0, 2)
    with pytest.raises(ValueError, match="timesteps.slots"):
        TimestepOptions.from_mapping({"timesteps.slot": 1})
    model, inputs = lstm()
    manager = PassManager("timesteps", Policy(max_overhead=10.0), options={"timesteps.min_steps": 50})
    result = manager.run(graph_of(model, inputs))
    assert not result.records[0].changed


# ----------------------------------------------------------------------------------------------
# (d) invariants on random unrolled loops


class RandomLoop(nn.Module):
    """A random cell (``memplan.testing.random_model``) applied over time: h = cell(x_t, h)."""

    def __init__(self, seed, ops, stack):
        super().__init__()
        self.cell, _ = random_model(seed, steps=ops, batch=4, width=8)
        self.stack = stack

    def forward(self, seq, h):
        outs = []
        for x in seq.unbind(0):
            h = torch.tanh(self.cell(x, h)[0])  # bounded: a random cell may hold exp(exp(.))
            outs.append(h if self.stack else h.sum())
        return torch.stack(outs)


def test_a_loop_left_whole_says_which_overhead_it_would_take():
    # eager priced as the plan's ops alone: the pass gets exactly max_overhead of them
    opt = optimize(RNN.model, passes="timesteps", max_overhead=0.01, rates=CostRates(autograd_node=0.0))
    opt(*RNN.inputs).sum().backward()
    [record] = opt.plan.records
    assert not record.changed
    found, why = record.notes
    assert found.startswith("loop of 11 steps")
    least = float(why.split("(the least +")[1].split("%")[0]) / 100
    assert why.startswith("keep every step: each of the") and "max_overhead=0.01" in why and least > 0.01
    # and at that overhead the pass takes a schedule
    taken = optimize(RNN.model, passes="timesteps", max_overhead=least + 0.001)
    taken(*RNN.inputs).sum().backward()
    assert taken.plan.records[0].changed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), ops=st.integers(3, 8), steps=st.integers(4, 7), stack=st.booleans(),
       max_overhead=st.sampled_from([0.3, 10.0]))
def test_random_loops(seed, ops, steps, stack, max_overhead):
    torch.manual_seed(seed)
    model = RandomLoop(seed, ops, stack)
    inputs = (torch.randn(steps, 4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True))
    graph = graph_of(model, inputs)
    chosen, candidates, loops = plan_timesteps(graph, AnalysisManager(graph), Policy(max_overhead=max_overhead))
    for loop in loops:
        assert sum(len(step) for step in loop.steps) == loop.iterations * loop.period
    assert chosen.peak <= candidates[0].peak
    applied = apply_remat(graph_of(model, inputs), candidates[-1].plan)
    assert AnalysisManager(applied).get(PeakSimulation).peak + step_margin(graph) == candidates[-1].peak
    opt = optimize(model, passes="timesteps", max_overhead=max_overhead)
    if is_well_conditioned(model, *inputs):  # not one whose loop overflows to NaN gradients, say
        assert_equivalent(model, opt, *inputs)
    peak = measured(opt, inputs)  # the first call plans
    planned = opt.plan.planned_peak
    assert planned <= peak <= planned + step_margin(opt.plan.graph)


# ----------------------------------------------------------------------------------------------
# schedules planned without the square of the loop's length


def _copy_setup(name):
    from memplan.passes._remat.copies import after_stack_reads, backward_reads, forward_inputs, plan_stack_reads
    from memplan.passes.timesteps import _describe_steps

    model, inputs = MODELS[name]()
    graph = graph_of(model, inputs)
    am = AnalysisManager(graph)
    facts = after_stack_reads(RematFacts.compute(graph, am), plan_stack_reads(graph, am))
    by_seq = {}
    for node in graph.gm.graph.nodes:
        if graph.phases.get(node.name) is Phase.BACKWARD and node.name in graph.seq_nr:
            by_seq.setdefault(graph.seq_nr[node.name], []).append(node.name)
    loops = [_describe_steps(graph, loop, facts, by_seq) for loop in find_loops(graph, facts, TimestepOptions())]
    return facts, loops, forward_inputs(graph), backward_reads(graph)


@pytest.mark.parametrize("name", ["lstm", "rnn", "latent_gru", "seq2seq"])
def test_groups_by_step_ranges_copy_what_the_unions_of_their_steps_copy(name):
    # Groups name their steps' nodes by range, and only the intervals without parts serve: a long loop
    # under one state slot no longer builds sets whose sizes sum to the square of its length. The copies
    # are those of the groups built from the unions, every step serving through every interval.
    from memplan.passes._remat.copies import RecomputeGroup, plan_copies
    from memplan.passes.timesteps import _groups

    facts, loops, inputs, backward = _copy_setup(name)
    longest = max(s.loop.iterations for s in loops)
    cost, split = checkpoint_costs(longest, 3)
    for schedule in (Schedule(2, 0), Schedule(longest, 1), Schedule(longest, 3), Schedule(4, 2)):
        lazy = _groups(loops, schedule, split)
        unions = []
        for s in loops:
            base = len(unions)
            for first, end, parent in schedule_tree(s.loop.iterations, schedule, split):
                unions.append(RecomputeGroup(frozenset().union(*s.nodes[first:end]), frozenset().union(*s.serves[first:end]),
                                             None if parent is None else base + parent))
        assert [set(g.nodes) for g in lazy] == [set(g.nodes) for g in unions]
        a = plan_copies(lazy, inputs=inputs, backward=backward, units=facts.units)
        b = plan_copies(unions, inputs=inputs, backward=backward, units=facts.units)
        assert (a.copies, a.sources, a.anchors, a.reads) == (b.copies, b.sources, b.anchors, b.reads), (name, schedule)


def test_copies_are_counted_only_up_to_the_limit():
    from memplan.passes._remat.copies import plan_copies
    from memplan.passes.timesteps import _groups

    facts, loops, inputs, backward = _copy_setup("lstm")
    flops = {name: fact.flops for name, fact in facts.nodes.items()}
    longest = max(s.loop.iterations for s in loops)
    cost, split = checkpoint_costs(longest, 1)
    groups = _groups(loops, Schedule(longest, 1), split)
    full = plan_copies(groups, inputs=inputs, backward=backward, units=facts.units)
    total = sum(flops.get(name, 0) for _, name in full.copies)
    assert total > 0
    assert plan_copies(groups, inputs=inputs, backward=backward, units=facts.units, flops=flops, limit=total - 1) is None
    exact = plan_copies(groups, inputs=inputs, backward=backward, units=facts.units, flops=flops, limit=total)
    assert exact is not None and exact.copies == full.copies


@pytest.mark.parametrize("name", ["lstm", "rnn", "seq2seq"])
def test_a_budget_chooses_among_all_schedules_though_it_plans_fewer(name):
    # With a budget, schedules that cost more than a candidate already fitting are counted only that
    # far, and never simulated: the choice is still the one among every schedule.
    from memplan.policy import pareto_front

    model, inputs = MODELS[name]()
    graph = graph_of(model, inputs)
    _, every, _ = plan_timesteps(graph, AnalysisManager(graph), EVERY)
    peaks = sorted({c.peak for c in every})
    counts = []
    for budget in [peaks[0] - 1, *peaks, peaks[-1] + 1]:
        policy = Policy(budget=budget, when_over="lowest")
        chosen, simulated, _ = plan_timesteps(graph, AnalysisManager(graph), policy)
        expected = policy.choose(pareto_front(list(every)))
        assert (chosen.label, chosen.peak, chosen.overhead) == (expected.label, expected.peak, expected.overhead)
        counts.append(len(simulated))
    assert max(counts) == len(every) and min(counts) < len(every)  # none fits the lowest: all are simulated
