"""rewrite: algebraic rewrites that never materialise a broadcast.

What it does
------------
Two rewrites of a forward region *and* its backward, each keeping outputs and gradients equal to
eager's (up to summation order):

(a) **Broadcast batched matmul.** ``x.view(B, H, 1, D) @ W`` with ``W`` of shape ``(H, D, D)`` reaches
    aten as ``expand(W)`` + ``clone`` (``W`` copied ``B`` times) + ``bmm``, and its backward builds an
    expanded gradient of the same size before summing it over ``B``
    (pytorch/pytorch#154128, #18862, #76702). The rewrite folds the broadcast dimensions into the rows
    of the other operand (permute ``x`` to ``(H, B, D)``) and runs one ``bmm`` per real batch entry
    against ``W`` itself, so neither the forward nor the backward holds an expanded copy.
(b) **Matmul followed by a max.** ``(a @ b).max(dim)`` over a row or column dimension of the product
    keeps the argmax indices (in the narrowest integer type that holds them) for the backward instead
    of the product; the backward adds the selected rows or columns of the other operand into each
    gradient as one sparse-times-dense product (``memplan::grouped_addmm_``, see :mod:`memplan.ops`), whose
    only temporaries are the selections' coordinates and values: it never materialises the product,
    its gradient (the max backward of eager scatters into a zero tensor of the product's size) or the
    gathered rows.
(c) **Broadcast products.** Values built from broadcasts (an ``expand``, or a pointwise op's implicit
    broadcast) by pointwise ops, by reductions over dimensions that are not broadcast, and by sums of
    products are evaluated on the unexpanded values: each op at the broadcast of its operands' real
    extents, a ``sum`` over a product of two smaller operands as one ``einsum``. The backward is that of
    the unexpanded computation. ``F.cosine_similarity(z[:, None], z[None], dim=-1)`` then never holds
    its ``(B, B, D)`` norms, quotients and product (see :class:`BroadcastProduct`).

(d) **Oversized results.** A result whose storage, made by its own op, is at least twice its extent
    (CPU reduced losses write the elementwise loss into the storage of their 0-d result; ``col2im`` keeps
    one as large as its input) is cloned right after it and the clone read in its place, so the large
    storage dies at once instead of when the result does (for a training loss: after the backward).
    Kept only if the simulated peak does not rise (see :class:`OversizedResult`).

(e) **A vocabulary head and its cross-entropy** (:mod:`~memplan.passes._rewrite.linear_ce`):
    ``F.cross_entropy(h @ W.T + b, y)`` (ignore_index, class weights, label smoothing, a z-loss) computed
    in chunks of tokens or of the vocabulary, the backward recomputing each chunk's logits, so the full
    logits, their log-softmax and their gradient never exist. It adds one matrix product: the policy
    chooses the chunk count (or no rewrite) from each variant's simulated peak and predicted time,
    within the pass's share of ``max_overhead``, never raising the peak.

(f) **Copies saved before an in-place write.** ``c = clone(v); op_(v, ...)`` (autograd's copy of a value an
    in-place op then overwrites; ``nn.GRUCell`` makes two a step) runs the op out of place and reads
    ``v`` where the copy was read: the same values and bytes, and no read of a storage before a later
    write into it, which kept the storage and the copy from being recomputed (see
    :mod:`~memplan.passes._rewrite.saved_before_write`). Kept only if the simulated peak does not rise.

(h) **Dropout's output made again from its mask.** ``native_dropout`` (CUDA's dropout) keeps its mask for
    its backward; where the op after it saves its output too and the backward keeps its input anyway
    (``dropout(softmax(s)) @ v``), the backward makes the output again, ``x * mask * scale``, the same bits,
    and the output dies in the forward (:mod:`~memplan.passes._rewrite.dropout_mask`). Kept only if the
    simulated peak does not rise.

(i) **Dropout's noise drawn again.** ``empty_like(x).bernoulli_(q).div_(q)`` (``F.dropout`` on a CPU, or a
    mask written so by hand) keeps a float tensor the size of ``x`` for the product's backward. The
    forward now takes the generator's state right before the draw, and the backward draws the noise
    again from it, as ``torch.utils.checkpoint`` recomputes a draw: the same bits, no later draw moved
    (:mod:`~memplan.passes._rewrite.noise_replay`). Kept only if the simulated peak does not rise.

(j) **Batch norm's output made again.** A training ``native_batch_norm`` updates the running statistics in
    place, so nothing runs it twice as it is; where the backward reads its output or the ReLU of it (conv,
    batch norm, ReLU, conv), the backward now makes that value again by the same kernel on the input its own
    backward keeps, without running statistics to update: the same bits
    (:mod:`~memplan.passes._rewrite.norm_output`). Kept only if the simulated peak does not rise.

(g) **Attention written out.** ``softmax(q @ k^T * scale [+ bias] [masked -inf]) @ v`` over heads as
    batch dimensions (``matmul``, ``bmm``, einsum) becomes one ``F.scaled_dot_product_attention``,
    whose fused kernel keeps a log-sum-exp per query instead of the scores and the probabilities
    (:mod:`~memplan.passes._rewrite.attention`, with its own conditions: no dropout in training, no
    returned weights, masks that need no gradient).

Stages
------
(1) Find patterns in the forward graph, from the graph's structure only:
    (a) a ``bmm`` operand that is a view of a ``clone`` of an ``expand`` of a smaller tensor, broadcast
        over at least one batch dimension (and not over the matrix dimensions);
    (b) a ``max.dim``/``min.dim`` whose input is a chain of views of a ``bmm``/``mm`` used only there,
        whose reduced dimension is a factor of the product's rows or columns, and whose other
        dimensions factor the product's dimensions exactly (checked by walking each dimension back
        through the view chain with the chunk pass's rules);
    (c) forward nodes reached from broadcasts through pointwise ops and reductions, in graph order, each
        with the extents it is evaluated at; connected ones form one region;
    (e) a ``_log_softmax`` over the vocabulary of row moves of an ``mm``/``addmm``, read only by the loss
        terms the rewrite computes; then admitted, at a chunk count, by the policy (``linear_ce.admit``);
    (f) a forward ``clone`` of a value that an in-place op writes next, the written elements read
        afterwards only through the op's result;
    (g) a softmax over the last dimension between two products (first: it takes a broadcast key
        over heads before (a) does).
(2)-(4) Region rewrites ((a), (b), (c) and those in their own modules under ``passes/_rewrite/``) each
    name their region, its inputs and outputs and a replacement function
    (:class:`~memplan.passes._rewrite.region.Replacement`);
    :func:`~memplan.passes._rewrite.region.replace_region` finds the region's backward, traces the
    replacement's forward with its backward through autograd, and inlines both into the joint graph.
    Backward peepholes are replaced in place; oversized results are cloned last, on the graph the others
    leave. A new pattern is a finder added to ``_FINDERS`` and a class with ``claimed()`` (and
    ``replacement(graph)`` for a region rewrite).

Preconditions
-------------
Training or inference graphs with static shapes; the pattern's intermediate nodes (expand, clone,
views, the product) have no users outside the pattern.

Soundness conditions (each with a counterexample the detector refuses)
--------------------------------------------------------------------
* (a) The copy is only read by the ``bmm``. Counterexample: ``Wb = W.expand(B, H, D, D).contiguous();
  y = x @ Wb; Wb.add_(1)`` also needs the copy itself.
* (a) Broadcast only over batch dimensions. Counterexample: ``W`` of shape ``(H, 1, D)`` expanded to
  ``(B, H, D, D)`` repeats a row of the matrix; folding batch dimensions does not remove that copy.
* (b) The reduced dimension is a row or column factor of the product. Counterexample: the max over
  the ``bmm`` batch dimension selects whole matrices, not rows of one operand.
* (b) Ties: ``max`` returns one index among equal values, and its eager backward sends the gradient
  to that index too, so gradients agree; ``amax`` (which splits the gradient among ties) is not
  rewritten.
* (c) Reductions reduce only dimensions that are real in the unexpanded value. Counterexample:
  ``x[:, None].expand(-1, 7, -1).sum(1)`` is ``7 * x``, not ``x.sum(1)``.
* (c) A value read outside the region whose unexpanded form is smaller is expanded back and copied
  (the region is kept only when that copy is at most half the largest value it removes); one read
  outside as a view (an ``expand`` read by a reshape) is not rewritten.
* (c) In-place writes only into a copy the region made (``clamp_min_`` of a cloned norm), at that
  copy's extents. Counterexample: ``x[:, None].expand(...).exp().mul_(y)`` with ``y`` real along the
  broadcast dimension cannot be written into the unexpanded value.
* (b) Every other dimension of the max's input maps to one factor of the product (a permutation and
  reshape of it). Counterexample: a ``view`` that splits a row factor across two dimensions in a
  different order than the product's layout (an interleaving ``as_strided``) has no such map.

What it leaves to other passes
------------------------------
Chunking the rewritten regions along an independent dimension (``chunk``: with (b), the product is
still built in the forward, but a chunk at a time, and the saved indices are small), saving versus
recomputing (``remat``), in-place reuse (``inplace``), ordering (``schedule``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import mutated_args, packet_name, run_device
from memplan.opschema import is_view_op
from memplan.ops import grouped_addmm_
from memplan.passes._chunk.graphs import copy_graph, fake_call, fake_mode_of
from memplan.passes._chunk.rules import Split
from memplan.passes._rewrite.attention import Attention, find_attention
from memplan.passes._rewrite.dropout_mask import DropoutFromMask, apply_dropout_from_mask, find_dropout_from_mask
from memplan.passes._rewrite.noise_replay import NoiseReplay, apply_noise_replay, find_noise_replay
from memplan.passes._rewrite.norm_output import NormOutput, apply_norm_outputs, find_norm_outputs
from memplan.passes._rewrite.remade import undo as undo_remade
from memplan.passes._rewrite.linear_ce import LinearCrossEntropy, admit, find_linear_cross_entropy
from memplan.passes._rewrite.region import (
    Replacement,
    forward_nodes,
    forward_users,
    node_dtype,
    node_shape,
    replace_region,
)
from memplan.passes._rewrite.saved_before_write import (
    SavedBeforeWrite,
    apply_saved_before_write,
    find_saved_before_write,
)
from memplan.pipeline import PassContext, PassResult, PassStats, pass_options, register_pass

__all__ = ["Attention", "BroadcastMatmul", "BroadcastProduct", "MatmulMax", "ScatterIntoZeros", "InterleavedSlices", "OversizedResult", "RewritePlan", "plan_rewrite", "apply_rewrite", "rewrite"]

_VIEWS = {"view", "_unsafe_view", "reshape"}
_CHAIN = _VIEWS | {"permute", "transpose", "t", "unsqueeze", "squeeze", "alias", "detach"}


# ----------------------------------------------------------------------------------------------
# patterns (stage 1)


@dataclasses.dataclass(frozen=True)
class BroadcastMatmul:
    """``bmm`` with operand ``side`` a view of a copy of ``source`` broadcast to ``shape``.

    ``broadcast`` are the batch dimensions of ``shape`` along which ``source`` is repeated.
    """

    bmm: str
    side: int
    nodes: tuple[str, ...]  # expand, clone and views between them and the bmm, then the bmm
    source: str
    other: str
    shape: tuple[int, ...]
    broadcast: tuple[int, ...]

    def claimed(self) -> set[str]:
        return set(self.nodes)

    def replacement(self, graph: CapturedGraph) -> Replacement:
        fn = _broadcast_matmul_fn(self, node_shape(graph.node(self.other)))
        return Replacement(self.nodes, (self.other, self.source), (self.bmm,), fn, self.bmm)

    def __str__(self) -> str:
        copies = math.prod(self.shape[i] for i in self.broadcast)
        return f"broadcast matmul {self.bmm}: {self.source} no longer copied {copies}x"


@dataclasses.dataclass(frozen=True)
class MatmulMax:
    """``max``/``min`` over a factor of the rows (``rows``) or columns of a ``bmm``/``mm`` product.

    ``ydims`` gives, for each dimension of the reduced result, the product dimension it is a factor
    of in the canonical problem (0 batch, 1 rows, 2 columns, with rows and columns swapped when the
    rows are reduced; -1 for size-1 dimensions), the factor's stride and its size; ``step`` is the
    stride of the reduced factor inside the reduced dimension.
    """

    matmul: str
    chain: tuple[str, ...]
    reduce: str
    items: tuple[str, ...]
    values: str
    indices: str | None
    left: str
    right: str
    rows: bool
    batched: bool
    kind: str
    dim: int
    keepdim: bool
    ydims: tuple[tuple[int, int, int], ...]
    step: int
    index_dtype: torch.dtype

    def claimed(self) -> set[str]:
        return {self.matmul, *self.chain, self.reduce}

    def replacement(self, graph: CapturedGraph) -> Replacement:
        return Replacement((self.matmul, *self.chain, self.reduce, *self.items), (self.left, self.right),
                           (self.values, self.indices), _matmul_max_fn(self, graph), self.reduce)

    def __str__(self) -> str:
        what = "rows" if self.rows else "columns"
        return f"matmul {self.kind} {self.reduce}: keeps {str(self.index_dtype).replace('torch.', '')} indices over {what} of {self.matmul}"


@dataclasses.dataclass(frozen=True)
class ScatterIntoZeros:
    """``x + scatter(zeros, dim, index, src)`` with one index per line along ``dim`` (what the gradient
    of ``max(dim, keepdim=True)`` builds) is ``scatter_add(x, dim, index, src)``: no zero tensor, no add."""

    add: str
    scatter: str
    zeros: str
    other: str

    def claimed(self) -> set[str]:
        return {self.add, self.scatter, self.zeros}

    def __str__(self) -> str:
        return f"scatter into zeros {self.scatter}: added into {self.other} directly"


@dataclasses.dataclass(frozen=True)
class InterleavedSlices:
    """``slice_backward(a, shape, d, 0, end, 2) + slice_backward(b, shape, d, 1, end, 2)`` (the gradients
    of the even and the odd slices of a tensor) is ``stack([a, b], d + 1).view(shape)``: no two zero
    tensors of the full shape, no add."""

    add: str
    even: str
    odd: str

    def claimed(self) -> set[str]:
        return {self.add, self.even, self.odd}

    def __str__(self) -> str:
        return f"interleaved slice gradients {self.even}, {self.odd}: stacked"


@dataclasses.dataclass(frozen=True)
class OversizedResult:
    """A result that keeps a storage much larger than itself alive: CPU kernels of reduced losses
    (``mse_loss``, ``binary_cross_entropy``, ...) write the elementwise loss into the storage they return
    the scalar in, so a 0-d loss holds its whole input's worth of bytes for as long as it lives (in
    training, until the backward is done). A ``clone`` right after it, read in its place, lets that
    storage go at once; the copy is the size of the value."""

    node: str
    held: int  # bytes of the storage the result keeps alive
    kept: int  # bytes of the clone

    def claimed(self) -> set[str]:
        return {self.node}

    def __str__(self) -> str:
        return f"oversized result {self.node}: cloned out of its {self.held}-byte storage ({self.kept} bytes kept)"


Rewrite = Union[Attention, BroadcastMatmul, MatmulMax, ScatterIntoZeros, InterleavedSlices, OversizedResult,
                "BroadcastProduct", SavedBeforeWrite, LinearCrossEntropy, DropoutFromMask, NoiseReplay,
                NormOutput]


@dataclasses.dataclass(frozen=True)
class RewritePlan:
    """The rewrites a run of the pass applies, in order."""

    rewrites: tuple[Rewrite, ...] = ()

    def __str__(self) -> str:
        return "\n".join(str(r) for r in self.rewrites) if self.rewrites else "rewrite: nothing to do"


def _find_broadcast_matmuls(graph: CapturedGraph) -> list[BroadcastMatmul]:
    found = []
    for node in forward_nodes(graph):
        if packet_name(node) != "bmm":
            continue
        for side in (1, 0):
            views, value = [], node.args[side]
            while packet_name(value) in _VIEWS and forward_users(graph, value) == 1:
                views.append(value)
                value = value.args[0]
            copy = value
            if packet_name(copy) != "clone" or forward_users(graph, copy) != 1:
                continue
            expand = copy.args[0]
            if packet_name(expand) != "expand" or forward_users(graph, expand) != 1:
                continue
            shape = node_shape(expand)
            if len(shape) < 3 or node_shape(node.args[side]) != (math.prod(shape[:-2]), shape[-2], shape[-1]):
                continue
            source = expand.args[0]
            aligned = _aligned(node_shape(source), len(shape))
            if aligned[-2:] != shape[-2:]:
                continue
            broadcast = tuple(i for i in range(len(shape) - 2) if aligned[i] == 1 and shape[i] > 1)
            if not broadcast:
                continue
            nodes = (expand.name, copy.name, *(v.name for v in reversed(views)), node.name)
            found.append(BroadcastMatmul(node.name, side, nodes, source.name, node.args[1 - side].name, shape, broadcast))
            break
    return found


def _single_use(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and len(node.users) == 1


def _plain_add(node: torch.fx.Node) -> bool:
    """``a + b`` of two tensors of the same shape and dtype (no broadcast, no ``alpha``)."""
    if node.target is not torch.ops.aten.add.Tensor or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return False
    a, b = node.args
    value = node.meta.get("val")
    return all(
        isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)
        and isinstance(value, torch.Tensor) and x.meta["val"].shape == value.shape and x.meta["val"].dtype == value.dtype
        for x in (a, b)
    )


def _find_scatter_into_zeros(graph: CapturedGraph) -> list[ScatterIntoZeros]:
    found = []
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or not _plain_add(node):
            continue
        for s, x in (node.args, node.args[::-1]):
            # out of place into zeros, or in place into zeros nothing else reads (eager's max backward)
            if s.target not in (torch.ops.aten.scatter.src, torch.ops.aten.scatter_.src) or not _single_use(s) or s is x:
                continue
            zeros, dim, index, src = s.args[:4]
            if packet_name(zeros) not in ("new_zeros", "zeros", "zeros_like") or not _single_use(zeros):
                continue
            rank = len(node_shape(s))
            if node_shape(index)[dim % rank] != 1 or node_dtype(src) != node_dtype(s):
                continue  # several indices on a line: scatter keeps one value, scatter_add would sum them
            found.append(ScatterIntoZeros(node.name, s.name, zeros.name, x.name))
            break
    return found


def _find_interleaved_slices(graph: CapturedGraph) -> list[InterleavedSlices]:
    found = []
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or not _plain_add(node):
            continue
        parts = {}
        for s in node.args:
            if s.target is not torch.ops.aten.slice_backward.default or not _single_use(s):
                break
            grad, shape, dim, start, end, step = s.args
            rank = len(shape)
            if step != 2 or start not in (0, 1) or end < shape[dim % rank] or shape[dim % rank] % 2:
                break
            if node_shape(grad)[dim % rank] != shape[dim % rank] // 2:
                break
            parts[start] = (s, dim % rank, tuple(shape))
        else:
            if set(parts) == {0, 1} and parts[0][1:] == parts[1][1:]:
                found.append(InterleavedSlices(node.name, parts[0][0].name, parts[1][0].name))
    return found


# A result is copied out of its storage when that storage is at least twice the copy and this many bytes
# larger: below a page, the copy's dispatch costs more than the bytes are worth.
_OVERSIZED_MIN_BYTES = 4096


def _extent_bytes(value: torch.Tensor) -> int:
    """Bytes a tensor's elements span in its storage, from its first element to its last."""
    if value.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))
    return (last + 1) * value.element_size()


def _find_oversized_results(graph: CapturedGraph) -> list[OversizedResult]:
    """Nodes whose tensor result sits in a storage they made that is much larger than the result (see
    :class:`OversizedResult`). Views, in-place ops and ``out=`` writers return a storage they did not make,
    and are never taken; neither is an item of a tuple result (its op made the storage)."""
    found = []
    for node in graph.gm.graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, torch.Tensor) or value.is_sparse:
            continue
        if node.target is operator.getitem or is_view_op(node.target) or mutated_args(node) \
                or value.storage_offset() != 0:
            continue  # a tuple's item lives in its op's storage, which the other items may share
        held = value.untyped_storage().nbytes()
        kept = _extent_bytes(value)
        if held < 2 * kept or held - kept < _OVERSIZED_MIN_BYTES:
            continue
        storage = StorageWeakRef(value.untyped_storage())
        if any(isinstance(a.meta.get("val"), torch.Tensor) and StorageWeakRef(a.meta["val"].untyped_storage()) == storage
               for a in node.all_input_nodes):
            continue  # an alias of an argument after all
        found.append(OversizedResult(node.name, held, kept))
    return found


def _factor_back(node: torch.fx.Node, dim: int, inner: int, units: int) -> tuple[int, int] | None:
    """Where a factor (stride ``inner``, ``units`` values) of ``node``'s dimension ``dim`` lives in its
    input: ``(input dim, stride there)``, for the view-like ops of a chain."""
    name = packet_name(node)
    out_shape, in_shape = node_shape(node), node_shape(node.args[0])
    if name in _VIEWS:
        flat = inner * math.prod(out_shape[dim + 1 :])
        for k, size in enumerate(in_shape):
            after = math.prod(in_shape[k + 1 :])
            if flat % after == 0 and size % ((flat // after) * units) == 0 and size > 1:
                return k, flat // after
        return None
    rank = len(in_shape)
    if name == "permute":
        return [p % rank for p in node.args[1]][dim], inner
    if name in ("transpose", "t"):
        a, b = (0, 1) if name == "t" else (node.args[1] % rank, node.args[2] % rank)
        return (b if dim == a else a if dim == b else dim), inner
    if name == "unsqueeze":
        k = node.args[1] % len(out_shape)
        return (None if dim == k else (dim - (1 if dim > k else 0), inner))
    if name == "squeeze":
        kept = [i for i in range(rank) if not (in_shape[i] == 1 and _squeezes(node, i, rank))]
        return kept[dim], inner
    if name in ("alias", "detach"):
        return dim, inner
    return None


def _squeezes(node: torch.fx.Node, i: int, rank: int) -> bool:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        return True
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return i in [d % rank for d in dims]


def _walk_to(chain_end: torch.fx.Node, product: torch.fx.Node, state: Split) -> Split | None:
    """Follow dimension ``state.dim`` of ``chain_end`` back through its view chain to ``product``:
    the product dimension it is a factor of and the factor's stride there."""
    units = node_shape(chain_end)[state.dim]
    node, dim, inner = chain_end, state.dim, state.inner
    while node is not product:
        back = _factor_back(node, dim, inner, units)
        if back is None:
            return None
        (dim, inner), node = back, node.args[0]
    return Split(dim, inner)


def _index_dtype(size: int) -> torch.dtype:
    if size <= 256:
        return torch.uint8
    if size <= 2**15:
        return torch.int16
    if size <= 2**31:
        return torch.int32
    return torch.int64


def _factors_ok(ydims: Sequence[tuple[int, int, int]], extra: tuple[int, int, int] | None, sizes: Sequence[int]) -> bool:
    """Each canonical product dimension is exactly the row-major product of its factors."""
    for e, size in enumerate(sizes):
        factors = sorted([(inner, n) for d, inner, n in ydims if d == e] + ([extra[1:]] if extra and extra[0] == e else []), reverse=True)
        expected = 1
        for inner, n in reversed(factors):
            if inner != expected:
                return False
            expected *= n
        if expected != size:
            return False
    return True


def _find_matmul_max(graph: CapturedGraph) -> list[MatmulMax]:
    found = []
    for node in forward_nodes(graph):
        kind = packet_name(node)
        if kind not in ("max", "min") or node.target._overloadname != "dim":
            continue
        x = node.args[0]
        rank = len(node_shape(x))
        dim = node.args[1] + rank if node.args[1] < 0 else node.args[1]
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        chain, value = [], x
        while packet_name(value) in _CHAIN and forward_users(graph, value) == 1:
            chain.append(value)
            value = value.args[0]
        product = value
        if packet_name(product) not in ("bmm", "mm") or forward_users(graph, product) != 1:
            continue
        items = [u for u in node.users if u.target is operator.getitem]
        if len(items) != len(node.users) or not any(u.args[1] == 0 and forward_users(graph, u) for u in items):
            continue
        batched = packet_name(product) == "bmm"
        reduced = _walk_to(x, product, Split(dim))
        if reduced is None:
            continue
        rows_dim, cols_dim = (1, 2) if batched else (0, 1)
        if reduced.dim not in (rows_dim, cols_dim):
            continue
        rows = reduced.dim == rows_dim

        def canonical(e: int) -> int:
            e = e if batched else e + 1
            return {0: 0, 1: 2, 2: 1}[e] if rows else e

        ydims = []
        for k, size in enumerate(node_shape(x)):
            if k == dim:
                continue
            if size == 1:
                ydims.append((-1, 1, 1))
                continue
            walked = _walk_to(x, product, Split(k))
            if walked is None:
                break
            ydims.append((canonical(walked.dim), walked.inner, size))
        else:
            psize = node_shape(product) if batched else (1, *node_shape(product))
            sizes = (psize[0], psize[2], psize[1]) if rows else psize
            extra = (2, reduced.inner, node_shape(x)[dim])
            if not _factors_ok(ydims, extra, sizes):
                continue
            found.append(
                MatmulMax(
                    matmul=product.name,
                    chain=tuple(c.name for c in reversed(chain)),
                    reduce=node.name,
                    items=tuple(u.name for u in items),
                    values=next(u.name for u in items if u.args[1] == 0),
                    indices=next((u.name for u in items if u.args[1] == 1), None),
                    left=product.args[0].name,
                    right=product.args[1].name,
                    rows=rows,
                    batched=batched,
                    kind=kind,
                    dim=dim,
                    keepdim=keepdim,
                    ydims=tuple(ydims),
                    step=reduced.inner,
                    index_dtype=_index_dtype(node_shape(x)[dim]),
                )
            )
    return found


# ----------------------------------------------------------------------------------------------
# replacement functions (traced by make_fx in stage 3)


def _broadcast_matmul_fn(pattern: BroadcastMatmul, other_shape: tuple[int, ...]) -> Callable[..., tuple[torch.Tensor]]:
    shape, broadcast, side = pattern.shape, pattern.broadcast, pattern.side
    nb = len(shape) - 2
    real = [i for i in range(nb) if i not in broadcast]
    n_real, n_broad = math.prod(shape[i] for i in real), math.prod(shape[i] for i in broadcast)
    batch = list(shape[:nb])
    total = math.prod(batch)

    def right_broadcast(other: torch.Tensor, small: torch.Tensor) -> tuple[torch.Tensor]:
        m, k, n = other_shape[1], shape[-2], shape[-1]
        weight = small.reshape(n_real, k, n)
        perm = real + list(broadcast) + [nb, nb + 1]
        rows = other.reshape(*batch, m, k).permute(perm).reshape(n_real, n_broad * m, k)
        out = torch.bmm(rows, weight).reshape(*[shape[i] for i in real], *[shape[i] for i in broadcast], m, n)
        return (out.permute(_argsort(perm)).reshape(total, m, n),)

    def left_broadcast(small: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor]:
        m, k, n = shape[-2], shape[-1], other_shape[2]
        weight = small.reshape(n_real, m, k)
        perm = real + [nb] + list(broadcast) + [nb + 1]  # (real..., K, broadcast..., N)
        cols = other.reshape(*batch, k, n).permute(perm).reshape(n_real, k, n_broad * n)
        out = torch.bmm(weight, cols).reshape(*[shape[i] for i in real], m, *[shape[i] for i in broadcast], n)
        order = real + [nb] + list(broadcast) + [nb + 1]  # which logical dim each axis of ``out`` is
        return (out.permute(_argsort(order)).reshape(total, m, n),)

    if side == 1:
        return lambda other, small: right_broadcast(other, small)
    return lambda other, small: left_broadcast(small, other)


def _argsort(order: Sequence[int]) -> list[int]:
    return sorted(range(len(order)), key=lambda i: order[i])


class _MatmulMaxFunction(torch.autograd.Function):
    """Forward: the product, the view chain and the max, keeping narrow indices. Backward: gathers."""

    @staticmethod
    def forward(ctx: Any, left: torch.Tensor, right: torch.Tensor, spec: "_MaxSpec") -> tuple[torch.Tensor, torch.Tensor]:
        product = torch.bmm(left, right) if spec.pattern.batched else torch.mm(left, right)
        x = spec.replay(product)
        reduce = torch.max if spec.pattern.kind == "max" else torch.min
        values, indices = reduce(x, spec.pattern.dim, spec.pattern.keepdim)
        ctx.save_for_backward(left, right, indices.to(spec.pattern.index_dtype))
        ctx.spec = spec
        ctx.mark_non_differentiable(indices)
        return values, indices

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_indices: torch.Tensor) -> tuple[Any, ...]:
        left, right, small = ctx.saved_tensors
        pattern: MatmulMax = ctx.spec.pattern
        index = small
        if pattern.keepdim:
            grad, index = grad.squeeze(pattern.dim), index.squeeze(pattern.dim)
        a, b = (right.transpose(-1, -2), left.transpose(-1, -2)) if pattern.rows else (left, right)
        if not pattern.batched:
            a, b = a.unsqueeze(0), b.unsqueeze(0)
        grad_a, grad_b = _gather_grads(a, b, grad, index, pattern, ctx.spec.device)
        if not pattern.batched:
            grad_a, grad_b = grad_a.squeeze(0), grad_b.squeeze(0)
        if pattern.rows:
            grad_a, grad_b = grad_b.transpose(-1, -2), grad_a.transpose(-1, -2)
        return grad_a, grad_b, None


_COORD_BLOCK = 512  # entries whose int64 coordinates the operator holds at once (8 KiB of workspace)


def _coordinate_block(entries: int, device: torch.device) -> int:
    """Entries ``memplan::grouped_addmm_`` takes per block: :data:`_COORD_BLOCK` on a CPU, where a block's
    work (a row of the dense operand per entry) outweighs its half-dozen dispatches; all of them on a
    GPU, where one block's dispatches (about 50 us from Python) cost more than a hundred thousand
    entries' work, and the workspace (16 bytes an entry) stays below the entries' columns and values
    together (8 to 16 bytes an entry) unless those are half precision."""
    if device.type == "cuda":
        return max(1, entries)
    return max(1, min(entries, _COORD_BLOCK))  # (an empty product still gets a workspace)


def _gather_grads(a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, pattern: MatmulMax,
                  device: torch.device):
    """Gradients of ``y = max over a factor of the columns of a @ b`` from the kept indices.

    ``a`` is ``(Bt, R, K)``, ``b`` is ``(Bt, K, C)``; ``grad`` and ``index`` (the narrow indices as
    saved) have the shape of ``y``. Each element of ``y`` selected one entry of the product: row ``r``
    of ``a`` against column ``c`` of ``b``. Its gradient adds ``grad * b[:, c]`` to row ``r`` of
    ``grad_a`` and ``grad * a[r]`` to column ``c`` of ``grad_b``: two products of the same sparse
    selection matrix (one entry per element of ``y``, grouped by row of ``a``) with a dense operand,
    ``memplan::grouped_addmm_``, whose only temporaries are the entries' columns, values and
    coordinates. ``device``: the one the plan runs on (the trace's may be a stand-in for it).
    """
    batch, rows_n, k = a.shape
    cols_n = b.shape[2]
    ydims = pattern.ydims
    rank = grad.dim()

    def coordinate(e: int, scale: int) -> torch.Tensor | None:
        """``scale`` times the index along canonical product dimension ``e`` (None: always zero)."""
        total = None
        for y, (d, inner, n) in enumerate(ydims):
            if d == e:
                shape = [1] * rank
                shape[y] = n
                term = torch.arange(0, n * inner * scale, inner * scale, device=grad.device).view(shape)
                total = term if total is None else total + term
        return total

    # entries in the order of a's rows (the kept dimensions, batch factors first, each by falling
    # stride), the selections of one row together: entry e belongs to row e // (selections per row)
    summed = [y for y, (d, _, _) in enumerate(ydims) if d not in (0, 1)]
    kept = sorted((y for y in range(rank) if y not in summed), key=lambda y: (ydims[y][0], -ydims[y][1]))
    order = kept + summed
    per_row = math.prod(grad.shape[y] for y in summed)
    # the column of b each kept index selects, flattened over the batch, in int32 where it fits (the
    # operator's fast path, and half the bytes); the offsets, small, are summed first, then added to the
    # narrow indices in one broadcast add that widens them; terms that are zero are left out (each is
    # one op less in every chunk of a loop that runs this backward)
    cols_dtype = torch.int32 if batch * cols_n < 2**31 else torch.int64
    offsets = None
    for offset in (coordinate(0, cols_n), coordinate(2, 1)):
        if offset is not None:
            offsets = offset.to(cols_dtype) if offsets is None else offsets + offset.to(cols_dtype)
    selected = index.to(cols_dtype) * pattern.step if pattern.step != 1 else index
    cols = selected.to(cols_dtype) if offsets is None else offsets + selected
    # (contiguous: a reshape of a one-dimensional broadcast is a view with stride 0; the gradient's
    # values are copied: ``contiguous()`` is traced over the fake gradient's layout, where it may be a
    # no-op, and the gradient that reaches the plan can be a broadcast that the trace's was not, the
    # one of ``out.sum()``; the columns are made from the saved indices, laid out as in the trace)
    cols = cols.expand(grad.shape).permute(order).reshape(-1).contiguous()
    values = grad.permute(order).reshape(-1).clone(memory_format=torch.contiguous_format)
    a_rows = a.reshape(batch * rows_n, k)
    b_rows = b.transpose(1, 2).reshape(batch * cols_n, k)
    block = _coordinate_block(cols.shape[0], device)
    grad_a = torch.zeros(batch * rows_n, k, dtype=a.dtype, device=a.device)
    workspace = torch.empty(2, block, dtype=torch.int64, device=a.device)
    grad_a = grouped_addmm_(grad_a, cols, values.to(a.dtype), b_rows, per_row, False, workspace)
    grad_bt = torch.zeros(batch * cols_n, k, dtype=b.dtype, device=b.device)
    workspace = torch.empty(2, block, dtype=torch.int64, device=a.device)
    grad_bt = grouped_addmm_(grad_bt, cols, values.to(b.dtype), a_rows, per_row, True, workspace)
    return grad_a.view(batch, rows_n, k), grad_bt.view(batch, cols_n, k).transpose(1, 2)


@dataclasses.dataclass(frozen=True)
class _MaxSpec:
    pattern: MatmulMax
    steps: tuple[tuple[Callable[..., Any], tuple, dict], ...]  # the view chain, replayed on the product
    device: torch.device  # the device the plan runs on

    def replay(self, value: torch.Tensor) -> torch.Tensor:
        for target, args, kwargs in self.steps:
            value = target(value, *args, **kwargs)
        return value


def _matmul_max_fn(pattern: MatmulMax, graph: CapturedGraph) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    steps = tuple((n.target, tuple(n.args[1:]), dict(n.kwargs)) for n in (graph.node(c) for c in pattern.chain))
    spec = _MaxSpec(pattern, steps, run_device(graph))
    return lambda left, right: _MatmulMaxFunction.apply(left, right, spec)


# ----------------------------------------------------------------------------------------------
# (c) broadcast products: explicit broadcasts evaluated unexpanded

# Reductions a broadcast product may end in: ``(name, overload) -> (dims argument, keepdim argument)``
# positions. Each reduces only the dimensions it names.
_REDUCTIONS = {
    ("sum", "dim_IntList"): (1, 2),
    ("mean", "dim"): (1, 2),
    ("amax", "default"): (1, 2),
    ("amin", "default"): (1, 2),
    ("logsumexp", "default"): (1, 2),
    ("linalg_vector_norm", "default"): (2, 3),
}


@dataclasses.dataclass(frozen=True)
class BroadcastProduct:
    """Values built from explicit broadcasts (``expand``) by pointwise ops and by reductions over
    dimensions that are not broadcast, evaluated on the unexpanded values: each op at the broadcast of
    its operands' real extents, and a ``sum`` over a product of two broadcasts as one ``einsum`` (a
    matrix product). ``F.cosine_similarity(z[:, None], z[None], dim=-1)`` expands both sides to
    ``(B, B, D)`` and takes norms and quotients there; evaluated unexpanded, the norms and quotients are
    ``(B, 1, D)`` and ``(1, B, D)`` and the similarity one ``(B, B)`` product, in the forward and in the
    backward.

    ``shapes`` holds, for each node of ``nodes``, the extents it is evaluated at (1 where broadcast);
    ``contractions`` the ``sum`` nodes computed as an einsum of their product's operands (the product
    itself is not computed); ``outputs`` the values read outside, expanded back where they were
    broadcast."""

    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    contractions: tuple[str, ...]
    before: int  # elements of the largest value the region makes, as written
    after: int  # the same, evaluated unexpanded

    def claimed(self) -> set[str]:
        return set(self.nodes)

    def replacement(self, graph: CapturedGraph) -> Replacement:
        return Replacement(self.nodes, self.inputs, self.outputs, _broadcast_product_fn(self, graph), self.outputs[-1])

    def __str__(self) -> str:
        fused = f", {len(self.contractions)} product(s) as einsum" if self.contractions else ""
        return (f"broadcast product {self.outputs[-1]}: {len(self.nodes)} ops evaluated unexpanded{fused} "
                f"(largest value {self.before} -> {self.after} elements)")


def _reduction(node: torch.fx.Node) -> tuple[tuple[int, ...], bool] | None:
    """The dimensions (non-negative) a supported reduction reduces, and its keepdim; None otherwise."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    spec = _REDUCTIONS.get((packet_name(node), node.target._overloadname))
    if spec is None:
        return None
    dims_at, keep_at = spec
    schema = node.target._schema.arguments
    if set(node.kwargs) - {schema[dims_at].name, schema[keep_at].name}:
        return None  # a dtype or an out argument
    dims = node.args[dims_at] if len(node.args) > dims_at else node.kwargs.get(schema[dims_at].name)
    keepdim = node.args[keep_at] if len(node.args) > keep_at else node.kwargs.get(schema[keep_at].name, False)
    if len(node.args) > keep_at + 1 or not isinstance(dims, (list, tuple)) or not dims:
        return None
    rank = len(node_shape(node.args[0]))
    if rank == 0 or any(not isinstance(d, int) or not -rank <= d < rank for d in dims):
        return None
    return tuple(sorted({d % rank for d in dims})), bool(keepdim)


def _pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
            and torch.Tag.nondeterministic_seeded not in target.tags)


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The tensor arguments of ``node`` (all top-level); None when a list holds one."""
    found = []
    for arg in [*node.args, *node.kwargs.values()]:
        if isinstance(arg, torch.fx.Node):
            if isinstance(arg.meta.get("val"), torch.Tensor):
                found.append(arg)
            elif arg.meta.get("val") is not None:
                return None
        elif isinstance(arg, (list, tuple)) and any(isinstance(a, torch.fx.Node) for a in arg):
            return None
    return found


def _aligned(shape: Sequence[int], rank: int) -> tuple[int, ...]:
    return (1,) * (rank - len(shape)) + tuple(shape)


def _contraction_shape(p: tuple[int, ...], q: tuple[int, ...], full: tuple[int, ...],
                       dims: tuple[int, ...], keepdim: bool) -> tuple[int, ...] | None:
    """The evaluated shape of ``sum(p * q, dims)`` computed as an einsum; None when a summed dimension
    is broadcast on both sides (the sum would be a multiple of one term)."""
    out = []
    for d, (a, b) in enumerate(zip(p, q)):
        if d in dims:
            if a == 1 and b == 1 and full[d] > 1:
                return None
            if keepdim:
                out.append(1)
        else:
            out.append(max(a, b))
    return tuple(out)


def _find_broadcast_products(graph: CapturedGraph) -> list[BroadcastProduct]:
    forward = forward_nodes(graph)
    shapes: dict[torch.fx.Node, tuple[int, ...]] = {}  # extents each region node is evaluated at
    fused: dict[torch.fx.Node, torch.fx.Node] = {}  # sum -> the product it contracts
    writers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in forward:
        for target in mutated_args(node):
            writers.setdefault(target, []).append(node)
    written = set(writers)
    for node in forward:
        name = packet_name(node)
        if name not in ("expand", "sum") and not any(a in shapes for a in node.all_input_nodes):
            continue  # (the common case, first: most nodes read no broadcast)
        full = node_shape(node)
        if not isinstance(node.meta.get("val"), torch.Tensor) or not full:
            continue
        if name == "expand":
            source = node.args[0]
            if source in written or not isinstance(source.meta.get("val"), torch.Tensor):
                continue
            small = _aligned(node_shape(source), len(full))
            if small != full and all(s in (1, f) for s, f in zip(small, full)):
                shapes[node] = small
            continue
        args = _tensor_args(node)
        if not args:
            continue
        reduced = _reduction(node)
        if reduced is not None and len(args) == 1 and name == "sum":
            # a sum over a product of two smaller (broadcast) operands: one einsum
            product = args[0]
            pair = _tensor_args(product) if product.target is torch.ops.aten.mul.Tensor and len(product.users) == 1 else None
            if pair is not None and len(pair) == 2 and product not in written and all(
                    a.meta["val"].dtype == product.meta["val"].dtype and a.meta["val"].is_floating_point() for a in pair):
                rank = len(node_shape(product))
                sides = [shapes.get(a, _aligned(node_shape(a), rank)) for a in pair]
                if len(sides[0]) == len(sides[1]) == rank and math.prod(node_shape(product)) > max(math.prod(x) for x in sides):
                    got = _contraction_shape(*sides, node_shape(product), *reduced)
                    if got is not None:
                        shapes.setdefault(product, node_shape(product))
                        shapes[node] = got
                        fused[node] = product
                        continue
        if not any(a in shapes for a in args):
            continue
        extents = [shapes.get(a, _aligned(node_shape(a), len(full))) for a in args]
        if reduced is not None and len(args) == 1:
            dims, keepdim = reduced
            (inner,) = extents
            if any(inner[d] != node_shape(args[0])[d] for d in dims):
                continue  # a broadcast dimension reduced: not the same op on the unexpanded value
            shapes[node] = tuple(1 if d in dims else s for d, s in enumerate(inner) if keepdim or d not in dims)
            continue
        if not _pointwise(node) or any(len(e) > len(full) for e in extents):
            continue
        out = tuple(max(e[d] for e in (_aligned(x, len(full)) for x in extents)) for d in range(len(full)))
        target = mutated_args(node)
        if target:
            # in place: into a copy the region made (``clamp_min_`` of a cloned norm), at its extents
            if len(target) != 1 or target[0] not in shapes or packet_name(target[0]) != "clone" or shapes[target[0]] != out:
                continue
        shapes[node] = out
    # Components: region nodes joined by reading one another, each in graph order.
    members = [n for n in forward if n in shapes]
    if not members:
        return []
    import networkx as nx  # here: most graphs have no broadcast to group

    joined = nx.Graph()
    joined.add_nodes_from(members)
    joined.add_edges_from((arg, node) for node in members for arg in node.all_input_nodes if arg in shapes)
    position = {n: i for i, n in enumerate(members)}
    components = sorted((sorted(c, key=position.__getitem__) for c in nx.connected_components(joined)),
                        key=lambda c: position[c[0]])
    found = []
    for nodes in components:
        pattern = _broadcast_product(graph, nodes, shapes, fused, writers)
        if pattern is not None:
            found.append(pattern)
    return found


def _broadcast_product(graph, nodes, shapes, fused, writers) -> BroadcastProduct | None:
    region = set(nodes)
    # Values written in place: a copy the region made, by the region, or a result the region hands on
    # whole and no longer reads; an input or another region value written elsewhere would be read
    # before or after the write depending on where the region runs.
    for node in nodes:
        if node not in writers:
            continue
        own_copy = packet_name(node) == "clone" and all(w in region for w in writers[node])
        handed_on = shapes[node] == node_shape(node) and not any(w in region or u in region for w in writers[node] for u in node.users)
        if not (own_copy or handed_on):
            return None
    skipped = {p for s, p in fused.items() if s in region}
    if any(p not in region or any(u is not s for u in p.users) for s, p in fused.items() if s in region):
        return None
    inputs: list[torch.fx.Node] = []
    outputs: list[torch.fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in region and arg not in inputs:
                if arg in writers:
                    return None
                inputs.append(arg)
        readers = [u for u in node.users if u not in region and (u.op == "output" or graph.phases.get(u.name) is Phase.FORWARD)]
        if readers:
            if node in skipped:
                return None
            if shapes[node] != node_shape(node):
                value = node.meta["val"]
                if packet_name(node) == "expand" or tuple(value.stride()) != tuple(torch.empty(node_shape(node), device="meta").stride()):
                    return None  # expanded back, the value would be laid out otherwise
            outputs.append(node)
    if not outputs:
        return None
    computed = [n for n in nodes if n not in skipped and packet_name(n) != "expand"]
    before = max((math.prod(node_shape(n)) for n in nodes if packet_name(n) != "expand"), default=0)
    after = max([math.prod(shapes[n]) for n in computed]
                + [math.prod(node_shape(n)) for n in outputs if shapes[n] != node_shape(n) and packet_name(n) != "expand"], default=0)
    if before < 2 * max(after, 1):
        return None
    return BroadcastProduct(
        nodes=tuple(n.name for n in nodes), inputs=tuple(n.name for n in inputs), outputs=tuple(n.name for n in outputs),
        shapes=tuple(shapes[n] for n in nodes), contractions=tuple(n.name for n in nodes if n in fused),
        before=before, after=after,
    )


def _einsum(p: torch.Tensor, q: torch.Tensor, dims: tuple[int, ...], out_shape: tuple[int, ...]) -> torch.Tensor:
    """``(p * q).sum(dims)`` (``p`` and ``q`` of one rank, broadcasting) as one einsum, shaped ``out_shape``."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    rank = p.dim()
    left = "".join(letters[d] for d in range(rank) if p.shape[d] > 1)
    right = "".join(letters[d] for d in range(rank) if q.shape[d] > 1)
    kept = "".join(letters[d] for d in range(rank) if d not in dims and max(p.shape[d], q.shape[d]) > 1)
    squeezed_p = p.reshape([s for s in p.shape if s > 1])
    squeezed_q = q.reshape([s for s in q.shape if s > 1])
    return torch.einsum(f"{left},{right}->{kept}", squeezed_p, squeezed_q).reshape(out_shape)


def _broadcast_product_fn(pattern: BroadcastProduct, graph: CapturedGraph) -> Callable[..., tuple[torch.Tensor, ...]]:
    nodes = [graph.node(n) for n in pattern.nodes]
    extents = dict(zip(pattern.nodes, pattern.shapes))
    product_of = {n: graph.node(n).args[0] for n in pattern.contractions}  # sum -> the product it contracts
    skipped = {p.name for p in product_of.values()}
    full = {n.name: node_shape(n) for n in nodes}  # the products are region nodes too
    steps = [(n.name, packet_name(n), n.target, n.args, n.kwargs, _reduction(n) if n.name in product_of else None)
             for n in nodes if n.name not in skipped]

    def fn(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env: dict[str, Any] = dict(zip(pattern.inputs, values))

        def get(arg):
            return env[arg.name] if isinstance(arg, torch.fx.Node) else arg

        for name, kind, target, args, kwargs, reduced in steps:
            if kind == "expand":
                value = env[args[0].name]
                env[name] = value.reshape(_aligned(value.shape, len(full[name])))
            elif reduced is not None:
                product = product_of[name]
                rank = len(full[product.name])
                p, q = (env[a.name].reshape(_aligned(env[a.name].shape, rank)) for a in product.args[:2])
                env[name] = _einsum(p, q, reduced[0], extents[name])
            else:
                env[name] = target(*[get(a) for a in args], **{k: get(v) for k, v in kwargs.items()})
        results = []
        for name in pattern.outputs:
            value = env[name]
            if tuple(value.shape) != full[name]:
                value = value.expand(full[name]).contiguous()
            results.append(value)
        return tuple(results)

    return fn


# ----------------------------------------------------------------------------------------------
# plan and apply


def _with_state(graph: CapturedGraph, state: dict) -> CapturedGraph:
    """``graph`` with the phases, sources, sequence numbers and outputs being edited in ``state``."""
    return dataclasses.replace(graph, phases=dict(state["phases"]), sources=dict(state["sources"]),
                               seq_nr=dict(state["seq_nr"]), outputs=state["outputs"])


def _write_out_of_place(graph: CapturedGraph, patterns: Sequence[SavedBeforeWrite], state: dict) -> list[SavedBeforeWrite] | None:
    """Run each in-place write whose input autograd copied first out of place (see
    :mod:`~memplan.passes._rewrite.saved_before_write`); the patterns applied, or None when that raised
    the graph's simulated peak (the storage the copy's readers now read may live longer than the copy
    did), the graph then edited: the caller starts again without them."""
    live = {n.name for n in graph.gm.graph.nodes}
    patterns = [p for p in patterns if {p.clone, p.write, p.value} <= live]  # not erased by a region rewrite
    if not patterns:
        return []

    before = AnalysisManager(_with_state(graph, state)).get(PeakSimulation).peak
    apply_saved_before_write(_with_state(graph, state), patterns, state)
    if AnalysisManager(_with_state(graph, state)).get(PeakSimulation).peak > before:
        return None
    return list(patterns)


def _remake_dropouts(graph: CapturedGraph, patterns: Sequence[DropoutFromMask], state: dict) -> list[DropoutFromMask]:
    """Make each dropout's output again in the backward from its mask (see
    :mod:`~memplan.passes._rewrite.dropout_mask`); kept only if the graph's simulated peak does not rise."""
    live = {n.name: n for n in graph.gm.graph.nodes}
    patterns = [p for p in patterns if {p.dropout, p.out, p.mask, p.input} <= set(live)]

    def undo(made: list[torch.fx.Node]) -> None:
        for pattern, again in zip(patterns, made):
            again.replace_all_uses_with(live[pattern.out])
            graph.gm.graph.erase_node(again)
            for key in ("phases", "sources", "seq_nr"):
                state[key].pop(again.name, None)

    return _kept_unless_peak_rises(graph, state, patterns,
                                   lambda: apply_dropout_from_mask(_with_state(graph, state), list(patterns), state), undo)


def _remade_in_backward(graph: CapturedGraph, state: dict, patterns: Sequence[NoiseReplay | NormOutput],
                        apply: Callable[..., list], undo: Callable[[list], None]) -> list:
    """Remake each pattern's value in the backward (rewrites (i), dropout's noise drawn again:
    :mod:`~memplan.passes._rewrite.noise_replay`, and (j), batch norm's output:
    :mod:`~memplan.passes._rewrite.norm_output`); kept only if the graph's simulated peak does not rise."""
    live = {n.name for n in graph.gm.graph.nodes}
    patterns = [p for p in patterns if p.claimed() <= live]
    return _kept_unless_peak_rises(graph, state, patterns,
                                   lambda: apply(_with_state(graph, state), list(patterns), state), undo)


def _clone_oversized(graph: CapturedGraph, patterns: Sequence[OversizedResult], state: dict) -> list[OversizedResult]:
    """Clone each oversized result out of its storage (see :class:`OversizedResult`); the clones are kept
    only if they do not raise the graph's simulated peak (a clone made at the peak adds its bytes there)."""
    live = {n.name: n for n in graph.gm.graph.nodes}
    patterns = [p for p in patterns if p.node in live]  # not erased by a region rewrite before
    outputs = state["outputs"]

    def undo(copies: list[torch.fx.Node]) -> None:
        for pattern, copy in zip(patterns, copies):
            copy.replace_all_uses_with(live[pattern.node])
            graph.gm.graph.erase_node(copy)
            for key in ("phases", "sources"):
                state[key].pop(copy.name, None)
        state["outputs"] = outputs

    return _kept_unless_peak_rises(graph, state, patterns,
                                   lambda: [_clone_out(graph, live[p.node], state) for p in patterns], undo)


def _kept_unless_peak_rises(graph: CapturedGraph, state: dict, patterns: list, apply: Callable[[], Any],
                            undo: Callable[[Any], None]) -> list:
    """``patterns`` after ``apply()`` edits the graph, or none after ``undo`` of what it returned when the
    graph's simulated peak rose."""
    if not patterns:
        return []
    before = AnalysisManager(_with_state(graph, state)).get(PeakSimulation).peak
    made = apply()
    if AnalysisManager(_with_state(graph, state)).get(PeakSimulation).peak <= before:
        return list(patterns)
    undo(made)
    return []


def _clone_out(graph: CapturedGraph, node: torch.fx.Node, state: dict) -> torch.fx.Node:
    """Read a clone of ``node`` everywhere it was read (the graph's outputs included); return the clone."""
    with graph.gm.graph.inserting_after(node):
        copy = graph.gm.graph.call_function(torch.ops.aten.clone.default, (node,))
    copy.meta["val"] = fake_call(torch.ops.aten.clone.default, (node,), {}, fake_mode_of(graph.gm.graph))
    for key in ("phases", "sources"):
        if node.name in state[key]:
            state[key][copy.name] = state[key][node.name]
    node.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
    state["outputs"] = tuple(dataclasses.replace(s, node=copy.name) if s.node == node.name else s
                             for s in state["outputs"])
    return copy


def _replace_local(graph: CapturedGraph, pattern: Rewrite, state: dict) -> bool:
    """Apply a backward peephole in place: new nodes right before the add, which they replace."""
    gm = graph.gm
    add = graph.node(pattern.add)
    mode = fake_mode_of(gm.graph)
    if isinstance(pattern, ScatterIntoZeros):
        scatter = graph.node(pattern.scatter)
        _, dim, index, src = scatter.args[:4]
        steps = [(torch.ops.aten.scatter_add.default, (graph.node(pattern.other), dim, index, src))]
        dead = [add, scatter, graph.node(pattern.zeros)]
    else:
        even, odd = graph.node(pattern.even), graph.node(pattern.odd)
        dim = even.args[2] % len(even.args[1])
        steps = [(torch.ops.aten.stack.default, ([even.args[0], odd.args[0]], dim + 1)),
                 (torch.ops.aten.view.default, (None, list(even.args[1])))]
        dead = [add, even, odd]
    value = None
    with gm.graph.inserting_before(add):
        for target, args in steps:
            if args[0] is None:
                args = (value, *args[1:])
            value = gm.graph.call_function(target, args)
            value.meta["val"] = fake_call(target, args, {}, mode)
            state["phases"][value.name] = graph.phases[add.name]
            if add.name in graph.seq_nr:
                state["seq_nr"][value.name] = graph.seq_nr[add.name]
            if add.name in graph.sources:
                state["sources"][value.name] = graph.sources[add.name]
    add.replace_all_uses_with(value)
    for node in dead:
        gm.graph.erase_node(node)
    return True


# Stage 1's finders, in the order their patterns claim nodes (a node goes to the first pattern that
# claims it). Region rewrites first (they remove the most), backward peepholes, then oversized results.
_FINDERS: tuple[Callable[[CapturedGraph], Sequence[Rewrite]], ...] = (
    find_attention,
    find_linear_cross_entropy,
    _find_broadcast_matmuls,
    _find_matmul_max,
    _find_broadcast_products,
    _find_scatter_into_zeros,
    _find_interleaved_slices,
    find_saved_before_write,
    find_dropout_from_mask,
    find_noise_replay,
    find_norm_outputs,
    _find_oversized_results,
)


@dataclasses.dataclass(frozen=True)
class RewriteOptions:
    """Options of the pass (``ctx.options`` keys ``"rewrite.<field>"``).

    Attributes
    ----------
    noise_replay : bool
        Rewrite (i): dropout's noise drawn again in the backward from the generator's state. On by
        default; off under ``inductor=True`` (see :mod:`memplan.inductor`).
    norm_output : bool
        Rewrite (j): batch norm's output made again in the backward from its input.
    """

    noise_replay: bool = True
    norm_output: bool = True

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "RewriteOptions":
        return pass_options(cls, "rewrite", options)


def plan_rewrite(graph: CapturedGraph, options: RewriteOptions = RewriteOptions()) -> RewritePlan:
    """Stage 1: the patterns found in ``graph`` (pure).

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> w = torch.randn(8, 16, 16)
    >>> g = capture(lambda x: x.view(32, 8, 1, 16) @ w, torch.randn(32, 128, requires_grad=True))
    >>> [type(r).__name__ for r in plan_rewrite(g).rewrites]
    ['BroadcastMatmul']
    """
    # Step 1: the patterns, each node in at most one.
    found: list[Rewrite] = []
    taken: set[str] = set()
    finders = [find for find in _FINDERS if (options.noise_replay or find is not find_noise_replay)
               and (options.norm_output or find is not find_norm_outputs)]
    for pattern in (p for find in finders for p in find(graph)):
        nodes = pattern.claimed()
        if nodes & taken:
            continue
        taken |= nodes
        found.append(pattern)
    return RewritePlan(tuple(found))


def apply_rewrite(graph: CapturedGraph, plan: RewritePlan) -> tuple[CapturedGraph, tuple[Rewrite, ...]]:
    """Stages 2-4: a new graph with the plan's rewrites applied, and the rewrites that applied."""
    if not plan.rewrites:
        return graph, ()
    original, graph = graph, copy_graph(graph)
    state = {"phases": dict(graph.phases), "sources": dict(graph.sources), "seq_nr": dict(graph.seq_nr),
             "outputs": graph.outputs}
    done: list[Rewrite] = []
    live = {n.name for n in graph.gm.graph.nodes}
    for pattern in plan.rewrites:
        if isinstance(pattern, (OversizedResult, SavedBeforeWrite, DropoutFromMask, NoiseReplay, NormOutput)):
            continue  # last, on the graph the other rewrites leave
        current = _with_state(graph, state)
        if isinstance(pattern, (ScatterIntoZeros, InterleavedSlices)):
            if _replace_local(current, pattern, state):
                done.append(pattern)
            continue
        try:
            r = pattern.replacement(graph)
        except KeyError:
            continue  # it reads a node an earlier rewrite replaced (an attention's output, erased)
        if any(name not in live for name in r.inputs):
            continue
        if replace_region(current, r.region, r.inputs, r.outputs, r.fn, r.anchor, state):
            done.append(pattern)
            live = {n.name for n in graph.gm.graph.nodes}
    applied = _write_out_of_place(graph, [p for p in plan.rewrites if isinstance(p, SavedBeforeWrite)], state)
    if applied is None:  # they raised the peak: the plan without them, on a fresh copy
        return apply_rewrite(original, RewritePlan(tuple(p for p in plan.rewrites if not isinstance(p, SavedBeforeWrite))))
    done += applied
    done += _remake_dropouts(graph, [p for p in plan.rewrites if isinstance(p, DropoutFromMask)], state)
    done += _remade_in_backward(graph, state, [p for p in plan.rewrites if isinstance(p, NoiseReplay)],
                                apply_noise_replay, undo_remade)
    done += _remade_in_backward(graph, state, [p for p in plan.rewrites if isinstance(p, NormOutput)],
                                apply_norm_outputs, undo_remade)
    done += _clone_oversized(graph, [p for p in plan.rewrites if isinstance(p, OversizedResult)], state)
    graph.gm.recompile()
    live = {n.name for n in graph.gm.graph.nodes}
    graph = dataclasses.replace(
        graph,
        phases={k: v for k, v in state["phases"].items() if k in live},
        sources={k: v for k, v in state["sources"].items() if k in live},
        library_sources={k: v for k, v in graph.library_sources.items() if k in live},
        modules={k: v for k, v in graph.modules.items() if k in live},
        seq_nr={k: v for k, v in state["seq_nr"].items() if k in live},
        outputs=state["outputs"],
    )
    return graph, tuple(done)


def _variants(graph: CapturedGraph, options: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The pipeline is also planned without rewrite (j) where it would act and the user left it to
    memplan: remaking batch norms' outputs can leave ``remat`` nothing to gain, where remat's own cuts
    through them (it recomputes a batch norm without its running statistics) reach lower, and on other
    models (j) is the lower plan (see :meth:`~memplan.pipeline.PassManager.run`)."""
    if "rewrite.norm_output" in options or not graph.training or not find_norm_outputs(graph):
        return []
    return [{"rewrite.norm_output": False}]


@register_pass("rewrite", options=RewriteOptions.from_mapping, variants=_variants)
def rewrite(graph: CapturedGraph, ctx: PassContext) -> PassResult:
    """Rewrite broadcast matmuls, matmul+max regions, broadcast products, oversized results, vocabulary
    heads with their cross-entropy, copies saved before in-place writes, and attention written out (see
    the module docstring)."""
    plan = plan_rewrite(graph, RewriteOptions.from_mapping(ctx.options))
    # the rewrites that add time (a head's chunks recompute its product) are priced and chosen by the
    # policy, on graphs built with them; the plan chosen is not built twice
    built: dict[tuple[Rewrite, ...], tuple[CapturedGraph, tuple[Rewrite, ...]]] = {}

    def build(patterns: Sequence[Rewrite]) -> tuple[CapturedGraph, tuple[Rewrite, ...]]:
        if tuple(patterns) not in built:
            built[tuple(patterns)] = apply_rewrite(graph, RewritePlan(tuple(patterns)))
        return built[tuple(patterns)]

    plan = RewritePlan(admit(graph, plan.rewrites, ctx, build))
    if not plan.rewrites:
        return PassResult(graph, changed=False, plan=plan)
    new, done = built[plan.rewrites] if plan.rewrites in built else apply_rewrite(graph, plan)
    if not done:
        return PassResult(graph, changed=False, plan=RewritePlan())
    before = ctx.am.get(PeakSimulation).peak
    after = AnalysisManager(new).get(PeakSimulation).peak
    applied = RewritePlan(done)
    return PassResult(
        new,
        changed=True,
        stats=PassStats(nodes_rewritten=len(done), bytes_saved=max(0, before - after)),
        notes=tuple(str(r) for r in done),
        plan=applied,
    )
