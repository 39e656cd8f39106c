"""Offload: saved activations wait in host memory between the forward and the backward.

What it does
------------
A tensor the forward makes and the backward reads is saved: it holds device memory from its creation to
its last backward reader. This pass copies chosen ones to host memory once the forward no longer needs
them and back ahead of their first backward reader, so the device holds them only at both ends. It is
the third way to lower a peak, beside keeping and recomputing (``remat``, ``timesteps``): it costs no
compute, only transfers over the host link, which overlap the graph's other ops where these leave them
time. It runs last, on the plan the other passes made, and moves what they chose to keep.

The copies are four operators (:mod:`memplan.ops`): ``offload`` (start the copy to the host on a side
stream), ``offload_wait_`` (the current stream waits for it; the device tensor dies after it),
``prefetch`` (allocate the device tensor again and start the copy back on another side stream) and
``prefetch_wait_`` (the current stream waits; the backward readers read its result). On a CPU there is
no host tier: the pass does nothing unless ``offload.emulate`` is set, when the same operators copy
within memory, synchronously, and the ruler and the analyses count the host copies as host memory (so
plans and their correctness are tested where there is no GPU; the time gain exists only on one).

Stages
------
(1) Eligible tensors (:func:`eligible`): see the soundness conditions.
(2) Placement (:func:`place`), for a set of tensors: each copy to the host starts right after the tensor
    is made; the copies run one after another on their stream, each taking ``bytes / host_bandwidth``
    seconds (:class:`~memplan.analysis.cost.CostRates`). Its wait goes after the first node, at or after
    the tensor's last forward reader, by which the graph's predicted time since the copy's start covers
    it (at the latest, the forward's last node); what is left is the stall, the time the current
    stream waits there. Copies back run one after another on their stream in the order of their first
    backward readers, each started as late as lets it finish before its reader and before the next one
    starts (placed from the last reader back; at the earliest, at the backward's first node); the wait
    goes just before the reader. Emulated, copies are synchronous: waits go
    right after the last forward reader and right before the first backward reader, and each copy's
    whole time is a stall.
(3) Candidates: greedily, the largest eligible tensor whose time in host memory would cover the
    position of the current peak is added to the set, and the set placed and simulated
    (:meth:`~memplan.analysis.memory_model.MemoryModel.with_intervals`: the tensor's storage lives from
    its creation to its wait, and from its prefetch to its last reader); until no tensor covers the peak
    or ``offload.max_tensors`` are taken. Each set is a candidate: its peak, and as overhead its stalls
    and four dispatches per tensor over the plan's predicted time.
(4) ``ctx.policy.choose`` picks among the Pareto-optimal candidates, as for ``remat``. By default
    (``offload.when="budget"``) the pass acts only for a budget; ``"always"`` also takes the lowest peak
    within the allowance without one. Under a budget, each rung of the pipeline's ladder is planned
    twice (:meth:`~memplan.pipeline.PassManager.ladder`): with every pass given the rung's budget, where
    this pass moves what recomputation could not reach; and with this pass given it alone, the others
    choosing as on the rung before, where it moves what recomputation could reach only at a higher
    price. The rung takes the plan that fits at the lower predicted time.

Preconditions
-------------
A training graph with graph lifetimes and fake values; run after the passes that reorder (``schedule``):
the waits are placed by position.

Soundness conditions, each with the counterexample it rules out
---------------------------------------------------------------
(a) Never a storage a random op or a collective wrote (a copy would be exact, but a dropout mask or a
    communication buffer stays where the framework that made it expects it).
(b) Only a tensor that covers all of its storage (offset 0, no gaps, no overlap) and is the only way
    the backward reaches it: every other alias of the storage is a forward node read only in the
    forward. Counterexample: a saved view of the tensor would keep reading the device storage after it
    was freed (or keep it alive, and nothing would be gained). It may be an in-place op's result
    (``tanh_`` on a linear layer's output, as ``inplace`` leaves it); its copy starts after it.
(c) No node writes into the storage after the tensor is made. Counterexample: ``h = x + 1; y = h * w;
    h.mul_(2)`` after the copy started: the backward of ``y`` would read the value before the write.
(d) Not a graph output, an input or a parameter (they stay alive anyway).
(e) The copy back is read only by backward nodes, each reading it where they read the tensor; the
    tensor's forward readers all run before its wait. Counterexample: a forward reader placed after the
    wait would read freed memory.

Left to other passes / missing
------------------------------
Which tensors to keep or recompute (``remat``, ``timesteps``): offload moves what they keep. A copy's
wait blocks the current stream, so a transfer longer than the time left for it stalls the step by the
difference; memory bandwidth the copies take from the kernels is not modelled.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

from memplan.analysis.cost import STALL, CostRates, node_cost
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory_model import MemoryModel
from memplan.analysis.peak import step_margin
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import GraphEditor, run_device
from memplan.measure import format_bytes
from memplan.ops import offload, offload_wait_, prefetch, prefetch_wait_
from memplan.opschema import is_random, mutated_args
from memplan.pipeline import PassContext, PassResult, PassStats, pass_options, register_pass
from memplan.policy import Candidate, pareto_front

__all__ = ["OffloadOptions", "Saved", "Placed", "OffloadPlan", "eligible", "place", "plan_offload", "offload_pass"]

#: four dispatches per offloaded tensor: the two copies and the two waits
_OPS_PER_TENSOR = 4


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """Options of the pass, read from ``ctx.options`` keys ``"offload.<field>"``.

    Attributes
    ----------
    when : str
        ``"budget"``: act only when the policy has a budget (the default: a saved tensor goes to the
        host where keeping and recomputing did not meet a budget cheaply); ``"always"``: also without
        one, the lowest peak within the allowance; ``"never"``.
    emulate : bool
        On a CPU, emulate the host tier (synchronous copies within memory, not counted as the device's):
        the plans and their correctness, tested without a GPU.
    min_bytes : int
        Smaller tensors are not moved: each costs four dispatches and two waits.
    max_tensors : int
        At most this many tensors are moved (the greedy search's steps).
    """

    when: str = "budget"
    emulate: bool = False
    min_bytes: int = 256 * 1024
    max_tensors: int = 64

    def __post_init__(self) -> None:
        if self.when not in ("budget", "always", "never"):
            raise ValueError(f"offload.when must be 'budget', 'always' or 'never', not {self.when!r}")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "OffloadOptions":
        return pass_options(cls, "offload", options)


@dataclasses.dataclass(frozen=True)
class Saved:
    """A tensor the pass may move: its node, storage, bytes and positions (``Liveness``'s)."""

    name: str
    storage: int
    nbytes: int
    born: int  # its storage's allocation (an in-place op may make the value later)
    created: int
    last_forward: int  # its last forward reader (``created`` when none)
    first_backward: int  # its first backward reader
    stop: int  # its storage's last reader


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where one moved tensor's copies and waits go: the wait of the copy to the host right after
    position ``wait``, the copy back right before position ``fetch`` (its wait before the first backward
    reader), and the predicted stalls of the two waits."""

    saved: Saved
    wait: int
    fetch: int
    stall_out: float
    stall_in: float


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    label: str
    placed: tuple[Placed, ...] = ()

    @property
    def changes(self) -> bool:
        return bool(self.placed)

    @property
    def moved_bytes(self) -> int:
        return sum(p.saved.nbytes for p in self.placed)


# ----------------------------------------------------------------------------------------------
# Stage 1: what may move


def _collective(node: torch.fx.Node) -> bool:
    namespace = getattr(getattr(node.target, "_schema", None), "name", "").split("::")[0]
    return namespace in ("_c10d_functional", "c10d", "c10d_functional", "_dtensor")


def eligible(graph: CapturedGraph, model: MemoryModel, min_bytes: int = 0) -> list[Saved]:
    """The saved tensors the soundness conditions allow to move, in graph order."""
    tensors: Tensors = model.tensors
    position = model.liveness.position
    phases = graph.phases
    index = {int(sid): k for k, sid in enumerate(model.storage)}
    found = []
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or phases.get(node.name) is not Phase.FORWARD:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        sids = tensors.storages_of(node.name)
        if len(sids) != 1 or sids[0] not in index:
            continue
        sid = sids[0]
        storage = tensors.storages[sid]
        size = value.numel() * value.element_size()
        if storage.external or storage.host or size < max(1, min_bytes):
            continue
        if value.storage_offset() != 0 or value.untyped_storage().nbytes() != size:
            continue
        at = position[node.name]
        backward, forward_last, ok = [], at, True
        for member in storage.members:
            alias = graph.node(member)
            if alias.op != "call_function" or phases.get(member) is not Phase.FORWARD or is_random(alias) \
                    or _collective(alias):
                ok = False
                break
            for user in alias.users:
                if user.op == "output":
                    ok = False
                elif position[user.name] > at and any(sid in tensors.storages_of(m.name) for m in mutated_args(user)):
                    ok = False  # written after the value the backward reads
                elif phases.get(user.name) is Phase.BACKWARD:
                    ok = alias is node
                    backward.append(position[user.name])
                else:
                    forward_last = max(forward_last, position[user.name])
                if not ok:
                    break
            if not ok:
                break
        if not ok or not backward:
            continue
        k = index[sid]
        found.append(Saved(node.name, sid, size, int(model.start[k]), at, forward_last, min(backward),
                           int(model.stop[k])))
    return found


# ----------------------------------------------------------------------------------------------
# Stage 2: placement


def _clock(graph: CapturedGraph, model: MemoryModel, rates: CostRates) -> list[float]:
    """``clock[i]``: the predicted seconds before position ``i`` runs (``clock[end]``: the whole graph)."""
    clock = [0.0]
    for name in model.order:
        node = graph.node(name)
        clock.append(clock[-1] + (node_cost(node, rates) if node.op == "call_function" else 0.0))
    return clock


def place(chosen: Sequence[Saved], clock: Sequence[float], last_forward: int, rates: CostRates,
          overlap: bool) -> tuple[Placed, ...]:
    """Where the copies and waits of ``chosen`` go (stage 2); ``overlap`` False: synchronous copies."""
    out: dict[str, tuple[int, float]] = {}
    busy = 0.0  # when the stream to the host is free
    for saved in sorted(chosen, key=lambda s: s.created):
        seconds = saved.nbytes / rates.host_bandwidth
        if not overlap:
            out[saved.name] = (saved.last_forward, seconds)
            continue
        start = max(clock[saved.created + 1], busy)
        done = busy = start + seconds
        # the first position at or after the last forward reader that ends once the copy is done
        after = bisect.bisect_left(clock, done, saved.last_forward + 1, last_forward + 2)
        wait = min(after, last_forward + 1) - 1
        out[saved.name] = (wait, max(0.0, done - clock[wait + 1]))
    # copies back: as late as lets each finish before its reader and before the next one starts (from
    # the last reader back), then run in that order to find what each wait still stalls
    readers = sorted(chosen, key=lambda s: (s.first_backward, s.created))
    fetches: dict[str, int] = {}
    deadline = float("inf")
    for saved in reversed(readers):
        reader = saved.first_backward
        if not overlap:
            fetches[saved.name] = reader
            continue
        latest = min(clock[reader], deadline) - saved.nbytes / rates.host_bandwidth
        fetch = max(last_forward + 1, bisect.bisect_right(clock, latest, last_forward + 1, reader + 1) - 1)
        fetches[saved.name] = fetch
        deadline = clock[fetch]
    placed = []
    busy = 0.0  # when the stream from the host is free
    for saved in readers:
        seconds = saved.nbytes / rates.host_bandwidth
        fetch = fetches[saved.name]
        if overlap:
            busy = max(clock[fetch], busy) + seconds
            stall = max(0.0, busy - clock[saved.first_backward])
        else:
            stall = seconds
        wait, stall_out = out[saved.name]
        placed.append(Placed(saved, wait, fetch, stall_out, stall))
    return tuple(sorted(placed, key=lambda p: p.saved.created))


def _timeline_peak(model: MemoryModel, placed: Sequence[Placed]) -> tuple[int, int]:
    """The peak and its position with ``placed`` moved."""
    dropped = [p.saved.storage for p in placed]
    added = []
    for p in placed:
        added.append((p.saved.born, p.wait, p.saved.nbytes))
        added.append((p.fetch, p.saved.stop, p.saved.nbytes))
    timeline = model.with_intervals(dropped, added)
    return timeline.peak, timeline.peak_index


# ----------------------------------------------------------------------------------------------
# Stage 3: candidates


def plan_offload(graph: CapturedGraph, model: MemoryModel, rates: CostRates, options: OffloadOptions,
                 overlap: bool) -> list[Candidate[OffloadPlan]]:
    """The candidates of stage 3, the untouched graph first."""
    margin = step_margin(graph)
    candidates = [Candidate(OffloadPlan("keep everything"), model.peak + margin, 0.0, "keep everything")]
    saved = eligible(graph, model, options.min_bytes)
    if not saved:
        return candidates
    clock = _clock(graph, model, rates)
    total = clock[-1]
    phases = graph.phases
    last_forward = max(i for i, name in enumerate(model.order) if phases.get(name) is Phase.FORWARD)
    # where each tensor would be off the device when moved alone (the greedy's cover test)
    alone = {s.name: place([s], clock, last_forward, rates, overlap)[0] for s in saved}
    useful = [s for s in saved if alone[s.name].fetch > alone[s.name].wait + 1]
    chosen: list[Saved] = []
    peak_at = model.peak_index
    while len(chosen) < options.max_tensors:
        covering = [s for s in useful if s not in chosen and alone[s.name].wait < peak_at < alone[s.name].fetch]
        if not covering:
            break
        chosen.append(max(covering, key=lambda s: (s.nbytes, -s.created)))
        placed = place(chosen, clock, last_forward, rates, overlap)
        peak, peak_at = _timeline_peak(model, placed)
        extra = sum(p.stall_out + p.stall_in for p in placed) + _OPS_PER_TENSOR * rates.dispatch * len(placed)
        label = f"offload {len(placed)} ({format_bytes(sum(p.saved.nbytes for p in placed))})"
        candidates.append(Candidate(OffloadPlan(label, placed), peak + margin, extra / total if total > 0 else 0.0,
                                    label))
    return candidates


# ----------------------------------------------------------------------------------------------
# apply


def apply_offload(graph: CapturedGraph, plan: OffloadPlan, model: MemoryModel) -> CapturedGraph:
    """``graph`` with the copies and waits of ``plan`` inserted and the backward readers moved to the
    copies back (see the module docstring)."""
    editor = GraphEditor(graph)
    order = [graph.node(name) for name in model.order]
    after: dict[int, list[torch.fx.Node]] = {}  # position -> nodes inserted after it so far (in order)

    def insert_after(position: int, target: Any, args: tuple, like: torch.fx.Node, phase: Phase,
                     value: Any = None) -> torch.fx.Node:
        chain = after.setdefault(position, [])
        anchor = chain[-1] if chain else order[position]
        node = editor.call(target, args, like=like, phase=phase, after=anchor, value=value)
        chain.append(node)
        return node

    for p in plan.placed:
        x = graph.node(p.saved.name)
        readers = [u for u in x.users if graph.phases.get(u.name) is Phase.BACKWARD]
        host = insert_after(p.saved.created, offload, (x,), x, Phase.FORWARD)
        host = insert_after(p.wait, offload_wait_, (host, x), x, Phase.FORWARD, value=host.meta["val"])
        host.meta[STALL] = p.stall_out
        device = x.meta["val"].device
        reader = order[p.saved.first_backward]
        fetched = editor.call(prefetch, (host, device), like=reader, phase=Phase.BACKWARD, before=order[p.fetch])
        ready = editor.call(prefetch_wait_, (fetched,), like=reader, phase=Phase.BACKWARD, before=reader,
                            value=fetched.meta["val"])
        ready.meta[STALL] = p.stall_in
        for user in readers:
            user.replace_input_with(x, ready)
    return editor.finish()


# ----------------------------------------------------------------------------------------------
# the pass


def _acts(graph: CapturedGraph, options: Mapping[str, Any]) -> bool:
    """Whether the pass would act on ``graph`` under a budget (the ladder's question, see
    :func:`~memplan.pipeline.register_pass`): a training graph with a host tier, offload not turned off,
    and a saved tensor it may move (in the graph as captured: the other passes keep fewer)."""
    own = OffloadOptions.from_mapping(options)
    if not graph.training or own.when == "never" or not (run_device(graph).type == "cuda" or own.emulate):
        return False
    graph = dataclasses.replace(graph, lifetimes="graph")
    return bool(eligible(graph, AnalysisManager(graph).get(MemoryModel), own.min_bytes))


@register_pass("offload", options=OffloadOptions.from_mapping, alone=_acts)
def offload_pass(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Move saved activations to host memory between the forward and the backward (see the module docstring)."""
    options = OffloadOptions.from_mapping(ctx.options)
    if not graph.training:
        return PassResult(graph, changed=False, notes=("inference graph: nothing is saved for backward",))
    if options.when == "never" or options.when == "budget" and ctx.policy.budget is None:
        return PassResult(graph, changed=False, notes=(f"offload.when={options.when!r}: nothing moved",))
    device = run_device(graph)
    if device.type != "cuda" and not options.emulate:
        return PassResult(graph, changed=False,
                          notes=(f"no host tier for {device.type} (offload.emulate=True emulates one)",))
    model = ctx.am.get(MemoryModel)
    rates = ctx.rates.resolved()
    candidates = plan_offload(graph, model, rates, options, overlap=device.type == "cuda")
    chosen = ctx.policy.choose(pareto_front(candidates))
    plan = chosen.plan
    if not plan.changes:
        return PassResult(graph, changed=False, plan=plan,
                          notes=(f"kept every saved tensor on the device ({len(candidates)} candidates)",))
    result = apply_offload(graph, plan, model)
    before = candidates[0].peak
    notes = (f"{plan.label} to host memory: peak {format_bytes(before)} -> {format_bytes(chosen.peak)}, "
             f"transfers +{chosen.overhead:.1%} ({len(candidates)} candidates)",)
    stats = PassStats(nodes_rewritten=_OPS_PER_TENSOR * len(plan.placed), bytes_saved=before - chosen.peak,
                      recompute_added=chosen.overhead)
    return PassResult(result, changed=True, stats=stats, notes=notes, plan=plan)
