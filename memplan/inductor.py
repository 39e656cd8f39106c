"""A plan's forward and backward compiled by Inductor (``optimize(model, inductor=True)``,
``memplan.compile.backend(inductor=True)``).

memplan decides what a training step keeps for its backward and what it computes again there (its
recomputing passes: ``rewrite``, ``chunk``, ``timesteps``, ``remat``); :func:`memplan.emit.emit` splits
the planned graph into a forward module (model outputs and the saved values) and a backward module. Here
each module goes to Inductor as torch.compile hands a graph to it after AOTAutograd's partitioner: the
module is traced again over fake tensors, functionalized (in-place ops become their functional forms,
writes into the module's inputs copies at its end) and decomposed with Inductor's own table, then
compiled by ``compile_fx_inner``. The plan's saved set stays memplan's, and the kernels are Inductor's,
fused; Inductor plans the buffers inside each module itself, so the passes that only order and reuse
buffers (``inplace``, ``concat``, ``schedule``) are not in this pipeline (:data:`PIPELINE`).

Both modules are compiled while the signature is planned, from fake values of their arguments (as the
planned graph records them), and again for another layout of the arguments on its first call (a loss's
gradient may come dense or as a broadcast scalar). The compiled modules take their arguments as one list
and free each at its last use, as memplan's own modules do. Where Inductor cannot compile the forward or
the backward (torch's functionalization refuses a write through an ``as_strided`` view, say), the
signature is planned again without ``inductor=True`` and runs memplan's own code, with a
:class:`~memplan.errors.CompileFallbackWarning` (memplan's backward reads the storages its own forward
saved: the two run together).

A chunk loop of the plan (:class:`memplan.passes._chunk.loops.ChunkLoop`) stays a loop: it runs as one
opaque operator (``memplan::opaque_call``) inside the compiled module, and its bodies are compiled in turn.
Unrolled, Inductor summed the chunks' partial results in one kernel reading them all, which undid the
chunking.

Randomness stays eager's: Inductor is told to call torch's own random ops (``fallback_random``) rather
than its generator; where a module draws more than once, not to reorder its ops for memory
(``reorder_for_peak_memory``), which could swap two draws; and a dropout's draw into a fresh tensor runs as
``memplan::draw_bernoulli``, into a tensor of eager's strides (see there). A draw taken again in the
backward (``rewrite``'s dropout noise replay, which reads the generator's state as a value) is not planned
here: nothing would keep the compiled forward from moving the state's read across its draw.

What a plan predicts (``plan.planned_peak``) is the peak of memplan's op-by-op code; Inductor's kernels
hold other temporaries (fewer where they fuse, more where a fused kernel reads many buffers at once), so a
compiled plan is measured with the allocator (:func:`memplan.measure.allocator_peak`), as compiled code
runs outside dispatch modes. The backward runs in one piece (no stages for DDP's hooks: see
:func:`memplan.emit.run_training`).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from memplan.capture import autocast_off
from memplan.emit import Emitted, _hand_off, fast_callable
from memplan.errors import CompileFallbackWarning
from memplan.ops import grouped_addmm_, grouped_addmm_into, replay_bernoulli_, rng_state, TIER_OPS

__all__ = ["PIPELINE", "OPTIONS", "InductorFailed", "compile_emitted", "refuse_pipeline"]

#: The default pipeline under ``inductor=True``: the passes that decide what is saved and recomputed.
PIPELINE: tuple[str, ...] = ("rewrite", "chunk", "timesteps", "remat")
#: Pass options under ``inductor=True`` unless the user sets them (see the module docstring).
OPTIONS: dict[str, Any] = {"rewrite.noise_replay": False}

# In-place operators of memplan's own, and their forms that return nothing (functionalizable).
_INTO = {grouped_addmm_: grouped_addmm_into}

# A submodule the plan calls (the chunk pass's loops, ``memplan.passes._chunk.loops.ChunkLoop``) runs as one
# opaque operator in the compiled code: Inductor would unroll the loop and fuse its chunks' partial results
# into one kernel that holds them all (and compile for minutes), where the loop keeps one chunk at a time.
_LIBRARY = torch.library.Library("memplan", "FRAGMENT")
_LIBRARY.define("opaque_call(str key, Tensor?[] args) -> Tensor[]")
# key -> (the module, its outputs' (shape, stride, dtype, device)); the compiled code holds the modules
_OPAQUE: "weakref.WeakValueDictionary[str, _Opaque]"


class _Opaque:
    """A chunk loop the compiled code calls through ``memplan::opaque_call``, and its outputs' layouts."""

    def __init__(self, module: torch.nn.Module, outputs: Sequence[Any]) -> None:
        from memplan.passes._chunk.loops import ChunkLoop

        if not isinstance(module, ChunkLoop):
            raise NotImplementedError(f"a plan calling the module {type(module).__name__} cannot be compiled by Inductor")
        self.module = module
        # each chunk's body is compiled too (fused kernels inside the chunk), on its first run
        module.run_bodies_with(lambda body: _Compiled(lambda: body, "chunk body", fast_callable(body)))
        self.outputs = [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in outputs]
        # the loop's last output stands for its scratch memory in memplan's analyses (a fake value of the
        # scratch's size); what the loop returns there is an empty tensor
        shape, stride, dtype, device = self.outputs[-1]
        self.outputs[-1] = ((0,), (1,), dtype, device)


def _opaque_call(key: str, args: list[torch.Tensor | None]) -> list[torch.Tensor]:
    outputs = list(_OPAQUE[key].module(*args))
    # An operator's outputs must alias neither its inputs nor each other (functionalization relies on it):
    # a loop output that is an input, or a view of another output, is copied.
    seen = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
    for i, out in enumerate(outputs):
        if out.numel():
            storage = out.untyped_storage().data_ptr()
            if storage in seen:
                outputs[i] = out = out.clone()
                storage = out.untyped_storage().data_ptr()
            seen.add(storage)
    return outputs


def _opaque_fake(key: str, args: list[torch.Tensor | None]) -> list[torch.Tensor]:
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device if device is not None else where)
            for shape, stride, dtype, where in _OPAQUE[key].outputs]


_LIBRARY.impl("opaque_call", _opaque_call, "CompositeExplicitAutograd")
torch.library.register_fake("memplan::opaque_call", _opaque_fake, lib=_LIBRARY)
_OPAQUE = weakref.WeakValueDictionary()
opaque_call = torch.ops.memplan.opaque_call.default


# A dropout's draw on a CPU (``empty_like(x).bernoulli_(q)``) fills its tensor in memory order, so its
# strides decide which element gets which number. Functionalized, it becomes ``bernoulli(t, q)``, which
# Inductor runs as ``bernoulli_`` on a copy laid out as it likes (contiguous): another element order than
# eager's where ``x`` was a transposed view. This operator draws into a tensor of the strides eager had,
# and Inductor keeps the layout a custom operator's output declares.
_LIBRARY.define("draw_bernoulli(SymInt[] size, SymInt[] stride, float p, ScalarType dtype, Device device) -> Tensor",
                tags=(torch.Tag.nondeterministic_seeded,))


def _draw_bernoulli(size: list[int], stride: list[int], p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device).bernoulli_(p)


def _draw_bernoulli_fake(size: list[int], stride: list[int], p: float, dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


_LIBRARY.impl("draw_bernoulli", _draw_bernoulli, "CompositeExplicitAutograd")
torch.library.register_fake("memplan::draw_bernoulli", _draw_bernoulli_fake, lib=_LIBRARY)
draw_bernoulli = torch.ops.memplan.draw_bernoulli.default



def refuse_pipeline(passes: Sequence[str]) -> None:
    """Refuse, up front, a pipeline whose operators a compiled plan cannot run."""
    if "offload" in passes:
        raise ValueError(
            "inductor=True cannot run the offload pass: its copies to host memory and their waits are "
            "ordered by position on memplan's own schedule, which Inductor does not keep. Fix: drop "
            '"offload" from passes=, or plan without inductor=True.'
        )


def compile_emitted(emitted: Emitted) -> Emitted:
    """``emitted`` with its forward and backward run by Inductor's code, both compiled now, from fake values
    of their arguments (as the planned graph records them). Raises :class:`InductorFailed` where Inductor
    cannot compile one of them: memplan's own backward reads the storages its own forward saved (an
    in-place unit remade is viewed with ``as_strided`` over its storage), so the two go together."""
    forward = _Compiled(lambda: emitted.forward, "forward")
    backward = _Compiled(lambda: emitted.backward, "backward") if emitted.run_backward is not None else None
    for part in (forward, backward):
        if part is None:
            continue
        try:
            part.compile(_fake_arguments(part.module()))
        except Exception as exc:  # noqa: BLE001 - any failure of the compiler
            text = str(exc).strip()
            raise InductorFailed(part.name, f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]) from exc
    return dataclasses.replace(emitted, run_forward=forward, run_backward=backward, stages=(), start_staged=None)


class InductorFailed(Exception):
    """Inductor could not compile a plan's ``module`` (``"forward"`` or ``"backward"``); ``reason``: why."""

    def __init__(self, module: str, reason: str) -> None:
        super().__init__(f"Inductor could not compile the plan's {module} ({reason})")
        self.module, self.reason = module, reason


class _Compiled:
    """A boxed runner of the module ``module()`` compiled by Inductor, once per layout of its arguments.

    The compiled code assumes the strides of the tensors it was compiled for. A tangent may come as a
    broadcast scalar (``loss.sum().backward()``) on one call and dense on the next: each layout gets its
    own code, compiled on its first call; where that fails, the arguments are copied into the layout of
    the first code compiled. ``fallback``: memplan's own code of the module, run where even the first
    compilation fails (None: that failure raises)."""

    def __init__(self, module: Callable[[], torch.fx.GraphModule], name: str,
                 fallback: Callable[[list[Any]], Any] | None = None) -> None:
        self.module = module
        self.name = name
        self._fallback = fallback
        self._lock = threading.Lock()
        self._runs: dict[tuple, Callable[[list[Any]], Any]] = {}
        self.compile_seconds = 0.0  # compiling, all layouts together

    @staticmethod
    def _layout(args: Sequence[Any]) -> tuple:
        return tuple(a.stride() if isinstance(a, torch.Tensor) else None for a in args)

    def compile(self, args: Sequence[Any]) -> Callable[[list[Any]], Any]:
        """The code for the layout of ``args`` (real or fake tensors), compiled now if it is new."""
        layout = self._layout(args)
        with self._lock:
            run = self._runs.get(layout)
            if run is None:
                import time

                start = time.perf_counter()
                try:
                    run = self._runs[layout] = _compile(self.module(), args, self.name)
                finally:
                    self.compile_seconds += time.perf_counter() - start
        return run

    def __call__(self, args: list[Any]) -> Any:
        run = self._runs.get(self._layout(args))
        if run is None:
            try:
                run = self.compile(args)
            except Exception as exc:  # noqa: BLE001 - see the class docstring
                if self._runs:
                    layout, run = next(iter(self._runs.items()))
                    args[:] = [a if stride is None or a.stride() == stride else
                               torch.empty_strided(a.shape, stride, dtype=a.dtype, device=a.device).copy_(a)
                               for a, stride in zip(args, layout)]
                elif self._fallback is not None:
                    text = str(exc).strip()
                    reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
                    warnings.warn(CompileFallbackWarning(
                        f"inductor=True: Inductor could not compile a {self.name} of the plan ({reason[:300]}); "
                        "it runs as memplan's own code, op by op, with the same values and memory.",
                        module=self.name, reason=reason), stacklevel=2)
                    run = self._runs[self._layout(args)] = self._fallback
                else:
                    raise
        with torch.no_grad(), autocast_off():
            return run(args)


def _fake_arguments(module: torch.fx.GraphModule) -> list[Any]:
    """Fake tensors (no memory) shaped as ``module``'s arguments, as its placeholders' values record them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    arguments = []
    with FakeTensorMode():
        for node in module.graph.nodes:
            if node.op != "placeholder":
                continue
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
            arguments.append(value)
    return arguments


def _plain(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module`` called with positional arguments, without its gradient hand-offs, with memplan's
    in-place operators in their forms that return nothing."""
    graph = copy.deepcopy(module.graph)
    held: list[_Opaque] = []
    for node in list(graph.nodes):
        if node.op == "call_module":
            # one per loop: compiling the module again (for another layout of its arguments) keeps the
            # loop's bodies compiled so far
            loop = module.get_submodule(node.target)
            key = f"{node.target}@{id(loop)}"
            opaque = _OPAQUE.get(key)
            if opaque is None or opaque.module is not loop:
                opaque = _OPAQUE[key] = _Opaque(loop, node.meta["val"])
            held.append(opaque)
            with graph.inserting_after(node):
                call = graph.call_function(opaque_call, (key, list(node.args)))
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            continue
        if node.op != "call_function":
            continue
        if node.target is _hand_off:
            node.replace_all_uses_with(node.args[1])
            graph.erase_node(node)
        elif node.target in _INTO:
            with graph.inserting_after(node):
                into = graph.call_function(_INTO[node.target], node.args, node.kwargs)
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            into.meta = {}
        elif (node.target is torch.ops.aten.bernoulli_.float and not node.kwargs and len(node.args) == 2
              and isinstance(node.args[0], torch.fx.Node) and _fresh(node.args[0])):
            # a draw into a tensor made for it (see draw_bernoulli)
            fresh, value = node.args[0], node.args[0].meta["val"]
            with graph.inserting_after(node):
                draw = graph.call_function(draw_bernoulli, (list(value.shape), list(value.stride()), node.args[1],
                                                            value.dtype, value.device))
            node.replace_all_uses_with(draw)
            graph.erase_node(node)
            graph.erase_node(fresh)
        elif node.target in (rng_state, replay_bernoulli_) or node.target in TIER_OPS:
            raise NotImplementedError(
                f"memplan's {node.target} cannot be compiled by Inductor (see memplan.inductor); it is "
                "not planned under inductor=True"
            )
    graph.set_codegen(torch.fx.graph.CodeGen())
    plain = torch.fx.GraphModule(module, graph, class_name=type(module).__name__)
    plain.memplan_opaque = held  # alive as long as the module (and the compiled code made from it)
    return plain


def _fresh(node: torch.fx.Node) -> bool:
    """Whether ``node`` makes an uninitialised tensor read by one op only."""
    return (node.op == "call_function" and node.target in (torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format,
                                                           torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default)
            and len(node.users) == 1 and isinstance(node.meta.get("val"), torch.Tensor))


def _functionalized(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` traced functionally, as AOTAutograd traces a graph for Inductor: in-place ops
    become functional ones, and an input written in place gets its new value copied in at the end."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def unwrap(t: FunctionalTensor) -> torch.Tensor:
        torch._sync(t)
        return torch._from_functional_tensor(t.elem)

    def inner(*args: Any) -> Any:
        excluded = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
        with excluded, FunctionalTensorMode():
            wrapped = [FunctionalTensor.to_functional(a) if isinstance(a, torch.Tensor) else a for a in args]
            outputs = pytree.tree_map_only(FunctionalTensor, unwrap, function(*wrapped))
            for original, value in zip(args, wrapped):
                if isinstance(value, FunctionalTensor):
                    torch._sync(value)
                    if torch._functionalize_has_data_mutation(value.elem):
                        original.copy_(torch._from_functional_tensor(value.elem))
        return outputs

    return inner


def _draws(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and torch.Tag.nondeterministic_seeded in n.target.tags)


def _compile(module: torch.fx.GraphModule, args: Sequence[Any], name: str) -> Callable[[list[Any]], Any]:
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    plain = _plain(module)
    patches: dict[str, Any] = {"fallback_random": True}
    if _draws(plain.graph) > 1:
        patches["reorder_for_peak_memory"] = False
    if name == "backward":
        # Inductor's reuse of a dead buffer for a new one raised the compiled backward's peak, never lowered
        # it: the zoo's GPT-2 198 -> 180 KiB without it, its encoder 118 -> 95 KiB, the latent GRU 924 -> 840
        # KiB, the other examples unchanged (this CPU); in the forward it changed nothing.
        patches["allow_buffer_reuse"] = False
    examples = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    with config.patch(patches), torch.no_grad(), autocast_off():
        traced = make_fx(_functionalized(plain), decomposition_table=select_decomp_table(),
                         tracing_mode="fake")(*examples)
        fakes = [n.meta.get("val") for n in traced.graph.nodes if n.op == "placeholder"]
        compiled = compile_fx_inner(traced, fakes, is_backward=name == "backward")
    # the loops the compiled code calls by key (memplan::opaque_call) live as long as it
    def run(arguments: list[Any], _loops: list[_Opaque] = plain.memplan_opaque) -> Any:
        return compiled(arguments)

    return run
