"""The what-if memory model: a graph's simulated timeline, and what it becomes under a change.

Built once per graph from :class:`~memplan.analysis.tensors.Tensors` and
:class:`~memplan.analysis.liveness.Liveness`, it prices a candidate change without building it:

- ``with_sizes({storage: bytes})``: some storages resized or dropped (a loop's scratch at another chunk
  size; 0 bytes for a storage that is no longer made);
- ``with_intervals(dropped, added)``: some storages gone, some intervals of bytes added (values a
  chunked region no longer makes, or makes elsewhere);
- ``with_order(order)``: the nodes run in another order (a schedule);
- ``with_recompute(inserted, retouched)``: new nodes run before given nodes, and some nodes touch other
  storages than they did (copies of forward nodes in the backward; slices read instead of the values
  a stack holds).

Each answers a :class:`Timeline`, whose ``peak`` is what
:class:`~memplan.analysis.peak.PeakSimulation` would report for the graph so changed.
``PeakSimulation`` is the model's base timeline.

The model
---------
A *position* is a node's index in ``Liveness.order``; position ``end`` (``len(order)``) stands for the
graph's output. A storage is *counted* unless it is external (owned by a placeholder or a constant: it
exists before the graph runs). A counted storage is allocated, whole, when the node that creates it runs,
and freed after the last position it is live at; one the output aliases is never freed. The timeline is
the bytes live right after each position allocates, before what dies there is freed; the peak is its
highest value (0 when nothing is allocated). A node *touches* a storage when its value aliases it or it
reads a node whose value aliases it; under graph lifetimes a storage is live until its last toucher.

Stages
------
(1) Base (:meth:`MemoryModel.compute`, after every change of the graph): each counted storage's size and
    live interval (``Liveness``: under eager lifetimes also held until the user's Python released it),
    the bytes born at and dying after each position, and their running sums: the timeline and its peak.
(2) Touches (:attr:`MemoryModel.touchers`, built on first use by a what-if that moves nodes or changes
    what they touch): the positions touching each storage, the output's at ``end``.
(3) What-ifs, each a few numpy operations over the positions (and, when nodes move, over the touches):
    (a) ``with_sizes``: resizing a storage by ``d`` bytes adds ``d`` over its interval: the base
        timeline plus a running sum of those changes;
    (b) ``with_order``: every node gets its new position; a storage is born at its creator's and dies
        after the latest of its touchers';
    (c) ``with_recompute``: the nodes after an inserted one move down by one; a new node allocates the
        storages it creates where it runs; each storage dies after its latest toucher, the touches of the
        retouched nodes replaced by those given;
    (d) ``with_intervals``: as (a), the dropped storages' intervals subtracted and the added ones added.

Sizes a what-if invents (new sizes, added intervals, new nodes' storages) are charged as the graph's
device's allocator charges them (:mod:`memplan.analysis.allocator`: exact bytes on the CPU, 512-byte
blocks on CUDA), as :class:`~memplan.analysis.tensors.Tensors` charges the graph's own storages.

Moving nodes and changing what they touch are modelled under graph lifetimes (a storage dies after its
last toucher); a model of a graph with eager lifetimes refuses them. Byte counts are exact (int64). A
what-if of no change is the base timeline, and each what-if equals the base timeline of the graph
changed that way (``tests/analysis/test_memory_model.py`` checks both).

Examples
--------
>>> import dataclasses, torch
>>> from memplan.analysis.manager import AnalysisManager
>>> from memplan.capture import capture
>>> g = capture(lambda x: (x.exp() + 1).sin(), torch.randn(256), train=False)
>>> model = AnalysisManager(dataclasses.replace(g, lifetimes="graph")).get(MemoryModel)
>>> model.order, model.peak  # exp and add each alive with the next op's output: 2 x 1 KiB
(('exp', 'add', 'sin'), 2048)
>>> add = model.tensors.storages_of("add")[0]
>>> model.with_sizes({add: 4096}).peak  # add's output four times bigger
5120
>>> model.with_order([0, 1, 2]).peak
2048
>>> copy = NewNode(before=2, creates={model.next_storage: 1024})  # one more KiB before sin, read by nobody
>>> model.with_recompute([copy]).live.tolist()
[1024, 2048, 2048, 2048]
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from memplan.analysis.allocator import AllocatorModel, allocator_for
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import Analysis, AnalysisManager
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph
from memplan.graphutil import graph_device

__all__ = ["MemoryModel", "NewNode", "Timeline"]


@dataclasses.dataclass(frozen=True, eq=False)
class Timeline:
    """Bytes live right after each position of one run allocates (before what dies there is freed).

    Attributes
    ----------
    live : numpy.ndarray
        int64, one entry per node of the run, in the order it runs (read-only).

    Examples
    --------
    >>> import numpy as np
    >>> t = Timeline(np.array([4, 12, 8]))
    >>> t.peak, t.peak_index
    (12, 1)
    >>> Timeline(np.zeros(0, dtype=np.int64)).peak_index  # nothing allocated
    -1
    """

    live: np.ndarray

    def __post_init__(self) -> None:
        self.live.flags.writeable = False

    @property
    def peak(self) -> int:
        """The highest live total; 0 when nothing is allocated."""
        return max(0, int(self.live.max())) if len(self.live) else 0

    @property
    def peak_index(self) -> int:
        """The first position where the peak is reached; -1 when nothing is allocated."""
        if not len(self.live):
            return -1
        top = int(np.argmax(self.live))
        return top if self.live[top] > 0 else -1


@dataclasses.dataclass(frozen=True)
class NewNode:
    """A node a what-if inserts (:meth:`MemoryModel.with_recompute`).

    Attributes
    ----------
    before : int
        Position of the node it runs just before (``end``: after every node). New nodes before the same
        node run in the order they are given.
    creates : mapping of int to int
        Storages it allocates (ids from :attr:`MemoryModel.next_storage` on, each created once) -> bytes
        (charged as the device's allocator charges them).
    touches : tuple of int
        Storages it reads or aliases besides those it creates: ids of the graph's storages, or of
        storages an earlier new node creates.
    """

    before: int
    creates: Mapping[int, int] = dataclasses.field(default_factory=dict)
    touches: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryModel(Analysis):
    """The base timeline of a graph and its what-ifs (see the module docstring).

    Per counted storage ``k`` (ascending ids ``storage[k]``): ``nbytes[k]``, and the first and last
    positions it is live at, ``start[k]`` and ``stop[k]`` (``end``: to the end). Per position: ``born``
    (bytes allocated there), ``dies`` (bytes freed after it) and ``live`` (the base timeline). All
    arrays are int64 and read-only.
    """

    name = "memory_model"
    order: tuple[str, ...]
    peak: int
    peak_index: int  # -1 when nothing is allocated
    after: int  # bytes still live at the end (outputs, gradients)
    next_storage: int  # the first storage id the graph does not use (new nodes' storages start here)
    lifetimes: str
    storage: np.ndarray = dataclasses.field(repr=False)
    nbytes: np.ndarray = dataclasses.field(repr=False)
    start: np.ndarray = dataclasses.field(repr=False)
    stop: np.ndarray = dataclasses.field(repr=False)
    born: np.ndarray = dataclasses.field(repr=False)
    dies: np.ndarray = dataclasses.field(repr=False)
    live: np.ndarray = dataclasses.field(repr=False)
    graph: CapturedGraph = dataclasses.field(repr=False)
    tensors: Tensors = dataclasses.field(repr=False)
    liveness: Liveness = dataclasses.field(repr=False)
    # how the graph's device charges an allocation (for the sizes a what-if invents)
    allocator: AllocatorModel = dataclasses.field(repr=False, default=allocator_for("cpu"))

    @property
    def end(self) -> int:
        return len(self.order)

    @property
    def timeline(self) -> Timeline:
        """The base timeline: the graph as it is."""
        return Timeline(self.live)

    @classmethod
    def compute(cls, graph: CapturedGraph, am: AnalysisManager) -> "MemoryModel":
        # Step 1: the base timeline (asked after every pass: one loop over the storages, then numpy).
        tensors, liveness = am.get(Tensors), am.get(Liveness)
        end = liveness.end
        intervals = liveness.intervals
        ids: list[int] = []
        sizes: list[int] = []
        starts: list[int] = []
        stops: list[int] = []
        for sid, storage in tensors.storages.items():
            if storage.external:
                continue
            interval = intervals[sid]
            ids.append(sid)
            sizes.append(storage.nbytes)
            starts.append(interval.start)
            stops.append(interval.end)
        storage = _frozen(np.array(ids, dtype=np.int64))
        nbytes = _frozen(np.array(sizes, dtype=np.int64))
        start = _frozen(np.array(starts, dtype=np.int64))
        stop = _frozen(np.array(stops, dtype=np.int64))
        born = np.zeros(end, dtype=np.int64)
        np.add.at(born, start, nbytes)
        dying = stop < end
        dies = np.zeros(end, dtype=np.int64)
        np.add.at(dies, stop[dying], nbytes[dying])
        # live right after each node allocates: all born so far, less all freed before it
        live = np.cumsum(born)
        live[1:] -= np.cumsum(dies)[:-1]
        timeline = Timeline(live)
        return cls(
            order=liveness.order, peak=timeline.peak, peak_index=timeline.peak_index,
            after=int(born.sum() - dies.sum()), next_storage=max(tensors.storages, default=-1) + 1,
            lifetimes=graph.lifetimes, storage=storage, nbytes=nbytes, start=start, stop=stop,
            born=_frozen(born), dies=_frozen(dies), live=_frozen(live), graph=graph, tensors=tensors,
            liveness=liveness, allocator=allocator_for(graph_device(graph), graph.target_device),
        )

    # -- what-ifs -------------------------------------------------------------------------------

    def with_sizes(self, sizes: Mapping[int, int]) -> Timeline:
        """The timeline with some storages resized (0 bytes: dropped), each live where it was.

        Parameters
        ----------
        sizes : mapping of int to int
            Counted storage id -> its new size in bytes (charged as the device's allocator charges it).

        Raises
        ------
        ValueError
            For a storage that is not counted (external, or not in the graph), or a negative size.
        """
        # Step 3a: a storage resized by d adds d to every position of its interval.
        if not sizes:
            return self.timeline
        k = self._counted(sizes.keys())
        new = np.fromiter(sizes.values(), dtype=np.int64, count=len(sizes))
        if np.any(new < 0):
            raise ValueError(f"storage sizes must be >= 0 bytes; got {dict(sizes)}")
        change = self.allocator.charge_array(new) - self.nbytes[k]
        delta = np.zeros(self.end + 2, dtype=np.int64)  # stop + 1 == end + 1 for those kept to the end
        np.add.at(delta, self.start[k], change)
        np.add.at(delta, self.stop[k] + 1, -change)
        return Timeline(self.live + np.cumsum(delta[: self.end]))

    def with_intervals(self, dropped: Iterable[int] = (), added: Iterable[tuple[int, int, int]] = ()) -> Timeline:
        """The timeline with some storages gone and some intervals added, every node where it is.

        Parameters
        ----------
        dropped : iterable of int
            Counted storage ids no longer allocated where they were (each once).
        added : iterable of (start, stop, nbytes)
            Allocations of ``nbytes`` live on positions ``start..stop`` (``stop == end``: to the end); a
            dropped storage allocated elsewhere, or a value made by a node that no longer exists
            (charged as the device's allocator charges them).

        Raises
        ------
        ValueError
            For a storage that is not counted or dropped twice, or an interval outside ``0..end``.
        """
        # Step 3d: an interval adds its bytes at its start and frees them after its stop.
        end = self.end
        dropped = list(dropped)
        k = self._counted(dropped)
        if len(set(dropped)) != len(dropped):
            raise ValueError(f"a storage is dropped once; got {dropped}")
        added = np.array(list(added), dtype=np.int64).reshape(-1, 3)
        start, stop, size = added[:, 0], added[:, 1], added[:, 2]
        if np.any(start < 0) or np.any(start >= max(end, 1)) or np.any(stop < start) or np.any(stop > end) or np.any(size < 0):
            raise ValueError(f"intervals must satisfy 0 <= start <= stop <= {end}, start < {end}, bytes >= 0")
        size = self.allocator.charge_array(size)
        delta = np.zeros(end + 2, dtype=np.int64)
        np.add.at(delta, self.start[k], -self.nbytes[k])
        np.add.at(delta, self.stop[k] + 1, self.nbytes[k])
        np.add.at(delta, start, size)
        np.add.at(delta, stop + 1, -size)
        return Timeline(self.live + np.cumsum(delta[:end]))

    def with_order(self, order: Sequence[int]) -> Timeline:
        """The timeline of the graph run in ``order``, a permutation of its positions (``range(end)``):
        ``order[i]`` is the position of the node run ``i``-th. The timeline is in the new order.

        The order is not checked against the graph's dependencies (the caller's constraints).

        Raises
        ------
        ValueError
            When ``order`` is not a permutation of the positions, or the graph has eager lifetimes.
        """
        # Step 3b: each node's new position; storages die after their latest toucher there.
        self._refuse_eager("a reorder")
        end = self.end
        order = np.asarray(order, dtype=np.int64)
        if order.shape != (end,) or (end and (order.min() < 0 or order.max() >= end
                                              or np.any(np.bincount(order, minlength=end) != 1))):
            raise ValueError(f"an order must be a permutation of the graph's {end} positions")
        place = np.empty(end + 1, dtype=np.int64)
        place[order] = np.arange(end, dtype=np.int64)
        place[end] = end  # the output stays last
        return self._replay(place, end, self.born[order])

    def with_recompute(self, inserted: Sequence[NewNode] = (),
                       retouched: Mapping[int, Iterable[int]] | None = None) -> Timeline:
        """The timeline with new nodes inserted and some nodes touching other storages.

        Parameters
        ----------
        inserted : sequence of NewNode
            Nodes to run, each before the node at its ``before`` position; the nodes from there on move
            down.
        retouched : mapping of int to iterable of int, optional
            Position (``end``: the output) -> every storage that node touches now (its value's and its
            inputs', new storages included), replacing what it touched. A node keeps creating the
            storages it created.

        Returns
        -------
        Timeline
            One entry per node of the changed graph, new nodes included, in its order.

        Raises
        ------
        ValueError
            For a position outside ``0..end``, a new storage id below :attr:`next_storage` or created
            twice, a touch of a new storage no earlier new node creates, or a graph with eager lifetimes.
        """
        # Step 3c: positions after the insertions, then births and last touches.
        self._refuse_eager("added recomputation")
        end = self.end
        retouched = retouched or {}
        before = [node.before for node in inserted]
        if any(not 0 <= b <= end for b in itertools.chain(before, retouched)):
            raise ValueError(f"positions must be in 0..{end} (the graph's nodes, then its output)")
        count = np.zeros(end + 1, dtype=np.int64)  # new nodes before each position
        np.add.at(count, np.array(before, dtype=np.int64), 1)
        place = np.arange(end + 1, dtype=np.int64) + np.cumsum(count)  # place[end]: the new length
        length = end + len(inserted)
        taken: dict[int, int] = {}  # anchor -> new nodes placed before it so far
        new_born: dict[int, int] = {}  # new storage -> where it is made
        new_size: dict[int, int] = {}
        new_last: dict[int, int] = {}
        touched_sid: list[int] = []  # touches of the graph's storages, and where
        touched_at: list[int] = []
        first_new = self.next_storage

        def touch(sids: Iterable[int], at: int) -> None:
            for sid in sids:
                if sid >= first_new:
                    if sid not in new_born:
                        raise ValueError(f"storage {sid} is touched at position {at}; no earlier new node creates it")
                    if at > new_last[sid]:
                        new_last[sid] = at
                else:
                    touched_sid.append(sid)
                    touched_at.append(at)

        for node in inserted:
            j = taken.get(node.before, 0)
            taken[node.before] = j + 1
            at = int(place[node.before] - count[node.before]) + j
            for sid, nbytes in node.creates.items():
                if sid < first_new or sid in new_born:
                    raise ValueError(f"new storage id {sid}: ids start at next_storage={first_new}, each created once")
                if nbytes < 0:
                    raise ValueError(f"new storage {sid} has {nbytes} bytes")
                new_born[sid], new_size[sid], new_last[sid] = at, self.allocator.charge(nbytes), at
            touch(node.touches, at)
        for position, sids in retouched.items():
            touch(sids, int(place[position]))
        alloc = np.zeros(length, dtype=np.int64)
        np.add.at(alloc, place[self.start], self.nbytes)
        free = self._frees(place, length, retouched, (np.array(touched_sid, dtype=np.int64),
                                                      np.array(touched_at, dtype=np.int64)))
        for sid, at in new_born.items():
            alloc[at] += new_size[sid]
            free[new_last[sid]] += new_size[sid]
        free = free[:length]  # what the output touches (at ``length``) is never freed
        return Timeline(np.cumsum(alloc) - np.cumsum(free) + free)

    # -- touches --------------------------------------------------------------------------------

    @functools.cached_property
    def touchers(self) -> Mapping[int, tuple[int, ...]]:
        """Storage id -> the positions touching it, ascending; ``end`` when the output aliases it.

        Every storage touched by some node or by the output, external ones included. Built on first
        use (one loop over the storages, the nodes aliasing each and their readers).
        """
        # Step 2: who touches each storage: the nodes aliasing it and the readers of those (as
        # ``Liveness`` finds its last reader), the output at ``end``.
        end = self.end
        nodes = [n for n in self.graph.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
        if len(nodes) != end:  # pragma: no cover - Liveness orders exactly these nodes
            raise AssertionError("the graph changed after its analyses were computed")
        at_node = {node: i for i, node in enumerate(nodes)}  # keyed by node: users come as nodes
        by_name = {n.name: n for n in self.graph.gm.graph.nodes}
        found: dict[int, tuple[int, ...]] = {}
        for sid, storage in self.tensors.storages.items():
            touched: set[int] = set()
            for member in storage.members:
                node = by_name[member]
                at = at_node.get(node)
                if at is not None:
                    touched.add(at)
                for user in node.users:
                    at = at_node.get(user)
                    if at is not None:
                        touched.add(at)
                    elif user.op == "output":
                        touched.add(end)
            if touched:
                found[sid] = tuple(sorted(touched))
        return found

    @functools.cached_property
    def _touches(self) -> tuple[np.ndarray, np.ndarray]:
        """``(k, position)`` per touch of a counted storage ``k``, output touches at ``end``."""
        touchers = self.touchers
        ats = [touchers.get(sid, ()) for sid in self.storage.tolist()]
        k = np.repeat(np.arange(len(ats), dtype=np.int64), [len(a) for a in ats])
        at = np.fromiter(itertools.chain.from_iterable(ats), dtype=np.int64, count=len(k))
        return k, at

    # -- helpers --------------------------------------------------------------------------------

    def _replay(self, place: np.ndarray, length: int, alloc: np.ndarray) -> Timeline:
        """The timeline with every node at ``place[position]`` (the output at ``place[end] == length``)
        and ``alloc`` bytes allocated at each new position: each storage dies after its last toucher."""
        free = self._frees(place, length, {}, None)[:length]
        return Timeline(np.cumsum(alloc) - np.cumsum(free) + free)

    def _frees(self, place: np.ndarray, length: int, retouched: Mapping[int, Iterable[int]],
               extra: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        """Bytes of counted storages freed after each new position (``length + 1`` entries: the last is
        the output's, never freed). A counted storage dies at the latest of its creator's new position,
        its touchers' (those of the ``retouched`` nodes left out) and the ``extra`` touches
        ``(storage ids, new positions)``, which may name external storages (ignored)."""
        last = place[self.start]
        k, at = self._touches
        if retouched:
            moved = np.zeros(self.end + 1, dtype=bool)
            moved[list(retouched)] = True
            kept = ~moved[at]
            k, at = k[kept], at[kept]
        np.maximum.at(last, k, place[at])
        if extra is not None and len(extra[0]):
            sid, where = extra
            slot = np.searchsorted(self.storage, sid)
            counted = slot < len(self.storage)
            counted[counted] = self.storage[slot[counted]] == sid[counted]
            np.maximum.at(last, slot[counted], where[counted])
        free = np.zeros(length + 1, dtype=np.int64)
        np.add.at(free, last, self.nbytes)
        return free

    def _counted(self, sids: Iterable[int]) -> np.ndarray:
        """Indices ``k`` of counted storage ids."""
        ids = np.fromiter(sids, dtype=np.int64)
        slot = np.searchsorted(self.storage, ids)
        found = slot < len(self.storage)
        found[found] = self.storage[slot[found]] == ids[found]
        if not found.all():
            missing = ids[~found].tolist()
            raise ValueError(f"storages {missing} are not counted: external (inputs, parameters, constants, "
                             "which exist before the graph runs) or not in the graph")
        return slot

    def _refuse_eager(self, change: str) -> None:
        if self.lifetimes == "eager":
            raise ValueError(
                f"{change} is modelled under graph lifetimes (a storage dies after its last reader); this graph "
                "has eager ones: use dataclasses.replace(graph, lifetimes='graph'), as the pipeline does"
            )


def _frozen(array: np.ndarray) -> np.ndarray:
    """``array``, made read-only (the model hands out its arrays)."""
    array.flags.writeable = False
    return array
