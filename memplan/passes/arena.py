"""Static arena: a byte offset for every storage the graph allocates, all inside one buffer.

What it does
------------
Inference runtimes (TFLite's ``ArenaPlanner``/``SimpleMemoryArena``, XLA's
``GlobalDecreasingSizeBestFitHeap``) place every intermediate at a fixed offset of one arena, decided
before running: two storages may share bytes when their lifetimes do not overlap. The arena's size
is at least the most bytes ever live at once (the simulated peak, the *no-fragmentation lower
bound*); how much more it needs is its fragmentation. :func:`plan_arena` computes the offsets and
the report; the ``arena`` pass attaches that plan to the pipeline's record.

Stages
------
(1) Buffers: every storage that is not external (not a parameter, buffer, input or constant), with
    its bytes rounded up to ``alignment`` and its live interval under graph lifetimes (positions in
    :class:`~memplan.analysis.liveness.Liveness`; outputs live to the end).
(2) Lower bound: the most bytes live at one position (unrounded), which is
    :class:`~memplan.analysis.peak.PeakSimulation`'s peak.
(3) Placement, once per order in :data:`ORDERS`: take the buffers in that order; for each, look at the
    already placed buffers whose intervals overlap its own, and put it in the smallest gap between
    them that fits (best fit), else on top of the highest. The orders are TFLite's and XLA's:
    size-decreasing (ties: longer life, earlier start), lifetime-decreasing, size x lifetime
    decreasing, and start time (what an online allocator sees).
(4) Keep the smallest arena (ties: the earlier order), as XLA's ``ChooseBestHeapAlgorithm`` does.

Preconditions
-------------
Graph lifetimes: a storage is free after its last reader.

Soundness conditions, each with the counterexample it rules out
---------------------------------------------------------------
(a) Two buffers whose intervals overlap get disjoint byte ranges. Intervals are closed: a storage
    freed after node ``i`` and one allocated by node ``i`` overlap, since the node reads the first
    while writing the second. Counterexample: ``y = x.exp()`` placed on ``x``'s bytes is only safe as an
    in-place op, which the ``inplace`` pass decides, not the arena.
(b) Every alias of a storage lives in that storage's interval (liveness follows every alias).
    Counterexample: a ``view`` read after its base's last direct reader keeps the base alive.
(c) Offsets are multiples of ``alignment`` (64 bytes by default, a multiple of every element size),
    so typed views of the arena are valid. Counterexample: a float64 at offset 4.

Using the plan
--------------
By default the pass only annotates: ``changed=False`` and the :class:`ArenaPlan` on the record. The
option ``{"arena.preallocate": True}`` asks for the graph to run out of one preallocated buffer; that
rewrite (every op into its ``.out`` overload writing into arena views) is not implemented: the pass
says so in its notes and leaves the graph alone (see "Left to other passes / missing").

Left to other passes / missing
------------------------------
Lowering the peak itself (``inplace``, ``schedule``, ``remat``, ``chunk``): the arena can only approach
it. Running from the arena (``.out`` rewriting) is not done yet; on CPU the ruler would see the same
peak (arena size >= lower bound), the gain would be one allocation per call instead of one per op.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph
from memplan.pipeline import PassContext, PassResult, pass_options, register_pass

__all__ = ["ORDERS", "ArenaBuffer", "ArenaPlan", "ArenaOptions", "plan_arena", "place"]


@dataclasses.dataclass(frozen=True)
class ArenaBuffer:
    """One storage to place: ``nbytes`` (rounded up to the alignment) live on ``[start, end]``."""

    storage: int
    nbytes: int
    start: int
    end: int

    @property
    def lifetime(self) -> int:
        return self.end - self.start + 1


@dataclasses.dataclass(frozen=True)
class ArenaOptions:
    """Options of the pass (``ctx.options`` keys ``"arena.<field>"``).

    Attributes
    ----------
    alignment : int
        Every offset and size is a multiple of it (bytes).
    preallocate : bool
        Ask to run the graph from one preallocated buffer (not implemented: noted, graph unchanged).
    """

    alignment: int = 64
    preallocate: bool = False

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "ArenaOptions":
        return pass_options(cls, "arena", options)


@dataclasses.dataclass(frozen=True)
class ArenaPlan:
    """Offsets of every allocated storage in one arena, and how close the arena is to its bound.

    Attributes
    ----------
    offsets : Mapping[int, int]
        Storage id -> byte offset.
    buffers : tuple of ArenaBuffer
        What was placed (rounded sizes, intervals), by storage id.
    size : int
        Arena bytes: the highest ``offset + nbytes``.
    lower_bound : int
        Most bytes live at once (unrounded): no arena can be smaller.
    order : str
        The placement order that gave the smallest arena.
    sizes_tried : tuple of (str, int)
        Arena size for each order tried.

    Examples
    --------
    >>> b = (ArenaBuffer(0, 64, 0, 1), ArenaBuffer(1, 64, 1, 2), ArenaBuffer(2, 64, 2, 3))
    >>> offsets, size = place(b, ORDERS["size"])
    >>> offsets, size
    ({0: 0, 1: 64, 2: 0}, 128)
    """

    offsets: Mapping[int, int]
    buffers: tuple[ArenaBuffer, ...]
    size: int
    lower_bound: int
    order: str
    sizes_tried: tuple[tuple[str, int], ...]
    alignment: int

    @property
    def fragmentation(self) -> float:
        """``size / lower_bound - 1``: 0 when the arena is as small as any can be."""
        return self.size / self.lower_bound - 1 if self.lower_bound else 0.0

    def __str__(self) -> str:
        from memplan.measure import format_bytes

        return (
            f"ArenaPlan: {len(self.buffers)} storages in {format_bytes(self.size)} "
            f"(lower bound {format_bytes(self.lower_bound)}, fragmentation {self.fragmentation:.1%}, "
            f"order {self.order!r})"
        )

    def __rich__(self) -> Any:
        from rich.table import Table

        from memplan.measure import format_bytes

        table = Table(title=str(self), title_justify="left")
        for column in ("storage", "offset", "bytes", "live"):
            table.add_column(column, justify="right")
        for buffer in sorted(self.buffers, key=lambda b: (self.offsets[b.storage], b.start)):
            table.add_row(
                str(buffer.storage), str(self.offsets[buffer.storage]), format_bytes(buffer.nbytes),
                f"{buffer.start}..{buffer.end}",
            )
        return table


# ----------------------------------------------------------------------------------------------
# placement


#: Placement orders (sort keys), tried in this order.
ORDERS: dict[str, Callable[[ArenaBuffer], tuple]] = {
    "size": lambda b: (-b.nbytes, -b.lifetime, b.start, b.storage),
    "lifetime": lambda b: (-b.lifetime, -b.nbytes, b.start, b.storage),
    "area": lambda b: (-b.nbytes * b.lifetime, -b.nbytes, b.start, b.storage),
    "start": lambda b: (b.start, -b.nbytes, b.storage),
}

_BUCKET = 32  # positions per time bucket of the overlap index


def place(buffers: Sequence[ArenaBuffer], key: Callable[[ArenaBuffer], tuple]) -> tuple[dict[int, int], int]:
    """Best-fit offsets for ``buffers`` taken in ``sorted(buffers, key=key)`` order; returns (offsets, size)."""
    offsets: dict[int, int] = {}
    placed: list[ArenaBuffer] = []
    buckets: dict[int, list[int]] = {}  # time bucket -> indices into placed
    size = 0
    for buffer in sorted(buffers, key=key):
        # Step 3a: the placed buffers alive at the same time, by offset.
        seen: set[int] = set()
        busy: list[tuple[int, int]] = []
        for bucket in range(buffer.start // _BUCKET, buffer.end // _BUCKET + 1):
            for index in buckets.get(bucket, ()):
                if index in seen:
                    continue
                seen.add(index)
                other = placed[index]
                if other.start <= buffer.end and buffer.start <= other.end:
                    begin = offsets[other.storage]
                    busy.append((begin, begin + other.nbytes))
        busy.sort()
        # Step 3b: the smallest gap that fits, else on top.
        best: tuple[int, int] | None = None  # (gap size, offset)
        cursor = 0
        for begin, end in busy:
            gap = begin - cursor
            if gap >= buffer.nbytes and (best is None or gap < best[0]):
                best = (gap, cursor)
            cursor = max(cursor, end)
        offset = best[1] if best is not None else cursor
        offsets[buffer.storage] = offset
        size = max(size, offset + buffer.nbytes)
        placed.append(buffer)
        for bucket in range(buffer.start // _BUCKET, buffer.end // _BUCKET + 1):
            buckets.setdefault(bucket, []).append(len(placed) - 1)
    return offsets, size


def _round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_arena(graph: CapturedGraph, am: AnalysisManager, options: ArenaOptions = ArenaOptions()) -> ArenaPlan:
    """Offsets for every allocated storage of ``graph`` (stages 1 to 4 of the module docstring).

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> g = capture(lambda x: x.exp().sin().cos(), torch.randn(256), train=False)
    >>> import dataclasses; g = dataclasses.replace(g, lifetimes="graph")
    >>> plan = plan_arena(g, AnalysisManager(g))
    >>> plan.size, plan.lower_bound, sorted(plan.offsets.values())
    (2048, 2048, [0, 0, 1024])
    """
    tensors, liveness = am.get(Tensors), am.get(Liveness)
    # Step 1: the buffers.
    buffers = []
    raw: dict[int, int] = {}
    for sid, storage in sorted(tensors.storages.items()):
        if storage.external:
            continue
        interval = liveness.intervals[sid]
        end = min(interval.end, liveness.end)
        buffers.append(ArenaBuffer(sid, _round_up(storage.nbytes, options.alignment), interval.start, end))
        raw[sid] = storage.nbytes
    # Step 2: the lower bound, a sweep over allocation and free events.
    events: dict[int, int] = {}
    for buffer in buffers:
        events[buffer.start] = events.get(buffer.start, 0) + raw[buffer.storage]
        events[buffer.end + 1] = events.get(buffer.end + 1, 0) - raw[buffer.storage]
    live = lower_bound = 0
    for position in sorted(events):
        live += events[position]
        lower_bound = max(lower_bound, live)
    # Step 3: one placement per order; Step 4: keep the smallest.
    best: tuple[int, str, dict[int, int]] | None = None
    tried = []
    for name, key in ORDERS.items():
        offsets, size = place(buffers, key)
        tried.append((name, size))
        if best is None or size < best[0]:
            best = (size, name, offsets)
    size, name, offsets = best if best is not None else (0, "size", {})
    return ArenaPlan(
        offsets=types.MappingProxyType(offsets),
        buffers=tuple(buffers),
        size=size,
        lower_bound=lower_bound,
        order=name,
        sizes_tried=tuple(tried),
        alignment=options.alignment,
    )


@register_pass("arena", options=ArenaOptions.from_mapping)
def arena(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Plan static offsets and attach the plan to the record; the graph is left as it is."""
    options = ArenaOptions.from_mapping(ctx.options)
    plan = plan_arena(graph, ctx.am, options)
    notes = [str(plan)]
    if options.preallocate:
        notes.append(
            "arena.preallocate is not implemented: running every op through its .out overload into views of "
            "one buffer needs an out variant for each allocating op and outputs kept outside the arena; "
            "the graph is left unchanged"
        )
    return PassResult(graph, changed=False, notes=tuple(notes), plan=plan)
