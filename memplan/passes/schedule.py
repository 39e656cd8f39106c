"""Memory-aware ordering: pick the topological order of the joint graph with the lowest simulated peak.

What it does
------------
The order a model's Python code happens to compute things in is one valid order among many. When a
graph branches, computing one branch to the end (and freeing its temporaries) before starting the
next one can keep far fewer bytes live than interleaving them. The pass tries several orders that
respect every dependency, simulates the peak of each with the same model as
:class:`~memplan.analysis.peak.PeakSimulation` (graph lifetimes), and keeps the lowest; the input order
is one of the candidates, so the peak never rises.

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
    whose order does not matter is left untouched (``changed=False``).
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
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
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
    the graph in that order, without rebuilding it.
    """

    def __init__(self, graph: CapturedGraph, am: AnalysisManager):
        tensors, liveness = am.get(Tensors), am.get(Liveness)
        self.names: tuple[str, ...] = liveness.order
        index = {name: i for i, name in enumerate(self.names)}
        self.index = index
        by_name = {n.name: n for n in graph.gm.graph.nodes}
        nodes = [by_name[name] for name in self.names]
        n = len(nodes)
        self.n = n
        self.backward = [graph.phases.get(name) is Phase.BACKWARD for name in self.names]
        self.n_forward = sum(1 for b in self.backward if not b)
        preds: list[set[int]] = [set() for _ in range(n)]

        # Step 1a: data edges.
        for i, node in enumerate(nodes):
            for arg in node.all_input_nodes:
                j = index.get(arg.name)
                if j is not None:
                    preds[i].add(j)

        # Storages: size, creator, every node touching one of its aliases, pinned to the end or not.
        self.sizes: list[int] = []
        self.creator: list[int] = []
        self.to_end: list[bool] = []
        touchers: list[set[int]] = []
        storage_of_sid: dict[int, int] = {}
        readers_of_sid: dict[int, set[int]] = {}
        for sid, storage in tensors.storages.items():
            readers: set[int] = set()
            to_end = storage.external
            for member in storage.members:
                if member in index:
                    readers.add(index[member])
                for user in by_name[member].users:
                    if user.op == "output":
                        to_end = True
                    elif user.name in index:
                        readers.add(index[user.name])
            readers_of_sid[sid] = readers
            if storage.external:
                continue
            creator = index[storage.creator]
            storage_of_sid[sid] = len(self.sizes)
            self.sizes.append(storage.nbytes)
            self.creator.append(creator)
            self.to_end.append(to_end)
            touchers.append(readers - {creator})

        # Step 1b: writers stay between the earlier and the later readers of what they write.
        ordered: list[int] = []
        writers_of_sid: dict[int, set[int]] = {}
        for i, node in enumerate(nodes):
            written = mutated_args(node) if node.op == "call_function" else []
            if written or _has_side_effects(node):
                ordered.append(i)
            for target in written:
                for sid in tensors.storages_of(target.name):
                    writers_of_sid.setdefault(sid, set()).add(i)
        for sid, writers in writers_of_sid.items():
            _order_writers(sorted(readers_of_sid.get(sid, set()) | writers), writers, preds)
        # Step 1c: side effects keep their relative order.
        for a, b in zip(ordered, ordered[1:]):
            preds[b].add(a)
        for i in range(n):
            preds[i].discard(i)

        self.preds: list[tuple[int, ...]] = [tuple(sorted(p)) for p in preds]
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, ps in enumerate(self.preds):
            for j in ps:
                succs[j].append(i)
        self.succs: list[tuple[int, ...]] = [tuple(sorted(s)) for s in succs]
        self.born: list[list[int]] = [[] for _ in range(n)]
        for s, c in enumerate(self.creator):
            self.born[c].append(s)
        self.touches: list[list[int]] = [[] for _ in range(n)]
        for s, ts in enumerate(touchers):
            for t in sorted(ts):
                self.touches[t].append(s)
        self.n_touchers = [len(ts) for ts in touchers]
        self.touchers: list[tuple[int, ...]] = [tuple(sorted(ts)) for ts in touchers]
        self.alloc = [sum(self.sizes[s] for s in self.born[i]) for i in range(n)]

    # -- simulation -----------------------------------------------------------------------------

    def simulate(self, order: Sequence[int]) -> int:
        """Peak bytes of the graph run in ``order`` (a permutation of ``range(n)``)."""
        position = [0] * self.n
        for p, i in enumerate(order):
            position[i] = p
        dies: dict[int, int] = {}
        for s, c in enumerate(self.creator):
            if self.to_end[s]:
                continue
            end = position[c]
            dies[s] = end
        for i in range(self.n):
            p = position[i]
            for s in self.touches[i]:
                if not self.to_end[s] and p > dies[s]:
                    dies[s] = p
        freed_at = [0] * self.n
        for s, p in dies.items():
            freed_at[p] += self.sizes[s]
        live = peak = 0
        for p, i in enumerate(order):
            live += self.alloc[i]
            peak = max(peak, live)
            live -= freed_at[p]
        return peak

    def is_valid(self, order: Sequence[int]) -> bool:
        """True when ``order`` respects every dependency and the phase boundary."""
        if sorted(order) != list(range(self.n)):
            return False
        position = {i: p for p, i in enumerate(order)}
        if any(position[j] > position[i] for i in range(self.n) for j in self.preds[i]):
            return False
        seen_backward = False
        for i in order:
            if self.backward[i]:
                seen_backward = True
            elif seen_backward:
                return False
        return True

    # -- greedy list scheduling -----------------------------------------------------------------

    def greedy(self, ready: "_Ready") -> list[int]:
        """Kahn's algorithm; ``ready`` ranks the nodes whose dependencies are placed and picks the next."""
        state = _State(self, ready)
        indegree = [len(p) for p in self.preds]
        waiting_backward: list[int] = []
        forward_left = self.n_forward
        order: list[int] = []

        def release(i: int) -> None:
            if self.backward[i] and forward_left > 0:
                waiting_backward.append(i)
            else:
                state.release(i)

        for i in range(self.n):
            if indegree[i] == 0:
                release(i)
        while state.n_ready:
            pick = ready.pop(state)
            order.append(pick)
            state.run(pick)
            if not self.backward[pick]:
                forward_left -= 1
                if forward_left == 0:
                    for i in waiting_backward:
                        state.release(i)
                    waiting_backward.clear()
            for j in self.succs[pick]:
                indegree[j] -= 1
                if indegree[j] == 0:
                    release(j)
        if len(order) != self.n:  # pragma: no cover - a cycle would be a bug in stage 1
            raise AssertionError("the dependency graph of the schedule has a cycle")
        return order


class _State:
    """Live bytes, remaining readers, and what each ready node would free, while a greedy order is built.

    What running a ready node ``i`` frees changes only when a storage it reads is left with ``i`` as
    its one reader, or a storage it creates with none: ``freed[i]`` is updated on those events (and
    ``ready`` told), rather than summed again for every ready node at every step.
    """

    def __init__(self, problem: ScheduleProblem, ready: "_Ready"):
        self.problem = problem
        self.ready = ready
        self.remaining = list(problem.n_touchers)
        self.placed = [False] * problem.n
        self.is_ready = [False] * problem.n
        self.freed = [0] * problem.n
        self.n_ready = 0
        self.live = 0
        self.peak = 0

    def freed_by(self, i: int) -> int:
        """Bytes freed right after running ``i`` now."""
        p = self.problem
        freed = 0
        for s in p.touches[i]:
            if self.remaining[s] == 1 and not p.to_end[s]:
                freed += p.sizes[s]
        for s in p.born[i]:
            if self.remaining[s] == 0 and not p.to_end[s]:
                freed += p.sizes[s]
        return freed

    def release(self, i: int) -> None:
        """``i`` becomes ready."""
        self.is_ready[i] = True
        self.n_ready += 1
        self.freed[i] = self.freed_by(i)
        self.ready.add(i, self)

    def _refresh(self, i: int) -> None:
        if self.is_ready[i] and not self.placed[i]:
            freed = self.freed_by(i)
            if freed != self.freed[i]:
                self.freed[i] = freed
                self.ready.add(i, self)

    def run(self, i: int) -> None:
        p = self.problem
        self.placed[i] = True
        self.n_ready -= 1
        self.live += p.alloc[i]
        self.peak = max(self.peak, self.live)
        self.live -= self.freed[i]
        for s in p.touches[i]:
            self.remaining[s] -= 1
            if p.to_end[s]:
                continue
            if self.remaining[s] == 1:
                for t in p.touchers[s]:  # the one reader left now frees s
                    if not self.placed[t]:
                        self._refresh(t)
            elif self.remaining[s] == 0:
                self._refresh(p.creator[s])


class _Ready:
    """How a greedy order ranks its ready nodes; ties go to the original position.

    ``add(i, state)`` is called when ``i`` becomes ready and again whenever ``state.freed[i]``
    changes; ``pop(state)`` removes and returns the first. Heaps hold one entry per ``add``: entries
    of placed nodes, or with an old ``freed``, are stale and dropped when they reach the top.
    """

    def add(self, i: int, state: _State) -> None:
        raise NotImplementedError

    def pop(self, state: _State) -> int:
        raise NotImplementedError


def _drop_stale(heap: list, state: _State) -> None:
    """Pop the stale entries ``(net, i)`` off the top of ``heap`` (``net`` is ``alloc - freed``)."""
    alloc, freed, placed = state.problem.alloc, state.freed, state.placed
    while heap and (placed[heap[0][1]] or heap[0][0] != alloc[heap[0][1]] - freed[heap[0][1]]):
        heapq.heappop(heap)


class _ByRank(_Ready):
    """The ready node with the lowest fixed ``rank[i]`` (ties: the lower ``i``)."""

    def __init__(self, rank: Sequence[Any]):
        self.rank = rank
        self.heap: list = []
        self.queued: set[int] = set()

    def add(self, i: int, state: _State) -> None:
        if i not in self.queued:  # the rank does not depend on what is freed
            self.queued.add(i)
            heapq.heappush(self.heap, (self.rank[i], i))

    def pop(self, state: _State) -> int:
        return heapq.heappop(self.heap)[1]


class _FreeFirst(_Ready):
    """The ready node with the smallest net allocation ``alloc - freed`` (frees the most)."""

    def __init__(self):
        self.heap: list = []

    def add(self, i: int, state: _State) -> None:
        heapq.heappush(self.heap, (state.problem.alloc[i] - state.freed[i], i))

    def pop(self, state: _State) -> int:
        _drop_stale(self.heap, state)
        return heapq.heappop(self.heap)[1]


class _Lpmf(_Ready):
    """Least peak memory first (Inductor's ``topological_sort_lpmf`` rule): if some ready node would
    not raise the peak so far (``live + alloc <= peak``), the one leaving the fewest bytes live after
    it; else the one with the lowest peak while it runs, then the fewest bytes after.

    Both orders compare ``alloc`` and ``alloc - freed`` only (``live`` is the same for every node),
    so the ready nodes are kept in one heap of ``(alloc - freed, i)`` per distinct ``alloc``: the
    first rule takes the best top among the heaps whose ``alloc`` fits under ``peak - live``, the
    second the top of the heap with the smallest ``alloc``.
    """

    def __init__(self, problem: ScheduleProblem):
        self.allocs = sorted(set(problem.alloc))
        self.heaps: dict[int, list] = {a: [] for a in self.allocs}

    def add(self, i: int, state: _State) -> None:
        alloc = state.problem.alloc[i]
        heapq.heappush(self.heaps[alloc], (alloc - state.freed[i], i))

    def pop(self, state: _State) -> int:
        room = state.peak - state.live
        best: list | None = None
        for alloc in self.allocs:
            heap = self.heaps[alloc]
            _drop_stale(heap, state)
            if not heap:
                continue
            if alloc > room:  # nothing fits under the peak: the smallest alloc, then the fewest after
                best = best or heap
                break
            if best is None or heap[0] < best[0]:
                best = heap
        return heapq.heappop(best)[1]


def _bfs(problem: ScheduleProblem) -> list[int]:
    """By depth (longest path from a source), then original position."""
    depth = [0] * problem.n
    for i in range(problem.n):  # original order is topological
        for j in problem.preds[i]:
            depth[i] = max(depth[i], depth[j] + 1)
    return problem.greedy(_ByRank(depth))


def _dfs(problem: ScheduleProblem) -> list[int]:
    """Sethi-Ullman post-order: visit the operand that needs the most memory first.

    ``need(v)`` is the peak of evaluating ``v`` with its operands in Sethi-Ullman order as if the graph
    were a tree; shared operands make it an estimate, which is why the result is only a candidate.
    """
    n = problem.n
    out = problem.alloc
    need = [0] * n
    for i in range(n):
        children = sorted(problem.preds[i], key=lambda c: (-(need[c] - out[c]), c))
        held, best = 0, out[i]
        for c in children:
            best = max(best, held + need[c])
            held += out[c]
        need[i] = max(best, held + out[i])

    order: list[int] = []
    placed = [False] * n

    def visit(root: int) -> None:
        # a node is popped once per operand it visits: sort its operands once
        ranked: dict[int, list[int]] = {}
        stack: list[tuple[int, int]] = [(root, 0)]
        while stack:
            v, k = stack.pop()
            if placed[v]:
                continue
            children = ranked.get(v)
            if children is None:
                children = ranked[v] = sorted(problem.preds[v], key=lambda c: (-(need[c] - out[c]), c))
            while k < len(children) and placed[children[k]]:
                k += 1
            if k < len(children):
                stack.append((v, k + 1))
                stack.append((children[k], 0))
            else:
                placed[v] = True
                order.append(v)

    for phase_backward in (False, True):
        sinks = [
            i for i in range(n)
            if problem.backward[i] == phase_backward
            and not any(problem.backward[j] == phase_backward for j in problem.succs[i])
        ]
        for root in sorted(sinks, key=lambda i: (-need[i], i)):
            visit(root)
    return order


#: Candidate orders, in the order they are tried (the first of equal peaks wins).
STRATEGIES: dict[str, Callable[[ScheduleProblem], list[int]]] = {
    "original": lambda problem: list(range(problem.n)),
    "lpmf": lambda problem: problem.greedy(_Lpmf(problem)),
    "free_first": lambda problem: problem.greedy(_FreeFirst()),
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
    peaks = []
    for name in strategies:
        order = STRATEGIES[name](problem)
        if name != "original" and not problem.is_valid(order):
            continue  # a strategy may only ever produce valid orders; never take the risk
        peak = problem.simulate(order)
        peaks.append((name, peak))
        # Step 3: strictly lower wins; ties keep the earlier candidate (the original first).
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
