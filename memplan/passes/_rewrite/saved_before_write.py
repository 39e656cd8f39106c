"""A value autograd copies before an in-place op overwrites it: the op made out of place instead.

What it does
------------
``c = clone(v); w = op_(v, ...)``: when an in-place op overwrites a value its backward (or another
op's) still needs, autograd saves a copy made just before the write. ``nn.GRUCell``'s decomposition
does it twice a step (``clone`` of the new-gate slice before ``mul_``, of ``h - n`` before ``mul_``).
The rewrite runs the op out of place, ``w' = op(v, ...)``, points what read ``w`` at ``w'`` and what
read the copy at ``v`` itself, which now keeps its values: the same values everywhere, the same bytes
(one fresh tensor either way), and no read of a storage before a later write into it. That read is
what kept the storage from being recomputed whole (an in-place unit, see
:func:`memplan.passes._remat.facts.RematFacts`) and the copy from being recomputed at all: every
step's copies and gate buffers stayed saved until the backward.

Soundness conditions (each with the counterexample the finder refuses)
--------------------------------------------------------------------
* ``v`` keeps its values from the copy on: no write into its storage touches ``v``'s elements after
  the copy, except ``w`` and writes through ``w``'s result (which now go to ``w'``). Counterexample:
  ``c = v.clone(); v.mul_(2); v.add_(1)`` where the ``add_`` reads ``v`` by another alias: after the
  rewrite it would write into ``v``, which the copy's readers read.
* Nothing reads ``v``'s elements of the old storage after ``w`` but through ``w``'s result: those
  reads saw the written values. Counterexample: ``c = x[:, 0].clone(); x[:, 0].mul_(2); y = x.sum()``
  reads the written column through ``x``; after the rewrite it would read the old one.
* The copy's readers and ``w``'s readers run on the new layouts (``v`` is often a slice, the copy is
  contiguous; ``w'`` is laid out as its op lays a result out): checked by running each reader, and the
  views down from it, on the fake values (:func:`~memplan.passes._rewrite.region.runs_on`).
* ``w`` writes its first argument only, and ``op`` is its out-of-place overload (``mul_.Tensor`` ->
  ``mul.Tensor``), with the same arguments, giving the same dtype and shape. Counterexample: a
  bfloat16 ``v.mul_(w)`` with a float32 ``w`` keeps bfloat16; ``v.mul(w)`` is float32.
* What derives from ``w``'s result stays within ``v``'s elements: it will alias ``w'``. Counterexample:
  an ``as_strided`` of the result that reaches the rest of the storage.
* The copy is a plain ``clone`` of ``v`` itself; ``v``'s storage is not an input or a parameter (the
  caller sees a write into it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx

from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase
from memplan.opschema import is_pure_view, mutated_args
from memplan.passes._chunk.graphs import fake_call, fake_mode_of, refresh_aliases, same_layouts
from memplan.passes._rewrite.region import forward_nodes, runs_on
from memplan.pipeline import element_span, elements_overlap

__all__ = ["SavedBeforeWrite", "find_saved_before_write", "apply_saved_before_write"]


@dataclasses.dataclass(frozen=True)
class SavedBeforeWrite:
    """``clone`` of ``value`` read in place of it, taken before ``write`` overwrites it in place."""

    clone: str
    write: str
    value: str

    def claimed(self) -> set[str]:
        return {self.clone, self.write}

    def __str__(self) -> str:
        return f"copy saved before a write {self.clone}: {self.write} runs out of place, {self.value} read instead"


def _out_of_place(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    """The out-of-place overload of an in-place aten op (``mul_.Tensor`` -> ``mul.Tensor``), if any."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if overload is None or any(a.alias_info is not None and a.alias_info.is_write for a in overload._schema.arguments):
        return None
    return overload


def find_saved_before_write(graph: CapturedGraph) -> list[SavedBeforeWrite]:
    """Stage 1: each ``clone(v)`` followed by an in-place op writing ``v`` (see the module docstring)."""
    am = AnalysisManager(graph)
    tensors, liveness = am.get(Tensors), am.get(Liveness)
    position = liveness.position
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    mode = fake_mode_of(graph.gm.graph)
    found = []
    for write in forward_nodes(graph):
        written = mutated_args(write)
        if len(written) != 1 or not write.args or write.args[0] is not written[0]:
            continue
        value = written[0]
        storages = tensors.storages_of(value.name)
        op = _out_of_place(write)
        if len(storages) != 1 or op is None:
            continue
        (sid,) = storages
        if tensors.storages[sid].external:
            continue  # a write into the caller's tensor (an input, a parameter) is seen outside: kept
        at = position[write.name]
        clones = [u for u in value.users if u.target is torch.ops.aten.clone.default and len(u.args) == 1
                  and graph.phases.get(u.name) is Phase.FORWARD and position.get(u.name, at) < at]
        if len(clones) != 1:
            continue
        clone = clones[0]
        if any(u.op == "output" for u in clone.users):
            continue
        chain = _chain(write, sid, tensors)
        if not _keeps_values(sid, value.meta.get("val"), position[clone.name], at, chain, tensors, by_name, position):
            continue
        new = fake_call(op, write.args, write.kwargs, mode)
        was = write.meta.get("val")
        if not (isinstance(new, torch.Tensor) and isinstance(was, torch.Tensor) and new.dtype == was.dtype
                and new.shape == was.shape):
            continue  # out of place, the op would promote or broadcast where in place it keeps self's
        if not all(_within(by_name[name].meta.get("val"), value.meta.get("val")) for name in chain):
            continue  # a view of the result reaching other elements of the storage (as_strided)
        if not all(runs_on(u, clone, value.meta["val"], mode) for u in clone.users) \
                or not all(runs_on(u, write, new, mode) for u in write.users):
            continue
        found.append(SavedBeforeWrite(clone.name, write.name, value.name))
    return found


def _within(view, value) -> bool:
    """Whether every element ``view`` can touch lies within ``value``'s span (by element spans)."""
    inner, outer = element_span(view), element_span(value)
    return inner is not None and outer is not None and outer[0] <= inner[0] and inner[1] <= outer[1]


def _chain(write: torch.fx.Node, sid: int, tensors: Tensors) -> set[str]:
    """``write`` and the nodes aliasing its storage that derive from its result (views of it, writes
    into those): after the rewrite they alias ``w'``."""
    chain = {write.name}
    pending = [write]
    while pending:
        node = pending.pop()
        for user in node.users:
            if user.name in chain or sid not in tensors.storages_of(user.name):
                continue
            if user.args and user.args[0] is node:
                chain.add(user.name)
                pending.append(user)
    return chain


def _keeps_values(sid: int, value: torch.Tensor, copied: int, written: int, chain: set[str], tensors: Tensors,
                  by_name, position) -> bool:
    """The first two soundness conditions: after the copy, ``v``'s elements are written only by the
    chain, and after ``write`` read only through it."""

    def touches(node: torch.fx.Node) -> bool:
        return elements_overlap(value, node.meta.get("val"))

    for member in tensors.storages[sid].members:
        node = by_name[member]
        if member in chain:
            continue
        for target in mutated_args(node) if node.op == "call_function" else ():
            if sid in tensors.storages_of(target.name) and position.get(member, -1) > copied and touches(target):
                return False
        if not touches(node):
            continue
        for user in node.users:
            if user.op == "output":
                return False  # the graph hands the storage out: whoever reads it reads it after everything
            if is_pure_view(user) or user.name in chain:
                continue
            if position.get(user.name, -1) > written:
                return False
    return True


def apply_saved_before_write(graph: CapturedGraph, patterns: Sequence[SavedBeforeWrite], state: dict) -> None:
    """Run each pattern's ``write`` out of place and read its ``value`` where the copy was read (in place
    on ``graph.gm``).

    A write node itself becomes the out-of-place op (same name, same readers): what reads it now reads a
    fresh tensor, and the views downstream are given fake values that alias it, in one walk of the graph
    for all the patterns."""
    gm = graph.gm
    mode = fake_mode_of(gm.graph)
    starts, relaid = [], []
    for pattern in patterns:
        write, clone, value = graph.node(pattern.write), graph.node(pattern.clone), graph.node(pattern.value)
        old = write.meta.get("val")
        write.target = _out_of_place(write)
        write.meta["val"] = fake_call(write.target, write.args, write.kwargs, mode)
        clone.replace_all_uses_with(value)
        gm.graph.erase_node(clone)
        for key in ("phases", "sources", "seq_nr"):
            state[key].pop(pattern.clone, None)
        starts += [write, value]
        if not same_layouts(old, write.meta["val"]):
            relaid.append(write)
    refresh_aliases(gm.graph, starts, mode, relaid=relaid)
