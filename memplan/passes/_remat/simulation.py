"""Stage 5 of rematerialisation: the peak a plan reaches, simulated without building it."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence

import numpy as np

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory_model import MemoryModel, NewNode
from memplan.analysis.peak import step_margin
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase
from memplan.passes._remat.copies import CopyPlan, StackRead

__all__ = ["VirtualSimulation"]


# ----------------------------------------------------------------------------------------------
# Step 5: candidates, simulated without building them


class VirtualSimulation:
    """The peak a graph reaches after stack reads and copies, computed without editing the graph.

    Same model as :class:`~memplan.analysis.peak.PeakSimulation` under graph lifetimes: a storage is
    allocated by the node that creates it and freed after the last node that reads any tensor aliasing
    it; storages aliased by graph outputs stay to the end; external storages never count. A copy creates
    storages of the same sizes as its original's and aliases whatever its inputs resolve to, so the peak
    equals the simulated peak of the applied graph (the tests check it) at the cost of one linear sweep,
    with no fake-tensor propagation and no code generation.

    The sweep is sparse: a plan touches a few thousand items (its copies and slices, the backward nodes
    that read them, and the views of those whose storages move), and every other node of the graph
    aliases and reads what it did before the plan. What those do is fixed per graph and kept as arrays
    (which storages each node touches, which node creates each storage), so a plan costs numpy work on
    them plus Python work on the items it touches, not a Python loop over the whole graph; planning
    simulates a dozen plans of one graph.

    Examples
    --------
    >>> import torch, dataclasses
    >>> from memplan.capture import capture
    >>> from memplan.analysis.peak import PeakSimulation
    >>> g = dataclasses.replace(capture(torch.nn.Linear(4, 4), torch.randn(2, 4)), lifetimes="graph")
    >>> am = AnalysisManager(g)
    >>> VirtualSimulation(g, am).peak() == am.get(PeakSimulation).peak
    True
    """

    def __init__(self, graph: CapturedGraph, am: AnalysisManager):
        tensors = am.get(Tensors)
        nodes = list(graph.gm.graph.nodes)
        self._nodes = nodes
        self._phases = graph.phases
        self.names = tuple(n.name for n in nodes)  # copy anchors index this (all nodes, graph order)
        # Items are ids (ints): a node of the graph is its index in ``names``.
        self.index = index = {name: i for i, name in enumerate(self.names)}
        node_id = {n: i for i, n in enumerate(nodes)}
        infos = tensors.tensors
        storages = self.storages = tensors.storages
        self.next_id = max(storages, default=-1) + 1
        self.margin = step_margin(graph)
        # Per node: the ids of its inputs (for the nodes the emitted code runs: ops and chunk loops, which
        # read every input they are given), the storages it aliases, and the bytes of its (first) value.
        self.arg_ids = tuple(tuple(node_id[a] for a in n.all_input_nodes)
                             if n.op not in ("placeholder", "get_attr", "output") else () for n in nodes)
        self.alias_ids = tuple(tuple(dict.fromkeys(info.storage for info in infos.get(name, ())))
                               for name in self.names)
        self.value_bytes = {index[name]: found[0].nbytes for name, found in infos.items() if found and name in index}
        self.creator = {sid: index.get(storage.creator, -1) for sid, storage in storages.items()}
        output = next(n for n in reversed(nodes) if n.op == "output")
        self.output_ids = tuple(node_id[a] for a in output.all_input_nodes)
        # The nodes the sweep visits, in graph order (``order[p]`` is a node id), and each node's place.
        self.order = np.array([i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr", "output")],
                              dtype=np.int64)
        place = [-1] * len(nodes)
        for p, i in enumerate(self.order.tolist()):
            place[i] = p
        self.place = place
        # Who reads each node (among the visited nodes), for following storages that a plan moves.
        readers: list[list[int]] = [[] for _ in nodes]
        for i in self.order.tolist():
            for a in self.arg_ids[i]:
                readers[a].append(i)
        self.readers = tuple(tuple(r) for r in readers)
        # The timeline of an applied plan is the memory model's (its positions are ``place``).
        if graph.lifetimes != "graph":
            am = AnalysisManager(dataclasses.replace(graph, lifetimes="graph"))
        self.model = am.get(MemoryModel)
        self._backward_users: dict[str, tuple[int, ...]] = {}

    def backward_users(self, name: str) -> tuple[int, ...]:
        """Ids of the backward nodes that read ``name`` (for the stack reads of a plan)."""
        found = self._backward_users.get(name)
        if found is None:
            node = self._nodes[self.index[name]]
            found = self._backward_users[name] = tuple(
                self.index[u.name] for u in node.users if self._phases.get(u.name) is Phase.BACKWARD)
        return found

    def step_peak(self, reads: Sequence[StackRead] = (), copies: CopyPlan | None = None) -> int:
        """:meth:`peak` plus :func:`step_margin`: the peak ``memplan.measure`` reports for a training step."""
        return self.peak(reads, copies) + self.margin

    def step_floor(self, saved: Iterable[str], reads: Sequence[StackRead] = ()) -> int:
        """A lower bound on :meth:`step_peak` for a plan that saves ``saved`` (its forward values that the
        backward or its copies read, stack reads included): the forward storages they alias are all alive
        when the backward starts, since copies go into the backward, and so are those of the graph's
        outputs. Values the ``reads`` serve are read from their stack instead (every reader is
        redirected), so they do not count."""
        served = {read.value for read in reads}
        index, alias_ids, storages, creator = self.index, self.alias_ids, self.storages, self.creator
        names, phases = self.names, self._phases
        kept = [index[name] for name in saved if name in index and name not in served]
        alive: set[int] = set()
        for i in (*kept, *self.output_ids):
            for sid in alias_ids[i]:
                made = creator[sid]
                if made >= 0 and not storages[sid].external and phases.get(names[made]) is Phase.FORWARD:
                    alive.add(sid)
        return sum(storages[sid].nbytes for sid in alive) + self.margin

    def peak(self, reads: Sequence[StackRead] = (), copies: CopyPlan | None = None) -> int:
        """Peak bytes of the graph with ``reads`` and ``copies`` applied (both planned on this graph)."""
        live = self._live(reads, copies)
        return int(live.max()) if len(live) else 0

    def timeline(self, reads: Sequence[StackRead] = (), copies: CopyPlan | None = None) -> list[int]:
        """Bytes live right after each node of the applied graph (``SimEvent.live``), in its order."""
        return self._live(reads, copies).tolist()

    def _live(self, reads: Sequence[StackRead], copies: CopyPlan | None) -> np.ndarray:
        # Step 1: the new items. Copy ``k`` (creation order) is ``count + k``, the slice of ``reads[i]``
        # is ``first_slice + i``; what each stands for, and what it reads: an original (its id) or a copy.
        index, names, count = self.index, self.names, len(self.names)
        keys = copies.copies if copies is not None else ()
        copy_of = {key: count + k for k, key in enumerate(keys)}
        first_slice = count + len(keys)
        units = copies.units if copies is not None else {}

        def root(name: str) -> str:
            unit = units.get(name)
            return unit[0] if unit is not None else name

        node_of: list[int] = list(range(count))  # item -> id of the node of the graph it stands for
        copy_args: list[tuple[int, ...]] = []  # per copy: ids of the originals of its inputs
        copy_reads: list[list[int]] = []  # per copy: the items it reads
        for key in keys:
            sources = copies.sources[key]
            node_of.append(index[key[1]])
            copy_args.append(tuple(index[arg] for arg in sources))  # a unit reads the outside inputs of all its members
            copy_reads.append([index[arg] if held is None else copy_of[(held, root(arg))]
                               for arg, held in sources.items()])
        node_of.extend(index[read.value] for read in reads)

        # Step 2: where each new item goes: copies before their anchor node (creation order), then each
        # slice of a stack read before the first backward node or copy that reads its value.
        place = self.place
        before: dict[int, list[int]] = {}
        rank: dict[int, tuple[int, int, int]] = {}  # an item's place in the sequence, comparable without building it
        for k, key in enumerate(keys):
            anchor = copies.anchors[key]
            made = before.setdefault(anchor, [])
            rank[count + k] = (place[anchor], 0, len(made))
            made.append(count + k)

        def rank_of(item: int) -> tuple[int, int, int]:
            return rank[item] if item >= count else (place[item], 1, 0)

        redirect: dict[tuple[int, int], int] = {}  # (reader item, id of the value it reads) -> slice item
        slices: dict[int, list[int]] = {}
        if reads:
            copy_readers: dict[str, list[int]] = {}
            for k, key in enumerate(keys):
                for arg, held in copies.sources[key].items():
                    if held is None:
                        copy_readers.setdefault(arg, []).append(count + k)
            for i, read in enumerate(reads):
                via = [r for r in self.backward_users(read.value)
                       if copies is None or read.value not in copies.reads.get(names[r], {})]
                readers = via + copy_readers.get(read.value, [])
                if not readers:
                    continue
                slices.setdefault(min(readers, key=rank_of), []).append(first_slice + i)
                value = index[read.value]
                for reader in readers:
                    redirect[(reader, value)] = first_slice + i

        # Step 3: the position of every item in the applied graph. A visited node moves down by the new
        # items placed before it or before an earlier node; the new items placed before node ``i`` are
        # ``runs[i]``, in order.
        runs: dict[int, list[int]] = {}
        for anchor in set(before) | {item for item in slices if item < count}:
            if place[anchor] < 0:
                continue  # not a visited node: neither are the items placed before it
            run: list[int] = []
            for made in before.get(anchor, ()):
                run.extend(slices.get(made, ()))
                run.append(made)
            run.extend(slices.get(anchor, ()))
            runs[anchor] = run
        visited = len(self.order)
        shift = np.zeros(visited, dtype=np.int64)
        for anchor, run in runs.items():
            shift[place[anchor]] = len(run)
        at_place = np.arange(visited, dtype=np.int64) + np.cumsum(shift)  # position of each visited node
        at_new: dict[int, int] = {}
        for anchor, run in runs.items():
            start = int(at_place[place[anchor]]) - len(run)
            for j, item in enumerate(run):
                at_new[item] = start + j

        # What a node of the graph reads through a copy: item -> {id of the value: copy item}.
        through: dict[int, dict[int, int]] = {}
        if copies is not None:
            for reader, values in copies.reads.items():
                through[index[reader]] = {index[value]: copy_of[(held, root(value))] for value, held in values.items()}

        # Step 4: the storages of the items the plan touches, visited in order: every new item, the nodes
        # that read a copy or a slice, and (found on the way) the readers of nodes whose storages moved.
        # Every other node of the graph reads no copy or slice and no node whose storages moved, so it
        # aliases and reads what it did before the plan (step 5). An item's inputs come before it, so
        # what they alias is known when it is reached.
        arg_ids, alias_ids, storages, value_bytes, creator = (self.arg_ids, self.alias_ids, self.storages,
                                                              self.value_bytes, self.creator)
        readers_of, next_id = self.readers, self.next_id
        created: dict[int, int] = {}  # new storage id -> bytes
        maps: dict[int, dict[int, int] | None] = {}  # item -> {storage of its node: storage it has}, or None: the same
        aliases: dict[int, tuple[int, ...]] = {}  # item -> the storages it aliases
        queued: set[int] = set()  # nodes of the graph visited here
        pending = [(at, item) for item, at in at_new.items()]
        for item in set(through) | {reader for reader, _ in redirect if reader < count}:
            if place[item] >= 0:
                pending.append((int(at_place[place[item]]), item))
                queued.add(item)
        heapq.heapify(pending)
        touches: dict[int, tuple[int, ...]] = {}  # item -> the storages it aliases and reads
        born: dict[int, int] = {}  # new storage -> position of its first item
        while pending:
            at, item = heapq.heappop(pending)
            mapping: dict[int, int] | None
            if item >= first_slice:
                # a slice aliases the stack (or, made contiguous, a storage of its own)
                read = reads[item - first_slice]
                stack, value = index[read.stack], index[read.value]
                arg_items: list[int] = [stack]
                if read.contiguous:
                    target = next_id + len(created)
                    created[target] = value_bytes[value]
                else:
                    target = alias_ids[stack][0]
                mapping = {sid: target for sid in alias_ids[value]}
                own = tuple(dict.fromkeys(mapping.values()))
            else:
                if item < count:
                    node, args = item, arg_ids[item]
                    via = through.get(item)
                    arg_items = list(args) if via is None else [via.get(arg, arg) for arg in args]
                else:
                    node, args = node_of[item], copy_args[item - count]
                    arg_items = copy_reads[item - count]
                if redirect:
                    arg_items = [redirect.get((item, arg), ref) for arg, ref in zip(args, arg_items)]
                # A node that creates a storage keeps it (a copy gets a new one of the same size); a view
                # aliases whatever the input it views now aliases, exactly as the applied graph's
                # refreshed fake values do.
                mapping = {}
                changed = False
                for sid in alias_ids[node]:
                    target = sid
                    if creator.get(sid) == node:
                        if item >= count:
                            target = next_id + len(created)
                            created[target] = storages[sid].nbytes
                    else:
                        for arg, arg_item in zip(args, arg_items):
                            if sid in alias_ids[arg]:
                                arg_map = maps.get(arg_item)
                                if arg_map is not None:
                                    target = arg_map.get(sid, sid)
                                break
                    mapping[sid] = target
                    changed = changed or target != sid
                if changed:
                    own = tuple(dict.fromkeys(mapping[sid] for sid in alias_ids[node]))
                else:
                    mapping, own = None, alias_ids[node]
                if item < count and mapping is not None:
                    for reader in readers_of[item]:
                        if reader not in queued:
                            queued.add(reader)
                            heapq.heappush(pending, (int(at_place[place[reader]]), reader))
            maps[item] = mapping
            aliases[item] = own
            touched = list(own)
            for sid in own:
                if sid >= next_id and sid not in born:
                    born[sid] = at
            for arg_item in arg_items:
                found = aliases.get(arg_item)
                touched.extend(alias_ids[arg_item] if found is None else found)
            touches[item] = tuple(dict.fromkeys(touched))

        # Step 5: the applied graph's timeline is the memory model's: each new item a ``NewNode`` before
        # its anchor (in run order), each node followed here touching what it touches now, the output
        # too when a storage it keeps moved. Every other node touches what it touched before the plan.
        inserted: list[NewNode] = []
        for anchor in sorted(runs, key=place.__getitem__):  # in run order: a storage is made before it is read
            for item in runs[anchor]:
                at = at_new[item]
                own = set(aliases[item])
                creates = {sid: created[sid] for sid in own if sid >= next_id and born[sid] == at}
                inserted.append(NewNode(before=place[anchor], creates=creates,
                                        touches=tuple(sid for sid in touches[item] if sid not in creates)))
        retouched = {place[item]: touches[item] for item in touches if item < count}
        if any(maps.get(item) is not None for item in self.output_ids):
            retouched[self.model.end] = tuple(sid for item in self.output_ids
                                              for sid in aliases.get(item, alias_ids[item]))
        return self.model.with_recompute(inserted, retouched).live
