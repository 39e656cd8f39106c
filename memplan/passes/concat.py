"""Concatenation in place: a ``cat``/``stack`` is filled part by part, as soon as each part is made.

What it does
------------
Eager code that collects results in a list and concatenates them at the end (``outputs.append(h)`` in
an unrolled loop, then ``torch.stack(outputs)``) holds every part until the concatenation, and then the
parts and the result together: twice the result at that moment. This pass allocates the result when
the first part appears and copies each part into its slice right after it is made; later readers of
the part read the slice instead, so the part dies at once. TensorRT's and MXNet's concat elision make
producers write into the slices; copies let any producer qualify, at the cost of one copy per part,
which the concatenation paid anyway. In training the gradient of an unrolled loop's input (the
backward of ``unbind`` stacks one gradient per step) is filled the same way.

Stages
------
(1) Candidates (:func:`plan_concats`): ``aten.cat`` and ``aten.stack`` nodes whose result is dense and
    written by nothing after, whose parts are distinct, non-external storages of the result's dtype
    made in the same phase (forward or backward) as the concatenation.
(2) Per part: it may be copied in right after it is made when nothing aliases or writes it later. Its
    later readers read its slice (``redirect``) when the slice has the part's shape and strides and
    no graph output is among them; otherwise the part keeps its readers and lives as before.
(3) Cost: the result now lives from its first part on, a redirected part dies right after its copy.
    On the simulated timeline (updated by the concatenations already chosen, largest first) a
    concatenation is kept only if the live bytes over its window fall and the peak does not rise.
(4) Apply (:func:`apply_concats`): ``new_empty_strided`` with the result's strides after the first
    part, then per part a ``select``/``slice`` of it and ``copy_``; redirected readers read the
    ``copy_`` (the value as written, defined at the write); the concatenation becomes an ``alias`` of
    the buffer, and views of the old result are re-derived to alias the buffer.

Preconditions
-------------
Graph lifetimes (the pipeline sets them). Fake values on every node (``meta["val"]``).

Soundness conditions, each with the counterexample it rules out
---------------------------------------------------------------
(a) No alias of a part is made, and nothing writes it, after it is made. Counterexample:
    ``h.add_(1)`` after ``outputs.append(h)``: the stack holds the written ``h``, an early copy would not.
(b) Nothing writes the result after the concatenation. Counterexample: ``s = stack(xs); s.mul_(2);
    y = xs[0] + 1``: a redirected reader of ``xs[0]`` would read the doubled slice.
(c) A redirected part has its slice's shape and strides. Counterexample: ``stack(xs, dim=1)[:, i]``
    is strided where ``xs[i]`` is contiguous; a later ``view`` of it would fail.
(d) A part read by a graph output keeps its own storage. Counterexample: ``return stack(hs), hs[-1]``:
    returning a slice would make the two outputs share memory, which the caller can observe.
(e) The parts are distinct storages. Counterexample: ``cat([x, x])`` or two chunks of one tensor: the
    storage can die only after its last copy.

Left to other passes
--------------------
Run after ``remat`` and ``timesteps``: they judge recomputation per storage, and a buffer written
slice by slice looks to them like a storage written after it is read.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.liveness import Liveness
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors, tensor_values
from memplan.capture import CapturedGraph
from memplan.graphutil import GraphEditor, fake_value, mutated_args
from memplan.passes.inplace import is_dense_full
from memplan.pipeline import PassContext, PassResult, PassStats, register_pass

__all__ = ["ConcatPart", "ConcatInPlace", "plan_concats", "apply_concats"]

_CONCATS = {torch.ops.aten.cat.default: False, torch.ops.aten.stack.default: True}


@dataclasses.dataclass(frozen=True)
class ConcatPart:
    """One part of a concatenation filled in place; ``redirect``: its later readers read its slice."""

    name: str
    redirect: bool


@dataclasses.dataclass(frozen=True)
class ConcatInPlace:
    """``node`` (a ``cat`` or ``stack`` along ``dim``) is filled part by part as ``parts`` are made."""

    node: str
    parts: tuple[ConcatPart, ...]
    dim: int
    stack: bool
    nbytes: int


def _slice_geometry(out: torch.Tensor, stack: bool, dim: int, start: int, length: int) -> tuple:
    """Shape and strides of ``out.select(dim, start)`` (stack) or ``out.narrow(dim, start, length)``.

    Examples
    --------
    >>> out = torch.zeros(5, 4, 3)
    >>> _slice_geometry(out, True, 1, 2, 1) == (tuple(out.select(1, 2).shape), out.select(1, 2).stride())
    True
    >>> _slice_geometry(out, False, 0, 1, 2) == (tuple(out.narrow(0, 1, 2).shape), out.narrow(0, 1, 2).stride())
    True
    """
    shape, stride = [int(n) for n in out.shape], list(out.stride())
    if stack:
        del shape[dim], stride[dim]
    else:
        shape[dim] = length
    return tuple(shape), tuple(stride)


def _concat_parts(node: torch.fx.Node, tensors: Tensors, liveness: Liveness,
                  by_name: Mapping[str, torch.fx.Node]) -> tuple[tuple[ConcatPart, ...], int, list] | None:
    """``(parts, dim, [(made, dies, nbytes) of each part whose storage dies at its copy]`` when every part
    may be copied in as soon as it is made, else None."""
    position = liveness.position
    parts, dim = node.args[0], (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
    out, stack = node.meta.get("val"), _CONCATS[node.target]
    if not isinstance(out, torch.Tensor) or not is_dense_full(out) or not isinstance(parts, (list, tuple)):
        return None
    dim %= out.dim()
    for sid in tensors.storages_of(node.name):  # the result is written by nothing but the copies
        for member in tensors.storages[sid].members:
            if any(by_name[member] in mutated_args(user) for user in by_name[member].users):
                return None
    rank = out.dim() - (1 if stack else 0)
    seen: set[int] = set()
    chosen, freed, start = [], [], 0
    for part in parts:
        value = part.meta.get("val") if isinstance(part, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dim() != rank or value.dtype != out.dtype:
            return None  # (also rules out cat's legacy empty 1-d parts)
        sids = tensors.storages_of(part.name)
        if len(sids) != 1 or sids[0] in seen or tensors.storages[sids[0]].external:
            return None
        seen.add(sids[0])
        storage = tensors.storages[sids[0]]
        p = position[part.name]
        later = []  # readers of the part after it is made, other than the concatenation
        for member in storage.members:
            if position.get(member, -1) > p:
                return None  # an alias of the part made (or a write into it) after it
            for user in by_name[member].users:
                if user is node or (user.op != "output" and position[user.name] <= p):
                    continue
                if member != part.name or user.op != "output" and part in mutated_args(user):
                    return None  # read later through another alias, or written
                later.append(user)
        length = 1 if stack else int(value.shape[dim])
        same = (tuple(value.shape), value.stride()) == _slice_geometry(out, stack, dim, start, length)
        start += length
        redirect = not later or (same and all(user.op != "output" for user in later))
        chosen.append(ConcatPart(part.name, redirect))
        if redirect:
            freed.append((p, liveness.intervals[sids[0]].end, storage.nbytes))
    return tuple(chosen), dim, freed


def plan_concats(graph: CapturedGraph, am: AnalysisManager) -> tuple[ConcatInPlace, ...]:
    """The concatenations to fill in place (stage 5): largest first, each only where the simulated live
    bytes over its window fall and the peak does not rise (judged on the timeline as updated by the
    ones already chosen)."""
    tensors, liveness = am.get(Tensors), am.get(Liveness)
    position = liveness.position
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    live = [event.live for event in am.get(PeakSimulation).timeline]
    candidates = []
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CONCATS or node.name not in graph.phases:
            continue
        found = _concat_parts(node, tensors, liveness, by_name)
        if found is not None and all(graph.phases.get(part.name) == graph.phases[node.name] for part in found[0]):
            nbytes = tensors.storages[tensors.storages_of(node.name)[0]].nbytes
            candidates.append((nbytes, position[node.name], node, found))
    chosen = []
    for nbytes, at, node, (parts, dim, freed) in sorted(candidates, key=lambda c: (-c[0], c[1])):
        first = min(position[part.name] for part in parts)
        # The result lives from its first part on instead of from the concatenation; a redirected part
        # dies right after its copy instead of at its last reader.
        last = max([at] + [dies for _, dies, _ in freed])
        last = min(last, len(live) - 1)
        # The change in live bytes over the window, as differences between neighbouring positions (a
        # part's range summed position by position was quadratic in the length of an unrolled loop).
        steps = [0] * (last - first + 2)
        steps[0] += nbytes
        steps[max(at, first) - first] -= nbytes
        # A redirected part's later readers read the result: it lives until the last of them, past its
        # own end when the parts outlive the concatenation (each step's state, saved for the backward,
        # stacked into an output the loss reads at once).
        own_end = min(liveness.intervals[tensors.storages_of(node.name)[0]].end, len(live) - 1)
        if last > own_end:
            steps[max(own_end + 1, first) - first] += nbytes
            steps[last + 1 - first] -= nbytes
        for made, dies, size in freed:
            end = min(dies, len(live) - 1)
            if made + 1 <= end:
                steps[made + 1 - first] -= size
                steps[end + 1 - first] += size
        window = live[first:last + 1]
        new = [a + b for a, b in zip(window, itertools.accumulate(steps))]
        if max(new) >= max(window) or max(new) > max(live):
            continue
        live[first:last + 1] = new
        chosen.append(ConcatInPlace(node.name, parts, dim, _CONCATS[node.target], nbytes))
    return tuple(chosen)


def apply_concats(graph: CapturedGraph, concats: tuple[ConcatInPlace, ...],
                  tensors: Tensors | None = None) -> CapturedGraph:
    """Allocate each concatenation before its first part, copy every part into its slice right after
    it is made (its later readers read the slice), and read the result through an alias made where the
    concatenation was. ``tensors``: the :class:`Tensors` of ``graph`` when the caller has them."""
    if not concats:
        return graph
    tensors = tensors if tensors is not None else AnalysisManager(graph).get(Tensors)
    # The nodes aliasing a replaced result (its views, in-place writes into it): their values move.
    aliasing = {member for concat in concats for sid in tensors.storages_of(concat.node)
                for member in tensors.storages[sid].members if member != concat.node}
    editor = GraphEditor(graph)
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    order = {n.name: i for i, n in enumerate(graph.gm.graph.nodes)}
    moved: set[StorageWeakRef] = set()  # storages of the replaced concatenations' results
    for concat in concats:
        node = by_name[concat.node]
        out = node.meta["val"]
        parts = [by_name[part.name] for part in concat.parts]
        first = min(parts, key=lambda part: order[part.name])
        buffer = editor.call(
            torch.ops.aten.new_empty_strided.default, (first, list(out.shape), list(out.stride())),
            {"dtype": out.dtype, "device": out.device}, like=node, after=first,
        )
        start = 0
        for index, (part, spec) in enumerate(zip(parts, concat.parts)):
            anchor = buffer if part is first else part
            if concat.stack:
                view = editor.call(torch.ops.aten.select.int, (buffer, concat.dim, index), like=part, after=anchor)
            else:
                length = int(part.meta["val"].shape[concat.dim])
                view = editor.call(torch.ops.aten.slice.Tensor, (buffer, concat.dim, start, start + length),
                                   like=part, after=anchor)
                start += length
            # copy_ returns its ``self``, of the part's shape: the slice's own fake value, with no dispatch.
            written = view.meta["val"] if _same_shape(view, part) else None
            copy = editor.call(torch.ops.aten.copy_.default, (view, part), like=part, after=view, value=written)
            if spec.redirect:
                # read through the copy: the value as written, defined at the write
                part.replace_all_uses_with(copy, delete_user_cb=lambda user: user not in (node, copy, buffer))
        result = editor.call(torch.ops.aten.alias.default, (buffer,), like=node, before=node)
        node.replace_all_uses_with(result)
        editor.erase(node)
        moved.add(StorageWeakRef(out.untyped_storage()))
    # Views of the old results must alias the buffers: their values again, in graph order (an alias of
    # an alias after it).
    for later in sorted((by_name[name] for name in aliasing), key=lambda n: order[n.name]):
        if later.op == "call_function" and any(StorageWeakRef(v.untyped_storage()) in moved
                                               for _, v in tensor_values(later)):
            later.meta["val"] = fake_value(later.target, later.args, later.kwargs)
    return editor.finish()


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Both nodes hold fake tensors of one shape and dtype (a copy between them needs no broadcast)."""
    x, y = a.meta.get("val"), b.meta.get("val")
    return (isinstance(x, FakeTensor) and isinstance(y, FakeTensor) and x.shape == y.shape
            and x.dtype == y.dtype and x.device == y.device)


# ----------------------------------------------------------------------------------------------
# the pass


@register_pass("concat")
def concat(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Fill concatenations part by part (see the module docstring)."""
    concats = plan_concats(graph, ctx.am)
    if not concats:
        return PassResult(graph, changed=False, notes=("no concatenation whose parts may be copied in early lowers the timeline",))
    peak_before = ctx.am.get(PeakSimulation).peak
    new = apply_concats(graph, concats, ctx.am.get(Tensors))
    analyses = AnalysisManager(new)  # handed to the pipeline, which would compute them again
    peak_after = analyses.get(PeakSimulation).peak
    stats = PassStats(nodes_rewritten=len(concats), bytes_saved=peak_before - peak_after)
    return PassResult(new, changed=True, stats=stats, notes=(f"{len(concats)} concatenation(s) filled in place",),
                      plan=concats, analyses=analyses)
