"""Dropout's noise drawn again in the backward from the generator's state, instead of kept from the forward.

What it does
------------
On a CPU, ``F.dropout(x, p)`` in training runs ``noise = empty_like(x).bernoulli_(1 - p).div_(1 - p)`` and
returns ``x * noise``; the product's backward reads ``noise``, so a float tensor the size of ``x`` is held
from the forward to the backward for every dropout (two per transformer layer, and a user's own masks
written the same way). ``torch.utils.checkpoint`` recomputes such a draw by saving the generator's state
and restoring it. The rewrite does the same for the noise alone:

* in the forward, ``state = memplan::rng_state(noise)`` right before the draw (a copy of the generator's
  state: 5 KiB on a CPU, whatever the tensor's size);
* in the backward, before the first reader of the noise: a tensor of the same shape, strides and dtype,
  ``memplan::replay_bernoulli_(new, q, state)`` and the same in-place ops after the draw (``div_(q)``), and
  the backward's readers read that.

The forward's noise then dies after its last forward reader (the product). The forward makes its noise
with ``empty_strided`` of the activation's shape and strides instead of ``empty_like(x)``: the same
tensor, but the draw then reads no value, and ``chunk`` can draw it whole before a loop that reads it in
slices (attention's probabilities times their dropout noise). The backward's noise is marked as the
forward's twin (:data:`~memplan.passes._rewrite.remade.REMAKES`).

Why the bits are the same: the draw runs the same kernel on a tensor of the same shape and strides from
the same generator state, which is what makes ``torch.utils.checkpoint``'s recomputation equal to the
forward's (``preserve_rng_state``). The replay puts the generator back where it found it, so no later draw
moves. ``rng_state`` is tagged as drawing from the RNG, so every pass keeps it where the draw's own state is:
random ops keep their relative order (schedule), are never recomputed (remat) and never split (chunk).

Soundness conditions (each with the counterexample the finder refuses)
--------------------------------------------------------------------
* The draw is ``bernoulli_.float`` on a fresh ``empty_like``/``empty``/``new_empty`` tensor (``F.dropout2d``'s
  and stochastic depth's noise of shape ``(N, C, 1, 1)`` or ``(N, 1, 1, 1)``), from the default generator
  (no ``generator=``: a generator the user passes is not the one ``rng_state`` reads), on a CPU tensor.
* Every write into the noise's storage is the draw or an in-place scaling by a number after it
  (``div_.Scalar``, ``mul_.Scalar``), all in the forward, one after the other on the value before;
  every alias of the storage is one of those results. Counterexample: ``noise[0] = 1`` after the draw (a
  write the chain does not replay), or a view of the noise the backward reads.
* The backward reads the noise (otherwise nothing is held), and never writes into it; no output is an alias.
* The noise is larger than the state (5 KiB on a CPU): a mask per channel or per example (``F.dropout2d``,
  stochastic depth) is kept as it is, and remat can recompute the product from it.
* Kept only if the simulated peak does not rise.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase
from memplan.ops import replay_bernoulli_, rng_state, rng_state_bytes
from memplan.opschema import mutated_args
from memplan.passes._chunk.graphs import fake_mode_of, refresh_aliases
from memplan.passes._rewrite.remade import REMAKES, Remade

__all__ = ["NoiseReplay", "find_noise_replay", "apply_noise_replay", "replayable_draws",
           "replay_args", "REPLAY_STATE"]

#: The meta key of a draw whose generator state the rewrite took right before it: the state node's name.
REPLAY_STATE = "replay_state"

_DRAW = torch.ops.aten.bernoulli_.float
_FRESH = (torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default)
_SCALINGS = (torch.ops.aten.div_.Scalar, torch.ops.aten.mul_.Scalar)


@dataclasses.dataclass(frozen=True)
class NoiseReplay:
    """The noise ``chain[-1]`` (``fresh``, drawn by ``draw``, then scaled by ``chain[1:]``) drawn again in the backward."""

    fresh: str
    draw: str
    chain: tuple[str, ...]  # the draw and the scalings after it, in order: the values of the noise's storage

    def claimed(self) -> set[str]:
        return {self.fresh, *self.chain}

    def __str__(self) -> str:
        return f"noise {self.chain[-1]}: drawn again in the backward from the generator's state"


def find_noise_replay(graph: CapturedGraph) -> list[NoiseReplay]:
    """The forward's fresh Bernoulli draws whose noise the backward reads (see the module docstring)."""
    if not graph.training:
        return []
    phases = graph.phases
    tensors: Tensors | None = None
    position: dict[torch.fx.Node, int] | None = None
    found = []
    for node in graph.gm.graph.nodes:
        if node.target is not _DRAW or phases.get(node.name) is not Phase.FORWARD:
            continue
        if node.kwargs.get("generator") is not None or set(node.kwargs) - {"generator", "p"}:
            continue
        fresh, q = node.args[0], _probability(node)
        if not isinstance(fresh, torch.fx.Node) or fresh.target not in _FRESH or not isinstance(q, float):
            continue
        value = fresh.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            continue
        if value.numel() * value.element_size() <= rng_state_bytes(value.device):
            continue  # a mask per channel or per example: smaller than the state that would replace it
        if tensors is None:
            tensors = AnalysisManager(graph).get(Tensors)
            position = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
        storages = tensors.storages_of(fresh.name)
        if len(storages) != 1:
            continue
        members = sorted((graph.node(m) for m in tensors.storages[storages[0]].members), key=position.__getitem__)
        chain = _chain(members, fresh, node, phases)
        if chain is None:
            continue
        readers = [u for m in members for u in m.users if phases.get(u.name) is Phase.BACKWARD]
        if not readers or any(u.op == "output" for m in members for u in m.users):
            continue
        if any(m in mutated_args(u) for u in readers for m in members):
            continue
        found.append(NoiseReplay(fresh.name, node.name, tuple(n.name for n in chain)))
    return found


def _probability(draw: torch.fx.Node) -> object:
    """The draw's ``p``, as an argument or by the schema's default (``bernoulli_(x)`` draws with 0.5)."""
    if len(draw.args) > 1:
        return draw.args[1]
    if "p" in draw.kwargs:
        return draw.kwargs["p"]
    return next(a.default_value for a in _DRAW._schema.arguments if a.name == "p")


def _chain(members: list[torch.fx.Node], fresh: torch.fx.Node, draw: torch.fx.Node,
           phases: dict) -> list[torch.fx.Node] | None:
    """The draw and the scalings after it, when they are every alias of the storage besides ``fresh``."""
    if len(members) < 2 or members[0] is not fresh or members[1] is not draw:
        return None
    chain = [draw]
    for member in members[2:]:
        if member.target not in _SCALINGS or phases.get(member.name) is not Phase.FORWARD \
                or member.args[0] is not chain[-1] or not isinstance(member.args[1], (int, float)) or member.kwargs:
            return None
        chain.append(member)
    return chain


def apply_noise_replay(graph: CapturedGraph, patterns: list[NoiseReplay], state: dict) -> list[Remade]:
    """Take each pattern's state before its draw and draw its noise again before its first backward
    reader (edits ``graph`` and ``state``); what each added, for :func:`~memplan.passes._rewrite.remade.undo`."""
    order = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
    done = []
    for pattern in patterns:
        fresh, chain = graph.node(pattern.fresh), [graph.node(n) for n in pattern.chain]
        members = [fresh, *chain]
        readers = [(u, m) for m in members for u in list(m.users) if state["phases"].get(u.name) is Phase.BACKWARD]
        first = min((u for u, _ in readers), key=order.__getitem__)
        remade = Remade(graph, state)
        held = fresh.meta["val"]
        shape = (list(held.shape), list(held.stride()))
        layout = {"dtype": held.dtype, "device": held.device}
        # made from its shape alone, the noise reads no value: chunk draws it whole before a loop that
        # reads it in slices (see the module docstring)
        remade.retarget(fresh, torch.ops.aten.empty_strided.default, shape, layout)
        taken = remade.insert(chain[0], rng_state, (fresh,), phase=Phase.FORWARD)
        remade.mark(chain[0], REPLAY_STATE, taken.name)  # remat may replay the draw too (see replayable_draws)
        again = remade.insert(first, torch.ops.aten.empty_strided.default, shape, layout)
        again = remade.insert(first, replay_bernoulli_, (again, _probability(chain[0]), taken))
        for scaling in chain[1:]:
            again = remade.insert(first, scaling.target, (again, *scaling.args[1:]))
        for reader, member in readers:
            remade.redirect(reader, member, again)
        remade.mark(again, REMAKES, chain[-1].name)
        refresh_aliases(graph.gm.graph, remade.made[1:], fake_mode_of(graph.gm.graph))
        done.append(remade)
    return done




def replayable_draws(nodes: list[torch.fx.Node], position: dict[str, int], by_name) -> frozenset[str]:
    """The draws that can be made again from a state taken right before them: the ``rng_state`` named by
    the draw's ``REPLAY_STATE`` still reads the draw's tensor, and no random op runs between the two in
    ``nodes`` (graph order; ``position`` by name, ``by_name`` a node by name). remat recomputes these
    with :func:`replay_args`, as an in-place unit's writer."""
    from memplan.opschema import is_random

    found = set()
    for node in nodes:
        name = node.meta.get(REPLAY_STATE) if node.target is _DRAW else None
        if name is None or name not in position:
            continue
        state = by_name(name)
        if state.target is not rng_state or state.args[0] is not node.args[0]:
            continue
        start, end = position[name], position[node.name]
        if start < end and not any(is_random(n) for n in nodes[start + 1:end]):
            found.add(node.name)
    return frozenset(found)


def replay_args(draw: torch.fx.Node, args: tuple, state: torch.fx.Node) -> tuple:
    """The arguments of ``replay_bernoulli_`` that make ``draw`` again (``args``: the draw's, remapped)."""
    return (args[0], _probability(draw), state)
