"""The ruler: measure the memory a call really allocates.

:func:`measure` runs ``fn(*args, **kwargs)`` once and reports the peak number of bytes that were
allocated *during* the call (the forward pass, and the backward pass when ``fn`` runs one), with
autograd's saved tensors and the gradient buffers counted. Memory that existed before the call is
reported separately (``before``) and never counted in the peak. Every other part of memplan checks
its predictions against this number.

Method on CPU (a deterministic byte count)
------------------------------------------
(1) Before the call, every storage reachable from the arguments (and, when ``fn`` is an
    ``nn.Module`` or a bound method of one, its parameters, buffers and ``.grad`` tensors) is
    registered as *pre-existing*: its bytes make up ``before`` and it is excluded from all later
    accounting, even if the call frees it.
(2) A :class:`~torch.utils._python_dispatch.TorchDispatchMode` is active during the call. It sees
    every aten op that reaches the Python dispatch key, backward ops included (the autograd engine
    carries the mode to its thread-local state). After each op it walks the outputs; an output
    storage that was not seen before and does not alias one of the op's inputs is new: its
    ``nbytes()`` are added to the live count. Views and in-place ops return an existing storage,
    so they allocate nothing; a tracked storage whose size changed (``resize_``, ``out=``
    variants) is charged the difference. The host copy ``memplan::offload`` makes of an activation
    (:mod:`memplan.ops`, the emulated host tier of a plan) is host memory, not the device's: it is
    tracked and never charged, as on CUDA, where the caching allocator does not see pinned memory.
(3) Each new storage gets a ``weakref`` whose callback fires when the C++ storage dies (torch keeps
    one Python object per live storage, so the weakref follows the C++ lifetime, not the Python
    wrapper's). The callback subtracts the bytes from the live count at once and reports them as
    ``freed`` in the next event. The peak is the largest live count right after an op's outputs
    were added, which is the maximum over time because the count only grows at those moments.
(4) A dispatch mode changes what some of autograd's formulas run (the gradients of ``max`` over a
    dimension, ``gather``, indexing, ``topk``...: written into zeros in place in eager, out of place
    under a mode). The mode runs them in place, as eager does (:mod:`memplan._capture.formulas`), so
    the count is eager's; :func:`allocator_peak`, which needs no mode, checks it.

Method on CUDA
--------------
The same dispatch mode records the op timeline, but the byte counts come from the caching
allocator: ``live`` is ``torch.cuda.memory_allocated() - before`` after each op, the peak is
``torch.cuda.max_memory_allocated() - before`` (so kernel workspaces are included) and ``after`` is
read once the device has been synchronised. The allocator rounds blocks up to 512 bytes, so these
numbers are slightly above the sum of ``nbytes()``.

Blind spots
-----------
* CPU kernel-internal memory: workspaces and temporaries that a kernel allocates and frees below
  the dispatch mode (BLAS packing buffers, the intermediates of a fused or composite kernel that
  is not decomposed above the Python key) never show up. The CPU number is a lower bound of what
  the allocator really served.
* Allocator overhead: the CPU count is exact ``nbytes()``; malloc headers, page granularity and
  fragmentation are not included.
* Storages not made by aten ops: ``torch.from_numpy``, ``torch.UntypedStorage(n)``, and
  ``UntypedStorage.resize_`` called on a storage directly bypass the dispatcher.
* A pre-existing storage that is not reachable from the arguments (for example a tensor captured
  by a closure) is recognised as pre-existing the first time an op reads it, but it is not part of
  ``before``.
* Frees that happen after the last op are reflected in ``after`` but belong to no event.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from memplan._capture.formulas import EagerFormulas
from memplan.errors import UnsupportedInputError
from memplan.ops import HOST_OPS

__all__ = ["MemoryEvent", "Measurement", "measure", "allocator_peak", "measured_snapshot", "format_bytes"]

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")

# ``torch.tensor(data)`` builds its tensor below the dispatcher and hands it to the mode through
# ``lift_fresh``: the output aliases the input, yet the storage was created by this very call.
_FRESH_ALIAS_OPS = frozenset({"aten.lift_fresh.default"})


def format_bytes(n: int) -> str:
    """Format a byte count with binary units.

    Parameters
    ----------
    n : int
        Number of bytes (may be negative).

    Returns
    -------
    str
        ``"512 B"`` below one KiB, otherwise two decimals and the largest binary unit that keeps
        the number at or above one.

    Examples
    --------
    >>> format_bytes(0), format_bytes(512), format_bytes(1536)
    ('0 B', '512 B', '1.50 KiB')
    >>> format_bytes(12_939_428), format_bytes(-3 * 2**30)
    ('12.34 MiB', '-3.00 GiB')
    """
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{abs(int(n))} B"
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{sign}{value:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass(frozen=True)
class MemoryEvent:
    """One aten op seen during a measured call.

    Attributes
    ----------
    index : int
        Position in call order, starting at 0.
    op : str
        The aten overload, ``str(func)``, e.g. ``"aten.mm.default"`` or ``"aten.add_.Tensor"``.
    allocated : int
        Bytes of the new storages this op created (plus growth of resized storages).
    freed : int
        Bytes of storages allocated during the call that died since the previous event.
    live : int
        Bytes live right after this op, counting only storages allocated during the call
        (on CUDA: ``torch.cuda.memory_allocated()`` minus ``before``).
    """

    index: int
    op: str
    allocated: int
    freed: int
    live: int


@dataclass(frozen=True)
class Measurement:
    """What :func:`measure` found.

    Attributes
    ----------
    peak : int
        Most bytes live at any moment of the call, counting only memory allocated during it.
    before : int
        Bytes already in use when the call started. CPU: distinct storages reachable from the
        arguments and, for a module (or a bound method of one), its parameters, buffers and
        ``.grad``. CUDA: ``torch.cuda.memory_allocated()``.
    after : int
        Bytes allocated during the call and still alive after it (returned tensors, ``.grad``).
    timeline : tuple of MemoryEvent
        One event per aten op, in call order.
    device : str
        ``"cpu"`` or ``"cuda:N"``.
    result : object
        What ``fn`` returned (excluded from comparison and repr).
    """

    peak: int
    before: int
    after: int
    timeline: tuple[MemoryEvent, ...]
    device: str
    result: object = field(default=None, compare=False, repr=False)

    def peak_at(self) -> MemoryEvent:
        """Return the first event with the highest ``live`` count.

        On CPU its ``live`` equals :attr:`peak`. On CUDA the peak also contains kernel workspaces,
        so the event is where the timeline came closest to it.

        Raises
        ------
        ValueError
            If the call ran no aten op at all.
        """
        if not self.timeline:
            raise ValueError("the measured call ran no aten op, so there is no peak event")
        return max(self.timeline, key=lambda event: event.live)

    def summary(self) -> str:
        """One line: peak, before, after, number of ops and device."""
        return (
            f"peak {format_bytes(self.peak)} (before {format_bytes(self.before)}, "
            f"after {format_bytes(self.after)}) over {len(self.timeline)} ops on {self.device}"
        )

    def __repr__(self) -> str:
        return f"<Measurement {self.summary()}>"

    def __rich__(self) -> Any:
        from rich.text import Text

        return Text.assemble(
            "peak ",
            (format_bytes(self.peak), "bold"),
            f" (before {format_bytes(self.before)}, after {format_bytes(self.after)})"
            f" over {len(self.timeline)} ops on {self.device}",
        )


# --------------------------------------------------------------------------------------------
# Storage accounting
# --------------------------------------------------------------------------------------------


def _tensors_in(obj: object) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (nested tuples, lists and dict values)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    _collect_tensors(obj, found)
    return found


def _collect_tensors(obj: object, found: list[torch.Tensor]) -> None:
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, (tuple, list)):
        return
    for item in obj:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            _collect_tensors(item, found)


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor; wrapper subclasses are flattened to their parts."""
    if type(t) not in _PLAIN_TENSOR_TYPES and is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = (getattr(t, name) for name in names)
        return [st for part in inner if isinstance(part, torch.Tensor) for st in _storages(part)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional tensors
        return []


def _device_filter(device: torch.device) -> Callable[[torch.Tensor], bool]:
    """A cheap predicate telling whether a tensor holds real memory on ``device``.

    Fake tensors (``FakeTensorMode``, as in memplan's own capture) report a real device but own no
    memory, so they are never counted.
    """
    if device.type == "cpu":
        return lambda t: t.is_cpu and not isinstance(t, FakeTensor)
    index = device.index
    return lambda t: t.is_cuda and t.get_device() == index and not isinstance(t, FakeTensor)


class _Ledger:
    """Live-byte bookkeeping for the storages seen during one call.

    Each known storage is keyed by ``storage._cdata`` (its C++ address) and carries a base size
    (its bytes before the call; 0 for storages the call created) and its current size; the call
    owns ``max(0, size - base)`` bytes of it. A weakref per storage removes the entry when the
    storage dies, so a recycled address can never be mistaken for an old storage.
    """

    def __init__(self) -> None:
        self.sizes: dict[int, tuple[int, int]] = {}  # key -> (base, size)
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0
        self.pending_freed = 0

    def register(self, storage: torch.UntypedStorage, *, pre_existing: bool) -> int:
        """Start tracking ``storage``; return the bytes charged to the call (0 if pre-existing)."""
        key = storage._cdata
        size = storage.nbytes()
        base = size if pre_existing else 0
        self.sizes[key] = (base, size)
        self.refs[key] = weakref.ref(storage, functools.partial(self._on_death, key))
        charged = size - base
        self.live += charged
        return charged

    def resize(self, key: int, new_size: int) -> int:
        """Update a known storage's size; return the change in bytes owned by the call."""
        base, old_size = self.sizes[key]
        self.sizes[key] = (base, new_size)
        change = max(0, new_size - base) - max(0, old_size - base)
        self.live += change
        return change

    def _on_death(self, key: int, _ref: weakref.ref) -> None:
        entry = self.sizes.pop(key, None)
        self.refs.pop(key, None)
        if entry is None:
            return
        base, size = entry
        owned = max(0, size - base)
        self.live -= owned
        self.pending_freed += owned

    def take_freed(self) -> int:
        """Bytes freed since the last call to this method."""
        freed = self.pending_freed
        self.pending_freed = 0
        return freed

    def close(self) -> None:
        """Drop every weakref so that no callback fires after the measurement."""
        self.refs.clear()
        self.sizes.clear()


class _MeasureMode(TorchDispatchMode):
    """Dispatch mode that charges new output storages to a :class:`_Ledger` after every op.

    ``live_probe``, when given, replaces the ledger's count in the timeline (CUDA uses the
    caching allocator's number).
    """

    def __init__(
        self,
        ledger: _Ledger,
        on_device: Callable[[torch.Tensor], bool],
        live_probe: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self.ledger = ledger
        self.on_device = on_device
        self.live_probe = live_probe
        self.rows: list[tuple[str, int, int, int]] = []  # (op, allocated, freed, live)
        self._names: dict[Any, str] = {}
        self.formulas = EagerFormulas()  # autograd's formulas as eager runs them, not as under this mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        func = self.formulas.in_place(func, args, kwargs) or func
        out = func(*args, **(kwargs or {}))
        self.formulas.made(func, out)
        self._record(func, args, kwargs, out)
        return out

    def _op_name(self, func: Any) -> str:
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func)
        return name

    def _record(self, func: Any, args: tuple, kwargs: dict | None, out: object) -> None:
        ledger = self.ledger
        name = self._op_name(func)
        allocated = 0
        input_keys: set[int] | None = None
        for tensor in _tensors_in(out):
            if not self.on_device(tensor):
                continue
            for storage in _storages(tensor):
                key = storage._cdata
                known = ledger.sizes.get(key)
                if known is not None:
                    size = storage.nbytes()
                    if size != known[1]:
                        allocated += ledger.resize(key, size)
                    continue
                if func in HOST_OPS:  # the host tier (an offloaded activation) is not the device's memory
                    ledger.register(storage, pre_existing=True)
                    continue
                if input_keys is None:
                    input_keys = _storage_keys(args, kwargs)
                aliases_input = key in input_keys and name not in _FRESH_ALIAS_OPS
                allocated += ledger.register(storage, pre_existing=aliases_input)
        live = ledger.live if self.live_probe is None else self.live_probe()
        if live > ledger.peak:
            ledger.peak = live
        self.rows.append((name, allocated, ledger.take_freed(), live))

    def timeline(self) -> tuple[MemoryEvent, ...]:
        return tuple(
            MemoryEvent(index, op, allocated, freed, live)
            for index, (op, allocated, freed, live) in enumerate(self.rows)
        )


def _storage_keys(args: tuple, kwargs: dict | None) -> set[int]:
    """Keys of every storage an op received."""
    tensors: list[torch.Tensor] = []
    _collect_tensors(args, tensors)
    if kwargs:
        _collect_tensors(kwargs, tensors)
    return {storage._cdata for tensor in tensors for storage in _storages(tensor)}


# --------------------------------------------------------------------------------------------
# Inputs: device and pre-existing memory
# --------------------------------------------------------------------------------------------


def _owning_module(fn: Callable[..., Any]) -> torch.nn.Module | None:
    """The module behind ``fn``: ``fn`` itself or the ``__self__`` of a bound method."""
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None) if inspect.ismethod(fn) else None
    return owner if isinstance(owner, torch.nn.Module) else None


def _existing_tensors(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors alive before the call: argument leaves, then the module's state and grads."""
    tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    module = _owning_module(fn)
    if module is not None:
        for param in module.parameters():
            tensors.append(param)
            if param.grad is not None:
                tensors.append(param.grad)
        tensors.extend(module.buffers())
    return tensors


def _resolve_device(device: str | torch.device | None, tensors: list[torch.Tensor]) -> torch.device:
    """The device to measure: the one given, else the first tensor's, else CPU."""
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedInputError(
            f"measure() supports cpu and cuda devices, got {device}; "
            "pass device='cpu' or device='cuda' (or move the inputs there)"
        )
    return device


def _register_existing(ledger: _Ledger, tensors: list[torch.Tensor], on_device: Callable) -> int:
    """Register the distinct storages of ``tensors`` as pre-existing; return their bytes."""
    total = 0
    for tensor in tensors:
        if not on_device(tensor):
            continue
        for storage in _storages(tensor):
            if storage._cdata not in ledger.sizes:
                ledger.register(storage, pre_existing=True)
                total += storage.nbytes()
    return total


# --------------------------------------------------------------------------------------------
# measure
# --------------------------------------------------------------------------------------------


def measure(
    fn: Callable[..., Any],
    *args: Any,
    device: str | torch.device | None = None,
    **kwargs: Any,
) -> Measurement:
    """Call ``fn(*args, **kwargs)`` once and measure the memory it allocates.

    Parameters
    ----------
    fn : callable
        What to run: a function, an ``nn.Module`` or a bound method. It may run backward.
    *args, **kwargs
        Passed to ``fn``. Their storages count as memory that existed before the call.
    device : str or torch.device, optional
        Device to measure. By default the device of the first tensor among the arguments (then
        the module's parameters and buffers); CPU if there is none.

    Returns
    -------
    Measurement
        Peak, before, after and the per-op timeline; ``result`` holds what ``fn`` returned.

    Raises
    ------
    UnsupportedInputError
        If the device is neither CPU nor CUDA.

    Notes
    -----
    On CPU the count is exact for every storage an aten op creates, but kernel-internal
    workspaces are invisible (see the module docstring). If ``fn`` raises, the dispatch mode is
    exited and the exception propagates unchanged.

    Examples
    --------
    >>> import torch
    >>> m = measure(lambda x: x * 2, torch.ones(256))
    >>> m.peak, m.before, m.after
    (1024, 1024, 1024)
    >>> m.timeline[0].op
    'aten.mul.Tensor'
    """
    existing = _existing_tensors(fn, args, kwargs)
    dev = _resolve_device(device, existing)
    if dev.type == "cuda":
        return _measure_cuda(fn, args, kwargs, dev, existing)
    return _measure_cpu(fn, args, kwargs, dev, existing)


def allocator_peak(fn: Callable[..., Any], *args: Any, device: str | torch.device = "cpu", **kwargs: Any) -> int:
    """Peak bytes the allocator held during ``fn(*args, **kwargs)`` above what it held before, with no
    dispatch mode: the ruler for compiled code.

    :func:`measure` counts what aten ops return, through a dispatch mode. Compiled code does not run
    under one (``torch.compile`` runs its model eagerly when a mode is active), and autograd's formulas
    take other forms under one (``isTensorSubclassLike``). This ruler reads the allocator instead: on
    CUDA, ``torch.cuda.max_memory_allocated``; on CPU, the allocation and free events
    ``torch.profiler`` records with ``profile_memory=True``, summed in time order. It sees what ops
    allocate inside their kernels too (workspaces, the temporaries of fused or compiled kernels), so on
    eager code it reads at least :func:`measure`'s peak; and it sees nothing per op.

    Examples
    --------
    >>> import torch
    >>> x = torch.ones(256)
    >>> allocator_peak(lambda: (x * 2) + 1) >= 2 * 1024
    True
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        fn(*args, **kwargs)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - before
    if dev.type != "cpu":
        raise UnsupportedInputError(f"allocator_peak() reads the CPU's or a CUDA device's allocator, not {dev}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args, **kwargs)
    # the allocations of the event tree, by address: a block freed here that was allocated before the call
    # (a .grad a step drops) is not the call's
    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            allocations.append((event.start_time_ns, fields.id, fields.ptr, fields.alloc_size))
    allocations.sort()
    mine: dict[int, int] = {}
    live = peak = 0
    for _, _, ptr, size in allocations:
        if size > 0:
            mine[ptr] = size
            live += size
            peak = max(peak, live)
        elif ptr in mine:
            live -= mine.pop(ptr)
    return peak


def measured_snapshot(fn: Callable[..., Any], *args: Any, device: str | torch.device | None = None,
                      max_entries: int = 200_000, **kwargs: Any) -> dict:
    """Call ``fn(*args, **kwargs)`` once on a GPU with the CUDA caching allocator recording its history,
    and return what ``torch.cuda.memory._snapshot()`` returns: the measured counterpart of the predicted
    snapshots (:meth:`memplan.analyze.MemoryAnalysis.to_snapshot`, :meth:`memplan.api.Plan.to_snapshot`),
    for PyTorch's memory visualizer (pickle it and open it at https://pytorch.org/memory_viz). Recording
    is switched off again afterwards, also when ``fn`` raises.

    Raises
    ------
    UnsupportedInputError
        On any device but CUDA: only the CUDA allocator records a history. On CPU, export the predicted
        timeline instead, which :func:`measure` agrees with.
    """
    existing = _existing_tensors(fn, args, kwargs)
    if device is None and not existing and torch.cuda.is_available():
        device = "cuda"  # a closure, e.g. a training step: only a CUDA device can be meant
    dev = _resolve_device(device, existing)
    existing.clear()
    if dev.type != "cuda":
        raise UnsupportedInputError(
            f"a measured memory snapshot needs the CUDA caching allocator, and this call runs on {dev}. "
            "Fix: on CPU, export the predicted timeline, which memplan.measure agrees with: "
            "memplan.analyze(model, *inputs).save_snapshot(path), or opt.plan.save_snapshot(path)."
        )
    torch.cuda.synchronize(dev)
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=max_entries, device=dev)
    try:
        fn(*args, **kwargs)
        torch.cuda.synchronize(dev)
        return torch.cuda.memory._snapshot(dev)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=dev)


def _measure_cpu(
    fn: Callable[..., Any], args: tuple, kwargs: dict, dev: torch.device, existing: list
) -> Measurement:
    ledger = _Ledger()
    on_device = _device_filter(dev)
    try:
        before = _register_existing(ledger, existing, on_device)
        existing.clear()  # holding them would keep e.g. a .grad that fn drops alive
        mode = _MeasureMode(ledger, on_device)
        with mode:
            result = fn(*args, **kwargs)
        # Locals of ``fn`` are gone by now, so their storages' callbacks have already fired.
        after = ledger.live
        return Measurement(ledger.peak, before, after, mode.timeline(), str(dev), result)
    finally:
        ledger.close()


def _measure_cuda(
    fn: Callable[..., Any], args: tuple, kwargs: dict, dev: torch.device, existing: list
) -> Measurement:
    ledger = _Ledger()
    on_device = _device_filter(dev)
    try:
        _register_existing(ledger, existing, on_device)
        existing.clear()  # holding them would keep e.g. a .grad that fn drops alive
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        mode = _MeasureMode(ledger, on_device, lambda: torch.cuda.memory_allocated(dev) - before)
        with mode:
            result = fn(*args, **kwargs)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        after = torch.cuda.memory_allocated(dev) - before
        return Measurement(peak, before, after, mode.timeline(), str(dev), result)
    finally:
        ledger.close()
