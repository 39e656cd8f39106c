"""The one time model: predicted seconds of every op, of a plan, and of eager's training step.

Every pass prices its candidates with it and the pipeline holds the whole plan to ``max_overhead`` with
it (see :class:`~memplan.policy.Policy`): "overhead" is the predicted step time of the plan over eager's.

An op costs a roofline-style sum (:class:`CostRates`): its FLOPs at a matmul rate, the bytes it reads
and writes at a memory (or cache) bandwidth, elements moved through an index, and a fixed cost per call.
A plan runs as one autograd function whose forward and backward are plain op calls, so its time is the
sum over its ops (a chunk loop prices its own chunks). Eager runs the same ops, and autograd records a
node per differentiable forward op and runs it in the backward: :func:`eager_seconds` adds
``autograd_node`` per such op, which is why a plan with a little recomputation can be as fast as eager.

The rates are the fixed :data:`REFERENCE_RATES` by default, fitted once on a 2-core CPU at one thread
to measured step times, under which a plan is the same on every machine; or they come from a
micro-benchmark of the machine (:func:`calibrate`, about a second, cached per device, torch version,
processor and thread count): ``optimize(model, rates="calibrated")`` or ``MEMPLAN_RATES=calibrated``
(see :func:`rates_for`). The micro-benchmark measures what the machine's ops can do in isolation; on
the examples its predictions of whole steps were further from the measured times than the reference
rates' (docs/benchmarks.md, "The time model"), hence not the default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import pathlib
import platform
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import ALIAS_OPS, is_tensor, nbytes, packet_name, shape_of
from memplan.ops import TIER_OPS, grouped_addmm_blocks

__all__ = [
    "STALL",
    "CostRates",
    "REFERENCE_CUDA_RATES",
    "REFERENCE_RATES",
    "OpWork",
    "op_work",
    "op_flops",
    "node_cost",
    "module_cost",
    "submodule_cost",
    "graph_cost",
    "eager_seconds",
    "autograd_nodes",
    "calibrate",
    "rates_for",
]


@dataclasses.dataclass(frozen=True)
class CostRates:
    """A roofline-style estimate of an op's time: FLOPs at ``flops`` per second, bytes read and written
    at ``bandwidth`` bytes per second (``cache_bandwidth`` when the op's operands and result together
    fit in ``cache_bytes``: a chunk's working set stays in cache, a whole-batch tensor streams from
    memory), ``index_element`` seconds per element an op reduces with indices (``max.dim``) or moves
    through an index tensor (``index``, ``index_add_``, ``scatter``, ``gather``: element-wise loops
    that do not vectorise), plus a fixed overhead per op (``dispatch`` for ops that compute,
    ``view_dispatch`` for views, which allocate nothing), ``chunk_seconds`` per chunk of a loop, and
    ``autograd_node`` per node eager's autograd records and runs (see :func:`eager_seconds`), and
    ``host_bandwidth``, the bytes per second one copy between the device and host memory moves (pinned
    memory over the host link on CUDA; a copy within memory on a CPU, the emulated host tier): what
    the ``offload`` pass prices its transfers with.

    The reference rates were fitted on a shared 2-core CPU (torch 2.13, one thread) to the measured step
    times of the chunked examples at several chunk counts: the extra time grows by about 4 us per op
    per chunk (chain product: 1.7 ms per chunk for ~340 ops; maxsim: 0.14 ms per chunk for ~30 ops),
    a ``max`` with indices costs 1-5 ns per element read (maxsim's 1.2 M-element max: 5.9 ms, where
    bytes alone predict 0.5 ms), single-thread matmuls reach about 30 GFLOP/s, and a chunk's working
    set in cache moves about 1.5x faster. :func:`calibrate` measures them on the machine at hand.

    Threads: torch splits an op over its ``threads`` intra-op threads only when the op has at least
    ``grain`` elements (ATen's ``at::internal::GRAIN_SIZE``), into ``ceil(elements / grain)`` parts
    at most, each thread starting at a cost of ``fork`` seconds; the fixed costs (``dispatch``, the
    Python that calls the op) never shrink. So the whole-batch ops of the original graph run up to
    ``threads`` times faster while a chunk's small ops may run on one thread: chunking costs more,
    relative to the original, the more threads there are. ``threads=None`` stands for
    ``torch.get_num_threads()`` when the pass runs."""

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
    autograd_node: float = 6e-6
    host_bandwidth: float = 5e9
    source: str = "reference"

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


REFERENCE_RATES = CostRates()

#: The rates a plan for a CUDA device is priced with by default: an H100-class GPU run eagerly from
#: Python, as :func:`calibrate` measured one (an H100 80GB HBM3, torch 2.11, CUDA 13.0, rounded):
#: fp32 matmuls without TF32 at 51 TFLOP/s, 3.05 TB/s read and written, 8.2 us a dispatch, 2.8 us a
#: view, 9.7 us an autograd node; its 50 MB L2 as the cache, and ``chunk_seconds`` (a Python iteration of
#: a loop) not measured. What decides most plans is the fixed cost, which is the host's: every op is a
#: Python call, a dispatch and a kernel launch. Where an op costs far less on the GPU than on the CPU
#: and the fixed costs stay, splitting work into chunks costs relatively more: a plan priced with the
#: CPU's rates chunked maxsim 20x slower than eager on that H100. ``rates="calibrated"`` measures the
#: GPU at hand instead. ``host_bandwidth`` (pinned copies over the host link, one direction) is a
#: PCIe 5.0 x16 link's usual 20 GB/s, not yet measured on that H100.
REFERENCE_CUDA_RATES = CostRates(
    flops=50e12, bandwidth=3e12, cache_bandwidth=5e12, cache_bytes=32 * 2**20, index_element=2e-12,
    dispatch=8e-6, view_dispatch=2.5e-6, chunk_seconds=20e-6, threads=1, fork=0.0, autograd_node=9.5e-6,
    host_bandwidth=20e9, source="reference cuda")


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
    # an op that loops over blocks in Python (``memplan::grouped_addmm_``) makes this many dispatches
    # beyond its own, as many more per chunk length when ``rounds_scale``
    rounds: float = 0.0
    rounds_scale: bool = False

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
        return work + rates.dispatch * (1.0 + self.rounds * (factor if self.rounds_scale else 1.0))


#: Dispatches per block of ``memplan::grouped_addmm_`` (see :mod:`memplan.ops`): coordinates
#: (``arange``, ``floor_divide_``, ``copy_``), the sparse matrix and its ``addmm_``, with their views
#: counted as one; the compressed-row path makes its offsets, the matrix and the product.
_GROUPED_ADDMM_COO_CALLS = 6
_GROUPED_ADDMM_CSR_CALLS = 4


def _grouped_addmm_rounds(node: torch.fx.Node) -> float:
    """Dispatches ``memplan::grouped_addmm_`` makes beyond its own (:func:`memplan.ops.grouped_addmm_blocks`)."""
    out, cols, _values, _dense, _per_group, scatter, workspace = (
        a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args[:7])
    if not all(isinstance(t, torch.Tensor) for t in (out, cols, workspace)) or workspace.dim() != 2:
        return 0.0
    groups, blocks = grouped_addmm_blocks(out, cols, scatter, workspace)
    return blocks * (_GROUPED_ADDMM_CSR_CALLS if groups else _GROUPED_ADDMM_COO_CALLS)


def op_flops(node: torch.fx.Node) -> int:
    """FLOPs of the matrix products of one op, from the shapes of its fake values: ``2*m*n*k`` for a
    matrix product (plus the bias), ``2 * output elements * input channels per group * kernel size`` for a
    convolution (twice that for its backward), ``4*b*h*l*s*e`` for attention; 0 for every other op, whose
    time the bytes it moves and its dispatch dominate (see :class:`OpWork`).

    Examples
    --------
    >>> from memplan.capture import capture
    >>> g = capture(lambda a, b: (a @ b).relu(), torch.randn(4, 8), torch.randn(8, 2), train=False)
    >>> [(n.name, op_flops(n)) for n in g.gm.graph.nodes if n.op == "call_function"]
    [('mm', 128), ('relu', 0)]
    """
    if node.op != "call_function":
        return 0
    name = packet_name(node).rstrip("_")  # addmm_ (an in-place accumulation) computes as addmm does
    args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    out = node.meta.get("val")

    def numel(value: Any) -> int:
        return int(value.numel()) if isinstance(value, torch.Tensor) else 0

    def matrices(values: list[Any]) -> bool:
        return len(values) >= 2 and all(isinstance(a, torch.Tensor) and a.dim() >= 2 for a in values[:2])

    if name in ("mm", "matmul") and matrices(args):
        (m, k), n = args[0].shape[-2:], args[1].shape[-1]
        return 2 * int(m) * int(k) * int(n) * max(1, numel(out) // max(1, int(m) * int(n)))
    if name in ("addmm", "_addmm_activation") and matrices(args[1:]):
        (m, k), n = args[1].shape, args[2].shape[-1]
        return 2 * int(m) * int(k) * int(n) + int(m) * int(n)
    if name in ("bmm", "baddbmm", "addbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return 2 * numel(a) * int(b.shape[-1])
    if name in ("convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution") and len(args) > 1 \
            and isinstance(args[1], torch.Tensor):
        weight = args[1]
        return 2 * numel(out) * int(weight.shape[1]) * math.prod(int(s) for s in weight.shape[2:])
    if name == "convolution_backward" and len(args) > 2 and isinstance(args[0], torch.Tensor) \
            and isinstance(args[2], torch.Tensor):
        weight = args[2]
        return 4 * numel(args[0]) * int(weight.shape[1]) * math.prod(int(s) for s in weight.shape[2:])
    if (name.startswith("_scaled_dot_product") or name == "scaled_dot_product_attention") and len(args) > 1 \
            and isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor):
        return (8 if "backward" in name else 4) * numel(args[0]) * int(args[1].shape[-2])
    return 0


def op_work(node: torch.fx.Node, scales: Callable[[torch.fx.Node], bool] = lambda n: False) -> OpWork:
    """The work of ``node``; ``scales(value)`` tells which values carry a loop's chunked index.

    FLOPs scale with the chunk length when any operand does (the index is then part of the
    iteration space: rows, columns, the contraction or the batch of a matmul)."""
    name = packet_name(node)
    if node.target is operator.getitem:
        return OpWork(none=True)
    if name in _NO_TRAFFIC:
        return OpWork(view=True)
    if node.target in TIER_OPS:  # a copy started or waited for: its time is the wait's (see node_cost)
        return OpWork()
    flops = op_flops(node)
    indexed = 0
    if name in _INDEXED_REDUCTIONS and not (name in ("max", "min") and node.target._overloadname == "default"):
        indexed = _numel(node.args[0])
    elif name in _INDEXED_MOVES:
        source = _INDEXED_MOVES[name]  # the argument whose elements move (None: the result)
        moved = node if source is None else node.args[source] if source < len(node.args) else None
        indexed = _numel(moved) if isinstance(moved, torch.fx.Node) else 0
    rounds = 0.0
    if name == "grouped_addmm_":  # one row of the dense operand moved per entry
        values, dense = node.args[2], node.args[3]
        indexed = _numel(values) * (shape_of(dense)[-1] if shape_of(dense) else 1)
        rounds = _grouped_addmm_rounds(node)
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
                  elements=elements, elements_scale=elements_scale, rounds=rounds,
                  rounds_scale=rounds > 0 and scales(node.args[2]))


_WORK = "memplan_work"  # node.meta key: (value, OpWork), the work of the value it was made from
#: node.meta key of a host-tier wait (``memplan::offload_wait_``, ``prefetch_wait_``): the seconds the
#: current stream is predicted to wait there for its copy, as the ``offload`` pass placed it
STALL = "memplan_stall"


def node_cost(node: torch.fx.Node, rates: CostRates) -> float:
    """Estimated seconds of one op (see :class:`CostRates`); a host-tier wait adds the stall the
    ``offload`` pass predicted for it (:data:`STALL`).

    Every planning pass prices most nodes of each graph, and a copy of a graph shares its nodes' fake
    values: the work is kept with the value it was read from."""
    value = node.meta.get("val")
    cached = node.meta.get(_WORK)
    if cached is not None and cached[0] is value and cached[2] is node.target:
        return cached[1].price(rates) + node.meta.get(STALL, 0.0)
    work = op_work(node)
    node.meta[_WORK] = (value, work, node.target)
    return work.price(rates) + node.meta.get(STALL, 0.0)


def submodule_cost(module: torch.nn.Module, rates: CostRates) -> float:
    """Estimated seconds of one call of a module a graph calls: a chunk loop prices its own chunks, any
    other module costs a dispatch."""
    cost = getattr(module, "cost", None)
    return cost(rates) if callable(cost) else rates.dispatch


def module_cost(gm: torch.fx.GraphModule, rates: CostRates) -> float:
    """Estimated seconds to run the ops of ``gm`` once (a chunk loop prices its own chunks)."""
    total = 0.0
    for node in gm.graph.nodes:
        if node.op == "call_function":
            total += node_cost(node, rates)
        elif node.op == "call_module":
            total += submodule_cost(gm.get_submodule(node.target), rates)
    return total


def graph_cost(graph: CapturedGraph, rates: CostRates | None = None) -> float:
    """Estimated seconds of one training (or inference) step of ``graph`` run as a plan: its ops, forward
    and backward, called one after another (see :class:`CostRates`)."""
    return module_cost(graph.gm, (rates or REFERENCE_RATES).resolved())


_NO_SEQ = 2**64 - 1  # the sequence number of backward ops no autograd node ran (gradient detaches)


def autograd_nodes(graph: CapturedGraph) -> int:
    """How many autograd nodes eager records in the forward and runs in the backward: one per distinct
    sequence number among the backward's ops (0 for an inference graph). A node whose backward runs no
    op (the backward of a chunk of a GRU cell's gates) leaves no trace and is not counted."""
    return len({seq for name, seq in graph.seq_nr.items()
                if graph.phases.get(name) is Phase.BACKWARD and seq != _NO_SEQ})


def eager_seconds(graph: CapturedGraph, rates: CostRates | None = None) -> float:
    """Estimated seconds of eager's step of the model ``graph`` was captured from: its ops (as
    :func:`graph_cost`) plus ``autograd_node`` for each node autograd records and runs
    (:func:`autograd_nodes`). ``graph`` must be the capture, before any pass."""
    rates = (rates or REFERENCE_RATES).resolved()
    return graph_cost(graph, rates) + rates.autograd_node * autograd_nodes(graph)


# ----------------------------------------------------------------------------------------------
# calibration


def _timed(fn: Callable[[], Any], calls: int, device: torch.device, rounds: int = 5) -> float:
    """Seconds per call of ``fn``: the best of ``rounds`` rounds of ``calls`` calls (a round synchronises
    once, at its end, on CUDA: launches overlap as they do in a step)."""
    best = math.inf
    for _ in range(rounds + 1):  # the first round warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / calls) if _ else math.inf
    return best


def calibrate(device: str | torch.device = "cpu") -> CostRates:
    """:class:`CostRates` measured on ``device`` at torch's current intra-op thread count: a few short
    loops of aten ops, about a second in all. Each rate is the best of several rounds (what the machine
    can do, not what a busy moment left of it); what cannot be told apart from noise keeps the reference
    value scaled by the measured dispatch cost.

    Examples
    --------
    >>> rates = calibrate("cpu")
    >>> rates.source.startswith("calibrated"), rates.flops > 0 and rates.dispatch > 0
    (True, True)
    """
    device = torch.device(device)
    aten = torch.ops.aten
    ref = REFERENCE_RATES
    with torch.no_grad():
        tiny = torch.ones(1, device=device)
        dispatch = _timed(lambda: aten.add.Tensor(tiny, tiny), 300, device)
        view_dispatch = min(dispatch, _timed(lambda: aten.view.default(tiny, [1]), 300, device))
        n = 384 if device.type == "cpu" else 4096
        a = torch.randn(n, n, device=device)
        flops = 2 * n**3 / max(_timed(lambda: aten.mm.default(a, a), 3, device) - dispatch, 1e-9)
        # a step's large tensors: two operands beyond the caches and a result the allocator hands back
        # warm (16 MiB: below glibc's largest mmap threshold, which would page-fault every call)
        big, other = (torch.randn(2**22 if device.type == "cpu" else 2**26, device=device) for _ in range(2))
        streamed = 3 * big.numel() * big.element_size()
        bandwidth = streamed / max(_timed(lambda: aten.add.Tensor(big, other), 3, device) - dispatch, 1e-9)
        small, small_other = (torch.randn(2**14, device=device) for _ in range(2))
        cached = 3 * small.numel() * small.element_size()
        seconds = _timed(lambda: aten.add.Tensor(small, small_other), 50, device) - dispatch
        cache_bandwidth = max(bandwidth, cached / max(seconds, cached / (10 * bandwidth)))
        rows = torch.randn(1024, 1024, device=device)
        reduce = _timed(lambda: aten.max.dim(rows, -1), 3, device) - dispatch - 4 * rows.numel() / bandwidth
        index_element = max(reduce / rows.numel(), ref.index_element / 20)
    # autograd's own cost per node: a chain of tanh, eager forward and backward, against its ops alone
    steps = 32
    x = torch.randn(64, device=device, requires_grad=True)

    def eager() -> None:
        y = x
        for _ in range(steps):
            y = torch.tanh(y)
        y.backward(torch.ones_like(y))

    def ops() -> None:
        with torch.no_grad():
            y, outs = x, []
            for _ in range(steps):
                y = aten.tanh.default(y)
                outs.append(y)
            grad = torch.ones_like(y)
            for out in reversed(outs):
                grad = aten.tanh_backward.default(grad, out)

    autograd_node = max(0.0, (_timed(eager, 5, device) - _timed(ops, 5, device)) / steps)
    x.grad = None
    host_bandwidth = _host_bandwidth(device)
    scale = dispatch / ref.dispatch  # the fixed costs of Python and dispatch move together
    return dataclasses.replace(
        ref, flops=flops, bandwidth=bandwidth, cache_bandwidth=cache_bandwidth, index_element=index_element,
        dispatch=dispatch, view_dispatch=view_dispatch, chunk_seconds=ref.chunk_seconds * scale,
        fork=ref.fork * scale, autograd_node=autograd_node, host_bandwidth=host_bandwidth,
        threads=torch.get_num_threads() if device.type == "cpu" else 1,
        source=f"calibrated {time.strftime('%Y-%m-%d')}")


def _host_bandwidth(device: torch.device) -> float:
    """Bytes per second of one copy of a 64 MiB tensor (16 MiB on a CPU) into host memory and back,
    the slower direction: pinned memory over the host link on CUDA, a copy within memory on a CPU (the
    emulated host tier)."""
    cuda = device.type == "cuda"
    numel = (2**24 if cuda else 2**22)
    with torch.no_grad():
        dev = torch.empty(numel, device=device)
        host = torch.empty(numel, pin_memory=cuda)
        seconds = max(_timed(lambda: host.copy_(dev, non_blocking=cuda), 3, device),
                      _timed(lambda: dev.copy_(host, non_blocking=cuda), 3, device))
    return 4 * numel / max(seconds, 1e-9)


def _machine_key(device: torch.device) -> str:
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as info:
                what = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), what)
        except OSError:
            pass
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    return f"{device.type}|{what}|torch {torch.__version__}|threads {threads}"


def _cache_path() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "memplan" / "rates.json"


_CALIBRATED: dict[str, CostRates] = {}


def rates_for(spec: "CostRates | str | None" = None, device: str | torch.device = "cpu") -> CostRates:
    """The rates a plan for ``device`` is priced with.

    ``spec``: a :class:`CostRates` (used as given); ``"reference"`` (:data:`REFERENCE_RATES`, or
    :data:`REFERENCE_CUDA_RATES` for a CUDA device: the same plan on every machine); ``"calibrated"`` (:func:`calibrate`, run once per machine, device, torch
    version and thread count and kept in ``$XDG_CACHE_HOME/memplan/rates.json``); None: what the
    environment variable ``MEMPLAN_RATES`` says, else ``"reference"``. A device this machine lacks is
    priced with its reference rates.
    """
    if isinstance(spec, CostRates):
        return spec.resolved()
    if spec is None:
        spec = os.environ.get("MEMPLAN_RATES", "reference").strip().lower() or "reference"
    if spec not in ("reference", "calibrated"):
        raise ValueError(f"rates must be a CostRates, 'reference' or 'calibrated', not {spec!r} "
                         "(MEMPLAN_RATES takes 'reference' or 'calibrated')")
    device = torch.device(device)
    reference = REFERENCE_CUDA_RATES if device.type == "cuda" else REFERENCE_RATES
    if spec == "reference" or device.type not in ("cpu", "cuda") or device.type == "cuda" and not torch.cuda.is_available():
        return reference
    key = _machine_key(device)
    if key in _CALIBRATED:
        return _CALIBRATED[key]
    path = _cache_path()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    fields = {f.name for f in dataclasses.fields(CostRates)}
    entry = stored.get(key)
    if isinstance(entry, Mapping) and set(entry) == fields:
        rates = CostRates(**entry)
    else:
        rates = calibrate(device)
        stored[key] = dataclasses.asdict(rates)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(stored, indent=1, sort_keys=True))
            temporary.replace(path)
        except OSError:
            pass  # a read-only home: calibrate again next time
    _CALIBRATED[key] = rates
    return rates
