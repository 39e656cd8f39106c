"""Emit: a planned joint graph becomes forward and backward GraphModules run by one autograd.Function.

Stages
------
(1) Saved set: every forward node or graph input that a backward node reads crosses from forward to
    backward, and nothing else does.
(2) Forward module: the graph inputs (parameters, buffers, user leaves) -> model outputs + saved values.
(3) Backward module: saved values + one tangent per differentiable output -> gradients of the inputs
    that require grad.
(4) Both modules use boxed calling (one list argument, cleared on entry), so each tensor is freed at
    its last use inside the module; the backward also clears autograd's copies of the saved tensors
    (unless the graph is retained) before running, as eager autograd releases them node by node.

The modules are ordinary fx GraphModules executed eagerly: profilers and allocator statistics see
their real allocations. Inference plans have only the forward module.

Where hooks wait for gradients as they are made (DDP's reducer, an optimizer step in the backward), the
backward runs in stages instead (see :func:`run_training`): its code, written again as a generator, pauses
after each run of finished gradients and hands them to autograd.

Stages (2) and (3) describe each module as a :class:`_Program`, a selection of the joint graph's nodes.
The code that runs is generated from the programs directly (:func:`_boxed_source`), character for
character the code fx would generate for the modules, so the modules themselves (copies of the
selected nodes) are built only when read (``Emitted.forward``, ``Emitted.code``): on a 1000-step loop,
copying the nodes and fx's code generation took most of emit's time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import _BoxedCodeGen

try:  # fx's private naming and formatting helpers, which the direct code generation repeats
    from torch.fx.graph import _custom_builtins, _format_target, _is_from_torch, _Namespace, magic_methods
except ImportError:  # pragma: no cover - another torch: emit writes fx's own code (slower, the same code)
    _custom_builtins = None
from torch.fx.immutable_collections import immutable_list
from torch.autograd.graph import get_gradient_edge
from torch.fx.node import _get_qualified_name
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.capture import AUTOCAST_KINDS, CapturedGraph, Phase, autocast_off, caller_line
from memplan.errors import AutocastBackwardError, HigherOrderGradientError, OutputGradientHookError
from memplan.graphutil import nbytes
from memplan.opschema import GRAD_MODE_OPS

__all__ = ["Emitted", "emit", "PlanFunction", "run_training"]

# At most this many pauses in a staged backward, each an autograd node (see _Program.staged).
MAX_STAGES = 16


@dataclasses.dataclass(frozen=True)
class Emitted:
    """The runnable form of a plan.

    ``forward`` and ``backward`` (None for inference) are the modules as fx GraphModules, built from the
    planned graph on first access (the plan keeps that graph, and nothing edits it after planning);
    ``run_forward`` and ``run_backward`` run their code.
    """

    n_outputs: int  # flat model outputs the forward returns before the saved values
    saved: tuple[str, ...]  # joint-graph names of the saved values, in order
    differentiable: tuple[int, ...]  # flat output positions that receive a tangent
    grad_inputs: tuple[int, ...]  # flat input positions the backward's gradients belong to
    constant_outputs: tuple[tuple[int, Any], ...]  # outputs that are Python constants
    # positions among the saved values of plain values (a Python number read by .item()), not tensors
    plain_saved: tuple[int, ...]
    tangents: tuple[tuple[torch.Size, torch.dtype, torch.device], ...]  # per differentiable output
    dense_tangents: tuple[bool, ...]  # per differentiable output: its tangent must reach the backward dense
    # per differentiable output: ... unless every tangent arrives as a broadcast scalar (see OutputSpec)
    broadcast_together: tuple[bool, ...]
    # per gradient the backward returns: the tangents (bit j: the j-th differentiable output's) it reads
    # through any op; with none of them sent, autograd gives the input no gradient (None), not zeros
    grad_tangents: tuple[int, ...]
    read_inside: frozenset[int]  # differentiable output positions the forward also reads (their gradient has an inside part)
    run_forward: Callable[[list[Any]], Any] = dataclasses.field(repr=False, compare=False)
    run_backward: Callable[[list[Any]], Any] | None = dataclasses.field(repr=False, compare=False)
    # () -> (forward, backward): builds the GraphModules (see the module docstring).
    build_modules: Callable[[], tuple[torch.fx.GraphModule, torch.fx.GraphModule | None]] = dataclasses.field(
        repr=False, compare=False
    )
    # the backward op autocast would cast were the backward run inside the forward's autocast block
    # (see CapturedGraph.autocast_in_backward), or None
    autocast_in_backward: str | None = None
    # the output positions (gradients) each pause of the staged backward gives out, in order (see
    # _Program.staged), and a start of that backward (None without pauses; see run_training)
    stages: tuple[tuple[int, ...], ...] = ()
    start_staged: Callable[[list[Any]], Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @functools.cached_property
    def _modules(self) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule | None]:
        return self.build_modules()

    @property
    def forward(self) -> torch.fx.GraphModule:
        return self._modules[0]

    @property
    def backward(self) -> torch.fx.GraphModule | None:
        return self._modules[1]

    @property
    def code(self) -> str:
        parts = ["# forward", self.forward.code.strip()]
        if self.backward is not None:
            parts += ["", "# backward", self.backward.code.strip()]
        return "\n".join(parts) + "\n"


def _boxed(root: torch.nn.Module, graph: torch.fx.Graph, name: str) -> torch.fx.GraphModule:
    """A boxed GraphModule of ``graph``, lazy: its own code is generated only when read or called."""
    graph.set_codegen(_BoxedCodeGen())
    return _LazyGraphModule(root, graph, class_name=name)


@dataclasses.dataclass(eq=False)
class _HandOff:
    """A line of the backward that hands gradient ``index`` (``value``) to :func:`_hand_off` once nothing
    after it reads or writes its storage; the program returns what that gives back."""

    index: int
    value: torch.fx.Node


@dataclasses.dataclass(eq=False)
class _Yield:
    """A line of the staged backward (see :meth:`_Program.staged`) that gives out the gradients handed off
    just before it, and pauses the backward until autograd asks for the next stage."""

    hands: list[_HandOff]


_HANDS = threading.local()  # .sink: the backward running now takes gradients early (see PlanFunction)


def _hand_off(index: int, value: Any) -> Any:
    """``value``, or None when the backward running now has taken it (added it to a ``.grad``)."""
    sink = getattr(_HANDS, "sink", None)
    return value if sink is None else sink(index, value)


@dataclasses.dataclass
class _Program:
    """One emitted module as a selection of the joint graph's nodes, in graph order, without copies.

    ``items`` holds ``(node, saved)`` pairs: the node is copied as it is, or, when ``saved``, it is a
    value saved for backward and becomes a placeholder named after it. ``alias`` maps each skipped
    ``detach`` (see :func:`_is_detach`) to the node it stands for; ``outputs`` are joint nodes or constants.
    """

    items: list[tuple[torch.fx.Node, bool]] = dataclasses.field(default_factory=list)
    alias: dict[torch.fx.Node, torch.fx.Node] = dataclasses.field(default_factory=dict)
    outputs: list[Any] = dataclasses.field(default_factory=list)

    def resolve(self, node: torch.fx.Node) -> torch.fx.Node:
        return self.alias.get(node, node)

    def add(self, node: torch.fx.Node) -> None:
        """Copy ``node`` into the program; a detach is not copied, its readers read its input (see :func:`_is_detach`)."""
        if _is_detach(node):
            self.alias[node] = self.resolve(node.args[0])
        else:
            self.items.append((node, False))

    def graph_module(self, root: torch.fx.GraphModule, name: str) -> torch.fx.GraphModule:
        """The program as a boxed GraphModule (copies of its nodes)."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node, saved in self.items:
            if isinstance(node, _HandOff):
                env[node] = graph.call_function(_hand_off, (node.index, env[node.value]))
                continue
            if saved:
                env[node] = graph.placeholder(node.name)
                env[node].meta = dict(node.meta)
            else:
                env[node] = graph.node_copy(node, lambda n: env[self.resolve(n)])
            if env[node].op == "placeholder":
                # The module is called with one list (boxed), so a placeholder's target names nothing the
                # caller sees. fx's code reads every placeholder into its target and then renames it to
                # its node's name, one after another: with a target ``Mul`` named ``mul`` and a target
                # ``mul`` named ``mul_1``, ``mul = Mul`` overwrites ``mul`` before ``mul_1 = mul`` reads
                # it. Reading each straight into its name has nothing to rename.
                env[node].target = env[node].name
        graph.output([env[v] if isinstance(v, _HandOff) else env[self.resolve(v)] if isinstance(v, torch.fx.Node) else v
                      for v in self.outputs])
        return _boxed(root, graph, name)

    def hand_off_gradients(self) -> None:
        """Hand each output (a gradient) to :func:`_hand_off` right after the last item that reads or
        writes its storage, and return what it gives back: a gradient the running backward adds to a
        ``.grad`` itself is freed there, not held to the end (see :class:`PlanFunction`)."""
        key_of: dict[torch.fx.Node, Any] = {}  # each node's storage key, made once

        def key(node: torch.fx.Node) -> Any:
            found = key_of.get(node)
            if found is None:
                found = key_of[node] = _storage_key(node)
            return found

        last: dict[Any, int] = {}  # storage (or node, without a fake value) -> last item touching it
        for i, (node, saved) in enumerate(self.items):
            last[key(node)] = i
            if not saved and node.op != "placeholder":
                for arg in node.all_input_nodes:
                    last[key(self.resolve(arg))] = i
        after: dict[int, list[_HandOff]] = {}
        for k, value in enumerate(self.outputs):
            if isinstance(value, torch.fx.Node):
                value = self.resolve(value)
                at = last.get(key(value))
                if at is not None:
                    self.outputs[k] = hand = _HandOff(k, value)
                    after.setdefault(at, []).append(hand)
        items = []
        for i, item in enumerate(self.items):
            items.append(item)
            items.extend((hand, False) for hand in after.get(i, ()))
        self.items = items

    def staged(self, max_stages: int) -> tuple[_Program, tuple[tuple[int, ...], ...]]:
        """This backward program (after :meth:`hand_off_gradients`) paused after its gradients are handed
        off: a copy whose code is a generator that yields, at most ``max_stages`` times, the gradients
        handed off since its last pause, and returns the rest (None where it gave one out already). Also
        the output positions each pause gives out. A group of hand-offs with nothing computed after it
        gives nothing out early: those are returned.

        Pauses are placed between runs of hand-offs, merged so that each stage gives out about an equal
        share of the early gradients' bytes (autograd then hands each stage's to its leaves, and their
        hooks fire, DDP's all-reduce among them, while the rest of the backward runs)."""
        groups: list[tuple[int, list[_HandOff]]] = []  # (item position after the run, its hand-offs)
        run: list[_HandOff] = []
        for i, (item, _) in enumerate(self.items):
            if isinstance(item, _HandOff):
                run.append(item)
            elif run:
                groups.append((i, run))
                run = []
        sizes = [sum(nbytes(hand.value) for hand in hands) for _, hands in groups]
        share = sum(sizes) / max_stages if groups else 0
        cuts: list[tuple[int, list[_HandOff]]] = []
        pending: list[_HandOff] = []
        held = 0
        for (at, hands), size in zip(groups, sizes):
            pending += hands
            held += size
            if held >= share or len(groups) <= max_stages:
                cuts.append((at, pending))
                pending, held = [], 0
        if pending:
            cuts.append((groups[-1][0], pending))
        pause_at = {at: _Yield(hands) for at, hands in cuts}
        given = {hand.index for _, hands in cuts for hand in hands}  # output positions given out early
        items = []
        for i, item in enumerate(self.items):
            if i in pause_at:
                items.append((pause_at[i], False))
            items.append(item)
        outputs = [None if isinstance(v, _HandOff) and v.index in given else v for v in self.outputs]
        stages = tuple(tuple(hand.index for hand in hands) for _, hands in cuts)
        return _Program(items=items, alias=self.alias, outputs=outputs), stages


def _storage_key(node: torch.fx.Node) -> Any:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return StorageWeakRef(value.untyped_storage())
    return node


def emit(graph: CapturedGraph) -> Emitted:
    """Split ``graph`` into forward and backward modules (see the module docstring)."""
    gm = graph.gm
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    tangent_names = {s.node for s in graph.inputs if s.kind == "tangent"}
    model_outputs = [s for s in graph.outputs if s.kind == "output"]
    grad_outputs = [s for s in graph.outputs if s.kind == "grad"]
    output_node = next(n for n in nodes if n.op == "output")
    flat_output_args = list(output_node.args[0])

    def is_forward(node: torch.fx.Node) -> bool:
        if node.op == "placeholder":
            return node.name not in tangent_names
        if node.op == "get_attr":
            return True
        return graph.phases.get(node.name) is Phase.FORWARD

    forward = {node for node in nodes if is_forward(node)}

    # Step 1: the saved set, in graph order.
    saved: list[torch.fx.Node] = []
    if graph.training:
        for node in nodes:
            if node not in forward or node.op == "get_attr":
                continue
            if any(u.op != "output" and u not in forward for u in node.users):
                saved.append(node)

    # Step 2: the forward program (detaches are not copied: see _is_detach).
    fwd = _Program()
    for node in nodes:
        if node.op != "output" and node in forward:
            fwd.add(node)
    constant_outputs = []
    for i, value in enumerate(flat_output_args[: len(model_outputs)]):
        if isinstance(value, torch.fx.Node):
            fwd.outputs.append(value)
        else:
            constant_outputs.append((i, value))
            fwd.outputs.append(None)
    fwd.outputs += saved
    programs = [(fwd, "MemplanForward")]

    # Step 3: the backward program.
    grad_inputs: tuple[int, ...] = ()
    if graph.training:
        bwd = _Program()
        bwd.items += [(node, True) for node in saved]
        bwd.items += [(node, False) for node in placeholders if node.name in tangent_names]
        for node in nodes:
            # a constant the backward reads (a plain tensor attribute of the module, by which an op's
            # gradient multiplies) is read there from the module, as the forward reads it: never saved
            if node.op == "get_attr" and any(u.op != "output" and u not in forward for u in node.users):
                bwd.add(node)
        for node in nodes:
            if node.op not in ("placeholder", "output") and node not in forward:
                bwd.add(node)
        bwd.outputs = flat_output_args[len(model_outputs) :]
        bwd.hand_off_gradients()
        programs.append((bwd, "MemplanBackward"))
        requires = [i for i, s in enumerate(s for s in graph.inputs if s.kind != "tangent") if s.requires_grad]
        if len(requires) != len(grad_outputs):
            raise AssertionError(f"{len(requires)} inputs require grad but the graph returns {len(grad_outputs)} gradients")
        grad_inputs = tuple(requires)

    # Step 4: the code that runs, and the modules, built when first read. The code runs with the planned
    # graph's module as ``self``: a GraphModule takes its submodules and attributes from there.
    def build_modules() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule | None]:
        modules = [program.graph_module(gm, name) for program, name in programs]
        return modules[0], modules[1] if len(modules) > 1 else None

    runners: list[Callable[[list[Any]], Any]] = []
    stages: tuple[tuple[int, ...], ...] = ()
    start_staged = None
    try:
        for program, name in programs:
            source, globals_ = _boxed_source(program)
            runners.append(_runner(gm, source, globals_, name, _calls(program), describe=graph.describe))
        if graph.training:
            staged, stages = bwd.staged(MAX_STAGES)
            start_staged = _lazy_staged(gm, staged, graph.describe) if stages else None
    except _Unsupported:
        # Something the direct code generation does not know: fx generates the modules' code (and the
        # backward returns every gradient at its end: no stages).
        built = build_modules()
        runners = [fast_callable(module) for module in built if module is not None]
        build_modules = lambda: built  # noqa: E731 - the modules already built
        stages, start_staged = (), None

    differentiable = tuple(i for i, s in enumerate(model_outputs) if s.differentiable)
    tangents = [node.meta["val"] for node in placeholders if node.name in tangent_names]
    return Emitted(
        n_outputs=len(model_outputs),
        saved=tuple(n.name for n in saved),
        differentiable=differentiable,
        grad_inputs=grad_inputs,
        constant_outputs=tuple(constant_outputs),
        plain_saved=tuple(i for i, n in enumerate(saved)
                          if not (n.meta.get("val") is None or isinstance(n.meta.get("val"), torch.Tensor))),
        tangents=tuple((t.shape, t.dtype, t.device) for t in tangents),
        dense_tangents=tuple(model_outputs[i].dense_tangent for i in differentiable),
        broadcast_together=tuple(model_outputs[i].broadcast_together for i in differentiable),
        read_inside=frozenset(i for i in differentiable if isinstance(flat_output_args[i], torch.fx.Node)
                              and any(u.op != "output" and u in forward for u in flat_output_args[i].users)),
        grad_tangents=_tangent_masks([n for n in nodes if n not in forward], [n for n in placeholders if n.name in tangent_names],
                                     flat_output_args[len(model_outputs):]) if graph.training else (),
        run_forward=runners[0],
        run_backward=runners[1] if len(runners) > 1 else None,
        build_modules=build_modules,
        autocast_in_backward=graph.autocast_in_backward,
        stages=stages,
        start_staged=start_staged,
    )


def _calls(program: _Program) -> Iterable[torch.fx.Node]:
    """The nodes whose calls ``program``'s code makes (see :func:`_runner`)."""
    return (node for node, saved in program.items if not saved and not isinstance(node, (_HandOff, _Yield)))


def _lazy_staged(root: torch.fx.GraphModule, program: _Program, describe: Callable[[str], str]) -> Callable[[list[Any]], _Stages]:
    """Starts ``program`` (a staged backward) on its arguments; its code is generated and compiled on the
    first start, as most plans never run staged (see :func:`run_training`)."""
    made: list[Callable[[list[Any]], _Stages]] = []
    lock = threading.Lock()

    def start(args: list[Any]) -> _Stages:
        if not made:
            with lock:
                if not made:
                    source, globals_ = _boxed_source(program)
                    made.append(_staged_runner(root, source, globals_, "MemplanBackward", _calls(program), describe))
        return made[0](args)

    return start


def _tangent_masks(nodes: Sequence[torch.fx.Node], tangents: Sequence[torch.fx.Node], grads: Sequence[Any]) -> tuple[int, ...]:
    """Per gradient output, the tangents it depends on, as a bit mask (bit j: ``tangents[j]``); ``nodes``:
    those that may read one (the backward's, in graph order)."""
    mask: dict[torch.fx.Node, int] = {t: 1 << j for j, t in enumerate(tangents)}
    for node in nodes:
        if node.op in ("call_function", "call_module"):
            bits = 0
            for arg in node.all_input_nodes:
                bits |= mask.get(arg, 0)
            if bits:
                mask[node] = bits
    return tuple(mask.get(g, 0) if isinstance(g, torch.fx.Node) else 0 for g in grads)


def run_training(emitted: Emitted, flat: Sequence[torch.Tensor]) -> list[Any]:
    """Run a training plan's forward under autograd: the outputs, whose backward runs the plan's.

    Two autograd nodes: :class:`PlanFunction` runs the forward and the backward and hands autograd
    one empty tensor; :class:`_Release` gives out the outputs and receives their gradients. Autograd
    keeps a node's incoming gradients until the node returns; given to ``PlanFunction`` itself, the
    outputs' gradients were held through the whole planned backward, where eager frees each after
    the last op that reads it (with the loss outside the model, a full gradient of the logits). The
    release node returns at once, handing them over, and the backward frees each at its last read.

    Where someone listens for gradients as they are made (``torch.distributed`` is initialized: DDP's
    reducer starts each bucket's all-reduce from hooks on the parameters' gradient accumulators; or a
    leaf has a post-accumulate-grad hook, an optimizer step in the backward), the backward runs in
    stages (:meth:`_Program.staged`): one :class:`_Stage` node per pause between the release and
    ``PlanFunction``, each an autograd input of the leaves whose gradients it gives out. Autograd runs
    each leaf's accumulation, and its hooks, as soon as its stage returns, before the next stage runs,
    as it does for eager's per-op nodes; the values live across stages stay in the paused backward.
    """
    relay = _Relay()
    stages = emitted.stages if emitted.start_staged is not None and _listened(emitted, flat) else ()
    if stages:
        early = {emitted.grad_inputs[k] for stage in stages for k in stage}
        own = [None if i in early else x for i, x in enumerate(flat)]
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in own):
            relay.flat = flat
            token = PlanFunction.apply(emitted, relay, *own)
            for stage in range(len(stages) - 1, -1, -1):  # the first stage runs first: made last
                token = _Stage.apply(relay, stage, token, *[flat[emitted.grad_inputs[k]] for k in stages[stage]])
            return list(_Release.apply(relay, token))
    token = PlanFunction.apply(emitted, relay, *flat)
    return list(_Release.apply(relay, token))


def _listened(emitted: Emitted, flat: Sequence[Any]) -> bool:
    """Whether a hook may wait for a gradient of this call as it is made (see :func:`run_training`)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True
    for i in emitted.grad_inputs:
        x = flat[i]
        if isinstance(x, torch.Tensor) and x.is_leaf and getattr(x, "_post_accumulate_grad_hooks", None):
            return True
    return False


class _Relay:
    """Carries one call's outputs from :class:`PlanFunction` to :class:`_Release`, and their
    gradients back (each taken once, so the relay holds nothing after); in a staged backward, the
    values the stages share (see :func:`run_training`)."""

    __slots__ = ("emitted", "outputs", "inputs", "grads", "token", "given", "flat", "saved", "steps", "sent", "anchors")

    def __init__(self) -> None:
        self.emitted: Emitted | None = None  # the plan: which outputs take a gradient, which the forward reads
        self.outputs: list[Any] | None = None
        self.inputs: frozenset[int] = frozenset()  # ids of the plan's input tensors
        self.grads: tuple[Any, ...] | None = None
        self.token: torch.device | None = None  # where the plan's empty tensor is, and its gradient
        self.given: dict[int, Any] = {}
        self.flat: Sequence[Any] | None = None  # staged: every input of the plan (PlanFunction takes some)
        self.saved: list[Any] | None = None  # staged: the saved values, from the forward to the first stage
        self.steps: _Stages | None = None  # staged: the backward, paused between stages
        self.sent = 0  # bit j: the j-th differentiable output received a gradient
        self.anchors: list[torch.Tensor] = []  # create_graph: the backward's inputs that require grad


def _as_saved(value: torch.Tensor) -> torch.Tensor:
    """``value`` as :class:`PlanFunction` hands it to autograd's saving: a view that does not require
    grad as a detached alias of the same memory (the same version counter), anything else as it is.

    The plan's forward runs under no_grad, so each view it makes is marked as made in no_grad mode, and
    keeps its base. When its base is written after it is made (a loop writing its states into slices of
    an output: a saved slice, or the result of ``copy_`` into one) and the base then requires grad (an
    output, which :class:`_Release` gives a grad_fn), unpacking the saved view has autograd re-derive
    its history from the base, and refuse ("a view was created in no_grad mode ... modified inplace").
    The backward reads saved values as data only, so the view's link to its base serves nothing. A view
    that requires grad has a base that does (an input), which a training plan never writes (see
    ``api._check_mutations``); it stays an anchor for the refusal of higher-order gradients. The shared
    version counter keeps autograd's check of saved tensors: a write into an output between the forward
    and the backward is still caught as in eager.
    """
    if isinstance(value, torch.Tensor) and value._is_view() and not value.requires_grad:
        return value.detach()
    return value


def _save(ctx: Any, emitted: Emitted, saved: Sequence[Any]) -> None:
    """Keep a plan's saved values on ``ctx``: tensors through autograd's saving; the plain values a graph
    can save too (a Python number read from a tensor by .item() that the backward reads) on ctx, in
    their places."""
    if emitted.plain_saved:
        plain = set(emitted.plain_saved)
        ctx.plain_values = {i: saved[i] for i in emitted.plain_saved}
        ctx.save_for_backward(*[_as_saved(v) for i, v in enumerate(saved) if i not in plain])
    else:
        ctx.save_for_backward(*map(_as_saved, saved))


class PlanFunction(torch.autograd.Function):
    """Runs an :class:`Emitted` plan's forward, and its backward when autograd asks (see :func:`run_training`).
    In a staged backward it runs the last stage."""

    @staticmethod
    def forward(ctx: Any, emitted: Emitted, relay: _Relay, *flat: torch.Tensor) -> torch.Tensor:
        staged = relay.flat is not None
        if staged:  # the inputs the stages take are passed as None, and every input in the relay
            flat, relay.flat = relay.flat, None
        results = emitted.run_forward([*flat])
        outputs = list(results[: emitted.n_outputs])
        saved = results[emitted.n_outputs :]
        ctx.emitted = emitted
        ctx.relay = relay
        ctx.n_inputs = len(flat)
        # the leaves a gradient goes to, for adding it to their .grad early (see _early_accumulation)
        ctx.leaves = [weakref.ref(flat[i]) if flat[i].is_leaf and flat[i].requires_grad else None
                      for i in emitted.grad_inputs]
        ctx.staged = staged
        if staged:
            relay.saved = saved  # the first stage keeps them (it runs first in the backward)
        else:
            _save(ctx, emitted, saved)
        relay.outputs = outputs
        relay.inputs = frozenset(id(x) for x in flat)
        relay.emitted = emitted
        like = next((t for t in (*outputs, *flat) if isinstance(t, torch.Tensor)), None)
        device = like.device if like is not None else torch.device("cpu")
        relay.token = device
        return torch.empty(0, device=device)  # no element: nothing is allocated

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor) -> tuple[Any, ...]:
        emitted: Emitted = ctx.emitted
        relay: _Relay = ctx.relay
        if ctx.staged:
            steps, relay.steps = relay.steps, None
            if steps is None:
                raise AssertionError("the plan's staged backward reached its last stage without its first")
            with _running_backward(sink=None):  # autograd accumulates each leaf's gradient
                done, grads = steps.next()
            if not done:
                raise AssertionError("the plan's staged backward paused more often than it has stages")
        else:
            args = _backward_arguments(ctx, emitted, relay)
            # Autograd runs a backward with grad mode on only for create_graph=True. The gradients are still
            # the plan's (computed without recording), and asking for their own gradients is refused: a
            # graph recorded through the plan's code would miss every term through the values it saved.
            sink = None if relay.anchors or torch.is_grad_enabled() else _early_accumulation(ctx.leaves)
            with _running_backward(sink):
                grads = emitted.run_backward(args)
        result: list[Any] = [None] * (2 + ctx.n_inputs)
        for index, grad in zip(emitted.grad_inputs, _gradients(emitted, range(len(grads)), grads, relay)):
            result[2 + index] = grad
        relay.anchors = []
        return tuple(result)


@contextlib.contextmanager
def _running_backward(sink: Callable[[int, Any], Any] | None) -> Iterator[None]:
    """Where the plan's backward code runs: outside grad mode, its gradients handed to ``sink`` (see
    :func:`_hand_off`; None: returned to autograd)."""
    previous, _HANDS.sink = getattr(_HANDS, "sink", None), sink
    try:
        with torch.no_grad():
            yield
    finally:
        _HANDS.sink = previous


def _backward_arguments(ctx: Any, emitted: Emitted, relay: _Relay) -> list[Any]:
    """The planned backward's arguments, from the values ``ctx`` saved and the outputs' gradients in
    ``relay`` (taken from it); notes in ``relay`` which outputs received one, and under create_graph
    the arguments that require grad."""
    if emitted.autocast_in_backward is not None and any(map(torch.is_autocast_enabled, AUTOCAST_KINDS)):
        raise AutocastBackwardError(
            f"the plan's backward runs inside an autocast block, which would cast "
            f"{emitted.autocast_in_backward} in eager's backward; memplan planned the backward as it runs "
            "outside the block. Fix: call backward() after the `with torch.autocast(...)` block ends, as "
            "torch's automatic mixed precision recipes do (the forward and the loss stay inside)."
        )
    grad_outputs, relay.grads = relay.grads, None
    grad_outputs_sent = [g is not None for g in grad_outputs] if grad_outputs is not None else [False] * emitted.n_outputs
    relay.sent = sum(1 << j for j, i in enumerate(emitted.differentiable) if grad_outputs_sent[i])
    args: list[Any] = list(ctx.saved_tensors)
    for i in emitted.plain_saved:  # ascending: each goes back to its place
        args.insert(i, ctx.plain_values[i])
    # Autograd would keep its copies until this whole backward returns; drop them now (unless the
    # graph is retained), so the boxed backward frees each saved tensor at its last use.
    ctx.maybe_clear_saved_tensors()
    # every tangent a broadcast scalar (or absent): the backward may take them so where it refuses one
    # alone (OutputSpec.broadcast_together)
    broadcast = grad_outputs is None or all(grad_outputs[i] is None or _is_broadcast_scalar(grad_outputs[i])
                                            for i in emitted.differentiable)
    for i, (shape, dtype, device), dense, together in zip(emitted.differentiable, emitted.tangents,
                                                          emitted.dense_tangents, emitted.broadcast_together):
        grad = grad_outputs[i] if grad_outputs is not None else None
        if dense and not (together and broadcast):  # the backward refuses a broadcast scalar here
            args.append(torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad.contiguous())
        else:
            args.append(torch.zeros((), dtype=dtype, device=device).expand(shape) if grad is None
                        else _as_traced_layout(grad))
    relay.anchors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] if torch.is_grad_enabled() else []
    return args


def _gradients(emitted: Emitted, positions: Iterable[int], grads: Sequence[Any], relay: _Relay) -> list[Any]:
    """The planned backward's gradients at ``positions`` (of its outputs) as autograd receives them."""
    result = []
    for k, grad in zip(positions, grads):
        needs = emitted.grad_tangents[k]
        # an input reached only through outputs the loss does not reach gets None, as in eager (an
        # optimizer skips it), not the zeros the plan computed from broadcast zero tangents
        if needs and not needs & relay.sent:
            grad = None
        elif relay.anchors and isinstance(grad, torch.Tensor):
            grad = _FirstOrderOnly.apply(grad, *relay.anchors)
        result.append(grad)
    return result


class _Stage(torch.autograd.Function):
    """A pause of a staged backward (see :func:`run_training`): its backward runs the plan's backward to
    its next pause and returns the gradients given out there, to its inputs (the leaves they belong
    to). The first stage keeps the saved values, and starts the plan's backward."""

    @staticmethod
    def forward(ctx: Any, relay: _Relay, stage: int, token: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.relay, ctx.stage = relay, stage
        if stage == 0:
            saved, relay.saved = relay.saved, None
            _save(ctx, relay.emitted, saved)
        return torch.empty(0, device=relay.token)

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor) -> tuple[Any, ...]:
        relay: _Relay = ctx.relay
        emitted = relay.emitted
        if ctx.stage == 0:  # (in the backward's grad mode: it reads create_graph's anchors)
            relay.steps = emitted.start_staged(_backward_arguments(ctx, emitted, relay))
        elif relay.steps is None:
            raise AssertionError("a stage of the plan's backward ran before the first")
        with _running_backward(sink=None):  # autograd accumulates each leaf's gradient
            done, given = relay.steps.next()
        if done:
            raise AssertionError("the plan's staged backward ended before its last stage")
        positions = emitted.stages[ctx.stage]
        return (None, None, torch.empty(0, device=relay.token), *_gradients(emitted, positions, given, relay))


_ACCUMULATING = threading.Lock()  # held while a planned backward adds a gradient to a .grad (see _early_accumulation)


def _early_accumulation(leaves: Sequence[Any]) -> Callable[[int, Any], Any] | None:
    """A sink for :func:`_hand_off`: it adds gradient ``k`` to its leaf's ``.grad`` at once, as autograd's
    AccumulateGrad would after the backward returns, and frees it, where a ``.grad`` already exists
    (gradient accumulation over micro-batches, ``zero_grad(set_to_none=False)``). Returned to autograd,
    every such gradient was held to the end of the planned backward: a step above eager's peak by all
    the parameters' gradients.

    Only where nothing else would see the gradient on its way: no hook on the leaf, a ``.backward()``
    that accumulates into it (not ``autograd.grad``, not ``inputs=`` leaving it out), no
    ``torch.distributed`` (its hooks on the accumulators cannot be seen), dense tensors of one shape,
    dtype and device. None when no gradient qualifies.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    taken: dict[int, torch.Tensor] = {}
    for k, ref in enumerate(leaves):
        leaf = ref() if ref is not None else None
        if leaf is None or leaf.grad is None or leaf.grad.layout is not torch.strided:
            continue
        if leaf._backward_hooks or getattr(leaf, "_post_accumulate_grad_hooks", None):
            continue
        try:
            if not torch._C._will_engine_execute_node(get_gradient_edge(leaf).node):
                continue
        except RuntimeError:  # autograd.grad(): nothing is accumulated
            return None
        taken[k] = leaf
    if not taken:
        return None

    def sink(k: int, grad: Any) -> Any:
        leaf = taken.get(k)
        if leaf is None or not isinstance(grad, torch.Tensor) or grad.layout is not torch.strided:
            return grad
        # two threads' planned backwards add to one .grad one after the other, as AccumulateGrad's own lock has it
        with _ACCUMULATING:
            current = leaf.grad
            if current is None or (current.shape, current.dtype, current.device) != (grad.shape, grad.dtype, grad.device):
                return grad
            current.add_(grad)  # AccumulateGrad's own update of an existing .grad outside grad mode
        return None

    return sink


class _Release(torch.autograd.Function):
    """Gives out a plan's outputs (see :func:`run_training`); its backward hands their gradients to the
    plan's and returns."""

    @staticmethod
    def forward(ctx: Any, relay: _Relay, token: torch.Tensor) -> tuple[Any, ...]:
        outputs, relay.outputs = relay.outputs, None
        differentiable = frozenset(relay.emitted.differentiable)
        ctx.relay = relay
        # The plan drops detaches (a no-op outside autograd), so an output the model detached can be
        # the very tensor of a differentiable output (``return y, y.detach()``) or of an input: marked
        # as it is, it would take the other's gradient away. It is returned as an alias of its own.
        plain = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and i not in differentiable]
        taken = {id(o) for i, o in enumerate(outputs) if i in differentiable} | set(relay.inputs)
        for i in plain:
            if id(outputs[i]) in taken:
                outputs[i] = outputs[i].detach()
        # An input (or parameter) returned as it is would be given this node as its grad_fn, in place:
        # it is returned as a view, as autograd returns an input a function gives back. A view the plan
        # made (``y.t()``) is given out as a tensor of its own on the same memory: autograd forbids
        # in-place writes into a view a custom function returns, where eager allows them (a write into
        # memory the backward saved is still caught by the saved tensor's version check).
        for i in differentiable:
            if isinstance(outputs[i], torch.Tensor):
                if id(outputs[i]) in relay.inputs:
                    outputs[i] = outputs[i].view_as(outputs[i])
                elif outputs[i]._base is not None:
                    outputs[i] = outputs[i].detach()
        if plain:
            ctx.mark_non_differentiable(*[outputs[i] for i in plain])
        # the outputs the forward also reads, as given out: a hook on one is refused in the backward
        relay.given = {i: weakref.ref(outputs[i]) for i in relay.emitted.read_inside if isinstance(outputs[i], torch.Tensor)}
        # Autograd would otherwise allocate a zero gradient for every output the loss does not reach,
        # the non-differentiable ones included (an argmax returned beside the loss), which eager never
        # makes; the backward reads a broadcast zero for those it takes a tangent for.
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        relay: _Relay = ctx.relay
        for i, ref in relay.given.items():
            output = ref()
            if output is not None and (output._backward_hooks or output.retains_grad):
                raise OutputGradientHookError(
                    f"output {i} of the optimized model has a hook or retain_grad(), and the model also reads "
                    f"it inside{caller_line('backward called')}: its gradient there is added by the plan's "
                    "backward, so the hook would see (and change) only the part from outside the model, where "
                    "eager gives it the whole. Fix: hook or retain a copy the model does not read (return "
                    "h.clone() beside h), or compute the hooked value outside the optimized module."
                )
        relay.grads = grad_outputs
        return None, torch.empty(0, device=relay.token)


class _FirstOrderOnly(torch.autograd.Function):
    """Hands on a gradient a plan computed; differentiating it raises :class:`HigherOrderGradientError`.
    ``anchors`` (the backward's inputs that require grad) only connect it to the graph."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        raise HigherOrderGradientError(
            f"a gradient of memplan's gradients was asked for{caller_line('backward called')} (the "
            "gradients came from backward or torch.autograd.grad with create_graph=True, then were "
            "differentiated again: a gradient penalty, a Hessian-vector product, MAML). A plan computes "
            "first-order gradients from values it saved outside autograd, so their own gradients would "
            "miss every term through those values. Fix: run this computation with the model itself "
            "(opt.original)."
        )


_OP_CALL = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


def _in_grad_mode(function: Callable[..., Any], enabled: bool) -> Callable[..., Any]:
    """``function`` called with autograd's grad mode ``enabled`` and its tensor arguments detached (so
    nothing is recorded): how planned code calls :data:`~memplan.opschema.GRAD_MODE_OPS`."""

    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs))
        with torch.set_grad_enabled(enabled):
            return function(*args, **kwargs)

    return call


def fast_callable(gm: torch.fx.GraphModule) -> Callable[[list[Any]], Any]:
    """``gm``'s generated code with each ``torch.ops.ns.op.overload(`` bound to a direct way to call it.

    fx code looks each operator up through four attributes and calls it through ``OpOverload.__call__``,
    a Python frame that only forwards to ``OpOverload._op``, which reads its arguments against the
    operator's schema. Binding the operator as a global removes the lookups and the frame; where torch's
    own Python binding of the operator reaches it with the same arguments (see :func:`python_bindings`),
    that binding is bound, whose typed argument parser is faster still (0.5-1.3 us less a call on a
    small op). Together most of the Python overhead of running a graph of small ops. The code is
    otherwise fx's own.
    """
    python_code = gm.graph.python_code(root_module="self")
    return _runner(gm, python_code.src, python_code.globals, type(gm).__name__, gm.graph.nodes)


def _runner(
    root: torch.nn.Module, src: str, globals_: dict[str, Any], name: str, nodes: Iterable[torch.fx.Node],
    describe: Callable[[str], str] | None = None,
) -> Callable[[list[Any]], Any]:
    """Compile the boxed function ``forward(self, args_list)`` in ``src`` with its operators bound (see
    :func:`fast_callable`; ``nodes`` are the calls the code makes, which choose the bindings), and call it
    with ``root`` as ``self`` (where its submodules and attributes are). An exception an op raises gets a
    note naming the op and, through ``describe`` (a node name to its op and the user's line), its line."""
    function, source = _compiled(src, globals_, name, nodes)

    def call(args: list[Any]) -> Any:
        try:
            return _without_autocast(function, root, args)
        except Exception as exc:
            _note_failing_op(exc, f"<memplan {name}>", source, describe)
            raise

    return call


def _staged_runner(
    root: torch.nn.Module, src: str, globals_: dict[str, Any], name: str, nodes: Iterable[torch.fx.Node],
    describe: Callable[[str], str] | None = None,
) -> Callable[[list[Any]], _Stages]:
    """:func:`_runner` for the code of a staged backward (a generator, see :meth:`_Program.staged`): a
    call starts it and returns its :class:`_Stages`."""
    function, source = _compiled(src, globals_, name, nodes)
    return lambda args: _Stages(function(root, args), source, name, describe)


class _Stages:
    """A staged backward started on its arguments: :meth:`next` runs it to its next pause."""

    __slots__ = ("generator", "source", "name", "describe")

    def __init__(self, generator: Any, source: str, name: str, describe: Callable[[str], str] | None) -> None:
        self.generator, self.source, self.name, self.describe = generator, source, name, describe

    def next(self) -> tuple[bool, Any]:
        """Run to the next pause: ``(False, gradients it gives out)``, or at the end ``(True, the rest)``,
        as :func:`_runner`'s call runs the whole (autocast off, a failing op named)."""
        try:
            given = _without_autocast(next, self.generator)
            out = tuple(given)
            given.clear()  # the paused code holds none of them now
            return False, out
        except StopIteration as stop:
            return True, stop.value
        except Exception as exc:
            _note_failing_op(exc, f"<memplan {self.name}>", self.source, self.describe)
            raise


def _without_autocast(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with autocast off on the devices capture follows (see below)."""
    if not any(map(torch.is_autocast_enabled, AUTOCAST_KINDS)):
        return function(*args)
    with autocast_off():
        return function(*args)


def _compiled(src: str, globals_: dict[str, Any], name: str, nodes: Iterable[torch.fx.Node]) -> tuple[Callable[..., Any], str]:
    """The function ``forward`` that ``src`` defines, compiled with its operators bound (see
    :func:`fast_callable`), and the source that was compiled."""
    bound: dict[str, Any] = {}
    names: dict[str, str] = {}
    nodes = list(nodes)
    bindings = python_bindings(nodes)

    def bind(match: re.Match) -> str:
        qualified = match.group(0)[:-1]
        if qualified not in names:
            namespace, op, overload = match.groups()
            operator = getattr(getattr(getattr(torch.ops, namespace), op), overload)
            names[qualified] = f"_memplan_op{len(names)}"
            function = bindings.get(operator, operator._op)
            if operator in GRAD_MODE_OPS:
                # the grad mode capture saw (on where a copy made since does not say: a training plan's
                # recomputation); looked up only for these operators, not over every graph's nodes
                enabled = any(n.meta.get("grad_enabled", True) for n in nodes if n.target is operator)
                function = _in_grad_mode(function, enabled)
            bound[names[qualified]] = function
        return names[qualified] + "("

    source = _OP_CALL.sub(bind, src)
    namespace = dict(globals_)
    namespace.update(bound)
    exec(compile(source, f"<memplan {name}>", "exec"), namespace)
    return namespace["forward"], source


# A plan's code runs without autocast on the devices capture follows (AUTOCAST_KINDS). Capture records
# the casts autocast made as ops of the graph (``_to_copy``), under the operators autocast dispatches
# to; run again under an enabled autocast, an operator on its lists would cast its inputs a second
# time, or to another dtype than eager's (the float32 matmuls of scaled_dot_product_attention's math
# path came out bfloat16, and the backward's softmax raised on the mix).


_ASSIGNED = re.compile(r"^\s*(\w+)(?:\s*,\s*\w+)*\s*=")


def _note_failing_op(exc: Exception, filename: str, source: str, describe: Callable[[str], str] | None) -> None:
    """Add a note to ``exc`` naming the op of the generated code (``filename``, ``source``) that raised it
    and the user's line it came from: the traceback shows only the generated code (an out-of-memory
    error, or eager's own error for inputs eager refuses too, such as two dtypes)."""
    tb, lineno = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    lines = source.splitlines()
    if lineno is None or not 0 < lineno <= len(lines):
        return
    found = _ASSIGNED.match(lines[lineno - 1])
    what = f"`{found.group(1)}`" if found else "an op"
    if found and describe is not None:
        try:
            what = describe(found.group(1))
        except KeyError:
            pass
    phase = "backward" if "Backward" in filename else "forward"
    exc.add_note(f"memplan: raised by {what} in the plan's {phase}")


# ----------------------------------------------------------------------------------------------
# torch's Python bindings of the operators


class _Reached(Exception):
    """Raised by :class:`_FirstDispatch` once it has seen the call: nothing runs."""


class _FirstDispatch(TorchDispatchMode):
    """Records the first operator call that reaches the dispatcher's Python key, then stops it."""

    def __init__(self) -> None:
        super().__init__()
        self.call: tuple[Any, tuple, dict] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.call = (func, args, kwargs or {})
        raise _Reached


def _dispatched(function: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, tuple, dict, int] | None:
    """The operator call ``function(*args, **kwargs)`` makes first, with the arguments the dispatcher
    receives and the number of warnings raised on the way; None when it raises before (arguments it
    does not take) or reaches none."""
    mode = _FirstDispatch()
    with torch.no_grad(), warnings.catch_warnings(record=True) as raised:  # the code runs without autograd
        warnings.simplefilter("always")
        try:
            with mode:
                function(*args, **kwargs)
        except _Reached:
            return (*mode.call, len(raised))
        except Exception:  # noqa: BLE001 - a binding that does not take these arguments is no candidate
            return None
    return None


def _same_call(a: tuple[Any, tuple, dict, int], b: tuple[Any, tuple, dict, int]) -> bool:
    """Both reach the same operator with the same tensors (the same objects) and equal other values,
    and ``a`` warns no more than ``b`` (a deprecated signature warns at every call)."""
    if a[0] is not b[0] or a[3] > b[3]:
        return False
    leaves_a, spec_a = pytree.tree_flatten((a[1], a[2]))
    leaves_b, spec_b = pytree.tree_flatten((b[1], b[2]))
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is not y:
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


# Where torch keeps the Python bindings of aten operators: functions, then Tensor methods (the C ones:
# ``torch.Tensor``'s Python methods may do more).
_BINDING_HOMES = tuple(
    home for home in (getattr(torch._C, n, None) for n in ("_VariableFunctions", "_nn", "_linalg", "_special", "_fft"))
    if home is not None
) + (torch._C.TensorBase,)


def _kind(arg: Any) -> Any:
    """What decides which overload torch's Python argument parser picks: a value's type, a node's
    value's type, and the kinds of a list's items."""
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("val")
        return torch.Tensor if isinstance(value, torch.Tensor) else ("node", type(value))
    if isinstance(arg, (list, tuple)):
        return (type(arg) if type(arg) in (list, tuple) else list, tuple(_kind(a) for a in arg))
    return type(arg)


def _example(arg: Any) -> Any:
    """The node's value (its fake tensor) for a node, the constant otherwise; raises KeyError when a node has none."""
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise KeyError(arg.name)
        return value
    if isinstance(arg, (list, tuple)):
        return [_example(a) for a in arg]
    return arg


_BINDING_CACHE: dict[tuple, Callable | None] = {}


def _binding(operator: torch._ops.OpOverload, node: torch.fx.Node) -> Callable | None:
    """torch's Python binding that makes the same dispatcher call as ``operator._op`` for ``node``'s
    arguments, or None. The parser picks an overload by the arguments' types alone, so the answer
    holds for every call with arguments of the same kinds, and is cached by them."""
    key = (operator, _kind(node.args), tuple((k, _kind(v)) for k, v in node.kwargs.items()))
    if key in _BINDING_CACHE:
        return _BINDING_CACHE[key]
    try:
        args = [_example(a) for a in node.args]
        kwargs = {k: _example(v) for k, v in node.kwargs.items()}
    except KeyError:
        return None
    reference = _dispatched(operator._op, args, kwargs)
    if reference is None or reference[0] is not operator:
        return None  # the context (autocast, a mode) reached something else first: not cached
    found = None
    name = operator._schema.name.split("::")[-1]
    for home in _BINDING_HOMES:
        candidate = getattr(home, name, None)
        if candidate is None:
            continue
        call = _dispatched(candidate, args, kwargs)
        if call is not None and _same_call(call, reference):
            found = candidate
            break
    _BINDING_CACHE[key] = found
    return found


def python_bindings(nodes: Iterable[torch.fx.Node]) -> dict[torch._ops.OpOverload, Callable]:
    """For each aten operator ``nodes`` call, torch's Python binding of it (``torch.add``,
    ``Tensor.view``...) when, for every kind of arguments they pass it, the binding reaches the
    dispatcher with the very call ``OpOverload._op`` makes: the same operator, the same tensors, equal
    other values. The check calls both on the nodes' fake values under a dispatch mode that records
    the first operator call and stops it, so nothing runs. Operators with no such binding (``slice``,
    a binding that reaches another overload first, nodes without fake values) are left out.
    """
    found: dict[torch._ops.OpOverload, Callable] = {}
    refused: set[torch._ops.OpOverload] = set()
    for node in nodes:
        operator = node.target
        if node.op != "call_function" or not isinstance(operator, torch._ops.OpOverload) or operator in refused:
            continue
        if operator.namespace != "aten":
            refused.add(operator)
            continue
        binding = _binding(operator, node)
        if binding is None or found.setdefault(operator, binding) is not binding:
            refused.add(operator)
            found.pop(operator, None)
    return found


class _Unsupported(Exception):
    """A program :func:`_boxed_source` cannot write as fx would (fx then writes it)."""


# Argument types whose code is their ``repr``, as in fx's code generation.
_REPR_TYPES = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)


def _boxed_source(program: _Program) -> tuple[str, dict[str, Any]]:
    """The source and globals fx would generate for the program's boxed GraphModule.

    fx copies the nodes into a new graph, whose namespace names them (a saved value's placeholder is
    named after its target, snake-cased, and read straight into that name; a copy keeps its name unless
    that is taken), then writes the graph's code, one line per node, each followed by the names of the
    values whose last use it is (``;  a = b = None``). This does the same on the joint graph's nodes, naming them with fx's own
    namespace in the same order, for the nodes memplan's graphs hold: placeholders, ``get_attr``,
    ``call_module`` and ``call_function`` of an aten operator or of a Python operator fx writes as an
    expression (``x[0]``), over arguments of plain types. Anything else raises :class:`_Unsupported`.
    ``tests/test_emit.py`` checks the output against fx's.

    fx's code generation names each node once more, in a namespace holding its builtins (``torch``,
    ``inf``...); that keeps the graph's names, which are valid, distinct and never a builtin's (the
    graph's namespace renames those), so it is not repeated here. It would name other globals too,
    which is why calls of other Python functions are left to fx.
    """
    if _custom_builtins is None:
        raise _Unsupported("this torch's fx lacks the helpers the direct code generation uses")
    if os.environ.get("FX_GRAPH_SHOW_META", "0") == "1":
        raise _Unsupported("fx writes each node's metadata into the code")
    graph = torch.fx.Graph()  # stands for the module's graph: its placeholder naming rule
    graph_names = _Namespace()  # the names node_copy gives in the new graph
    builtins = _Namespace()
    globals_: dict[str, Any] = {}
    for name, (_, obj) in _custom_builtins.items():
        if not (_is_from_torch(obj) and obj != torch.device):
            globals_[builtins.create_name(name, obj)] = obj

    names: dict[torch.fx.Node, str] = {}
    resolve = program.resolve
    inputs: list[dict[torch.fx.Node, None]] = []  # per line: the values it reads, in fx's order
    keys: list[torch.fx.Node | None] = []  # per line: the value it defines (None: none)
    lines: list[str] = []
    free_vars: list[str] = []

    def code(arg: Any, reads: dict[torch.fx.Node, None]) -> str:
        kind = type(arg)
        if kind is torch.fx.Node:
            value = resolve(arg)
            reads[value] = None
            return names[value]
        if kind is _HandOff:
            reads[arg] = None
            return names[arg]
        if kind in _REPR_TYPES:
            return repr(arg)
        if kind is tuple:
            if len(arg) == 1:
                return f"({code(arg[0], reads)},)"
            return "(" + ", ".join([code(a, reads) for a in arg]) + ")"
        if kind is list or kind is immutable_list:
            return "[" + ", ".join([code(a, reads) for a in arg]) + "]"
        if kind is slice:
            return f"slice({code(arg.start, reads)}, {code(arg.stop, reads)}, {code(arg.step, reads)})"
        raise _Unsupported(f"argument of type {kind.__name__}")

    for node, saved in program.items:
        if isinstance(node, _HandOff):  # fx writes graph.call_function(_hand_off, (index, value)) so
            names[node] = name = graph_names.create_name(graph._target_to_str(_hand_off), None)
            function = builtins.create_name(_get_qualified_name(_hand_off), _hand_off)
            globals_[function] = _hand_off
            reads = {}
            lines.append(f"{name} = {function}({node.index}, {code(node.value, reads)})")
            keys.append(node)
            inputs.append(reads)
            continue
        if isinstance(node, _Yield):  # a pause of the staged backward (see _Program.staged)
            names[node] = name = graph_names.create_name("stage", None)
            reads = {}
            lines.append(f"{name} = {code(list(node.hands), reads)}")  # yielded below, once they are freed
            keys.append(node)
            inputs.append(reads)
            continue
        if node.type is not None or node.meta.get("is_wrapped", False):
            raise _Unsupported("type annotation or wrapped function")
        if saved:
            target = node.name
            candidate = graph._target_to_str(target)
        else:
            target = node.target
            candidate = node.name
        name = graph_names.create_name(candidate, None)
        names[node] = name
        reads: dict[torch.fx.Node, None] = {}
        op = "placeholder" if saved else node.op
        if op == "placeholder":
            if not isinstance(target, str) or name == "self" or (not saved and node.args):
                raise _Unsupported("placeholder")
            free_vars.append(name)  # read straight into its name (see _Program.graph_module)
            continue
        args = [code(a, reads) for a in node.args]
        kwargs = [f"{k} = {code(v, reads)}" for k, v in node.kwargs.items()]
        if op == "call_function":
            function = node.target
            if getattr(function, "__module__", "") == "_operator" and function.__name__ in magic_methods:
                line = f"{name} = {magic_methods[function.__name__].format(*args)}"
            elif isinstance(function, torch._ops.OpOverload):
                line = f"{name} = {_qualified_name(function)}({', '.join(args + kwargs)})"
            else:
                raise _Unsupported(f"call of {function!r}")
        elif op == "call_module":
            line = f"{name} = {_format_target('self', node.target)}({', '.join(args + kwargs)})"
        elif op == "get_attr":
            line = f"{name} = {_format_target('self', node.target)}"
        else:
            raise _Unsupported(f"{op} node")
        lines.append(line)
        keys.append(node)
        inputs.append(reads)
    reads = {}
    lines.append(f"return {code(list(program.outputs), reads)}")
    keys.append(None)
    inputs.append(reads)

    # Each line frees the values it reads last, and a value nothing reads right after it is made.
    read: set[torch.fx.Node] = set()
    last_reads: list[list[torch.fx.Node]] = [[] for _ in lines]
    for i in range(len(lines) - 1, -1, -1):
        for value in inputs[i]:
            if value not in read:
                read.add(value)
                last_reads[i].append(value)
    body = []
    for i, line in enumerate(lines[:-1]):
        freed = [names[value] for value in last_reads[i]]
        if keys[i] is not None and keys[i] not in read:
            freed.append(names[keys[i]])
        if isinstance(keys[i], _Yield):
            # the list is the only reference to the gradients while the backward is paused: the stage
            # empties it, so each is freed as soon as autograd is done with it (a hook may drop it)
            name = names[keys[i]]
            freed = [f for f in freed if f != name]
            freeing = f";  {' = '.join(freed)} = None" if freed else ""
            line = f"{line}{freeing};  {name} = yield {name};  {name} = None"
        elif freed and keys[i] is not None:
            line = f"{line};  {' = '.join(freed)} = None"
        body.append(line)
    body.append(lines[-1])

    prologue = "def forward(self, args_list):"
    if free_vars:
        prologue += "\n    args_iter = iter(args_list)"
        prologue += "".join(f"\n    {var} = next(args_iter)" for var in free_vars)
        prologue += "\n    args_list.clear()"
    code_text = "\n".join("    " + line for line in body + [""])
    return f"\n\n\n{prologue}\n{code_text}", globals_


@functools.lru_cache(maxsize=None)
def _qualified_name(operator: torch._ops.OpOverload) -> str:
    """How fx's code names an operator (``torch.ops.aten.mm.default``); raises :class:`_Unsupported` for one
    fx would name as a global of the module."""
    if not _is_from_torch(operator):
        raise _Unsupported(f"call of {operator!r}")
    return _get_qualified_name(operator)


def _is_broadcast_scalar(grad: torch.Tensor) -> bool:
    """Every stride 0: one element seen at every index (``out.sum()``'s gradient)."""
    return all(stride == 0 for stride in grad.stride())


def _as_traced_layout(grad: torch.Tensor) -> torch.Tensor:
    """A tangent the backward module can read.

    The backward was traced with dense tangents. A broadcast scalar (all strides 0, what ``.sum()`` and
    ``.mean()`` send) supports every view a dense tensor does, so it passes as is and costs nothing;
    any other non-dense layout is made dense first, as view ops may not accept it.
    """
    if grad.is_contiguous() or _is_broadcast_scalar(grad):
        return grad
    return grad.contiguous()


def _is_detach(node: torch.fx.Node) -> bool:
    """``detach`` is a no-op outside autograd (both modules run under it): the copy reads its input
    instead, which saves the Python time of running it. Skipping it while copying, rather than erasing
    it after, also spares rewriting its readers (the forward's output, which returns every saved value)."""
    return node.op == "call_function" and node.target is torch.ops.aten.detach.default


def run_inference(emitted: Emitted, flat: Sequence[torch.Tensor]) -> list[Any]:
    """Run an inference plan (forward module only)."""
    return list(emitted.run_forward([*flat])[: emitted.n_outputs])
