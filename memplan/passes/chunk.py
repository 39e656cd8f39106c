"""chunk: run a region whose huge intermediate is reduced or sliced away in chunks, one after another.

What it does
------------
Some regions hold a huge intermediate only because a dimension that stays independent through the
region (a batch, the ``i`` of a pairwise similarity, the time steps of a generator) is processed all
at once. This pass splits such a region along that dimension into chunks run in sequence, combines
the partial results (concatenate, sum, length-weighted mean, log-sum-exp, max, NLL mean weighted by
the chunk's total weight), and runs the region's backward chunk by chunk too, recomputing each
chunk's forward values instead of saving them (Rabe & Staats 2021; KeOps; ``vmap(chunk_size=)``;
OpenNMT-py generator shards).

The dimension is found from the graph: every op has a *chunk rule*
(:func:`~memplan.passes._chunk.rules.chunk_rule`, in :mod:`memplan.passes._chunk.rules`) saying,
given which input carries the index (``Split(dim, inner)``: the outer factor of ``dim``), which
dimension of its output carries it, or that its output is a *partial* result of the chunk
(``Partial``: a sum, a mean, a log-sum-exp, ...), or that it mixes the index (a ``Barrier``: a softmax
over it, a slice along it, a random op).

Stages
------
(1) Seeds. For the largest forward tensors and each of their dimensions, walk the index back through
    ops that carry it to its *sources* (placeholders, or ops that create it, such as ``stack``); also
    every dimension of every user input. Each distinct source set is one candidate index.
(2) Forward flood. From the sources, propagate states forward with the chunk rules. Nodes that carry
    the index or hold a partial form the region ``R``; an op that needs another operand sliced
    (``x + y`` with both full-sized) slices it too, unless it is downstream of the region; a
    shape-only value (a ``zeros``, a broadcast ``expand``) is rebuilt chunk-sized instead; ops that
    mix the index, and everything after them, stay outside (so the region is convex).
(3) Backward analysis. The region's backward ``B`` (:func:`region_backward`: backward nodes with the
    region's autograd sequence numbers, plus the accumulations between them) is propagated the same
    way from the states of what it reads. Nodes that carry the index or a partial sum form the
    backward body; the rest is hoisted (runs once, outside the loop). A backward op that mixes the
    index makes its forward op a barrier, and stage (2) runs again without it.
(4) Recompute or save. Forward values the backward body reads are recomputed in the body (with their
    ancestors in ``R`` up to materialised values), except, in one candidate variant, small results of
    reductions (maxima and their indices, log-sum-exps) saved by the forward loop when that removes
    recomputation; saved indices travel in the narrowest integer type that holds them.
(5) Candidates and policy. A region is first priced without building anything: a lower bound on
    its peak (the untouched graph's storages, less what the loops do not keep, with reads moved to
    the loops: :func:`_peak_bound`) and on its extra compute (a dispatch per op per extra chunk, the
    recomputation, all bytes at cache speed: :func:`_overhead_bound`). A region that cannot beat the
    policy's threshold on either is skipped. Each remaining region and variant is built once, at the
    coarsest chunk count; every count of the ladder is then priced from that build (a body at another
    length has the same nodes, storages and live intervals, only the values that carry the index
    change size: :class:`BodyModel`), its graph peak re-walked with the loops' scratch sizes and its
    extra compute estimated with a cost model (:class:`CostRates`: FLOPs, bytes moved, a fixed cost
    per op and per chunk); when the index is used up (chunks of one unit), the loop bodies are
    chunked again along a second index (nested chunking: the tokens of each sequence).
    ``ctx.policy.choose`` picks one candidate, or none (the unchunked graph is a candidate).
(6) Apply. The region becomes one forward loop node and one backward loop node (:class:`ChunkLoop`
    modules running fx bodies chunk by chunk); scatter-adds into a zero tensor (gradients of what
    every chunk reads, e.g. an embedding table) add into one accumulator owned by the loop. The old
    nodes are erased and the graph re-sorted stably. A loop node's fake value carries a scratch tensor
    the size of its body's own peak, so the peak simulation sees the memory a chunk uses and agrees
    with the ruler. Bodies do as little as they can per chunk (:func:`build_body`): views that fold
    away are not emitted, a cheap pointwise value the backward reads late is computed again there
    (:func:`rematerialise_cheap`), and a loop output that capture's gradient-layout copy would copy
    into its very own layout is not copied (:func:`_drop_layout_copy`).

Preconditions
-------------
Static shapes; every op of a region has a chunk rule (unknown ops are barriers); the index has at
least 2 units; no random op is in a region, and no op writes in place into a value from outside
its loop body, except a scatter-add into a tensor nothing else reads (every chunk adds its part).

Soundness conditions (each with a counterexample that the rules refuse)
---------------------------------------------------------------------
* Every op in ``R`` treats the index independently. Counterexample: ``softmax(x, dim=i)`` over the
  chunked dim needs all of ``i`` at once; it is a barrier.
* Partial results flow only through linear ops before they are combined (the algebra, and the
  one check every rule asks, are :func:`~memplan.passes._chunk.rules.crosses` and
  :func:`~memplan.passes._chunk.rules.partial_op_class`). Counterexamples: ``exp(x.sum(i))`` on a
  chunk computes ``exp`` of a partial sum (nonlinear); ``x.sum(i).add(1e-6)`` adds the constant once
  per chunk (affine). Both are barriers for partials.
* A reduction over the index has a combine and a backward that slices. Counterexample:
  ``x.max(dim=i)`` has a combine (max with argmax) but its backward scatters into all of ``i`` with
  global indices; it is a barrier (``amax`` too: its backward divides by a count over ``i``).
* Random ops are never chunked or recomputed, nor run in a loop at all. Counterexample: ``dropout``
  drawn chunk by chunk draws other numbers than eager's single draw; it is a barrier, even when all
  it reads is replicated (the mask of a dropout of a partial sum, drawn into an ``empty_like`` of it).
  A draw that reads no value of the region (``rewrite`` (i) makes dropout's noise from its shape alone)
  stays outside it: drawn whole before the loop, in eager's order among the draws, and read in slices.
  The backward loop reads the noise the backward draws again (:data:`REMAKES`) where it recomputes
  from the forward's, so the forward's noise dies with the forward loop.
* The region is convex (nothing outside it both reads it and feeds it). Counterexample:
  ``m = x.amax(i); z = x - m; w = z * x``: ``z`` reads the combined ``m``, and ``w`` would need ``z``
  sliced inside the loop that computes ``m``. The flood marks ``z`` downstream of the region, and ``w``.
* In-place writes inside a body go to values the body made, or to one accumulator nothing else reads.
  Counterexample: ``zeros.index_add_(...)`` with ``zeros`` created once outside the loop and also read
  by another op would see the other chunks' additions.
* Sums over chunks add in another order than eager's sums: results agree to float tolerance.

What it leaves to other passes
------------------------------
Rewriting a matmul whose broadcast or max makes its backward huge (``rewrite``, which should run
first); saving versus recomputing outside regions (``remat``); reusing buffers, e.g. the copy of a
gradient into its parameter's layout when the gradient is not a loop output (``inplace``,
``arena``); ordering (``schedule``). It runs best
before passes that move forward nodes into the backward, since it finds a region's backward by
autograd sequence numbers.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import operator
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from memplan._capture.tracer import quiet_meta_failures
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory_model import MemoryModel
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase
from memplan.errors import InfeasibleBudgetError
from memplan.graphutil import is_pure_view, is_random, mutated_args, next_seq_nr, packet_name
from memplan.analysis.cost import REFERENCE_RATES, CostRates, graph_cost, module_cost, op_work
from memplan.passes._chunk.graphs import (
    ALIAS_OPS,
    BackwardIndex,
    RegionBackward,
    copy_graph,
    fake_mode_of,
    finish_module,
    owned_by,
    refresh_aliases,
    region_backward,
    same_layouts,
    stable_toposort,
)
from memplan.passes._chunk.loops import (
    AGAIN,
    original_name,
    BodyModel,
    rematerialise_cheap,
    ChunkLoop,
    LoopInput,
    LoopOutput,
    replay_views,
    LoopSpec,
    body_graph,
    build_body,
    handed_over,
    loop_scratch,
)
from memplan.passes._chunk.rules import (
    REP,
    VIEW_OPS,
    ZERO_PRODUCERS,
    Barrier,
    Need,
    Partial,
    Replicated,
    Split,
    State,
    arg_of,
    chunk_rule,
    operand_requests,
    is_tensor,
    map_view,
    nbytes,
    shape_of,
)
from memplan.passes._rewrite.remade import REMAKES
from memplan.pipeline import PassContext, PassResult, PassStats, mutation_hazards, pass_options, register_pass
from memplan.policy import Candidate, Policy

__all__ = [
    "Split",
    "Partial",
    "Replicated",
    "REP",
    "chunk_rule",
    "map_view",
    "RegionBackward",
    "region_backward",
    "ChunkRegion",
    "ChunkPlan",
    "ChunkLoop",
    "ChunkOptions",
    "CostRates",
    "plan_chunk",
    "apply_chunk",
    "apply_region",
    "chunk",
    "stable_toposort",
    "copy_graph",
    "refresh_aliases",
    "fake_mode_of",
    "graph_cost",
]


# ----------------------------------------------------------------------------------------------
# propagation

_MAX_RESTARTS = 64
_RELABEL_FACTORIES = {"new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones", "empty", "full"}


def _relabelable(node: torch.fx.Node, state: Split, st: Callable[[Any], State]) -> bool:
    """A shape-only value that can be built chunk-sized directly: a factory, or a broadcast of a
    replicated value along the chunked dimension."""
    name = packet_name(node)
    if name in _RELABEL_FACTORIES:
        return True
    if name == "expand":
        src = node.args[0]
        if not isinstance(st(src), Replicated):
            return False
        out_rank, in_shape = len(shape_of(node)), shape_of(src)
        aligned = state.dim - (out_rank - len(in_shape))
        return aligned < 0 or in_shape[aligned] == 1
    return False


def _is_zero_factory(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    name = packet_name(node)
    if name in ZERO_PRODUCERS:
        return True
    if name in ("full", "new_full"):
        return arg_of(node, 1 if name == "full" else 2, "fill_value", None) == 0
    return False


_MEMO_INPUTS = 8  # ops with more inputs (a cat of many steps) are asked directly


class _RuleMemo:
    """:func:`chunk_rule` with its answers kept by ``(node, the states of its inputs)``.

    A rule reads nothing but its op and its inputs' states, and the floods of the candidate indices of
    one graph ask the same ops about the same states again and again (the batch of an unrolled loop
    is reached from the hidden state, from the inputs and from the noise alike)."""

    def __init__(self):
        self.answers: dict[tuple, Any] = {}
        self.inputs: dict[torch.fx.Node, tuple[torch.fx.Node, ...]] = {}

    def __call__(self, node: torch.fx.Node, st: Callable[[Any], State]) -> Any:
        inputs = self.inputs.get(node)
        if inputs is None:
            inputs = self.inputs[node] = tuple(node.all_input_nodes)
        if len(inputs) > _MEMO_INPUTS or node.target is operator.getitem:
            # a key as long as the rule's own work; an item of an op with many results (the steps
            # of an unbind) would hash all its siblings' states to be looked up in one
            return chunk_rule(node, st, _is_zero_factory)
        key = (node, *(st(a) for a in inputs))
        answer = self.answers.get(key)
        if answer is None:
            answer = self.answers[key] = chunk_rule(node, st, _is_zero_factory)
        return answer


def _plain_rule(node: torch.fx.Node, st: Callable[[Any], State]) -> Any:
    return chunk_rule(node, st, _is_zero_factory)


class _Asker:
    """Asks ``rule`` about ``node``, again after each :class:`Need` is met (the floods' loop).

    A ``cat`` or ``stack`` asks for its replicated operands one at a time, reading all of them for
    each answer; once it has asked, its next answer is the next operand of
    :func:`~memplan.passes._chunk.rules.operand_requests` still replicated, found without asking
    (the rule itself gives the last answer, when none is left)."""

    def __init__(self, node: torch.fx.Node, st: Callable[[Any], State], rule: Callable):
        self.node, self.st, self.rule = node, st, rule
        self.requests: tuple[Split, list[torch.fx.Node]] | None = None
        self.next = 0

    def __call__(self) -> Any:
        if self.requests is not None:
            split, asked = self.requests
            while self.next < len(asked):
                state = self.st(asked[self.next])
                if isinstance(state, Replicated):
                    return Need(asked[self.next], split)
                if state != split:
                    break  # not met as asked: let the rule answer
                self.next += 1
            return self.rule(self.node, self.st)
        answer = self.rule(self.node, self.st)
        if isinstance(answer, Need):
            self.requests = operand_requests(self.node, self.st)
        return answer


@dataclasses.dataclass
class _Flood:
    states: dict[torch.fx.Node, State]
    slices: dict[torch.fx.Node, Split]
    relabel: dict[torch.fx.Node, Split]
    tainted: set[torch.fx.Node]
    failed: torch.fx.Node | None = None


def _flood_forward(
    order: Sequence[torch.fx.Node],
    seeds: Mapping[torch.fx.Node, Split],
    barriers: set[str],
    position: Mapping[torch.fx.Node, int] | None = None,
    rule: Callable[[torch.fx.Node, Callable[[Any], State]], Any] = _plain_rule,
) -> _Flood:
    """Propagate chunk states forward from the sliced ``seeds`` (stage 2).

    A rule that needs an input sliced or rebuilt chunk-sized changes that input's state. When nothing
    walked so far read that input, the rule is simply asked again; otherwise, as states only flow
    forward, the walk resumes at the first node the input can affect, keeping what it found before.

    The walk visits, in graph order, only the nodes something can reach: readers of a value with a
    state, a slice or a taint, and values relabelled or pulled into the chunk. Any other node reads
    nothing the flood touched, so a full walk would pass it by; skipping it keeps the cost in
    proportion to the region, not to the graph. ``position`` is ``order``'s index when the caller
    has it; ``rule`` answers as :func:`chunk_rule` (a :class:`_RuleMemo` shared by the floods of one
    graph)."""
    if position is None:
        position = {node: i for i, node in enumerate(order)}
    slices = dict(seeds)
    relabel: dict[torch.fx.Node, Split] = {}
    pulled: set[torch.fx.Node] = set()  # shape-only values the region writes in place: made per chunk
    states: dict[torch.fx.Node, State] = {}
    tainted: set[torch.fx.Node] = set()
    whole: set[torch.fx.Node] = set()  # views of sliced sources read whole, from outside the loops

    def st(x: Any) -> State:
        if x in slices:
            return slices[x]
        return states.get(x, REP)

    def first_affected(changed: Sequence[torch.fx.Node]) -> int:
        at = [position[n] for n in changed if n in position]
        at += [position[u] for n in changed for u in n.users if u in position]
        return min(at, default=len(order))

    start = 0
    for _ in range(_MAX_RESTARTS):
        for node in [n for n in states if position[n] >= start]:
            del states[node]
        tainted.difference_update([n for n in tainted if position[n] >= start])
        queue: list[int] = []
        queued: set[int] = set()

        def visit(node: torch.fx.Node, after: int) -> None:
            at = position.get(node)
            if at is not None and at > after and at not in queued:
                queued.add(at)
                heapq.heappush(queue, at)

        def visit_readers(node: torch.fx.Node, after: int) -> None:
            for user in node.users:
                visit(user, after)

        def taint(node: torch.fx.Node) -> None:
            # ``node`` and, at once, what reads it: the walk would taint each reader of a tainted
            # value when it reaches it (slices, relabelled and pulled values aside), and nothing added
            # to those later lies after the node the walk is at, so no reader has to wait for its turn
            tainted.add(node)
            stack = [node]
            while stack:
                for user in stack.pop().users:
                    held = user in slices or user in relabel or user in pulled
                    if user in position and user not in tainted and not held:
                        tainted.add(user)
                        stack.append(user)

        for node in [*states, *slices, *relabel]:
            visit_readers(node, start - 1)
        for node in list(tainted):
            taint(node)
        for node in [*slices, *relabel, *pulled]:
            visit(node, start - 1)
        changed: list[torch.fx.Node] = []
        while queue:
            at = heapq.heappop(queue)
            node = order[at]
            if node in slices:
                continue
            if node in relabel:
                states[node] = relabel[node]
                visit_readers(node, at)
                continue
            if node in pulled:
                states[node] = REP
                visit_readers(node, at)
                continue
            if node in tainted or node in whole:
                continue
            inputs = node.all_input_nodes
            if not any(a in states or a in slices for a in inputs):
                continue
            foreign = [m for m in mutated_args(node) if not owned_by(m, states)]
            if foreign and all(packet_name(m) in _RELABEL_FACTORIES and m not in pulled for m in foreign):
                pulled.update(foreign)
                changed = foreign
                break
            ask = _Asker(node, st, rule)
            result = ask()
            if node.name in barriers or foreign and result != Partial("inplace"):
                taint(node)
                continue
            while isinstance(result, Need):
                target = result.node
                if target in tainted or target in slices:
                    break
                if target in states:
                    if not (isinstance(states[target], Replicated) and _relabelable(target, result.state, st)):
                        break
                    relabel[target] = result.state
                elif _relabelable(target, result.state, st):
                    relabel[target] = result.state
                else:
                    slices[target] = result.state
                if any(position.get(u, len(order)) < at for u in target.users):
                    changed = [target]  # something before this node read the old state: walk again from there
                    break
                if target in relabel and target in position:
                    states[target] = relabel[target]
                visit_readers(target, at)
                result = ask()
            if changed:
                break
            if isinstance(result, (Need, Barrier)):
                # An op that reads the index twice (``z @ z.t()`` sliced by the rows of ``z``) may read one
                # of them whole: a view of a sliced source can be taken of the whole source, outside the
                # loops (a view costs nothing). Read those whole and walk again from them.
                views = _whole_views(node, inputs, states, slices, whole, st, rule)
                if views:
                    whole.update(views)
                    changed = views
                    break
                taint(node)
                continue
            states[node] = result
            visit_readers(node, at)
        if not changed:
            return _Flood(states, slices, relabel, tainted)
        start = first_affected(changed)
    return _Flood({}, slices, relabel, set())


def _whole_views(node: torch.fx.Node, inputs: Sequence[torch.fx.Node], states: Mapping[torch.fx.Node, State],
                 slices: Mapping[torch.fx.Node, Split], whole: set[torch.fx.Node], st: Callable[[Any], State],
                 rule: Callable) -> list[torch.fx.Node]:
    """Inputs of ``node`` (whose rule refused its inputs' states) to read whole instead, so that the rule
    accepts: views of sliced sources (taken of the whole source outside the loops, at no cost), never
    all the inputs that carry the index. Empty when no such choice satisfies the rule.

    ``z @ z.t()`` sliced by the rows of ``z`` reads ``z.t()`` whole; ``z[:, None] * z[None]`` reads the
    second view whole (each view carrying the index is tried as the one kept sliced, in order)."""
    carrying = [a for a in inputs if a in states or a in slices]
    views = [a for a in carrying if a not in slices and is_pure_view(a) and a.all_input_nodes
             and all(b in slices or b in whole for b in a.all_input_nodes)]
    if not views:
        return []
    choices = [views] if len(views) < len(carrying) else [[v for v in views if v is not kept] for kept in views]
    for chosen in choices:
        trial = set(chosen)
        answer = rule(node, lambda x: REP if x in trial else st(x))
        if not isinstance(answer, (Need, Barrier)):
            return chosen
    return []


def _flood_backward(
    order: Sequence[torch.fx.Node],
    fixed: Mapping[torch.fx.Node, State],
    rule: Callable[[torch.fx.Node, Callable[[Any], State]], Any] = _plain_rule,
) -> _Flood:
    """Propagate chunk states through a region's backward from what it reads (stage 3); a changed
    input is handled as in :func:`_flood_forward` (asked again, or the walk resumes where it matters)."""
    slices: dict[torch.fx.Node, Split] = {}
    relabel: dict[torch.fx.Node, Split] = {}
    members = set(order)
    position = {node: i for i, node in enumerate(order)}
    states: dict[torch.fx.Node, State] = {}

    def st(x: Any) -> State:
        if x in slices:
            return slices[x]
        if x in states:
            return states[x]
        return fixed.get(x, REP)

    start = 0
    for _ in range(_MAX_RESTARTS):
        for node in order[start:]:
            states.pop(node, None)
        changed: torch.fx.Node | None = None
        for node in order[start:]:
            if node in relabel:
                states[node] = relabel[node]
                continue
            mutated = mutated_args(node)
            ask = _Asker(node, st, rule)
            result = ask()
            if any(m in slices or not owned_by(m, members) and result != Partial("inplace") for m in mutated):
                return _Flood(states, slices, relabel, set(), failed=node)
            while isinstance(result, Need):
                target, want = result.node, result.state
                if target in slices:
                    return _Flood(states, slices, relabel, set(), failed=node)
                if target in states:
                    if _relabelable(target, want, st):
                        relabel[target] = want
                    elif isinstance(states[target], Replicated):
                        slices[target] = want  # hoisted, materialised, read in slices
                    else:
                        return _Flood(states, slices, relabel, set(), failed=node)
                elif isinstance(fixed.get(target, REP), Replicated):
                    slices[target] = want
                else:
                    return _Flood(states, slices, relabel, set(), failed=node)
                if any(position.get(u, len(order)) < position[node] for u in target.users):
                    changed = target
                    break
                if target in relabel and target in position:
                    states[target] = relabel[target]
                result = ask()
            if changed is not None:
                break
            if isinstance(result, Barrier):
                return _Flood(states, slices, relabel, set(), failed=node)
            states[node] = result
        if changed is None:
            return _Flood(states, slices, relabel, set())
        at = [position[changed]] if changed in position else []
        start = min(at + [position[u] for u in changed.users if u in position])
    return _Flood({}, slices, relabel, set(), failed=order[0] if order else None)


def _combined(state: State) -> State:
    """How the backward sees a forward value: partial results are read combined (replicated)."""
    if isinstance(state, tuple):
        return tuple(_combined(s) for s in state)
    return REP if isinstance(state, Partial) else state


def _carries(state: State) -> bool:
    if isinstance(state, tuple):
        return any(_carries(s) for s in state)
    return isinstance(state, (Split, Partial))


# ----------------------------------------------------------------------------------------------
# the plan


def _state_str(state: State) -> str:
    if isinstance(state, tuple):
        return "(" + ", ".join(_state_str(s) for s in state) + ")"
    return str(state)


@dataclasses.dataclass(frozen=True)
class ChunkRegion:
    """One region to run in chunks: what is in it, how each value is split, what the loops exchange.

    All nodes are named; ``forward``/``backward`` list the nodes of the two loop bodies with their
    states, in graph order. ``chunk`` is the number of index units per chunk (the last chunk may be
    shorter) and ``saved`` the small forward values kept for the backward instead of recomputed.
    """

    label: str
    units: int
    chunk: int
    forward: tuple[tuple[str, State], ...]
    sources: tuple[tuple[str, Split], ...]
    outputs: tuple[str, ...]
    saved: tuple[str, ...]
    backward: tuple[tuple[str, State], ...]
    recompute: tuple[str, ...]
    backward_slices: tuple[tuple[str, Split], ...]
    backward_outputs: tuple[str, ...]
    relabelled: tuple[str, ...]
    inner: tuple[tuple[str, int, "ChunkPlan"], ...] = ()  # (loop, body length, plan) chunking a body again

    @property
    def chunks(self) -> int:
        return -(-self.units // self.chunk)

    def __str__(self) -> str:
        nested = "".join(f"; {loop} body: {r}" for loop, _, plan in self.inner[:2] for r in plan.regions[:1])
        return (
            f"chunk {self.label}: {self.units} units in {self.chunks} chunks of {self.chunk}, "
            f"{len(self.forward)} forward ops, {len(self.backward)} backward ops, "
            f"{len(self.recompute)} recomputed, {len(self.saved)} saved" + nested
        )


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The regions a run of the pass chunks, in the order they are applied."""

    regions: tuple[ChunkRegion, ...] = ()

    def __str__(self) -> str:
        return "\n".join(str(r) for r in self.regions) if self.regions else "chunk: nothing to do"


@dataclasses.dataclass(frozen=True)
class _Search:
    """Facts of one graph that the analysis of every candidate index reads, gathered once."""

    forward: tuple[torch.fx.Node, ...]  # forward ops, graph order
    position: Mapping[torch.fx.Node, int]  # index in ``forward``
    backward: BackwardIndex
    rule: _RuleMemo

    @classmethod
    def of(cls, graph: CapturedGraph) -> "_Search":
        forward = tuple(
            n for n in graph.gm.graph.nodes if n.op == "call_function" and graph.phases.get(n.name) is Phase.FORWARD
        )
        return cls(forward, {n: i for i, n in enumerate(forward)}, BackwardIndex.of(graph), _RuleMemo())


def _analyse(
    graph: CapturedGraph, seeds: Mapping[str, Split], label: str, search: _Search | None = None
) -> ChunkRegion | None:
    """Stages 2-4 for one candidate index: the region, its backward body, what to recompute."""
    search = search if search is not None else _Search.of(graph)
    seed_nodes = {graph.node(k): v for k, v in seeds.items()}
    units = {(shape_of(n)[s.dim] // s.inner) for n, s in seed_nodes.items()}
    if len(units) != 1 or next(iter(units)) < 2:
        return None
    (n_units,) = units
    barriers: set[str] = set()
    for _ in range(16):
        # Step 2: the forward flood from the sliced sources.
        flood = _flood_forward(search.forward, seed_nodes, barriers, search.position, search.rule)
        region = sorted(flood.states, key=search.position.__getitem__)
        if not any(_carries(flood.states[n]) for n in region):
            return None
        if any(shape_of(n)[s.dim] != n_units * s.inner for n, s in flood.slices.items()):
            return None
        if _tuple_leaves(graph, region, flood):
            return None
        rb = region_backward(graph, [n.name for n in region], search.backward)
        if rb is None:
            return None
        # Step 3: the region's backward, from the states of the values it reads.
        border = [graph.node(x) for x in rb.nodes]
        fixed: dict[torch.fx.Node, State] = {n: _combined(flood.states[n]) for n in region}
        fixed.update(flood.slices)
        back = _flood_backward(border, fixed, search.rule)
        if back.failed is not None:
            seq = graph.seq_nr.get(back.failed.name)
            culprits = {n.name for n in region if graph.seq_nr.get(n.name) == seq}
            if not culprits or culprits <= barriers:
                return None
            barriers |= culprits
            continue
        return _finish_region(graph, label, n_units, region, flood, border, back)
    return None


def _relabelled_out(region_set: set[torch.fx.Node], flood: _Flood) -> set[torch.fx.Node]:
    """Relabelled nodes that read nothing of the region: they stay outside the loop."""
    return {n for n in flood.relabel if not any(a in region_set for a in n.all_input_nodes)}


def _tuple_leaves(graph: CapturedGraph, region: Sequence[torch.fx.Node], flood: _Flood) -> bool:
    """Whether a forward node outside the region reads a tuple value of it, which
    :func:`_finish_region` refuses (only a tuple's items may leave a loop; a forward user never joins
    the backward body). Checked before the region's backward is searched, which on a long unrolled
    loop takes about a second with the backward flood; such a region is dropped then, without the
    narrower retry a failing backward flood would have led to."""
    region_set = set(region)
    relabelled = _relabelled_out(region_set, flood)
    return any(
        isinstance(flood.states[node], tuple) and node not in relabelled
        and any(u not in region_set and graph.phases.get(u.name) is Phase.FORWARD for u in node.users)
        for node in region
    )


def _finish_region(graph, label, n_units, region, flood: _Flood, border, back: _Flood) -> ChunkRegion | None:
    region_set = set(region)
    # the backward body: nodes carrying the index or a partial, and shape-only nodes that read them
    body: list[torch.fx.Node] = []
    body_set: set[torch.fx.Node] = set()
    for node in border:
        state = back.states[node]
        if _carries(state) or node in back.relabel or any(a in body_set for a in node.all_input_nodes):
            body.append(node)
            body_set.add(node)
    # a value the body writes in place is created in the body, once per chunk
    border_set = set(border)
    pulled = True
    while pulled:
        pulled = False
        for node in list(body):
            for target in mutated_args(node):
                chain = [target]
                while packet_name(chain[-1]) in ALIAS_OPS and chain[-1].args:
                    chain.append(chain[-1].args[0])
                for member in chain:
                    if member in border_set and member not in body_set:
                        body_set.add(member)
                        pulled = True
        body = [n for n in border if n in body_set]
    hoisted = [n for n in border if n not in body_set]
    # a hoisted node that the body reads must not depend on the body
    downstream: set[torch.fx.Node] = set()
    for node in hoisted:
        if any(a in body_set or a in downstream for a in node.all_input_nodes):
            downstream.add(node)
    if any(a in downstream for n in body for a in n.all_input_nodes):
        return None
    relabelled_out = _relabelled_out(region_set, flood)
    outputs = []
    for node in region:
        if node in relabelled_out:
            continue
        outside = [u for u in node.users if u not in region_set and u not in body_set]
        partial_read = isinstance(flood.states[node], Partial) and any(u in body_set for u in node.users)
        if outside or partial_read:
            if isinstance(flood.states[node], tuple):
                return None  # a tuple value read outside: only its items may leave the loop
            outputs.append(node)
    backward_outputs = [n for n in body if any(u not in body_set for u in n.users)]
    # Step 4: what the backward body recomputes (the save-small variant is made by _with_saved).
    recompute = _recompute_closure(region, region_set, set(outputs), body)
    forward_states = tuple((n.name, flood.states[n]) for n in region)
    return ChunkRegion(
        label=label,
        units=n_units,
        chunk=n_units,
        forward=forward_states,
        sources=tuple(sorted(((n.name, s) for n, s in flood.slices.items()), key=lambda p: p[0])),
        outputs=tuple(n.name for n in outputs),
        saved=(),
        backward=tuple((n.name, back.states[n]) for n in body),
        recompute=tuple(n.name for n in recompute),
        backward_slices=tuple(sorted(((n.name, s) for n, s in back.slices.items()), key=lambda p: p[0])),
        backward_outputs=tuple(n.name for n in backward_outputs),
        relabelled=tuple(sorted(n.name for n in relabelled_out)),
    )


def _writers(region: Sequence[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """The ops of ``region`` that write in place into each value (or into a view of it, or into the
    value it is a view of)."""
    writers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in region:
        for target in mutated_args(node):
            chain = [target]
            while packet_name(chain[-1]) in ALIAS_OPS and chain[-1].args:
                chain.append(chain[-1].args[0])
            for member in chain:
                writers.setdefault(member, []).append(node)
    return writers


def _recompute_closure(region, region_set, materialised, body) -> list[torch.fx.Node]:
    """Forward values of the region the backward body reads, with their ancestors in the region, up to
    values the forward loop materialises.

    A value recomputed is recomputed with the region's in-place writes into it or into a view of it
    (``idx[:, 1::2] = labels`` fills a recomputed zero tensor): they are not its ancestors. A value the
    loop materialises holds what those writes left in it, so a recomputed write must not start from it:
    it is recomputed too. Counterexample: ``rms_norm``'s ``mean(x ** 2).add_(eps).rsqrt()`` with the
    mean saved, and ``add_`` recomputed from it, added ``eps`` twice (gradients 1000x eager's error).
    """
    writers = _writers(region)
    materialised = set(materialised)
    while True:
        needed: set[torch.fx.Node] = set()
        stack = [a for n in body for a in n.all_input_nodes if a in region_set and a not in materialised]
        while stack:
            node = stack.pop()
            if node in needed:
                continue
            needed.add(node)
            stack.extend(a for a in node.all_input_nodes if a in region_set and a not in materialised)
            stack.extend(w for w in writers.get(node, ()) if w not in materialised)
        written = {m for m in materialised if any(w in needed for w in writers.get(m, ()))}
        if not written:
            return [n for n in region if n in needed]
        materialised -= written


_MAKES_VALUES = _RELABEL_FACTORIES | {"zeros_like", "ones_like", "empty_like", "full_like", "new_empty_strided",
                                      "empty_strided", "scalar_tensor", "arange"}
_REDUCTION_RATIO = 8  # see _with_saved: a saved value's op reads at least this many times what it returns


def _with_saved(graph: CapturedGraph, region: ChunkRegion, fraction: float) -> ChunkRegion | None:
    """A variant that saves small forward values (at most ``fraction`` of the region's largest) made
    by reductions (the op reads at least ``_REDUCTION_RATIO`` times the bytes it returns: a max and its
    indices, a log-sum-exp) when that removes recomputation.

    Every small value the recomputation reads is a candidate; saving them shrinks the recomputed set,
    and the candidates nothing recomputed still reads are dropped again, until nothing changes. A max
    that returns values and indices is recomputed only if one of the two is not saved."""
    node_of = graph.node  # the graph's name table
    forward = [node_of(name) for name, _ in region.forward]
    states = dict(region.forward)
    region_set = set(forward)
    body = [node_of(name) for name, _ in region.backward]
    largest = max((nbytes(n) for n in forward), default=0)
    outputs = {node_of(o) for o in region.outputs}

    def small(a: torch.fx.Node) -> bool:
        # the result of a reduction: its op reads many times the bytes it returns, so keeping the
        # result saves much more recomputation than it costs memory
        op = a.args[0] if a.target is operator.getitem else a
        if packet_name(op) in _MAKES_VALUES:
            return False  # a factory reads no data: it is free to make again
        reads = sum(nbytes(x) for x in op.all_input_nodes)
        return (
            isinstance(states[a.name], Split)
            and isinstance(a.meta.get("val"), torch.Tensor)
            and nbytes(a) <= fraction * largest
            and packet_name(a) not in ALIAS_OPS  # views cost nothing to recompute, and saving one would copy it
            and reads >= _REDUCTION_RATIO * nbytes(op)
        )

    written = _writers(forward)  # a value written in place after it is made holds the written value
    recompute = [node_of(n) for n in region.recompute]
    readers = set(recompute) | set(body)
    saved = {a for n in readers for a in n.all_input_nodes
             if a in region_set and a not in outputs and a not in written and small(a)}
    while saved:
        recompute = _recompute_closure(forward, region_set, outputs | saved, body)
        readers = set(recompute) | set(body)
        still = {a for n in readers for a in n.all_input_nodes if a in saved}
        if still == saved:
            break
        saved = still
    if not saved or len(recompute) >= len(region.recompute):
        return None
    return dataclasses.replace(
        region, saved=tuple(n.name for n in forward if n in saved), recompute=tuple(n.name for n in recompute)
    )


def _external_inputs(nodes: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    members = set(nodes)
    seen: dict[torch.fx.Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in seen:
                seen[arg] = None
    return list(seen)


def _output_spec(node: torch.fx.Node, state: State) -> LoopOutput:
    value = node.meta["val"]
    shape, stride = tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride())
    if torch._debug_has_internal_overlap(value) != 0:
        # A broadcast (``expand``) value, or a view with gaps (one of the parts ``split`` cut from a
        # projection): the loop writes its chunks into a dense tensor instead, whose dimensions keep
        # the value's order in memory (``empty_like``'s layout), as an op on the value would: an op
        # reading it may lay its own output out after it (attention's output follows its query).
        stride = tuple(int(s) for s in torch.empty_like(torch.empty_strided(shape, stride, device="meta")).stride())
    if isinstance(state, Split):
        return LoopOutput("cat", state.dim, state.inner, shape, stride, dtype=value.dtype)
    if isinstance(state, Partial) and state.kind != "inplace":
        return LoopOutput(state.kind, shape=shape, stride=stride, dtype=value.dtype)
    return LoopOutput("first", shape=shape, stride=stride, dtype=value.dtype)


_SCATTER_ADDS = {"index_add_", "index_put_", "_index_put_impl_", "scatter_add_", "grouped_addmm_"}


def _accumulation(output: torch.fx.Node, nodes: Sequence[torch.fx.Node], outputs: Sequence[torch.fx.Node]):
    """``output`` is views of a zero tensor made in the body and scatter-added into in place: return the
    zero tensor's node and the view ops from it to ``output`` (None otherwise)."""
    members = set(nodes)
    chain = []
    node = output
    while packet_name(node) in ALIAS_OPS and node in members:
        chain.append(node)
        node = node.args[0]
    if packet_name(node) not in _SCATTER_ADDS or node not in members:
        return None
    zero = node.args[0]
    if zero not in members or packet_name(zero) not in ("zeros", "new_zeros", "zeros_like"):
        return None
    if set(zero.users) != {node} or any(u in members and u not in chain for u in node.users):
        return None
    if any(n in outputs and n is not output for n in [node, *chain]):
        return None
    steps = tuple((n.target, tuple(n.args[1:]), dict(n.kwargs)) for n in reversed(chain))
    return zero, steps, node


# the alias ops that make one view of one tensor from their first argument alone
_VIEW_STEPS = ALIAS_OPS - {"unbind", "split", "split_with_sizes", "chunk", "unfold", "view_as", "lift_fresh"}


def _view_chain(node: torch.fx.Node, members: Container[torch.fx.Node]) -> tuple[torch.fx.Node, tuple]:
    """The value ``node`` is a chain of single-tensor views of, inside ``members``, and the view ops
    from it to ``node`` (``(target, args after the first, kwargs)`` each, first op first; empty when
    ``node`` is no view). A view op whose other arguments are nodes ends the chain."""
    chain = []
    while (node in members and packet_name(node) in _VIEW_STEPS and isinstance(node.args[0], torch.fx.Node)
           and node.args[0] in members
           and not any(isinstance(a, torch.fx.Node) for a in pytree.tree_leaves((node.args[1:], node.kwargs)))):
        chain.append((node.target, tuple(node.args[1:]), dict(node.kwargs)))
        node = node.args[0]
    return node, tuple(reversed(chain))


def _strip_aliases(node: torch.fx.Node) -> torch.fx.Node:
    while node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        node = node.args[0]
    return node


def _make_loops(
    region: ChunkRegion,
    sizes: Sequence[int],
    nodes: Sequence[torch.fx.Node],
    inputs: Sequence[tuple[torch.fx.Node, State]],
    outputs: Sequence[torch.fx.Node],
    states: Mapping[torch.fx.Node, State],
    mode,
    compile: bool,
    inner: Mapping[int, "ChunkPlan"] | None = None,
    narrow: Mapping[torch.fx.Node, torch.dtype] | None = None,
) -> tuple[dict[int, ChunkLoop], list[LoopOutput], Callable[[str, int | None], bool], int]:
    """Loop modules running ``nodes`` chunk by chunk, one per chunk size in ``sizes``; a body of a
    length in ``inner`` is chunked again by that plan. Also returns ``scales(name, index)``: whether a
    body value (item ``index`` of body node ``name``) carries the index (see :class:`BodyModel`)."""
    narrow = narrow or {}
    body_outputs: list[tuple[torch.fx.Node, int | None]] = [(o, None) for o in outputs]
    specs = [_output_spec(o, states.get(o, REP)) for o in outputs]
    specs = [dataclasses.replace(s, dtype=narrow[o]) if o in narrow else s for s, o in zip(specs, outputs)]
    input_index = {node: i for i, (node, _) in enumerate(inputs)}
    for i, o in enumerate(outputs):
        if states.get(o) == Partial("inplace") and o.args[0] in input_index:
            specs[i] = dataclasses.replace(specs[i], alias_of=input_index[o.args[0]])
    for i, out in enumerate(list(outputs)):
        if specs[i].kind == "nll_mean":
            parent = out.args[0]
            body_outputs.append((parent, 1))
            tw = parent.meta["val"][1]
            specs.append(LoopOutput("sum", shape=tuple(tw.shape), stride=tuple(tw.stride()), public=False, dtype=tw.dtype))
            specs[i] = dataclasses.replace(specs[i], partner=len(specs) - 1)
    # outputs that are the same value (through detach, or an NLL weight that is also public) combine once
    first: dict[tuple[torch.fx.Node, int | None], int] = {}
    for i, (node, index) in enumerate(body_outputs):
        key = (_strip_aliases(node), index)
        if index is None and node.target is operator.getitem:
            key = (_strip_aliases(node.args[0]), node.args[1])
        if key in first:
            specs[i] = dataclasses.replace(specs[i], same_as=first[key])
        else:
            first[key] = i
    accumulators = []
    for i, (node, index) in enumerate(body_outputs):
        if index is None and specs[i].same_as < 0 and states.get(node) == Partial("sum"):
            found = _accumulation(node, nodes, [o for o, _ in body_outputs])
            if found is not None:
                zero, steps, scatter = found
                value = zero.meta["val"]
                specs[i] = dataclasses.replace(specs[i], kind="inplace", steps=steps, acc_shape=tuple(value.shape), dtype=value.dtype)
                accumulators.append(zero)
                body_outputs[i] = (scatter, None)  # the loop views the accumulator itself, once, at the end
    # a concatenated output that the body scatter-adds into a chunk-sized zero tensor: the loop passes
    # the chunk's slice of the result instead (see LoopOutput.into)
    slots = []
    for i, (node, index) in enumerate(body_outputs):
        if index is not None or specs[i].kind != "cat" or specs[i].same_as >= 0:
            continue
        found = _accumulation(node, nodes, [o for o, _ in body_outputs])
        zero_state = states.get(found[0]) if found is not None else None
        if not (isinstance(zero_state, Split) and zero_state.dim == 0):
            continue
        zero, _, scatter = found
        value, spec = zero.meta["val"], specs[i]
        # the output is the zero tensor reshaped (a contiguous view of all of a contiguous tensor keeps
        # its row-major order), with the same units along the dimensions each is split on
        out_value = node.meta["val"]
        if not (value.is_contiguous() and out_value.is_contiguous() and out_value.storage_offset() == 0):
            continue
        if value.numel() != out_value.numel() or value.shape[0] * spec.inner != spec.shape[spec.dim] * zero_state.inner:
            continue
        specs[i] = dataclasses.replace(specs[i], into=zero_state.inner, acc_shape=tuple(value.shape))
        slots.append((zero, zero_state))
    # two concatenated outputs that are views of one body value (``c`` and ``c.t()``) would come out as
    # two results that do not share storage, where eager's are views of one tensor: a write into one
    # (``c.t()[1:].sub_(0.5)``) would miss the other. Counterexample: seed 3561 of the structural
    # fuzzer, every output 0.5 off in inference. Such a region is not built.
    members = set(nodes)
    cat_bases: dict[torch.fx.Node, int] = {}
    for i, (node, index) in enumerate(body_outputs):
        if index is None and specs[i].kind == "cat" and specs[i].same_as < 0 and specs[i].alias_of < 0:
            base, _steps = _view_chain(node, members)
            if base in cat_bases:
                raise ValueError(f"outputs {cat_bases[base]} and {i} of the loop are views of one value, which "
                                 "concatenated results would not share")
            cat_bases[base] = i
    # a folded output (not an accumulator) that is a view of a value the body folds too (``s.t()``
    # beside ``s``, or two views of ``s``): folding each on its own would add every chunk twice into
    # their one storage, and eager's views of one tensor are views of one tensor; the loop folds the
    # base once and hands out its views (the base as a hidden output when it is not returned itself)
    for i, (node, index) in enumerate(list(body_outputs)):
        if index is not None or specs[i].same_as >= 0 or not specs[i].combined:
            continue
        base, steps = _view_chain(node, members)
        if not steps or states.get(base) != states.get(node):
            continue
        j = first.get((base, None))
        if j is None:
            body_outputs.append((base, None))
            specs.append(dataclasses.replace(_output_spec(base, states[base]), public=False))
            j = first[(base, None)] = len(specs) - 1
        if specs[j].combined and specs[j].view_of < 0:
            specs[i] = dataclasses.replace(specs[i], view_of=j, steps=steps)
    # an input stored narrow by the forward loop is widened back, chunk by chunk, beside the body
    loop_inputs = tuple(
        LoopInput(s.dim, s.inner, node.meta["val"].dtype if node in narrow else None) if isinstance(s, Split) else LoopInput()
        for node, s in inputs
    )
    held = sum(nbytes(node) // region.units for node, s in inputs if node in narrow and isinstance(s, Split))
    built: dict[int, torch.fx.GraphModule] = {}
    loops = {}
    for size in sizes:
        chunks = -(-region.units // size)
        lengths = sorted({size, region.units - (chunks - 1) * size})
        for length in lengths:
            if length not in built:
                built[length] = build_body(nodes, inputs, body_outputs, states, length, mode, compile, accumulators, slots)
                if inner and length in inner:
                    built[length] = apply_chunk(body_graph(built[length]), inner[length], compile).gm
        bodies = {length: built[length] for length in lengths}
        analyses = {length: AnalysisManager(body_graph(b)) for length, b in bodies.items()}  # peak and results share
        peaks = {length: am.get(PeakSimulation).peak + held * length for length, am in analyses.items()}
        first = min(size, region.units)
        scratch = loop_scratch(peaks.__getitem__, region.units, size,
                               handed_over(bodies[first], specs, analyses[first].get(Tensors)))
        spec = LoopSpec(region.units, size, loop_inputs, tuple(specs), scratch)
        loops[size] = ChunkLoop(spec, bodies)
    body_states = {node.name: states.get(node, REP) for node in nodes}
    body_states.update({f"{node.name}_in": state for node, state in inputs})

    def scales(name: str, index: int | None) -> bool:
        state = body_states.get(original_name(name), REP)
        if isinstance(state, tuple):
            state = state[index] if index is not None and index < len(state) else REP
        return isinstance(state, Split)

    return loops, specs, scales, held


def _narrow_indices(nodes: Sequence[torch.fx.Node]) -> dict[torch.fx.Node, torch.dtype]:
    """The narrowest integer type for each of ``nodes`` that holds indices into a dimension of known
    size (the indices of ``max``/``min`` over a dimension, ``argmax``/``argmin``): saved for the
    backward, they take a quarter or an eighth of the memory."""
    found = {}
    for node in nodes:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
            continue
        op, item = (node.args[0], node.args[1]) if node.target is operator.getitem else (node, None)
        name = packet_name(op)
        if name in ("max", "min") and op.target._overloadname == "dim" and item == 1:
            size = shape_of(op.args[0])[arg_of(op, 1, "dim") % len(shape_of(op.args[0]))]
        elif name in ("argmax", "argmin") and arg_of(op, 1, "dim") is not None and item is None:
            size = shape_of(op.args[0])[arg_of(op, 1, "dim") % len(shape_of(op.args[0]))]
        else:
            continue
        found[node] = torch.uint8 if size <= 256 else torch.int16 if size <= 2**15 else torch.int32 if size <= 2**31 else torch.int64
    return {n: d for n, d in found.items() if d != torch.int64}


def _insert_loop(graph_state: dict, gm: torch.fx.GraphModule, loop: ChunkLoop, specs, args, phase: Phase, like: torch.fx.Node,
                 seq: int, mode) -> list[torch.fx.Node]:
    """Add ``loop`` as a submodule, a call_module node and one getitem per public output."""
    index = 0
    while hasattr(gm, f"memplan_chunk{index}"):
        index += 1
    target = f"memplan_chunk{index}"
    gm.add_submodule(target, loop)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        call = gm.graph.create_node("call_module", target, tuple(args), {}, name=f"chunk{index}_{phase.value}")
    device = like.meta["val"].device if isinstance(like.meta.get("val"), torch.Tensor) else torch.device("cpu")
    with mode:
        values = [
            args[s.alias_of].meta["val"] if s.alias_of >= 0 else torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device)
            for s in specs
        ]
        # a view the loop hands out of another output shares its storage, as at run time
        values = [replay_views(values[s.view_of], s.steps) if s.view_of >= 0 else v for v, s in zip(values, specs)]
        public = [v for v, s in zip(values, specs) if s.public]
        scratch = torch.empty(loop.spec.scratch, dtype=torch.uint8, device=device)
    call.meta["val"] = (*public, scratch)
    items = []
    for i in range(len(public)):
        with gm.graph.inserting_before(output):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta["val"] = public[i]
        items.append(item)
    for node in [call, *items]:
        graph_state["phases"][node.name] = phase
        graph_state["seq_nr"][node.name] = seq
        if like.name in graph_state["sources"]:
            graph_state["sources"][node.name] = graph_state["sources"][like.name]
    return [call, *items]


def apply_region(graph: CapturedGraph, region: ChunkRegion) -> CapturedGraph:
    """Stage 6 for one region: a new graph with the region replaced by a forward and a backward loop."""
    return _apply_region(graph, region, compile=True).graph


@dataclasses.dataclass
class _Applied:
    """A region applied at one chunk size: the new graph, ``loops_for(size)`` (the ``(loop node,
    module)`` pairs that run the region with another chunk size, built on demand from the input
    graph's nodes) and, per loop, ``scales(name, index)`` for :class:`BodyModel`."""

    graph: CapturedGraph
    loops_for: Callable[[int], list[tuple[torch.fx.Node, ChunkLoop]]]
    scales: list[Callable[[str, int | None], bool]]
    held: list[int]


def _apply_region(graph: CapturedGraph, region: ChunkRegion, compile: bool) -> _Applied:
    """:func:`apply_region`, with what candidate evaluation needs to price other chunk sizes."""
    src = {n.name: n for n in graph.gm.graph.nodes}  # bodies are built from the untouched input graph
    graph = copy_graph(graph, compile=False)
    gm = graph.gm
    mode = fake_mode_of(gm.graph)
    by_name = {n.name: n for n in gm.graph.nodes}
    original = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    forward = [by_name[n] for n, _ in region.forward]
    fset = set(forward)
    body = [by_name[n] for n, _ in region.backward]
    bset = set(body)
    state = {"phases": dict(graph.phases), "sources": dict(graph.sources), "seq_nr": dict(graph.seq_nr)}
    seq = next_seq_nr(graph)
    anchor = max(forward, key=lambda n: (nbytes(n), -original[n]))
    inner = {loop: {length: plan for kind, length, plan in region.inner if kind == loop} for loop in ("forward", "backward")}
    fstates = {src[n]: s for n, s in region.forward}
    sources = {src[n]: s for n, s in region.sources}

    # Step 6a: the forward loop.
    f_nodes = [src[n] for n, _ in region.forward]
    f_inputs = [(a, sources.get(a, REP)) for a in _external_inputs(f_nodes)]
    f_outputs = [src[n] for n in (*region.outputs, *region.saved)]
    narrow = _narrow_indices([src[n] for n in region.saved if n not in region.outputs])
    builders = [lambda sizes: _make_loops(region, sizes, f_nodes, f_inputs, f_outputs, fstates, mode, compile, inner["forward"], narrow)]
    loops, specs, f_scales, f_held = builders[0]([region.chunk])
    scales, held = [f_scales], [f_held]
    new_fwd = _insert_loop(state, gm, loops[region.chunk], specs, [by_name[a.name] for a, _ in f_inputs], Phase.FORWARD, anchor, seq, mode)
    calls = [new_fwd[0]]
    priority = dict(original)
    first = min(original[n] for n in forward)
    for i, node in enumerate(new_fwd):
        priority[node] = first - 0.5 + i * 1e-6
    materialised = {by_name[o.name]: item for o, item in zip(f_outputs, new_fwd[1:])}
    replaced = list(materialised.items())  # (node, the loop output that stands for it)
    for node, item in materialised.items():
        node.replace_all_uses_with(item, delete_user_cb=lambda u: u not in fset and u not in bset)

    # Step 6b: the backward loop (recomputed forward values first, then the backward body).
    new_bwd: list[torch.fx.Node] = []
    if body:
        b_nodes = [src[n] for n in region.recompute] + [src[n] for n, _ in region.backward]
        slices = {src[n]: s for n, s in region.backward_slices}
        b_inputs = []
        for a in _external_inputs(b_nodes):
            if a in slices:
                s = slices[a]
            elif a in fstates:
                s = fstates[a] if isinstance(fstates[a], Split) else REP
            else:
                s = sources.get(a, REP)
            b_inputs.append((a, s))
        states = {**{src[n]: fstates[src[n]] for n in region.recompute}, **{src[n]: s for n, s in region.backward}}
        b_outputs = [src[n] for n in region.backward_outputs]
        builders.append(lambda sizes: _make_loops(region, sizes, b_nodes, b_inputs, b_outputs, states, mode, compile, inner["backward"], narrow))
        bloops, bspecs, b_scales, b_held = builders[1]([region.chunk])
        scales.append(b_scales)
        held.append(b_held)
        twins = _remade_in_backward(gm.graph, by_name)
        args = [materialised.get(by_name[a.name], twins.get(a.name, by_name[a.name])) for a, _ in b_inputs]
        new_bwd = _insert_loop(state, gm, bloops[region.chunk], bspecs, args, Phase.BACKWARD, body[0], seq, mode)
        calls.append(new_bwd[0])
        bfirst = min(original[n] for n in body)
        for i, node in enumerate(new_bwd):
            priority[node] = bfirst - 0.5 + i * 1e-6
        for name, item in zip(region.backward_outputs, new_bwd[1:]):
            replaced.append((by_name[name], item))
            by_name[name].replace_all_uses_with(item, delete_user_cb=lambda u: u not in bset)

    # Step 6c: erase what the loops replaced, then restore a topological order; views of the loops'
    # outputs get fresh fake values (their old ones alias the replaced nodes' storages), and so does
    # every op downstream of a loop output laid out otherwise than the value it replaces.
    relaid = [item for node, item in replaced if not same_layouts(node.meta.get("val"), item.meta.get("val"))]
    for node in reversed(body):
        gm.graph.erase_node(node)
    for node in reversed(forward):
        if not node.users:
            gm.graph.erase_node(node)
    stable_toposort(gm.graph, priority)
    refresh_aliases(gm.graph, new_fwd + new_bwd, mode, relaid, root=gm)
    # Step 6d: a loop output that autograd's layout copy copies into a tensor of its very own layout
    # needs no copy.
    for item in new_fwd[1:] + new_bwd[1:]:
        _drop_layout_copy(gm.graph, item)
    if compile:
        finish_module(gm)
    live = {n.name for n in gm.graph.nodes}
    new = dataclasses.replace(
        graph,
        phases={k: v for k, v in state["phases"].items() if k in live},
        sources={k: v for k, v in state["sources"].items() if k in live},
        library_sources={k: v for k, v in graph.library_sources.items() if k in live},
        modules={k: v for k, v in graph.modules.items() if k in live},
        seq_nr={k: v for k, v in state["seq_nr"].items() if k in live},
    )
    cache: dict[int, list[tuple[torch.fx.Node, ChunkLoop]]] = {region.chunk: [(new_fwd[0], loops[region.chunk])]}
    if body:
        cache[region.chunk].append((new_bwd[0], bloops[region.chunk]))

    def loops_for(size: int) -> list[tuple[torch.fx.Node, ChunkLoop]]:
        if size not in cache:
            cache[size] = [(call, build([size])[0][size]) for call, build in zip(calls, builders)]
        return cache[size]

    return _Applied(new, loops_for, scales, held)


def _remade_in_backward(graph: torch.fx.Graph, by_name: Mapping[str, torch.fx.Node]) -> dict[str, torch.fx.Node]:
    """Forward value's name -> the backward node that makes the same value again, bit for bit (the noise
    of a dropout drawn again: ``rewrite`` (i)). The backward loop reads the twin where it recomputes from
    the forward value, so the forward's value dies with its forward readers. A twin laid out otherwise
    than the value (a stale mark) is not used."""
    twins = {}
    for node in graph.nodes:
        name = node.meta.get(REMAKES)
        value, twin = (by_name[name].meta.get("val") if name in by_name else None), node.meta.get("val")
        if isinstance(value, torch.Tensor) and same_layouts(value, twin):
            twins[name] = node
    return twins


def _drop_layout_copy(graph: torch.fx.Graph, item: torch.fx.Node) -> None:
    """Remove ``copy_(empty_strided(...), v)`` when ``v`` is a chain of views of the loop output
    ``item`` that already has the empty tensor's shape, strides and dtype, covers its whole storage,
    and nothing else reads the chain: ``v`` itself is the copy. (Capture copies a gradient whose
    strides differ from its leaf's into the leaf's layout; a loop may produce it in that layout.)

    Counterexample it refuses: the gradient ``g.t()`` of a leaf of ``g``'s transposed layout, or a
    loop output also read by another node (the copy would then alias it)."""
    node = item
    while True:
        users = list(node.users)
        if len(users) == 1 and packet_name(users[0]) in ALIAS_OPS and users[0].args[0] is node:
            node = users[0]
            continue
        copies = [u for u in users if packet_name(u) == "copy_" and u.args[1] is node]
        if len(copies) != 1 or len(copies[0].args) > 2 and copies[0].args[2]:
            return
        user = copies[0]
        target = user.args[0]
        if packet_name(target) not in ("new_empty_strided", "empty_strided") or len(target.users) != 1:
            return
        if any(u is not user and u is not target for u in users):
            return  # (``new_empty_strided`` reads its ``self`` for dtype and device only)
        src, dst = node.meta.get("val"), target.meta.get("val")
        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
            return
        same = (src.shape, src.stride(), src.dtype, src.device) == (dst.shape, dst.stride(), dst.dtype, dst.device)
        whole = src.storage_offset() == 0 and src.untyped_storage().nbytes() == dst.untyped_storage().nbytes()
        if same and whole:
            user.replace_all_uses_with(node)
            graph.erase_node(user)
            graph.erase_node(target)
        return


def apply_chunk(graph: CapturedGraph, plan: ChunkPlan, compile: bool = True) -> CapturedGraph:
    """Apply every region of ``plan`` in order (a new graph; ``graph`` is not modified)."""
    for region in plan.regions:
        graph = _apply_region(graph, region, compile).graph
    return graph


# ----------------------------------------------------------------------------------------------
# planning


@dataclasses.dataclass(frozen=True)
class ChunkOptions:
    """Options of the chunk pass, read from ``ctx.options`` (keys prefixed ``"chunk."``).

    Attributes
    ----------
    counts : tuple of int
        Chunk counts tried for each region (a candidate per count). More chunks: lower peak, more
        per-chunk overhead.
    seed_nodes : int
        How many of the largest forward tensors seed the search for an independent dimension.
    seed_fraction : float
        Seed only tensors at least this fraction of the largest one.
    shallow_fraction : float
        Each seed also gives a region that starts where its index passes through a value at most
        this fraction of the seed's size (kept whole and sliced per chunk), rather than where the
        index enters the graph.
    regions : int
        How many regions one run of the pass may chunk (greedily, one after another).
    evaluate : int
        How many candidate regions (ranked by the bytes they could free) are evaluated in full, at
        least; small graphs evaluate more, up to ``evaluate_nodes`` graph nodes in all (evaluating
        is building the transformed graph, which costs time in proportion to its size).
    evaluate_nodes : int
        The budget of graph nodes built for evaluation per region search.
    save_fraction : float
        A forward value at most this fraction of the region's largest tensor may be saved for the
        backward instead of recomputed (one candidate variant).
    min_gain : float
        A region is chunked only if it lowers the predicted peak by at least this fraction: a loop
        has a cost in time and code size that a few percent of memory does not repay.
    nest : bool
        When a region's index is used up (chunks of one unit), also try chunking its loop bodies
        along a second independent index (e.g. the tokens of each sequence).
    nest_fraction : float
        Try that only for a loop whose chunk needs at least this fraction of the peak (otherwise
        chunking its body cannot lower the peak much).
    rates : CostRates
        The time model's rates behind the overhead estimate, priced for ``rates.threads`` intra-op
        threads; in a pipeline, the pipeline's unless ``"chunk.rates"`` is given (see
        :func:`memplan.analysis.cost.rates_for`).
    """

    counts: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
    seed_nodes: int = 6
    seed_fraction: float = 0.25
    shallow_fraction: float = 0.125
    regions: int = 3
    evaluate: int = 3
    evaluate_nodes: int = 3000
    save_fraction: float = 0.125
    min_gain: float = 0.05
    nest: bool = True
    nest_fraction: float = 0.25
    rates: CostRates = REFERENCE_RATES

    @classmethod
    def from_options(cls, options: Mapping[str, Any], rates: CostRates = REFERENCE_RATES) -> "ChunkOptions":
        """The options ``options`` sets, priced with ``rates`` unless ``"chunk.rates"`` is among them."""
        chosen = pass_options(cls, "chunk", options)
        return dataclasses.replace(chosen, rates=(chosen.rates if "chunk.rates" in options else rates).resolved())


_TRIAL_STEPS = 4  # rule evaluations in one trial of _inverse: each may ask one more operand sliced


def _inverse(node: torch.fx.Node, state: Split) -> list[tuple[torch.fx.Node, Split]]:
    """Inputs of ``node`` that carry the index when its output carries it as ``state`` (by testing the
    forward rule), empty when the op creates or mixes it."""
    index = None
    op = node
    if node.target is operator.getitem:
        op, index = node.args[0], node.args[1]
        if not isinstance(op, torch.fx.Node) or op.op != "call_function":
            return []
    units = shape_of(node)[state.dim] // state.inner
    tensors = list(dict.fromkeys(a for a in op.all_input_nodes if is_tensor(a)))
    # A list op (cat, stack) asks, one at a time, for every other operand full-sized on the index to
    # be sliced too; a trial succeeds only if its last rule evaluation asks for nothing more, so with
    # _TRIAL_STEPS or more such operands besides p none can. Counting them first keeps a stack of a
    # thousand steps linear instead of quadratic.
    full_sized: dict[int, int] = {}
    if packet_name(op) in ("cat", "stack"):
        for a in tensors:
            for e, size in enumerate(shape_of(a)):
                if size != 1:
                    full_sized[e] = full_sized.get(e, 0) + 1
    for p in tensors:
        shape = shape_of(p)
        options: list[Split] = []
        if packet_name(op) in VIEW_OPS:
            mapped = map_view(shape_of(op), shape, state)
            options = [mapped] if mapped is not None else []
        else:
            options = [Split(e, state.inner) for e, size in enumerate(shape) if size == units * state.inner]
        for option in options:
            if full_sized.get(option.dim, 0) - 1 >= _TRIAL_STEPS:
                continue  # p itself is full-sized on option.dim: the others need more than the trial resolves
            trial: dict[torch.fx.Node, State] = {p: option}
            for _ in range(_TRIAL_STEPS):
                result = chunk_rule(op, trial.get, _is_zero_factory)
                if isinstance(result, Need) and result.node not in trial:
                    trial[result.node] = result.state
                    continue
                break
            if isinstance(result, tuple) and index is not None:
                result = result[index]
            if result == state:
                return [(n, s) for n, s in trial.items() if isinstance(s, Split)]
    return []


def _sources(graph: CapturedGraph, node: torch.fx.Node, state: Split,
             small: int | None = None) -> dict[str, Split] | None:
    """Walk the index back from ``node`` to where it enters the graph or is created (stage 1).

    ``small``: also stop at a value of at most this many bytes. The walk back from a large value can
    run through the whole model (every op of a transformer keeps its batch independent), and the
    region flooded from there is the whole model; stopped where the index passes through a value
    small enough to keep whole (not a view: the walk goes on to its base, which costs no more to
    slice), it gives the region that makes the large value and nothing before it (the hidden states
    a vocabulary projection reads, sliced per chunk).
    """
    found: dict[torch.fx.Node, Split] = {}
    seen: set[tuple[str, Split]] = set()
    stack = [(node, state)]
    while stack:
        n, s = stack.pop()
        if (n.name, s) in seen:
            continue
        seen.add((n.name, s))
        carriers = []
        if n.op == "call_function" and graph.phases.get(n.name) is Phase.FORWARD and not is_random(n) \
                and (small is None or n is node or not is_tensor(n) or nbytes(n) > small or is_pure_view(n)):
            carriers = _inverse(n, s)
        if not carriers:
            if found.get(n, s) != s:
                return None
            found[n] = s
            continue
        stack.extend(carriers)
    return {n.name: s for n, s in found.items()}


def _seed_sets(graph: CapturedGraph, options: ChunkOptions) -> list[tuple[str, dict[str, Split]]]:
    forward = [n for n in graph.gm.graph.nodes if n.op == "call_function" and graph.phases.get(n.name) is Phase.FORWARD]
    sized = sorted((n for n in forward if is_tensor(n)), key=lambda n: (-nbytes(n), n.name))
    seeds: dict[frozenset, tuple[str, dict[str, Split]]] = {}
    if sized:
        largest = nbytes(sized[0])
        for node in sized[: options.seed_nodes]:
            if nbytes(node) < options.seed_fraction * largest:
                break
            for d, size in enumerate(shape_of(node)):
                if size < 2:
                    continue
                for label, small in ((f"dim {d} of {node.name}", None),
                                     (f"dim {d} of {node.name} from small values", int(options.shallow_fraction * nbytes(node)))):
                    found = _sources(graph, node, Split(d), small)
                    if found:
                        seeds.setdefault(frozenset(found.items()), (label, found))
    for spec in graph.inputs:
        if spec.kind != "input":
            continue
        node = graph.node(spec.node)
        for d, size in enumerate(shape_of(node)):
            if size >= 2:
                found = {node.name: Split(d)}
                seeds.setdefault(frozenset(found.items()), (f"dim {d} of {spec.path}", found))
    return list(seeds.values())


def _potential(graph: CapturedGraph, region: ChunkRegion, tensors: Tensors) -> int:
    """Bytes the region could stop holding at once: its largest value the loops do not materialise,
    less the largest sliced input that still has to be materialised in full (not a view of an input)."""
    node_of = graph.node  # the graph's name table
    keep = set(region.outputs) | {n for n, _ in region.sources}
    handed_on = set(region.backward_outputs)
    inside = [n for n, _ in region.forward if n not in keep] + [n for n, _ in region.backward if n not in handed_on]
    freed = max((nbytes(node_of(n)) for n in inside), default=0)
    held = 0
    for name, _ in list(region.sources) + list(region.backward_slices):
        if any(not tensors.storages[sid].external for sid in tensors.storages_of(name)):
            held = max(held, nbytes(node_of(name)))
    return freed - held


def _peak_bound(graph: CapturedGraph, region: ChunkRegion, memory: MemoryModel) -> int:
    """A lower bound on the peak of ``graph`` with ``region`` chunked, from the graph's own analyses
    (nothing is built): the loops' scratch counts as zero.

    The chunked graph keeps the nodes outside the region in their order. The region's values that no
    loop materialises disappear; a loop's output is born when its loop runs, at the latest where it is
    first read; a value the region reads is read at its loop, at the earliest where the region's first
    forward node (forward loop) or first backward node (backward loop, which also runs the recomputed
    forward nodes) ran. Earliest reads and latest births keep it a lower bound.

    Regions whose bound is no better than the policy's threshold are not built. Example of one: chunking
    a recurrence along its batch makes the backward loop read every step's input, which the untouched
    backward had dropped step by step; the bound is above the untouched peak.

    The bound is ``memory``'s (the graph's memory model) timeline with the storages the region makes
    or reads given their new intervals (:meth:`~memplan.analysis.memory_model.MemoryModel.with_intervals`): under graph
    lifetimes a storage that no node of the region touches keeps its interval. Under eager lifetimes
    every storage is given its interval again.
    """
    tensors, liveness = memory.tensors, memory.liveness
    position = liveness.position
    forward = [n for n, _ in region.forward]
    body = [n for n, _ in region.backward]
    f_at = min(position[n] for n in forward)
    b_at = min((position[n] for n in body), default=f_at)
    kept = set(region.outputs) | set(region.saved) | set(region.backward_outputs)
    in_forward, in_body, recomputed = set(forward), set(body), set(region.recompute)
    node_of = graph.node  # the graph's name table

    def read_at(user: str) -> list[int]:
        if user in in_body:
            return [b_at]
        if user in in_forward:
            return [f_at, b_at] if user in recomputed else [f_at]
        return [position[user]] if user in position else []

    members = in_forward | in_body

    def first_read(outputs: set[str], loop: set[str]) -> int | None:
        # the first read of any output of a loop by a node after that loop (outside the region, or
        # the backward loop reading the forward one's): the loop runs, and makes them all, before it
        reads = []
        for member in outputs:
            for user in node_of(member).users:
                if user.name not in loop:
                    reads.extend(read_at(user.name))
        return min(reads, default=None)

    forward_first = first_read(kept & in_forward, in_forward)
    body_first = first_read(kept & in_body, members)
    added: list[tuple[int, int, int]] = []

    def hold(start: int, end: int, size: int, readers: list[str]) -> None:
        if end < liveness.end:
            end = max([start] + [at for reader in readers for at in read_at(reader)])
        added.append((start, end, size))

    if graph.lifetimes == "graph":
        # storages of the region's values and of what it reads; every other storage is neither made
        # nor read by the region, and its interval (its readers' positions) stays as it is
        read = {a.name for name in members for a in node_of(name).all_input_nodes}
        affected = {sid for name in members | read for sid in tensors.storages_of(name)}
    else:
        affected = set(tensors.storages)
    affected = {sid for sid in affected if not tensors.storages[sid].external}
    for sid in affected:
        storage = tensors.storages[sid]
        interval = liveness.intervals[sid]
        if storage.creator not in members:
            readers = [u.name for m in storage.members for u in node_of(m).users] + list(storage.members)
            hold(interval.start, interval.end, storage.nbytes, readers)
            continue
        # a region value: gone, unless a loop materialises it (a fresh tensor of the kept value's size)
        for member in storage.members:
            if member not in kept:
                continue
            readers = [u.name for u in node_of(member).users]
            reads = sorted(at for reader in readers for at in read_at(reader))
            first = reads[0] if reads else interval.start
            loop_first = body_first if member in in_body else forward_first
            if loop_first is not None:
                first = loop_first  # the loop makes all its outputs at once, before any of them is read
            start = max(b_at, first) if member in in_body else first
            size = sum(info.nbytes for info in tensors.tensors[member] if info.storage == sid)
            hold(start, interval.end, size, readers)
    return memory.with_intervals(sorted(affected), added).peak


def _overhead_bound(graph: CapturedGraph, region: ChunkRegion, rates: CostRates, chunks: int) -> float:
    """A lower bound, in seconds, on the extra time of ``region`` run in at least ``chunks`` chunks
    (nothing is built), under the cost model.

    Every op of a loop body that computes runs once per chunk, so it pays ``chunks`` dispatches where
    the untouched graph paid one; the chunks together move at least the op's bytes, possibly from
    cache (the only saving chunking can bring, counted in full); views may be folded away; recomputed
    forward ops run once more on top, at cache speed on every thread; each chunk of each loop costs
    ``chunk_seconds``. More chunks only add dispatches, so
    the bound for the fewest chunks holds for every candidate of the region, nested ones included.
    """
    node_of = graph.node  # the graph's name table
    threads = rates.thread_count
    extra = chunks * rates.chunk_seconds * (2 if region.backward else 1)
    for name in [n for n, _ in region.forward] + [n for n, _ in region.backward]:
        work = op_work(node_of(name))
        if work.none:
            continue
        if work.view:
            extra -= rates.view_dispatch  # a body may fold views away (see build_body)
            continue
        extra += (chunks - 1) * rates.dispatch
        extra -= rates.fork * (threads - 1)  # the threads the original op started, a chunk may not
        traffic = work.fixed_bytes + work.scaled_bytes
        if traffic > rates.cache_bytes:
            extra -= traffic / rates.bandwidth - traffic / rates.cache_bandwidth
    for name in region.recompute:
        work = op_work(node_of(name))
        if work.none or work.view:
            continue
        traffic = work.fixed_bytes + work.scaled_bytes
        extra += chunks * rates.dispatch + (work.flops / rates.flops + traffic / rates.cache_bandwidth) / threads
    return extra


def _regions(graph: CapturedGraph, options: ChunkOptions, tensors: Tensors) -> list[ChunkRegion]:
    """Stages 1-4 for every seed set: the distinct regions, ranked by the bytes they could free."""
    found: dict[tuple, ChunkRegion] = {}
    search = _Search.of(graph)
    for label, seeds in _seed_sets(graph, options):
        region = _analyse(graph, seeds, label, search)
        if region is None:
            continue
        key = (region.units, tuple(n for n, _ in region.forward), tuple(n for n, _ in region.backward))
        found.setdefault(key, region)
    ranked = sorted(found.values(), key=lambda r: (-_potential(graph, r, tensors), r.label))
    size = sum(1 for _ in graph.gm.graph.nodes)
    return _distinct(ranked)[: max(options.evaluate, min(3 * options.evaluate, options.evaluate_nodes // max(size, 1)))]


def _distinct(ranked: Sequence[ChunkRegion], alike: float = 0.95) -> list[ChunkRegion]:
    """``ranked`` without the regions nearly equal to one ranked before them: the same units and at least
    ``alike`` of the larger one's forward and backward nodes shared. Seeds one step apart in an unrolled
    loop (each step's state) give regions that differ by a step's few nodes; each would be built and
    priced in full to the same verdict, and taking the place of a region that differs."""
    kept: list[tuple[ChunkRegion, frozenset[str]]] = []
    for region in ranked:
        nodes = frozenset(n for n, _ in region.forward) | frozenset(n for n, _ in region.backward)
        if not any(other.units == region.units and len(nodes & members) >= alike * max(len(nodes), len(members))
                   for other, members in kept):
            kept.append((region, nodes))
    return [region for region, _ in kept]


def _variants(graph: CapturedGraph, region: ChunkRegion, options: ChunkOptions) -> list[tuple[ChunkRegion, list[int]]]:
    """The region (recomputing everything) and, when it helps, a variant saving small values; each
    with the chunk sizes to try."""
    bases = [region]
    saving = _with_saved(graph, region, options.save_fraction)
    if saving is not None:
        bases.append(saving)
    sizes = sorted({-(-region.units // k) for k in options.counts if k <= region.units}, reverse=True)
    return [(base, sizes) for base in bases] if sizes else []


def _placeable(graph: CapturedGraph, region: ChunkRegion, tensors: Tensors) -> bool:
    """Whether the region's loops can be placed at all: the graph, with the region's forward nodes
    made one node (the forward loop) and its backward nodes another (the backward loop, which also
    reads what its recomputed forward nodes read), has no cycle. A region that reads, through nodes
    outside it, a value it makes has one (a flood that went around an op without a chunk rule, such
    as attention, and met its output again); building it would fail only after the copy of the
    graph, the loops' bodies and their traces were made.

    The edges are the data edges and the order of each storage's in-place writes against its other
    touchers (the nodes aliasing it and their readers): a write comes after the touchers before it
    and before those after it, as in eager. Without them a loop could run at one place an op before
    a write outside it and an op after it. Counterexample: ``v = zeros_like(a); v[:, :k] = t;
    v.sum(-1)`` with ``zeros_like`` and ``sum`` in a loop and the write (a ``copy_`` into a slice,
    which the index cannot cross) outside: the loop summed the zeros, and the output was 0.

    A cycle through a loop runs between its first and its last member in graph order, so only the
    nodes there are walked.
    """
    node_of = graph.node
    group: dict[torch.fx.Node, Any] = {node_of(n): "forward" for n, _ in region.forward}
    group.update((node_of(n), "backward") for n, _ in region.backward)
    position = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
    first, last = min(position[n] for n in group), max(position[n] for n in group)
    import networkx as nx  # here: only regions about to be built are checked

    contracted = nx.DiGraph()
    for node in itertools.islice(graph.gm.graph.nodes, first, last + 1):
        source = group.get(node, node)
        for user in node.users:
            if position[user] <= last:
                target = group.get(user, user)
                if target is not source:
                    contracted.add_edge(source, target)
    recomputed = set(region.recompute)
    for name in region.recompute:
        for arg in node_of(name).all_input_nodes:
            if arg.name not in recomputed and position[arg] >= first and group.get(arg) != "backward":
                contracted.add_edge(group.get(arg, arg), "backward")
    for before, after in _write_order(graph, tensors, position, first, last):
        source, target = group.get(before, before), group.get(after, after)
        if source is not target:
            contracted.add_edge(source, target)
    return nx.is_directed_acyclic_graph(contracted)


def _write_order(graph: CapturedGraph, tensors: Tensors, position: Mapping[torch.fx.Node, int],
                 first: int, last: int) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """Per storage written in place between positions ``first`` and ``last``, the order eager keeps
    between its writes and its other touchers there (the nodes aliasing it, and their readers), as
    ``(before, after)`` edges: each toucher after the write before it and before the write after it,
    each write after the one before (linear in the touchers, where every pair would be quadratic in a
    loop's accumulations)."""
    written: dict[int, set[torch.fx.Node]] = {}
    for node in itertools.islice(graph.gm.graph.nodes, first, last + 1):
        if node.op == "call_function":
            for target in mutated_args(node):
                for sid in tensors.storages_of(target.name):
                    written.setdefault(sid, set()).add(node)
    node_of = graph.node
    for sid, writers in written.items():
        touchers = set(writers)
        for name in tensors.storages[sid].members:
            member = node_of(name)
            touchers.add(member)
            touchers.update(member.users)
        inside = sorted((n for n in touchers if n in position and first <= position[n] <= last), key=position.__getitem__)
        yield from _ordered_around_writes(inside, writers)


def _ordered_around_writes(touchers: list[torch.fx.Node],
                           writers: set[torch.fx.Node]) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """Edges tying each of ``touchers`` (in graph order) to the writes on either side of it:
    (toucher, next write), (previous write, toucher) and (write, next write)."""
    last_write = None
    pending: list[torch.fx.Node] = []  # touchers since the last write
    for node in touchers:
        if node in writers:
            for toucher in pending:
                yield toucher, node
            if last_write is not None:
                yield last_write, node
            last_write, pending = node, []
        else:
            if last_write is not None:
                yield last_write, node
            pending.append(node)


def _evaluate(graph: CapturedGraph, region: ChunkRegion, sizes: list[int], base_cost: float,
              options: ChunkOptions, policy, finals: dict | None = None,
              hazards: frozenset[tuple[str, str]] = frozenset()) -> list[Candidate]:
    """Build the variant once, then simulate the peak and estimate the extra compute for each chunk
    size, from few chunks to many; stop once the policy cannot want more chunks (the overhead is far
    beyond ``max_overhead``, or the peak fits the budget).

    Sizes differ only in the loops' bodies and scratch, so the graph's analyses are computed once and
    each size asks the graph's memory model for its peak with the loops' scratch at that size
    (:meth:`~memplan.analysis.memory_model.MemoryModel.with_sizes`).
    ``finals`` receives, per candidate plan, a function that finishes the graph built here for it
    (the chosen candidate is not built twice).
    A variant whose loops read a storage on the other side of an in-place write than its ops did (a
    hazard of :func:`~memplan.pipeline.mutation_hazards` that ``hazards``, the graph's own, lacks) is
    no candidate: a loop runs all of its ops at one place in the graph, and a write outside the region
    that fell between two of them cannot. Counterexample: autograd's ``copy_`` into a slice of a dense
    gradient, between the region's reads of that gradient.
    """
    finals = {} if finals is None else finals
    try:
        applied = _apply_region(graph, dataclasses.replace(region, chunk=sizes[0]), compile=False)
    except (RuntimeError, ValueError, TypeError, IndexError):
        # a body that does not trace at this size (the rules missed a constraint): not a candidate
        return []
    am = AnalysisManager(applied.graph)
    if mutation_hazards(applied.graph, am) - hazards:
        return []
    tensors, memory = am.get(Tensors), am.get(MemoryModel)
    built = applied.loops_for(sizes[0])
    scratch_ids = [tensors.storages_of(call.name)[-1] for call, _ in built]
    fixed_cost = module_cost(applied.graph.gm, options.rates) - sum(loop.cost(options.rates) for _, loop in built)
    models = [
        BodyModel.of(loop.bodies[str(sizes[0])], scales, sizes[0], held, loop.spec.outputs)
        for (_, loop), scales, held in zip(built, applied.scales, applied.held)
    ]
    candidates: list[Candidate] = []
    stopped = False
    for size in sizes:
        chunks = -(-region.units // size)
        last = region.units - (chunks - 1) * size
        scratch = [model.scratch(region.units, size) for model in models]
        peak = memory.with_sizes(dict(zip(scratch_ids, scratch))).peak
        cost = fixed_cost + sum(
            (chunks - 1) * model.cost(size, options.rates) + model.cost(last, options.rates) + chunks * options.rates.chunk_seconds
            for model in models
        )
        overhead = max(0.0, cost / base_cost - 1.0) if base_cost > 0 else 0.0
        variant = dataclasses.replace(region, chunk=size)
        label = f"{region.label}: {variant.chunks} chunks" + (f", {len(region.saved)} saved" if region.saved else "")
        candidates.append(Candidate(variant, peak, overhead, label))
        finals[variant] = lambda size=size: _finish_at(applied, size)
        # The overhead is not monotone in the chunk count (chunks that fit in cache run faster), so
        # only a hopeless overhead stops the ladder; under a budget the first fit stops it.
        hopeless = policy.budget is None and overhead > _hopeless(policy)
        if hopeless or policy.budget is not None and peak <= policy.budget:
            stopped = True
            break
    within = policy.budget is not None or (candidates and candidates[-1].overhead < policy.max_overhead)
    if options.nest and candidates and not stopped and within and not _compares_recomputed(graph, region):
        finest = candidates[-1]  # nesting only adds overhead: not when the finest is already over
        try:
            swap = applied.loops_for(finest.plan.chunk)
        except (RuntimeError, ValueError, TypeError, IndexError):
            return candidates
        nested = _nested_variant(swap, finest, options, policy, base_cost)
        if nested is not None:
            try:
                new = _apply_region(graph, nested, compile=False).graph
            except (RuntimeError, ValueError, TypeError, IndexError):
                return candidates
            nested_am = AnalysisManager(new)
            if mutation_hazards(new, nested_am) - hazards:
                return candidates
            peak = nested_am.get(PeakSimulation).peak
            overhead = max(0.0, graph_cost(new, options.rates) / base_cost - 1.0) if base_cost > 0 else 0.0
            candidates.append(Candidate(nested, peak, overhead, f"{region.label}: {nested.chunks} chunks, nested"))
            finals[nested] = lambda new=new: _finished(new)
    return candidates


_COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge"}


def _compares_recomputed(graph: CapturedGraph, region: ChunkRegion) -> bool:
    """Whether the region's backward compares values (``amax``'s backward finds the maxima by ``x ==
    amax``): the values it recomputes must then have the forward's very bits. A loop body recomputes
    its chunk as the forward loop computed it, op for op on slices of one shape; nested loops chunk
    the forward and the backward bodies independently, along other indices, and a matmul on other
    shapes rounds otherwise. Counterexample: ``bmm(a, b).amax(-1)`` nested along the columns in the
    forward and the rows in the backward: no element equalled its recomputed maximum, and the gradient
    was ``0 / 0``."""
    return any(packet_name(graph.node(name)) in _COMPARISONS for name, _ in region.backward)


def _hopeless(policy: Policy) -> float:
    """Overhead beyond which no policy without a budget takes a candidate, nor one with more chunks:
    twice the allowance plus 0.2 (margin for the cost model's error and for overhead that falls again
    when chunks start to fit in cache)."""
    return 2.0 * policy.max_overhead + 0.2


def _finish_at(applied: _Applied, size: int) -> CapturedGraph:
    """The graph ``applied`` built, with the loops of chunk size ``size`` behind its loop nodes, compiled."""
    gm = applied.graph.gm
    for node, loop in applied.loops_for(size):
        setattr(gm, node.target, loop)
        *public, scratch = node.meta["val"]
        with scratch.fake_mode:
            node.meta["val"] = (*public, torch.empty(loop.spec.scratch, dtype=torch.uint8, device=scratch.device))
    return _finished(applied.graph)


def _finished(graph: CapturedGraph) -> CapturedGraph:
    finish_module(graph.gm)
    return graph


def _units_in(body: torch.fx.GraphModule, region: ChunkRegion) -> int | None:
    """How many units of ``region``'s index ``body`` has (its sources' sizes), None when a source is
    missing."""
    by_name = {n.name: n for n in body.graph.nodes}
    units = {shape_of(by_name[name])[s.dim] // s.inner for name, s in region.sources if name in by_name}
    return units.pop() if len(units) == 1 and len(region.sources) == sum(1 for n, _ in region.sources if n in by_name) else None


def _nested_variant(swap, finest: Candidate, options: ChunkOptions, policy, base_cost: float) -> ChunkRegion | None:
    """When the index is used up (chunks of one unit), chunk the loop bodies along a second index.

    Only loops whose chunk (scratch) is a sizeable part of the peak are tried. A body is planned under
    what the outer candidate leaves of the policy: without a budget, the rest of the overhead
    allowance, shared by the loops tried and converted into the body's own terms (an extra fraction
    ``x`` of a loop costs ``x * loop cost`` seconds, which must fit in the rest of ``max_overhead *
    base_cost``); with a budget, the budget less what the rest of the graph holds. The plan is made on
    the full-length body and reused for the shorter last chunk's body when it chunks another index
    than the outer one (that index has the same size in both); otherwise the short body gets its own
    plan. The nested candidate is then priced whole, so the policy still has the last word."""
    region = finest.plan
    inner_options = dataclasses.replace(options, nest=False, regions=1)
    tried = [(kind, loop) for kind, (_node, loop) in zip(("forward", "backward"), swap)
             if loop.spec.scratch >= options.nest_fraction * finest.peak]
    plans = []
    for kind, loop in tried:
        if policy.budget is None:
            if finest.overhead >= policy.max_overhead:
                continue
            rest = (policy.max_overhead - finest.overhead) * base_cost / len(tried)
            inner_policy = Policy(max_overhead=rest / max(loop.cost(options.rates), 1e-12))
        else:
            inner_policy = Policy(budget=max(1, policy.budget - (finest.peak - loop.spec.scratch)), max_overhead=policy.max_overhead)
        plan, _ = _plan(body_graph(loop.bodies[str(region.chunk)]), inner_policy, inner_options)
        if not plan.regions:
            continue
        plans.append((kind, region.chunk, plan))
        for length in loop.bodies:
            if int(length) == region.chunk:
                continue
            # the shorter last chunk: the same plan when it chunks another index, else its own
            if all(r.units == _units_in(loop.bodies[length], r) for r in plan.regions):
                plans.append((kind, int(length), plan))
            else:
                short, _ = _plan(body_graph(loop.bodies[length]), inner_policy, inner_options)
                if short.regions:
                    plans.append((kind, int(length), short))
    return dataclasses.replace(region, inner=tuple(plans)) if plans else None


def plan_chunk(graph: CapturedGraph, policy, options: Mapping[str, Any] | None = None) -> ChunkPlan:
    """Stages 1-5: choose regions and chunk sizes under ``policy`` (pure: ``graph`` is not modified).

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> from memplan.policy import Policy
    >>> x, y = torch.randn(64, 16), torch.randn(48, 16)
    >>> g = capture(lambda a, b: (a[:, None, :] - b[None, :, :]).abs().sum(-1).amin(-1), x, y, train=False)
    >>> plan = plan_chunk(dataclasses.replace(g, lifetimes="graph"), Policy(max_overhead=10.0))
    >>> plan.regions[0].units, plan.regions[0].chunks > 1  # the 64 rows of a, concatenated
    (64, True)
    """
    return _plan(graph, policy, options)[0]


def _plan(
    graph: CapturedGraph, policy, options: Mapping[str, Any] | None, am: AnalysisManager | None = None
) -> tuple[ChunkPlan, CapturedGraph]:
    """:func:`plan_chunk` that also returns the graph with the plan applied (built while planning);
    ``am`` holds analyses of ``graph`` already computed."""
    opts = options if isinstance(options, ChunkOptions) else ChunkOptions.from_options(options or {})
    chosen: list[ChunkRegion] = []
    current = graph
    am = am if am is not None else AnalysisManager(graph)
    # Overheads are against the graph the pass was given, so the regions of later rounds share one
    # max_overhead with the earlier ones instead of each taking it again on top of them.
    base_cost = None  # priced only when some region gets past the peak bound
    spent = 0.0  # the extra cost of the regions chosen so far, against base_cost
    for _ in range(opts.regions):
        base_peak = am.get(PeakSimulation).peak
        candidates: list[Candidate] = [Candidate(None, base_peak, spent, "unchunked")]
        finals: dict[ChunkRegion, Callable[[], CapturedGraph]] = {}
        over_budget = policy.budget is not None and base_peak > policy.budget
        worth = base_peak if over_budget else (1.0 - opts.min_gain) * base_peak
        tensors, memory = am.get(Tensors), am.get(MemoryModel)
        hazards = None  # the graph's own in-place hazards, found once a variant is built
        # Steps 1-4 find the regions; step 5 prices the candidates of those that can pay (a peak
        # below the policy's threshold, an overhead not hopeless), building each variant once.
        for region in _regions(current, opts, tensors):
            if _peak_bound(current, region, memory) >= worth:
                continue
            if base_cost is None:
                base_cost = graph_cost(current, opts.rates)
            for variant, sizes in _variants(current, region, opts):
                fewest = -(-region.units // sizes[0])
                # Never taken: without a budget, over max_overhead; with one, dearer than a candidate that
                # already fits it (the policy takes the least overhead that fits). Not built.
                allowed = (policy.max_overhead if policy.budget is None else
                           min((c.overhead for c in candidates if c.peak <= policy.budget), default=math.inf))
                if _overhead_bound(current, variant, opts.rates, fewest) > (allowed - spent) * base_cost:
                    continue
                if not _placeable(current, variant, tensors):
                    continue
                # a variant whose body does not trace is dropped: torch's log of the failing op is noise
                if hazards is None:
                    hazards = mutation_hazards(current, am)
                with quiet_meta_failures():
                    candidates.extend(_evaluate(current, variant, sizes, base_cost, opts, policy, finals, hazards))
        try:
            best = policy.choose(candidates)
        except InfeasibleBudgetError:
            best = min(candidates, key=lambda c: (c.peak, c.overhead, c.label))
        best = _latest_of_equals(candidates, best, memory.liveness.position)
        if best.plan is None or (best.peak > (1.0 - opts.min_gain) * base_peak and not over_budget):
            break
        chosen.append(best.plan)
        current = finals[best.plan]() if best.plan in finals else apply_region(current, best.plan)
        am = AnalysisManager(current)
        spent = best.overhead
    return ChunkPlan(tuple(chosen)), current


def _latest_of_equals(candidates: Sequence[Candidate], best: Candidate, position: Mapping[str, int],
                      rounding: float = 1e-9) -> Candidate:
    """Among the candidates equal to ``best`` (the same peak and chunk count, overheads equal up to
    float ``rounding``), the one whose region's forward ends latest in the graph (``position``: the
    graph's order, as its liveness numbers it).

    Equal candidates come from repeated layers (the MLP of each block of a transformer): the policy
    cannot tell them apart, and the tie would go to whichever label sorts first or to float noise in
    the cost sums. In a training step the backward meets the regions in reverse, starting when the
    most is held; a later region's chunked backward runs earlier, where the working set it frees is
    added to more. (The transformer LM of ``benchmarks/``: with its last two blocks' MLPs chunked,
    the plan after remat peaks at 55.23 MiB; with the third's and the first's, which label order and
    rounding chose, at 64.22 MiB.)"""
    if best.plan is None:
        return best
    equal = [c for c in candidates if c.plan is not None and c.peak == best.peak and c.plan.chunks == best.plan.chunks
             and abs(c.overhead - best.overhead) <= rounding * max(1.0, abs(best.overhead))]
    if len(equal) < 2:
        return best
    return max(equal, key=lambda c: (max((position[n] for n, _ in c.plan.forward), default=-1), c.label))


@register_pass("chunk", options=ChunkOptions.from_options)
def chunk(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Run regions whose huge intermediates are reduced or sliced away in chunks (see the module docstring)."""
    options = ChunkOptions.from_options(ctx.options, ctx.rates)
    plan, new = _plan(graph, ctx.policy, options, ctx.am)
    if not plan.regions:
        return PassResult(graph, changed=False, plan=plan)
    before = ctx.am.get(PeakSimulation).peak
    after = AnalysisManager(new).get(PeakSimulation).peak
    rates = options.rates
    base = graph_cost(graph, rates)
    overhead = max(0.0, graph_cost(new, rates) / base - 1.0) if base > 0 else 0.0
    nodes = sum(len(r.forward) + len(r.backward) for r in plan.regions)
    return PassResult(
        new,
        changed=True,
        stats=PassStats(nodes_rewritten=nodes, bytes_saved=max(0, before - after), recompute_added=overhead),
        notes=tuple(str(r) for r in plan.regions),
        plan=plan,
    )
