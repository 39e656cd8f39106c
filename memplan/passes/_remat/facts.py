"""Stage 1 of rematerialisation: what may be recomputed, what recomputing costs, what saving costs.

Per forward node (:class:`NodeFacts`): whether it may be recomputed (the soundness conditions of
:mod:`memplan.passes.remat`), its FLOPs (which price the cuts) and predicted seconds (which price a
candidate for the policy), and the bytes its value keeps alive. An in-place unit counts as one node."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from memplan.analysis.cost import REFERENCE_RATES, CostRates, node_cost, submodule_cost
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.tensors import Tensors, last_writes, tensor_values
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import is_random, mutated_args, packet_name
from memplan.opschema import BATCH_NORM_RUNNING_STATISTICS, without_running_statistics
from memplan.passes._rewrite.noise_replay import replayable_draws

__all__ = [
    "DEFAULT_BAN_OPS",
    "recomputed_call",
    "updates_running_statistics_only",
    "NodeFacts",
    "RematFacts",
    "StorageIndex",
    "output_storages",
    "node_flops",
    "module_flops",
    "graph_flops",
    "copy_costs",
]


#: Ops too expensive to recompute in AOTAutograd's cut (its ``compute_intensive_ops``): matrix products,
#: convolutions and attention kernels. The priced cuts may still recompute them, at their FLOP cost.
DEFAULT_BAN_OPS: tuple[str, ...] = (
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation", "einsum",
    "convolution", "_convolution", "convolution_backward", "cudnn_convolution", "mkldnn_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward", "_scaled_mm", "upsample_bilinear2d",
)

#: Ops that produce a new tensor but cost no arithmetic worth counting (memory movement only).
_MOVE_OPS = frozenset({"clone", "contiguous", "_to_copy", "copy", "cat", "stack", "zeros", "ones", "full", "empty",
                       "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_empty",
                       "new_full", "scalar_tensor", "lift_fresh_copy", "_unsafe_view", "index_select",
                       "embedding", "gather", "constant_pad_nd"})



# ----------------------------------------------------------------------------------------------
# facts


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """What the planner knows about one forward node (or graph input)."""

    name: str
    position: int  # index in graph order
    recomputable: bool
    why_not: str | None  # why it cannot be recomputed
    expensive: bool  # its op is in ``ban_ops``
    signature: str  # op and input shapes, e.g. "mm(16x64,64x128)": repeated ops of a loop share it ("" unless expensive)
    flops: int
    save_bytes: int  # bytes kept alive by saving it (0: input, parameter, or kept by an output anyway)
    first_reader: int | None  # position of its first backward reader
    saveable: bool = True  # a single tensor (emit cannot save a list of tensors)
    view_of: str | None = None  # the one input whose storage this node only views (no FLOPs, no storage)
    unit: str | None = None  # first node of the in-place unit it belongs to (see ``RematFacts.units``)
    storages: tuple[int, ...] = ()  # the storages ``save_bytes`` counts
    seconds: float = 0.0  # predicted seconds of one run of it (the time model's, see memplan.analysis.cost)


@dataclasses.dataclass(frozen=True)
class RematFacts:
    """Facts about every forward node, the forward edges, and what the backward reads."""

    nodes: Mapping[str, NodeFacts]
    inputs: Mapping[str, tuple[str, ...]]  # forward node -> forward nodes / graph inputs it reads
    needed: tuple[str, ...]  # forward nodes and graph inputs that a backward node reads, graph order
    total_flops: int  # FLOPs of the whole graph, forward and backward
    forward_flops: int
    units: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # member -> its unit
    storage_bytes: Mapping[int, int] = dataclasses.field(default_factory=dict)  # storage id -> bytes
    total_seconds: float = 0.0  # predicted seconds of the whole graph run as a plan (graph_cost)

    @classmethod
    def compute(cls, graph: CapturedGraph, am: AnalysisManager,
                ban_ops: Iterable[str] = DEFAULT_BAN_OPS, rates: CostRates = REFERENCE_RATES) -> "RematFacts":
        """The facts of ``graph``; ``rates`` price each node's time (what recomputing it adds to the step)."""
        tensors = StorageIndex(am.get(Tensors))
        ban = frozenset(ban_ops)
        nodes = list(graph.gm.graph.nodes)
        position = {n.name: i for i, n in enumerate(nodes)}
        written = last_writes(graph, tensors)
        kept = output_storages(graph, tensors)
        units = _inplace_units(graph, tensors, position, written)
        replayable = replayable_draws(nodes, position, graph.node)
        tangents = {s.node for s in graph.inputs if s.kind == "tangent"}
        facts: dict[str, NodeFacts] = {}
        inputs: dict[str, tuple[str, ...]] = {}
        needed: list[str] = []
        total = forward = 0
        rates = rates.resolved()
        total_seconds = 0.0
        for node in nodes:
            seconds = 0.0
            if node.op == "call_function":
                flops = node_flops(node, tensors)
                seconds = node_cost(node, rates)
                total += flops
                total_seconds += seconds
                if graph.phases.get(node.name) is not Phase.FORWARD:
                    continue
                forward += flops
            elif node.op == "call_module":
                # a loop (a chunk loop) is one node to this pass, but its FLOPs are the graph's too: left
                # out, the share of any recomputation would be priced against too small a whole. (The
                # forward FLOPs, which scale the cuts' prices, stay those of the nodes the cuts see.)
                total += module_flops(graph.gm.get_submodule(node.target))
                total_seconds += submodule_cost(graph.gm.get_submodule(node.target), rates)
                continue
            elif node.op not in ("placeholder", "get_attr") or node.name in tangents:
                continue
            else:
                flops = 0
            readers = [position[u.name] for u in node.users
                       if u.op == "call_function" and graph.phases.get(u.name) is Phase.BACKWARD]
            first_reader = min(readers) if readers else None
            if first_reader is not None:
                needed.append(node.name)
            unit = units.get(node.name)
            if unit is not None:
                own = frozenset(tensors.storages_of(unit[0]))  # its own writes are replayed with it
                why_not = _why_not_recomputable(node, position[node.name], tensors, written, in_unit=True,
                                                replayed=own, replayable=replayable)
            elif node.op == "call_function":
                why_not = _why_not_recomputable(node, position[node.name], tensors, written)
            else:
                why_not = "graph input"
            if why_not is None:
                # a forward node these facts do not describe (a chunk loop's call_module) can be neither
                # saved nor recomputed by this pass: a copy reading it would make the backward read it
                # as it is (a loop's tuple of outputs, which cannot be saved)
                unknown = next((a.name for a in node.all_input_nodes if a.name not in facts), None)
                if unknown is not None:
                    why_not = f"reads {unknown}, which remat neither saves nor recomputes"
            counted = _saved_storages(node, tensors, kept)
            parent = node.args[0] if node.target is operator.getitem else None
            if why_not is None and isinstance(parent, torch.fx.Node) and parent.name in facts \
                    and not facts[parent.name].recomputable:
                why_not = "part of a multi-output op that cannot be recomputed"
            expensive = packet_name(node) in ban
            facts[node.name] = NodeFacts(
                name=node.name,
                position=position[node.name],
                recomputable=why_not is None,
                why_not=why_not,
                expensive=expensive,
                signature=_signature(node) if expensive else "",
                flops=flops,
                seconds=seconds,
                save_bytes=sum(tensors.storages[sid].nbytes for sid in counted),
                storages=counted,
                saveable=node.op != "call_function" or isinstance(node.meta.get("val"), torch.Tensor),
                view_of=_view_of(node, tensors) if node.op == "call_function" else None,
                first_reader=first_reader,
                unit=unit[0] if unit is not None else None,
            )
            inputs[node.name] = tuple(a.name for a in node.all_input_nodes)
        # A unit is recomputed whole or not at all.
        for member, unit in units.items():
            if not all(facts[m].recomputable for m in unit):
                why = next(facts[m].why_not for m in unit if not facts[m].recomputable)
                facts[member] = dataclasses.replace(facts[member], recomputable=False, why_not=why)
        storage_bytes = {sid: tensors.storages[sid].nbytes for fact in facts.values() for sid in fact.storages}
        return cls(nodes=facts, inputs=inputs, needed=tuple(needed), total_flops=total, forward_flops=forward,
                   units=units, storage_bytes=storage_bytes, total_seconds=total_seconds)

    def saved_bytes(self) -> int:
        """Bytes the graph saves: the storages of needed nodes that cost to save, each counted once.

        Not the sum of the nodes' saving costs: the views of one storage (the steps' slices of noise drawn
        before a loop) would count it once per view, and the sum would grow with the square of the
        loop's length.
        """
        seen: set[int] = set()
        total = 0
        for name in self.needed:
            fact = self.nodes[name]
            if fact.save_bytes == 0:
                continue
            if not fact.storages:
                total += fact.save_bytes
                continue
            for sid in fact.storages:
                if sid not in seen:
                    seen.add(sid)
                    total += self.storage_bytes[sid]
        return total


class StorageIndex:
    """A :class:`~memplan.analysis.tensors.Tensors` whose ``storages_of`` is a lookup: the facts ask for a
    node's storages once per reader, and a node with many outputs (``unbind`` of a 1000-step input, read
    by 1000 ``getitem`` nodes) would rebuild its tuple for each."""

    def __init__(self, tensors: Tensors):
        self.tensors = tensors.tensors
        self.storages = tensors.storages
        self._of = {name: tuple(info.storage for info in infos) for name, infos in tensors.tensors.items()}

    def storages_of(self, name: str) -> tuple[int, ...]:
        return self._of.get(name, ())


def _inplace_units(graph: CapturedGraph, tensors: Tensors, position: Mapping[str, int],
                   last_write: Mapping[int, int]) -> dict[str, tuple[str, ...]]:
    """In-place units: a storage the forward creates and then writes in place before anyone else reads it.

    Such a storage can be recomputed as a whole: replay its creator and its writers, in order, on a fresh
    storage (``nn.LSTMCell``'s gate buffer: ``addmm``, ``add_``, then ``sigmoid_``/``tanh_`` on slices).
    Conditions: every member (node aliasing it) is in the forward and aliases nothing else, the creator
    is a single tensor, and every forward node outside the unit that reads it does so after the last
    write (so the copies' final state is what every reader saw), or makes a storage of its own from it
    before then without writing (``nn.GRUCell``'s ``clone`` of a gate that autograd saves before
    ``mul_`` overwrites it). Such an early reader read a state the copies pass through, not their final
    one: it is never recomputed (:func:`_why_not_recomputable` sees the later write), so it is saved,
    and the unit still is replayed whole.
    """
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    units: dict[str, tuple[str, ...]] = {}
    for sid, storage in tensors.storages.items():
        if storage.external or sid not in last_write or graph.phases.get(storage.creator) is not Phase.FORWARD:
            continue
        members = storage.members
        if any(graph.phases.get(m) is not Phase.FORWARD for m in members if by_name[m].op == "call_function"
               and any(sid in tensors.storages_of(t.name) for t in mutated_args(by_name[m]))):
            continue  # a backward write
        members = tuple(m for m in members if graph.phases.get(m) is Phase.FORWARD)
        if not isinstance(by_name[members[0]].meta.get("val"), torch.Tensor):
            continue
        if any(set(tensors.storages_of(m)) != {sid} for m in members):
            continue
        if any(set(tensors.storages_of(t.name)) != {sid} for m in members for t in mutated_args(by_name[m])):
            continue
        writes = [position[m] for m in members if mutated_args(by_name[m])]
        if not writes:
            continue  # written by an op that returns another tensor (rrelu's noise): not replayable as a unit
        inside = set(members)
        last = max(writes)
        ok = True
        for member in members:
            for user in by_name[member].users:
                if user.name in inside or graph.phases.get(user.name) is not Phase.FORWARD:
                    continue
                if not isinstance(by_name[member].meta.get("val"), torch.Tensor):
                    ok = False
                elif position[user.name] < last and (mutated_args(user) or sid in tensors.storages_of(user.name)):
                    ok = False  # an early reader that writes, or aliases the storage (a view read later)
        if ok:
            for member in members:
                units[member] = members
    return units


def output_storages(graph: CapturedGraph, tensors: Tensors) -> frozenset[int]:
    output = next(n for n in reversed(graph.gm.graph.nodes) if n.op == "output")
    kept = set()
    for arg in output.all_input_nodes:
        kept.update(tensors.storages_of(arg.name))
    return frozenset(kept)


_BATCH_NORM = torch.ops.aten.native_batch_norm.default


def updates_running_statistics_only(node: torch.fx.Node) -> bool:
    """A training batch norm on the CPU that updates running statistics: its only writes.

    Recomputed, it runs without them (``native_batch_norm(x, w, b, None, None, True, momentum, eps)``, see
    :func:`recomputed_call`): the kernel computes the batch statistics and the output from ``x``, ``w``, ``b``,
    ``momentum`` and ``eps`` alone, so the same call gives the same statistics and output bit for bit
    (``rewrite``'s batch norm output, (j), relies on the same; checked for contiguous and channels-last
    inputs, with the backward on the forward's thread count as a training step runs it), and the running
    statistics are updated once, by the forward. CPU only: CUDA runs cuDNN's kernel, not checked.
    """
    if node.target is not _BATCH_NORM or len(node.args) < 8 or node.args[5] is not True:
        return False
    if not all(isinstance(node.args[i], torch.fx.Node) for i in BATCH_NORM_RUNNING_STATISTICS):
        return False
    value = node.meta.get("val")
    first = value[0] if isinstance(value, (tuple, list)) and value else None
    return isinstance(first, torch.Tensor) and first.device.type == "cpu"


def recomputed_call(node: torch.fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments a copy of ``node`` runs with (its own, remapped): a batch norm that updates running
    statistics is recomputed without them (:func:`updates_running_statistics_only`)."""
    return (without_running_statistics(args) if updates_running_statistics_only(node) else args), kwargs


def _why_not_recomputable(node: torch.fx.Node, position: int, tensors: Tensors, last_write: Mapping[int, int],
                          in_unit: bool = False, replayed: frozenset[int] = frozenset(),
                          replayable: frozenset[str] = frozenset()) -> str | None:
    if not (isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem):
        return "not an aten operator"
    if is_random(node) and not (in_unit and node.name in replayable):
        return "draws from the RNG"  # (a draw whose state the rewrite took is replayed from it, in its unit)
    statistics = updates_running_statistics_only(node)  # its copy reads and writes none of them
    if mutated_args(node) and not in_unit and not statistics:
        return "writes in place"
    if "val" not in node.meta:
        return "no fake value"
    touched = set(tensors.storages_of(node.name))
    unread = {node.args[i] for i in BATCH_NORM_RUNNING_STATISTICS} if statistics else set()
    for arg in node.all_input_nodes:
        if arg not in unread:
            touched.update(tensors.storages_of(arg.name))
    if any(last_write.get(sid, -1) > position for sid in touched if sid not in replayed):
        return "reads or is a storage that an op writes in place afterwards"
    return None


def _view_of(node: torch.fx.Node, tensors: Tensors) -> str | None:
    """The single input that ``node`` is a view of (it creates no storage and aliases only that input)."""
    args = node.all_input_nodes
    if len(args) != 1 or not _is_view(node, tensors):
        return None
    if set(tensors.storages_of(node.name)) <= set(tensors.storages_of(args[0].name)):
        return args[0].name
    return None


def _saved_storages(node: torch.fx.Node, tensors: Tensors, kept: frozenset[int]) -> tuple[int, ...]:
    """The storages that saving ``node`` keeps alive (not external, not kept by an output anyway)."""
    return tuple(sid for sid in sorted(set(tensors.storages_of(node.name)))
                 if not tensors.storages[sid].external and sid not in kept)


def _signature(node: torch.fx.Node) -> str:
    """``"mm(16x64,64x128)"``: the op and the shapes it reads."""
    shapes = []
    for arg in node.args:
        value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if isinstance(value, torch.Tensor):
            shapes.append("x".join(str(int(d)) for d in value.shape))
    return f"{packet_name(node) or node.op}({','.join(shapes)})"


def _numel(value: Any) -> int:
    return int(value.numel()) if isinstance(value, torch.Tensor) else 0


_FLOPS = "memplan_flops"  # node.meta key: (value, whether a view, FLOPs), see node_flops


def node_flops(node: torch.fx.Node, tensors: Tensors | None = None) -> int:
    """Estimated FLOPs of one node, from the shapes of its fake values.

    Matrix products count ``2*m*n*k`` (plus the bias), convolutions ``2 * output elements * input
    channels per group * kernel size``, attention ``4*b*h*l*s*e``; views and ``getitem`` count 0;
    memory movement (``clone``, ``cat``, factories) counts 0; every other op counts the elements it
    reads or writes, whichever is more (pointwise ops and reductions).

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> g = capture(lambda a, b: (a @ b).relu(), torch.randn(4, 8), torch.randn(8, 2), train=False)
    >>> [(n.name, node_flops(n)) for n in g.gm.graph.nodes if n.op == "call_function"]
    [('mm', 128), ('relu', 8)]
    """
    if node.op != "call_function" or node.target is operator.getitem:
        return 0
    view = tensors is not None and _is_view(node, tensors)
    # Asked of every node by each planning pass, and most nodes keep their fake value from one graph to
    # the next (copies share it): the count is kept with the value it was made from.
    meta = node.meta
    value = meta.get("val")
    cached = meta.get(_FLOPS)
    if cached is not None and cached[0] is value and cached[1] is view:
        return cached[2]
    flops = 0 if view else _node_flops(node)
    meta[_FLOPS] = (value, view, flops)
    return flops


def module_flops(module: torch.nn.Module) -> int:
    """FLOPs of one call of a module a graph calls: a loop's (a chunk loop's :meth:`flops`, every chunk's
    ops counted by :func:`node_flops`), 0 for a module that does not say."""
    flops = getattr(module, "flops", None)
    return int(flops(node_flops)) if callable(flops) else 0


def _node_flops(node: torch.fx.Node) -> int:
    name = packet_name(node)
    if name in _MOVE_OPS:
        return 0
    args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    out = node.meta.get("val")
    if name in ("mm", "matmul") and _shapes(args, 2):
        (m, k), (_, n) = args[0].shape[-2:], args[1].shape[-2:]
        return 2 * int(m) * int(k) * int(n) * max(1, _numel(out) // max(1, int(m) * int(n)))
    if name in ("addmm", "_addmm_activation") and _shapes(args[1:], 2):
        (m, k), (_, n) = args[1].shape, args[2].shape
        return 2 * int(m) * int(k) * int(n) + int(m) * int(n)
    if name in ("bmm", "baddbmm", "addbmm"):
        a, b = (args[1], args[2]) if name != "bmm" else (args[0], args[1])
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return 2 * _numel(a) * int(b.shape[-1])
    convolutions = ("convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution")
    if name in convolutions and isinstance(out, torch.Tensor):
        weight = args[1]
        if isinstance(weight, torch.Tensor):
            per_output = int(weight.shape[1]) * math.prod(int(s) for s in weight.shape[2:])
            return 2 * _numel(out) * per_output
    if name == "convolution_backward" and isinstance(args[2], torch.Tensor) and isinstance(args[0], torch.Tensor):
        weight = args[2]
        per_output = int(weight.shape[1]) * math.prod(int(s) for s in weight.shape[2:])
        return 4 * _numel(args[0]) * per_output
    if name.startswith("_scaled_dot_product") or name == "scaled_dot_product_attention":
        q, k = args[0], args[1]
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
            return 4 * _numel(q) * int(k.shape[-2])
    read = sum(_numel(a) for a in args if isinstance(a, torch.Tensor))
    written = sum(_numel(v) for _, v in tensor_values(node))
    return max(read, written)


def _shapes(args: Sequence[Any], rank: int) -> bool:
    return len(args) >= 2 and all(isinstance(a, torch.Tensor) and a.dim() >= rank for a in args[:2])


def _is_view(node: torch.fx.Node, tensors: Tensors) -> bool:
    """True when the node creates no storage: a view, an alias, or an in-place result."""
    infos = tensors.tensors.get(node.name, ())
    return bool(infos) and all(tensors.storages[i.storage].creator != node.name for i in infos)


def graph_flops(graph: CapturedGraph, am: AnalysisManager | None = None) -> int:
    """Estimated FLOPs of every op of ``graph`` (see :func:`node_flops`), the ops of its loops included
    (see :func:`module_flops`)."""
    tensors = (am or AnalysisManager(graph)).get(Tensors)
    total = 0
    for node in graph.gm.graph.nodes:
        if node.op == "call_function":
            total += node_flops(node, tensors)
        elif node.op == "call_module":
            total += module_flops(graph.gm.get_submodule(node.target))
    return total



def copy_costs(facts: RematFacts) -> dict[str, float]:
    """Predicted seconds of one copy of each forward node: its own, or, for the creator of an in-place
    unit (the key its copy goes by), the whole unit's, which is copied with it."""
    costs = {name: fact.seconds for name, fact in facts.nodes.items()}
    for member, unit in facts.units.items():
        if member == unit[0]:
            costs[member] = sum(facts.nodes[m].seconds for m in unit if m in facts.nodes)
    return costs
