"""Hand-written attention as one fused kernel: ``softmax(q @ k^T * scale + mask) @ v`` becomes
``F.scaled_dot_product_attention``.

What it does
------------
Attention written out (``scores = q @ k.transpose(-1, -2) / sqrt(d)``, a mask, ``softmax``, ``@ v``)
makes ``(..., n, m)`` scores, their scaled and masked copies and the probabilities; the probabilities
are saved for the backward, which builds their gradient and the scores' at the same size.
``F.scaled_dot_product_attention`` computes the same value a block of keys at a time and keeps only
its output and one log-sum-exp per query; its backward recomputes the blocks. On CPU, for float32,
float64, bfloat16 and float16 operands of rank 4 with one head size for ``q``, ``k`` and ``v`` (each
read with unit stride there), and a mask that needs no gradient (or none), PyTorch picks
``_scaled_dot_product_flash_attention_for_cpu``:
it saves ``q``, ``k``, ``v``, the output and a float ``(B, H, n)`` log-sum-exp, and reads the mask
(a boolean one converted by ``where`` into a float mask of the mask's own, unbroadcast size) without
expanding it. Its blocks are kernel workspaces (per thread, a block of queries by a block of keys),
which the simulation does not see and CPU measurement does not count. Otherwise (a mask that needs a
gradient, other ranks, unlike head sizes, a strided head dimension) PyTorch takes its math path, which
builds the scores (and saves the probabilities) all the same: the replacement makes the operands 4-d,
pads the narrower head sizes with zeros and copies a strided one, and the finder refuses the rest.

Stages
------
(1) Find, from the graph's structure only, a ``_softmax``/``softmax.int`` over the last dimension
    whose input comes, through nodes that each have one forward reader, from
    (a) score ops at the softmax's shape: a positive finite scale (``mul``/``div`` by a number or a
        constant 0-d tensor), an additive float bias (``add``), a ``-inf`` fill of masked positions
        (``masked_fill``, or ``where`` with ``-inf`` on one side), in place or not, in any order;
        before them, views and scales only, back to
    (b) a ``bmm``/``mm`` whose output reaches the softmax's input as a reshape (the views replayed
        on a contiguous meta tensor keep row-major strides). Its operands are ``q`` and ``k^T``
        through views, ``expand``, ``clone`` and scales (the matmul decomposition's ``expand``,
        ``clone`` and ``_unsafe_view``; einsum's ``unsqueeze``, ``permute`` and ``view``);
    and whose result reaches, through views that again only reshape it, the left operand of a second
    ``bmm``/``mm``, whose right operand is ``v`` through views, ``expand`` and ``clone``. The output is
    the last of the views after the second product that is that product reshaped to
    ``(*batch, n, dv)``, ``batch`` being the softmax's leading dimensions.
(2) Check the conditions below, then trace the replacement over the inputs' fake values (with its
    backward where a gradient flows): refused when it computes a softmax of its own (PyTorch's math
    path) or when the storages its forward makes, its output's aside, are not fewer bytes than the
    scores.
(3) The replacement reads each operand from its source: as one ``permute`` when the chain only
    permutes it (einsum's), else by replaying the chain with its copies left out, its views replayed
    as reshapes and the final reshape into the product's batch left out (the matmul decomposition's
    ``clone`` only served the ``bmm``), so that ``q``, ``k`` and ``v`` reach the kernel as views. The
    scales are folded into ``scale=``; the masks are replayed in order on one additive float mask of
    their broadcast shape (a scale after a mask scales it too); a single ``-inf`` fill whose mask,
    evaluated from constants at plan time, is exactly ``triu(ones(n, n), 1)`` becomes
    ``is_causal=True``, and the nodes that built it for it alone go. Operands of another rank are
    made 4-d (leading ones added, leading batch dimensions merged); when ``v``'s head size is not
    ``q``'s, the narrower are padded with zeros (which add nothing to ``q @ k^T``) and the output's
    extra columns cut off; a ``k`` whose head dimension is strided (``k^T`` laid out as ``(d, m)``) is
    copied, as eager's ``clone`` copied it.
    :func:`~memplan.passes._rewrite.region.replace_region` traces it through autograd and inlines it
    in place of the region and its backward.

Soundness conditions (each with a counterexample the finder refuses)
--------------------------------------------------------------------
* No node of the pattern but its output is read outside it and its backward. Counterexample: a
  model that returns its attention weights (``return out, probs``) needs ``probs``.
* The softmax is over the last dimension, the keys'. Counterexample: ``scores.softmax(-2)``
  normalises over the queries.
* Only views between the softmax and the second product. Counterexample: ``dropout`` on the
  probabilities in training (``empty_like``, ``bernoulli_``, ``mul``): SDPA's ``dropout_p`` draws its
  mask otherwise than eager's ``dropout``, and memplan keeps eager's random draws exactly; the region
  is left to the other passes. In evaluation the graph holds no dropout, and it is rewritten.
* Scales are positive finite numbers (a Python number, or a 0-d tensor built from constants).
  Counterexamples: a learned temperature ``scores * self.tau`` needs a gradient; a negative scale
  turns a ``-inf`` fill into ``+inf``.
* Masks are additive float tensors of the scores' dtype that need no gradient, or boolean masks
  filled with ``-inf``, each broadcastable to the scores without enlarging them. Counterexamples: a
  learned relative-position bias needs the gradient of the full scores (the math path);
  ``masked_fill(mask, -1e9)`` sets scores, which an additive mask cannot do: on a row whose keys are
  all masked eager's weights are uniform and its gradient into ``q`` and ``k`` is zero, SDPA's is not.
* On a row whose keys are all masked by ``-inf``, eager's softmax gives NaN (and so do that row of the
  output and the gradient of ``v``), SDPA zeros: the rewrite differs from eager only where eager's
  result is NaN. ``optimize(..., verify=True)`` sees it on a first call that has such a row. A causal
  mask has none.
* Operands of one floating dtype the fused kernel takes, and the fused kernel chosen (the traced
  replacement holds no softmax). Counterexample: a boolean mask that broadcasts along some of three
  leading batch dimensions cannot be merged with them into 4-d operands without expanding it (refused
  before the trace); on another device, whatever its kernels do not take.
* The product's rows follow the operands' batch: the views from each product to the softmax and to
  the output only reshape it. Counterexample: ``bmm(q, kT).view(H, B, n, m).transpose(0, 1)`` reorders
  the batch; replayed on a meta tensor, its strides are not row-major.
* No input of the region is written in place in the forward. Counterexample: ``v.add_(1)`` between
  the two products: the replacement reads ``v`` where the first product ran.
* Bytes: the new storages the replacement makes (the log-sum-exp, a converted mask, a padded or copied
  operand) hold fewer bytes than the scores, which (or the probabilities saved for the backward) were
  live wherever those are, so the step holds no more than eager at any point.
* Each gradient the region's backward hands on belongs to one input. One source in two roles
  (``x @ x.mT``) would get two, summed outside the region's backward: the key's chain (else the
  value's) then starts after its first view (``x.mT`` is the key's source). Counterexample: ``x``
  read as the query and the values by ``torch.bmm`` itself, with no view between
  (``torch.bmm(torch.bmm(x, k.mT).softmax(-1), x)``).

What it leaves to other passes
------------------------------
Attention it refuses (dropout in training, returned weights) is left as it is to the other passes
(``chunk`` runs a region a block of queries at a time, ``remat``); saving versus recomputing,
ordering (``schedule``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.capture import CapturedGraph
from memplan.graphutil import mutated_args, packet_name
from memplan.opschema import is_view_op
from memplan.passes._chunk.graphs import BackwardIndex, region_backward
from memplan.passes._rewrite.region import (
    Replacement,
    forward_nodes,
    match_gradients,
    node_dtype,
    node_shape,
    trace_joint,
)

__all__ = ["Attention", "find_attention"]

# Views whose value the finder follows (replayed on a meta tensor to check they only reshape).
_VIEWS = frozenset({"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "permute", "transpose", "t", "alias"})
# What may lie between ``q``, ``k`` or ``v`` and a product: views and value-preserving copies.
_OPERAND_CHAIN = _VIEWS | {"clone"}
_SCALES = frozenset({"mul", "mul_", "div", "div_"})
_PRODUCTS = frozenset({"bmm", "mm"})
_FUSED_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_INTEGERS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
_SOFTMAXES = frozenset({"_softmax", "softmax", "_safe_softmax"})
# Ops a plan-time constant (a causal mask, a fill value, a 0-d scale) may be built with, besides
# views and deterministic pointwise ops.
_CONSTANT_OPS = frozenset({"ones", "zeros", "full", "arange", "scalar_tensor", "lift_fresh_copy", "ones_like",
                           "zeros_like", "full_like", "triu", "tril", "clone", "_to_copy"})


@dataclasses.dataclass(frozen=True)
class _Operand:
    """``q``, ``k^T`` or ``v`` of the products: ``source`` (an input of the region) permuted by
    ``permutation`` when the chain only permutes it, else through ``steps`` (the chain's nodes to
    replay, scales and copies left out), reshaped to ``shape``."""

    source: str
    steps: tuple[str, ...]
    shape: tuple[int, ...]
    permutation: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class _ScoreOp:
    """One op between the scores and the softmax: ``("scale", factor)``, ``("add", bias)`` or
    ``("fill", mask, inverted)`` (``-inf`` where ``mask`` is true, or false when ``inverted``)."""

    kind: str
    factor: float = 1.0
    tensor: str | None = None
    inverted: bool = False


@dataclasses.dataclass(frozen=True)
class Attention:
    """``softmax(q @ k^T * scale + mask) @ v`` written out, rewritten as one
    ``F.scaled_dot_product_attention``.

    ``nodes`` is the forward region (in graph order), ``inputs`` the values it reads, ``output`` the
    node read outside; ``query``, ``key`` (``k^T``) and ``value`` the operands; ``scale`` the product
    of every scale; ``ops`` the score ops in order; ``causal`` whether the only mask is the causal one
    (then given as ``is_causal``); ``batch`` the leading dimensions of the scores; ``scores`` their
    bytes, which the rewrite no longer keeps."""

    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    output: str
    query: _Operand
    key: _Operand
    value: _Operand
    scale: float
    ops: tuple[_ScoreOp, ...]
    causal: bool
    batch: tuple[int, ...]
    out_shape: tuple[int, ...]
    scores: int
    softmax: str

    def claimed(self) -> set[str]:
        return set(self.nodes)

    def replacement(self, graph: CapturedGraph) -> Replacement:
        return Replacement(self.nodes, self.inputs, (self.output,), _attention_fn(self, graph), self.softmax)

    def __str__(self) -> str:
        masks = sum(op.kind != "scale" for op in self.ops)
        mask = ", causal" if self.causal else f", {masks} mask(s)" if masks else ""
        return (f"attention {self.softmax}: fused scaled_dot_product_attention{mask} "
                f"({self.scores} bytes of scores no longer kept)")


# ----------------------------------------------------------------------------------------------
# stage 1: the pattern


def find_attention(graph: CapturedGraph) -> list[Attention]:
    """Hand-written attention in the forward graph (see the module docstring).

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> q, k, v = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
    >>> g = capture(lambda q, k, v: (q @ k.transpose(-1, -2) / 8 ** 0.5).softmax(-1) @ v, q, k, v)
    >>> [p.scale for p in find_attention(g)]
    [0.35355339059327373]
    """
    forward = forward_nodes(graph)
    if not any(_is_softmax(n) for n in forward):
        return []  # (the common case, first)
    context = _Context(graph, forward)
    found: list[Attention] = []
    replaced: set[str] = set()  # the outputs of those found: replaced by new nodes when applied
    for node in forward:
        if _is_softmax(node):
            pattern = _match(context, node)
            if pattern is None or replaced.intersection(pattern.inputs):
                continue  # (one attention reading another's output directly: the first only)
            if pattern.causal and not _replaceable(context, pattern):
                # a causal mask built apart (its nodes share the autograd number of an op outside the
                # region, whose backward then blurs the region's): they stay, read by nothing
                pattern = _match(context, node, take_builders=False)
            if _replaceable(context, pattern) and _fused_and_smaller(context, pattern):
                found.append(pattern)
                replaced.add(pattern.output)
    return found


class _Context:
    """What the matcher asks of the whole graph: forward readers, storages written in place, values
    that carry a gradient, and plan-time constants."""

    def __init__(self, graph: CapturedGraph, forward: Sequence[torch.fx.Node]):
        self.graph = graph
        self.forward = set(forward)
        self.written = {StorageWeakRef(t.meta["val"].untyped_storage()) for n in forward for t in mutated_args(n)
                        if isinstance(t.meta.get("val"), torch.Tensor)}
        self.grad = _carrying_grad(graph, forward)
        self._constants: dict[tuple[torch.fx.Node, int], torch.Tensor | None] = {}
        self._index: BackwardIndex | None = None

    @property
    def index(self) -> BackwardIndex:
        if self._index is None:
            self._index = BackwardIndex.of(self.graph)
        return self._index

    def readers(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The forward nodes (and the graph's output) that read ``node``."""
        return [u for u in node.users if u.op == "output" or u in self.forward]

    def single(self, node: torch.fx.Node) -> torch.fx.Node | None:
        readers = self.readers(node)
        return readers[0] if len(readers) == 1 and readers[0].op != "output" else None

    def constant(self, node: Any, limit: int) -> torch.Tensor | None:
        """The value of ``node`` when it is built from constants only, each value on the way of at most
        ``limit`` elements (evaluated on CPU at plan time); else None."""
        if not isinstance(node, torch.fx.Node):
            return None
        key = (node, limit)
        if key not in self._constants:
            self._constants[key] = _evaluate(self, node, limit)
        return self._constants[key]


def _carrying_grad(graph: CapturedGraph, forward: Sequence[torch.fx.Node]) -> set[torch.fx.Node]:
    """Forward values that may need a gradient: inputs that require grad and the floating results of
    ops that read one (an over-approximation: a ``sign`` is counted too)."""
    if not graph.training:
        return set()
    carrying = {graph.node(s.node) for s in graph.inputs if s.requires_grad}
    for node in forward:
        if packet_name(node) == "detach" or not any(a in carrying for a in node.all_input_nodes):
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
            continue  # a mask or an index: no gradient
        carrying.add(node)
    return carrying


def _evaluate(context: _Context, node: torch.fx.Node, limit: int) -> torch.Tensor | None:
    if node.op == "get_attr":
        value = getattr(context.graph.gm, node.target, None)
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor) or value.numel() > limit:
            return None
        return value.detach().cpu()
    if node.op != "call_function" or node not in context.forward or mutated_args(node):
        return None
    if not isinstance(node.meta.get("val"), torch.Tensor) or node.meta["val"].numel() > limit:
        return None
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
        return None
    if not (packet_name(node) in _CONSTANT_OPS or is_view_op(target) or torch.Tag.pointwise in target.tags):
        return None
    values = {}
    for arg in node.all_input_nodes:
        values[arg] = context.constant(arg, limit)
        if values[arg] is None:
            return None
    args = torch.fx.node.map_arg(node.args, values.__getitem__)
    kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
    if "device" in kwargs:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    try:
        result = target(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return None
    return result if isinstance(result, torch.Tensor) else None


def _is_softmax(node: torch.fx.Node) -> bool:
    """A softmax over the last dimension, in its input's dtype."""
    name = packet_name(node)
    if name not in ("_softmax", "softmax") or node.kwargs:
        return False
    overload = node.target._overloadname
    if (name, overload) == ("_softmax", "default"):
        if len(node.args) != 3 or node.args[2]:
            return False  # half_to_float: a float32 result of a half input
    elif (name, overload) != ("softmax", "int") or len(node.args) > 3 or node.args[2:] not in ((), (None,)):
        return False  # a dtype: the softmax of a cast
    rank = len(node_shape(node))
    return rank >= 2 and isinstance(node.args[1], int) and node.args[1] % rank == rank - 1


def _match(context: _Context, softmax: torch.fx.Node, take_builders: bool = True) -> Attention | None:
    graph = context.graph
    shape = node_shape(softmax)
    batch, (n, m) = shape[:-2], shape[-2:]
    dtype = node_dtype(softmax)
    if dtype not in _FUSED_DTYPES or not softmax.meta["val"].is_contiguous():
        return None
    # Step 1: from the softmax, views to the second product's left operand.
    probs_chain, node = [], softmax
    while True:
        reader = context.single(node)
        if reader is None or reader.args[0] is not node:
            return None  # read twice (the weights returned), or by something else than views (dropout)
        if packet_name(reader) in _PRODUCTS:
            attend = reader
            break
        if packet_name(reader) not in _VIEWS:
            return None
        probs_chain.append(reader)
        node = reader
    if attend.args[1] is node or _rows(node, n, m) is None or not _reshapes(shape, probs_chain, node_shape(node)):
        return None
    # Step 2: from the softmax's input back to the first product: score ops at the softmax's shape,
    # then views and scales.
    ops: list[_ScoreOp] = []
    score_nodes: list[torch.fx.Node] = []
    views: list[torch.fx.Node] = []
    node = softmax.args[0]
    while True:
        if not isinstance(node, torch.fx.Node) or context.single(node) is None:
            return None
        if packet_name(node) in _PRODUCTS:
            scores = node
            break
        factor = _scale_of(context, node)
        if factor is not None:
            op, before = _ScoreOp("scale", factor=factor), node.args[0]
        elif packet_name(node) in _VIEWS:
            op, before = None, node.args[0]
            views.append(node)
        elif views:
            return None  # a mask before a reshape: not at the softmax's shape
        else:
            op, before = _mask_op(context, node, shape, dtype) or (None, None)
            if op is None:
                return None
        if op is not None:
            ops.append(op)
        score_nodes.append(node)
        node = before
    ops.reverse()
    if _rows(scores, n, m) is None or not _reshapes(node_shape(scores), views[::-1], shape):
        return None
    if not (scores.meta["val"].is_contiguous() and attend.meta["val"].is_contiguous()):
        return None  # (a product's result is: the reshape checks start from that)
    # Step 3: the operands: q and k^T of the scores, v of the second product.
    d, dv = node_shape(scores.args[0])[-1], node_shape(attend.args[1])[-1]
    ends = ((scores.args[0], (*batch, n, d), True), (scores.args[1], (*batch, d, m), True),
            (attend.args[1], (*batch, m, dv), False))
    operands = [_operand(context, *end) for end in ends]
    if any(o is None for o in operands):
        return None
    # One source in two roles (``x @ x.mT``) would get two gradients, which the backward sums outside
    # the region: the key's (else the value's) chain then starts after its first view, a source of
    # its own.
    for i in (1, 2, 0):
        chain = operands[i][1]
        shared = [o[0].source for j, o in enumerate(operands) if j != i]
        if operands[i][0].source in shared and chain and packet_name(chain[0]) in _VIEWS:
            operands[i] = _operand(context, *ends[i], stop=chain[0])
    if any(o is None for o in operands):
        return None
    (query, q_nodes, q_scale), (key, k_nodes, k_scale), (value, v_nodes, _) = operands
    sources = [graph.node(o.source) for o in (query, key, value)]
    if any(node_dtype(x) != dtype for x in sources):
        return None
    scale = q_scale * k_scale * math.prod(op.factor for op in ops if op.kind == "scale")
    # Step 4: the output: views of the second product while they reshape it to (*batch, n, dv).
    out_shape = (*batch, n, dv)
    output, out_nodes, chain, node = attend, [], [], attend
    while (reader := context.single(node)) is not None and packet_name(reader) in _VIEWS and reader.args[0] is node:
        chain.append(reader)
        node = reader
        if node_shape(node) == out_shape and _reshapes(node_shape(attend), chain, out_shape):
            output, out_nodes = node, list(chain)
    # Step 5: masks, the region, its inputs, and the conditions on them.
    masks = [graph.node(op.tensor) for op in ops if op.tensor is not None]
    if not _mergeable(batch, [node_shape(x) for x in masks]):
        return None
    region = {*q_nodes, *k_nodes, *v_nodes, scores, *score_nodes, softmax, *probs_chain, attend, *out_nodes}
    causal = _causal(context, ops, n, m)
    if causal:  # the mask goes, and so do the nodes that build it for it alone
        region |= _builders(context, masks[0], region) if take_builders else set()
        ops, masks = [op for op in ops if op.kind == "scale"], []
    inputs = list(dict.fromkeys([*sources, *masks]))
    if any(x in region for x in inputs):
        return None
    for node in region:
        if node is not output and any(r not in region for r in context.readers(node)):
            return None  # a value of the pattern read elsewhere: the attention weights, returned
    for x in inputs:
        if StorageWeakRef(x.meta["val"].untyped_storage()) in context.written:
            return None
    order = {node: i for i, node in enumerate(graph.gm.graph.nodes)}
    return Attention(
        nodes=tuple(x.name for x in sorted(region, key=order.__getitem__)),
        inputs=tuple(x.name for x in inputs),
        output=output.name,
        query=query,
        key=key,
        value=value,
        scale=scale,
        ops=tuple(ops),
        causal=causal,
        batch=tuple(batch),
        out_shape=node_shape(output),
        scores=math.prod(shape) * softmax.meta["val"].element_size(),
        softmax=softmax.name,
    )


def _rows(product: torch.fx.Node, n: int, m: int) -> tuple[int, ...] | None:
    """The shape of a product with ``n`` rows and ``m`` columns, or None."""
    shape = node_shape(product)
    return shape if len(shape) in (2, 3) and shape[-2:] == (n, m) else None


def _reshapes(start: tuple[int, ...], chain: Sequence[torch.fx.Node], end: Sequence[int]) -> bool:
    """Whether the views ``chain``, applied to a contiguous tensor of shape ``start``, give that tensor
    reshaped to ``end`` (row-major strides, offset 0): replayed on a meta tensor."""
    value = torch.empty(start, device="meta")
    for node in chain:
        args = node.args[1:]
        if any(isinstance(a, torch.fx.Node) for a in _flat([*args, *node.kwargs.values()])):
            return False
        try:
            value = node.target(value, *args, **node.kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError):
            return False
    if tuple(value.shape) != tuple(end) or value.storage_offset() != 0:
        return False
    expected = torch.empty(tuple(end), device="meta").stride()
    return all(size == 1 or s == e for size, s, e in zip(value.shape, value.stride(), expected))


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        out.extend(_flat(a) if isinstance(a, (list, tuple)) else [a])
    return out


def _number(context: _Context, arg: Any) -> float | None:
    """``arg`` as a real number: a Python number, or a 0-d constant tensor."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    value = context.constant(arg, 1)
    if value is not None and value.dim() == 0 and (value.is_floating_point() or value.dtype in _INTEGERS):
        return float(value.item())
    return None


def _scale_of(context: _Context, node: torch.fx.Node) -> float | None:
    """The factor of ``x * c``, ``x / c`` (in place or not, ``c`` a positive finite number), else None."""
    if packet_name(node) not in _SCALES or node.kwargs or len(node.args) != 2:
        return None
    if node.target._overloadname not in ("Tensor", "Scalar"):
        return None  # div's rounding modes
    c = _number(context, node.args[1])
    if c is None or not math.isfinite(c) or c <= 0 or not isinstance(node.args[0], torch.fx.Node):
        return None
    if node.args[0].meta.get("val") is None or node_shape(node) != node_shape(node.args[0]):
        return None
    if node_dtype(node) != node_dtype(node.args[0]):
        return None
    return c if packet_name(node).startswith("mul") else 1.0 / c


def _mask_op(context: _Context, node: torch.fx.Node, shape: tuple[int, ...],
             dtype: torch.dtype) -> tuple[_ScoreOp, torch.fx.Node] | None:
    """An additive bias or a ``-inf`` fill at the scores' shape, and the scores it reads; else None."""
    name = packet_name(node)
    arity = 2 if name in ("add", "add_") else 3
    if node_shape(node) != shape or node_dtype(node) != dtype or len(node.args) != arity:
        return None
    if name in ("add", "add_"):
        if node.target._overloadname != "Tensor" or set(node.kwargs) - {"alpha"} or node.kwargs.get("alpha", 1) != 1:
            return None
        sides = node.args if name == "add" else node.args[:1]  # (in place: the scores are written)
        for scores in sides:
            bias = node.args[1] if scores is node.args[0] else node.args[0]
            if isinstance(scores, torch.fx.Node) and node_shape(scores) == shape and isinstance(bias, torch.fx.Node) \
                    and node_dtype(bias) == dtype and bias not in context.grad and _broadcasts(node_shape(bias), shape):
                return _ScoreOp("add", tensor=bias.name), scores
        return None
    if node.kwargs:
        return None
    if name in ("masked_fill", "masked_fill_"):
        scores, mask, fill = node.args
        if _number(context, fill) == -math.inf and _bool_mask(mask, shape) and isinstance(scores, torch.fx.Node):
            return _ScoreOp("fill", tensor=mask.name), scores
        return None
    if name == "where":
        mask, kept, other = node.args
        if not _bool_mask(mask, shape):
            return None
        for scores, fill, inverted in ((kept, other, True), (other, kept, False)):
            if isinstance(scores, torch.fx.Node) and node_shape(scores) == shape \
                    and _number(context, fill) == -math.inf:
                return _ScoreOp("fill", tensor=mask.name, inverted=inverted), scores
    return None


def _bool_mask(mask: Any, shape: tuple[int, ...]) -> bool:
    return isinstance(mask, torch.fx.Node) and node_dtype(mask) == torch.bool and _broadcasts(node_shape(mask), shape)


def _broadcasts(small: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """``small`` broadcasts to ``shape`` without enlarging it."""
    return len(small) <= len(shape) and all(s in (1, f) for s, f in zip(small[::-1], shape[::-1]))


def _mergeable(batch: tuple[int, ...], masks: Sequence[tuple[int, ...]]) -> bool:
    """With more than two batch dimensions the leading ones are merged into one (the fused kernel takes
    4-d operands): each mask must be broadcast along all of them or along none."""
    if len(batch) <= 2:
        return True
    lead = batch[:-1]
    for shape in masks:
        aligned = (1,) * (len(batch) + 2 - len(shape)) + tuple(shape)
        if aligned[: len(lead)] not in ((1,) * len(lead), tuple(lead)):
            return False
    return True


def _operand(context: _Context, node: Any, shape: tuple[int, ...], scaled: bool, stop: torch.fx.Node | None = None):
    """The chain from a region input (``stop``, or the first node that is not a view, a copy or a
    scale, or has other readers) to a product's operand: ``(_Operand, chain nodes, scale)``."""
    chain, scale = [], 1.0
    while isinstance(node, torch.fx.Node) and node is not stop and context.single(node) is not None:
        name = packet_name(node)
        factor = _scale_of(context, node) if scaled else None
        if factor is not None:
            scale *= factor
        elif name not in _OPERAND_CHAIN or node.kwargs.keys() - {"memory_format"}:
            break
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    chain.reverse()
    steps = [x for x in chain if packet_name(x) != "clone" and not (scaled and _scale_of(context, x) is not None)]
    # The matmul decomposition ends in a reshape of (*batch, rows, cols) into the product's batch
    # (einsum's with a trailing 1): left out, the operand stays a view (eager's ``clone`` before it
    # served only the ``bmm``), reshaped to ``shape`` by adding or removing ones.
    permutation = _permutation(node_shape(node), steps, shape)
    if steps and packet_name(steps[-1]) in ("view", "_unsafe_view") \
            and _ones_aside(node_shape(steps[-1].args[0])) == _ones_aside(shape):
        steps.pop()
    return _Operand(node.name, tuple(x.name for x in steps), shape, permutation), chain, scale


def _ones_aside(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def _permutation(source: tuple[int, ...], steps: Sequence[torch.fx.Node],
                 shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The permutation ``p`` with ``chain(x).reshape(shape) == x.permute(p)``, when the views ``steps``
    and the reshape only permute ``x`` (einsum's ``unsqueeze``, ``permute`` and ``view`` of ``q`` give
    ``q`` itself): replayed on a contiguous meta tensor, the result is a view of it whose strides are
    its own, permuted. Then the operand is read as that one view, and its gradient leaves the same way,
    without the copies the backward of the chain's reshapes makes."""
    if len(source) != len(shape) or sorted(source) != sorted(shape):
        return None
    start = torch.empty(source, device="meta")
    value = start
    try:
        for node in steps:
            args = node.args[1:]
            if packet_name(node) in ("view", "_unsafe_view"):
                value = value.reshape(*args)
            else:
                value = node.target(value, *args, **node.kwargs)
        value = value.reshape(shape)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    copied = StorageWeakRef(value.untyped_storage()) != StorageWeakRef(start.untyped_storage())
    if copied or value.storage_offset() != 0:
        return None  # a reshape copied
    free = list(range(len(source)))
    permutation = []
    for size, stride in zip(value.shape, value.stride()):
        match = [j for j in free if source[j] == size and (size == 1 or start.stride(j) == stride)]
        if not match:
            return None
        permutation.append(match[0])
        free.remove(match[0])
    return tuple(permutation)


def _causal(context: _Context, ops: Sequence[_ScoreOp], n: int, m: int) -> bool:
    """Whether the only mask is one ``-inf`` fill of exactly the positions above the diagonal (a
    constant mask, evaluated at plan time), broadcast over the batch."""
    masks = [op for op in ops if op.kind != "scale"]
    if len(masks) != 1 or masks[0].kind != "fill" or n != m:
        return False
    mask = context.constant(context.graph.node(masks[0].tensor), n * m)
    if mask is None or any(s != 1 for s in mask.shape[:-2]) or tuple(mask.shape[-2:]) != (n, m):
        return False
    filled = mask.reshape(n, m)
    filled = ~filled if masks[0].inverted else filled
    return bool(torch.equal(filled, torch.ones(n, m, dtype=torch.bool).triu(1)))


def _builders(context: _Context, mask: torch.fx.Node, region: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes that build a constant mask and that nothing but the region and one another reads
    (they go with the region when the mask becomes ``is_causal``)."""
    ancestors, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node not in ancestors and node.op == "call_function" and node in context.forward:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    taken: set[torch.fx.Node] = set()
    order = {node: i for i, node in enumerate(context.graph.gm.graph.nodes)}
    for node in sorted(ancestors, key=order.__getitem__, reverse=True):  # readers before what they read
        if all(r in region or r in taken for r in context.readers(node)):
            taken.add(node)
    return taken


# ----------------------------------------------------------------------------------------------
# stage 2: the fused kernel chosen, and fewer bytes kept


def _replaceable(context: _Context, pattern: Attention) -> bool:
    """What :func:`~memplan.passes._rewrite.region.replace_region` will ask, asked first (a pattern it
    refuses would hold its nodes from the other rewrites): the region's backward is found, no node but
    the output is read outside the region and that backward, and each gradient the backward hands on
    belongs to one input (an input read in two roles, ``x @ x.mT``, gets two, summed outside)."""
    graph = context.graph
    backward = region_backward(graph, pattern.nodes, context.index)
    if backward is None:
        return False
    inside = {*pattern.nodes, *backward.nodes}
    for name in pattern.nodes:
        if name != pattern.output and any(u.name not in inside for u in graph.node(name).users
                                          if u.target is not torch.ops.aten.detach.default):
            return False
    inputs, output = [graph.node(x) for x in pattern.inputs], graph.node(pattern.output)
    return match_gradients(graph, pattern.nodes, inputs, [output], backward) is not None


def _fused_and_smaller(context: _Context, pattern: Attention) -> bool:
    """Trace the replacement's forward over the inputs' fake values (those that carry a gradient
    requiring one: PyTorch chooses its kernel by that too): it must compute no softmax of its own
    (PyTorch's math path does, over the full scores; the backward follows the forward's choice), and
    the new storages it makes, its output's aside, must hold fewer bytes than the scores."""
    graph = context.graph
    inputs = [graph.node(x) for x in pattern.inputs]
    needs_grad = [x in context.grad for x in inputs]
    try:
        traced, _ = trace_joint(_attention_fn(pattern, graph), [x.meta["val"] for x in inputs], needs_grad, [None])
    except (RuntimeError, TypeError, ValueError):
        return False
    if any(packet_name(n) in _SOFTMAXES for n in traced.graph.nodes):
        return False
    result = next(n for n in traced.graph.nodes if n.op == "output").args[0][0].meta["val"]
    storages = {StorageWeakRef(p.meta["val"].untyped_storage()) for p in traced.graph.nodes if p.op == "placeholder"}
    storages.add(StorageWeakRef(result.untyped_storage()))
    kept = result.untyped_storage().nbytes() - result.nbytes  # (a padded output's cut columns)
    for node in traced.graph.nodes:
        for value in (v for v in _flat([node.meta.get("val")]) if isinstance(v, torch.Tensor)):
            storage = StorageWeakRef(value.untyped_storage())
            if storage not in storages:
                storages.add(storage)
                kept += value.untyped_storage().nbytes()
    return kept < pattern.scores


# ----------------------------------------------------------------------------------------------
# stage 3: the replacement


def _attention_fn(pattern: Attention, graph: CapturedGraph) -> Callable[..., tuple[torch.Tensor]]:
    def steps_of(operand: _Operand):
        return [(graph.node(s).target, graph.node(s).args[1:], dict(graph.node(s).kwargs)) for s in operand.steps]

    operands = [(pattern.inputs.index(o.source), steps_of(o), o.shape, o.permutation)
                for o in (pattern.query, pattern.key, pattern.value)]
    ops = [(op, pattern.inputs.index(op.tensor) if op.tensor is not None else None) for op in pattern.ops]
    batch, out_shape, scale, causal = pattern.batch, pattern.out_shape, pattern.scale, pattern.causal

    def fn(*values: torch.Tensor) -> tuple[torch.Tensor]:
        q, kt, v = (values[i].permute(p) if p is not None else _replay(values[i], steps, shape)
                    for i, steps, shape, p in operands)
        mask = None
        for op, i in ops:
            if op.kind == "scale":
                mask = mask * op.factor if mask is not None else None
            elif op.kind == "add":
                mask = values[i] if mask is None else mask + values[i]
            else:
                filled = ~values[i] if op.inverted else values[i]
                base = mask if mask is not None else filled.new_zeros((), dtype=q.dtype)
                mask = torch.where(filled, -math.inf, base)
        # The fused kernel takes one head size for q, k and v, read with unit stride: the narrower are
        # padded with zeros (which add nothing to q @ k^T, and make output columns that are cut off);
        # a k^T laid out as (d, m) is copied, as eager's ``clone`` copied it.
        width = max(q.shape[-1], v.shape[-1])
        q, k, v = (F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x if x.stride(-1) == 1
                   else x.contiguous() for x in (q, kt.transpose(-1, -2), v))
        q, k, v, mask = (_four_d(x, batch) if x is not None else None for x in (q, k, v, mask))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
        return (out[..., : out_shape[-1]].reshape(out_shape),)

    return fn


def _replay(value: torch.Tensor, steps, shape: tuple[int, ...]) -> torch.Tensor:
    """An operand's chain replayed on its source (views as reshapes: the copies are left out), then
    reshaped to ``shape``."""
    for target, args, kwargs in steps:
        if target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            value = value.reshape(*args)
        else:
            value = target(value, *args, **kwargs)
    return value.reshape(shape)


def _four_d(x: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """``x`` (``(*batch, rows, cols)``, or a mask broadcastable to it) as a 4-d tensor: leading ones
    added, or the leading batch dimensions merged (:func:`_mergeable` checked that masks allow it)."""
    rank = len(batch) + 2
    x = x.reshape((1,) * (rank - x.dim()) + tuple(x.shape))
    if rank <= 4:
        return x.reshape((1,) * (4 - rank) + tuple(x.shape))
    lead = rank - 3
    return x.reshape(math.prod(x.shape[:lead]), *x.shape[lead:])
