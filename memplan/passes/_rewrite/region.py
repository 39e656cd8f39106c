"""Replacing a forward region and its backward by a function traced through autograd.

A region rewrite (stage 1 of :mod:`memplan.passes.rewrite`) names the forward nodes it replaces, the
values they read (*inputs*) and the values read outside them (*outputs*), and a function computing the
outputs from the inputs: a :class:`Replacement`. :func:`replace_region` then

(2) finds the region's backward by autograd sequence numbers
    (:func:`~memplan.passes._chunk.graphs.region_backward`) and matches the gradients it reads to the
    region's outputs and the gradients it produces to the region's inputs (by shape and dtype, then by
    sequence number);
(3) traces the function's forward together with its backward by ``make_fx`` over the inputs' fake
    values (the graph's own fake mode), through autograd, with sequence numbers recorded;
(4) inlines the traced forward (phase forward) and backward (phase backward, ordered after the last
    gradient it reads, as autograd runs it) into the joint graph, points the region's readers at the
    new values, erases the old nodes and re-sorts stably.

It refuses (returns ``False``, the graph untouched) when the backward cannot be found or matched, when a
region node other than an output is read outside the region and its backward, or when a gradient the
graph needs is not produced by the function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from memplan.capture import CapturedGraph, Phase, _tag_backward_with_seq_nr
from memplan.graphutil import mutated_args, next_seq_nr
from memplan.opschema import is_view_op
from memplan.passes._chunk.graphs import fake_mode_of, refresh_aliases, region_backward, same_layouts, stable_toposort

__all__ = ["Replacement", "RegionRewrite", "node_shape", "node_dtype", "forward_users", "forward_nodes",
           "match_gradients", "trace_joint", "replace_region", "runs_on"]


@dataclasses.dataclass(frozen=True)
class Replacement:
    """What replaces a forward region: ``fn(*inputs)`` returns one value per name in ``outputs`` (``None``
    for an output nothing reads); ``anchor`` is the node whose source line and sequence number the new
    nodes take."""

    region: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str | None, ...]
    fn: Callable[..., tuple[torch.Tensor, ...]]
    anchor: str


class RegionRewrite(Protocol):
    """A pattern found in stage 1 that replaces a forward region and its backward."""

    def nodes(self) -> set[str]:
        """The graph nodes the pattern claims (no two patterns of one run share a node)."""

    def replacement(self, graph: CapturedGraph) -> Replacement:
        """The region, its inputs and outputs, and the function that computes them."""


def node_shape(node: Any) -> tuple[int, ...]:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else ()


def node_dtype(node: torch.fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def forward_users(graph: CapturedGraph, node: torch.fx.Node) -> int:
    """How many forward nodes (or graph outputs) read ``node``; backward readers belong to its backward."""
    return sum(1 for u in node.users if u.op == "output" or graph.phases.get(u.name) is Phase.FORWARD)


def forward_nodes(graph: CapturedGraph) -> list[torch.fx.Node]:
    return [n for n in graph.gm.graph.nodes if n.op == "call_function" and graph.phases.get(n.name) is Phase.FORWARD]




def match_gradients(graph, region, inputs, outputs, backward):
    """Map the backward's incoming gradients to region outputs, its results to region inputs."""
    seq = graph.seq_nr
    members = set(backward.nodes)
    region_set = set(region)
    incoming: dict[int, list[torch.fx.Node]] = {}
    for name in backward.grad_inputs:
        g = graph.node(name)
        options = [i for i, o in enumerate(outputs) if o is not None and node_shape(o) == node_shape(g) and node_dtype(o) == node_dtype(g)]
        if len(options) > 1:
            readers = {seq.get(u.name) for u in g.users if u.name in members}
            options = [i for i in options if seq.get(outputs[i].name) in readers]
        if len(options) != 1:
            return None
        incoming.setdefault(options[0], []).append(g)
    produced: dict[int, torch.fx.Node] = {}
    for name in backward.grad_outputs:
        d = graph.node(name)
        options = [i for i, x in enumerate(inputs) if node_shape(x) == node_shape(d) and node_dtype(x) == node_dtype(d)]
        if len(options) > 1:
            # the input whose chain holds the op whose backward made the gradient; when none or several,
            # or when the gradient is an accumulation (whose number is stale), the input read by that op
            # or by those it reads
            number = seq.get(d.name)
            exact = [i for i in options if number is not None and number in _chain_seqs(inputs[i], region_set, seq)]
            accumulation = d.target is torch.ops.aten.add.Tensor
            seqs = {seq.get(d.name)} | {seq.get(a.name) for a in d.all_input_nodes if a.name in members}
            options = exact if len(exact) == 1 and not accumulation else \
                [i for i in options if any(seq.get(u.name) in seqs for u in inputs[i].users if u.name in region_set)]
        if len(options) != 1 or options[0] in produced:
            return None
        produced[options[0]] = d
    return incoming, produced


def _chain_seqs(x: torch.fx.Node, region: set[str], seq: dict[str, int]) -> set[int | None]:
    """Sequence numbers of the region ops that read ``x`` and of the ops that follow them while each
    reads one tensor (views, copies, scales: their backward hands the gradient on to ``x``), up to and
    including the first that reads more. Only ``x``'s gradient is made by such a chain's backward
    (``expand`` of ``q`` to its own shape has none, and the ``view`` after it makes ``q``'s)."""
    found: set[int | None] = set()
    stack, seen = [u for u in x.users if u.name in region], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        found.add(seq.get(node.name))
        if len(node.all_input_nodes) == 1:
            stack.extend(u for u in node.users if u.name in region)
    return found


def trace_joint(fn, input_values, needs_grad, grad_values):
    """``make_fx`` of ``fn``'s forward and, through autograd, its backward; returns the graph and the
    name of its last forward node."""
    box: dict[str, Any] = {}
    n_in = len(input_values)

    def joint(*flat):
        leaves = [x.detach().requires_grad_(True) if need else x for x, need in zip(flat[:n_in], needs_grad)]
        outs = fn(*leaves)
        box["boundary"] = list(get_proxy_mode().tracer.graph.nodes)[-1].name
        pairs = [(o, g) for o, g in zip(outs, grad_values) if g is not None]
        wrt = [leaf for leaf, need in zip(leaves, needs_grad) if need]
        grads: tuple = ()
        if pairs and wrt:
            _tag_backward_with_seq_nr([o.grad_fn for o, _ in pairs if o.grad_fn is not None])
            given = iter(flat[n_in:])
            grads = torch.autograd.grad([o for o, _ in pairs], wrt, [next(given) for _ in pairs], allow_unused=True)
        return (*outs, *grads)

    grads = [g for g in grad_values if g is not None]
    with torch.enable_grad(), fx_traceback.preserve_node_meta():
        gm = make_fx(joint, tracing_mode="fake")(*input_values, *grads)
    gm.graph.eliminate_dead_code()
    return gm, box["boundary"]


def replace_region(graph: CapturedGraph, region_names: Sequence[str], input_names: Sequence[str],
                    output_names: Sequence[str], fn, anchor_name: str, state: dict) -> bool:
    """Replace ``region`` (forward) and its backward with ``fn`` traced through autograd (in place on
    ``graph.gm``; ``state`` holds the phases, sources and sequence numbers being edited).

    ``fn(*inputs)`` returns one value per name in ``output_names``; every region node read outside
    the region and its backward must be one of them."""
    gm = graph.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    names = set(region_names)
    for node in gm.graph.nodes:  # autograd's detach of a region value (made to save it) goes with it
        if node.target is torch.ops.aten.detach.default and node.args[0].name in names:
            if graph.phases.get(node.name) is Phase.FORWARD:
                names.add(node.name)
    region_names = [n.name for n in gm.graph.nodes if n.name in names]
    region = [by_name[n] for n in region_names]
    region_set = set(region)
    inputs = [by_name[n] for n in input_names]
    # Step 2: the region's backward, and which gradients it reads and produces.
    backward = region_backward(graph, region_names)
    if backward is None:
        return False
    members = {by_name[n] for n in backward.nodes}
    outputs = [by_name[n] if n is not None else None for n in output_names]
    if any(n not in outputs and any(u not in region_set and u not in members for u in n.users) for n in region):
        return False
    matched = match_gradients(graph, region_names, inputs, outputs, backward)
    if matched is None:
        return False
    incoming, produced = matched
    needs_grad = [i in produced for i in range(len(inputs))]
    grad_values = [incoming[i][0].meta["val"] if i in incoming else None for i in range(len(outputs))]
    # Step 3: the replacement's forward and backward, traced together over the inputs' fake values.
    mode = fake_mode_of(gm.graph)
    traced, boundary = trace_joint(fn, [x.meta["val"] for x in inputs], needs_grad, grad_values)
    if any(getattr(v, "fake_mode", mode) is not mode for n in traced.graph.nodes for v in [n.meta.get("val")]):
        return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    priority = dict((n, float(i)) for n, i in order.items())
    first_fwd = min(order[n] for n in region)
    first_bwd = min((order[n] for n in members), default=len(order))
    # the new backward runs once every gradient it reads exists, as autograd runs a node: ops of it that
    # read none (a recomputation) would otherwise be ordered before a late one's producers, and held
    first_bwd = max([first_bwd] + [order[g] + 1 for gs in incoming.values() for g in gs])
    base_seq = next_seq_nr(graph)
    traced_seqs = sorted({n.meta["seq_nr"] for n in traced.graph.nodes if isinstance(n.meta.get("seq_nr"), int)})
    remap = {s: base_seq + i for i, s in enumerate(traced_seqs)}

    # Step 4: inline it, forward nodes in the forward phase and backward nodes in the backward phase.
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for p, x in zip(placeholders, inputs):
        env[p] = x
    gradient_placeholders = iter(placeholders[len(inputs):])
    created: list[torch.fx.Node] = []

    def add(target, args, kwargs, phase: Phase, seq: int | None, value, prio: float) -> torch.fx.Node:
        with gm.graph.inserting_before(output_node):
            node = gm.graph.call_function(target, args, kwargs)
        node.meta["val"] = value
        state["phases"][node.name] = phase
        state["seq_nr"][node.name] = seq if seq is not None else graph.seq_nr.get(anchor_name, base_seq)
        if anchor_name in graph.sources:
            state["sources"][node.name] = graph.sources[anchor_name]
        priority[node] = prio
        created.append(node)
        return node

    for i, g in enumerate(grad_values):
        if g is None:
            continue
        total = incoming[i][0]
        for extra in incoming[i][1:]:
            total = add(torch.ops.aten.add.Tensor, (total, extra), {}, Phase.BACKWARD, None, total.meta["val"], first_bwd - 0.6)
        env[next(gradient_placeholders)] = total
    phase = Phase.FORWARD
    for k, node in enumerate(n for n in traced.graph.nodes if n.op == "call_function"):
        if node.target is torch.ops.aten.detach.default and node.args[0] in env and node.args[0].op == "placeholder":
            env[node] = env[node.args[0]]  # a leaf made for tracing, not part of the computation
        else:
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            seq = remap.get(node.meta.get("seq_nr"))
            prio = (first_fwd if phase is Phase.FORWARD else first_bwd) - 0.5 + k * 1e-6
            env[node] = add(node.target, args, kwargs, phase, seq, node.meta["val"], prio)
        if node.name == boundary:
            phase = Phase.BACKWARD
    results = [env[v] if isinstance(v, torch.fx.Node) else v for v in next(n for n in traced.graph.nodes if n.op == "output").args[0]]
    new_outputs, new_grads = results[: len(outputs)], results[len(outputs) :]
    if any(g is None for g in new_grads):
        for node in reversed(created):
            gm.graph.erase_node(node)
        return False
    def laid_out_as(old: torch.fx.Node, new: Any, phase: Phase, outside: Callable[[torch.fx.Node], bool]) -> Any:
        """``new``, copied to ``old``'s contiguous layout when a reader of ``old`` (outside the region)
        cannot run on ``new``'s: what reads ``old`` was traced on its layout, and a view there may be
        impossible on another (the gradient of ``k`` in ``(x[:, :, None] * k[:, None]).sum(-1)`` comes
        out of the batched matmul transposed, and ``nn.Linear``'s backward views it as a matrix). Most
        readers take any layout, and get no copy (maxsim's gradients)."""
        was, value = old.meta.get("val"), getattr(new, "meta", {}).get("val")
        if not (isinstance(new, torch.fx.Node) and isinstance(was, torch.Tensor) and isinstance(value, torch.Tensor)):
            return new
        if same_layouts(was, value) or not was.is_contiguous() \
                or all(runs_on(u, old, value, mode) for u in old.users if outside(u)):
            return new
        with mode:
            dense = value.clone(memory_format=torch.contiguous_format)
        return add(torch.ops.aten.clone.default, (new,), {"memory_format": torch.contiguous_format}, phase,
                   state["seq_nr"].get(new.name), dense, priority[new] + 1e-7)

    for old, new in zip(outputs, new_outputs):
        if old is None:
            continue
        outside = lambda u: u not in region_set and u not in members  # noqa: E731
        old.replace_all_uses_with(laid_out_as(old, new, Phase.FORWARD, outside), delete_user_cb=outside)
    grads_for = iter(new_grads)
    for i in range(len(inputs)):
        if i in produced:
            outside = lambda u: u not in members  # noqa: E731
            new = laid_out_as(produced[i], next(grads_for), Phase.BACKWARD, outside)
            produced[i].replace_all_uses_with(new, delete_user_cb=outside)
    for node in [n for n in gm.graph.nodes if n in members][::-1]:
        gm.graph.erase_node(node)
    for node in region[::-1]:
        if not node.users:
            gm.graph.erase_node(node)
    stable_toposort(gm.graph, priority)
    # Views of the region's inputs must alias the inputs' storages (the traced backward unpacks saved
    # tensors into new fake tensors); views of the new values must alias those.
    refresh_aliases(gm.graph, [*inputs, *created, *(g for gs in incoming.values() for g in gs)], mode)
    return True


def runs_on(reader: torch.fx.Node, old: torch.fx.Node, value: torch.Tensor, mode, depth: int = 8) -> bool:
    """Whether ``reader`` runs with ``value`` in place of ``old``'s, and so do the views of its result,
    down the chain (only a view can fail on a layout: ``squeeze`` of a gradient, then ``view`` of that).

    The graph's output takes the old layout only: a gradient leaves the plan for its leaf's ``.grad``,
    and autograd copies one laid out unlike the leaf into the leaf's layout, a copy the plan does not
    see (capture plans that copy where the trace's gradient needs it, on the old layout). Counterexample:
    ``(x @ w).min(0)`` gave ``w``'s gradient transposed, and autograd's copy of it was 5% above the
    predicted peak. A pointwise op lays its result out after its inputs, so a changed layout also
    flows through the ops that are not views, to the output: ``a.squeeze(0) + b.squeeze(1)``, two
    contributions to one gradient, gave it the transposed layout of the product they came from."""
    if reader.op == "output":
        return same_layouts(old.meta.get("val"), value)
    if reader.op != "call_function" or mutated_args(reader):
        return True  # an in-place op's result is its input, laid out as it is
    view = is_view_op(reader.target)

    def to_val(a: Any) -> Any:
        return value if a is old else a.meta["val"] if isinstance(a, torch.fx.Node) else a

    try:
        with mode:
            result = reader.target(*torch.fx.node.map_aggregate(reader.args, to_val),
                                   **torch.fx.node.map_aggregate(reader.kwargs, to_val))
    except (RuntimeError, ValueError):
        return False
    if not view and same_layouts(reader.meta.get("val"), result):
        return True  # the op lays its result out as traced: its readers see nothing new
    if not isinstance(result, torch.Tensor):
        return view  # a view's items (split) were run; another op's changed items are not followed
    if depth == 0:
        return False  # not followed to its end: copied, to be safe
    return all(runs_on(user, reader, result, mode, depth - 1) for user in reader.users)
