"""Stages 3 and 4 of rematerialisation: which nodes to recompute, as minimum cuts of the forward graph.

:class:`CutNetwork` is AOTAutograd's construction (a node ``v_in -> v_out`` of its saving bytes, forward
edges infinite), cut at a price of compute per FLOP; :class:`Cuts` memoises the cuts of one graph, swept
over prices and repaired for hoisting (:func:`hoisted`); :func:`ban_sets` are the classes of expensive ops
the knapsack keeps saved in turn. See :mod:`memplan.passes.remat`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence


from memplan.passes._remat.facts import RematFacts

__all__ = ["min_cut", "CutNetwork", "hoisted", "Cuts", "ban_sets"]


# ----------------------------------------------------------------------------------------------
# Step 3: cuts


def _relevant(facts: RematFacts) -> list[str]:
    """Forward nodes that are needed by the backward or are ancestors of one, in graph order."""
    seen: set[str] = set()
    stack = list(facts.needed)
    while stack:
        name = stack.pop()
        if name in seen or name not in facts.nodes:
            continue
        seen.add(name)
        stack.extend(facts.inputs.get(name, ()))
    return sorted(seen, key=lambda n: facts.nodes[n].position)


def min_cut(facts: RematFacts, *, price: float | None, banned: frozenset[str] = frozenset()) -> frozenset[str]:
    """The forward nodes a minimum cut recomputes.

    Parameters
    ----------
    facts : RematFacts
    price : float or None
        None: AOTAutograd's cut (expensive ops banned, every other recomputable op free). Otherwise the
        price of one FLOP in bytes: recomputing ``v`` costs ``price * FLOPs(v)``.
    banned : frozenset of str
        Nodes that must not be recomputed (saved if the backward needs them).

    Returns
    -------
    frozenset of str
        Recomputable nodes on the sink side of the cut (those the backward needs, transitively, are
        copied; the rest are never made).

    Notes
    -----
    Several cuts of one graph share their network: :class:`CutNetwork` builds it once.
    """
    return CutNetwork(facts).cut(price, banned)


class CutNetwork:
    """The flow network of stage 3 for one graph, built once and cut at any price and ban set.

    Nodes free to save (inputs, views of them, tensors an output keeps) stay out of the network: they
    are always available and never recomputed. A view is merged into the tensor it views (saving either
    keeps the same storage, and recomputing a view costs nothing), and an in-place unit into its creator.
    Each remaining node ``v`` is two network nodes, ``v_in -> v_out`` with its saving cost; a node that
    cannot be recomputed is only its ``v_out`` half, fed from the source through its saving cost. Edges
    ``u_out -> v_in`` (``v`` reads ``u``) and ``v_out -> sink`` (the backward reads ``v``) are infinite;
    ``source -> v_in`` costs ``price * FLOPs(v)``. A banned node (or, in AOTAutograd's cut, an expensive
    one) is fed from the source without limit instead: its ``v_in`` is on the source side of every finite
    cut, so the cut pays its saving cost exactly as if it could not be recomputed.

    So the network is the same for every cut; only the capacities of the source edges differ (and the
    saving edge of a banned node that cannot be saved, which is closed). A cut is solved by Dinic's
    max-flow (short augmenting paths in level graphs; the networks of unrolled loops have few levels),
    after pushing along the one- and two-node paths directly. When an earlier cut of the network had no
    larger capacity anywhere (a lower price, a subset of the bans), its maximum flow is still a flow here
    and the search starts from it.

    The result does not depend on which maximum flow is found: the nodes that can still reach the sink in
    the residual network are the same for every maximum flow (they form the smallest sink side of all
    minimum cuts), so this agrees with any other exact max-flow solver, networkx's included (the tests
    compare them).

    Examples
    --------
    A chain ``x -> a -> b`` whose ``b`` the backward reads, ``a`` cheap to recompute from the input:

    >>> from memplan.passes._remat.facts import NodeFacts
    >>> facts = RematFacts(
    ...     nodes={n: NodeFacts(n, i, n != "x", None, False, n, 8 if n != "x" else 0, s, r)
    ...            for i, (n, s, r) in enumerate([("x", 0, None), ("a", 64, None), ("b", 64, 5)])},
    ...     inputs={"a": ("x",), "b": ("a",)}, needed=("b",), total_flops=16, forward_flops=16)
    >>> network = CutNetwork(facts)
    >>> sorted(network.cut(price=None)), sorted(network.cut(price=100.0))
    (['a', 'b'], [])
    """

    def __init__(self, facts: RematFacts):
        self.facts = facts
        self.relevant = relevant = _relevant(facts)  # also what :func:`_ban_sets` groups into classes
        rep = _representatives(facts, relevant)
        members: dict[str, list[str]] = {}
        for name in relevant:
            members.setdefault(rep[name], []).append(name)
        # One pair of network nodes per merged node, in graph order; nodes free to save are out. Node 0
        # is the source, 1 the sink, 2i + 2 and 2i + 3 are ``v_in`` and ``v_out`` of merged node i.
        self.names: list[str] = [name for name in members if facts.nodes[name].save_bytes > 0]
        index = {name: i for i, name in enumerate(self.names)}
        self.recomputed_members = [tuple(m for m in members[name] if facts.nodes[m].recomputable) for name in self.names]
        self.size = 2 * len(self.names) + 2
        self.adjacent: list[list[int]] = [[] for _ in range(self.size)]  # edge ids leaving each node
        self.to: list[int] = []  # head of each edge; edge e ^ 1 is the reverse of edge e
        self.base: list[float] = []  # capacities that no cut changes
        self.save: list[int | None] = []  # None: cannot be saved (infinite)
        self.flops: list[int] = []
        self.expensive: list[bool] = []
        self.priced: list[int] = []  # recomputable merged nodes, whose source and saving edges vary
        self.source_edge: dict[int, int] = {}
        self.save_edge: dict[int, int] = {}
        self.paths: list[tuple[int, int | None, int]] = []  # (source edge, saving edge, sink edge)
        self.unsaveable = frozenset(name for name in self.names if not facts.nodes[name].saveable)
        for i, name in enumerate(self.names):
            fact = facts.nodes[name]
            group = members[name]
            save = fact.save_bytes if fact.saveable else None
            self.save.append(save)
            self.flops.append(sum(facts.nodes[m].flops for m in group))
            self.expensive.append(fact.expensive)
            v_in, v_out = 2 * i + 2, 2 * i + 3
            first = None
            if fact.recomputable:
                self.priced.append(i)
                first = self.source_edge[i] = self._edge(0, v_in, 0)
                self.save_edge[i] = self._edge(v_in, v_out, 0)
                heads = []
                for member in group:
                    for arg in facts.inputs.get(member, ()):
                        head = rep.get(arg)
                        if head is not None and head != name and head in index:
                            heads.append(index[head])
                for head in dict.fromkeys(heads):
                    self._edge(2 * head + 3, v_in, math.inf)
            elif save is not None:
                first = self._edge(0, v_out, save)
            if any(facts.nodes[m].first_reader is not None for m in group):
                sink = self._edge(v_out, 1, math.inf)
                if first is not None:
                    self.paths.append((first, self.save_edge.get(i), sink))
        # Per recomputable merged node, what a cut's capacities depend on (read once per cut, in a loop
        # over thousands of nodes): (i, source edge, saving edge, saving cost, FLOPs, expensive, name).
        self._priced_rows = [(i, self.source_edge[i], self.save_edge[i], self.save[i], self.flops[i],
                              self.expensive[i], self.names[i]) for i in self.priced]
        # Solved cuts: (price, banned, capacities, residual capacities of the maximum flow).
        self._solved: list[tuple[float, frozenset[str], list[float], list[float]]] = []

    def _edge(self, tail: int, head: int, capacity: float) -> int:
        edge = len(self.to)
        self.adjacent[tail].append(edge)
        self.to.append(head)
        self.base.append(capacity)
        self.adjacent[head].append(edge + 1)
        self.to.append(tail)
        self.base.append(0)
        return edge

    def _banned(self, i: int, price: float | None, banned: frozenset[str]) -> bool:
        return self.names[i] in banned or (price is None and self.expensive[i])

    def cut(self, price: float | None, banned: frozenset[str] = frozenset()) -> frozenset[str]:
        """The recompute set of the minimum cut at ``price`` with ``banned`` kept saved (see :func:`min_cut`)."""
        banned = frozenset(banned)
        # Step 1: the capacities of this cut (``open_`` lists the merged nodes neither banned nor, in
        # AOTAutograd's cut, expensive: :meth:`_banned` inlined).
        capacity = list(self.base)
        open_: list[int] = []
        for i, source_edge, save_edge, save, flops, expensive, name in self._priced_rows:
            if name in banned or (price is None and expensive):
                capacity[source_edge] = math.inf if save is not None else 0
                capacity[save_edge] = save if save is not None else 0
            else:
                open_.append(i)
                capacity[source_edge] = 0 if price is None else int(round(price * flops))
                capacity[save_edge] = save if save is not None else math.inf
        # Step 2: start from the maximum flow of an earlier cut whose capacities are nowhere larger.
        residual = None
        if price is not None:
            for old_price, old_banned, old_capacity, old_residual in reversed(self._solved):
                if old_price <= price and old_banned <= banned and not (banned - old_banned) & self.unsaveable:
                    residual = [r if new == old else r + (new - old)
                                for r, new, old in zip(old_residual, capacity, old_capacity)]
                    break
        if residual is None:
            residual = list(capacity)
        # Step 3: a maximum flow; then the nodes that still reach the sink.
        _max_flow(self.adjacent, self.to, residual, self.paths)
        if price is not None:
            self._solved.append((price, banned, capacity, residual))
        reaches = _reaching_sink(self.adjacent, self.to, residual)
        members = self.recomputed_members
        return frozenset(m for i in open_ if reaches[2 * i + 2] for m in members[i])


def _max_flow(adjacent: Sequence[Sequence[int]], to: Sequence[int], residual: list[float],
              paths: Sequence[tuple[int, int | None, int]] = ()) -> None:
    """Turn ``residual`` (residual capacities of a feasible flow from node 0 to node 1) into those of a
    maximum flow.

    First the short ``paths`` (edge ids from the source to the sink) are pushed directly. Then Dinic's
    algorithm: a breadth-first search labels nodes by their distance from the source over edges with
    residual capacity, and a depth-first search pushes flow along shortest paths only (each node remembers
    the next edge to try, and a dead end is dropped from the level graph), until the sink is out of reach.
    """
    for first, middle, last in paths:
        pushed = min(residual[first], residual[last]) if middle is None \
            else min(residual[first], residual[middle], residual[last])
        if pushed > 0:
            for e in (first, middle, last):
                if e is not None:
                    residual[e] -= pushed
                    residual[e ^ 1] += pushed
    size, source, sink = len(adjacent), 0, 1
    while True:
        level = [-1] * size
        level[source] = 0
        frontier = [source]
        while frontier and level[sink] < 0:
            following = []
            for u in frontier:
                next_level = level[u] + 1
                for e in adjacent[u]:
                    v = to[e]
                    if residual[e] > 0 and level[v] < 0:
                        level[v] = next_level
                        following.append(v)
            frontier = following
        if level[sink] < 0:
            return
        cursor = [0] * size
        while True:
            path: list[int] = []
            u = source
            while u != sink:
                edges_of, i, wanted = adjacent[u], cursor[u], level[u] + 1
                end = len(edges_of)
                while i < end:
                    e = edges_of[i]
                    if residual[e] > 0 and level[to[e]] == wanted:
                        break
                    i += 1
                cursor[u] = i
                if i < end:
                    path.append(e)
                    u = to[e]
                elif u == source:
                    break
                else:
                    level[u] = -1  # a dead end: out of this level graph
                    u = to[path.pop() ^ 1]
                    cursor[u] += 1
            if u != sink:
                break
            pushed = min(residual[e] for e in path)
            for e in path:
                residual[e] -= pushed
                residual[e ^ 1] += pushed


def _reaching_sink(adjacent: Sequence[Sequence[int]], to: Sequence[int], residual: Sequence[float]) -> list[bool]:
    """Which nodes reach the sink (node 1) over edges with residual capacity: a search backwards from it
    (the edge ``u -> v`` is the reverse of an edge ``v -> u`` that ``v`` lists)."""
    reaches = [False] * len(adjacent)
    reaches[1] = True
    stack = [1]
    while stack:
        v = stack.pop()
        for e in adjacent[v]:
            if residual[e ^ 1] > 0:
                u = to[e]
                if not reaches[u]:
                    reaches[u] = True
                    stack.append(u)
    return reaches


def _reaches_sink_after_max_flow(size: int, edges: Sequence[tuple[int, int, int | None]]) -> list[bool]:
    """Which nodes reach the sink (node 1) in the residual network of a maximum flow from node 0, for a
    network given as ``(tail, head, capacity)`` edges (None: infinite)."""
    adjacent: list[list[int]] = [[] for _ in range(size)]
    to: list[int] = []
    residual: list[float] = []
    for tail, head, capacity in edges:
        adjacent[tail].append(len(to))
        to.append(head)
        residual.append(math.inf if capacity is None else capacity)
        adjacent[head].append(len(to))
        to.append(tail)
        residual.append(0)
    _max_flow(adjacent, to, residual)
    return _reaching_sink(adjacent, to, residual)


def _representatives(facts: RematFacts, relevant: Sequence[str]) -> dict[str, str]:
    """Node -> the node it is merged into in the cut network (itself, or what it views)."""
    rep: dict[str, str] = {}
    for name in relevant:
        fact = facts.nodes[name]
        if fact.unit is not None and fact.unit != name and fact.unit in rep:
            rep[name] = rep[fact.unit]  # an in-place unit is recomputed whole: one node
            continue
        base = fact.view_of
        head = rep.get(base) if base is not None else None
        mergeable = head is not None and facts.nodes[head].saveable
        if mergeable and (fact.recomputable or not facts.nodes[head].recomputable):
            rep[name] = head
        else:
            rep[name] = name
    return rep



# ----------------------------------------------------------------------------------------------
# Step 4: hoisting repair


def hoisted(facts: RematFacts, recompute: frozenset[str], limit: int,
            users: Mapping[str, tuple[str, ...]]) -> frozenset[str]:
    """Nodes to save instead, so that no copy goes more than ``limit`` positions before its own reader.

    Scans the recomputed nodes from the last forward node back. ``placed[v]`` is where the copy of ``v``
    goes: before its earliest consumer (its own first backward reader, or a copy that reads it). A node
    whose copy would be placed more than ``limit`` positions before its own first reader is saved
    instead, and then consumes nothing, which moves its ancestors' copies later.
    """
    placed: dict[str, int | None] = {}
    ban: set[str] = set()
    for name in sorted(recompute, key=lambda n: -facts.nodes[n].position):
        own = facts.nodes[name].first_reader
        times = [placed[u] for u in users.get(name, ()) if placed.get(u) is not None]
        if own is not None:
            times.append(own)
        at = min(times) if times else None
        if own is not None and at is not None and own - at > limit:
            ban.add(name)
            placed[name] = None
        else:
            placed[name] = at
    return frozenset(ban)


def _forward_users(facts: RematFacts) -> dict[str, tuple[str, ...]]:
    users: dict[str, list[str]] = {}
    for name, args in facts.inputs.items():
        for arg in args:
            users.setdefault(arg, []).append(name)
    return {k: tuple(v) for k, v in users.items()}



class Cuts:
    """Memoised cuts of one graph: plain, repaired for hoisting, and swept over prices."""

    def __init__(self, facts: RematFacts, rounds: int = 4):
        self.facts = facts
        self.network = CutNetwork(facts)
        self.users = _forward_users(facts)
        self.rounds = rounds
        self.memo: dict[tuple[float | None, frozenset[str]], frozenset[str]] = {}

    def cut(self, price: float | None, banned: frozenset[str] = frozenset()) -> frozenset[str]:
        key = (price, banned)
        if key not in self.memo:
            self.memo[key] = self.network.cut(price, banned)
        return self.memo[key]

    def repaired(self, price: float | None, limit: int) -> frozenset[str]:
        """The cut at ``price`` with hoisted nodes saved instead, re-cut until no copy is hoisted."""
        banned: frozenset[str] = frozenset()
        recompute = self.cut(price)
        for _ in range(self.rounds):
            more = hoisted(self.facts, recompute, limit, self.users) - banned
            if not more:
                break
            banned |= more
            recompute = self.cut(price, banned)
        return recompute

    def sweep(self, low: float, high: float, depth: int) -> list[float]:
        """Prices from ``low`` to ``high`` (bytes per FLOP), bisected geometrically where the cut changes.

        The sink side of a priced cut only grows as the price falls (a parametric min cut), so an
        interval whose two ends cut alike holds no other cut and is not split further.
        """
        points = {low: self.cut(low), high: self.cut(high)}

        def refine(a: float, b: float, depth: int) -> None:
            if depth == 0 or points[a] == points[b]:
                return
            middle = math.sqrt(a * b)
            points[middle] = self.cut(middle)
            refine(a, middle, depth - 1)
            refine(middle, b, depth - 1)

        refine(low, high, depth)
        return sorted(points)



def ban_sets(facts: RematFacts, exhaustive: int,
              relevant: Sequence[str] | None = None) -> list[tuple[str, frozenset[str]]]:
    """Sets of expensive-op classes to keep saved: every subset of up to ``exhaustive`` classes, else
    growing prefixes of the classes sorted by FLOPs (most expensive first). ``relevant``: ``_relevant(facts)``
    when the caller has it."""
    classes: dict[str, list[str]] = {}
    flops: dict[str, int] = {}
    for name in _relevant(facts) if relevant is None else relevant:
        fact = facts.nodes[name]
        if fact.expensive and fact.recomputable and fact.save_bytes > 0:
            classes.setdefault(fact.signature, []).append(name)
            flops[fact.signature] = flops.get(fact.signature, 0) + fact.flops
    keys = sorted(classes, key=lambda k: (-flops[k], k))
    if len(keys) <= exhaustive:
        subsets = [c for r in range(1, len(keys)) for c in itertools.combinations(keys, r)]
    else:
        subsets = [tuple(keys[:r]) for r in range(1, len(keys))]
    return [("+".join(sub), frozenset(n for k in sub for n in classes[k])) for sub in subsets]
