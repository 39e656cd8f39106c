"""The cost model behind the chunk pass's overhead estimate (see :class:`CostRates`)."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable

import torch
import torch.fx

from memplan.capture import CapturedGraph
from memplan.graphutil import packet_name
from memplan.passes._chunk.graphs import ALIAS_OPS
from memplan.passes._chunk.rules import is_tensor, nbytes, shape_of

__all__ = ["CostRates", "OpWork", "op_work", "node_cost", "module_cost", "graph_cost"]


# ----------------------------------------------------------------------------------------------
# cost model


@dataclasses.dataclass(frozen=True)
class CostRates:
    """A roofline-style estimate of an op's time: FLOPs at ``flops`` per second, bytes read and written
    at ``bandwidth`` bytes per second (``cache_bandwidth`` when the op's operands and result together
    fit in ``cache_bytes``: a chunk's working set stays in cache, a whole-batch tensor streams from
    memory), ``index_element`` seconds per element an op reduces with indices (``max.dim``) or moves
    through an index tensor (``index``, ``index_add_``, ``scatter``, ``gather``: element-wise loops
    that do not vectorise), plus a fixed overhead per op (``dispatch`` for ops that compute,
    ``view_dispatch`` for views, which allocate nothing) and ``chunk_seconds`` per chunk of a loop.

    The defaults were fitted on a shared 2-core CPU (torch 2.13, one thread) to the measured step
    times of the chunked examples at several chunk counts: the extra time grows by about 4 us per op
    per chunk (chain product: 1.7 ms per chunk for ~340 ops; maxsim: 0.14 ms per chunk for ~30 ops),
    a ``max`` with indices costs 1-5 ns per element read (maxsim's 1.2 M-element max: 5.9 ms, where
    bytes alone predict 0.5 ms), single-thread matmuls reach about 30 GFLOP/s, and a chunk's working
    set in cache moves about 1.5x faster. Only ratios matter: the policy compares extra compute with
    the original. Other machines differ; pass ``options={"chunk.rates": CostRates(...)}``.

    Threads: torch splits an op over its ``threads`` intra-op threads only when the op has at least
    ``grain`` elements (ATen's ``at::internal::GRAIN_SIZE``), into ``ceil(elements / grain)`` parts
    at most, each thread starting at a cost of ``fork`` seconds; the fixed costs (``dispatch``, the
    Python that calls the op) never shrink. So the whole-batch ops of the original graph run up to
    ``threads`` times faster while a chunk's small ops may run on one thread: chunking costs more,
    relative to the original, the more threads there are. The default prices one thread, so a plan is
    the same on every machine; ``threads=None`` stands for ``torch.get_num_threads()`` when the pass
    runs (the plan then depends on the machine). With ``threads > 1`` the estimate is more honest on
    a multi-core CPU and the policy chunks less: on the 2-core machine above, chain product's 16
    chunks predict 0.68 extra (measured 0.4-0.9, eager itself gaining only 1.4x from a second thread),
    so ``max_overhead=0.3`` keeps its peak high there."""

    flops: float = 30e9
    bandwidth: float = 10e9
    cache_bandwidth: float = 15e9
    cache_bytes: int = 2**20
    index_element: float = 2e-9
    dispatch: float = 4e-6
    view_dispatch: float = 1.5e-6
    chunk_seconds: float = 15e-6
    threads: int | None = 1
    grain: int = 32768
    fork: float = 5e-6

    def resolved(self) -> "CostRates":
        """These rates with ``threads`` fixed: torch's intra-op thread count now, where it is None."""
        return self if self.threads is not None else dataclasses.replace(self, threads=torch.get_num_threads())

    @property
    def thread_count(self) -> int:
        return self.threads if self.threads is not None else torch.get_num_threads()

    def ways(self, elements: float) -> int:
        """How many threads torch splits an op of ``elements`` elements over."""
        threads = self.thread_count
        if threads <= 1 or elements < self.grain:
            return 1
        return min(threads, math.ceil(elements / self.grain))


_NO_TRAFFIC = ALIAS_OPS | {"getitem", "_unsafe_view", "empty", "new_empty", "new_empty_strided", "empty_strided"}


_INDEXED_REDUCTIONS = {"max", "min", "argmax", "argmin", "sort", "topk", "cummax", "cummin"}
# op -> the argument whose elements move through the index (None: the result's elements)
_INDEXED_MOVES = {"index": None, "index_select": None, "gather": None, "embedding": None,
                  "scatter": 3, "scatter_": 3, "scatter_add": 3, "scatter_add_": 3, "index_add": 3, "index_add_": 3,
                  "index_put": 2, "index_put_": 2, "_index_put_impl_": 2, "embedding_dense_backward": 0}


def _numel(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        value = value[0] if value else None
    return int(value.numel()) if isinstance(value, torch.Tensor) else 0


@dataclasses.dataclass(frozen=True)
class OpWork:
    """What one op computes and moves, in two parts: the part that scales with a loop body's chunk
    length (values that carry the chunked index) and the fixed part (values every chunk sees whole).

    ``view``: the op allocates and moves nothing (priced at ``view_dispatch``); ``none``: not priced at
    all (``getitem`` of a tuple)."""

    flops: float = 0.0
    flops_scale: bool = False
    fixed_bytes: int = 0
    scaled_bytes: int = 0
    view: bool = False
    none: bool = False
    indexed: float = 0.0  # elements reduced with indices or moved through an index tensor
    elements: int = 0  # elements of the op's largest tensor: what torch splits over threads
    elements_scale: bool = False  # that tensor carries the chunked index

    def price(self, rates: CostRates, factor: float = 1.0) -> float:
        """Seconds at ``factor`` times the length the work was measured at."""
        if self.none:
            return 0.0
        if self.view:
            return rates.view_dispatch
        scale = factor if self.flops_scale else 1.0
        traffic = self.fixed_bytes + self.scaled_bytes * factor
        bandwidth = rates.cache_bandwidth if traffic <= rates.cache_bytes else rates.bandwidth
        work = self.flops * scale / rates.flops + self.indexed * scale * rates.index_element + traffic / bandwidth
        ways = rates.ways(self.elements * (factor if self.elements_scale else 1.0))
        if ways > 1:
            work = work / ways + rates.fork * (ways - 1)
        return work + rates.dispatch


def op_work(node: torch.fx.Node, scales: Callable[[torch.fx.Node], bool] = lambda n: False) -> OpWork:
    """The work of ``node``; ``scales(value)`` tells which values carry a loop's chunked index.

    FLOPs scale with the chunk length when any operand does (the index is then part of the
    iteration space: rows, columns, the contraction or the batch of a matmul)."""
    name = packet_name(node)
    if node.target is operator.getitem:
        return OpWork(none=True)
    if name in _NO_TRAFFIC:
        return OpWork(view=True)
    flops = 0
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = (node.args[0], node.args[1]) if name in ("mm", "bmm") else (node.args[1], node.args[2])
        sa, sb = shape_of(a), shape_of(b)
        if len(sa) >= 2 and len(sb) >= 2:
            flops = 2 * math.prod(sa) * sb[-1]
    elif name == "convolution":
        weight = shape_of(node.args[1])
        flops = 2 * max(nbytes(node) // 4, 1) * math.prod(weight[1:]) if weight else 0
    indexed = 0
    if name in _INDEXED_REDUCTIONS and not (name in ("max", "min") and node.target._overloadname == "default"):
        indexed = _numel(node.args[0])
    elif name in _INDEXED_MOVES:
        source = _INDEXED_MOVES[name]  # the argument whose elements move (None: the result)
        moved = node if source is None else node.args[source] if source < len(node.args) else None
        indexed = _numel(moved) if isinstance(moved, torch.fx.Node) else 0
    elif name == "grouped_addmm_":  # one row of the dense operand moved per entry
        values, dense = node.args[2], node.args[3]
        indexed = _numel(values) * (shape_of(dense)[-1] if shape_of(dense) else 1)
    fixed = scaled = 0
    elements, elements_scale = 0, False
    operands = [a for a in node.all_input_nodes if is_tensor(a)]
    for value in [node, *operands]:
        if scales(value):
            scaled += nbytes(value)
        else:
            fixed += nbytes(value)
        count = _numel(value)
        if count > elements or count == elements and scales(value):
            elements, elements_scale = count, scales(value)
    return OpWork(flops, any(scales(a) for a in operands) or scales(node), fixed, scaled, indexed=indexed,
                  elements=elements, elements_scale=elements_scale)


def node_cost(node: torch.fx.Node, rates: CostRates) -> float:
    """Estimated seconds of one op (see :class:`CostRates`)."""
    return op_work(node).price(rates)


def module_cost(gm: torch.fx.GraphModule, rates: CostRates) -> float:
    total = 0.0
    for node in gm.graph.nodes:
        if node.op == "call_function":
            total += node_cost(node, rates)
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            cost = getattr(module, "cost", None)  # a ChunkLoop prices its own chunks
            total += cost(rates) if callable(cost) else rates.dispatch
    return total


def graph_cost(graph: CapturedGraph, rates: CostRates | None = None) -> float:
    """Estimated seconds to run ``graph`` once (see :class:`CostRates`)."""
    return module_cost(graph.gm, (rates or CostRates()).resolved())
