"""Chunk states and chunk rules: how each op carries the chunked index from its inputs to its output.

A value's *state* says how a chunk sees it: :class:`Split` (it carries the index on one dimension),
:class:`Partial` (a chunk holds a partial result, combined over chunks), or :data:`REP` (every chunk
sees all of it). :func:`chunk_rule` gives an op's output state from its inputs' states, asks for an
input to be sliced (:class:`Need`), or refuses (:class:`Barrier`: the op mixes the index).
Rules are per op, found from aten semantics only: nothing here knows a model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
import torch.fx

from memplan.graphutil import is_random, is_tensor, nbytes, packet_name, shape_of, value_of

__all__ = [
    "Split",
    "Partial",
    "Replicated",
    "REP",
    "State",
    "Need",
    "Barrier",
    "RuleResult",
    "LINEAR_PARTIALS",
    "crosses",
    "partial_op_class",
    "VIEW_OPS",
    "ZERO_PRODUCERS",
    "chunk_rule",
    "operand_requests",
    "map_view",
    "value_of",
    "shape_of",
    "is_tensor",
    "norm_dim",
    "arg_of",
    "tensor_args",
    "is_pointwise",
    "nbytes",
]


# ----------------------------------------------------------------------------------------------
# states


@dataclasses.dataclass(frozen=True)
class Split:
    """The value carries the chunked index on ``dim``: that dimension has ``units * inner`` entries and
    the index is its outer factor (a chunk of ``c`` units is ``narrow(dim, start * inner, c * inner)``)."""

    dim: int
    inner: int = 1

    def __str__(self) -> str:
        return f"split(dim={self.dim})" if self.inner == 1 else f"split(dim={self.dim}, inner={self.inner})"


@dataclasses.dataclass(frozen=True)
class Partial:
    """A chunk's value is a partial result; the full value combines all chunks with ``kind``:
    ``"sum"``, ``"mean"`` (sum weighted by chunk length), ``"lse"`` (log-sum-exp), ``"max"``, ``"min"``,
    ``"nll_mean"`` (NLL mean, weighted by the chunk's total weight)."""

    kind: str

    def __str__(self) -> str:
        return f"partial({self.kind})"


@dataclasses.dataclass(frozen=True)
class Replicated:
    """The value does not depend on the chunk: every chunk sees all of it."""

    def __str__(self) -> str:
        return "replicated"


REP = Replicated()
State = Union[Split, Partial, Replicated, tuple]

# ----------------------------------------------------------------------------------------------
# the algebra of partial results
#
# A chunk's partial value ``p_c`` becomes the full value by its kind's combine ``C``:
#
#     sum:  x = sum_c p_c                mean: x = sum_c (n_c / n) p_c     (the additive kinds)
#     max:  x = max_c p_c                min:  x = min_c p_c               lse:  x = log sum_c exp p_c
#
# An op ``f`` may run on every chunk's partial, before the combine, only if ``f(C(p_1, ..., p_k)) =
# C(f(p_1), ..., f(p_k))`` for every way of splitting. What an op is to its partial operand decides it:
#
# * a *value* op (a view, a layout change, a copy in a float dtype) keeps every element's value: it
#   commutes with every combine; the rules let it carry the additive kinds only.
# * a *linear* op (``f(a + b) = f(a) + f(b)``, ``f(s a) = s f(a)``) commutes with the additive combines:
#   negation, scaling by a value every chunk shares, add/sub of partials of one kind, a sum or mean
#   over other dimensions, a matmul with a shared operand.
# * an *affine* op (linear plus a constant: ``p + 1e-6``, ``p + bias``, ``addmm``) does not: each
#   chunk would add the constant, k times in all. Counterexample: ``((x[:, None] - x[None]) ** 2)
#   .sum(-1).add(1e-6).sqrt()`` with the features chunked in two gave ``sqrt(2e-6)`` on the diagonal.
# * a *nonlinear* op (``exp``, ``sqrt``, ``relu``, ``fill_`` with a non-zero value, a cast to an
#   integer dtype, a floor division) does not. Counterexample: ``exp(x.sum(i))``.
#
# The rules below classify an op with :func:`partial_op_class` where it meets a partial and ask
# :func:`crosses`; nothing else lets a partial through.

#: Partial kinds that linear ops (views, add, scaling) carry through unchanged.
LINEAR_PARTIALS = ("sum", "mean")

VALUE, LINEAR, AFFINE, NONLINEAR = "value", "linear", "affine", "nonlinear"


def crosses(kind: str, op_class: str) -> bool:
    """Whether a partial result of ``kind`` may pass, chunk by chunk, an op of ``op_class`` before
    its combine (see the algebra above).

    Examples
    --------
    >>> crosses("sum", LINEAR), crosses("sum", AFFINE), crosses("max", LINEAR)
    (True, False, False)
    """
    return kind in LINEAR_PARTIALS and op_class in (VALUE, LINEAR)


def partial_op_class(node: torch.fx.Node, st: Callable[[Any], State]) -> str:
    """What pointwise or copying op ``node`` is to its partial operands (``st`` gives the states).

    Linear only where every operand that is not a partial enters as a factor: ``add``/``sub`` of
    partials alone (``alpha`` scales), ``mul`` with one partial, ``div`` of a partial by a shared
    value without rounding, ``neg``. A non-partial addend (a tensor or a Python number) makes the op
    affine. Copies are value ops when they keep a float dtype; ``zero_`` is linear (it gives 0).
    """
    name = packet_name(node)

    def partial(a: Any) -> bool:
        return isinstance(a, torch.fx.Node) and isinstance(st(a), Partial)

    positions = [i for i, a in enumerate(node.args) if partial(a)]
    if name in ("alias", "detach", "clone", "contiguous", "lift_fresh_copy", "positive"):
        return VALUE
    if name == "_to_copy":
        value = node.meta.get("val")
        floating = isinstance(value, torch.Tensor) and value.dtype.is_floating_point
        return VALUE if floating else NONLINEAR
    if name == "zero_":
        return LINEAR
    if name in ("add", "sub"):
        operands = list(node.args[:2])
        if len(operands) == 2 and all(partial(a) for a in operands):
            return LINEAR
        return AFFINE if positions else NONLINEAR
    if name == "mul" and len(positions) == 1:
        return LINEAR
    if name == "neg":
        return LINEAR
    if name == "div" and positions == [0] and node.kwargs.get("rounding_mode") is None:
        return LINEAR
    return NONLINEAR


@dataclasses.dataclass(frozen=True)
class Need:
    """The rule holds only if input ``node`` is sliced as ``state`` (it is full-sized on the index)."""

    node: torch.fx.Node
    state: Split


@dataclasses.dataclass(frozen=True)
class Barrier:
    """The op mixes the index (or has no rule): it cannot run chunk by chunk."""

    reason: str


RuleResult = Union[Split, Partial, Replicated, tuple, Need, Barrier]


# ----------------------------------------------------------------------------------------------
# op chunk rules

_IDENTITY_OPS = {"alias", "detach", "clone", "contiguous", "lift_fresh_copy", "_to_copy", "fill_", "zero_",
                 "relu_", "positive"}
VIEW_OPS = {"view", "_unsafe_view", "reshape"}
_FACTORY_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like"}
_NEW_FACTORIES = {"new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided"}
_FACTORIES = {"zeros", "ones", "empty", "full", "empty_strided", "scalar_tensor", "arange"}
ZERO_PRODUCERS = {"zeros", "new_zeros", "zeros_like"}
_REDUCTION_KINDS = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min", "logsumexp": "lse", "max": "max", "min": "min"}
_EXTRA_POINTWISE = {"copy_", "copy", "masked_fill_", "where"}


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def is_pointwise(node: torch.fx.Node) -> bool:
    return _op_facts(node.target)[2]


@functools.lru_cache(maxsize=None)
def _op_facts(target: Any) -> tuple[str, bool, bool]:
    """``(packet name, draws from the RNG, pointwise)`` of an op: they depend on the op alone, and
    reading an op's tags builds them anew each time, so the rules ask once per op."""
    packet = getattr(target, "overloadpacket", None)
    name = packet.__name__ if packet is not None else ""
    tags = getattr(target, "tags", ())
    return name, torch.Tag.nondeterministic_seeded in tags, torch.Tag.pointwise in tags or name in _EXTRA_POINTWISE


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes if is_tensor(a)]


def arg_of(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def map_view(in_shape: Sequence[int], out_shape: Sequence[int], state: Split) -> Split | None:
    """Where the chunked index lands after reshaping ``in_shape`` to ``out_shape`` (None: it is split).

    Examples
    --------
    >>> map_view((16, 64, 32), (1024, 32), Split(0))
    Split(dim=0, inner=64)
    >>> map_view((1024, 32), (16, 64, 32), Split(0, 64))
    Split(dim=0, inner=1)
    >>> map_view((1024, 32), (16, 64, 32), Split(0)) is None
    True
    """
    d, inner = state.dim, state.inner
    units = in_shape[d] // inner
    outer = math.prod(in_shape[:d])
    unit_elems = inner * math.prod(in_shape[d + 1 :])
    for k, size in enumerate(out_shape):
        if size < units or size % units or math.prod(out_shape[:k]) != outer:
            continue
        new_inner = size // units
        if new_inner * math.prod(out_shape[k + 1 :]) == unit_elems:
            return Split(k, new_inner)
    return None


def _pointwise(node: torch.fx.Node, st: Callable[[Any], State], out_shape: tuple[int, ...],
               tensors: Sequence[torch.fx.Node] | None = None) -> RuleResult:
    rank = len(out_shape)
    states = [(a, st(a)) for a in (tensor_args(node) if tensors is None else tensors)]
    splits = [(a, s) for a, s in states if isinstance(s, Split)]
    partials = [(a, s) for a, s in states if isinstance(s, Partial)]
    if partials:
        return _linear_partial(node, st, splits, partials)
    dims = {(s.dim + rank - len(shape_of(a)), s.inner) for a, s in splits}
    if len(dims) != 1:
        return Barrier("operands carry the index on different dimensions")
    (dim, inner), = dims
    for a, s in states:
        if isinstance(s, Replicated):
            shape = shape_of(a)
            aligned = dim - (rank - len(shape))
            if aligned >= 0 and shape[aligned] != 1:
                return Need(a, Split(aligned, inner))
    return Split(dim, inner)


def _linear_partial(node: torch.fx.Node, st, splits, partials) -> RuleResult:
    """Partial sums and means pass through linear ops: add/sub of partials, scaling by a replicated value."""
    if splits:
        return Barrier("mixes a partial result with a sliced value")
    kinds = {p.kind for _, p in partials}
    if len(kinds) != 1 or not crosses(next(iter(kinds)), LINEAR):
        return Barrier("a partial result that only linear ops may touch")
    kind = next(iter(kinds))
    # by argument position, not by node: ``mul(p, p)`` reads one partial node twice and is not linear
    op_class = partial_op_class(node, st)
    if crosses(kind, op_class):
        return Partial(kind)
    return Barrier(f"{packet_name(node)} is {op_class} in a partial result, which only linear ops may cross")


def _reduction(node: torch.fx.Node, st, name: str) -> RuleResult:
    """Reductions: over another dimension the index moves; over the chunked one the result is partial."""
    x = node.args[0]
    s = st(x)
    rank = len(shape_of(x))
    overload = node.target._overloadname
    with_indices = name in ("max", "min") and overload == "dim"
    if name in ("sum", "mean", "max", "min") and overload == "default":
        dims, keepdim = list(range(rank)), False
    elif with_indices or name in ("argmax", "argmin"):
        dim = arg_of(node, 1, "dim")
        dims = list(range(rank)) if dim is None else [norm_dim(dim, rank)]
        keepdim = bool(arg_of(node, 2, "keepdim", False))
    else:
        dim = arg_of(node, 1, "dim")
        dim = [] if dim is None else list(dim) if isinstance(dim, (list, tuple)) else [dim]
        dims = list(range(rank)) if not dim else [norm_dim(d, rank) for d in dim]
        keepdim = bool(arg_of(node, 2, "keepdim", False))
    if isinstance(s, Partial):
        if name in ("sum", "mean") and crosses(s.kind, LINEAR):
            return Partial(s.kind)
        return Barrier(f"{name} of a partial result")
    if not isinstance(s, Split):
        return REP
    if s.dim in dims:
        if with_indices or name in ("argmax", "argmin"):
            return Barrier(f"{name} with indices over the chunked dimension")
        return Partial(_REDUCTION_KINDS.get(name, name))
    new_dim = s.dim if keepdim else s.dim - sum(1 for d in dims if d < s.dim)
    out = Split(new_dim, s.inner)
    return (out, out) if with_indices else out


def _vector_norm(node: torch.fx.Node, st) -> RuleResult:
    """``linalg_vector_norm(x, ord, dim, keepdim)``: over other dimensions the index moves as in a sum; a
    norm over the chunked dimension has no partial form here (it is not a sum of the chunks' norms)."""
    x = node.args[0]
    s = st(x)
    if isinstance(s, Partial):
        return Barrier("norm of a partial result")
    if not isinstance(s, Split):
        return REP
    rank = len(shape_of(x))
    dim = arg_of(node, 2, "dim")
    dims = list(range(rank)) if dim is None else [norm_dim(d, rank) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    if s.dim in dims:
        return Barrier("norm over the chunked dimension")
    keepdim = bool(arg_of(node, 3, "keepdim", False))
    return Split(s.dim if keepdim else s.dim - sum(1 for d in dims if d < s.dim), s.inner)


def _matmul(node: torch.fx.Node, st, a: Any, b: Any, batched: bool) -> RuleResult:
    """``mm`` (rows of a, columns of b, contraction) and ``bmm`` (plus a shared batch dimension)."""
    sa, sb = st(a), st(b)
    off = 1 if batched else 0
    if isinstance(sa, Partial) or isinstance(sb, Partial):
        if isinstance(sa, Split) or isinstance(sb, Split):
            return Barrier("matmul of a partial and a sliced value")
        kinds = {s.kind for s in (sa, sb) if isinstance(s, Partial)}
        if len(kinds) == 1 and isinstance(sa, Partial) != isinstance(sb, Partial) and crosses(next(iter(kinds)), LINEAR):
            return Partial(kinds.pop())
        return Barrier("matmul of two partial results")
    if batched:
        a0 = isinstance(sa, Split) and sa.dim == 0
        b0 = isinstance(sb, Split) and sb.dim == 0
        if a0 and b0:
            return sa if sa.inner == sb.inner else Barrier("batch dimensions carry the index differently")
        if a0:
            return Need(b, Split(0, sa.inner)) if isinstance(sb, Replicated) else Barrier("batch and another dimension")
        if b0:
            return Need(a, Split(0, sb.inner)) if isinstance(sa, Replicated) else Barrier("batch and another dimension")
    rows, inner_a = (isinstance(sa, Split) and sa.dim == off), (isinstance(sa, Split) and sa.dim == off + 1)
    cols, inner_b = (isinstance(sb, Split) and sb.dim == off + 1), (isinstance(sb, Split) and sb.dim == off)
    if rows and not isinstance(sb, Split):
        return Split(off, sa.inner)
    if cols and not isinstance(sa, Split):
        return Split(off + 1, sb.inner)
    if inner_a and inner_b and sa.inner == sb.inner:
        return Partial("sum")
    if inner_a and isinstance(sb, Replicated):
        return Need(b, Split(off, sa.inner))
    if inner_b and isinstance(sa, Replicated):
        return Need(a, Split(off + 1, sb.inner))
    return Barrier("matmul operands carry the index on incompatible dimensions")


def _broadcast_into(node: torch.fx.Node, st, other: Any, out: RuleResult, out_rank: int) -> RuleResult:
    """``out`` combined with a broadcast operand (addmm's bias): slice it if it is full-sized there."""
    if not isinstance(out, Split) or not is_tensor(other):
        return out
    s = st(other)
    aligned = out.dim - (out_rank - len(shape_of(other)))
    if isinstance(s, Split):
        return out if s.dim == aligned and s.inner == out.inner else Barrier("bias carries the index elsewhere")
    if isinstance(s, Partial):
        return Barrier("partial bias")
    if aligned >= 0 and shape_of(other)[aligned] != 1:
        return Need(other, Split(aligned, out.inner))
    return out


def _same_dim_all(node: torch.fx.Node, st, tensors: Sequence[Any], forbidden: int | None, rank_of) -> RuleResult:
    """All tensor operands carry the index on the same dimension, which must not be ``forbidden``."""
    states = [(t, st(t)) for t in tensors if is_tensor(t)]
    if any(isinstance(s, Partial) for _, s in states):
        return Barrier("partial operand")
    splits = {s for _, s in states if isinstance(s, Split)}
    if len(splits) != 1:
        return Barrier("operands carry the index on different dimensions")
    (s,) = splits
    if forbidden is not None and s.dim == forbidden:
        return Barrier("the op works along the chunked dimension")
    for t, ts in states:
        if isinstance(ts, Replicated) and shape_of(t) and len(shape_of(t)) > s.dim and shape_of(t)[s.dim] != 1:
            return Need(t, s)
    return s


def chunk_rule(node: torch.fx.Node, st: Callable[[Any], State], is_zero: Callable[[Any], bool] = lambda n: False) -> RuleResult:
    """The chunk rule of ``node``: its output state given its inputs' states ``st(input)``.

    Returns a state (``Split``, ``Partial``, ``REP`` or a tuple for ops with several outputs), a
    :class:`Need` (an input must be sliced for the rule to hold) or a :class:`Barrier`.
    ``is_zero(x)`` tells whether a replicated input is known to be all zeros (scatter-adds into zeros
    are partial sums).

    Examples
    --------
    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x, w: (x @ w).softmax(-1), tracing_mode="fake")(torch.randn(8, 4), torch.randn(4, 5))
    >>> x, w, mm, soft = [n for n in gm.graph.nodes][:4]
    >>> chunk_rule(mm, {x: Split(0)}.get), chunk_rule(soft, {mm: Split(0)}.get)
    (Split(dim=0, inner=1), Split(dim=0, inner=1))
    >>> chunk_rule(soft, {mm: Split(1)}.get)
    Barrier(reason='softmax along the chunked dimension')
    """
    answer = _chunk_rule(node, st, is_zero)
    if _rounds_partials(node, answer):
        return Barrier("a partial sum in a half-precision dtype: each chunk's would be rounded on its own, "
                       "where the op rounds the whole once")
    return answer


# Partial results whose combination adds the chunks' values: in a dtype below single precision each chunk's
# partial is rounded before the adding (a bfloat16 sum over 64 features, split in 4, came out 0.375 off).
_ROUNDED_KINDS = frozenset({"sum", "mean", "lse", "nll_mean"})


def _rounds_partials(node: torch.fx.Node, answer: RuleResult) -> bool:
    """Whether ``answer`` makes ``node`` (or one of its results) a partial result that adds the chunks'
    values in a float dtype narrower than 32 bits (max and min combine exactly in any dtype)."""
    states = answer if isinstance(answer, tuple) else (answer,)
    value = node.meta.get("val")
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * len(states)
    return any(isinstance(s, Partial) and s.kind in _ROUNDED_KINDS and isinstance(v, torch.Tensor)
               and v.dtype.is_floating_point and torch.finfo(v.dtype).bits < 32
               for s, v in zip(states, values))


def _chunk_rule(node: torch.fx.Node, st: Callable[[Any], State], is_zero: Callable[[Any], bool]) -> RuleResult:
    """:func:`chunk_rule` before the check of half-precision partial sums."""

    def state(x: Any) -> State:
        if not isinstance(x, torch.fx.Node):
            return REP
        s = st(x)
        return REP if s is None else s

    if node.op != "call_function":
        return Barrier("not an op")
    if node.target is operator.getitem:
        parent = state(node.args[0])
        if isinstance(parent, tuple):
            return parent[node.args[1]]
        return parent if isinstance(parent, Replicated) else Barrier("getitem of a non-tuple")
    tensors = tensor_args(node)
    in_states = [state(a) for a in tensors]
    name, random, _ = _op_facts(node.target)
    if name in _NEW_FACTORIES or name in _FACTORIES:
        return REP  # shape-only: relabelled on demand (see Need handling)
    if random and is_random(node):
        # Before the replicated shortcut: an op the flood asks about reads a value the region makes,
        # so the region would run it once per chunk, even with every input replicated (dropout's
        # ``bernoulli_`` into an ``empty_like`` of a partial sum), drawing once per chunk where eager
        # draws once.
        return Barrier("random op")
    if all(isinstance(s, Replicated) for s in in_states):
        return REP
    value = node.meta.get("val")
    out_shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
    x = node.args[0] if node.args else None
    sx = state(x)

    if name in _IDENTITY_OPS:
        if isinstance(sx, Partial):
            op_class = partial_op_class(node, state)
            if not crosses(sx.kind, op_class):
                return Barrier(f"{name} is {op_class} in a partial result, which only linear ops may cross")
        return sx if shape_of(x) == out_shape or isinstance(sx, Replicated) else Barrier("shape changes")
    if name in _FACTORY_LIKE:
        return sx if isinstance(sx, Split) else REP
    if name in VIEW_OPS:
        if isinstance(sx, Partial):
            return sx if crosses(sx.kind, VALUE) else Barrier("view of a partial")
        mapped = map_view(shape_of(x), out_shape, sx)
        return mapped if mapped is not None else Barrier("the view splits the chunked dimension")
    if name == "expand":
        if isinstance(sx, Partial):
            return sx if crosses(sx.kind, VALUE) else Barrier("expand of a partial")
        return Split(sx.dim + len(out_shape) - len(shape_of(x)), sx.inner)
    if name in ("permute", "transpose", "t", "unsqueeze", "squeeze", "select", "slice", "narrow", "diagonal"):
        return _layout_rule(node, name, sx, shape_of(x), out_shape)
    if name in ("split", "split_with_sizes", "unbind", "chunk", "unsafe_split", "unsafe_chunk", "unsafe_split_with_sizes"):
        if not isinstance(sx, Split):
            return Barrier("split of a partial")
        dim = norm_dim(arg_of(node, 2 if name != "unbind" else 1, "dim", 0), len(shape_of(x)))
        if dim == sx.dim:
            return Barrier("split along the chunked dimension")
        new = Split(sx.dim - (1 if name == "unbind" and dim < sx.dim else 0), sx.inner)
        return tuple(new for _ in value)
    if name == "cat":
        seq = [t for t in node.args[0] if is_tensor(t)]
        rank = len(out_shape)
        return _same_dim_all(node, state, seq, norm_dim(arg_of(node, 1, "dim", 0), rank), None)
    if name == "stack":
        seq = [t for t in node.args[0] if is_tensor(t)]
        dim = norm_dim(arg_of(node, 1, "dim", 0), len(out_shape))
        inner = _same_dim_all(node, state, seq, None, None)
        if not isinstance(inner, Split):
            return inner
        return Split(inner.dim + (1 if dim <= inner.dim else 0), inner.inner)
    if name in _REDUCTION_KINDS or name in ("max", "min", "argmax", "argmin"):
        return _reduction(node, state, name)
    if name == "linalg_vector_norm":
        return _vector_norm(node, state)
    if name == "mm":
        return _matmul(node, state, node.args[0], node.args[1], batched=False)
    if name == "bmm":
        return _matmul(node, state, node.args[0], node.args[1], batched=True)
    if name == "addmm":
        if isinstance(state(node.args[0]), (Split, Partial)) and not isinstance(state(node.args[1]), Split) and not isinstance(state(node.args[2]), Split):
            return Barrier("bias carries the index")
        inner_result = _matmul(node, state, node.args[1], node.args[2], batched=False)
        if isinstance(inner_result, Partial):
            return Barrier("bias added to a partial sum")
        return _broadcast_into(node, state, node.args[0], inner_result, 2)
    if name == "baddbmm":
        inner_result = _matmul(node, state, node.args[1], node.args[2], batched=True)
        if isinstance(inner_result, Partial):
            return Barrier("self added to a partial sum")
        return _broadcast_into(node, state, node.args[0], inner_result, 3)
    if name in ("_softmax", "_log_softmax"):
        if not isinstance(sx, Split):
            return Barrier(f"{name} of a partial")
        return sx if norm_dim(node.args[1], len(out_shape)) != sx.dim else Barrier("softmax along the chunked dimension")
    if name in ("_softmax_backward_data", "_log_softmax_backward_data"):
        return _same_dim_all(node, state, node.args[:2], norm_dim(node.args[2], len(out_shape)), None)
    if name == "native_layer_norm":
        normalized = len(node.args[1])
        if not isinstance(sx, Split) or sx.dim >= len(shape_of(x)) - normalized:
            return Barrier("layer norm over the chunked dimension")
        if any(isinstance(state(a), (Split, Partial)) for a in node.args[2:4]):
            return Barrier("sliced layer-norm weights")
        return (sx, sx, sx)
    if name == "native_layer_norm_backward":
        normalized = len(node.args[2])
        split = _same_dim_all(node, state, [node.args[0], node.args[1], node.args[3], node.args[4]], None, None)
        if not isinstance(split, Split) or split.dim >= len(shape_of(node.args[1])) - normalized:
            return split if not isinstance(split, Split) else Barrier("layer norm over the chunked dimension")
        return (split, Partial("sum"), Partial("sum"))
    if name == "nll_loss_forward":
        split = _same_dim_all(node, state, [node.args[0], node.args[1]], None, None)
        if not isinstance(split, Split):
            return split
        if split.dim != 0 or len(shape_of(node.args[0])) != 2 or isinstance(state(node.args[2]), (Split, Partial)):
            return Barrier("NLL over the class dimension")
        reduction = node.args[3]
        if reduction == 1:
            return (Partial("nll_mean"), Partial("sum"))
        if reduction == 2:
            return (Partial("sum"), Partial("sum"))
        return Barrier("unreduced NLL")
    if name == "nll_loss_backward":
        if isinstance(state(node.args[0]), (Split, Partial)) or isinstance(state(node.args[6]), (Split, Partial)):
            return Barrier("NLL backward with a sliced loss gradient")
        split = _same_dim_all(node, state, [node.args[1], node.args[2]], None, None)
        return split if not isinstance(split, Split) or split.dim == 0 else Barrier("NLL over classes")
    if name == "embedding":
        if isinstance(state(node.args[0]), (Split, Partial)):
            return Barrier("sliced embedding table")
        s = state(node.args[1])
        return s if isinstance(s, Split) else Barrier("partial indices")
    if name == "embedding_dense_backward":
        split = _same_dim_all(node, state, [node.args[0], node.args[1]], None, None)
        if not isinstance(split, Split):
            return split
        return Partial("sum") if not arg_of(node, 4, "scale_grad_by_freq", False) else Barrier("scale_grad_by_freq")
    if name == "gather":
        dim = norm_dim(node.args[1], len(out_shape))
        return _same_dim_all(node, state, [node.args[0], node.args[2]], dim, None)
    if name in ("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce"):
        dim = norm_dim(node.args[1], len(out_shape))
        return _same_dim_all(node, state, [a for a in (node.args[0], node.args[2], node.args[3] if len(node.args) > 3 else None) if a is not None], dim, None)
    if name in ("index_add", "index_add_"):
        return _index_add(node, state, is_zero)
    if name == "grouped_addmm_":
        return _grouped_addmm(node, state, is_zero)
    if name == "index":
        return _index(node, state, out_shape)
    if name in ("index_put", "index_put_", "_index_put_impl_"):
        return _index_put(node, state, is_zero)
    if name == "slice_backward":
        g = state(node.args[0])
        if isinstance(g, Split) and norm_dim(node.args[2], len(out_shape)) != g.dim:
            return g
        return Barrier("slice_backward along the chunked dimension") if isinstance(g, Split) else Barrier("partial")
    if name == "select_backward":
        g = state(node.args[0])
        if not isinstance(g, Split):
            return Barrier("partial")
        dim = norm_dim(node.args[2], len(out_shape))
        return Split(g.dim + (1 if dim <= g.dim else 0), g.inner)
    if name in ("convolution",):
        if isinstance(sx, Split) and sx.dim == 0 and not any(isinstance(state(a), (Split, Partial)) for a in node.args[1:3]):
            return sx
        return Barrier("convolution over a non-batch dimension")
    if name == "convolution_backward":
        split = _same_dim_all(node, state, [node.args[0], node.args[1]], None, None)
        if isinstance(split, Split) and split.dim == 0 and not isinstance(state(node.args[2]), (Split, Partial)):
            return (split, Partial("sum"), Partial("sum"))
        return split if not isinstance(split, Split) else Barrier("convolution over a non-batch dimension")
    if name in _ATTENTION:
        return _attention(node, state)
    if name in _ATTENTION_BACKWARD:
        return _attention_backward(node, state)
    if is_pointwise(node):
        if not out_shape and not isinstance(value, torch.Tensor):
            return Barrier("pointwise op without a tensor value")
        return _pointwise(node, state, out_shape, tensors)
    return Barrier(f"no chunk rule for {name or node.target}")


# Fused attention as ``scaled_dot_product_attention`` runs it on the CPU: query, key and value are
# (batch, heads, positions, features); the outputs are the attention (batch, heads, query positions,
# features) and the log-sum-exp of each query's scores (batch, heads, query positions). The backward
# takes the output's gradient, the three inputs, the output and the log-sum-exp.
_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu"}
_ATTENTION_BACKWARD = {"_scaled_dot_product_flash_attention_for_cpu_backward"}


def _attention_split(node: torch.fx.Node, st, per_query: Sequence[Any], shared: Sequence[Any], flags: int) -> RuleResult:
    """The split of an attention op whose query-side tensors are ``per_query`` (the query first) and
    key-side ``shared`` (key and value); ``dropout_p`` and ``is_causal`` are arguments ``flags`` and
    ``flags + 1``.

    Batch and heads (dimensions 0 and 1) are independent: every tensor carries the index there. Query
    positions (dimension 2) are independent when the attention is not causal (a causal mask is
    relative to each chunk's first query, not the sequence's): the query side carries the index, the
    key side is whole in every chunk. Key positions and features are mixed. The mask, broadcast from
    the right, carries the index where it is not of size one.
    """
    if arg_of(node, flags, "dropout_p", 0.0):
        return Barrier("attention with dropout")
    if any(len(shape_of(t)) != 4 for t in (per_query[0], *shared)):
        return Barrier("attention on other than (batch, heads, positions, features)")
    tensors = [*per_query, *shared]
    if any(isinstance(st(t), Partial) for t in tensors):
        return Barrier("attention of a partial")
    queries = {st(t) for t in per_query if isinstance(st(t), Split)}
    if len(queries) == 1 and next(iter(queries)).dim == 2 and not any(isinstance(st(t), Split) for t in shared):
        if arg_of(node, flags + 1, "is_causal", False):
            return Barrier("causal attention along the query positions")
        split = _same_dim_all(node, st, per_query, None, None)
    elif any(isinstance(st(t), Split) and st(t).dim > 1 for t in tensors):
        return Barrier("attention along key positions or features")
    else:
        split = _same_dim_all(node, st, tensors, None, None)
    if not isinstance(split, Split):
        return split
    mask = node.kwargs.get("attn_mask")
    if isinstance(mask, torch.fx.Node):
        rank = len(shape_of(mask))
        aligned = split.dim - (4 - rank) if split.dim < 2 else rank - 2
        carries = 0 <= aligned < rank and shape_of(mask)[aligned] != 1
        mask_state = st(mask)
        if not carries and not isinstance(mask_state, Replicated):
            return Barrier("mask carries another index")
        if carries and mask_state != Split(aligned, split.inner):
            return Need(mask, Split(aligned, split.inner)) if isinstance(mask_state, Replicated) else Barrier("mask split elsewhere")
    return split


def _attention(node: torch.fx.Node, st) -> RuleResult:
    query, key, value = node.args[:3]
    split = _attention_split(node, st, [query], [key, value], 3)
    return (split, split) if isinstance(split, Split) else split


def _attention_backward(node: torch.fx.Node, st) -> RuleResult:
    grad_out, query, key, value, out, logsumexp = node.args[:6]
    split = _attention_split(node, st, [query, grad_out, out, logsumexp], [key, value], 6)
    if not isinstance(split, Split):
        return split
    if split.dim == 2:  # each chunk of queries adds its part to the keys' and values' gradients
        return (split, Partial("sum"), Partial("sum"))
    return (split, split, split)


def operand_requests(node: torch.fx.Node, st: Callable[[Any], State]) -> tuple[Split, list[torch.fx.Node]] | None:
    """For ``cat`` and ``stack``, whose rule asks for one replicated operand at a time to be sliced
    (the first in order that is full-sized on the index): the split every operand must carry and the
    operands the rule would ask for, in that order. None when its answer is not such a request, and
    for every other op.

    Meeting the requests one rule call at a time reads all the operands each time, which is quadratic
    in them; a stack of the thousand steps of an unrolled loop is asked once instead (see the floods).
    """
    name = packet_name(node)
    if node.op != "call_function" or name not in ("cat", "stack"):
        return None

    def state(x: Any) -> State:
        s = st(x) if isinstance(x, torch.fx.Node) else REP
        return REP if s is None else s

    seq = [(t, state(t)) for t in node.args[0] if is_tensor(t)]
    if any(isinstance(s, Partial) for _, s in seq):
        return None
    splits = {s for _, s in seq if isinstance(s, Split)}
    if len(splits) != 1:
        return None
    (split,) = splits
    if name == "cat":
        value = node.meta.get("val")
        rank = len(value.shape) if isinstance(value, torch.Tensor) else 0
        if split.dim == norm_dim(arg_of(node, 1, "dim", 0), rank):
            return None
    asked = [
        t for t, s in seq
        if isinstance(s, Replicated) and shape_of(t) and len(shape_of(t)) > split.dim and shape_of(t)[split.dim] != 1
    ]
    return split, asked


def _layout_rule(node: torch.fx.Node, name: str, sx: State, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> RuleResult:
    if isinstance(sx, Partial):
        if name in ("permute", "transpose", "t", "unsqueeze", "squeeze") and crosses(sx.kind, VALUE):
            return sx
        return Barrier(f"{name} of a partial")
    d, inner = sx.dim, sx.inner
    rank_in, rank_out = len(in_shape), len(out_shape)
    if name == "permute":
        dims = [norm_dim(p, rank_in) for p in node.args[1]]
        return Split(dims.index(d), inner)
    if name in ("transpose", "t"):
        a, b = (0, 1) if name == "t" else (norm_dim(node.args[1], rank_in), norm_dim(node.args[2], rank_in))
        if rank_in < 2:
            return sx
        return Split(b if d == a else a if d == b else d, inner)
    if name == "unsqueeze":
        k = norm_dim(node.args[1], rank_out)
        return Split(d + (1 if k <= d else 0), inner)
    if name == "squeeze":
        dims = arg_of(node, 1, "dim")
        if dims is None:
            removed = [i for i, s in enumerate(in_shape) if s == 1]
        else:
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
            removed = [norm_dim(i, rank_in) for i in dims if in_shape[norm_dim(i, rank_in)] == 1]
        return Split(d - sum(1 for i in removed if i < d), inner)
    if name == "select":
        dim = norm_dim(node.args[1], rank_in)
        return Barrier("select along the chunked dimension") if dim == d else Split(d - (1 if dim < d else 0), inner)
    if name in ("slice", "narrow"):
        dim = norm_dim(arg_of(node, 1, "dim", 0), rank_in)
        if dim != d:
            return sx
        if in_shape == out_shape and (name == "narrow" or arg_of(node, 4, "step", 1) == 1):
            return sx  # a full slice
        return Barrier("slice along the chunked dimension")
    return Barrier(f"{name} of the chunked dimension")


def _index_add(node: torch.fx.Node, st, is_zero) -> RuleResult:
    base, dim, index, source = node.args[0], node.args[1], node.args[2], node.args[3]
    rank = len(shape_of(base))
    dim = norm_dim(dim, rank)
    sb, si, ss = st(base), st(index), st(source)
    if isinstance(ss, Split) and ss.dim == dim and isinstance(si, Split) and si.dim == 0 and si.inner == ss.inner:
        return _added_into(node, base, sb, is_zero, "index_add of sliced rows")
    if isinstance(si, Replicated) and isinstance(ss, Split) and ss.dim == dim and is_tensor(index):
        if shape_of(index) == (shape_of(source)[dim],):
            return Need(index, Split(0, ss.inner))  # the rows a chunk adds go with their indices
    if isinstance(si, Replicated):
        return _same_dim_all(node, st, [base, source], dim, None)
    return Barrier("index_add along the chunked dimension")


def _grouped_addmm(node: torch.fx.Node, st, is_zero) -> RuleResult:
    """``memplan::grouped_addmm_(out, cols, values, dense, per_group, scatter, workspace)``: a chunk of
    consecutive groups is the op on the slices of the entries (``cols``, ``values``) and of the
    grouped side (``out`` without ``scatter``, ``dense`` with it), group numbers being positions. The
    other side is read or written whole: with ``scatter`` every chunk adds into all of ``out`` (a
    partial sum), without it every chunk reads all of ``dense``. The workspace has a fixed size."""
    out, cols, values, dense, per_group, scatter, workspace = node.args[:7]
    so, sc, sv, sd = st(out), st(cols), st(values), st(dense)
    if not isinstance(st(workspace), Replicated):
        return Barrier("grouped_addmm_ with a sliced workspace")
    sg, sh = (sd, so) if scatter else (so, sd)
    entries = [(cols, sc), (values, sv)]
    split = next((s for _, s in entries if isinstance(s, Split) and s.dim == 0), None)
    if split is None and isinstance(sg, Split) and sg.dim == 0:
        split = Split(0, sg.inner * per_group)
    if split is None or split.inner % per_group:
        return Barrier("grouped_addmm_ along the chunked dimension")
    for t, s in entries:
        if isinstance(s, Replicated):
            return Need(t, split)  # a chunk's entries go with their columns and values
        if s != split:
            return Barrier("grouped_addmm_ with entries sliced unevenly")
    group_split = Split(0, split.inner // per_group)
    if isinstance(sg, Replicated):
        if scatter:
            return Need(dense, group_split)  # the rows of dense a chunk's groups read
        if not (is_zero(out) and len(out.users) == 1):
            return Barrier("grouped_addmm_ into rows of a tensor other ops read")
        return Need(out, group_split)  # a chunk's rows of out (a zero factory: built chunk-sized)
    if sg != group_split:
        return Barrier("grouped_addmm_ with groups sliced unlike their entries")
    if not scatter:
        return group_split if isinstance(sh, Replicated) else Barrier("grouped_addmm_ of a sliced dense operand")
    return _added_into(node, out, sh, is_zero, "grouped_addmm_ of sliced entries")


def _index(node: torch.fx.Node, st, out_shape) -> RuleResult:
    base, indices = node.args[0], node.args[1]
    real = [(p, i) for p, i in enumerate(indices) if i is not None]
    if len(real) != 1:
        return Barrier("advanced indexing with several index tensors")
    p, idx = real[0]
    sb, si = st(base), st(idx)
    if isinstance(sb, Partial) or isinstance(si, Partial):
        return Barrier("indexing a partial")
    if isinstance(si, Split) and isinstance(sb, Replicated):
        return Split(p + si.dim, si.inner)
    if isinstance(sb, Split) and isinstance(si, Replicated) and sb.dim != p:
        idx_rank = len(shape_of(idx))
        return Split(sb.dim if sb.dim < p else sb.dim - 1 + idx_rank, sb.inner)
    return Barrier("indexing along the chunked dimension")


def _index_put(node: torch.fx.Node, st, is_zero) -> RuleResult:
    base, indices, values = node.args[0], node.args[1], node.args[2]
    accumulate = bool(arg_of(node, 3, "accumulate", False))
    real = [i for i in indices if i is not None]
    if len(real) != 1 or not accumulate or indices[0] is None:
        return Barrier("index_put other than an accumulation at dim 0")
    si, sv, sb = st(real[0]), st(values), st(base)
    if isinstance(si, Split) and isinstance(sv, Split) and si.dim == sv.dim == 0 and si.inner == sv.inner:
        return _added_into(node, base, sb, is_zero, "index_put of sliced values")
    return Barrier("index_put of sliced values into a non-zero base")


def _added_into(node: torch.fx.Node, base: Any, state: State, is_zero, what: str) -> RuleResult:
    """Sliced values added into ``base`` (in ``state``): a partial sum when the base is zeros or itself a
    partial sum, one accumulator when the op adds in place into a tensor nothing else reads."""
    if isinstance(state, Replicated) and is_zero(base) or isinstance(state, Partial) and state.kind == "sum":
        return Partial("sum")
    if _accumulates_into(node, base, state):
        return Partial("inplace")
    return Barrier(f"{what} into a non-zero base")


def _accumulates_into(node: torch.fx.Node, base: Any, state: State) -> bool:
    """An in-place scatter-add of sliced values into a replicated tensor nothing else reads: every chunk
    adds its part into the same tensor, which holds the full result after the last chunk
    (``Partial("inplace")``: no combine, and no op in the region may read it)."""
    return packet_name(node).endswith("_") and isinstance(state, Replicated) and len(base.users) == 1


