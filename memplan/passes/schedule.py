"""Memory-aware ordering: pick the topological order of the joint graph with the lowest simulated peak.

What it does
------------
The order a model's Python code happens to compute things in is one valid order among many. When a
graph branches, computing one branch to the end (and freeing its temporaries) before starting the
next one can keep far fewer bytes live than interleaving them. The pass tries several orders that
respect every dependency, prices each with the memory model
(:meth:`~memplan.analysis.memory_model.MemoryModel.with_order`, the peak
:class:`~memplan.analysis.peak.PeakSimulation` would report for the reordered graph, graph lifetimes),
and keeps the lowest; the input order is one of the candidates, so the peak never rises.

Stages
------
(1) Dependencies (:class:`ScheduleProblem`): data edges; for every op that writes in place, an edge
    from each earlier reader of the storage it writes (through any alias) to the writer, and from
    the writer to each later reader; a chain through the ops with side effects (random ops: the RNG
    stream; ops that mutate; ops without a tensor result) in their original order; and the phase
    boundary: a backward node becomes ready only once every forward node is placed.
(2) Candidate orders:
    ``original``; ``lpmf`` (Inductor's least-peak-memory-first greedy: among ready nodes, if some
    would not raise the peak so far, take the one leaving the fewest bytes live after it, else the
    one with the lowest peak while it runs); ``free_first`` (the ready node with the smallest net
    allocation); ``bfs`` (by depth, then original position); ``dfs`` (Sethi-Ullman: a depth-first
    post-order that evaluates the operand needing the most memory first).
    Ties are broken by original position everywhere, so the result is deterministic.
(3) Choose: the candidate with the lowest simulated peak; the original order wins ties, so a graph
    whose order does not matter is left untouched (``changed=False``). The peaks are those of a step
    seeded as ``.sum()`` seeds it (a broadcast scalar per output); a candidate that would raise the peak
    of a step whose loss is outside the model (dense gradients of the outputs, alive from the start of
    the backward to their last reader: :meth:`ScheduleProblem.simulate_dense`) above the input order's
    is not taken, so a cross-entropy over the logits never pays for an order made for ``.sum()``.
(4) Apply: move the ``call_function`` nodes into the chosen order (placeholders stay first, the
    output last) and recompile.

Preconditions
-------------
Graph lifetimes (the pipeline sets them): storages die after their last reader.

Soundness conditions, each with the counterexample it rules out
---------------------------------------------------------------
(a) Data dependencies: a node runs after its inputs. Counterexample: ``exp`` before the ``mm`` it reads.
(b) Writers after earlier readers and before later readers of the storage they write.
    Counterexample: ``b = a.clone(); c = a.sum(); a.mul_(2)``: moving ``mul_`` before ``sum`` changes ``c``.
(c) Random ops keep their relative order. Counterexample: swapping two ``randn_like`` swaps their values
    (the seed fixes the stream, not which op draws first).
(d) Ops that mutate keep their relative order. Counterexample: BatchNorm's ``running_mean.mul_`` and
    ``running_mean.add_`` in swapped order give another running mean.
(e) No node crosses the forward/backward boundary. Counterexample: a backward node moved into the
    forward would make emit save a backward value the forward cannot compute.

Left to other passes
--------------------
Reusing storages (``inplace``, ``arena``); recomputing instead of keeping (``remat``); splitting big ops
(``chunk``). Running ``schedule`` after them lets it order the nodes they add.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory_model import MemoryModel, Timeline
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import is_random, mutated_args
from memplan.pipeline import PassContext, PassResult, PassStats, register_pass

__all__ = ["STRATEGIES", "SchedulePlan", "ScheduleProblem", "plan_schedule", "apply_schedule"]


@dataclasses.dataclass(frozen=True)
class SchedulePlan:
    """The chosen order and the simulated peak of every candidate.

    Attributes
    ----------
    order : tuple of str
        Every scheduled node (what :class:`~memplan.analysis.liveness.Liveness` orders), new order.
    strategy : str
        The candidate that won (``"original"`` when nothing beat the input order).
    peaks : tuple of (str, int)
        Simulated peak of each candidate, in the order tried.

    Examples
    --------
    >>> plan = SchedulePlan(("a", "b"), "original", (("original", 8), ("lpmf", 8)))
    >>> plan.peak, plan.peak_before
    (8, 8)
    """

    order: tuple[str, ...]
    strategy: str
    peaks: tuple[tuple[str, int], ...]

    @property
    def peak(self) -> int:
        return dict(self.peaks)[self.strategy]

    @property
    def peak_before(self) -> int:
        return dict(self.peaks)["original"]

    def __str__(self) -> str:
        from memplan.measure import format_bytes

        tried = ", ".join(f"{name} {format_bytes(peak)}" for name, peak in self.peaks)
        return f"SchedulePlan: {self.strategy} order ({len(self.order)} nodes); tried {tried}"


class ScheduleProblem:
    """Nodes, dependency edges and storages of a graph, indexed by original position.

    ``simulate(order)`` gives the peak :class:`~memplan.analysis.peak.PeakSimulation` would report for
    the graph in that order, without rebuilding it: the graph's
    :class:`~memplan.analysis.memory_model.MemoryModel` prices the order (its touchers are also the
    storages' readers here).

    Every candidate order is built, checked and simulated on this one object, so what they share is
    computed here once: the edges, the storages, and the numpy copies of the edges for
    :meth:`is_valid` (an unrolled loop has a hundred thousand nodes and more, and a Python loop over
    every edge and storage per candidate cost more than building the candidate).
    """

    def __init__(self, graph: CapturedGraph, am: AnalysisManager):
        tensors, liveness = am.get(Tensors), am.get(Liveness)
        self.model = model = am.get(MemoryModel)
        self.names: tuple[str, ...] = liveness.order
        index = liveness.position  # name -> original position
        self.index = index
        by_name = {n.name: n for n in graph.gm.graph.nodes}
        nodes = [by_name[name] for name in self.names]
        n = len(nodes)
        self.n = n
        phase_of = graph.phases.get
        self.backward = [phase_of(name) is Phase.BACKWARD for name in self.names]
        self.n_forward = self.backward.count(False)

        position_of = {node: i for i, node in enumerate(nodes)}  # by node: no name to look up

        # Step 1a: data edges.
        preds: list[set[int]] = [
            {position_of[arg] for arg in node.all_input_nodes if arg in position_of} for node in nodes
        ]

        # Storages: size, creator, every node touching one of its aliases (the memory model's touchers,
        # where position n is the output), pinned to the end or not.
        self.sizes: list[int] = []
        self.creator: list[int] = []
        self.to_end: list[bool] = []
        touchers: list[list[int]] = []
        readers_of_sid: dict[int, tuple[int, ...]] = {}
        touched = model.touchers
        for sid, storage in tensors.storages.items():
            readers = touched.get(sid, ())
            to_end = storage.external
            if readers and readers[-1] == n:  # an output aliases it
                readers, to_end = readers[:-1], True
            readers_of_sid[sid] = readers
            if storage.external:
                continue
            creator = index[storage.creator]
            self.sizes.append(storage.nbytes)
            self.creator.append(creator)
            self.to_end.append(to_end)
            # the creator is the first toucher (every other member, and every reader, comes after it)
            first = readers[:1] == (creator,)
            touchers.append(list(readers[1:]) if first else [j for j in readers if j != creator])

        # The gradients of the outputs as a loss outside the model sends them: dense, alive from the start
        # of the backward to their last reader (see simulate_dense). Planned with the seed a .sum() sends
        # (a broadcast scalar), they cost nothing in the other storages.
        self.tangents: list[tuple[int, list[int]]] = []  # (dense bytes, nodes reading it)
        for spec in graph.inputs:
            value = by_name[spec.node].meta.get("val") if spec.kind == "tangent" else None
            if isinstance(value, torch.Tensor):
                readers = set().union(*(readers_of_sid.get(sid, ()) for sid in tensors.storages_of(spec.node)))
                if readers:
                    self.tangents.append((value.numel() * value.element_size(), sorted(readers)))

        # Step 1b: writers stay between the earlier and the later readers of what they write.
        ordered: list[int] = []
        writers_of_sid: dict[int, set[int]] = {}
        side_effects: dict[tuple[str, Any], bool] = {}  # one schema lookup per operator, not per node
        for i, node in enumerate(nodes):
            written = mutated_args(node) if node.op == "call_function" else []
            key = (node.op, node.target)
            if key not in side_effects:
                side_effects[key] = _has_side_effects(node)
            if written or side_effects[key]:
                ordered.append(i)
            for target in written:
                for sid in tensors.storages_of(target.name):
                    writers_of_sid.setdefault(sid, set()).add(i)
        for sid, writers in writers_of_sid.items():
            _order_writers(sorted(writers.union(readers_of_sid.get(sid, ()))), writers, preds)
        # Step 1c: side effects keep their relative order.
        for a, b in zip(ordered, ordered[1:]):
            preds[b].add(a)
        for i in range(n):
            preds[i].discard(i)

        # The getitems of a multi-output node, in the node's phase: they take its items out of the tuple
        # that holds all of them (a chunk loop's scratch included) until its last getitem.
        self.items: list[list[int]] = [[] for _ in range(n)]
        for i, node in enumerate(nodes):
            if node.op == "call_function" and node.target is operator.getitem and len(node.all_input_nodes) == 1:
                source = position_of.get(node.all_input_nodes[0])
                if source is not None and self.backward[source] == self.backward[i]:
                    self.items[source].append(i)

        self.preds: list[list[int]] = [sorted(p) for p in preds]
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, ps in enumerate(self.preds):  # i ascending: each list of successors comes out sorted
            for j in ps:
                succs[j].append(i)
        self.succs = succs
        self.born: list[list[int]] = [[] for _ in range(n)]
        self.alloc = [0] * n
        for s, c in enumerate(self.creator):
            self.born[c].append(s)
            self.alloc[c] += self.sizes[s]
        self.touchers: list[list[int]] = touchers  # each ascending
        self.n_touchers = [len(ts) for ts in touchers]
        self.touches: list[list[int]] = [[] for _ in range(n)]
        for s, ts in enumerate(self.touchers):
            for t in ts:
                self.touches[t].append(s)
        self._shared = _Shared(self)

    # -- simulation -----------------------------------------------------------------------------

    def simulate(self, order: Sequence[int]) -> int:
        """Peak bytes of the graph run in ``order`` (a permutation of ``range(n)``): the memory model's
        :meth:`~memplan.analysis.memory_model.MemoryModel.with_order`."""
        return self.model.with_order(order).peak

    def simulate_dense(self, order: Sequence[int], timeline: Timeline | None = None) -> int:
        """:meth:`simulate` with the outputs' gradients dense, as a loss outside the model sends them
        (a cross-entropy over the logits): each alive from the first backward node to its last reader.
        ``timeline``: the model's timeline of ``order`` when the caller has it."""
        if self.n == 0:
            return 0
        if timeline is None:
            timeline = self.model.with_order(order)
        live = timeline.live
        if self.tangents:
            position = _positions(order)[1]
            extra = np.zeros(self.n + 1, dtype=np.int64)
            for nbytes, readers in self.tangents:
                extra[self.n_forward] += nbytes
                extra[int(position[readers].max()) + 1] -= nbytes
            live = live + np.cumsum(extra[:-1])
        return max(0, int(live.max()))

    def items_first(self, order: Sequence[int]) -> list[int]:
        """``order`` with every getitem (see ``items``) right after the node it reads. Never a higher
        peak: a getitem allocates nothing, and the tuple it reads keeps every item alive until the
        last getitem runs, so a getitem placed late keeps the items, and a chunk loop's scratch, alive
        for nothing. Valid when ``order`` is: a getitem depends on its node alone."""
        moved = {j for js in self.items for j in js}
        if not moved:
            return list(order)
        result: list[int] = []
        for i in order:
            if i not in moved:
                result.append(i)
                result.extend(self.items[i])
        return result

    def is_valid(self, order: Sequence[int]) -> bool:
        """True when ``order`` respects every dependency and the phase boundary."""
        shared = self._shared
        if sorted(order) != list(range(self.n)):
            return False
        order, position = _positions(order)
        if np.any(position[shared.edge_from] > position[shared.edge_to]):
            return False
        # no forward node after a backward one: the phase flags never step down along the order
        phases = shared.backward[order]
        return not np.any(phases[1:] < phases[:-1])

    # -- greedy list scheduling -----------------------------------------------------------------

    def greedy(self, ready: "_Ready") -> list[int]:
        """Kahn's algorithm; ``ready`` ranks the nodes whose dependencies are placed and picks the next.

        Alongside, it keeps ``live`` and ``peak`` and, for every node not yet placed, ``freed[i]``:
        the bytes running ``i`` now would free. That changes only when a storage ``i`` touches is left
        with ``i`` as its one toucher not placed, or a storage ``i`` creates with none, so ``freed``
        is updated on those events (and ``ready`` told when ``i`` is ready), not summed again for
        every ready node at every step. Storages pinned to the end, or of size 0, never free
        anything and are left out (``_Shared.touches``).
        """
        shared = self._shared
        n, alloc, backward, succs = self.n, self.alloc, self.backward, self.succs
        touches, frees, creator = shared.touches, shared.frees, self.creator
        freed = list(shared.freed_at_start)
        remaining = list(self.n_touchers)  # touchers of each storage not placed yet
        # and the sum of their positions: once one is left, that is its position (no search)
        unplaced_sum = list(shared.toucher_sum)
        is_ready = [False] * n
        placed = [False] * n
        indegree = [len(p) for p in self.preds]
        waiting_backward: list[int] = []
        forward_left = self.n_forward
        n_ready = live = peak = 0
        order: list[int] = []
        add = ready.add

        def release(i: int) -> None:
            """``i``'s dependencies are placed: it is ready, or waits if it is backward and forward is not done."""
            nonlocal n_ready
            if backward[i] and forward_left > 0:
                waiting_backward.append(i)
            else:
                is_ready[i] = True
                n_ready += 1
                add(i, freed[i])

        for i in range(n):
            if indegree[i] == 0:
                release(i)
        while n_ready:
            pick = ready.pop(peak - live)
            order.append(pick)
            placed[pick] = True
            n_ready -= 1
            live += alloc[pick]
            if live > peak:
                peak = live
            live -= freed[pick]
            for s in touches[pick]:
                left = remaining[s] = remaining[s] - 1
                unplaced_sum[s] -= pick
                if left == 1:  # the one toucher left now frees s
                    t = unplaced_sum[s]
                elif left == 0:  # s dies with its creator, if the creator is still to run
                    t = creator[s]
                    if placed[t]:
                        continue
                else:
                    continue
                freed[t] += frees[s]
                if is_ready[t]:
                    add(t, freed[t])
            if not backward[pick]:
                forward_left -= 1
                if forward_left == 0:
                    for i in waiting_backward:
                        release(i)
                    waiting_backward.clear()
            for j in succs[pick]:
                indegree[j] -= 1
                if indegree[j] == 0:
                    release(j)
        if len(order) != n:  # pragma: no cover - a cycle would be a bug in stage 1
            raise AssertionError("the dependency graph of the schedule has a cycle")
        return order


def _positions(order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``order`` as an array, and each node's position in it (its inverse permutation)."""
    order = np.asarray(order, dtype=np.int64)
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order), dtype=np.int64)
    return order, position


class _Shared:
    """What the candidates share, derived once from a :class:`ScheduleProblem`.

    For :meth:`~ScheduleProblem.is_valid`: the edges and the phase flags, as numpy arrays. For
    :meth:`~ScheduleProblem.greedy`: ``touches[i]``, the storages ``i`` touches that free bytes when
    they die (``frees[s]`` > 0), the sum of each storage's touchers, and what each node frees before
    anything runs.
    """

    def __init__(self, problem: ScheduleProblem):
        n = problem.n
        frees = [0 if pinned else size for size, pinned in zip(problem.sizes, problem.to_end)]
        self.frees = frees
        self.edge_to = np.repeat(np.arange(n, dtype=np.int64), [len(ps) for ps in problem.preds])
        self.edge_from = np.fromiter(
            itertools.chain.from_iterable(problem.preds), dtype=np.int64, count=len(self.edge_to)
        )
        self.backward = np.array(problem.backward, dtype=bool)

        self.touches = [[s for s in ss if frees[s]] for ss in problem.touches]
        self.toucher_sum = [sum(ts) for ts in problem.touchers]
        self.freed_at_start = [0] * n
        for s, size in enumerate(frees):
            if size and problem.n_touchers[s] == 1:
                self.freed_at_start[problem.touchers[s][0]] += size
            elif size and problem.n_touchers[s] == 0:
                self.freed_at_start[problem.creator[s]] += size


class _Ready:
    """How a greedy order ranks its ready nodes; ties go to the original position.

    ``add(i, freed)`` is called when ``i`` becomes ready and again whenever what it would free
    changes (it only grows); ``pop(room)`` removes and returns the first, ``room`` being
    ``peak - live``. The heaps hold one entry per ``add``, the key ``(alloc - freed) * n + i``: one
    int orders like the pair ``(alloc - freed, i)`` (``0 <= i < n``) and compares faster. An entry
    is stale once its node is placed or has a newer key (``key[i]``); stale entries are dropped
    when they reach the top.
    """

    def __init__(self, problem: ScheduleProblem):
        self.n = problem.n
        self.alloc = problem.alloc
        self.key: list[int | None] = [None] * problem.n  # None: not ready, or placed

    def add(self, i: int, freed: int) -> None:
        raise NotImplementedError

    def pop(self, room: int) -> int:
        raise NotImplementedError


class _FreeFirst(_Ready):
    """The ready node with the smallest net allocation ``alloc - freed`` (frees the most)."""

    def __init__(self, problem: ScheduleProblem):
        super().__init__(problem)
        self.heap: list[int] = []

    def add(self, i: int, freed: int) -> None:
        key = self.key[i] = (self.alloc[i] - freed) * self.n + i
        heapq.heappush(self.heap, key)

    def pop(self, room: int) -> int:
        heap, key, n = self.heap, self.key, self.n
        while heap[0] != key[heap[0] % n]:
            heapq.heappop(heap)
        i = heapq.heappop(heap) % n
        key[i] = None
        return i


class _Lpmf(_Ready):
    """Least peak memory first (Inductor's ``topological_sort_lpmf`` rule): if some ready node would
    not raise the peak so far (``live + alloc <= peak``), the one leaving the fewest bytes live after
    it; else the one with the lowest peak while it runs, then the fewest bytes after.

    Both orders compare ``alloc`` and ``alloc - freed`` only (``live`` is the same for every node),
    so the ready nodes are kept in one heap of keys per distinct ``alloc``: the first rule takes the
    best top among the heaps whose ``alloc`` fits under ``room = peak - live``, the second the top of
    the heap with the smallest ``alloc``.
    """

    def __init__(self, problem: ScheduleProblem):
        super().__init__(problem)
        self.allocs = sorted(set(problem.alloc))
        self.heaps: list[list[int]] = [[] for _ in self.allocs]
        bucket = {alloc: b for b, alloc in enumerate(self.allocs)}
        self.bucket = [bucket[alloc] for alloc in problem.alloc]

    def add(self, i: int, freed: int) -> None:
        key = self.key[i] = (self.alloc[i] - freed) * self.n + i
        heapq.heappush(self.heaps[self.bucket[i]], key)

    def pop(self, room: int) -> int:
        key, n = self.key, self.n
        best: list[int] | None = None
        for alloc, heap in zip(self.allocs, self.heaps):
            while heap and heap[0] != key[heap[0] % n]:  # drop the stale entries
                heapq.heappop(heap)
            if not heap:
                continue
            if alloc > room:  # nothing fits under the peak: the smallest alloc, then the fewest after
                best = best or heap
                break
            if best is None or heap[0] < best[0]:
                best = heap
        i = heapq.heappop(best) % n
        key[i] = None
        return i


def _bfs(problem: ScheduleProblem) -> list[int]:
    """By depth (longest path from a source), then original position; the forward phase first.

    This is the order Kahn's algorithm gives when it always takes the ready node of lowest
    ``(depth, position)`` (how it was built before), found by one sort instead: an edge raises the
    depth, so the lowest node not placed has all its predecessors placed and is ready, and within a
    phase the greedy takes exactly the nodes in sorted order. Backward nodes wait for the forward
    ones, which depend on no backward node (else the greedy could never finish either).
    """
    n, preds, backward = problem.n, problem.preds, problem.backward
    depth = [0] * n
    for i in range(n):  # original order is topological
        ps = preds[i]
        if ps:
            depth[i] = max([depth[j] for j in ps]) + 1
            if not backward[i] and any(backward[j] for j in ps):  # pragma: no cover - a bug in stage 1
                raise AssertionError("the dependency graph of the schedule has a cycle")
    # np.lexsort sorts by its last key first
    return np.lexsort((np.arange(n), depth, problem.backward)).tolist()


def _dfs(problem: ScheduleProblem) -> list[int]:
    """Sethi-Ullman post-order: visit the operand that needs the most memory first.

    ``need(v)`` is the peak of evaluating ``v`` with its operands in Sethi-Ullman order as if the graph
    were a tree; shared operands make it an estimate, which is why the result is only a candidate.
    Each node's operands are ranked once, when its ``need`` is computed, and the walk reuses them.
    """
    n = problem.n
    out = problem.alloc
    need = [0] * n
    # operands go most-needing first, ties by position: a stable sort of the (ascending) operands
    # on out - need, which is -(need - out)
    rank_key = [0] * n
    ranked: list[list[int]] = []
    for i in range(n):
        children = problem.preds[i]
        if len(children) > 1:
            children = sorted(children, key=rank_key.__getitem__)
        ranked.append(children)
        held, best = 0, out[i]
        for c in children:
            if held + need[c] > best:
                best = held + need[c]
            held += out[c]
        need[i] = max(best, held + out[i])
        rank_key[i] = out[i] - need[i]

    order: list[int] = []
    placed = [False] * n

    def visit(root: int) -> None:
        stack: list[tuple[int, int]] = [(root, 0)]
        while stack:
            v, k = stack.pop()
            if placed[v]:
                continue
            children = ranked[v]
            while k < len(children) and placed[children[k]]:
                k += 1
            if k < len(children):
                stack.append((v, k + 1))
                stack.append((children[k], 0))
            else:
                placed[v] = True
                order.append(v)

    # the roots: nodes no node of their own phase reads, forward ones first
    backward = problem.backward
    sink = [not any(backward[j] == backward[i] for j in problem.succs[i]) for i in range(n)]
    for phase_backward in (False, True):
        sinks = [i for i in range(n) if sink[i] and backward[i] == phase_backward]
        for root in sorted(sinks, key=lambda i: (-need[i], i)):
            visit(root)
    return order


#: Candidate orders, in the order they are tried (the first of equal peaks wins).
STRATEGIES: dict[str, Callable[[ScheduleProblem], list[int]]] = {
    "original": lambda problem: list(range(problem.n)),
    "lpmf": lambda problem: problem.greedy(_Lpmf(problem)),
    "free_first": lambda problem: problem.greedy(_FreeFirst(problem)),
    "bfs": _bfs,
    "dfs": _dfs,
}


def plan_schedule(
    graph: CapturedGraph, am: AnalysisManager, strategies: Sequence[str] = tuple(STRATEGIES)
) -> SchedulePlan:
    """Try each strategy and keep the order with the lowest simulated peak (stages 1 to 3)."""
    if "original" not in strategies:
        strategies = ("original", *strategies)
    # Step 1: dependencies and storages.
    problem = ScheduleProblem(graph, am)
    # Step 2: candidate orders, each checked and simulated.
    best_name, best_order, best_peak = "", None, None
    dense_limit = None  # the input order's peak with dense output gradients
    peaks = []
    for name in strategies:
        order = problem.items_first(STRATEGIES[name](problem))
        if name != "original" and not problem.is_valid(order):
            continue  # a strategy may only ever produce valid orders; never take the risk
        timeline = problem.model.with_order(order)
        peak = timeline.peak
        peaks.append((name, peak))
        # Step 3: strictly lower wins; ties keep the earlier candidate (the original first). An order
        # is not taken when it would raise the peak of a step whose loss is outside the model (dense
        # output gradients) above the input order's: the plan is made with a .sum()'s broadcast seed,
        # and must not cost a cross-entropy over the logits more than eager's order does.
        if name == "original":
            dense_limit = problem.simulate_dense(order, timeline)
        elif best_peak is not None and peak < best_peak and problem.simulate_dense(order, timeline) > dense_limit:
            continue
        if best_peak is None or peak < best_peak:
            best_name, best_order, best_peak = name, order, peak
    return SchedulePlan(tuple(problem.names[i] for i in best_order), best_name, tuple(peaks))


def apply_schedule(graph: CapturedGraph, plan: SchedulePlan) -> CapturedGraph:
    """Move the nodes into ``plan.order`` (stage 4); the input graph when the order is unchanged."""
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    current = tuple(n.name for n in graph.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output"))
    if current == plan.order:
        return graph
    # Step 4: move each node just before the output, in the new order.
    output = next(n for n in graph.gm.graph.nodes if n.op == "output")
    for name in plan.order:
        output.prepend(by_name[name])
    graph.gm.graph.lint()
    graph.gm.recompile()
    return dataclasses.replace(graph)


def _order_writers(touching: Sequence[int], writers: set[int], preds: list[set[int]]) -> None:
    """Edges that keep each writer of one storage after the nodes touching it earlier and before
    those touching it later (``touching``: in original order, writers included).

    Each writer follows the writer before it and the readers since; each reader follows the writer
    before it. Every other such pair is ordered through these (a reader before a later writer comes
    before the next writer, which the writers after it follow), so k writers among n nodes cost
    O(n) edges instead of O(k n): the writes of every step of an unrolled loop into one buffer, or
    into one gradient accumulator, would otherwise make the problem quadratic in the steps.
    """
    previous: int | None = None
    readers: list[int] = []  # since the previous writer
    for i in touching:
        if previous is not None:
            preds[i].add(previous)
        if i in writers:
            preds[i].update(readers)
            previous, readers = i, []
        else:
            readers.append(i)


def _has_side_effects(node: torch.fx.Node) -> bool:
    """Random ops, and ops returning no tensor (asserts, prints) other than ``getitem``."""
    if node.op != "call_function":
        return node.op in ("call_module", "call_method")
    if is_random(node):
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and len(schema.returns) == 0


@register_pass("schedule")
def schedule(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Reorder the graph for the lowest simulated peak (see the module docstring)."""
    plan = plan_schedule(graph, ctx.am)
    if plan.strategy == "original":
        return PassResult(graph, changed=False, notes=("the input order already has the lowest peak found",), plan=plan)
    new = apply_schedule(graph, plan)
    analyses = AnalysisManager(new)  # handed to the pipeline, which would compute them again
    peak_after = analyses.get(PeakSimulation).peak
    moved = sum(1 for a, b in zip(ctx.am.get(Liveness).order, plan.order) if a != b)
    stats = PassStats(nodes_rewritten=moved, bytes_saved=plan.peak_before - peak_after)
    return PassResult(new, changed=True, stats=stats, notes=(str(plan),), plan=plan, analyses=analyses)
