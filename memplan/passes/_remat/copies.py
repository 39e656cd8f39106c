"""Stage 2 and the apply step of rematerialisation: stack reads, where copies go, and building them.

A plan is a list of nested :class:`RecomputeGroup`; :func:`plan_copies` places each copy just before its
earliest consumer (:class:`CopyPlan`), :func:`apply_recompute` builds them (an in-place unit replayed
whole), and :func:`plan_stack_reads` finds the values a backward reader can read from a stack that
stays alive anyway. See :mod:`memplan.passes.remat` for the stages and soundness conditions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.tensors import Tensors, last_writes, tensor_values
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import (
    GraphEditor,
    create_node,
    fake_value,
    mutated_args,
    packet_name,
    rebuilt_value,
    same_geometry,
)
from memplan.ops import replay_bernoulli_
from memplan.passes._remat.facts import RematFacts, StorageIndex, output_storages, recomputed_call
from memplan.passes._rewrite.noise_replay import REPLAY_STATE, replay_args

__all__ = [
    "StackRead",
    "plan_stack_reads",
    "apply_stack_reads",
    "retarget",
    "RecomputeGroup",
    "CopyPlan",
    "backward_reads",
    "late_reads",
    "plan_copies",
    "apply_recompute",
    "RematPlan",
    "apply_remat",
    "forward_inputs",
    "after_stack_reads",
]


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
    tensors = StorageIndex(am.get(Tensors))
    last_write = last_writes(graph, tensors)
    kept = output_storages(graph, tensors)
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


def late_reads(copies: CopyPlan, backward: Sequence[tuple[str, int, tuple[str, ...]]], limit: int) -> dict[str, set[str]]:
    """Forward value -> the backward nodes (``backward``: :func:`backward_reads`) that read its copy more
    than ``limit`` graph positions after the copy is placed: a copy made early for another copy, and held
    until them."""
    position = {name: at for name, at, _ in backward}
    found: dict[str, set[str]] = {}
    for name, values in copies.reads.items():
        for value, group in values.items():
            if position[name] - copies.anchors[(group, copies.root(value))] > limit:
                found.setdefault(value, set()).add(name)
    return found


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

    args, kwargs = recomputed_call(node, node.args, node.kwargs)  # (before remapping: what it no longer reads)
    args = torch.fx.map_arg(args, record)
    kwargs = torch.fx.map_arg(kwargs, record)
    target = node.target
    state = node.meta.get(REPLAY_STATE)
    if state is not None:  # a draw made again from the generator's state taken before it (facts: replayable)
        target, args, kwargs = replay_bernoulli_, replay_args(node, args, editor.graph.node(state)), {}
    graph = editor.gm.graph
    with graph.inserting_before(before):
        new = create_node(graph, node.op, target, args, kwargs, node.name, node.type)
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



def after_stack_reads(facts: RematFacts, reads: Sequence[StackRead]) -> RematFacts:
    """Facts once ``reads`` are planned: their values are free to save, their stacks are never recomputed."""
    nodes = dict(facts.nodes)
    for read in reads:
        nodes[read.value] = dataclasses.replace(nodes[read.value], save_bytes=0)
        nodes[read.stack] = dataclasses.replace(nodes[read.stack], recomputable=False,
                                                why_not="read back by stack reads")
    return dataclasses.replace(facts, nodes=nodes)
