"""Rematerialisation: which forward tensors the backward keeps, and which it recomputes.

What it does
------------
In a captured training graph, whatever forward node a backward node reads is saved: it stays in memory
from the forward until its last backward reader. This pass copies chosen forward nodes into the backward
phase, each just before its first consumer, and points the backward readers at the copies; the emitted
forward then saves only what the copies read. Which nodes to recompute is a minimum cut of the forward
graph (AOTAutograd's construction, solved by :class:`CutNetwork`), swept over a price of compute and completed by
a knapsack over classes of expensive ops, so that the policy can pick the least recomputation that fits
a budget, or the lowest peak within ``max_overhead``.

Stages
------
(1) Facts (:class:`RematFacts`). Per forward node: whether it may be recomputed (soundness below), what
    recomputing it costs (FLOPs from shapes, :func:`node_flops`, which price the cuts below; and its
    predicted seconds by the time model, :mod:`memplan.analysis.cost`, which price a candidate's overhead
    for the policy) and what saving it costs (bytes of the storages its value keeps alive; nothing for
    inputs, parameters and storages an output keeps anyway).
    An *in-place unit* (a storage the forward creates and writes in place before anyone else reads it,
    such as ``nn.LSTMCell``'s gate buffer: ``addmm``, ``add_``, ``sigmoid_`` on slices) is one node.
(2) Stack reads (:func:`plan_stack_reads`). A tensor that the forward copies into a ``stack``/``cat``
    that stays alive anyway (a graph output, or read by the backward) is free to save: every backward
    reader, copies included, reads a slice of the stack instead. An unrolled RNN that appends its
    hidden states to ``outputs`` then saves no state at all.
(3) Cuts (:func:`min_cut`). Each forward node ``v`` becomes ``v_in -> v_out`` with capacity = the bytes
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
(4) Hoisting repair (:func:`hoisted`). A cut does not see *when* a copy lives: a copy that another copy
    needs early lives from then until its own reader (cut an RNN only at its first state and every step
    is recomputed at the start of the backward, which keeps as much as saving it all). For each cut,
    a variant saves every node whose copy would be placed more than ``remat.hoist_limits`` positions
    before its own first reader (scanning from the last forward node back) and cuts again.
(5) Candidates (:func:`plan_remat`). Each distinct recompute set is placed (:func:`plan_copies`) and
    simulated without building it (:class:`VirtualSimulation`, the model ``PeakSimulation`` and the
    ruler use, plus :func:`step_margin`, the step's own loss scalars): ``Candidate(plan, peak,
    overhead)`` with overhead = the copies' predicted seconds / the whole graph's (in-place units whole,
    :func:`copy_costs`). The untouched graph is a
    candidate. The set does not depend on the budget, so the chosen peak never rises when the budget
    falls (AOTAutograd's does: pytorch/pytorch#197838). Without a budget, candidates the policy can
    never take are not simulated: those over ``max_overhead``, and those whose floor (the saved values
    and the outputs, all alive when the backward starts: :meth:`VirtualSimulation.step_floor`) is above
    the lowest peak simulated so far, taking the lowest floors first (``remat.bound``).
(6) ``ctx.policy.choose`` picks among the Pareto-optimal candidates (a budget: least overhead that fits,
    else :class:`~memplan.errors.InfeasibleBudgetError` naming the smallest peak; none: lowest peak whose
    overhead is within ``max_overhead``), and :func:`apply_remat` applies it.

Apply (:func:`apply_recompute`, shared with the ``timesteps`` pass): a plan is a list of nested
:class:`RecomputeGroup`; a backward node reads a forward value through the deepest group that serves it
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
    running statistics twice (the running mean is a buffer: never a unit).
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
import heapq
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.analysis.cost import REFERENCE_RATES, CostRates, node_cost, submodule_cost
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory_model import MemoryModel, NewNode
from memplan.analysis.peak import PeakSimulation, step_margin
from memplan.analysis.tensors import Tensors, tensor_values
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import (
    GraphEditor,
    create_node,
    fake_value,
    is_random,
    mutated_args,
    packet_name,
    rebuilt_value,
    same_geometry,
)
from memplan.measure import format_bytes
from memplan.pipeline import PassContext, PassResult, PassStats, pass_options, register_pass
from memplan.policy import Candidate, Policy

__all__ = [
    "DEFAULT_BAN_OPS",
    "RematOptions",
    "NodeFacts",
    "RematFacts",
    "StackRead",
    "RecomputeGroup",
    "RematPlan",
    "copy_costs",
    "node_flops",
    "graph_flops",
    "module_flops",
    "VirtualSimulation",
    "step_margin",
    "plan_stack_reads",
    "apply_stack_reads",
    "retarget",
    "min_cut",
    "CutNetwork",
    "CopyPlan",
    "plan_copies",
    "backward_reads",
    "forward_inputs",
    "after_stack_reads",
    "hoisted",
    "pareto_front",
    "apply_recompute",
    "plan_remat",
    "apply_remat",
    "remat",
]

#: Ops too expensive to recompute in AOTAutograd's cut (its ``compute_intensive_ops``): matrix products,
#: convolutions and attention kernels. The priced cuts may still recompute them, at their FLOP cost.
DEFAULT_BAN_OPS: tuple[str, ...] = (
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation", "einsum",
    "convolution", "_convolution", "convolution_backward", "cudnn_convolution", "mkldnn_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward", "_scaled_mm", "upsample_bilinear2d",
)

#: Ops that produce a new tensor but cost no arithmetic worth counting (memory movement only).
_MOVE_OPS = frozenset({"clone", "contiguous", "_to_copy", "copy", "cat", "stack", "zeros", "ones", "full", "empty",
                       "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_empty",
                       "new_full", "scalar_tensor", "lift_fresh_copy", "_unsafe_view", "index_select",
                       "embedding", "gather", "constant_pad_nd"})


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

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "RematOptions":
        return pass_options(cls, "remat", options)


# ----------------------------------------------------------------------------------------------
# facts


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """What the planner knows about one forward node (or graph input)."""

    name: str
    position: int  # index in graph order
    recomputable: bool
    why_not: str | None  # why it cannot be recomputed
    expensive: bool  # its op is in ``ban_ops``
    signature: str  # op and input shapes, e.g. "mm(16x64,64x128)": repeated ops of a loop share it ("" unless expensive)
    flops: int
    save_bytes: int  # bytes kept alive by saving it (0: input, parameter, or kept by an output anyway)
    first_reader: int | None  # position of its first backward reader
    saveable: bool = True  # a single tensor (emit cannot save a list of tensors)
    view_of: str | None = None  # the one input whose storage this node only views (no FLOPs, no storage)
    unit: str | None = None  # first node of the in-place unit it belongs to (see ``RematFacts.units``)
    storages: tuple[int, ...] = ()  # the storages ``save_bytes`` counts
    seconds: float = 0.0  # predicted seconds of one run of it (the time model's, see memplan.analysis.cost)


@dataclasses.dataclass(frozen=True)
class RematFacts:
    """Facts about every forward node, the forward edges, and what the backward reads."""

    nodes: Mapping[str, NodeFacts]
    inputs: Mapping[str, tuple[str, ...]]  # forward node -> forward nodes / graph inputs it reads
    needed: tuple[str, ...]  # forward nodes and graph inputs that a backward node reads, graph order
    total_flops: int  # FLOPs of the whole graph, forward and backward
    forward_flops: int
    units: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # member -> its unit
    storage_bytes: Mapping[int, int] = dataclasses.field(default_factory=dict)  # storage id -> bytes
    total_seconds: float = 0.0  # predicted seconds of the whole graph run as a plan (graph_cost)

    @classmethod
    def compute(cls, graph: CapturedGraph, am: AnalysisManager,
                ban_ops: Iterable[str] = DEFAULT_BAN_OPS, rates: CostRates = REFERENCE_RATES) -> "RematFacts":
        """The facts of ``graph``; ``rates`` price each node's time (what recomputing it adds to the step)."""
        tensors = _StorageIndex(am.get(Tensors))
        ban = frozenset(ban_ops)
        nodes = list(graph.gm.graph.nodes)
        position = {n.name: i for i, n in enumerate(nodes)}
        written = _last_writes(graph, tensors)
        kept = _output_storages(graph, tensors)
        units = _inplace_units(graph, tensors, position, written)
        tangents = {s.node for s in graph.inputs if s.kind == "tangent"}
        facts: dict[str, NodeFacts] = {}
        inputs: dict[str, tuple[str, ...]] = {}
        needed: list[str] = []
        total = forward = 0
        rates = rates.resolved()
        total_seconds = 0.0
        for node in nodes:
            seconds = 0.0
            if node.op == "call_function":
                flops = node_flops(node, tensors)
                seconds = node_cost(node, rates)
                total += flops
                total_seconds += seconds
                if graph.phases.get(node.name) is not Phase.FORWARD:
                    continue
                forward += flops
            elif node.op == "call_module":
                # a loop (a chunk loop) is one node to this pass, but its FLOPs are the graph's too: left
                # out, the share of any recomputation would be priced against too small a whole. (The
                # forward FLOPs, which scale the cuts' prices, stay those of the nodes the cuts see.)
                total += module_flops(graph.gm.get_submodule(node.target))
                total_seconds += submodule_cost(graph.gm.get_submodule(node.target), rates)
                continue
            elif node.op not in ("placeholder", "get_attr") or node.name in tangents:
                continue
            else:
                flops = 0
            readers = [position[u.name] for u in node.users
                       if u.op == "call_function" and graph.phases.get(u.name) is Phase.BACKWARD]
            first_reader = min(readers) if readers else None
            if first_reader is not None:
                needed.append(node.name)
            unit = units.get(node.name)
            if unit is not None:
                own = frozenset(tensors.storages_of(unit[0]))  # its own writes are replayed with it
                why_not = _why_not_recomputable(node, position[node.name], tensors, written, in_unit=True,
                                                replayed=own)
            elif node.op == "call_function":
                why_not = _why_not_recomputable(node, position[node.name], tensors, written)
            else:
                why_not = "graph input"
            if why_not is None:
                # a forward node these facts do not describe (a chunk loop's call_module) can be neither
                # saved nor recomputed by this pass: a copy reading it would make the backward read it
                # as it is (a loop's tuple of outputs, which cannot be saved)
                unknown = next((a.name for a in node.all_input_nodes if a.name not in facts), None)
                if unknown is not None:
                    why_not = f"reads {unknown}, which remat neither saves nor recomputes"
            counted = _saved_storages(node, tensors, kept)
            parent = node.args[0] if node.target is operator.getitem else None
            if why_not is None and isinstance(parent, torch.fx.Node) and parent.name in facts \
                    and not facts[parent.name].recomputable:
                why_not = "part of a multi-output op that cannot be recomputed"
            expensive = packet_name(node) in ban
            facts[node.name] = NodeFacts(
                name=node.name,
                position=position[node.name],
                recomputable=why_not is None,
                why_not=why_not,
                expensive=expensive,
                signature=_signature(node) if expensive else "",
                flops=flops,
                seconds=seconds,
                save_bytes=sum(tensors.storages[sid].nbytes for sid in counted),
                storages=counted,
                saveable=node.op != "call_function" or isinstance(node.meta.get("val"), torch.Tensor),
                view_of=_view_of(node, tensors) if node.op == "call_function" else None,
                first_reader=first_reader,
                unit=unit[0] if unit is not None else None,
            )
            inputs[node.name] = tuple(a.name for a in node.all_input_nodes)
        # A unit is recomputed whole or not at all.
        for member, unit in units.items():
            if not all(facts[m].recomputable for m in unit):
                why = next(facts[m].why_not for m in unit if not facts[m].recomputable)
                facts[member] = dataclasses.replace(facts[member], recomputable=False, why_not=why)
        storage_bytes = {sid: tensors.storages[sid].nbytes for fact in facts.values() for sid in fact.storages}
        return cls(nodes=facts, inputs=inputs, needed=tuple(needed), total_flops=total, forward_flops=forward,
                   units=units, storage_bytes=storage_bytes, total_seconds=total_seconds)

    def saved_bytes(self) -> int:
        """Bytes the graph saves: the storages of needed nodes that cost to save, each counted once.

        Not the sum of the nodes' saving costs: the views of one storage (the steps' slices of noise drawn
        before a loop) would count it once per view, and the sum would grow with the square of the
        loop's length.
        """
        seen: set[int] = set()
        total = 0
        for name in self.needed:
            fact = self.nodes[name]
            if fact.save_bytes == 0:
                continue
            if not fact.storages:
                total += fact.save_bytes
                continue
            for sid in fact.storages:
                if sid not in seen:
                    seen.add(sid)
                    total += self.storage_bytes[sid]
        return total


class _StorageIndex:
    """A :class:`~memplan.analysis.tensors.Tensors` whose ``storages_of`` is a lookup: the facts ask for a
    node's storages once per reader, and a node with many outputs (``unbind`` of a 1000-step input, read
    by 1000 ``getitem`` nodes) would rebuild its tuple for each."""

    def __init__(self, tensors: Tensors):
        self.tensors = tensors.tensors
        self.storages = tensors.storages
        self._of = {name: tuple(info.storage for info in infos) for name, infos in tensors.tensors.items()}

    def storages_of(self, name: str) -> tuple[int, ...]:
        return self._of.get(name, ())


def _last_writes(graph: CapturedGraph, tensors: Tensors) -> dict[int, int]:
    """Storage id -> graph position of the last node that writes into it in place."""
    last: dict[int, int] = {}
    for i, node in enumerate(graph.gm.graph.nodes):
        if node.op == "call_function":
            for target in mutated_args(node):
                for sid in tensors.storages_of(target.name):
                    last[sid] = i
    return last


def _inplace_units(graph: CapturedGraph, tensors: Tensors, position: Mapping[str, int],
                   last_write: Mapping[int, int]) -> dict[str, tuple[str, ...]]:
    """In-place units: a storage the forward creates and then writes in place before anyone else reads it.

    Such a storage can be recomputed as a whole: replay its creator and its writers, in order, on a fresh
    storage (``nn.LSTMCell``'s gate buffer: ``addmm``, ``add_``, then ``sigmoid_``/``tanh_`` on slices).
    Conditions: every member (node aliasing it) is in the forward and aliases nothing else, the creator
    is a single tensor, and every forward node outside the unit that reads it does so after the last
    write (so the copies' final state is what every reader saw).
    """
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    units: dict[str, tuple[str, ...]] = {}
    for sid, storage in tensors.storages.items():
        if storage.external or sid not in last_write or graph.phases.get(storage.creator) is not Phase.FORWARD:
            continue
        members = storage.members
        if any(graph.phases.get(m) is not Phase.FORWARD for m in members if by_name[m].op == "call_function"
               and any(sid in tensors.storages_of(t.name) for t in mutated_args(by_name[m]))):
            continue  # a backward write
        members = tuple(m for m in members if graph.phases.get(m) is Phase.FORWARD)
        if not isinstance(by_name[members[0]].meta.get("val"), torch.Tensor):
            continue
        if any(set(tensors.storages_of(m)) != {sid} for m in members):
            continue
        if any(set(tensors.storages_of(t.name)) != {sid} for m in members for t in mutated_args(by_name[m])):
            continue
        writes = [position[m] for m in members if mutated_args(by_name[m])]
        if not writes:
            continue  # written by an op that returns another tensor (rrelu's noise): not replayable as a unit
        inside = set(members)
        last = max(writes)
        ok = True
        for member in members:
            for user in by_name[member].users:
                if user.name in inside or graph.phases.get(user.name) is not Phase.FORWARD:
                    continue
                if position[user.name] < last or not isinstance(by_name[member].meta.get("val"), torch.Tensor):
                    ok = False
        if ok:
            for member in members:
                units[member] = members
    return units


def _output_storages(graph: CapturedGraph, tensors: Tensors) -> frozenset[int]:
    output = next(n for n in reversed(graph.gm.graph.nodes) if n.op == "output")
    kept = set()
    for arg in output.all_input_nodes:
        kept.update(tensors.storages_of(arg.name))
    return frozenset(kept)


def _why_not_recomputable(node: torch.fx.Node, position: int, tensors: Tensors, last_write: Mapping[int, int],
                          in_unit: bool = False, replayed: frozenset[int] = frozenset()) -> str | None:
    if not (isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem):
        return "not an aten operator"
    if is_random(node):
        return "draws from the RNG"
    if mutated_args(node) and not in_unit:
        return "writes in place"
    if "val" not in node.meta:
        return "no fake value"
    touched = set(tensors.storages_of(node.name))
    for arg in node.all_input_nodes:
        touched.update(tensors.storages_of(arg.name))
    if any(last_write.get(sid, -1) > position for sid in touched if sid not in replayed):
        return "reads or is a storage that an op writes in place afterwards"
    return None


def _view_of(node: torch.fx.Node, tensors: Tensors) -> str | None:
    """The single input that ``node`` is a view of (it creates no storage and aliases only that input)."""
    args = node.all_input_nodes
    if len(args) != 1 or not _is_view(node, tensors):
        return None
    if set(tensors.storages_of(node.name)) <= set(tensors.storages_of(args[0].name)):
        return args[0].name
    return None


def _saved_storages(node: torch.fx.Node, tensors: Tensors, kept: frozenset[int]) -> tuple[int, ...]:
    """The storages that saving ``node`` keeps alive (not external, not kept by an output anyway)."""
    return tuple(sid for sid in sorted(set(tensors.storages_of(node.name)))
                 if not tensors.storages[sid].external and sid not in kept)


def _signature(node: torch.fx.Node) -> str:
    """``"mm(16x64,64x128)"``: the op and the shapes it reads."""
    shapes = []
    for arg in node.args:
        value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if isinstance(value, torch.Tensor):
            shapes.append("x".join(str(int(d)) for d in value.shape))
    return f"{packet_name(node) or node.op}({','.join(shapes)})"


def _numel(value: Any) -> int:
    return int(value.numel()) if isinstance(value, torch.Tensor) else 0


_FLOPS = "memplan_flops"  # node.meta key: (value, whether a view, FLOPs), see node_flops


def node_flops(node: torch.fx.Node, tensors: Tensors | None = None) -> int:
    """Estimated FLOPs of one node, from the shapes of its fake values.

    Matrix products count ``2*m*n*k`` (plus the bias), convolutions ``2 * output elements * input
    channels per group * kernel size``, attention ``4*b*h*l*s*e``; views and ``getitem`` count 0;
    memory movement (``clone``, ``cat``, factories) counts 0; every other op counts the elements it
    reads or writes, whichever is more (pointwise ops and reductions).

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> g = capture(lambda a, b: (a @ b).relu(), torch.randn(4, 8), torch.randn(8, 2), train=False)
    >>> [(n.name, node_flops(n)) for n in g.gm.graph.nodes if n.op == "call_function"]
    [('mm', 128), ('relu', 8)]
    """
    if node.op != "call_function" or node.target is operator.getitem:
        return 0
    view = tensors is not None and _is_view(node, tensors)
    # Asked of every node by each planning pass, and most nodes keep their fake value from one graph to
    # the next (copies share it): the count is kept with the value it was made from.
    meta = node.meta
    value = meta.get("val")
    cached = meta.get(_FLOPS)
    if cached is not None and cached[0] is value and cached[1] is view:
        return cached[2]
    flops = 0 if view else _node_flops(node)
    meta[_FLOPS] = (value, view, flops)
    return flops


def module_flops(module: torch.nn.Module) -> int:
    """FLOPs of one call of a module a graph calls: a loop's (a chunk loop's :meth:`flops`, every chunk's
    ops counted by :func:`node_flops`), 0 for a module that does not say."""
    flops = getattr(module, "flops", None)
    return int(flops(node_flops)) if callable(flops) else 0


def _node_flops(node: torch.fx.Node) -> int:
    name = packet_name(node)
    if name in _MOVE_OPS:
        return 0
    args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    out = node.meta.get("val")
    if name in ("mm", "matmul") and _shapes(args, 2):
        (m, k), (_, n) = args[0].shape[-2:], args[1].shape[-2:]
        return 2 * int(m) * int(k) * int(n) * max(1, _numel(out) // max(1, int(m) * int(n)))
    if name in ("addmm", "_addmm_activation") and _shapes(args[1:], 2):
        (m, k), (_, n) = args[1].shape, args[2].shape
        return 2 * int(m) * int(k) * int(n) + int(m) * int(n)
    if name in ("bmm", "baddbmm", "addbmm"):
        a, b = (args[1], args[2]) if name != "bmm" else (args[0], args[1])
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return 2 * _numel(a) * int(b.shape[-1])
    convolutions = ("convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution")
    if name in convolutions and isinstance(out, torch.Tensor):
        weight = args[1]
        if isinstance(weight, torch.Tensor):
            per_output = int(weight.shape[1]) * math.prod(int(s) for s in weight.shape[2:])
            return 2 * _numel(out) * per_output
    if name == "convolution_backward" and isinstance(args[2], torch.Tensor) and isinstance(args[0], torch.Tensor):
        weight = args[2]
        per_output = int(weight.shape[1]) * math.prod(int(s) for s in weight.shape[2:])
        return 4 * _numel(args[0]) * per_output
    if name.startswith("_scaled_dot_product") or name == "scaled_dot_product_attention":
        q, k = args[0], args[1]
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
            return 4 * _numel(q) * int(k.shape[-2])
    read = sum(_numel(a) for a in args if isinstance(a, torch.Tensor))
    written = sum(_numel(v) for _, v in tensor_values(node))
    return max(read, written)


def _shapes(args: Sequence[Any], rank: int) -> bool:
    return len(args) >= 2 and all(isinstance(a, torch.Tensor) and a.dim() >= rank for a in args[:2])


def _is_view(node: torch.fx.Node, tensors: Tensors) -> bool:
    """True when the node creates no storage: a view, an alias, or an in-place result."""
    infos = tensors.tensors.get(node.name, ())
    return bool(infos) and all(tensors.storages[i.storage].creator != node.name for i in infos)


def graph_flops(graph: CapturedGraph, am: AnalysisManager | None = None) -> int:
    """Estimated FLOPs of every op of ``graph`` (see :func:`node_flops`), the ops of its loops included
    (see :func:`module_flops`)."""
    tensors = (am or AnalysisManager(graph)).get(Tensors)
    total = 0
    for node in graph.gm.graph.nodes:
        if node.op == "call_function":
            total += node_flops(node, tensors)
        elif node.op == "call_module":
            total += module_flops(graph.gm.get_submodule(node.target))
    return total


# ----------------------------------------------------------------------------------------------
# Step 2: stack reads


@dataclasses.dataclass(frozen=True)
class StackRead:
    """Backward reads of ``value`` served by a slice of the ``stack``/``cat`` node ``stack``.

    ``index`` is the position along ``dim`` (stack) or the offset (cat, with ``length`` elements);
    ``contiguous`` asks for a contiguous copy of the slice (its strides differ from the value's).
    """

    value: str
    stack: str
    dim: int
    index: int
    length: int | None
    contiguous: bool


def plan_stack_reads(graph: CapturedGraph, am: AnalysisManager) -> tuple[StackRead, ...]:
    """Find backward reads of tensors that a kept ``stack``/``cat`` also holds (see the module docstring)."""
    if not graph.training:
        return ()
    tensors = _StorageIndex(am.get(Tensors))
    last_write = _last_writes(graph, tensors)
    kept = _output_storages(graph, tensors)
    reads: list[StackRead] = []
    for position, node in enumerate(graph.gm.graph.nodes):
        if graph.phases.get(node.name) is not Phase.FORWARD or packet_name(node) not in ("stack", "cat"):
            continue
        value = node.meta.get("val")
        sids = set(tensors.storages_of(node.name))
        written = {sid for sid, at in last_write.items() if at > position}
        if not isinstance(value, torch.Tensor) or sids & written:
            continue
        read_later = any(graph.phases.get(u.name) is Phase.BACKWARD for u in node.users)
        if not (sids & kept or read_later):
            continue
        parts = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim = dim % value.dim()
        offset = 0
        for index, part in enumerate(parts):
            if not isinstance(part, torch.fx.Node):
                break
            part_value = part.meta.get("val")
            if not isinstance(part_value, torch.Tensor):
                break
            stacked = packet_name(node) == "stack"
            length = None if stacked else int(part_value.shape[dim]) if part_value.dim() == value.dim() else None
            start = index if stacked else offset
            if not stacked:
                if length is None:
                    break  # a legacy empty 1-d part: offsets no longer follow
                offset += length
            read = _stack_read(node, value, part, part_value, dim, start, length, tensors, written)
            if read is None:
                continue
            for alias in _identity_aliases(part, graph):
                if alias is part or any(graph.phases.get(u.name) is Phase.BACKWARD for u in alias.users):
                    reads.append(dataclasses.replace(read, value=alias.name))
    return tuple(reads)


def _stack_read(node, value, part, part_value, dim, start, length, tensors, written) -> StackRead | None:
    if part_value.dtype != value.dtype or set(tensors.storages_of(part.name)) & written:
        return None
    if length is None:
        sliced = fake_value(torch.ops.aten.select.int, (node, dim, start))
    else:
        sliced = fake_value(torch.ops.aten.slice.Tensor, (node, dim, start, start + length))
    if tuple(sliced.shape) != tuple(part_value.shape):
        return None
    if sliced.stride() == part_value.stride() or part_value.numel() <= 1:
        contiguous = False
    elif part_value.is_contiguous():
        contiguous = True
    else:
        return None
    return StackRead(part.name, node.name, dim, start, length, contiguous)


def _identity_aliases(node: torch.fx.Node, graph: CapturedGraph) -> list[torch.fx.Node]:
    """``node`` and the forward ``detach``/``alias`` chains hanging off it (same values, same layout)."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        found.append(current)
        for user in current.users:
            if graph.phases.get(user.name) is Phase.FORWARD and packet_name(user) in ("detach", "alias"):
                stack.append(user)
    return sorted(found, key=lambda n: n.name)


def apply_stack_reads(editor: GraphEditor, reads: Sequence[StackRead]) -> int:
    """Insert the slices of ``reads`` before their first backward reader; return how many were made."""
    graph = editor.graph
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    position = {n.name: i for i, n in enumerate(graph.gm.graph.nodes)}

    def position_of(node: torch.fx.Node) -> int:
        # A slice made for one read can read another read's value (a stack grown by cat, step by step,
        # is the value of the next step's read): numbered again, every node at once, when one is new.
        # Insertions never reorder the nodes numbered before, so positions from one numbering compare.
        if node.name not in position:
            position.clear()
            position.update((n.name, i) for i, n in enumerate(graph.gm.graph.nodes))
        return position[node.name]

    made = 0
    for read in reads:
        value, stack = by_name[read.value], by_name[read.stack]
        readers = sorted((u for u in value.users if editor.phases.get(u.name) is Phase.BACKWARD), key=position_of)
        if not readers:
            continue
        first = readers[0]
        if read.length is None:
            sliced = editor.call(torch.ops.aten.select.int, (stack, read.dim, read.index), like=value,
                                 phase=Phase.BACKWARD, before=first)
        else:
            sliced = editor.call(torch.ops.aten.slice.Tensor, (stack, read.dim, read.index, read.index + read.length),
                                 like=value, phase=Phase.BACKWARD, before=first)
        if read.contiguous:
            sliced = editor.call(torch.ops.aten.clone.default, (sliced,), {"memory_format": torch.contiguous_format},
                                 like=value, phase=Phase.BACKWARD, before=first)
        for reader in readers:
            retarget(reader, value, sliced)
        made += 1
    return made


def retarget(reader: torch.fx.Node, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """Make ``reader`` read ``new`` instead of ``old``, and refresh the fake values of views of ``old``.

    A view's fake value shares its input's storage; ``reader`` (or a view of it further down) that was
    a view of ``old`` must now be a view of ``new``, or the storage analysis would keep ``old`` alive.
    """
    reader.replace_input_with(old, new)
    olds, news = tensor_values(old), tensor_values(new)
    stale = {StorageWeakRef(v.untyped_storage()) for _, v in olds}
    same_layout = len(olds) == len(news) and all(same_geometry(a, b) for (_, a), (_, b) in zip(olds, news))
    storage_of = {StorageWeakRef(a.untyped_storage()): b.untyped_storage() for (_, a), (_, b) in zip(olds, news)}
    stack = [reader]
    while stack:
        node = stack.pop()
        if node.op != "call_function":
            continue
        if not any(StorageWeakRef(v.untyped_storage()) in stale for _, v in tensor_values(node)):
            continue
        rebuilt = rebuilt_value(node.meta.get("val"), storage_of) if same_layout else None
        node.meta["val"] = rebuilt if rebuilt is not None else fake_value(node.target, node.args, node.kwargs)
        stack.extend(node.users)


# ----------------------------------------------------------------------------------------------
# plans and where copies go


@dataclasses.dataclass(frozen=True)
class RecomputeGroup:
    """Forward nodes recomputed together for some backward nodes.

    Attributes
    ----------
    nodes : frozenset of str
        Forward nodes this group may copy into the backward; only those its consumers need are copied,
        and never one that cannot be recomputed (it is read from the saved original instead).
    serves : frozenset of str or None
        Backward nodes whose reads go through this group (None: every backward node).
    parent : int or None
        Index, in the plan, of the enclosing group: a copy here reads the parent's copy of a value
        outside this group before falling back to the original.
    label : str
        For reports, e.g. ``"steps 8-15"``.
    """

    nodes: frozenset[str]
    serves: frozenset[str] | None = None
    parent: int | None = None
    label: str = ""


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """Where each copy goes: the output of :func:`plan_copies`, pure names and positions.

    ``copies`` lists ``(group, node)`` in creation order (inputs before their readers); ``sources`` maps
    each copy's inputs to the group whose copy it reads (None: the original); ``anchors`` is the graph
    position of the original backward node each copy is inserted before; ``reads`` maps backward nodes
    to the forward values they read through a copy; ``units`` lists the in-place units copied whole
    (member -> all members, creator first; a member is read through its unit's copy, keyed by the creator).
    """

    copies: tuple[tuple[int, str], ...]
    sources: Mapping[tuple[int, str], Mapping[str, int | None]]
    anchors: Mapping[tuple[int, str], int]
    reads: Mapping[str, Mapping[str, int]]
    units: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # member -> its copied unit

    @property
    def recomputed(self) -> tuple[str, ...]:
        """Names of the forward nodes that get at least one copy, sorted."""
        return tuple(sorted({m for _, name in self.copies for m in self.units.get(name, (name,))}))

    def root(self, name: str) -> str:
        """The copy key of a forward node: itself, or the creator of its in-place unit."""
        unit = self.units.get(name)
        return unit[0] if unit is not None else name

    def originals_read(self) -> frozenset[str]:
        """Forward nodes the copies read as originals (they stay saved)."""
        found = set()
        for sources in self.sources.values():
            found.update(name for name, group in sources.items() if group is None)
        return frozenset(found)


def backward_reads(graph: CapturedGraph) -> list[tuple[str, int, tuple[str, ...]]]:
    """``(backward node, position, forward nodes it reads)`` in graph order."""
    rows = []
    for i, node in enumerate(graph.gm.graph.nodes):
        if node.op == "call_function" and graph.phases.get(node.name) is Phase.BACKWARD:
            forward = tuple(
                a.name for a in node.all_input_nodes
                if graph.phases.get(a.name) is Phase.FORWARD
            )
            if forward:
                rows.append((node.name, i, forward))
    return rows


class _OverLimit(Exception):
    """Raised inside :func:`plan_copies` when the copies made cost more than its ``limit``."""


def plan_copies(
    groups: Sequence[RecomputeGroup],
    *,
    inputs: Mapping[str, tuple[str, ...]],
    backward: Sequence[tuple[str, int, tuple[str, ...]]],
    units: Mapping[str, tuple[str, ...]] | None = None,
    flops: Mapping[str, float] | None = None,
    limit: float | None = None,
) -> CopyPlan | None:
    """Decide which copies a plan makes and where each goes (see "Apply" in the module docstring).

    Parameters
    ----------
    groups : sequence of RecomputeGroup
        Parents come before their children; their nodes may all be copied.
    inputs : mapping
        Forward node -> the nodes it reads.
    backward : sequence
        ``(name, position, forward nodes read)`` per backward node, in graph order.
    units : mapping, optional
        In-place units (member -> all members, creator first): a unit is copied whole, as one copy keyed
        by its creator, and its members are read through it.
    flops, limit : optional
        FLOPs per node, and a bound on the copies' total: None is returned as soon as the copies made
        cost more (a plan the caller would refuse, whose copies can number the square of a loop's length).
    """
    units = dict(units or {})
    depth: list[int] = []
    for i, group in enumerate(groups):
        if group.parent is not None and not 0 <= group.parent < i:
            raise ValueError(f"group {i} names parent {group.parent}; parents must come first")
        depth.append(0 if group.parent is None else depth[group.parent] + 1)
    owner: dict[str, int] = {}
    default: int | None = None
    for i in sorted(range(len(groups)), key=lambda g: (depth[g], g)):
        if groups[i].serves is None:
            default = i
        else:
            for name in groups[i].serves:
                owner[name] = i

    def root(name: str) -> str:
        unit = units.get(name)
        return unit[0] if unit is not None else name

    def copy_inputs(name: str) -> tuple[str, ...]:
        unit = units.get(name)
        if unit is None:
            return inputs.get(name, ())
        inside = set(unit)
        return tuple(dict.fromkeys(a for m in unit for a in inputs.get(m, ()) if a not in inside))

    # Memoised per (group, node): an unrolled loop asks for the same values from many readers.
    holders: dict[tuple[int, str], int | None] = {}

    def holder(group: int | None, name: str) -> int | None:
        if group is None:
            return None
        key = (group, name)
        if key in holders:
            return holders[key]
        # Walk up to the first group that holds it or whose answer is known, then record the answer for
        # every group passed: in a deep schedule tree (one state slot over a long segment) the readers
        # of one value start from many groups of one chain, and each walk would climb it again.
        passed = []
        found: int | None = group
        while found is not None:
            known = holders.get((found, name), -1)
            if known != -1:
                found = known
                break
            if name in groups[found].nodes:
                break
            passed.append(found)
            found = groups[found].parent
        for g in passed:
            holders[(g, name)] = found
        holders[key] = found
        return found

    done: set[tuple[int, str]] = set()
    order: list[tuple[int, str]] = []
    sources: dict[tuple[int, str], dict[str, int | None]] = {}
    # Per copy not yet made: where each input is read from, and the copies it needs first (one per
    # input read from a copy, repeats kept), so a copy revisited on the stack is not resolved again.
    resolving: dict[tuple[int, str], tuple[dict[str, int | None], list[tuple[int, str]]]] = {}

    def ensure(key: tuple[int, str]) -> None:
        stack = [key]
        while stack:
            current = stack[-1]
            if current in done:
                stack.pop()
                continue
            found = resolving.get(current)
            if found is None:
                group, name = current
                resolved: dict[str, int | None] = {}
                needs: list[tuple[int, str]] = []
                for arg in copy_inputs(name):
                    held = holder(group, arg)
                    resolved[arg] = held
                    if held is not None:
                        needs.append((held, root(arg)))
                found = resolving[current] = (resolved, needs)
            pending = [need for need in found[1] if need not in done]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            done.add(current)
            order.append(current)
            sources[current] = found[0]
            if limit is not None:
                spent[0] += flops.get(current[1], 0)
                if spent[0] > limit:
                    raise _OverLimit

    spent = [0.0]  # FLOPs of the copies made, against ``limit``
    if limit is not None and flops is None:
        raise ValueError("a limit needs the nodes' flops")
    reads: dict[str, dict[str, int]] = {}
    readers: dict[tuple[int, str], int] = {}
    for name, position, forward in backward:
        group = owner.get(name, default)
        if group is None:
            continue
        for value in forward:
            held = holder(group, value)
            if held is None:
                continue
            key = (held, root(value))
            if key not in done:
                try:
                    ensure(key)
                except _OverLimit:
                    return None
            reads.setdefault(name, {})[value] = held
            if key not in readers or position < readers[key]:
                readers[key] = position
    anchors: dict[tuple[int, str], int] = {}
    for key in reversed(order):
        if key in readers:
            anchors[key] = min(anchors.get(key, readers[key]), readers[key])
        anchor = anchors[key]
        for need in resolving[key][1]:
            if need not in anchors or anchor < anchors[need]:
                anchors[need] = anchor
    # ``sources`` and ``reads`` hold dicts made here for this plan alone: the plan may keep them.
    return CopyPlan(
        copies=tuple(order),
        sources=sources,
        anchors=anchors,
        reads=reads,
        units={m: units[r] for _, r in order if r in units for m in units[r]},
    )


def _insert(editor: GraphEditor, node: torch.fx.Node, like: torch.fx.Node) -> None:
    """Record a node inserted by hand: backward phase, and the source, module and sequence number of ``like``."""
    editor.phases[node.name] = Phase.BACKWARD
    editor.inherit_origin(node, like)
    editor.changed = True


def _layout(node: torch.fx.Node, cache: dict[torch.fx.Node, tuple]) -> tuple:
    """Per tensor of ``node``'s fake value: ``(geometry, storage key, storage)``, computed once per node.

    Two tensors with equal geometries (shape, strides, offset, dtype, storage size; see
    :func:`~memplan.graphutil.same_geometry`) have views with the same metadata. A copy reads a saved
    original (a weight, a step's input) that many other copies read too, so :func:`apply_recompute`
    keeps these for the whole apply: the fake values they describe are not replaced while copies are
    made (readers are retargeted after the last copy).
    """
    found = cache.get(node)
    if found is None:
        rows = []
        for _, value in tensor_values(node):
            storage = value.untyped_storage()
            geometry = (value.shape, value.stride(), value.storage_offset(), value.dtype, storage.nbytes())
            rows.append((geometry, StorageWeakRef(storage), storage))
        found = cache[node] = tuple(rows)
    return found


def _copy_node(editor: GraphEditor, node: torch.fx.Node, remap: Callable[[torch.fx.Node], torch.fx.Node],
               before: torch.fx.Node, layouts: dict[torch.fx.Node, tuple] | None = None) -> torch.fx.Node:
    """A copy of ``node`` in the backward, before ``before``, with its arguments remapped.

    Its fake value is the original's metadata on the storages of the remapped arguments (see
    :func:`~memplan.graphutil.rebuilt_value`); when that does not apply (no fake tensors), the op runs under the fake mode.
    ``layouts`` caches :func:`_layout` across the copies of one apply.

    The node is made with :func:`~memplan.graphutil.create_node` (fx's ``create_node``, which
    ``Graph.node_copy`` calls, under the same name candidate, so fx names it alike) but without copying
    the original's ``meta`` only to replace it: assigning a node attribute goes through
    ``Node.__setattr__``, which updates fx's node lookup table, and an unrolled loop makes tens of
    thousands of copies.
    """
    layouts = {} if layouts is None else layouts
    mapping: dict[torch.fx.Node, torch.fx.Node] = {}

    def record(arg: torch.fx.Node) -> torch.fx.Node:
        mapping[arg] = remap(arg)
        return mapping[arg]

    args = torch.fx.map_arg(node.args, record)
    kwargs = torch.fx.map_arg(node.kwargs, record)
    graph = editor.gm.graph
    with graph.inserting_before(before):
        new = create_node(graph, node.op, node.target, args, kwargs, node.name, node.type)
    storage_of: dict[StorageWeakRef, Any] = {}
    geometry_kept = True
    for old, replacement in mapping.items():
        olds = _layout(old, layouts)
        if replacement is old:  # an original read as it is (a weight, a saved input): its own storages
            for row in olds:
                storage_of[row[1]] = row[2]
            continue
        news = _layout(replacement, layouts)
        geometry_kept = geometry_kept and len(olds) == len(news) and all(
            a[0] == b[0] for a, b in zip(olds, news))
        for a, b in zip(olds, news):
            storage_of[a[1]] = b[2]
    value = rebuilt_value(node.meta.get("val"), storage_of) if geometry_kept else None
    if value is None:
        if new.all_input_nodes:
            value = fake_value(new.target, new.args, new.kwargs)
        else:
            mode = next(v.fake_mode for _, v in tensor_values(node) if hasattr(v, "fake_mode"))
            with mode:
                value = new.target(*new.args, **new.kwargs)
    new.meta["val"] = value  # ``meta`` is the new node's own empty dict
    _insert(editor, new, node)
    return new


def apply_recompute(editor: GraphEditor, copies: CopyPlan) -> dict[tuple[int, str], torch.fx.Node]:
    """Insert the copies of ``copies`` and point the backward readers at them (edits ``editor``'s graph).

    An in-place unit is replayed on a fresh storage: its creator, then each writer, every argument that
    views the unit's storage taken as ``as_strided`` of the latest write, made just before it is read;
    the members the consumers read are ``as_strided`` views made after the last write. So no node
    defined before a write is read after it (the pipeline's alias check), and every reader sees the
    final state, as in the forward.
    """
    nodes = list(editor.gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    position = {n.name: i for i, n in enumerate(nodes)}
    last_writer: dict[StorageWeakRef, torch.fx.Node] = {}
    for node in nodes:
        if node.op == "call_function" and editor.phases.get(node.name) is Phase.FORWARD:
            for target in mutated_args(node):
                for _, value in tensor_values(target):
                    last_writer[StorageWeakRef(value.untyped_storage())] = node
    layouts: dict[torch.fx.Node, tuple] = {}
    written_after: dict[torch.fx.Node, torch.fx.Node | None] = {}
    settled: dict[tuple[str, str], torch.fx.Node] = {}

    def original(arg: torch.fx.Node, anchor: torch.fx.Node) -> torch.fx.Node:
        """``arg`` itself, or a view of its storage made from the last write to it when ``arg`` was
        defined before that write (a copy must not read through a node older than a write)."""
        if arg not in written_after:
            found = None
            if isinstance(arg.meta.get("val"), torch.Tensor):
                for _, key, _ in _layout(arg, layouts):
                    writer = last_writer.get(key)
                    if writer is not None and position[writer.name] > position[arg.name]:
                        found = writer
                        break
            written_after[arg] = found
        writer = written_after[arg]
        if writer is None:
            return arg
        key = (arg.name, anchor.name)
        if key not in settled:
            settled[key] = _strided(editor, writer, arg, anchor)
        return settled[key]

    made: dict[tuple[int, str], torch.fx.Node] = {}
    wanted: dict[tuple[int, str], set[str]] = {}
    for key, sources in copies.sources.items():
        for arg, held in sources.items():
            if held is not None and arg in copies.units:
                wanted.setdefault((held, copies.root(arg)), set()).add(arg)
    for values in copies.reads.values():
        for value, held in values.items():
            if value in copies.units:
                wanted.setdefault((held, copies.root(value)), set()).add(value)

    for key in copies.copies:
        group, name = key
        sources = copies.sources[key]
        anchor = nodes[copies.anchors[key]]

        def remap(arg: torch.fx.Node, sources: Mapping[str, int | None] = sources,
                  anchor: torch.fx.Node = anchor) -> torch.fx.Node:
            held = sources.get(arg.name)
            return original(arg, anchor) if held is None else made[(held, arg.name)]

        if name not in copies.units:
            made[key] = _copy_node(editor, by_name[name], remap, anchor, layouts)
            continue
        unit = copies.units[name]
        inside = set(unit)
        version = _copy_node(editor, by_name[unit[0]], remap, anchor, layouts)
        for member in unit[1:]:
            node = by_name[member]
            if not mutated_args(node):
                continue  # a view of the storage: made from the latest version when read

            def remap_writer(arg: torch.fx.Node, version: torch.fx.Node = version) -> torch.fx.Node:
                return _strided(editor, version, arg, anchor) if arg.name in inside else remap(arg)

            version = _copy_node(editor, node, remap_writer, anchor, layouts)
        for member in sorted(wanted.get(key, ()), key=unit.index):
            made[(group, member)] = _strided(editor, version, by_name[member], anchor)
    for reader, values in copies.reads.items():
        node = by_name[reader]
        for value, group in values.items():
            retarget(node, by_name[value], made[(group, value)])
    return made


def _strided(editor: GraphEditor, version: torch.fx.Node, like: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
    """``as_strided`` of ``version``'s storage with ``like``'s geometry, in the backward."""
    value = like.meta["val"]
    args = (version, [int(s) for s in value.shape], [int(s) for s in value.stride()], int(value.storage_offset()))
    (_, base), *_ = tensor_values(version)
    rebuilt = rebuilt_value(value, {StorageWeakRef(value.untyped_storage()): base.untyped_storage()})
    if rebuilt is None:
        return editor.call(torch.ops.aten.as_strided.default, args, like=like, phase=Phase.BACKWARD, before=before)
    with editor.gm.graph.inserting_before(before):
        node = create_node(editor.gm.graph, "call_function", torch.ops.aten.as_strided.default, args)
    node.meta["val"] = rebuilt  # ``meta`` is the new node's own empty dict
    _insert(editor, node, like)
    return node


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """A rematerialisation plan: stack reads, then recompute groups.

    ``recomputed`` (forward nodes copied into the backward) and ``saved`` (forward nodes the backward
    still reads) describe the plan's effect on the graph it was planned for.
    """

    label: str
    stack_reads: tuple[StackRead, ...] = ()
    groups: tuple[RecomputeGroup, ...] = ()
    units: tuple[tuple[str, ...], ...] = ()  # in-place units among the groups' nodes (recomputed whole)
    recomputed: tuple[str, ...] = ()
    saved: tuple[str, ...] = ()
    # The placement the planner simulated, and the node names (graph order) of the graph it was planned
    # on: :func:`apply_remat` applies it as is to a graph with those names instead of placing again.
    copies: CopyPlan | None = dataclasses.field(default=None, compare=False, repr=False)
    planned_on: tuple[str, ...] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        lines = [f"remat plan {self.label!r}: {len(self.stack_reads)} stack reads, "
                 f"{len(self.recomputed)} nodes recomputed, {len(self.saved)} tensors saved"]
        if self.recomputed:
            more = " ..." if len(self.recomputed) > 20 else ""
            lines.append("  recompute: " + ", ".join(self.recomputed[:20]) + more)
        return "\n".join(lines)

    @property
    def changes(self) -> bool:
        return bool(self.stack_reads or self.recomputed)


def apply_remat(graph: CapturedGraph, plan: RematPlan) -> CapturedGraph:
    """Apply ``plan`` to ``graph`` (editing its fx graph in place) and return the updated graph."""
    editor = GraphEditor(graph)
    if plan.groups:
        copies = plan.copies
        if copies is None or plan.planned_on != tuple(n.name for n in graph.gm.graph.nodes):
            units = {m: unit for unit in plan.units for m in unit}
            copies = plan_copies(plan.groups, inputs=forward_inputs(graph), backward=backward_reads(graph), units=units)
        apply_recompute(editor, copies)
    if plan.stack_reads:
        apply_stack_reads(editor, plan.stack_reads)
    return editor.finish()


def forward_inputs(graph: CapturedGraph) -> dict[str, tuple[str, ...]]:
    """Forward node -> the nodes it reads (graph inputs included)."""
    return {
        n.name: tuple(a.name for a in n.all_input_nodes)
        for n in graph.gm.graph.nodes
        if n.op == "call_function" and graph.phases.get(n.name) is Phase.FORWARD
    }


# ----------------------------------------------------------------------------------------------
# Step 3: cuts


def _relevant(facts: RematFacts) -> list[str]:
    """Forward nodes that are needed by the backward or are ancestors of one, in graph order."""
    seen: set[str] = set()
    stack = list(facts.needed)
    while stack:
        name = stack.pop()
        if name in seen or name not in facts.nodes:
            continue
        seen.add(name)
        stack.extend(facts.inputs.get(name, ()))
    return sorted(seen, key=lambda n: facts.nodes[n].position)


def min_cut(facts: RematFacts, *, price: float | None, banned: frozenset[str] = frozenset()) -> frozenset[str]:
    """The forward nodes a minimum cut recomputes.

    Parameters
    ----------
    facts : RematFacts
    price : float or None
        None: AOTAutograd's cut (expensive ops banned, every other recomputable op free). Otherwise the
        price of one FLOP in bytes: recomputing ``v`` costs ``price * FLOPs(v)``.
    banned : frozenset of str
        Nodes that must not be recomputed (saved if the backward needs them).

    Returns
    -------
    frozenset of str
        Recomputable nodes on the sink side of the cut (those the backward needs, transitively, are
        copied; the rest are never made).

    Notes
    -----
    Several cuts of one graph share their network: :class:`CutNetwork` builds it once.
    """
    return CutNetwork(facts).cut(price, banned)


class CutNetwork:
    """The flow network of stage 3 for one graph, built once and cut at any price and ban set.

    Nodes free to save (inputs, views of them, tensors an output keeps) stay out of the network: they
    are always available and never recomputed. A view is merged into the tensor it views (saving either
    keeps the same storage, and recomputing a view costs nothing), and an in-place unit into its creator.
    Each remaining node ``v`` is two network nodes, ``v_in -> v_out`` with its saving cost; a node that
    cannot be recomputed is only its ``v_out`` half, fed from the source through its saving cost. Edges
    ``u_out -> v_in`` (``v`` reads ``u``) and ``v_out -> sink`` (the backward reads ``v``) are infinite;
    ``source -> v_in`` costs ``price * FLOPs(v)``. A banned node (or, in AOTAutograd's cut, an expensive
    one) is fed from the source without limit instead: its ``v_in`` is on the source side of every finite
    cut, so the cut pays its saving cost exactly as if it could not be recomputed.

    So the network is the same for every cut; only the capacities of the source edges differ (and the
    saving edge of a banned node that cannot be saved, which is closed). A cut is solved by Dinic's
    max-flow (short augmenting paths in level graphs; the networks of unrolled loops have few levels),
    after pushing along the one- and two-node paths directly. When an earlier cut of the network had no
    larger capacity anywhere (a lower price, a subset of the bans), its maximum flow is still a flow here
    and the search starts from it.

    The result does not depend on which maximum flow is found: the nodes that can still reach the sink in
    the residual network are the same for every maximum flow (they form the smallest sink side of all
    minimum cuts), so this agrees with any other exact max-flow solver, networkx's included (the tests
    compare them).

    Examples
    --------
    A chain ``x -> a -> b`` whose ``b`` the backward reads, ``a`` cheap to recompute from the input:

    >>> facts = RematFacts(
    ...     nodes={n: NodeFacts(n, i, n != "x", None, False, n, 8 if n != "x" else 0, s, r)
    ...            for i, (n, s, r) in enumerate([("x", 0, None), ("a", 64, None), ("b", 64, 5)])},
    ...     inputs={"a": ("x",), "b": ("a",)}, needed=("b",), total_flops=16, forward_flops=16)
    >>> network = CutNetwork(facts)
    >>> sorted(network.cut(price=None)), sorted(network.cut(price=100.0))
    (['a', 'b'], [])
    """

    def __init__(self, facts: RematFacts):
        self.facts = facts
        self.relevant = relevant = _relevant(facts)  # also what :func:`_ban_sets` groups into classes
        rep = _representatives(facts, relevant)
        members: dict[str, list[str]] = {}
        for name in relevant:
            members.setdefault(rep[name], []).append(name)
        # One pair of network nodes per merged node, in graph order; nodes free to save are out. Node 0
        # is the source, 1 the sink, 2i + 2 and 2i + 3 are ``v_in`` and ``v_out`` of merged node i.
        self.names: list[str] = [name for name in members if facts.nodes[name].save_bytes > 0]
        index = {name: i for i, name in enumerate(self.names)}
        self.recomputed_members = [tuple(m for m in members[name] if facts.nodes[m].recomputable) for name in self.names]
        self.size = 2 * len(self.names) + 2
        self.adjacent: list[list[int]] = [[] for _ in range(self.size)]  # edge ids leaving each node
        self.to: list[int] = []  # head of each edge; edge e ^ 1 is the reverse of edge e
        self.base: list[float] = []  # capacities that no cut changes
        self.save: list[int | None] = []  # None: cannot be saved (infinite)
        self.flops: list[int] = []
        self.expensive: list[bool] = []
        self.priced: list[int] = []  # recomputable merged nodes, whose source and saving edges vary
        self.source_edge: dict[int, int] = {}
        self.save_edge: dict[int, int] = {}
        self.paths: list[tuple[int, int | None, int]] = []  # (source edge, saving edge, sink edge)
        self.unsaveable = frozenset(name for name in self.names if not facts.nodes[name].saveable)
        for i, name in enumerate(self.names):
            fact = facts.nodes[name]
            group = members[name]
            save = fact.save_bytes if fact.saveable else None
            self.save.append(save)
            self.flops.append(sum(facts.nodes[m].flops for m in group))
            self.expensive.append(fact.expensive)
            v_in, v_out = 2 * i + 2, 2 * i + 3
            first = None
            if fact.recomputable:
                self.priced.append(i)
                first = self.source_edge[i] = self._edge(0, v_in, 0)
                self.save_edge[i] = self._edge(v_in, v_out, 0)
                heads = []
                for member in group:
                    for arg in facts.inputs.get(member, ()):
                        head = rep.get(arg)
                        if head is not None and head != name and head in index:
                            heads.append(index[head])
                for head in dict.fromkeys(heads):
                    self._edge(2 * head + 3, v_in, math.inf)
            elif save is not None:
                first = self._edge(0, v_out, save)
            if any(facts.nodes[m].first_reader is not None for m in group):
                sink = self._edge(v_out, 1, math.inf)
                if first is not None:
                    self.paths.append((first, self.save_edge.get(i), sink))
        # Per recomputable merged node, what a cut's capacities depend on (read once per cut, in a loop
        # over thousands of nodes): (i, source edge, saving edge, saving cost, FLOPs, expensive, name).
        self._priced_rows = [(i, self.source_edge[i], self.save_edge[i], self.save[i], self.flops[i],
                              self.expensive[i], self.names[i]) for i in self.priced]
        # Solved cuts: (price, banned, capacities, residual capacities of the maximum flow).
        self._solved: list[tuple[float, frozenset[str], list[float], list[float]]] = []

    def _edge(self, tail: int, head: int, capacity: float) -> int:
        edge = len(self.to)
        self.adjacent[tail].append(edge)
        self.to.append(head)
        self.base.append(capacity)
        self.adjacent[head].append(edge + 1)
        self.to.append(tail)
        self.base.append(0)
        return edge

    def _banned(self, i: int, price: float | None, banned: frozenset[str]) -> bool:
        return self.names[i] in banned or (price is None and self.expensive[i])

    def cut(self, price: float | None, banned: frozenset[str] = frozenset()) -> frozenset[str]:
        """The recompute set of the minimum cut at ``price`` with ``banned`` kept saved (see :func:`min_cut`)."""
        banned = frozenset(banned)
        # Step 1: the capacities of this cut (``open_`` lists the merged nodes neither banned nor, in
        # AOTAutograd's cut, expensive: :meth:`_banned` inlined).
        capacity = list(self.base)
        open_: list[int] = []
        for i, source_edge, save_edge, save, flops, expensive, name in self._priced_rows:
            if name in banned or (price is None and expensive):
                capacity[source_edge] = math.inf if save is not None else 0
                capacity[save_edge] = save if save is not None else 0
            else:
                open_.append(i)
                capacity[source_edge] = 0 if price is None else int(round(price * flops))
                capacity[save_edge] = save if save is not None else math.inf
        # Step 2: start from the maximum flow of an earlier cut whose capacities are nowhere larger.
        residual = None
        if price is not None:
            for old_price, old_banned, old_capacity, old_residual in reversed(self._solved):
                if old_price <= price and old_banned <= banned and not (banned - old_banned) & self.unsaveable:
                    residual = [r if new == old else r + (new - old)
                                for r, new, old in zip(old_residual, capacity, old_capacity)]
                    break
        if residual is None:
            residual = list(capacity)
        # Step 3: a maximum flow; then the nodes that still reach the sink.
        _max_flow(self.adjacent, self.to, residual, self.paths)
        if price is not None:
            self._solved.append((price, banned, capacity, residual))
        reaches = _reaching_sink(self.adjacent, self.to, residual)
        members = self.recomputed_members
        return frozenset(m for i in open_ if reaches[2 * i + 2] for m in members[i])


def _max_flow(adjacent: Sequence[Sequence[int]], to: Sequence[int], residual: list[float],
              paths: Sequence[tuple[int, int | None, int]] = ()) -> None:
    """Turn ``residual`` (residual capacities of a feasible flow from node 0 to node 1) into those of a
    maximum flow.

    First the short ``paths`` (edge ids from the source to the sink) are pushed directly. Then Dinic's
    algorithm: a breadth-first search labels nodes by their distance from the source over edges with
    residual capacity, and a depth-first search pushes flow along shortest paths only (each node remembers
    the next edge to try, and a dead end is dropped from the level graph), until the sink is out of reach.
    """
    for first, middle, last in paths:
        pushed = min(residual[first], residual[last]) if middle is None \
            else min(residual[first], residual[middle], residual[last])
        if pushed > 0:
            for e in (first, middle, last):
                if e is not None:
                    residual[e] -= pushed
                    residual[e ^ 1] += pushed
    size, source, sink = len(adjacent), 0, 1
    while True:
        level = [-1] * size
        level[source] = 0
        frontier = [source]
        while frontier and level[sink] < 0:
            following = []
            for u in frontier:
                next_level = level[u] + 1
                for e in adjacent[u]:
                    v = to[e]
                    if residual[e] > 0 and level[v] < 0:
                        level[v] = next_level
                        following.append(v)
            frontier = following
        if level[sink] < 0:
            return
        cursor = [0] * size
        while True:
            path: list[int] = []
            u = source
            while u != sink:
                edges_of, i, wanted = adjacent[u], cursor[u], level[u] + 1
                end = len(edges_of)
                while i < end:
                    e = edges_of[i]
                    if residual[e] > 0 and level[to[e]] == wanted:
                        break
                    i += 1
                cursor[u] = i
                if i < end:
                    path.append(e)
                    u = to[e]
                elif u == source:
                    break
                else:
                    level[u] = -1  # a dead end: out of this level graph
                    u = to[path.pop() ^ 1]
                    cursor[u] += 1
            if u != sink:
                break
            pushed = min(residual[e] for e in path)
            for e in path:
                residual[e] -= pushed
                residual[e ^ 1] += pushed


def _reaching_sink(adjacent: Sequence[Sequence[int]], to: Sequence[int], residual: Sequence[float]) -> list[bool]:
    """Which nodes reach the sink (node 1) over edges with residual capacity: a search backwards from it
    (the edge ``u -> v`` is the reverse of an edge ``v -> u`` that ``v`` lists)."""
    reaches = [False] * len(adjacent)
    reaches[1] = True
    stack = [1]
    while stack:
        v = stack.pop()
        for e in adjacent[v]:
            if residual[e ^ 1] > 0:
                u = to[e]
                if not reaches[u]:
                    reaches[u] = True
                    stack.append(u)
    return reaches


def _reaches_sink_after_max_flow(size: int, edges: Sequence[tuple[int, int, int | None]]) -> list[bool]:
    """Which nodes reach the sink (node 1) in the residual network of a maximum flow from node 0, for a
    network given as ``(tail, head, capacity)`` edges (None: infinite)."""
    adjacent: list[list[int]] = [[] for _ in range(size)]
    to: list[int] = []
    residual: list[float] = []
    for tail, head, capacity in edges:
        adjacent[tail].append(len(to))
        to.append(head)
        residual.append(math.inf if capacity is None else capacity)
        adjacent[head].append(len(to))
        to.append(tail)
        residual.append(0)
    _max_flow(adjacent, to, residual)
    return _reaching_sink(adjacent, to, residual)


def _representatives(facts: RematFacts, relevant: Sequence[str]) -> dict[str, str]:
    """Node -> the node it is merged into in the cut network (itself, or what it views)."""
    rep: dict[str, str] = {}
    for name in relevant:
        fact = facts.nodes[name]
        if fact.unit is not None and fact.unit != name and fact.unit in rep:
            rep[name] = rep[fact.unit]  # an in-place unit is recomputed whole: one node
            continue
        base = fact.view_of
        head = rep.get(base) if base is not None else None
        mergeable = head is not None and facts.nodes[head].saveable
        if mergeable and (fact.recomputable or not facts.nodes[head].recomputable):
            rep[name] = head
        else:
            rep[name] = name
    return rep


# ----------------------------------------------------------------------------------------------
# Step 4: hoisting repair


def hoisted(facts: RematFacts, recompute: frozenset[str], limit: int,
            users: Mapping[str, tuple[str, ...]]) -> frozenset[str]:
    """Nodes to save instead, so that no copy goes more than ``limit`` positions before its own reader.

    Scans the recomputed nodes from the last forward node back. ``placed[v]`` is where the copy of ``v``
    goes: before its earliest consumer (its own first backward reader, or a copy that reads it). A node
    whose copy would be placed more than ``limit`` positions before its own first reader is saved
    instead, and then consumes nothing, which moves its ancestors' copies later.
    """
    placed: dict[str, int | None] = {}
    ban: set[str] = set()
    for name in sorted(recompute, key=lambda n: -facts.nodes[n].position):
        own = facts.nodes[name].first_reader
        times = [placed[u] for u in users.get(name, ()) if placed.get(u) is not None]
        if own is not None:
            times.append(own)
        at = min(times) if times else None
        if own is not None and at is not None and own - at > limit:
            ban.add(name)
            placed[name] = None
        else:
            placed[name] = at
    return frozenset(ban)


def _forward_users(facts: RematFacts) -> dict[str, tuple[str, ...]]:
    users: dict[str, list[str]] = {}
    for name, args in facts.inputs.items():
        for arg in args:
            users.setdefault(arg, []).append(name)
    return {k: tuple(v) for k, v in users.items()}


class _Cuts:
    """Memoised cuts of one graph: plain, repaired for hoisting, and swept over prices."""

    def __init__(self, facts: RematFacts, rounds: int = 4):
        self.facts = facts
        self.network = CutNetwork(facts)
        self.users = _forward_users(facts)
        self.rounds = rounds
        self.memo: dict[tuple[float | None, frozenset[str]], frozenset[str]] = {}

    def cut(self, price: float | None, banned: frozenset[str] = frozenset()) -> frozenset[str]:
        key = (price, banned)
        if key not in self.memo:
            self.memo[key] = self.network.cut(price, banned)
        return self.memo[key]

    def repaired(self, price: float | None, limit: int) -> frozenset[str]:
        """The cut at ``price`` with hoisted nodes saved instead, re-cut until no copy is hoisted."""
        banned: frozenset[str] = frozenset()
        recompute = self.cut(price)
        for _ in range(self.rounds):
            more = hoisted(self.facts, recompute, limit, self.users) - banned
            if not more:
                break
            banned |= more
            recompute = self.cut(price, banned)
        return recompute

    def sweep(self, low: float, high: float, depth: int) -> list[float]:
        """Prices from ``low`` to ``high`` (bytes per FLOP), bisected geometrically where the cut changes.

        The sink side of a priced cut only grows as the price falls (a parametric min cut), so an
        interval whose two ends cut alike holds no other cut and is not split further.
        """
        points = {low: self.cut(low), high: self.cut(high)}

        def refine(a: float, b: float, depth: int) -> None:
            if depth == 0 or points[a] == points[b]:
                return
            middle = math.sqrt(a * b)
            points[middle] = self.cut(middle)
            refine(a, middle, depth - 1)
            refine(middle, b, depth - 1)

        refine(low, high, depth)
        return sorted(points)


def _cut_sets(facts: RematFacts, options: RematOptions) -> list[tuple[str, frozenset[str]]]:
    """``(label, recompute set)`` of every cut tried (see stages 3 and 4), duplicates included."""
    cuts = _Cuts(facts)
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
        for names, banned in _ban_sets(facts, options.max_ban_classes, cuts.network.relevant):
            found.append((f"save {names}", cuts.cut(low * scale, banned)))
    return found


def _ban_sets(facts: RematFacts, exhaustive: int,
              relevant: Sequence[str] | None = None) -> list[tuple[str, frozenset[str]]]:
    """Sets of expensive-op classes to keep saved: every subset of up to ``exhaustive`` classes, else
    growing prefixes of the classes sorted by FLOPs (most expensive first). ``relevant``: ``_relevant(facts)``
    when the caller has it."""
    classes: dict[str, list[str]] = {}
    flops: dict[str, int] = {}
    for name in _relevant(facts) if relevant is None else relevant:
        fact = facts.nodes[name]
        if fact.expensive and fact.recomputable and fact.save_bytes > 0:
            classes.setdefault(fact.signature, []).append(name)
            flops[fact.signature] = flops.get(fact.signature, 0) + fact.flops
    keys = sorted(classes, key=lambda k: (-flops[k], k))
    if len(keys) <= exhaustive:
        subsets = [c for r in range(1, len(keys)) for c in itertools.combinations(keys, r)]
    else:
        subsets = [tuple(keys[:r]) for r in range(1, len(keys))]
    return [("+".join(sub), frozenset(n for k in sub for n in classes[k])) for sub in subsets]


# ----------------------------------------------------------------------------------------------
# Step 5: candidates, simulated without building them


class VirtualSimulation:
    """The peak a graph reaches after stack reads and copies, computed without editing the graph.

    Same model as :class:`~memplan.analysis.peak.PeakSimulation` under graph lifetimes: a storage is
    allocated by the node that creates it and freed after the last node that reads any tensor aliasing
    it; storages aliased by graph outputs stay to the end; external storages never count. A copy creates
    storages of the same sizes as its original's and aliases whatever its inputs resolve to, so the peak
    equals the simulated peak of the applied graph (the tests check it) at the cost of one linear sweep,
    with no fake-tensor propagation and no code generation.

    The sweep is sparse: a plan touches a few thousand items (its copies and slices, the backward nodes
    that read them, and the views of those whose storages move), and every other node of the graph
    aliases and reads what it did before the plan. What those do is fixed per graph and kept as arrays
    (which storages each node touches, which node creates each storage), so a plan costs numpy work on
    them plus Python work on the items it touches, not a Python loop over the whole graph; planning
    simulates a dozen plans of one graph.

    Examples
    --------
    >>> import torch, dataclasses
    >>> from memplan.capture import capture
    >>> from memplan.analysis.peak import PeakSimulation
    >>> g = dataclasses.replace(capture(torch.nn.Linear(4, 4), torch.randn(2, 4)), lifetimes="graph")
    >>> am = AnalysisManager(g)
    >>> VirtualSimulation(g, am).peak() == am.get(PeakSimulation).peak
    True
    """

    def __init__(self, graph: CapturedGraph, am: AnalysisManager):
        tensors = am.get(Tensors)
        nodes = list(graph.gm.graph.nodes)
        self._nodes = nodes
        self._phases = graph.phases
        self.names = tuple(n.name for n in nodes)  # copy anchors index this (all nodes, graph order)
        # Items are ids (ints): a node of the graph is its index in ``names``.
        self.index = index = {name: i for i, name in enumerate(self.names)}
        node_id = {n: i for i, n in enumerate(nodes)}
        infos = tensors.tensors
        storages = self.storages = tensors.storages
        self.next_id = max(storages, default=-1) + 1
        self.margin = step_margin(graph)
        # Per node: the ids of its inputs (for the nodes the emitted code runs: ops and chunk loops, which
        # read every input they are given), the storages it aliases, and the bytes of its (first) value.
        self.arg_ids = tuple(tuple(node_id[a] for a in n.all_input_nodes)
                             if n.op not in ("placeholder", "get_attr", "output") else () for n in nodes)
        self.alias_ids = tuple(tuple(dict.fromkeys(info.storage for info in infos.get(name, ())))
                               for name in self.names)
        self.value_bytes = {index[name]: found[0].nbytes for name, found in infos.items() if found and name in index}
        self.creator = {sid: index.get(storage.creator, -1) for sid, storage in storages.items()}
        output = next(n for n in reversed(nodes) if n.op == "output")
        self.output_ids = tuple(node_id[a] for a in output.all_input_nodes)
        # The nodes the sweep visits, in graph order (``order[p]`` is a node id), and each node's place.
        self.order = np.array([i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr", "output")],
                              dtype=np.int64)
        place = [-1] * len(nodes)
        for p, i in enumerate(self.order.tolist()):
            place[i] = p
        self.place = place
        # Who reads each node (among the visited nodes), for following storages that a plan moves.
        readers: list[list[int]] = [[] for _ in nodes]
        for i in self.order.tolist():
            for a in self.arg_ids[i]:
                readers[a].append(i)
        self.readers = tuple(tuple(r) for r in readers)
        # The timeline of an applied plan is the memory model's (its positions are ``place``).
        if graph.lifetimes != "graph":
            am = AnalysisManager(dataclasses.replace(graph, lifetimes="graph"))
        self.model = am.get(MemoryModel)
        self._backward_users: dict[str, tuple[int, ...]] = {}

    def backward_users(self, name: str) -> tuple[int, ...]:
        """Ids of the backward nodes that read ``name`` (for the stack reads of a plan)."""
        found = self._backward_users.get(name)
        if found is None:
            node = self._nodes[self.index[name]]
            found = self._backward_users[name] = tuple(
                self.index[u.name] for u in node.users if self._phases.get(u.name) is Phase.BACKWARD)
        return found

    def step_peak(self, reads: Sequence[StackRead] = (), copies: CopyPlan | None = None) -> int:
        """:meth:`peak` plus :func:`step_margin`: the peak ``memplan.measure`` reports for a training step."""
        return self.peak(reads, copies) + self.margin

    def step_floor(self, saved: Iterable[str], reads: Sequence[StackRead] = ()) -> int:
        """A lower bound on :meth:`step_peak` for a plan that saves ``saved`` (its forward values that the
        backward or its copies read, stack reads included): the forward storages they alias are all alive
        when the backward starts, since copies go into the backward, and so are those of the graph's
        outputs. Values the ``reads`` serve are read from their stack instead (every reader is
        redirected), so they do not count."""
        served = {read.value for read in reads}
        index, alias_ids, storages, creator = self.index, self.alias_ids, self.storages, self.creator
        names, phases = self.names, self._phases
        kept = [index[name] for name in saved if name in index and name not in served]
        alive: set[int] = set()
        for i in (*kept, *self.output_ids):
            for sid in alias_ids[i]:
                made = creator[sid]
                if made >= 0 and not storages[sid].external and phases.get(names[made]) is Phase.FORWARD:
                    alive.add(sid)
        return sum(storages[sid].nbytes for sid in alive) + self.margin

    def peak(self, reads: Sequence[StackRead] = (), copies: CopyPlan | None = None) -> int:
        """Peak bytes of the graph with ``reads`` and ``copies`` applied (both planned on this graph)."""
        live = self._live(reads, copies)
        return int(live.max()) if len(live) else 0

    def timeline(self, reads: Sequence[StackRead] = (), copies: CopyPlan | None = None) -> list[int]:
        """Bytes live right after each node of the applied graph (``SimEvent.live``), in its order."""
        return self._live(reads, copies).tolist()

    def _live(self, reads: Sequence[StackRead], copies: CopyPlan | None) -> np.ndarray:
        # Step 1: the new items. Copy ``k`` (creation order) is ``count + k``, the slice of ``reads[i]``
        # is ``first_slice + i``; what each stands for, and what it reads: an original (its id) or a copy.
        index, names, count = self.index, self.names, len(self.names)
        keys = copies.copies if copies is not None else ()
        copy_of = {key: count + k for k, key in enumerate(keys)}
        first_slice = count + len(keys)
        units = copies.units if copies is not None else {}

        def root(name: str) -> str:
            unit = units.get(name)
            return unit[0] if unit is not None else name

        node_of: list[int] = list(range(count))  # item -> id of the node of the graph it stands for
        copy_args: list[tuple[int, ...]] = []  # per copy: ids of the originals of its inputs
        copy_reads: list[list[int]] = []  # per copy: the items it reads
        for key in keys:
            sources = copies.sources[key]
            node_of.append(index[key[1]])
            copy_args.append(tuple(index[arg] for arg in sources))  # a unit reads the outside inputs of all its members
            copy_reads.append([index[arg] if held is None else copy_of[(held, root(arg))]
                               for arg, held in sources.items()])
        node_of.extend(index[read.value] for read in reads)

        # Step 2: where each new item goes: copies before their anchor node (creation order), then each
        # slice of a stack read before the first backward node or copy that reads its value.
        place = self.place
        before: dict[int, list[int]] = {}
        rank: dict[int, tuple[int, int, int]] = {}  # an item's place in the sequence, comparable without building it
        for k, key in enumerate(keys):
            anchor = copies.anchors[key]
            made = before.setdefault(anchor, [])
            rank[count + k] = (place[anchor], 0, len(made))
            made.append(count + k)

        def rank_of(item: int) -> tuple[int, int, int]:
            return rank[item] if item >= count else (place[item], 1, 0)

        redirect: dict[tuple[int, int], int] = {}  # (reader item, id of the value it reads) -> slice item
        slices: dict[int, list[int]] = {}
        if reads:
            copy_readers: dict[str, list[int]] = {}
            for k, key in enumerate(keys):
                for arg, held in copies.sources[key].items():
                    if held is None:
                        copy_readers.setdefault(arg, []).append(count + k)
            for i, read in enumerate(reads):
                via = [r for r in self.backward_users(read.value)
                       if copies is None or read.value not in copies.reads.get(names[r], {})]
                readers = via + copy_readers.get(read.value, [])
                if not readers:
                    continue
                slices.setdefault(min(readers, key=rank_of), []).append(first_slice + i)
                value = index[read.value]
                for reader in readers:
                    redirect[(reader, value)] = first_slice + i

        # Step 3: the position of every item in the applied graph. A visited node moves down by the new
        # items placed before it or before an earlier node; the new items placed before node ``i`` are
        # ``runs[i]``, in order.
        runs: dict[int, list[int]] = {}
        for anchor in set(before) | {item for item in slices if item < count}:
            if place[anchor] < 0:
                continue  # not a visited node: neither are the items placed before it
            run: list[int] = []
            for made in before.get(anchor, ()):
                run.extend(slices.get(made, ()))
                run.append(made)
            run.extend(slices.get(anchor, ()))
            runs[anchor] = run
        visited = len(self.order)
        shift = np.zeros(visited, dtype=np.int64)
        for anchor, run in runs.items():
            shift[place[anchor]] = len(run)
        at_place = np.arange(visited, dtype=np.int64) + np.cumsum(shift)  # position of each visited node
        at_new: dict[int, int] = {}
        for anchor, run in runs.items():
            start = int(at_place[place[anchor]]) - len(run)
            for j, item in enumerate(run):
                at_new[item] = start + j

        # What a node of the graph reads through a copy: item -> {id of the value: copy item}.
        through: dict[int, dict[int, int]] = {}
        if copies is not None:
            for reader, values in copies.reads.items():
                through[index[reader]] = {index[value]: copy_of[(held, root(value))] for value, held in values.items()}

        # Step 4: the storages of the items the plan touches, visited in order: every new item, the nodes
        # that read a copy or a slice, and (found on the way) the readers of nodes whose storages moved.
        # Every other node of the graph reads no copy or slice and no node whose storages moved, so it
        # aliases and reads what it did before the plan (step 5). An item's inputs come before it, so
        # what they alias is known when it is reached.
        arg_ids, alias_ids, storages, value_bytes, creator = (self.arg_ids, self.alias_ids, self.storages,
                                                              self.value_bytes, self.creator)
        readers_of, next_id = self.readers, self.next_id
        created: dict[int, int] = {}  # new storage id -> bytes
        maps: dict[int, dict[int, int] | None] = {}  # item -> {storage of its node: storage it has}, or None: the same
        aliases: dict[int, tuple[int, ...]] = {}  # item -> the storages it aliases
        queued: set[int] = set()  # nodes of the graph visited here
        pending = [(at, item) for item, at in at_new.items()]
        for item in set(through) | {reader for reader, _ in redirect if reader < count}:
            if place[item] >= 0:
                pending.append((int(at_place[place[item]]), item))
                queued.add(item)
        heapq.heapify(pending)
        touches: dict[int, tuple[int, ...]] = {}  # item -> the storages it aliases and reads
        born: dict[int, int] = {}  # new storage -> position of its first item
        while pending:
            at, item = heapq.heappop(pending)
            mapping: dict[int, int] | None
            if item >= first_slice:
                # a slice aliases the stack (or, made contiguous, a storage of its own)
                read = reads[item - first_slice]
                stack, value = index[read.stack], index[read.value]
                arg_items: list[int] = [stack]
                if read.contiguous:
                    target = next_id + len(created)
                    created[target] = value_bytes[value]
                else:
                    target = alias_ids[stack][0]
                mapping = {sid: target for sid in alias_ids[value]}
                own = tuple(dict.fromkeys(mapping.values()))
            else:
                if item < count:
                    node, args = item, arg_ids[item]
                    via = through.get(item)
                    arg_items = list(args) if via is None else [via.get(arg, arg) for arg in args]
                else:
                    node, args = node_of[item], copy_args[item - count]
                    arg_items = copy_reads[item - count]
                if redirect:
                    arg_items = [redirect.get((item, arg), ref) for arg, ref in zip(args, arg_items)]
                # A node that creates a storage keeps it (a copy gets a new one of the same size); a view
                # aliases whatever the input it views now aliases, exactly as the applied graph's
                # refreshed fake values do.
                mapping = {}
                changed = False
                for sid in alias_ids[node]:
                    target = sid
                    if creator.get(sid) == node:
                        if item >= count:
                            target = next_id + len(created)
                            created[target] = storages[sid].nbytes
                    else:
                        for arg, arg_item in zip(args, arg_items):
                            if sid in alias_ids[arg]:
                                arg_map = maps.get(arg_item)
                                if arg_map is not None:
                                    target = arg_map.get(sid, sid)
                                break
                    mapping[sid] = target
                    changed = changed or target != sid
                if changed:
                    own = tuple(dict.fromkeys(mapping[sid] for sid in alias_ids[node]))
                else:
                    mapping, own = None, alias_ids[node]
                if item < count and mapping is not None:
                    for reader in readers_of[item]:
                        if reader not in queued:
                            queued.add(reader)
                            heapq.heappush(pending, (int(at_place[place[reader]]), reader))
            maps[item] = mapping
            aliases[item] = own
            touched = list(own)
            for sid in own:
                if sid >= next_id and sid not in born:
                    born[sid] = at
            for arg_item in arg_items:
                found = aliases.get(arg_item)
                touched.extend(alias_ids[arg_item] if found is None else found)
            touches[item] = tuple(dict.fromkeys(touched))

        # Step 5: the applied graph's timeline is the memory model's: each new item a ``NewNode`` before
        # its anchor (in run order), each node followed here touching what it touches now, the output
        # too when a storage it keeps moved. Every other node touches what it touched before the plan.
        inserted: list[NewNode] = []
        for anchor in sorted(runs, key=place.__getitem__):  # in run order: a storage is made before it is read
            for item in runs[anchor]:
                at = at_new[item]
                own = set(aliases[item])
                creates = {sid: created[sid] for sid in own if sid >= next_id and born[sid] == at}
                inserted.append(NewNode(before=place[anchor], creates=creates,
                                        touches=tuple(sid for sid in touches[item] if sid not in creates)))
        retouched = {place[item]: touches[item] for item in touches if item < count}
        if any(maps.get(item) is not None for item in self.output_ids):
            retouched[self.model.end] = tuple(sid for item in self.output_ids
                                              for sid in aliases.get(item, alias_ids[item]))
        return self.model.with_recompute(inserted, retouched).live


def after_stack_reads(facts: RematFacts, reads: Sequence[StackRead]) -> RematFacts:
    """Facts once ``reads`` are planned: their values are free to save, their stacks are never recomputed."""
    nodes = dict(facts.nodes)
    for read in reads:
        nodes[read.value] = dataclasses.replace(nodes[read.value], save_bytes=0)
        nodes[read.stack] = dataclasses.replace(nodes[read.stack], recomputable=False,
                                                why_not="read back by stack reads")
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
    for label, recompute in _cut_sets(facts, options):
        recompute = _with_tuple_parents(graph, facts, recompute)
        if not recompute or recompute in seen:
            continue
        seen.add(recompute)
        groups = (RecomputeGroup(recompute, label=label),)
        copies = plan_copies(groups, inputs=inputs, backward=backward, units=facts.units)
        if not copies.copies:
            continue
        extra = sum(costs[name] for _, name in copies.copies)
        direct = {v for n, _, fw in backward for v in fw if v not in copies.reads.get(n, {})}
        saved = sorted(copies.originals_read() | direct,
                       key=lambda n: facts.nodes[n].position if n in facts.nodes else -1)
        plan = RematPlan(label, stack_reads=reads, groups=groups, units=tuple(dict.fromkeys(copies.units.values())),
                         recomputed=copies.recomputed, saved=tuple(saved), copies=copies,
                         planned_on=simulation.names)
        overhead = extra / facts.total_seconds if facts.total_seconds > 0 else 0.0
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

    # Step 6: the policy chooses among the candidates no other beats on both peak and overhead.
    return policy.choose(pareto_front(candidates)), tuple(candidates)


def copy_costs(facts: RematFacts) -> dict[str, float]:
    """Predicted seconds of one copy of each forward node: its own, or, for the creator of an in-place
    unit (the key its copy goes by), the whole unit's, which is copied with it."""
    costs = {name: fact.seconds for name, fact in facts.nodes.items()}
    for member, unit in facts.units.items():
        if member == unit[0]:
            costs[member] = sum(facts.nodes[m].seconds for m in unit if m in facts.nodes)
    return costs


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


def pareto_front(candidates: Sequence[Candidate[RematPlan]]) -> list[Candidate[RematPlan]]:
    """Drop candidates that another beats on both peak and overhead (ties kept: the policy breaks them)."""
    kept = []
    for c in candidates:
        dominated = any(
            (o.peak <= c.peak and o.overhead <= c.overhead) and (o.peak < c.peak or o.overhead < c.overhead)
            for o in candidates
        )
        if not dominated:
            kept.append(c)
    return kept


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
