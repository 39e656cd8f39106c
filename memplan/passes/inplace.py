"""In-place reuse: a pointwise op writes its result into an input whose storage dies with it.

What it does
------------
optnet's in-place trick and MXNet PlanMemory's ``refcount == 1`` rule, with the dependency
information of the joint graph instead of a hand-kept list. When an out-of-place pointwise op
(``aten.exp.default``, ``aten.add.Tensor``, ...) reads a tensor whose storage nobody reads afterwards,
the op becomes its in-place overload (``aten.exp_.default``, ``aten.add_.Tensor``) and writes into
that storage, so no new storage is allocated. In the joint forward+backward graph "nobody reads it
afterwards" already covers autograd: a tensor saved for backward has backward readers later in the
graph. The same rule lets the backward accumulate gradient contributions in place
(``add(g1, g2)`` -> ``g1.add_(g2)`` when ``g1`` is dead).

Stages
------
(1) Candidates: ``call_function`` nodes whose target is an out-of-place overload in
    :data:`INPLACE_OPS` that has an in-place overload with the same arguments (found by schema,
    :func:`inplace_overload`), that do not draw from the RNG and whose schema mutates nothing; and the
    activations' backward formulas of :data:`OUT_WRITE_OPS` (``gelu_backward``, ``threshold_backward``,
    ...), which have no in-place overload but an ``out=`` one (:func:`out_overload`): they write into any
    of their inputs passed as their ``out`` (``grad_input=grad_output``), under the same conditions.
(2) Plan (:func:`plan_inplace`): walk the graph in order, keeping storage groups (a rewritten node
    joins the storage of the input it writes). A node may write into argument ``self`` (or ``other``
    of a commutative op, by swapping the operands) when every soundness condition below holds.
    The result is a frozen :class:`InplacePlan` of ``(node, input)`` pairs.
(3) Apply (:func:`apply_inplace`): retarget each planned node to its in-place overload (swapping the
    operands when it writes ``other``), set its fake value by running the in-place op on the fake
    input (so the value shares the input's storage), and re-derive the fake values of every later
    node that aliased the node's old output (views of it), so the storage analysis sees one storage.
(4) Fused accumulation (:func:`fuse_accumulations`): an in-place ``acc.add_(mm(a, b))`` whose
    product has no other reader becomes ``acc.addmm_(a, b)`` (``bmm``: ``baddbmm_``), so the product
    is never materialised. This is how a weight used at every step of an unrolled loop accumulates its
    gradient: one product per step, summed into the gradient; autograd's fused RNN kernels do the same.
    The sum is rounded in another order (the BLAS adds into ``acc`` as it goes).
(5) Report: nodes rewritten and the simulated peak (graph lifetimes) before minus after.

Preconditions
-------------
Graph lifetimes (the pipeline sets them). Fake values on every node (``meta["val"]``).

Soundness conditions, each with the counterexample it rules out
---------------------------------------------------------------
(a) The input storage has no reader after the node, through any alias, and is not aliased by a graph
    output. Counterexample: ``b = a.sin(); c = a.cos()``: ``sin_`` into ``a`` feeds ``cos`` the sine.
(b) The storage is not external (parameter, buffer, user input, tangent, constant). Counterexample:
    ``x.exp()`` on the user's ``x`` would overwrite the caller's tensor.
(c) The input covers its whole storage, densely and without overlap (no ``expand``, no stride 0, no
    slice of a bigger buffer). Counterexamples: ``x.expand(4, 3).exp_()`` writes one element four
    times; ``cat(...)[:, :5].exp_()`` while another slice of the cat is still to be read.
(d) The out-of-place result has the input's shape, dtype, strides and device: no broadcasting up,
    no type promotion, same layout. Counterexample: ``a (3, 1) + b (3, 4)`` cannot fit in ``a``;
    ``int_tensor * 0.5`` is a float; a ``(4, 3)`` transposed input would make later ``view`` calls
    see other strides than the graph was traced with.
(e) No other argument of the node aliases the written storage (the very same node may appear twice:
    ``mul(a, a)`` is pointwise-safe). Counterexample: ``a.add_(a.t())`` reads elements it has
    already overwritten.
(f) Not a random op, not an op that already mutates. Counterexample: ``bernoulli`` would draw from
    the RNG in another way; an in-place op's own ordering is the user's.
(g) By default a backward node does not write into a storage the forward created (a tensor saved for
    backward): with ``retain_graph=True`` autograd would hand the clobbered tensor to a second
    backward (and raise its version-counter error). ``options={"inplace.saved": True}`` allows it for
    users who never retain the graph.

Never raises the peak: the written storage lives on where the node's own output would have lived,
and both have the same size, so the live bytes never grow at any position. A fused accumulation
frees the product's storage; ``a`` and ``b`` are read by the fused node instead of the product, so
they live at most until the accumulation, and only when nothing writes them in between; it is made
only where the bytes of theirs it holds longer are at most the product's (see :func:`_extended_bytes`).

Left to other passes
--------------------
Filling a concatenation part by part (``concat``), reusing dead storages of other shapes or of
non-adjacent ops (``arena``), reordering so that more
inputs are dead in time (``schedule``), recomputation (``remat``) and non-pointwise ops (matmul,
reductions: their out variants need the ``arena`` preallocation).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.liveness import Liveness
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors, tensor_values
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import (
    GraphEditor,
    fake_value,
    is_pure_view,
    is_random,
    mutated_args,
    packet_name,
    rebuilt_value,
    same_geometry,
)
from memplan.pipeline import PassContext, PassResult, PassStats, pass_options, register_pass

__all__ = [
    "INPLACE_OPS",
    "COMMUTATIVE_OPS",
    "InplaceOptions",
    "InplaceRewrite",
    "InplacePlan",
    "inplace_overload",
    "plan_inplace",
    "apply_inplace",
    "is_dense_full",
    "fuse_accumulations",
]

#: Pointwise ops whose in-place overload computes the same values into ``self``. Membership is a
#: promise about semantics (elementwise, ``self``-shaped); :func:`inplace_overload` still checks
#: that the in-place overload exists with the same arguments.
INPLACE_OPS: frozenset[str] = frozenset(
    {
        # unary
        "abs", "neg", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
        "sin", "cos", "tan", "sinh", "cosh", "tanh", "asin", "acos", "atan", "asinh", "acosh",
        "atanh", "sigmoid", "logit", "relu", "reciprocal", "sgn", "sign", "floor", "ceil", "round",
        "trunc", "frac", "erf", "erfc", "erfinv", "square", "silu", "gelu", "hardtanh",
        "leaky_relu", "elu", "hardsigmoid", "hardswish", "mish", "nan_to_num", "clamp",
        "clamp_min", "clamp_max", "threshold", "digamma", "lgamma", "sinc", "deg2rad", "rad2deg",
        # binary and ternary
        "add", "sub", "mul", "div", "pow", "atan2", "hypot", "fmod", "remainder", "copysign",
        "lerp", "addcmul", "addcdiv", "xlogy", "masked_fill",
    }
)

#: Pointwise ops without an in-place overload whose ``out=`` overload (a keyword argument, ``grad_input`` or
#: ``out``, that the op writes and returns) may be one of their own inputs: elementwise kernels read each
#: element before writing it, and allow an output that is exactly an input (the same memory and strides).
#: The activations' backward formulas, which read the incoming gradient and the saved input or output.
OUT_WRITE_OPS: frozenset[str] = frozenset(
    {
        "gelu_backward", "tanh_backward", "sigmoid_backward", "threshold_backward", "silu_backward",
        "hardtanh_backward", "elu_backward", "leaky_relu_backward", "softplus_backward",
        "hardsigmoid_backward", "hardswish_backward", "logit_backward",
    }
)

#: Ops whose first two operands commute exactly in floating point (IEEE ``+`` and ``*`` do), so the
#: op may write into ``other`` by swapping. ``add`` only without an ``alpha``.
COMMUTATIVE_OPS: frozenset[str] = frozenset({"add", "mul"})


@dataclasses.dataclass(frozen=True)
class InplaceOptions:
    """Options of the pass (read from ``ctx.options`` keys ``"inplace.<field>"``).

    Attributes
    ----------
    saved : bool
        Let backward nodes write into storages the forward created (tensors saved for backward).
        Off by default: a second backward with ``retain_graph=True`` would read the clobbered values.
    """

    saved: bool = False

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "InplaceOptions":
        return pass_options(cls, "inplace", options)


@dataclasses.dataclass(frozen=True)
class InplaceRewrite:
    """``node`` becomes ``target`` writing into its argument ``input`` (``swap``: operands swapped; ``out``:
    the keyword through which an ``out=`` overload writes, ``input`` passed as it)."""

    node: str
    input: str
    target: str
    swap: bool
    nbytes: int
    out: str | None = None


@dataclasses.dataclass(frozen=True)
class InplacePlan:
    """The rewrites, in graph order.

    Examples
    --------
    >>> plan = InplacePlan((InplaceRewrite("exp", "sub", "aten.exp_.default", False, 1024),))
    >>> plan.pairs
    (('exp', 'sub'),)
    >>> print(plan)
    InplacePlan: 1 rewrite(s), 1.00 KiB written in place
      exp -> aten.exp_.default into sub
    """

    rewrites: tuple[InplaceRewrite, ...]

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """``(node, input)`` pairs."""
        return tuple((r.node, r.input) for r in self.rewrites)

    def __str__(self) -> str:
        from memplan.measure import format_bytes

        total = sum(r.nbytes for r in self.rewrites)
        lines = [f"InplacePlan: {len(self.rewrites)} rewrite(s), {format_bytes(total)} written in place"]
        for r in self.rewrites:
            swapped = " (operands swapped)" if r.swap else ""
            lines.append(f"  {r.node} -> {r.target} into {r.input}{swapped}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# which ops


def _signature(schema: torch._C.FunctionSchema) -> tuple[tuple[str, str, bool], ...]:
    return tuple((a.name, str(a.type), a.kwarg_only) for a in schema.arguments)


def _mutates(schema: torch._C.FunctionSchema) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


@functools.lru_cache(maxsize=None)
def inplace_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The in-place overload of ``op`` with the same arguments, or None.

    Examples
    --------
    >>> inplace_overload(torch.ops.aten.add.Tensor)
    <OpOverload(op='aten.add_', overload='Tensor')>
    >>> inplace_overload(torch.ops.aten.pow.Tensor_Scalar)
    <OpOverload(op='aten.pow_', overload='Scalar')>
    >>> inplace_overload(torch.ops.aten.mm.default) is None
    True
    """
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    if name not in INPLACE_OPS or _mutates(op._schema):
        return None
    packet = getattr(torch.ops.aten, name + "_", None)
    if packet is None:
        return None
    wanted = _signature(op._schema)
    for overload_name in packet.overloads():
        candidate = getattr(packet, overload_name)
        schema = candidate._schema
        arguments = schema.arguments
        if not arguments or arguments[0].alias_info is None or not arguments[0].alias_info.is_write:
            continue
        if _signature(schema) == wanted and not any(
            a.alias_info is not None and a.alias_info.is_write for a in arguments[1:]
        ):
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def out_overload(op: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, str] | None:
    """The ``out=`` overload of ``op`` (one of :data:`OUT_WRITE_OPS`) taking the same arguments and one
    keyword-only tensor it writes, and that keyword's name; or None.

    Examples
    --------
    >>> out_overload(torch.ops.aten.gelu_backward.default)
    (<OpOverload(op='aten.gelu_backward', overload='grad_input')>, 'grad_input')
    >>> out_overload(torch.ops.aten.mm.default) is None
    True
    """
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    packet = op.overloadpacket
    if packet.__name__ not in OUT_WRITE_OPS or _mutates(op._schema):
        return None
    wanted = _signature(op._schema)
    for overload_name in packet.overloads():
        candidate = getattr(packet, overload_name)
        arguments = candidate._schema.arguments
        written = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
        if len(written) != 1 or not written[0].kwarg_only or written[0] is not arguments[-1]:
            continue
        if _signature(candidate._schema)[:-1] == wanted:
            return candidate, written[0].name
    return None


def is_dense_full(value: torch.Tensor) -> bool:
    """True when ``value`` covers its whole storage, each byte once (dense, no overlap, offset 0).

    Examples
    --------
    >>> x = torch.zeros(4, 3)
    >>> is_dense_full(x), is_dense_full(x.t()), is_dense_full(x[:2]), is_dense_full(x[:1].expand(4, 3))
    (True, True, False, False)
    """
    if value.storage_offset() != 0:
        return False
    if value.numel() * value.element_size() != value.untyped_storage().nbytes():
        return False
    dims = sorted((s for s in zip(value.stride(), value.shape) if s[1] != 1), key=lambda s: s[0])
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and (a.numel() <= 1 or a.stride() == b.stride())
    )


#: Products that may be fused into the in-place accumulation that consumes them: ``acc.add_(mm(a, b))``
#: is ``acc.addmm_(a, b)``.
_FUSED_ACCUMULATIONS: dict[Any, Any] = {
    torch.ops.aten.mm.default: torch.ops.aten.addmm_.default,
    torch.ops.aten.bmm.default: torch.ops.aten.baddbmm_.default,
}


def _is_transpose(node: torch.fx.Node) -> bool:
    """``t(x)``, or ``transpose(x, d0, d1)`` of the last two dims of a 3-D tensor."""
    if node.target is torch.ops.aten.t.default:
        return True
    if node.target is torch.ops.aten.transpose.int and isinstance(node.meta.get("val"), torch.Tensor):
        rank = node.meta["val"].dim()
        return rank == 3 and {d % rank for d in node.args[1:3]} == {1, 2}
    return False


def _fusable_product(node: Any) -> tuple[torch.fx.Node, int] | None:
    """``(product, transposes)`` when ``node`` is a single-use product seen through single-use transposes."""
    transposes = 0
    while isinstance(node, torch.fx.Node) and len(node.users) == 1 and _is_transpose(node):
        node, transposes = node.args[0], transposes + 1
    if isinstance(node, torch.fx.Node) and node.target in _FUSED_ACCUMULATIONS and len(node.users) == 1:
        return node, transposes
    return None


# ----------------------------------------------------------------------------------------------
# plan


class _Groups:
    """Storage groups while planning: a rewritten node's output joins the storage it writes.

    Each group keeps the last position at which any of its members is read (``math.inf`` when a graph
    output reads one): a group grows by one member per in-place write, so rereading every member's
    readers at each write was quadratic in the length of an accumulation chain.
    """

    def __init__(self, tensors: Tensors, by_name: Mapping[str, torch.fx.Node], position: Mapping[str, int]):
        self.root: dict[int, int] = {sid: sid for sid in tensors.storages}
        self.members: dict[int, list[str]] = {sid: list(s.members) for sid, s in tensors.storages.items()}
        self.last_read: dict[int, float] = {}
        for sid, members in self.members.items():
            last: float = -1
            for member in members:
                for user in by_name[member].users:
                    if user.op == "output":
                        last = math.inf
                    else:
                        last = max(last, position.get(user.name, -1))
            self.last_read[sid] = last

    def find(self, sid: int) -> int:
        while self.root[sid] != sid:
            sid = self.root[sid]
        return sid

    def merge(self, into: int, other: int) -> None:
        into, other = self.find(into), self.find(other)
        if into != other:
            self.root[other] = into
            self.members[into].extend(self.members.pop(other))
            self.last_read[into] = max(self.last_read[into], self.last_read.pop(other))

    def dead_after(self, root: int, p: int) -> bool:
        """No member of group ``root`` is read after position ``p`` (nor by a graph output)."""
        return self.last_read[root] <= p


def plan_inplace(graph: CapturedGraph, am: AnalysisManager, options: InplaceOptions = InplaceOptions()) -> InplacePlan:
    """Choose the ``(node, input)`` pairs to rewrite (stages 1 and 2 of the module docstring)."""
    tensors, liveness = am.get(Tensors), am.get(Liveness)
    position = liveness.position
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    groups = _Groups(tensors, by_name, position)
    rewrites: list[InplaceRewrite] = []

    # Step 1: candidates, in graph order.
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or is_random(node):
            continue
        target, keyword = inplace_overload(node.target), None
        if target is None:
            found = out_overload(node.target)
            if found is None:
                continue
            target, keyword = found
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor):
            continue
        p = position[node.name]
        # Step 2: the first argument position that satisfies every condition.
        positions = _writable_positions(node) if keyword is None else range(len(node.args))
        for index in positions:
            arg = node.args[index]
            if not isinstance(arg, torch.fx.Node) or not isinstance(arg.meta.get("val"), torch.Tensor):
                continue
            sids = tensors.storages_of(arg.name)
            if len(sids) != 1:
                continue
            root = groups.find(sids[0])
            storage = tensors.storages[root]
            value = arg.meta["val"]
            if storage.external:  # (b)
                continue
            if (
                not options.saved
                and graph.phases.get(node.name) is Phase.BACKWARD
                and graph.phases.get(storage.creator) is Phase.FORWARD
            ):  # (g)
                continue
            if not is_dense_full(value) or not _same_layout(value, out):  # (c), (d)
                continue
            if _other_alias(node, arg, root, tensors, groups):  # (e)
                continue
            if not groups.dead_after(root, p):  # (a)
                continue
            rewrites.append(InplaceRewrite(node.name, arg.name, str(target), swap=keyword is None and index == 1,
                                           nbytes=storage.nbytes, out=keyword))
            for sid in tensors.storages_of(node.name):
                groups.merge(root, sid)
            break
    return InplacePlan(tuple(rewrites))


def _writable_positions(node: torch.fx.Node) -> tuple[int, ...]:
    """``(0,)``, or ``(0, 1)`` for a commutative op whose operands may be swapped."""
    if packet_name(node) in COMMUTATIVE_OPS and len(node.args) >= 2 and isinstance(node.args[1], torch.fx.Node):
        alpha = node.kwargs.get("alpha", 1)
        if alpha == 1 and len(node.args) == 2:
            if _fusable_product(node.args[0]) is not None:
                return (1, 0)  # write into the other operand, so that the product can be fused (stage 4)
            return (0, 1)
    return (0,)


def _other_alias(node: torch.fx.Node, arg: torch.fx.Node, root: int, tensors: Tensors, groups: _Groups) -> bool:
    """True when another argument of ``node`` (not ``arg`` itself) aliases storage group ``root``."""
    for other in node.all_input_nodes:
        if other is arg:
            continue
        for sid in tensors.storages_of(other.name):
            if groups.find(sid) == root:
                return True
    return False


# ----------------------------------------------------------------------------------------------
# apply


def apply_inplace(graph: CapturedGraph, plan: InplacePlan) -> CapturedGraph:
    """Rewrite ``graph.gm`` as ``plan`` says (stage 3) and return the new captured graph."""
    if not plan.rewrites:
        return graph
    by_node = {r.node: r for r in plan.rewrites}
    # The fake storage of each rewritten node's old output -> the storage it now writes into.
    storage_of: dict[StorageWeakRef, Any] = {}
    before: dict[torch.fx.Node, Any] = {}  # the old value of each node whose value was replaced
    # Step 3: retarget, in graph order, so every fake value is derived from already-updated inputs.
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        rewrite = by_node.get(node.name)
        if rewrite is not None:
            if rewrite.out is not None:  # the out= overload, writing into the input as its out
                written = next(a for a in node.args if isinstance(a, torch.fx.Node) and a.name == rewrite.input)
                node.target = out_overload(node.target)[0]
                node.kwargs = {**node.kwargs, rewrite.out: written}
                value = _written_value(node, written)
            else:
                target = inplace_overload(node.target)
                if rewrite.swap:
                    node.args = (node.args[1], node.args[0], *node.args[2:])
                node.target = target
                value = _written_value(node)
            for _, old in tensor_values(node):
                storage_of[StorageWeakRef(old.untyped_storage())] = value.untyped_storage()
            before[node] = node.meta["val"]
            node.meta["val"] = value
        elif any(StorageWeakRef(v.untyped_storage()) in storage_of for _, v in tensor_values(node)):
            # A view (or any alias) of a rewritten node's old output: its value must alias the new one.
            before[node] = node.meta["val"]
            node.meta["val"] = _moved_view(node, before, storage_of)
    graph.gm.recompile()
    return dataclasses.replace(graph)


def _written_value(node: torch.fx.Node, written: Any = None) -> Any:
    """The fake value of an in-place op: the value of the argument it writes and returns, ``written`` (an
    ``out=``), by default its first.

    Fake tensors keep an in-place op's written argument as its result (the same object), so this is what
    running the op under the fake mode returns, without running its shape function (a few hundred
    microseconds each, for thousands of rewritten nodes of an unrolled loop). Anything else runs the op.
    """
    if written is None and node.args:
        written = node.args[0]
    value = written.meta.get("val") if isinstance(written, torch.fx.Node) else None
    if isinstance(value, FakeTensor):
        return value
    return fake_value(node.target, node.args, node.kwargs)


def _moved_view(node: torch.fx.Node, before: Mapping[torch.fx.Node, Any], storage_of: dict[StorageWeakRef, Any]) -> Any:
    """The fake value of ``node`` once the storages of ``storage_of`` moved: a pure view whose inputs kept
    their layout has its old metadata on the moved storage; anything else runs the op again."""
    if is_pure_view(node) and all(_kept_layout(before[arg], arg.meta.get("val"))
                                  for arg in node.all_input_nodes if arg in before):
        value = rebuilt_value(node.meta.get("val"), storage_of, fresh=False)
        if value is not None:
            return value
    return fake_value(node.target, node.args, node.kwargs)


def _kept_layout(old: Any, new: Any) -> bool:
    return isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and same_geometry(old, new)


def fuse_accumulations(graph: CapturedGraph) -> tuple[CapturedGraph, int]:
    """Fuse ``acc.add_(mm(a, b))`` into ``acc.addmm_(a, b)`` (stage 4); returns the graph and the count.

    The product may be seen through transposes (``acc.add_(mm(a, b).t())`` is ``acc.addmm_(b.t(),
    a.t())``, the form of a linear layer's weight gradient). Conditions: the accumulation is
    ``add_.Tensor`` with ``alpha`` 1 writing into ``acc``, not into the product; the product and the
    transposes are read by nothing else; the product has ``acc``'s shape, dtype and device, a dtype of
    32 bits or more (in half precision the one rounding of the fused op is visible); nothing
    between the definitions of ``a`` and ``b`` and the accumulation writes them (through any alias).
    A write before the product would be harmless to the values (the product read after it too), but
    the fused op would then read through an alias made before a write, a read the pipeline's check
    (:func:`~memplan.pipeline.mutation_hazards`) finds in no earlier graph: autograd's gradient of
    ``y[:, 0] += 1`` writes into a slice of a gradient that a weight's product then reads.

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> def f(acc, a, b):
    ...     acc = acc * 2
    ...     acc.add_(a @ b)
    ...     return acc.add_((b.t() @ a.t()).t())
    >>> g = capture(f, torch.randn(4, 3), torch.randn(4, 5), torch.randn(5, 3), train=False)
    >>> g, n = fuse_accumulations(g)
    >>> n, [packet_name(x) for x in g.gm.graph.nodes if x.op == "call_function"]
    (2, ['mul', 'addmm_', 't', 't', 't', 't', 'addmm_'])
    """
    am = AnalysisManager(graph)
    tensors, liveness = am.get(Tensors), am.get(Liveness)
    editor = GraphEditor(graph)
    nodes = list(graph.gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    writes: dict[StorageWeakRef, list[int]] = {}  # storage -> positions of the ops writing into it, ascending
    for i, n in enumerate(nodes):
        if n.op == "call_function":
            for target in mutated_args(n):
                if isinstance(target.meta.get("val"), torch.Tensor):
                    writes.setdefault(StorageWeakRef(target.meta["val"].untyped_storage()), []).append(i)
    fused = 0
    for node in nodes:
        if node.target is not torch.ops.aten.add_.Tensor or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
            continue
        acc, operand = node.args
        found = _fusable_product(operand)
        if found is None or not isinstance(acc, torch.fx.Node) or acc is operand:
            continue
        product, transposes = found
        acc_value, value = acc.meta.get("val"), operand.meta.get("val")
        if not isinstance(acc_value, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        if (acc_value.shape, acc_value.dtype, acc_value.device) != (value.shape, value.dtype, value.device):
            continue
        if value.dtype.is_floating_point and torch.finfo(value.dtype).bits < 32:
            continue  # the fused op rounds the sum once, eager the product and then the sum: in bfloat16 a unit apart
        a, b = product.args[:2]
        if any(_written_between(writes, x, order.get(x, -1), order[node]) for x in (a, b)):
            continue
        if _extended_bytes(tensors, liveness, (a, b), node) > tensors.tensors[product.name][0].nbytes:
            continue
        if transposes % 2:  # (a @ b).T == b.T @ a.T
            flip = ((torch.ops.aten.t.default, ()) if product.target is torch.ops.aten.mm.default
                    else (torch.ops.aten.transpose.int, (1, 2)))
            a, b = (editor.call(flip[0], (x, *flip[1]), like=node, before=node) for x in (b, a))
        chain = [operand]
        while chain[-1] is not product:
            chain.append(chain[-1].args[0])
        node.target = _FUSED_ACCUMULATIONS[product.target]
        node.args = (acc, a, b)
        node.meta["val"] = _written_value(node)
        for dead in chain:
            editor.erase(dead)
        fused += 1
    return editor.finish(), fused


def _extended_bytes(tensors: Tensors, liveness: Liveness, operands: Sequence[Any], at: torch.fx.Node) -> int:
    """Bytes of the storages of ``operands`` that a read at ``at`` keeps alive longer: those the graph
    frees before ``at`` (external storages live anyway).

    The fused op reads ``a`` and ``b`` where the accumulation was, not where their product was. Until
    then the product's storage is gone, and theirs may be held in its place: the peak cannot rise
    where the bytes held longer are at most the product's. Counterexample: ``mm(a, b)`` early in the
    backward, with ``a`` a (142, 142) gradient dead after it, accumulated much later into a (142, 32)
    gradient: fused, ``a`` lived across the later products and the peak rose 14%.
    """
    position = liveness.position[at.name]
    held = 0
    for operand in operands:
        if not isinstance(operand, torch.fx.Node) or operand.name not in tensors.tensors:
            continue
        for sid in tensors.storages_of(operand.name):
            storage = tensors.storages[sid]
            if not storage.external and liveness.intervals[sid].end < position:
                held += storage.nbytes
    return held


def _written_between(writes: Mapping[StorageWeakRef, list[int]], node: Any, start: int, end: int) -> bool:
    """Whether an op at a position strictly between ``start`` and ``end`` writes into ``node``'s storage
    (``writes``: ascending write positions by storage)."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return False
    positions = writes.get(StorageWeakRef(value.untyped_storage()), ())
    first_after = bisect.bisect_right(positions, start)
    return first_after < len(positions) and positions[first_after] < end


# ----------------------------------------------------------------------------------------------
# the pass


@register_pass("inplace", options=InplaceOptions.from_mapping)
def inplace(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Rewrite pointwise ops to write into dead inputs (see the module docstring)."""
    options = InplaceOptions.from_mapping(ctx.options)
    plan = plan_inplace(graph, ctx.am, options)
    peak_before = ctx.am.get(PeakSimulation).peak
    new, fused = fuse_accumulations(apply_inplace(graph, plan))
    if not plan.rewrites and not fused:
        return PassResult(graph, changed=False, notes=("no pointwise op has a dead, dense input",), plan=plan)
    # Step 5: report what the simulated peak gained.
    analyses = AnalysisManager(new)  # handed to the pipeline, which would compute them again
    peak_after = analyses.get(PeakSimulation).peak
    stats = PassStats(nodes_rewritten=len(plan.rewrites) + fused, bytes_saved=peak_before - peak_after)
    return PassResult(new, changed=True, stats=stats, plan=plan, analyses=analyses)
