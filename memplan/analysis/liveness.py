"""Liveness of every storage under the graph's current order.

A storage is born at its creator's position and dies after the last position that reads any node
aliasing it. Storages aliased by a graph output, and external storages (inputs, parameters,
constants), live to the end (position ``len(order)``).

With ``graph.lifetimes == "eager"`` a storage also lives until the node after which the user's Python
dropped its last reference (recorded at capture), as it does when the model runs eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

from memplan.analysis.manager import Analysis, AnalysisManager
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph

__all__ = ["Interval", "Liveness"]


class Interval(NamedTuple):
    """A storage is live on ``[start, end]`` (positions in ``Liveness.order``; end == len(order): to the end).

    A named tuple: one per storage, made at every change of the graph (cheaper to build than a dataclass).
    """

    start: int
    end: int

    def overlaps(self, other: "Interval") -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclasses.dataclass(frozen=True)
class Liveness(Analysis):
    """Execution order, each node's position, and each storage's live interval."""

    name = "liveness"
    order: tuple[str, ...]
    position: Mapping[str, int]
    intervals: Mapping[int, Interval]
    last_reader: Mapping[int, str | None]

    @property
    def end(self) -> int:
        return len(self.order)

    @classmethod
    def compute(cls, graph: CapturedGraph, am: AnalysisManager) -> "Liveness":
        tensors = am.get(Tensors)
        nodes = [n for n in graph.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
        order = tuple(n.name for n in nodes)
        position = {name: i for i, name in enumerate(order)}
        end = len(order)
        by_name = {n.name: n for n in graph.gm.graph.nodes}
        intervals: dict[int, Interval] = {}
        last_reader: dict[int, str | None] = {}
        for sid, storage in tensors.storages.items():
            start = -1 if storage.external else position[storage.creator]
            last, reader = start, None
            to_end = storage.external
            for member in storage.members:
                node = by_name[member]
                if member in position and position[member] > last:
                    last, reader = position[member], member
                for user in node.users:
                    if user.op == "output":
                        to_end = True
                    elif position[user.name] > last:
                        last, reader = position[user.name], user.name
            if graph.lifetimes == "eager" and not to_end and not storage.external:
                # Python may hold the storage past its last reader (a local variable, a list).
                released = graph.released_after.get(storage.creator)
                if released is None:  # a node of several tensors: the item's getitem has the release
                    points = [graph.released_after[m] for m in storage.members if m in graph.released_after]
                    released = max(points, key=lambda n: position.get(n, end)) if points else None
                if released is None:
                    to_end = True
                elif released in position and position[released] > last:
                    last, reader = position[released], None
            intervals[sid] = Interval(start, end if to_end else last)
            last_reader[sid] = None if to_end else reader
        return cls(order=order, position=position, intervals=intervals, last_reader=last_reader)
