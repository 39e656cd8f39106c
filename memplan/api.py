"""``memplan.optimize``: a module that plans itself on first call, per input signature.

Stages of a call
----------------
(1) Flatten the arguments and form the signature: structure, and per tensor its shape, strides, dtype,
    device and requires_grad; per parameter its dtype, device and requires_grad; ``training`` and
    grad mode.
(2) On a new signature: capture (seeded with tangents when training), run the pass pipeline under the
    policy, emit forward/backward modules, and cache the plan. A model that cannot be captured raises
    :class:`~memplan.errors.CaptureError`, or runs eagerly with a warning under ``fallback="eager"``.
(3) Run: the model's own parameters and buffers (fetched afresh, so ``.to()`` and optimizers keep
    working) plus the user's tensors go through the plan's autograd.Function (training) or its
    forward module (inference); the outputs are rebuilt in the user's structure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from memplan._capture.target import resolve_target
from memplan.analysis.cost import CostRates
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors, parameter_bytes
from memplan.capture import (
    TRACING, CapturedGraph, capture, check_leaves, is_static_leaf, leaf_paths, on_target, refuse_compiled,
)
from memplan.emit import Emitted, emit, run_inference, run_training
from memplan.errors import CaptureError, CompileFallbackWarning, TargetDeviceError, UnsupportedInputError
from memplan.measure import format_bytes
from memplan.graphutil import copy_graph, graph_device, mutated_args
from memplan.pipeline import PassManager, PassRecord, check_options, user_stacklevel
from memplan.policy import Policy
from memplan.verify import check_first_call, first_run_failure

__all__ = ["optimize", "OptimizedModule", "Plan", "DEFAULT_PIPELINE"]

#: Passes run when ``passes=None``; the empty pipeline only captures and emits. Rewrites first (they
#: remove broadcast copies chunking would otherwise carry), then chunking of huge reduced
#: intermediates (it finds a region's backward by sequence numbers, which recomputation would blur),
#: rematerialisation before in-place reuse (a node written in place joins an in-place unit that can
#: only be recomputed whole, so in-place first would leave remat fewer choices), checkpointing across
#: unrolled timesteps under the policy, concatenations filled part by part (after the recomputing
#: passes, which would see the buffer written slice by slice as a storage written after it is read),
#: and last the order with the lowest peak.
# timesteps before remat: remat's cut, taken first, recomputes an unrolled loop's cheap ops and leaves
# timesteps nothing it can checkpoint at a lower peak (a 2-layer LSTMCell loop: 1.38x lower than eager in
# that order, 3.65x in this one); on the examples this order is as low or lower.
# offload after the order is final: it places its copies and waits by position, and moves what the
# recomputing passes kept, only for a budget they did not meet cheaply, and only where there is a host
# tier (CUDA).
DEFAULT_PIPELINE: tuple[str, ...] = ("rewrite", "chunk", "timesteps", "remat", "inplace", "concat", "schedule",
                                     "offload")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What memplan decided for one input signature, with predicted bytes."""

    training: bool
    pipeline: str
    records: tuple[PassRecord, ...]
    eager_peak: int  # predicted peak of the model as written (eager lifetimes)
    planned_peak: int  # predicted peak of the emitted plan
    saved_bytes: int  # bytes crossing from forward to backward
    plan_seconds: float
    emitted: Emitted = dataclasses.field(repr=False)
    graph: CapturedGraph = dataclasses.field(repr=False)
    original: CapturedGraph = dataclasses.field(repr=False)  # as captured, before any pass
    eager_time: float = 0.0  # predicted seconds of eager's step, and of the plan's (memplan.analysis.cost)
    plan_time: float = 0.0

    def report(self, title: str = "memplan report"):
        """The memory report of this plan (before and after); ``.save_html(path)`` writes it."""
        from memplan.report.data import build_report

        return build_report(
            self.original, self.graph, records=self.records, title=title, parameter_bytes=parameter_bytes(self.original)
        )

    def to_snapshot(self, which: str = "plan") -> dict:
        """The predicted timeline of the plan (``which="plan"``) or of the model as written (``"eager"``) as
        the dictionary ``torch.cuda.memory._snapshot()`` returns (see :mod:`memplan.report.snapshot`)."""
        from memplan.report.snapshot import to_snapshot

        graphs = {"plan": self.graph, "eager": self.original}
        if which not in graphs:
            raise ValueError(f"which={which!r}: choose 'plan' (memplan's plan) or 'eager' (the model as written)")
        return to_snapshot(graphs[which], label=which)

    def save_snapshot(self, path: str, which: str = "plan") -> str:
        """Pickle :meth:`to_snapshot` to ``path``; open it at https://pytorch.org/memory_viz. Returns the path.
        ``memplan.report.snapshot.snapshot_paths(path)`` names a pair of files for both."""
        from memplan.report.snapshot import save_snapshot

        return save_snapshot(self.to_snapshot(which), path)

    @property
    def code(self) -> str:
        return self.emitted.code

    @property
    def device(self) -> torch.device:
        """The device the plan's tensors are on (its code makes them there)."""
        return graph_device(self.original)

    @property
    def overhead(self) -> float:
        """The plan's predicted step time over eager's, minus one (what ``max_overhead`` bounds)."""
        return self.plan_time / self.eager_time - 1.0 if self.eager_time > 0 else 0.0

    def headline(self) -> str:
        ratio = self.planned_peak / self.eager_peak if self.eager_peak else 1.0
        mode = "training" if self.training else "inference"
        return (
            f"{mode} plan: peak {format_bytes(self.eager_peak)} -> {format_bytes(self.planned_peak)} "
            f"({ratio:.1%}), predicted step time {1 + self.overhead:.2f}x eager's, saved for backward "
            f"{format_bytes(self.saved_bytes)}, planned in {self.plan_seconds:.2f} s"
        )

    def __str__(self) -> str:
        lines = [self.headline()]
        for r in self.records:
            change = "rolled back" if r.rolled_back is not None else "changed" if r.changed else "no change"
            lines.append(
                f"  {r.name:12s} {change:9s} peak {format_bytes(r.peak_before)} -> {format_bytes(r.peak_after)}, "
                f"{r.stats.nodes_rewritten} nodes rewritten, recompute +{r.stats.recompute_added:.1%}, {r.seconds:.3f} s"
            )
        if not self.records:
            lines.append("  (no passes: capture and emit only)")
        return "\n".join(lines)

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        table = Table(show_header=True)
        for column in ("pass", "changed", "peak before", "peak after", "nodes rewritten", "recompute", "seconds"):
            table.add_column(column)
        for r in self.records:
            table.add_row(
                r.name, "yes" if r.changed else "no", format_bytes(r.peak_before), format_bytes(r.peak_after),
                str(r.stats.nodes_rewritten), f"+{r.stats.recompute_added:.1%}", f"{r.seconds:.3f}",
            )
        return Group(self.headline(), table)


def _static_key(value: Any) -> tuple:
    """How a plain argument value keys its plan: equal values, one plan. Floats and complex numbers by
    their text, so that a NaN finds its plan again and -0.0 is not 0.0."""
    if not is_static_leaf(value):
        return ("py", type(value))  # capture refuses it, naming the argument
    if isinstance(value, (float, complex)):
        return ("py", type(value), repr(value))
    return ("py", type(value), value)


# Plans for one set of tensor shapes that differ only in plain argument values before memplan warns that
# a value probably changes every call (each new value is planned again, in seconds).
VALUE_PLANS_WARNING = 8

#: Plans an optimized module keeps by default (``optimize(..., max_plans=)``), least recently used dropped
#: first. A plan holds the model's graphs as captured and as planned, with their analyses and code (megabytes
#: for a large model), and a model fed a new shape at every call (a sequence length per batch) would keep
#: one per call, without bound. 32 keeps a training and an evaluation plan for each of 16 shape buckets.
MAX_PLANS = 32

# Capture and planning, of any module, one at a time: a capture swaps the model's parameters for fake
# tensors while it traces, and patches process-wide functions (Python's random, Tensor.register_hook).
# The lock capture itself takes (one lock, so no two threads take the two in opposite orders); reentrant,
# as a model may hold an optimized module, which plans inside the parent's trace. Always taken before a
# module's own lock (``OptimizedModule._lock``), never after, so two threads cannot deadlock.
_PLANNING = TRACING
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class _Walk:
    """A module's submodules, parameters and buffers, as ``modules()``, ``parameters()`` and
    ``buffers()`` give them (each once, in their order), gathered in one walk: every call of an
    optimized module reads them to find its plan, and torch's generators walk the tree once each."""

    modules: list[nn.Module]
    parameters: list[torch.Tensor]
    buffers: list[torch.Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> "_Walk":
        modules: list[nn.Module] = []
        seen: set[int] = set()
        stack = [model]
        while stack:  # depth first, children in order, a module met again skipped with its subtree
            module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            modules.append(module)
            stack.extend(m for m in reversed(module._modules.values()) if m is not None)
        if not all(map(_iterates_as_torch, {type(m) for m in modules})):
            # a class of the user's lists its members its own way: capture asked it, so ask it too
            return cls(list(model.modules()), [p for _, p in model.named_parameters(remove_duplicate=True)],
                       [b for _, b in model.named_buffers(remove_duplicate=True)])
        return cls(modules, _members(modules, "_parameters"), _members(modules, "_buffers"))


# nn.Module's methods that list a module's submodules, parameters and buffers (what :class:`_Walk` does)
_ITERATORS = ("modules", "named_modules", "children", "named_children", "parameters", "named_parameters",
              "buffers", "named_buffers", "_named_members")
_TORCH_ITERATION: dict[type, bool] = {}


def _iterates_as_torch(kind: type) -> bool:
    """Whether the module class ``kind`` keeps nn.Module's own ways of listing its members."""
    found = _TORCH_ITERATION.get(kind)
    if found is None:
        found = _TORCH_ITERATION[kind] = all(getattr(kind, name) is getattr(nn.Module, name) for name in _ITERATORS)
    return found


def _members(modules: Sequence[nn.Module], attribute: str) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in modules:
        for value in getattr(module, attribute).values():
            if value is not None and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
    return found


_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)
_POSITIONAL_SPECS: dict[int, pytree.TreeSpec] = {}


def _flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], pytree.TreeSpec]:
    """``pytree.tree_flatten((args, kwargs))``, with a shortcut for the usual call (positional plain
    tensors only), whose structure depends only on how many there are: pytree's walk costs more than
    many small models' forward."""
    if not kwargs and all(type(a) in _PLAIN_TENSOR_TYPES for a in args):
        spec = _POSITIONAL_SPECS.get(len(args))
        if spec is None:
            spec = _POSITIONAL_SPECS[len(args)] = pytree.tree_flatten((tuple(range(len(args))), {}))[1]
        return list(args), spec
    return pytree.tree_flatten((args, kwargs))


def _signature(model: Any, leaves: Sequence[Any], spec: pytree.TreeSpec, walk: _Walk | None = None) -> tuple:
    """The key of a call's plan; ``walk`` is the model's (:class:`_Walk`), when it is a module."""
    tensors = tuple(
        (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.requires_grad and t.is_leaf, t.layout)
        if isinstance(t, torch.Tensor)
        else _static_key(t)
        for t in leaves
    )
    params: tuple = ()
    state: tuple = ()
    if isinstance(model, nn.Module):
        walk = walk if walk is not None else _Walk.of(model)
        params = tuple((tuple(p.shape), p.dtype, p.device, p.requires_grad) for p in walk.parameters)
        params += tuple((tuple(b.shape), b.dtype, b.device) for b in walk.buffers)
        state = tuple(_module_state_key(m) for m in walk.modules)
    autocast = tuple((kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind))
    autocast += (torch.is_autocast_cache_enabled(),)  # casts cached once per block, or made at every use
    return (spec, tensors, params, state, torch.is_grad_enabled(), autocast)


# A module's attributes that hold its hooks: a hook registered after planning must be planned with.
_HOOK_ATTRIBUTES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# The attributes every module has (its parameters, buffers, submodules, hooks and mode): never a plain
# value of the user's, so the key does not look at each of them on every call.
_MODULE_ATTRIBUTES = frozenset(vars(nn.Module()))


def _checked_signature(model: Any, leaves: Sequence[Any], spec: pytree.TreeSpec, walk: "_Walk | None",
                       call: tuple[tuple, dict]) -> tuple:
    """:func:`_signature` of a call, or the error that names the tensor it cannot key."""
    try:
        return _signature(model, leaves, spec, walk)
    except RuntimeError:  # a tensor without sizes or strides (sparse, nested): the check names it
        check_leaves(leaves, leaf_paths(call))
        raise


def _module_state_key(module: nn.Module) -> tuple:
    """What of a module the traced code may have read besides tensors, so that a plan is made again
    when it changes: its mode, its plain attribute values (``self.scale = 2.0``, ``self.residual =
    False``, set after planning) and its hooks. A plan runs the graph, not the module's Python, so it
    would otherwise keep the values it was traced with."""
    values = vars(module)
    plain, tensors = [], []
    for name, value in values.items():
        if name in _MODULE_ATTRIBUTES:
            continue
        if is_static_leaf(value):
            plain.append((name, _static_key(value)))
        elif isinstance(value, torch.Tensor):
            # a plain tensor attribute (not a parameter or buffer) is a constant of the plan: another
            # tensor assigned to it is planned again (one changed in place is read as it is)
            tensors.append((name, _Identity(value)))
    hooks = tuple(tuple(values[name]) for name in _HOOK_ATTRIBUTES if values.get(name))
    return (module.training, tuple(plain), tuple(tensors), hooks)


def _names_only(entry: tuple) -> tuple:
    """A module's part of a plan key (:func:`_module_state_key`) with its attributes' names, not their
    values: the calls a value that changes every call plans again share it."""
    training, plain, tensors, hooks = entry
    return training, tuple(name for name, _ in plain), tuple(name for name, _ in tensors), hooks


class _Identity:
    """An object compared by identity in a plan key; holding it keeps its id from being reused."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


class OptimizedModule(nn.Module):
    """The module ``memplan.optimize`` returns. Same parameters, outputs and gradients as the original."""

    def __init__(
        self,
        model: nn.Module | Callable[..., Any],
        *,
        policy: Policy,
        passes: Sequence[str],
        fallback: str | None,
        options: Mapping[str, Any] | None = None,
        max_plans: int = MAX_PLANS,
        verify: bool = False,
        rates: CostRates | str | None = None,
        device: torch.device | str | None = None,
        inductor: bool = False,
    ):
        super().__init__()
        target = resolve_target(device)  # an unknown device is refused here, before any call
        if fallback not in (None, "eager"):
            raise ValueError(f'fallback must be None or "eager", not {fallback!r}')
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            raise ValueError(f"max_plans must be a positive int, not {max_plans!r}")
        if isinstance(model, nn.Module):
            self.model = model
        else:
            self._function = model
        self.policy = policy
        self.passes = tuple(passes)
        self.fallback = fallback
        self.options = dict(options or {})
        self.rates = rates
        #: The device plans are made for (None: where each call's tensors are); see :func:`optimize`. (Not
        #: ``device``: a model's own ``.device``, which many have, reads through this module.)
        self.target_device = target.device if target is not None else None
        self.max_plans = max_plans
        #: Whether each plan's forward and backward run as Inductor's compiled code (see :mod:`memplan.inductor`).
        self.inductor = bool(inductor)
        # check each signature's first call against eager (memplan.verify); private, not to hide a `verify`
        # of the model's, which reads through this module
        self._verify = bool(verify)
        # per signature, least recently used first (None: the signature runs eagerly, under fallback="eager")
        self._plans: OrderedDict[tuple, Plan | None] = OrderedDict()
        # plain-value keys per tensor shapes (see _warn_if_values_vary)
        self._value_plans: OrderedDict[tuple, list[tuple]] = OrderedDict()
        self._last: Plan | None = None
        self._evicted = False  # whether a plan was dropped yet (warned once)
        # Held while a call reads the model to find its plan, and while it plans: a capture swaps the model's
        # parameters for fake tensors, which another thread's call must not read meanwhile.
        self._lock = threading.RLock()
        self.plans_built = 0
        # Inside a bigger model, the parent's state_dict() asks this module's (which gives the original's
        # keys) but its load_state_dict() walks into ``model``: its keys are read under either name.
        self._register_load_state_dict_pre_hook(_keys_of_the_original, with_module=True)

    # -- delegation: the optimized module *is* the model for checkpoints ------------------------

    def __getattr__(self, name: str) -> Any:
        """Attributes of the original module (``opt.encoder``, ``opt.config``) read through this one."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("__"):
                raise
            return getattr(model, name)

    def __getstate__(self) -> dict[str, Any]:
        """Copies (``copy.deepcopy``, ``pickle``, ``torch.save``) keep the model and the settings, not the
        plans: a plan holds fake tensors and compiled code, and is made again on the copy's first call."""
        state = self.__dict__.copy()
        state.update(_plans=OrderedDict(), _value_plans=OrderedDict(), _last=None, _evicted=False)
        state.pop("_lock", None)  # a lock cannot be copied: each copy makes its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("max_plans", MAX_PLANS)
        self.__dict__.setdefault("target_device", None)
        self.__dict__.setdefault("inductor", False)
        self._lock = threading.RLock()

    @property
    def original(self) -> nn.Module | Callable[..., Any]:
        return self._modules["model"] if "model" in self._modules else self._function

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        original = self.original
        if isinstance(original, nn.Module):
            return original.state_dict(*args, **kwargs)
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        original = self.original
        if isinstance(original, nn.Module):
            return original.load_state_dict(state_dict, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # -- planning ---------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The plan of the most recent call (None before the first call)."""
        return self._last

    def report(self, title: str | None = None):
        """The memory report of the most recent plan: timelines before and after, passes, graph."""
        if self._last is None:
            raise RuntimeError("nothing is planned yet: call the module once first")
        name = type(self.original).__name__ if isinstance(self.original, nn.Module) else getattr(self.original, "__name__", "model")
        return self._last.report(title or f"memplan report: {name}")

    @property
    def code(self) -> str:
        """Readable generated code of the most recent plan's forward and backward."""
        if self._last is None:
            raise RuntimeError("nothing is planned yet: call the module once first")
        return self._last.code

    def _build_plan(self, args: tuple, kwargs: dict, passes: Sequence[str] | None = None) -> Plan:
        # Planning builds hundreds of thousands of small objects (nodes, metadata, analyses) and frees
        # few: the cyclic collector would walk them again and again (seconds on a 1000-step loop).
        with _collector_paused():
            return self._build_plan_unpaused(args, kwargs, self.passes if passes is None else tuple(passes))

    def _build_plan_unpaused(self, args: tuple, kwargs: dict, passes: tuple[str, ...]) -> Plan:
        if not self.inductor:
            return self._planned(args, kwargs, passes, inductor=False)
        from memplan import inductor

        try:
            return self._planned(args, kwargs, passes, inductor=True)
        except inductor.InductorFailed as failed:
            # memplan's own code, as planned without inductor=True (its default pipeline for the default,
            # without the options inductor=True sets)
            ordinary = DEFAULT_PIPELINE if passes == inductor.PIPELINE else passes
            warnings.warn(CompileFallbackWarning(
                f"inductor=True: {failed}; this signature runs as memplan's own code, op by op, planned with "
                f"passes={','.join(ordinary)!r}: the same values, its kernels not fused.",
                module=failed.module, reason=failed.reason), stacklevel=user_stacklevel())
            return self._planned(args, kwargs, ordinary, inductor=False)

    def _planned(self, args: tuple, kwargs: dict, passes: tuple[str, ...], inductor: bool) -> Plan:
        start = time.perf_counter()
        original = self.original
        graph = capture(original, *args, seed="tangents", target_device=self.target_device, **kwargs)
        captured = AnalysisManager(graph)
        _check_mutations(graph, captured)
        eager_peak = captured.get(PeakSimulation).peak
        # Passes edit the graph they are given; keep the captured one intact for reports. The copy has the
        # captured graph's nodes and fake values, so its tensor facts are the captured ones.
        options = self.options
        if inductor:
            from memplan.inductor import OPTIONS

            options = {**OPTIONS, **options}  # the user's own settings win
        result = PassManager(passes, self.policy, options=options, rates=self.rates).run(
            copy_graph(graph), known={Tensors: captured.get(Tensors)}, pristine=graph)
        # The pipeline hands over the analyses of its last graph (computing them again took seconds).
        analyses = result.graph_analyses()
        planned_peak = analyses.get(PeakSimulation).peak
        # A plan for a device traced on a stand-in (CUDA without a GPU) has its values moved there now, after
        # the passes, whose own traces run autograd over the values: its code makes its tensors there.
        planned, graph = on_target(result.graph), on_target(graph)
        emitted = emit(planned)
        if inductor:
            from memplan.inductor import compile_emitted

            emitted = compile_emitted(emitted)
        tensors = analyses.get(Tensors)
        saved_storages = {sid for name in emitted.saved for sid in tensors.storages_of(name) if not tensors.storages[sid].external}
        saved_bytes = sum(tensors.storages[sid].nbytes for sid in saved_storages)
        self.plans_built += 1
        return Plan(
            training=graph.training,
            pipeline=",".join(passes),
            records=result.records,
            eager_peak=eager_peak,
            planned_peak=planned_peak,
            saved_bytes=saved_bytes,
            plan_seconds=time.perf_counter() - start,
            emitted=emitted,
            graph=planned,
            original=graph,
            eager_time=result.eager_time,
            plan_time=result.plan_time,
        )

    # -- running ----------------------------------------------------------------------------------

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan of the call ``self(*args, **kwargs)``, made (or found) without running anything: capture,
        the passes and the emitted code, for the module's ``target_device``. It is kept, and is :attr:`plan`
        after.

        With ``optimize(model, device="cuda")`` this plans for a GPU on a machine without one: the model
        and inputs may be on the CPU or the meta device; read the plan (``planned_peak``, ``code``,
        ``report()``), since it runs only on the device it was made for. Planning errors are raised
        whatever ``fallback`` says, and ``verify`` does not apply (nothing runs).

        Examples
        --------
        >>> opt = optimize(torch.nn.Linear(4, 2), device="cuda")  # on any machine
        >>> plan = opt.plan_for(torch.randn(3, 4))
        >>> plan.device, plan.planned_peak % 512  # CUDA's allocator hands out 512-byte blocks
        (device(type='cuda', index=0), 0)
        """
        original = self.original
        leaves, spec = _flatten_call(args, kwargs)
        with _PLANNING, self._lock:
            walk = _Walk.of(original) if isinstance(original, nn.Module) else None
            key = (_checked_signature(original, leaves, spec, walk, (args, kwargs)), "planned, not run",
                   self.target_device)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._build_plan(args, kwargs)
                self._keep(key, plan)
            else:
                self._plans.move_to_end(key)
            self._last = plan
            return plan

    def _check_on_device(self, original: Any, leaves: Sequence[Any], call: tuple[tuple, dict]) -> None:
        """Raise :class:`TargetDeviceError` when a tensor of the call, or a parameter or buffer of the model, is
        not on the device the module plans for."""
        device = self.target_device
        found = [(path, leaf.device) for path, leaf in zip(leaf_paths(call), leaves)
                 if isinstance(leaf, torch.Tensor) and leaf.device != device]
        if isinstance(original, nn.Module) and not found:
            members = [*original.named_parameters(), *original.named_buffers()]
            found = [(name, t.device) for name, t in members if t.device != device]
        if found:
            where, elsewhere = found[0]
            raise TargetDeviceError(
                f"this module plans for {device} (memplan.optimize(..., device={str(device)!r})), and its plans run "
                f"only there; {where} is on {elsewhere}. Fix: move the model and inputs to {device} "
                f"(model.to({str(device)!r})); to read a plan without running it (where there is no such device), "
                "call plan_for(*inputs) instead; or optimize without device= to plan for where the tensors are.")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        original = self.original
        leaves, spec = _flatten_call(args, kwargs)
        if self.target_device is not None:
            self._check_on_device(original, leaves, (args, kwargs))
        with self._lock:
            found = self._lookup(original, leaves, spec, (args, kwargs), plan=False)
        if found is None:  # a new signature: planned once, whichever threads call (see _PLANNING)
            with _PLANNING, self._lock:
                found = self._lookup(original, leaves, spec, (args, kwargs), plan=True)
        plan, flat = found
        if plan is None:
            with _PLANNING, self._lock:  # the model's Python reads the parameters that a capture swaps
                return original(*args, **kwargs)
        if plan.training:
            outputs = run_training(plan.emitted, flat)
        else:
            outputs = run_inference(plan.emitted, flat)
        for index, value in plan.emitted.constant_outputs:
            outputs[index] = value
        return pytree.tree_unflatten(outputs, plan.graph.out_spec)

    def _lookup(self, original: Any, leaves: Sequence[Any], spec: pytree.TreeSpec, call: tuple[tuple, dict],
                plan: bool) -> tuple[Plan | None, list[torch.Tensor] | None] | None:
        """``(plan, flat inputs)`` for the call (a None plan runs eagerly, under ``fallback="eager"``);
        without a plan for its signature, one is made when ``plan`` is true, else None is returned. Called
        under the module's lock, which ``plan`` needs :data:`_PLANNING` taken before."""
        walk = _Walk.of(original) if isinstance(original, nn.Module) else None
        key = _checked_signature(original, leaves, spec, walk, call)
        found = self._plans.get(key, _MISSING)
        if found is _MISSING:
            if not plan:
                return None
            found = self._plan_signature(key, call)
        else:
            self._plans.move_to_end(key)  # the most recently used, dropped last
        self._last = found
        return found, (self._flat_inputs(leaves, walk) if found is not None else None)

    def _plan_signature(self, key: tuple, call: tuple[tuple, dict]) -> Plan | None:
        """Plan a new signature and keep the plan, dropping the least recently used beyond ``max_plans``.
        Nothing is kept when planning fails or is interrupted: the next call of the signature plans again."""
        self._warn_if_values_vary(key, call)
        try:
            plan = self._build_plan(*call)
            walk = _Walk.of(self.original) if isinstance(self.original, nn.Module) else None
            if self._verify:  # the plan that matches eager on this call (see memplan.verify)
                plan = check_first_call(self, plan, *call, state=self._flat_inputs([], walk))
            elif self.fallback == "eager":  # a plan that fails to run runs eagerly too (see memplan.verify)
                failure = first_run_failure(self, plan, *call, state=self._flat_inputs([], walk))
                if failure is not None:
                    warnings.warn(
                        f"memplan runs this input signature eagerly (fallback='eager'): its plan raised "
                        f"{type(failure).__name__} on a trial run of this call: {failure}. This is memplan's "
                        "failure, not your model's: please report it with the model, or the reproducer of "
                        "memplan.pipeline.save_reproducer.", stacklevel=user_stacklevel())
                    plan = None
        except (CaptureError, UnsupportedInputError) as exc:
            if self.fallback != "eager":
                raise
            warnings.warn(f"memplan runs this model eagerly (fallback='eager'): {exc}", stacklevel=user_stacklevel())
            plan = None
        self._keep(key, plan)
        return plan

    def _keep(self, key: tuple, plan: Plan | None) -> None:
        """Keep ``plan`` under ``key``, dropping the least recently used plans beyond ``max_plans``."""
        while len(self._plans) >= self.max_plans:
            self._plans.popitem(last=False)
            self._warn_evicted()
        self._plans[key] = plan

    def _warn_evicted(self) -> None:
        """Warn, once per module, that a plan was dropped to keep ``max_plans``."""
        if self._evicted:
            return
        self._evicted = True
        original = self.original
        name = type(original).__name__ if isinstance(original, nn.Module) else getattr(original, "__qualname__", "model")
        warnings.warn(
            f"memplan has planned {name} for {self.max_plans} input signatures (shapes, dtypes, devices, "
            f"train/eval, grad mode) and keeps at most max_plans={self.max_plans}: it drops the least recently "
            "used plan, and a signature seen again is planned again, which takes seconds. Plans are made for "
            "fixed shapes (dimensions that vary are not supported). Fix: bucket the shapes, padding inputs to a "
            "few sizes (round the sequence length or batch size up to a multiple of 64, and mask the padding), "
            f"or raise the bound (memplan.optimize(model, max_plans={2 * self.max_plans})) if memory allows.",
            stacklevel=user_stacklevel(),
        )

    def _warn_if_values_vary(self, key: tuple, call: tuple[tuple, dict]) -> None:
        """Warn once per set of tensor shapes when plain values, of the call's arguments or of the
        modules' attributes (``self.alpha``, a schedule the training loop sets), have made
        :data:`VALUE_PLANS_WARNING` plans of it: a value that changes every call replans every call."""
        spec, per_leaf, params, state, *rest = key
        shapes = (spec, tuple(k[:2] if k and k[0] == "py" else k for k in per_leaf), params,
                  tuple(_names_only(entry) for entry in state), *rest)
        seen = self._value_plans.setdefault(shapes, [])
        self._value_plans.move_to_end(shapes)
        while len(self._value_plans) > self.max_plans:  # bounded as the plans are
            self._value_plans.popitem(last=False)
        if (per_leaf, state) in seen or len(seen) >= VALUE_PLANS_WARNING:
            return  # planned again after its plan was dropped or planning failed; or warned already
        seen.append((per_leaf, state))
        if len(seen) != VALUE_PLANS_WARNING:
            return
        arguments = [path for i, path in enumerate(leaf_paths(call)) if len({leaves[i] for leaves, _ in seen}) > 1]
        attributes = []
        modules = [name for name, _ in self.original.named_modules()] if isinstance(self.original, nn.Module) else []
        for j, module in zip(range(len(state)), modules):  # the key's modules, in named_modules() order
            for kind in (1, 2):  # plain values, then plain tensors
                for i, (name, _) in enumerate(seen[0][1][j][kind]):
                    if len({states[j][kind][i][1] for _, states in seen}) > 1:
                        attributes.append(f"{module}.{name}" if module else name)
        fixes = []
        if arguments:
            fixes.append("pass a value that changes from call to call as a tensor (torch.tensor(value))")
        if attributes:
            fixes.append("keep an attribute that changes from call to call in a buffer "
                         "(self.register_buffer(name, torch.tensor(value)), then .fill_(new_value)), which is "
                         "read as a tensor, not planned as a constant")
        warnings.warn(
            f"memplan has planned this model {len(seen)} times for the same tensor shapes, once per value of "
            f"{', '.join(arguments + attributes)}: each new value is a new plan, which takes seconds, and each "
            f"plan is kept (up to max_plans={self.max_plans}). Fix: {'; '.join(fixes)}.",
            stacklevel=user_stacklevel(),
        )

    @staticmethod
    def _flat_inputs(leaves: Sequence[Any], walk: _Walk | None) -> list[torch.Tensor]:
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]  # plain values are in the plan
        if walk is not None:
            return [*walk.parameters, *walk.buffers, *tensors]
        return tensors


def _keys_of_the_original(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A load-state-dict pre-hook of :class:`OptimizedModule`: the keys under ``prefix`` that name the
    original's entries without ``model.`` (what the module's state_dict() gives) are renamed to the
    module's own, in place (``load_state_dict`` hands its hooks a copy)."""
    if "model" not in module._modules:
        return
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        renamed = inner + key[len(prefix):]
        if renamed not in state_dict:
            state_dict[renamed] = state_dict.pop(key)


def _check_mutations(graph: CapturedGraph, am: AnalysisManager | None = None) -> None:
    """In-place writes to inputs that require grad cannot go through one autograd.Function. A plan
    for inference runs outside autograd and writes where eager does (``nn.Embedding(max_norm=...)``
    renormalises the rows it reads in its weight, as eager does under ``torch.no_grad()``)."""
    if not graph.training:
        return
    tensors = (am or AnalysisManager(graph)).get(Tensors)
    owner = {}
    for spec in graph.inputs:
        for sid in tensors.storages_of(spec.node):
            owner[sid] = spec
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        for target in mutated_args(node):
            for sid in tensors.storages_of(target.name):
                spec = owner.get(sid)
                if spec is None or not spec.requires_grad:
                    continue
                source = graph.sources.get(node.name)
                where = f" at {source}" if source else ""
                if node.target is torch.ops.aten.embedding_renorm_.default:
                    # inside F.embedding, under no_grad: nothing in the user's code is out of place to write
                    fix = (f"construct the embedding without max_norm and renormalise the rows a batch reads "
                           f"before calling the model, as F.embedding does (with torch.no_grad(): "
                           f"torch.embedding_renorm_({spec.path}, ids, max_norm, norm_type)), which gives the "
                           'same results; or pass fallback="eager".')
                    raise CaptureError(
                        f"the model's nn.Embedding(max_norm=...) renormalises the rows it reads in place in "
                        f"{spec.kind} '{spec.path}', which requires grad ({node.format_node()}){where}. memplan "
                        f"cannot plan in-place updates of differentiable inputs in training. Fix: {fix}"
                    )
                if spec.kind == "parameter":  # a weight update (under no_grad), on the parameter or a view of it
                    fix = (f"update the parameter outside the forward, before or after calling the model "
                           f"(with torch.no_grad(): model.{spec.path}.mul_(...)), as an optimizer does; keep a value "
                           "the forward updates in a buffer (register_buffer), which memplan plans; or use the "
                           'out-of-place op; or pass fallback="eager".')
                else:
                    fix = 'use the out-of-place op (e.g. x = x + y), or pass fallback="eager".'
                raise CaptureError(
                    f"the model writes in place into {spec.kind} '{spec.path}', which requires grad "
                    f"({node.format_node()}){where}. memplan cannot plan in-place updates of differentiable "
                    f"inputs in training (one autograd function runs the plan). Fix: {fix}"
                )


@contextlib.contextmanager
def _collector_paused():
    """Pause Python's cyclic garbage collector, restoring its previous state after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def optimize(
    model: nn.Module | Callable[..., Any],
    *,
    budget: int | float | str | None = None,
    max_overhead: float = 0.3,
    passes: str | Sequence[str] | None = None,
    fallback: str | None = None,
    options: Mapping[str, Any] | None = None,
    max_plans: int = MAX_PLANS,
    verify: bool = False,
    rates: CostRates | str | None = None,
    device: torch.device | str | None = None,
    inductor: bool = False,
) -> OptimizedModule:
    """Wrap ``model`` so that each call runs a memory-planned version of it.

    Nothing happens until the first call, which captures the model for that input signature, runs
    the pass pipeline under the policy and emits the plan; later calls with the same signature reuse it.

    Parameters
    ----------
    model : nn.Module or callable
    budget : int, float or str, optional
        Hard limit on the predicted peak of a step: bytes (``"2GiB"``, ``2**31``), or a fraction of the
        model's own predicted peak (``0.5``, ``"50%"``), worked out for each input signature. See
        :func:`memplan.policy.parse_budget`.
    max_overhead : float
        Without a budget: the lowest peak whose predicted step time is at most ``1 + max_overhead`` times
        eager's (default 0.3), the whole plan's, from the time model (:mod:`memplan.analysis.cost`).
    passes : str or sequence of str, optional
        Pipeline, e.g. ``"inplace,schedule"``; ``""`` for none; None for the default pipeline.
    fallback : {None, "eager"}
        Run models that cannot be captured eagerly, with a warning, instead of raising.
    options : mapping, optional
        Pass options, named ``"<pass>.<option>"`` (each pass documents its own).
    max_plans : int
        Plans kept, one per input signature (default :data:`MAX_PLANS`); beyond it the least recently
        used is dropped, with a warning the first time.
    verify : bool
        Check the first call of each signature against the model run eagerly on copies of the same
        tensors, from the same RNG state: outputs, buffers after the call, and in training the
        gradients of every argument and parameter that requires grad (taken with
        ``torch.autograd.grad``, so ``.grad`` is left alone). On a difference the pass to blame is
        rolled back (a :class:`~memplan.errors.PassRolledBackWarning`), and the call returns the
        results of the plan without it. Costs an eager run and a second run of the plan on that call;
        skipped, with a warning, where the eager run would not fit in the GPU's free memory.
    rates : CostRates or {"reference", "calibrated"}, optional
        The time model's rates (:func:`memplan.analysis.cost.rates_for`): None takes the environment's
        ``MEMPLAN_RATES``, else the reference rates (the same plan on every machine).
    device : torch.device or str, optional
        Plan for this device (``"cuda"``) wherever the model and inputs are: on a machine without a GPU,
        ``opt.plan_for(*inputs)`` makes the plan for CUDA over fake tensors (its peaks counted as CUDA's
        caching allocator counts them, its code making every tensor on ``cuda:0``), to read rather than run;
        calling the module then raises :class:`~memplan.errors.TargetDeviceError` unless its tensors are on
        that device. See :mod:`memplan._capture.target` for what is planned as CUDA runs it and what is
        refused. None (the default): plan for the device of each call's tensors.
    inductor : bool
        Run each plan's forward and backward as code compiled by Inductor (torch.compile's compiler, its
        fused kernels) instead of memplan's op-by-op code: memplan still decides what the step saves and
        recomputes. The default pipeline is then :data:`memplan.inductor.PIPELINE` (the passes that only
        order and reuse buffers are Inductor's business), and dropout's noise is kept, not drawn again.
        Both compile while the signature is planned; where Inductor cannot compile them, the signature is
        planned again without it, with a :class:`~memplan.errors.CompileFallbackWarning`. See :mod:`memplan.inductor`.

    Notes
    -----
    A pass that raises or breaks an invariant the pipeline verifies (graph lint, forward/backward
    order, in-place writes clobbering a value read later) is rolled back: the plan is made without its
    change, and a :class:`~memplan.errors.PassRolledBackWarning` names the pass, what broke, the
    user's line involved and a saved reproducer (``opt.plan.records`` mark it ``rolled_back``). Inside
    ``memplan.pipeline.pass_failures("raise")`` it raises :class:`~memplan.errors.PassError` instead.

    Examples
    --------
    >>> import torch
    >>> lin = torch.nn.Linear(4, 2)
    >>> opt = optimize(lin, passes="")
    >>> x = torch.randn(3, 4)
    >>> torch.allclose(opt(x), lin(x))
    True
    """
    from memplan.pipeline import parse_pipeline

    refuse_compiled(model, "memplan.optimize(model)")
    if inductor:
        from memplan import inductor as compiled

        names = parse_pipeline(compiled.PIPELINE if passes is None else passes)
        compiled.refuse_pipeline(names)
    else:
        names = parse_pipeline(DEFAULT_PIPELINE if passes is None else passes)
    check_options(options or {})
    return OptimizedModule(
        model, policy=Policy(budget=budget, max_overhead=max_overhead), passes=names, fallback=fallback,
        options=options, max_plans=max_plans, verify=verify, rates=rates, device=device, inductor=inductor,
    )
