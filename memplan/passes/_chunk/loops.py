"""Loop bodies and the loop module: a region's nodes as an fx body for one chunk, run chunk by chunk.

:func:`build_body` copies a region's nodes into a new graph whose size arguments shrink to a chunk;
:class:`ChunkLoop` slices its inputs, runs a body per chunk and combines the chunks' outputs as its
:class:`LoopSpec` says (concatenate, sum, length-weighted mean, log-sum-exp, max, min, NLL mean, or
scatter-adds into one accumulator).
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.graph import _BoxedCodeGen

from memplan.analysis.memory_model import MemoryModel
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors, tensor_values
from memplan.capture import CapturedGraph, InputSpec, OutputSpec, Phase
from memplan.graphutil import is_random, mutated_args, packet_name
from memplan.analysis.cost import CostRates, OpWork, module_cost, op_work
from memplan.passes._chunk.graphs import ALIAS_OPS, fake_call, graph_module
from memplan.passes._chunk.rules import REP, Split, State, arg_of, norm_dim, shape_of
from memplan.passes.inplace import apply_inplace, plan_inplace

__all__ = [
    "AGAIN", "NEGATED", "original_name", "sink_negations", "rematerialise_cheap", "write_in_place", "LoopInput",
    "LoopOutput", "LoopSpec", "ChunkLoop", "BodyModel", "build_body", "body_graph", "body_peak", "handed_over", "loop_scratch",
]


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
    elif name == "slice" and norm_dim(arg_of(node, 1, "dim", 0), len(shape_of(node.args[0]))) == d:
        if len(args) > 3:
            args[3] = sys.maxsize
    elif name == "narrow" and norm_dim(args[1], len(shape_of(node.args[0]))) == d:
        args[3] = length
    return tuple(args), kwargs


def _narrow_fake(value: torch.Tensor, state: Split, units: int, mode) -> torch.Tensor:
    with mode:
        return value.narrow(state.dim, 0, units * state.inner)


# Views whose result depends only on their input's index map (never a copy); a chain of them that ends
# with its start's shape, strides and offset is the identity.
_PURE_VIEWS = {"view", "_unsafe_view", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand"}
# Views that keep the row-major order of elements (a reshape); a chain of them is one ``view``.
_RESHAPES = {"view", "_unsafe_view", "unsqueeze", "squeeze"}


def _same_view(value: Any, origin: Any) -> bool:
    """``value`` (a view of ``origin``) addresses exactly ``origin``'s elements at the same indices."""
    if not isinstance(value, torch.Tensor) or not isinstance(origin, torch.Tensor):
        return False
    if (value.shape, value.stride(), value.storage_offset()) != (origin.shape, origin.stride(), origin.storage_offset()):
        return False
    # distinct strides on every dimension of size > 1 and no overlap: the strides determine the indices
    strides = [s for s, n in zip(origin.stride(), origin.shape) if n > 1]
    return all(s != 0 for s in strides) and len(set(strides)) == len(strides) and not _overlaps(origin)


AGAIN = "_again"  # name suffix of a value a body computes again (same state as the original)
NEGATED = "_negated"  # name suffix of the negation moved after a sum (same state as the sum)


def original_name(name: str) -> str:
    """The region node a body node stands for (its state is that node's state)."""
    return name.removesuffix(AGAIN).removesuffix(NEGATED)


def sink_negations(graph: torch.fx.Graph, mode) -> int:
    """``sum(neg(x))`` -> ``neg(sum(x))`` when nothing else reads ``neg(x)``: the negation runs on the
    reduced value instead of the whole one (autograd writes ``-grad.sum(dims)`` for the broadcast
    operand of every subtraction as a ``neg`` of the full gradient, then a ``sum``). Then
    ``add(a, neg(b))`` -> ``sub(a, b)`` when nothing else reads ``neg(b)``: no negation at all (the
    gradient of ``x`` in ``x - m`` adds both contributions of ``m``).

    Exact: rounding to nearest is symmetric under a change of sign, so each partial sum of the
    negated values is the negation of the same partial sum, whatever the order of the additions, and
    ``a + (-b)`` is ``a - b``. Returns how many ops were rewritten."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SUMS or node.kwargs.get("dtype") is not None:
            continue
        neg = node.args[0]
        if not isinstance(neg, torch.fx.Node) or neg.target is not torch.ops.aten.neg.default or len(neg.users) != 1:
            continue
        node.replace_input_with(neg, neg.args[0])
        graph.erase_node(neg)
        with graph.inserting_after(node):
            negated = graph.call_function(torch.ops.aten.neg.default, (node,), name=f"{node.name}{NEGATED}")
        node.replace_all_uses_with(negated, delete_user_cb=lambda user: user is not negated)
        negated.meta["val"] = fake_call(negated.target, negated.args, {}, mode)
        done += 1
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.add.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        for i in (1, 0):
            neg = node.args[i]
            if isinstance(neg, torch.fx.Node) and neg.target is torch.ops.aten.neg.default and len(neg.users) == 1:
                other = node.args[1 - i]
                value = fake_call(torch.ops.aten.sub.Tensor, (other, neg.args[0]), {}, mode)
                if not _same_meta(value, node.meta.get("val")):
                    continue  # (a scalar operand, or another dtype: keep the op as it is)
                node.target, node.args = torch.ops.aten.sub.Tensor, (other, neg.args[0])
                node.meta["val"] = value
                graph.erase_node(neg)
                done += 1
                break
    return done


def _same_meta(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()))


_SUMS = {torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default}


def _cheap_unary(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one tensor input of a pointwise op that reads nothing else and keeps its input's shape
    (``clamp(x, min=eps)``, ``exp(x)``, ``relu(x)``), else None."""
    if node.op != "call_function" or torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return None
    if is_random(node) or mutated_args(node):
        return None
    tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if len(tensors) != 1 or len(node.all_input_nodes) != 1:
        return None
    source, value = tensors[0], node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.shape != source.meta["val"].shape:
        return None
    return source


def rematerialise_cheap(graph: torch.fx.Graph, mode) -> int:
    """Recompute cheap pointwise values where they are read late, instead of keeping them alive.

    A body recomputing a forward and running its backward keeps ``v = f(u)`` (a pointwise op of one
    input, e.g. ``clamp(exp(x), min=eps)``) from the forward until the backward reads it. When ``u``
    is alive at that late read anyway, ``f(u)`` is computed again right before it (with the views of
    ``v`` the read goes through), so ``v`` dies after its early reads: the live set never grows and
    shrinks by ``v`` in between, for one op more per chunk. Refused when something writes ``u``,
    ``v`` or a view of them in between (the value would differ). Returns how many were recomputed.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    last_read: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            last_read[arg] = order[node]
    writes = [(order[n], m) for n in graph.nodes for m in mutated_args(n)]
    done = 0
    for value in list(graph.nodes):
        source = _cheap_unary(value)
        if source is None:
            continue
        # the views of v, each with the chain of view nodes from v
        chains: dict[torch.fx.Node, list[torch.fx.Node]] = {value: []}
        stack = [value]
        while stack:
            node = stack.pop()
            for user in node.users:
                if user.op == "call_function" and packet_name(user) in ALIAS_OPS and user.args[0] is node and user not in chains:
                    chains[user] = chains[node] + [user]
                    stack.append(user)
        reads = sorted(
            (order[user], user, alias)
            for alias in chains
            for user in alias.users
            if user not in chains and user.op != "output"
        )
        if len(reads) < 2 or any(user.op == "output" for alias in chains for user in alias.users):
            continue
        first = reads[0][0]
        late = [(at, user, alias) for at, user, alias in reads if at > first + 1 and at <= last_read.get(source, -1)]
        if not late:
            continue
        start = late[0][0]
        guarded = set(chains) | {source}
        if any(order[value] < at < start and m in guarded for at, m in writes):
            continue
        # Step: compute v again before its first late read, replay the views each late read needs.
        with graph.inserting_before(late[0][1]):
            again = graph.call_function(value.target, value.args, dict(value.kwargs), name=f"{value.name}{AGAIN}")
            again.meta["val"] = fake_call(value.target, value.args, value.kwargs, mode)
            copies = {value: again}
            for _, user, alias in late:
                for view in chains[alias]:
                    if view not in copies:
                        args = (copies[view.args[0]], *view.args[1:])
                        node = graph.call_function(view.target, args, dict(view.kwargs), name=f"{view.name}{AGAIN}")
                        node.meta["val"] = fake_call(view.target, args, view.kwargs, mode)
                        copies[view] = node
                user.replace_input_with(alias, copies[alias])
        done += 1
    return done


def build_body(
    nodes: Sequence[torch.fx.Node],
    inputs: Sequence[tuple[torch.fx.Node, State]],
    outputs: Sequence[tuple[torch.fx.Node, int | None]],
    states: Mapping[torch.fx.Node, State],
    units: int,
    mode,
    compile: bool = True,
    accumulators: Sequence[torch.fx.Node] = (),
    slots: Sequence[tuple[torch.fx.Node, Split]] = (),
) -> torch.fx.GraphModule:
    """An fx module computing ``outputs`` of one chunk of ``units`` units from chunk-sized ``inputs``.

    ``outputs`` are ``(node, index)`` pairs: ``index`` picks an item of a tuple value. The zero
    tensors in ``accumulators`` are not created per chunk: they are extra inputs (the loop's own
    accumulators) that the body adds into in place; nor are the chunk-sized zero tensors in
    ``slots`` (with their states), which the loop passes after them (the chunk's slices of results).
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
    for node, state in slots:
        placeholder = graph.placeholder(f"{node.name}_out")
        placeholder.meta["val"] = _narrow_fake(node.meta["val"], state, units, mode)
        env[node] = placeholder
    returned = {node for node, _ in outputs}
    base: dict[torch.fx.Node, torch.fx.Node] = {}  # body node -> the value it is a chain of views of
    reshaped: dict[torch.fx.Node, torch.fx.Node] = {}  # body node -> the value it is a chain of reshapes of
    for node in nodes:
        if node in env:
            continue
        if node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            env[node] = env[node.args[0]]  # no-ops outside autograd: one Python call less per chunk
            continue
        args, kwargs = _chunk_args(node, states.get(node, REP), units)
        args = torch.fx.node.map_arg(args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(kwargs, env.__getitem__)
        target, name = node.target, packet_name(node)
        if target is torch.ops.aten.permute.default and args[0].target is torch.ops.aten.permute.default:
            inner, outer = args[0].args[1], args[1]  # permute(permute(x, p), q) is permute(x, p[q])
            args = (args[0].args[0], [inner[d] for d in outer])
        if name == "permute" and list(args[1]) == list(range(len(args[1]))) and node not in returned:
            env[node] = args[0]  # the identity permutation
            continue
        value = fake_call(target, args, kwargs, mode)
        if name in _PURE_VIEWS and node not in returned:
            origin = base.get(args[0], args[0])
            if _same_view(value, origin.meta.get("val")):
                env[node] = origin  # the chain of views maps every index to itself: no op at all
                continue
        if name in _RESHAPES and isinstance(value, torch.Tensor):
            # a chain of row-major reshapes is one reshape of where it started
            origin = reshaped.get(args[0], args[0])
            if origin is not args[0]:
                direct = fake_call(torch.ops.aten.view.default, (origin, list(value.shape)), {}, mode)
                if (direct.shape, direct.stride(), direct.storage_offset()) == (value.shape, value.stride(), value.storage_offset()):
                    target, args, kwargs = torch.ops.aten.view.default, (origin, list(value.shape)), {}
        new = graph.call_function(target, args, kwargs, name=node.name)
        new.meta["val"] = value
        env[node] = new
        if name in _PURE_VIEWS:
            base[new] = base.get(args[0], args[0])
        if name in _RESHAPES:
            reshaped[new] = reshaped.get(args[0], args[0])
    results = []
    for node, index in outputs:
        value = env[node]
        if index is not None:
            item = graph.call_function(operator.getitem, (value, index))
            item.meta["val"] = value.meta["val"][index]
            value = item
        results.append(value)
    graph.output(tuple(results))
    sink_negations(graph, mode)
    rematerialise_cheap(graph, mode)
    for node in reversed(list(graph.nodes)):  # views that folded into others, or were replayed, are not read
        if node.op == "call_function" and not node.users and packet_name(node) in ALIAS_OPS:
            graph.erase_node(node)
    graph.set_codegen(_BoxedCodeGen())
    body = graph_module(torch.nn.Module(), graph, "ChunkBody", compile)
    write_in_place(body)
    return body


def write_in_place(body: torch.fx.GraphModule) -> int:
    """Let the pointwise ops of a loop body write into inputs that die with them (the ``inplace`` pass,
    run on the body: the passes after ``chunk`` see a loop as one node, never its body).

    The body's placeholders are slices of the loop's inputs or its accumulators: external storages,
    which the pass never writes. Returns how many ops now write in place.
    """
    graph = body_graph(body)
    plan = plan_inplace(graph, AnalysisManager(graph))
    if plan.rewrites:
        apply_inplace(graph, plan)
    return len(plan.rewrites)


@dataclasses.dataclass(frozen=True)
class LoopInput:
    """How the loop hands an input to each chunk: a slice on ``dim`` (None: the whole tensor),
    converted to ``dtype`` when set (indices a forward loop stored narrow)."""

    dim: int | None = None
    inner: int = 1
    dtype: torch.dtype | None = None


@dataclasses.dataclass(frozen=True)
class LoopOutput:
    """How the chunks' values combine: ``"cat"`` on ``dim``, ``"sum"``, ``"mean"``, ``"lse"``, ``"max"``,
    ``"min"``, ``"nll_mean"`` (weighted by output ``partner``, a hidden sum), ``"first"``, or
    ``"inplace"`` (the bodies scatter-add into one zero accumulator the loop passes them).

    A ``"cat"`` output with ``into`` set is a zero tensor the body scatter-adds into (viewed): the loop
    passes each chunk its slice of the result, zeroed and viewed as ``into`` rows per unit, so the
    chunk's value is never copied; where that slice is not contiguous, a zero tensor and a copy."""

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
    into: int = 0  # ``"cat"``: rows per unit of the zero tensor the body adds into, which the loop
    # passes it: the chunk's slice of the result itself (zeroed), so nothing is copied
    view_of: int = -1  # a combined output that is a view of combined output ``view_of``: the loop
    # combines that one and hands out its view (``steps``), as eager's views of one tensor

    @property
    def combined(self) -> bool:
        """Whether the loop folds this output over the chunks (in place, after the first chunk)."""
        return self.kind not in ("cat", "first", "inplace")


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


def replay_views(value: Any, steps: Sequence[tuple]) -> Any:
    """``value`` through the view ops ``steps`` (``(target, args after the first, kwargs)`` each)."""
    for target, rest, kwargs in steps:
        value = target(value, *rest, **kwargs)
    return value


def _storage_id(value: torch.Tensor) -> int | None:
    """Where ``value``'s storage starts, or None for a tensor without one to read (a functional tensor of a
    compiler's trace, see :mod:`memplan.inductor`: the loop then copies where it would ask)."""
    try:
        return value.untyped_storage().data_ptr()
    except RuntimeError:
        return None


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

    def run_bodies_with(self, make: Callable[[torch.fx.GraphModule], Callable[[list[Any]], Any]]) -> None:
        """Run each body (called with one list of arguments) with ``make(body)`` instead of its fx code: a
        compiled plan compiles them (:mod:`memplan.inductor`)."""
        self._runners = {int(k): make(body) for k, body in self.bodies.items()}

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        spec = self.spec
        results: list[Any] = [None] * len(spec.outputs)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        accumulators = [
            torch.zeros(out.acc_shape, dtype=out.dtype, device=device) for out in spec.outputs if out.kind == "inplace"
        ]
        # Every chunk's slice of every input in one call per input (views, no copies).
        pieces = [
            None if s.dim is None else a.split(spec.chunk * s.inner, s.dim) for a, s in zip(args, spec.inputs)
        ]
        combined = [(i, out) for i, out in enumerate(spec.outputs)
                    if out.same_as < 0 and out.view_of < 0 and out.kind != "inplace"]
        owned: set[int] = set()  # storages of the folded outputs' values and of the inputs: never shared
        owned.update(_storage_id(a) for a in args if isinstance(a, torch.Tensor))
        widened = [i for i, s in enumerate(spec.inputs) if s.dtype is not None]
        slots: dict[int, Sequence[torch.Tensor]] = {}  # "cat" outputs: each chunk's slice of the result
        for i, out in combined:
            if out.kind == "cat":
                results[i] = torch.empty_strided(out.shape, out.stride, dtype=out.dtype, device=device)
                slots[i] = results[i].split(spec.chunk * out.inner, out.dim)
        into = [(i, out) for i, out in combined if out.into]
        for k in range(spec.chunks):
            start = k * spec.chunk
            length = min(spec.chunk, spec.units - start)
            chunk_args = [a if p is None else p[k] for a, p in zip(args, pieces)]
            for i in widened:
                chunk_args[i] = chunk_args[i].to(spec.inputs[i].dtype)
            chunk_args.extend(accumulators)
            copied = set()
            for i, out in into:
                slot = slots[i][k]
                if slot.is_contiguous():
                    chunk_args.append(slot.view(length * out.into, *out.acc_shape[1:]).zero_())
                else:
                    chunk_args.append(torch.zeros((length * out.into, *out.acc_shape[1:]), dtype=out.dtype, device=device))
                    copied.add(i)
            outs = self._runner(length)(chunk_args)
            for i, out in combined:
                if out.kind == "cat":
                    if not out.into or i in copied:
                        slots[i][k].copy_(outs[i])
                else:
                    results[i] = self._combine(results[i], outs[i], out, length, outs, owned)
            outs = chunk_args = None  # drop this chunk's values before the next chunk runs
        for i, out in enumerate(spec.outputs):
            if out.kind == "nll_mean":
                partner = spec.outputs[out.partner].same_as if spec.outputs[out.partner].same_as >= 0 else out.partner
                results[i] = results[i] / results[partner]
        inplace = iter(accumulators)
        for i, out in enumerate(spec.outputs):
            if out.kind == "inplace":
                results[i] = replay_views(next(inplace), out.steps)
        for i, out in enumerate(spec.outputs):
            if out.view_of >= 0:
                results[i] = replay_views(results[out.view_of], out.steps)
        for i, out in enumerate(spec.outputs):
            if out.same_as >= 0:
                results[i] = results[out.same_as]
        public = [r for r, out in zip(results, spec.outputs) if out.public]
        return (*public, torch.empty(0, dtype=torch.uint8, device=device))

    def _combine(self, acc: Any, value: torch.Tensor, out: LoopOutput, length: int, outs, owned: set[int]) -> Any:
        """Fold one chunk's ``value`` into ``acc`` (None before the first chunk); ``"cat"`` is done
        by :meth:`forward`, which writes each chunk into its slice of the result.

        The first chunk's value becomes the accumulator that later chunks fold into in place, so it
        must own its storage: a value sharing storage with another folded output (two views of one
        body value) or with an input is copied first (``owned`` holds those storages)."""
        kind = out.kind
        if kind == "first":
            return value if acc is None else acc
        if kind == "nll_mean":
            # the chunk's mean times its total weight (the partner's chunk value, the same tensor as its
            # twin's) is its sum; a chunk of ignored targets only (or of weight-0 classes) has mean 0/0,
            # and its sum is 0, not nan
            weight = outs[out.partner]
            value = (value * weight).masked_fill(weight == 0, 0)
            kind = "sum"
        if kind == "mean":
            weight = length / self.spec.units
            if acc is None:
                return value * weight
            return acc.add_(value, alpha=weight)
        if acc is None:
            storage = _storage_id(value)
            if storage is None or _overlaps(value) or storage in owned:
                value = value.clone()
            owned.add(_storage_id(value))
            return value
        if kind == "sum":
            return acc.add_(value)
        if kind == "lse":
            return torch.logaddexp(acc, value, out=acc)
        if kind == "max":
            return torch.maximum(acc, value, out=acc)
        if kind == "min":
            return torch.minimum(acc, value, out=acc)
        raise ValueError(f"unknown combine {kind!r}")

    def _chunk_lengths(self) -> Iterator[int]:
        """The length of each chunk of one run, in order (every chunk but the last is full)."""
        for k in range(self.spec.chunks):
            yield min(self.spec.chunk, self.spec.units - k * self.spec.chunk)

    def cost(self, rates: CostRates) -> float:
        """Estimated seconds of one run: every chunk's body plus ``rates.chunk_seconds`` per chunk."""
        per_length = {length: module_cost(body, rates) for length, body in self.bodies.items()}
        total = 0.0
        for length in self._chunk_lengths():
            total += per_length[str(length)] + rates.chunk_seconds
        return total

    def flops(self, count: Callable[[torch.fx.Node], int]) -> int:
        """FLOPs of one run: ``count`` of every op of every chunk's body (a nested loop by its own
        :meth:`flops`). The passes after ``chunk`` see a loop as one node; this is what it computes."""
        per_length = {}
        for length, body in self.bodies.items():
            ops = 0
            for node in body.graph.nodes:
                if node.op == "call_function":
                    ops += count(node)
                elif node.op == "call_module":
                    inner = body.get_submodule(node.target)
                    ops += inner.flops(count) if isinstance(inner, ChunkLoop) else 0
            per_length[length] = ops
        return sum(per_length[str(length)] for length in self._chunk_lengths())


@dataclasses.dataclass(frozen=True)
class BodyModel:
    """A loop body's peak and cost at any chunk length, from one body built at ``length``.

    Changing the chunk length changes no node, no storage and no live interval of a body: a value that
    carries the index changes its size in proportion to the length, every other value keeps its size.
    So one built body prices every length: ``peak`` is the body's
    :class:`~memplan.analysis.memory_model.MemoryModel` with the storages that carry the index resized
    (``with_sizes``), ``cost`` scales each op's work (:class:`~memplan.analysis.cost.OpWork`).
    """

    length: int
    model: MemoryModel = dataclasses.field(repr=False)  # the body's, at ``length``
    scaled: tuple[tuple[int, int], ...]  # (storage id, bytes at ``length``) of the storages that carry the index
    work: tuple[OpWork, ...]
    held: int = 0  # bytes per unit of length the loop holds beside the body (inputs it widens)
    results: int = 0  # bytes of the first chunk's values that become the loop's results (see handed_over)

    @classmethod
    def of(cls, body: torch.fx.GraphModule, scales: Callable[[str, int | None], bool], length: int, held: int = 0,
           outputs: Sequence[LoopOutput] = ()) -> "BodyModel":
        """``scales(name, index)``: the value of body node ``name`` (item ``index``) carries the index;
        ``held``: bytes per unit of length the loop holds beside the body; ``outputs``: how the loop
        combines the body's outputs (for :func:`handed_over`)."""
        am = AnalysisManager(body_graph(body))
        tensors = am.get(Tensors)
        scaled = []
        for sid, storage in tensors.storages.items():
            if storage.external:
                continue
            index = next(info.index for info in tensors.tensors[storage.creator] if info.storage == sid)
            if scales(storage.creator, index):
                scaled.append((sid, storage.nbytes))

        def node_scales(node: torch.fx.Node) -> bool:
            items = [i for i, _ in tensor_values(node)]
            return any(scales(node.name, i) for i in items)

        work = tuple(op_work(n, node_scales) for n in body.graph.nodes if n.op == "call_function")
        return cls(length, am.get(MemoryModel), tuple(scaled), work, held, handed_over(body, outputs, tensors))

    def peak(self, length: int) -> int:
        if length == self.length or not self.scaled:
            peak = self.model.peak
        else:
            peak = self.model.with_sizes({sid: size * length // self.length for sid, size in self.scaled}).peak
        return peak + self.held * length

    def scratch(self, units: int, chunk: int) -> int:
        """The loop's scratch (see :func:`loop_scratch`) when it runs ``units`` units ``chunk`` at a time."""
        return loop_scratch(self.peak, units, chunk, self.results)

    def cost(self, length: int, rates: CostRates) -> float:
        factor = length / self.length
        return sum(w.price(rates, factor) for w in self.work)


# the combines whose first chunk's value is the result itself, folded into by the later chunks
_HANDED_OVER = ("sum", "lse", "max", "min", "first")


def handed_over(body: torch.fx.GraphModule, outputs: Sequence[LoopOutput], tensors: Tensors | None = None) -> int:
    """Bytes of the values the first chunk of a loop hands over, uncopied, as the loop's results.

    :meth:`ChunkLoop._combine` keeps the first chunk's value of a ``"sum"``, ``"lse"``, ``"max"``,
    ``"min"`` or ``"first"`` output as the result the later chunks fold into. Counted are the folded
    outputs the user sees (public, or the base of a public view) whose value owns a storage of its
    own, exactly its size (a view of a larger storage, an expanded value, or one sharing its storage
    with another folded output may be copied at run time, and is not counted: the scratch then stays
    an upper bound)."""
    if not outputs:
        return 0
    tensors = AnalysisManager(body_graph(body)).get(Tensors) if tensors is None else tensors
    values = next(n for n in body.graph.nodes if n.op == "output").args[0]
    infos = [tensors.tensors.get(v.name, ()) if isinstance(v, torch.fx.Node) else () for v in values]
    folded = [out.same_as < 0 and out.view_of < 0 for out in outputs]  # the others are handed out from these
    seen = {i for i, out in enumerate(outputs) if out.public} | {out.view_of for out in outputs if out.public}
    uses: dict[int, int] = {}
    for found, fold in zip(infos, folded):
        for info in found if fold else ():
            uses[info.storage] = uses.get(info.storage, 0) + 1
    total = 0
    for i, (found, out) in enumerate(zip(infos, outputs)):
        if not (folded[i] and i in seen and out.kind in _HANDED_OVER and len(found) == 1):
            continue
        storage = tensors.storages[found[0].storage]
        if not storage.external and uses[storage.id] == 1 and storage.nbytes == found[0].nbytes:
            total += storage.nbytes
    return total


def loop_scratch(peak: Callable[[int], int], units: int, chunk: int, results: int = 0) -> int:
    """The bytes a loop needs beside its results, at its highest chunk: what the simulation adds to
    the loop's results (allocated when the loop starts) to get the loop's peak exactly.

    ``peak(length)``: a body's peak at ``length`` units, its outputs included; ``results``: bytes of
    those outputs the first chunk hands over as the results (:func:`handed_over`). During the first
    chunk those results are the body's own values, so they are not counted twice; every later chunk
    runs beside them."""
    chunk = min(chunk, units)
    chunks = -(-units // chunk)
    last = units - (chunks - 1) * chunk
    highest = peak(chunk) - results
    if chunks > 2:
        highest = max(highest, peak(chunk))
    if chunks > 1:
        highest = max(highest, peak(last))
    return highest


def body_peak(body: torch.fx.GraphModule) -> int:
    """Simulated peak of one run of a loop body (its inputs are views of existing tensors)."""
    return AnalysisManager(body_graph(body)).get(PeakSimulation).peak


def body_graph(body: torch.fx.GraphModule) -> CapturedGraph:
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
