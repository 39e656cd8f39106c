"""``optimize(..., verify=True)``: the first call of each input signature checked against eager.

Stages of a check (:func:`check_first_call`)
--------------------------------------------
(1) Room. The eager copy must fit: on CUDA, the model's predicted eager peak plus copies of the
    call's tensors within the device's free memory (``torch.cuda.mem_get_info``, plus what the
    caching allocator holds unused); otherwise the check is skipped with a one-line
    :class:`~memplan.errors.VerificationWarning`. On CPU there is no such bound, and it runs.
(2) Reference. The RNG state (CPU and CUDA) and the state the call may change (buffers, and any
    parameter the graph writes in place) are saved; the untouched model runs on copies of the call's
    tensors (same strides, storage offsets and aliasing). In training, ``torch.autograd.grad`` of its
    differentiable outputs, with a fixed random upstream gradient, gives the gradient of every
    argument that requires grad and every parameter that does, leaving every ``.grad`` as it was.
    Kept: outputs, gradients, and the changed state and tensor copies after the call.
(3) Check. RNG and state restored, the plan runs the same way on fresh copies, and each output,
    gradient and state tensor is compared with eager's (:func:`first_difference`, whose tolerance is
    :func:`memplan.testing.assert_equivalent`'s).
(4) Blame. On a difference, the pipeline is planned again without one of the passes that changed
    the graph at a time, last first; the first plan that matches eager is kept, and a
    :class:`~memplan.errors.PassRolledBackWarning` names the pass, the first output or gradient that
    differed and a saved reproducer (the captured graph and the pipeline up to that pass). When no
    single pass explains it, the plan without any pass is tried, and when even that differs (capture
    or emit, not a pass) the signature runs eagerly, with a
    :class:`~memplan.errors.VerificationWarning`. Under ``pass_failures("raise")`` (memplan's
    tests) a difference raises :class:`~memplan.errors.PassError` instead.
(5) RNG and state are restored once more, so the call itself, which the optimized module then runs
    on the user's tensors with the plan chosen, draws the random numbers eager draws and updates the
    buffers once; the user's own backward runs on it as on any call.

A plan replanned without a pass is planned under the same policy: under a budget it may be refused
(:class:`~memplan.errors.InfeasibleBudgetError`), and that pass is then not taken as the culprit.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, _raised_by_user_code
from memplan.emit import run_inference, run_training
from memplan.equivalence import assert_equivalent
from memplan.errors import MemplanError, PassError, PassRolledBackWarning, VerificationWarning
from memplan.graphutil import mutated_args
from memplan.measure import format_bytes
from memplan.pipeline import PassRecord, PassStats, failure_mode, save_reproducer, user_stacklevel

__all__ = ["check_first_call", "first_difference", "first_run_failure"]

#: Seed of the fixed upstream gradient both runs take (a torch.Generator of its own: the global RNG
#: is the model's).
UPSTREAM_SEED = 0


def first_difference(expected: Sequence[tuple[str, Any]], actual: Sequence[Any],
                     terms: int | None = None) -> str | None:
    """The first of the named values ``expected`` that ``actual`` does not match, and how; None when
    all match. Tensors are compared by :func:`memplan.testing.assert_equivalent`, one family at a time
    (the outputs, the gradients, the state after the call: its tolerance scales with each family's
    magnitude), ``terms`` being the length of the longest sum the plan may reorder (by default the
    largest dimension among the tensors compared); other values with ``==``. A value's family is the
    first word of its name.

    Examples
    --------
    >>> first_difference([("output 0", torch.ones(2))], [torch.ones(2)]) is None
    True
    >>> first_difference([("output 0", torch.ones(2)), ("gradient of w", torch.ones(2))],
    ...                  [torch.ones(2), torch.zeros(2)])  # doctest: +ELLIPSIS
    'gradient of w differs: 2 of 2 elements differ by more than ...'
    """
    if len(expected) != len(actual):
        return f"eager gives {len(expected)} values where the plan gives {len(actual)}"
    families: dict[str, list[int]] = {}
    for i, ((name, a), b) in enumerate(zip(expected, actual)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            families.setdefault(name.split(" ", 1)[0], []).append(i)
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            return f"{name} differs: eager gives {_short(a)}, the plan {_short(b)}"
    for members in families.values():
        reference = [expected[i][1] for i in members]
        planned = [actual[i] for i in members]
        try:
            assert_equivalent(lambda: reference, lambda: planned, grad=False, terms=terms)
        except AssertionError as exc:
            first = str(exc).splitlines()[0]
            found = re.match(r"output (\d+) differs(.*)", first)
            if found is None or int(found[1]) >= len(members):
                return first
            return f"{expected[members[int(found[1])]][0]} differs{found[2]}"
    return None


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------------------------------------
# the check


@dataclasses.dataclass
class _Call:
    """What a check runs: the model's state tensors (parameters, then buffers, as the plan takes them),
    the call, and the graph's description of them."""

    model: Callable[..., Any]
    state: list[torch.Tensor]
    args: tuple
    kwargs: dict
    graph: CapturedGraph  # as captured: its inputs name the state and the call's tensors, in order

    def changed(self) -> list[int]:
        """Indices (into the graph's inputs) of the state the call may change: every buffer, and every
        parameter the graph writes in place."""
        written = _written_inputs(self.graph)
        return [i for i, spec in enumerate(self.graph.inputs[: len(self.state)])
                if spec.kind == "buffer" or i in written]


@dataclasses.dataclass
class _Run:
    """One run's results, named: outputs, gradients, then state and tensor copies after the call."""

    values: list[tuple[str, Any]]
    differentiable: list[int]  # which outputs took an upstream gradient
    terms: int = 1  # the longest dimension of the call's tensors, state and outputs: see first_difference


def check_first_call(module: Any, plan: Any, args: tuple, kwargs: dict, state: Sequence[torch.Tensor]) -> Any:
    """The plan to run this signature with, after checking ``plan`` against the untouched model on
    this call (see the module docstring): ``plan`` itself when it matches, a plan without the pass
    to blame when one does, None (run eagerly) when no plan does.

    ``module``: the :class:`~memplan.api.OptimizedModule` (its ``original``, and ``_build_plan`` to
    plan again without a pass); ``state``: its model's parameters, then buffers, as the plan takes them.
    """
    call = _Call(module.original, list(state), args, dict(kwargs), plan.original)
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    short = _short_of_memory(plan, call.state, leaves)
    if short is not None:
        _skip(short)
        return plan
    changed = call.changed()
    restore = _kept(call, changed)
    try:
        try:
            reference = _run_eager(call, changed, plan.training)
        except Exception as exc:  # the model itself, on copies of the tensors: not the plan's to answer for
            _skip(f"the model run eagerly on copies of this call's tensors raised {type(exc).__name__}: {exc}")
            return plan
        restore()
        difference = _difference(call, changed, plan, reference)
        if difference is None:
            return plan
        return _blame(module, call, changed, plan, reference, difference, restore)
    finally:
        restore()


def first_run_failure(module: Any, plan: Any, args: tuple, kwargs: dict, state: Sequence[torch.Tensor]) -> Exception | None:
    """What the plan's first run raises on copies of this call's tensors (forward, and in training the
    backward from a fixed random upstream gradient), or None when it runs. Under ``fallback="eager"`` a
    signature whose plan raises where the model itself would not runs eagerly instead (see
    :meth:`memplan.api.OptimizedModule._plan_signature`): a failure in the backward comes after the
    forward has returned, when no eager graph is left to fall back on, so the trial runs both first.

    The RNG and the state the call may change are put back afterwards, so the call itself draws and
    updates as eager does. An exception the model's own code raises (a hook, a check of its inputs)
    is the model's to raise, and is not counted as the plan's: the trial returns None and the call
    raises it, eagerly or planned, as eager would.
    """
    call = _Call(module.original, list(state), args, dict(kwargs), plan.original)
    restore = _kept(call, call.changed())
    try:
        flat, copies = _plan_outputs(call, plan)
        targets = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        # the planned backward is one node: a gradient of any leaf runs all of it. The call's copies first,
        # which no hook of the user's watches; else parameters without hooks (a hook would be called once more)
        leaves = [c for c in copies if c.requires_grad] or [
            p for p in call.state if p.requires_grad and not p._backward_hooks
            and not getattr(p, "_post_accumulate_grad_hooks", None)]
        if plan.training and targets and leaves:
            torch.autograd.grad(targets, leaves, _upstream(targets), allow_unused=True)
    except MemplanError:
        raise  # memplan's own refusals (a higher-order gradient, a backward under autocast) say what to do
    except Exception as exc:  # noqa: BLE001 - a failure of the plan, answered by running eagerly
        if _raised_by_user_code(exc):
            return None
        return exc
    finally:
        restore()
    return None


def _skip(why: str) -> None:
    warnings.warn(f"memplan skipped verify=True for this call: {why}", VerificationWarning,
                  stacklevel=user_stacklevel())


def _difference(call: _Call, changed: list[int], plan: Any, reference: _Run) -> str | None:
    """How ``plan`` run on this call differs from eager's ``reference`` (a plan that raises differs)."""
    try:
        run = _run_plan(call, changed, plan, reference)
    except Exception as exc:
        return f"the plan raised {type(exc).__name__}: {exc}"
    return first_difference(reference.values, [value for _, value in run.values], terms=reference.terms)


def _blame(module: Any, call: _Call, changed: list[int], plan: Any, reference: _Run, difference: str,
           restore: Callable[[], None]) -> Any:
    """Stage (4): the plan without the pass to blame, warned about; None when no plan matches eager."""
    passes = tuple(plan.pipeline.split(",")) if plan.pipeline else ()
    changing = [r.name for r in plan.records if r.changed and r.rolled_back is None and r.name in passes]
    candidates = [(name,) for name in reversed(dict.fromkeys(changing))]
    if len(candidates) > 1:
        candidates.append(tuple(dict.fromkeys(changing)))  # none of them
    for dropped in candidates:
        kept = [name for name in passes if name not in dropped]
        try:
            replanned = module._build_plan(call.args, call.kwargs, passes=kept)
        except MemplanError:  # refused without it (a budget it alone met): not the one to drop
            continue
        restore()
        if _difference(call, changed, replanned, reference) is None:
            return _rolled_back(replanned, plan, dropped, difference)
    if changing:
        why = (f"and no plan made without {' or '.join(repr(name) for name in dict.fromkeys(changing))} (the "
               f"passes that changed its graph) matches eager either")
    else:
        why = "although no pass changed its graph: the difference is in how memplan captured or ran the model"
    message = (f"memplan's plan for this call differs from the model run eagerly ({difference}), {why}. This "
               f"signature runs eagerly. Please report it.")
    if failure_mode() == "raise":
        raise MemplanError(message)
    warnings.warn(message, VerificationWarning, stacklevel=user_stacklevel())
    return None


def _rolled_back(replanned: Any, plan: Any, dropped: tuple[str, ...], difference: str) -> Any:
    """Warn that ``dropped`` were rolled back (or raise, under ``pass_failures("raise")``), and mark
    their records in the plan kept."""
    passes = plan.pipeline.split(",")
    names = ", ".join(repr(name) for name in dropped)
    reason = f"changed the results: {difference}"
    last = max(passes.index(name) for name in dropped)
    if failure_mode() == "raise":  # as the pipeline raises: a message, and no reproducer left behind
        raise PassError(f"pass{'es' if len(dropped) > 1 else ''} {names} changed the results: verify=True found "
                        f"the plan differing from the model run eagerly ({difference}), and the plan without "
                        f"{'them' if len(dropped) > 1 else 'it'} matching.")
    path = save_reproducer(plan.original, ",".join(passes[: last + 1]), name="-".join(dropped))
    message = (
        f"memplan rolled back pass{'es' if len(dropped) > 1 else ''} {names}: verify=True found the plan's "
        f"results differing from the model run eagerly on this call ({difference}); the plan made without "
        f"{'them' if len(dropped) > 1 else 'it'} matches, and this call and the later ones with the same "
        f"signature run it. Reproducer (the captured graph and the pipeline up to that pass) saved to {path}; "
        f"replay it with memplan.pipeline.replay({str(path)!r}) and run the result. This is a bug in the pass: "
        f"please report it with the reproducer."
    )
    warnings.warn(PassRolledBackWarning(message, pass_name=dropped[0] if len(dropped) == 1 else ",".join(dropped),
                                        reason=reason, reproducer=str(path)),
                  stacklevel=user_stacklevel())
    records = list(replanned.records)
    for name in dropped:
        position = sum(1 for r in records if r.name in passes[: passes.index(name)])
        records.insert(position, PassRecord(name, False, PassStats(), (f"rolled back: {reason}",), 0.0,
                                            replanned.eager_peak, replanned.eager_peak, rolled_back=reason))
    return dataclasses.replace(replanned, records=tuple(records))


# ----------------------------------------------------------------------------------------------
# running both


def _run_eager(call: _Call, changed: list[int], training: bool) -> _Run:
    args, kwargs, copies = _copy_call(call.args, call.kwargs)
    flat = pytree.tree_leaves(call.model(*args, **kwargs))
    differentiable = []
    if training:
        differentiable = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    return _finish(call, changed, flat, differentiable, copies)


def _run_plan(call: _Call, changed: list[int], plan: Any, reference: _Run) -> _Run:
    flat, copies = _plan_outputs(call, plan)
    return _finish(call, changed, flat, reference.differentiable, copies)


def _plan_outputs(call: _Call, plan: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """The plan run on copies of the call's tensors: its flat outputs (constants in their places) and the copies."""
    _, _, copies = _copy_call(call.args, call.kwargs)
    outputs = (run_training if plan.training else run_inference)(plan.emitted, [*call.state, *copies])
    for index, value in plan.emitted.constant_outputs:
        outputs[index] = value
    return pytree.tree_leaves(pytree.tree_unflatten(outputs, plan.graph.out_spec)), copies


def _kept(call: _Call, changed: list[int]) -> Callable[[], None]:
    """Save the RNG state and the ``changed`` state tensors; the function returned puts them back."""
    rng = _RNGState.save()
    before = [call.state[i].detach().clone() for i in changed]

    def restore() -> None:
        rng.restore()
        with torch.no_grad():
            for i, value in zip(changed, before):
                call.state[i].copy_(value)

    return restore


def _upstream(targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fixed random gradients both runs send into ``targets`` (a generator of their own, seeded with
    :data:`UPSTREAM_SEED`: the global RNG is the model's)."""
    generator = torch.Generator().manual_seed(UPSTREAM_SEED)
    return [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) for t in targets]


def _finish(call: _Call, changed: list[int], flat: list[Any], differentiable: list[int],
            copies: list[torch.Tensor]) -> _Run:
    """Name a run's outputs; take its gradients; add the changed state and the tensors' copies after."""
    inputs = call.graph.inputs
    values: list[tuple[str, Any]] = [(f"output {i}", t.detach() if isinstance(t, torch.Tensor) else t)
                                     for i, t in enumerate(flat)]
    if differentiable:
        targets = [flat[i] if i < len(flat) else None for i in differentiable]
        if not all(isinstance(t, torch.Tensor) and t.requires_grad for t in targets):
            values.append(("gradients", "outputs that do not require grad"))  # differs from eager's
        else:
            # the arguments first, then the parameters, as memplan.testing.assert_equivalent lists them
            named = list(zip(inputs, [*call.state, *copies]))
            named = named[len(call.state):] + named[: len(call.state)]
            leaves = [(spec.path, t) for spec, t in named if t.requires_grad]
            grads = torch.autograd.grad(targets, [t for _, t in leaves], _upstream(targets), allow_unused=True,
                                        materialize_grads=True) if leaves else ()
            values += [(f"gradient of {name}", g) for (name, _), g in zip(leaves, grads)]
    values += [(f"{inputs[i].kind} {inputs[i].path} after the call", call.state[i].detach().clone()) for i in changed]
    values += [(f"argument {spec.path} after the call", t.detach())
               for spec, t in zip(inputs[len(call.state):], copies)]
    tensors = [*call.state, *copies, *(t for t in flat if isinstance(t, torch.Tensor))]
    return _Run(values, differentiable, max((size for t in tensors for size in t.shape), default=1))


def _copy_call(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """The call with each tensor replaced by a copy: same shape, strides and storage offset, tensors
    sharing a storage still sharing one (a copy of it), same ``requires_grad`` (as leaves)."""
    storages: dict[tuple, torch.UntypedStorage] = {}
    copies: list[torch.Tensor] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        key = (t.device, t.untyped_storage().data_ptr())
        storage = storages.get(key)
        if storage is None:
            storage = storages[key] = t.untyped_storage().clone()
        with torch.no_grad():
            new = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())
        new.requires_grad_(t.requires_grad)
        copies.append(new)
        return new

    copied_args, copied_kwargs = pytree.tree_map_only(torch.Tensor, copy, (tuple(args), dict(kwargs)))
    return copied_args, copied_kwargs, copies


def _written_inputs(graph: CapturedGraph) -> set[int]:
    """Indices of the graph inputs whose storage some node writes in place."""
    tensors = AnalysisManager(graph).get(Tensors)
    owner: dict[int, int] = {}
    for i, spec in enumerate(graph.inputs):
        for sid in tensors.storages_of(spec.node):
            owner.setdefault(sid, i)
    written = set()
    for node in graph.gm.graph.nodes:
        if node.op == "call_function":
            for target in mutated_args(node):
                written.update(owner[sid] for sid in tensors.storages_of(target.name) if sid in owner)
    return written


def _short_of_memory(plan: Any, state: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]) -> str | None:
    """Why the eager copy would not fit (None: it fits, or the device has no bound memplan knows)."""
    devices = {t.device for t in (*state, *leaves) if t.device.type == "cuda"}
    copies = sum(t.untyped_storage().nbytes() for t in leaves)
    for device in sorted(devices, key=str):
        free, _ = torch.cuda.mem_get_info(device)
        available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        need = plan.eager_peak + copies
        if need > available:
            return (f"the model run eagerly beside it needs about {format_bytes(need)} on {device}, which has "
                    f"{format_bytes(available)} free")
    return None


class _RNGState:
    """The CPU generator's state and those of the CUDA devices in use."""

    def __init__(self, cpu: torch.Tensor, cuda: dict[int, torch.Tensor]):
        self.cpu, self.cuda = cpu, cuda

    @classmethod
    def save(cls) -> "_RNGState":
        cuda = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = {i: torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())}
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for i, state in self.cuda.items():
            torch.cuda.set_rng_state(state, i)
