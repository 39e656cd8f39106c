"""What a backward peephole adds to a joint graph, and how it is taken back (rewrites (i) and (j)).

A peephole makes a value again in the backward and points the backward's readers at it. :class:`Remade`
records the nodes it inserts (each with its fake value, phase, source and sequence number taken from the
node it is inserted before), the readers it redirects, the calls it changes and the marks it sets in nodes' metadata, so that :func:`undo` can put the graph back
when the simulated peak rose.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from memplan.capture import CapturedGraph, Phase
from memplan.passes._chunk.graphs import fake_call, fake_mode_of

__all__ = ["Remade", "undo", "REMAKES"]

#: The meta key of a backward node whose value is a forward node's, bit for bit (the noise a dropout's
#: backward draws again): that forward node's name. chunk's backward loop reads it in the forward value's
#: place, so the forward's value need not be kept for the loop's recomputation.
REMAKES = "memplan_remakes"


@dataclasses.dataclass
class Remade:
    """The nodes one remake added, in order, and the readers it redirected ``(reader, old input, new input)``."""

    graph: CapturedGraph
    state: dict  # the rewrite pass's phases, sources and sequence numbers being edited
    made: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    redirected: list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]] = dataclasses.field(default_factory=list)
    marked: list[tuple[torch.fx.Node, str]] = dataclasses.field(default_factory=list)  # (node, meta key) set
    # (node, its target, args and kwargs before) for each call :meth:`retarget` changed
    retargeted: list[tuple[torch.fx.Node, Any, tuple, dict]] = dataclasses.field(default_factory=list)

    def insert(self, before: torch.fx.Node, target: Any, args: tuple, kwargs: dict | None = None,
               phase: Phase = Phase.BACKWARD) -> torch.fx.Node:
        """A call of ``target`` inserted before ``before``, its fake value computed, in ``phase``."""
        graph = self.graph.gm.graph
        with graph.inserting_before(before):
            new = graph.call_function(target, args, kwargs or {})
        new.meta["val"] = fake_call(target, args, kwargs or {}, fake_mode_of(graph))
        self.state["phases"][new.name] = phase
        for key in ("sources", "seq_nr"):
            if before.name in self.state[key]:
                self.state[key][new.name] = self.state[key][before.name]
        self.made.append(new)
        return new

    def mark(self, node: torch.fx.Node, key: str, value: Any) -> None:
        """``node.meta[key] = value``, taken back by :func:`undo`."""
        node.meta[key] = value
        self.marked.append((node, key))

    def retarget(self, node: torch.fx.Node, target: Any, args: tuple, kwargs: dict) -> None:
        """``node`` calls ``target(*args, **kwargs)`` instead; its value (kept) must stay the same tensor."""
        self.retargeted.append((node, node.target, node.args, dict(node.kwargs)))
        node.target, node.args, node.kwargs = target, args, kwargs

    def redirect(self, reader: torch.fx.Node, old: torch.fx.Node, new: torch.fx.Node) -> None:
        """``reader`` reads ``new`` where it read ``old``."""
        reader.replace_input_with(old, new)
        self.redirected.append((reader, old, new))


def undo(remakes: list[Remade]) -> None:
    """Put back what ``remakes`` changed, the last first."""
    for one in reversed(remakes):
        for node, key in one.marked:
            node.meta.pop(key, None)
        for reader, old, new in one.redirected:
            reader.replace_input_with(new, old)
        for node, target, args, kwargs in reversed(one.retargeted):
            node.target, node.args, node.kwargs = target, args, kwargs
        for node in reversed(one.made):
            one.graph.gm.graph.erase_node(node)
            for key in ("phases", "sources", "seq_nr"):
                one.state[key].pop(node.name, None)
