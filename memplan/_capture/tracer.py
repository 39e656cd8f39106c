"""A recording dispatch mode over fake tensors: the graph ``make_fx(tracing_mode="fake")`` builds, built faster.

Why not make_fx
---------------
make_fx stacks a proxy mode over a fake tensor mode. For every aten op it flattens the arguments with pytree,
builds the fake tensor cache key, makes the output from that cache or runs the op's meta kernel (for pointwise
ops a Python reference implementation, slower than the meta kernel of a matrix product), snapshots the output
and creates the fx node through several layers of hooks. A Python-unrolled loop repeats the same few ops on the
same layouts thousands of times, and this per-op work, not the graph, is what capture spent its time on.

What the tracer does for each op
--------------------------------
(1) ``prim.device`` queries (most dispatches: autograd asks each fake tensor its device) are answered at once
    from the fake tensor.
(2) An op that autograd would have decomposed is decomposed, and ``is_nonzero`` becomes ``item()``, as in
    make_fx.
(3) Cache key: the op, each tensor argument's layout (shape, strides, dtype, device, storage size; the offset
    only for ops that are given an offset, like ``as_strided``), the other arguments, and the global state a
    factory reads (default dtype and device, inference mode).
(4) On a hit the outputs are made from the cached recipe: a new meta tensor in the recorded layout, a view of
    the recorded argument's storage a recorded step past the argument's own offset, or the argument itself
    (in-place ops), each wrapped as a fake tensor. On a miss a view op runs its ATen kernel on meta aliases of
    its arguments (:meth:`Tracer._view`) and any other op runs under the fake tensor mode exactly as in make_fx;
    the outputs give the recipe when they fit one (:meth:`Tracer._recipe`).
(5) One fx node per op, with make_fx's name, ``seq_nr`` and ``val`` (a fake alias of the output that autograd
    never sees), then one ``getitem`` node per element of a list or tuple output.

Real constants
--------------
A call that reads no input's values (a factory such as ``arange``, ``torch.tensor(...)``, then any op whose
tensor arguments are all real constants), draws nothing, and makes small strided CPU tensors is computed for
real too, and the traced code gets the real tensor (its fake twin, the fake mode's output, is what the node's
``val`` aliases and what later fake runs read). Code that reads its values, as a library checking that its
position ids are ``0..n-1`` unless they are fake, then does what it does in eager. Its values depend only on
the signature's shapes and the code's constants, so the decision holds for every call of the signature. A
write of input-dependent values into a real constant raises :class:`RealConstantWritten` (capture then
traces again with ``real_constants=False``).

The recipe is a function of the key because an aten op's output layout, and which argument its output aliases,
depend only on its arguments' layouts, and a view's offset moves with its base's. Ops for which that does not
hold (data-dependent outputs, dynamic output shapes, in-place changes of a tensor's layout, custom ops, ops with
a ``CompositeImplicitAutograd`` kernel) are never cached; neither is a call with a constant or a real (non-fake)
tensor argument. Those take :meth:`Tracer._slow`, which follows make_fx's ``proxy_call``: real tensors become
``get_attr`` constants, constants of one element are computed for real (``torch.tensor(2.0).item()`` works),
and a data-dependent scalar (``x.sum().item()``) becomes a node that later ops take as an argument.

While the traced code runs, a ProxyTorchDispatchMode that never sees an op sits on the mode stack and fx's
tracing flag is set, so library code that asks whether make_fx is tracing (checkpointing, dynamo) takes the
branch it takes under make_fx; ``nn.MultiheadAttention`` alone is told it is not traced, so that it runs the
fused inference kernel eager runs.

What make_fx does that the tracer does not: symbolic shapes, pre-dispatch tracing, decomposition tables,
higher-order operators (``torch.cond``), recording arithmetic on data-dependent scalars (the scalar's node is
recorded, the arithmetic is not), and the per-node bookkeeping capture drops anyway (``tensor_meta``,
``original_aten``, module scopes). Its dead-code elimination removes only symbolic-size accessors, which a
static-shape trace never makes.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
import torch.fx._symbolic_trace as _fx_trace
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
    autograd_would_have_decomposed,
)

from memplan._capture.formulas import EagerFormulas
from memplan.opschema import (
    CONTIGUOUS_RESULTS, GRAD_MODE_OPS, KERNEL_DTYPE_OPS, REDUCED_IN_RESULT, SIZED_BY_RUNNING, STORAGE_OF_INPUT,
    kernel_dtypes, result_storage_numel,
)

__all__ = ["NotDenseError", "Tracer", "new_fake_mode", "quiet_meta_failures"]


class NotDenseError(RuntimeError):
    """An op of the traced code made a sparse (or otherwise not strided) tensor: memplan plans dense ones."""


class GeneratorArgumentError(RuntimeError):
    """An op of the traced code draws from a ``torch.Generator`` of its own: a plan has no such value to
    pass (its code names arguments, and a generator's state moves at every call)."""

aten = torch.ops.aten
_DEVICE_QUERY = torch.ops.prim.device.default
# make_fx computes a constant's result for real only when it has at most this many elements.
_CONSTANT_NUMEL_LIMIT = 1
# Where a traced tensor keeps ``(tracer, node, constant, twin)``: the node that made it; for a constant (from
# ``torch.tensor(...)``), its real value, or ``_REAL`` for a real constant (the tensor is its own value); and
# for a real constant its fake twin, the fake tensor the fake mode computes on and the node's ``val`` aliases.
_TRACED = "_memplan_traced"
_REAL = "real"
# A tensor made from no input's values (``torch.arange(n)``, a mask built from it) is a real constant when its
# storage has at most this many bytes: see Tracer._slow.
_REAL_CONSTANT_BYTES = 1 << 18
# Factories of uninitialized memory: no code branches on their values, and they are made to be written into,
# often with the inputs' values (which a real constant cannot hold), so they stay fake.
_UNINITIALIZED = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.empty_permuted.default,
})
_SCALARS = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)
_UNCACHEABLE = "uncacheable"
_SYMBOLS = (torch.SymInt, torch.SymFloat, torch.SymBool)
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_HELD_STORAGE = STORAGE_OF_INPUT | REDUCED_IN_RESULT  # results whose storage the real kernel makes larger


class RealConstantWritten(RuntimeError):
    """An op wrote values that depend on the inputs into a real constant (see Tracer._slow): the tensor the
    traced code holds cannot carry them. Capture traces again without real constants."""


class _Uncacheable(Exception):
    """A call whose outputs cannot be made from a recipe (raised while building its key or its recipe)."""


def new_fake_mode() -> FakeTensorMode:
    """The fake tensor mode make_fx creates for ``tracing_mode="fake"``: static shapes, real inputs allowed."""
    import torch._functorch.config as functorch_config
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        mode = FakeTensorMode(
            allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True
        )
    # Without torch's dispatch cache, shared by every fake mode of the process: it rebuilds the outputs
    # of a cached call on storages of their own, where the kernel gives outputs that share one (oneDNN's
    # LSTM backward returns the two bias gradients on one storage), so a capture would depend on what
    # the process traced before. The tracer keeps its own cache, which records how outputs alias.
    mode.cache_enabled = False
    return mode


class _MetaFailureFilter(logging.Filter):
    """Drops the fake tensor mode's traceback of a meta kernel that raised, inside
    :func:`quiet_meta_failures` on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.state = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.state, "depth", 0)


_META_FAILURES = _MetaFailureFilter()
logging.getLogger("torch._subclasses.fake_tensor").addFilter(_META_FAILURES)


@contextlib.contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """Silence the fake tensor mode's error log for the meta kernels that raise inside the block.

    The mode logs a full traceback at ERROR level whenever an op's meta kernel raises (two shapes
    that do not broadcast, say), and then raises. Where memplan catches that error, because it was
    probing whether an op applies or because it turns the error into its own that names the user's
    line, the log is noise in the user's terminal; the exception itself still propagates.

    >>> with quiet_meta_failures():
    ...     pass
    """
    state = _META_FAILURES.state
    state.depth = getattr(state, "depth", 0) + 1
    try:
        yield
    finally:
        state.depth -= 1


class _Op:
    """What the tracer needs to know about an operator, worked out once."""

    __slots__ = ("name", "cacheable", "decomposable", "absolute", "view", "writes")

    def __init__(self, func: Any, graph: torch.fx.Graph):
        overload = isinstance(func, torch._ops.OpOverload)
        self.name = graph._target_to_str(func.overloadpacket.__name__) if overload else None
        self.decomposable = overload and torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        )
        tags = set(func.tags) if overload else set()
        self.cacheable = (
            overload
            and func.namespace in ("aten", "prims")
            and not self.decomposable
            and not tags & {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.inplace_view}
            and func not in (aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.is_nonzero.default)
            and func not in GRAD_MODE_OPS  # sized by running them (see Tracer._sized_as_run)
            and func not in KERNEL_DTYPE_OPS  # dtypes by their arguments' (see Tracer._kernel_dtypes)
        )
        # A view's offset is its base's plus a step the other arguments fix, except for ops told the
        # offset itself (as_strided): their keys hold the arguments' offsets.
        self.absolute = overload and any(arg.name == "storage_offset" for arg in func._schema.arguments)
        # A view op whose tensor arguments are all top-level (none in a list): see Tracer._view.
        self.view = self.cacheable and func.is_view and not any(
            isinstance(arg.type, torch.ListType) and "Tensor" in str(arg.type) for arg in func._schema.arguments
        )
        # The arguments the op writes (in-place and out= ops), as (position, keyword).
        self.writes = tuple(
            (i, arg.name) for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        ) if overload else ()


def create_node(graph: torch.fx.Graph, op: str, target: Any, args: tuple, kwargs: dict | None = None,
                name: str | None = None, type_expr: Any = None) -> torch.fx.Node:
    """``graph.create_node(op, target, args, kwargs, name, type_expr)`` at the graph's insert point, for
    arguments that hold no raw ``SymInt`` (memplan's graphs have static shapes).

    ``Graph.create_node`` walks the arguments (pytree, lists of sizes included) only to warn about raw
    symbolic values; that walk was about a third of the cost of making a node, and the trace and the
    passes make tens of thousands of an unrolled loop. The node is created without arguments, which skips it, and
    then given them as fx says arguments are set (assigning ``args`` and ``kwargs``, which records the
    uses). The node gets the name, place and users ``Graph.create_node`` would give it.
    """
    node = graph.create_node(op, target, (), None, name, type_expr)
    if args:
        node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


@contextlib.contextmanager
def _eager_attention_path() -> Iterator[None]:
    """``nn.MultiheadAttention`` answers as it does in eager whether to run its fused kernel.

    In eval mode without gradients, eager runs ``aten._native_multi_head_attention``, one op; asked
    whether make_fx is tracing (a proxy mode on the stack, as in a trace), the module runs its
    decomposed path instead: another program, 3-6x eager's peak, which a plan would then be made of
    and predicted from. The fused op has a fake kernel and is traced like any op."""
    import torch.nn.modules.activation as activation

    asked = getattr(activation, "_is_make_fx_tracing", None)
    if asked is None:  # a torch without the check: nothing to answer
        yield
        return
    activation._is_make_fx_tracing = lambda: False
    try:
        yield
    finally:
        activation._is_make_fx_tracing = asked


class Tracer(TorchDispatchMode):
    """Records every aten op run on its fake tensors into :attr:`graph`.

    Parameters
    ----------
    fake_mode : FakeTensorMode
        The mode of every traced tensor; see :func:`new_fake_mode`.
    observer : callable, optional
        ``observer(last, out)`` after each op the traced code calls (not the ops a decomposition calls), with
        the graph's last node before the op and the op's outputs.

    Examples
    --------
    >>> import torch.fx.traceback as fx_traceback
    >>> tracer = Tracer(new_fake_mode())
    >>> with fx_traceback.preserve_node_meta():
    ...     (x,) = tracer.placeholders([torch.randn(4, 3)])
    ...     with tracer:
    ...         results = tracer.node_args([x.exp().sum(0), x.exp().sum(0)])
    ...     _ = tracer.output(results)
    >>> [node.name for node in tracer.graph.nodes]
    ['arg0_1', 'exp', 'sum_1', 'exp_1', 'sum_2', 'output']
    >>> tracer.fake_runs  # the second exp and sum were made from the first ones' recipes
    2
    """

    def __init__(self, fake_mode: FakeTensorMode, observer: Callable[[torch.fx.Node, Any], None] | None = None,
                 real_constants: bool = True):
        super().__init__()
        self.fake_mode = fake_mode
        self.real_constants = real_constants
        #: Real constants made so far (see :meth:`_slow`).
        self.reals_made = 0
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self.observer = observer
        self._formulas = EagerFormulas()  # autograd's formulas as eager runs them (in place), not as over fakes
        self._ops: dict[Any, _Op] = {}
        self._cache: dict[tuple, Any] = {}
        self._depth = 0
        self._tensor_attrs: dict[torch.Tensor, str] = {}
        self._qualname_counter: dict[str, int] = {}
        self._symbols: dict[Any, torch.fx.Node] = {}
        self._wrap = _FakeWrapper(fake_mode)
        self._entered = 0
        self._fx_tracing = False
        self._dormant: TorchDispatchMode | None = None
        self._attention_check: contextlib.AbstractContextManager | None = None
        #: Calls whose outputs the fake mode computed (not made from a recipe, nor by a view kernel).
        self.fake_runs = 0

    # ------------------------------------------------------------------------------------------
    # graph inputs and outputs

    def placeholders(self, reals: Sequence[torch.Tensor], device: torch.device | None = None) -> list[FakeTensor]:
        """Fake copies of ``reals``, each a graph input (named like make_fx's, ``arg0_1``...); on ``device``
        when given, wherever the real ones are (inputs that share a storage still share one)."""
        from torch._dynamo.source import ConstantSource

        fakes = [self.fake_mode.from_tensor(real, source=ConstantSource(f"input{i}")) for i, real in enumerate(reals)]
        if device is not None:
            fakes = [fake if fake.fake_device == device else self._moved(fake, device) for fake in fakes]
        for i, fake in enumerate(fakes):
            name = f"arg{i}_1"
            self._track(fake, self._node("placeholder", name, (), {}, name), None)
        return fakes

    def _moved(self, fake: FakeTensor, device: torch.device) -> FakeTensor:
        """``fake`` on ``device``: the same storage and layout, and whether it requires grad."""
        meta = self._meta_alias(fake).requires_grad_(fake.requires_grad)
        return FakeTensor(self.fake_mode, meta, device)

    def add_placeholder(self, value: FakeTensor, target: str, seq_nr: int | None) -> torch.fx.Node:
        """One more graph input holding ``value``, placed after the other inputs."""
        first_op = next((node for node in self.graph.nodes if node.op != "placeholder"), None)
        with self.graph.inserting_before(first_op) if first_op is not None else contextlib.nullcontext():
            node = self._node("placeholder", target, (), {}, None)
        if seq_nr is not None:
            node.meta["seq_nr"] = seq_nr
        with self._untraced():
            self._track(value, node, None)
        return node

    def node_args(self, values: Sequence[Any]) -> list[Any]:
        """``values`` as graph arguments: traced tensors become their nodes, other tensors constants."""
        return self._node_arg(list(values))

    def output(self, args: list[Any]) -> torch.fx.Node:
        """The output node returning ``args`` (from :meth:`node_args`)."""
        return self._node("output", "output", (args,), {}, None)

    def graph_module(self, name: str) -> torch.fx.GraphModule:
        return torch.fx._lazy_graph_module._make_graph_module(self.root, self.graph, name)

    def node_of(self, tensor: torch.Tensor) -> torch.fx.Node:
        """The node whose value ``tensor`` is (the last op that wrote it, for in-place ops)."""
        traced = getattr(tensor, _TRACED, None)
        if traced is None or traced[0] is not self:
            raise KeyError("tensor was not made by this trace")
        return traced[1]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run ops on the fake tensors without recording them (under the fake mode, as make_fx would)."""
        with self._untraced(), self.fake_mode:
            yield

    @contextlib.contextmanager
    def _untraced(self) -> Iterator[None]:
        """Take the tracer (it must be innermost) and its dormant proxy mode off the dispatch mode stack."""
        with _proxy_mode_unset():
            if _get_current_dispatch_mode() is not self:
                yield
                return
            with _pop_mode_temporarily():
                yield

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ so that dynamo never compiles it, at a fifth of the
        # trace's time. Dynamo does not run inside an fx trace (see __enter__), so the guard is not needed.
        return False

    def __enter__(self) -> Tracer:
        # Library code asks whether make_fx is tracing (checkpoint changes how it caches): a
        # ProxyTorchDispatchMode on the stack while the traced code runs gives make_fx's answer. It never
        # sees an op: each op reaches the tracer first, which takes the proxy mode off the stack until the
        # op is recorded. fx's tracing flag is set as make_fx's tracer sets it: dynamo refuses to compile
        # inside a trace (a torch.compile'd model raises, as under make_fx). One question gets eager's
        # answer instead: nn.MultiheadAttention's, which would skip its fused inference kernel for
        # make_fx (see _eager_attention_path).
        self._entered += 1
        if self._entered == 1:
            self._fx_tracing = _fx_trace._is_fx_tracing_flag
            _fx_trace._is_fx_tracing_flag = True
            if _get_proxy_mode() is None:
                from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode, PythonKeyTracer

                self._dormant = ProxyTorchDispatchMode(PythonKeyTracer(), "fake")
                self._dormant.__enter__()
            self._attention_check = _eager_attention_path()
            self._attention_check.__enter__()
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            self._entered -= 1
            if self._entered == 0:
                _fx_trace._is_fx_tracing_flag = self._fx_tracing
                if self._dormant is not None:
                    self._dormant.__exit__(exc_type, exc_value, traceback)
                    self._dormant = None
                if self._attention_check is not None:
                    self._attention_check.__exit__(exc_type, exc_value, traceback)
                    self._attention_check = None

    # ------------------------------------------------------------------------------------------
    # dispatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:
            return args[0].fake_device
        kwargs = kwargs or {}
        last = self.graph._root.prev
        if self._depth == 0:
            func = self._formulas.in_place(func, args, kwargs) or func
        self._depth += 1
        dormant = torch._C._unset_dispatch_mode(_PROXY)
        try:
            out = self._dispatch(func, args, kwargs)
        finally:
            if dormant is not None:
                torch._C._set_dispatch_mode(dormant)
            self._depth -= 1
        if self._depth == 0:
            self._formulas.made(func, out)
        if self._depth == 0 and self.observer is not None:
            self.observer(last, self._fake_arg(out) if self.reals_made else out)
        return out

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        op = self._ops.get(func)
        if op is None:
            op = self._ops[func] = _Op(func, self.graph)
        key = None
        # a call with no fake argument may make real constants (see _slow): never from the recipe cache
        if op.cacheable and (not self.real_constants or _has_fake(args) or _has_fake(kwargs.values())):
            # Step 3: the key; Step 4: a hit makes the outputs from the recipe.
            key = self._cache_key(func, op, args, kwargs)
            recipe = self._cache.get(key) if key is not None else None
            if recipe is _UNCACHEABLE:
                key = None
            elif recipe is not None:
                out, vals = self._make(recipe, args, kwargs, True)
                node = self._node("call_function", func, self._node_arg(args), self._node_arg(kwargs), op.name)
                self._track(out, node, None, vals)
                return out
            elif key is not None and op.view:
                out = self._view(func, args, kwargs)
                node = self._node("call_function", func, self._node_arg(args), self._node_arg(kwargs), op.name)
                self._track(out, node, None)
                self._remember(key, args, kwargs, out)
                return out
        elif op.decomposable and func not in (aten.size.default, aten.stride.default, aten.storage_offset.default):
            # Step 2: decompose as autograd would have (make_fx does the same below autograd).
            if autograd_would_have_decomposed(func, _tensors_in((args, kwargs))):
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
        if func is aten.is_nonzero.default:
            with self:
                torch._check(args[0].numel() == 1, lambda: "Boolean value of Tensor with more than one value is ambiguous")
                return (args[0] != 0).item()
        out = self._slow(func, args, kwargs)
        if key is not None:
            self._remember(key, args, kwargs, out)
        return out

    def evaluate(self, func: Any, args: tuple, kwargs: dict | None = None) -> Any:
        """``func(*args, **kwargs)`` on fake tensors as the fake mode computes it, recording nothing.

        Made from the cache where the trace has already run ``func`` on arguments of the same layout.
        """
        kwargs = kwargs or {}
        with self._untraced(), unset_fake_temporarily():
            op = self._ops.get(func)
            if op is None:
                op = self._ops[func] = _Op(func, self.graph)
            key = self._cache_key(func, op, args, kwargs) if op.cacheable else None
            recipe = self._cache.get(key) if key is not None else None
            if recipe is not None and recipe is not _UNCACHEABLE:
                return self._make(recipe, args, kwargs, False)[0]
            if key is not None and recipe is None and op.view:
                out = self._view(func, args, kwargs)
            else:
                self.fake_runs += 1
                with self.fake_mode:
                    out = func(*args, **kwargs)
                if func in KERNEL_DTYPE_OPS:
                    out = self._kernel_dtypes(func, args, out)
            if key is not None and recipe is None:
                self._remember(key, args, kwargs, out)
            return out

    def _view(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A view op's outputs, from its ATen kernel run on meta aliases of the fake arguments.

        A view's layout is computed by the one ATen function every backend shares, so this is the fake
        mode's answer without its Python (the fake mode's own rule for ``select``, for one, costs a
        millisecond, and a loop over ``select(x, 0, t)`` misses the cache at every step).
        """
        device = next(a.fake_device for a in (*args, *kwargs.values()) if type(a) is FakeTensor)
        out = func(
            *[self._meta_alias(a) if type(a) is FakeTensor else a for a in args],
            **{k: self._meta_alias(v) if type(v) is FakeTensor else v for k, v in kwargs.items()},
        )
        return self._wrapped(out, device)

    def _wrapped(self, value: Any, device: torch.device) -> Any:
        if isinstance(value, torch.Tensor):
            return self._wrap(value, device)
        if type(value) in (list, tuple):
            return type(value)(self._wrapped(item, device) for item in value)
        return value

    def _slow(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` under the fake mode and record it, following make_fx's ``proxy_call``."""
        tensors = _tensors_in((args, kwargs))
        constants = [self._constant(t) for t in tensors if self._traces(t)]
        all_constant = all(c is not None for c in constants)
        tags = func.tags if isinstance(func, torch._ops.OpOverload) else ()
        op = self._ops.get(func) or _Op(func, self.graph)
        real = self.real_constants and self._may_be_real(func, op, tags, tensors)
        if self.reals_made and not real:
            for written in self._written(op, args, kwargs):
                if type(written) is not FakeTensor and self._constant(written) is written:
                    raise RealConstantWritten(f"{func} writes values that depend on the inputs into a constant")
        if torch.Tag.data_dependent_output in tags:
            if all_constant:
                # e.g. torch.tensor(2.0).item(): the value is known, and no node is made.
                return func(*self._constant_arg(args), **self._constant_arg(kwargs))
            if all(not isinstance(t, FakeTensor) for t in tensors):
                raise RuntimeError(
                    f"It appears that you're trying to get value out of a tracing tensor with {func} - erroring out! "
                    "It's likely that this is caused by data-dependent control flow or similar."
                )
        if func is aten.lift_fresh.default:
            # torch.tensor(...) lifts a fresh real tensor; the graph copies the constant, as make_fx's does.
            func = aten.lift_fresh_copy.default
            tags = func.tags
            op = self._ops.get(func) or _Op(func, self.graph)
        node = self._node("call_function", func, self._node_arg(args), self._node_arg(kwargs), op.name)
        self.fake_runs += 1
        if func in SIZED_BY_RUNNING:
            out = self._sized_as_run(func, args, kwargs, None)
        else:
            with self.fake_mode:
                out = func(*self._fake_arg(args), **self._fake_arg(kwargs)) if self.reals_made else func(*args, **kwargs)
        for tensor in _tensors_in(out):
            if tensor.layout != torch.strided:
                raise NotDenseError(f"{func} makes a {tensor.layout} tensor")
            if any(type(size) is not int for size in tensor.shape):
                # the shape depends on the values (a packed sequence's batch sizes): no static plan
                raise DynamicOutputShapeException(func)
        if func in CONTIGUOUS_RESULTS and isinstance(out, torch.Tensor) and not out.is_contiguous():
            with self.fake_mode:
                out = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        if func in _HELD_STORAGE:
            numel = result_storage_numel(func, args, kwargs, out)
            if numel is not None and numel > out.numel():
                with self.fake_mode:
                    base = torch.empty(numel, dtype=out.dtype, device=out.device)
                    out = base.as_strided(out.shape, out.stride(), 0)
        if func in GRAD_MODE_OPS:
            out = self._sized_as_run(func, args, kwargs, out)
            node.meta["grad_enabled"] = torch.is_grad_enabled()
        if func in KERNEL_DTYPE_OPS:
            out = self._kernel_dtypes(func, args, out)
        if real:
            made = self._real(func, op, args, kwargs, out)
            if made is not None:
                self.reals_made += 1
                self._track(made, node, _REAL, self._val(out), out)
                return made
        constant = None
        if func is aten.lift_fresh_copy.default and out.numel() <= _CONSTANT_NUMEL_LIMIT:
            constant = args[0].clone()
        elif (
            torch.Tag.nondeterministic_seeded not in tags
            and all_constant
            and any(c is not None for c in constants)
            and all(t.numel() <= _CONSTANT_NUMEL_LIMIT for t in _tensors_in(out))
        ):
            constant = func(*self._constant_arg(args), **self._constant_arg(kwargs))
        self._track(out, node, constant)
        return out

    def _kernel_dtypes(self, func: Any, args: tuple, out: Any) -> Any:
        """``out`` with the results whose dtype the real kernel gives otherwise than the fake one in the
        kernel's dtype (see :data:`~memplan.opschema.KERNEL_DTYPE_OPS`)."""
        device = out[0].fake_device if isinstance(out[0], FakeTensor) else out[0].device
        found = kernel_dtypes(func, args, device)
        if found is None:
            return out
        dtype, which = found
        with self.fake_mode:
            return type(out)(
                torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)
                if isinstance(t, torch.Tensor) and (which is None or i in which) and t.dtype != dtype else t
                for i, t in enumerate(out)
            )

    def _sized_as_run(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """``out`` (the fake kernel's outputs) with each tensor the real kernel makes in another size or
        dtype replaced by a fake one of the real layout (every tensor, when ``out`` is None: there is no
        fake kernel to ask). The real kernel runs once, in the current grad mode, on zeros of the
        arguments' layouts on their device.

        For :data:`~memplan.opschema.GRAD_MODE_OPS`: the fake kernel of oneDNN's LSTM layer makes its
        workspace empty, and the real one is about as large as all the layer's gates, so a plan that
        did not know its size would predict a fraction of what the step holds. For
        :data:`~memplan.opschema.SIZED_BY_RUNNING`: the fake kernel refuses to size the outputs.
        """

        def zeros(t: FakeTensor) -> torch.Tensor:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.fake_device).zero_()

        with unset_fake_temporarily():
            real_args, real_kwargs = pytree.tree_map_only(FakeTensor, zeros, (args, kwargs))
            real = func(*real_args, **real_kwargs)
        if out is None:
            out = pytree.tree_map_only(torch.Tensor, lambda t: None, real)
        single = not isinstance(out, (tuple, list))
        fakes, reals = ((out,), (real,)) if single else (out, real)
        sized = []
        for fake, made in zip(fakes, reals):
            if isinstance(made, torch.Tensor) and (
                fake is None
                or isinstance(fake, FakeTensor) and (fake.shape != made.shape or fake.dtype != made.dtype)
            ):
                device = made.device if fake is None else fake.fake_device
                with self.fake_mode:
                    fake = torch.empty_strided(made.shape, made.stride(), dtype=made.dtype, device=device)
            sized.append(fake)
        return sized[0] if single else type(out)(sized)

    # ------------------------------------------------------------------------------------------
    # the cache

    def _cache_key(self, func: Any, op: _Op, args: tuple, kwargs: dict) -> tuple | None:
        try:
            return (
                func,
                self._key(args, op.absolute),
                self._key(kwargs.values(), op.absolute) if kwargs else None,
                tuple(kwargs) if kwargs else None,
                torch.get_default_dtype(),
                torch._C._get_default_device(),
                torch.is_inference_mode_enabled(),
            )
        except _Uncacheable:
            return None

    def _remember(self, key: tuple, args: tuple, kwargs: dict, out: Any) -> None:
        try:
            self._cache[key] = self._recipe(args, kwargs, out)
        except _Uncacheable:
            self._cache[key] = _UNCACHEABLE

    def _key(self, values: Any, absolute: bool) -> tuple:
        key = []
        for value in values:
            kind = type(value)
            if kind is FakeTensor:
                # Fake tensors of this trace's mode that are not constants; they need not be traced
                # (evaluate() runs ops on the graph's values).
                if value.fake_mode is not self.fake_mode or value.constant is not None or value.dtype.is_complex:
                    raise _Uncacheable
                traced = getattr(value, _TRACED, None)
                if traced is not None and (traced[0] is not self or traced[2] is not None):
                    raise _Uncacheable
                try:
                    stride = value.stride()
                except RuntimeError as exc:  # a sparse tensor has no strides
                    raise _Uncacheable from exc
                key.append(
                    (value.shape, stride, value.storage_offset() if absolute else None, value.dtype,
                     value.fake_device, value.untyped_storage().nbytes())
                )
            elif kind in _SCALARS:
                key.append((kind, value))
            elif kind is list or kind is tuple:
                key.append((kind, self._key(value, absolute)))
            else:
                raise _Uncacheable
        return tuple(key)

    def _recipe(self, args: tuple, kwargs: dict, out: Any) -> Any:
        """How to make ``out`` again from arguments with the same key, or raise :class:`_Uncacheable`.

        Each tensor is ``("same", where)`` (the argument itself: in-place and ``out=`` ops), ``("view", where,
        step, shape, stride, dtype, device)`` (a view of that argument's storage, ``step`` elements past the
        argument's own offset), or ``("fresh", shape,
        stride, dtype, device)`` (a new storage, exactly as large as the layout needs); ``where`` is
        ``(True, position)`` or ``(False, keyword)``. A tensor sharing storage with a fresh output or with an
        argument nested in a list, or ambiguously with two arguments, makes the call uncacheable.

        (A method, not a recursive closure: a closure that calls itself is a reference cycle, and with the
        garbage collector paused it would keep the arguments alive, which the release recorder would see.)
        """
        top = [((True, i), a) for i, a in enumerate(args)] + [((False, k), a) for k, a in kwargs.items()]
        top = [(where, a) for where, a in top if isinstance(a, FakeTensor)]
        nested = {t.untyped_storage()._cdata for t in _tensors_in((args, kwargs))}
        return self._recipe_of(out, top, nested, set())

    def _recipe_of(self, value: Any, top: list, nested: set[int], fresh: set[int]) -> Any:
        kind = type(value)
        if kind is FakeTensor:
            for where, arg in top:
                if value is arg:
                    return ("same", where)
            if value.fake_mode is not self.fake_mode or value.constant is not None or value.layout != torch.strided:
                raise _Uncacheable
            storage = value.untyped_storage()
            layout = (tuple(value.shape), tuple(value.stride()), value.dtype, value.fake_device)
            matches = [(where, arg) for where, arg in top if arg.untyped_storage()._cdata == storage._cdata]
            if len(matches) == 1:
                where, base = matches[0]
                return ("view", where, value.storage_offset() - base.storage_offset()) + layout
            if matches or storage._cdata in nested or storage._cdata in fresh or value.storage_offset() != 0:
                raise _Uncacheable
            fresh.add(storage._cdata)
            shape, stride, dtype, _ = layout
            if torch.empty_strided(shape, stride, dtype=dtype, device="meta").untyped_storage().nbytes() != storage.nbytes():
                raise _Uncacheable
            return ("fresh",) + layout
        if kind is list or kind is tuple:
            return (kind, tuple(self._recipe_of(item, top, nested, fresh) for item in value))
        if value is None or kind in (int, float, bool):
            return ("const", value)
        raise _Uncacheable

    def _make(self, recipe: Any, args: tuple, kwargs: dict, vals: bool) -> tuple[Any, Any]:
        """Outputs from ``recipe`` and, if ``vals``, beside each tensor the fake alias for its node's ``val``."""
        kind = recipe[0]
        if kind == "fresh":
            _, shape, stride, dtype, device = recipe
            elem = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            return self._wrap(elem, device), self._wrap(elem, device) if vals else None
        if kind == "view":
            _, (positional, where), step, shape, stride, dtype, device = recipe
            base = args[where] if positional else kwargs[where]
            elem = torch.empty((0,), dtype=dtype, device="meta").set_(
                base.untyped_storage(), base.storage_offset() + step, shape, stride
            )
            return self._wrap(elem, device), self._wrap(elem, device) if vals else None
        if kind == "same":
            _, (positional, where) = recipe
            value = args[where] if positional else kwargs[where]
            return value, self._alias(value) if vals else None
        if kind == "const":
            return recipe[1], None
        pairs = [self._make(item, args, kwargs, vals) for item in recipe[1]]
        return kind(out for out, _ in pairs), kind(val for _, val in pairs) if vals else None

    # ------------------------------------------------------------------------------------------
    # nodes and tracked tensors

    def _node(self, op: str, target: Any, args: tuple, kwargs: dict, name: str | None) -> torch.fx.Node:
        """A graph node with make_fx's ``seq_nr``: the running backward node's, or the last autograd node made."""
        node = create_node(self.graph, op, target, args, kwargs, name)
        meta = fx_traceback.current_meta
        if meta.get("in_grad_fn", 0) > 0:
            node.meta["seq_nr"] = meta["grad_fn_seq_nr"][-1]
        else:
            node.meta["seq_nr"] = torch.autograd._get_sequence_nr() - 1
        return node

    def _track(self, value: Any, node: torch.fx.Node, constant: Any, vals: Any = None, twin: Any = None) -> None:
        """Make ``node`` the source of the tensors in ``value`` and record its ``val`` (getitem nodes for sequences)."""
        if isinstance(value, torch.Tensor):
            setattr(value, _TRACED, (self, node, constant, twin))
            node.meta["val"] = vals if vals is not None else self._alias(value)
        elif isinstance(value, _SYMBOLS):
            # A data-dependent scalar (``x.sum().item()``): later ops that take it take the node.
            node.meta["val"] = value
            self._symbols[value.node] = node
        elif isinstance(value, (list, tuple)):
            node.meta["val"] = vals if vals is not None else self._val(value)
            for i, item in enumerate(value):
                child = self._node("call_function", operator.getitem, (node, i), {}, None)
                self._track(
                    item,
                    child,
                    constant if constant is _REAL else constant[i] if constant is not None else None,
                    vals[i] if vals is not None else None,
                    twin[i] if twin is not None else None,
                )

    def _val(self, value: Any) -> Any:
        if isinstance(value, FakeTensor):
            return self._alias(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self._val(item) for item in value)
        return value

    def _alias(self, value: FakeTensor) -> FakeTensor:
        """A fake tensor sharing ``value``'s storage and layout, unknown to autograd (make_fx's ``val``)."""
        elem = self._meta_alias(value)
        if value.fake_mode is not self.fake_mode:
            return FakeTensor(value.fake_mode, elem, value.fake_device)
        return self._wrap(elem, value.fake_device)

    @staticmethod
    def _meta_alias(value: FakeTensor) -> torch.Tensor:
        """A plain meta tensor sharing ``value``'s storage and layout."""
        return torch.empty((0,), dtype=value.dtype, device="meta").set_(
            value.untyped_storage(), value.storage_offset(), value.shape, value.stride()
        )

    def _traces(self, value: Any) -> bool:
        traced = getattr(value, _TRACED, None)
        return traced is not None and traced[0] is self

    def _node_arg(self, value: Any) -> Any:
        """``value`` with traced tensors replaced by their nodes and other tensors by ``get_attr`` constants."""
        kind = type(value)
        if kind is FakeTensor or isinstance(value, torch.Tensor):
            traced = getattr(value, _TRACED, None)
            if traced is not None and traced[0] is self:
                return traced[1]
            return self._constant_node(value)
        if kind in _SCALARS:
            return value
        if kind is list or kind is tuple:
            return kind([self._node_arg(item) for item in value])
        if kind is dict:
            return {k: self._node_arg(v) for k, v in value.items()}
        if isinstance(value, _SYMBOLS):
            return self._symbols.get(value.node, value)
        if isinstance(value, torch.Generator):
            raise GeneratorArgumentError("an op draws from a torch.Generator of its own")
        return value

    def _constant_arg(self, value: Any) -> Any:
        """``value`` with traced constants replaced by their real values."""
        if isinstance(value, torch.Tensor):
            return self._constant(value) if self._traces(value) else value
        if type(value) in (list, tuple):
            return type(value)(self._constant_arg(item) for item in value)
        if type(value) is dict:
            return {k: self._constant_arg(v) for k, v in value.items()}
        return value

    def _constant(self, value: torch.Tensor) -> Any:
        """The real value of a traced constant (the tensor itself for a real constant); None for another tensor."""
        traced = getattr(value, _TRACED, None)
        if traced is None or traced[0] is not self:
            return None
        return value if traced[2] is _REAL else traced[2]

    def _fake_arg(self, value: Any) -> Any:
        """``value`` with each real constant replaced by its fake twin."""
        kind = type(value)
        if kind is FakeTensor:
            return value
        if isinstance(value, torch.Tensor):
            traced = getattr(value, _TRACED, None)
            return traced[3] if traced is not None and traced[0] is self and traced[2] is _REAL else value
        if kind is list or kind is tuple:
            return kind(self._fake_arg(item) for item in value)
        if kind is dict:
            return {k: self._fake_arg(v) for k, v in value.items()}
        return value

    @staticmethod
    def _written(op: _Op, args: tuple, kwargs: dict) -> list[Any]:
        """The tensors ``op`` writes among its arguments."""
        return [args[i] if i < len(args) else kwargs.get(name) for i, name in op.writes]

    def _may_be_real(self, func: Any, op: _Op, tags: Any, tensors: list[torch.Tensor]) -> bool:
        """Whether the call reads no input's values, so that its results can be real constants.

        Its tensor arguments must all be real constants (none, for a factory; the fresh tensor
        ``torch.tensor(...)`` lifts), nothing it reads may require grad, and it must not draw random numbers.
        """
        if not isinstance(func, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in tags:
            return False
        if func in SIZED_BY_RUNNING or func in GRAD_MODE_OPS or func in _HELD_STORAGE or func in _UNINITIALIZED:
            return False
        if func is aten.lift_fresh_copy.default or func is aten.lift_fresh.default:
            return len(tensors) == 1 and type(tensors[0]) is not FakeTensor and not self._traces(tensors[0])
        return all(
            type(t) is not FakeTensor and not t.requires_grad and self._constant(t) is t for t in tensors
        )

    def _real(self, func: Any, op: _Op, args: tuple, kwargs: dict, out: Any) -> Any:
        """The call's results computed for real, if they make real constants: every result a strided CPU tensor
        of at most :data:`_REAL_CONSTANT_BYTES` whose real layout is the fake one. None otherwise.

        A real constant is what the traced code holds in place of a fake tensor, so that code that reads
        its values (a branch on ``(positions == 0).all()``, a library asking whether it is traced) does what
        eager does; its node is recorded as any other, so a plan computes it at every call as eager does.
        Its values depend on no input, only on the signature's shapes and the code's constants, so what the
        trace decides from them holds for every call of the signature.
        """
        fakes = _tensors_in(out)
        made = None
        if fakes and (type(out) is FakeTensor or (type(out) in (list, tuple) and len(out) == len(fakes))) and all(
            type(f) is FakeTensor and f.fake_device.type == "cpu" and f.layout == torch.strided
            and f.untyped_storage().nbytes() <= _REAL_CONSTANT_BYTES for f in fakes
        ):
            made = func(*self._constant_arg(args), **self._constant_arg(kwargs))
            reals = _tensors_in(made)
            if len(reals) != len(fakes) or any(
                r.shape != f.shape or r.stride() != f.stride() or r.dtype != f.dtype or r.device.type != "cpu"
                for r, f in zip(reals, fakes)
            ):
                made = None
        if made is None and op.writes:
            # it wrote a real constant (every tensor it reads is one), which its fake twin cannot follow
            raise RealConstantWritten(f"{func} wrote a constant in a way its fake twin cannot follow")
        return made

    def _constant_node(self, tensor: torch.Tensor) -> torch.fx.Node:
        """A ``get_attr`` node for a tensor the trace did not make, stored on :attr:`root` as fx stores it."""
        if isinstance(tensor, torch.nn.Parameter):
            qualname = next((name for name, p in self.root.named_parameters() if p is tensor), None)
            if qualname is None:
                qualname = self._fresh_qualname("_param_constant")
                setattr(self.root, qualname, tensor)
        else:
            qualname = self._tensor_attrs.get(tensor)
            if qualname is None:
                qualname = self._tensor_attrs[tensor] = self._fresh_qualname("_tensor_constant")
                setattr(self.root, qualname, tensor)
        node = self._node("get_attr", qualname, (), {}, None)
        if isinstance(tensor, FakeTensor):
            node.meta["val"] = self._alias(tensor)
        else:
            with self.fake_mode:
                node.meta["val"] = torch.empty_strided(
                    tensor.shape, tensor.stride(), device=tensor.device, dtype=tensor.dtype
                )
        return node

    def _fresh_qualname(self, prefix: str) -> str:
        """fx's ``Tracer.get_fresh_qualname``: ``prefix0``, ``prefix1``..., the first not on :attr:`root`."""
        qualname = f"{prefix}0"
        if not hasattr(self.root, qualname):
            self._qualname_counter[prefix] = 0
            return qualname
        i = self._qualname_counter[prefix]
        while True:
            qualname = f"{prefix}{i}"
            i += 1
            if not hasattr(self.root, qualname):
                break
        self._qualname_counter[prefix] = i
        return qualname


class _FakeWrapper:
    """``FakeTensor(fake_mode, elem, device)`` for a meta tensor ``elem``, without the constructor's Python work.

    The constructor checks its arguments, normalises the device and then sets a dozen attributes that are
    the same for every new fake tensor of the mode. Here the first tensor on each device is made by the
    constructor and its attributes are copied onto the next ones. Where ``Tensor._make_subclass`` does not
    take the constructor's arguments (another torch version) or the copy differs from the constructor's
    tensor, every tensor is made by the constructor.
    """

    def __init__(self, fake_mode: FakeTensorMode):
        self.fake_mode = fake_mode
        self._state: dict[torch.device, dict[str, Any]] = {}
        self._fast = True
        probe = torch.empty((2, 3), device="meta")
        device = torch.device("cpu")
        try:
            expected = FakeTensor(fake_mode, probe, device)
            self._state[device] = dict(expected.__dict__)
            made = self(probe, device)
            self._fast = (
                type(made) is FakeTensor
                and made.__dict__ == expected.__dict__
                and made.device == expected.device
                and made.untyped_storage()._cdata == expected.untyped_storage()._cdata
            )
        except (TypeError, RuntimeError):
            self._fast = False
        self._state.clear()

    def __call__(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        state = self._state.get(device) if self._fast else None
        if state is None:
            made = FakeTensor(self.fake_mode, elem, device)
            self._state[device] = dict(made.__dict__)
            return made
        made = torch.Tensor._make_subclass(
            FakeTensor, elem, False, dispatch_device=True, device_for_backend_keys=device
        )
        if self.fake_mode._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(made)
        else:
            torch._C._set_throw_on_mutable_data_ptr(made)
        made.__dict__.update(state)
        return made


def _get_proxy_mode() -> TorchDispatchMode | None:
    return torch._C._get_dispatch_mode(_PROXY)


@contextlib.contextmanager
def _proxy_mode_unset() -> Iterator[None]:
    dormant = torch._C._unset_dispatch_mode(_PROXY)
    try:
        yield
    finally:
        if dormant is not None:
            torch._C._set_dispatch_mode(dormant)


def _has_fake(values: Any) -> bool:
    """Whether a fake tensor is among ``values`` or in a list or tuple among them."""
    for value in values:
        kind = type(value)
        if kind is FakeTensor or ((kind is list or kind is tuple) and _has_fake(value)):
            return True
    return False


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, nested in lists, tuples and dicts, in order."""
    found: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif type(item) in (list, tuple):
            stack.extend(reversed(item))
        elif type(item) is dict:
            stack.extend(reversed(list(item.values())))
    return found
