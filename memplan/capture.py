"""Capture: a model plus example inputs becomes one aten-level fx graph, forward and backward.

What it does
------------
``capture(model, *inputs)`` traces the model over fake tensors (nothing big is allocated), with
Python loops unrolled by the trace, into the graph ``make_fx(tracing_mode="fake")`` would build. In
training mode the trace continues through autograd's own backward, so the graph holds the backward
ops exactly in the order the autograd engine runs them, and a forward value used by a backward node
is exactly a tensor autograd saved.

Stages
------
(1) Check and flatten the inputs: tensors (in tuples, lists, dicts; dense ones only) become
    placeholders; plain values (None, numbers, strings, dtypes: :data:`STATIC_TYPES`) are constants.
(2) Build a flat function over ``parameters, buffers, user leaves`` that calls the model with the
    traced parameters and buffers in place of its own (as ``torch.func.functional_call`` does, but
    through the backward too, which may run the module's code again: ``torch.utils.checkpoint``), so
    parameters and buffers are graph inputs, not copies.
(3) In training mode, run backward inside the traced function: ``loss = sum(out.sum())`` (the
    ``"sum"`` seed, what ``model(x).sum().backward()`` does) or ``autograd.backward(outs, tangents)``
    (the ``"tangents"`` seed, used when memplan emits its own backward; the tangents become graph
    inputs, after the others, once the forward has made the outputs). The last node traced before
    backward starts marks the forward/backward boundary. Gradients are returned in their leaves'
    layouts: where autograd would copy one (AccumulateGrad's layout contract), in the trace or in a
    run whose tangent is a broadcast scalar, the graph makes the copy, so the plan accounts for it.
(4) Trace with :class:`memplan._capture.tracer.Tracer`, a dispatch mode that records each aten op
    as make_fx does, but makes the fake outputs of an op it has seen on arguments of the same
    layout from a cache instead of running the op's fake kernel again (an unrolled loop repeats a
    few ops thousands of times), and learns from the real kernel the sizes of outputs a fake kernel
    gets wrong (oneDNN's LSTM workspace, see :data:`memplan.opschema.GRAD_MODE_OPS`); a recorder it
    calls after each op notes the forward op's user line and when Python releases each storage.
    Data-dependent control flow becomes a :class:`~memplan.errors.CaptureError` naming the user's line;
    an exception the model's own code raises is raised as it is. A process traces one model at a time
    (:data:`TRACING`), and a failed or interrupted trace leaves no fake tensor on the model.
(5) Read what the trace recorded (``val``, ``seq_nr``) and what the recorder saw once, into a frozen
    :class:`CapturedGraph` keyed by node name. Nothing later reads ``node.meta`` for decisions
    except the fake value of a node (``node.meta["val"]``), which is fx's own shape record, and the
    grad mode of a call of a :data:`~memplan.opschema.GRAD_MODE_OPS` operator, which emit reads.

Backward nodes carry the forward op's autograd sequence number, so each backward node inherits the
source line of the forward op whose derivative it computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import gc
import heapq
import operator
import os
import linecache
import re
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet  # typing.AbstractSet's name, without typing's alias
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import nn
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.utils.stateless import _reparametrize_module

from memplan._capture.target import Target, TargetError, resolve_target, retarget, tracing_for, watching
from memplan._capture.tracer import GeneratorArgumentError, NotDenseError, Tracer, new_fake_mode, quiet_meta_failures
from memplan.errors import CaptureError, UnsupportedInputError
from memplan.opschema import is_random, is_view_op, mutated_args

__all__ = [
    "Phase",
    "SourceLine",
    "InputSpec",
    "OutputSpec",
    "CapturedGraph",
    "capture",
    "sum_backward",
    "is_user_frame",
    "is_static_leaf",
    "check_leaves",
    "caller_line",
    "TRACING",
    "on_target",
    "is_compiled",
    "refuse_compiled",
    "leaf_paths",
    "STATIC_TYPES",
    "AUTOCAST_KINDS",
    "autocast_off",
    "UNORDERED_SEQ_NR",
]

#: Sequence numbers from here up are not the forward's order: autograd numbers ``AccumulateGrad`` nodes
#: (the ``detach`` of a leaf's gradient) with the largest ``uint64``. New numbers go above the others.
UNORDERED_SEQ_NR = 2**62

#: Held while a model is traced, so a process traces one model at a time: a trace swaps the model's
#: parameters for fake tensors, and patches process-wide functions (Python's ``random``,
#: ``Tensor.register_hook``). Reentrant: a model may hold an optimized module, which plans inside the trace.
TRACING = threading.RLock()

_TORCH_DIR = os.path.dirname(torch.__file__)
_MEMPLAN_DIR = os.path.dirname(os.path.abspath(__file__))
_EXAMPLES_DIR = os.path.join(_MEMPLAN_DIR, "examples")


class Phase(str, enum.Enum):
    """Which half of a training step a node belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclasses.dataclass(frozen=True)
class SourceLine:
    """A line of the user's code: where an op came from.

    Examples
    --------
    >>> str(SourceLine("/home/me/model.py", 42, "forward", "y = x @ w"))
    'model.py:42 (y = x @ w)'
    """

    filename: str
    lineno: int
    function: str
    code: str

    def __str__(self) -> str:
        name = os.path.basename(self.filename)
        return f"{name}:{self.lineno} ({self.code})" if self.code else f"{name}:{self.lineno}"


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One placeholder of the captured graph.

    ``kind`` is ``"parameter"``, ``"buffer"``, ``"input"`` (a user argument) or ``"tangent"``
    (the gradient flowing into an output, when backward is seeded with tangents). ``path`` is the
    parameter's qualified name or the argument's position, e.g. ``"fc1.weight"`` or ``"args[0]"``.
    """

    node: str
    kind: str
    path: str
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """One flat output of the captured graph: a model output, or the gradient of an input."""

    node: str | None
    kind: str  # "output" or "grad"
    path: str  # output position ("out[0]") or the input the gradient belongs to ("fc1.weight")
    differentiable: bool = False  # a model output that requires grad (gets a tangent in backward)
    # its tangent must reach the backward dense: the backward fails on a broadcast scalar (view_as_complex,
    # the backward of a view_as_real output, needs unit stride)
    dense_tangent: bool = False
    # ... unless every tangent arrives as a broadcast scalar (what sum(out.sum()) sends): the backward
    # takes them all at once, where it refused this one alone beside dense others (an add of two of them
    # laid out after the dense one, then viewed)
    broadcast_together: bool = False


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """A captured model: the fx graph plus what capture learned about each node, keyed by name.

    Attributes
    ----------
    gm : torch.fx.GraphModule
        Flat function ``gm(*params, *buffers, *user_leaves[, *tangents]) -> [*outputs, *grads]``.
    training : bool
        Whether the graph holds a backward.
    phases : Mapping[str, Phase]
        Node name to forward/backward, for every ``call_function`` node.
    sources : Mapping[str, SourceLine]
        Node name to the user's source line, where one is known.
    library_sources : Mapping[str, SourceLine]
        Node name to the line of torch's beneath the user's line (the innermost frame of a public torch
        module, such as ``nn/modules/activation.py`` for ``nn.GELU``), where the op ran inside torch.
    target_device : torch.device or None
        Where the graph runs when it was traced on a stand-in device (a plan for CUDA made without a GPU:
        its values are on ``meta`` until :func:`on_target` moves them there; analyses charge them as that
        device's allocator would). None when the values are on the device they run on.
    modules : Mapping[str, str]
        Node name to the qualified name of the innermost module of the model whose call (its forward or
        a hook) ran the op: ``"encoder.layers.1.mlp.act"``, ``""`` for the model itself. Absent for an op
        outside the model's modules (the loss of the ``"sum"`` seed, a function's ops) and for nodes passes
        create.
    seq_nr : Mapping[str, int]
        Node name to autograd sequence number (backward nodes share it with their forward op). Numbers
        from :data:`UNORDERED_SEQ_NR` up have no place in the forward's order (autograd gives
        ``AccumulateGrad`` the largest ``uint64``).
    inputs, outputs : tuple
        One spec per placeholder and per flat output.
    in_spec, out_spec : pytree.TreeSpec
        How the user's ``(args, kwargs)`` and outputs flatten. ``inputs`` has a placeholder for each
        tensor leaf of ``in_spec``; the other leaves are constants of the graph.
    """

    gm: torch.fx.GraphModule
    training: bool
    phases: Mapping[str, Phase]
    sources: Mapping[str, SourceLine]
    seq_nr: Mapping[str, int]
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    seed: str
    released_after: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # where the forward ran under autocast: the first backward op autocast would cast if the backward ran
    # inside the autocast block too ("mm at model.py:12 (...)"), or None (see _autocast_in_backward)
    autocast_in_backward: str | None = None
    static_inputs: tuple[tuple[str, Any], ...] = ()
    lifetimes: str = "eager"
    library_sources: Mapping[str, SourceLine] = dataclasses.field(default_factory=dict)
    modules: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # the device the values are for, when the trace ran on a stand-in (see memplan._capture.target): values on
    # the meta device run there, and :func:`on_target` moves them; None when the values are where they run
    target_device: torch.device | None = None
    _by_name: dict[str, torch.fx.Node] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.gm.graph

    def node(self, name: str) -> torch.fx.Node:
        """The node called ``name`` (names are stable and unique).

        Looked up in a name table, rebuilt when it misses or holds a node since erased or renamed
        (passes edit the graph in place), so looking up every node once is linear, not quadratic.
        """
        node = self._by_name.get(name)
        if node is None or node._erased or node.name != name or node.graph is not self.gm.graph:
            self._by_name.clear()
            self._by_name.update((n.name, n) for n in self.gm.graph.nodes)
            node = self._by_name.get(name)
            if node is None:
                raise KeyError(f"no node named {name!r} in the captured graph")
        return node

    def input_spec(self, name: str) -> InputSpec | None:
        for spec in self.inputs:
            if spec.node == name:
                return spec
        return None

    def describe(self, name: str) -> str:
        """``"mm (model.py:42 (y = x @ w))"``: op name and user line, for messages."""
        node = self.node(name)
        op = _op_name(node)
        source = self.sources.get(name)
        return f"{op} at {source}" if source else op


# in-place ops that Python assignment makes (``y[i] = v``, ``y[mask] = 0``): no out-of-place twin to name
_ASSIGNMENTS = frozenset({"copy_", "fill_", "zero_", "index_put_", "_index_put_impl_"})


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


# ----------------------------------------------------------------------------------------------
# user frames


def is_user_frame(filename: str) -> bool:
    """True for frames of the user's code: outside torch and memplan (memplan's examples count as user code)."""
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR + os.sep):
        return False
    if path.startswith(_MEMPLAN_DIR + os.sep) and not path.startswith(_EXAMPLES_DIR + os.sep):
        return False
    return not filename.startswith("<")


def _user_line_from_traceback(frames: traceback.StackSummary) -> SourceLine | None:
    found = None
    for frame in frames:
        if is_user_frame(frame.filename):
            found = SourceLine(frame.filename, frame.lineno or 0, frame.name, (frame.line or "").strip())
    return found


# torch's modules that run the user's code and ops rather than make a layer's choices: never the line to name
_MACHINERY = frozenset({"fx", "utils", "autograd", "overrides.py", os.path.join("nn", "modules", "module.py")})


def _public_torch_path(filename: str) -> str | None:
    """``"nn/modules/linear.py"``: the path, relative to torch's directory, of a file of a public torch module
    (``nn/modules``, ``nn/functional.py``; not ``_subclasses``, ``fx`` or the module call machinery), None
    for any other file: a frame there is a layer or function of torch's the user called."""
    path = os.path.abspath(filename)
    if not path.startswith(_TORCH_DIR + os.sep):
        return None
    relative = os.path.relpath(path, _TORCH_DIR)
    parts = relative.split(os.sep)
    if parts[0] in _MACHINERY or relative in _MACHINERY or any(part.startswith("_") for part in parts):
        return None
    return relative


def _library_line_from_traceback(frames: traceback.StackSummary) -> SourceLine | None:
    """The innermost frame, below the user's last one (if any), in a public torch module (``nn/modules/batchnorm.py``,
    not ``_subclasses`` or ``fx``): where a layer the user called did what failed (BatchNorm with
    ``momentum=None`` reading its step count into Python). Its path is relative to torch's directory."""
    found = None
    for frame in frames:
        if is_user_frame(frame.filename):
            found = None
            continue
        relative = _public_torch_path(frame.filename)
        if relative is not None:
            found = SourceLine(relative, frame.lineno or 0, frame.name, (frame.line or "").strip())
    return found


# ----------------------------------------------------------------------------------------------
# inputs


# Argument values that are not tensors but are planned as constants, one plan per value (``mask=None``,
# ``return_weights=False``, ``scale=0.5``, ``dtype=torch.bfloat16``): immutable values whose equality says
# that the model computes the same graph.
STATIC_TYPES: tuple[type, ...] = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
    torch.memory_format, enum.Enum,
)


def is_static_leaf(leaf: Any) -> bool:
    """True for an argument value memplan plans as a constant (see :data:`STATIC_TYPES`)."""
    return isinstance(leaf, STATIC_TYPES)


# Why a generator of the model's own cannot be planned, and what to do: for an argument and for an op alike.
_OWN_GENERATOR_FIX = (
    "A plan reproduces random ops from the global RNG stream only (as eager draws them under torch.manual_seed). "
    'Fix: draw from the global RNG, pass the random tensor in as an input, or pass fallback="eager" to '
    "memplan.optimize to run this model eagerly."
)


def caller_line(doing: str = "called") -> str:
    """`` (called at model.py:12: `y = opt(x)`)``: the innermost line of the user's code on the stack, for
    messages ("" when there is none); ``doing`` says what that line does."""
    for frame in reversed(traceback.extract_stack()):
        if is_user_frame(frame.filename):
            return f" ({doing} at {os.path.basename(frame.filename)}:{frame.lineno}: `{(frame.line or '').strip()}`)"
    return ""


def check_leaves(leaves: Sequence[Any], paths: Sequence[str]) -> None:
    """Raise :class:`~memplan.errors.UnsupportedInputError` for an argument memplan cannot plan over
    (``leaves`` and their ``paths`` as :func:`leaf_paths` gives them): neither a tensor nor a plain value,
    a generator, or a tensor that is not dense (sparse, nested, quantized)."""
    for leaf, path in zip(leaves, paths):
        if is_static_leaf(leaf):
            continue
        if isinstance(leaf, torch.Generator):
            raise UnsupportedInputError(f"{path} is a torch.Generator{caller_line()}. {_OWN_GENERATOR_FIX}")
        if not isinstance(leaf, torch.Tensor) and _is_key_value_cache(leaf):
            raise UnsupportedInputError(
                f"{path} is a key/value cache ({type(leaf).__name__}){caller_line()}, an object holding the "
                f"tensors of earlier calls, which a plan cannot take in. {_CACHE_FIX}"
            )
        if not isinstance(leaf, torch.Tensor):
            raise UnsupportedInputError(
                f"memplan plans over tensors and plain values (None, bool, int, float, str, dtype, device, "
                f"enum) only, but {path} is a {type(leaf).__name__} ({leaf!r:.60}){caller_line()}. Fix: bind it "
                "first, e.g. memplan.optimize(functools.partial(model_fn, config=config)), or store it on the module."
            )
        kind = _unsupported_kind(leaf)
        if kind is not None:
            what, fix = kind
            raise UnsupportedInputError(
                f"{path} is a {what} tensor{caller_line()}; memplan plans dense (strided) tensors of real or "
                f"complex numbers only. Fix: {fix}, or keep that part outside the optimized module."
            )


def _unsupported_kind(tensor: torch.Tensor) -> tuple[str, str] | None:
    """``(what the tensor is, the fix)`` for a tensor memplan cannot plan over, None for one it can: a
    dense tensor (on any device, the meta device included; complex numbers included)."""
    if tensor.is_nested:
        return ("nested", "pad it into one dense tensor (torch.nested.to_padded_tensor(x, 0.0), or "
                "nn.utils.rnn.pad_sequence) and pass a mask of the padding beside it")
    if tensor.layout != torch.strided:
        return (f"sparse ({tensor.layout})", "pass x.to_dense()")
    if tensor.is_quantized:
        return ("quantized", "pass x.dequantize() (and quantize the outputs yourself)")
    return None


def _model_name(model: Any) -> str:
    """How errors name the model: its class, or the function's qualified name."""
    return type(model).__name__ if isinstance(model, nn.Module) else getattr(model, "__qualname__", repr(model))


def _check_requires_grad_unchanged(model: Any, traced: Sequence[torch.Tensor], given: Sequence[torch.Tensor],
                                   paths: Sequence[str]) -> None:
    """Raise :class:`CaptureError` when the forward turned gradients of an input on or off
    (``x.requires_grad_()`` inside ``forward``, as energy-based and score-matching code does): the
    plan's gradients are the inputs' as they are passed in, so it would not give the one autograd
    gives eager. ``requires_grad_`` is no op of the trace, so there is no line to name: the input is."""
    for tensor, leaf, path in zip(traced, given, paths):
        if tensor.requires_grad != leaf.requires_grad:
            name = _model_name(model)
            now = "on" if tensor.requires_grad else "off"
            raise CaptureError(
                f"{name}'s forward turns gradients {now} for its input {path} (requires_grad was "
                f"{leaf.requires_grad} when it was passed in). memplan plans a training step from the inputs "
                f"as they are passed in, so its gradients would not be the ones autograd gives eager. Fix: set "
                f"requires_grad on {path} before calling the model (where the batch is made), or pass "
                'fallback="eager" to memplan.optimize to run it unplanned.'
            )


def _forward_line(model: Any) -> str:
    """``"Model.forward (model.py:12)"``: where the model's forward (or the function) is defined."""
    return _describe_function(type(model).forward if isinstance(model, nn.Module) else model)


def _check_outputs(model: Any, out: Any, flat_out: Sequence[Any]) -> None:
    """Refuse an output that is neither a tensor nor a plain value (in tuples, lists, dicts, namedtuples,
    or a class registered with pytree). A plan returns the outputs it computes and, for every other leaf,
    the very object the trace returned: an object of the user's would hold the trace's fake tensors, and
    would be the same object at every call, where eager returns a new one."""
    for i, value in enumerate(flat_out):
        if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)) or is_static_leaf(value):
            continue
        where = leaf_paths((out, {}))[i].replace("args", "output", 1)
        if _is_key_value_cache(value):
            raise CaptureError(
                f"{_forward_line(model)} returns a key/value cache ({type(value).__name__}) at {where}: a plan "
                f"gives back the tensors it computes, not an object holding them. {_CACHE_FIX}"
            )
        raise CaptureError(
            f"{_forward_line(model)} returns a value of type {type(value).__name__} at {where}; memplan returns "
            "tensors and plain values (None, numbers, strings, dtypes), in tuples, lists, dicts and namedtuples, "
            "and a plan would give back the object it saw while planning, holding no real values, at every call. "
            "Fix: return its tensors in a tuple or dict, or register its class with "
            "torch.utils._pytree.register_dataclass (or register_pytree_node) so memplan sees inside it; or pass "
            'fallback="eager" to memplan.optimize to run this model eagerly.'
        )


_CACHE_FIX = (
    "Fix: for training and full-sequence passes, call the model with use_cache=False (or set "
    "model.config.use_cache = False), so it returns no cache; decode token by token with the model itself "
    "(opt.original), where each step holds little memory."
)


def _is_key_value_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face transformers cache of keys and values (``DynamicCache`` and the
    other ``Cache`` classes), recognised by its class's lineage, without importing transformers."""
    return any(cls.__name__.endswith("Cache") and cls.__module__.startswith("transformers.")
               for cls in type(value).__mro__)


def leaf_paths(tree: Any) -> list[str]:
    """``["args[0]", "kwargs['mask']"]``: the path of each leaf of the ``(args, kwargs)`` pair ``tree``."""
    flat_with_path, _ = pytree.tree_flatten_with_path(tree)
    paths = []
    for key_path, _leaf in flat_with_path:
        text = pytree.keystr(key_path)
        # (args, kwargs) -> "args[0]" / "kwargs['x']"
        if text.startswith("[0]"):
            text = "args" + text[3:]
        elif text.startswith("[1]"):
            text = "kwargs" + text[3:]
        paths.append(text)
    return paths


def sum_backward(outputs: Any, before_backward: Callable[[list[torch.Tensor]], None] | None = None) -> None:
    """Run backward on ``sum(o.sum())`` over the floating outputs that require grad.

    This is the training step memplan's analysis and benchmarks assume when no loss is given:
    the same as ``model(x).sum().backward()``. ``before_backward`` runs once the loss is formed.
    """
    leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise CaptureError(
            "training capture needs an output that requires grad, but none does. "
            "Fix: capture in inference mode (train=False), or check that parameters require grad."
        )
    loss = leaves[0].sum()
    for leaf in leaves[1:]:
        loss = loss + leaf.sum()
    if before_backward is not None:
        before_backward([loss])
    loss.backward()


# ----------------------------------------------------------------------------------------------
# capture


def capture(
    model: nn.Module | Callable[..., Any],
    *args: Any,
    train: bool | None = None,
    seed: str = "sum",
    target_device: torch.device | str | None = None,
    _real_constants: bool = True,
    **kwargs: Any,
) -> CapturedGraph:
    """Trace ``model(*args, **kwargs)`` into a :class:`CapturedGraph` over fake tensors.

    Tensors the model makes from no input's values (``torch.arange(n)``, masks built from it) hold their
    real values while the model's code runs, so that code branching on them goes as in eager; where the
    model later writes input-dependent values into one, or the trace fails after one was made, the model is
    traced again with every tensor fake (``_real_constants=False``).

    Parameters
    ----------
    model : nn.Module or callable
        The model. A module's parameters and buffers become graph inputs.
    *args, **kwargs
        Example inputs: tensors, possibly nested in tuples, lists and dicts.
    train : bool, optional
        Capture forward+backward (True) or forward only (False). Default: True when grad mode is on
        and a parameter or input requires grad.
    seed : {"sum", "tangents"}
        How backward is seeded in training mode: ``"sum"`` backpropagates ``sum(out.sum())``;
        ``"tangents"`` adds one placeholder per differentiable output holding its gradient.
    target_device : torch.device or str, optional
        Trace for this device (``"cuda"``) wherever the model and inputs are (the CPU, or the meta device):
        parameters, buffers and inputs become fake tensors there, and so does every tensor the model makes
        on their device. Without a GPU, a CUDA target is traced on a stand-in device, the graph's
        ``target_device`` says so, and :func:`on_target` moves its values to ``cuda:0``; see
        :mod:`memplan._capture.target` for what is planned as CUDA runs it and what is refused. None: the
        devices the tensors are on.

    Raises
    ------
    CaptureError
        When the model's Python control flow depends on tensor values, or it cannot be traced.
    UnsupportedInputError
        For sparse tensors, and for arguments that are neither tensors nor plain values (see
        :data:`STATIC_TYPES`); plain values are constants of the graph.

    Examples
    --------
    >>> import torch
    >>> cg = capture(torch.nn.Linear(4, 3), torch.randn(8, 4))
    >>> cg.training, [s.kind for s in cg.inputs]
    (True, ['parameter', 'parameter', 'input'])
    >>> sorted({p.value for p in cg.phases.values()})
    ['backward', 'forward']
    """
    if seed not in ("sum", "tangents"):
        raise ValueError(f"seed must be 'sum' or 'tangents', not {seed!r}")

    # Step 1: check and flatten the inputs.
    # Plain values (None, flags, scales) are constants of the plan; only tensors become placeholders.
    all_leaves, in_spec = pytree.tree_flatten((args, kwargs))
    all_paths = leaf_paths((args, kwargs))
    check_leaves(all_leaves, all_paths)
    tensor_at = [i for i, leaf in enumerate(all_leaves) if isinstance(leaf, torch.Tensor)]
    user_leaves = [all_leaves[i] for i in tensor_at]
    tensor_paths = [all_paths[i] for i in tensor_at]
    static_inputs = tuple((path, leaf) for path, leaf in zip(all_paths, all_leaves) if not isinstance(leaf, torch.Tensor))

    if isinstance(model, nn.Module):
        params = dict(model.named_parameters(remove_duplicate=True))
        buffers = dict(model.named_buffers(remove_duplicate=True))
    else:
        params, buffers = {}, {}

    if train is None:
        train = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params.values()) or any(t.requires_grad for t in user_leaves)
        )

    param_names, buffer_names = list(params), list(buffers)
    n_params, n_buffers, n_user = len(param_names), len(buffer_names), len(user_leaves)
    boundary: dict[str, Any] = {}
    out_spec_box: dict[str, Any] = {}

    # Step 2: a flat function over params, buffers, user leaves (and tangents).
    # An input made by earlier ops (not a leaf) is traced as one too, through an alias: autocast caches
    # the cast of a leaf that requires grad once per block, but casts another tensor at every use.
    made = {i for i, t in zip(tensor_at, user_leaves) if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_leaf}

    def call_model(flat: Sequence[torch.Tensor]) -> Any:
        leaves = list(all_leaves)
        for i, tensor in zip(tensor_at, flat[n_params + n_buffers : n_params + n_buffers + n_user]):
            leaves[i] = tensor.view_as(tensor) if i in made else tensor
        call_args, call_kwargs = pytree.tree_unflatten(leaves, in_spec)
        return model(*call_args, **call_kwargs)

    def substituted(flat: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager:
        """The module with the traced parameters and buffers in place of its own, as
        ``torch.func.functional_call`` has it, but for the backward too: a backward that runs the
        module's code again (``torch.utils.checkpoint`` recomputing a segment) reads the traced ones."""
        if not isinstance(model, nn.Module):
            return contextlib.nullcontext()
        p = dict(zip(param_names, flat[:n_params]))
        b = dict(zip(buffer_names, flat[n_params : n_params + n_buffers]))
        return _restoring_rnn_weights(model, _reparametrize_module(model, {**p, **b}, tie_weights=True, strict=False))

    def tag_backward(roots: list[torch.Tensor]) -> None:
        _check_constants(model, tracer)
        last = tracer.graph._root.prev
        boundary["last_forward"] = last.name if last is not tracer.graph._root else None
        recorder.in_backward = True
        _tag_backward_with_seq_nr([t.grad_fn for t in roots if t.grad_fn is not None])

    def made_at(value: Any) -> str:
        """`` at model.py:12 (...)``: the user's line of the op that made the first traced tensor in ``value``."""
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                try:
                    line = recorder.sources.get(tracer.node_of(leaf).name)
                except KeyError:
                    continue
                if line is not None:
                    return f" at {line}"
        return ""

    def traced_body(flat: Sequence[torch.Tensor]) -> list[Any]:
        before = _module_state(model)
        with substituted(flat):
            try:
                results = traced_steps(flat)
            except BaseException:  # a failed or interrupted trace leaves no fake tensor on the model
                if isinstance(model, nn.Module):
                    _restore_module_state(model, before, tracer.fake_mode)
                raise
            _check_module_state(model, before, dict(zip(buffer_names, flat[n_params : n_params + n_buffers])),
                                tracer.fake_mode, made_at)
            return results

    def traced_steps(flat: Sequence[torch.Tensor]) -> list[Any]:
        out = call_model(flat)
        if train:
            _check_requires_grad_unchanged(model, flat[n_params + n_buffers : n_params + n_buffers + n_user],
                                           user_leaves, tensor_paths)
        flat_out, out_spec = pytree.tree_flatten(out)
        _check_outputs(model, out, flat_out)
        out_spec_box["spec"] = out_spec
        out_spec_box["differentiable"] = [isinstance(t, torch.Tensor) and t.requires_grad for t in flat_out]
        if not train:
            return list(flat_out)
        # Step 3: run backward inside the trace.
        grad_inputs = [t for t in flat[: n_params] if t.requires_grad]
        grad_inputs += [t for t in flat[n_params + n_buffers : n_params + n_buffers + n_user] if t.requires_grad]
        relaid: set[int] = set()
        # The backward as it runs outside the autocast block of the forward (what torch's automatic
        # mixed precision recipes do): a backward run inside one casts again (see _autocast_in_backward).
        with autocast_off():
            if seed == "sum":
                sum_backward(flat_out, before_backward=tag_backward)
            else:
                diff = [t for t in flat_out if isinstance(t, torch.Tensor) and t.requires_grad]
                tangents = _tangent_placeholders(tracer, diff)
                tag_backward(diff)
                torch.autograd.backward(diff, tangents)
                relaid, dense, together, broadcast = _relaid_by_broadcast_tangents(tracer, tangents, grad_inputs)
                out_spec_box["dense_tangents"] = dense
                out_spec_box["broadcast_together"] = together
                out_spec_box["broadcast"] = broadcast
        _check_constants(model, tracer)  # what the backward alone reads
        # AccumulateGrad copies a gradient that breaks its leaf's layout contract. Make that copy inside
        # the graph, where the plan sees it, so autograd takes ours as it is: where the trace breaks the
        # contract, and where a run breaks it when the tangents arrive as broadcast scalars.
        return list(flat_out) + [_in_layout_of(t.grad, t, always=i in relaid) for i, t in enumerate(grad_inputs)]

    real_flat: list[torch.Tensor] = []
    for name in param_names:
        real_flat.append(params[name].detach().requires_grad_(params[name].requires_grad))
    for name in buffer_names:
        real_flat.append(buffers[name].detach())
    for leaf in user_leaves:
        real_flat.append(leaf.detach().requires_grad_(leaf.requires_grad) if leaf.requires_grad else leaf.detach())

    # Step 4: trace over fake tensors. The cyclic garbage collector is paused: a trace keeps hundreds
    # of thousands of objects alive, and full collections over them made capture superlinear in the
    # graph's size. Tensors are freed by reference counting, which is what the recorder reads.
    # The GraphModule is lazy: its Python code is generated when first run or read, not twice here
    # (once traced, then again after the placeholders are renamed).
    recorder = _Recorder(stop=traced_body.__code__, module_names=_module_names(model))
    target = resolve_target(target_device)
    tracer = Tracer(new_fake_mode(), observer=watching(target, recorder), real_constants=_real_constants)
    recorder.graph = tracer.graph
    TRACING.acquire()  # released below, after the collector's state is put back
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with (
            torch.enable_grad() if train else torch.no_grad(),
            fx_traceback.preserve_node_meta(),
            _use_lazy_graph_module(True),
            # autocast's cache is left on (make_fx turns it off): eager casts a weight once per
            # autocast block and sums the gradient of that copy, and the plan must be that program
            quiet_meta_failures(),  # an op that fails is re-raised below, naming the user's line
            _python_random_refused(),
            _hooks_watched(model),
            tracing_for(target),  # a stand-in trace for CUDA makes CUDA's kernel choices, or refuses
        ):
            flat = tracer.placeholders(real_flat, device=target.trace_device if target is not None else None)
            with tracer:
                # The list the body returns is dropped here, before the output node is made, so a tensor
                # only it held is released after the last op; the inputs (and the gradients they hold)
                # are released after the output node.
                results = tracer.node_args(traced_body(flat))
            tracer.output(results)
            del flat
            gm = tracer.graph_module("captured")
    except CaptureError:
        if not tracer.reals_made:
            raise
        again = True
    except Exception as exc:  # noqa: BLE001 - re-raised as a domain error naming the user's line
        if tracer.reals_made:
            again = True
        elif _raised_by_user_code(exc):
            # the model's own `raise` (a check of its inputs, a hook that raises): eager raises it too, as it is
            exc.add_note(
                "memplan: raised by the model's code while memplan traced it to plan this input signature, over "
                "tensors that have shapes but no values; the call did not run. If the model itself does not raise "
                "here (opt.original(...)), the check reads something a trace changes (a tensor's values, or "
                "type(x) is torch.Tensor): test shapes and dtypes instead, or see memplan's troubleshooting guide."
            )
            raise
        else:
            raise _capture_error(model, exc, tracer.graph, recorder.sources, target) from exc
    else:
        again = False
    finally:
        if gc_was_enabled:
            gc.enable()
        TRACING.release()
    if again:  # with every tensor fake, as make_fx traces (see above)
        return capture(model, *args, train=train, seed=seed, target_device=target_device, _real_constants=False,
                       **kwargs)

    _reshapes_of_broadcast(gm, out_spec_box.get("broadcast", set()))
    autocast_in_backward = _autocast_in_backward(gm, boundary.get("last_forward"), recorder.sources) if train else None
    if train:
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        leaves = {node for node, tensor in zip(placeholders, real_flat) if tensor.requires_grad}
        _autocast_cache_released(gm, boundary.get("last_forward"), leaves, recorder.released_after)
    # Step 5: read what the trace recorded, once.
    captured = _build_captured(
        gm,
        train=train,
        seed=seed,
        param_names=param_names,
        buffer_names=buffer_names,
        leaf_paths=tensor_paths,
        real_flat=real_flat,
        boundary=boundary.get("last_forward"),
        in_spec=in_spec,
        static_inputs=static_inputs,
        out_spec=out_spec_box["spec"],
        n_user=n_user,
        released=recorder.released_after,
        recorded_sources=recorder.sources,
        recorded_library_sources=recorder.library_sources,
        recorded_modules=recorder.modules,
        differentiable=out_spec_box["differentiable"],
        dense_tangents=out_spec_box.get("dense_tangents", set()),
        broadcast_together=out_spec_box.get("broadcast_together", False),
        autocast_in_backward=autocast_in_backward,
    )
    if target is not None and target.stand_in:  # values on the stand-in, for the target (see on_target)
        captured = dataclasses.replace(captured, target_device=target.device)
    _refuse_random_recomputation(captured)
    return captured


def is_compiled(model: Any) -> bool:
    """Whether ``model`` is a module ``torch.compile`` wrapped (its own module is ``model._orig_mod``)."""
    return type(model).__name__ == "OptimizedModule" and type(model).__module__.startswith("torch._dynamo")


def refuse_compiled(model: Any, call: str) -> None:
    """A clear error for a module ``torch.compile`` wrapped, which memplan cannot trace."""
    if is_compiled(model):
        raise CaptureError(
            "memplan traces a model's own code, and torch.compile's wrapper cannot be traced. Fix: pass "
            f"the module itself, {call} (a compiled module keeps it as ._orig_mod); to plan inside "
            'torch.compile, compile with backend="memplan" or memplan.compile.backend(), whose .plans say '
            "what memplan did to each graph."
        )


def on_target(graph: CapturedGraph) -> CapturedGraph:
    """``graph`` with its values on the device it was captured for: where a stand-in trace left them on the
    meta device (:attr:`CapturedGraph.target_device`), every such value and every device argument naming
    the stand-in moves to the target, in place; ``graph`` itself otherwise.

    Passes run on the stand-in graph (their own traces run autograd, which a CPU-only build cannot run
    over CUDA tensors); a plan is moved when it is emitted, an analysis when it is made.
    """
    if graph.target_device is None:
        return graph
    retarget(graph.gm, Target(graph.target_device, torch.device("meta")))
    return dataclasses.replace(graph, target_device=None)


class HookEffectError(RuntimeError):
    """Raised inside a trace when a hook of the user's returns None: it is called for what it does besides
    returning a value (recording, counting, printing), which a plan, running the traced graph, would not
    do again. ``kind`` says which hook, ``hook`` is the function, ``registered`` the user's line that
    registered it (for a tensor hook registered inside the forward)."""

    def __init__(self, kind: str, hook: Any, registered: str | None):
        named = "" if _is_torch_function(hook) else f" {_describe_function(hook)}"  # torch's name says nothing
        super().__init__(f"the {kind}{named} returned None")
        self.kind, self.hook, self.registered = kind, hook, registered


# A module's hook dictionaries that a trace calls (its global and state-dict hooks are not traced).
_MODULE_HOOKS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
                 "_backward_pre_hooks": "full backward pre-hook", "_backward_hooks": "full backward hook"}


def _describe_function(function: Any) -> str:
    """``"<lambda> (model.py:12)"``: a function's name and where it is defined, for messages."""
    function = getattr(function, "func", function)  # a functools.partial
    code = getattr(function, "__code__", None) or getattr(getattr(function, "__call__", None), "__code__", None)
    name = getattr(function, "__qualname__", type(function).__qualname__)
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code is not None else name


def _is_torch_function(function: Any) -> bool:
    function = getattr(function, "func", function)
    module = getattr(function, "__module__", None) or type(function).__module__ or ""
    return module == "torch" or module.startswith("torch.")


@contextlib.contextmanager
def _hooks_watched(model: Any) -> Iterator[None]:
    """While tracing, a hook of the user's that returns None raises :class:`HookEffectError`: the modules'
    forward, forward pre-, and full backward (pre-) hooks, and the tensor hooks the traced code registers
    (``h.register_hook``, ``register_multi_grad_hook``). The trace calls a hook once, over fake tensors:
    what it returns becomes part of the plan (``lambda m, args, out: out * 2`` is planned), but what else
    it does would happen only while planning, never at a later call. torch's own hooks are left alone
    (those that keep state on the module are refused by :func:`_check_module_state`)."""
    tracing = threading.get_ident()

    def watched(kind: str, hook: Any, registered: str | None) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = hook(*args, **kwargs)
            if result is None:
                raise HookEffectError(kind, hook, registered)
            return result
        return call

    swapped = []
    if isinstance(model, nn.Module):
        for path, module in model.named_modules():
            for attribute, kind in _MODULE_HOOKS.items():
                hooks = getattr(module, attribute)
                for key, hook in list(hooks.items()):
                    if not _is_torch_function(hook):
                        swapped.append((hooks, key, hook))
                        owner = f"submodule {path!r}" if path else "the model"
                        hooks[key] = watched(f"{kind} of {owner}", hook, None)
    register_hook = torch.Tensor.register_hook

    def registering(tensor: torch.Tensor, hook: Callable[..., Any]) -> Any:
        if threading.get_ident() == tracing:
            hook = watched("tensor hook", hook, caller_line("registered") or None)
        return register_hook(tensor, hook)

    torch.Tensor.register_hook = registering
    try:
        yield
    finally:
        torch.Tensor.register_hook = register_hook
        for hooks, key, hook in swapped:
            if key in hooks:
                hooks[key] = hook


class PythonRandomError(RuntimeError):
    """Raised inside a trace when the traced code draws from Python's ``random`` module."""


# Python's random draws: a value drawn while tracing would be a constant of the plan, the same at every call
_PYTHON_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
                  "normalvariate", "lognormvariate", "betavariate", "expovariate", "gammavariate", "triangular",
                  "vonmisesvariate", "paretovariate", "weibullvariate", "getrandbits")


@contextlib.contextmanager
def _python_random_refused() -> Iterator[None]:
    """While this thread traces, a draw from Python's ``random`` module raises :class:`PythonRandomError`
    (a plan would hold the value drawn at capture and give it at every call, where eager draws anew)."""
    import random
    import threading

    tracing = threading.get_ident()
    originals = {name: getattr(random, name) for name in _PYTHON_RANDOM if hasattr(random, name)}

    def refusing(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def draw(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == tracing:
                raise PythonRandomError(f"random.{name}() called in the traced code")
            return function(*args, **kwargs)
        return draw

    for name, function in originals.items():
        setattr(random, name, refusing(name, function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(random, name, function)


def _refuse_random_recomputation(graph: "CapturedGraph") -> None:
    """A random op the backward runs is a recomputation of the forward's (``torch.utils.checkpoint``
    runs the checkpointed function again): eager replays the forward's random state for it, which the
    trace does not record, so a plan would draw a new dropout mask where eager draws the old one, and
    compute other gradients. Refused, naming the op and the user's line."""
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and graph.phases.get(node.name) is Phase.BACKWARD and is_random(node):
            raise CaptureError(
                f"{graph.describe(node.name)} runs again in the backward, a recomputation such as "
                "torch.utils.checkpoint's: eager replays the forward's random state there, which memplan "
                "cannot, so the plan would draw another mask and give other gradients. Fix: call the "
                "checkpointed function directly (memplan's remat and timesteps passes choose what to "
                "recompute, and never draw a random op again), or optimize(model, fallback='eager')."
            )


# What a frame of the traced code is, per code object (see _Recorder._where).
_OTHER_FRAME, _USER_FRAME, _TORCH_FRAME, _MODULE_CALL_FRAME = range(4)
# ``nn.Module.__call__``: its frame's ``self`` is the module being called, through its forward and its hooks.
_MODULE_CALL = nn.Module._wrapped_call_impl.__code__


def _frame_kind(code: Any) -> int:
    """Which of the kinds above a frame running ``code`` is."""
    if code is _MODULE_CALL:
        return _MODULE_CALL_FRAME
    if is_user_frame(code.co_filename):
        return _USER_FRAME
    if _public_torch_path(code.co_filename) is not None:
        return _TORCH_FRAME
    return _OTHER_FRAME


def _module_names(model: Any) -> dict[int, str]:
    """``id(module) -> qualified name`` of every module of ``model`` (``""`` for itself), the first name of a
    module registered twice; empty for a function."""
    if not isinstance(model, nn.Module):
        return {}
    return {id(module): name for name, module in model.named_modules()}


class _Recorder:
    """Watches the trace: where each forward op ran, and when Python releases each storage.

    Called by the tracer after each op the traced code runs. Release: the fake trace runs the user's
    Python exactly as eager would, so a traced tensor object dies when the eager one would: when its
    variable is rebound or goes out of scope, or when autograd releases it. That is when eager frees
    memory, which graph liveness alone cannot see. Storages are keyed by their address
    (``_storage_key``), as ``StorageWeakRef`` compares them; the graph's fake values keep every traced
    storage alive, so its address is not reused while the trace runs.

    Where an op ran, from one walk of the frames below ``stop`` (the traced body), innermost first, much
    cheaper than formatting a whole stack per node (backward nodes get theirs by ``seq_nr``): the user's
    line (the innermost user frame), the line of torch's beneath it (the innermost frame of a public torch
    module, ``nn/modules/linear.py``), and the innermost module of the model being called. A module is
    read from the frame of ``nn.Module.__call__`` (``self``), which runs its forward and its hooks; its
    locals are the module and the call's arguments, never rebound, so reading them (``f_locals`` keeps a
    copy of a frame's locals until the frame ends) keeps nothing alive longer. A user frame's ``self`` is
    never read: its copy would hold a tensor its variable was rebound from, and delay the release
    recorded above. The kind of a frame is cached per code object, and each line's :class:`SourceLine`
    per code object and line number, so an unrolled loop pays a few dictionary lookups per frame.
    """

    def __init__(self, stop: Any, module_names: Mapping[int, str] | None = None):
        self.graph: torch.fx.Graph | None = None
        self.stop = stop
        self.alive: dict[int, int] = {}
        self.released_after: dict[int, str] = {}
        self.sources: dict[str, SourceLine] = {}
        self.library_sources: dict[str, SourceLine] = {}
        self.modules: dict[str, str] = {}
        self.in_backward = False
        self._module_names = module_names or {}
        self._kinds: dict[Any, int] = {}
        self._lines: dict[tuple[Any, int], SourceLine] = {}
        self._watches: dict[int, weakref.ref] = {}

    def _line(self, frame: Any) -> SourceLine:
        code, lineno = frame.f_code, frame.f_lineno
        line = self._lines.get((code, lineno))
        if line is None:
            text = linecache.getline(code.co_filename, lineno).strip()
            line = self._lines[(code, lineno)] = SourceLine(code.co_filename, lineno, code.co_name, text)
        return line

    def _where(self) -> tuple[SourceLine | None, SourceLine | None, str | None]:
        """``(user line, torch line beneath it, module path)`` of the op being traced (each None if none)."""
        frame = sys._getframe(2)
        user = torch_line = module = None
        find_module = bool(self._module_names)
        kinds = self._kinds
        while frame is not None:
            code = frame.f_code
            if code is self.stop:
                break
            kind = kinds.get(code)
            if kind is None:
                kind = kinds[code] = _frame_kind(code)
            if kind == _USER_FRAME:
                if user is None:
                    user = self._line(frame)
                    if module is not None or not find_module:
                        break
            elif kind == _MODULE_CALL_FRAME:
                if find_module:
                    name = self._module_names.get(id(frame.f_locals.get("self")))
                    if name is not None:
                        module, find_module = name, False
                        if user is not None:
                            break
            elif kind == _TORCH_FRAME and user is None and torch_line is None:
                torch_line = self._line(frame)
            frame = frame.f_back
        return user, torch_line, module

    def __call__(self, last: torch.fx.Node, out: Any) -> None:
        root = self.graph._root
        if not self.in_backward and root.prev is not last:
            user, torch_line, module = self._where()
            node = last.next
            while node is not root:
                name = node.name
                if user is not None:
                    self.sources[name] = user
                if torch_line is not None:
                    self.library_sources[name] = torch_line
                if module is not None:
                    self.modules[name] = module
                node = node.next
        self._watch_all(out)

    def _watch_all(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self._watch(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._watch_all(item)

    def _watch(self, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        self.alive[key] = self.alive.get(key, 0) + 1
        watch = weakref.ref(tensor, functools.partial(self._release, key))
        self._watches[id(watch)] = watch

    def _release(self, key: int, watch: weakref.ref) -> None:
        del self._watches[id(watch)]
        self.alive[key] -= 1
        root = self.graph._root
        if self.alive[key] == 0 and root.prev is not root:
            self.released_after[key] = root.prev.name




def _storage_key(tensor: torch.Tensor) -> int:
    """The address of a tensor's storage: equal for all tensors that alias it."""
    return tensor.untyped_storage()._cdata


def _tag_backward_with_seq_nr(roots: list[Any]) -> None:
    """Hook every autograd node reachable from ``roots`` so the backward ops it traces carry its ``seq_nr``."""
    seen: set[Any] = set()
    stack = list(roots)
    while stack:
        grad_fn = stack.pop()
        if grad_fn is None or grad_fn in seen:
            continue
        seen.add(grad_fn)
        seq = grad_fn._sequence_nr()

        def prehook(grad_outputs: Any, seq: int = seq) -> None:
            fx_traceback.set_grad_fn_seq_nr(seq)

        def posthook(grad_inputs: Any, grad_outputs: Any) -> None:
            fx_traceback.reset_grad_fn_seq_nr()

        grad_fn.register_prehook(prehook)
        grad_fn.register_hook(posthook)
        stack.extend(fn for fn, _ in grad_fn.next_functions if fn is not None)


def _in_layout_of(grad: torch.Tensor | None, leaf: torch.Tensor, *, always: bool = False) -> torch.Tensor | None:
    """``grad`` as autograd stores it for ``leaf``: itself when it keeps the leaf's layout contract, else a copy
    in the leaf's strides (contiguous for a leaf that is not dense), as AccumulateGrad would make.

    ``always`` copies even a gradient that keeps the contract in the trace (it may break it in a run).
    """
    if grad is None or (not always and _keeps_layout_contract(grad, leaf)):
        return grad
    if not _is_dense(leaf):
        return grad.clone(memory_format=torch.contiguous_format)
    return torch.empty_strided(leaf.shape, leaf.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)


def _keeps_layout_contract(grad: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Whether AccumulateGrad keeps ``grad`` as ``leaf``'s gradient as it is, instead of copying it.

    A dense leaf's gradient must have its strides, except in dimensions of size one (where a stride of
    zero still makes it a view); any other leaf's gradient must be contiguous.
    """
    if not _is_dense(leaf):
        return grad.is_contiguous()
    for size, stride, leaf_stride in zip(grad.shape, grad.stride(), leaf.stride()):
        if (size != 1 and stride != leaf_stride) or (size == 1 and stride == 0):
            return False
    return True


def _is_dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill a contiguous span, in some order of the dimensions."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _relaid_by_broadcast_tangents(tracer: Tracer, tangents: list[torch.Tensor], leaves: list[torch.Tensor]
                                   ) -> tuple[set[int], set[int], bool, set[str]]:
    """What changes when the tangents arrive as ``out.sum()`` sends them, broadcast scalars (all strides zero),
    rather than dense, as traced. :func:`memplan.emit.PlanFunction` passes a broadcast tangent on as it is,
    since it costs nothing, and kernels lay out their outputs after their inputs' strides, so the values
    computed from it may come out in other strides. They are found by re-running over fake values the
    backward ops whose inputs change strides (:func:`_restrided_values`).

    Returns
    -------
    relaid
        Positions of the ``leaves`` whose gradient keeps the leaf's layout contract in the trace but breaks
        it when the tangents arrive broadcast. Capture makes AccumulateGrad's copy of those in the graph, so
        the plan counts it. Where only some tangents arrive broadcast (a loss that sums one output and
        reads another densely) a gradient may break the contract too; AccumulateGrad copies it then, as
        it does in eager, outside the plan's count.
    dense
        Positions of the tangents that cannot arrive broadcast alone: some backward op refuses the layout
        (``view_as_complex``, the backward of a ``view_as_real`` output, needs unit stride, which eager's
        backward makes with a ``contiguous`` the trace recorded as a no-op). Those are made dense before
        the backward runs.
    together
        Whether the ``dense`` tangents may stay broadcast when every tangent arrives broadcast (what
        ``sum(out.sum())`` sends): an op may refuse one broadcast tangent beside a dense one and take all
        of them broadcast. Counterexample: ``y`` and ``y.transpose(1, 2)`` returned, their tangents added
        and viewed; beside a dense tangent the sum is laid out transposed and cannot be viewed.
    broadcast
        Names of the nodes whose value is itself a broadcast scalar (all strides zero where the size is not
        one) when the tangents arrive as ``sum(out.sum())`` sends them: a tangent and its views. See
        :func:`_reshapes_of_broadcast`.
    """
    graph = tracer.graph
    tangent_nodes = [tracer.node_of(t) for t in tangents]
    grad_nodes = {i: tracer.node_of(leaf.grad) for i, leaf in enumerate(leaves) if leaf.grad is not None}
    scenarios, dense = [], set()
    for j, node in enumerate(tangent_nodes):
        values = _restrided_values(tracer, [node])
        if values is None:
            dense.add(j)
        else:
            scenarios.append(values)
    # What sum(out.sum()) sends: every tangent broadcast, but for those that must arrive dense.
    modeled: dict[torch.fx.Node, Any] = {}
    for values in scenarios:
        modeled.update(values)
    broadcastable = [node for j, node in enumerate(tangent_nodes) if j not in dense]
    if len(broadcastable) > 1 and _meet(graph, scenarios):
        values = _restrided_values(tracer, broadcastable)
        if values is None:  # each alone passes, not all at once: every one of them arrives dense
            dense.update(range(len(tangent_nodes)))
            values = {}
        modeled = values
    together = False
    if dense and len(tangent_nodes) > 1:
        values = _restrided_values(tracer, tangent_nodes)
        if values is not None:
            together = True
            modeled = values
    relaid = {i for i, node in grad_nodes.items()
              if node in modeled and not _keeps_layout_contract(modeled[node], leaves[i])}
    broadcast = {node.name for node, value in modeled.items() if _is_broadcast_value(value)}
    return relaid, dense, together, broadcast


def _meet(graph: torch.fx.Graph, scenarios: list[dict[torch.fx.Node, Any]]) -> bool:
    """Whether some op reads values changed in two scenarios (if none does, broadcasting several tangents
    at once changes each value as broadcasting one of them alone does)."""
    changed_in: dict[torch.fx.Node, set[int]] = {}
    for i, values in enumerate(scenarios):
        for node in values:
            changed_in.setdefault(node, set()).add(i)
    for node in graph.nodes:
        reads: set[int] = set()
        for arg in node.all_input_nodes:
            reads |= changed_in.get(arg, set())
        if len(reads) > 1:
            return True
    return False


# The devices whose autocast capture follows (and the plan's code runs without: see memplan.emit).
AUTOCAST_KINDS = ("cpu", "cuda")


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Every enabled autocast (of :data:`AUTOCAST_KINDS`) turned off for the block, as outside a
    ``with torch.autocast(...)``: capture's backward, and a plan's code (see :mod:`memplan.emit`)."""
    with contextlib.ExitStack() as stack:
        for kind in AUTOCAST_KINDS:
            if torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def _autocast_cache_released(gm: torch.fx.GraphModule, boundary: str | None, leaves: AbstractSet[torch.fx.Node],
                             released: dict[int, str]) -> None:
    """Record that the casts autocast's cache holds (of the placeholders in ``leaves``, those that require grad)
    are let go when the forward ends (into ``released``, keyed by storage as the recorder keys it).

    Autocast casts a parameter (a leaf that requires grad) once per ``with torch.autocast(...)`` block and
    keeps the copy in a cache until the outermost block ends. Capture traces the backward as it runs after
    the block, torch's recipe, where the cache has been cleared and a cast lives on only if autograd saved
    it; but the trace runs inside the caller's block, whose cache still holds the casts, so the recorder saw
    none of them released: ``analyze()`` counted every cast weight through the backward (5-13% above eager's
    measured peak on the library zoo). Casts released inside the trace (a block the model opens itself)
    keep their recorded release.

    A cast autograd saved lives on until the backward of the node that saved it has run: the engine lets a
    node's saved tensors go when its backward function returns, after the last op it ran (a linear layer's
    cast weight outlives the matrix product that reads it, while the same node computes the weight's and
    the bias's gradients). It is released there, as the recorder sees any other saved tensor released.
    """
    if boundary is None or not torch.is_autocast_cache_enabled():
        return
    dtypes = {kind: torch.get_autocast_dtype(kind) for kind in AUTOCAST_KINDS if torch.is_autocast_enabled(kind)}
    if not dtypes:
        return
    casts: set[int] = set()
    for node in gm.graph.nodes:
        if node.name == boundary:
            break
        if node.target is not torch.ops.aten._to_copy.default or not isinstance(node.args[0], torch.fx.Node):
            continue
        value = node.meta.get("val")
        if node.args[0] in leaves and isinstance(value, torch.Tensor) and dtypes.get(value.device.type) == value.dtype:
            key = _storage_key(value)
            if key not in released:
                casts.add(key)
    if not casts:
        return
    # the backward's last op of each autograd node (by sequence number), and the nodes that read each cast
    nodes = list(gm.graph.nodes)
    start = next(i for i, node in enumerate(nodes) if node.name == boundary) + 1
    last_of: dict[int, int] = {}  # sequence number -> position of its last op
    readers: dict[int, set[int]] = {}
    for i in range(start, len(nodes)):
        node = nodes[i]
        seq = node.meta.get("seq_nr")
        if seq is None or node.op != "call_function":
            continue
        last_of[seq] = i
        for arg in node.all_input_nodes:
            value = arg.meta.get("val")
            if isinstance(value, torch.Tensor) and _storage_key(value) in casts:
                readers.setdefault(_storage_key(value), set()).add(seq)
    for key in casts:
        ends = [last_of[seq] for seq in readers.get(key, ())]
        released[key] = nodes[max(ends)].name if ends else boundary


def _autocast_in_backward(gm: torch.fx.GraphModule, boundary: str | None,
                          sources: Mapping[str, SourceLine]) -> str | None:
    """The first backward op that autocast, as enabled now, would cast, named with the user's line; None
    when autocast is off or casts none of them.

    Capture traces the backward outside the forward's autocast block, as torch's mixed precision recipes
    run it (``loss.backward()`` after the ``with`` block). A backward called inside the block runs under
    autocast, which casts the inputs of the operators on its lists again: the float32 matmuls of the
    math path of ``scaled_dot_product_attention``'s backward run in bfloat16 then, and the gradients
    differ from the traced program's. Each distinct operator and input dtypes is tried once on fake
    values under the autocast of now; if its result's dtype changes, the plan's backward cannot be
    eager's there, and :class:`memplan.emit.PlanFunction` refuses such a call with this op named.
    """
    casting = [(kind, torch.get_autocast_dtype(kind)) for kind in AUTOCAST_KINDS if torch.is_autocast_enabled(kind)]
    if not casting:
        return None
    tried: set[tuple] = set()
    in_backward = boundary is None
    forward_lines: dict[int, SourceLine] = {}
    for node in gm.graph.nodes:
        if not in_backward:
            if node.name in sources and isinstance(node.meta.get("seq_nr"), int):
                forward_lines.setdefault(node.meta["seq_nr"], sources[node.name])
            in_backward = node.name == boundary
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or mutated_args(node):
            continue  # an op that writes is not run again: it would write into the trace's own values
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val"))
        dtypes = tuple(leaf.dtype if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                       for leaf in pytree.tree_leaves((args, kwargs)))
        key = (node.target, dtypes)
        if key in tried:
            continue
        tried.add(key)
        expected = [leaf.dtype for leaf in pytree.tree_leaves(node.meta.get("val")) if isinstance(leaf, torch.Tensor)]
        try:
            with contextlib.ExitStack() as stack:
                for kind, dtype in casting:
                    stack.enter_context(torch.autocast(kind, dtype=dtype))
                value = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - an op the fake mode cannot run again on its own: not judged
            continue
        if [leaf.dtype for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)] != expected:
            line = forward_lines.get(node.meta.get("seq_nr", -1))
            name = node.target.__name__.split(".")[0]
            return f"{name} at {line}" if line is not None else name
    return None


def _is_reshape_copy(node: torch.fx.Node) -> bool:
    """Whether ``node`` is the copy of a ``reshape`` that could not view its input in the trace: a ``clone``
    to the contiguous format whose one reader is ``_unsafe_view`` (how ``reshape`` decomposes when it copies)."""
    if node.target is not torch.ops.aten.clone.default or node.kwargs.get("memory_format") is not torch.contiguous_format:
        return False
    users = list(node.users)
    return (isinstance(node.args[0], torch.fx.Node) and len(users) == 1
            and users[0].target is torch.ops.aten._unsafe_view.default)


def _is_broadcast_value(value: Any) -> bool:
    """Whether ``value`` is a tensor whose every stride is zero where its size is not one (a broadcast
    scalar, or a view of one): any shape views it."""
    return isinstance(value, torch.Tensor) and all(stride == 0 or size == 1 for size, stride in zip(value.shape, value.stride()))


def _reshapes_of_broadcast(gm: torch.fx.GraphModule, broadcast: AbstractSet[str]) -> None:
    """Make the copies autograd's ``reshape`` recorded of a dense tangent's broadcast into ``reshape`` again.

    ``reshape`` views its input where the strides allow and copies it where they do not; the trace,
    over a dense tangent, recorded the copy (``clone`` then ``_unsafe_view``). Eager's ``out.sum()``
    sends a broadcast scalar, which any shape views: ``x.unflatten(-1, (2, k)).sum(-1)`` returned as it
    is, whose backward reshapes the expanded gradient, copies a whole gradient in the trace and nothing
    in eager. Where the copied value is a broadcast scalar when the tangents arrive broadcast (names in
    ``broadcast``), the pair becomes one ``aten.reshape``, which copies only where the run's strides
    ask for it, as eager's does. Its fake value is a broadcast view of its input: the memory it is
    counted for is what it costs when the tangents arrive as ``sum(out.sum())`` sends them, the step
    memplan's predictions are made for (see :func:`memplan.analysis.peak.step_margin`). As any view,
    passes never write into it, nor into its input while it lives.
    """
    if not broadcast:
        return
    changed = False
    for node in list(gm.graph.nodes):
        if not _is_reshape_copy(node) or node.args[0].name not in broadcast:
            continue
        source = node.args[0]
        view, value = next(iter(node.users)), source.meta.get("val")
        shape = view.meta.get("val").shape
        view.target = torch.ops.aten.reshape.default
        view.args = (source, view.args[1])
        view.meta["val"] = value.as_strided(shape, [0] * len(shape), value.storage_offset())
        gm.graph.erase_node(node)
        view._rename("reshape")
        changed = True
        # the views of the copy viewed its storage: they view the broadcast one now
        queue = [view]
        while queue:
            for user in queue.pop().users:
                if is_view_op(user.target) or user.target is operator.getitem:
                    args, kwargs = torch.fx.node.map_arg((user.args, user.kwargs), lambda arg: arg.meta.get("val"))
                    user.meta["val"] = user.target(*args, **kwargs)
                    queue.append(user)
    if changed:
        gm.recompile()


def _restrided_values(tracer: Tracer, broadcast: list[torch.fx.Node]) -> dict[torch.fx.Node, Any] | None:
    """Fake values of the nodes whose strides change when the ``broadcast`` placeholders are broadcast scalars,
    or None when an op refuses the changed layout.

    Each op reading a changed value runs again on fake values (from the tracer's cache of the layouts it
    has seen); its result is kept only if its strides differ from the trace's. An op that writes into an
    unchanged input is not run again: it would write into the trace's own value, and its result (that
    input) keeps its strides.
    """
    changed: dict[torch.fx.Node, Any] = {}
    with tracer.paused():
        for node in broadcast:
            value = node.meta["val"]
            changed[node] = torch.zeros((), dtype=value.dtype, device=value.device).expand(value.shape)
    # The ops reading a changed value, in graph order: the readers of each changed value are queued by
    # their position, so only they are visited, not the whole graph (once per scenario).
    position = {node: i for i, node in enumerate(tracer.graph.nodes)}
    queue: list[tuple[int, torch.fx.Node]] = []
    queued: set[torch.fx.Node] = set()

    def queue_readers(value: torch.fx.Node) -> None:
        for user in value.users:
            if user.op == "call_function" and user not in queued:
                queued.add(user)
                heapq.heappush(queue, (position[user], user))

    for node in broadcast:
        queue_readers(node)
    while queue:
        _, node = heapq.heappop(queue)
        if any(arg not in changed for arg in mutated_args(node)):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: changed.get(arg, arg.meta.get("val")))
        if _is_reshape_copy(node) and _is_broadcast_value(args[0]):
            # the reshape views a broadcast value (see _reshapes_of_broadcast): its "copy" is the value itself,
            # and what reads it sees a broadcast layout (a leaf's gradient made of it breaks its contract)
            changed[node] = args[0]
            queue_readers(node)
            continue
        try:
            value = tracer.evaluate(node.target, args, kwargs)
        except (RuntimeError, ValueError):
            # the op refuses this layout: view_as_complex needs unit stride; a view that autograd's
            # reshape made of a dense gradient cannot view the strides a broadcast tangent gives (the
            # reference implementations raise ValueError)
            return None
        if _layout(value) != _layout(node.meta.get("val")):
            changed[node] = value
            queue_readers(node)
    return changed


def _layout(value: Any) -> Any:
    """Strides and offsets of the tensors in a node's value (nested like the value)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.stride()), value.storage_offset()
    if isinstance(value, (tuple, list)):
        return tuple(_layout(item) for item in value)
    return None


@contextlib.contextmanager
def _restoring_rnn_weights(model: nn.Module, substitution: contextlib.AbstractContextManager) -> Iterator[None]:
    """``substitution``, after which every recurrent module (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) lists its
    own weights again. Such a module keeps a list of its weights (``_flat_weights``), which swapping
    the traced ones in fills and swapping its own back does not refill: it would keep the trace's fake
    tensors alive with the module, and the next capture would start from them."""
    try:
        with substitution:
            yield
    finally:
        for module in model.modules():
            names = getattr(module, "_flat_weights_names", None)
            if isinstance(module, nn.RNNBase) and names is not None:
                module._flat_weights = [getattr(module, name, None) for name in names]


# What nn.Module keeps in its own attributes (and what an RNN lists of its weights): never the user's state.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"_flat_weights"}


def _module_state(model: Any) -> list[tuple[nn.Module, str, Any, Any]]:
    """``(module, attribute, value, copy of a list or dict value)`` for every plain attribute of every
    module of ``model``: what :func:`_check_module_state` restores when the traced forward changed it."""
    if not isinstance(model, nn.Module):
        return []
    state = []
    for module in model.modules():
        for name, value in vars(module).items():
            if name not in _MODULE_INTERNALS:
                copy = list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else None
                state.append((module, name, value, copy))
    return state


def _holds_fake(value: Any, mode: Any) -> bool:
    if isinstance(value, (list, tuple, dict)):
        return any(_holds_fake(v, mode) for v in (value.values() if isinstance(value, dict) else value))
    return isinstance(value, FakeTensor) and value.fake_mode is mode


def _restore_module_state(model: nn.Module, before: list[tuple[nn.Module, str, Any, Any]],
                          mode: Any) -> tuple[dict[str, Any], Any]:
    """Put back every attribute of ``model``'s modules that the trace left holding one of its fake tensors
    (``before`` is :func:`_module_state`'s record): as it was, or deleted when it is new. Also run when
    the trace fails or is interrupted, so a model is never left holding fake tensors. Returns those
    attributes' paths and the values the trace left, and ``(path, hook)`` for the first set by a torch
    forward pre-hook (or None)."""
    known = {(id(module), attribute): (value, copy) for module, attribute, value, copy in before}
    kept: dict[str, Any] = {}
    hooked = None  # (attribute's path, torch's forward pre-hook of its module) of the first kept one
    for path, module in model.named_modules():
        for attribute, value in list(vars(module).items()):
            if attribute not in _MODULE_INTERNALS and _holds_fake(value, mode):
                where = f"{path}.{attribute}" if path else attribute
                kept[where] = value
                torch_hooks = [h for h in module._forward_pre_hooks.values()
                               if getattr(type(h), "__module__", "").startswith("torch.")]
                if torch_hooks and hooked is None:
                    hooked = (where, torch_hooks[0])
                old = known.get((id(module), attribute))
                if old is None:
                    delattr(module, attribute)
                elif old[1] is not None and old[0] is value:  # the same list or dict, changed in place
                    value.clear()
                    if isinstance(value, dict):
                        value.update(old[1])
                    else:
                        value.extend(old[1])
                else:
                    setattr(module, attribute, old[0])
    return kept, hooked


def _check_module_state(model: Any, before: list[tuple[nn.Module, str, Any, Any]],
                        buffers: Mapping[str, torch.Tensor], mode: Any,
                        made_at: Callable[[Any], str] = lambda value: "") -> None:
    """Refuse a forward that keeps state on the module by Python assignment: a buffer given a new tensor
    (``self.count = self.count + 1``), or a tensor of the forward stored in an attribute (``self.last =
    h``, ``self.history.append(y)``). A plan runs the graph, not the module's Python, so such state would
    never change again (and would hold the trace's fake tensors); with no error, outputs that read it
    would silently differ from eager's. The attributes the trace changed are put back first. ``made_at``
    gives the user's line of the op that made a traced value (`` at model.py:12 (...)``, or "")."""
    if not isinstance(model, nn.Module):
        return
    name = type(model).__name__
    # Step 1: put back what the trace changed (a reassigned buffer is put back by the substitution).
    kept, hooked = _restore_module_state(model, before, mode)
    # Step 2: refuse.
    for path, installed in buffers.items():
        prefix, _, attribute = path.rpartition(".")
        owner = model.get_submodule(prefix) if prefix else model
        if owner._buffers.get(attribute) is not installed:
            raise CaptureError(
                f"{name} assigns a new tensor to its buffer '{path}' in forward"
                f"{made_at(owner._buffers.get(attribute))} "
                f"(e.g. `self.{attribute} = self.{attribute} + 1`). A plan runs the traced graph, not the module's "
                "Python, so the buffer would keep its old value and outputs reading it would differ from eager's. "
                f"Fix: update it in place (self.{attribute}.add_(1), or self.{attribute}.copy_(new_value)), which "
                "memplan plans; "
                'or pass fallback="eager" to memplan.optimize to run this model eagerly.'
            )
    if hooked is not None:
        path, hook = hooked
        api = type(hook).__module__.rpartition(".")[2]  # weight_norm, spectral_norm
        replacement = (f"use torch.nn.utils.parametrizations.{api} instead, which memplan plans (the same "
                       "reparametrization, done as a parametrization); or "
                       if api in ("weight_norm", "spectral_norm") else "")
        raise CaptureError(
            f"{name}: attribute '{path}' is set on every call by torch's forward pre-hook {type(hook).__name__} "
            f"(torch.nn.utils.{api}, the hook-based API). A plan runs the traced graph, not the hooks' Python, "
            f"so that attribute would never be set again. Fix: {replacement}pass fallback=\"eager\" to "
            "memplan.optimize to run this model eagerly."
        )
    if kept:
        path, value = next(iter(kept.items()))
        raise CaptureError(
            f"{name} keeps a tensor its forward computed on the module (attribute '{path}'{made_at(value)}). A "
            "plan runs the traced graph, not the module's Python, so that attribute would never be set again. "
            "Fix: return the tensor as an output, or keep it in a buffer updated in place "
            f"(self.register_buffer(...), then .copy_(value.detach())), which memplan plans; "
            'or pass fallback="eager" to memplan.optimize to run this model eagerly.'
        )


def _check_constants(model: Any, tracer: Any) -> None:
    """Tensors a plain function closes over become constants; in training that would drop their gradients,
    and a plan would keep their values of the first call.

    Runs before backward is traced, so the user's real tensors never see a fake ``.grad``, and again
    after it, for the tensors only the backward reads (a custom ``autograd.Function`` whose backward
    closes over one).
    """
    for node in tracer.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(tracer.root, str(node.target), None)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            user = next(iter(node.users), None)
            name = getattr(model, "__qualname__", type(model).__name__)
            raise CaptureError(
                f"{name} uses a tensor that requires grad but is neither an argument nor a parameter of an "
                f"nn.Module (shape {tuple(value.shape)}, first used by {user.format_node() if user else 'nothing'}); "
                "memplan would treat it as a constant and lose its gradient. "
                "Fix: make the callable an nn.Module that owns it as a parameter, or pass it as an argument."
            )


def _tangent_placeholders(tracer: Tracer, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """New graph inputs, one per differentiable output: the (dense) gradient flowing into it.

    Added while tracing, once the forward has produced the outputs, so their shapes need no separate
    forward. They go after the other placeholders, with their autograd sequence number (the counter
    before the trace, which no op has), and their fake values are zeros made outside the graph, like
    the fake values of the other inputs.
    """
    with tracer.paused():
        values = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in outputs]
    first = next(iter(tracer.graph.nodes), None)
    input_seq_nr = first.meta.get("seq_nr") if first is not None and first.op == "placeholder" else None
    for value in values:
        tracer.add_placeholder(value, "tangent", input_seq_nr)
    return values


# autograd's error when a value saved for the backward was written in place after it was saved
_CLOBBERED = re.compile(r"modified by an inplace operation: \[\S+ \[([\d, ]*)\]\], which is output \d+ of (\w+), "
                        r"is at version (\d+); expected version (\d+)")


def _op_at(node: torch.fx.Node, sources: Mapping[str, SourceLine]) -> str:
    """The op of ``node`` and the user's line that called it, when the trace recorded one."""
    line = sources.get(node.name)
    return f"`{_op_name(node)}` at {line}" if line is not None else f"`{_op_name(node)}`"


def _clobber_message(name: str, exc: BaseException, graph: torch.fx.Graph | None,
                     sources: Mapping[str, SourceLine]) -> str | None:
    """For autograd's "modified by an inplace operation" error: which op of the traced forward saved the
    value and which in-place ops wrote into it afterwards, with the user's lines (None when the trace
    does not say). The saver is the op autograd names (``ReluBackward0``: ``relu``/``relu_``) whose
    result has the reported shape and whose storage later ops write in place."""
    found = _CLOBBERED.search(str(exc))
    if found is None or graph is None:
        return None
    shape = tuple(int(s) for s in found.group(1).split(",") if s.strip())
    op = re.sub(r"Backward\d*$", "", found.group(2)).lower()
    writes = int(found.group(3)) - int(found.group(4))
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    for i, node in enumerate(nodes):
        value = node.meta.get("val")
        if _op_name(node).rstrip("_").replace("_", "") != op or not isinstance(value, torch.Tensor) \
                or tuple(value.shape) != shape:
            continue
        storage = _storage_key(value)
        writers = [w for w in nodes[i + 1:] if any(
            isinstance(t.meta.get("val"), torch.Tensor) and _storage_key(t.meta["val"]) == storage
            for t in mutated_args(w))]
        if not writers:
            continue
        writers = writers[:max(writes, 1)]
        first = _op_name(writers[0])
        if first in _ASSIGNMENTS:
            fix = "assign into a clone of the value (y = y.clone() before the assignment)"
        else:
            fix = (f"use the out-of-place `{first.rstrip('_')}` there instead of `{first}` "
                   f"(y = y.{first.rstrip('_')}(...)), or write into a clone of the value")
        written_by = ", ".join(_op_at(w, sources) for w in writers)
        return (
            f"memplan cannot capture {name}: {_op_at(node, sources)} keeps its result for the backward, and "
            f"{written_by} then {'writes' if len(writers) == 1 else 'write'} into it in place, so its gradient "
            f"cannot be computed (eager's backward fails the same way). Fix: {fix}."
        )
    return _clobbered_input_message(name, op, shape, nodes, sources)


def _clobbered_input_message(name: str, op: str, shape: tuple[int, ...], nodes: list[torch.fx.Node],
                             sources: Mapping[str, SourceLine]) -> str | None:
    """The other case of :func:`_clobber_message`: the op autograd names is the in-place write itself
    (the written tensor's history now ends in it), and the value was saved by an op that read it
    before (``g = gelu(h); h += 1``: gelu keeps its input). Names the write and the ops that read the
    value before it, with the user's lines."""
    for i, node in enumerate(nodes):
        written = mutated_args(node)
        if not written or _op_name(node).rstrip("_").replace("_", "") != op:
            continue
        value = written[0].meta.get("val")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            continue
        storage = _storage_key(value)
        readers = [r for r in nodes[:i] if not mutated_args(r) and not is_view_op(r.target) and any(
            isinstance(a.meta.get("val"), torch.Tensor) and _storage_key(a.meta["val"]) == storage
            for a in r.all_input_nodes)]
        if not readers:
            continue
        write = _op_name(node)
        readers = readers[-2:]
        read_by = " and ".join(_op_at(r, sources) for r in readers)
        return (
            f"memplan cannot capture {name}: {_op_at(node, sources)} writes in place into a value that "
            f"{read_by} read before, and autograd keeps that value for the backward, so its gradient "
            f"cannot be computed (eager's backward fails the same way). Fix: use "
            f"the out-of-place `{write.rstrip('_')}` there instead of `{write}` (y = y.{write.rstrip('_')}(...)), "
            "or write into a clone of the value."
        )
    return None


def _raised_by_user_code(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by a ``raise`` statement (or an ``assert``) in the user's code: its
    innermost frame is the user's and stopped at a raise instruction (not at a call of torch's C code,
    ``.numpy()`` on a fake tensor), and it is none of the errors a trace makes."""
    import dis

    tb = exc.__traceback__
    made_by_a_trace = (PythonRandomError, HookEffectError, GeneratorArgumentError, NotDenseError, TargetError)
    if tb is None or isinstance(exc, made_by_a_trace):
        return False
    if type(exc).__module__.startswith("torch."):  # a trace's own (a branch on a value), raised on the user's line
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if not is_user_frame(code.co_filename) or not 0 <= tb.tb_lasti < len(code.co_code):
        return False
    return dis.opname[code.co_code[tb.tb_lasti]] in ("RAISE_VARARGS", "RERAISE")


def _in_torch_function(frames: traceback.StackSummary, function: str) -> bool:
    """Whether a frame of torch's own ``function`` (``pack_padded_sequence``) is on the failing stack."""
    return any(frame.name == function and frame.filename.startswith(_TORCH_DIR + os.sep) for frame in frames)


def _capture_error(model: Any, exc: BaseException, graph: torch.fx.Graph | None = None,
                   sources: Mapping[str, SourceLine] | None = None, target: Target | None = None) -> CaptureError:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    frames = traceback.extract_tb(exc.__traceback__)
    where = _user_line_from_traceback(frames)
    name = _model_name(model)
    at = f" at {where.filename}:{where.lineno} in {where.function}: `{where.code}`" if where else ""
    inner = _library_line_from_traceback(frames)
    if inner is not None:
        library = f"in torch's {inner.filename}:{inner.lineno}: `{inner.code}`"
        at += f" ({library})" if where else f" {library}"
    # where the trace's frames hold no line of the user's (the model is torch's own), the line that called it
    at_call = at if where else at + caller_line()
    data_dependent = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    clobbered = _clobber_message(name, exc, graph, sources or {}) if isinstance(exc, RuntimeError) else None
    if clobbered is not None:
        return CaptureError(clobbered)
    if isinstance(exc, RuntimeError) and "leaf Variable that requires grad is being used in an in-place" in str(exc):
        return CaptureError(
            f"{name} writes in place into an input that requires grad{at}. memplan cannot plan in-place "
            "updates of differentiable inputs. "
            'Fix: use the out-of-place op (e.g. x = x + y), or pass fallback="eager".'
        )
    if any(frame.line and "_nested_tensor_from_mask" in frame.line for frame in frames) or "NestedTensorImpl" in str(exc):
        return CaptureError(
            f"memplan cannot capture {name}: it turns a padded batch into a nested tensor{at_call}, which memplan cannot "
            "plan: nn.TransformerEncoder does so in evaluation under no_grad when given src_key_padding_mask (its "
            "fast path). Fix: build the encoder with nn.TransformerEncoder(..., enable_nested_tensor=False), which "
            "keeps the batch padded (the outputs at padded positions are then the layers' values rather than "
            'zeros, in eager as in the plan); or pass fallback="eager" to memplan.optimize to run this model '
            "eagerly."
        )
    in_ctc = _in_torch_function(frames, "ctc_loss")
    if in_ctc and (isinstance(exc, data_dependent) or "data is not allocated" in str(exc)):
        return CaptureError(
            f"memplan cannot capture {name}: CTC loss sizes its work from the values of the lengths{at} (and its "
            "'mean' reduction divides by a tensor it builds from them inside C++, which a trace cannot see). "
            "Fix: compute the loss outside the optimized module (optimize the network that makes the log "
            "probabilities), or pass the lengths as tuples of ints with reduction='none' (one plan per distinct "
            "lengths) and average yourself: (loss / torch.tensor(target_lengths).clamp(min=1)).mean()."
        )
    if isinstance(exc, data_dependent):
        if any(f"torch{os.sep}distributions{os.sep}" in frame.filename for frame in frames):
            return CaptureError(
                f"memplan cannot capture {name}: torch.distributions checks the values of its arguments{at}, "
                "and a static plan cannot depend on them. Fix: pass validate_args=False to the distribution, "
                "or call torch.distributions.Distribution.set_default_validate_args(False) once."
            )
        if _in_torch_function(frames, "_detect_is_causal_mask"):
            return CaptureError(
                f"memplan cannot capture {name}: torch reads the values of an attention mask to find out whether it is "
                f"causal{at_call}, and a static plan cannot depend on them. Fix: say it: pass "
                "is_causal=True (or False) to nn.TransformerEncoder, tgt_is_causal= (and memory_is_causal=) to "
                'nn.TransformerDecoder, beside the mask; or pass fallback="eager" to memplan.optimize to run this '
                "model eagerly."
            )
        if _in_torch_function(frames, "pack_padded_sequence"):
            return CaptureError(
                f"memplan cannot capture {name}: nn.utils.rnn.pack_padded_sequence makes its batch sizes from the "
                f"values of the lengths{at}, and a static plan cannot depend on them. Fix: run the recurrent layer "
                "on the padded batch and mask the padded steps (multiply the outputs by a mask made from the "
                "lengths, and pick each sequence's last state with gather), or keep packing outside the optimized "
                'module; or pass fallback="eager" to memplan.optimize to run this model eagerly.'
            )
        return CaptureError(
            f"memplan cannot capture {name}: its Python control flow or output shapes depend on tensor values{at} "
            "(a branch on a tensor, float(t) or int(t) of one, or an op whose output size depends on values, "
            "such as nonzero or masked_select; or, with none of those on that line, a torch function there that "
            "reads values inside: a check of its input, as torch.istft checks its window's overlap, or a float "
            "argument given a value read by .item(), which ops taking a tensor accept). A static plan needs the "
            "same ops for every input of a given shape. Fix: express the branch with tensor ops (torch.where, "
            "masking), keep values tensors, move it outside the model, or pass fallback=\"eager\" to "
            "memplan.optimize to run this model eagerly."
        )
    if isinstance(exc, RuntimeError) and re.search(r"Sym(Int|Float|Bool)\b.*is not tracked with proxy", str(exc)):
        return CaptureError(
            f"memplan cannot capture {name}: it computes in Python with a value read from a tensor{at} (a "
            "branch on it, or Python arithmetic such as sum() over .tolist()). A plan can carry a value read "
            "by .item() only straight into tensor ops. Fix: keep the computation in tensor ops (y.sum() "
            "rather than sum(y.tolist()), torch.where for a branch), move it outside the model, or pass "
            'fallback="eager" to memplan.optimize to run this model eagerly.'
        )
    if isinstance(exc, RuntimeError) and any(frame.name in ("numpy", "__array__") for frame in frames) \
            or "not supported for tensor subclasses" in str(exc):
        return CaptureError(
            f"memplan cannot capture {name}: it reads a tensor's values into numpy or another library{at} "
            "(.numpy(), np.asarray(t)); a plan is traced over tensors that hold no values. Fix: keep the "
            "computation in tensor ops (t.mean() rather than t.numpy().mean()), move it outside the model, or "
            'pass fallback="eager" to memplan.optimize to run this model eagerly.'
        )
    if isinstance(exc, HookEffectError):
        if exc.registered is not None:  # a tensor hook the forward registers
            where, fix = (exc.registered, (
                "make the hook return the gradient it passes on (lambda g: g * 3 is planned), or return the "
                "tensor as an output (h.clone() beside the result, when the model reads h too) and register the "
                "hook on that output, which runs at every backward"))
        else:
            where, fix = (f" (called{at})" if at else "", (
                "make the hook return the value it passes on (a hook that changes a value is planned), or register "
                "it on the optimized module itself (opt.register_forward_hook(...), "
                "opt.register_full_backward_hook(...)), which runs at every call around the plan, or return what "
                "it records as an output of the model"))
        return CaptureError(
            f"memplan cannot capture {name}: {exc}{where}, so it is called for what it does besides returning a "
            "value (recording, counting, printing, checking). A plan calls the hooks only once, while planning, "
            "over tensors that hold no values; at every later call they would not run. Fix: "
            f'{fix}; or inspect with opt.original, or pass fallback="eager" to memplan.optimize to run this model '
            "eagerly."
        )
    if isinstance(exc, PythonRandomError):
        return CaptureError(
            f"memplan cannot capture {name}: it draws from Python's random module{at} ({exc}). A plan would "
            "keep the value drawn while capturing and give it at every call, where eager draws anew. Fix: draw "
            "with torch (torch.rand(()) < p, torch.randint), which a plan draws at every call, or pass the "
            'value in as an argument, or pass fallback="eager" to memplan.optimize to run this model eagerly.'
        )
    if isinstance(exc, GeneratorArgumentError):
        return CaptureError(
            f"memplan cannot capture {name}: an op draws random numbers from a torch.Generator of its own{at}. "
            f"{_OWN_GENERATOR_FIX}"
        )
    if isinstance(exc, TargetError):
        return CaptureError(f"memplan cannot plan {name} for {target.device} on this build{at_call}: {exc}")
    stand_in = target is not None and target.stand_in
    # torch 2.13 raises FakeTensorDeviceMismatchError; 2.11 a RuntimeError saying the same
    two_devices = type(exc).__name__ == "FakeTensorDeviceMismatchError" or bool(
        re.search(r"Unhandled FakeTensor Device Propagation .*found two different devices", str(exc)))
    if stand_in and two_devices:
        found = str(exc).splitlines()[0].replace(str(target.trace_device), str(target.device))
        return CaptureError(
            f"memplan cannot capture {name} for {target.device}: an op{at} reads tensors on two devices ({found}): "
            f"a tensor the model makes on the CPU (torch.arange(n), torch.ones(k) without device=) meets the model's "
            f"tensors, which are on {target.device} for this plan; eager on the GPU fails the same way. Fix: make it "
            "on the device of the model's tensors (device=x.device), or register it as a buffer, which "
            "model.to(device) moves."
        )
    if stand_in and re.search(r"not (compiled|linked) with (CUDA|support for cuda)|Found no NVIDIA driver", str(exc),
                              re.IGNORECASE):
        return CaptureError(
            f"memplan cannot capture {name} for {target.device} on this machine, which has no GPU: the model calls "
            f"CUDA's runtime{at_call} ({str(exc).splitlines()[0]}), which needs a GPU: a torch.cuda function, or a "
            "tensor made on a CUDA device by name (device='cuda'). Fix: make tensors on the device of the model's "
            "tensors (device=x.device, x.new_zeros(...)) and keep torch.cuda calls outside the forward; or plan on "
            "a machine with a GPU."
        )
    if two_devices:
        return CaptureError(
            f"memplan cannot capture {name}: an op{at} reads tensors on two devices ({str(exc).splitlines()[0]}); "
            "eager fails the same way. Fix: move the inputs to the model's device (x.to(device)), or the model "
            "to theirs (model.to(device)) before calling it."
        )
    if isinstance(exc, NotDenseError):
        return CaptureError(
            f"memplan cannot capture {name}: {exc}{at}; it plans dense (strided) tensors only "
            "(nn.Embedding(sparse=True) makes a sparse gradient). Fix: use the dense variant (sparse=False), "
            'or pass fallback="eager" to memplan.optimize to run this model eagerly.'
        )
    return CaptureError(
        f"memplan could not trace {name}{at}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
        'Fix: check the model runs eagerly with these inputs; pass fallback="eager" to memplan.optimize to run it unplanned.'
    )


def _drop_aliases(gm: torch.fx.GraphModule, boundary: str | None) -> dict[str, str]:
    """Remove alias nodes that do nothing in the captured graph, their readers reading what they alias.

    - ``detach`` nodes the graph does not return. Autograd detaches every output it saves for the
      backward, and again when the backward unpacks it (8 of the 71 nodes of a latent-GRU step). In the
      captured graph the gradient flow is explicit and the emitted code runs without autograd, so a
      ``detach`` is an alias with nothing to do: same storage, same layout, same values.
    - A view of a graph input taken again in the same phase (``t(W)`` of a weight at every step of an
      unrolled loop's backward) reads the first one: a view of a storage nothing writes is the same
      value wherever it is taken. Inputs an op writes (through any alias) keep their views.

    Every later analysis and pass then walks fewer nodes. ``boundary``: the last forward node (None:
    no backward). Returns, for each dropped node, the op before it that stays (what happened "after"
    the dropped one happened after that one); an alias before the first op stays.
    """
    graph = gm.graph
    written: set[torch.fx.Node] = set()
    for node in graph.nodes:
        for target in mutated_args(node):
            while target.op == "call_function" and target.args and isinstance(target.args[0], torch.fx.Node):
                target = target.args[0]  # the written value's base (a view of a view of an input)
            written.add(target)
    dropped: dict[str, str] = {}
    views: dict[tuple, torch.fx.Node] = {}
    kept = None
    backward = False
    for node in list(graph.nodes):
        name = node.name
        source = node.args[0] if node.op == "call_function" and node.args else None
        replacement = None
        if isinstance(source, torch.fx.Node) and kept is not None:
            if node.target is torch.ops.aten.detach.default:
                if all(user.op != "output" for user in node.users):
                    replacement = source
            elif (
                source.op == "placeholder"
                and source not in written
                and not node.kwargs
                and all(isinstance(a, (int, bool, type(None))) for a in node.args[1:])
                and is_view_op(node.target)
            ):
                replacement = views.setdefault((backward, node.target, source, tuple(node.args[1:])), node)
                if replacement is node:
                    replacement = None
        if replacement is not None:
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
            dropped[name] = kept
        elif node.op == "call_function":
            kept = name
        if name == boundary:
            backward = True
    return dropped


def _rename_placeholders(
    gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node], kinds: list[str], paths: list[str]
) -> None:
    """Give placeholders readable names (``fc1_weight``, ``args_0``) so generated code reads well."""
    taken = {n.name for n in gm.graph.nodes if n.op != "placeholder"}
    used: set[str] = set()
    for node, kind, path in zip(placeholders, kinds, paths):
        base = "".join(c if c.isalnum() else "_" for c in path).strip("_") or kind
        if base[0].isdigit():
            base = f"{kind}_{base}"
        name, i = base, 1
        while name in taken or name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        node._rename(name)
        node.target = name
    gm.recompile()


def _build_captured(
    gm: torch.fx.GraphModule,
    *,
    train: bool,
    seed: str,
    param_names: list[str],
    buffer_names: list[str],
    leaf_paths: list[str],
    real_flat: list[torch.Tensor],
    boundary: str | None,
    in_spec: pytree.TreeSpec,
    static_inputs: tuple[tuple[str, Any], ...],
    out_spec: pytree.TreeSpec,
    n_user: int,
    released: Mapping[int, str],
    differentiable: Sequence[bool],
    recorded_sources: Mapping[str, SourceLine],
    recorded_library_sources: Mapping[str, SourceLine] | None = None,
    recorded_modules: Mapping[str, str] | None = None,
    dense_tangents: AbstractSet[int] = frozenset(),
    broadcast_together: bool = False,
    autocast_in_backward: str | None = None,
) -> CapturedGraph:
    dropped = _drop_aliases(gm, boundary)
    boundary = dropped.get(boundary, boundary) if boundary is not None else None
    released = {key: dropped.get(name, name) for key, name in released.items()}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = ["parameter"] * len(param_names) + ["buffer"] * len(buffer_names) + ["input"] * n_user
    paths = list(param_names) + list(buffer_names) + list(leaf_paths)
    n_tangents = len(placeholders) - len(kinds)
    kinds += ["tangent"] * n_tangents
    paths += [f"tangent[{i}]" for i in range(n_tangents)]
    _rename_placeholders(gm, placeholders, kinds, paths)
    requires_grad = [bool(tensor.requires_grad) for tensor in real_flat] + [False] * n_tangents
    inputs = tuple(
        InputSpec(node.name, kind, path, requires)
        for node, kind, path, requires in zip(placeholders, kinds, paths, requires_grad)
    )

    # One pass in graph order (all forward nodes come before the first backward node):
    phases: dict[str, Phase] = {}
    seq_nr: dict[str, int] = {}
    sources: dict[str, SourceLine] = {}
    library_sources: dict[str, SourceLine] = {}
    modules: dict[str, str] = {}
    recorded_library_sources = recorded_library_sources or {}
    recorded_modules = recorded_modules or {}
    # per sequence number, the first of its forward ops' user lines, torch lines and modules
    forward_by_seq: tuple[dict[int, Any], ...] = ({}, {}, {})
    released_after: dict[str, str] = {}
    phase = Phase.FORWARD
    for node in gm.graph.nodes:
        name, meta = node.name, node.meta
        node_seq_nr = meta.get("seq_nr")
        if isinstance(node_seq_nr, int):
            seq_nr[name] = int(node_seq_nr)
        if node.op != "call_function":
            continue
        # A backward op may return None for a gradient nobody needs (e.g. convolution_backward's
        # output_mask); the trace records no value for the getitem reading it. Its value is None.
        value = meta.setdefault("val", None)
        phases[name] = phase
        # The user's line, torch's line and the module: a forward node's as recorded, a backward node's
        # those of the forward op with its autograd sequence number.
        if phase is Phase.FORWARD:
            where = (recorded_sources.get(name), recorded_library_sources.get(name), recorded_modules.get(name))
            for found, by_seq in zip(where, forward_by_seq):
                if found is not None:
                    by_seq.setdefault(seq_nr.get(name, -1), found)
        else:
            where = tuple(by_seq.get(seq_nr.get(name, -2)) for by_seq in forward_by_seq)
        line, library_line, module = where
        if line is not None:
            sources[name] = line
        if library_line is not None:
            library_sources[name] = library_line
        if module is not None:
            modules[name] = module
        # Python's release of the storage the node created. A node of several tensors has none of its own:
        # each of its storages is released when Python drops that tensor, which the node's getitem of it
        # records (embedding_bag's offsets die inside F.embedding_bag, its result lives on).
        if isinstance(value, torch.Tensor):
            key = _storage_key(value)
            if key in released:
                released_after[name] = released[key]
        if train and name == boundary:
            phase = Phase.BACKWARD

    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat_outputs = list(pytree.tree_leaves(output_node.args[0], is_leaf=lambda x: x is None))
    n_model_outputs = out_spec.num_leaves
    grad_paths = [spec.path for spec in inputs if spec.requires_grad]
    outputs = []
    tangent_of = {i: j for j, i in enumerate(i for i, d in enumerate(differentiable) if d)} if train else {}
    for i, value in enumerate(flat_outputs):
        node_name = value.name if isinstance(value, torch.fx.Node) else None
        if i < n_model_outputs:
            dense = tangent_of.get(i) in dense_tangents
            outputs.append(OutputSpec(node_name, "output", f"out[{i}]", bool(train and differentiable[i]),
                                      dense, dense and broadcast_together))
        else:
            outputs.append(OutputSpec(node_name, "grad", grad_paths[i - n_model_outputs]))

    return CapturedGraph(
        gm=gm,
        released_after=released_after,
        autocast_in_backward=autocast_in_backward,
        training=train,
        phases=phases,
        sources=sources,
        library_sources=library_sources,
        modules=modules,
        seq_nr=seq_nr,
        inputs=inputs,
        outputs=tuple(outputs),
        in_spec=in_spec,
        out_spec=out_spec,
        seed=seed,
        static_inputs=static_inputs,
    )
