"""Small helpers every pass needs: naming ops, spotting random ops, editing a captured graph safely.

A pass that adds nodes must give each one a fake value (``meta["val"]``, fx's shape record, which the
analyses read), a phase (forward or backward) and, where it can, the user's source line.
:class:`GraphEditor` does all three and returns a new :class:`~memplan.capture.CapturedGraph`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.multiprocessing.reductions import StorageWeakRef

from memplan._capture.fake import wrap_fake
from memplan._capture.tracer import create_node  # capture's tracer makes its nodes the same way
from memplan.capture import UNORDERED_SEQ_NR, CapturedGraph, Phase
from memplan.opschema import is_pure_view, is_random, is_view_op, mutated_args

__all__ = [
    "ALIAS_OPS",
    "value_of",
    "shape_of",
    "is_tensor",
    "nbytes",
    "graph_device",
    "run_device",
    "next_seq_nr",
    "packet_name",
    "is_random",
    "mutated_args",
    "is_pure_view",
    "fake_value",
    "same_geometry",
    "rebuilt_value",
    "create_node",
    "copy_graph",
    "GraphEditor",
]


# ops whose result aliases an operand's storage: they allocate and compute nothing
ALIAS_OPS = frozenset({"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze",
                       "squeeze", "select", "slice", "narrow", "alias", "detach", "as_strided", "diagonal", "unbind",
                       "split", "split_with_sizes", "chunk", "unfold", "view_as", "_reshape_alias", "lift_fresh"})


def value_of(node: Any) -> Any:
    """The fake value of ``node`` (None for what is not a node)."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def shape_of(node: Any) -> tuple[int, ...]:
    """The shape of ``node``'s fake tensor (``()`` when it holds none)."""
    value = value_of(node)
    if isinstance(value, torch.Tensor):
        return tuple(map(int, value.shape))
    return ()


def is_tensor(node: Any) -> bool:
    """``node`` is a graph node whose fake value is one tensor."""
    return isinstance(node, torch.fx.Node) and isinstance(value_of(node), torch.Tensor)


def nbytes(node: torch.fx.Node) -> int:
    """Bytes of the tensors in ``node``'s fake value."""
    total = 0
    for value in pytree.tree_leaves(node.meta.get("val")):
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def graph_device(graph: CapturedGraph) -> torch.device:
    """The device of the graph's tensors: its first tensor value's (CPU for a graph without any)."""
    for node in graph.gm.graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor):
                return value.device
    return torch.device("cpu")


def run_device(graph: CapturedGraph) -> torch.device:
    """The device the graph's plan runs on: the target of a graph traced on a stand-in device
    (:attr:`CapturedGraph.target_device`), else its tensors' device."""
    return graph.target_device or graph_device(graph)


def next_seq_nr(graph: CapturedGraph) -> int:
    """The first sequence number above every one the graph's ops are ordered by: where the numbers of
    nodes a pass adds start (:data:`~memplan.capture.UNORDERED_SEQ_NR` and up stay out)."""
    return max([s for s in graph.seq_nr.values() if s < UNORDERED_SEQ_NR] + [0]) + 1


def packet_name(node: torch.fx.Node) -> str:
    """``"mm"`` for ``aten.mm.default``; ``""`` for non-operator nodes."""
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else ""


def copy_graph(graph: CapturedGraph) -> CapturedGraph:
    """A copy whose GraphModule passes may edit in place; node names (and so every mapping) are kept.

    Fake values are shared, not copied: passes replace a node's ``meta["val"]``, never mutate it.
    The copy generates its Python code lazily (fx's ``_LazyGraphModule``, as :mod:`memplan.emit` uses):
    each changing pass recompiles the module, and on an unrolled loop of tens of thousands of nodes
    generating code nobody reads took seconds per pass; reading ``gm.code`` or calling the module still
    generates it first.
    """
    # fx's ``Graph.graph_copy`` makes each node with ``Graph.create_node``, whose walk of the arguments
    # (a warning about symbolic values memplan's static graphs never hold) was a third of the copy.
    new = torch.fx.Graph()
    value_map: dict[torch.fx.Node, torch.fx.Node] = {}
    lookup = value_map.__getitem__
    for old in graph.gm.graph.nodes:
        if old.op == "output":
            new.output(torch.fx.map_arg(old.args[0], lookup))
            break
        copied = create_node(new, old.op, old.target, torch.fx.map_arg(old.args, lookup),
                             torch.fx.map_arg(old.kwargs, lookup), old.name, old.type)
        copied.meta = copy.copy(old.meta)
        if copied.name != old.name:
            raise AssertionError(f"graph copy renamed {old.name} to {copied.name}")
        value_map[old] = copied
    return dataclasses.replace(graph, gm=_LazyGraphModule(graph.gm, new))


def _fake_mode_of(values: list[Any]):
    for value in values:
        mode = getattr(value, "fake_mode", None)
        if mode is not None:
            return mode
    raise ValueError("no fake tensor among the arguments: cannot infer the fake mode")


def fake_value(target: Callable[..., Any], args: tuple, kwargs: dict | None = None) -> Any:
    """Run ``target`` on the fake values of fx-node arguments: the new node's ``meta["val"]``."""
    kwargs = kwargs or {}

    def to_val(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    fake_args = pytree.tree_map(to_val, args)
    fake_kwargs = pytree.tree_map(to_val, kwargs)
    leaves = pytree.tree_leaves((fake_args, fake_kwargs))
    mode = _fake_mode_of(leaves)
    if is_view_op(target):
        value = _view_value(mode, target, fake_args, fake_kwargs, leaves)
        if value is not None:
            return value
    with mode:
        return target(*fake_args, **fake_kwargs)


def _view_value(mode: Any, target: Any, args: Any, kwargs: Any, leaves: list[Any]) -> Any:
    """A pure view op's fake value, computed as the fake mode computes it (the op's meta kernel on the
    fake tensors, whose outputs are wrapped on their input's device) without the mode's dispatch, which
    costs ten times the kernel: passes re-derive thousands of views of moved values. Only for inputs that
    are fake tensors of ``mode`` on one device and carry no constant (constants are propagated by the
    mode); None otherwise."""
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not tensors or any(not isinstance(t, FakeTensor) or t.fake_mode is not mode or t.constant is not None
                          for t in tensors):
        return None
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        return None
    with in_kernel_invocation_manager(mode):
        out = target(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        return wrap_fake(mode, out, device)
    if isinstance(out, (list, tuple)) and all(isinstance(o, torch.Tensor) for o in out):
        return type(out)(wrap_fake(mode, o, device) for o in out)
    return None


def same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, strides, offset, dtype and storage size: views of either have the same metadata."""
    return (a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.dtype == b.dtype and a.untyped_storage().nbytes() == b.untyped_storage().nbytes())


def rebuilt_value(value: Any, storage_of: dict[StorageWeakRef, Any], *, fresh: bool = True) -> Any:
    """``value`` with the same metadata on other storages: ``storage_of`` maps an old storage to its new
    one; a storage not in it gets a fresh one (shared by every tensor of ``value`` that had it), or with
    ``fresh=False`` makes this return None.

    This is the fake value of a copy of a node whose arguments have the layout of the original's, or of
    a view whose input moved to another storage of the same layout: the op would produce the same
    metadata, and alias the arguments it aliased before. Building it directly is about ten times faster
    than running the op under the fake mode, which matters when a pass copies or re-derives tens of
    thousands of nodes. Returns None when ``value`` holds something else than fake tensors.
    """
    def convert(tensor: Any) -> Any:
        mode = getattr(tensor, "fake_mode", None)
        if mode is None:
            raise _NotRebuilt
        key = StorageWeakRef(tensor.untyped_storage())
        storage = storage_of.get(key)
        if storage is None:
            if not fresh:
                raise _NotRebuilt
            storage = storage_of[key] = torch.UntypedStorage(tensor.untyped_storage().nbytes(), device=_META)
        meta = torch.empty(0, dtype=tensor.dtype, device=_META).set_(
            storage, tensor.storage_offset(), tensor.shape, tensor.stride()
        )
        return wrap_fake(mode, meta, tensor.fake_device)

    try:
        if isinstance(value, torch.Tensor):
            return convert(value)
        if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
            return type(value)(convert(v) for v in value)
    except (_NotRebuilt, RuntimeError):
        return None
    return None


_META = torch.device("meta")
class _NotRebuilt(Exception):
    """A value that cannot be rebuilt (the slow path is taken)."""


class GraphEditor:
    """Edits ``graph.gm`` in place and tracks phases, sources, modules and sequence numbers of new nodes.

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> g = capture(lambda x: x.exp(), torch.randn(4), train=False)
    >>> ed = GraphEditor(g)
    >>> exp = next(n for n in g.gm.graph.nodes if packet_name(n) == "exp")
    >>> neg = ed.call(torch.ops.aten.neg.default, (exp,), like=exp, after=exp)
    >>> tuple(neg.meta["val"].shape), ed.finish().phases[neg.name].value
    ((4,), 'forward')
    """

    def __init__(self, graph: CapturedGraph):
        self.graph = graph
        self.gm = graph.gm
        self.phases = dict(graph.phases)
        self.sources = dict(graph.sources)
        self.library_sources = dict(graph.library_sources)
        self.modules = dict(graph.modules)
        self.seq_nr = dict(graph.seq_nr)
        self.changed = False

    def call(
        self,
        target: Callable[..., Any],
        args: tuple,
        kwargs: dict | None = None,
        *,
        like: torch.fx.Node | None = None,
        phase: Phase | None = None,
        before: torch.fx.Node | None = None,
        after: torch.fx.Node | None = None,
        name: str | None = None,
        value: Any = None,
    ) -> torch.fx.Node:
        """Insert ``target(*args, **kwargs)``; its phase, source and module come from ``like`` (phase unless given).

        ``value``: its fake value when the caller knows it (an in-place op's is its ``self``'s), which
        saves running the op under the fake mode; by default the op runs.
        """
        if (before is None) == (after is None):
            raise ValueError("give exactly one of before= or after=")
        graph = self.gm.graph
        ctx = graph.inserting_before(before) if before is not None else graph.inserting_after(after)
        with ctx:
            node = create_node(graph, "call_function", target, args, kwargs, name)
        node.meta["val"] = fake_value(target, args, kwargs) if value is None else value
        self._inherit(node, like, phase)
        self.changed = True
        return node

    def copy(self, node: torch.fx.Node, remap: Callable[[torch.fx.Node], torch.fx.Node], *, phase: Phase,
             before: torch.fx.Node) -> torch.fx.Node:
        """A copy of ``node`` with its inputs remapped (e.g. recomputation in the backward)."""
        with self.gm.graph.inserting_before(before):
            new = self.gm.graph.node_copy(node, remap)
        new.meta = {"val": fake_value(node.target, new.args, new.kwargs)}
        self._inherit(new, node, phase)
        self.changed = True
        return new

    def _inherit(self, node: torch.fx.Node, like: torch.fx.Node | None, phase: Phase | None) -> None:
        if like is not None:
            self.phases[node.name] = phase or self.phases.get(like.name, Phase.FORWARD)
            self.inherit_origin(node, like)
        else:
            self.phases[node.name] = phase or Phase.FORWARD

    def inherit_origin(self, node: torch.fx.Node, like: torch.fx.Node) -> None:
        """Give ``node`` the user line, torch line, module and sequence number of ``like`` (what it copies
        or stands for), so reports name the same layer and line for both."""
        for names in (self.sources, self.library_sources, self.modules, self.seq_nr):
            if like.name in names:
                names[node.name] = names[like.name]

    def erase(self, node: torch.fx.Node) -> None:
        self.gm.graph.erase_node(node)
        self.phases.pop(node.name, None)
        self.changed = True

    def finish(self) -> CapturedGraph:
        """The edited graph, recompiled, with updated metadata (the input graph if nothing changed)."""
        if not self.changed:
            return self.graph
        live = {n.name for n in self.gm.graph.nodes}
        self.gm.recompile()
        return dataclasses.replace(
            self.graph,
            phases={k: v for k, v in self.phases.items() if k in live},
            sources={k: v for k, v in self.sources.items() if k in live},
            library_sources={k: v for k, v in self.library_sources.items() if k in live},
            modules={k: v for k, v in self.modules.items() if k in live},
            seq_nr={k: v for k, v in self.seq_nr.items() if k in live},
        )
