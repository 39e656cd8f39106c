"""Dropout's output made again in the backward from its mask, where the backward keeps its input anyway.

What it does
------------
``out, mask = native_dropout(x, p, True)`` (CUDA's fused dropout; what ``F.dropout`` runs on a GPU) keeps
``mask`` for its own backward, one byte an element. When the op after it saves ``out`` too (the product of
attention probabilities with the values: ``dropout(softmax(s)) @ v``), and the backward keeps ``x`` anyway
(the softmax's output, which its backward reads), ``out`` is four more bytes an element held from the
forward to the backward. The rewrite makes it again where the backward first reads it:
``native_dropout_backward(x, mask, 1 / (1 - p))``, which computes ``x * mask * scale`` as the forward did,
and points the backward's readers of ``out`` at that. ``out`` then dies after its last forward reader.
No random number is drawn again: the mask is the forward's.

Why the values are the same bits: both kernels compute ``x * m * s`` with ``m`` in {0, 1} and ``s`` the
float ``1 / (1 - p)``: ``x * 1 * s`` and ``x * 0 * s`` round once either way, to the same value and sign.
Checked for ``float32`` and ``float64`` only (half precision kernels may round in another order).

Soundness conditions (each with the counterexample the finder refuses)
--------------------------------------------------------------------
* ``x`` keeps its values until the backward: no write into its storage after the dropout.
  Counterexample: ``y = dropout(h); h.mul_(2)``: the backward would scale the written ``h``.
* The backward reads ``x`` anyway (another of its readers is a backward node): otherwise keeping ``x``
  instead of ``out`` saves nothing. Kept only if the simulated peak does not rise.
* ``out`` is read by the backward as it is or through forward views of it (``expand``, ``view``,
  ``transpose``: each view the backward reads is made again on the new value), no write touches its
  storage, and ``native_dropout_backward`` gives it back with the same shape, strides and dtype.
* The dropout is in training (``train=True``) with ``0 < p < 1``, on ``float32`` or ``float64``.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.tensors import Tensors, last_writes
from memplan.capture import CapturedGraph, Phase
from memplan.opschema import is_pure_view
from memplan.passes._chunk.graphs import fake_call, fake_mode_of, refresh_aliases

__all__ = ["DropoutFromMask", "find_dropout_from_mask", "apply_dropout_from_mask"]

_DROPOUT = torch.ops.aten.native_dropout.default
_DROPOUT_BACKWARD = torch.ops.aten.native_dropout_backward.default


@dataclasses.dataclass(frozen=True)
class DropoutFromMask:
    """``out`` (item 0 of ``dropout``) made again in the backward from ``input`` and ``mask`` (item 1)."""

    dropout: str
    out: str
    mask: str
    input: str
    scale: float
    views: tuple[str, ...] = ()  # the views of ``out`` the backward reads, each of the one before or of out

    def claimed(self) -> set[str]:
        return {self.dropout, self.out, *self.views}

    def __str__(self) -> str:
        return f"dropout {self.dropout}: its output made again in the backward from its mask"


def find_dropout_from_mask(graph: CapturedGraph) -> list[DropoutFromMask]:
    """The training dropouts whose output the backward reads and whose input it keeps (see the module docstring)."""
    if not graph.training:
        return []
    phases = graph.phases
    tensors: Tensors | None = None
    last_write: dict[int, int] | None = None  # storage -> position of the last node writing into it
    position = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
    found = []
    for node in graph.gm.graph.nodes:
        if node.target is not _DROPOUT or phases.get(node.name) is not Phase.FORWARD:
            continue
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if train is not True or not isinstance(p, float) or not 0.0 < p < 1.0 or not isinstance(value, torch.Tensor) \
                or value.dtype not in (torch.float32, torch.float64):
            continue
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if set(items) != {0, 1} or len(items) != len(node.users):
            continue
        out, mask = items[0], items[1]
        if not any(phases.get(u.name) is Phase.BACKWARD for u in x.users):
            continue  # keeping x instead of out would keep as much
        if tensors is None:
            tensors = AnalysisManager(graph).get(Tensors)
            last_write = last_writes(graph, tensors)
        x_storages = set(tensors.storages_of(x.name))
        out_storages = set(tensors.storages_of(out.name))
        if any(last_write.get(sid, -1) > position[node] for sid in x_storages) \
                or any(sid in last_write for sid in out_storages):
            continue  # x written after the dropout, or out written at all
        views = _views_read_backward(graph, out, [graph.node(m) for sid in out_storages
                                                   for m in tensors.storages[sid].members])
        if views is None or not views[1]:
            continue
        scale = 1.0 / (1.0 - p)
        remade = fake_call(_DROPOUT_BACKWARD, (x, mask, scale), {}, fake_mode_of(graph.gm.graph))
        held = out.meta.get("val")
        if not isinstance(held, torch.Tensor) or (remade.shape, remade.stride(), remade.dtype) != \
                (held.shape, held.stride(), held.dtype):
            continue
        found.append(DropoutFromMask(node.name, out.name, mask.name, x.name, scale, views[0]))
    return found


def _views_read_backward(graph: CapturedGraph, out: torch.fx.Node,
                         members: list[torch.fx.Node]) -> tuple[tuple[str, ...], bool] | None:
    """The forward views of ``out`` (in graph order) on the way to every alias the backward reads, and
    whether the backward reads any; None when a forward alias is not such a view, or is an output. (The
    dropout's own tuple aliases the storage too; backward aliases are readers, views made from these.)"""
    phases = graph.phases
    chain: dict[torch.fx.Node, torch.fx.Node] = {}  # view -> what it views
    dropout = out.args[0]
    for member in members:
        if member is out or member is dropout or phases.get(member.name) is Phase.BACKWARD:
            continue  # the op's tuple; a backward node is a reader of one of the aliases
        source = member.args[0] if member.args else None
        if not is_pure_view(member) or phases.get(member.name) is not Phase.FORWARD or not isinstance(source, torch.fx.Node):
            return None
        chain[member] = source
    read = False
    needed: set[torch.fx.Node] = set()
    for alias in [out, *chain]:
        users = list(alias.users)
        if any(u.op == "output" for u in users):
            return None
        if any(phases.get(u.name) is Phase.BACKWARD for u in users):
            read = True
            walk = alias
            while walk is not out:
                if walk not in chain:
                    return None
                needed.add(walk)
                walk = chain[walk]
    order = [n for n in graph.gm.graph.nodes if n in needed]
    return tuple(n.name for n in order), read


def apply_dropout_from_mask(graph: CapturedGraph, patterns: list[DropoutFromMask], state: dict) -> list[torch.fx.Node]:
    """Insert each pattern's ``native_dropout_backward`` before the first backward reader of its output and
    point the backward's readers at it (edits ``graph`` and ``state``); the new nodes."""
    gm = graph.gm
    mode = fake_mode_of(gm.graph)
    made = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for pattern in patterns:
        out, x, mask = graph.node(pattern.out), graph.node(pattern.input), graph.node(pattern.mask)
        aliases = [out, *(graph.node(v) for v in pattern.views)]
        readers = {a: [u for u in a.users if state["phases"].get(u.name) is Phase.BACKWARD] for a in aliases}
        first = min((u for users in readers.values() for u in users), key=order.__getitem__)

        def insert(target, args):  # noqa: ANN001, ANN202 - one backward node before the first reader
            with gm.graph.inserting_before(first):
                new = gm.graph.call_function(target, args)
            new.meta["val"] = fake_call(target, args, {}, mode)
            state["phases"][new.name] = Phase.BACKWARD
            for key in ("sources", "seq_nr"):
                if first.name in state[key]:
                    state[key][new.name] = state[key][first.name]
            return new

        again = {out: insert(_DROPOUT_BACKWARD, (x, mask, pattern.scale))}
        for view in aliases[1:]:  # in graph order: each views out or a view made before it
            again[view] = insert(view.target, (again[view.args[0]], *view.args[1:]))
        for alias, users in readers.items():
            for reader in users:
                reader.replace_input_with(alias, again[alias])
        # the readers that alias what they read (a backward transpose of a view) alias the new value now
        refresh_aliases(gm.graph, list(again.values()), mode)
        made.append(again[out])
    return made
