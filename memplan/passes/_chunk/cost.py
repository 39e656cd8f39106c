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


_NO_TRAFFIC = ALIAS_OPS | {"getitem", "_unsafe_view", "empty", "new_empty", "new_empty_strided", "empty_strided"}


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

    def price(self, rates: CostRates, factor: float = 1.0) -> float:
        """Seconds at ``factor`` times the length the work was measured at."""
        if self.none:
            return 0.0
        if self.view:
            return rates.view_dispatch
        flops = self.flops * (factor if self.flops_scale else 1.0)
        traffic = self.fixed_bytes + self.scaled_bytes * factor
        bandwidth = rates.cache_bandwidth if traffic <= rates.cache_bytes else rates.bandwidth
        return flops / rates.flops + traffic / bandwidth + rates.dispatch


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
    fixed = scaled = 0
    operands = [a for a in node.all_input_nodes if is_tensor(a)]
    for value in [node, *operands]:
        if scales(value):
            scaled += nbytes(value)
        else:
            fixed += nbytes(value)
    return OpWork(flops, any(scales(a) for a in operands) or scales(node), fixed, scaled)


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
    return module_cost(graph.gm, rates or CostRates())
