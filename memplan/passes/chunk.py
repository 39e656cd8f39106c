"""chunk: run a region whose huge intermediate is reduced or sliced away in chunks, one after another.

What it does
------------
Some regions hold a huge intermediate only because a dimension that stays independent through the
region (a batch, the ``i`` of a pairwise similarity, the time steps of a generator) is processed all
at once. This pass splits such a region along that dimension into chunks run in sequence, combines
the partial results (concatenate, sum, length-weighted mean, log-sum-exp, max, NLL mean weighted by
the chunk's total weight), and runs the region's backward chunk by chunk too, recomputing each
chunk's forward values instead of saving them (Rabe & Staats 2021; KeOps; ``vmap(chunk_size=)``;
OpenNMT-py generator shards).

The dimension is found from the graph: every op has a *chunk rule* (:func:`chunk_rule`) saying,
given which input carries the index (``Split(dim, inner)``: the outer factor of ``dim``), which
dimension of its output carries it, or that its output is a *partial* result of the chunk
(``Partial``: a sum, a mean, a log-sum-exp, ...), or that it mixes the index (a ``Barrier``: a softmax
over it, a slice along it, a random op).

Stages
------
(1) Seeds. For the largest forward tensors and each of their dimensions, walk the index back through
    ops that carry it to its *sources* (placeholders, or ops that create it, such as ``stack``); also
    every dimension of every user input. Each distinct source set is one candidate index.
(2) Forward flood. From the sources, propagate states forward with the chunk rules. Nodes that carry
    the index or hold a partial form the region ``R``; an op that needs another operand sliced
    (``x + y`` with both full-sized) slices it too, unless it is downstream of the region; a
    shape-only value (a ``zeros``, a broadcast ``expand``) is rebuilt chunk-sized instead; ops that
    mix the index, and everything after them, stay outside (so the region is convex).
(3) Backward analysis. The region's backward ``B`` (:func:`region_backward`: backward nodes with the
    region's autograd sequence numbers, plus the accumulations between them) is propagated the same
    way from the states of what it reads. Nodes that carry the index or a partial sum form the
    backward body; the rest is hoisted (runs once, outside the loop). A backward op that mixes the
    index makes its forward op a barrier, and stage (2) runs again without it.
(4) Recompute or save. Forward values the backward body reads are recomputed in the body (with their
    ancestors in ``R`` up to materialised values), except, in one candidate variant, small ones
    (integer indices, log-sum-exps) saved by the forward loop when that removes recomputation.
(5) Candidates and policy. For each of the best-ranked regions, each variant and a ladder of chunk
    counts, the transformed graph is built once, its peak simulated (re-walked per chunk count) and
    its extra compute estimated with a cost model (:class:`CostRates`: FLOPs, bytes moved, a fixed cost
    per op and per chunk); when the index is used up (chunks of one unit), the loop bodies are
    chunked again along a second index (nested chunking: the tokens of each sequence).
    ``ctx.policy.choose`` picks one candidate, or none (the unchunked graph is a candidate).
(6) Apply. The region becomes one forward loop node and one backward loop node (:class:`ChunkLoop`
    modules running fx bodies chunk by chunk); scatter-adds into a zero tensor (gradients of what
    every chunk reads, e.g. an embedding table) add into one accumulator owned by the loop. The old
    nodes are erased and the graph re-sorted stably. A loop node's fake value carries a scratch tensor
    the size of its body's own peak, so the peak simulation sees the memory a chunk uses and agrees
    with the ruler.

Preconditions
-------------
Static shapes; every op of a region has a chunk rule (unknown ops are barriers); the index has at
least 2 units; no random op is in a region, and no op writes in place into a value from outside
its loop body, except a scatter-add into a tensor nothing else reads (every chunk adds its part).

Soundness conditions (each with a counterexample that the rules refuse)
---------------------------------------------------------------------
* Every op in ``R`` treats the index independently. Counterexample: ``softmax(x, dim=i)`` over the
  chunked dim needs all of ``i`` at once; it is a barrier.
* Partial results flow only through linear ops before they are combined. Counterexample:
  ``exp(x.sum(i))`` on a chunk computes ``exp`` of a partial sum; ``exp`` is a barrier for partials.
* A reduction over the index has a combine and a backward that slices. Counterexample:
  ``x.max(dim=i)`` has a combine (max with argmax) but its backward scatters into all of ``i`` with
  global indices; it is a barrier (``amax`` too: its backward divides by a count over ``i``).
* Random ops are never chunked or recomputed. Counterexample: ``dropout`` drawn chunk by chunk draws
  other numbers than eager's single draw; it is a barrier.
* The region is convex (nothing outside it both reads it and feeds it). Counterexample:
  ``m = x.amax(i); z = x - m; w = z * x``: ``z`` reads the combined ``m``, and ``w`` would need ``z``
  sliced inside the loop that computes ``m``. The flood marks ``z`` downstream of the region, and ``w``.
* In-place writes inside a body go to values the body made, or to one accumulator nothing else reads.
  Counterexample: ``zeros.index_add_(...)`` with ``zeros`` created once outside the loop and also read
  by another op would see the other chunks' additions.
* Sums over chunks add in another order than eager's sums: results agree to float tolerance.

What it leaves to other passes
------------------------------
Rewriting a matmul whose broadcast or max makes its backward huge (``rewrite``, which should run
first); saving versus recomputing outside regions (``remat``); reusing buffers, e.g. the copy of a
gradient into its parameter's layout (``inplace``, ``arena``); ordering (``schedule``). It runs best
before passes that move forward nodes into the backward, since it finds a region's backward by
autograd sequence numbers.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import operator
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Union

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.graph import _BoxedCodeGen

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.liveness import Liveness
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, InputSpec, OutputSpec, Phase
from memplan.graphutil import is_random, mutated_args, packet_name
from memplan.pipeline import PassContext, PassResult, PassStats, register_pass
from memplan.policy import Candidate, Policy
from memplan.errors import InfeasibleBudgetError

__all__ = [
    "Split",
    "Partial",
    "Replicated",
    "REP",
    "chunk_rule",
    "RegionBackward",
    "region_backward",
    "ChunkRegion",
    "ChunkPlan",
    "ChunkLoop",
    "plan_chunk",
    "apply_chunk",
    "chunk",
    "stable_toposort",
    "copy_graph",
    "refresh_aliases",
    "fake_mode_of",
    "graph_cost",
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

#: Partial kinds that linear ops (views, add, scaling) carry through unchanged.
_LINEAR_PARTIALS = ("sum", "mean")


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
_VIEW_OPS = {"view", "_unsafe_view", "reshape"}
_FACTORY_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like"}
_NEW_FACTORIES = {"new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided"}
_FACTORIES = {"zeros", "ones", "empty", "full", "empty_strided", "scalar_tensor", "arange"}
_ZERO_PRODUCERS = {"zeros", "new_zeros", "zeros_like"}
_REDUCTION_KINDS = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min", "logsumexp": "lse", "max": "max", "min": "min"}
_EXTRA_POINTWISE = {"copy_", "copy", "masked_fill_", "where"}


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _shape(node: Any) -> tuple[int, ...]:
    value = _val(node)
    if isinstance(value, torch.Tensor):
        return tuple(int(s) for s in value.shape)
    return ()


def _is_tensor(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(_val(node), torch.Tensor)


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _is_pointwise(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or packet_name(node) in _EXTRA_POINTWISE


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes if _is_tensor(a)]


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
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


def _pointwise(node: torch.fx.Node, st: Callable[[Any], State], out_shape: tuple[int, ...]) -> RuleResult:
    rank = len(out_shape)
    tensors = _tensor_args(node)
    splits = [(a, st(a)) for a in tensors if isinstance(st(a), Split)]
    partials = [(a, st(a)) for a in tensors if isinstance(st(a), Partial)]
    if partials:
        return _linear_partial(node, st, splits, partials)
    dims = {(s.dim + rank - len(_shape(a)), s.inner) for a, s in splits}
    if len(dims) != 1:
        return Barrier("operands carry the index on different dimensions")
    (dim, inner), = dims
    for a in tensors:
        if isinstance(st(a), Replicated):
            aligned = dim - (rank - len(_shape(a)))
            if aligned >= 0 and _shape(a)[aligned] != 1:
                return Need(a, Split(aligned, inner))
    return Split(dim, inner)


def _linear_partial(node: torch.fx.Node, st, splits, partials) -> RuleResult:
    """Partial sums and means pass through linear ops: add/sub of partials, scaling by a replicated value."""
    if splits:
        return Barrier("mixes a partial result with a sliced value")
    kinds = {p.kind for _, p in partials}
    if len(kinds) != 1 or next(iter(kinds)) not in _LINEAR_PARTIALS:
        return Barrier("a partial result that only linear ops may touch")
    kind = next(iter(kinds))
    name = packet_name(node)
    tensors = _tensor_args(node)
    if name in ("add", "sub") and all(isinstance(st(a), Partial) for a in tensors):
        return Partial(kind)
    if name in ("mul", "neg") and len(partials) == 1:
        return Partial(kind)
    if name == "div" and len(partials) == 1 and partials[0][0] is node.args[0]:
        return Partial(kind)
    return Barrier(f"{name} is not linear in a partial result")


def _reduction(node: torch.fx.Node, st, name: str) -> RuleResult:
    """Reductions: over another dimension the index moves; over the chunked one the result is partial."""
    x = node.args[0]
    s = st(x)
    rank = len(_shape(x))
    overload = node.target._overloadname
    with_indices = name in ("max", "min") and overload == "dim"
    if name in ("sum", "mean", "max", "min") and overload == "default":
        dims, keepdim = list(range(rank)), False
    elif with_indices or name in ("argmax", "argmin"):
        dim = _arg(node, 1, "dim")
        dims = list(range(rank)) if dim is None else [_norm(dim, rank)]
        keepdim = bool(_arg(node, 2, "keepdim", False))
    else:
        dim = _arg(node, 1, "dim")
        dim = [] if dim is None else list(dim) if isinstance(dim, (list, tuple)) else [dim]
        dims = list(range(rank)) if not dim else [_norm(d, rank) for d in dim]
        keepdim = bool(_arg(node, 2, "keepdim", False))
    if isinstance(s, Partial):
        if s.kind in _LINEAR_PARTIALS and name in ("sum", "mean"):
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


def _matmul(node: torch.fx.Node, st, a: Any, b: Any, batched: bool) -> RuleResult:
    """``mm`` (rows of a, columns of b, contraction) and ``bmm`` (plus a shared batch dimension)."""
    sa, sb = st(a), st(b)
    off = 1 if batched else 0
    if isinstance(sa, Partial) or isinstance(sb, Partial):
        if isinstance(sa, Split) or isinstance(sb, Split):
            return Barrier("matmul of a partial and a sliced value")
        kinds = {s.kind for s in (sa, sb) if isinstance(s, Partial)}
        if len(kinds) == 1 and isinstance(sa, Partial) != isinstance(sb, Partial) and kinds <= set(_LINEAR_PARTIALS):
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
    if not isinstance(out, Split) or not _is_tensor(other):
        return out
    s = st(other)
    aligned = out.dim - (out_rank - len(_shape(other)))
    if isinstance(s, Split):
        return out if s.dim == aligned and s.inner == out.inner else Barrier("bias carries the index elsewhere")
    if isinstance(s, Partial):
        return Barrier("partial bias")
    if aligned >= 0 and _shape(other)[aligned] != 1:
        return Need(other, Split(aligned, out.inner))
    return out


def _same_dim_all(node: torch.fx.Node, st, tensors: Sequence[Any], forbidden: int | None, rank_of) -> RuleResult:
    """All tensor operands carry the index on the same dimension, which must not be ``forbidden``."""
    states = [(t, st(t)) for t in tensors if _is_tensor(t)]
    if any(isinstance(s, Partial) for _, s in states):
        return Barrier("partial operand")
    splits = {s for _, s in states if isinstance(s, Split)}
    if len(splits) != 1:
        return Barrier("operands carry the index on different dimensions")
    (s,) = splits
    if forbidden is not None and s.dim == forbidden:
        return Barrier("the op works along the chunked dimension")
    for t, ts in states:
        if isinstance(ts, Replicated) and _shape(t) and len(_shape(t)) > s.dim and _shape(t)[s.dim] != 1:
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
    tensors = _tensor_args(node)
    in_states = [state(a) for a in tensors]
    name = packet_name(node)
    if name in _NEW_FACTORIES or name in _FACTORIES:
        return REP  # shape-only: relabelled on demand (see Need handling)
    if all(isinstance(s, Replicated) for s in in_states):
        return REP
    if is_random(node):
        return Barrier("random op")
    value = node.meta.get("val")
    out_shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
    x = node.args[0] if node.args else None
    sx = state(x)

    if name in _IDENTITY_OPS:
        return sx if _shape(x) == out_shape or isinstance(sx, Replicated) else Barrier("shape changes")
    if name in _FACTORY_LIKE:
        return sx if isinstance(sx, Split) else REP
    if name in _VIEW_OPS:
        if isinstance(sx, Partial):
            return sx if sx.kind in _LINEAR_PARTIALS else Barrier("view of a partial")
        mapped = map_view(_shape(x), out_shape, sx)
        return mapped if mapped is not None else Barrier("the view splits the chunked dimension")
    if name == "expand":
        if isinstance(sx, Partial):
            return sx if sx.kind in _LINEAR_PARTIALS else Barrier("expand of a partial")
        return Split(sx.dim + len(out_shape) - len(_shape(x)), sx.inner)
    if name in ("permute", "transpose", "t", "unsqueeze", "squeeze", "select", "slice", "narrow", "diagonal"):
        return _layout_rule(node, name, sx, _shape(x), out_shape)
    if name in ("split", "split_with_sizes", "unbind", "chunk", "unsafe_split", "unsafe_chunk", "unsafe_split_with_sizes"):
        if not isinstance(sx, Split):
            return Barrier("split of a partial")
        dim = _norm(_arg(node, 2 if name != "unbind" else 1, "dim", 0), len(_shape(x)))
        if dim == sx.dim:
            return Barrier("split along the chunked dimension")
        new = Split(sx.dim - (1 if name == "unbind" and dim < sx.dim else 0), sx.inner)
        return tuple(new for _ in value)
    if name == "cat":
        seq = [t for t in node.args[0] if _is_tensor(t)]
        rank = len(out_shape)
        return _same_dim_all(node, state, seq, _norm(_arg(node, 1, "dim", 0), rank), None)
    if name == "stack":
        seq = [t for t in node.args[0] if _is_tensor(t)]
        dim = _norm(_arg(node, 1, "dim", 0), len(out_shape))
        inner = _same_dim_all(node, state, seq, None, None)
        if not isinstance(inner, Split):
            return inner
        return Split(inner.dim + (1 if dim <= inner.dim else 0), inner.inner)
    if name in _REDUCTION_KINDS or name in ("max", "min", "argmax", "argmin"):
        return _reduction(node, state, name)
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
        return sx if _norm(node.args[1], len(out_shape)) != sx.dim else Barrier("softmax along the chunked dimension")
    if name in ("_softmax_backward_data", "_log_softmax_backward_data"):
        return _same_dim_all(node, state, node.args[:2], _norm(node.args[2], len(out_shape)), None)
    if name == "native_layer_norm":
        normalized = len(node.args[1])
        if not isinstance(sx, Split) or sx.dim >= len(_shape(x)) - normalized:
            return Barrier("layer norm over the chunked dimension")
        if any(isinstance(state(a), (Split, Partial)) for a in node.args[2:4]):
            return Barrier("sliced layer-norm weights")
        return (sx, sx, sx)
    if name == "native_layer_norm_backward":
        normalized = len(node.args[2])
        split = _same_dim_all(node, state, [node.args[0], node.args[1], node.args[3], node.args[4]], None, None)
        if not isinstance(split, Split) or split.dim >= len(_shape(node.args[1])) - normalized:
            return split if not isinstance(split, Split) else Barrier("layer norm over the chunked dimension")
        return (split, Partial("sum"), Partial("sum"))
    if name == "nll_loss_forward":
        split = _same_dim_all(node, state, [node.args[0], node.args[1]], None, None)
        if not isinstance(split, Split):
            return split
        if split.dim != 0 or len(_shape(node.args[0])) != 2 or isinstance(state(node.args[2]), (Split, Partial)):
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
        return Partial("sum") if not _arg(node, 4, "scale_grad_by_freq", False) else Barrier("scale_grad_by_freq")
    if name == "gather":
        dim = _norm(node.args[1], len(out_shape))
        return _same_dim_all(node, state, [node.args[0], node.args[2]], dim, None)
    if name in ("scatter", "scatter_add", "scatter_reduce"):
        dim = _norm(node.args[1], len(out_shape))
        return _same_dim_all(node, state, [a for a in (node.args[0], node.args[2], node.args[3] if len(node.args) > 3 else None) if a is not None], dim, None)
    if name in ("index_add", "index_add_"):
        return _index_add(node, state, is_zero)
    if name == "index":
        return _index(node, state, out_shape)
    if name in ("index_put", "_index_put_impl_"):
        return _index_put(node, state, is_zero)
    if name == "slice_backward":
        g = state(node.args[0])
        if isinstance(g, Split) and _norm(node.args[2], len(out_shape)) != g.dim:
            return g
        return Barrier("slice_backward along the chunked dimension") if isinstance(g, Split) else Barrier("partial")
    if name == "select_backward":
        g = state(node.args[0])
        if not isinstance(g, Split):
            return Barrier("partial")
        dim = _norm(node.args[2], len(out_shape))
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
    if _is_pointwise(node):
        if not out_shape and not isinstance(value, torch.Tensor):
            return Barrier("pointwise op without a tensor value")
        return _pointwise(node, state, out_shape)
    return Barrier(f"no chunk rule for {name or node.target}")


def _layout_rule(node: torch.fx.Node, name: str, sx: State, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> RuleResult:
    if isinstance(sx, Partial):
        if sx.kind in _LINEAR_PARTIALS and name in ("permute", "transpose", "t", "unsqueeze", "squeeze"):
            return sx
        return Barrier(f"{name} of a partial")
    d, inner = sx.dim, sx.inner
    rank_in, rank_out = len(in_shape), len(out_shape)
    if name == "permute":
        dims = [_norm(p, rank_in) for p in node.args[1]]
        return Split(dims.index(d), inner)
    if name in ("transpose", "t"):
        a, b = (0, 1) if name == "t" else (_norm(node.args[1], rank_in), _norm(node.args[2], rank_in))
        if rank_in < 2:
            return sx
        return Split(b if d == a else a if d == b else d, inner)
    if name == "unsqueeze":
        k = _norm(node.args[1], rank_out)
        return Split(d + (1 if k <= d else 0), inner)
    if name == "squeeze":
        dims = _arg(node, 1, "dim")
        if dims is None:
            removed = [i for i, s in enumerate(in_shape) if s == 1]
        else:
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
            removed = [_norm(i, rank_in) for i in dims if in_shape[_norm(i, rank_in)] == 1]
        return Split(d - sum(1 for i in removed if i < d), inner)
    if name == "select":
        dim = _norm(node.args[1], rank_in)
        return Barrier("select along the chunked dimension") if dim == d else Split(d - (1 if dim < d else 0), inner)
    if name in ("slice", "narrow"):
        dim = _norm(_arg(node, 1, "dim", 0), rank_in)
        if dim != d:
            return sx
        if in_shape == out_shape and (name == "narrow" or _arg(node, 4, "step", 1) == 1):
            return sx  # a full slice
        return Barrier("slice along the chunked dimension")
    return Barrier(f"{name} of the chunked dimension")


def _index_add(node: torch.fx.Node, st, is_zero) -> RuleResult:
    base, dim, index, source = node.args[0], node.args[1], node.args[2], node.args[3]
    rank = len(_shape(base))
    dim = _norm(dim, rank)
    sb, si, ss = st(base), st(index), st(source)
    if isinstance(ss, Split) and ss.dim == dim and isinstance(si, Split) and si.dim == 0 and si.inner == ss.inner:
        if isinstance(sb, Replicated) and is_zero(base):
            return Partial("sum")
        if isinstance(sb, Partial) and sb.kind == "sum":
            return Partial("sum")
        if _accumulates_into(node, base, sb):
            return Partial("inplace")
        return Barrier("index_add of sliced rows into a non-zero base")
    if isinstance(si, Replicated):
        return _same_dim_all(node, st, [base, source], dim, None)
    return Barrier("index_add along the chunked dimension")


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
        idx_rank = len(_shape(idx))
        return Split(sb.dim if sb.dim < p else sb.dim - 1 + idx_rank, sb.inner)
    return Barrier("indexing along the chunked dimension")


def _index_put(node: torch.fx.Node, st, is_zero) -> RuleResult:
    base, indices, values = node.args[0], node.args[1], node.args[2]
    accumulate = bool(_arg(node, 3, "accumulate", False))
    real = [i for i in indices if i is not None]
    if len(real) != 1 or not accumulate or indices[0] is None:
        return Barrier("index_put other than an accumulation at dim 0")
    si, sv, sb = st(real[0]), st(values), st(base)
    if isinstance(si, Split) and isinstance(sv, Split) and si.dim == sv.dim == 0 and si.inner == sv.inner:
        if isinstance(sb, Replicated) and is_zero(base) or isinstance(sb, Partial) and sb.kind == "sum":
            return Partial("sum")
        if _accumulates_into(node, base, sb):
            return Partial("inplace")
    return Barrier("index_put of sliced values into a non-zero base")


def _accumulates_into(node: torch.fx.Node, base: Any, state: State) -> bool:
    """An in-place scatter-add of sliced values into a replicated tensor nothing else reads: every chunk
    adds its part into the same tensor, which holds the full result after the last chunk
    (``Partial("inplace")``: no combine, and no op in the region may read it)."""
    return packet_name(node).endswith("_") and isinstance(state, Replicated) and len(base.users) == 1


# ----------------------------------------------------------------------------------------------
# small graph helpers shared with the rewrite pass


_ALIAS_OPS = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze",
              "select", "slice", "narrow", "alias", "detach", "as_strided", "diagonal", "unbind", "split",
              "split_with_sizes", "chunk", "unfold", "view_as", "_reshape_alias", "lift_fresh"}


def _owned_by(node: torch.fx.Node, members: set[torch.fx.Node]) -> bool:
    """``node`` is a value created inside ``members`` (following views back to a non-view op)."""
    while node in members:
        if packet_name(node) in _ALIAS_OPS or node.target is operator.getitem and packet_name(node.args[0]) in _ALIAS_OPS:
            node = node.args[0]
            continue
        return True
    return False


def stable_toposort(graph: torch.fx.Graph, priority: Mapping[torch.fx.Node, float]) -> None:
    """Reorder ``graph`` topologically, keeping nodes in ``priority`` order wherever dependencies allow.

    Raises ``ValueError`` when the graph has a cycle.
    """
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    output = next(n for n in graph.nodes if n.op == "output")
    position = {n: i for i, n in enumerate(graph.nodes)}
    members = set(nodes)
    indegree = {n: sum(1 for a in set(n.all_input_nodes) if a in members) for n in nodes}
    ready = [(priority.get(n, position[n]), position[n], n.name, n) for n in nodes if indegree[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, node = heapq.heappop(ready)
        order.append(node)
        for user in set(node.users):
            if user in members:
                indegree[user] -= 1
                if indegree[user] == 0:
                    heapq.heappush(ready, (priority.get(user, position[user]), position[user], user.name, user))
    if len(order) != len(nodes):
        raise ValueError("the edited graph has a cycle")
    for node in order:
        output.prepend(node)


def copy_graph(graph: CapturedGraph, compile: bool = True) -> CapturedGraph:
    """A copy of ``graph`` with a fresh fx graph (same node names, shallow ``meta``, shared submodules).

    With ``compile=False`` the module's code is not generated (for graphs that are only analysed);
    :func:`finish_module` generates it later.
    """
    new = torch.fx.Graph()
    value_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = new.graph_copy(graph.gm.graph, value_map)
    new.output(out)
    new.set_codegen(graph.gm.graph._codegen)  # loop bodies use boxed calling
    return dataclasses.replace(graph, gm=_graph_module(graph.gm, new, type(graph.gm).__name__, compile))


def _graph_module(root: torch.nn.Module, graph: torch.fx.Graph, class_name: str, compile: bool) -> torch.fx.GraphModule:
    if compile:
        return torch.fx.GraphModule(root, graph, class_name=class_name)
    gm = torch.fx.GraphModule(root, torch.fx.Graph(), class_name=class_name)
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr") and not hasattr(gm, node.target):
            setattr(gm, node.target, getattr(root, node.target))
    gm._graph = graph  # code is generated by finish_module
    return gm


def finish_module(gm: torch.fx.GraphModule) -> None:
    """Generate the code of a module built with ``compile=False`` (and of its loop bodies)."""
    gm.recompile()
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule) and module is not gm:
            module.recompile()


def fake_mode_of(graph: torch.fx.Graph):
    for node in graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            mode = getattr(value, "fake_mode", None)
            if mode is not None:
                return mode
    raise ValueError("the graph has no fake values")


def _fake_call(target: Callable[..., Any], args: tuple, kwargs: dict, mode) -> Any:
    def to_val(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    with mode:
        return target(*pytree.tree_map(to_val, args), **pytree.tree_map(to_val, kwargs))


# ----------------------------------------------------------------------------------------------
# a region's backward


@dataclasses.dataclass(frozen=True)
class RegionBackward:
    """The backward of a forward region: its nodes, the gradients it reads, the values it hands on.

    ``nodes`` are the backward nodes whose sequence number is one of the region's, plus the
    accumulations that lie between them; ``grad_inputs`` are backward values (or tangents) they read
    from outside; ``grad_outputs`` are those of ``nodes`` read by something else.
    """

    nodes: tuple[str, ...]
    grad_inputs: tuple[str, ...]
    grad_outputs: tuple[str, ...]


def region_backward(graph: CapturedGraph, region: Iterable[str]) -> RegionBackward | None:
    """Find the backward of ``region`` by autograd sequence numbers and dataflow; None when ambiguous.

    Backward nodes carry the sequence number of the forward op whose derivative they compute. Two
    things blur that: gradient accumulations (``add`` of two backward values) carry a stale number, and
    forward ops that need no gradient share the number of the op before them. So the backward is
    grown from the nodes whose number belongs to the region alone: accumulations join when they lie
    between two of its nodes, nodes with a shared number when they are next to one; a node with a
    shared number that joins nothing makes the answer ambiguous.

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> g = capture(lambda x: (x * 2).exp(), torch.randn(3, requires_grad=True))
    >>> exp = next(n.name for n in g.gm.graph.nodes if n.name.startswith("exp"))
    >>> rb = region_backward(g, [exp]); len(rb.nodes) >= 1, len(rb.grad_outputs)
    (True, 1)
    """
    region = set(region)
    if not graph.training:
        return RegionBackward((), (), ())
    # autograd's own aliases of a region value (the ``detach`` made to save it) belong to the region
    for node in graph.gm.graph.nodes:
        if node.target is torch.ops.aten.detach.default and node.args[0].name in region:
            if graph.phases.get(node.name) is Phase.FORWARD:
                region.add(node.name)
    seqs = {graph.seq_nr[n] for n in region if n in graph.seq_nr}
    shared = set()
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and graph.phases.get(node.name) is Phase.FORWARD and node.name not in region:
            if graph.seq_nr.get(node.name) in seqs:
                shared.add(graph.seq_nr[node.name])
    backward = [n for n in graph.gm.graph.nodes if n.op == "call_function" and graph.phases.get(n.name) is Phase.BACKWARD]

    def accumulation(node: torch.fx.Node) -> bool:
        return node.target is torch.ops.aten.add.Tensor and all(
            graph.phases.get(a.name) is not Phase.FORWARD for a in node.all_input_nodes
        )

    members = {n for n in backward if graph.seq_nr.get(n.name) in seqs - shared and not accumulation(n)}
    pending_shared = {n for n in backward if graph.seq_nr.get(n.name) in shared and not accumulation(n)}
    glue = {n for n in backward if accumulation(n) and n not in members}
    changed = True
    while changed:
        changed = False
        below = _reach(members, lambda n: n.users, graph)
        above = _reach(members, lambda n: n.all_input_nodes, graph)
        for node in sorted(glue | pending_shared, key=lambda n: n.name):
            between = node in below and node in above
            adjacent = node in pending_shared and (
                any(a in members for a in node.all_input_nodes) or any(u in members for u in node.users)
            )
            if between or adjacent:
                members.add(node)
                glue.discard(node)
                pending_shared.discard(node)
                changed = True
    if pending_shared:
        return None
    ordered = [n for n in backward if n in members]
    tangents = {s.node for s in graph.inputs if s.kind == "tangent"}
    grad_inputs, grad_outputs = [], []
    for node in ordered:
        for arg in node.all_input_nodes:
            if arg in members or arg.name in grad_inputs:
                continue
            if graph.phases.get(arg.name) is Phase.BACKWARD or arg.name in tangents:
                grad_inputs.append(arg.name)
        if any(u not in members for u in node.users):
            grad_outputs.append(node.name)
    return RegionBackward(tuple(n.name for n in ordered), tuple(grad_inputs), tuple(grad_outputs))


def _reach(start: set[torch.fx.Node], step, graph: CapturedGraph) -> set[torch.fx.Node]:
    """Backward nodes reachable from ``start`` (excluded) by ``step``."""
    seen: set[torch.fx.Node] = set()
    stack = list(start)
    while stack:
        for nxt in step(stack.pop()):
            if nxt not in seen and graph.phases.get(nxt.name) is Phase.BACKWARD:
                seen.add(nxt)
                stack.append(nxt)
    return seen


# ----------------------------------------------------------------------------------------------
# propagation

_MAX_RESTARTS = 64
_RELABEL_FACTORIES = {"new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones", "empty", "full"}


def _relabelable(node: torch.fx.Node, state: Split, st: Callable[[Any], State]) -> bool:
    """A shape-only value that can be built chunk-sized directly: a factory, or a broadcast of a
    replicated value along the chunked dimension."""
    name = packet_name(node)
    if name in _RELABEL_FACTORIES:
        return True
    if name == "expand":
        src = node.args[0]
        if not isinstance(st(src), Replicated):
            return False
        out_rank, in_shape = len(_shape(node)), _shape(src)
        aligned = state.dim - (out_rank - len(in_shape))
        return aligned < 0 or in_shape[aligned] == 1
    return False


def _is_zero_factory(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    name = packet_name(node)
    if name in _ZERO_PRODUCERS:
        return True
    if name in ("full", "new_full"):
        return _arg(node, 1 if name == "full" else 2, "fill_value", None) == 0
    return False


@dataclasses.dataclass
class _Flood:
    states: dict[torch.fx.Node, State]
    slices: dict[torch.fx.Node, Split]
    relabel: dict[torch.fx.Node, Split]
    tainted: set[torch.fx.Node]
    failed: torch.fx.Node | None = None


def _flood_forward(order: Sequence[torch.fx.Node], seeds: Mapping[torch.fx.Node, Split], barriers: set[str]) -> _Flood:
    """Propagate chunk states forward from the sliced ``seeds`` (stage 2)."""
    slices = dict(seeds)
    relabel: dict[torch.fx.Node, Split] = {}
    pulled: set[torch.fx.Node] = set()  # shape-only values the region writes in place: made per chunk
    for _ in range(_MAX_RESTARTS):
        states: dict[torch.fx.Node, State] = {}
        tainted: set[torch.fx.Node] = set()

        def st(x: Any) -> State:
            if x in slices:
                return slices[x]
            return states.get(x, REP)

        restart = False
        for node in order:
            if node in slices:
                continue
            if node in relabel:
                states[node] = relabel[node]
                continue
            if node in pulled:
                states[node] = REP
                continue
            inputs = node.all_input_nodes
            if any(a in tainted for a in inputs):
                tainted.add(node)
                continue
            if not any(a in states or a in slices for a in inputs):
                continue
            foreign = [m for m in mutated_args(node) if not _owned_by(m, set(states))]
            if foreign and all(packet_name(m) in _RELABEL_FACTORIES and m not in pulled for m in foreign):
                pulled.update(foreign)
                restart = True
                break
            result = chunk_rule(node, st, _is_zero_factory)
            if node.name in barriers or foreign and result != Partial("inplace"):
                tainted.add(node)
                continue
            if isinstance(result, Need):
                target = result.node
                if target in tainted or target in slices:
                    tainted.add(node)
                    continue
                if target in states:
                    if isinstance(states[target], Replicated) and _relabelable(target, result.state, st):
                        relabel[target] = result.state
                        restart = True
                        break
                    tainted.add(node)
                    continue
                if _relabelable(target, result.state, st):
                    relabel[target] = result.state
                else:
                    slices[target] = result.state
                restart = True
                break
            if isinstance(result, Barrier):
                tainted.add(node)
                continue
            states[node] = result
        if not restart:
            return _Flood(states, slices, relabel, tainted)
    return _Flood({}, slices, relabel, set())


def _flood_backward(order: Sequence[torch.fx.Node], fixed: Mapping[torch.fx.Node, State]) -> _Flood:
    """Propagate chunk states through a region's backward from what it reads (stage 3)."""
    slices: dict[torch.fx.Node, Split] = {}
    relabel: dict[torch.fx.Node, Split] = {}
    members = set(order)
    for _ in range(_MAX_RESTARTS):
        states: dict[torch.fx.Node, State] = {}

        def st(x: Any) -> State:
            if x in slices:
                return slices[x]
            if x in states:
                return states[x]
            return fixed.get(x, REP)

        restart = False
        for node in order:
            if node in relabel:
                states[node] = relabel[node]
                continue
            mutated = mutated_args(node)
            result = chunk_rule(node, st, _is_zero_factory)
            if any(m in slices or not _owned_by(m, members) and result != Partial("inplace") for m in mutated):
                return _Flood(states, slices, relabel, set(), failed=node)
            if isinstance(result, Need):
                target, want = result.node, result.state
                if target in slices:
                    return _Flood(states, slices, relabel, set(), failed=node)
                if target in states:
                    if _relabelable(target, want, st):
                        relabel[target] = want
                    elif isinstance(states[target], Replicated):
                        slices[target] = want  # hoisted, materialised, read in slices
                    else:
                        return _Flood(states, slices, relabel, set(), failed=node)
                elif isinstance(fixed.get(target, REP), Replicated):
                    slices[target] = want
                else:
                    return _Flood(states, slices, relabel, set(), failed=node)
                restart = True
                break
            if isinstance(result, Barrier):
                return _Flood(states, slices, relabel, set(), failed=node)
            states[node] = result
        if not restart:
            return _Flood(states, slices, relabel, set())
    return _Flood({}, slices, relabel, set(), failed=order[0] if order else None)


def _combined(state: State) -> State:
    """How the backward sees a forward value: partial results are read combined (replicated)."""
    if isinstance(state, tuple):
        return tuple(_combined(s) for s in state)
    return REP if isinstance(state, Partial) else state


def _carries(state: State) -> bool:
    if isinstance(state, tuple):
        return any(_carries(s) for s in state)
    return isinstance(state, (Split, Partial))


# ----------------------------------------------------------------------------------------------
# the plan


def _state_str(state: State) -> str:
    if isinstance(state, tuple):
        return "(" + ", ".join(_state_str(s) for s in state) + ")"
    return str(state)


@dataclasses.dataclass(frozen=True)
class ChunkRegion:
    """One region to run in chunks: what is in it, how each value is split, what the loops exchange.

    All nodes are named; ``forward``/``backward`` list the nodes of the two loop bodies with their
    states, in graph order. ``chunk`` is the number of index units per chunk (the last chunk may be
    shorter) and ``saved`` the small forward values kept for the backward instead of recomputed.
    """

    label: str
    units: int
    chunk: int
    forward: tuple[tuple[str, State], ...]
    sources: tuple[tuple[str, Split], ...]
    outputs: tuple[str, ...]
    saved: tuple[str, ...]
    backward: tuple[tuple[str, State], ...]
    recompute: tuple[str, ...]
    backward_slices: tuple[tuple[str, Split], ...]
    backward_outputs: tuple[str, ...]
    relabelled: tuple[str, ...]
    inner: tuple[tuple[str, int, "ChunkPlan"], ...] = ()  # (loop, body length, plan) chunking a body again

    @property
    def chunks(self) -> int:
        return -(-self.units // self.chunk)

    def __str__(self) -> str:
        nested = "".join(f"; {loop} body: {r}" for loop, _, plan in self.inner[:2] for r in plan.regions[:1])
        return (
            f"chunk {self.label}: {self.units} units in {self.chunks} chunks of {self.chunk}, "
            f"{len(self.forward)} forward ops, {len(self.backward)} backward ops, "
            f"{len(self.recompute)} recomputed, {len(self.saved)} saved" + nested
        )


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The regions a run of the pass chunks, in the order they are applied."""

    regions: tuple[ChunkRegion, ...] = ()

    def __str__(self) -> str:
        return "\n".join(str(r) for r in self.regions) if self.regions else "chunk: nothing to do"


def _analyse(graph: CapturedGraph, seeds: Mapping[str, Split], label: str) -> ChunkRegion | None:
    """Stages 2-4 for one candidate index: the region, its backward body, what to recompute."""
    gm = graph.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    seed_nodes = {by_name[k]: v for k, v in seeds.items()}
    units = {(_shape(n)[s.dim] // s.inner) for n, s in seed_nodes.items()}
    if len(units) != 1 or next(iter(units)) < 2:
        return None
    (n_units,) = units
    forward_order = [n for n in gm.graph.nodes if n.op == "call_function" and graph.phases.get(n.name) is Phase.FORWARD]
    barriers: set[str] = set()
    for _ in range(16):
        # Step 2: the forward flood from the sliced sources.
        flood = _flood_forward(forward_order, seed_nodes, barriers)
        region = [n for n in forward_order if n in flood.states]
        if not any(_carries(flood.states[n]) for n in region):
            return None
        if any(_shape(n)[s.dim] != n_units * s.inner for n, s in flood.slices.items()):
            return None
        rb = region_backward(graph, [n.name for n in region])
        if rb is None:
            return None
        # Step 3: the region's backward, from the states of the values it reads.
        border = [by_name[x] for x in rb.nodes]
        fixed: dict[torch.fx.Node, State] = {n: _combined(flood.states[n]) for n in region}
        fixed.update(flood.slices)
        back = _flood_backward(border, fixed)
        if back.failed is not None:
            seq = graph.seq_nr.get(back.failed.name)
            culprits = {n.name for n in region if graph.seq_nr.get(n.name) == seq}
            if not culprits or culprits <= barriers:
                return None
            barriers |= culprits
            continue
        return _finish_region(graph, label, n_units, region, flood, border, back)
    return None


def _finish_region(graph, label, n_units, region, flood: _Flood, border, back: _Flood) -> ChunkRegion | None:
    region_set = set(region)
    # the backward body: nodes carrying the index or a partial, and shape-only nodes that read them
    body: list[torch.fx.Node] = []
    body_set: set[torch.fx.Node] = set()
    for node in border:
        state = back.states[node]
        if _carries(state) or node in back.relabel or any(a in body_set for a in node.all_input_nodes):
            body.append(node)
            body_set.add(node)
    # a value the body writes in place is created in the body, once per chunk
    pulled = True
    while pulled:
        pulled = False
        for node in list(body):
            for target in mutated_args(node):
                chain = [target]
                while packet_name(chain[-1]) in _ALIAS_OPS and chain[-1].args:
                    chain.append(chain[-1].args[0])
                for member in chain:
                    if member in set(border) and member not in body_set:
                        body_set.add(member)
                        pulled = True
        body = [n for n in border if n in body_set]
    hoisted = [n for n in border if n not in body_set]
    # a hoisted node that the body reads must not depend on the body
    downstream: set[torch.fx.Node] = set()
    for node in hoisted:
        if any(a in body_set or a in downstream for a in node.all_input_nodes):
            downstream.add(node)
    if any(a in downstream for n in body for a in n.all_input_nodes):
        return None
    relabelled_out = {n for n in flood.relabel if not any(a in region_set for a in n.all_input_nodes)}
    outputs = []
    for node in region:
        if node in relabelled_out:
            continue
        outside = [u for u in node.users if u not in region_set and u not in body_set]
        partial_read = isinstance(flood.states[node], Partial) and any(u in body_set for u in node.users)
        if outside or partial_read:
            if isinstance(flood.states[node], tuple):
                return None  # a tuple value read outside: only its items may leave the loop
            outputs.append(node)
    backward_outputs = [n for n in body if any(u not in body_set for u in n.users)]
    # Step 4: what the backward body recomputes (the save-small variant is made by _with_saved).
    recompute = _recompute_closure(region, region_set, set(outputs), body)
    forward_states = tuple((n.name, flood.states[n]) for n in region)
    return ChunkRegion(
        label=label,
        units=n_units,
        chunk=n_units,
        forward=forward_states,
        sources=tuple(sorted(((n.name, s) for n, s in flood.slices.items()), key=lambda p: p[0])),
        outputs=tuple(n.name for n in outputs),
        saved=(),
        backward=tuple((n.name, back.states[n]) for n in body),
        recompute=tuple(n.name for n in recompute),
        backward_slices=tuple(sorted(((n.name, s) for n, s in back.slices.items()), key=lambda p: p[0])),
        backward_outputs=tuple(n.name for n in backward_outputs),
        relabelled=tuple(sorted(n.name for n in relabelled_out)),
    )


def _recompute_closure(region, region_set, materialised, body) -> list[torch.fx.Node]:
    """Forward values of the region the backward body reads, with their ancestors in the region, up to
    values the forward loop materialises."""
    needed: set[torch.fx.Node] = set()
    stack = [a for n in body for a in n.all_input_nodes if a in region_set and a not in materialised]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        stack.extend(a for a in node.all_input_nodes if a in region_set and a not in materialised)
    return [n for n in region if n in needed]


def _with_saved(graph: CapturedGraph, region: ChunkRegion, fraction: float) -> ChunkRegion | None:
    """A variant that saves the small values the backward body reads when that removes recomputation."""
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    forward = [by_name[name] for name, _ in region.forward]
    states = dict(region.forward)
    region_set = set(forward)
    body = [by_name[name] for name, _ in region.backward]
    largest = max((_bytes(n) for n in forward), default=0)
    outputs = {by_name[o] for o in region.outputs}
    direct = {a for n in body for a in n.all_input_nodes if a in region_set and a not in outputs}
    small = {
        a for a in direct
        if isinstance(states[a.name], Split) and _bytes(a) <= fraction * largest and packet_name(a) not in _ALIAS_OPS
    }  # views cost nothing to recompute, and saving one would copy it
    if not small:
        return None
    recompute = set(_recompute_closure(forward, region_set, outputs | small, body))
    # a small value whose producer is recomputed anyway costs nothing to recompute
    small = {s for s in small if not all(a in recompute or a not in region_set for a in s.all_input_nodes)}
    if not small:
        return None
    recompute_list = _recompute_closure(forward, region_set, outputs | small, body)
    if len(recompute_list) >= len(region.recompute):
        return None
    saved = tuple(n.name for n in forward if n in small)
    return dataclasses.replace(region, saved=saved, recompute=tuple(n.name for n in recompute_list))


def _bytes(node: torch.fx.Node) -> int:
    total = 0
    for value in pytree.tree_leaves(node.meta.get("val")):
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


# ----------------------------------------------------------------------------------------------
# loop bodies and the loop module

_SIZE_ARG = {"view": 1, "_unsafe_view": 1, "reshape": 1, "expand": 1, "new_zeros": 1, "new_ones": 1, "new_empty": 1,
             "new_full": 1, "new_empty_strided": 1, "zeros": 0, "ones": 0, "empty": 0, "full": 0, "empty_strided": 0,
             "slice_backward": 1, "select_backward": 1}


def _restride(shape: Sequence[int], stride: Sequence[int], new_shape: Sequence[int]) -> list[int]:
    """Dense strides for ``new_shape`` with the dimension order that ``stride`` has for ``shape``."""
    order = sorted(range(len(shape)), key=lambda i: (-stride[i], -i))
    out = [0] * len(shape)
    step = 1
    for i in reversed(order):
        out[i] = step
        step *= max(new_shape[i], 1)
    return out


def _chunk_args(node: torch.fx.Node, state: State, units: int) -> tuple[tuple, dict]:
    """``node``'s arguments for a chunk of ``units`` units: size arguments shrink on the split dimension."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if not isinstance(state, Split):
        return tuple(args), kwargs
    name = packet_name(node)
    d, length = state.dim, units * state.inner
    if name in _SIZE_ARG:
        i = _SIZE_ARG[name]
        sizes = list(args[i]) if i < len(args) else list(kwargs["size"])
        full = list(sizes)
        if sizes[d] != -1:
            sizes[d] = length
        if i < len(args):
            args[i] = sizes
        else:
            kwargs["size"] = sizes
        if name in ("new_empty_strided", "empty_strided"):
            args[i + 1] = _restride(full, args[i + 1], sizes)
    elif name == "slice" and _norm(_arg(node, 1, "dim", 0), len(_shape(node.args[0]))) == d:
        if len(args) > 3:
            args[3] = sys.maxsize
    elif name == "narrow" and _norm(args[1], len(_shape(node.args[0]))) == d:
        args[3] = length
    return tuple(args), kwargs


def _narrow_fake(value: torch.Tensor, state: Split, units: int, mode) -> torch.Tensor:
    with mode:
        return value.narrow(state.dim, 0, units * state.inner)


def _build_body(
    nodes: Sequence[torch.fx.Node],
    inputs: Sequence[tuple[torch.fx.Node, State]],
    outputs: Sequence[tuple[torch.fx.Node, int | None]],
    states: Mapping[torch.fx.Node, State],
    units: int,
    mode,
    compile: bool = True,
    accumulators: Sequence[torch.fx.Node] = (),
) -> torch.fx.GraphModule:
    """An fx module computing ``outputs`` of one chunk of ``units`` units from chunk-sized ``inputs``.

    ``outputs`` are ``(node, index)`` pairs: ``index`` picks an item of a tuple value. The zero
    tensors in ``accumulators`` are not created per chunk: they are extra inputs (the loop's own
    accumulators) that the body adds into in place.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, (node, state) in enumerate(inputs):
        placeholder = graph.placeholder(f"{node.name}_in")
        value = node.meta["val"]
        placeholder.meta["val"] = _narrow_fake(value, state, units, mode) if isinstance(state, Split) else value
        env[node] = placeholder
    for node in accumulators:
        placeholder = graph.placeholder(f"{node.name}_acc")
        placeholder.meta["val"] = node.meta["val"]
        env[node] = placeholder
    for node in nodes:
        if node in env:
            continue
        if node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            env[node] = env[node.args[0]]  # no-ops outside autograd: one Python call less per chunk
            continue
        args, kwargs = _chunk_args(node, states.get(node, REP), units)
        args = torch.fx.node.map_arg(args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(kwargs, env.__getitem__)
        new = graph.call_function(node.target, args, kwargs, name=node.name)
        new.meta["val"] = _fake_call(node.target, args, kwargs, mode)
        env[node] = new
    results = []
    for node, index in outputs:
        value = env[node]
        if index is not None:
            item = graph.call_function(operator.getitem, (value, index))
            item.meta["val"] = value.meta["val"][index]
            value = item
        results.append(value)
    graph.output(tuple(results))
    graph.set_codegen(_BoxedCodeGen())
    return _graph_module(torch.nn.Module(), graph, "ChunkBody", compile)


@dataclasses.dataclass(frozen=True)
class LoopInput:
    """How the loop hands an input to each chunk: a slice on ``dim`` (None: the whole tensor)."""

    dim: int | None = None
    inner: int = 1


@dataclasses.dataclass(frozen=True)
class LoopOutput:
    """How the chunks' values combine: ``"cat"`` on ``dim``, ``"sum"``, ``"mean"``, ``"lse"``, ``"max"``,
    ``"min"``, ``"nll_mean"`` (weighted by output ``partner``, a hidden sum), ``"first"``, or
    ``"inplace"`` (the bodies scatter-add into one zero accumulator the loop passes them)."""

    kind: str
    dim: int = 0
    inner: int = 1
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    partner: int = -1
    public: bool = True
    dtype: torch.dtype = torch.float32
    same_as: int = -1  # the body returns the same tensor as output ``same_as``: reuse its result
    steps: tuple = ()  # ``"inplace"``: the view ops from the accumulator to the output
    alias_of: int = -1  # the output is loop input ``alias_of``, added into in place by every chunk
    acc_shape: tuple[int, ...] = ()  # ``"inplace"``: the zero accumulator the body adds into


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    units: int
    chunk: int
    inputs: tuple[LoopInput, ...]
    outputs: tuple[LoopOutput, ...]
    scratch: int  # bytes a chunk's body needs at its peak

    @property
    def chunks(self) -> int:
        return -(-self.units // self.chunk)


def _overlaps(t: torch.Tensor) -> bool:
    return torch._debug_has_internal_overlap(t) != 0


class ChunkLoop(torch.nn.Module):
    """Runs fx bodies chunk by chunk and combines their outputs (see :class:`LoopOutput`).

    Returns the public outputs and, last, an empty tensor standing for the scratch memory a chunk
    uses (its fake value in the graph has the scratch's size, so the peak simulation counts it).
    """

    def __init__(self, spec: LoopSpec, bodies: Mapping[int, torch.fx.GraphModule]):
        super().__init__()
        self.spec = spec
        self.bodies = torch.nn.ModuleDict({str(k): v for k, v in sorted(bodies.items())})
        self._runners: dict[int, Callable] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_runners"] = None
        return state

    def extra_repr(self) -> str:
        return f"units={self.spec.units}, chunk={self.spec.chunk}, chunks={self.spec.chunks}"

    def _runner(self, length: int) -> Callable:
        if self._runners is None:
            from memplan.emit import fast_callable

            self._runners = {int(k): fast_callable(body) for k, body in self.bodies.items()}
        return self._runners[length]

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        spec = self.spec
        results: list[Any] = [None] * len(spec.outputs)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        accumulators = [
            torch.zeros(out.acc_shape, dtype=out.dtype, device=device) for out in spec.outputs if out.kind == "inplace"
        ]
        for k in range(spec.chunks):
            start = k * spec.chunk
            length = min(spec.chunk, spec.units - start)
            chunk_args = [
                a if s.dim is None else a.narrow(s.dim, start * s.inner, length * s.inner) for a, s in zip(args, spec.inputs)
            ]
            outs = self._runner(length)(chunk_args + accumulators)
            for i, out in enumerate(spec.outputs):
                if out.same_as < 0 and out.kind != "inplace":
                    results[i] = self._combine(results[i], outs[i], out, start, length, outs)
            outs = chunk_args = None  # drop this chunk's values before the next chunk runs
        for i, out in enumerate(spec.outputs):
            if out.kind == "nll_mean":
                partner = spec.outputs[out.partner].same_as if spec.outputs[out.partner].same_as >= 0 else out.partner
                results[i] = results[i] / results[partner]
        inplace = iter(accumulators)
        for i, out in enumerate(spec.outputs):
            if out.kind == "inplace":
                value = next(inplace)
                for target, rest, kwargs in out.steps:
                    value = target(value, *rest, **kwargs)
                results[i] = value
        for i, out in enumerate(spec.outputs):
            if out.same_as >= 0:
                results[i] = results[out.same_as]
        public = [r for r, out in zip(results, spec.outputs) if out.public]
        return (*public, torch.empty(0, dtype=torch.uint8, device=device))

    def _combine(self, acc: Any, value: torch.Tensor, out: LoopOutput, start: int, length: int, outs) -> Any:
        kind = out.kind
        if kind == "cat":
            if acc is None:
                acc = torch.empty_strided(out.shape, out.stride, dtype=value.dtype, device=value.device)
            acc.narrow(out.dim, start * out.inner, length * out.inner).copy_(value)
            return acc
        if kind == "first":
            return value if acc is None else acc
        if kind == "nll_mean":
            value = value * outs[out.partner]  # the partner's chunk value (same tensor as its twin's)
            kind = "sum"
        if kind == "mean":
            weight = length / self.spec.units
            if acc is None:
                return value * weight
            return acc.add_(value, alpha=weight)
        if acc is None:
            return value.clone() if _overlaps(value) else value
        if kind == "sum":
            return acc.add_(value)
        if kind == "lse":
            return torch.logaddexp(acc, value, out=acc)
        if kind == "max":
            return torch.maximum(acc, value, out=acc)
        if kind == "min":
            return torch.minimum(acc, value, out=acc)
        raise ValueError(f"unknown combine {kind!r}")

    def cost(self, rates: "CostRates") -> float:
        total = 0.0
        for k in range(self.spec.chunks):
            length = min(self.spec.chunk, self.spec.units - k * self.spec.chunk)
            total += _module_cost(self.bodies[str(length)], rates) + rates.chunk_seconds
        return total


# ----------------------------------------------------------------------------------------------
# cost model


@dataclasses.dataclass(frozen=True)
class CostRates:
    """A roofline-style estimate of an op's time: FLOPs at ``flops`` per second, bytes read and written
    at ``bandwidth`` bytes per second (``cache_bandwidth`` when the op's operands and result together
    fit in ``cache_bytes``: a chunk's working set stays in cache, a whole-batch tensor streams from
    memory), plus a fixed overhead per op (``dispatch`` for ops that compute, ``view_dispatch`` for
    views, which allocate nothing) and ``chunk_seconds`` per chunk of a loop. The defaults are a modest
    2-core CPU: overheads measured on fx code running tiny tensors (about 3 us per op, 1 us per view),
    and a cache advantage of 1.5x (chain product: its chunked forward ran in 34 ms where eager's took
    46 ms). Only ratios matter: the policy compares extra compute with the original."""

    flops: float = 50e9
    bandwidth: float = 10e9
    cache_bandwidth: float = 15e9
    cache_bytes: int = 2**20
    dispatch: float = 3e-6
    view_dispatch: float = 1e-6
    chunk_seconds: float = 10e-6


_NO_TRAFFIC = _ALIAS_OPS | {"getitem", "_unsafe_view", "empty", "new_empty", "new_empty_strided", "empty_strided"}


def _node_cost(node: torch.fx.Node, rates: CostRates) -> float:
    name = packet_name(node)
    if node.target is operator.getitem:
        return 0.0
    flops = 0
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = (node.args[0], node.args[1]) if name in ("mm", "bmm") else (node.args[1], node.args[2])
        sa, sb = _shape(a), _shape(b)
        if len(sa) >= 2 and len(sb) >= 2:
            flops = 2 * math.prod(sa) * sb[-1]
    elif name == "convolution":
        weight = _shape(node.args[1])
        flops = 2 * max(_bytes(node) // 4, 1) * math.prod(weight[1:]) if weight else 0
    if name in _NO_TRAFFIC:
        return rates.view_dispatch
    traffic = _bytes(node) + sum(_bytes(a) for a in node.all_input_nodes if _is_tensor(a))
    bandwidth = rates.cache_bandwidth if traffic <= rates.cache_bytes else rates.bandwidth
    return flops / rates.flops + traffic / bandwidth + rates.dispatch


def _module_cost(gm: torch.fx.GraphModule, rates: CostRates) -> float:
    total = 0.0
    for node in gm.graph.nodes:
        if node.op == "call_function":
            total += _node_cost(node, rates)
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            total += module.cost(rates) if isinstance(module, ChunkLoop) else rates.dispatch
    return total


def graph_cost(graph: CapturedGraph, rates: CostRates | None = None) -> float:
    """Estimated seconds to run ``graph`` once (see :class:`CostRates`)."""
    return _module_cost(graph.gm, rates or CostRates())


# ----------------------------------------------------------------------------------------------
# apply


def _body_peak(body: torch.fx.GraphModule) -> int:
    """Simulated peak of one run of a loop body (its inputs are views of existing tensors)."""
    return AnalysisManager(_body_graph(body)).get(PeakSimulation).peak


def _body_graph(body: torch.fx.GraphModule) -> CapturedGraph:
    """A loop body as an inference graph, so that analyses (and the pass itself) run on it."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    n_out = len(next(n for n in body.graph.nodes if n.op == "output").args[0])
    return CapturedGraph(
        gm=body,
        training=False,
        phases={n.name: Phase.FORWARD for n in body.graph.nodes if n.op == "call_function"},
        sources={},
        seq_nr={},
        inputs=tuple(InputSpec(p.name, "input", p.name, False) for p in placeholders),
        outputs=tuple(OutputSpec(None, "output", f"out[{i}]") for i in range(n_out)),
        in_spec=pytree.tree_flatten(((), {}))[1],
        out_spec=pytree.tree_flatten(None)[1],
        seed="sum",
        lifetimes="graph",
    )


def _external_inputs(nodes: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    members = set(nodes)
    seen: dict[torch.fx.Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in seen:
                seen[arg] = None
    return list(seen)


def _output_spec(node: torch.fx.Node, state: State) -> LoopOutput:
    value = node.meta["val"]
    shape, stride = tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride())
    if isinstance(state, Split):
        return LoopOutput("cat", state.dim, state.inner, shape, stride, dtype=value.dtype)
    if isinstance(state, Partial) and state.kind != "inplace":
        return LoopOutput(state.kind, shape=shape, stride=stride, dtype=value.dtype)
    return LoopOutput("first", shape=shape, stride=stride, dtype=value.dtype)


_SCATTER_ADDS = {"index_add_", "index_put_", "_index_put_impl_", "scatter_add_"}


def _accumulation(output: torch.fx.Node, nodes: Sequence[torch.fx.Node], outputs: Sequence[torch.fx.Node]):
    """``output`` is views of a zero tensor made in the body and scatter-added into in place: return the
    zero tensor's node and the view ops from it to ``output`` (None otherwise)."""
    members = set(nodes)
    chain = []
    node = output
    while packet_name(node) in _ALIAS_OPS and node in members:
        chain.append(node)
        node = node.args[0]
    if packet_name(node) not in _SCATTER_ADDS or node not in members:
        return None
    zero = node.args[0]
    if zero not in members or packet_name(zero) not in ("zeros", "new_zeros", "zeros_like"):
        return None
    if set(zero.users) != {node} or any(u in members and u not in chain for u in node.users):
        return None
    if any(n in outputs and n is not output for n in [node, *chain]):
        return None
    steps = tuple((n.target, tuple(n.args[1:]), dict(n.kwargs)) for n in reversed(chain))
    return zero, steps


def _strip_aliases(node: torch.fx.Node) -> torch.fx.Node:
    while node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        node = node.args[0]
    return node


def _make_loops(
    region: ChunkRegion,
    sizes: Sequence[int],
    nodes: Sequence[torch.fx.Node],
    inputs: Sequence[tuple[torch.fx.Node, State]],
    outputs: Sequence[torch.fx.Node],
    states: Mapping[torch.fx.Node, State],
    mode,
    compile: bool,
    inner: Mapping[int, "ChunkPlan"] | None = None,
) -> tuple[dict[int, ChunkLoop], list[LoopOutput]]:
    """Loop modules running ``nodes`` chunk by chunk, one per chunk size in ``sizes``; a body of a
    length in ``inner`` is chunked again by that plan."""
    body_outputs: list[tuple[torch.fx.Node, int | None]] = [(o, None) for o in outputs]
    specs = [_output_spec(o, states.get(o, REP)) for o in outputs]
    input_index = {node: i for i, (node, _) in enumerate(inputs)}
    for i, o in enumerate(outputs):
        if states.get(o) == Partial("inplace") and o.args[0] in input_index:
            specs[i] = dataclasses.replace(specs[i], alias_of=input_index[o.args[0]])
    for i, out in enumerate(list(outputs)):
        if specs[i].kind == "nll_mean":
            parent = out.args[0]
            body_outputs.append((parent, 1))
            tw = parent.meta["val"][1]
            specs.append(LoopOutput("sum", shape=tuple(tw.shape), stride=tuple(tw.stride()), public=False, dtype=tw.dtype))
            specs[i] = dataclasses.replace(specs[i], partner=len(specs) - 1)
    # outputs that are the same value (through detach, or an NLL weight that is also public) combine once
    first: dict[tuple[torch.fx.Node, int | None], int] = {}
    for i, (node, index) in enumerate(body_outputs):
        key = (_strip_aliases(node), index)
        if index is None and node.target is operator.getitem:
            key = (_strip_aliases(node.args[0]), node.args[1])
        if key in first:
            specs[i] = dataclasses.replace(specs[i], same_as=first[key])
        else:
            first[key] = i
    accumulators = []
    for i, (node, index) in enumerate(body_outputs):
        if index is None and specs[i].same_as < 0 and states.get(node) == Partial("sum"):
            found = _accumulation(node, nodes, [o for o, _ in body_outputs])
            if found is not None:
                zero, steps = found
                value = zero.meta["val"]
                specs[i] = dataclasses.replace(specs[i], kind="inplace", steps=steps, acc_shape=tuple(value.shape), dtype=value.dtype)
                accumulators.append(zero)
    loop_inputs = tuple(LoopInput(s.dim, s.inner) if isinstance(s, Split) else LoopInput() for _, s in inputs)
    built: dict[int, torch.fx.GraphModule] = {}
    loops = {}
    for size in sizes:
        chunks = -(-region.units // size)
        lengths = sorted({size, region.units - (chunks - 1) * size})
        for length in lengths:
            if length not in built:
                built[length] = _build_body(nodes, inputs, body_outputs, states, length, mode, compile, accumulators)
                if inner and length in inner:
                    built[length] = apply_chunk(_body_graph(built[length]), inner[length], compile).gm
        bodies = {length: built[length] for length in lengths}
        scratch = max(_body_peak(b) for b in bodies.values())
        spec = LoopSpec(region.units, size, loop_inputs, tuple(specs), scratch)
        loops[size] = ChunkLoop(spec, bodies)
    return loops, specs


def _insert_loop(graph_state: dict, gm: torch.fx.GraphModule, loop: ChunkLoop, specs, args, phase: Phase, like: torch.fx.Node,
                 seq: int, mode) -> list[torch.fx.Node]:
    """Add ``loop`` as a submodule, a call_module node and one getitem per public output."""
    index = 0
    while hasattr(gm, f"memplan_chunk{index}"):
        index += 1
    target = f"memplan_chunk{index}"
    gm.add_submodule(target, loop)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        call = gm.graph.create_node("call_module", target, tuple(args), {}, name=f"chunk{index}_{phase.value}")
    device = like.meta["val"].device if isinstance(like.meta.get("val"), torch.Tensor) else torch.device("cpu")
    with mode:
        public = [
            args[s.alias_of].meta["val"] if s.alias_of >= 0 else torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device)
            for s in specs if s.public
        ]
        scratch = torch.empty(loop.spec.scratch, dtype=torch.uint8, device=device)
    call.meta["val"] = (*public, scratch)
    items = []
    for i in range(len(public)):
        with gm.graph.inserting_before(output):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta["val"] = public[i]
        items.append(item)
    for node in [call, *items]:
        graph_state["phases"][node.name] = phase
        graph_state["seq_nr"][node.name] = seq
        if like.name in graph_state["sources"]:
            graph_state["sources"][node.name] = graph_state["sources"][like.name]
    return [call, *items]


def apply_region(graph: CapturedGraph, region: ChunkRegion) -> CapturedGraph:
    """Stage 6 for one region: a new graph with the region replaced by a forward and a backward loop."""
    new, _ = _apply_region(graph, region, compile=True)
    return new


def _apply_region(graph: CapturedGraph, region: ChunkRegion, compile: bool):
    """:func:`apply_region`, also returning ``loops_for(size)``: the ``(loop node, module)`` pairs that
    run the same region with another chunk size (built on demand, from the input graph's nodes)."""
    src = {n.name: n for n in graph.gm.graph.nodes}  # bodies are built from the untouched input graph
    graph = copy_graph(graph, compile=False)
    gm = graph.gm
    mode = fake_mode_of(gm.graph)
    by_name = {n.name: n for n in gm.graph.nodes}
    original = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    forward = [by_name[n] for n, _ in region.forward]
    fset = set(forward)
    body = [by_name[n] for n, _ in region.backward]
    bset = set(body)
    state = {"phases": dict(graph.phases), "sources": dict(graph.sources), "seq_nr": dict(graph.seq_nr)}
    seq = max([s for s in graph.seq_nr.values() if s < 2**62] + [0]) + 1
    anchor = max(forward, key=lambda n: (_bytes(n), -original[n]))
    inner = {loop: {length: plan for kind, length, plan in region.inner if kind == loop} for loop in ("forward", "backward")}
    fstates = {src[n]: s for n, s in region.forward}
    sources = {src[n]: s for n, s in region.sources}

    # Step 6a: the forward loop.
    f_nodes = [src[n] for n, _ in region.forward]
    f_inputs = [(a, sources.get(a, REP)) for a in _external_inputs(f_nodes)]
    f_outputs = [src[n] for n in (*region.outputs, *region.saved)]
    builders = [lambda sizes: _make_loops(region, sizes, f_nodes, f_inputs, f_outputs, fstates, mode, compile, inner["forward"])]
    loops, specs = builders[0]([region.chunk])
    new_fwd = _insert_loop(state, gm, loops[region.chunk], specs, [by_name[a.name] for a, _ in f_inputs], Phase.FORWARD, anchor, seq, mode)
    calls = [new_fwd[0]]
    priority = dict(original)
    first = min(original[n] for n in forward)
    for i, node in enumerate(new_fwd):
        priority[node] = first - 0.5 + i * 1e-6
    materialised = {by_name[o.name]: item for o, item in zip(f_outputs, new_fwd[1:])}
    for node, item in materialised.items():
        node.replace_all_uses_with(item, delete_user_cb=lambda u: u not in fset and u not in bset)

    # Step 6b: the backward loop (recomputed forward values first, then the backward body).
    new_bwd: list[torch.fx.Node] = []
    if body:
        b_nodes = [src[n] for n in region.recompute] + [src[n] for n, _ in region.backward]
        slices = {src[n]: s for n, s in region.backward_slices}
        b_inputs = []
        for a in _external_inputs(b_nodes):
            if a in slices:
                s = slices[a]
            elif a in fstates:
                s = fstates[a] if isinstance(fstates[a], Split) else REP
            else:
                s = sources.get(a, REP)
            b_inputs.append((a, s))
        states = {**{src[n]: fstates[src[n]] for n in region.recompute}, **{src[n]: s for n, s in region.backward}}
        b_outputs = [src[n] for n in region.backward_outputs]
        builders.append(lambda sizes: _make_loops(region, sizes, b_nodes, b_inputs, b_outputs, states, mode, compile, inner["backward"]))
        bloops, bspecs = builders[1]([region.chunk])
        args = [materialised.get(by_name[a.name], by_name[a.name]) for a, _ in b_inputs]
        new_bwd = _insert_loop(state, gm, bloops[region.chunk], bspecs, args, Phase.BACKWARD, body[0], seq, mode)
        calls.append(new_bwd[0])
        bfirst = min(original[n] for n in body)
        for i, node in enumerate(new_bwd):
            priority[node] = bfirst - 0.5 + i * 1e-6
        for name, item in zip(region.backward_outputs, new_bwd[1:]):
            by_name[name].replace_all_uses_with(item, delete_user_cb=lambda u: u not in bset)

    # Step 6c: erase what the loops replaced, then restore a topological order; views of the loops'
    # outputs get fresh fake values (their old ones alias the replaced nodes' storages).
    for node in reversed(body):
        gm.graph.erase_node(node)
    for node in reversed(forward):
        if not node.users:
            gm.graph.erase_node(node)
    stable_toposort(gm.graph, priority)
    refresh_aliases(gm.graph, new_fwd + new_bwd, mode)
    if compile:
        finish_module(gm)
    live = {n.name for n in gm.graph.nodes}
    new = dataclasses.replace(
        graph,
        phases={k: v for k, v in state["phases"].items() if k in live},
        sources={k: v for k, v in state["sources"].items() if k in live},
        seq_nr={k: v for k, v in state["seq_nr"].items() if k in live},
    )
    cache: dict[int, list[tuple[torch.fx.Node, ChunkLoop]]] = {region.chunk: [(new_fwd[0], loops[region.chunk])]}
    if body:
        cache[region.chunk].append((new_bwd[0], bloops[region.chunk]))

    def loops_for(size: int) -> list[tuple[torch.fx.Node, ChunkLoop]]:
        if size not in cache:
            cache[size] = [(call, build([size])[0][size]) for call, build in zip(calls, builders)]
        return cache[size]

    return new, loops_for


def _use_loops(graph: CapturedGraph, swap: Sequence[tuple[torch.fx.Node, ChunkLoop]]) -> None:
    """Put other loop modules (another chunk size) behind the loop nodes of ``graph``."""
    for node, loop in swap:
        setattr(graph.gm, node.target, loop)
        value = node.meta["val"]
        scratch = value[-1]
        with scratch.fake_mode:
            node.meta["val"] = (*value[:-1], torch.empty(loop.spec.scratch, dtype=torch.uint8, device=scratch.device))


def refresh_aliases(graph: torch.fx.Graph, starts: Sequence[torch.fx.Node], mode) -> None:
    """Recompute the fake values of views (and in-place results) downstream of ``starts``, in order."""
    dirty = set(starts)
    for node in graph.nodes:
        if node.op != "call_function" or not any(a in dirty for a in node.all_input_nodes):
            continue
        aliasing = packet_name(node) in _ALIAS_OPS or node.target is operator.getitem or bool(mutated_args(node))
        if aliasing:
            node.meta["val"] = _fake_call(node.target, node.args, node.kwargs, mode)
            dirty.add(node)


def apply_chunk(graph: CapturedGraph, plan: ChunkPlan, compile: bool = True) -> CapturedGraph:
    """Apply every region of ``plan`` in order (a new graph; ``graph`` is not modified)."""
    for region in plan.regions:
        graph, _ = _apply_region(graph, region, compile)
    return graph


# ----------------------------------------------------------------------------------------------
# planning


@dataclasses.dataclass(frozen=True)
class ChunkOptions:
    """Options of the chunk pass, read from ``ctx.options`` (keys prefixed ``"chunk."``).

    Attributes
    ----------
    counts : tuple of int
        Chunk counts tried for each region (a candidate per count). More chunks: lower peak, more
        per-chunk overhead.
    seed_nodes : int
        How many of the largest forward tensors seed the search for an independent dimension.
    seed_fraction : float
        Seed only tensors at least this fraction of the largest one.
    regions : int
        How many regions one run of the pass may chunk (greedily, one after another).
    evaluate : int
        How many candidate regions (ranked by the bytes they could free) are evaluated in full, at
        least; small graphs evaluate more, up to ``evaluate_nodes`` graph nodes in all (evaluating
        is building the transformed graph, which costs time in proportion to its size).
    evaluate_nodes : int
        The budget of graph nodes built for evaluation per region search.
    save_fraction : float
        A forward value at most this fraction of the region's largest tensor may be saved for the
        backward instead of recomputed (one candidate variant).
    min_gain : float
        A region is chunked only if it lowers the predicted peak by at least this fraction: a loop
        has a cost in time and code size that a few percent of memory does not repay.
    nest : bool
        When a region's index is used up (chunks of one unit), also try chunking its loop bodies
        along a second independent index (e.g. the tokens of each sequence).
    nest_fraction : float
        Try that only for a loop whose chunk needs at least this fraction of the peak (otherwise
        chunking its body cannot lower the peak much).
    rates : CostRates
        The cost model behind the overhead estimate.
    """

    counts: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
    seed_nodes: int = 6
    seed_fraction: float = 0.25
    regions: int = 3
    evaluate: int = 3
    evaluate_nodes: int = 3000
    save_fraction: float = 0.125
    min_gain: float = 0.05
    nest: bool = True
    nest_fraction: float = 0.25
    rates: CostRates = CostRates()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "ChunkOptions":
        fields = {f.name for f in dataclasses.fields(cls)}
        picked = {k[len("chunk."):]: v for k, v in options.items() if k.startswith("chunk.") and k[len("chunk."):] in fields}
        return cls(**picked)


def _inverse(node: torch.fx.Node, state: Split) -> list[tuple[torch.fx.Node, Split]]:
    """Inputs of ``node`` that carry the index when its output carries it as ``state`` (by testing the
    forward rule), empty when the op creates or mixes it."""
    index = None
    op = node
    if node.target is operator.getitem:
        op, index = node.args[0], node.args[1]
        if not isinstance(op, torch.fx.Node) or op.op != "call_function":
            return []
    units = _shape(node)[state.dim] // state.inner
    for p in dict.fromkeys(a for a in op.all_input_nodes if _is_tensor(a)):
        shape = _shape(p)
        options: list[Split] = []
        if packet_name(op) in _VIEW_OPS:
            mapped = map_view(_shape(op), shape, state)
            options = [mapped] if mapped is not None else []
        else:
            options = [Split(e, state.inner) for e, size in enumerate(shape) if size == units * state.inner]
        for option in options:
            trial: dict[torch.fx.Node, State] = {p: option}
            for _ in range(4):
                result = chunk_rule(op, trial.get, _is_zero_factory)
                if isinstance(result, Need) and result.node not in trial:
                    trial[result.node] = result.state
                    continue
                break
            if isinstance(result, tuple) and index is not None:
                result = result[index]
            if result == state:
                return [(n, s) for n, s in trial.items() if isinstance(s, Split)]
    return []


def _sources(graph: CapturedGraph, node: torch.fx.Node, state: Split) -> dict[str, Split] | None:
    """Walk the index back from ``node`` to where it enters the graph or is created (stage 1)."""
    found: dict[torch.fx.Node, Split] = {}
    seen: set[tuple[str, Split]] = set()
    stack = [(node, state)]
    while stack:
        n, s = stack.pop()
        if (n.name, s) in seen:
            continue
        seen.add((n.name, s))
        carriers = []
        if n.op == "call_function" and graph.phases.get(n.name) is Phase.FORWARD and not is_random(n):
            carriers = _inverse(n, s)
        if not carriers:
            if found.get(n, s) != s:
                return None
            found[n] = s
            continue
        stack.extend(carriers)
    return {n.name: s for n, s in found.items()}


def _seed_sets(graph: CapturedGraph, options: ChunkOptions) -> list[tuple[str, dict[str, Split]]]:
    forward = [n for n in graph.gm.graph.nodes if n.op == "call_function" and graph.phases.get(n.name) is Phase.FORWARD]
    sized = sorted((n for n in forward if _is_tensor(n)), key=lambda n: (-_bytes(n), n.name))
    seeds: dict[frozenset, tuple[str, dict[str, Split]]] = {}
    if sized:
        largest = _bytes(sized[0])
        for node in sized[: options.seed_nodes]:
            if _bytes(node) < options.seed_fraction * largest:
                break
            for d, size in enumerate(_shape(node)):
                if size < 2:
                    continue
                found = _sources(graph, node, Split(d))
                if found:
                    key = frozenset(found.items())
                    seeds.setdefault(key, (f"dim {d} of {node.name}", found))
    for spec in graph.inputs:
        if spec.kind != "input":
            continue
        node = graph.node(spec.node)
        for d, size in enumerate(_shape(node)):
            if size >= 2:
                found = {node.name: Split(d)}
                seeds.setdefault(frozenset(found.items()), (f"dim {d} of {spec.path}", found))
    return list(seeds.values())


def _potential(graph: CapturedGraph, region: ChunkRegion, tensors: Tensors) -> int:
    """Bytes the region could stop holding at once: its largest value the loops do not materialise,
    less the largest sliced input that still has to be materialised in full (not a view of an input)."""
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    keep = set(region.outputs) | {n for n, _ in region.sources}
    inside = [n for n, _ in region.forward if n not in keep] + [n for n, _ in region.backward if n not in region.backward_outputs]
    freed = max((_bytes(by_name[n]) for n in inside), default=0)
    held = 0
    for name, _ in list(region.sources) + list(region.backward_slices):
        if any(not tensors.storages[sid].external for sid in tensors.storages_of(name)):
            held = max(held, _bytes(by_name[name]))
    return freed - held


def _regions(graph: CapturedGraph, options: ChunkOptions) -> list[ChunkRegion]:
    found: dict[tuple, ChunkRegion] = {}
    for label, seeds in _seed_sets(graph, options):
        region = _analyse(graph, seeds, label)
        if region is None:
            continue
        key = (region.units, tuple(n for n, _ in region.forward), tuple(n for n, _ in region.backward))
        found.setdefault(key, region)
    tensors = AnalysisManager(graph).get(Tensors)
    ranked = sorted(found.values(), key=lambda r: (-_potential(graph, r, tensors), r.label))
    size = sum(1 for _ in graph.gm.graph.nodes)
    return ranked[: max(options.evaluate, min(3 * options.evaluate, options.evaluate_nodes // max(size, 1)))]


def _variants(graph: CapturedGraph, region: ChunkRegion, options: ChunkOptions) -> list[tuple[ChunkRegion, list[int]]]:
    """The region (recomputing everything) and, when it helps, a variant saving small values; each
    with the chunk sizes to try."""
    bases = [region]
    saving = _with_saved(graph, region, options.save_fraction)
    if saving is not None:
        bases.append(saving)
    sizes = sorted({-(-region.units // k) for k in options.counts if k <= region.units}, reverse=True)
    return [(base, sizes) for base in bases] if sizes else []


def _evaluate(graph: CapturedGraph, region: ChunkRegion, sizes: list[int], base_cost: float,
              options: ChunkOptions, policy) -> list[Candidate]:
    """Build the variant once, then simulate the peak and estimate the extra compute for each chunk
    size, from few chunks to many; stop once the policy cannot want more chunks (the overhead is far
    beyond ``max_overhead``, or the peak fits the budget).

    Sizes differ only in the loops' bodies and scratch, so the graph's analyses are computed once and
    each size re-runs the peak walk with the loops' scratch sizes (see :func:`_walk_peak`).
    """
    try:
        new, loops_for = _apply_region(graph, dataclasses.replace(region, chunk=sizes[0]), compile=False)
    except (RuntimeError, ValueError, TypeError, IndexError):
        # a body that does not trace at this size (the rules missed a constraint): not a candidate
        return []
    am = AnalysisManager(new)
    tensors, liveness = am.get(Tensors), am.get(Liveness)
    calls = [call for call, _ in loops_for(sizes[0])]
    scratch_ids = [tensors.storages_of(call.name)[-1] for call in calls]
    fixed_cost = _module_cost(new.gm, options.rates) - sum(loop.cost(options.rates) for _, loop in loops_for(sizes[0]))
    candidates: list[Candidate] = []
    stopped = False
    for size in sizes:
        try:
            loops = [loop for _, loop in loops_for(size)]
        except (RuntimeError, ValueError, TypeError, IndexError):
            continue
        peak = _walk_peak(tensors, liveness, dict(zip(scratch_ids, (loop.spec.scratch for loop in loops))))
        cost = fixed_cost + sum(loop.cost(options.rates) for loop in loops)
        overhead = max(0.0, cost / base_cost - 1.0) if base_cost > 0 else 0.0
        variant = dataclasses.replace(region, chunk=size)
        label = f"{region.label}: {variant.chunks} chunks" + (f", {len(region.saved)} saved" if region.saved else "")
        candidates.append(Candidate(variant, peak, overhead, label))
        # The overhead is not monotone in the chunk count (chunks that fit in cache run faster), so
        # only a hopeless overhead stops the ladder; under a budget the first fit stops it.
        hopeless = policy.budget is None and overhead > 2.0 * policy.max_overhead + 0.2
        if hopeless or policy.budget is not None and peak <= policy.budget:
            stopped = True
            break
    if options.nest and candidates and not stopped:
        finest = candidates[-1]
        nested = _nested_variant(loops_for(finest.plan.chunk), finest, options, policy)
        if nested is not None:
            try:
                new, _ = _apply_region(graph, nested, compile=False)
            except (RuntimeError, ValueError, TypeError, IndexError):
                return candidates
            peak = AnalysisManager(new).get(PeakSimulation).peak
            overhead = max(0.0, graph_cost(new, options.rates) / base_cost - 1.0) if base_cost > 0 else 0.0
            candidates.append(Candidate(nested, peak, overhead, f"{region.label}: {nested.chunks} chunks, nested"))
    return candidates


def _walk_peak(tensors: Tensors, liveness: Liveness, sizes: Mapping[int, int]) -> int:
    """The peak of :class:`~memplan.analysis.peak.PeakSimulation`'s walk (allocate at birth, free after
    the last reader, external storages never counted) with some storages' sizes replaced."""
    born: dict[int, int] = {}
    dies: dict[int, int] = {}
    for sid, storage in tensors.storages.items():
        if storage.external:
            continue
        nbytes = sizes.get(sid, storage.nbytes)
        interval = liveness.intervals[sid]
        born[interval.start] = born.get(interval.start, 0) + nbytes
        if interval.end < liveness.end:
            dies[interval.end] = dies.get(interval.end, 0) + nbytes
    live = peak = 0
    for index in range(len(liveness.order)):
        live += born.get(index, 0)
        peak = max(peak, live)
        live -= dies.get(index, 0)
    return peak


def _nested_variant(swap, finest: Candidate, options: ChunkOptions, policy) -> ChunkRegion | None:
    """When the index is used up (chunks of one unit), chunk the loop bodies along a second index.

    Only loops whose chunk (scratch) is a sizeable part of the peak are tried. A body is planned under
    what the outer candidate leaves of the policy: the rest of the overhead allowance, or the budget
    less what the rest of the graph holds. The plan is made on the full-length body and reused for
    the shorter last chunk's body (the second index is the same in both)."""
    region = finest.plan
    inner_options = dataclasses.replace(options, nest=False, regions=1)
    plans = []
    for kind, (_node, loop) in zip(("forward", "backward"), swap):
        if loop.spec.scratch < options.nest_fraction * finest.peak:
            continue
        if policy.budget is None:
            if finest.overhead >= policy.max_overhead:
                continue
            # the body runs (1 + outer overhead) times the original work: its own overhead scales by that
            inner_policy = Policy(max_overhead=(policy.max_overhead - finest.overhead) / (1.0 + finest.overhead))
        else:
            inner_policy = Policy(budget=max(1, policy.budget - (finest.peak - loop.spec.scratch)), max_overhead=policy.max_overhead)
        plan, _ = _plan(_body_graph(loop.bodies[str(region.chunk)]), inner_policy, inner_options)
        if plan.regions:
            plans.extend((kind, int(length), plan) for length in loop.bodies)
    return dataclasses.replace(region, inner=tuple(plans)) if plans else None


def plan_chunk(graph: CapturedGraph, policy, options: Mapping[str, Any] | None = None) -> ChunkPlan:
    """Stages 1-5: choose regions and chunk sizes under ``policy`` (pure: ``graph`` is not modified).

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> from memplan.policy import Policy
    >>> x, y = torch.randn(64, 16), torch.randn(48, 16)
    >>> g = capture(lambda a, b: (a[:, None, :] - b[None, :, :]).abs().sum(-1).amin(-1), x, y, train=False)
    >>> plan = plan_chunk(dataclasses.replace(g, lifetimes="graph"), Policy(max_overhead=10.0))
    >>> plan.regions[0].units, plan.regions[0].chunks > 1  # the 48 rows of b, combined by min
    (48, True)
    """
    return _plan(graph, policy, options)[0]


def _plan(graph: CapturedGraph, policy, options: Mapping[str, Any] | None) -> tuple[ChunkPlan, CapturedGraph]:
    """:func:`plan_chunk` that also returns the graph with the plan applied (built while planning)."""
    opts = options if isinstance(options, ChunkOptions) else ChunkOptions.from_options(options or {})
    chosen: list[ChunkRegion] = []
    current = graph
    for _ in range(opts.regions):
        base_peak = AnalysisManager(current).get(PeakSimulation).peak
        base_cost = graph_cost(current, opts.rates)
        candidates: list[Candidate] = [Candidate(None, base_peak, 0.0, "unchunked")]
        # Steps 1-4 find the regions; step 5 builds and measures their candidates.
        for region in _regions(current, opts):
            for variant, sizes in _variants(current, region, opts):
                candidates.extend(_evaluate(current, variant, sizes, base_cost, opts, policy))
        try:
            best = policy.choose(candidates)
        except InfeasibleBudgetError:
            best = min(candidates, key=lambda c: (c.peak, c.overhead, c.label))
        over_budget = policy.budget is not None and base_peak > policy.budget
        if best.plan is None or (best.peak > (1.0 - opts.min_gain) * base_peak and not over_budget):
            break
        chosen.append(best.plan)
        current = apply_region(current, best.plan)
    return ChunkPlan(tuple(chosen)), current


@register_pass("chunk")
def chunk(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Run regions whose huge intermediates are reduced or sliced away in chunks (see the module docstring)."""
    plan, new = _plan(graph, ctx.policy, ctx.options)
    if not plan.regions:
        return PassResult(graph, changed=False, plan=plan)
    before = ctx.am.get(PeakSimulation).peak
    after = AnalysisManager(new).get(PeakSimulation).peak
    rates = ChunkOptions.from_options(ctx.options).rates
    base = graph_cost(graph, rates)
    overhead = max(0.0, graph_cost(new, rates) / base - 1.0) if base > 0 else 0.0
    nodes = sum(len(r.forward) + len(r.backward) for r in plan.regions)
    return PassResult(
        new,
        changed=True,
        stats=PassStats(nodes_rewritten=nodes, bytes_saved=max(0, before - after), recompute_added=overhead),
        notes=tuple(str(r) for r in plan.regions),
        plan=plan,
    )
