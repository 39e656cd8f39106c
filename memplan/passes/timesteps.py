"""Timesteps: find the repeated steps of an unrolled loop and checkpoint across them on an optimal schedule.

What it does
------------
A Python loop over time steps is unrolled by capture, and autograd keeps every step's tensors until the
backward reaches that step: memory grows linearly with the sequence. This pass finds the steps by the
*structure* of the forward graph (no names, no source lines), keeps only some step states (the values
one step hands to the next), and recomputes the steps in between just before their backward, on the
checkpoint schedule the policy picks: plain segments (Chen et al.'s sqrt(T) checkpointing, with several
segment lengths) or, inside each segment, the optimal binary schedule of Gruslys et al.'s BPTT dynamic
program (Revolve's binomial schedules) for a given number of state slots.

Stages
------
(1) Labels. Each forward node gets a label from its op, its output shapes and dtypes, and for each
    argument the op and shape of the node it reads (a graph input by name, a constant by type): equal
    labels mean "the same op in the same place of a step", whatever the node names.
(2) Loops (:func:`find_loops`). Candidate periods are the gaps between repeated labels; for a period
    ``p`` the forward label sequence equals itself shifted by ``p`` over a run, and a run of
    ``(T - 1) * p`` matches is ``T`` iterations. Each run is verified edge by edge: from the second
    iteration on, every node reads the same offsets of its own or earlier iterations (or values from
    outside the loop); runs are then taken greedily by coverage (longest first, shorter period on ties),
    without overlap, so an encoder loop and a decoder loop are two loops, and a layer loop inside a time
    loop is part of the time step.
(3) Steps (:class:`Loop`). The iteration boundary is rotated to where the carried state is smallest
    (bytes of loop values read across the boundary by later steps; values that are free to save, such
    as tensors a returned ``stack`` keeps, count nothing). Each step is a unit of forward nodes, with
    its backward nodes found by autograd sequence number (``CapturedGraph.seq_nr``).
(4) Schedules (:func:`schedule_tree`). ``k`` root segments keep their first state saved from the
    forward. Inside a segment of ``L`` steps with ``m`` state slots, the dynamic program
    ``C(L, m) = min_y y + C(L - y, m - 1) + C(y, m)``, ``C(1, m) = 1``, ``C(L, 0) = inf`` (Gruslys et
    al. 2016, BPTT-HSM) picks the split ``y``: advance ``y`` steps, keep that state, process the right
    part with one slot less, then the left part. ``m = 0`` means the segment is recomputed whole (plain
    checkpointing). A schedule is realised as nested :class:`~memplan.passes._remat.copies.RecomputeGroup`:
    a segment or split interval is a group whose children are its parts; a copy reads its group's
    copies, then its ancestors', then the saved originals; each group copies only what its consumers
    need, just before the first of them, so an advance of ``y`` steps copies only those steps.
(5) Candidates. Segment lengths (powers of two and about ``sqrt(T * activations / state)``) times
    slot counts are costed with the model (memory ``(k + m) * state + leaf activations``, compute in
    step recomputations); the Pareto front is simulated exactly (:class:`~memplan.passes._remat.simulation.VirtualSimulation`) beside the
    segments of ``sqrt(steps)`` steps recomputed whole, overhead is the copies' predicted seconds
    over the whole graph's (the time model, :mod:`memplan.analysis.cost`), and ``ctx.policy.choose`` picks one (a budget:
    least overhead that fits, or :class:`~memplan.errors.InfeasibleBudgetError` naming the smallest
    peak; none: lowest peak within ``max_overhead``). A schedule is planned only as far as the policy
    could take it: its copies are counted until they cost more than ``max_overhead`` (no budget) or than
    a candidate that already fits the budget, so the choice is the one among all schedules, and the
    chosen peak is monotonic in the budget.
(6) Apply the chosen groups with the remat engine (stack reads included).

Preconditions
-------------
A training graph with graph lifetimes (the pipeline sets them); fake values on every node; autograd
sequence numbers on backward nodes (capture records them). Inference graphs are returned untouched.

Soundness conditions, each with the counterexample it rules out
---------------------------------------------------------------
(a) Only nodes ``remat`` may recompute are recomputed (no random op, no in-place write, nothing that
    reads a storage written afterwards). Counterexample: a dropout inside the loop recomputed in the
    backward would draw a new mask; its output is read from the saved original instead.
(b) A backward node reads a value through the deepest group that serves it and holds the value; every
    other value is the saved original. Counterexample: the backward of step ``t`` reading a copy made
    for step ``t + 1``'s segment would read a node placed after it (the graph lints fail).
(c) Loop detection is only a grouping: a wrong period makes a worse plan, never a wrong one, because the
    copies are exact replays of the forward nodes wherever they are placed. Counterexample of what it
    rules out: relying on names (``h_3``) or source lines would break on a loop body written in a helper.

Left to other passes
--------------------
Horizontal sharing of a step's temporaries (OpenNMT's clone sharing) already follows from graph
lifetimes: a temporary the backward does not read dies after its last forward reader, so the next step
reuses the memory (``arena`` gives it static offsets). Recomputing parts of a step while keeping others
(``remat``'s cuts, which can run after this pass), in-place reuse (``inplace``), splitting big
intermediates (``chunk``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from memplan.analysis.cost import REFERENCE_RATES, CostRates
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.capture import UNORDERED_SEQ_NR, CapturedGraph, Phase
from memplan.graphutil import packet_name
from memplan.measure import format_bytes
from memplan.passes._remat.copies import (
    RecomputeGroup,
    RematPlan,
    after_stack_reads,
    apply_remat,
    backward_reads,
    forward_inputs,
    plan_copies,
    plan_stack_reads,
)
from memplan.passes._remat.facts import RematFacts, copy_costs
from memplan.passes._remat.simulation import VirtualSimulation
from memplan.pipeline import PassContext, PassResult, PassStats, pass_options, register_pass
from memplan.policy import Candidate, Policy, pareto_front

__all__ = [
    "TimestepOptions",
    "Loop",
    "Schedule",
    "find_loops",
    "checkpoint_costs",
    "schedule_tree",
    "plan_timesteps",
    "timesteps",
]


# ----------------------------------------------------------------------------------------------
# options


@dataclasses.dataclass(frozen=True)
class TimestepOptions:
    """Options of the pass, read from ``ctx.options`` keys ``"timesteps.<field>"``.

    Attributes
    ----------
    min_steps : int
        Loops with fewer iterations are left alone (nothing to gain from 2 steps).
    max_period : int
        Longest loop body (forward nodes per step) looked for.
    slots : tuple of int
        State slots tried inside each segment (0: recompute the segment whole).
    max_candidates : int
        Schedules simulated exactly (spread over the model's Pareto front).

    Examples
    --------
    >>> TimestepOptions.from_mapping({"timesteps.slots": [0, 1]}).slots
    (0, 1)
    """

    min_steps: int = 3
    max_period: int = 5000
    slots: tuple[int, ...] = (0, 1, 2, 3, 4, 6)
    max_candidates: int = 12

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "TimestepOptions":
        return pass_options(cls, "timesteps", options)


# ----------------------------------------------------------------------------------------------
# Step 1: labels


def _shape_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(int(s) for s in value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return ("seq", len(value))  # a list output's elements are described by its getitems
    return type(value).__name__


def _labels(nodes: Sequence[torch.fx.Node]) -> np.ndarray:
    """One small int per node: equal for the same op, output shapes and argument structure."""
    ids: dict[Any, int] = {}
    described: dict[torch.fx.Node, Any] = {}

    def node_key(node: torch.fx.Node) -> Any:
        if node not in described:
            if node.op in ("placeholder", "get_attr"):
                described[node] = ("input", node.name)
            else:
                described[node] = ("node", packet_name(node) or str(node.target), _shape_key(node.meta.get("val")))
        return described[node]

    def arg_key(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return node_key(arg)
        if isinstance(arg, (list, tuple)):
            return ("seq", tuple(arg_key(a) for a in arg))
        return type(arg).__name__

    labels = np.empty(len(nodes), dtype=np.int64)
    for i, node in enumerate(nodes):
        key = (
            packet_name(node) or str(node.target),
            _shape_key(node.meta.get("val")),
            tuple(arg_key(a) for a in node.args),
            tuple(sorted((k, arg_key(v)) for k, v in node.kwargs.items())),
        )
        labels[i] = ids.setdefault(key, len(ids))
    return labels


# ----------------------------------------------------------------------------------------------
# Steps 2-3: loops and steps


@dataclasses.dataclass(frozen=True)
class Loop:
    """An unrolled loop: ``steps[i]`` are the forward nodes of step ``i`` (graph order).

    ``period`` is the number of forward nodes per iteration, ``start`` the forward index where the
    repetition begins and ``offset`` the rotation of the step boundary chosen for the smallest carried
    state, ``state_bytes`` that state.
    """

    start: int
    period: int
    iterations: int
    offset: int
    state_bytes: int
    steps: tuple[tuple[str, ...], ...]

    def __str__(self) -> str:
        return (f"loop of {self.iterations} steps x {self.period} nodes from forward node {self.start} "
                f"(boundary offset {self.offset}, carried state {format_bytes(self.state_bytes)})")


def _runs(labels: np.ndarray, period: int) -> list[tuple[int, int]]:
    """``(start, length)`` of maximal runs where ``labels[i] == labels[i + period]`` for ``length >= period``."""
    if period >= len(labels):
        return []
    match = labels[:-period] == labels[period:]
    padded = np.concatenate(([False], match, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    starts, ends = edges[0::2], edges[1::2]
    return [(int(s), int(e - s)) for s, e in zip(starts, ends) if e - s >= period]


def _candidate_periods(labels: np.ndarray, max_period: int) -> list[int]:
    """Gaps between consecutive equal labels that occur at least twice, most frequent first."""
    last: dict[int, int] = {}
    counts: dict[int, int] = {}
    for i, label in enumerate(labels.tolist()):
        if label in last:
            gap = i - last[label]
            if gap <= max_period:
                counts[gap] = counts.get(gap, 0) + 1
        last[label] = i
    return sorted((g for g, c in counts.items() if c >= 2), key=lambda g: (-counts[g] * g, g))[:16]


def _verified_iterations(nodes: Sequence[torch.fx.Node], index: Mapping[str, int], start: int, period: int,
                         iterations: int) -> int:
    """How many iterations from ``start`` read their inputs alike (from the second one on)."""

    def pattern(k: int) -> tuple:
        refs = []
        base = start + k * period
        for j in range(period):
            for arg in nodes[base + j].all_input_nodes:
                at = index.get(arg.name)
                if at is None or at < start:
                    refs.append("outside")
                else:
                    delta, offset = divmod(at - start, period)
                    refs.append((delta - k, offset))
        return tuple(refs)

    if iterations < 2:
        return iterations
    reference = pattern(1)
    for k in range(2, iterations):
        if pattern(k) != reference:
            return k
    return iterations


def find_loops(graph: CapturedGraph, facts: RematFacts | None = None,
               options: TimestepOptions = TimestepOptions()) -> tuple[Loop, ...]:
    """The unrolled loops of the forward graph, found by structure (see stages 1-3).

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> from memplan.testing import zoo
    >>> rnn = next(z for z in zoo() if z.name == "rnn")
    >>> [loop.iterations for loop in find_loops(capture(rnn.model, *rnn.inputs))]
    [11]
    """
    nodes = [n for n in graph.gm.graph.nodes if graph.phases.get(n.name) is Phase.FORWARD]
    if len(nodes) < 2 * options.min_steps:
        return ()
    index = {n.name: i for i, n in enumerate(nodes)}
    labels = _labels(nodes)
    found: list[tuple[int, int, int, int]] = []  # (coverage, period, start, iterations)
    for period in _candidate_periods(labels, options.max_period):
        for start, length in _runs(labels, period):
            iterations = length // period + 1
            iterations = _verified_iterations(nodes, index, start, period, iterations)
            if iterations >= options.min_steps:
                found.append((iterations * period, period, start, iterations))
    taken: list[tuple[int, int]] = []
    loops = []
    for coverage, period, start, iterations in sorted(found, key=lambda f: (-f[0], f[1], f[2])):
        end = start + coverage
        if any(start < e and s < end for s, e in taken):
            continue
        taken.append((start, end))
        loops.append(_steps(nodes, index, start, period, iterations, facts))
    return tuple(sorted(loops, key=lambda loop: loop.start))


def _steps(nodes: Sequence[torch.fx.Node], index: Mapping[str, int], start: int, period: int, iterations: int,
           facts: RematFacts | None) -> Loop:
    """Rotate the step boundary to the smallest carried state and cut the loop into steps."""
    end = start + iterations * period
    # Carried state across the boundary b: loop values made before b and read at or after b in the loop.
    crossing = [0] * period
    if iterations >= 3:
        low, high = start + period, start + 2 * period  # boundaries inside the loop, away from its ends
        for i in range(start, high):
            node = nodes[i]
            last = max((index[u.name] for u in node.users if u.name in index and index[u.name] < end), default=-1)
            nbytes = facts.nodes[node.name].save_bytes if facts is not None and node.name in facts.nodes else 1
            for b in range(max(low, i + 1), min(high, last + 1)):
                crossing[b - low] += nbytes if (nodes[i].meta.get("val") is not None) else 0
    # Ties go to a boundary that splits no in-place unit (a split unit cannot be recomputed).
    splits = [0] * period
    if facts is not None and iterations >= 3:
        low = start + period
        for r in range(period):
            b = low + r
            splits[r] = sum(1 for i in range(b - period, b) if nodes[i].name in facts.units
                            and any(index.get(m, -1) >= b for m in facts.units[nodes[i].name]))
    offset = min(range(period), key=lambda r: (crossing[r], splits[r], r))
    cuts = [start] + [start + k * period + offset for k in range(1, iterations)] + [end]
    steps = tuple(tuple(nodes[i].name for i in range(a, b)) for a, b in zip(cuts, cuts[1:]))
    return Loop(start, period, iterations, offset, crossing[offset], steps)


# ----------------------------------------------------------------------------------------------
# Step 4: schedules


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A checkpoint schedule: root segments of ``segment`` steps, ``slots`` state slots inside each."""

    segment: int
    slots: int

    def __str__(self) -> str:
        inside = "recomputed whole" if self.slots == 0 else f"{self.slots} state slots (BPTT DP)"
        return f"segments of {self.segment} steps, {inside}"


def checkpoint_costs(length: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Gruslys et al.'s BPTT-HSM table: ``cost[L, m]`` step forwards to backpropagate ``L`` steps with ``m``
    state slots (the input state held elsewhere), and ``split[L, m]`` the first advance.

    ``cost[1, m] = 1``; ``cost[L, 0] = inf`` for ``L > 1``; otherwise
    ``cost[L, m] = min_y y + cost[L - y, m - 1] + cost[y, m]``.

    Examples
    --------
    >>> cost, split = checkpoint_costs(8, 2)
    >>> int(cost[8, 1]), int(cost[8, 2])  # one slot: 8 * 9 / 2; two slots: far fewer
    (36, 22)
    """
    cost = np.full((length + 1, slots + 1), np.inf)
    split = np.zeros((length + 1, slots + 1), dtype=np.int64)
    cost[0, :] = 0
    cost[1, :] = 1
    for m in range(1, slots + 1):
        for n in range(2, length + 1):
            ys = np.arange(1, n)
            values = ys + cost[n - ys, m - 1] + cost[ys, m]
            best = int(np.argmin(values))
            cost[n, m] = values[best]
            split[n, m] = ys[best]
    return cost, split


def schedule_tree(steps: int, schedule: Schedule, split: np.ndarray | None = None) -> list[tuple[int, int, int | None]]:
    """The intervals ``(first, end, parent)`` of a schedule over ``steps`` steps, parents first.

    Examples
    --------
    >>> schedule_tree(4, Schedule(segment=2, slots=0))
    [(0, 2, None), (2, 4, None)]
    >>> schedule_tree(3, Schedule(segment=3, slots=1))
    [(0, 3, None), (0, 2, 0), (2, 3, 0), (0, 1, 1), (1, 2, 1)]
    """
    if split is None and schedule.slots > 0:
        _, split = checkpoint_costs(min(schedule.segment, steps), schedule.slots)
    intervals: list[tuple[int, int, int | None]] = []
    for first in range(0, steps, schedule.segment):
        intervals.append((first, min(first + schedule.segment, steps), None))
        pending = [(len(intervals) - 1, schedule.slots)]
        while pending:
            index, slots = pending.pop()
            a, b, _ = intervals[index]
            if b - a == 1 or slots == 0:
                continue
            y = int(split[b - a, slots])
            intervals.append((a, a + y, index))
            left = len(intervals) - 1
            intervals.append((a + y, b, index))
            right = len(intervals) - 1
            pending.append((left, slots))
            pending.append((right, slots - 1))
    return intervals


def _model(steps: int, state: float, activation: float, schedule: Schedule, cost: np.ndarray) -> tuple[float, float]:
    """(memory, step recomputations) of a schedule by the model of stage 5."""
    segment = min(schedule.segment, steps)
    segments = math.ceil(steps / segment)
    if schedule.slots == 0:
        memory = segments * state + segment * activation
        work = steps
    else:
        memory = (segments + schedule.slots) * state + activation
        work = sum(cost[min(segment, steps - first), schedule.slots] for first in range(0, steps, segment))
    return memory, work


# ----------------------------------------------------------------------------------------------
# Step 5: candidates


@dataclasses.dataclass(frozen=True)
class _Steps:
    """What the schedules need of one loop: per step, the nodes a group may copy and the backward
    nodes it serves; and the step's mean state, activation and predicted seconds of its copyable nodes."""

    loop: Loop
    nodes: tuple[frozenset[str], ...]
    serves: tuple[frozenset[str], ...]
    state: float
    activation: float
    seconds: float
    step_of: Mapping[str, int] = dataclasses.field(default_factory=dict)  # a copyable node -> its step


@dataclasses.dataclass(frozen=True, eq=False)
class _StepNodes:
    """The copyable nodes of steps ``first`` to ``end - 1``, as a group's ``nodes``: membership by the
    node's step, without the union of the steps' sets (one state slot over a loop of ``L`` steps nests
    intervals whose lengths sum to ``L(L+1)/2``)."""

    steps: _Steps
    first: int
    end: int

    def __contains__(self, name: object) -> bool:
        step = self.steps.step_of.get(name)
        return step is not None and self.first <= step < self.end and name in self.steps.nodes[step]

    def __iter__(self):
        for step in range(self.first, self.end):
            yield from self.steps.nodes[step]


def _describe_steps(graph: CapturedGraph, loop: Loop, facts: RematFacts,
                    backward_by_seq: Mapping[int, list[str]]) -> _Steps:
    nodes, serves = [], []
    activation = seconds = 0.0
    for step in loop.steps:
        inside = set(step)
        copyable = frozenset(
            n for n in step
            if facts.nodes[n].recomputable and facts.nodes[n].save_bytes > 0
            and all(m in inside for m in facts.units.get(n, ()))  # an in-place unit split by the boundary stays
        )
        nodes.append(copyable)
        # The backward nodes of every autograd node the step made: sequence numbers grow as the forward
        # runs, so they are the step's range, which also holds those no forward node is tagged with (an
        # in-place op on a view is tagged with the CopySlices node made after its own, whose number its
        # backward ops carry: GRUCell's ``mul_`` on a gate slice).
        seqs = [graph.seq_nr[n] for n in step if n in graph.seq_nr and graph.seq_nr[n] < UNORDERED_SEQ_NR]
        span = range(min(seqs), max(seqs) + 1) if seqs else range(0)
        serves.append(frozenset(b for seq in span for b in backward_by_seq.get(seq, ())))
        activation += sum(facts.nodes[n].save_bytes for n in copyable if facts.nodes[n].first_reader is not None)
        seconds += sum(facts.nodes[n].seconds for n in copyable)
    count = max(1, len(loop.steps))
    step_of = {name: t for t, names in enumerate(nodes) for name in names}
    return _Steps(loop, tuple(nodes), tuple(serves), float(loop.state_bytes), activation / count, seconds / count,
                  step_of)


def _schedules(loops: Sequence[_Steps], options: TimestepOptions, cost: np.ndarray) -> list[Schedule]:
    """Segment lengths x slot counts, costed by the model; up to ``max_candidates`` from its Pareto front.

    ``cost`` is :func:`checkpoint_costs` up to the longest loop and the most slots (the caller needs its
    splits too)."""
    longest = max(s.loop.iterations for s in loops)
    lengths = {1, longest}
    length = 2
    while length < longest:
        lengths.add(length)
        length *= 2
    for s in loops:
        if s.state > 0:
            lengths.add(max(1, min(s.loop.iterations, round(math.sqrt(s.loop.iterations * s.activation / s.state)))))
    scored = []
    for length in sorted(lengths):
        for slots in sorted(set(options.slots)):
            if slots > 0 and length == 1:
                continue
            schedule = Schedule(length, slots)
            memory = work = 0.0
            for s in loops:
                m, w = _model(s.loop.iterations, s.state, s.activation, schedule, cost)
                memory += m
                work += w * s.seconds
            scored.append((memory, work, schedule))
    front = [c for c in scored
             if not any(o[0] <= c[0] and o[1] <= c[1] and (o[0] < c[0] or o[1] < c[1]) for o in scored)]
    front.sort(key=lambda c: (c[0], c[1], c[2].segment, c[2].slots))
    if len(front) > options.max_candidates:
        picks = np.linspace(0, len(front) - 1, options.max_candidates).round().astype(int)
        front = [front[i] for i in sorted(set(picks.tolist()))]
    chosen = [c[2] for c in front]
    # Segments recomputed whole all cost one forward of each step, so the model keeps only the length
    # it thinks lowest; but it prices a segment's backward as its steps' activations alone, and the
    # simulated peak of the length sqrt(steps) (the usual hand-placed checkpointing) comes out lower
    # than that one's on recurrent cells (a 2-layer LSTMCell loop of 62 steps: 3.26 MiB at 8 steps, 3.38
    # at 4, 4.20 at 2). It is simulated too.
    root = round(math.sqrt(longest))
    if 0 in options.slots and root > 1 and Schedule(root, 0) not in chosen:
        chosen.append(Schedule(root, 0))
    return chosen


def _groups(loops: Sequence[_Steps], schedule: Schedule, split: np.ndarray) -> tuple[RecomputeGroup, ...]:
    groups: list[RecomputeGroup] = []
    for number, s in enumerate(loops):
        base = len(groups)
        tree = schedule_tree(s.loop.iterations, schedule, split)
        parents = {parent for _, _, parent in tree}
        for i, (first, end, parent) in enumerate(tree):
            groups.append(RecomputeGroup(
                nodes=_StepNodes(s, first, end),
                # A backward node goes through the deepest group that serves it; an interval's parts cover
                # it, so only the intervals without parts serve (the same reads, without the unions).
                serves=frozenset() if i in parents else frozenset().union(*s.serves[first:end]),
                parent=None if parent is None else base + parent,
                label=f"loop {number} steps {first}-{end - 1}",
            ))
    return tuple(groups)


def plan_timesteps(
    graph: CapturedGraph,
    am: AnalysisManager,
    policy: Policy,
    options: TimestepOptions = TimestepOptions(),
    rates: CostRates = REFERENCE_RATES,
) -> tuple[Candidate[RematPlan], tuple[Candidate[RematPlan], ...], tuple[Loop, ...]]:
    """Candidates (simulated), the policy's choice, and the loops found. A candidate's overhead is its
    recomputation's predicted seconds (by ``rates``) over the graph's.

    Raises
    ------
    InfeasibleBudgetError
        When the policy has a budget that no candidate meets; it names the smallest reachable peak.
    """
    # Steps 1-3: facts (what may be recomputed, what is free to save), loops and their steps.
    plain = RematFacts.compute(graph, am, rates=rates)
    reads = plan_stack_reads(graph, am)
    facts = after_stack_reads(plain, reads)
    found = find_loops(graph, facts, options)
    # A stack made inside a step (``cat([x_t, context])``, which a step's backward reads) is kept anyway
    # only while nothing is recomputed: read from it, its parts are free to save, but the stack itself
    # can then never be recomputed, and every step's stack stays saved. Checkpointing recomputes the
    # step instead; stacks made outside the steps (the outputs a loop stacks and returns) stay read.
    inside = {name for loop in found for step in loop.steps for name in step}
    if any(read.stack in inside for read in reads):
        reads = tuple(read for read in reads if read.stack not in inside)
        facts = after_stack_reads(plain, reads)
        found = find_loops(graph, facts, options)  # the step boundaries, rotated by the new facts
    simulation = VirtualSimulation(graph, am)
    base_peak = am.get(PeakSimulation).peak + simulation.margin  # the pipeline computes it anyway
    candidates = [Candidate(RematPlan("keep every step"), base_peak, 0.0, "keep every step")]
    backward_by_seq: dict[int, list[str]] = {}
    for node in graph.gm.graph.nodes:
        if graph.phases.get(node.name) is Phase.BACKWARD and node.name in graph.seq_nr:
            backward_by_seq.setdefault(graph.seq_nr[node.name], []).append(node.name)
    loops = [_describe_steps(graph, loop, facts, backward_by_seq) for loop in found]
    loops = [s for s in loops if s.activation > 0]
    if not loops:
        return policy.choose(candidates), tuple(candidates), ()
    if reads:
        plan = RematPlan("stack reads", stack_reads=reads)
        candidates.append(Candidate(plan, simulation.step_peak(reads), 0.0, plan.label))

    # Steps 4-5: schedules, realised as nested groups and simulated.
    backward = backward_reads(graph)
    inputs = forward_inputs(graph)
    longest = max(s.loop.iterations for s in loops)
    cost, split = checkpoint_costs(longest, max(options.slots))
    refused: list[float] = []  # overheads of the schedules the policy can never take (inf: only over the limit)
    over: list[tuple[float, tuple[RecomputeGroup, ...]]] = []  # (model's work, groups) of those not counted in full
    seconds = copy_costs(facts)
    # Without a budget the policy never takes more than max_overhead: a schedule's copies are counted
    # only until they cost more (one slot over a long loop makes the square of its length).
    # With a budget the policy takes the least overhead that fits it: once a candidate fits, a schedule
    # whose copies cost more can never be taken, and is counted only until they do. Schedules go in the
    # order of the model's work, so the cheap ones that may fit come first.
    total = facts.total_seconds or 1.0
    limit = None if policy.budget is not None else policy.max_overhead * total
    schedules = [(sum(_model(x.loop.iterations, x.state, x.activation, schedule, cost)[1] * x.seconds for x in loops), schedule)
                 for schedule in _schedules(loops, options, cost)]
    for work, schedule in sorted(schedules, key=lambda w: w[0]):
        if policy.budget is not None:
            limit = min((c.overhead * total for c in candidates if c.peak <= policy.budget), default=None)
        groups = _groups(loops, schedule, split)
        copies = plan_copies(groups, inputs=inputs, backward=backward, units=facts.units, flops=seconds, limit=limit)
        if copies is None:
            if policy.budget is None:
                refused.append(math.inf)
                over.append((work, groups))
            continue  # never taken: it costs more than max_overhead, or than a candidate that fits the budget
        extra = sum(seconds[name] for _, name in copies.copies)
        label = str(schedule)
        plan = RematPlan(label, stack_reads=reads, groups=groups, units=tuple(dict.fromkeys(copies.units.values())),
                         recomputed=copies.recomputed, copies=copies, planned_on=simulation.names)
        overhead = extra / total
        if not policy.may_take(overhead):
            refused.append(overhead)
            continue  # never taken: not simulated
        candidates.append(Candidate(plan, simulation.step_peak(reads, copies), overhead, label))
    if refused and len(candidates) == 1 + bool(reads):
        # the least overhead, for the note: the schedules over the limit, in the order of the model's work,
        # each counted only up to the least found so far
        least = min(refused)
        for _, groups in sorted(over, key=lambda o: o[0]):
            bound = None if least == math.inf else least * total
            copies = plan_copies(groups, inputs=inputs, backward=backward, units=facts.units, flops=seconds, limit=bound)
            if copies is not None:
                least = sum(seconds[name] for _, name in copies.copies) / total
        # say why the steps are all kept: a user reads this in the plan's notes
        candidates[0] = dataclasses.replace(candidates[0], label=(
            f"keep every step: each of the {len(refused)} schedules recomputes more than max_overhead="
            f"{policy.max_overhead:g} allows"
            + f" (the least +{least:.1%} of the step's predicted time)"
            + "; a budget or a higher max_overhead lets the pass take one"))

    # Step 5 (end): the policy picks among the candidates no other beats on both counts.
    return policy.choose(pareto_front(candidates)), tuple(candidates), tuple(s.loop for s in loops)


# ----------------------------------------------------------------------------------------------
# the pass


# retry_before: remat's lowest plan on its own may recompute an unrolled loop's states all at once, which
# leaves this pass no saved step to checkpoint; a budget that misses it is planned with this pass first too.
@register_pass("timesteps", options=TimestepOptions.from_mapping, retry_before="remat")
def timesteps(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Checkpoint the steps of unrolled loops on the schedule the policy picks (see the module docstring)."""
    if not graph.training:
        return PassResult(graph, changed=False, notes=("inference graph: nothing is saved for backward",))
    options = TimestepOptions.from_mapping(ctx.options)
    chosen, candidates, loops = plan_timesteps(graph, ctx.am, ctx.policy, options, ctx.rates)
    plan = chosen.plan
    found = "; ".join(str(loop) for loop in loops) or "no loop found"
    if not plan.changes:
        notes = (found,) if not loops or chosen.label == plan.label else (found, chosen.label)
        return PassResult(graph, changed=False, plan=plan, notes=notes)
    before = candidates[0].peak
    # Step 6: apply the chosen groups (and stack reads) with the remat engine.
    result = apply_remat(graph, plan)
    notes = (
        found,
        f"{plan.label}: peak {format_bytes(before)} -> {format_bytes(chosen.peak)}, "
        f"recompute +{chosen.overhead:.1%} ({len(plan.recomputed)} nodes), {len(candidates)} candidates",
    )
    stats = PassStats(nodes_rewritten=len(plan.recomputed) + len(plan.stack_reads),
                      bytes_saved=before - chosen.peak, recompute_added=chosen.overhead)
    return PassResult(result, changed=True, stats=stats, notes=notes, plan=plan)
