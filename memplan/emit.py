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
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import _BoxedCodeGen

from memplan.capture import CapturedGraph, Phase

__all__ = ["Emitted", "emit", "PlanFunction"]


@dataclasses.dataclass(frozen=True)
class Emitted:
    """The runnable form of a plan."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None
    n_outputs: int  # flat model outputs the forward returns before the saved values
    saved: tuple[str, ...]  # joint-graph names of the saved values, in order
    differentiable: tuple[int, ...]  # flat output positions that receive a tangent
    grad_inputs: tuple[int, ...]  # flat input positions the backward's gradients belong to
    constant_outputs: tuple[tuple[int, Any], ...]  # outputs that are Python constants
    run_forward: Callable[[list[Any]], Any] = dataclasses.field(default=None, repr=False, compare=False)
    run_backward: Callable[[list[Any]], Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_forward", fast_callable(self.forward))
        if self.backward is not None:
            object.__setattr__(self, "run_backward", fast_callable(self.backward))

    @property
    def code(self) -> str:
        parts = ["# forward", self.forward.code.strip()]
        if self.backward is not None:
            parts += ["", "# backward", self.backward.code.strip()]
        return "\n".join(parts) + "\n"


def _boxed(root: torch.nn.Module, graph: torch.fx.Graph, name: str) -> torch.fx.GraphModule:
    """A boxed GraphModule of ``graph``, lazy: it runs through :func:`fast_callable`, which generates the
    code itself, so the module's own code is generated only when read (``Emitted.code``) or called."""
    graph.set_codegen(_BoxedCodeGen())
    return _LazyGraphModule(root, graph, class_name=name)


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

    # Step 1: the saved set, in graph order.
    saved: list[torch.fx.Node] = []
    if graph.training:
        for node in nodes:
            if not is_forward(node) or node.op == "get_attr":
                continue
            if any(u.op != "output" and not is_forward(u) for u in node.users):
                saved.append(node)

    # Step 2: the forward module (detaches are not copied: see _is_detach).
    fwd = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        if node.op == "output" or not is_forward(node):
            continue
        env[node] = env[node.args[0]] if _is_detach(node) else fwd.node_copy(node, lambda n: env[n])
    constant_outputs = []
    fwd_outputs: list[Any] = []
    for i, value in enumerate(flat_output_args[: len(model_outputs)]):
        if isinstance(value, torch.fx.Node):
            fwd_outputs.append(env[value])
        else:
            constant_outputs.append((i, value))
            fwd_outputs.append(None)
    fwd.output(fwd_outputs + [env[n] for n in saved])
    forward = _boxed(gm, fwd, "MemplanForward")

    # Step 3: the backward module.
    backward = None
    grad_inputs: tuple[int, ...] = ()
    if graph.training:
        bwd = torch.fx.Graph()
        benv: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in saved:
            benv[node] = bwd.placeholder(node.name)
            benv[node].meta = dict(node.meta)
        for node in placeholders:
            if node.name in tangent_names:
                benv[node] = bwd.node_copy(node, lambda n: benv[n])
        for node in nodes:
            if node.op in ("placeholder", "output") or is_forward(node):
                continue
            benv[node] = benv[node.args[0]] if _is_detach(node) else bwd.node_copy(node, lambda n: benv[n])
        grads = []
        for value in flat_output_args[len(model_outputs) :]:
            grads.append(benv[value] if isinstance(value, torch.fx.Node) else value)
        bwd.output(grads)
        backward = _boxed(gm, bwd, "MemplanBackward")
        requires = [i for i, s in enumerate(s for s in graph.inputs if s.kind != "tangent") if s.requires_grad]
        if len(requires) != len(grad_outputs):
            raise AssertionError(f"{len(requires)} inputs require grad but the graph returns {len(grad_outputs)} gradients")
        grad_inputs = tuple(requires)

    differentiable = tuple(i for i, s in enumerate(model_outputs) if s.differentiable)
    return Emitted(
        forward=forward,
        backward=backward,
        n_outputs=len(model_outputs),
        saved=tuple(n.name for n in saved),
        differentiable=differentiable,
        grad_inputs=grad_inputs,
        constant_outputs=tuple(constant_outputs),
    )


class PlanFunction(torch.autograd.Function):
    """Runs an :class:`Emitted` plan's forward, and its backward when autograd asks."""

    @staticmethod
    def forward(ctx: Any, emitted: Emitted, *flat: torch.Tensor) -> tuple[Any, ...]:
        results = emitted.run_forward([*flat])
        outputs = list(results[: emitted.n_outputs])
        saved = results[emitted.n_outputs :]
        ctx.emitted = emitted
        ctx.n_inputs = len(flat)
        ctx.save_for_backward(*saved)
        differentiable = set(emitted.differentiable)
        ctx.mark_non_differentiable(
            *[o for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and i not in differentiable]
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        emitted: Emitted = ctx.emitted
        args: list[Any] = list(ctx.saved_tensors)
        # Autograd would keep its copies until this whole backward returns; drop them now (unless the
        # graph is retained), so the boxed backward frees each saved tensor at its last use.
        ctx.maybe_clear_saved_tensors()
        for i in emitted.differentiable:
            args.append(_as_traced_layout(grad_outputs[i]))
        grads = emitted.run_backward(args)
        result: list[Any] = [None] * (1 + ctx.n_inputs)
        for index, grad in zip(emitted.grad_inputs, grads):
            result[1 + index] = grad
        return tuple(result)


_OP_CALL = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


def fast_callable(gm: torch.fx.GraphModule) -> Callable[[list[Any]], Any]:
    """``gm``'s generated code with each ``torch.ops.ns.op.overload(`` bound to the operator itself.

    fx code looks each operator up through four attributes and calls it through ``OpOverload.__call__``,
    a Python frame that only forwards to ``OpOverload._op``. Binding ``_op`` as a global removes both,
    which is most of the Python overhead of running a graph of small ops. The code is otherwise fx's own.
    """
    bound: dict[str, Any] = {}
    names: dict[str, str] = {}

    def bind(match: re.Match) -> str:
        qualified = match.group(0)[:-1]
        if qualified not in names:
            namespace, op, overload = match.groups()
            operator = getattr(getattr(getattr(torch.ops, namespace), op), overload)
            names[qualified] = f"_memplan_op{len(names)}"
            bound[names[qualified]] = operator._op
        return names[qualified] + "("

    python_code = gm.graph.python_code(root_module="self")
    source = _OP_CALL.sub(bind, python_code.src)
    namespace = dict(python_code.globals)
    namespace.update(bound)
    exec(compile(source, f"<memplan {type(gm).__name__}>", "exec"), namespace)
    function = namespace["forward"]

    def call(args: list[Any]) -> Any:
        return function(gm, args)

    return call


def _as_traced_layout(grad: torch.Tensor) -> torch.Tensor:
    """A tangent the backward module can read.

    The backward was traced with dense tangents. A broadcast scalar (all strides 0, what ``.sum()`` and
    ``.mean()`` send) supports every view a dense tensor does, so it passes as is and costs nothing;
    any other non-dense layout is made dense first, as view ops may not accept it.
    """
    if grad.is_contiguous() or all(stride == 0 for stride in grad.stride()):
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
