"""A vocabulary head and its loss, chunked so that the full logits never exist.

What it does
------------
A language model's last ops are a linear head and a cross-entropy over the vocabulary:
``F.cross_entropy(h @ W.T + b, y)``. Eager (and the captured graph) builds the logits, ``N x V`` for
``N`` tokens and a vocabulary of ``V``, then their log-softmax, of the same size, which it keeps for the
backward, and in the backward a gradient of that size again (three, with label smoothing). With
``V = 50257`` these are the largest tensors of a small model's step. This rewrite (the idea of Liger's
fused linear cross-entropy and of Apple's Cut Cross-Entropy) replaces the head, its log-softmax and the
loss by one function traced through autograd (:class:`_LinearCrossEntropyFunction`), which works on one
chunk of the logits at a time: rows of tokens, or columns of the vocabulary (see
:class:`LinearCrossEntropy`):

* forward: per chunk, the logits and their logsumexp (combined over chunks of the vocabulary with
  ``logaddexp``), and the row sums a smoothing term reads; the targets' logits once, one dot product
  per token; the loss from those. It saves the head's inputs (already alive) and one logsumexp per
  token (``N`` floats): no logits, no log-probabilities;
* backward: per chunk, the logits again (the one extra matrix product this costs), then in their
  buffer, in place, ``softmax * scale + shift`` (the incoming gradients over the reduction's divisor,
  class weights, ignored tokens zero, smoothing, a z-loss), multiplied into ``d h``, ``d W`` and ``d b``;
  the targets' one-hot part goes into those once. No gradient is computed in the forward, so a
  ``retain_graph`` backward runs again as eager's does.

Stages
------
(1) :func:`find_linear_cross_entropy`, from the graph's structure only: a forward ``_log_softmax`` over
    the last dimension of a 2-d value ``X`` (``N' x V``), where ``X`` is a chain of views, slices,
    copies and dtype casts of a ``mm``/``addmm`` product ``P`` (``N x V``) that keeps the vocabulary as the
    last dimension (:func:`_row_program`: each op moves whole rows), and where every forward reader of
    ``P``, of the chain, of ``X`` and of the log-probabilities is one of the terms this rewrite
    computes (:class:`Nll`, :class:`RowSum`, :class:`LogSumExp`). A pattern is found with a chunk
    count from the graph's sizes alone (:func:`initial_chunks`), what ``apply_rewrite`` uses when no
    policy admits it.
(2) :func:`admit` (the pass, with its policy and rates): each head is chunked along the axis whose
    chunks re-read the smaller operand (:func:`chunk_axis`); it is applied with one chunk and with two,
    and the fall of the head's own simulated peak (the most bytes alive at once in the storages its
    new nodes make: chunks and gradients) between them gives the chunk count beyond which doubling
    gains less than :data:`MIN_GAIN` of it (:func:`chunk_count`), halved while the time allowance does
    not cover it. That variant is priced
    by the time model (:func:`~memplan.analysis.cost.graph_cost`: the extra matrix product, the chunks'
    ops and traffic) and simulated (``PeakSimulation``); the policy takes it or leaves the graph as it
    is, never a variant with a higher step peak.
(3)-(4) :func:`~memplan.passes._rewrite.region.replace_region` traces the function's forward with its
    backward and inlines both.

Forms recognised
----------------
* The head: ``mm`` or ``addmm`` (``nn.Linear``, ``h @ emb.weight.T``, ``torch.matmul`` of a 3-d ``h``),
  the bias a vector over the vocabulary.
* Between the product and the log-softmax, ops that move whole rows: ``view``/``_unsafe_view``/
  ``reshape`` that keep the last dimension, ``slice``/``select``/``narrow`` of a leading dimension
  (Hugging Face's shift ``logits[..., :-1, :].contiguous()``), ``clone``, ``alias``,
  ``permute``/``transpose``/``unsqueeze``/``squeeze`` of leading dimensions, and a dtype cast
  (``.float()``). The row of ``P`` each row of ``X`` comes from is found by replaying these ops on the
  row indices (an ``arange``), in the traced function too.
* Readers of the log-probabilities: ``nll_loss_forward`` (``F.cross_entropy`` and ``F.nll_loss``: mean,
  sum or none, ``ignore_index``, class weights); ``sum`` over the vocabulary, alone or of the product
  with a vector over the vocabulary (label smoothing, with and without class weights: the rest of
  ``F.cross_entropy(label_smoothing=...)`` reads only per-token values and stays in the graph).
* Readers of the logits ``X``: ``logsumexp`` over the vocabulary (a z-loss ``logsumexp(logits, -1)**2``).

Refused (left to the other passes, which may chunk the head along the tokens the generic way)
-----------------------------------------------------------------------------------------------
* Logits or log-probabilities read by anything else: a model that returns its logits with the loss
  (Hugging Face's ``CausalLMOutput`` when the caller keeps ``.logits``), an ``argmax`` for accuracy.
* Any op between the product and the log-softmax that is not a row move: a scale, a soft cap
  (``tanh``), a slice of the vocabulary, a ``bmm`` head, ``cross_entropy`` over the class dimension 1 of
  a 3-d input (``nll_loss2d``).
* A head the policy does not take: its rewrite lowers no step peak (the head is not where the step
  peaks, nor holds much there), or its extra matrix product does not fit the time allowance (with
  ``max_overhead=0``, a head whose product is most of its time never does); inference graphs (no
  backward to spare: the chunk pass chunks the head there without recomputation).

Soundness conditions (each with a counterexample the finder refuses)
--------------------------------------------------------------------
* Every forward reader of the logits, of the views between them and of the log-probabilities is
  recomputed by the function. Counterexample: ``return loss, logits`` needs the logits themselves.
* The ops between the product and the log-softmax move whole rows: then row ``i`` of ``X`` is row
  ``rows[i]`` of ``P`` cast, and the chunk's logits are ``h[rows] @ R``. Counterexample:
  ``logits[..., :V - 1]`` (a slice of the vocabulary) changes each row's softmax.
* The log-softmax is over the vocabulary (the last dimension, of a 2-d ``X``). Counterexample: a
  softmax over the tokens.
* Targets outside ``[0, V)`` other than ``ignore_index`` raise in both (eager's ``nll_loss`` and the
  chunk's ``gather``).
* Ignored tokens have no gradient even when every token is ignored (``torch.where``, not a product by
  a zero mask over a ``0 / 0``). Counterexample: a batch of padding only, where eager's mean is NaN
  and its gradient zero.

What it leaves to other passes
------------------------------
The rest of the model; the order of the chunks' ops (``schedule``); the chunked computation itself is
not chunked again.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from memplan.analysis.cost import graph_cost, node_cost, op_flops
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import nbytes, packet_name
from memplan.passes._chunk.graphs import region_backward
from memplan.passes._rewrite.region import Replacement, forward_nodes, node_dtype, node_shape
from memplan.policy import Candidate

__all__ = ["LinearCrossEntropy", "Nll", "RowSum", "LogSumExp", "find_linear_cross_entropy", "chunk_axis",
           "initial_chunks", "chunk_count", "admit", "MAX_CHUNKS", "MIN_GAIN"]

# Each chunk unrolls about twenty ops into the graph (forward and backward), each traced over fake
# tensors when a variant is built (a few ms an op): planning time and the graph's size grow with the
# count. At 32 chunks a GPT-2 head (1024 tokens, 50257 words) holds 6 MiB of logits at a time, against
# the 77-154 MiB of its weight (width 384-768) and as much again for the weight's gradient.
MAX_CHUNKS = 32
# The chunk count stops where one more doubling would lower the head's own simulated peak by less than
# this share of it (see chunk_count): the chunk is then a small part of what is alive while the head
# runs, and more chunks only add ops (and time: smaller matrix products, more of them).
MIN_GAIN = 0.1


# ----------------------------------------------------------------------------------------------
# the pattern (stage 1)


@dataclasses.dataclass(frozen=True)
class Nll:
    """``nll_loss_forward(log_probs, target, weight, reduction, ignore_index)``: ``target`` and ``weight``
    are positions in the pattern's inputs (``weight`` None: no class weights); ``loss`` and ``total`` the
    names of its two items (None where nothing outside the region reads one)."""

    node: str
    target: int
    weight: int | None
    reduction: int  # 0 none, 1 mean, 2 sum (aten's enum)
    ignore_index: int
    items: tuple[str, ...]
    loss: str | None
    total: str | None


@dataclasses.dataclass(frozen=True)
class RowSum:
    """``log_probs.sum(-1)``, or ``(log_probs * weight).sum(-1)`` with ``weight`` (a position in the
    pattern's inputs) a vector over the vocabulary: label smoothing's per-token term."""

    node: str
    product: str | None  # the ``mul`` by the weight, when there is one
    weight: int | None
    keepdim: bool


@dataclasses.dataclass(frozen=True)
class LogSumExp:
    """``logsumexp(logits, -1)`` of the logits (a z-loss)."""

    node: str
    keepdim: bool


Term = Nll | RowSum | LogSumExp


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropy:
    """A linear head ``P = h @ R (+ b)`` (``mm``/``addmm``), row moves and a cast to ``X`` (``N' x V``), its
    log-softmax and the terms that read them (see the module docstring).

    ``inputs`` are ``h``, ``R``, the bias or None, then the targets and weights the terms name;
    ``program`` the row moves as ``(kind, args)`` replayed on the product's row indices (empty: row
    ``i`` of ``X`` is row ``i`` of ``P``); ``chunks`` how many chunks the function runs, along ``axis``:

    * ``"tokens"``: each chunk is rows of ``X`` against the whole vocabulary. It reads all of ``R`` and
      adds into all of ``d R`` (a read and a write of the weight's size per chunk);
    * ``"vocab"``: each chunk is every token against columns of the vocabulary, the logsumexp combined
      over the chunks (``logaddexp``). It reads all of ``h`` and adds into all of ``d h`` per chunk,
      and writes its columns of ``d R`` once.

    Both hold one chunk's logits at a time and run the same matrix products; they differ in what each
    chunk re-reads (:func:`chunk_axis`)."""

    product: str
    chain: tuple[str, ...]
    log_softmax: str
    terms: tuple[Term, ...]
    inputs: tuple[str | None, ...]
    tokens: int  # N, the product's rows
    rows: int  # N', the log-softmax's rows
    vocab: int
    program: tuple[tuple[str, tuple], ...]
    leading: tuple[int, ...]  # the product's shape without its last dimension
    logits_dtype: torch.dtype  # X's dtype (the log-softmax's input)
    logits_bytes: int  # the largest of the product, the chain and X
    chunks: int
    axis: str = "vocab"  # what the chunks split: "tokens" (rows of X) or "vocab" (its columns)

    def region(self) -> tuple[str, ...]:
        nodes = [self.product, *self.chain, self.log_softmax]
        for term in self.terms:
            if isinstance(term, Nll):
                nodes += [term.node, *term.items]
            elif isinstance(term, RowSum):
                nodes += [n for n in (term.product, term.node) if n is not None]
            else:
                nodes.append(term.node)
        return tuple(nodes)

    def claimed(self) -> set[str]:
        return set(self.region())

    def outputs(self) -> tuple[str | None, ...]:
        names: list[str | None] = []
        for term in self.terms:
            names += [term.loss, term.total] if isinstance(term, Nll) else [term.node]
        return tuple(names)

    def replacement(self, graph: CapturedGraph) -> Replacement:
        present = tuple(n for n in self.inputs if n is not None)
        spec = _Spec(self, tuple(n is not None for n in self.inputs), _right_transposed(graph.node(self.inputs[1])))
        anchor = next((t.node for t in self.terms if isinstance(t, Nll)), self.log_softmax)
        return Replacement(self.region(), present, self.outputs(), lambda *values: _run(spec, values), anchor)

    def extent(self) -> int:
        """The length of the chunked dimension of ``X``: tokens (rows) or the vocabulary (columns)."""
        return self.rows if self.axis == "tokens" else self.vocab

    def chunk_bytes(self) -> int:
        """Bytes of one chunk's logits (the largest chunk)."""
        per = -(-self.extent() // self.chunks)
        other = self.vocab if self.axis == "tokens" else self.rows
        return per * other * self.logits_dtype.itemsize

    def __str__(self) -> str:
        full = self.rows * self.vocab * self.logits_dtype.itemsize
        kinds = "+".join(sorted({type(t).__name__.lower() for t in self.terms}))
        return (f"linear cross-entropy {self.log_softmax} ({kinds}): {self.rows} x {self.vocab} logits "
                f"({full} bytes) in {self.chunks} chunks of the {self.axis} ({self.chunk_bytes()} bytes each)")


# Row moves: ops after which row i of the result is one row of the input, the last dimension (the
# vocabulary) untouched.
_RESHAPES = {"view", "_unsafe_view", "reshape", "_reshape_alias"}
_SAME_ROWS = {"clone", "alias", "_to_copy"}
_ROW_MOVES = _RESHAPES | _SAME_ROWS | {"slice", "narrow", "select", "permute", "transpose", "unsqueeze", "squeeze"}


def _row_program(chain: Sequence[torch.fx.Node]) -> list[tuple[str, tuple]] | None:
    """The chain's ops as moves of whole rows (``(kind, args)`` on the leading dimensions), or None when
    one of them is not a row move."""
    program: list[tuple[str, tuple]] = []
    for node in chain:
        name = packet_name(node)
        before, after = node_shape(node.args[0]), node_shape(node)
        if not before or not after or before[-1] != after[-1]:
            return None  # the vocabulary merged, split or sliced
        rank = len(before)
        if name in _RESHAPES:
            program.append(("reshape", (after[:-1],)))
        elif name in _SAME_ROWS:
            value, source = node.meta.get("val"), node.args[0].meta.get("val")
            if name == "_to_copy" and (set(node.kwargs) - {"dtype", "memory_format", "layout", "device"}
                                       or value.device != source.device or value.layout != source.layout):
                return None
        elif name in ("slice", "narrow", "select"):
            dim = node.args[1] % rank if len(node.args) > 1 else 0
            if dim == rank - 1:
                return None
            if name == "slice":
                start, end, step = [*node.args[2:5], None, None, None][:3]
                program.append(("slice", (dim, start, end, 1 if step is None else step)))
            elif name == "narrow":
                start = node.args[2] % before[dim]  # narrow counts a negative start from the end
                program.append(("slice", (dim, start, start + node.args[3], 1)))
            else:
                program.append(("select", (dim, node.args[2])))
        elif name in ("permute", "transpose"):
            dims = [d % rank for d in node.args[1]] if name == "permute" else None
            if name == "transpose":
                a, b = node.args[1] % rank, node.args[2] % rank
                dims = list(range(rank))
                dims[a], dims[b] = dims[b], dims[a]
            if dims[-1] != rank - 1:
                return None
            program.append(("permute", (tuple(dims[:-1]),)))
        elif name in ("unsqueeze", "squeeze"):
            program.append(("reshape", (after[:-1],)))  # a size-1 dimension before the last
        else:
            return None
    return program


def _replay(program: Sequence[tuple[str, tuple]], index: torch.Tensor) -> torch.Tensor:
    """``program``'s row moves applied to ``index`` (the product's leading shape), flattened."""
    for kind, args in program:
        if kind == "reshape":
            index = index.reshape(args[0])
        elif kind == "slice":
            dim, start, end, step = args
            index = index[(slice(None),) * dim + (slice(start, end, step),)]
        elif kind == "select":
            index = index.select(*args)
        else:
            index = index.permute(*args)
    return index.reshape(-1)


def _chain_to_product(graph: CapturedGraph, x: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """Follow ``x`` back through forward ops that may move rows (:func:`_row_program` checks that they
    do) to an ``mm``/``addmm``: the product, and the ops after it in graph order."""
    chain: list[torch.fx.Node] = []
    value = x
    while packet_name(value) not in ("mm", "addmm"):
        if value.op != "call_function" or graph.phases.get(value.name) is not Phase.FORWARD:
            return None
        if packet_name(value) not in _ROW_MOVES or not value.args or not isinstance(value.args[0], torch.fx.Node):
            return None
        chain.append(value)
        value = value.args[0]
    return value, chain[::-1]


def _only_forward_readers(graph: CapturedGraph, node: torch.fx.Node, allowed: set[torch.fx.Node]) -> bool:
    """Every reader of ``node`` in the forward (or the graph's output) is in ``allowed``, or is autograd's
    ``detach`` of it (made to save it; the region machinery replaces it with the region, and refuses
    when something else reads it)."""
    return all(u in allowed or u.target is torch.ops.aten.detach.default for u in node.users
               if u.op == "output" or graph.phases.get(u.name) is Phase.FORWARD)


def _last_dim_reduction(node: torch.fx.Node, rank: int) -> bool | None:
    """``sum.dim_IntList``/``logsumexp`` over exactly the last dimension of a ``rank``-d input: its keepdim
    (None when it is not such a reduction)."""
    if len(node.args) < 2 or not isinstance(node.args[1], (list, tuple)) or len(node.args[1]) != 1:
        return None
    if set(node.kwargs) - {"keepdim"} or len(node.args) > 3:
        return None
    if node.args[1][0] % rank != rank - 1:
        return None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return bool(keepdim)


def _vocab_vector(node: Any, vocab: int) -> bool:
    """A tensor of ``vocab`` elements laid along the last dimension (``(V,)`` or ``(1, V)``)."""
    shape = node_shape(node)
    return isinstance(node, torch.fx.Node) and len(shape) in (1, 2) and shape[-1] == vocab and math.prod(shape) == vocab


def find_linear_cross_entropy(graph: CapturedGraph) -> list[LinearCrossEntropy]:
    """Stage 1: the linear heads whose logits only a cross-entropy reads (see the module docstring).

    Examples
    --------
    >>> import torch, torch.nn.functional as F
    >>> from memplan.capture import capture
    >>> w = torch.randn(300, 8, requires_grad=True)
    >>> g = capture(lambda h, w, y: F.cross_entropy(h @ w.t(), y), torch.randn(64, 8), w, torch.randint(0, 300, (64,)))
    >>> [(p.rows, p.vocab, p.axis, p.chunks) for p in find_linear_cross_entropy(g)]
    [(64, 300, 'vocab', 7)]
    """
    if not graph.training:
        return []  # inference keeps no logits for a backward; a chunk loop is the chunk pass's
    found = []
    for node in forward_nodes(graph):
        pattern = _match(graph, node) if packet_name(node) == "_log_softmax" else None
        if pattern is not None:
            found.append(pattern)
    return found


def _match(graph: CapturedGraph, lsm: torch.fx.Node) -> LinearCrossEntropy | None:
    x = lsm.args[0]
    shape = node_shape(x)
    if len(shape) != 2 or lsm.args[1] % 2 != 1 or shape[1] < 2:
        return None
    if lsm.args[2] and node_dtype(lsm) != node_dtype(x):
        return None  # half_to_float: a cast inside the op (refused, rare)
    walked = _chain_to_product(graph, x)
    if walked is None:
        return None
    product, chain = walked
    if graph.phases.get(product.name) is not Phase.FORWARD or len(node_shape(product)) != 2:
        return None
    if packet_name(product) == "addmm":
        if product.kwargs.get("beta", 1) != 1 or product.kwargs.get("alpha", 1) != 1 or len(product.args) != 3:
            return None
        bias, h, right = product.args
        if not _vocab_vector(bias, shape[1]) or node_dtype(bias) != node_dtype(product):
            return None
    else:
        if product.kwargs or len(product.args) != 2:
            return None
        bias, (h, right) = None, product.args
    program = _row_program(chain)
    if program is None:
        return None
    tokens, vocab = node_shape(product)
    try:
        rows = _replay(program, torch.arange(tokens).reshape(node_shape(product)[:-1]))
    except (RuntimeError, IndexError, ValueError):
        return None
    if rows.numel() != shape[0]:
        return None
    if rows.numel() == tokens and bool((rows == torch.arange(tokens)).all()):
        program = []  # row i is row i: no index needed
    inputs: list[str | None] = [h.name, right.name, bias.name if bias is not None else None]

    def position(arg: Any) -> int | None:
        if arg is None:
            return None
        if arg.name not in inputs:
            inputs.append(arg.name)
        return inputs.index(arg.name)

    # Step 1: the readers, each one of the terms; nothing else may read the logits or log-probabilities.
    terms: list[Term] = []
    members: set[torch.fx.Node] = {product, *chain, lsm}
    for reader in lsm.users:
        if graph.phases.get(reader.name) is not Phase.FORWARD:
            continue  # its backward: replaced with it
        term = _log_prob_term(graph, lsm, reader, vocab, position)
        if term is None:
            return None
        terms.append(term)
        members |= {graph.node(n) for n in _term_nodes(term)}
    for reader in x.users:
        if reader is lsm or graph.phases.get(reader.name) is not Phase.FORWARD:
            continue
        keepdim = _last_dim_reduction(reader, 2) if packet_name(reader) == "logsumexp" else None
        if keepdim is None:
            return None
        terms.append(LogSumExp(reader.name, keepdim))
        members.add(reader)
    if not any(isinstance(t, Nll) for t in terms):
        return None  # no cross-entropy: a log-softmax the model keeps for itself
    for node in [product, *chain, lsm, *[graph.node(n) for t in terms for n in _term_nodes(t)]]:
        if not _only_forward_readers(graph, node, members) and node.name not in _outputs_of(terms):
            return None
    if any(graph.node(n) in members for n in inputs if n is not None):
        return None
    sizes = [nbytes(n) for n in (product, *chain, x)]
    pattern = LinearCrossEntropy(
        product=product.name, chain=tuple(n.name for n in chain), log_softmax=lsm.name, terms=tuple(terms),
        inputs=tuple(inputs), tokens=tokens, rows=shape[0], vocab=vocab, program=tuple(program),
        leading=node_shape(product)[:-1], logits_dtype=node_dtype(x), logits_bytes=max(sizes), chunks=1,
        axis=chunk_axis(shape[0], vocab),
    )
    return dataclasses.replace(pattern, chunks=initial_chunks(graph, pattern))


def _log_prob_term(graph: CapturedGraph, lsm: torch.fx.Node, reader: torch.fx.Node, vocab: int,
                   position: Callable[[Any], int | None]) -> Term | None:
    name = packet_name(reader)
    if name == "nll_loss_forward" and reader.args[0] is lsm and len(reader.args) == 5 and not reader.kwargs:
        _, target, weight, reduction, ignore_index = reader.args
        if lsm in (target, weight) or (weight is not None and not _vocab_vector(weight, vocab)):
            return None
        if not isinstance(reduction, int) or reduction not in (0, 1, 2) or not isinstance(ignore_index, int):
            return None
        if node_shape(target) != node_shape(lsm)[:1]:
            return None
        items = [u for u in reader.users]
        if any(u.target is not operator.getitem for u in items):
            return None
        by_index = {u.args[1]: u for u in items}
        readers = {i: u.name if any(v.op == "output" or graph.phases.get(v.name) is Phase.FORWARD for v in u.users) else None
                   for i, u in by_index.items()}
        return Nll(reader.name, position(target), position(weight), reduction, ignore_index,
                   tuple(u.name for u in items), readers.get(0), readers.get(1))
    if name == "sum" and reader.target._overloadname == "dim_IntList":
        keepdim = _last_dim_reduction(reader, 2)
        if keepdim is None or reader.args[0] is not lsm:
            return None
        return RowSum(reader.name, None, None, keepdim)
    if name == "mul" and reader.target._overloadname == "Tensor" and len(reader.args) == 2 and not reader.kwargs:
        weight = reader.args[1] if reader.args[0] is lsm else reader.args[0]
        if weight is lsm or not _vocab_vector(weight, vocab) or node_dtype(weight) != node_dtype(lsm):
            return None
        sums = [u for u in reader.users if graph.phases.get(u.name) is Phase.FORWARD or u.op == "output"]
        if len(sums) != 1 or packet_name(sums[0]) != "sum" or sums[0].target._overloadname != "dim_IntList":
            return None
        keepdim = _last_dim_reduction(sums[0], 2)
        if keepdim is None:
            return None
        return RowSum(sums[0].name, reader.name, position(weight), keepdim)
    return None


def _term_nodes(term: Term) -> tuple[str, ...]:
    if isinstance(term, Nll):
        return (term.node, *term.items)
    if isinstance(term, RowSum):
        return tuple(n for n in (term.product, term.node) if n is not None)
    return (term.node,)


def _outputs_of(terms: Sequence[Term]) -> set[str]:
    return {n for t in terms for n in ((t.loss, t.total) if isinstance(t, Nll) else (t.node,)) if n is not None}


def chunk_axis(rows: int, vocab: int) -> str:
    """The axis to chunk: the one whose chunks re-read the smaller operand. A chunk of tokens reads all
    of the weight and adds into all of its gradient (``V x H`` each), a chunk of the vocabulary all of
    ``h``'s rows and of their gradient (``N' x H``); the matrix products are the same. So the
    vocabulary when there are fewer tokens than words (a language model's head), the tokens otherwise
    (a classifier's, over many tokens)."""
    return "vocab" if rows < vocab else "tokens"


def initial_chunks(graph: CapturedGraph, pattern: LinearCrossEntropy) -> int:
    """The chunk count a pattern is found with (:func:`admit` chooses its own): the fewest chunks whose
    logits are no larger than the head's inputs (``h``, the weight and the bias), which are alive while
    it runs, so the head's working set is at most about twice what it reads anyway; between 1 and
    :data:`MAX_CHUNKS`, and at most one chunk per token (or word). A chunk no larger than ``h`` alone
    (Liger's choice) would need hundreds of chunks for a narrow model with a wide vocabulary
    (``H = 64``, ``V = 50257``: one token per chunk)."""
    inputs = sum(nbytes(graph.node(n)) for n in pattern.inputs[:3] if n is not None)
    chunks = -(-pattern.logits_bytes // max(inputs, 1))
    return max(1, min(chunks, MAX_CHUNKS, pattern.extent()))


# ----------------------------------------------------------------------------------------------
# admission (stage 2): the policy chooses the chunk count, or no rewrite


def chunk_count(one: int, two: int, extent: int) -> int:
    """The chunk count from the head's own simulated peaks with one chunk and with two: where one more
    doubling would lower it by less than :data:`MIN_GAIN` of it; between 2 and :data:`MAX_CHUNKS` (and
    the chunked extent).

    With ``c`` chunks the head's own peak is about ``F + A / c``: a part no chunking changes (the
    gradients of ``h`` and of the weight, the logsumexps), ``F``, and the chunk's logits and gradient,
    ``A / c``; ``one - two`` is ``A / 2``. Doubling ``c`` gains ``A / (2c)``, less than
    ``MIN_GAIN (F + A / c)`` once ``c > A (1/2 - MIN_GAIN) / (MIN_GAIN F)``. When nothing falls (``A`` is
    0), two chunks.

    >>> chunk_count(1000, 600, 4096)  # A = 800, F = 200
    16
    >>> chunk_count(1000, 990, 4096)  # A = 20, F = 980: the chunk is a small part of the head's peak
    2
    """
    gain = max(0, one - two)
    floor = one - 2 * gain
    if gain == 0 or floor <= 0:
        return max(1, min(2, extent))
    chunks = math.ceil(2 * gain * (0.5 - MIN_GAIN) / (MIN_GAIN * floor))
    return max(min(2, extent), min(chunks, MAX_CHUNKS, extent))


def _own_peak(sim: PeakSimulation, before: set[str]) -> int:
    """The most bytes alive at once in storages made by nodes not in ``before`` (a variant's own)."""
    events: dict[int, int] = {}
    for sid, storage in sim.tensors.storages.items():
        if storage.external or storage.creator in before:
            continue
        interval = sim.liveness.intervals[sid]
        events[interval.start] = events.get(interval.start, 0) + storage.nbytes
        events[interval.end + 1] = events.get(interval.end + 1, 0) - storage.nbytes
    live = peak = 0
    for position in sorted(events):
        live += events[position]
        peak = max(peak, live)
    return peak


def least_extra_seconds(graph: CapturedGraph, head: LinearCrossEntropy, rates: Any) -> float:
    """A lower bound of the time the rewrite adds to ``graph``: its one extra matrix product, priced by
    its FLOPs alone (at the rate of all threads), less everything but the FLOPs of the region and its
    backward in ``graph`` (the rewrite runs all of their products' FLOPs again, and might save all the
    rest). Above the allowance, no chunk count fits it and none is built: with ``max_overhead=0`` (the
    first rung of a budget's ladder) a head whose products are most of its time is refused at once."""
    def flops_seconds(node: torch.fx.Node) -> float:
        return op_flops(node) / (rates.flops * rates.thread_count)

    backward = region_backward(graph, head.region())
    nodes = [graph.node(n) for n in head.region()] + ([graph.node(n) for n in backward.nodes] if backward else [])
    others = sum(node_cost(n, rates) - flops_seconds(n) for n in nodes)
    return flops_seconds(graph.node(head.product)) - others


def admit(graph: CapturedGraph, rewrites: Sequence[Any], ctx: Any,
          build: Callable[[Sequence[Any]], tuple[CapturedGraph, tuple[Any, ...]]]) -> tuple[Any, ...]:
    """``rewrites`` with each :class:`LinearCrossEntropy` at the chunk count the policy chooses, or left
    out (the others pass through).

    ``build(patterns)`` applies patterns to a copy of ``graph`` and returns it with the patterns that
    applied (the rewrite pass's ``apply_rewrite``). Heads are admitted one after the other, each on the
    graph with the heads admitted before it: a variant's overhead is its predicted time over
    ``graph``'s, so the heads share the pass's allowance (``ctx.policy.max_overhead``, a share of
    ``graph``'s predicted time). A variant whose simulated peak is above that of the graph it is applied
    to is no candidate; the graph as it is (overhead so far, its peak) always is one. So with
    ``max_overhead=0`` only a variant predicted no slower is taken, and with a budget the one with the
    least overhead that fits it (``policy.choose``; where none fits, as without a budget: a later pass
    may reach it)."""
    heads = [r for r in rewrites if isinstance(r, LinearCrossEntropy)]
    if not heads:
        return tuple(rewrites)
    rates = ctx.rates
    base_cost = graph_cost(graph, rates)
    policy = ctx.policy if ctx.policy.when_over != "raise" else dataclasses.replace(ctx.policy, when_over="overhead")
    admitted: list[LinearCrossEntropy] = []
    now_peak = ctx.am.get(PeakSimulation).peak
    now_cost = base_cost

    def overhead(cost: float) -> float:
        return max(0.0, cost / base_cost - 1.0) if base_cost > 0 else 0.0

    def evaluate(variant: LinearCrossEntropy) -> tuple[int, float, int] | None:
        """The simulated peak and predicted time of the graph with the heads admitted so far and
        ``variant``, and the head's own peak: the most bytes alive at once in storages the variant's
        nodes make (its chunks, its gradients); None where the region machinery refuses it (its
        backward could not be matched)."""
        new, done = build([*admitted, variant])
        if len(done) != len(admitted) + 1:
            return None
        sim = AnalysisManager(new).get(PeakSimulation)
        return sim.peak, graph_cost(new, rates), _own_peak(sim, now_names)

    now_names = {n.name for n in graph.gm.graph.nodes}
    for head in heads:
        if head.extent() < 2:
            continue
        if policy.budget is None and overhead(now_cost + least_extra_seconds(graph, head, rates)) > policy.max_overhead:
            continue  # no chunk count fits the allowance: not traced
        # Step 2a: one chunk and two (along chunk_axis, the finder's); the fall of the head's own peak
        # between them gives the chunk count (chunk_count). The head's own, not the step's nor all that
        # is alive while it runs: where the step peaks elsewhere, or the model's saved activations
        # dwarf the chunk, every count looks alike, and the later passes that lower the rest (remat)
        # would leave the head's chunks as the peak.
        probes = [evaluate(dataclasses.replace(head, chunks=chunks)) for chunks in (1, 2)]
        if None in probes:
            continue
        chunks = chunk_count(probes[0][2], probes[1][2], head.extent())
        # Step 2b: that count, halved while the time allowance does not cover it (without a budget).
        variant, measured = None, None
        while chunks >= 2:
            variant = dataclasses.replace(head, chunks=chunks)
            measured = probes[1] if chunks == 2 else evaluate(variant)
            if measured is not None and (policy.budget is not None or overhead(measured[1]) <= policy.max_overhead):
                break
            chunks //= 2
        # Step 2c: the policy takes it or leaves the graph as it is; never a higher peak.
        candidates = [Candidate(None, now_peak, overhead(now_cost), "unchanged")]
        if measured is not None and measured[0] <= now_peak:
            peak, cost, _ = measured
            candidates.append(Candidate((variant, peak, cost), peak, overhead(cost), str(variant)))
        choice = policy.choose(candidates)
        if choice.plan is not None:
            variant, now_peak, now_cost = choice.plan
            admitted.append(variant)
            now_names = {n.name for n in build(admitted)[0].gm.graph.nodes}
    taken = {h.log_softmax: h for h in admitted}
    return tuple(taken.get(r.log_softmax) if isinstance(r, LinearCrossEntropy) else r
                 for r in rewrites if not isinstance(r, LinearCrossEntropy) or r.log_softmax in taken)


# ----------------------------------------------------------------------------------------------
# the replacement (traced by make_fx in stage 3)


@dataclasses.dataclass(frozen=True)
class _Spec:
    pattern: LinearCrossEntropy
    present: tuple[bool, ...]  # which of the pattern's inputs are given (the bias may be None)
    right_transposed: bool  # R is the transpose of a dense matrix (``W.t()``): its gradient is made so


def _right_transposed(node: torch.fx.Node) -> bool:
    value = node.meta["val"]
    return value.dim() == 2 and value.stride(0) == 1 and value.stride(1) == value.shape[0] and value.shape[0] > 1


def _run(spec: _Spec, values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    given = iter(values)
    inputs = [next(given) if present else None for present in spec.present]
    pattern = spec.pattern
    rows = None
    if pattern.program:
        index = torch.arange(pattern.tokens, device=inputs[0].device).reshape(pattern.leading)
        rows = _replay(pattern.program, index)
    return _LinearCrossEntropyFunction.apply(spec, rows, *inputs)


def _bounds(total: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` windows ``(start, length)`` covering ``range(total)``, all of one length but the last."""
    size = -(-total // chunks)
    return [(start, min(size, total - start)) for start in range(0, total, size)]


def _windows(pattern: LinearCrossEntropy) -> list[tuple[int, int, int, int]]:
    """The chunks as ``(first row, rows, first column, columns)`` of ``X``: rows of tokens (every column)
    or columns of the vocabulary (every row)."""
    if pattern.axis == "tokens":
        return [(r0, n, 0, pattern.vocab) for r0, n in _bounds(pattern.rows, pattern.chunks)]
    return [(0, pattern.rows, v0, n) for v0, n in _bounds(pattern.vocab, pattern.chunks)]


def _token_rows(h: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The rows of ``h`` that the rows of ``X`` come from, in ``X``'s order (``h`` itself when row ``i``
    is row ``i``; else a copy, ``N' x H``)."""
    return h if rows is None else h.index_select(0, rows)


def _logits(spec: _Spec, h_rows: torch.Tensor, columns: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A chunk's logits from its rows of ``h``, its columns of ``R`` and of the bias, in ``X``'s dtype (a
    fresh tensor: the backward writes its gradient into it)."""
    logits = torch.mm(h_rows, columns) if bias is None else torch.addmm(bias, h_rows, columns)
    if logits.dtype != spec.pattern.logits_dtype:
        logits = logits.to(spec.pattern.logits_dtype)
    return logits


def _accumulate(store: dict, key: Any, value: torch.Tensor,
                combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """``store[key]`` is ``value``, or combined with it when there already."""
    store[key] = value if key not in store else combine(store[key], value)


class _LinearCrossEntropyFunction(torch.autograd.Function):
    """Forward: per chunk, the logits and their logsumexp (and the row sums the terms read); the
    targets' logits once, as one dot product per token. Saves the inputs and the logsumexps. Backward:
    per chunk, the logits again and ``softmax * scale + shift`` in their buffer, multiplied into the
    gradients; then the targets' one-hot part, once, into those gradients (see
    :class:`LinearCrossEntropy` for the chunks)."""

    @staticmethod
    def forward(ctx: Any, spec: _Spec, rows: torch.Tensor | None, h: torch.Tensor, right: torch.Tensor,
                bias: torch.Tensor | None, *extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pattern = spec.pattern
        inputs = [h, right, bias, *extra]
        vocab = pattern.vocab
        h_rows = _token_rows(h, rows)
        b = bias.reshape(-1) if bias is not None else None
        lse: dict[int, torch.Tensor] = {}  # per row window
        summed: dict[tuple[int, int], torch.Tensor] = {}  # (term, row window): a row sum of the logits
        for r0, rn, v0, vn in _windows(pattern):
            window_bias = _columns(b, 0, v0, vn) if b is not None else None
            logits = _logits(spec, _narrow(h_rows, r0, rn), _columns(right, 1, v0, vn), window_bias)
            _accumulate(lse, r0, torch.logsumexp(logits, 1), torch.logaddexp)
            for i, term in enumerate(pattern.terms):
                if isinstance(term, RowSum):
                    if term.weight is None:
                        value = logits.sum(1)
                    else:
                        w = inputs[term.weight].reshape(-1)
                        value = torch.mv(logits, w if vn == vocab else w.narrow(0, v0, vn))
                    _accumulate(summed, (i, r0), value, torch.add)
            del logits
        windows = list(lse)
        lse_all = torch.cat([lse[r] for r in windows]) if len(windows) > 1 else lse[windows[0]]
        dtype = lse_all.dtype
        outputs, totals = [], []
        for i, term in enumerate(pattern.terms):
            if isinstance(term, Nll):
                valid, safe = _valid(inputs[term.target], term.ignore_index)
                weight = _token_weights(inputs, term, safe, valid, dtype)
                picked = _target_logits(spec, h_rows, right, bias, safe)
                losses = (lse_all - picked) * weight
                total = weight.sum()
                if term.reduction == 0:  # per token; aten's total weight is then 0
                    outputs += [losses, torch.zeros((), dtype=dtype, device=h.device)]
                else:
                    loss = losses.sum()
                    outputs += [loss / total if term.reduction == 1 else loss, total]
                totals.append(total)
            elif isinstance(term, RowSum):
                scale = vocab if term.weight is None else inputs[term.weight].sum()
                value = torch.cat([summed[i, r0] for r0 in windows]) - scale * lse_all
                outputs.append(value.unsqueeze(1) if term.keepdim else value)
            else:
                outputs.append(lse_all.unsqueeze(1) if term.keepdim else lse_all.clone())
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(rows, lse_all, *[t for t in inputs if t is not None], *totals)
        ctx.mark_non_differentiable(*[o for o, kind in zip(outputs, _item_kinds(pattern)) if kind == "total"])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        spec: _Spec = ctx.spec
        pattern = spec.pattern
        vocab = pattern.vocab
        saved = list(ctx.saved_tensors)
        rows, lse = saved[0], saved[1]
        present = iter(saved[2:])
        inputs = [next(present) if p else None for p in spec.present]
        totals = iter(present)
        h, right, bias = inputs[:3]
        need_h, need_right, need_bias = ctx.needs_input_grad[2:5]
        need_extra = ctx.needs_input_grad[5:]
        # the gradient reaching each term (the total weights are not differentiable), its divisor
        flat = iter(grads)
        incoming, divisors = [], []
        for term in pattern.terms:
            incoming.append(next(flat))
            divisors.append(next(totals) if isinstance(term, Nll) else None)
            if isinstance(term, Nll):
                next(flat)
        co = _coefficients(pattern, inputs, incoming, divisors, lse)
        h_rows = _token_rows(h, rows)
        # Step 1: the gradients indexed by the vocabulary start with the targets' one-hot part: column
        # target_t of d R gets -c_t h_t (row target_t of d W), entry target_t of d bias -c_t. (Each chunk
        # then adds into them in place; one made whole at the end would hold its chunks twice.)
        grad_right = grad_bias = None
        if need_right:
            grad_right = right.new_zeros(right.t().shape if spec.right_transposed else right.shape)
        if need_bias:
            grad_bias = bias.new_zeros((vocab,))
        grad_weights = {p: inputs[p].new_zeros((vocab,)) for p, _ in co.weight_sums if need_extra[p - 3]}
        for safe, coefficient in co.picks:
            coefficient = coefficient.to(right.dtype).neg()
            if need_right:
                update = h_rows * coefficient.unsqueeze(1)
                if spec.right_transposed:
                    grad_right.index_add_(0, safe, update)
                else:
                    grad_right.index_add_(1, safe, update.t())
            if need_bias:
                grad_bias.index_add_(0, safe, coefficient)
        # Step 2: per chunk, softmax * scale + shift, multiplied into the gradients.
        b = bias.reshape(-1) if bias is not None else None
        grad_rows: dict[int, torch.Tensor] = {}  # per row window: d h_rows
        per_rows: dict[int, tuple] = {}  # per row window: its rows of h and per-token columns
        for r0, rn, v0, vn in _windows(pattern):
            if r0 not in per_rows:
                lse_rows = _narrow(lse, r0, rn)
                per_rows[r0] = (_narrow(h_rows, r0, rn), lse_rows, lse_rows.unsqueeze(1),
                                _narrow(co.scale, r0, rn).unsqueeze(1),
                                [(_narrow(g, r0, rn).unsqueeze(1) if weight is None else _narrow(g, r0, rn), weight)
                                 for g, weight in co.shifts],
                                [(p, _narrow(g, r0, rn)) for p, g in co.weight_sums if p in grad_weights])
            chunk_rows, lse_rows, lse_column, scale_column, shifts, weight_sums = per_rows[r0]
            columns = _columns(right, 1, v0, vn)
            logits = _logits(spec, chunk_rows, columns, _columns(b, 0, v0, vn) if b is not None else None)
            for position, g in weight_sums:  # d/dw of sum_v w_v log p_v: (logits - lse)^T g
                _columns(grad_weights[position], 0, v0, vn).add_(torch.mv(logits.t(), g) - (g * lse_rows).sum())
            grad = logits.sub_(lse_column).exp_().mul_(scale_column)
            for g, weight in shifts:
                if weight is None:
                    grad.add_(g)  # a column: the same shift on every word
                else:
                    grad.addr_(g, _columns(inputs[weight].reshape(-1), 0, v0, vn))
            if grad.dtype != right.dtype:
                grad = grad.to(right.dtype)
            if need_h:
                if r0 in grad_rows:
                    grad_rows[r0].addmm_(grad, columns.t())
                else:
                    grad_rows[r0] = torch.mm(grad, columns.t())
            if need_right:
                if spec.right_transposed:  # rows v0:v0 + vn of d W += grad^T h
                    _columns(grad_right, 0, v0, vn).addmm_(grad.t(), chunk_rows)
                else:
                    _columns(grad_right, 1, v0, vn).addmm_(chunk_rows.t(), grad)
            if need_bias:
                _columns(grad_bias, 0, v0, vn).add_(grad.sum(0))
            del logits, grad
        # Step 3: d h gets the one-hot part too: row t of d h_rows gets -c_t R[:, target_t].
        grad_h = None
        if need_h:
            parts = [grad_rows[r] for r in sorted(grad_rows)]
            grad_h_rows = torch.cat(parts) if len(parts) > 1 else parts[0]
            for safe, coefficient in co.picks:
                grad_h_rows.addcmul_(coefficient.to(right.dtype).neg().unsqueeze(1), right.index_select(1, safe).t())
            grad_h = _rows_gradient(h, grad_h_rows, rows)
        if need_right and spec.right_transposed:
            grad_right = grad_right.t()
        if need_bias:
            grad_bias = grad_bias.reshape(bias.shape)
        extra = []
        for position, needed in enumerate(need_extra, start=3):
            like = inputs[position]
            value = grad_weights.get(position)
            extra.append(None if not needed else torch.zeros_like(like) if value is None else value.reshape(like.shape))
        return (None, None, grad_h, grad_right, grad_bias, *extra)


def _narrow(value: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``start:start + length`` of ``value`` (all of it when they are all)."""
    return value if (start, length) == (0, value.shape[0]) else value.narrow(0, start, length)


def _target_logits(spec: _Spec, h_rows: torch.Tensor, right: torch.Tensor, bias: torch.Tensor | None,
                   safe: torch.Tensor) -> torch.Tensor:
    """Each token's logit at its target: row ``t`` of ``h_rows`` against column ``safe[t]`` of ``R``
    (one dot product per token; the same sum as the matrix product's, in another order)."""
    columns = right.index_select(1, safe).t()  # (tokens, H)
    picked = (h_rows * columns).sum(1)
    if bias is not None:
        picked = picked + bias.reshape(-1).index_select(0, safe)
    return picked.to(spec.pattern.logits_dtype) if picked.dtype != spec.pattern.logits_dtype else picked


@dataclasses.dataclass
class _Coefficients:
    """What the gradient of the logits is made of, per token: ``softmax * scale[:, None]`` plus each
    shift ``g`` (on every entry, or times a weight vector), minus each pick's coefficient at its target."""

    scale: torch.Tensor
    shifts: list[tuple[torch.Tensor, int | None]]  # per token g, times 1 or a weight vector (input position)
    picks: list[tuple[torch.Tensor, torch.Tensor]]  # (target column, coefficient) per token
    weight_sums: list[tuple[int, torch.Tensor]]  # (weight input position, per token g) of weighted row sums


def _coefficients(pattern: LinearCrossEntropy, inputs: Sequence[Any], incoming: Sequence[torch.Tensor | None],
                  divisors: Sequence[torch.Tensor | None], lse: torch.Tensor) -> _Coefficients:
    """The per-token coefficients of the gradient (see :class:`_Coefficients`).

    nll: ``g w_t / divisor`` on the softmax and at the target (ignored tokens 0); a row sum of the
    log-probabilities (with weights ``w``): ``g`` (``g w``) on every entry and ``-g V`` (``-g sum w``) on
    the softmax; a logsumexp: ``g`` on the softmax."""
    dtype, device = lse.dtype, lse.device
    zero = torch.zeros((), dtype=dtype, device=device)
    scale = None
    shifts, picks, weight_sums = [], [], []
    for term, grad, divisor in zip(pattern.terms, incoming, divisors):
        if grad is None:
            continue
        if isinstance(term, Nll):
            valid, safe = _valid(inputs[term.target], term.ignore_index)
            weight = _token_weights(inputs, term, safe, valid, dtype)
            g = grad / divisor if term.reduction == 1 else grad
            coefficient = torch.where(valid, weight * g, zero)
            picks.append((safe, coefficient))
            term_scale = coefficient
        else:
            g = grad.reshape(-1)
            if isinstance(term, LogSumExp):
                term_scale = g
            else:
                total = pattern.vocab if term.weight is None else inputs[term.weight].sum()
                term_scale = g * -total
                shifts.append((g, term.weight))
                if term.weight is not None:
                    weight_sums.append((term.weight, g))
        scale = term_scale if scale is None else scale + term_scale
    if scale is None:
        scale = torch.zeros_like(lse)
    return _Coefficients(scale, shifts, picks, weight_sums)


def _columns(value: torch.Tensor, dim: int, v0: int, vn: int) -> torch.Tensor:
    """Columns ``v0:v0 + vn`` of the vocabulary, along ``dim`` of ``value`` (all of it when they are all)."""
    return value if (v0, vn) == (0, value.shape[dim]) else value.narrow(dim, v0, vn)


def _item_kinds(pattern: LinearCrossEntropy) -> list[str]:
    kinds = []
    for term in pattern.terms:
        kinds += ["loss", "total"] if isinstance(term, Nll) else ["value"]
    return kinds


def _valid(target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens count, and the targets with ignored ones pointing at class 0 (read, never used)."""
    valid = target != ignore_index
    return valid, torch.where(valid, target, torch.zeros((), dtype=target.dtype, device=target.device))


def _token_weights(inputs: Sequence[Any], term: Nll, safe: torch.Tensor, valid: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Each token's class weight (1 without weights), 0 for ignored tokens."""
    zero = torch.zeros((), dtype=dtype, device=safe.device)
    if term.weight is None:
        return torch.where(valid, torch.ones((), dtype=dtype, device=safe.device), zero)
    return torch.where(valid, inputs[term.weight].reshape(-1).index_select(0, safe), zero)


def _rows_gradient(h: torch.Tensor, grad_rows: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``grad h`` from the gradient of the rows ``X`` reads: itself when row ``i`` of ``X`` is row ``i``
    of ``h``, else added at the rows each came from (rows no token reads get zero)."""
    if rows is None:
        return grad_rows
    return torch.zeros_like(h).index_add_(0, rows, grad_rows)
