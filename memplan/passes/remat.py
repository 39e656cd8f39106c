"""Rematerialisation: which forward tensors the backward keeps, and which it recomputes.

What it does
------------
In a captured training graph, whatever forward node a backward node reads is saved: it stays in memory
from the forward until its last backward reader. This pass copies chosen forward nodes into the backward
phase, each just before its first consumer, and points the backward readers at the copies; the emitted
forward then saves only what the copies read. Which nodes to recompute is a minimum cut of the forward
graph (AOTAutograd's construction, solved by :class:`~memplan.passes._remat.cuts.CutNetwork`), swept over a price of compute and completed by
a knapsack over classes of expensive ops, so that the policy can pick the least recomputation that fits
a budget, or the lowest peak within ``max_overhead``.

Stages
------
(1) Facts (:class:`~memplan.passes._remat.facts.RematFacts`). Per forward node: whether it may be recomputed (soundness below), what
    recomputing it costs (FLOPs from shapes, :func:`~memplan.passes._remat.facts.node_flops`, which price the cuts below; and its
    predicted seconds by the time model, :mod:`memplan.analysis.cost`, which price a candidate's overhead
    for the policy) and what saving it costs (bytes of the storages its value keeps alive; nothing for
    inputs, parameters and storages an output keeps anyway).
    An *in-place unit* (a storage the forward creates and writes in place before anyone else reads it,
    such as ``nn.LSTMCell``'s gate buffer: ``addmm``, ``add_``, ``sigmoid_`` on slices) is one node.
(2) Stack reads (:func:`~memplan.passes._remat.copies.plan_stack_reads`). A tensor that the forward copies into a ``stack``/``cat``
    that stays alive anyway (a graph output, or read by the backward) is free to save: every backward
    reader, copies included, reads a slice of the stack instead. An unrolled RNN that appends its
    hidden states to ``outputs`` then saves no state at all.
(3) Cuts (:func:`~memplan.passes._remat.cuts.min_cut`). Each forward node ``v`` becomes ``v_in -> v_out`` with capacity = the bytes
    of saving it (a view is merged into what it views, a unit into its creator); forward edges
    ``u_out -> v_in`` and ``v_out -> sink`` (for what the backward reads) are infinite; a node that
    cannot be recomputed hangs from the source by its saving cost. A cut edge is a saved tensor, a
    needed node on the sink side is recomputed. Three families of cuts:
    (a) AOTAutograd's: expensive ops (``remat.ban_ops``) banned, every other op free to recompute;
    (b) priced: ``source -> v_in`` has capacity ``lam * FLOPs(v)``, so the cut minimises ``saved bytes +
        lam * recomputed FLOPs`` exactly. ``lam`` is bisected over ``remat.price_range`` (times the
        graph's ratio of saved bytes to forward FLOPs) where the cut changes; this traces the lower
        convex hull of the memory/compute trade-off;
    (c) the knapsack: the hull misses plans in between, so classes of expensive ops (same op on the same
        shapes: the ``mm`` of every loop step) are kept saved in turn, everything else recomputed.
(4) Hoisting repair (:func:`~memplan.passes._remat.cuts.hoisted`). A cut does not see *when* a copy lives: a copy that another copy
    needs early lives from then until its own reader (cut an RNN only at its first state and every step
    is recomputed at the start of the backward, which keeps as much as saving it all). For each cut,
    a variant saves every node whose copy would be placed more than ``remat.hoist_limits`` positions
    before its own first reader (scanning from the last forward node back) and cuts again.
(5) Candidates (:func:`plan_remat`). Each distinct recompute set is placed (:func:`~memplan.passes._remat.copies.plan_copies`) and
    simulated without building it (:class:`~memplan.passes._remat.simulation.VirtualSimulation`, the model ``PeakSimulation`` and the
    ruler use, plus :func:`~memplan.analysis.peak.step_margin`, the step's own loss scalars): ``Candidate(plan, peak,
    overhead)`` with overhead = the copies' predicted seconds / the whole graph's (in-place units whole,
    :func:`~memplan.passes._remat.facts.copy_costs`). The untouched graph is a
    candidate. The set does not depend on the budget, so the chosen peak never rises when the budget
    falls (AOTAutograd's does: pytorch/pytorch#197838). Without a budget, candidates the policy can
    never take are not simulated: those over ``max_overhead``, and those whose floor (the saved values
    and the outputs, all alive when the backward starts: :meth:`~memplan.passes._remat.simulation.VirtualSimulation.step_floor`) is above
    the lowest peak simulated so far, taking the lowest floors first (``remat.bound``).
(5b) Late readers. A cut copies a value once, before its earliest consumer: an attention's probabilities,
    recomputed for the block's output that the feed-forward block's backward needs, stay alive until the
    attention's own backward reads them again. For the lowest plans (``remat.late_readers``), a variant
    serves such late readers of the largest copies by a second group that recomputes those values again
    right before them, from the first group's copies of the smaller values (queries and keys); the early
    copies die with the copies that needed them.
(6) ``ctx.policy.choose`` picks among the Pareto-optimal candidates (a budget: least overhead that fits,
    else :class:`~memplan.errors.InfeasibleBudgetError` naming the smallest peak; none: lowest peak whose
    overhead is within ``max_overhead``), and :func:`~memplan.passes._remat.copies.apply_remat` applies it.

Apply (:func:`~memplan.passes._remat.copies.apply_recompute`, shared with the ``timesteps`` pass): a plan is a list of nested
:class:`~memplan.passes._remat.copies.RecomputeGroup`; a backward node reads a forward value through the deepest group that serves it
and holds the value, else its parent's, else the original (saved) value. Copies are made on demand (a
group recomputes just what its consumers need), each immediately before its earliest consumer, inputs
first; an in-place unit is replayed whole on a fresh storage, its views re-derived with ``as_strided``
after each write. Fake values of copies are built from the originals' metadata (:func:`~memplan.graphutil.rebuilt_value`).
A plan keeps the placement its candidate was simulated with, and applies it as is to the graph it was
planned on (same node names in the same order); on another graph it is placed again.

Preconditions
-------------
A training graph with graph lifetimes (the pipeline sets them) and fake values on every node.
Inference graphs are returned untouched.

Soundness conditions, each with the counterexample it rules out
---------------------------------------------------------------
(a) Never recompute an op that draws from the RNG (``graphutil.is_random``). Counterexample: ``dropout``
    recomputed in the backward would mask other elements than the forward did; its output is saved.
(b) Never recompute an op that writes in place, unless it is part of an in-place unit replayed whole on
    a fresh storage. Counterexample: BatchNorm's ``running_mean.add_`` recomputed would update the
    running statistics twice (the running mean is a buffer: never a unit). One op is recomputed without
    its writes: a training ``native_batch_norm`` on the CPU, whose only writes are the running statistics,
    runs again as ``native_batch_norm(x, w, b, None, None, True, momentum, eps)``, the same kernel giving
    the same output and batch statistics bit for bit (:func:`~memplan.passes._remat.facts.updates_running_statistics_only`;
    its copy neither reads nor writes the running statistics, so a later write to them, the same module
    applied again, does not matter). The cuts that keep every such batch norm are tried too (their
    cuts through batch norms can all land above the best plan that keeps them).
(c) Never recompute an op that reads (or is) a storage written after it. Counterexample:
    ``y = buf * 2; buf.add_(1)``: a copy of ``y`` in the backward would read the updated ``buf``.
    A unit needs every reader outside it to come after its last write: ``g = addmm(..); h = g.sigmoid();
    g.add_(1)`` is no unit, since a copy of the unit would hand ``h``'s copy the written ``g``.
(d) A copy reads only saved originals or earlier copies and precedes its consumers, and never reads an
    original through a node defined before a later write to its storage (it reads an ``as_strided``
    view of the last write instead). Counterexample: a copy reading LSTMCell's ``detach(sigmoid_)``,
    defined before ``tanh_`` writes the same buffer, would be an in-place hazard the pipeline rejects.
(e) A stack read needs the slice to equal the tensor exactly: same dtype, shape and strides (else it is
    copied contiguous), and no write to either storage after the stack. Counterexample: ``cat`` of an
    int and a float tensor promotes the int; ``stack(xs, dim=1)[:, i]`` has other strides than
    ``xs[i]``, and a backward ``view`` of it would fail. A user who writes into a returned tensor before
    ``backward()`` gets autograd's "modified by an inplace operation" error, not a wrong gradient.

Left to other passes
--------------------
Checkpointing across the steps of an unrolled loop on an optimal schedule (``timesteps``: a cut copies
each value at most once, so it cannot nest recomputation), reusing storages of dead tensors (``inplace``,
``arena``), reordering (``schedule``: run it before this pass, since a reorder could move copies back to
the top of the backward), splitting big intermediates (``chunk``). In a pipeline the passes share one
allowance: the pipeline hands this pass what is left of ``max_overhead`` (see
:class:`~memplan.pipeline.PassManager`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

from memplan.analysis.cost import REFERENCE_RATES, CostRates
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.capture import CapturedGraph
from memplan.graphutil import nbytes
from memplan.measure import format_bytes
from memplan.passes._remat.copies import (
    CopyPlan,
    RecomputeGroup,
    RematPlan,
    after_stack_reads,
    apply_remat,
    backward_reads,
    forward_inputs,
    late_reads,
    plan_copies,
    plan_stack_reads,
)
from memplan.passes._remat.cuts import Cuts, ban_sets
from memplan.passes._remat.facts import DEFAULT_BAN_OPS, RematFacts, copy_costs, updates_running_statistics_only
from memplan.passes._remat.simulation import VirtualSimulation
from memplan.pipeline import PassContext, PassResult, PassStats, pass_options, register_pass
from memplan.policy import Candidate, Policy, pareto_front

__all__ = ["RematOptions", "plan_remat", "remat"]

# ----------------------------------------------------------------------------------------------
# options


@dataclasses.dataclass(frozen=True)
class RematOptions:
    """Options of the pass, read from ``ctx.options`` keys ``"remat.<field>"``.

    Attributes
    ----------
    ban_ops : tuple of str
        Op names (``overloadpacket`` names, e.g. ``"mm"``) that AOTAutograd's cut never recomputes.
        Rationale: a matmul costs ``O(n^3)`` for ``O(n^2)`` bytes, so saving it is almost always cheaper
        than recomputing it; the priced cuts still consider them.
    price_range : (float, float)
        Lowest and highest price of compute for the priced cuts, as multiples of the graph's ratio of
        saved bytes to forward FLOPs (at 1.0, recomputing the whole forward costs as much as saving
        everything it saves). Rationale: below 0.01 everything recomputable is recomputed, above 10
        nothing that costs FLOPs is; the two ends bracket the trade-off.
    price_depth : int
        How many times a price interval whose ends cut differently is bisected (at most
        ``2**depth + 1`` priced cuts). Each cut costs one max-flow.
    hoist_limits : tuple of int
        Hoisting limits (graph positions) tried as a repaired variant of every cut. Rationale: a copy
        hoisted a few positions (within one op's backward) is harmless, one hoisted across a loop step
        keeps the step's values alive; simulation decides between the plain and the repaired cut.
    max_nodes : int
        Graphs with more forward nodes than this get AOTAutograd's cut and the two end prices only
        (the max-flow is pure Python).
    max_ban_classes : int
        Up to this many classes of expensive ops (same op on the same shapes, e.g. one ``mm`` per loop
        step), every subset is tried kept saved while everything else is recomputed; beyond it, growing
        prefixes by FLOPs. Rationale: the priced cuts only reach the convex hull of the trade-off.
    late_readers : int
        For this many of the lowest simulated plans, also try a variant in which each backward node that
        reads a copy made more than ``min(hoist_limits)`` positions before it (made early for another
        copy: an attention's probabilities recomputed for the block's output, then read again by the
        attention's backward after the feed-forward block's) is served by copies of its own, recomputed
        again right before it. Rationale: the copy made early then dies with the copies that needed it,
        at the price of recomputing it twice; simulation decides.
    bound : bool
        Without a budget, simulate the cuts in the order of a lower bound on their peak (the saved
        values and the outputs, all alive when the backward starts) and skip those whose bound is above the lowest
        peak simulated so far: the policy takes the lowest peak, so they cannot be chosen. Off: every
        cut the policy may take is simulated (to list them all).

    Examples
    --------
    >>> RematOptions.from_mapping({"remat.ban_ops": ("mm",)}).ban_ops
    ('mm',)
    """

    ban_ops: tuple[str, ...] = DEFAULT_BAN_OPS
    price_range: tuple[float, float] = (0.01, 10.0)
    price_depth: int = 4
    hoist_limits: tuple[int, ...] = (16,)
    max_nodes: int = 20000
    max_ban_classes: int = 4
    bound: bool = True
    late_readers: int = 2

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "RematOptions":
        return pass_options(cls, "remat", options)


# ----------------------------------------------------------------------------------------------
# Steps 3-5: the cuts tried, and their candidates


def _cut_sets(facts: RematFacts, options: RematOptions) -> list[tuple[str, frozenset[str]]]:
    """``(label, recompute set)`` of every cut tried (see stages 3 and 4), duplicates included."""
    cuts = Cuts(facts)
    scale = facts.saved_bytes() / max(1, facts.forward_flops)
    low, high = options.price_range
    depth = options.price_depth if len(facts.nodes) <= options.max_nodes else 0
    found: list[tuple[str, frozenset[str]]] = []
    prices = cuts.sweep(low * scale, high * scale, depth) if scale > 0 else []
    for price in [None] + prices:
        label = "aot" if price is None else f"price {price / scale:.3g}"
        found.append((label, cuts.cut(price)))
        for limit in options.hoist_limits:
            found.append((f"{label}, hoist <= {limit}", cuts.repaired(price, limit)))
    # The knapsack part: the priced cuts only find the convex hull of the trade-off, so also try
    # keeping whole classes of expensive ops saved (all ``mm(x_t, W)`` of a loop are one class).
    if scale > 0:
        for names, banned in ban_sets(facts, options.max_ban_classes, cuts.network.relevant):
            found.append((f"save {names}", cuts.cut(low * scale, banned)))
    return found



def _without_statistics(graph: CapturedGraph, facts: RematFacts) -> RematFacts | None:
    """``facts`` with every batch norm that updates running statistics (and its items) kept, not recomputed;
    None when the graph recomputes none.

    Recomputing such a batch norm (without its running statistics: see
    :func:`~memplan.passes._remat.facts.updates_running_statistics_only`) opens cuts through it, and the
    priced cuts then land elsewhere: on a small ResNet every cut of the sweep recomputed batch norms and
    convolutions, and the plan it found before (105 KiB at +21%, saving the normalised values) was no longer
    among them. The cuts of both are tried, so the option never makes the plan worse.
    """
    held = {name for name, fact in facts.nodes.items()
            if fact.recomputable and updates_running_statistics_only(graph.node(name))}
    if not held:
        return None
    nodes = dict(facts.nodes)
    for name, fact in facts.nodes.items():
        node = graph.node(name)
        parent = node.args[0].name if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) else None
        if name in held or parent in held:
            nodes[name] = dataclasses.replace(fact, recomputable=False, why_not="a batch norm kept (cuts without it)")
    return dataclasses.replace(facts, nodes=nodes)


def plan_remat(
    graph: CapturedGraph,
    am: AnalysisManager,
    policy: Policy,
    options: RematOptions = RematOptions(),
    rates: CostRates = REFERENCE_RATES,
) -> tuple[Candidate[RematPlan], tuple[Candidate[RematPlan], ...]]:
    """Every candidate plan with its simulated peak and overhead (its recomputation's predicted seconds
    over the graph's, by ``rates``), and the one the policy chooses.

    Raises
    ------
    InfeasibleBudgetError
        When the policy has a budget that no candidate meets; it names the smallest reachable peak.
    """
    # Step 1: facts of the graph as given (its peak and compute are the reference).
    simulation = VirtualSimulation(graph, am)
    facts = RematFacts.compute(graph, am, options.ban_ops, rates)
    backward = backward_reads(graph)
    base_peak = am.get(PeakSimulation).peak + simulation.margin  # the pipeline computes it anyway
    candidates = [Candidate(RematPlan("keep everything"), base_peak, 0.0, "keep everything")]

    # Step 2: stack reads; every later candidate starts from them.
    reads = plan_stack_reads(graph, am)
    facts = after_stack_reads(facts, reads)
    if reads:
        plan = RematPlan("stack reads", stack_reads=reads, saved=tuple(facts.needed))
        candidates.append(Candidate(plan, simulation.step_peak(reads), 0.0, plan.label))
    inputs = forward_inputs(graph)

    # Steps 3-4: cuts, each repaired for hoisting; one candidate per distinct recompute set.
    seen: set[frozenset[str]] = set()
    costs = copy_costs(facts)
    bounded = options.bound and policy.budget is None
    pending: list[tuple[int, int, RematPlan, CopyPlan, float, str]] = []  # (floor, order, ...) to simulate
    strict = _without_statistics(graph, facts)
    cut_sets = _cut_sets(facts, options)
    if strict is not None:
        cut_sets += [(f"{label}, batch norms kept", cut) for label, cut in _cut_sets(strict, options)]

    def placed(groups: tuple[RecomputeGroup, ...], label: str) -> tuple[RematPlan, CopyPlan, float] | None:
        """The plan recomputing through ``groups``, placed, with its overhead; None when it copies nothing."""
        copies = plan_copies(groups, inputs=inputs, backward=backward, units=facts.units)
        if not copies.copies:
            return None
        extra = sum(costs[name] for _, name in copies.copies)
        direct = {v for n, _, fw in backward for v in fw if v not in copies.reads.get(n, {})}
        saved = sorted(copies.originals_read() | direct,
                       key=lambda n: facts.nodes[n].position if n in facts.nodes else -1)
        plan = RematPlan(label, stack_reads=reads, groups=groups, units=tuple(dict.fromkeys(copies.units.values())),
                         recomputed=copies.recomputed, saved=tuple(saved), copies=copies,
                         planned_on=simulation.names)
        return plan, copies, extra / facts.total_seconds if facts.total_seconds > 0 else 0.0

    for label, recompute in cut_sets:
        recompute = _with_tuple_parents(graph, facts, recompute)
        if not recompute or recompute in seen:
            continue
        seen.add(recompute)
        found = placed((RecomputeGroup(recompute, label=label),), label)
        if found is None:
            continue
        plan, copies, overhead = found
        if not policy.may_take(overhead):
            continue  # never taken (the plan keeping everything costs nothing): not simulated
        floor = simulation.step_floor(plan.saved, reads) if bounded else 0
        pending.append((floor, len(pending), plan, copies, overhead, label))
    # Step 5: simulate them, lowest floor first (in order when unbounded), until a floor is above the
    # lowest peak so far. A skipped plan peaks above a candidate the policy may take, so it is never
    # chosen (a floor equal to that peak is simulated: the plan could tie on peak and win on overhead).
    lowest = min(c.peak for c in candidates)
    simulated = []
    for floor, order, plan, copies, overhead, label in sorted(pending, key=lambda item: item[:2]):
        if bounded and floor > lowest:
            break
        candidate = Candidate(plan, simulation.step_peak(reads, copies), overhead, label)
        lowest = min(lowest, candidate.peak)
        simulated.append((order, candidate))
    candidates.extend(candidate for _, candidate in sorted(simulated, key=lambda item: item[0]))

    # Step 5b: the lowest plans again, the late readers of their largest copies served by copies of their own.
    # (the lowest peaks, within 2%, cheapest first: equal peaks come at quite different overheads)
    floor_peak = min((c.peak for _, c in simulated), default=0)
    lowest_plans = sorted((c for _, c in simulated if c.peak <= 1.02 * floor_peak),
                          key=lambda c: (c.overhead, c.peak))[:options.late_readers]
    for candidate in lowest_plans:
        late = late_reads(candidate.plan.copies, backward, min(options.hoist_limits, default=0))
        sizes = {value: nbytes(graph.node(value)) for value in late}
        largest = max(sizes.values(), default=0)
        large = [value for value in late if 2 * sizes[value] >= largest > 0]
        if not large:
            continue
        readers = frozenset(r for value in large for r in late[value])
        # they recompute the large values again, from the first group's copies of the smaller ones
        group = candidate.plan.groups[0]
        again, stack = set(), list(large)
        while stack:
            value = stack.pop()
            if value in again or value not in group.nodes or 2 * nbytes(graph.node(value)) < largest:
                continue
            again.add(value)
            stack.extend(facts.inputs.get(value, ()))
        label = f"{candidate.label}, late readers recompute again"
        found = placed((group, RecomputeGroup(frozenset(again), serves=readers, parent=0, label=label)), label)
        if found is not None and policy.may_take(found[2]):
            plan, copies, overhead = found
            candidates.append(Candidate(plan, simulation.step_peak(reads, copies), overhead, label))

    # Step 6: the policy chooses among the candidates no other beats on both peak and overhead.
    return policy.choose(pareto_front(candidates)), tuple(candidates)



def _with_tuple_parents(graph: CapturedGraph, facts: RematFacts, recompute: frozenset[str]) -> frozenset[str]:
    """``recompute`` with the op of every recomputed ``getitem`` whose op's tuple cannot be saved (a
    copy of the item would read it): recomputed too when it can be, else the item is saved instead.
    (Attention's output and log-sum-exp are two items of one tuple; recomputing one of them alone
    would hand the backward the whole tuple.)"""
    added, dropped = set(), set()
    for name in recompute:
        node = graph.node(name)
        if node.target is not operator.getitem or not isinstance(node.args[0], torch.fx.Node):
            continue
        parent = facts.nodes.get(node.args[0].name)
        if parent is None or parent.saveable or parent.name in recompute:
            continue
        if parent.recomputable:
            added.add(parent.name)
        else:
            dropped.add(name)
    return recompute if not added and not dropped else frozenset((recompute | added) - dropped)



# ----------------------------------------------------------------------------------------------
# the pass


@register_pass("remat", options=RematOptions.from_mapping)
def remat(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Recompute cheap forward tensors in the backward instead of saving them (see the module docstring)."""
    if not graph.training:
        return PassResult(graph, changed=False, notes=("inference graph: nothing is saved for backward",))
    options = RematOptions.from_mapping(ctx.options)
    chosen, candidates = plan_remat(graph, ctx.am, ctx.policy, options, ctx.rates)
    plan = chosen.plan
    if not plan.changes:
        return PassResult(graph, changed=False, plan=plan,
                          notes=(f"kept every saved tensor ({len(candidates)} candidates considered)",))
    before = candidates[0].peak
    # Step 6 (end): apply the chosen plan to the graph itself.
    result = apply_remat(graph, plan)
    notes = (
        f"{plan.label}: peak {format_bytes(before)} -> {format_bytes(chosen.peak)}, "
        f"recompute +{chosen.overhead:.1%} ({len(plan.recomputed)} nodes), {len(candidates)} candidates",
    )
    stats = PassStats(nodes_rewritten=len(plan.recomputed) + len(plan.stack_reads),
                      bytes_saved=before - chosen.peak, recompute_added=chosen.overhead)
    return PassResult(result, changed=True, stats=stats, notes=notes, plan=plan)
